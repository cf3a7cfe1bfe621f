"""benchmarks/scaling_table.py: its figures match hand-derived formulas on a tiny model.

The script sizes layers with the library's own objects; these checks recompute the same
quantities from the layer shapes alone (K-FAC EIGEN, float32 everywhere).
"""
import importlib.util
import pathlib
import sys

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "scaling_table.py"
_spec = importlib.util.spec_from_file_location("scaling_table", _PATH)
scaling = importlib.util.module_from_spec(_spec)
sys.modules["scaling_table"] = scaling  # dataclasses look their module up
_spec.loader.exec_module(scaling)

D, FFN, BLOCKS = 4, 8, 2
# (in, out) of each K-FAC layer of one tiny Llama block: q, k, v, o, gate, up, down (no bias)
SHAPES = [(D, D)] * 4 + [(D, FFN)] * 2 + [(FFN, D)]


@pytest.fixture(scope="module")
def tiny():
    with torch.device("meta"):
        model = scaling.Llama(n_layer=BLOCKS, d=D, ffn=FFN, vocab=10)
    return scaling.layer_sizes(model, "kfac")


def _row(layers, strategy, world):
    return scaling.strategy_row(strategy, layers, world)


def test_registers_every_block_linear_but_lm_head(tiny):
    assert len(tiny) == BLOCKS * len(SHAPES)
    assert not any("lm_head" in l.name for l in tiny)


@pytest.mark.parametrize("world", [2, 4])
def test_figures_match_formulas(tiny, world):
    shapes = SHAPES * BLOCKS
    grads = sum(4 * a * g for a, g in shapes)
    statistics = sum(4 * (a * a + g * g + 2) for a, g in shapes)  # sums + 2 row counts
    # EIGEN: per factor Q (n²) + eigenvalues (n) + validity flag (1); cached 1/(d_G d_Aᵀ+λ)
    applied = sum(4 * (a * a + a + 1 + g * g + g + 1 + a * g) for a, g in shapes)
    factors = sum(4 * (a * a + g * g) for a, g in shapes)
    work = sum(float(a) ** 3 + float(g) ** 3 for a, g in shapes)
    ring = (world - 1) / world

    comm = _row(tiny, "DDP COMM_OPT", world)
    assert comm.plain_bytes == 0
    assert comm.factor_bytes == pytest.approx(2 * ring * statistics)
    assert comm.memory_max == pytest.approx(factors + applied)  # every rank holds everything
    assert comm.work_mean == pytest.approx(work / world)

    mem = _row(tiny, "DDP MEM_OPT", world)
    assert mem.plain_bytes == pytest.approx(ring * grads)  # row broadcast of every gradient
    assert mem.refresh_bytes == pytest.approx(mem.factor_bytes)  # nothing to broadcast: W = 1
    assert mem.memory_mean == pytest.approx(factors + applied / world)

    fsdp = _row(tiny, "FSDP2", world)
    # state is split without copies: the ranks together hold one copy of everything
    assert fsdp.memory_mean * world == pytest.approx(factors + applied)
    assert fsdp.factor_bytes - fsdp.plain_bytes == pytest.approx(ring * statistics)
    # gather + scatter: summed over ranks, each layer costs (R-1)/R (gather) + (R-1)/R (scatter)
    assert fsdp.plain_bytes >= 2 * ring * grads / world - 1e-9
    assert fsdp.plain_bytes <= mem.plain_bytes


def test_hybrid_halves_the_workers(tiny):
    row = _row(tiny, "DDP HYBRID", 4)  # W = 2, C = 2
    grads = sum(4 * a * g for a, g in SHAPES * BLOCKS)
    assert row.plain_bytes == pytest.approx(0.5 * grads)
