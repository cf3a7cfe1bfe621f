"""benchmarks/whitening_power.py's whitener against scipy's fractional matrix power in float64."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.linalg import fractional_matrix_power
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.whitening_power import power_whitener  # noqa: E402
from kron_precond import WhitenedMuon, whitening  # noqa: E402


@pytest.mark.parametrize("power", [0.35, 0.5, 0.65])
def test_the_whitener_is_the_damped_factor_to_minus_the_power(monkeypatch, power):
    monkeypatch.setattr(whitening.WhiteningStatistics, "decompose", power_whitener(power))
    torch.manual_seed(0)
    layer = nn.Linear(6, 3, bias=True).double()
    x = torch.randn(50, 6, dtype=torch.float64) * torch.logspace(0, -1.5, 6, dtype=torch.float64)
    opt = WhitenedMuon([layer], lr=1e-2, statistics_every=1, statistics_rows=None, damping=0.1)
    layer(x).square().sum().backward()
    opt.step()
    a = (x.T @ x / len(x)).numpy()
    damped = a + 0.1 * np.trace(a) / 6 * np.eye(6)
    expected = fractional_matrix_power(damped, -power).real
    got = opt.state[layer.weight]["input_whitener"].reshape(6, 6).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_a_power_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="power"):
        power_whitener(0.0)
