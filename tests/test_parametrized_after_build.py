"""A layer reparametrised (``torch.nn.utils.parametrize``) after the preconditioner or
``WhitenedMuon`` was built is refused at the next step, naming it, before anything changes.

Its weight is then computed from ``parametrizations.weight.original``, and the gradient that
reaches the original is not the weight's: at construction such a layer is left alone (K-FAC
family) or stepped by AdamW (``WhitenedMuon``). Built before, the preconditioner had bound a
parameter no gradient reaches any more (its layer passed through, with misleading warnings),
and ``WhitenedMuon`` whitened the original as if it were the weight. Reference for "nothing
changed": the gradients and parameters before the refused step.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune  # noqa: F401 - torch.nn.utils.prune
from torch.nn.utils import parametrize

from kron_precond import KronPreconditioner, WhitenedMuon

METHODS = {"kfac": dict(damping=1e-2, lr=0.1), "ekfac": dict(damping=1e-2, lr=0.1),
           "ikfac": dict(damping=1e-2, lr=0.1), "shampoo": {}, "soap": {}, "psgd": {}}


class Double(nn.Module):
    def forward(self, weight):
        return 2 * weight


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    F.mse_loss(model(x), y).backward()


def _snapshot(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def _assert_unchanged(model, snapshot):
    params, grads = snapshot
    assert {n: p.detach() for n, p in model.named_parameters()}.keys() == params.keys()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), params[n]), n
        if n in grads:
            assert torch.equal(p.grad, grads[n]), n


@pytest.mark.parametrize("when", ["before_first_step", "after_first_step"])
@pytest.mark.parametrize("method", list(METHODS))
def test_preconditioner_refuses_a_layer_parametrized_since_it_was_built(method, when):
    model = _model()
    precond = KronPreconditioner(model, method=method, **METHODS[method])
    if when == "after_first_step":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        _backward(model)
        precond.step()
        optimizer.step()
        optimizer.zero_grad()
    parametrize.register_parametrization(model[2], "weight", Double())
    with pytest.raises(RuntimeError, match=r"'2' \(weight\) are computed from other parameters.*parametrize"):
        _backward(model, seed=1)  # the forward's hooks may refuse already
        snapshot = _snapshot(model)
        precond.step()
    if "snapshot" in locals():
        _assert_unchanged(model, snapshot)


@pytest.mark.parametrize("reparametrise", ["prune", "weight_norm"])
@pytest.mark.parametrize("method", list(METHODS))
def test_preconditioner_refuses_a_layer_pruned_or_weight_normed_since_it_was_built(method, reparametrise):
    """``torch.nn.utils.prune`` and the legacy ``weight_norm`` also turn the weight into a tensor
    computed from parameters of their own (``weight_orig``, ``weight_g`` / ``weight_v``): the same
    refusal, before anything changes."""
    model = _model()
    precond = KronPreconditioner(model, method=method, **METHODS[method])
    _backward(model)
    precond.step()
    model.zero_grad()
    if reparametrise == "prune":
        torch.nn.utils.prune.l1_unstructured(model[2], "weight", amount=0.5)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's deprecation of the legacy form
            nn.utils.weight_norm(model[2])
    with pytest.raises(RuntimeError, match=r"'2' \(weight\) are computed from other parameters"):
        _backward(model, seed=1)
        snapshot = _snapshot(model)
        precond.step()
    if "snapshot" in locals():
        _assert_unchanged(model, snapshot)


@pytest.mark.parametrize("method", list(METHODS))
def test_preconditioner_built_on_a_parametrized_model_still_steps(method):
    """The check refuses a change since construction only: a layer parametrized before is left
    alone as before, and the others are preconditioned (their gradients change)."""
    model = _model()
    parametrize.register_parametrization(model[0], "weight", Double())
    precond = KronPreconditioner(model, method=method, **METHODS[method])
    for step in range(3):
        model.zero_grad()
        _backward(model, seed=step)
        before = model[2].weight.grad.clone()
        precond.step()
    assert not torch.equal(model[2].weight.grad, before)


@pytest.mark.parametrize("when", ["before_first_step", "after_first_step"])
def test_whitened_muon_refuses_a_layer_parametrized_since_it_was_built(when):
    model = _model()
    optimizer = WhitenedMuon(model, lr=0.02)
    if when == "after_first_step":
        _backward(model)
        optimizer.step()
        optimizer.zero_grad()
    parametrize.register_parametrization(model[0], "weight", Double())
    _backward(model, seed=1)
    snapshot = _snapshot(model)
    state = {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for p, s in optimizer.state.items()}
    with pytest.raises(RuntimeError, match=r"'0\.weight'.*parametriz"):
        optimizer.step()
    _assert_unchanged(model, snapshot)
    for p, s in optimizer.state.items():
        for k, v in s.items():
            expected = state[id(p)][k]
            assert torch.equal(v, expected) if torch.is_tensor(v) else v == expected, k


def test_whitened_muon_built_on_a_parametrized_model_still_steps():
    """Parametrized before construction: that weight's original is an AdamW parameter, as
    before, and the step runs."""
    model = _model()
    parametrize.register_parametrization(model[0], "weight", Double())
    optimizer = WhitenedMuon(model, lr=0.02)
    original = model[0].parametrizations.weight.original
    before = original.detach().clone()
    for step in range(2):
        optimizer.zero_grad()
        _backward(model, seed=step)
        optimizer.step()
    assert not torch.equal(original.detach(), before)
