"""A run whose weights grow by orders of magnitude is reported, for every optimizer.

The update-growth check (tests/test_update_growth_warning.py) cannot see a method whose update
is normalised (PSGD, SOAP, ``second_moment``, ``WhitenedMuon``, ``Kron``): its update norm stays
level while the weights climb and the loss rises by orders of magnitude. So the weights' own
norms are checked every ``WEIGHT_CHECK_EVERY`` steps against the larger of their first checked
norm and the norm of torch's default initialisation for their shape. A run at 100x a working lr
is reported; the same runs at the working lr, from a 0.05x initialisation, or on a separable
task whose cross-entropy pushes the weights up indefinitely, are not. The reference for the
divergence is the loss itself, measured here beside the warning.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import Kron, KronPreconditioner, PreconditionedOptimizer, WhitenedMuon

STEPS = 201  # two checks after the first


def model(init=1.0):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(init)
    return net


def batches(task):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(4, 16, generator=g) / 4
    xs = [torch.randn(64, 16, generator=g) for _ in range(40)]
    if task == "sep":
        return [(x, (x @ w.T).argmax(1)) for x in xs]
    return [(x, torch.sin(x @ w.T) + 0.1 * torch.randn(64, 4, generator=g)) for x in xs]


OPTIMIZERS = {
    "psgd": lambda net, scale: PreconditionedOptimizer(
        torch.optim.SGD(net.parameters(), lr=1e-2 * scale, momentum=0.9), KronPreconditioner(net, method="psgd")),
    "soap": lambda net, scale: PreconditionedOptimizer(
        torch.optim.SGD(net.parameters(), lr=3e-2 * scale, momentum=0.9), KronPreconditioner(net, method="soap")),
    "second_moment": lambda net, scale: PreconditionedOptimizer(
        torch.optim.SGD(net.parameters(), lr=3e-2 * scale, momentum=0.9),
        KronPreconditioner(net, method="second_moment")),
    "whitened_muon": lambda net, scale: WhitenedMuon(net, lr=2e-2 * scale),
    "kron": lambda net, scale: Kron(net.parameters(), lr=3e-3 * scale),
}


def train(name, scale=1.0, init=1.0, task="reg"):
    net = model(init)
    opt = OPTIMIZERS[name](net, scale)
    losses, said = [], []
    for t in range(STEPS):
        x, y = batches(task)[t % 40]
        opt.zero_grad()
        out = net(x)
        loss = F.mse_loss(out, y) if task == "reg" else F.cross_entropy(out, y)
        losses.append(float(loss))
        loss.backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        said += [str(w.message) for w in caught if "grew to" in str(w.message)]
    return losses, said


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_diverging_run_is_reported(name):
    losses, said = train(name, scale=100.0)
    assert max(losses) > 10 * losses[0]  # it diverges: the loss says so
    assert said and "diverging" in said[0], said


@pytest.mark.parametrize("case", [dict(), dict(init=0.05), dict(task="sep")],
                         ids=["healthy", "small-init", "separable"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_healthy_run_is_not_reported(name, case):
    losses, said = train(name, **case)
    assert losses[-1] < losses[0]
    assert not said, said


@pytest.mark.parametrize("shape", [(64, 32), (4, 16, 32), (1, 64, 32)], ids=["linear", "experts", "positions"])
def test_a_weight_started_at_zero_is_measured_from_torchs_default_scale(shape):
    """A zero-initialised weight (LoRA's B, a fused experts weight, a learned position table)
    that trains to the scale torch's default initialisation gives a Linear of its rows is no
    divergence; 100x beyond that scale is. The reference scale is written out here: entries of
    variance 1 / (3 · in), in = the last dimension (kaiming_uniform_(a=√5))."""
    from kron_precond.health import WEIGHT_GROWTH_WARNING, WeightGrowth

    weight = torch.zeros(shape)
    growth = WeightGrowth("test")
    growth.check([("w", weight)])  # the first check: its reference
    scale = (1 / (3 * shape[-1])) ** 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weight.normal_(0, 30 * scale)  # trained to 30x the default entries: healthy, if large
        growth.check([("w", weight)])
    weight.mul_(1.2 * WEIGHT_GROWTH_WARNING / 30)
    with pytest.warns(RuntimeWarning, match="grew to"):
        growth.check([("w", weight)])
