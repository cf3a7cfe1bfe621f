"""An expert the router sends no token is a layer that was not called.

In a fused experts module the engine preconditions one layer per expert, whose gradient is
a view of the stacked parameter's ``.grad``; an expert that received no token gets an
all-zero slice there, where the same expert as an ``nn.Linear`` of its own is not called
and has no gradient. The stateful methods must treat the two alike (kron_precond/apply.py:
"a stateful method (moments, update counts) must not fold zeros in"): the idle expert's
gradient passes through (zeros) and its moment, update count, SOAP's statistics, count and
bases are left as they are. Checked against a twin of separate Linear experts with the same
weights and routing, whose K-FAC gradient scale is the fused call's tokens ``T`` (as the
fused experts' is), so K-FAC and EK-FAC -- exact already, their statistics come from hooks
that see no rows -- are controls.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from kron_precond import KronPreconditioner, RoutedExperts, register_adapter
from kron_precond import modules as adapter_registry
from kron_precond.modules import KFACAdapter
from state_compare import assert_same

F64 = torch.float64
E, D, HIDDEN, T = 3, 4, 6, 40
STEPS = 6
# step -> the expert the router sends no token: expert 1 on the first step and on step 4 (after a
# gradient on step 3), expert 2 on step 3
IDLE = {0: 1, 3: 2, 4: 1}
METHODS = {
    "second_moment": dict(moment_decay=0.95),
    "soap": dict(moment_decay=0.95, factor_update_steps=1, inv_update_steps=1),
    # bases refreshed on even steps: an expert idle on a refresh step after a gradient on the step
    # before is refreshed (as a Linear used since its last refresh), one idle on every step since
    # its last refresh is not; one idle on the first refresh keeps its identity bases until the next
    "soap_refresh_2": dict(moment_decay=0.95, factor_update_steps=1, inv_update_steps=2),
    "ikfac": dict(moment_decay=0.95, factor_update_steps=1, inv_update_steps=1, inv_dtype=F64),
    "kfac": dict(damping=1e-2, factor_update_steps=1, inv_update_steps=1, inv_dtype=F64),
    "ekfac": dict(damping=1e-2, factor_update_steps=1, inv_update_steps=1, inv_dtype=F64),
}


class TwinLinear(nn.Linear):
    """An expert's Linear whose K-FAC gradient scale is the tokens of the fused call."""

    tokens: int | None = None


class TwinAdapter(KFACAdapter):
    def gradient_scale(self, output):
        tokens = self.module.tokens
        return super().gradient_scale(output) if tokens is None else tokens


class Twin(nn.Module):
    """``fused``'s experts as separate Linear pairs, called on their routed rows only (an
    expert without a token is not called: its parameters get no gradient)."""

    def __init__(self, fused: RoutedExperts) -> None:
        super().__init__()
        bias = fused.up_bias is not None
        self.up = nn.ModuleList(TwinLinear(D, HIDDEN, bias=bias, dtype=F64) for _ in range(E))
        self.down = nn.ModuleList(TwinLinear(HIDDEN, D, bias=bias, dtype=F64) for _ in range(E))
        self.activation = fused.activation
        with torch.no_grad():
            for e in range(E):
                self.up[e].weight.copy_(fused.up_weight[e])
                self.down[e].weight.copy_(fused.down_weight[e])
                if bias:
                    self.up[e].bias.copy_(fused.up_bias[e])
                    self.down[e].bias.copy_(fused.down_bias[e])

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(E):
            token, choice = torch.where(index == e)
            if token.numel() == 0:
                continue
            self.up[e].tokens = self.down[e].tokens = x.shape[0]
            y = self.down[e](self.activation(self.up[e](x[token]))) * weights[token, choice].unsqueeze(1)
            out = out.index_add(0, token, y)
        return out


def routing(step: int, gen: torch.Generator):
    scores = torch.rand(T, E, generator=gen)
    if step in IDLE:
        scores[:, IDLE[step]] = -1.0
    index = scores.topk(1, dim=1).indices
    weights = torch.rand(T, 1, generator=gen, dtype=F64) + 0.1
    return index, weights


