"""The per-step path reads nothing back from the device.

Every registered method, with statistics gathered on every step and (for the interval
methods) no refresh in the window checked, runs its steps with every tensor-to-host read
forbidden: ``.item()``, ``.tolist()``, truthiness and the int/float conversions. On a GPU
each would stall the host until the device drains. The one read allowed is Health's copy of
the per-layer "gradient finite" flags, which on CPU is a plain read of a CPU tensor and on
a GPU a non-blocking copy polled by an event (``kron_precond/health.py``).
PSGD updates its factors with probability 1 here, so its refresh is on the checked path too.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

from kron_precond import KronPreconditioner
from kron_precond.methods.registry import METHODS

SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
OPTIONS = {"kfac": dict(inv_update_steps=50), "ekfac": dict(inv_update_steps=50),
           "shampoo": dict(inv_update_steps=50), "soap": dict(inv_update_steps=50),
           "ikfac": dict(factor_update_steps=1, inv_update_steps=50),
           "psgd": dict(preconditioner_update_probability=1.0), "second_moment": {}}


def test_every_registered_method_is_covered():
    assert set(OPTIONS) == set(METHODS)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_steps_between_refreshes_make_no_host_sync(monkeypatch, method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    precond = KronPreconditioner(model, method=method, **OPTIONS[method])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    def train(steps):
        for _ in range(steps):
            x, y = torch.randn(32, 8), torch.randn(32, 4)
            optimizer.zero_grad()
            (model(x) - y).square().mean().backward()
            precond.step()
            optimizer.step()

    train(1)  # step 0: the first refresh (decompositions may check their results there)

    def forbid(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if sys._getframe(1).f_code.co_name == "record_gradients" and self.device.type == "cpu":
                return original(self, *args, **kwargs)
            raise AssertionError(f"host sync ({name}) in the {method} step")
        return read

    with monkeypatch.context() as m:
        for name in SYNCS:
            m.setattr(torch.Tensor, name, forbid(name))
        train(8)
    assert all(torch.isfinite(p).all() for p in model.parameters())
