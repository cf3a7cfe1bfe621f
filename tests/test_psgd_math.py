"""PSGD Kron math (kron_precond/methods/psgd.py) against oracles that do not use it.

* whitening: gradients ~ N(0, Σ_L ⊗ Σ_R) must drive ⊗ QᵢᵀQᵢ to Σ_L^-1/2 ⊗ Σ_R^-1/2
  (computed with eigh here); a broken update must miss the same target;
* one Q update equals DESIGN.md §3's formula written out with dense Kronecker matrices;
* structure: triangular stays triangular, diagonal stays positive, factor_is_diagonal table.
"""
import math

import pytest
import torch

from kron_precond.methods import psgd
from kron_precond.methods.psgd import PSGDFactors, factor_is_diagonal, most_square_split, spectral_norm_lower_bound
from kron_precond.optim import Kron

torch.set_num_threads(1)
F64 = torch.float64


# ----------------------------------------------------------------------------- helpers
def spd(n, cond, gen):
    """A random SPD matrix with eigenvalues log-spaced in [1, cond]."""
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    return q @ torch.diag(torch.logspace(0, math.log10(cond), n, dtype=F64)) @ q.T


def inv_sqrt(s):
    e, v = torch.linalg.eigh(s)
    return v @ torch.diag(e.rsqrt()) @ v.T


def kron_all(mats):
    out = mats[0]
    for m in mats[1:]:
        out = torch.kron(out, m)
    return out


def dense(q):
    return torch.diag(q) if q.dim() == 1 else q


def unfold(x, i):
    return x.movedim(i, 0).reshape(x.shape[i], -1)


def dense_preconditioner(f):
    return kron_all([dense(q).T @ dense(q) for q in f.q])


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------- whitening
WHITEN_TOL = 0.10  # relative Frobenius error of ⊗ QᵢᵀQᵢ vs Σ_L^-1/2 ⊗ Σ_R^-1/2, no rescaling
# (measured: 0.032 in float64 and in float32 after 2000 updates; lr = 0 gives 3.2 and a
# swapped sign diverges)


def fit_whitening(lr0, steps=2000, sign=1.0, dtype=F64):
    """Run `steps` Q updates on G = L Z Rᵀ (Z iid normal) with lr0·min(1, 0.05·steps/k); return the
    relative error of the learned preconditioner against the exact whitening one."""
    gen = torch.Generator().manual_seed(1)
    m, n = 8, 6
    sl, sr = spd(m, 100.0, gen), spd(n, 100.0, gen)
    left, right = torch.linalg.cholesky(sl), torch.linalg.cholesky(sr)
    target = torch.kron(inv_sqrt(sl), inv_sqrt(sr))
    f = PSGDFactors((m, n), dtype=dtype)
    for k in range(steps):
        g = left @ torch.randn(m, n, generator=gen, dtype=F64) @ right.T
        v = torch.randn(m, n, generator=gen, dtype=F64)
        lr = lr0 * min(1.0, 0.05 * steps / (k + 1))
        f.update(g.to(dtype), v.to(dtype), sign * lr)
    return rel_err(dense_preconditioner(f).to(F64), target)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_whitening_converges_to_inverse_sqrt_covariance(dtype):
    # The fixed point E[hhᵀ] = P^-1 E[vvᵀ] P^-1 pins the overall scale, so no normalisation.
    assert fit_whitening(0.1, dtype=dtype) <= WHITEN_TOL


@pytest.mark.parametrize("lr0,sign", [(0.0, 1.0), (0.1, -1.0)], ids=["lr0", "swapped_sign"])
def test_broken_update_fails_whitening_criterion(lr0, sign):
    err = fit_whitening(lr0, steps=500, sign=sign)
    assert not err <= WHITEN_TOL  # NaN counts as failing too


# ----------------------------------------------------------------------------- one update
CASES = [  # shape, memory_save_mode, min_ndim_triangular
    ((5, 4), None, 2),
    ((5, 4), "one_diag", 2),
    ((5, 4), "all_diag", 2),
    ((3, 4, 2), None, 2),
    ((3, 4, 2), "smart_one_diag", 2),
    ((6,), None, 1),
    ((6,), None, 2),
]


