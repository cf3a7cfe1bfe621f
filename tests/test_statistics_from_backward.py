"""The input factors count the rows of the calls a backward reached, once each.

A module's rows feed a weight's gradient only through a call whose output a backward reaches.
So, on a statistics step, a forward in training mode with gradients enabled that no backward
follows (a metric on another batch, a head whose loss is not taken this step) leaves the
factors alone, and a call that activation checkpointing runs again in the backward counts
once, as the call it repeats.

Reference: the float64 covariance of the rows that entered the training backward, recorded
by hooks of the test's own on a twin model; never the library's state. WhitenedMuon's input
factor, K-FAC's and input-side K-FAC's A (with the bias's ones column) are checked.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kron_precond import KronPreconditioner, WhitenedMuon

F64 = torch.float64
KINDS = ("whitened_muon", "kfac", "ikfac")


def covariance(rows: list[torch.Tensor], bias: bool) -> torch.Tensor:
    r = torch.cat([x.reshape(-1, x.shape[-1]) for x in rows]).to(F64)
    if bias:
        r = torch.cat([r, torch.ones(r.shape[0], 1, dtype=F64)], 1)
    return r.T @ r / r.shape[0]


class Rows:
    """The inputs of ``module`` on the calls made while ``on``."""

    def __init__(self, module: nn.Module) -> None:
        self.on, self.rows = False, []
        module.register_forward_hook(lambda m, args, out: self.rows.append(args[0].detach().clone()) if self.on
                                     else None)


class Trainer:
    """One optimizer of ``kind`` over ``model``, statistics on step 0 and every ``every`` steps."""

    def __init__(self, kind: str, model: nn.Module, every: int = 1) -> None:
        self.kind, self.model = kind, model
        if kind == "whitened_muon":
            self.opt = WhitenedMuon(model, lr=1e-2, statistics_rows=None, statistics_every=every)
            self.precond = None
        else:
            self.precond = KronPreconditioner(model, method=kind, lr=0.1, factor_update_steps=every,
                                              inv_update_steps=every)
            self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unused head, a first step
            if self.precond is not None:
                self.precond.step()
            self.opt.step()

    def factor(self, module: nn.Linear) -> torch.Tensor:
        if self.kind == "whitened_muon":
            f = self.opt.state[module.weight]["input_factor"]
            return f.reshape(-1, *f.shape[-2:])[0]
        layer = next(layer for layer in self.precond.layers.values() if layer.module is module)
        return layer.method.a_factor

    def check(self, module: nn.Linear, rows: list[torch.Tensor]) -> None:
        want = covariance(rows, bias=self.kind != "whitened_muon" and module.bias is not None)
        torch.testing.assert_close(self.factor(module).to(F64), want, rtol=1e-10, atol=1e-12)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(F64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("when", ["before backward", "after backward"])
def test_a_forward_no_backward_reaches_stays_out(kind, when):
    model = mlp()
    seen = Rows(model[0])
    trainer = Trainer(kind, model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g, dtype=F64), torch.randn(32, 4, generator=g, dtype=F64)
    other = 3 + 2 * torch.randn(32, 8, generator=g, dtype=F64)  # a metric's batch, in training mode
    trainer.opt.zero_grad()
    seen.on = True
    loss = F.mse_loss(model(x), y)
    seen.on = False
    if when == "before backward":
        model(other).sum()
    loss.backward()
    if when == "after backward":
        model(other).sum()
    trainer.step()
    trainer.check(model[0], seen.rows)


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_without_gradient_on_a_statistics_step_keeps_none_of_its_rows(kind):
    """Both heads run forward every step; head ``b``'s loss is taken on step 5 only. Its
    factor is made of step 5's rows alone (statistics on steps 0 and 5)."""

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.trunk, self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

        def forward(self, x):
            h = torch.tanh(self.trunk(x))
            return self.a(h), self.b(h)

    model = Heads().to(F64)
    seen = Rows(model.b)
    trainer = Trainer(kind, model, every=5)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        x, y = torch.randn(32, 8, generator=g, dtype=F64) * (1 + step), torch.randn(32, 4, generator=g, dtype=F64)
        trainer.opt.zero_grad(set_to_none=True)
        seen.on = step == 5
        out_a, out_b = model(x)
        seen.on = False
        F.mse_loss(out_b if step == 5 else out_a, y).backward()
        trainer.step()
    trainer.check(model.b, seen.rows)


