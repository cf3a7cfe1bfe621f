"""WhitenedMuon on FSDP2 / HSDP models (DTensor weights sharded by rows) against one process.

Oracle: one process, no process group, the plain model on the full batch, in float64 (also
Newton-Schulz, so the comparison is not drowned by bfloat16 rounding). R gloo ranks each hold
1/R of the batch; FSDP2's reduce-scatter averages the gradients. After every step the full
weights (``full_tensor``) must equal the one-process weights (relative 1e-10) and be the same
on every rank. The weights' rows do not divide evenly: at 4 ranks the 7-row weight is split
2/2/2/1 and the 3-row one 1/1/1/0 (a rank with no rows at all). A DCP checkpoint written on
4 ranks resumes on 2 and continues the one-process trajectory.

Spawning costs seconds on the 2-core test machine, so each world size is one spawned group
that runs every scenario in turn (at 2 ranks also the fused experts' and the abandoned
iteration's scenarios, after the resumed checkpoint).
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from dist_utils import ranks_identical, results_of, run_workers
from kron_precond import WhitenedMuon
from test_whitened_muon import LR, WD, batches, loss_of, make_net

DIMS = (5, 7, 3)
# the fused scenario's: b is [12, 4], three square [4, 4] parts whose rows the shards split
# otherwise (3/3/3/3 at 4 ranks, 6/6 at 2)
FUSED_DIMS = (5, 4, 12)
STEPS = 5
SAVE_AT = 2  # the world-4 run of SAVED writes a DCP checkpoint after this many steps
SAVED = "input-1d"
TOL = dict(rtol=1e-10, atol=1e-12)
SPAWN_TIMEOUT = 300.0
# name -> (output_side, mesh, fused), every combination; output_side "wide": the output side on
# the wider-output weight alone (a: [7, 5] on DIMS; none on FUSED_DIMS, whose parts are square);
# mesh "1d": FSDP2 over every rank, "2x2": HSDP (replicate, shard), 4 ranks only; fused: b
# stepped as three parts (fused_qkv), on FUSED_DIMS
SIDES = {False: "input", True: "output", "wide": "wide"}
SCENARIOS = {f"{SIDES[side]}-{mesh}{'-fused' if fused else ''}": (side, mesh, fused)
             for side, mesh, fused in itertools.product(SIDES, ("1d", "2x2"), (False, True))}
ONE_DIM = [name for name, (_, mesh, _) in SCENARIOS.items() if mesh == "1d"]


def make_optimizer(net, output_side: bool | str, fused: bool = False) -> WhitenedMuon:
    return WhitenedMuon([net.a, net.b], lr=LR, weight_decay=WD, statistics_every=2, output_side=output_side,
                        fused_qkv=[r"^modules\[1\]$"] if fused else None, ns_dtype=torch.float64)


def weights(net) -> torch.Tensor:
    return torch.cat([(w.full_tensor() if hasattr(w, "full_tensor") else w).detach().reshape(-1)
                      for w in (net.a.weight, net.b.weight)])


def one_process(output_side: bool | str, fused: bool, dims: tuple[int, int, int]) -> list[torch.Tensor]:
    net = make_net(dims=dims)
    opt = make_optimizer(net, output_side, fused)
    trajectory = []
    for x, y in batches(STEPS, dims=dims):
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
        trajectory.append(weights(net))
    return trajectory


def _sharded(mesh_kind: str, world: int, dims: tuple[int, int, int] = DIMS):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = make_net(dims=dims)
    if mesh_kind == "2x2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for module in (net.a, net.b, net):
        fully_shard(module, mesh=mesh)
    return net


def _steps(net, opt, rank: int, world: int, first: int, stop: int = STEPS,
           dims: tuple[int, int, int] = DIMS) -> tuple[list[torch.Tensor], list[bool]]:
    """Steps ``first`` to ``stop`` on this rank's share of each batch: the full weights after
    each, and whether every rank holds the same."""
    import torch.distributed as dist

    trajectory, identical = [], []
    for x, y in batches(STEPS, dims=dims)[first:stop]:
        per = x.shape[0] // world
        opt.zero_grad()
        loss_of(net, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        full = weights(net)
        trajectory.append(full)
        identical.append(ranks_identical(full, world, dist.all_gather))
    return trajectory, identical


def world_worker(rank, world, out_dir, scenarios, checkpoint):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    results = {}
    for name in scenarios:
        output_side, mesh_kind, fused = SCENARIOS[name]
        dims = FUSED_DIMS if fused else DIMS
        net = _sharded(mesh_kind, world, dims)
        opt = make_optimizer(net, output_side, fused)
        sharded = opt._is_sharded(net.a.weight)
        if name == SAVED and world == 4:
            first, same_first = _steps(net, opt, rank, world, 0, SAVE_AT)
            model_sd, optim_sd = get_state_dict(net, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint)
            rest, same_rest = _steps(net, opt, rank, world, SAVE_AT)
            results[name] = (first + rest, same_first + same_rest, sharded)
        else:
            trajectory, identical = _steps(net, opt, rank, world, 0, dims=dims)
            results[name] = (trajectory, identical, sharded)
    if world == 4:
        results["nonfinite"] = _nonfinite_on_one_shard(rank, world)
        results["shard1"] = _tensor_parallel_weight_error(world)
    if world == 2:  # resume the 4-rank checkpoint on 2 ranks
        net = _sharded("1d", world)
        opt = make_optimizer(net, SCENARIOS[SAVED][0])
        model_sd, optim_sd = get_state_dict(net, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        results["resumed"] = _steps(net, opt, rank, world, SAVE_AT)
    dist.barrier()
    return results


def _nonfinite_on_one_shard(rank: int, world: int) -> dict:
    """Two steps, then one whose gradient of ``a`` holds a NaN in the last rank's rows only."""
    import torch.distributed as dist

    net = _sharded("1d", world)
    opt = make_optimizer(net, False)
    _steps(net, opt, rank, world, 0, 2)
    before = [weights(net), opt.state[net.a.weight]["momentum_buffer"].full_tensor().clone()]
    x, y = batches(STEPS, dims=DIMS)[2]
    per = x.shape[0] // world
    opt.zero_grad()
    loss_of(net, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]).backward()
    if rank == world - 1:
        net.a.weight.grad.to_local()[0, 0] = float("nan")
    opt.step()
    after = weights(net)
    return {"before": before, "after": after, "buffer": opt.state[net.a.weight]["momentum_buffer"].full_tensor(),
            "identical": ranks_identical(after, world, dist.all_gather), "a_size": net.a.weight.numel()}


