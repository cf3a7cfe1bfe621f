"""Run a benchmark script with ``torch.optim.Muon``'s Newton-Schulz function swapped for another.

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


def run_script_with(function: NewtonSchulz, argv: list[str]) -> None:
    """Run the script ``argv[0]`` with arguments ``argv[1:]`` as ``__main__``, with ``function`` in
    place of torch's Newton-Schulz iteration."""
    if not argv:
        raise SystemExit("usage: SCRIPT [ARGS...]")
    torch_muon._zeropower_via_newtonschulz = function
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
