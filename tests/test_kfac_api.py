"""KronPreconditioner (K-FAC) public API and robustness.

References are explicit: factors of a Linear layer are recomputed in the test from the
recorded input and the retained output gradient (``A = mean ã ãᵀ``,
``G = mean δδᵀ``, ``δ = grad_output · batch``); preconditioned gradients from a dense
``(G ⊗ A + λI)⁻¹`` solve.
"""
from __future__ import annotations

import copy
import io
import re
import warnings
from collections.abc import Mapping

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kron_precond
from kron_precond import ComputeMethod, KronPreconditioner, Method

DT = torch.float64


# --------------------------------------------------------------------------- helpers
def linear_factors(x, grad_out, bias=True):
    """Independent A, G of an nn.Linear from its input and output gradient (float64)."""
    a = x.reshape(-1, x.shape[-1]).to(DT)
    if bias:
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
    d = grad_out.reshape(-1, grad_out.shape[-1]).to(DT) * x.shape[0]
    return a.T @ a / a.shape[0], d.T @ d / d.shape[0]


def dense_eigen(G, A, grad, damping):
    M = torch.kron(G, A) + damping * torch.eye(G.shape[0] * A.shape[0], dtype=G.dtype)
    return torch.linalg.solve(M, grad.reshape(-1)).reshape(grad.shape)


def grad_matrix(m):
    g = m.weight.grad.reshape(m.weight.shape[0], -1)
    if m.bias is not None:
        g = torch.cat([g, m.bias.grad[:, None]], 1)
    return g.detach().clone()


def rel_err(x, ref):
    return ((x - ref).norm() / ref.norm()).item()


class Capture:
    """Forward hook on Linear modules: saves inputs and retains output grads."""

    def __init__(self, modules):
        self.x, self.out = {}, {}
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name):
        def hook(m, inp, out):
            self.x[name] = inp[0].detach().clone()
            if out.requires_grad:
                out.retain_grad()
            self.out[name] = out

        return hook

    def factors(self, name, bias=True):
        return linear_factors(self.x[name], self.out[name].grad, bias)

    def remove(self):
        for h in self.handles:
            h.remove()


def mlp(dtype=DT):
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def loss_fn(model, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss


def hook_count(model):
    n = 0
    for m in model.modules():
        n += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        n += len(getattr(m, "_backward_pre_hooks", {}))
    mod = torch.nn.modules.module
    for g in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
              "_global_backward_pre_hooks"):
        n += len(getattr(mod, g, {}))
    return n


def batch(n=16, d_in=4, d_out=3):
    return torch.randn(n, d_in, dtype=DT), torch.randn(n, d_out, dtype=DT)


# --------------------------------------------------------------------------- public names
def test_public_names():
    for name in ("KronPreconditioner", "Kron", "Method", "ComputeMethod", "AssignmentStrategy",
                 "DistributedStrategy", "precond_update_prob_schedule"):
        assert hasattr(kron_precond, name), name


# --------------------------------------------------------------------------- registration
class MyLinear(nn.Linear):
    pass


