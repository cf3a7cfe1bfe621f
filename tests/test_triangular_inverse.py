"""``triangular_inverse``: the whitener ``L⁻¹`` by halves, against a float64 dense inverse."""
from __future__ import annotations

import pytest
import torch

from kron_precond.whitening import WhiteningStatistics, triangular_inverse


def _lower(shape: tuple[int, ...], n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Cholesky factors of damped covariance-like matrices (as a refresh decomposes)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, 2 * n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, n,
                                                                                         dtype=torch.float64)
    factor = rows.mT @ rows / (2 * n)
    lam = 0.1 * factor.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    return torch.linalg.cholesky(factor + lam * torch.eye(n, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("n", [1, 5, 64, 65, 127, 200, 512])
@pytest.mark.parametrize("shape", [(3,), (2, 2)])
def test_matches_the_dense_inverse_in_float64(n, shape):
    lower = _lower(shape, n, torch.float64)
    inverse = triangular_inverse(lower)
    assert inverse.shape == lower.shape
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))  # lower-triangular, exactly
    torch.testing.assert_close(inverse, torch.linalg.inv(lower), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("leaf", [1, 2, 16, 1000])
def test_every_leaf_width_gives_the_same_inverse(leaf):
    lower = _lower((2,), 100, torch.float64, seed=1)
    torch.testing.assert_close(triangular_inverse(lower, leaf=leaf), torch.linalg.inv(lower), rtol=1e-9, atol=1e-11)


def test_float32_agrees_with_the_triangular_solve_to_rounding():
    lower = _lower((2,), 512, torch.float32, seed=2)
    eye = torch.eye(512).expand_as(lower)
    solved = torch.linalg.solve_triangular(lower, eye, upper=False)
    assert ((triangular_inverse(lower) - solved).norm() / solved.norm()).item() < 1e-5


def test_a_singular_factor_is_not_finite_so_the_refresh_falls_back():
    lower = _lower((2,), 130, torch.float64, seed=3)
    lower[1, 100, 100] = 0.0  # a zero pivot in the second half of the second matrix
    inverse = triangular_inverse(lower)
    assert torch.isfinite(inverse[0]).all() and not torch.isfinite(inverse[1]).all()
    torch.testing.assert_close(inverse[0], torch.linalg.inv(lower[0]), rtol=1e-9, atol=1e-11)


def test_the_refresh_whitener_is_the_inverse_cholesky_factor_at_a_wide_width():
    n = 300  # several halvings
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(2, 600, n, generator=g, dtype=torch.float64)
    factor = rows.mT @ rows / 600
    stats = WhiteningStatistics({}, {}, lambda p: True, sides=("input",), damping=0.1, factor_decay=0.8,
                                statistics_rows=None, root="cholesky", block_size=None, process_group=None)
    whitener = stats.whitener(factor, None)
    lam = 0.1 * factor.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None] / n
    damped = factor + lam * torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(whitener.mT @ whitener, torch.linalg.inv(damped), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(whitener, torch.linalg.inv(torch.linalg.cholesky(damped)), rtol=1e-9, atol=1e-11)
