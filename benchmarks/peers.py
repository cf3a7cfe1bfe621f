"""Other PSGD Kron implementations to compare against, when they are installed.

- ``kron_torch`` (``pip install --no-deps kron-torch==0.3.3``): the reference PSGD Kron
  optimizer the library's ``Kron`` follows. Runs eagerly.
- ``heavyball`` (``pip install --no-deps heavyball``): ``PSGDKron``. Opt-in only
  (``--peers kron_torch,heavyball``): heavyball 3.x compiles every step function with
  inductor in ``max-autotune`` mode, which took ~90 s for the first step of a single
  64x64 Linear on the 2-core CPU this was written on, and its eager fallback
  (``compile_mode=None``) allocated >20 GB for one 128x512 Linear and was OOM-killed.

Every builder takes the same knobs so a benchmark can line the implementations up at
equal settings: merge_dims off (the library's default) and a fixed or default
preconditioner update probability.
"""
from __future__ import annotations

import importlib
import math
from typing import Callable, Iterable

import torch

DEFAULT_PEERS = ("kron_torch",)
ALL_PEERS = ("kron_torch", "heavyball")


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def default_update_probability(step) -> float:
    """kron_torch's default schedule (1.0 flat for 500 steps, then exp(-0.001 n) down to
    0.03) in plain Python: kron_torch wraps it in torch.compile, whose one-off compile
    would otherwise be charged to its first step."""
    return min(1.0, max(0.03, math.exp(-0.001 * (float(step) - 500))))


def build_kron_torch(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
    update_probability: float | Callable[[int], float] | None,
) -> torch.optim.Optimizer:
    """``update_probability``: a float, a schedule ``p(step)``, or None (kron_torch's default)."""
    kron_torch = _import("kron_torch")
    if update_probability is None:
        update_probability = default_update_probability
    elif callable(update_probability):
        schedule = update_probability

        def update_probability(step):  # kron_torch passes a tensor
            return schedule(int(step))

    return kron_torch.Kron(
        params, lr=lr, weight_decay=weight_decay, merge_dims=False,
        preconditioner_update_probability=update_probability, precond_dtype=torch.float32,
    )


def build_heavyball(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, update_probability: float | None
) -> torch.optim.Optimizer:
    heavyball = _import("heavyball")
    kwargs = {} if update_probability is None else {"preconditioner_update_probability": update_probability}
    return heavyball.PSGDKron(params, lr=lr, weight_decay=weight_decay, merge_dims=False, **kwargs)


_BUILDERS: dict[str, tuple[str, Callable]] = {
    "kron_torch": ("kron_torch", build_kron_torch),
    "heavyball": ("heavyball", build_heavyball),
}


def available_peers(requested: Iterable[str]) -> dict[str, Callable]:
    """Builders of the requested peers that import; prints why each missing one is skipped."""
    found = {}
    for name in requested:
        if name not in _BUILDERS:
            raise ValueError(f"unknown peer {name!r}; choose from {list(_BUILDERS)}")
        module, builder = _BUILDERS[name]
        if _import(module) is None:
            print(f"[skip] {name}: not importable (pip install --no-deps {name.replace('_', '-')})")
            continue
        found[name] = builder
    return found


def parse_peers(value: str) -> list[str]:
    """``--peers`` value: comma-separated names, or ``none``."""
    return [] if value.strip() in ("", "none") else [p.strip() for p in value.split(",")]
