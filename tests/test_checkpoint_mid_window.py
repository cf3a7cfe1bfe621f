"""A checkpoint taken inside an accumulation window says that it leaves statistics out.

K-FAC, EK-FAC and ikfac (and ``WhitenedMuon``) gather statistics in the forwards and backwards
before a step; a checkpoint holds factors and counters, not those partial sums, so a run
resumed from one taken mid-window goes on without the micro-batches already run. Saving then
warns once, naming the rule; a checkpoint taken between ``step()`` and the next forward is
silent. Methods that read the gradient at the step (Shampoo) have nothing pending.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner, PreconditionedOptimizer, WhitenedMuon

DT = torch.float64
PENDING = "unfinished accumulation window"


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def micro_batch(net):
    x, y = torch.randn(4, 5, dtype=DT), torch.randn(4, 3, dtype=DT)
    F.mse_loss(net(x), y).backward()


def saved_warnings(save):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save()
    return [str(w.message) for w in caught if PENDING in str(w.message)]


@pytest.mark.parametrize("method, pending", [("kfac", True), ("ekfac", True), ("ikfac", True), ("shampoo", False)])
def test_a_checkpoint_mid_window_warns(method, pending):
    net = model()
    precond = KronPreconditioner(net, method=method, accumulation_steps=2)
    opt = PreconditionedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-2), precond)
    for _ in range(2):
        micro_batch(net)
    opt.step()
    opt.zero_grad()
    assert not saved_warnings(opt.state_dict)  # between step() and the next forward
    micro_batch(net)  # one micro-batch of two
    messages = saved_warnings(opt.state_dict)
    assert len(messages) == int(pending), messages
    assert not saved_warnings(precond.state_dict)  # once per preconditioner
    micro_batch(net)
    opt.step()


def test_a_whitened_muon_checkpoint_mid_window_warns():
    net = model()
    opt = WhitenedMuon(net, lr=1e-2, statistics_every=1)
    micro_batch(net)
    opt.step()
    opt.zero_grad()
    assert not saved_warnings(opt.state_dict)
    micro_batch(net)
    messages = saved_warnings(opt.state_dict)
    assert len(messages) == 1 and "WhitenedMuon" in messages[0], messages
    assert not saved_warnings(opt.state_dict)
