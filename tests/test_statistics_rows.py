"""K-FAC / EK-FAC ``statistics_rows``: only the first rows of each module call enter the
factor statistics.

Reference: the same model, with every row counted, on a batch holding only those rows.
With a per-row loss (MSE over samples) each row's output gradient ``δ_i`` (the library
multiplies the mean-loss gradient back by the call's row count) does not depend on the
other rows, so the two must give identical factors (and EK-FAC scalings); the dense
formulas behind the full-row case are checked in test_kfac_math.py / test_ekfac.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner

DT = torch.float64


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DT)


def _statistics(method: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 3, **kw):
    """Per layer (A, G[, scaling]) after ``steps`` steps on the same batch, no weight update."""
    precond = KronPreconditioner(model, method=method, factor_update_steps=1, inv_update_steps=2,
                                 kl_clip=None, damping=1e-2, inv_dtype=DT, **kw)
    for _ in range(steps):
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        precond.step()
    out = {}
    for name, layer in precond.layers.items():
        tensors = [layer.a_factor.clone(), layer.g_factor.clone()]
        if method == "ekfac":
            tensors.append(layer.method._scaling.clone())
        out[name] = tensors
    precond.remove()
    return out


@pytest.mark.parametrize("method", ["kfac", "ekfac"])
@pytest.mark.parametrize("rows", [1, 6, 16, 40])
def test_statistics_rows_equal_the_statistics_of_those_rows_alone(method, rows):
    torch.manual_seed(1)
    x, y = torch.randn(16, 5, dtype=DT), torch.randn(16, 3, dtype=DT)
    model = _net()
    got = _statistics(method, copy.deepcopy(model), x, y, statistics_rows=rows)
    kept = min(rows, 16)
    want = _statistics(method, copy.deepcopy(model), x[:kept], y[:kept])
    for name in want:
        for g, w in zip(got[name], want[name], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_statistics_rows_below_the_batch_changes_the_factors():
    """Guard for the test above: a subset is not silently ignored."""
    torch.manual_seed(1)
    x, y = torch.randn(16, 5, dtype=DT), torch.randn(16, 3, dtype=DT)
    model = _net()
    full = _statistics("kfac", copy.deepcopy(model), x, y)
    subset = _statistics("kfac", copy.deepcopy(model), x, y, statistics_rows=4)
    assert not torch.allclose(full["0"][0], subset["0"][0])


def test_statistics_rows_apply_per_call_of_a_module_called_twice():
    """Each call keeps its own first rows (the sums and row counts pool the calls)."""
    torch.manual_seed(2)
    layer = nn.Linear(4, 4).to(DT)
    x1, x2 = torch.randn(10, 4, dtype=DT), torch.randn(10, 4, dtype=DT)
    precond = KronPreconditioner(layer, factor_update_steps=1, inv_update_steps=1, kl_clip=None,
                                 statistics_rows=3, inv_dtype=DT)
    (layer(x1).square().sum() + layer(x2).square().sum()).backward()
    precond.step()
    rows = torch.cat([x1[:3], x2[:3]])
    rows = torch.cat([rows, torch.ones(6, 1, dtype=DT)], dim=1)  # the bias column
    torch.testing.assert_close(precond.layers[""].a_factor, rows.t() @ rows / 6, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("value", [0, -5, 2.5, "8", True])
def test_bad_statistics_rows_raise_naming_it(value):
    with pytest.raises(ValueError, match="statistics_rows"):  # like every integer option
        KronPreconditioner(_net(), statistics_rows=value)
