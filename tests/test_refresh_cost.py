"""benchmarks/refresh_cost.py: the refresh timed batched and one factor at a time gives the same
whiteners both ways, each a valid whitener of its damped factor (checked in float64)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import refresh_cost as rc  # noqa: E402


@pytest.mark.parametrize("root", ["cholesky", "symmetric"])
def test_every_row_is_timed_and_both_ways_agree(root, capsys):
    rows = rc.main(["--widths", "8:3,16", "--repeats", "2", "--device", "cpu", "--root", root, "--threads", "1"])
    assert [(r["width"], r["count"]) for r in rows] == [(8, 3), (16, 1)]
    for r in rows:
        assert all(r[c] > 0 for c in rc.COLUMNS)
        assert r["relative difference"] < 1e-5
    out = capsys.readouterr().out
    assert "| 8 x 3 |" in out and "| 16 x 1 |" in out


def test_the_timed_function_whitens_the_damped_factor():
    factors = rc.random_factors(12, 2, torch.device("cpu"), torch.Generator().manual_seed(0)).double()
    stats = rc.WhiteningStatistics({}, {}, lambda p: False, sides=("input",), damping=0.1, factor_decay=0.8,
                                   statistics_rows=None, root="cholesky", block_size=None, process_group=None)
    whiteners = stats.whitener(factors, None)
    for f, t in zip(factors, whiteners):
        damped = f + 0.1 * f.trace() / 12 * torch.eye(12, dtype=torch.float64)
        assert torch.allclose(t.mT @ t, torch.linalg.inv(damped), rtol=1e-8, atol=1e-10)
