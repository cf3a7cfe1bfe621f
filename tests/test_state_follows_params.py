"""A preconditioner built before ``model.to(...)`` keeps its state with the parameters.

Reference: the same model moved first and the preconditioner built after the move, run on
the same batches; the two must give the same parameters.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner

SETTINGS = {"kfac": dict(damping=1e-2, inv_update_steps=2, lr=0.1),
            "psgd": dict(preconditioner_update_probability=1.0),
            "ekfac": dict(damping=1e-2, inv_update_steps=2, lr=0.1),
            "shampoo": dict(inv_update_steps=2)}
METHODS = list(SETTINGS)


def _model(device=None):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8, device=device), nn.Tanh(), nn.Linear(8, 3, device=device))


def _train(model, precond, steps=3, dtype=torch.float32):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=g, dtype=dtype), torch.randn(16, 3, generator=g, dtype=dtype)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        precond.step()
        optimizer.step()


@pytest.mark.parametrize("method", METHODS)
def test_built_before_a_dtype_move_follows_the_parameters(method):
    before = _model()
    after = copy.deepcopy(before).to(torch.float64)
    precond_before = KronPreconditioner(before, method=method, **SETTINGS[method])
    before.to(torch.float64)  # a real move of every parameter (new storage, new dtype)
    precond_after = KronPreconditioner(after, method=method, **SETTINGS[method])
    _train(before, precond_before, dtype=torch.float64)
    _train(after, precond_after, dtype=torch.float64)
    for p_before, p_after in zip(before.parameters(), after.parameters()):
        assert p_before.dtype == torch.float64
        torch.testing.assert_close(p_before, p_after, rtol=1e-12, atol=1e-12)
    if method in ("kfac", "ekfac"):  # factor_dtype=None means "the parameters' dtype"
        for name, layer in precond_before.layers.items():
            assert layer.a_factor.dtype == layer.g_factor.dtype == torch.float64, name
            torch.testing.assert_close(layer.a_factor, precond_after.layers[name].a_factor)


@pytest.mark.parametrize("method", METHODS)
def test_built_on_meta_then_materialised_on_cpu(method):
    """``meta`` -> ``cpu`` stands in for ``cpu`` -> ``cuda``: the state must be where the
    parameters are when the preconditioner first uses it."""
    model = _model(device="meta")
    precond = KronPreconditioner(model, method=method, **SETTINGS[method])
    model.to_empty(device="cpu")
    reference = _model()
    model.load_state_dict(reference.state_dict())
    precond_ref = KronPreconditioner(reference, method=method, **SETTINGS[method])
    _train(model, precond)
    _train(reference, precond_ref)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    state = precond.state_dict()
    tensors = [t for layer in state["layers"].values() for t in _tensors(layer)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)


@pytest.mark.parametrize("move", ["overwriting_conversion", "to_empty_then_double"])
@pytest.mark.parametrize("method", [*METHODS, "ikfac"])
def test_new_parameters_of_a_wider_dtype_gather_the_first_statistics_in_it(method, move):
    """New Parameter objects of a wider dtype since construction (a conversion that overwrites
    the parameters; ``to_empty`` from meta, then ``.double()``): the first forward's statistics
    are gathered in the new dtype, bitwise as built after the move (a forward's hook follows a
    dtype at least as wide as the state's; FSDP2's narrower gathered copies it does not)."""
    settings = {**SETTINGS.get(method, {}), **({"damping": 1e-2, "lr": 0.1} if method == "ikfac" else {})}
    reference = _model().double()
    if move == "overwriting_conversion":
        model = _model()
        precond = KronPreconditioner(model, method=method, **settings)
        torch.__future__.set_overwrite_module_params_on_conversion(True)
        try:
            model.double()
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(False)
        assert model[0].weight.dtype == torch.float64
    else:
        model = _model(device="meta")
        precond = KronPreconditioner(model, method=method, **settings)
        model.to_empty(device="cpu")
        model.double()
        model.load_state_dict(reference.state_dict())
    precond_ref = KronPreconditioner(reference, method=method, **settings)
    _train(model, precond, dtype=torch.float64)
    _train(reference, precond_ref, dtype=torch.float64)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
