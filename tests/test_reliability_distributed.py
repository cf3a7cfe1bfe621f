"""Reliability, multi-process: no hang.

* ``state_dict()`` called on rank 0 only (the usual save pattern) with
  ``grad_worker_fraction < 1`` was a hidden collective: both ranks blocked until the
  process-group timeout. It is local now: it returns, or raises on the calling rank,
  within seconds, and the group keeps working; ``gather_state_dict()`` is the explicit
  collective.
* Ranks disagreeing on a setting that changes the collective schedule
  (``factor_update_steps``, ``inv_update_steps``, the PSGD update probability, a
  schedule callable) hung; they now fail at construction on every rank.
* HYBRID_OPT with a user-given sub-``process_group`` created its groups with torch's
  world-collective ``new_group``: two jobs on disjoint rank sets each created "their"
  groups under the same names and hung.
* HYBRID_OPT after some ranks made a process group of their own (``use_local_synchronization``)
  hung: torch named the grid's groups after each rank's count of groups. The whole world now
  creates them collectively (names agree); a sub-group whose ranks' counts differ is refused on
  every rank. A ``process_group`` of the wrong type, or one this rank is not in, is refused
  naming it.

Real gloo processes (``dist_utils.run_workers``) with hard timeouts; each spawn here is
short and a hang fails its test after ``TIMEOUT`` seconds (``TIMEOUT`` per scenario in the
2-rank spawn that several tests share).
"""
from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import results_of, run_scenarios, run_workers
from kron_precond import DistributedStrategy, KronPreconditioner

F64 = torch.float64
TIMEOUT = 60.0
BATCH = 8


def make_model() -> nn.Module:
    torch.manual_seed(21)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)


def train_step(model, precond, step, rank, world, group=None):
    g = torch.Generator().manual_seed(300 + step)
    x, y = torch.randn(BATCH, 4, generator=g, dtype=F64), torch.randn(BATCH, 3, generator=g, dtype=F64)
    n = BATCH // world
    model.zero_grad()
    F.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=group)
        p.grad /= world
    precond.step()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad


# ----------------------------------------------------------------------------- state_dict
def _rank0_saves_worker(rank, world, out_dir, method, strategy):
    model = make_model()
    kw = dict(inv_dtype=F64) if method == "kfac" else dict(precond_dtype=F64)
    precond = KronPreconditioner(model, method=method, grad_worker_fraction=strategy, **kw)
    for step in range(2):
        train_step(model, precond, step, rank, world)
    outcome, seconds = None, 0.0
    if rank == 0:  # the usual pattern: only rank 0 saves
        start = time.monotonic()
        try:
            state = precond.state_dict()
            outcome = ("returned", state)
        except Exception as err:  # noqa: BLE001 - its type is checked
            outcome = ("raised", f"{type(err).__name__}: {err}")
        seconds = time.monotonic() - start
    # The group still works and training goes on, on every rank.
    for step in range(2, 4):
        train_step(model, precond, step, rank, world)
    # The explicit collective works when every rank calls it.
    gathered = precond.gather_state_dict()
    return {"outcome": outcome, "seconds": seconds, "gathered": gathered,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_state_dict_on_rank_zero_only_does_not_hang(method, two_ranks):
    # both methods' runs: scenarios of the shared 2-rank spawn (a hang: its timeout)
    results = results_of(two_ranks, f"rank0_saves/{method}")
    assert len(results) == 2
    kind, value = results[0]["outcome"]
    assert results[0]["seconds"] < 10.0
    if kind == "raised":
        assert value.startswith("ValueError: ") and "gather_state_dict" in value, value
    else:  # a complete checkpoint: it loads into a single process
        model = make_model()
        KronPreconditioner(model, method=method).load_state_dict(value)
    assert torch.equal(results[0]["params"], results[1]["params"])
    # Both ranks gathered the same complete state.
    g0, g1 = results[0]["gathered"], results[1]["gathered"]
    assert set(g0["layers"]) == {"0", "2", "4"} and g0["steps"] == g1["steps"] == 4
    single = KronPreconditioner(make_model(), method=method)
    single.load_state_dict(g0)


# ----------------------------------------------------------------------------- agreement
class Every:
    """A picklable schedule ``step -> n``."""

    def __init__(self, n):
        self.n = n

    def __call__(self, step):
        return self.n

    def __repr__(self):
        return f"Every({self.n})"


DISAGREEMENTS = {
    "factor_update_steps": lambda rank: dict(factor_update_steps=1 + rank),
    "inv_update_steps": lambda rank: dict(inv_update_steps=1 + rank),
    "inv_update_steps-callable": lambda rank: dict(inv_update_steps=Every(1 + rank)),
    "psgd-update-probability": lambda rank: dict(method="psgd", preconditioner_update_probability=0.5 + 0.5 * rank),
    "accumulation_steps": lambda rank: dict(accumulation_steps=1 + rank),
}


def _disagree_worker(rank, world, out_dir):
    out = {}
    for name, kwargs in DISAGREEMENTS.items():
        model = make_model()
        start = time.monotonic()
        try:
            precond = KronPreconditioner(model, **kwargs(rank))
            for step in range(3):
                train_step(model, precond, step, rank, world)
            out[name] = ("no error", time.monotonic() - start)
        except Exception as err:  # noqa: BLE001 - its type is checked
            out[name] = (f"{type(err).__name__}: {err}", time.monotonic() - start)
        probe = torch.ones(1)
        dist.all_reduce(probe)  # the group still works
    return out


def test_settings_that_change_the_collective_schedule_must_agree(two_ranks):
    # a scenario of the shared 2-rank spawn, after the state_dict ones (each refusal is caught
    # on every rank, and the group is checked to work after it)
    results = results_of(two_ranks, "disagree")
    assert len(results) == 2
    for name in DISAGREEMENTS:
        for rank, result in enumerate(results):
            message, seconds = result[name]
            assert message.startswith("ValueError: ") and "differ" in message, (name, rank, message)
            assert seconds < 20.0, (name, rank, seconds)


# ----------------------------------------------------------------------------- the shared 2-rank spawn
# Spawning gloo ranks (each imports torch) costs more than these scenarios: the state_dict ones
# (both methods) and the disagreements share one spawn, one after the other, each building its
# own model and preconditioner as it did alone. The tests below that make process groups of
# their own, or depend on how many a process made, keep spawns of their own.
TWO_RANKS = {
    **{f"rank0_saves/{method}": functools.partial(_rank0_saves_worker, method=method,
                                                  strategy=DistributedStrategy.MEM_OPT)
       for method in ("kfac", "psgd")},
    "disagree": _disagree_worker,  # refusals last
}




@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_workers(run_scenarios, 2, tmp_path_factory.mktemp("w2"), TWO_RANKS, timeout=len(TWO_RANKS) * TIMEOUT)


# ----------------------------------------------------------------------------- sub-groups
def _subgroup_worker(rank, world, out_dir):
    # Two independent data-parallel jobs in one world, on disjoint rank sets.
    sets = [[0, 1, 2, 3], [4, 5, 6, 7]]
    groups = [dist.new_group(members) for members in sets]  # every rank creates both (torch's rule)
    mine = 0 if rank < 4 else 1
    members, group = sets[mine], groups[mine]
    model = make_model()
    precond = KronPreconditioner(model, grad_worker_fraction=DistributedStrategy.HYBRID_OPT,
                                 process_group=group, inv_dtype=F64)
    for step in range(2):
        train_step(model, precond, step, members.index(rank), len(members), group=group)
    return {"job": mine, "grad_workers": precond.grad_workers,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def test_hybrid_opt_in_disjoint_sub_process_groups_does_not_hang(tmp_path):
    # Each sub-group of 4 uses HYBRID_OPT (2 gradient workers, 2 columns: it creates
    # groups); two disjoint ones need a world of 8 -- the one test here above 4 ranks.
    # Spawning 8 processes alone takes up to a minute on two loaded cores; the ranks'
    # own work takes under a second.
    results = run_workers(_subgroup_worker, 8, tmp_path, timeout=180.0)
    for job in (0, 1):
        ranks = [r for r in results if r["job"] == job]
        assert len(ranks) == 4 and all(r["grad_workers"] == 2 for r in ranks)
        assert all(torch.equal(r["params"], ranks[0]["params"]) for r in ranks)
    # Both jobs train the same model on the same data: the same result.
    assert torch.equal(results[0]["params"], results[4]["params"])


# ----------------------------------------------------------------------------- grid groups' names
# torch (2.13) names a group made with ``use_local_synchronization=True`` after its ranks and the
# number of groups the creating process already has: ranks whose group histories differ (here
# ranks 0 and 1 made a pair of their own first) named "the same" grid group differently, never met,
# and the construction hung (torch's default timeout: 30 min).
def _side_group_first_worker(rank, world, out_dir, sub_group):
    if rank in (0, 1):
        side = dist.new_group([0, 1], use_local_synchronization=True)  # e.g. an evaluation pair
        dist.all_reduce(torch.ones(1), group=side)
    members = list(range(4))
    group = dist.new_group(members) if sub_group else None  # every rank makes it (torch's rule)
    if sub_group and rank not in members:
        return None  # outside the job
    model = make_model()
    start = time.monotonic()
    try:
        precond = KronPreconditioner(model, grad_worker_fraction=DistributedStrategy.HYBRID_OPT,
                                     process_group=group, inv_dtype=F64)
        for step in range(2):
            train_step(model, precond, step, rank, 4, group=group)
    except ValueError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start, "grad_workers": precond.grad_workers,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}


def test_hybrid_opt_after_a_local_group_on_some_ranks_builds_and_steps(tmp_path):
    # the whole world: the grid's groups are made by every rank, in one order (names agree)
    results = run_workers(_side_group_first_worker, 4, tmp_path, False, timeout=TIMEOUT)
    assert [r["error"] for r in results] == [None] * 4
    assert all(r["grad_workers"] == 2 for r in results)
    assert all(torch.equal(r["params"], results[0]["params"]) for r in results)


def test_hybrid_opt_sub_group_after_a_local_group_on_some_ranks_is_refused_on_every_rank(tmp_path):
    # a sub-group (rank 4 outside it): the grid's groups can only be made by their members, whose
    # names then differ: refused on every rank of the group, quickly, naming the cause and remedies
    results = run_workers(_side_group_first_worker, 5, tmp_path, True, timeout=TIMEOUT)
    assert results[4] is None
    for rank, result in enumerate(results[:4]):
        message = result["error"]
        assert message is not None, rank
        assert "process groups" in message and "COMM_OPT" in message and "MEM_OPT" in message, message
        assert result["seconds"] < 20.0, (rank, result["seconds"])


# ----------------------------------------------------------------------------- process_group values
def _bad_process_group_worker(rank, world, out_dir):
    pair = dist.new_group([0, 1])  # every rank makes it (torch's rule); rank 2 is not in it
    out = {}
    cases = {"list": [0, 1, 2], "string": "world", "int": 0}
    if rank == 2:
        cases["not a member"] = pair
    for name, value in cases.items():
        try:
            KronPreconditioner(make_model(), process_group=value, inv_dtype=F64)
            out[name] = ("no error", "")
        except Exception as err:  # noqa: BLE001 - its type is checked
            out[name] = (type(err).__name__, str(err))
    return out


def test_a_process_group_of_the_wrong_type_or_without_this_rank_is_refused(tmp_path):
    results = run_workers(_bad_process_group_worker, 3, tmp_path, timeout=TIMEOUT)
    for rank, result in enumerate(results):
        for name in ("list", "string", "int"):
            kind, message = result[name]
            assert kind == "TypeError" and "process_group" in message, (rank, name, kind, message)
    kind, message = results[2]["not a member"]
    assert kind == "ValueError" and "process_group" in message and "rank 2" in message, (kind, message)