def random_factors(shape, mode, min_ndim, gen):
    """Factors moved away from identity by a few random updates (any valid state will do)."""
    f = PSGDFactors(shape, memory_save_mode=mode, min_ndim_triangular=min_ndim, dtype=F64)
    for q in f.q:
        if q.dim() == 1:
            q.copy_(torch.rand(q.shape, generator=gen, dtype=F64) + 0.5)
        else:
            q.copy_(torch.eye(q.shape[0], dtype=F64)
                    + 0.3 * torch.triu(torch.randn(q.shape, generator=gen, dtype=F64)))
    return f


def design_update(qs, g, v, lr):
    """DESIGN.md §3 with dense explicit matrices (vec is row-major, like torch.kron)."""
    shape = g.shape
    a = (kron_all([dense(q) for q in qs]) @ g.reshape(-1)).reshape(shape)
    b = (kron_all([torch.linalg.inv(dense(q)).T for q in qs]) @ v.reshape(-1)).reshape(shape)
    new = []
    for i, q in enumerate(qs):
        t1 = unfold(a, i) @ unfold(a, i).T
        t2 = unfold(b, i) @ unfold(b, i).T
        if q.dim() == 1:
            t1, t2 = torch.diagonal(t1), torch.diagonal(t2)
            new.append(q - lr * (t1 - t2) * q / (t1 + t2).abs().max())
        else:
            norm = spectral_norm_lower_bound(t1 + t2)
            new.append(q - lr * torch.triu(t1 - t2) @ q / norm)
    return new


@pytest.mark.parametrize("block_min", [10 ** 6, 2], ids=["plain", "blocked"])
@pytest.mark.parametrize("shape,mode,min_ndim", CASES)
def test_one_update_matches_dense_formula(shape, mode, min_ndim, block_min, monkeypatch):
    monkeypatch.setattr(psgd, "BLOCK_MIN_CPU", block_min)  # blocked triangular products too
    gen = torch.Generator().manual_seed(2)
    f = random_factors(shape, mode, min_ndim, gen)
    g = torch.randn(shape, generator=gen, dtype=F64)
    v = torch.randn(shape, generator=gen, dtype=F64)
    g_before = g.clone()
    expected = design_update([q.clone() for q in f.q], g, v, 0.1)
    applied = f.update(g, v, 0.1)
    assert applied.dtype == torch.bool and applied.dim() == 0 and bool(applied)
    assert torch.equal(g, g_before)  # fit is never modified
    for q, e in zip(f.q, expected):
        torch.testing.assert_close(q, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block_min", [10 ** 6, 2], ids=["plain", "blocked"])
@pytest.mark.parametrize("shape,mode,min_ndim", CASES)
def test_precondition_matches_dense_kronecker(shape, mode, min_ndim, block_min, monkeypatch):
    monkeypatch.setattr(psgd, "BLOCK_MIN_CPU", block_min)
    gen = torch.Generator().manual_seed(3)
    f = random_factors(shape, mode, min_ndim, gen)
    g = torch.randn(shape, generator=gen, dtype=torch.float32)
    out = f.precondition(g)
    assert out.shape == g.shape and out.dtype == g.dtype
    expected = (dense_preconditioner(f) @ g.reshape(-1).to(F64)).reshape(shape)
    torch.testing.assert_close(out.to(F64), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 5, 13, 600])
def test_blocked_triangular_products(n, monkeypatch):
    if n < 600:
        monkeypatch.setattr(psgd, "BLOCK_MIN_CPU", 3)  # several levels of blocking
    gen = torch.Generator().manual_seed(11)
    a = torch.triu(torch.randn(n, n, generator=gen, dtype=F64))
    b = torch.triu(torch.randn(n, n, generator=gen, dtype=F64))
    x = torch.randn(7, n, generator=gen, dtype=F64)
    torch.testing.assert_close(psgd.upper_triangular_matmul(a, b), a @ b)
    torch.testing.assert_close(psgd.upper_gram(a), a.T @ a)
    torch.testing.assert_close(psgd.matmul_upper(x, a), x @ a)
    torch.testing.assert_close(psgd.matmul_upper_t(x, a), x @ a.T)
    xt = torch.randn(n, 7, generator=gen, dtype=F64).T  # a transposed view, as in the code
    torch.testing.assert_close(psgd.matmul_upper_t(xt, a), xt @ a.T)
    for form_p in (True, False):
        torch.testing.assert_close(psgd.apply_qtq(a, form_p)(xt), xt @ (a.T @ a))


