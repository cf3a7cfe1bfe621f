"""EK-FAC (``method="ekfac"``) against an independent dense float64 reference, across
ranks, in training and through checkpoints.

The reference below never imports the library's math. Per step it takes the activation
rows (conv patches built with explicit loops, tests/test_kfac_math.py) and the output
gradients captured with ``retain_grad``, and follows the documented rules (docs/API.md,
"EK-FAC"):

* K-FAC's running factors ``A``, ``G`` (first statistics taken as they are, then
  ``F ← F + (1 − decay)(F_new − F)``); on basis steps (every ``inv_update_steps``)
  ``A = Q_A diag(d_A) Q_Aᵀ``, ``G = Q_G diag(d_G) Q_Gᵀ`` (eigenvalues clamped at 0),
  and ``s ← d_G d_Aᵀ`` with the average's weight ``w ← 0``;
* on statistics steps, before any refresh of that step,
  ``s_new = mean_i (Q_Gᵀ δ_i)² (Q_Aᵀ ã_i)²ᵀ`` by an explicit loop over the rows, each
  row's gradient ``δ_i ã_iᵀ`` projected on the basis the rows were observed with;
  ``w ← decay·w + 1``, ``s ← s + (s_new − s) / w``;
* the update ``Q (diag(vec s) + λ)⁻¹ Qᵀ vec(∇)`` with ``Q = Q_G ⊗ Q_A`` built by
  ``torch.kron`` (row-major vec of ``∇ = [W | b]``);
* where a factor has clusters of equal eigenvalues (a null space: fewer rows than its
  dimension), ``eigh``'s basis of the cluster is arbitrary: every ``s`` (measured or reset)
  is replaced on each block ``C_G × C_A`` by its mean there, found by a Python loop over the
  sorted eigenvalues (a cluster takes every eigenvalue within ``(n + √n) · eps · max`` of
  its smallest one: float64 factors decomposed in float64).
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner
from test_kfac_math import conv_patch_rows, output_grad_rows, with_ones
from test_kfac_training import SGD_GRID, _ls_run, _mlp, _train_digits, digits  # noqa: F401 (fixture)

DT = torch.float64
PRECOND_RTOL = 1e-8


# =========================================================================== dense reference
class DenseEKFAC:
    """EK-FAC for one Linear/ConvNd module with explicit float64 matrices."""

    def __init__(self, module: nn.Module, *, damping: float, decay: float, factor_every: int, basis_every: int,
                 accumulation_steps: int = 1):
        self.module = module
        self.accumulation_steps = accumulation_steps
        self.damping, self.decay = damping, decay
        self.factor_every, self.basis_every = factor_every, basis_every
        self.A = self.G = None
        self.q_a = self.q_g = None  # the basis of the last refresh
        self.s = None
        self.weight = 0.0
        self.statistics_seen = 0

    def rows(self, x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ã rows with the ones column if biased, δ rows = grad · n · accumulation) of one call,
        n = the call's rows for a Linear (every leading index), its batch size for a conv."""
        conv = isinstance(self.module, nn.modules.conv._ConvNd)
        a = conv_patch_rows(x, self.module) if conv else x.reshape(-1, x.shape[-1])
        if self.module.bias is not None:
            a = with_ones(a)
        n = x.shape[0] if conv else a.shape[0]
        g = output_grad_rows(out.grad, conv) * n * self.accumulation_steps
        return a.to(DT), g.to(DT)

    def step(self, step: int, calls: list[tuple[torch.Tensor, torch.Tensor]], grad: torch.Tensor) -> torch.Tensor:
        statistics = step % self.factor_every == 0
        if statistics:
            pairs = [self.rows(x, out) for x, out in calls]
            a = torch.cat([p[0] for p in pairs])
            g = torch.cat([p[1] for p in pairs])
            if self.q_a is not None:  # s in the basis the rows were projected on
                s_new = torch.zeros(g.shape[1], a.shape[1], dtype=DT)
                for a_i, g_i in zip(a, g):  # one row's gradient δ_i ã_iᵀ at a time
                    projected = self.q_g.t() @ torch.outer(g_i, a_i) @ self.q_a
                    s_new += projected**2
                s_new = self.pool(s_new / a.shape[0])
                self.weight = self.decay * self.weight + 1.0
                self.s = self.s + (s_new - self.s) / self.weight
            A_new, G_new = a.t() @ a / a.shape[0], g.t() @ g / g.shape[0]
            self.A = A_new if self.A is None else self.A + (1 - self.decay) * (A_new - self.A)
            self.G = G_new if self.G is None else self.G + (1 - self.decay) * (G_new - self.G)
            self.statistics_seen += 1
        if step % self.basis_every == 0 and self.statistics_seen:
            d_a, self.q_a = torch.linalg.eigh(self.A)
            d_g, self.q_g = torch.linalg.eigh(self.G)
            self.clusters = (_clusters(d_g.clamp_min(0)), _clusters(d_a.clamp_min(0)))
            self.s = self.kfac_scaling = self.pool(torch.outer(d_g.clamp_min(0), d_a.clamp_min(0)))
            self.weight = 0.0
        if self.q_a is None:
            return grad.clone()
        return self.precondition(grad.to(DT), self.s)

    def pool(self, s: torch.Tensor) -> torch.Tensor:
        """``s`` with each block of (row cluster of G) x (column cluster of A) set to its mean."""
        out = s.clone()
        for rows in self.clusters[0]:
            for cols in self.clusters[1]:
                block = s[rows][:, cols]
                for i in rows:
                    for j in cols:
                        out[i, j] = block.mean()
        return out

    def precondition(self, grad: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        Q = torch.kron(self.q_g, self.q_a)
        diag = torch.diag(1.0 / (s.reshape(-1) + self.damping))
        return (Q @ diag @ Q.t() @ grad.reshape(-1)).reshape(grad.shape)

    def kfac_update(self, grad: torch.Tensor) -> torch.Tensor:
        """K-FAC's update with the current basis: what EK-FAC must differ from."""
        return self.precondition(grad.to(DT), self.kfac_scaling)


def _clusters(eigenvalues: torch.Tensor) -> list[list[int]]:
    """Index lists of the runs of ascending eigenvalues within ``(n + √n) · eps · max`` of
    the run's first (anchored: not a chain of close neighbours)."""
    n = len(eigenvalues)
    tolerance = (n + n**0.5) * torch.finfo(eigenvalues.dtype).eps * float(eigenvalues.abs().max())
    clusters = [[0]]
    for i in range(1, n):
        if float(eigenvalues[i] - eigenvalues[clusters[-1][0]]) > tolerance:
            clusters.append([])
        clusters[-1].append(i)
    return clusters


def grad_matrix(module: nn.Module) -> torch.Tensor:
    g = module.weight.grad.reshape(module.weight.shape[0], -1)
    if module.bias is not None:
        g = torch.cat([g, module.bias.grad.reshape(-1, 1)], dim=1)
    return g.detach().clone()


class Calls:
    """Each forward call's input and (grad-retaining) output of one module."""

    def __init__(self, module: nn.Module):
        self.calls = []
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        output.retain_grad()
        self.calls.append((inputs[0].detach().clone(), output))

    def take(self):
        calls, self.calls = self.calls, []
        return calls


class TwiceLinear(nn.Module):
    """fc1 is called twice per forward: per-row pairing must follow each call."""

    def __init__(self, bias: bool):
        super().__init__()
        self.fc1 = nn.Linear(5, 4, bias=bias)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.fc1(x)) * torch.sigmoid(self.fc1(x.flip(0) * 0.5 + 1)))