class Block(nn.Module):
    """A non-leaf container that also owns a parameter of its own."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * self.scale


class Zoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 4)
        self.my = MyLinear(4, 4)
        self.block = Block()
        self.frozen_w = nn.Linear(4, 4)
        self.frozen_w.weight.requires_grad_(False)
        self.frozen_all = nn.Linear(4, 4).requires_grad_(False)
        self.conv1 = nn.Conv1d(1, 2, 3)
        self.conv2 = nn.Conv2d(1, 2, 3)
        self.conv3 = nn.Conv3d(1, 2, 3)
        self.seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())


ZOO_KFAC = {"fc", "my", "block.fc", "conv1", "conv2", "conv3", "seq.0"}


def test_registration_default():
    precond = KronPreconditioner(Zoo())
    assert set(precond.layers) == ZOO_KFAC
    assert isinstance(precond.layers, Mapping)


def test_layers_mapping_is_read_only():
    precond = KronPreconditioner(mlp())
    with pytest.raises(TypeError):
        precond.layers["0"] = precond.layers["2"]
    with pytest.raises((TypeError, AttributeError)):
        del precond.layers["0"]
    assert set(precond.layers) == {"0", "2"}


@pytest.mark.parametrize(
    "skip, expected_removed",
    [
        ("fc", {"fc", "block.fc"}),  # re.search on the qualified name
        ("^fc$", {"fc"}),
        ("Conv", {"conv1", "conv2", "conv3"}),  # class name
        ("^Linear$", {"fc", "block.fc", "seq.0"}),  # class name, subclass MyLinear kept
        ("MyLinear", {"my"}),
        (["^my$", "Conv3d"], {"my", "conv3"}),  # list
        (("seq", r"block\."), {"seq.0", "block.fc"}),  # tuple
        ([], set()),
    ],
)
def test_skip_layers(skip, expected_removed):
    precond = KronPreconditioner(Zoo(), skip_layers=skip)
    assert set(precond.layers) == ZOO_KFAC - expected_removed


def test_grouped_conv_not_registered_but_others_are():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Conv2d(4, 2, 1))
    precond = KronPreconditioner(model)
    assert set(precond.layers) == {"1"}


def test_nothing_to_register_raises_value_error():
    with pytest.raises(ValueError):
        KronPreconditioner(nn.Sequential(nn.LayerNorm(4), nn.Embedding(3, 4)))
    with pytest.raises(ValueError):
        KronPreconditioner(mlp(), skip_layers=".*")
    with pytest.raises(ValueError):
        KronPreconditioner(mlp().requires_grad_(False))


@pytest.mark.parametrize("skip", [[3], 3, ["fc", None], [re.compile("fc").pattern.encode()]])
def test_non_string_pattern_raises_type_error(skip):
    with pytest.raises(TypeError):
        KronPreconditioner(mlp(), skip_layers=skip)


@pytest.mark.parametrize("model", [None, [nn.Parameter(torch.ones(2, 2))], nn.Linear])
def test_non_module_model_raises_type_error(model):
    with pytest.raises(TypeError):
        KronPreconditioner(model)


# --------------------------------------------------------------------------- arguments
BAD_ARGS = [
    ("damping", 0.0),
    ("damping", -1e-3),
    ("factor_decay", 0.0),
    ("factor_decay", -0.5),
    ("factor_decay", 1.5),
    ("factor_update_steps", 0),
    ("factor_update_steps", -3),
    ("inv_update_steps", 0),
    ("inv_update_steps", -1),
    ("accumulation_steps", 0),
    ("method", "kfac2"),
    ("method", "sophia"),
    ("compute_method", "cholesky"),
    ("compute_method", "eig"),
]


@pytest.mark.parametrize("arg, value", BAD_ARGS, ids=[f"{a}={v}" for a, v in BAD_ARGS])
def test_bad_argument_raises_value_error_naming_it(arg, value):
    with pytest.raises(ValueError) as info:
        KronPreconditioner(mlp(), **{arg: value})
    assert arg in str(info.value), f"message does not name {arg!r}: {info.value}"


@pytest.mark.parametrize("arg, value", [("damping", -1.0), ("factor_decay", 1.5), ("damping", 0.0)])
def test_callable_returning_bad_value_raises_at_step(arg, value):
    model = mlp()
    precond = KronPreconditioner(model, **{arg: lambda step: value})
    loss_fn(model, *batch())
    with pytest.raises(ValueError) as info:
        precond.step()
    assert arg in str(info.value)


def test_step_without_backward_leaves_grads_none():
    model = mlp()
    precond = KronPreconditioner(model)
    precond.step()
    assert all(p.grad is None for p in model.parameters())
    loss_fn(model, *batch())  # and training proceeds normally afterwards
    precond.step()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_boundary_and_enum_arguments_accepted():
    KronPreconditioner(mlp(), factor_decay=1.0)
    KronPreconditioner(mlp(), method=Method.KFAC, compute_method=ComputeMethod.INVERSE)
    KronPreconditioner(mlp(), method="KFAC", compute_method="Eigen")
    KronPreconditioner(mlp(), kl_clip=None)


def test_callable_hyperparameters_are_used():
    calls = {k: [] for k in ("damping", "factor_decay", "lr", "kl_clip", "fus", "ius")}

    def rec(key, value):
        def f(step):
            calls[key].append(step)
            return value

        return f

    lam, d = 0.05, 0.5
    model = mlp()
    precond = KronPreconditioner(
        model,
        damping=rec("damping", lam),
        factor_decay=rec("factor_decay", d),
        lr=rec("lr", 0.1),
        kl_clip=rec("kl_clip", 1e6),  # ν = 1
        factor_update_steps=rec("fus", 1),
        inv_update_steps=rec("ius", 1),
        inv_dtype=DT,
    )
    cap = Capture({"0": model[0], "2": model[2]})
    refs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss_fn(model, *batch())
        refs.append({n: cap.factors(n) for n in ("0", "2")})
        grads = {n: grad_matrix(model[int(n)]) for n in ("0", "2")}
        precond.step()
    for n in ("0", "2"):
        A = d * refs[0][n][0] + (1 - d) * refs[1][n][0]
        G = d * refs[0][n][1] + (1 - d) * refs[1][n][1]
        torch.testing.assert_close(precond.layers[n].a_factor, A, rtol=1e-10, atol=1e-12)
        ref = dense_eigen(G, A, grads[n], lam)
        assert rel_err(grad_matrix(model[int(n)]), ref) < 1e-8
    for key in ("damping", "factor_decay", "fus", "ius"):
        assert calls[key], f"{key} callable never called"
        assert all(isinstance(s, int) and not isinstance(s, bool) for s in calls[key]), (key, calls[key])
    assert precond.steps == 2


def test_callable_kl_clip_and_lr_are_used():
    """kl_clip/lr callables give the same result as the equivalent constants."""
    x, y = batch()
    out = []
    for kw in (dict(kl_clip=1e-4, lr=0.5), dict(kl_clip=lambda s: 1e-4, lr=lambda s: 0.5),
               dict(kl_clip=None)):
        torch.manual_seed(3)
        model = mlp()
        precond = KronPreconditioner(model, inv_dtype=DT, **kw)
        loss_fn(model, x, y)
        precond.step()
        out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(out[1], out[0], rtol=1e-12, atol=0)
    assert rel_err(out[0], out[2]) > 1e-3, "test setup: clipping inactive"


# --------------------------------------------------------------------------- hooks
def test_eval_mode_and_no_grad_forward_do_not_touch_factors():
    d = 0.5
    model = mlp()
    precond = KronPreconditioner(model, factor_decay=d, inv_dtype=DT)
    cap = Capture({"0": model[0]})
    loss_fn(model, *batch())
    F1 = cap.factors("0")
    precond.step()
    A1 = precond.layers["0"].a_factor.clone()
    G1 = precond.layers["0"].g_factor.clone()

    # eval-mode forward/backward followed by a step: nothing observed
    model.eval()
    model.zero_grad()
    loss_fn(model, *batch())
    precond.step()
    assert torch.equal(precond.layers["0"].a_factor, A1)
    assert torch.equal(precond.layers["0"].g_factor, G1)

    # an eval-mode no_grad forward between train steps does not leak into the next update
    with torch.no_grad():
        model(torch.randn(40, 4, dtype=DT) * 10)
    model.train()
    model.zero_grad()
    loss_fn(model, *batch())
    F2 = cap.factors("0")
    precond.step()
    torch.testing.assert_close(precond.layers["0"].a_factor, d * F1[0] + (1 - d) * F2[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(precond.layers["0"].g_factor, d * F1[1] + (1 - d) * F2[1], rtol=1e-10, atol=1e-12)


def test_train_mode_no_grad_forward_does_not_leak():
    d = 0.5
    model = mlp()
    precond = KronPreconditioner(model, factor_decay=d, inv_dtype=DT)
    cap = Capture({"0": model[0]})
    loss_fn(model, *batch())
    F1 = cap.factors("0")
    precond.step()
    with torch.no_grad():  # e.g. a metric computed in train mode
        model(torch.randn(40, 4, dtype=DT) * 10)
    model.zero_grad()
    loss_fn(model, *batch())
    F2 = cap.factors("0")
    precond.step()
    torch.testing.assert_close(precond.layers["0"].a_factor, d * F1[0] + (1 - d) * F2[0], rtol=1e-10, atol=1e-12)


def test_non_factor_and_non_refresh_steps():
    """factor_update_steps=2, inv_update_steps=2: steps 0, 2 observe and refresh."""
    d, lam = 0.5, 1e-2
    model = mlp()
    precond = KronPreconditioner(model, factor_update_steps=2, inv_update_steps=2, factor_decay=d,
                                 damping=lam, kl_clip=None, inv_dtype=DT)
    cap = Capture({"0": model[0]})
    facs, grads, outs = [], [], []
    for _ in range(3):
        model.zero_grad()
        loss_fn(model, *batch())
        facs.append(cap.factors("0"))
        grads.append(grad_matrix(model[0]))
        precond.step()
        outs.append((precond.layers["0"].a_factor.clone(), precond.layers["0"].g_factor.clone(),
                     grad_matrix(model[0])))
    assert precond.steps == 3
    torch.testing.assert_close(outs[0][0], facs[0][0], rtol=1e-10, atol=1e-12)
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1]), \
        "factors changed on a non-factor step"
    torch.testing.assert_close(outs[2][0], d * facs[0][0] + (1 - d) * facs[2][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[2][1], d * facs[0][1] + (1 - d) * facs[2][1], rtol=1e-10, atol=1e-12)
    # step 1 (no refresh) preconditions with the step-0 factors
    A0, G0 = facs[0]
    assert rel_err(outs[1][2], dense_eigen(G0, A0, grads[1], lam)) < 1e-8
    A2, G2 = outs[2][0], outs[2][1]
    assert rel_err(outs[2][2], dense_eigen(G2, A2, grads[2], lam)) < 1e-8


def test_remove_restores_hooks():
    model = mlp()
    before = hook_count(model)
    precond = KronPreconditioner(model)
    assert hook_count(model) > before
    precond.remove()
    assert hook_count(model) == before
    # the model still trains normally afterwards, and gradients are plain gradients
    ref = copy.deepcopy(model)
    x, y = batch()
    loss_fn(model, x, y)
    loss_fn(ref, x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_context_manager_removes_hooks():
    model = mlp()
    before = hook_count(model)
    with KronPreconditioner(model) as precond:
        assert isinstance(precond, KronPreconditioner)
        assert hook_count(model) > before
        loss_fn(model, *batch())
        precond.step()
    assert hook_count(model) == before


def test_inplace_relu_after_linear():
    lam = 1e-2
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)).to(DT)
    precond = KronPreconditioner(model, damping=lam, kl_clip=None, inv_dtype=DT)
    x, y = batch()
    loss_fn(model, x, y)
    grads = {i: grad_matrix(model[i]) for i in (0, 2)}
    precond.step()
    # reference: the same network written functionally, without in-place ops
    W1, b1, W2, b2 = (p.detach().clone().requires_grad_() for p in model.parameters())
    h = x @ W1.T + b1
    h.retain_grad()
    r = torch.relu(h)
    out = r @ W2.T + b2
    out.retain_grad()
    F.mse_loss(out, y).backward()
    refs = {0: linear_factors(x, h.grad), 2: linear_factors(r.detach(), out.grad)}
    for i in (0, 2):
        A, G = refs[i]
        torch.testing.assert_close(precond.layers[str(i)].a_factor, A, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(precond.layers[str(i)].g_factor, G, rtol=1e-10, atol=1e-12)
        assert rel_err(grad_matrix(model[i]), dense_eigen(G, A, grads[i], lam)) < 1e-8
    assert (h.detach() < 0).any(), "test setup: ReLU must zero something"


def test_module_called_twice_pools_rows_of_both_calls():
    """A shared Linear used twice in one forward: the rows of both calls are pooled."""
    lam = 1e-2

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))

    model = Twice().to(DT)
    precond = KronPreconditioner(model, damping=lam, kl_clip=None, inv_dtype=DT)
    xs, outs = [], []

    def hook(m, inp, out):
        xs.append(inp[0].detach().clone())
        out.retain_grad()
        outs.append(out)

    h = model.fc.register_forward_hook(hook)
    x, y = batch()
    loss_fn(model, x, y)
    h.remove()
    grad = grad_matrix(model.fc)
    precond.step()
    assert len(xs) == 2
    a = torch.cat([torch.cat([xi, torch.ones(len(xi), 1, dtype=DT)], 1) for xi in xs])
    dl = torch.cat([o.grad * x.shape[0] for o in outs])
    A, G = a.T @ a / a.shape[0], dl.T @ dl / dl.shape[0]
    for t in (precond.layers["fc"].a_factor, precond.layers["fc"].g_factor):
        assert torch.isfinite(t).all()
    torch.testing.assert_close(precond.layers["fc"].a_factor, A, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(precond.layers["fc"].g_factor, G, rtol=1e-10, atol=1e-12)
    assert rel_err(grad_matrix(model.fc), dense_eigen(G, A, grad, lam)) < 1e-8


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)

    def forward(self, x, mode="both"):
        if mode == "a":
            return self.a(x)
        if mode == "b_detached":  # b runs forward, but its output is not in the loss
            self.b(x)
            return self.a(x)
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("first", ["a", "both"])
def test_parameter_without_grad_is_left_none(first):
    model = TwoBranch().to(DT)
    precond = KronPreconditioner(model, inv_dtype=DT)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for mode in (first, "b_detached", "both", "a", "both"):
        opt.zero_grad(set_to_none=True)
        x, y = batch()
        F.mse_loss(model(x, mode), y).backward()
        precond.step()
        if mode in ("a", "b_detached"):
            assert model.b.weight.grad is None and model.b.bias.grad is None
        else:
            assert torch.isfinite(model.b.weight.grad).all()
        assert torch.isfinite(model.a.weight.grad).all()
        opt.step()
    for layer in precond.layers.values():
        assert torch.isfinite(layer.a_factor).all() and torch.isfinite(layer.g_factor).all()


def test_unregistered_grads_untouched_bitwise():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.ln = nn.LayerNorm(4)
            self.fc = nn.Linear(4, 4)
            self.skipme = nn.Linear(4, 4)
            self.out = nn.Linear(4, 3)

        def forward(self, idx):
            return self.out(self.skipme(torch.tanh(self.fc(self.ln(self.emb(idx))))))

    model = Net().to(DT)
    precond = KronPreconditioner(model, skip_layers="skipme", kl_clip=1e-4, lr=1.0)
    assert set(precond.layers) == {"fc", "out"}
    idx = torch.randint(0, 10, (16,))
    y = torch.randn(16, 3, dtype=DT)
    F.mse_loss(model(idx), y).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    precond.step()
    for n, p in model.named_parameters():
        if n.split(".")[0] in ("emb", "ln", "skipme"):
            assert torch.equal(p.grad, before[n]), f"{n} changed"
        else:
            assert not torch.equal(p.grad, before[n]), f"{n} not preconditioned"


def test_nan_input_warns_and_keeps_factors_finite():
    model = mlp()
    precond = KronPreconditioner(model, inv_dtype=DT)
    loss_fn(model, *batch())
    precond.step()
    factors = {n: (l.a_factor.clone(), l.g_factor.clone()) for n, l in precond.layers.items()}
    x, y = batch()
    x[3, 1] = float("nan")
    model.zero_grad()
    with pytest.warns(Warning, match=r"(?i)finite|nan"):
        loss_fn(model, x, y)
        precond.step()
    for n, layer in precond.layers.items():
        assert torch.isfinite(layer.a_factor).all() and torch.isfinite(layer.g_factor).all(), n
        assert torch.equal(layer.a_factor, factors[n][0]), f"{n}: non-finite update not dropped"
    # a clean step afterwards is fully finite
    model.zero_grad()
    loss_fn(model, *batch())
    precond.step()
    for p in model.parameters():
        assert torch.isfinite(p.grad).all()


# --------------------------------------------------------------------------- state
CONFIGS = {
    "every-step": dict(factor_update_steps=1, inv_update_steps=1),
    "stale-inverse": dict(factor_update_steps=1, inv_update_steps=3),
    "sparse": dict(factor_update_steps=2, inv_update_steps=3),
    "inverse": dict(factor_update_steps=1, inv_update_steps=2, compute_method="inverse"),
}


def _train(model, opt, precond, batches):
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()


def _make(seed, cfg):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    precond = KronPreconditioner(model, kl_clip=1e-3, lr=0.05, **cfg)
    return model, opt, precond


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_state_dict_resume_is_bitwise(cfg):
    torch.manual_seed(0)
    batches = [(torch.randn(16, 6), torch.randint(0, 4, (16,))) for _ in range(10)]
    model, opt, precond = _make(0, CONFIGS[cfg])
    _train(model, opt, precond, batches[:5])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "precond": precond.state_dict()}, buf)
    _train(model, opt, precond, batches[5:])

    model2, opt2, precond2 = _make(123, CONFIGS[cfg])
    buf.seek(0)
    saved = torch.load(buf)  # default torch.load (weights_only=True in this torch)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    precond2.load_state_dict(saved["precond"])
    assert precond2.steps == 5
    _train(model2, opt2, precond2, batches[5:])
    assert precond2.steps == precond.steps == 10
    for (n, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), f"{cfg}: {n} differs after resume (max {(p - q).abs().max():.3e})"


def test_state_dict_with_callables_is_saveable():
    hp = dict(damping=lambda s: 1e-3, factor_decay=lambda s: 0.9, lr=lambda s: 0.1,
              kl_clip=lambda s: 1e-3, factor_update_steps=lambda s: 1, inv_update_steps=lambda s: 2)
    model = mlp(torch.float32)
    precond = KronPreconditioner(model, **hp)
    loss_fn(model, torch.randn(8, 4), torch.randn(8, 3))
    precond.step()
    buf = io.BytesIO()
    torch.save(precond.state_dict(), buf)  # lambdas would make this fail if pickled
    buf.seek(0)
    sd = torch.load(buf)
    other = KronPreconditioner(copy.deepcopy(model), **hp)
    other.load_state_dict(sd)
    assert other.steps == 1
    for n in precond.layers:
        assert torch.equal(other.layers[n].a_factor, precond.layers[n].a_factor)


def test_a_scheduled_value_that_turns_bad_raises_at_that_step_before_anything_changes():
    """A callable schedule is read for a step when that step runs: the step before it completes
    (and does not raise), the step it turns bad at raises with nothing changed."""
    model = mlp(torch.float32)
    precond = KronPreconditioner(model, factor_update_steps=lambda s: 1 if s < 2 else 0)
    for _ in range(2):
        model.zero_grad()
        loss_fn(model, torch.randn(8, 4), torch.randn(8, 3))
        precond.step(lr=0.1)
    assert precond.steps == 2
    model.zero_grad()
    loss_fn(model, torch.randn(8, 4), torch.randn(8, 3))
    grads = [p.grad.clone() for p in model.parameters()]
    factors = {n: precond.layers[n].a_factor.clone() for n in precond.layers}
    with pytest.raises(ValueError, match="factor_update_steps"):
        precond.step(lr=0.1)
    assert precond.steps == 2
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert all(torch.equal(factors[n], precond.layers[n].a_factor) for n in precond.layers)


def test_load_state_dict_rejects_mismatched_layers():
    precond = KronPreconditioner(mlp())
    other = KronPreconditioner(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT))
    with pytest.raises((ValueError, KeyError, RuntimeError)):
        other.load_state_dict(precond.state_dict())


# --------------------------------------------------------------------------- introspection
def test_memory_usage_counts_factors():
    model = nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 5, bias=False))
    precond = KronPreconditioner(model)
    loss_fn(model, torch.randn(8, 10), torch.randn(8, 5))
    precond.step()
    mem = precond.memory_usage()
    assert isinstance(mem, dict) and mem
    for k, v in mem.items():
        assert isinstance(k, str)
        assert isinstance(v, int) and not isinstance(v, bool), (k, v)
        assert v > 0, (k, v)
    factor_bytes = 4 * ((11 * 11 + 7 * 7) + (7 * 7 + 5 * 5))  # float32 A and G
    total = mem.get("total", sum(mem.values()))
    assert total >= factor_bytes, (mem, factor_bytes)


def test_repr_mentions_method_and_damping():
    text = repr(KronPreconditioner(mlp(), damping=0.0123))
    assert "kfac" in text.lower()
    assert "0.0123" in text
    assert "damping" in text


def test_steps_counter():
    model = mlp()
    precond = KronPreconditioner(model)
    assert precond.steps == 0
    for i in range(3):
        model.zero_grad()
        loss_fn(model, *batch())
        precond.step()
        assert precond.steps == i + 1


class _ScaledLinear(nn.Linear):
    """A Linear whose forward multiplies by a parameter of its own: ``y = (W x + b) * s``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.full((self.out_features,), 1.5))

    def forward(self, x):
        return super().forward(x) * self.scale


