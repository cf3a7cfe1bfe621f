"""KronPreconditioner on FSDP2 / HSDP models (DTensor parameters), gloo ranks vs one process.

Oracle: one process, no process group, plain (unsharded) model on the full batch. R ranks
each hold 1/R of the batch; FSDP2's reduce-scatter averages the gradients. After every
step the full parameters are gathered from the shards (``full_tensor``) and compared with
the single-process trajectory by relative displacement ``‖p_R − p_1‖ / ‖p_1 − p_init‖``
≤ 1e-10 (float64 model, float64 decompositions / PSGD factors).

Spawning costs seconds on the 2-core test machine, so each world size is ONE spawned
group that runs every scenario in turn; world 4 runs first and saves DCP checkpoints that
world 2 resumes from. Scenarios cover both gradient paths of ``distributed/sharded.py``:
the all-gather (COMM_OPT, HSDP) and the owner gather/scatter (MEM_OPT on a 1-D mesh).
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

from dist_utils import run_workers
from kron_precond import DistributedStrategy, KronPreconditioner

F64 = torch.float64
MEM = DistributedStrategy.MEM_OPT
BATCH = 8  # divisible by 1, 2 and 4
STEPS = 4
SAVE_AT = 2  # DCP checkpoint after this many steps (world 4), resumed on world 2
BLOCKS = 8  # equal hidden blocks (the memory criterion asks for >= 8)
TOL = 1e-10
SPAWN_TIMEOUT = 420.0

# name -> (KronPreconditioner kwargs, mesh: "1d" or "2x2", reshard_after_forward)
SCENARIOS = {
    "kfac-eigen": (dict(inv_dtype=F64, inv_update_steps=2), "1d", True),
    "kfac-eigen-keep-unsharded": (dict(inv_dtype=F64, factor_update_steps=2), "1d", False),
    "kfac-inverse-mem": (dict(inv_dtype=F64, compute_method="inverse", grad_worker_fraction=MEM,
                              assignment_strategy="memory"), "1d", True),
    "kfac-eigen-mem": (dict(inv_dtype=F64, grad_worker_fraction=MEM, assignment_strategy="memory"), "1d", True),
    "psgd": (dict(method="psgd", precond_dtype=F64), "1d", True),
    "psgd-mem": (dict(method="psgd", precond_dtype=F64, grad_worker_fraction=MEM,
                      assignment_strategy="memory"), "1d", True),
    "kfac-eigen-partly-sharded": (dict(inv_dtype=F64), "1d-partial", True),
}
# HSDP (a 2x2 mesh: the gradients all-gathered) for every method that meets TOL against one
# process on this model, under every strategy. Not here, both at the tolerance of the generated
# suite (test_equivalence.py, 1e-7): SOAP, whose rounding divided by moment_eps reaches ~1e-9, and
# EK-FAC, whose sums taken in another order are amplified by its small damping on these 8-row
# batches (1.3e-6 at damping 1e-3, 1e-9 at 1e-1, alike on HSDP, a 1-D mesh and hand-averaged DDP)
HSDP_METHODS = {
    "kfac": dict(inv_dtype=F64, inv_update_steps=2),
    "ikfac": dict(method="ikfac", inv_dtype=F64, inv_update_steps=2, moment_decay=0.9),
    "shampoo": dict(method="shampoo", inv_dtype=F64, inv_update_steps=2),
    "psgd": dict(method="psgd", precond_dtype=F64),
}
SCENARIOS.update({f"hsdp-{method}-{strategy.name.lower()}": ({**kwargs, "grad_worker_fraction": strategy}, "2x2", True)
                  for method, kwargs in HSDP_METHODS.items() for strategy in DistributedStrategy})
# Saved at world 4; resumed at world 2 on a 1-D mesh (the HSDP one changes topology too).
GATHERED = "kfac-eigen-mem"  # its gather_state_dict() is compared with one process's state
CHECKPOINTED = ("kfac-eigen-mem", "psgd-mem", "kfac-eigen", "hsdp-kfac-comm_opt")
# World 2 runs one scenario per method and gradient path (world 4 runs them all).
WORLD2 = ["kfac-eigen", "kfac-inverse-mem", "psgd", "psgd-mem"]
# Which gradient path each 1-D scenario must take (checked by counting collectives).
OWNER_EXCHANGE = ("kfac-inverse-mem", "kfac-eigen-mem", "psgd-mem")


def make_model() -> nn.Sequential:
    """in (5 -> 6, uneven shards at world 4), 8 equal 6x6 blocks, head (6 -> 3)."""
    torch.manual_seed(7)
    layers = [nn.Linear(5, 6), nn.Tanh()]
    for _ in range(BLOCKS):
        layers += [nn.Linear(6, 6), nn.Tanh()]
    layers.append(nn.Linear(6, 3))
    return nn.Sequential(*layers).to(F64)


def batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(BATCH, 5, generator=g, dtype=F64), torch.randn(BATCH, 3, generator=g, dtype=F64)


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


class Run:
    """Model + preconditioner + SGD; sharded with FSDP2 when ``mesh`` is given."""

    def __init__(self, kwargs: dict, mesh=None, reshard: bool = True, rank: int = 0, world: int = 1,
                 partly: bool = False):
        self.model = make_model()
        self.rank, self.world = rank, world
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard
            linears = [m for m in self.model if isinstance(m, nn.Linear)]
            # partly: the head stays a plain module (its gradient is averaged by hand below)
            for module in linears[:-1] if partly else linears:
                fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
            if not partly:
                fully_shard(self.model, mesh=mesh, reshard_after_forward=reshard)
        self.precond = KronPreconditioner(self.model, **kwargs)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.5)
        self.step_index = 0
        self.trajectory: list[torch.Tensor] = []

    def full_params(self) -> torch.Tensor:
        return flat(p.full_tensor() if hasattr(p, "full_tensor") else p for p in self.model.parameters())

    def step(self) -> None:
        x, y = batch(self.step_index)
        n = BATCH // self.world
        x, y = x[self.rank * n:(self.rank + 1) * n], y[self.rank * n:(self.rank + 1) * n]
        self.opt.zero_grad()
        ((self.model(x) - y) ** 2).mean().backward()
        if self.world > 1:
            from kron_precond.distributed.sharded import is_dtensor
            for p in self.model.parameters():
                if not is_dtensor(p):
                    ORIGINAL_ALL_REDUCE[0](p.grad)
                    p.grad /= self.world
        self.precond.step()
        self.opt.step()
        self.step_index += 1
        self.trajectory.append(self.full_params())

    def run(self, steps: int) -> "Run":
        for _ in range(steps):
            self.step()
        return self


ORIGINAL_ALL_REDUCE = [None]  # the test's own traffic, not counted


def _mesh(kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    if kind == "2x2":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))


def _dcp_state(run: Run) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, optim_sd = get_state_dict(run.model, run.opt)
    return {"model": model_sd, "optim": optim_sd, "precond": run.precond, "step": run.step_index}


def _memory(run: Run) -> int:
    return sum(run.precond.memory_usage().values())


# ----------------------------------------------------------------------------- workers
def world4_worker(rank, world, out_dir):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from dist_utils import CollectiveCounter

    results = {"trajectories": {}, "memory": {}, "errors": {}, "seconds": {}, "calls": {}}
    for name, (kwargs, mesh_kind, reshard) in SCENARIOS.items():
        start = time.perf_counter()
        run = Run(kwargs, _mesh(mesh_kind, world), reshard, rank, world, partly=mesh_kind == "1d-partial")
        with CollectiveCounter() as counter:
            ORIGINAL_ALL_REDUCE[0] = counter.original("all_reduce")
            for _ in range(STEPS):
                run.step()
                if run.step_index == SAVE_AT and name in CHECKPOINTED:
                    counter.enabled = False
                    dcp.save(_dcp_state(run), checkpoint_id=os.path.join(out_dir, f"ckpt-{name}"))
                    counter.enabled = True
        results["calls"][name] = dict(counter.calls)
        results["trajectories"][name] = torch.stack(run.trajectory)
        results["memory"][name] = _memory(run)
        if name == GATHERED:
            results["gathered"] = run.precond.gather_state_dict()
        results["seconds"][name] = time.perf_counter() - start

    # Bad input: tensor-parallel style Shard(1) weight; FSDP2 modules on different meshes.
    mesh = _mesh("1d", world)
    model = make_model()
    model[2].weight = nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Shard(1)]))
    try:
        KronPreconditioner(model)
    except ValueError as err:
        results["errors"]["shard1"] = str(err)
    model = make_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=_mesh("2x2", world)["shard"])
    try:
        KronPreconditioner(model)
    except ValueError as err:
        results["errors"]["meshes"] = str(err)
    dist.barrier()
    return results


def world2_worker(rank, world, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    results = {"trajectories": {}, "resumed": {}, "seconds": {}}
    for name in WORLD2:
        kwargs, mesh_kind, reshard = SCENARIOS[name]
        start = time.perf_counter()
        run = Run(kwargs, _mesh(mesh_kind, world), reshard, rank, world).run(STEPS)
        results["trajectories"][name] = torch.stack(run.trajectory)
        results["seconds"][name] = time.perf_counter() - start
    for name in CHECKPOINTED:
        kwargs, _, reshard = SCENARIOS[name]
        run = Run(kwargs, _mesh("1d", world), reshard, rank, world)
        state = _dcp_state(run)
        dcp.load(state, checkpoint_id=os.path.join(out_dir, f"ckpt-{name}"))
        set_state_dict(run.model, run.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        run.step_index = state["step"]
        results["resumed"][name] = (run.precond.steps, torch.stack(run.run(STEPS - SAVE_AT).trajectory))

    # Unsharded DDP models keep their full, local state_dict; DCP saves and loads it as a
    # Stateful (COMM_OPT: with fewer gradient workers state_dict() refuses a partial state).
    from torch.nn.parallel import DistributedDataParallel
    for method in ("kfac", "psgd"):
        kwargs = dict(method=method)
        model = DistributedDataParallel(make_model())
        precond = KronPreconditioner(model, **kwargs)
        for step in range(SAVE_AT):
            x, y = batch(step)
            ((model(x[rank::world]) - y[rank::world]) ** 2).mean().backward()
            precond.step()
        path = os.path.join(out_dir, f"ddp-{method}")
        dcp.save({"precond": precond}, checkpoint_id=path)
        fresh = KronPreconditioner(DistributedDataParallel(make_model()), **kwargs)
        dcp.load({"precond": fresh}, checkpoint_id=path)
        results[f"ddp-{method}"] = (precond.state_dict(), fresh.state_dict())
    return results


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def reference():
    """Single-process trajectories (plain model, full batch) and preconditioner memory."""
    out = {}
    for name, (kwargs, _, _) in SCENARIOS.items():
        run = Run(kwargs)
        init = run.full_params()
        run.run(STEPS)
        out[name] = (init, torch.stack(run.trajectory), _memory(run))
        if name == GATHERED:
            out["state"] = run.precond.state_dict()
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    start = time.perf_counter()
    four = run_workers(world4_worker, 4, out, timeout=SPAWN_TIMEOUT)
    middle = time.perf_counter()
    two = run_workers(world2_worker, 2, out, timeout=SPAWN_TIMEOUT)
    print(f"\nworld 4: {middle - start:.1f} s, world 2: {time.perf_counter() - middle:.1f} s")
    return {4: four, 2: two}


def _relative(got: torch.Tensor, want: torch.Tensor, init: torch.Tensor) -> float:
    return float(((got - want).norm(dim=-1) / (want - init).norm(dim=-1)).max())


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_matches_single_process_every_step_on_every_rank(spawned, reference, world, name):
    if world == 2 and name not in WORLD2:
        pytest.skip("run at world 4 only (a 2x2 HSDP mesh needs 4 ranks)")
    init, want, _ = reference[name]
    for rank, result in enumerate(spawned[world]):
        got = result["trajectories"][name]
        assert got.shape == want.shape
        assert _relative(got, want, init) <= TOL, (name, world, rank)


@pytest.mark.parametrize("name", CHECKPOINTED)
def test_dcp_saved_on_4_ranks_resumes_on_2(spawned, reference, name):
    init, want, _ = reference[name]
    for result in spawned[2]:
        steps, resumed = result["resumed"][name]
        assert steps == SAVE_AT  # the preconditioner's own counters came back
        # Against the single-process run: the 4-rank steps before the checkpoint reduce in
        # another order than the 2-rank ones after it, so bitwise equality is not expected.
        deviation = _relative(resumed, want[SAVE_AT:], init)
        print(f"{name}: resumed on 2 ranks vs one process: {deviation:.2e}")
        assert deviation <= TOL, name


@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_ddp_state_round_trips_through_dcp(spawned, method):
    def leaves(tree, prefix=""):
        if isinstance(tree, dict):
            for key, value in tree.items():
                yield from leaves(value, f"{prefix}/{key}")
        elif isinstance(tree, (list, tuple)):
            for index, value in enumerate(tree):
                yield from leaves(value, f"{prefix}/{index}")
        else:
            yield prefix, tree

    for result in spawned[2]:
        saved, loaded = (dict(leaves(sd)) for sd in result[f"ddp-{method}"])
        assert saved.keys() == loaded.keys()
        assert saved["/steps"] == SAVE_AT
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, loaded[key]), key
            else:
                assert value == loaded[key], key


def test_gathered_state_equals_single_process_state(spawned, reference):
    want = reference["state"]["layers"]
    for result in spawned[4]:
        got = result["gathered"]["layers"]
        assert got.keys() == want.keys()
        for name, layer in want.items():
            for key in ("a_factor", "g_factor"):
                torch.testing.assert_close(got[name][key], layer[key], rtol=1e-10, atol=1e-14)
            assert got[name]["ready"] == layer["ready"]
            for part in ("A", "G"):  # eigenvalues (eigenvectors are defined up to sign)
                torch.testing.assert_close(got[name]["refreshed"][part][1], layer["refreshed"][part][1],
                                           rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", ["kfac-eigen-mem", "kfac-inverse-mem", "psgd-mem"])
def test_memory_per_rank_shrinks_with_ranks(spawned, reference, name):
    single = reference[name][2]
    per_rank = [result["memory"][name] for result in spawned[4]]
    ratio = max(per_rank) / single
    print(f"{name}: max per-rank state at world 4 = {max(per_rank)} B, world 1 = {single} B, ratio {ratio:.3f}")
    assert ratio <= 0.35
    assert sum(per_rank) <= 1.05 * single  # split, not copied


@pytest.mark.parametrize("name", [n for n, (_, mesh, _) in SCENARIOS.items() if mesh == "1d"])
def test_each_scenario_takes_its_gradient_path(spawned, name):
    calls = spawned[4][0]["calls"][name]
    exchange = name in OWNER_EXCHANGE
    # owner exchange: one gather and one scatter per owner per step; else DTensor all-gathers
    assert (calls.get("gather", 0) > 0 and calls.get("scatter", 0) > 0) == exchange, calls
    # K-FAC's statistics go to owners by dist.reduce, never all-reduced; the only all-reduce
    # is owner-exchange kl_clip's scalar sum, once per step (PSGD: kl_clip is off).
    kfac = name.startswith("kfac")
    assert (calls.get("reduce", 0) > 0) == kfac, calls
    assert calls.get("all_reduce", 0) == (STEPS if kfac and exchange else 0), calls


def test_unsupported_placement_is_named_at_construction(spawned):
    message = spawned[4][0]["errors"]["shard1"]
    assert "2.weight" in message and "Shard(dim=1)" in message


def test_modules_on_different_meshes_are_refused(spawned):
    message = spawned[4][0]["errors"]["meshes"]
    assert "different device meshes" in message and "0.weight" in message and "2.weight" in message