def _tensor_parallel_weight_error(world: int) -> str:
    """A weight sharded by columns (tensor-parallel style) must be refused, naming it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    net = make_net(dims=DIMS)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    net.b.weight = torch.nn.Parameter(distribute_tensor(net.b.weight.detach(), mesh, [Shard(1)]))
    try:
        make_optimizer(net, False)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = tmp_path_factory.mktemp("wmuon_fsdp2")
    checkpoint = str(root / "ckpt")
    out = {4: run_workers(world_worker, 4, root / "w4", list(SCENARIOS), checkpoint, timeout=SPAWN_TIMEOUT)}
    # what the 2-rank spawns it replaces had: this one's, the experts' (twice 240 s), the abandoned iteration's
    out[2] = run_workers(_two_ranks_worker, 2, root / "w2", checkpoint, timeout=SPAWN_TIMEOUT + 2 * 240 + 120)
    return out


def _two_ranks_worker(rank, world, out_dir, checkpoint):
    """Every 2-rank scenario, one after the other, each building its own model and optimizer as
    it did alone: ``world_worker``'s (the one-dimensional meshes, the resumed checkpoint), then the
    fused experts' (``"experts"``, ``"experts_block"``) and the abandoned iteration's
    (``"abandoned"``), defined further down."""
    results = world_worker(rank, world, out_dir, ONE_DIM, checkpoint)
    later = {"experts": _expert_worker, "experts_block": _expert_block_worker, "abandoned": _abandoning_worker}
    assert not results.keys() & later.keys()
    return {**results, **{name: scenario(rank, world, out_dir) for name, scenario in later.items()}}



@pytest.fixture(scope="module")
def reference():
    return {(side, fused): one_process(side, fused, FUSED_DIMS if fused else DIMS)
            for side, _, fused in SCENARIOS.values()}


def test_the_fused_scenario_steps_otherwise_than_its_weight_whole(reference):
    """The fused scenario tests the parts: on its net, b stepped whole ends elsewhere."""
    whole = one_process(True, False, FUSED_DIMS)
    assert (reference[(True, True)][-1] - whole[-1]).abs().max() > 1e-6


@pytest.mark.parametrize("world,name", [(4, name) for name in SCENARIOS] + [(2, name) for name in ONE_DIM])
def test_every_step_matches_one_process_on_every_rank(spawned, reference, world, name):
    output_side, _, fused = SCENARIOS[name]
    want = reference[(output_side, fused)]
    start = weights(make_net(dims=FUSED_DIMS if fused else DIMS))
    assert (want[-1] - start).abs().max() > 1e-3  # the steps did something
    for rank, result in enumerate(spawned[world]):
        trajectory, identical, sharded = result[name]
        assert sharded, "the weights were not sharded: the test would not test FSDP2"
        assert all(identical), f"rank {rank}: ranks differ"
        for step, (got, expected) in enumerate(zip(trajectory, want)):
            torch.testing.assert_close(got, expected, **TOL,
                                       msg=lambda m, rank=rank, step=step: f"rank {rank}, step {step}: {m}")


def test_a_checkpoint_saved_on_4_ranks_resumes_on_2(spawned, reference):
    want = reference[(SCENARIOS[SAVED][0], SCENARIOS[SAVED][2])][SAVE_AT:]
    for rank, result in enumerate(spawned[2]):
        trajectory, identical = result["resumed"]
        assert all(identical) and len(trajectory) == len(want), f"rank {rank}"
        for got, expected in zip(trajectory, want):
            torch.testing.assert_close(got, expected, **TOL)


def test_a_nan_in_one_shard_skips_that_weight_on_every_rank(spawned):
    for rank, result in enumerate(spawned[4]):
        r = result["nonfinite"]
        n = r["a_size"]
        assert r["identical"], f"rank {rank}: ranks differ"
        assert torch.isfinite(r["after"]).all()
        assert torch.equal(r["after"][:n], r["before"][0][:n])  # a: untouched
        assert torch.equal(r["buffer"], r["before"][1])  # and its momentum
        assert not torch.equal(r["after"][n:], r["before"][0][n:])  # b stepped


def test_a_weight_sharded_by_columns_is_refused_naming_it(spawned):
    assert "modules[1].weight" in spawned[4][0]["shard1"] and "Shard(dim=1)" in spawned[4][0]["shard1"]


# ---------------------------------------------------------------------- sharded fused experts
EXPERTS = 4


def _expert_batches():
    """Expert 3 gets no token on steps 2 and 3; expert 0's output weight overflows on step 4."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(5):
        x, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)
        scores = torch.rand(8, EXPERTS, generator=g)
        if step in (2, 3):
            scores[:, 3] = -1.0
        out.append((x, y, scores.topk(2, 1).indices, torch.rand(8, 2, generator=g, dtype=torch.float64) + 0.1))
    return out


