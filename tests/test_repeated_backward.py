"""Two backward passes through one forward (``backward(retain_graph=True)`` per loss) warn once.

Each pass's output gradient is read on its own, so a layer's output-gradient statistics get
``δ₁δ₁ᵀ + δ₂δ₂ᵀ`` where one backward of the summed losses gives ``(δ₁ + δ₂)(δ₁ + δ₂)ᵀ``: the
factor, and so the step, differs from the summed loss's (measured: K-FAC's parameter sum 0.13
apart after three steps, ``WhitenedMuon(output_side=True)``'s 0.01). Said, not silent. A
method that reads no output gradients (input-side whitening) counts a call's rows once however
many passes reach it: no warning; nor for a pass that writes no weight gradient (a gradient
penalty's ``torch.autograd.grad`` with respect to the inputs, or one with respect to the weights,
which computes their gradients without writing ``.grad``), nor for one backward per forward.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from kron_precond import KronPreconditioner, WhitenedMuon

MATCH = r"reached the output of layer '\d' .* a second time"


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _build(kind, model):
    if kind == "whitened_muon":
        return None, WhitenedMuon(model, lr=0.02, output_side=True, statistics_every=1)
    if kind == "whitened_muon_input_side":
        return None, WhitenedMuon(model, lr=0.02, output_side=False, statistics_every=1)
    precond = KronPreconditioner(model, method=kind, lr=0.1, factor_update_steps=1, inv_update_steps=1)
    return precond, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(kind, backward, steps=2):
    model = _model()
    precond, optimizer = _build(kind, model)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for _ in range(steps):
        out = model(x)
        backward(out, x, model)
        if precond is not None:
            precond.step()
        optimizer.step()
        optimizer.zero_grad()


def _two_losses(out, x, model):
    out.square().mean().backward(retain_graph=True)
    out.abs().mean().backward()


def _summed(out, x, model):
    (out.square().mean() + out.abs().mean()).backward()


def _gradient_norm_logged(out, x, model):
    """The weights' gradients through ``torch.autograd.grad`` first (a gradient-norm log, SAM's
    first half): that pass writes no ``.grad``; then the backward."""
    loss = out.square().mean()
    torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    loss.backward()


def _with_penalty(out, x, model):
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.square().mean() + grad.square().sum()).backward()


def _weight_gradient_penalty(out, x, model):
    """A penalty on the weights' gradient norm: their gradients with ``create_graph``, then one
    backward of the loss and the penalty."""
    loss = out.square().mean()
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    (loss + sum(g.square().sum() for g in grads)).backward()


@pytest.mark.parametrize("kind", ["kfac", "ekfac", "whitened_muon"])
def test_two_backward_passes_through_one_forward_warn_once(kind):
    with pytest.warns(UserWarning, match=MATCH) as caught:
        _train(kind, _two_losses)
    said = [w for w in caught if "a second time" in str(w.message)]
    assert len(said) == 1
    assert said[0].filename == __file__  # the user's backward() line, not torch's engine


@pytest.mark.parametrize("kind, backward", [("kfac", _summed), ("whitened_muon", _summed),
                                            ("kfac", _with_penalty), ("whitened_muon_input_side", _two_losses),
                                            ("kfac", _gradient_norm_logged), ("whitened_muon", _gradient_norm_logged),
                                            ("kfac", _weight_gradient_penalty)])
def test_one_backward_per_forward_or_no_output_gradients_read_is_silent(kind, backward):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(kind, backward)
