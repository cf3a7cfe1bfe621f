"""``torch.optim.Muon`` with its Newton-Schulz iteration in float32 instead of bfloat16.

On a CPU whose oneDNN has no bfloat16 kernels (AVX2-only x86, such as AMD Zen 3) a bfloat16
matmul takes a slow path, 25-100x a float32 one, and ``torch.optim.Muon``'s step at d_model 256
takes seconds. There ``WhitenedMuon`` iterates in float32 by default; this gives the Muon
baseline the same arithmetic, so that a run at that width fits in minutes and the step-time
ratio compares like with like. The iteration is the library's ``msign``, which in bfloat16 is
torch's bit for bit (tested): only the dtype changes. Its result
differs from the bfloat16 one by bfloat16's rounding, so a Muon run here ends a little off a
record made in bfloat16 (use ``--other-machine`` with ``whitening_levers.py``).

It runs another benchmark script with the change in place (``swap_newton_schulz.py``)::

    OMP_NUM_THREADS=1 python benchmarks/muon_float32.py benchmarks/whitening_levers.py --threads 1 \\
        --seeds 0 --other-machine --d-model 256 --batch-size 64 --steps 600 \\
        --base benchmarks/results/budget_speedup_d256 --lr 0.0113137 --momentum 0.8 \\
        --variants input_ns_float32,input_rank4_ns_float32 --out benchmarks/results/whitening_levers_d256_f32
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
from benchmarks.swap_newton_schulz import run_script_with  # noqa: E402
from kron_precond.whitened_muon import NS_COEFFICIENTS, msign  # noqa: E402


def newton_schulz_float32(grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                          eps: float) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` in float32 (torch's quintic only)."""
    if tuple(coefficients) != NS_COEFFICIENTS:
        raise ValueError(f"torch.optim.Muon's own coefficients {NS_COEFFICIENTS} only, got {tuple(coefficients)}")
    return msign(grad, steps, eps, dtype=torch.float32)


if __name__ == "__main__":
    run_script_with(newton_schulz_float32, sys.argv[1:])