class ConvOnly(nn.Module):
    def __init__(self, conv: nn.Module, in_shape):
        super().__init__()
        self.conv = conv
        with torch.no_grad():
            n = conv(torch.zeros(1, *in_shape)).numel()
        self.head = nn.Linear(n, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).flatten(1))


def _linear_net(bias):
    return nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias))


# name -> (model factory, layers checked, input shape (batch first), statistics / basis intervals)
CASES = {
    "linear-bias": (lambda: _linear_net(True), ["0", "2"], (16, 5), 1, 3),
    "linear-nobias": (lambda: _linear_net(False), ["0", "2"], (16, 5), 1, 3),
    "linear-3d-input": (lambda: _linear_net(True), ["0", "2"], (4, 6, 5), 1, 3),
    "linear-same-shapes-batched": (lambda: nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(),
                                                         nn.Linear(5, 3)), ["0", "2", "4"], (16, 5), 1, 3),
    "linear-called-twice": (lambda: TwiceLinear(True), ["fc1"], (16, 5), 1, 4),
    "linear-f2-i3": (lambda: _linear_net(True), ["0", "2"], (16, 5), 2, 3),
    # A (41 x 41) from 6 rows a step: a null space, whose basis eigh may choose freely
    "linear-wide-singular": (lambda: nn.Sequential(nn.Linear(40, 5), nn.Tanh(), nn.Linear(5, 3)), ["0"],
                             (6, 40), 1, 4),
    "conv2d": (lambda: ConvOnly(nn.Conv2d(2, 3, 3), (2, 6, 6)), ["conv"], (4, 2, 6, 6), 1, 3),
    "conv2d-stride-pad-nobias": (lambda: ConvOnly(nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=False), (2, 7, 6)),
                                 ["conv"], (5, 2, 7, 6), 1, 3),
}
STEPS = 8