class Shared(nn.Module):
    """``shared`` called inside a checkpointed region ``calls`` times, and outside it when
    ``outside``. Without ``tail`` the region's last op is a call of ``shared``, inside which
    torch's early stop ends the recompute; with it, the recompute calls ``shared`` again."""

    def __init__(self, calls: int, outside: bool, tail: bool, reentrant: bool | None):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.shared, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.calls, self.outside, self.tail, self.reentrant = calls, outside, tail, reentrant

    def region(self, h):
        for _ in range(self.calls):
            h = self.shared(torch.tanh(h))
        return torch.tanh(h) if self.tail else h

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        a = torch.tanh(self.shared(h)) if self.outside else 0.0
        b = (self.region(2.0 + 3.0 * h) if self.reentrant is None
             else checkpoint(self.region, 2.0 + 3.0 * h, use_reentrant=self.reentrant))
        return self.out(a + b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("calls,outside,tail", [(1, True, True), (2, False, False)])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_recomputed_call_counts_once(kind, calls, outside, tail, reentrant):
    reference = Shared(calls, outside, tail, reentrant=None).to(F64)
    seen = Rows(reference.shared)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g, dtype=F64), torch.randn(32, 4, generator=g, dtype=F64)
    seen.on = True
    reference(x)
    model = Shared(calls, outside, tail, reentrant).to(F64)
    trainer = Trainer(kind, model)
    trainer.opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    trainer.step()
    trainer.check(model.shared, seen.rows)


def test_an_input_buffer_refilled_in_place_is_read_again_by_each_micro_batch():
    """Micro-batches staged through one buffer refilled without a version bump (``.data``
    writes, numpy writes into ``torch.from_numpy``): each micro-batch's rows count, not the
    first one's again (the product shared by layers reading one input is one forward's)."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, statistics_rows=None, statistics_every=1)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(16, 8, generator=g, dtype=F64) * (1 + i) for i in range(3)]
    buffer = torch.empty(16, 8, dtype=F64)
    opt.zero_grad()
    for batch in batches:
        buffer.data.copy_(batch)
        model(buffer).square().mean().backward()
    opt.step()
    f = opt.state[model[0].weight]["input_factor"]
    torch.testing.assert_close(f.reshape(8, 8), covariance(batches, bias=False), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method,side", [("kfac", "activations"), ("ekfac", "activations"), ("ikfac", "activations"),
                                         ("kfac", "output gradients"), ("ekfac", "output gradients")])
def test_rows_of_another_width_are_refused_naming_the_layer(method, side):
    """A user's adapter that hands rows narrower than the weight reads: an error naming the
    layer, not a factor with a block of garbage (``WhitenedMuon`` checks the same)."""
    from kron_precond import register_adapter
    from kron_precond.modules import _ADAPTERS, KFACAdapter

    class Odd(nn.Linear):
        pass

    class Adapter(KFACAdapter):
        def activation_rows(self, x):
            rows = x.reshape(-1, x.shape[-1])
            return rows[:, :-2] if side == "activations" else rows

        def output_grad_rows(self, g):
            rows = g.reshape(-1, g.shape[-1])
            return rows[:, :-1] if side == "output gradients" else rows

    register_adapter(Odd, Adapter)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(Odd(8, 6), nn.Tanh(), nn.Linear(6, 3))
        precond = KronPreconditioner(model, method=method, lr=0.1, factor_update_steps=1, inv_update_steps=1)
        with pytest.raises(ValueError, match=r"\b0\b.*width"):
            model(torch.randn(5, 8)).square().mean().backward()
            precond.step()
    finally:
        del _ADAPTERS[0]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_module_returning_a_tuple_is_waited_on_through_its_first_tensor(checkpointed):
    """``nn.MultiheadAttention`` returns ``(output, weights)``: its packed projection's rows count
    once a backward reaches the output, as a Linear's do (a metric forward adds nothing; a
    non-reentrant checkpoint's rerun adds nothing more)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).to(F64)
    opt = WhitenedMuon(layer, lr=1e-2, statistics_rows=None)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=F64)
    opt.zero_grad()
    layer(3 + torch.randn(2, 5, 8, generator=g, dtype=F64)).sum()  # a metric's forward, no backward
    out = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
    out.square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    f = opt.state[layer.self_attn.in_proj_weight]["input_factor"]
    torch.testing.assert_close(f.reshape(-1, 8, 8)[0], covariance([x], bias=False), rtol=1e-10, atol=1e-12)