def pairs(fused: RoutedExperts, twin: Twin):
    """``(fused parameter row, twin parameter)`` for every parameter of every expert."""
    names = [("up_weight", "up", "weight"), ("down_weight", "down", "weight")]
    if fused.up_bias is not None:
        names += [("up_bias", "up", "bias"), ("down_bias", "down", "bias")]
    return [(getattr(fused, f), e, getattr(getattr(twin, side)[e], attr))
            for f, side, attr in names for e in range(E)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()



@pytest.fixture
def twin_adapter(monkeypatch):
    monkeypatch.setattr(adapter_registry, "_ADAPTERS", list(adapter_registry._ADAPTERS))
    register_adapter(TwinLinear, TwinAdapter)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_idle_expert_steps_as_a_separate_linear_not_called(twin_adapter, method, bias):
    """Expert 1 idle on the first step, expert 2 on a later one: every preconditioned
    gradient, parameter and piece of method state equals the twin's (whose idle expert has no
    gradient), and nothing is reported as a non-finite update."""
    torch.manual_seed(0)
    fused = RoutedExperts(E, D, HIDDEN, bias=bias, activation=torch.tanh, dtype=F64)
    twin = Twin(fused)
    kw = dict(method=method.removesuffix("_refresh_2"), kl_clip=None, **METHODS[method])
    p_fused, p_twin = KronPreconditioner(fused, **kw), KronPreconditioner(twin, **kw)
    o_fused = torch.optim.SGD(fused.parameters(), lr=0.05)
    o_twin = torch.optim.SGD(twin.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            x, target = torch.randn(T, D, generator=gen, dtype=F64), torch.randn(T, D, generator=gen, dtype=F64)
            index, weights = routing(step, gen)
            for model, precond, optimizer in ((fused, p_fused, o_fused), (twin, p_twin, o_twin)):
                optimizer.zero_grad()
                (model(x, index, weights) - target).pow(2).mean().backward()
                precond.step()
            for stacked, e, param in pairs(fused, twin):
                if param.grad is None:  # not called: the fused row passes through as zeros
                    assert e == IDLE.get(step), (step, e)
                    assert torch.equal(stacked.grad[e], torch.zeros_like(param)), (step, e)
                else:
                    err = rel(stacked.grad[e], param.grad)
                    assert err <= 1e-10, f"step {step}, expert {e}: preconditioned gradient off by {err:.3e}"
            o_fused.step()
            o_twin.step()
            for stacked, e, param in pairs(fused, twin):
                err = rel(stacked.detach()[e], param.detach())
                assert err <= 1e-10, f"step {step}, expert {e}: parameter off by {err:.3e}"
    for e in range(E):
        for weight, side in (("up_weight", "up"), ("down_weight", "down")):
            f_layer, t_layer = p_fused.layers[f"{weight}.{e}"], p_twin.layers[f"{side}.{e}"]
            assert_same(f_layer.method.state_dict(), t_layer.method.state_dict(), f"{weight}.{e}", tolerance=1e-10)
            assert f_layer.method.nonfinite.item() == 0, f"{weight}.{e}"
    nonfinite = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                 and ("non-finite" in str(w.message) or "not finite" in str(w.message))]
    assert not nonfinite, nonfinite


@pytest.mark.parametrize("method", ["second_moment", "soap", "ikfac"])
def test_a_linear_with_a_zero_gradient_still_folds_it(method):
    """Only an expert's zero slice means "not called": a Linear of its own with an all-zero
    gradient has been called, and its moment update is counted as before."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2, dtype=F64)
    precond = KronPreconditioner(model, method=method, kl_clip=None,
                                 **{k: v for k, v in METHODS[method].items() if k != "inv_dtype"})
    model(torch.randn(5, 3, dtype=F64)).sum().backward()
    model.weight.grad.zero_()
    model.bias.grad.zero_()
    precond.step()
    layer = next(iter(precond.layers.values()))
    assert int(layer.method.updates) == 1
    if method == "soap":
        assert layer.method.state_dict()["mass"].item() == 1.0


@pytest.mark.parametrize("method", ["second_moment", "ikfac_moment"])
def test_plain_step_op_count_does_not_grow_with_experts(method):
    """The idle experts are found on the device, batched: a plain step of 8 experts dispatches
    as many ops as one of 2 (not counting ``select``: each expert's gradient is a view of its
    row, taken per layer, which launches no kernel)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from benchmarks.op_count import ops_of_last_step
    finally:
        sys.path.pop(0)

    def count(experts: int) -> int:
        torch.manual_seed(0)
        model = RoutedExperts(experts, D, HIDDEN, dtype=F64)
        if method == "ikfac_moment":
            precond = KronPreconditioner(model, method="ikfac", kl_clip=None, factor_update_steps=100,
                                         inv_update_steps=100, moment_decay=0.95)
        else:
            precond = KronPreconditioner(model, method=method, kl_clip=None)
        def backward(step: int) -> None:
            x = torch.randn(T, D, dtype=F64)
            index = torch.randint(0, experts, (T, 1))
            index[index == 1] = 0  # expert 1 stays idle
            model.zero_grad()
            model(x, index, torch.ones(T, 1, dtype=F64)).pow(2).mean().backward()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # step 3: neither statistics nor a refresh (ikfac warms up on 1 and 2)
            ops = ops_of_last_step(precond, backward, 4)
        precond.remove()
        return sum(n for op, n in ops.items() if op != "select")

    assert count(8) == count(2)


@pytest.mark.parametrize("method", ["second_moment", "soap", "ikfac"])
def test_steps_with_an_idle_expert_make_no_host_sync(monkeypatch, method):
    """Finding an idle expert reads nothing back from the device in ``step()`` (statistics on
    every step, no refresh in the steps checked; the experts' forward hooks split the rows by
    expert with a host read of their own on statistics steps, outside ``step()``)."""
    torch.manual_seed(0)
    model = RoutedExperts(E, D, HIDDEN, dtype=F64)
    options = dict(moment_decay=0.95) if method == "second_moment" else \
        dict(moment_decay=0.95, factor_update_steps=1, inv_update_steps=50)
    precond = KronPreconditioner(model, method=method, kl_clip=None, **options)

    def train(steps, forbidden=()):
        for _ in range(steps):
            x = torch.randn(T, D, dtype=F64)
            index = torch.randint(0, E, (T, 1))
            index[index == 1] = 0  # expert 1 stays idle
            model.zero_grad()
            model(x, index, torch.ones(T, 1, dtype=F64)).pow(2).mean().backward()
            with monkeypatch.context() as m:
                for name in forbidden:
                    m.setattr(torch.Tensor, name, forbid(name))
                precond.step()

    def forbid(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):  # Health's read of the CPU "finite" flags is allowed
            if sys._getframe(1).f_code.co_name == "record_gradients" and self.device.type == "cpu":
                return original(self, *args, **kwargs)
            raise AssertionError(f"host sync ({name}) in the {method} step")
        return read

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(33)  # past the first refresh (and ikfac's warm-up refreshes on 1, 2, 4, ..., 32)
    train(4, ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"))
    assert torch.equal(model.down_weight.grad[1], torch.zeros(D, HIDDEN, dtype=F64))
    assert int(precond.layers["down_weight.1"].method.updates) == 0