@pytest.mark.parametrize("case", list(CASES))
def test_update_matches_dense_reference(case):
    make, checked, shape, factor_every, basis_every = CASES[case]
    torch.manual_seed(3)
    model = make().to(DT)
    modules = dict(model.named_modules())
    # the readouts of the single-layer cases are not registered (their A would be singular
    # and the eigenbasis of a repeated eigenvalue is arbitrary)
    registered = [n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Conv2d))]
    skip = [f"^{n}$" for n in registered if n not in checked]
    precond = KronPreconditioner(model, method="ekfac", skip_layers=skip, kl_clip=None, damping=1e-2,
                                 factor_decay=0.8, factor_update_steps=factor_every,
                                 inv_update_steps=basis_every, inv_dtype=DT)
    assert sorted(precond.layers) == sorted(checked)
    refs = {n: DenseEKFAC(modules[n], damping=1e-2, decay=0.8, factor_every=factor_every,
                          basis_every=basis_every) for n in checked}
    recorders = {n: Calls(modules[n]) for n in checked}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    corrected = 0
    for step in range(STEPS):
        x = torch.randn(*shape, dtype=DT) * 1.5 + 0.3
        y = torch.randn(*shape[:-1], 3, dtype=DT) if "linear" in case else torch.randn(shape[0], 3, dtype=DT)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = {n: grad_matrix(modules[n]) for n in checked}
        raw = {n: [p.grad.clone() for p in modules[n].parameters()] for n in checked}
        precond.step()
        for n in checked:
            expected = refs[n].step(step, recorders[n].take(), grads[n])
            got = grad_matrix(modules[n])  # from the batched apply (layers of one shape together)
            err = ((got - expected).norm() / expected.norm()).item()
            assert err <= PRECOND_RTOL, f"{case} step {step} {n}: relative error {err:.2e}"
            alone = precond.layers[n].method.apply(raw[n])  # the per-layer apply
            got = torch.cat([alone[0].reshape(expected.shape[0], -1)] + [b.reshape(-1, 1) for b in alone[1:]], 1)
            err = ((got - expected).norm() / expected.norm()).item()
            assert err <= PRECOND_RTOL, f"{case} step {step} {n}: per-layer apply: relative error {err:.2e}"
            if refs[n].q_a is not None and refs[n].weight > 0:  # s measured since the refresh
                kfac = refs[n].kfac_update(grads[n])
                if ((expected - kfac).norm() / kfac.norm()).item() > 1e-2:
                    corrected += 1
        opt.step()
    # not vacuous: on steps after a measurement EK-FAC's update is not K-FAC's
    assert corrected >= len(checked) * 2, f"{case}: EK-FAC's scaling never differed from K-FAC's"


