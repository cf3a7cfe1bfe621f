"""benchmarks/gram_newton_schulz.py: the Gram form it times is WhitenedMuon's step (exactly, in
float64, against the library's own direction and against an SVD-free written-out reference),
and its table reports every stack of a trained model."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import gram_newton_schulz as gns  # noqa: E402
from kron_precond.whitened_muon import NS_COEFFICIENTS  # noqa: E402


def _whitener(n: int, generator: torch.Generator) -> torch.Tensor:
    scales = torch.logspace(0, -1, n, dtype=torch.float64)
    rows = torch.randn(3 * n, n, generator=generator, dtype=torch.float64) * scales
    factor = rows.T @ rows / (3 * n) + 0.01 * torch.eye(n, dtype=torch.float64)
    return torch.linalg.inv(torch.linalg.cholesky(factor))  # Tᵀ T = factor⁻¹


def _written_out(m: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Muon's five quintic Newton-Schulz steps on X = M Tᵀ (on its wide side), then · T, rescaled
    to ‖msign(X)‖_F: WhitenedMuon's direction, written out for one matrix in float64."""
    a, b, c = NS_COEFFICIENTS
    x = m @ t.T
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.T
    direction = x @ t
    return direction * (x.norm() / direction.norm())


@pytest.mark.parametrize("shape", [(6, 20), (20, 6), (9, 9)])
def test_gram_form_is_the_library_step_in_float64(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    out_dim, in_dim = shape
    momenta = torch.randn(3, out_dim, in_dim, generator=generator, dtype=torch.float64)
    whiteners = torch.stack([_whitener(in_dim, generator) for _ in range(3)])
    precision = whiteners.mT @ whiteners
    library = gns.library_direction(momenta, whiteners, torch.float64)
    gram = gns.gram_direction(momenta, whiteners, precision, torch.float64, torch.float64)
    for i in range(3):
        reference = _written_out(momenta[i], whiteners[i])
        assert torch.allclose(library[i], reference, rtol=1e-10, atol=1e-12)
        assert torch.allclose(gram[i], reference, rtol=1e-9, atol=1e-11)


def test_the_restart_changes_nothing_in_exact_arithmetic():
    generator = torch.Generator().manual_seed(3)
    momenta = torch.randn(2, 5, 12, generator=generator, dtype=torch.float64)
    whiteners = torch.stack([_whitener(12, generator) for _ in range(2)])
    precision = whiteners.mT @ whiteners
    runs = [gns.gram_direction(momenta, whiteners, precision, torch.float64, torch.float64, restart=r)
            for r in (0, 2, 3)]
    for other in runs[1:]:
        assert torch.allclose(runs[0], other, rtol=1e-10, atol=1e-12)


def test_table_covers_every_stack_of_the_trained_model(capsys):
    rows = gns.main(["--d-model", "16", "--steps", "6", "--batch-size", "4", "--repeats", "1", "--threads", "1"])
    # the examples' GPT: q, k, v and out [16, 16] x 2 blocks, the MLP's [64, 16] and [16, 64] x 2
    assert [(r["shape"], r["count"]) for r in rows] == [((16, 16), 8), ((16, 64), 2), ((64, 16), 2)]
    for r in rows:
        assert all(r[c] > 0 for c in gns.COLUMNS[:4])
        assert r["gram fp32 error"] < 1e-2  # float32 throughout: the Gram form itself is sound
        assert 0.0 <= r["small"] <= 1.0
    assert "| [16, 64] x 2 |" in capsys.readouterr().out
