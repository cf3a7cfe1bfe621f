"""PSGD's opt-in Procrustes-style Q update (``update_rule="procrustes"``) against oracles
that do not use it.

* whitening: gradients ~ N(0, Σ_L ⊗ Σ_R) must drive ⊗ QᵢᵀQᵢ to Σ_L^-1/2 ⊗ Σ_R^-1/2 (eigh
  here), and the factors must stay close to symmetric (what the rotation is for); a
  sign-flipped update must miss the same target;
* the rotation leaves a symmetric Q unchanged and makes a rotated SPD matrix more symmetric;
* the optimizer and the preconditioner accept the option and name a bad value.
"""
import math

import pytest
import torch

from kron_precond import Kron, KronPreconditioner
from kron_precond.methods.psgd import PSGDFactors, procrustes_rotation

torch.set_num_threads(1)
F64 = torch.float64
WHITEN_TOL = 0.10  # relative Frobenius error, as for the triangular rule


def spd(n, cond, gen):
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    return q @ torch.diag(torch.logspace(0, math.log10(cond), n, dtype=F64)) @ q.T


def inv_sqrt(s):
    e, v = torch.linalg.eigh(s)
    return v @ torch.diag(e.rsqrt()) @ v.T


def fit(steps=2000, sign=1.0, dtype=F64, lr0=0.1):
    """Procrustes-rule fit on G = L Z Rᵀ; returns (relative error of ⊗QᵀQ against the exact
    whitening preconditioner, max relative asymmetry ‖Q − Qᵀ‖/‖Q‖ of the factors)."""
    gen = torch.Generator().manual_seed(1)
    m, n = 8, 6
    sl, sr = spd(m, 100.0, gen), spd(n, 100.0, gen)
    left, right = torch.linalg.cholesky(sl), torch.linalg.cholesky(sr)
    target = torch.kron(inv_sqrt(sl), inv_sqrt(sr))
    f = PSGDFactors((m, n), dtype=dtype, update_rule="procrustes")
    for k in range(steps):
        g = left @ torch.randn(m, n, generator=gen, dtype=F64) @ right.T
        v = torch.randn(m, n, generator=gen, dtype=F64)
        lr = lr0 * min(1.0, 0.05 * steps / (k + 1))
        f.update(g.to(dtype), v.to(dtype), sign * lr)
    qs = [q.to(F64) for q in f.q]
    p = torch.kron(qs[0].T @ qs[0], qs[1].T @ qs[1])
    asym = max(float((q - q.T).norm() / q.norm()) for q in qs)
    return float((p - target).norm() / target.norm()), asym


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_procrustes_rule_whitens(dtype):
    err, asym = fit(dtype=dtype)
    assert err <= WHITEN_TOL
    assert asym <= 1e-2


def test_sign_flipped_procrustes_rule_fails_whitening():
    err, _ = fit(steps=500, sign=-1.0)
    assert not err <= WHITEN_TOL  # NaN counts as failing too


def test_rotation_keeps_symmetric_and_symmetrises_rotated_spd():
    gen = torch.Generator().manual_seed(0)
    s = spd(7, 10.0, gen)
    assert torch.allclose(procrustes_rotation(s), s, atol=1e-12)
    # A small rotation of an SPD matrix: its Procrustes solution is s itself.
    skew = torch.randn(7, 7, generator=gen, dtype=F64)
    u = torch.linalg.matrix_exp(0.05 * (skew - skew.T))
    q = u @ s
    for _ in range(20):
        q = procrustes_rotation(q)
    # QᵀQ is preserved (U orthogonal to 2nd order) and Q returns to the symmetric root.
    assert float((q - q.T).norm() / q.norm()) < 1e-3
    assert torch.allclose(q, s, rtol=0, atol=1e-3 * float(s.norm()))


def test_options_threaded_and_validated():
    model = torch.nn.Linear(4, 3)
    opt = Kron(model.parameters(), lr=1e-2, precond_update="procrustes")
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    factors = next(iter(opt._tensors.values())).factors
    assert factors.update_rule == "procrustes" and len(factors.lipschitz) == 2
    pre = KronPreconditioner(torch.nn.Sequential(torch.nn.Linear(4, 3)), method="psgd",
                             precond_update="procrustes")
    layer = pre.layers["0"].method
    assert all(layer.factor(part).update_rule == "procrustes" for part in layer.parts)
    with pytest.raises(ValueError, match="precond_update"):
        Kron(model.parameters(), precond_update="qr")
    with pytest.raises(ValueError, match="precond_update"):
        KronPreconditioner(torch.nn.Sequential(torch.nn.Linear(4, 3)), method="psgd", precond_update="qr")


# -- checkpoints carry the running Lipschitz estimates (found by tests/test_equivalence.py) --
def _shrinking_batches(steps):
    """Inputs whose scale halves every step: the fit's ℓ shrinks, so the running Lipschitz
    estimate (not ℓ alone) sets the step size and a resume that forgot it diverges."""
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(16, 6, generator=gen, dtype=F64) * 0.5 ** s for s in range(steps)]