def test_layers_of_one_shape_with_different_dampings_each_take_their_own():
    """Layers of one shape are preconditioned together; each must use the damping of its own
    last refresh. With a damping schedule, a layer left alone on a refresh step (here '2', its
    bias frozen for that step) keeps the older value while its same-shape neighbour '4' takes
    the new one: '4' took '2''s (1e-2 for 1e-1, a relative error of 3.7 at step 3)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 3)).to(DT)

    def damping(step):
        return 1e-2 if step < 2 else 1e-1

    precond = KronPreconditioner(model, method="ekfac", kl_clip=None, damping=damping, factor_decay=0.7,
                                 factor_update_steps=1, inv_update_steps=2, inv_dtype=DT)
    ref = DenseEKFAC(model[4], damping=damping(0), decay=0.7, factor_every=1, basis_every=2)
    calls = Calls(model[4])
    for step in range(5):
        model[2].bias.requires_grad_(step != 2)
        model.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 5, generator=g, dtype=DT), torch.randn(12, 3, generator=g, dtype=DT)
        F.mse_loss(model(x), y).backward()
        grad = grad_matrix(model[4])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # '2' has no gradient for its bias on step 2: said
            precond.step()
        if step % 2 == 0:
            ref.damping = damping(step)
        expected = ref.step(step, calls.take(), grad)
        err = ((grad_matrix(model[4]) - expected).norm() / expected.norm()).item()
        assert err <= PRECOND_RTOL, f"step {step}: relative error {err:.2e}"
        if step == 3:  # not vacuous: the two layers of the group hold different dampings then
            assert (precond.layers["2"].method._damping_used, precond.layers["4"].method._damping_used) == (1e-2, 1e-1)
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.002 * p.grad


def test_accumulated_micro_batches_pool_their_rows():
    """Two backward passes per step (losses divided by 2): s is the mean over both
    micro-batches' rows, δ scaled by batch · accumulation_steps."""
    torch.manual_seed(4)
    model = _linear_net(True).to(DT)
    precond = KronPreconditioner(model, method="ekfac", kl_clip=None, damping=1e-2, factor_decay=0.7,
                                 inv_update_steps=3, accumulation_steps=2, inv_dtype=DT)
    refs = {n: DenseEKFAC(model[int(n)], damping=1e-2, decay=0.7, factor_every=1, basis_every=3,
                          accumulation_steps=2) for n in ("0", "2")}
    recorders = {n: Calls(model[int(n)]) for n in refs}
    for step in range(5):
        model.zero_grad()
        for micro in range(2):
            x = torch.randn(10 + 2 * micro, 5, dtype=DT)  # unequal micro-batches
            (F.mse_loss(model(x), torch.randn(x.shape[0], 3, dtype=DT)) / 2).backward()
        grads = {n: grad_matrix(model[int(n)]) for n in refs}
        precond.step()
        for n, ref in refs.items():
            expected = ref.step(step, recorders[n].take(), grads[n])
            got = grad_matrix(model[int(n)])
            err = ((got - expected).norm() / expected.norm()).item()
            assert err <= PRECOND_RTOL, f"step {step} layer {n}: relative error {err:.2e}"


