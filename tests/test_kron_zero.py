"""``ZeroRedundancyOptimizer(optimizer_class=Kron)``: each rank's ``Kron`` steps its partition,
and ZeRO's ``load_state_dict`` writes the saved entries straight into each rank's state (no
``Kron.load_state_dict``): the step must take them as a checkpoint holds them (the factors by
position) and with the 0-dim counters ZeRO moves to the CPU, the update schedule's counters
read from the entries as a torch.distributed.checkpoint load reads them."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import run_workers
from kron_precond import Kron

SETTINGS = dict(lr=1e-2, precond_dtype=torch.float64, preconditioner_update_probability=0.5,
                precond_update="procrustes")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, generator=gen, dtype=torch.float64), torch.randn(8, 3, generator=gen, dtype=torch.float64)


def _train(model, opt, steps):
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


def _zero_worker(rank, world, out_dir):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=Kron, **SETTINGS)
    _train(model, opt, range(3))
    saved_local = {id_: [q.clone() for q in entry["Q"]] for id_, entry in
                   ((i, opt.optim.state[p]) for i, p in enumerate(model.parameters()) if p in opt.optim.state)}
    opt.consolidate_state_dict(to=0)
    path = f"{out_dir}/zero.pt"
    if rank == 0:
        torch.save(opt.state_dict(), path)
    torch.distributed.barrier()

    resumed = _model()
    resumed.load_state_dict(model.state_dict())
    fresh = ZeroRedundancyOptimizer(resumed.parameters(), optimizer_class=Kron, **SETTINGS)
    fresh.load_state_dict(torch.load(path, weights_only=False))
    def factors(entry):  # as ZeRO wrote it: by position (a checkpoint's form)
        q = entry["Q"]
        return [q[str(k)].clone() for k in range(len(q))] if isinstance(q, dict) else [t.clone() for t in q]

    loaded = {i: factors(fresh.optim.state[p]) for i, p in enumerate(resumed.parameters()) if p in fresh.optim.state}
    _train(resumed, fresh, range(3, 5))
    _train(model, opt, range(3, 5))  # the uninterrupted run
    return {"saved": saved_local, "loaded": loaded,
            "params": [p.detach().clone() for p in resumed.parameters()],
            "uninterrupted": [p.detach().clone() for p in model.parameters()],
            "counters": (fresh.optim.steps, opt.optim.steps)}


@pytest.mark.parametrize("world", [2])
def test_a_zero_checkpoint_loads_its_factors_and_steps_on(tmp_path, world):
    results = run_workers(_zero_worker, world, tmp_path, timeout=120)
    for result in results:
        assert result["loaded"].keys() == result["saved"].keys() and result["loaded"]
        for key, factors in result["saved"].items():
            for a, b in zip(factors, result["loaded"][key]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    for result in results[1:]:  # ZeRO broadcasts each partition's parameters: ranks identical
        for a, b in zip(result["params"], results[0]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the schedule's counters ride in the entries ZeRO writes in: the resumed run is the
    # uninterrupted one (probe vectors and update decisions follow the counters)
    for result in results:
        assert result["counters"][0] == result["counters"][1] == 5
        for a, b in zip(result["params"], result["uninterrupted"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