def _reparametrised(kind: str, bias: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind == "weight_norm":
        return nn.utils.weight_norm(nn.Linear(5, 4, bias=bias))
    if kind == "spectral_norm":
        return nn.utils.spectral_norm(nn.Linear(5, 4, bias=bias))
    return _ScaledLinear(5, 4, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "scaled_subclass"])
@pytest.mark.parametrize("method", ["kfac", "ikfac"])
def test_a_linear_with_parameters_of_its_own_beyond_weight_and_bias_is_skipped_naming_it(kind, bias, method, caplog):
    """The legacy nn.utils.weight_norm / spectral_norm keep the weight as a plain attribute
    computed from weight_g, weight_v / weight_orig; a subclass may use a parameter of its own in
    its forward. How those enter the output is unknown to the Linear adapter, which would take
    the bias for the weight or whiten by the wrong rows: the module is skipped, logged by name."""
    import logging

    model = nn.Sequential(_reparametrised(kind, bias), nn.Tanh(), nn.Linear(4, 3))
    with caplog.at_level(logging.INFO, logger="kron_precond"):
        precond = KronPreconditioner(model, method=method)
    assert list(precond.layers) == ["2"]
    reason = "parameter of its own" if kind != "scaled_subclass" else "parameters of its own beyond"
    assert any(r.getMessage().startswith("skipping 0") and reason in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    model(torch.randn(6, 5)).square().mean().backward()
    precond.step()


@pytest.mark.parametrize("kind", ["weight_norm", "scaled_subclass"])
def test_whitened_muon_gives_such_a_module_to_adamw_or_refuses_it_in_the_list_form(kind):
    from kron_precond import WhitenedMuon

    module = _reparametrised(kind, bias=True)
    model = nn.Sequential(module, nn.Tanh(), nn.Linear(4, 3))
    opt = WhitenedMuon(model, lr=0.02)
    whitened = {id(p) for p in opt.param_groups[0]["params"]}
    assert whitened == {id(model[2].weight)}
    model(torch.randn(6, 5)).square().mean().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"modules\[0\].*(is not a parameter|parameters) of its own"):
        WhitenedMuon([module], lr=0.02)