def test_scaling_is_mean_of_squared_projected_row_gradients():
    """``s`` itself, right after one measurement (weight 1), on a Linear layer."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    precond = KronPreconditioner(model, method="ekfac", kl_clip=None, inv_update_steps=5, inv_dtype=DT)
    rec = Calls(model[0])
    ref = DenseEKFAC(model[0], damping=1e-3, decay=0.95, factor_every=1, basis_every=5)
    for step in range(2):
        x = torch.randn(12, 4, dtype=DT)
        model.zero_grad()
        (model(x) ** 3).mean().backward()
        grad = grad_matrix(model[0])
        precond.step()
        ref.step(step, rec.take(), grad)
    assert ref.weight == 1.0
    method = precond.layers["0"].method
    # compare s in the reference's basis: each eigenvector may differ by a sign only
    q_a, q_g = method._refreshed["A"][0], method._refreshed["G"][0]
    assert torch.allclose((q_a.t() @ ref.q_a).abs(), torch.eye(5, dtype=DT), atol=1e-8)
    assert torch.allclose((q_g.t() @ ref.q_g).abs(), torch.eye(3, dtype=DT), atol=1e-8)
    torch.testing.assert_close(method._scaling, ref.s, rtol=1e-9, atol=1e-12)


def test_default_and_inapplicable_options():
    model = _linear_net(True)
    precond = KronPreconditioner(model, method="ekfac")
    assert precond.hparams["inv_update_steps"] == 10
    with pytest.warns(UserWarning, match="compute_method"):
        KronPreconditioner(model, method="ekfac", compute_method="inverse")
    with pytest.raises(ValueError, match="inv_update_steps"):
        KronPreconditioner(model, method="ekfac", inv_update_steps=0)


# =========================================================================== training
def test_ekfac_beats_sgd_on_badly_scaled_least_squares():
    sgd = {lr: _ls_run(lr, False) for lr in SGD_GRID}
    best_sgd = min(sgd.values())
    ekfac = {lr: _ls_run(lr, True, method="ekfac", damping=1e-3) for lr in (0.1, 0.3, 1.0)}
    best = min(ekfac.values())
    print(f"least squares: SGD best {best_sgd:.3e}, EK-FAC {ekfac}")
    assert best * 10 <= best_sgd, (ekfac, sgd)


def test_digits_mlp_accuracy_with_sgd(digits):  # noqa: F811 (the fixture imported above)
    acc = _train_digits(digits, _mlp, lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9), epochs=5,
                        method="ekfac", damping=1e-2)
    print(f"digits MLP + EK-FAC + SGD: test accuracy {acc:.4f}")
    assert acc >= 0.95, f"digits MLP + EK-FAC + SGD: test accuracy {acc:.3f}"


# =========================================================================== checkpoints
def _train(model, precond, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(20, 6, generator=g)
        y = torch.randn(20, 2, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        precond.step()
        opt.step()


def _small_model():
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def test_checkpoint_round_trip_resumes_bitwise(tmp_path):
    kw = dict(method="ekfac", inv_update_steps=4, factor_update_steps=1, damping=1e-2)
    model = _small_model()
    precond = KronPreconditioner(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, precond, opt, 6, seed=1)  # mid-interval: s measured twice since the refresh
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "precond": precond.state_dict()}, path)
    _train(model, precond, opt, 7, seed=2)
    expected = [p.detach().clone() for p in model.parameters()]

    resumed = _small_model()
    precond2 = KronPreconditioner(resumed, **kw)
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
    state = torch.load(path, weights_only=False)
    resumed.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    precond2.load_state_dict(state["precond"])
    _train(resumed, precond2, opt2, 7, seed=2)
    for p, q in zip(resumed.parameters(), expected):
        assert torch.equal(p.detach(), q)


def test_a_dcp_checkpoint_loads_into_a_fresh_preconditioner_and_resumes_bitwise(tmp_path):
    """``torch.distributed.checkpoint`` loads into the state of the object it is given, so a
    freshly built preconditioner (no refresh yet) must present the same entries, as tensors,
    that a trained one saves."""
    import torch.distributed.checkpoint as dcp
    kw = dict(method="ekfac", inv_update_steps=4, factor_update_steps=1, damping=1e-2)
    model = _small_model()
    precond = KronPreconditioner(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(model, precond, opt, 6, seed=1)
    dcp.save({"precond": precond}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    params = [p.detach().clone() for p in model.parameters()]
    _train(model, precond, opt, 5, seed=2)
    resumed = _small_model()
    with torch.no_grad():
        for p, saved in zip(resumed.parameters(), params):
            p.copy_(saved)
    fresh = KronPreconditioner(resumed, **kw)
    dcp.load({"precond": fresh}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    _train(resumed, fresh, torch.optim.SGD(resumed.parameters(), lr=0.1), 5, seed=2)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p.detach(), q.detach())


def test_a_checkpoint_saved_before_the_first_refresh_loads_and_holds_no_scaling():
    kw = dict(method="ekfac", inv_update_steps=4, factor_update_steps=1, damping=1e-2)
    model = _small_model()
    precond = KronPreconditioner(model, **kw)
    state = precond.state_dict()  # nothing measured yet
    trained_model = _small_model()
    trained = KronPreconditioner(trained_model, **kw)
    _train(trained_model, trained, torch.optim.SGD(trained_model.parameters(), lr=0.1), 6, seed=1)
    trained.load_state_dict(state)
    for layer in trained.layers.values():
        assert layer.method._scaling is None and not layer.method.ready


def _same(a, b) -> bool:
    """Nested checkpoints equal, tensors bitwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("corrupt", ["nan_scaling", "integer_scaling", "nan_weight", "no_weight", "none_weight"])