def test_what_a_method_reading_no_output_gradient_keeps_until_the_backward(monkeypatch):
    """Waiting for the backward keeps the call's terms, not the adapter's context (routed
    experts: the routed rows and every expert's first-stage output), which only a method that
    reads output gradients needs then."""
    import gc
    import weakref

    from kron_precond.experts import RoutedExperts, RoutedExpertsModuleAdapter

    refs = []
    original = RoutedExpertsModuleAdapter.forward_rows

    def spy(self, inputs, kwargs, output):
        result = original(self, inputs, kwargs, output)
        if result is not None:
            routing, first = result[1]
            refs.extend(weakref.ref(t) for z in first if z is not None for t in z)
            refs.append(weakref.ref(routing.rows))
        return result

    monkeypatch.setattr(RoutedExpertsModuleAdapter, "forward_rows", spy)
    torch.manual_seed(0)
    experts = RoutedExperts(4, 16, 64)
    precond = KronPreconditioner(experts, method="ikfac")
    x, index, weights = torch.randn(256, 16), torch.randint(0, 4, (256, 2)), torch.rand(256, 2)
    out = experts(x, index, weights)
    gc.collect()
    assert refs and not [r for r in refs if r() is not None]
    out.sum().backward()
    precond.step()
    assert all(bool(layer.method.a_factor.abs().sum() > 0) for layer in precond.layers.values())  # rows counted


def test_rows_a_backward_took_past_the_weight_do_not_wait_for_a_later_refresh():
    """``torch.autograd.grad`` with respect to the inputs (an adversarial attack's step) reaches
    the layers' outputs but leaves the weights without a gradient: the optimizer's next refresh
    is made of its own step's rows alone."""
    model = mlp()
    opt = WhitenedMuon(model, lr=1e-2, statistics_rows=None, statistics_every=1)
    g = torch.Generator().manual_seed(0)
    attack = torch.randn(16, 8, generator=g, dtype=F64, requires_grad=True)
    torch.autograd.grad(model(attack).square().sum(), attack)
    opt.step()  # no gradient: nothing steps
    x = torch.randn(16, 8, generator=g, dtype=F64)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    f = opt.state[model[0].weight]["input_factor"]
    torch.testing.assert_close(f.reshape(8, 8), covariance([x], bias=False), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("order", ["self, cross", "cross, self"])
@pytest.mark.parametrize("backwards", ["one for both calls", "one per call"])
@pytest.mark.parametrize("centred", [False, True])
def test_self_and_cross_attention_calls_of_one_step_count_for_each_part_they_feed(order, backwards, centred):
    """A packed ``nn.MultiheadAttention`` called as self-attention and as cross-attention on one
    statistics step (its first cross-attention call switches it to a factor per part): the
    self-attention call's rows count for every part (docs/API.md: they are the query's, the
    key's and the value's alike), the cross-attention call's for the part each argument feeds;
    whether one backward follows both calls or each call has its own (micro-batches), in
    either order."""
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).to(F64)
    opt = WhitenedMuon(attn, lr=1e-2, statistics_rows=None, statistics_every=1, center_inputs=centred)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=F64)
    key, value = 2 + torch.randn(2, 3, 8, generator=g, dtype=F64), torch.randn(2, 3, 8, generator=g, dtype=F64) * 3
    calls = [(x, x, x), (x, key, value)] if order == "self, cross" else [(x, key, value), (x, x, x)]
    opt.zero_grad()
    losses = [attn(*arguments)[0].square().mean() for arguments in calls[:1]]
    if backwards == "one per call":
        losses.pop().backward()
    losses += [attn(*arguments)[0].square().mean() for arguments in calls[1:]]
    sum(losses).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    factor = opt.state[attn.in_proj_weight]["input_factor"]
    assert factor.shape == (3, 1, 8, 8)
    for part, name in enumerate(("query", "key", "value")):
        rows = torch.cat([arguments[part].reshape(-1, 8) for arguments in calls])
        want = covariance([rows - rows.mean(0) if centred else rows], bias=False)
        torch.testing.assert_close(factor[part, 0], want, rtol=1e-10, atol=1e-12,
                                   msg=lambda m, name=name: f"the {name} part's factor: {m}")


