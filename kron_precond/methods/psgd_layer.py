"""PSGD Kron as a :class:`LayerMethod`: whitening factors for each parameter of a module.

The math of one tensor lives in :mod:`kron_precond.methods.psgd`; this file adds what
the engine needs around it: one :class:`PSGDFactors` per parameter ("part"), the
optional gradient average that is fitted instead of the raw gradient, probe vectors
that depend only on ``(seed, layer, parameter, step)`` -- so the result is the same
whichever rank owns the layer and however many ranks there are -- and the update-RMS
clip of kron_torch.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import LayerMethod, tensor_bytes
from kron_precond.methods.psgd import PSGDFactors, probe_seed

_RMS_CLIP = 1.1  # as kron_torch: a preconditioned gradient's RMS is capped at 1.1
_BALANCE_EVERY = 100  # rebalance factor scales every this many updates (numerical hygiene)


class PSGDLayer(LayerMethod):
    """Kronecker whitening factors for the parameters of one module.

    Args:
        name: qualified module name (used in warnings).
        shapes: ``(parameter name, shape)`` for each registered parameter.
        momentum_into_precond_update: fit the factors to a debiased running average of
            the gradient (decay ``b1``) instead of the gradient itself.
        seed, layer_index: determine the probe vectors.
        **factor_settings: passed to :class:`PSGDFactors` (``max_size_triangular``,
            ``min_ndim_triangular``, ``memory_save_mode``, ``init_scale``, ``dtype``,
            ``merge_dims``).
    """

    def __init__(self, name: str, shapes: Sequence[tuple[str, torch.Size]], *, device: torch.device,
                 momentum_into_precond_update: bool, b1: float, seed: int, layer_index: int,
                 **factor_settings) -> None:
        self.name = name
        self.shapes = {part: torch.Size(shape) for part, shape in shapes}
        self.parts = tuple(self.shapes)
        self.device = device
        self.b1 = b1
        self.seed = seed
        self.layer_index = layer_index
        self._settings = factor_settings
        # Built on first use: ranks that are not gradient workers never hold factors.
        self._factors: dict[str, PSGDFactors | None] = {part: None for part in self.parts}
        self.momentum = ({part: torch.zeros(shape, device=device) for part, shape in self.shapes.items()}
                         if momentum_into_precond_update else None)
        self._momentum_steps = 0
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self.factor_dtype = factor_settings.get("dtype", torch.float32)
        self._generator: torch.Generator | None = None  # reseeded for every probe

    def factor(self, part: str) -> PSGDFactors:
        if self._factors[part] is None:
            self._factors[part] = PSGDFactors(self.shapes[part], device=self.device, **self._settings)
        return self._factors[part]

    @property
    def q_factors(self) -> dict[str, list[torch.Tensor]]:
        return {part: self.factor(part).tensors() for part in self.parts}

    # ------------------------------------------------------------------ observe
    def observe_gradients(self, grads: list[torch.Tensor | None]) -> None:
        """Advance the fitted gradient average (every step, on every rank)."""
        if self.momentum is None:
            return
        for part, grad in zip(self.parts, grads):
            if grad is None:
                continue
            buf = self.momentum[part]
            finite = torch.isfinite(grad).all()
            buf.copy_(torch.where(finite, torch.lerp(buf, grad.to(buf.dtype), 1.0 - self.b1), buf))
        self._momentum_steps += 1

    def initialize_from(self, grads: list[torch.Tensor | None]) -> None:
        """Estimate initial scales from the first gradients (``precond_init_scale=None``)."""
        for part, grad in zip(self.parts, grads):
            factor = self.factor(part)
            if grad is not None and not factor.initialized:
                try:
                    factor.initialize_from(grad)
                except ValueError:  # zero or non-finite first gradient: try again next step
                    pass

    def shared_statistics(self) -> list[torch.Tensor]:
        return []  # gradients are already averaged by DDP

    # ------------------------------------------------------------------ refresh
    def refresh(self, part: str, grads: list[torch.Tensor | None], lr: float, *, step: int,
                update_index: int) -> None:
        """One Q update of ``part`` (run by its owner); nothing to fit without a gradient
        or before the initial scale could be estimated."""
        index = self.parts.index(part)
        grad = grads[index]
        if grad is None or not self.factor(part).initialized:
            return
        if self.momentum is not None:
            debias = 1.0 - self.b1 ** max(self._momentum_steps, 1)
            fit = self.momentum[part] / debias
        else:
            fit = grad
        factor = self.factor(part)
        if update_index % _BALANCE_EVERY == 0:
            factor.balance()
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(probe_seed(self.seed, self.layer_index, index, step))
        probe = torch.randn(fit.shape, generator=self._generator, device=self.device, dtype=factor.dtype)
        applied = factor.update(fit, probe, lr)
        self.nonfinite.add_((~applied).to(self.nonfinite.dtype))

    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        parts = self.parts if part is None else (part,)
        return [q for p in parts for q in self.factor(p).tensors()]

    def release_refreshed(self) -> None:
        self._factors = {part: None for part in self.parts}

    # ------------------------------------------------------------------ apply
    def apply(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for part, grad in zip(self.parts, grads):
            if not self.factor(part).initialized:  # initial scale not estimated yet
                out.append(grad)
                continue
            update = self.factor(part).precondition(grad)
            rms = update.float().square().mean().sqrt()
            out.append(update * (_RMS_CLIP / (rms + 1e-12)).clamp(max=1.0).to(update.dtype))
        return out

    # ------------------------------------------------------------------ estimates
    def factor_costs(self) -> dict[str, tuple[float, float]]:
        costs = {}
        for part in self.parts:
            probe = PSGDFactors(self.shapes[part], device="meta", **self._settings)
            costs[part] = (probe.cost(), float(probe.memory()))
        return costs

    def memory_by_kind(self) -> dict[str, int]:
        factors = [q for f in self._factors.values() if f is not None for q in f.tensors()]
        usage = {"psgd_factors": tensor_bytes(factors)}
        if self.momentum is not None:
            usage["psgd_momentum"] = tensor_bytes(self.momentum.values())
        return usage

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "factors": {part: {"q": [q.clone() for q in self.factor(part).tensors()],
                               "initialized": self.factor(part).initialized} for part in self.parts},
            "momentum": None if self.momentum is None else {k: v.clone() for k, v in self.momentum.items()},
            "momentum_steps": self._momentum_steps,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` does not hold loadable factors for these
        parameters (missing entries, wrong shapes, integer or non-finite tensors)."""
        where = f"state of {self.name}"
        factors = checks.entry(state, "factors", where)
        missing = set(self.parts) - set(factors if isinstance(factors, dict) else ())
        if missing:
            raise ValueError(f"{where} has no factors for {sorted(missing)}")
        for part in self.parts:
            expected = [tuple(q.shape) for q in PSGDFactors(self.shapes[part], device="meta",
                                                            **self._settings).tensors()]
            saved = factors[part]
            checks.tensor_list(checks.entry(saved, "q", f"{where}.{part}"), expected, f"{where}.{part}: q")
            checks.boolean(checks.entry(saved, "initialized", f"{where}.{part}"), f"{where}.{part}: initialized")
        momentum = state.get("momentum")
        if self.momentum is not None and momentum is not None:
            for part, shape in self.shapes.items():
                checks.float_tensor(checks.entry(momentum, part, f"{where}: momentum"), shape,
                                    f"{where}: momentum[{part!r}]")
        checks.integer(state.get("momentum_steps", 0), f"{where}: momentum_steps")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        for part in self.parts:
            self.factor(part).load_state_dict(state["factors"][part])
        if self.momentum is not None and state.get("momentum") is not None:
            for part, value in state["momentum"].items():
                self.momentum[part].copy_(value)
        self._momentum_steps = int(state.get("momentum_steps", 0))
