"""WhitenedMuon's checkpoint checks on an FSDP2 model (2 gloo ranks, hard timeouts: ``dist_utils``).

A sharded model's moments (``momentum_buffer``, AdamW's ``exp_avg`` / ``exp_avg_sq``) are
DTensors: each rank holds its own rows. The load checked only their global shape, so a
checkpoint whose shard on one rank held NaN (a diverged run's, a corrupt file's) loaded on
every rank without a word, where one process raises ``ValueError``, and the next step made
every weight NaN. Each rank must check its own shards, and the ranks agree before anything
changes: every rank raises ``ValueError`` (naming the rank that rejected it, and there why),
none changes its state, and a good checkpoint still loads on every rank.
"""
from __future__ import annotations

import copy
import warnings

import torch

from dist_utils import ranks_identical, run_workers
from kron_precond import WhitenedMuon
from test_whitened_muon import LR, WD, batches, loss_of, make_net

DIMS = (5, 7, 3)  # a's 7 rows: 4 on rank 0, 3 on rank 1
WORLD = 2


def _local(value):
    return (value.to_local() if hasattr(value, "to_local") else value).detach().clone()


def _state(opt) -> dict:
    """This rank's optimizer state: its shards of the moments, its counters."""
    return {(i, j, key): _local(value) if torch.is_tensor(value) else value
            for i, group in enumerate(opt.param_groups) for j, p in enumerate(group["params"])
            for key, value in opt.state.get(p, {}).items()} | {"steps": opt._steps}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def _steps(net, opt, rank: int, steps: range) -> None:
    data = batches(max(steps) + 1, dims=DIMS)
    for step in steps:
        x, y = data[step]
        per = x.shape[0] // WORLD
        opt.zero_grad()
        loss_of(net, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()


def _load_worker(rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    net = make_net(dims=DIMS, bias=(True, False))  # a.bias: AdamW's moments, sharded 4 / 3
    mesh = init_device_mesh("cpu", (world,))
    for module in (net.a, net.b, net):
        fully_shard(module, mesh=mesh)
    opt = WhitenedMuon(net, lr=LR, weight_decay=WD, statistics_every=2, ns_dtype=torch.float64)
    _steps(net, opt, rank, range(2))
    saved = copy.deepcopy(get_optimizer_state_dict(net, opt))
    _steps(net, opt, rank, range(2, 4))  # state that differs from the checkpoint's
    before = _state(opt)

    def load(item: str, on_rank: int, value: float) -> str | None:
        state = copy.deepcopy(saved)
        key = next(k for k, entry in state["state"].items() if item in entry)
        if rank == on_rank:
            state["state"][key][item].to_local().view(-1)[0] = value
        try:
            set_optimizer_state_dict(net, opt, state)
        except ValueError as err:
            return str(err)
        return None

    results = {"nan_momentum": load("momentum_buffer", 1, float("nan")),
               "negative_exp_avg_sq": load("exp_avg_sq", 0, -1.0),
               "inf_exp_avg": load("exp_avg", 1, float("inf"))}
    results["unchanged"] = _same(_state(opt), before)
    results["good"] = load("momentum_buffer", 1, 0.0)  # a finite value: a checkpoint to load
    results["loaded_steps"] = opt._steps
    _steps(net, opt, rank, range(4, 5))
    weights = torch.cat([p.full_tensor().detach().reshape(-1) for p in net.parameters()])
    results["finite"] = bool(torch.isfinite(weights).all())
    results["identical"] = ranks_identical(weights, world, dist.all_gather)
    return results


def test_a_shard_rejected_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_workers(_load_worker, WORLD, tmp_path, timeout=120)
    cases = {"nan_momentum": (1, "momentum_buffer: holds NaN or infinite values"),
             "negative_exp_avg_sq": (0, "exp_avg_sq: holds negative values"),
             "inf_exp_avg": (1, "exp_avg: holds NaN or infinite values")}
    loaded = {f"{case} (rejected on rank {on_rank})": [rank for rank, result in enumerate(results)
                                                       if result[case] is None]
              for case, (on_rank, _) in cases.items()}
    assert not any(loaded.values()), f"the ranks that loaded each rejected checkpoint: {loaded}"
    for case, (on_rank, reason) in cases.items():
        for rank, result in enumerate(results):
            assert f"rejected on rank(s) [{on_rank}]" in result[case], (case, rank, result[case])
            assert (reason in result[case]) == (rank == on_rank), (case, rank, result[case])
    for rank, result in enumerate(results):
        assert result["unchanged"], f"rank {rank}: a rejected load changed the optimizer's state"
        assert result["good"] is None, f"rank {rank}: {result['good']}"
        assert result["loaded_steps"] == 2
        assert result["finite"] and result["identical"], f"rank {rank}"
