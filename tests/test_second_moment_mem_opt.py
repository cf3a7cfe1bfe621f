"""``second_moment`` under MEM_OPT / HYBRID_OPT on real gloo processes.

Its moments were placed as if free (compute cost 0.0: every layer on rank 0) and every rank
kept every layer's moment, so MEM_OPT saved nothing. Now each rank owns its share of the
layers and holds the moments of those only; the result is still exactly one process's on
the full batch, and the same on every rank after every step.

Both 4-rank runs (training under MEM_OPT, a one-process checkpoint loaded) share one spawn.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import results_of, run_workers
from kron_precond import DistributedStrategy, KronPreconditioner

F64 = torch.float64
TIMEOUT = 90.0
BATCH = 16
STEPS = 4


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(*[nn.Linear(12, 12) for _ in range(8)]).to(F64)


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def run(model, precond, rank=0, world=1):
    """STEPS steps of SGD on the preconditioned gradient; the parameters after each."""
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(700 + step)
        x = torch.randn(BATCH, 12, generator=g, dtype=F64)
        n = BATCH // world
        model.zero_grad()
        model(x[rank * n:(rank + 1) * n]).square().mean().backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        precond.step()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
        out.append(flat(model))
    return torch.stack(out)


def _worker(rank, world, out_dir, strategy):
    model = make_model()
    precond = KronPreconditioner(model, method="second_moment", grad_worker_fraction=strategy)
    owned = sorted(name for (name, _), r in precond.assignment.owners.items() if r == rank)
    params = run(model, precond, rank, world)
    held = {layer.name: layer.method.moment.numel() for layer in precond._layers}
    return {"owned": owned, "params": params, "held": held, "memory": precond.memory_usage(),
            "holds": {layer.name: precond._holds_state(layer) for layer in precond._layers},
            "state": precond.gather_state_dict()}


def _check(results, reference, world):
    for rank, result in enumerate(results):
        assert len(result["owned"]) == 8 // world, (rank, result["owned"])  # 2 layers each at world 4
        for name, holds in result["holds"].items():
            assert (result["held"][name] > 0) == holds, (rank, name)  # no moment where not held
        # after every step: identical on every rank, and one process's on the full batch
        assert torch.equal(result["params"], results[0]["params"]), rank
        err = ((result["params"] - reference).norm(dim=-1) / reference.norm(dim=-1)).max()
        assert err <= 1e-9, (rank, float(err))
    return results


def test_second_moment_mem_opt_spreads_layers_and_holds_only_its_moments(four_ranks):
    """4 ranks under MEM_OPT (a scenario of the shared 4-rank spawn at the end of the file)."""
    model = make_model()
    one = KronPreconditioner(model, method="second_moment")
    full_bytes = sum(one.memory_usage().values())
    reference = run(model, one)
    results = results_of(four_ranks, "mem_opt")
    assert len(results) == 4
    results = _check(results, reference, 4)
    for rank, result in enumerate(results):
        assert 0 < sum(result["memory"].values()) <= full_bytes / 4, (rank, result["memory"])
    # the gathered state is every layer's, the same on every rank, and one process's
    state = results[1]["state"]
    for rank, result in enumerate(results):
        for name in state["layers"]:
            assert torch.equal(result["state"]["layers"][name]["moment"], state["layers"][name]["moment"]), rank
    fresh = KronPreconditioner(make_model(), method="second_moment")
    fresh.load_state_dict(state)  # a 4-rank gathered state loads on one process
    for layer in fresh._layers:
        got = layer.method.state_dict()
        ref = one.layers[layer.name].method.state_dict()
        assert got["updates"] == ref["updates"] == STEPS
        assert torch.allclose(got["moment"], ref["moment"], rtol=1e-9, atol=0), layer.name


def _load_worker(rank, world, out_dir, state):
    # a 1-process checkpoint loaded on 4 ranks under MEM_OPT: holders take their moments,
    # the others hold none; then a step works and agrees across ranks
    model = make_model()
    precond = KronPreconditioner(model, method="second_moment", grad_worker_fraction=DistributedStrategy.MEM_OPT)
    precond.load_state_dict(state)
    held = {layer.name: layer.method.moment.numel() for layer in precond._layers}
    holds = {layer.name: precond._holds_state(layer) for layer in precond._layers}
    back = precond.gather_state_dict()
    return {"held": held, "holds": holds, "back": back}


def _one_process_checkpoint() -> dict:
    """One process's state after ``run``: what the 4 ranks load."""
    model = make_model()
    one = KronPreconditioner(model, method="second_moment")
    run(model, one)
    return one.state_dict()


def test_second_moment_checkpoint_moves_between_world_sizes(four_ranks):
    """A one-process checkpoint loaded on 4 ranks (a scenario of the shared 4-rank spawn, which
    loads what ``_one_process_checkpoint`` returns there; rebuilt here, the same)."""
    state = _one_process_checkpoint()
    results = results_of(four_ranks, "load")
    assert len(results) == 4
    for rank, result in enumerate(results):
        for name, holds in result["holds"].items():
            assert (result["held"][name] > 0) == holds, (rank, name)
        for name, layer_state in state["layers"].items():
            assert torch.equal(result["back"]["layers"][name]["moment"], layer_state["moment"]), (rank, name)


# ----------------------------------------------------------------------------- the shared spawn
# Spawning gloo ranks (each imports torch) costs more than these scenarios: both 4-rank runs
# share one spawn, one after the other, each building its own model and preconditioner as it
# did alone.
def _four_ranks_worker(rank: int, world: int, out_dir: str, state: dict) -> dict:
    """``{scenario: its result on this rank}``; ``state`` is the checkpoint ``load`` loads."""
    scenarios = {
        "mem_opt": functools.partial(_worker, strategy=DistributedStrategy.MEM_OPT),
        "load": functools.partial(_load_worker, state=state),
    }
    return {name: scenario(rank, world, out_dir) for name, scenario in scenarios.items()}



@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    """Both 4-rank scenarios: per rank, ``{scenario: result}``."""
    return run_workers(_four_ranks_worker, 4, tmp_path_factory.mktemp("w4"), _one_process_checkpoint(),
                       timeout=2 * TIMEOUT)  # what the two spawns it replaces had