def test_spectral_norm_lower_bound_is_a_tight_lower_bound():
    gen = torch.Generator().manual_seed(4)
    for n in (1, 2, 7, 30):
        x = torch.randn(n, 2 * n, generator=gen, dtype=F64)
        s = x @ x.T
        exact = torch.linalg.matrix_norm(s, 2)
        lb = spectral_norm_lower_bound(s)
        assert lb <= exact * (1 + 1e-12)
        assert lb >= exact / math.sqrt(n)
    assert spectral_norm_lower_bound(torch.zeros(3, 3)) == 0


def test_structure_is_preserved_over_many_updates():
    gen = torch.Generator().manual_seed(5)
    f = PSGDFactors((7, 5, 3), memory_save_mode="smart_one_diag", dtype=torch.float32)
    assert [q.dim() for q in f.q] == [1, 2, 2]
    for _ in range(200):
        g = torch.randn(7, 5, 3, generator=gen) * torch.rand(7, 1, 1, generator=gen)
        f.update(g, torch.randn(7, 5, 3, generator=gen), 0.2)
    assert (f.q[0] > 0).all()
    for q in f.q[1:]:
        assert torch.equal(torch.tril(q, -1), torch.zeros_like(q))
        assert (torch.diagonal(q) > 0).all()


# ----------------------------------------------------------------------------- structure
@pytest.mark.parametrize("shape,mode,expected", [
    ((8, 4), None, [False, False]),
    ((8, 4), "smart_one_diag", [True, False]),
    ((4, 4), "smart_one_diag", [False, False]),
    ((4, 8, 8), "smart_one_diag", [False, False, False]),
    ((8, 4, 8), "one_diag", [True, False, False]),
    ((4, 8), "one_diag", [False, True]),
    ((8, 4), "all_diag", [True, True]),
    ((8,), None, [True]),
    ((8,), "smart_one_diag", [True]),
    ((1, 8), None, [True, False]),
    ((10000, 8), None, [True, False]),
    ((), None, []),
])
def test_factor_is_diagonal_table(shape, mode, expected):
    assert factor_is_diagonal(shape, max_size_triangular=8192, min_ndim_triangular=2,
                              memory_save_mode=mode) == expected


def test_factor_is_diagonal_thresholds_and_bad_mode():
    kw = dict(memory_save_mode=None)
    assert factor_is_diagonal((8, 4), max_size_triangular=5, min_ndim_triangular=2, **kw) == [
        True, False]
    assert factor_is_diagonal((8, 4), max_size_triangular=99, min_ndim_triangular=3, **kw) == [
        True, True]
    assert factor_is_diagonal((8,), max_size_triangular=99, min_ndim_triangular=1,
                              memory_save_mode="smart_one_diag") == [False]
    with pytest.raises(ValueError, match="memory_save_mode"):
        factor_is_diagonal((8, 4), max_size_triangular=99, min_ndim_triangular=2,
                           memory_save_mode="some_diag")


def test_most_square_split_uses_absolute_difference():
    # The public signed-difference version picks 576×3 here.
    assert most_square_split((64, 3, 3, 3)) == (64, 27)
    assert most_square_split((2, 3, 4, 5)) == (6, 20)
    assert most_square_split((3, 64, 3, 3)) == (192, 9)


def test_merge_dims_is_transparent():
    gen = torch.Generator().manual_seed(6)
    merged = PSGDFactors((2, 3, 4, 5), merge_dims=True, dtype=F64)
    plain = PSGDFactors((6, 20), dtype=F64)
    assert [tuple(q.shape) for q in merged.q] == [(6, 6), (20, 20)]
    for _ in range(3):
        g = torch.randn(2, 3, 4, 5, generator=gen, dtype=F64)
        v = torch.randn(2, 3, 4, 5, generator=gen, dtype=F64)
        merged.update(g, v, 0.1)
        plain.update(g.reshape(6, 20), v.reshape(6, 20), 0.1)
    g = torch.randn(2, 3, 4, 5, generator=gen, dtype=F64)
    out = merged.precondition(g)
    assert out.shape == g.shape
    torch.testing.assert_close(out.reshape(6, 20), plain.precondition(g.reshape(6, 20)))


