"""A schedule (a setting given as a callable of the step) that cannot give a value: the error
comes on the step that needs the value, before anything changes, and leaves nothing behind."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

from kron_precond import KronPreconditioner


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def _backward(model: nn.Module) -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    ((model(x) - y) ** 2).mean().backward()


def test_a_load_whose_schedule_is_bad_at_the_loaded_step_changes_nothing():
    source = _model()
    precond = KronPreconditioner(source, factor_update_steps=2)
    for _ in range(6):
        source.zero_grad()
        _backward(source)
        precond.step()
    target = _model()
    loaded = KronPreconditioner(target, factor_update_steps=lambda step: 2 if step < 4 else 0)
    before = loaded.state_dict()
    with pytest.raises(ValueError, match="factor_update_steps"):
        loaded.load_state_dict(precond.state_dict())
    after = loaded.state_dict()
    assert loaded.steps == 0
    assert after.keys() == before.keys()
    assert all(after[k] == before[k] for k in before if not isinstance(before[k], (dict, torch.Tensor)))
    # and it still trains from where it was
    target.zero_grad()
    _backward(target)
    loaded.step()
    assert loaded.steps == 1


def test_a_schedule_that_raises_for_the_next_step_does_not_fail_the_completed_one():
    """The third step completes; the error (here an IndexError from the user's table) comes
    from the fourth, which it concerns, before that step changes anything."""
    table = [1, 1, 1]
    model = _model()
    precond = KronPreconditioner(model, factor_update_steps=lambda step: table[step])
    for _ in range(3):
        model.zero_grad()
        _backward(model)
        precond.step()
    assert precond.steps == 3
    model.zero_grad()
    _backward(model)
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(IndexError):
        precond.step()
    assert precond.steps == 3
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("schedule", [lambda step: 0, lambda: 1], ids=["zero", "no-argument"])
def test_a_constructor_refusing_a_schedule_leaves_no_hooks(schedule):
    model = _model()
    with pytest.raises((ValueError, TypeError)):
        KronPreconditioner(model, factor_update_steps=schedule)
    gc.collect()
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
               for m in model.modules())
