"""Modules taught with ``register_adapter`` whose parameters are not the plain ``weight`` and
``bias`` pair of an ``nn.Linear``.

A bias held as a buffer (a fixed shift) is not a parameter the unit steps: the unit has no bias
column, as an ``nn.Linear(bias=False)`` plus a constant, which is the reference here (a twin
model built the other way). A bias whose size is not the weight's output size under the
adapter's layout (a per-head ``[H, oh, in]`` weight with an ``[H, oh]`` bias) cannot be a
column of the gradient matrix: the module is refused at construction, naming it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner, WhitenedMuon, register_adapter
from kron_precond import modules as adapter_registry
from kron_precond.modules import KFACAdapter

DT = torch.float64
CAPTURING = ("kfac", "ekfac", "ikfac", "soap", "second_moment")


@pytest.fixture
def restore_adapters(monkeypatch):
    monkeypatch.setattr(adapter_registry, "_ADAPTERS", list(adapter_registry._ADAPTERS))


class BufferBiasLinear(nn.Module):
    """``x @ W.T + b`` with ``b`` a buffer: a fixed shift, not trained."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in, dtype=DT) / d_in ** 0.5)
        self.register_buffer("bias", torch.full((d_out,), 0.3, dtype=DT))

    def forward(self, x):
        return x @ self.weight.T + self.bias


class ShiftedLinear(nn.Module):
    """The twin: a bias-free ``nn.Linear`` and the same constant shift."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out, bias=False, dtype=DT)

    def forward(self, x):
        return self.lin(x) + 0.3


class Net(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.a, self.b = make(5, 7), make(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def twins():
    torch.manual_seed(0)
    user, twin = Net(BufferBiasLinear), Net(ShiftedLinear)
    with torch.no_grad():
        twin.a.lin.weight.copy_(user.a.weight)
        twin.b.lin.weight.copy_(user.b.weight)
    return user, twin


def weights(model):
    return [model.a.weight, model.b.weight] if isinstance(model.a, BufferBiasLinear) else \
        [model.a.lin.weight, model.b.lin.weight]


def batches():
    torch.manual_seed(1)
    return [(torch.randn(8, 5, dtype=DT), torch.randn(8, 3, dtype=DT)) for _ in range(4)]


@pytest.mark.parametrize("method", CAPTURING)
def test_a_buffer_bias_is_no_bias_column(restore_adapters, method):
    register_adapter(BufferBiasLinear, KFACAdapter)
    user, twin = twins()
    for model in (user, twin):
        precond = KronPreconditioner(model, method=method, kl_clip=None) if method in ("kfac", "ekfac") \
            else KronPreconditioner(model, method=method)
        assert len(precond.layers) == 2
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for x, y in batches():
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            precond.step()
            opt.step()
    for mine, reference in zip(weights(user), weights(twin)):
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-12)


def test_a_buffer_bias_is_no_bias_column_for_whitened_muon(restore_adapters):
    """``WhitenedMuon``'s default centring treats the layer as one without a trained bias."""
    register_adapter(BufferBiasLinear, KFACAdapter)
    user, twin = twins()
    for model in (user, twin):
        opt = WhitenedMuon(model, lr=0.02, statistics_every=1, ns_dtype=DT)
        for x, y in batches():
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    for mine, reference in zip(weights(user), weights(twin)):
        torch.testing.assert_close(mine, reference, rtol=0, atol=1e-12)


class PerHeadLinear(nn.Module):
    """A per-head projection: weight ``[H, oh, in]``, bias ``[H, oh]``. The plain adapter reads the
    weight as ``[H, oh·in]``, whose output size is H, not the bias's H·oh."""

    def __init__(self, d_in=6, heads=2, head_dim=5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(heads, head_dim, d_in, dtype=DT) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(heads, head_dim, dtype=DT))

    def forward(self, x):
        return torch.einsum("bti,hoi->btho", x, self.weight) + self.bias


@pytest.mark.parametrize("method", CAPTURING)
def test_a_bias_that_is_not_the_output_size_is_refused_at_construction(restore_adapters, method):
    register_adapter(PerHeadLinear, KFACAdapter)
    model = nn.Sequential(PerHeadLinear(), nn.Flatten(2), nn.Linear(10, 3, dtype=DT))
    with pytest.raises(ValueError, match=r"'0'.*bias"):
        KronPreconditioner(model, method=method)


def test_a_bias_that_is_not_the_output_size_is_refused_by_whitened_muon(restore_adapters):
    register_adapter(PerHeadLinear, KFACAdapter)
    model = nn.Sequential(PerHeadLinear(), nn.Flatten(2), nn.Linear(10, 3, dtype=DT))
    with pytest.raises(ValueError, match=r"'0'.*bias"):
        WhitenedMuon(model, lr=0.02)
    with pytest.raises(ValueError, match="bias"):
        WhitenedMuon([model[0]], lr=0.02)
