"""``grad_scaler``: a ``torch.amp.GradScaler``, or a callable returning the current loss scale
(what kfac-pytorch users pass); anything else is a ``TypeError`` at construction.

Reference: the same model and batch without any loss scaling.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner

SCALE = 2.0**16


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)


@pytest.mark.parametrize("scale_fn", [lambda: SCALE, lambda: torch.tensor(SCALE)],
                         ids=["float", "tensor"])
def test_callable_grad_scaler_divides_its_scale_out_of_g(scale_fn):
    x, y = _batch()
    ref_model = _model()
    scaled_model = copy.deepcopy(ref_model)
    ref = KronPreconditioner(ref_model, kl_clip=None)
    scaled = KronPreconditioner(scaled_model, kl_clip=None, grad_scaler=scale_fn)
    F.cross_entropy(ref_model(x), y).backward()
    ref.step()
    (F.cross_entropy(scaled_model(x), y) * SCALE).backward()
    for p in scaled_model.parameters():  # what scaler.unscale_ does to .grad
        p.grad.div_(SCALE)
    scaled.step()
    for name in ref.layers:
        got, want = scaled.layers[name].g_factor, ref.layers[name].g_factor
        assert ((got - want).norm() / want.norm()).item() < 1e-5, name


@pytest.mark.parametrize("method", ["kfac", "psgd"])
@pytest.mark.parametrize("value", [3.0, object(), "scaler"], ids=["float", "object", "str"])
def test_other_grad_scaler_values_are_rejected_at_construction(method, value):
    with pytest.raises(TypeError, match="grad_scaler"):
        KronPreconditioner(_model(), method=method, grad_scaler=value)


def test_grad_scaler_instance_and_none_are_accepted():
    KronPreconditioner(_model(), grad_scaler=None).remove()
    KronPreconditioner(_model(), grad_scaler=torch.amp.GradScaler("cpu")).remove()
