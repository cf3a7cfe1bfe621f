"""The per-step path reads nothing back from the device.

Every registered method, with statistics gathered on every step and (for the interval
methods) no refresh in the window checked, runs its steps with every tensor-to-host read
forbidden: ``.item()``, ``.tolist()``, truthiness and the int/float conversions. On a GPU
each would stall the host until the device drains. The one read allowed is Health's copy of
the per-layer "gradient finite" flags, which on CPU is a plain read of a CPU tensor and on
a GPU a non-blocking copy polled by an event (``kron_precond/health.py``).
PSGD updates its factors with probability 1 here, so its refresh is on the checked path too.
The standalone optimizers (``Kron``, ``WhitenedMuon``) read their non-finite counters on the
first step and then once per ``nonfinite_warn_interval``; the steps in between are checked.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from kron_precond import Kron, KronPreconditioner, WhitenedMuon
from kron_precond.methods.registry import METHODS

SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
OPTIONS = {"kfac": dict(inv_update_steps=50), "ekfac": dict(inv_update_steps=50),
           "shampoo": dict(inv_update_steps=50), "soap": dict(inv_update_steps=50),
           "ikfac": dict(factor_update_steps=1, inv_update_steps=50),
           "psgd": dict(preconditioner_update_probability=1.0), "second_moment": {}}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def train(model, steps, *stepped):
    for _ in range(steps):
        x, y = torch.randn(32, 8), torch.randn(32, 4)
        model.zero_grad()
        (model(x) - y).square().mean().backward()
        for obj in stepped:
            obj.step()


def forbid_host_syncs(monkeypatch, label):
    """Make every tensor-to-host read raise, except Health's read of a CPU flag tensor."""
    def forbid(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_name == "record_gradients" and self.device.type == "cpu":
                return original(self, *args, **kwargs)
            raise AssertionError(f"host sync ({name}) in the {label} step")
        return read

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, forbid(name))


def test_every_registered_method_is_covered():
    assert set(OPTIONS) == set(METHODS)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_steps_between_refreshes_make_no_host_sync(monkeypatch, method):
    model = make_model()
    precond = KronPreconditioner(model, method=method, **OPTIONS[method])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    # step 0: the first refresh (decompositions may check results); ikfac also refreshes on its
    # warm-up steps 1, 2, 4, ..., 32 (powers of two below its interval of 50): past them all
    train(model, 33, precond, optimizer)
    with monkeypatch.context() as m:
        forbid_host_syncs(m, method)
        train(model, 8, precond, optimizer)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["Kron", "WhitenedMuon", "WhitenedMuon(model)", "WhitenedMuon(centred)"])
def test_standalone_optimizer_steps_make_no_host_sync(monkeypatch, name):
    """``WhitenedMuon`` with the data-rich recipe refreshes on every step, so its refresh is on
    the checked path (centred input factors too: their row sums and the mean taken out);
    ``Kron`` updates its factors on every step here."""
    model = make_model()
    if name == "Kron":
        optimizer = Kron(model.parameters(), lr=1e-3, preconditioner_update_probability=1.0)
    elif name == "WhitenedMuon":
        optimizer = WhitenedMuon([model[0], model[2]], lr=1e-2, statistics_every=1, factor_decay=0.8)
    elif name == "WhitenedMuon(centred)":
        optimizer = WhitenedMuon([model[0], model[2]], lr=1e-2, statistics_every=1, factor_decay=0.8,
                                 center_inputs=True)
    else:  # one optimizer for the model: its AdamW half (the biases) is checked too
        optimizer = WhitenedMuon(model, lr=1e-2, statistics_every=1, factor_decay=0.8)
        assert [g["algorithm"] for g in optimizer.param_groups] == ["whitened_muon", "adamw"]
    train(model, 1, optimizer)  # step 1 reads the non-finite counters (once per interval)
    with monkeypatch.context() as m:
        forbid_host_syncs(m, name)
        train(model, 8, optimizer)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_wrapper_under_a_grad_scaler_reads_its_record_no_second_time(monkeypatch):
    """``scaler.step(optimizer)`` reads the overflow record and calls ``step()`` only when the
    gradients are finite: the wrapped preconditioner's step does not read it again (no second
    host sync, and no collective a skipping rank would never join)."""
    from kron_precond import PreconditionedOptimizer

    model = make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    precond = KronPreconditioner(model, method="kfac", inv_update_steps=50, grad_scaler=scaler)
    optimizer = PreconditionedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), precond)

    def iteration(forbid: bool):
        x, y = torch.randn(32, 8), torch.randn(32, 4)
        optimizer.zero_grad()
        scaler.scale((model(x) - y).square().mean()).backward()
        scaler.unscale_(optimizer)
        with monkeypatch.context() as m:
            if forbid:
                forbid_host_syncs(m, "wrapped")
            optimizer.step()  # what scaler.step calls once it found the gradients finite
        scaler.update()

    for step in range(8):
        iteration(forbid=step >= 2)  # past the first refresh, which may read
    assert all(torch.isfinite(p).all() for p in model.parameters())
