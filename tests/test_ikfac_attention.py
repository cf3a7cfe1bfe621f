"""Input-side K-FAC (``method="ikfac"``) on ``nn.MultiheadAttention``, whose projections are
applied functionally: a self-attention's packed ``in_proj`` is one Linear-like unit read from
the query, checked against the same attention built from a fused ``nn.Linear`` (the twins of
``test_whitened_muon_attention.py``). What the method cannot precondition (the out_proj, whose
input no hook sees; a cross-attention, whose parts read inputs of their own) is left to the
optimizer, and said so."""
from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import results_of, run_scenarios
from kron_precond import KronPreconditioner
from test_whitened_muon_attention import HEADS, E, LinearTwin, Packed, batches

SETTINGS = dict(method="ikfac", factor_update_steps=2, inv_update_steps=2, damping=0.1)


@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_self_attention_is_preconditioned_as_its_fused_linear_twin(bias):
    torch.manual_seed(0)
    packed = Packed(bias)
    twin = LinearTwin(packed, fused=True)
    ours = KronPreconditioner(packed, **SETTINGS)
    theirs = KronPreconditioner(twin, skip_layers=["out"], **SETTINGS)
    assert list(ours.layers) == ["attn"] and list(theirs.layers) == ["qkv"]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (packed, twin)]
    for x, y in batches(5):
        for model, precond, opt in zip((packed, twin), (ours, theirs), optimizers):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            raw = model.parameters().__next__().grad.clone()
            precond.step()
            assert not torch.allclose(raw, next(model.parameters()).grad)  # rewritten
            opt.step()
        torch.testing.assert_close(packed.attn.in_proj_weight, twin.qkv.weight, rtol=1e-9, atol=1e-11)
        if bias:
            torch.testing.assert_close(packed.attn.in_proj_bias, twin.qkv.bias, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(packed.attn.out_proj.weight, twin.out.weight, rtol=1e-9, atol=1e-11)


def test_what_ikfac_cannot_precondition_is_logged_and_left_alone(caplog):
    """The decoder's cross-attention and every out_proj are skipped at construction, each
    logged once; the encoder-style self-attention is taken."""
    layer = nn.TransformerDecoderLayer(E, HEADS, 16, batch_first=True)
    with caplog.at_level(logging.INFO, logger="kron_precond"):
        precond = KronPreconditioner(layer, **SETTINGS)
    assert "self_attn" in precond.layers and "multihead_attn" not in precond.layers
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    for name in ("multihead_attn", "self_attn.out_proj", "multihead_attn.out_proj"):
        assert sum(m.startswith(f"skipping {name}:") or m.startswith(f"skipping {name} (") for m in skipped) == 1, \
            (name, skipped)
    assert not any(m.startswith("skipping self_attn:") or m.startswith("skipping self_attn (") for m in skipped)


def test_a_call_as_cross_attention_raises_naming_the_module():
    """A module taken for self-attention that is then called with another key or value would be
    preconditioned by the wrong input: the first such call raises, naming it."""
    torch.manual_seed(0)
    packed = Packed()
    precond = KronPreconditioner(packed, **SETTINGS)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="'attn'.*cross-attention"):
        packed.attn(x, x + 1, x + 1, need_weights=False)
    precond.remove()


def test_two_sided_kfac_still_skips_the_attention(caplog):
    """K-FAC needs the projections' output gradients, which no hook sees: the attention stays
    with the optimizer, logged."""
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="kron_precond"):
        with pytest.raises(ValueError, match="no module"):
            KronPreconditioner(Packed(), method="kfac")
    assert any(r.getMessage().startswith("skipping attn") for r in caplog.records)


