"""The control for ``kron_precond.WhitenedMuon``: whitening before the orthogonalisation only.

``msign(G^{-1/2} M A^{-1/2})`` is what a preconditioner in front of ``torch.optim.Muon``
can do; ``WhitenedMuon`` also whitens after it. Same statistics, same cost, one matmul pair
fewer: measured beside it in benchmarks/results/lab_notebook.md ("WhitenedMuon").
"""
from __future__ import annotations

import torch

from kron_precond.whitened_muon import WhitenedMuon, msign


class PreWhitenedMuon(WhitenedMuon):
    """``WhitenedMuon`` without the whitening after ``msign``."""

    def _direction(self, update: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> torch.Tensor:
        return msign(self._whiten(update, left, right, transpose=True), self.ns_steps, dtype=self.ns_dtype)
