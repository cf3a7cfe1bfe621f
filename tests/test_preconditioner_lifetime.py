"""A KronPreconditioner the caller drops is freed, and its hooks go with it."""
from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn as nn

from kron_precond import KronPreconditioner
from kron_precond.methods.registry import METHODS


def hook_counts(model: nn.Module) -> list[tuple[int, int, int]]:
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_dropped_preconditioner_is_freed_and_its_hooks_removed(method):
    """Rebuilding the preconditioner on one model (a sweep, a notebook cell run twice) must not
    leave the earlier ones alive, hooked on the modules and gathering statistics on every
    forward; the one kept still gathers its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    bare = hook_counts(model)
    refs = []
    for _ in range(2):
        precond = KronPreconditioner(model, method=method, factor_update_steps=1, inv_update_steps=1)
        model(torch.randn(32, 8)).square().mean().backward()
        precond.step(lr=0.1)
        model.zero_grad()
        refs.append(weakref.ref(precond))
        del precond
    gc.collect()
    assert [r() is None for r in refs] == [True, True]
    assert hook_counts(model) == bare
    kept = KronPreconditioner(model, method=method, factor_update_steps=1, inv_update_steps=1)
    x = torch.randn(32, 8)
    model(x).square().mean().backward()
    before = model[0].weight.grad.clone()
    kept.step(lr=0.1)
    assert not torch.equal(before, model[0].weight.grad)  # it preconditioned: it saw its statistics


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda p: pickle.loads(pickle.dumps(p))])
def test_copying_or_pickling_raises_pointing_to_the_state_dict(copier):
    model = nn.Sequential(nn.Linear(8, 4))
    precond = KronPreconditioner(model, method="kfac")
    with pytest.raises(TypeError, match="state_dict"):
        copier(precond)
