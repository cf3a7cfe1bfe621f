"""``torch.optim.Muon`` with its Newton-Schulz iteration in float32 instead of bfloat16.

On a CPU whose oneDNN has no bfloat16 kernels (AVX2-only x86, such as AMD Zen 3) a bfloat16
matmul takes a slow path, 25-100x a float32 one, and ``torch.optim.Muon``'s step at d_model 256
takes seconds. There ``WhitenedMuon`` iterates in float32 by default; this gives the Muon
baseline the same arithmetic, so that a run at that width fits in minutes and the step-time
ratio compares like with like. The iteration is torch's (same coefficients, same
normalisation, the smaller side's Gram matrix), only its dtype changes; its result differs
from the bfloat16 one by bfloat16's rounding, so a Muon run here ends a little off a record
made in bfloat16 (use ``--other-machine`` with ``whitening_levers.py``).

It runs another benchmark script with the change in place, for the whole process (the NorMuon
baseline and the examples' ``ExpertMuon`` call the same function)::

    OMP_NUM_THREADS=1 python benchmarks/muon_float32.py benchmarks/whitening_levers.py --threads 1 \\
        --seeds 0 --other-machine --d-model 256 --batch-size 64 --steps 600 \\
        --base benchmarks/results/budget_speedup_d256 --lr 0.0113137 --momentum 0.8 \\
        --variants input_ns_float32,input_rank4_ns_float32 --out benchmarks/results/whitening_levers_d256_f32
"""
from __future__ import annotations

import runpy
import sys

import torch
import torch.optim._muon as torch_muon


def newton_schulz_float32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                          eps: float) -> torch.Tensor:
    """``torch.optim._muon._zeropower_via_newtonschulz`` in float32."""
    a, b, c = ns_coefficients
    x = grad.float()
    transposed = grad.size(0) > grad.size(1)
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if transposed else x


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} SCRIPT [ARGS...]")
    torch_muon._zeropower_via_newtonschulz = newton_schulz_float32
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
