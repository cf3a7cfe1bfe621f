"""``inverse_cholesky``: the whitener ``L⁻¹`` by halves, against float64 LAPACK and a dense inverse."""
from __future__ import annotations

import pytest
import torch

from kron_precond.whitening import WhiteningStatistics, inverse_cholesky


def _factors(shape: tuple[int, ...], n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Damped covariance-like matrices (eigenvalues over about four decades), as a refresh decomposes."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(*shape, 2 * n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, n,
                                                                                         dtype=torch.float64)
    factor = rows.mT @ rows / (2 * n)
    lam = 0.1 * factor.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
    return (factor + lam * torch.eye(n, dtype=torch.float64)).to(dtype)


def _reference(factor: torch.Tensor) -> torch.Tensor:
    return torch.linalg.inv(torch.linalg.cholesky(factor.double()))


@pytest.mark.parametrize("n", [1, 5, 64, 65, 96, 97, 127, 200, 512])
@pytest.mark.parametrize("shape", [(3,), (2, 2)])
def test_matches_the_inverse_of_lapacks_cholesky_factor_in_float64(n, shape):
    factor = _factors(shape, n, torch.float64)
    inverse, info = inverse_cholesky(factor)
    assert inverse.shape == factor.shape and info.shape == shape
    assert torch.equal(info, torch.zeros_like(info))
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))  # lower-triangular, exactly
    torch.testing.assert_close(inverse, _reference(factor), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(inverse.mT @ inverse, torch.linalg.inv(factor), rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("leaf", [1, 2, 16, 1000])
def test_every_leaf_width_gives_the_same_inverse(leaf):
    factor = _factors((2,), 100, torch.float64, seed=1)
    inverse, info = inverse_cholesky(factor, leaf=leaf)
    assert torch.equal(info, torch.zeros_like(info))
    torch.testing.assert_close(inverse, _reference(factor), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("triangle", [1, 2, 3, 8, 50])
@pytest.mark.parametrize("n", [37, 100, 257])
def test_every_triangle_width_gives_the_same_inverse(n, triangle):
    """The triangular and lower-only products (from ``2 · triangle`` wide) against float64 LAPACK:
    odd halvings, down to single-column blocks."""
    factor = _factors((3,), n, torch.float64, seed=6)
    inverse, info = inverse_cholesky(factor, leaf=8, triangle=triangle)
    assert torch.equal(info, torch.zeros_like(info))
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))
    torch.testing.assert_close(inverse, _reference(factor), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("triangle", [4, 128])
def test_only_the_lower_triangle_is_read(triangle):
    """The Schur complements' upper blocks are left stale; so may the input's be."""
    factor = _factors((2,), 300, torch.float64, seed=7)
    scribbled = factor.clone()
    rows, cols = torch.triu_indices(300, 300, 1)
    scribbled[:, rows, cols] = float("nan")
    inverse, info = inverse_cholesky(scribbled, leaf=16, triangle=triangle)
    assert torch.equal(info, torch.zeros_like(info))
    torch.testing.assert_close(inverse, _reference(factor), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("n", [512, 1024])
def test_float32_agrees_with_lapacks_cholesky_and_solve_to_rounding(n):
    factor = _factors((2,), n, torch.float32, seed=2)
    lower = torch.linalg.cholesky(factor)
    solved = torch.linalg.solve_triangular(lower, torch.eye(n).expand_as(lower), upper=False)
    exact = _reference(factor)
    inverse, _ = inverse_cholesky(factor)
    # as close to the float64 inverse as LAPACK's float32 path is
    assert ((inverse.double() - exact).norm() / exact.norm()).item() < 2 * ((solved.double() - exact).norm()
                                                                            / exact.norm()).item() + 1e-7
    assert ((inverse - solved).norm() / solved.norm()).item() < 1e-5


def test_a_matrix_whose_schur_complement_is_not_positive_definite_is_flagged():
    """Positive leading block, indefinite Schur complement: only the recursion's second half
    can see it. The other matrix of the batch is unaffected."""
    factor = _factors((2,), 130, torch.float64, seed=3)
    assert torch.linalg.cholesky_ex(factor[1, :65, :65])[1] == 0
    vectors = torch.linalg.eigh(factor[1])[1]
    factor[1] -= 2 * factor[1].diagonal().max() * torch.outer(vectors[:, 0], vectors[:, 0])  # one negative eigenvalue
    assert torch.linalg.cholesky_ex(factor[1, :65, :65])[1] == 0  # still positive definite up front
    inverse, info = inverse_cholesky(factor, leaf=16)
    assert info[0] == 0 and info[1] > 0
    torch.testing.assert_close(inverse[0], _reference(factor[0]), rtol=1e-9, atol=1e-11)


def _stats(root: str = "cholesky") -> WhiteningStatistics:
    return WhiteningStatistics({}, {}, lambda p: True, sides=("input",), damping=0.1, factor_decay=0.8,
                               statistics_rows=None, root=root, block_size=None, process_group=None)


@pytest.mark.parametrize("corrupt", ["nan", "indefinite"])
def test_the_refresh_keeps_the_previous_whitener_of_a_matrix_it_cannot_decompose(corrupt):
    factor = _factors((2,), 200, torch.float32, seed=5)
    if corrupt == "nan":
        factor[1, 150, 120] = factor[1, 120, 150] = float("nan")
    else:
        factor[1, 150:, 150:] -= 50 * torch.eye(50)
    previous = torch.randn(2, 200, 200)
    whitener = _stats().whitener(factor, previous)
    assert torch.equal(whitener[1], previous[1])
    torch.testing.assert_close(whitener[0].double(), torch.linalg.inv(torch.linalg.cholesky(
        factor[0].double() + 0.1 * factor[0].double().diagonal().mean() * torch.eye(200, dtype=torch.float64))),
        rtol=1e-4, atol=1e-5)


def test_the_refresh_whitener_is_the_inverse_cholesky_factor_at_a_wide_width():
    n = 300  # several halvings
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(2, 600, n, generator=g, dtype=torch.float64)
    factor = rows.mT @ rows / 600
    whitener = _stats().whitener(factor, None)
    lam = 0.1 * factor.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None] / n
    damped = factor + lam * torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close(whitener.mT @ whitener, torch.linalg.inv(damped), rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(whitener, torch.linalg.inv(torch.linalg.cholesky(damped)), rtol=1e-9, atol=1e-11)
