"""``torch.optim.Muon`` with a fused query/key/value weight orthogonalised as three matrices.

The control for ``WhitenedMuon``'s ``fused_qkv``: how much of what splitting GPT-2's ``c_attn``
saves is the split itself, which a Muon user gets as well. A weight stored ``[d, 3d]`` (or
``[3d, d]``) is orthogonalised as its three ``[d, d]`` blocks, each scaled to keep the RMS that
``adjust_lr_fn="match_rms_adamw"`` gives a ``[d, d]`` weight; every other weight is Muon's step.
In GPT-2 only ``c_attn`` has that shape. It runs another benchmark script with the change in
place, e.g. ``whitening_levers.py``, whose Muon run then is this one. The change replaces
``torch.optim.Muon``'s Newton-Schulz function for the whole process, which the NorMuon baseline
(``benchmarks/normuon.py``) and the examples' ``ExpertMuon`` call too: run it with
``--baselines muon`` alone::

    OMP_NUM_THREADS=1 python benchmarks/muon_split_qkv.py benchmarks/whitening_levers.py --threads 1 \\
        --seeds 0,1,2 --other-machine --arch gpt2 --base benchmarks/results/budget_speedup_gpt2 \\
        --lr 0.032 --momentum 0.8 --variants input --out benchmarks/results/muon_split_qkv_gpt2
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.optim._muon as torch_muon

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
from benchmarks.swap_newton_schulz import run_script_with  # noqa: E402

_whole = torch_muon._zeropower_via_newtonschulz


def _by_thirds(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    rows, cols = grad.shape[-2:]
    if cols == 3 * rows:  # [d, 3d]: three [d, d] blocks side by side
        parts = grad.reshape(rows, 3, rows).transpose(0, 1)
        out = torch.stack([_whole(p, ns_coefficients, ns_steps, eps) for p in parts]).transpose(0, 1)
        # match_rms_adamw scales by sqrt(3d) for the whole weight; each block's own scale is sqrt(d)
        return (out.reshape(rows, cols) / math.sqrt(3)).to(grad.dtype)
    if rows == 3 * cols:
        return _by_thirds(grad.mT, ns_coefficients, ns_steps, eps).mT
    return _whole(grad, ns_coefficients, ns_steps, eps)


if __name__ == "__main__":
    run_script_with(_by_thirds, sys.argv[1:])
