"""A step with no gradient at all is no step: a trainer's skipped iteration.

Lightning skips an iteration whose ``training_step`` returns ``None`` by calling
``optimizer.step(closure)`` all the same: the closure runs the forward and no backward, so
every ``.grad`` is ``None``. Such a step must leave the preconditioner's counters and schedule
where they were (its forward's statistics dropped), or every later statistics step and refresh
lands one step early. The reference is the same loop with that iteration left out.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner, PreconditionedOptimizer, WhitenedMuon

DT = torch.float64
SKIPPED = 2


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT)


def batches():
    torch.manual_seed(1)
    return [(torch.randn(8, 5, dtype=DT), torch.randn(8, 3, dtype=DT)) for _ in range(7)]


def train(make_optimizer, skip: bool):
    net = model()
    opt = make_optimizer(net)
    for i, (x, y) in enumerate(batches()):
        opt.zero_grad()
        if i == SKIPPED:
            if skip:  # as Lightning: the closure's forward returns no loss, no backward runs
                opt.step(lambda x=x: (net(x), None)[1])
            continue

        def closure(x=x, y=y):
            loss = F.mse_loss(net(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    return net, opt


PRECONDITIONED = {
    "kfac": dict(method="kfac", inv_update_steps=3, kl_clip=None),
    "ikfac": dict(method="ikfac"),
    "soap": dict(method="soap"),
    "ekfac": dict(method="ekfac", inv_update_steps=3),
}


@pytest.mark.parametrize("name", list(PRECONDITIONED))
def test_a_step_without_gradients_is_not_counted(name):
    def make(net):
        return PreconditionedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2),
                                       KronPreconditioner(net, **PRECONDITIONED[name]))
    skipped, opt = train(make, skip=True)
    reference, ref_opt = train(make, skip=False)
    assert opt.preconditioner.steps == ref_opt.preconditioner.steps
    for mine, theirs in zip(skipped.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("every", [2, 5])
def test_a_step_without_gradients_is_not_counted_by_whitened_muon(every):
    def make(net):
        return WhitenedMuon(net, lr=2e-2, statistics_every=every)
    skipped, _ = train(make, skip=True)
    reference, _ = train(make, skip=False)
    for mine, theirs in zip(skipped.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_a_step_where_only_unregistered_parameters_have_gradients_counts():
    """A head-only phase (the preconditioned layers frozen, a skipped head training) is a step
    of the optimizer: the preconditioner counts it, so its schedule stays in phase."""
    net = model()
    precond = KronPreconditioner(net, method="kfac", inv_update_steps=3, kl_clip=None, skip_layers=["^2$"])
    opt = PreconditionedOptimizer(torch.optim.SGD(net.parameters(), lr=1e-2), precond)
    for i, (x, y) in enumerate(batches()):
        net[0].requires_grad_(not 2 <= i <= 4)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    assert precond.steps == len(batches())