def _expert_run(shard: bool, rank: int = 0, world: int = 1) -> dict:
    from kron_precond import RoutedExperts

    torch.manual_seed(0)
    model = RoutedExperts(EXPERTS, 4, 4, bias=False, dtype=torch.float64)
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = WhitenedMuon([model], lr=LR, weight_decay=WD, statistics_every=1, output_side=False,
                       ns_dtype=torch.float64)
    trajectory = []
    for step, (x, y, index, weights) in enumerate(_expert_batches()):
        opt.zero_grad()
        (model(x, index, weights) - y).square().mean().backward()  # the full batch on every rank
        if step == 4:
            grad = model.down_weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if not shard or rank == 0:  # expert 0 lives on rank 0's shard
                local[0, 0, 0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        trajectory.append([(w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()
                           for w in (model.up_weight, model.down_weight)])
    count = opt.state[model.down_weight]["nonfinite_steps"]
    return {"trajectory": trajectory, "nonfinite": int(count.full_tensor() if hasattr(count, "full_tensor") else count),
            "sharded": opt._is_sharded(model.up_weight)}


def _expert_worker(rank, world, out_dir):
    return _expert_run(True, rank, world)


def test_sharded_fused_experts_leave_an_idle_or_non_finite_expert_alone_as_one_process(spawned):
    """FSDP2 splits a fused experts weight between experts: each rank judges its own experts
    (an expert with no token keeps its weight and momentum, one with a non-finite gradient
    too, the others step), and the non-finite count is the weight's on every rank: the
    one-process result, step by step. (2 ranks: a scenario of the shared 2-rank spawn.)"""
    single = _expert_run(False)
    ranks = results_of(spawned[2], "experts")
    assert len(ranks) == 2 and ranks[0]["sharded"]
    for step, expected in enumerate(single["trajectory"]):
        for run in ranks:
            for got, want in zip(run["trajectory"][step], expected):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert [run["nonfinite"] for run in ranks] == [single["nonfinite"]] * 2 == [1, 1]
    moved = single["trajectory"]
    assert torch.equal(moved[2][0][3], moved[1][0][3]) and torch.equal(moved[3][0][3], moved[1][0][3])



class _ExpertsBlock(torch.nn.Module):
    """Fused experts behind a projection: FSDP2 can wrap the experts module on its own."""

    def __init__(self) -> None:
        super().__init__()
        from kron_precond import RoutedExperts

        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.experts = RoutedExperts(EXPERTS, 4, 4, bias=False, dtype=torch.float64)

    def forward(self, x, index, weights):
        return self.experts(torch.tanh(self.inp(x)), index, weights)


def _expert_block_run(rank: int = 0, world: int = 1) -> list:
    model = _ExpertsBlock()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.experts, mesh=mesh, reshard_after_forward=True)  # gathered again for the backward
        fully_shard(model, mesh=mesh)
    opt = WhitenedMuon(model, lr=LR, statistics_every=1, output_side=True, ns_dtype=torch.float64)
    trajectory = []
    for x, y, index, weights in _expert_batches():
        opt.zero_grad()
        (model(x, index, weights) - y).square().mean().backward()  # the full batch on every rank
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        trajectory.append([(w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()
                           for w in (model.experts.up_weight, model.experts.down_weight)])
    return trajectory


def _expert_block_worker(rank, world, out_dir):
    return _expert_block_run(rank, world)


def test_an_experts_module_fsdp2_wraps_on_its_own_is_whitened_on_both_sides_as_one_process(spawned):
    """Wrapped on its own and resharded after its forward, the experts module's weights are
    gathered again for the backward by FSDP2's hook on its output, which the output side's
    rows (read through the down weight) wait for: the one-process result, step by step.
    (2 ranks: a scenario of the shared 2-rank spawn.)"""
    single = _expert_block_run()
    runs = results_of(spawned[2], "experts_block")
    assert len(runs) == 2
    for run in runs:
        for step, expected in enumerate(single):
            for got, want in zip(run[step], expected):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------- an abandoned iteration
ABANDONED_AT = 2  # a statistics step (statistics_every=2; K-FAC gathers every step)


def _abandoning_optimizer(net, kind: str):
    if kind == "wmuon":
        return make_optimizer(net, False)
    from kron_precond import KronPreconditioner, PreconditionedOptimizer

    precond = KronPreconditioner(net, method="kfac", inv_dtype=torch.float64, kl_clip=None)
    return PreconditionedOptimizer(torch.optim.SGD(net.parameters(), lr=LR), precond)


def _abandoning_run(kind: str, net, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """``STEPS`` steps with ``zero_grad(set_to_none=False)``; before step ``ABANDONED_AT`` a
    backward on another batch (ten times the inputs) whose step never comes -- what a
    ``GradScaler`` skip leaves -- and a ``zero_grad()``: its statistics must be dropped."""
    opt = _abandoning_optimizer(net, kind)
    trajectory = []
    data = batches(STEPS + 1, dims=DIMS)
    per = data[0][0].shape[0] // world
    rows = slice(rank * per, (rank + 1) * per)
    for step, (x, y) in enumerate(data[:STEPS]):
        opt.zero_grad(set_to_none=False)
        if step == ABANDONED_AT:
            x_skipped, y_skipped = data[STEPS]
            loss_of(net, 10 * x_skipped[rows], y_skipped[rows]).backward()
            opt.zero_grad(set_to_none=False)
        loss_of(net, x[rows], y[rows]).backward()
        opt.step()
        trajectory.append(weights(net))
    return trajectory


def _abandoning_worker(rank, world, out_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {kind: _abandoning_run(kind, _sharded("1d", world), rank, world) for kind in ("wmuon", "kfac")}


def test_an_abandoned_iteration_is_dropped_with_zero_grad_to_zeros(spawned):
    """FSDP2 accumulates a backward's gradient into the local shard of the gradient DTensor in
    place, leaving the DTensor's own version unchanged: with ``zero_grad(set_to_none=False)``
    (the gradient DTensor kept) the backward of an abandoned iteration went unseen, and its
    statistics entered the next step (2e-1 off one process). Both WhitenedMuon and
    PreconditionedOptimizer must drop them, as one process does. (2 ranks: a scenario of the
    shared 2-rank spawn.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = {kind: _abandoning_run(kind, make_net(dims=DIMS)) for kind in ("wmuon", "kfac")}
    ranks = results_of(spawned[2], "abandoned")
    assert len(ranks) == 2
    start = weights(make_net(dims=DIMS))
    for kind, expected in want.items():
        assert (expected[-1] - start).abs().max() > 1e-3  # the steps did something
        for rank, result in enumerate(ranks):
            for step, (got, reference) in enumerate(zip(result[kind], expected)):
                torch.testing.assert_close(got, reference, **TOL,
                                           msg=lambda m, k=kind, r=rank, s=step: f"{k}, rank {r}, step {s}: {m}")
