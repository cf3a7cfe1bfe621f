"""benchmarks/whitened_normuon.py's row normalisation against a float64 row-loop reference.

The reference keeps each row's second moment as a Python float and normalises row by row
(NorMuon, arXiv 2510.05491: ``v <- β2 v + (1 - β2) mean_j D[i, j]²``, ``D[i] / (sqrt(v_i) + ε)``,
rescaled to ``||D||_F``), sharing no tensor code with the optimizer."""
from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.whitened_normuon import WhitenedNorMuon, normalize_row_stack  # noqa: E402
from kron_precond.whitened_muon import WhitenedMuon  # noqa: E402


def reference_rows(matrix: list[list[float]], v: list[float], beta2: float, eps: float) -> list[list[float]]:
    """One NorMuon normalisation of ``matrix`` (rows = neurons); updates ``v`` in place."""
    norm = math.sqrt(sum(x * x for row in matrix for x in row))
    out = []
    for i, row in enumerate(matrix):
        v[i] = beta2 * v[i] + (1 - beta2) * sum(x * x for x in row) / len(row)
        out.append([x / (math.sqrt(v[i]) + eps) for x in row])
    out_norm = math.sqrt(sum(x * x for row in out for x in row))
    return [[x * norm / out_norm for x in row] for row in out]


@pytest.mark.parametrize("shape", [(6, 10), (12, 5)])
def test_normalize_row_stack_matches_reference_over_steps(shape):
    generator = torch.Generator().manual_seed(0)
    k, beta2, eps = 3, 0.95, 1e-10
    moments = torch.zeros(k, shape[0], 1)
    ref_v = [[0.0] * shape[0] for _ in range(k)]
    for _ in range(4):
        # rows of very different scales: the normalisation must even them out
        direction = torch.randn(k, *shape, generator=generator) * torch.logspace(-2, 1, shape[0]).reshape(1, -1, 1)
        got, moments = normalize_row_stack(direction, moments, beta2, eps)
        for j in range(k):
            want = torch.tensor(reference_rows(direction[j].double().tolist(), ref_v[j], beta2, eps),
                                dtype=torch.float64)
            torch.testing.assert_close(got[j].double(), want, rtol=2e-5, atol=1e-6)
            torch.testing.assert_close(moments[j, :, 0].double(), torch.tensor(ref_v[j], dtype=torch.float64),
                                       rtol=2e-5, atol=1e-9)
            assert torch.isclose(got[j].norm(), direction[j].norm(), rtol=1e-5)


def test_nonfinite_matrix_keeps_its_moment():
    moments = torch.full((2, 3, 1), 0.5)
    direction = torch.randn(2, 3, 4)
    direction[1, 0, 0] = float("nan")
    _, new = normalize_row_stack(direction, moments, 0.9)
    assert torch.equal(new[1], moments[1])
    assert not torch.equal(new[0], moments[0])


def test_one_step_is_whitened_muon_step_with_rows_normalised():
    """From the same state, WhitenedNorMuon's first step on a whitened weight is
    WhitenedMuon's direction, row-normalised (v from zero), at the same scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Tanh(), nn.Linear(6, 5, bias=False))
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    lr, beta2 = 0.05, 0.95
    kwargs = dict(momentum=0.9, statistics_every=1, ns_dtype=torch.float32)
    base = WhitenedMuon(model, lr, 0.0, **kwargs)
    ours = WhitenedNorMuon(twin, lr, 0.0, beta2=beta2, **kwargs)
    x = torch.randn(64, 8)
    for net, opt in ((model, base), (twin, ours)):
        net(x).square().mean().backward()
        opt.step()
    for p0, pb, po in zip(start.parameters(), model.parameters(), twin.parameters()):
        adjusted = lr * 0.2 * max(p0.shape) ** 0.5
        direction = ((p0 - pb) / adjusted).double()
        want = reference_rows(direction.tolist(), [0.0] * p0.shape[0], beta2, 1e-10)
        torch.testing.assert_close(((p0 - po) / adjusted).double(), torch.tensor(want, dtype=torch.float64),
                                   rtol=1e-3, atol=1e-5)
        v = ours.state[po]["row_second_moment"]
        torch.testing.assert_close(v.reshape(-1).double(), (1 - beta2) * direction.square().mean(dim=1),
                                   rtol=1e-3, atol=1e-9)


def test_the_lever_runner_builds_it_with_the_examples_settings():
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitened_normuon import build_whitened_normuon
    from char_lm import SKIP_LAYERS, CharTransformer, ModelConfig
    from kron_examples_common import PrecondConfig
    model = CharTransformer(ModelConfig(16, 1, 2, 8, False, "gpt"))
    config = PrecondConfig(skip_layers=SKIP_LAYERS, muon_momentum=0.8, wmuon_every=3, wmuon_factor_decay=0.7)
    built = build_whitened_normuon(model, 0.01, 0.0, config)
    assert isinstance(built, WhitenedNorMuon)
    assert built.statistics_every == 3 and built.factor_decay == 0.7 and built.param_groups[0]["momentum"] == 0.8
    whitened = [built._names[id(p)] for p in built.param_groups[0]["params"]]
    assert whitened and not any("lm_head" in name for name in whitened)  # skip_layers reached it