def test_a_registered_adapter_that_names_its_own_parameters_is_not_refused():
    """The rule is the Linear adapter's (weight and bias): an adapter a user registers with its
    own units() says which parameters it takes, and its module is whitened."""
    from kron_precond import WhitenedMuon, register_adapter
    from kron_precond.modules import _ADAPTERS, KFACAdapter, Selected

    class Kernel(nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel = nn.Parameter(torch.randn(4, 5) * 0.3)

        def forward(self, x):
            return x @ self.kernel.T

    class KernelAdapter(KFACAdapter):
        has_bias = False

        def units(self, name, params):
            return [Selected(name, self.module, [(n, p) for n, p in params if n == "kernel"], self, has_bias=False)]

    register_adapter(Kernel, KernelAdapter)
    try:
        module = Kernel()
        opt = WhitenedMuon([module], lr=0.02)
        assert [id(p) for p in opt.param_groups[0]["params"]] == [id(module.kernel)]
    finally:
        del _ADAPTERS[0]


@pytest.mark.parametrize("given, ran, warns", [(1, 4, True), (4, 4, False), (2, 1, True), (1, 1, False)])
def test_accumulation_steps_that_differ_from_the_first_steps_forwards_are_warned_about(given, ran, warns):
    """accumulation_steps scales G by its square; a trainer's accumulation the user forgot to
    pass on is a silent factor of k² in K-FAC's damping. The first step's training forwards
    (evaluation forwards not counted) are checked once."""
    import warnings as _warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    precond = KronPreconditioner(model, method="kfac", accumulation_steps=given)
    with torch.no_grad():
        model.eval()
        model(torch.randn(3, 4))  # an evaluation pass: not a micro-batch
        model.train()
    for _ in range(ran):
        (model(torch.randn(8, 4)).square().mean() / ran).backward()
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        precond.step()
        for _ in range(ran + 1):  # later steps are not checked
            model(torch.randn(8, 4)).square().mean().backward()
        precond.step()
    said = [str(w.message) for w in caught if "accumulation_steps" in str(w.message)]
    assert len(said) == (1 if warns else 0), said
    if warns:
        assert f"set accumulation_steps={ran}" in said[0]


@pytest.mark.parametrize("forwards, follows, warns", [
    ([1, 1, 4, 4, 4], False, True),  # Lightning's GradientAccumulationScheduler: 1, then 4
    ([1, 1, 4, 4, 4], True, False),  # ... with accumulation_steps set when it changes
    ([4, 4, 2, 4, 4], False, False),  # one short last window: not a change of count
    ([4, 4, 4, 4, 4], False, False),
])
def test_a_change_of_the_micro_batches_per_step_is_warned_about(forwards, follows, warns):
    """A count of micro-batches that changes during the run (a GradientAccumulationScheduler, a
    resume with another count) with accumulation_steps left as it was scales G by the square
    of the ratio from then on (K-FAC's damping 16x too strong from 1 to 4): said once, after
    two steps at the new count, naming the value to set."""
    import warnings as _warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    precond = KronPreconditioner(model, method="kfac", accumulation_steps=forwards[0])
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        for ran in forwards:
            if follows:
                precond.accumulation_steps = ran
            for _ in range(ran):
                (model(torch.randn(8, 4)).square().mean() / ran).backward()
            precond.step()
            model.zero_grad()
    said = [str(w.message) for w in caught if "accumulation_steps" in str(w.message)]
    assert len(said) == (1 if warns else 0), said
    if warns:
        assert "set accumulation_steps=4" in said[0] or "accumulation_steps = 4" in said[0], said[0]


def test_output_gradients_that_turn_non_finite_are_named_as_a_cause_of_stale_statistics():
    """K-FAC leaves non-finite output-gradient rows out of G: a layer whose output gradients
    are NaN or Inf on every statistics step stops updating G, and the warning says that this
    is one of the two causes (not only a detached output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    precond = KronPreconditioner(model, method="kfac", factor_update_steps=1, inv_update_steps=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for step in range(8):
            model.zero_grad()
            out = model(torch.randn(16, 4))
            scale = 1.0 if step < 2 else float("inf")  # from step 2 on, every output gradient is Inf
            (out * scale).sum().backward()
            precond.step()
    stale = [str(w.message) for w in record if "no usable output gradients" in str(w.message)]
    assert stale and "NaN or Inf" in stale[0], [str(w.message) for w in record]


@pytest.mark.parametrize("name,member", [("comm_opt", "COMM_OPT"), ("MEM_OPT", "MEM_OPT"),
                                         ("Hybrid_Opt", "HYBRID_OPT")])
def test_grad_worker_fraction_takes_the_strategys_name_as_the_other_enums_do(name, member):
    """Like ``method``, ``compute_method`` and ``assignment_strategy``, the strategy may be given
    by its name, in any case; an unknown name is refused naming the argument and the choices."""
    from kron_precond import DistributedStrategy

    model = nn.Sequential(nn.Linear(4, 3))
    precond = KronPreconditioner(model, grad_worker_fraction=name)
    assert precond.grad_worker_fraction is DistributedStrategy[member]
    with pytest.raises(ValueError, match=r"grad_worker_fraction.*'some_opt'.*comm_opt"):
        KronPreconditioner(model, grad_worker_fraction="some_opt")