def _procrustes_run(make_step, batches, resume_at=None):
    """Train a Linear(6, 5); at ``resume_at`` rebuild everything from state dicts."""
    model, step_fn, save, load = make_step()
    for s, x in enumerate(batches):
        if s == resume_at:
            import copy
            saved, weights = copy.deepcopy(save()), copy.deepcopy(model.state_dict())
            model, step_fn, save, load = make_step()
            model.load_state_dict(weights)
            load(saved)
        step_fn(model, x)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _kron_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5).to(F64)
    opt = Kron(model.parameters(), lr=1e-2, precond_update="procrustes", precond_dtype=F64,
               preconditioner_update_probability=1.0)

    def step(m, x):
        opt.zero_grad()
        (m(x) ** 2).mean().backward()
        opt.step()
    return model, step, opt.state_dict, opt.load_state_dict


def _precond_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 5).to(F64)
    precond = KronPreconditioner(model, method="psgd", precond_update="procrustes", precond_dtype=F64,
                                 preconditioner_update_probability=1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(m, x):
        opt.zero_grad()
        (m(x) ** 2).mean().backward()
        precond.step()
        opt.step()
    return model, step, precond.state_dict, precond.load_state_dict


@pytest.mark.parametrize("make_step", [_kron_step, _precond_step], ids=["Kron", "KronPreconditioner"])
def test_resume_continues_bitwise(make_step):
    batches = _shrinking_batches(8)
    straight = _procrustes_run(make_step, batches)
    resumed = _procrustes_run(make_step, batches, resume_at=4)
    assert torch.equal(straight, resumed), (straight - resumed).abs().max()


def _trained_preconditioner(rule: str, seed: int = 0) -> tuple[torch.nn.Module, KronPreconditioner]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    precond = KronPreconditioner(model, method="psgd", precond_update=rule, preconditioner_update_probability=1.0)
    for x in _shrinking_batches(3):
        model.zero_grad()
        (model(x.float()) ** 2).mean().backward()
        precond.step()
    return model, precond


def test_an_eq_preconditioner_refuses_a_procrustes_checkpoint_and_changes_nothing():
    """The eq rule applies its factors by triangular solves: a Procrustes factor (dense) loaded
    into it would be read by its upper triangle alone, a silently wrong preconditioner."""
    _, procrustes = _trained_preconditioner("procrustes")
    saved = procrustes.state_dict()
    assert any(not torch.equal(q, q.triu()) for layer in saved["layers"].values()
               for factors in layer["factors"].values() for q in factors["q"] if q.dim() == 2)
    _, eq = _trained_preconditioner("eq", seed=1)
    before = eq.state_dict()
    with pytest.raises(ValueError, match="procrustes"):
        eq.load_state_dict(saved)
    after = eq.state_dict()
    for name, layer in before["layers"].items():
        for part, factors in layer["factors"].items():
            for q, q_after in zip(factors["q"], after["layers"][name]["factors"][part]["q"]):
                assert torch.equal(q, q_after)
    # without its Lipschitz estimates (a file from before they were saved): still refused
    for layer in saved["layers"].values():
        for factors in layer["factors"].values():
            factors.pop("lipschitz", None)
    with pytest.raises(ValueError, match="triangular"):
        eq.load_state_dict(saved)


def test_a_procrustes_preconditioner_takes_an_eq_checkpoint():
    """An upper-triangular factor is a dense one too: the Procrustes fit continues from it."""
    _, eq = _trained_preconditioner("eq")
    model, procrustes = _trained_preconditioner("procrustes", seed=1)
    procrustes.load_state_dict(eq.state_dict())
    for name, layer in eq.state_dict()["layers"].items():
        for part, factors in layer["factors"].items():
            for q, got in zip(factors["q"], procrustes.state_dict()["layers"][name]["factors"][part]["q"]):
                assert torch.equal(q, got)


@pytest.mark.parametrize("bad", [float("nan"), -2.0, 1.5])
def test_a_momentum_step_count_that_does_not_count_steps_is_refused(bad):
    """The factors' fit debiases its momentum by this count: a NaN would reach the weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    precond = KronPreconditioner(model, method="psgd", momentum_into_precond_update=True,
                                 preconditioner_update_probability=1.0)
    for x in _shrinking_batches(2):
        model.zero_grad()
        (model(x.float()) ** 2).mean().backward()
        precond.step()
    import copy
    before = copy.deepcopy(precond.state_dict())
    saved = copy.deepcopy(before)
    layer = next(iter(saved["layers"].values()))
    part = next(iter(layer["momentum_steps"]))
    layer["momentum_steps"][part] = torch.tensor(bad)
    with pytest.raises(ValueError, match="momentum_steps"):
        precond.load_state_dict(saved)
    after = precond.state_dict()
    for name, layer in before["layers"].items():
        for key, value in layer["momentum_steps"].items():
            assert torch.equal(after["layers"][name]["momentum_steps"][key], value)