def _distributed_worker(rank, world_size, out_dir):
    from dist_utils import average_gradients_by_hand

    torch.manual_seed(0)
    packed = Packed()
    precond = KronPreconditioner(packed, inv_dtype=torch.float64, **SETTINGS)
    params = list(packed.parameters())
    grads = []
    for x, y in batches(5):
        packed.zero_grad()
        per = x.shape[0] // world_size
        F.mse_loss(packed(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        average_gradients_by_hand(params, world_size, torch.distributed.all_reduce)  # DDP's mean
        precond.step()
        grads.append([p.grad.clone() for p in params])
    return grads


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_equal_one_process_on_the_full_batch(tmp_path, world, request):
    """The query's rows join the statistics' all-reduce like any layer's: every rank's
    preconditioned gradients are one process's on the full batch, at every step. (2 ranks:
    the shared spawn at the end of the file; 4 ranks: a spawn of its own.)"""
    from dist_utils import run_workers

    if world == 2:
        results = results_of(request.getfixturevalue("two_ranks"), "distributed")
    else:
        results = run_workers(_distributed_worker, world, tmp_path, timeout=90)
    assert len(results) == world
    torch.manual_seed(0)
    packed = Packed()
    precond = KronPreconditioner(packed, inv_dtype=torch.float64, **SETTINGS)
    for step, (x, y) in enumerate(batches(5)):
        packed.zero_grad()
        F.mse_loss(packed(x), y).backward()
        precond.step()
        for rank_result in results:
            for got, p in zip(rank_result[step], packed.parameters()):
                torch.testing.assert_close(got, p.grad, rtol=1e-9, atol=1e-12)



def _fsdp_trajectory(rank, world_size, reshard):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    packed = Packed()
    if world_size > 1:  # the module holds a gathered copy of in_proj_weight during its forward
        # (and, not resharding after it, still when its forward hooks run)
        fully_shard(packed.attn, reshard_after_forward=reshard)
        fully_shard(packed)
    precond = KronPreconditioner(packed, inv_dtype=torch.float64, **SETTINGS)
    opt = torch.optim.SGD(packed.parameters(), lr=0.1)
    trajectory = []
    for x, y in batches(5):
        per = x.shape[0] // world_size
        opt.zero_grad()
        F.mse_loss(packed(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        precond.step()
        opt.step()
        trajectory.append([(p.full_tensor() if world_size > 1 else p).detach().clone()
                           for p in packed.parameters()])
    return {"layers": list(precond.layers), "trajectory": trajectory}


def _fsdp_worker(rank, world_size, out_dir):
    return {reshard: _fsdp_trajectory(rank, world_size, reshard) for reshard in (True, False)}


def test_fsdp2_ranks_equal_one_process_on_the_full_batch(two_ranks):
    """Under FSDP2 the packed in_proj is a DTensor sharded by rows: its preconditioned step on
    2 ranks equals one process's on the full batch, whether or not FSDP2 reshards it after
    the forward, on every rank and every step."""
    single = _fsdp_trajectory(0, 1, True)
    results = results_of(two_ranks, "fsdp")
    assert single["layers"] == ["attn"] and len(results) == 2
    for by_reshard in results:
        for r in by_reshard.values():
            assert r["layers"] == ["attn"]
            for got_step, want_step in zip(r["trajectory"], single["trajectory"], strict=True):
                for got, want in zip(got_step, want_step, strict=True):
                    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _masked_value_call(rank: int, world: int):
    """Padding in the last sequence only (on rank 1 of 2): the value differs from the query there."""
    from test_whitened_muon_attention import T, _MaskedValue

    model = _MaskedValue()
    x = torch.randn(4, T, E, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    keep = torch.ones(4, T, 1, dtype=torch.float64)
    keep[3, -1] = 0
    per = x.shape[0] // world
    rows = slice(rank * per, (rank + 1) * per)
    return model, lambda: model(x[rows], keep[rows]).square().mean()


def _context_call(rank: int, world: int):
    """A context on rank 0's batch, the query itself as key and value on rank 1's."""
    from test_whitened_muon_attention import _context_batches, _ContextOnSomeBatches

    model = _ContextOnSomeBatches()
    x, memory, y = _context_batches(1)[0][rank]
    return model, lambda: F.mse_loss(model(x, memory), y)


CROSS_ON_ONE_RANK = {"padding": _masked_value_call, "context": _context_call}


def _cross_attention_on_one_rank_worker(rank: int, world: int, out_dir: str, case: str):
    torch.manual_seed(0)
    model, loss = CROSS_ON_ONE_RANK[case](rank, world)
    precond = KronPreconditioner(model, factor_update_steps=1, inv_update_steps=1, method="ikfac", damping=0.1)
    try:
        loss().backward()
        precond.step()
    except Exception as error:  # noqa: BLE001 - its type is checked; the spawn's other scenarios go on
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None}


@pytest.mark.parametrize("case", sorted(CROSS_ON_ONE_RANK))
def test_a_call_read_as_cross_attention_on_one_rank_raises_on_every_rank(case, two_ranks):
    """One rank reads a call as cross-attention, the other not: from the values (padding on one
    rank only), or because the model's code passes a context on one rank's batch and the query
    itself on the other's, so only one rank's forward sees anything to decide (a collective
    there would go out of step). Every rank must refuse at the step, not only the rank that saw
    it: the others would otherwise wait in the statistics' all-reduce (a hang: the shared
    spawn's timeout)."""
    results = results_of(two_ranks, f"refused/{case}")
    assert len(results) == 2
    for r in results:
        raised = r["raised"]
        assert raised is not None and raised.startswith("RuntimeError: "), r
        assert "'attn'" in raised and "cross-attention" in raised, r


# ----------------------------------------------------------------------------- the shared spawn
# Spawning gloo ranks (each imports torch) costs more than the scenarios above, so every
# scenario on 2 ranks shares one spawn, one after the other, each seeding and building its own
# model as it did alone. The refusals come last: each is caught on every rank (every rank
# refuses at the same step, so the group stays in step for the next).
TWO_RANKS = {
    "distributed": _distributed_worker,
    "fsdp": _fsdp_worker,
    **{f"refused/{case}": functools.partial(_cross_attention_on_one_rank_worker, case=case)
       for case in sorted(CROSS_ON_ONE_RANK)},
}
TWO_RANKS_TIMEOUT = 3 * 90 + 2 * 60  # what the spawns it replaces had




@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Every 2-rank scenario: per rank, ``{scenario: result}``."""
    from dist_utils import run_workers

    return run_workers(run_scenarios, 2, tmp_path_factory.mktemp("w2"), TWO_RANKS, timeout=TWO_RANKS_TIMEOUT)