def test_a_corrupted_scaling_is_refused_and_changes_nothing(corrupt):
    """The EK-FAC scaling is checked like the factors: a NaN or integer scaling (a diverged
    run's checkpoint) or a missing or absent weight raises ValueError before any layer loads."""
    kw = dict(method="ekfac", inv_update_steps=4, factor_update_steps=1, damping=1e-2)
    model = _small_model()
    precond = KronPreconditioner(model, **kw)
    _train(model, precond, torch.optim.SGD(model.parameters(), lr=0.1), 3, seed=1)
    bad = copy.deepcopy(precond.state_dict())
    layer = bad["layers"]["2"]  # the last layer: an all-or-nothing load must not have taken the first
    if corrupt == "nan_scaling":
        layer["scaling"][0, 0] = float("nan")
    elif corrupt == "integer_scaling":
        layer["scaling"] = layer["scaling"].long()
    elif corrupt == "nan_weight":
        layer["scaling_weight"] = torch.tensor(float("nan"))
    elif corrupt == "no_weight":
        del layer["scaling_weight"]
    else:
        layer["scaling_weight"] = None
    fresh_model = _small_model()
    fresh = KronPreconditioner(fresh_model, **kw)
    _train(fresh_model, fresh, torch.optim.SGD(fresh_model.parameters(), lr=0.1), 2, seed=3)
    before = copy.deepcopy(fresh.state_dict())
    with pytest.raises(ValueError, match="scaling"):
        fresh.load_state_dict(bad)
    assert _same(before, fresh.state_dict())


def test_kfac_checkpoint_is_refused():
    model = _small_model()
    kfac = KronPreconditioner(model, method="kfac")
    _train(model, kfac, torch.optim.SGD(model.parameters(), lr=0.1), 2, seed=0)
    ekfac = KronPreconditioner(_small_model(), method="ekfac")
    with pytest.raises(ValueError, match="method"):
        ekfac.load_state_dict(kfac.state_dict())


# =========================================================================== distributed
# The distributed equivalence suite (world 1-4, gloo, COMM/HYBRID/MEM_OPT, float fractions,
# split placement, checkpoints across world sizes, the collectives of statistics-only steps)
# runs EK-FAC through tests/test_distributed.py: its CONFIGS / CKPT_CONFIGS hold "ekfac-*"
# entries, so they share that file's spawned groups instead of paying for new ones.
def test_distributed_ekfac_configurations_differ_from_kfac():
    """The ekfac-* runs of tests/test_distributed.py are EK-FAC runs: each one's single-process
    trajectory differs from K-FAC's with the same settings."""
    from test_distributed import CONFIGS, Trainer
    from test_distributed import STEPS as DIST_STEPS

    names = [name for name in CONFIGS if CONFIGS[name]["kw"].get("method") == "ekfac"]
    assert len(names) >= 5
    for name in names:
        runs = {}
        for method in ("ekfac", "kfac"):
            cfg = copy.deepcopy(CONFIGS[name])
            cfg["kw"]["method"] = method
            if cfg["kw"].get("grad_worker_fraction") == "float":
                cfg["kw"]["grad_worker_fraction"] = 1.0
            trainer = Trainer(cfg).run(DIST_STEPS)
            trainer.precond.remove()
            runs[method] = trainer
        ekfac, kfac = runs["ekfac"].trajectory[-1], runs["kfac"].trajectory[-1]
        gap = ((ekfac - kfac).norm() / (ekfac - runs["ekfac"].initial).norm()).item()
        assert gap > 1e-3, f"{name}: EK-FAC run indistinguishable from K-FAC ({gap:.2e})"
