"""``torch.optim.Muon``'s Newton-Schulz iteration written out in any dtype, and a runner that
swaps torch's own for another function while a benchmark script runs.

The baselines' variants (``muon_float32.py``: the iteration in float32; ``muon_split_qkv.py``: a
fused query/key/value weight orthogonalised as three matrices) change that one private function,
``torch.optim._muon._zeropower_via_newtonschulz``, for the whole process, so every Muon the
script builds (and the NorMuon baseline and the examples' ``ExpertMuon``, which call it too)
takes the change.
"""
from __future__ import annotations

import runpy
import sys
from typing import Callable

import torch
import torch.optim._muon as torch_muon

NewtonSchulz = Callable[[torch.Tensor, tuple[float, float, float], int, float], torch.Tensor]


def newton_schulz(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch's iteration (its quintic, its normalisation, the smaller side's Gram matrix) in
    ``dtype``; ``dtype=torch.bfloat16`` is torch's own arithmetic. Returns ``dtype``."""
    a, b, c = coefficients
    x = grad.to(dtype)
    transposed = grad.size(0) > grad.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transposed else x


def run_script_with(function: NewtonSchulz, argv: list[str]) -> None:
    """Run the script ``argv[0]`` with arguments ``argv[1:]`` as ``__main__``, with ``function`` in
    place of torch's Newton-Schulz iteration."""
    if not argv:
        raise SystemExit("usage: SCRIPT [ARGS...]")
    torch_muon._zeropower_via_newtonschulz = function
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