def test_a_call_staged_per_part_before_a_load_back_to_one_input_does_not_break_the_backward():
    """A cross-attention call's rows wait for the backward per part; a self-attention checkpoint
    loaded before it takes the input side back to one factor (dropping its statistics): the
    backward and the step go on, one factor, the staged rows left out with them."""
    import copy

    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True).to(F64)
    opt = WhitenedMuon(attn, lr=1e-2, statistics_rows=None, statistics_every=1)
    g = torch.Generator().manual_seed(0)
    x, memory = torch.randn(2, 5, 8, generator=g, dtype=F64), torch.randn(2, 3, 8, generator=g, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn(x, x, x)[0].square().mean().backward()
        opt.step()
        saved, first = copy.deepcopy(opt.state_dict()), opt.state[attn.in_proj_weight]["input_factor"].clone()
        for reload in (False, True):
            opt.zero_grad()
            out = attn(x, memory, memory)[0].square().mean()  # per part from the first of these calls
            if reload:
                opt.load_state_dict(saved)
            out.backward()
            opt.step()
    torch.testing.assert_close(opt.state[attn.in_proj_weight]["input_factor"], first, rtol=0, atol=0)  # one input


@pytest.mark.parametrize("kind", ["whitened_muon", "kfac"])
@pytest.mark.parametrize("grad_call", ["inputs", "backward_inputs"])
def test_output_gradients_of_a_pass_that_leaves_the_weights_alone_stay_out(kind, grad_call):
    """A gradient penalty takes the gradient with respect to the input first
    (``torch.autograd.grad(..., x)``, or ``backward(inputs=[x])``): that pass reaches the layer's
    output but writes no weight gradient, so its output gradients are not the loss's and stay
    out of G (they entered it: 0.5-0.9 off). Reference: the dense float64 G of the output
    gradients the training backward brought, ``mean((n g)(n g)ᵀ)``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    if kind == "whitened_muon":
        opt = WhitenedMuon(model, lr=1e-12, statistics_every=1, output_side=True, ns_dtype=F64)
    else:
        opt = KronPreconditioner(model, method="kfac", factor_update_steps=1, inv_update_steps=1, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 5, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(16, 3, generator=g, dtype=F64)
    kept: list[torch.Tensor] = []
    handle = model[0].register_forward_hook(lambda m, a, out: out.retain_grad() or kept.append(out))
    out = model(x)
    if grad_call == "inputs":
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    else:
        out.sum().backward(inputs=[x], create_graph=True)
        gx, x.grad = x.grad, None
    kept[0].grad = None  # only the training backward's output gradient is the reference's
    (((out - y) ** 2).mean() + 0.1 * gx.square().sum()).backward()
    handle.remove()
    rows = kept[0].grad * 16
    want = rows.T @ rows / rows.shape[0]
    opt.step()
    got = (opt.state[model[0].weight]["output_factor"].reshape(8, 8) if kind == "whitened_muon"
           else opt.layers["0"].g_factor)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


class GatedLinear(nn.Module):
    """A Linear whose first registered parameter (a gain) the call uses only when gated."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(o))
        self.weight = nn.Parameter(torch.randn(o, i) / i ** 0.5)
        self.bias = nn.Parameter(torch.zeros(o))
        self.gated = False

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y * self.gain if self.gated else y


@pytest.mark.parametrize("kind", ["whitened_muon", "kfac"])
def test_a_call_that_leaves_a_parameter_of_its_module_unused_still_counts(kind, monkeypatch):
    """Whether a pass writes the call's gradients is asked of every trainable parameter of the
    module: one the call does not use (a gain taken only when gated) writes nothing on any
    pass, and reading it alone left A and G at zero. Reference: dense float64 A and G."""
    from kron_precond import modules as adapter_registry
    from kron_precond.modules import KFACAdapter, register_adapter

    class GatedAdapter(KFACAdapter):  # weight and bias preconditioned, the gain elsewhere
        def units(self, name, params):
            return super().units(name, [(n, p) for n, p in params if n != "gain"])

    monkeypatch.setattr(adapter_registry, "_ADAPTERS", list(adapter_registry._ADAPTERS))
    register_adapter(GatedLinear, GatedAdapter)
    torch.manual_seed(0)
    gated = GatedLinear(5, 8)
    model = nn.Sequential(gated, nn.Tanh(), nn.Linear(8, 3)).double()
    if kind == "whitened_muon":
        opt = WhitenedMuon(model, lr=1e-12, statistics_every=1, output_side=True, ns_dtype=F64)
    else:
        opt = KronPreconditioner(model, method="kfac", factor_update_steps=1, inv_update_steps=1, lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 5, generator=g, dtype=F64), torch.randn(16, 3, generator=g, dtype=F64)
    kept: list[torch.Tensor] = []
    gated.register_forward_hook(lambda m, a, out: out.retain_grad() or kept.append(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gain's own parameter group has no gradient
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    rows = torch.cat([x, torch.ones(16, 1, dtype=F64)], 1) if kind == "kfac" else x
    grads = kept[0].grad * 16
    want_a, want_g = rows.T @ rows / 16, grads.T @ grads / 16
    if kind == "whitened_muon":
        state = opt.state[gated.weight]
        got_a, got_g = state["input_factor"].reshape(want_a.shape), state["output_factor"].reshape(want_g.shape)
    else:
        got_a, got_g = opt.layers["0"].a_factor, opt.layers["0"].g_factor
    torch.testing.assert_close(got_a, want_a, rtol=1e-10, atol=0)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=0)
