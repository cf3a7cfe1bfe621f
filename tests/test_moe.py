"""Fused MoE experts: per-expert K-FAC / EK-FAC units against dense float64 references.

The reference is the same experts written as separate layers applied to the routed rows:
per expert, a first-stage Linear (or two), the expert's activation, a second-stage Linear,
the routing weight on its output, the rows added back to their tokens. Its output gradients
are recorded by tensor hooks, and the expected factors are the explicit covariances of the
routed rows (``A_e = mean ã ãᵀ``, ``G_e = mean δ δᵀ`` with ``δ = grad · T``, ``T`` the
tokens of the call; see kron_precond/experts.py), the expected K-FAC step the dense solve
``(G_e ⊗ A_e + λ I)⁻¹ vec(∇_e)``.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kron_precond import KronPreconditioner, RoutedExperts, RoutedExpertsAdapter, register_adapter
from kron_precond import modules as adapter_registry
from kron_precond.experts import ExpertWeight, Routing

F64 = torch.float64
DAMPING = 1e-2


# ---------------------------------------------------------------------- dense reference
def dense_reference(x, index, weights, first, second, combine):
    """Run the experts as separate layers on the routed rows, with gradients.

    ``first``: list over first-stage weights of ``(W [E, out, in] as [out, in] matrices, b [E, out] | None)``;
    ``second``: ``(W, b)``; ``combine(list of z) -> h``. Returns per expert a dict with the
    activation rows and scaled output-gradient rows of every weight, and the gradients of
    each weight as ``[out, in(+1)]`` matrices, after ``loss = out.pow(2).mean()`` (a
    per-token mean over the output) backward.
    """
    tokens = x.shape[0]
    num_experts = second[0].shape[0]
    out = torch.zeros(tokens, second[0].shape[1], dtype=x.dtype)
    records = []
    layers = []
    for e in range(num_experts):
        token, choice = torch.where(index == e)
        rec = {"rows": token.numel()}
        params = [(W[e].detach().clone().requires_grad_(),
                   None if b is None else b[e].detach().clone().requires_grad_())
                  for W, b in first + [second]]
        layers.append(params)
        if token.numel() == 0:
            records.append(rec)
            continue
        xe = x[token]
        zs = []
        for j, (W, b) in enumerate(params[:-1]):
            z = F.linear(xe, W, b)
            z.register_hook(lambda g, j=j, rec=rec: rec.__setitem__(f"g{j}", g * tokens))
            zs.append(z)
            rec[f"a{j}"] = xe
        h = combine(zs)
        rec["a_out"] = h.detach()
        W, b = params[-1]
        y = F.linear(h, W, b)
        y.register_hook(lambda g, rec=rec: rec.__setitem__("g_out", g * tokens))
        out = out.index_add(0, token, y * weights[token, choice].unsqueeze(1))
        records.append(rec)
    out.pow(2).mean().backward()
    for rec, params in zip(records, layers):
        if rec["rows"]:
                rec["grads"] = [torch.cat([W.grad, b.grad[:, None]], 1) if b is not None else W.grad for W, b in params]
    return records


def covariance(rows, bias):
    if bias:
        rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=rows.dtype)], 1)
    return rows.t() @ rows / rows.shape[0]


def kfac_solution(G, A, grad, damping=DAMPING):
    """(G ⊗ A + λI)⁻¹ vec(∇) for a row-major [out, in] gradient."""
    n = G.shape[0] * A.shape[0]
    matrix = torch.kron(G, A) + damping * torch.eye(n, dtype=F64)
    return torch.linalg.solve(matrix, grad.reshape(-1)).reshape(grad.shape)


def unit_matrix(param, bias, e, transposed=False):
    w = param.grad[e].t() if transposed else param.grad[e]
    return torch.cat([w, bias.grad[e][:, None]], 1) if bias is not None else w


def routing(tokens, num_experts, k, seed, empty=None):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, num_experts, generator=g)
    if empty is not None:
        scores[:, empty] = -1.0  # this expert gets no row
    index = scores.topk(k, dim=1).indices
    weights = torch.rand(tokens, k, generator=g, dtype=F64) + 0.1
    return index, weights


# ---------------------------------------------------------------------- reference module
@pytest.mark.parametrize("bias", [True, False])
def test_reference_experts_kfac_equals_dense_float64(bias):
    torch.manual_seed(0)
    E, d, hidden, T = 4, 5, 3, 40
    model = RoutedExperts(E, d, hidden, bias=bias, activation=torch.tanh, dtype=F64)
    x = torch.randn(T, d, dtype=F64)
    index, weights = routing(T, E, 2, seed=1, empty=2)
    precond = KronPreconditioner(model, method="kfac", damping=DAMPING, kl_clip=None, inv_dtype=F64)
    assert len(precond.layers) == 2 * E
    model(x, index, weights).pow(2).mean().backward()
    raw = [model.up_weight.grad.clone(), model.down_weight.grad.clone()]
    with pytest.warns(RuntimeWarning, match=r"\['up_weight.2', 'down_weight.2'\] are registered but"):
        precond.step()  # expert 2 was routed no token: reported, passed through

    ref = dense_reference(x, index, weights, [(model.up_weight, model.up_bias)], (model.down_weight, model.down_bias),
                          lambda zs: torch.tanh(zs[0]))
    for e in range(E):
        rec = ref[e]
        up, down = precond.layers[f"up_weight.{e}"], precond.layers[f"down_weight.{e}"]
        if rec["rows"] == 0:  # no row: nothing observed, gradient (zero) passes through
            assert torch.equal(up.a_factor, torch.zeros_like(up.a_factor))
            assert torch.equal(model.up_weight.grad[e], torch.zeros_like(model.up_weight.grad[e]))
            continue
        torch.testing.assert_close(raw[0][e], rec["grads"][0][:, :d], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(raw[1][e], rec["grads"][1][:, :hidden], rtol=1e-12, atol=1e-14)
        A_up, G_up = covariance(rec["a0"], bias), covariance(rec["g0"], False)
        A_down, G_down = covariance(rec["a_out"], bias), covariance(rec["g_out"], False)
        torch.testing.assert_close(up.a_factor, A_up, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(up.g_factor, G_up, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(down.a_factor, A_down, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(down.g_factor, G_down, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(unit_matrix(model.up_weight, model.up_bias, e),
                                   kfac_solution(G_up, A_up, rec["grads"][0]), rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(unit_matrix(model.down_weight, model.down_bias, e),
                                   kfac_solution(G_down, A_down, rec["grads"][1]), rtol=1e-8, atol=1e-10)


class SeparateExperts(nn.Module):
    """The same experts as E pairs of nn.Linear applied to the routed rows."""

    def __init__(self, fused: RoutedExperts) -> None:
        super().__init__()
        E = fused.num_experts
        self.up = nn.ModuleList(nn.Linear(fused.dim, fused.hidden, dtype=F64) for _ in range(E))
        self.down = nn.ModuleList(nn.Linear(fused.hidden, fused.dim, dtype=F64) for _ in range(E))
        self.activation = fused.activation
        with torch.no_grad():
            for e in range(E):
                self.up[e].weight.copy_(fused.up_weight[e])
                self.up[e].bias.copy_(fused.up_bias[e])
                self.down[e].weight.copy_(fused.down_weight[e])
                self.down[e].bias.copy_(fused.down_bias[e])

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(len(self.up)):
            token, choice = torch.where(index == e)
            y = self.down[e](self.activation(self.up[e](x[token]))) * weights[token, choice].unsqueeze(1)
            out = out.index_add(0, token, y)
        return out


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_fused_equals_separate_linear_layers_over_steps(method):
    """Every token to every expert (k = E): each separate Linear then sees all T rows, so its
    K-FAC scale (the rows of its call) equals the fused one's (the tokens of the call) and
    the two must agree step by step, for K-FAC and EK-FAC, through several refreshes."""
    torch.manual_seed(3)
    E, d, hidden, T = 3, 4, 6, 24
    fused = RoutedExperts(E, d, hidden, activation=torch.tanh, dtype=F64)
    separate = SeparateExperts(fused)
    kw = dict(method=method, damping=DAMPING, kl_clip=None, factor_decay=0.8, inv_update_steps=3, inv_dtype=F64)
    p_fused, p_sep = KronPreconditioner(fused, **kw), KronPreconditioner(separate, **kw)
    for step in range(7):
        x = torch.randn(T, d, dtype=F64)
        index, weights = routing(T, E, E, seed=10 + step)
        for model, precond in ((fused, p_fused), (separate, p_sep)):
            model.zero_grad()
            model(x, index, weights).pow(2).mean().backward()
            precond.step()
        for e in range(E):
            torch.testing.assert_close(fused.up_weight.grad[e], separate.up[e].weight.grad, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(fused.up_bias.grad[e], separate.up[e].bias.grad, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(fused.down_weight.grad[e], separate.down[e].weight.grad, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(fused.down_bias.grad[e], separate.down[e].bias.grad, rtol=1e-9, atol=1e-12)


def test_separate_linear_layers_scale_g_by_their_own_rows():
    """With uneven routing the factors of separate Linear layers differ from the fused ones
    exactly by the documented scale: A equal, G_separate = (n_e / T)² G_fused."""
    torch.manual_seed(4)
    E, d, hidden, T = 3, 4, 5, 30
    fused = RoutedExperts(E, d, hidden, activation=torch.tanh, dtype=F64)
    separate = SeparateExperts(fused)
    x = torch.randn(T, d, dtype=F64)
    index, weights = routing(T, E, 1, seed=5)
    for model in (fused, separate):
        precond = KronPreconditioner(model, method="kfac", kl_clip=None)
        model(x, index, weights).pow(2).mean().backward()
        precond.step()
        model.precond = precond
    counts = torch.bincount(index.reshape(-1), minlength=E)
    for e in range(E):
        ratio = (counts[e].item() / T) ** 2
        f, s = fused.precond.layers[f"up_weight.{e}"], separate.precond.layers[f"up.{e}"]
        torch.testing.assert_close(f.a_factor, s.a_factor, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(f.g_factor * ratio, s.g_factor, rtol=1e-10, atol=1e-14)


def test_ekfac_scaling_step_equals_dense_float64():
    """EK-FAC on uneven routing: step 0 applies K-FAC's eigen-scaling, step 1 (same rows, no
    new basis) the scaling re-measured from the projected per-row gradients of each expert."""
    torch.manual_seed(6)
    E, d, hidden, T = 3, 4, 3, 36
    model = RoutedExperts(E, d, hidden, activation=torch.tanh, dtype=F64)
    x = torch.randn(T, d, dtype=F64)
    index, weights = routing(T, E, 2, seed=7)
    precond = KronPreconditioner(model, method="ekfac", damping=DAMPING, kl_clip=None, inv_update_steps=10,
                                 inv_dtype=F64)
    ref = dense_reference(x, index, weights, [(model.up_weight, model.up_bias)], (model.down_weight, model.down_bias),
                          lambda zs: torch.tanh(zs[0]))
    for step in range(2):
        model.zero_grad()
        model(x, index, weights).pow(2).mean().backward()
        precond.step()
        for e in range(E):
            rec = ref[e]
            cases = (("up_weight", model.up_weight, model.up_bias, rec["a0"], rec["g0"], rec["grads"][0]),
                     ("down_weight", model.down_weight, model.down_bias, rec["a_out"], rec["g_out"], rec["grads"][1]))
            for name, param, bias, a, g, grad in cases:
                A, G = covariance(a, True), covariance(g, False)
                d_a, q_a = torch.linalg.eigh(A)
                d_g, q_g = torch.linalg.eigh(G)
                if step == 0:
                    s = torch.outer(d_g.clamp_min(0), d_a.clamp_min(0))
                else:
                    a1 = torch.cat([a, torch.ones(a.shape[0], 1, dtype=F64)], 1)
                    s = ((g @ q_g) ** 2).t() @ ((a1 @ q_a) ** 2) / a.shape[0]
                expected = q_g @ ((q_g.t() @ grad @ q_a) / (s + DAMPING)) @ q_a.t()
                torch.testing.assert_close(unit_matrix(param, bias, e), expected, rtol=1e-7, atol=1e-10,
                                           msg=lambda m, step=step, name=name, e=e: f"step {step} {name}.{e}: {m}")


def test_expert_without_rows_keeps_its_factors():
    torch.manual_seed(8)
    E, d, hidden, T = 3, 4, 5, 20
    model = RoutedExperts(E, d, hidden, dtype=F64)
    precond = KronPreconditioner(model, method="kfac", kl_clip=None, factor_decay=0.5)
    x = torch.randn(T, d, dtype=F64)
    index, weights = routing(T, E, 2, seed=9)
    model(x, index, weights).sum().backward()
    precond.step()
    before = {name: (layer.a_factor.clone(), layer.g_factor.clone()) for name, layer in precond.layers.items()}
    model.zero_grad()
    index, weights = routing(T, E, 1, seed=10, empty=1)  # expert 1: no row at all this step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x, index, weights).sum().backward()
        precond.step()
    for name, layer in precond.layers.items():
        changed = not torch.equal(layer.a_factor, before[name][0])
        assert changed == (not name.endswith(".1")), name
        assert torch.isfinite(layer.a_factor).all() and torch.isfinite(layer.g_factor).all()
    assert torch.isfinite(model.up_weight.grad).all()


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
def test_expert_left_without_tokens_is_reported_as_such(method):
    torch.manual_seed(14)
    model = RoutedExperts(3, 4, 5, dtype=F64)
    precond = KronPreconditioner(model, method=method, kl_clip=None, inv_update_steps=1)
    x = torch.randn(20, 4, dtype=F64)
    index, weights = routing(20, 3, 2, seed=15)
    model(x, index, weights).sum().backward()
    precond.step()
    index, weights = routing(20, 3, 1, seed=16, empty=2)
    no_rows = r"'(up|down)_weight.2' received no rows \(the router sent this expert no token\)"
    with pytest.warns(RuntimeWarning, match=no_rows):
        for _ in range(3):
            model.zero_grad()
            model(x, index, weights).sum().backward()
            precond.step()


# ---------------------------------------------------------------------- a registered adapter
class GroupedExperts(nn.Module):
    """torchtitan-like: rows arrive grouped by expert with their counts; SwiGLU experts with
    separate gate (w1) and up (w3) weights stored [E, in, out]; no routing weight inside."""

    def __init__(self, E, d, hidden):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, d, hidden, dtype=F64) / d ** 0.5)
        self.w3 = nn.Parameter(torch.randn(E, d, hidden, dtype=F64) / d ** 0.5)
        self.w2 = nn.Parameter(torch.randn(E, hidden, d, dtype=F64) / hidden ** 0.5)

    def forward(self, x, counts):
        outs = []
        for e, xe in enumerate(x.split(counts.tolist())):
            outs.append((F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e])
        return torch.cat(outs)


class GroupedExpertsAdapter(RoutedExpertsAdapter):
    def __init__(self, module):
        super().__init__(module, num_experts=module.w1.shape[0],
                         inputs=[ExpertWeight("w1", transposed=True), ExpertWeight("w3", transposed=True)],
                         output=ExpertWeight("w2", transposed=True))

    def routing(self, inputs, kwargs, output):
        x, counts = inputs
        return Routing(rows=x.detach(), counts=counts.tolist(), targets=torch.arange(x.shape[0]),
                       weights=None, scale=float(x.shape[0]))

    def combine(self, outputs):
        return F.silu(outputs[0]) * outputs[1]


def test_registered_adapter_for_another_experts_module(monkeypatch):
    monkeypatch.setattr(adapter_registry, "_ADAPTERS", list(adapter_registry._ADAPTERS))
    torch.manual_seed(11)
    E, d, hidden = 3, 4, 5
    model = GroupedExperts(E, d, hidden)
    with pytest.raises(ValueError, match="no module"):
        KronPreconditioner(model, method="kfac")
    register_adapter(GroupedExperts, GroupedExpertsAdapter)
    precond = KronPreconditioner(model, method="kfac", damping=DAMPING, kl_clip=None, inv_dtype=F64)
    assert sorted(precond.layers) == sorted(f"{w}.{e}" for w in ("w1", "w3", "w2") for e in range(E))
    counts = torch.tensor([7, 0, 5])
    x = torch.randn(int(counts.sum()), d, dtype=F64)
    model(x, counts).pow(2).mean().backward()
    raw = [model.w1.grad.clone(), model.w3.grad.clone(), model.w2.grad.clone()]
    with pytest.warns(RuntimeWarning, match=r"\['w1.1', 'w3.1', 'w2.1'\] are registered but"):
        precond.step()
    # the dense reference: one token per row, k = 1 with weight 1, in the grouped order
    index = torch.repeat_interleave(torch.arange(E), counts).unsqueeze(1)
    ones = torch.ones(x.shape[0], 1, dtype=F64)
    ref = dense_reference(x, index, ones, [(model.w1.transpose(1, 2), None), (model.w3.transpose(1, 2), None)],
                          (model.w2.transpose(1, 2), None), lambda zs: F.silu(zs[0]) * zs[1])
    for e in (0, 2):
        rec = ref[e]
        for j, (name, param) in enumerate((("w1", model.w1), ("w3", model.w3), ("w2", model.w2))):
            a, g = (rec[f"a{j}"], rec[f"g{j}"]) if j < 2 else (rec["a_out"], rec["g_out"])
            A, G = covariance(a, False), covariance(g, False)
            layer = precond.layers[f"{name}.{e}"]
            torch.testing.assert_close(layer.a_factor, A, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(layer.g_factor, G, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(raw[j][e].t(), rec["grads"][j], rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(param.grad[e].t(), kfac_solution(G, A, rec["grads"][j]), rtol=1e-8, atol=1e-10)
    assert torch.equal(model.w1.grad[1], torch.zeros(d, hidden, dtype=F64))


class UntransposedAdapter(GroupedExpertsAdapter):
    """GroupedExperts' adapter without ``transposed=True``: its [E, in, out] weights read as
    [E, out, in]."""

    def __init__(self, module):
        RoutedExpertsAdapter.__init__(self, module, num_experts=module.w1.shape[0],
                                      inputs=[ExpertWeight("w1"), ExpertWeight("w3")], output=ExpertWeight("w2"))


def test_an_adapter_whose_weights_do_not_take_the_routed_rows_names_the_module_and_weight(monkeypatch):
    """A user adapter that reads a weight with the wrong side as its input (``transposed``
    left out) fails on the first call with the module, the weight and both widths named, not
    with a bare matmul error."""
    monkeypatch.setattr(adapter_registry, "_ADAPTERS", list(adapter_registry._ADAPTERS))
    register_adapter(GroupedExperts, UntransposedAdapter)
    model = GroupedExperts(2, 4, 5)
    precond = KronPreconditioner(model, method="kfac")
    counts = torch.tensor([3, 2])
    with pytest.raises(ValueError, match=r"GroupedExperts\.w1 .*rows of width 4.*takes inputs of width 5.*transposed"):
        model(torch.randn(5, 4, dtype=F64), counts).pow(2).mean().backward()
    precond.remove()


def test_register_adapter_checks_its_arguments():
    with pytest.raises(TypeError, match="matches"):
        register_adapter(3, GroupedExpertsAdapter)
    with pytest.raises(TypeError, match="factory"):
        register_adapter(GroupedExperts, "not callable")


def test_reference_experts_checks_its_arguments():
    with pytest.raises(ValueError, match="num_experts"):
        RoutedExperts(0, 4, 4)
    with pytest.raises(ValueError, match="hidden"):
        RoutedExperts(2, 4, 2.5)
    with pytest.raises(TypeError, match="activation"):
        RoutedExperts(2, 4, 4, activation="relu")


def test_routing_given_by_keyword_in_any_order():
    torch.manual_seed(12)
    model = RoutedExperts(3, 4, 5, dtype=F64)
    x = torch.randn(10, 4, dtype=F64)
    index, weights = routing(10, 3, 2, seed=13)
    factors = []
    for call in (lambda: model(x, index, weights), lambda: model(x, weights=weights, index=index)):
        precond = KronPreconditioner(model, method="kfac", kl_clip=None)
        model.zero_grad()
        call().sum().backward()
        precond.step()
        factors.append([layer.g_factor.clone() for layer in precond.layers.values()])
        precond.remove()
    for a, b in zip(*factors):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_experts_called_with_unexpected_arguments_fail_loudly():
    model = RoutedExperts(2, 4, 3)
    precond = KronPreconditioner(model, method="kfac")
    x = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match="does not understand"):
        model(x, torch.rand(5, 2), torch.rand(5, 2))  # float indices
    precond.remove()


class ScaledExperts(RoutedExperts):
    """Experts whose forward also reads a parameter of their own outside the expert layout."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.out_scale = nn.Parameter(torch.ones(self.dim))

    def forward(self, x, index, weights):
        return super().forward(x, index, weights) * self.out_scale


def test_experts_with_a_parameter_outside_the_layout_are_skipped_or_refused_by_name(caplog):
    """A parameter the expert layout does not know enters the output in a way the adapter cannot
    describe: the model-wide searches skip the module with the reason logged (its gradients
    pass through; ``WhitenedMuon(model)`` steps its parameters with AdamW), and the list form
    refuses it naming the module, as for any module no adapter describes."""
    from kron_precond import WhitenedMuon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ScaledExperts(4, 8, 6))
    with caplog.at_level("INFO", logger="kron_precond"):
        precond = KronPreconditioner(model, method="kfac")
    assert [layer.name for layer in precond._layers] == ["0"]
    assert any("skipping 1" in r.getMessage() and "out_scale" in r.getMessage() for r in caplog.records)
    opt = WhitenedMuon(model, lr=0.02)
    adamw = {id(p) for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]}
    assert {id(p) for p in model[1].parameters()} <= adamw
    with pytest.raises(ValueError, match=r"modules\[0\] \(ScaledExperts\).*out_scale"):
        WhitenedMuon([model[1]], lr=0.02)
