"""The whitening's power: ``WhitenedMuon`` with ``T = (F + λI)^{-p}`` in place of ``p = 1/2``.

``WhitenedMuon`` steps along ``msign(M Tᵀ) T`` with ``Tᵀ T = (F + λI)⁻¹``: Muon's steepest
descent measured in ``||ΔW (F + λI)^{1/2}||_op``. A power ``p`` measures the step in
``||ΔW (F + λI)^p||_op`` instead, so ``p = 0`` is Muon and ``p = 1/2`` the library's norm; this
runs ``benchmarks/budget_speedup.py`` with the whitener taken to another power, to see whether
the library sits at the best power. The root is the symmetric one (an ``eigh`` in float64),
whose ``p = 1/2`` gives the library's exact step (the Cholesky root differs from it by an
orthogonal factor inside ``msign``); its refresh costs more than the Cholesky factorisation, so
read the speed-up in steps, not in wall-clock.

    python benchmarks/whitening_power.py --power 0.65 <budget_speedup.py's arguments>
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from kron_precond import whitening

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_speedup  # noqa: E402  (the benchmark this one runs)


def power_whitener(power: float) -> Callable:
    """A ``WhiteningStatistics.decompose`` returning ``(F + λI)^{-power}`` per block (``λ`` as the
    library's: ``damping · tr(F) / b``) and whether it is finite (where it is not, the refresh
    keeps the previous whitener, as the library's does)."""
    if not power > 0:
        raise ValueError(f"power must be > 0, got {power!r}")

    def decompose(self, factor: torch.Tensor, overwrite: bool, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
        size = factor.shape[-1]
        eye = torch.eye(size, dtype=factor.dtype, device=factor.device)
        lam = (damping * factor.diagonal(dim1=-2, dim2=-1).sum(-1) / size)[:, None, None]
        floor = torch.where(lam > 0, lam, 1.0)
        values, vectors = torch.linalg.eigh((factor + floor * eye).double())
        scale = values.clamp(min=floor[:, :, 0].double()).pow(-power)
        result = ((vectors * scale[:, None, :]) @ vectors.mT).to(factor.dtype)
        return result, torch.isfinite(result.sum(dim=(1, 2), keepdim=True))
    return decompose


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--power", type=float, required=True, help="the whitener's power p (the library's: 0.5)")
    args, rest = parser.parse_known_args(argv)
    whitening.WhiteningStatistics.decompose = power_whitener(args.power)  # this process only
    return budget_speedup.main(rest)


if __name__ == "__main__":
    main()