# ----------------------------------------------------------------------------- edge cases
def test_zero_dim_and_one_dim_tensors():
    gen = torch.Generator().manual_seed(7)
    scalar = PSGDFactors((), init_scale=2.0)
    assert [tuple(q.shape) for q in scalar.q] == [(1,)] and scalar.q[0].item() == 2.0
    ok = scalar.update(torch.tensor(0.5), torch.tensor(-1.2), 0.1)
    assert bool(ok) and scalar.q[0].item() != 2.0
    out = scalar.precondition(torch.tensor(3.0))
    assert out.shape == () and torch.isclose(out, 3.0 * scalar.q[0][0] ** 2)

    vec = PSGDFactors((5,))
    assert [q.dim() for q in vec.q] == [1]
    vec.update(torch.randn(5, generator=gen), torch.randn(5, generator=gen), 0.1)
    g = torch.randn(5, generator=gen)
    torch.testing.assert_close(vec.precondition(g), g * vec.q[0] ** 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_fit_leaves_q_unchanged(bad):
    gen = torch.Generator().manual_seed(8)
    f = random_factors((4, 3), None, 2, gen)
    before = [q.clone() for q in f.q]
    g = torch.randn(4, 3, generator=gen, dtype=F64)
    g[3, 0] = bad  # lower part: triu alone would hide it
    g_before = g.clone()
    applied = f.update(g, torch.randn(4, 3, generator=gen, dtype=F64), 0.1)
    assert applied.dim() == 0 and not bool(applied)
    for q, b in zip(f.q, before):
        assert torch.equal(q, b)
    assert torch.equal(g.isnan(), g_before.isnan())
    assert torch.equal(g.nan_to_num(), g_before.nan_to_num())


def test_initialize_from_gradient_scale():
    g = torch.randn(6, 4) * 30.0
    f = PSGDFactors((6, 4), init_scale=None)
    assert not f.initialized
    f.initialize_from(g)
    s = float(g.double().pow(4).mean() ** -0.125)
    assert f.initialized
    torch.testing.assert_close(dense_preconditioner(f).to(F64),
                               s ** 2 * torch.eye(24, dtype=F64), rtol=1e-5, atol=0)
    f.initialize_from(2 * g)  # re-initialising resets the factors to the new scale
    torch.testing.assert_close(dense_preconditioner(f).to(F64),
                               s ** 2 / 2 * torch.eye(24, dtype=F64), rtol=1e-5, atol=0)
    for bad in (torch.zeros(6, 4), torch.full((6, 4), float("nan"))):
        with pytest.raises(ValueError, match="precond_init_scale"):
            PSGDFactors((6, 4), init_scale=None).initialize_from(bad)


def test_state_dict_round_trip_and_bookkeeping():
    gen = torch.Generator().manual_seed(9)
    f = random_factors((5, 4), "one_diag", 2, gen)
    g = PSGDFactors((5, 4), memory_save_mode="one_diag", dtype=F64)
    g.load_state_dict(f.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(f.tensors(), g.tensors()))
    assert f.memory() == (5 + 16) * 8
    assert f.cost() == 5 + 4 ** 3 + 20 * 9
    with pytest.raises(ValueError, match="shapes"):
        PSGDFactors((5, 4), dtype=F64).load_state_dict(f.state_dict())


# ----------------------------------------------------------------------------- memory
@pytest.mark.parametrize("mode,expected_q", [
    (None, lambda m, n: m * m + n * n),
    ("smart_one_diag", lambda m, n: m + n * n),
    ("one_diag", lambda m, n: m + n * n),
    ("all_diag", lambda m, n: m + n),
])
def test_optimizer_state_memory(mode, expected_q):
    m, n = 12, 7
    layer = torch.nn.Linear(n, m, bias=False)  # weight [m, n]
    opt = Kron(layer.parameters(), lr=1e-3, memory_save_mode=mode)
    layer(torch.randn(3, n)).sum().backward()
    opt.step()
    state = opt.state[layer.weight]
    # the schedule's counters: one tensor of 3 shared by every parameter's entry, not per-parameter memory
    floats = sum(t.numel() for k, t in state.items() if torch.is_tensor(t) and t.dim() > 0 and k != "kron_schedule")
    floats += sum(q.numel() for q in state["Q"])
    assert floats == m * n + expected_q(m, n)
