"""Preconditioners built before ``fully_shard`` (FSDP2), on 2 gloo ranks (hard timeouts: ``dist_utils``).

``fully_shard(model)`` replaces each module's parameters with new DTensor parameters. PyTorch's
rule is to build optimizers afterwards, but trainers do it the other way round: Accelerate's
FSDP2 ``prepare()`` takes an optimizer built on the plain model and re-maps its param groups
to the sharded parameters. Before the fix a ``KronPreconditioner`` built first kept the plain
parameters and failed at ``step()`` with ``aten.index_add_.default got mixed torch.Tensor and
DTensor``; a ``WhitenedMuon`` built first stepped nothing, silently (its param groups held the
plain parameters, which no backward reaches any more).

Now ``KronPreconditioner`` re-reads its layers' parameters from their modules at its first step
(or state-dict call) and takes the sharded layout then: its steps are bitwise those of one built
after ``fully_shard``, and match one process on the full batch. What cannot follow refuses
clearly, before anything changes: a ``PreconditionedOptimizer`` whose base optimizer still steps
the replaced parameters, a ``KronPreconditioner`` that stepped before the model was sharded, and
``WhitenedMuon`` (its state, hooks and views are keyed by the parameters it was built on).
DDP keeps the parameters, so wrapping with ``DistributedDataParallel`` after building works.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dist_utils import run_workers
from kron_precond import DistributedStrategy, KronPreconditioner, PreconditionedOptimizer, WhitenedMuon

F64 = torch.float64
WORLD = 2
BATCH = 8
STEPS = 4
LR = 0.05
TOL = 1e-10
SPAWN_TIMEOUT = 300.0
MEM = DistributedStrategy.MEM_OPT

# name -> KronPreconditioner kwargs (kl_clip reads the constructor's lr: the same in every run)
SCENARIOS = {
    "kfac": dict(inv_dtype=F64, inv_update_steps=2, lr=LR),
    # statistics reduced to owners, gradients through the owner exchange (gather / scatter)
    "kfac-mem": dict(inv_dtype=F64, grad_worker_fraction=MEM, assignment_strategy="memory", lr=LR),
    "psgd": dict(method="psgd", precond_dtype=F64),
}
# how the preconditioner meets fully_shard: "after" (PyTorch's order), "before" (the base
# optimizer built after sharding), "accelerate" (a PreconditionedOptimizer built on the plain
# model, its param groups re-mapped to the sharded parameters as Accelerate's prepare() does)
ORDERS = ("after", "before", "accelerate")


def make_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(),
                         nn.Linear(6, 3)).to(F64)


def batch(step: int):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(BATCH, 5, generator=g, dtype=F64), torch.randn(BATCH, 3, generator=g, dtype=F64)


def full_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in model.parameters()]).clone()


def shard(model: nn.Module, world: int, mp_policy=None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for index, module in enumerate(model):
        if isinstance(module, nn.Linear):
            policy = mp_policy if index == 0 and mp_policy is not None else MixedPrecisionPolicy()
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh)


def remap_like_accelerate(optimizer: torch.optim.Optimizer, model: nn.Module, names: dict[int, str]) -> None:
    """``accelerate.utils.fsdp_utils.fsdp2_switch_optimizer_parameters``: each parameter of the
    param groups replaced by the sharded one of the same name."""
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


def train(model, step_fn, rank: int, world: int, steps: int = STEPS, forward=None) -> list[torch.Tensor]:
    trajectory = []
    n = BATCH // world
    for step in range(steps):
        x, y = batch(step)
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        (((forward or model)(x) - y) ** 2).mean().backward()
        step_fn()
        trajectory.append(full_params(model))
    return trajectory


def run_order(order: str, kwargs: dict, rank: int, world: int, mp_policy=None) -> dict:
    model = make_model()
    if mp_policy is not None:  # the next layer reads float64 (registered first in every order)
        model[0].register_forward_hook(lambda module, args, output: output.double())
    names = {id(p): n for n, p in model.named_parameters()}
    if order == "after":
        shard(model, world, mp_policy)
        precond = KronPreconditioner(model, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    elif order == "before":
        precond = KronPreconditioner(model, **kwargs)
        shard(model, world, mp_policy)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    else:
        precond = KronPreconditioner(model, **kwargs)
        wrapped = PreconditionedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5), precond)
        shard(model, world, mp_policy)
        remap_like_accelerate(wrapped, model, names)

    def step():
        if order == "accelerate":
            wrapped.step()
            wrapped.zero_grad()
        else:
            precond.step()
            opt.step()
            opt.zero_grad()

    # before the first step (a trainer resuming before it trains): the sharded layout's state dict,
    # this rank's layers only
    saved_layers = sorted(precond.state_dict()["layers"])
    trajectory = train(model, step, rank, world)
    factors = [getattr(layer.method, name, None) for layer in precond._layers for name in ("a_factor", "g_factor")]
    return {"trajectory": torch.stack(trajectory), "memory": precond.memory_usage(), "saved_layers": saved_layers,
            "sharded": precond._runtime.sharding is not None, "exchange": precond._exchange,
            # K-FAC's factors this rank holds (a sharded model's non-owners hold none)
            "factor_dtypes": {f.dtype for f in factors if f is not None},
            "params_are_dtensors": all(hasattr(p, "full_tensor") for layer in precond._layers
                                       for _, p in layer.params)}


# Built on meta (a model too large to materialize unsharded), then fully_shard and to_empty: the
# state made on meta goes to the device of the materialized parameters in the first forward's
# hooks, before the first step binds the sharded parameters (K-FAC used to fail in the first
# backward: "Tensor on device meta is not on the expected device cpu"; ikfac's first statistics
# were lost, 2.6e-2 away). The same as built after to_empty, bitwise.
META_SCENARIOS = {"kfac": SCENARIOS["kfac"],
                  "ikfac": dict(method="ikfac", inv_dtype=F64, factor_update_steps=2, inv_update_steps=2, lr=LR)}
# built after to_empty (the reference); on meta before fully_shard; on meta after fully_shard
META_ORDERS = ("after-to-empty", "on-meta", "on-meta-sharded")


def materialize(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """``to_empty`` on the CPU, then each parameter's shard of ``values`` (the same on every rank)."""
    from torch.distributed.tensor import distribute_tensor

    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.to_local().copy_(distribute_tensor(values[name], p.device_mesh, p.placements).to_local())


def run_meta(order: str, kwargs: dict, rank: int, world: int, mp_policy=None) -> dict:
    values = {name: p.detach().clone() for name, p in make_model().named_parameters()}
    with torch.device("meta"):
        model = make_model()
    if mp_policy is not None:  # as run_order
        model[0].register_forward_hook(lambda module, args, output: output.double())
    if order == "on-meta":
        precond = KronPreconditioner(model, **kwargs)
        shard(model, world, mp_policy)
        materialize(model, values)
    elif order == "on-meta-sharded":
        shard(model, world, mp_policy)
        precond = KronPreconditioner(model, **kwargs)
        materialize(model, values)
    else:
        shard(model, world, mp_policy)
        materialize(model, values)
        precond = KronPreconditioner(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)

    def step():
        precond.step()
        opt.step()
        opt.zero_grad()

    trajectory = torch.stack(train(model, step, rank, world))
    state = [t for layer in precond._layers for t in vars(layer.method).values() if isinstance(t, torch.Tensor)]
    factors = [getattr(layer.method, "a_factor", None) for layer in precond._layers]
    return {"trajectory": trajectory, "devices": {t.device.type for t in state},
            "factor_dtypes": {f.dtype for f in factors if f is not None},
            "params_are_dtensors": all(hasattr(p, "full_tensor") for layer in precond._layers
                                       for _, p in layer.params)}


def meta_worker(rank: int, world: int, out_dir: str) -> dict:
    """``kfac-bf16``: the first layer's forward in bfloat16 (its gathered copy): the state made on
    meta goes to the CPU in float64, not in the copy's dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out = {}
    for name, kwargs in META_SCENARIOS.items():
        for order in META_ORDERS:
            try:
                out[(name, order)] = run_meta(order, kwargs, rank, world)
            except Exception as err:  # noqa: BLE001 - reported to the test process
                out[(name, order)] = f"{type(err).__name__}: {err}"
    for order in META_ORDERS:
        try:
            out[("kfac-bf16", order)] = run_meta(order, SCENARIOS["kfac"], rank, world,
                                                 MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        except Exception as err:  # noqa: BLE001
            out[("kfac-bf16", order)] = f"{type(err).__name__}: {err}"
    return out


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the test process
        return f"{type(err).__name__}: {err}"
    return None


def one_rank_worker(rank: int, world: int, out_dir: str) -> dict:
    """A one-rank mesh (torchtitan shards at every world size): still DTensors."""
    return {order: run_order(order, SCENARIOS["kfac"], rank, world)["trajectory"] for order in ("after", "before")}


def refusals(rank: int, world: int) -> dict:
    out = {}

    # a PreconditionedOptimizer whose base optimizer still steps the plain parameters (no re-map)
    model = make_model()
    precond = KronPreconditioner(model, lr=LR)
    wrapped = PreconditionedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), precond)
    shard(model, world)
    before = full_params(model)
    ((model(batch(0)[0]) - batch(0)[1]) ** 2).mean().backward()
    out["stale-optimizer"] = (_error(wrapped.step), precond.steps, bool(torch.equal(before, full_params(model))))

    # a KronPreconditioner that stepped on the plain model, then fully_shard
    model = make_model()
    precond = KronPreconditioner(model, lr=LR)
    ((model(batch(0)[0]) - batch(0)[1]) ** 2).mean().backward()
    precond.step()
    model.zero_grad()
    shard(model, world)
    ((model(batch(1)[0]) - batch(1)[1]) ** 2).mean().backward()
    grads = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()]).clone()
    error = _error(precond.step)
    out["stepped-then-sharded"] = (error, precond.steps,
                                   bool(torch.equal(grads, torch.cat([p.grad.to_local().reshape(-1)
                                                                      for p in model.parameters()]))))

    # rank 0's model materialised, the others' still on meta: refused on every rank, naming meta
    if rank == 0:
        model = make_model()
    else:
        with torch.device("meta"):
            model = make_model()
    out["meta-on-some-ranks"] = _error(lambda: KronPreconditioner(model, lr=LR))

    # WhitenedMuon built on the plain model
    for remapped in (False, True):
        model = make_model()
        names = {id(p): n for n, p in model.named_parameters()}
        opt = WhitenedMuon(model, lr=1e-2)
        shard(model, world)
        if remapped:
            remap_like_accelerate(opt, model, names)
        before = full_params(model)
        ((model(batch(0)[0]) - batch(0)[1]) ** 2).mean().backward()
        out[f"whitened-muon{'-remapped' if remapped else ''}"] = (
            _error(opt.step), opt._steps, bool(torch.equal(before, full_params(model))))
    return out


def ddp_runs(rank: int, world: int) -> dict:
    """KronPreconditioner built on the plain model, then DistributedDataParallel: DDP keeps the
    parameters (it broadcasts rank 0's values into them), so nothing is replaced."""
    from torch.nn.parallel import DistributedDataParallel

    out = {}
    for order in ("on-ddp", "before-ddp"):
        model = make_model()
        if order == "on-ddp":
            ddp = DistributedDataParallel(model)
            precond = KronPreconditioner(ddp, **SCENARIOS["kfac"])
        else:
            precond = KronPreconditioner(model, **SCENARIOS["kfac"])
            ddp = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)

        def step(precond=precond, opt=opt):
            precond.step()
            opt.step()
            opt.zero_grad()

        out[order] = torch.stack(train(model, step, rank, world, forward=ddp))
    return out


def submodule_runs(rank: int, world: int) -> dict:
    """A preconditioner on a submodule of a model that ``fully_shard`` wraps only at its root,
    with a bfloat16 policy: no FSDP2 module lies within the preconditioner's model, so the first
    forward's gathered copies cannot be recognised as such. The state keeps the float64 of the
    parameters at rest (it used to take the copies' bfloat16 for the first statistics: 7e-8 off)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for order in ("after", "before"):
        model = make_model()
        model = nn.Sequential(model[:4], *model[4:])  # the first three layers: one submodule
        if order == "after":
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)),
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=F64))
        precond = KronPreconditioner(model[0], **SCENARIOS["kfac"])
        if order == "before":
            fully_shard(model, mesh=init_device_mesh("cpu", (world,)),
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=F64))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)

        def step(precond=precond, opt=opt):
            precond.step()
            opt.step()
            opt.zero_grad()

        trajectory = torch.stack(train(model, step, rank, world, forward=lambda x, model=model: model(x).double()))
        out[order] = (trajectory, {layer.method.a_factor.dtype for layer in precond._layers
                                   if getattr(layer.method, "a_factor", None) is not None})
    return out


def worker(rank: int, world: int, out_dir: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    results: dict = {"runs": {}, "errors": {}}
    for name, kwargs in SCENARIOS.items():
        for order in ORDERS:
            try:
                results["runs"][(name, order)] = run_order(order, kwargs, rank, world)
            except Exception as err:  # noqa: BLE001 - each test reports its own scenario
                results["errors"][(name, order)] = f"{type(err).__name__}: {err}"
    # FSDP2 casts the first layer's weight to bfloat16 for its forward: the state built on the
    # plain float64 weight stays float64 (it does not follow the forward's gathered copy)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for order in ("after", "before"):
        try:
            results["runs"][("kfac-bf16", order)] = run_order(order, SCENARIOS["kfac"], rank, world, policy)
        except Exception as err:  # noqa: BLE001
            results["errors"][("kfac-bf16", order)] = f"{type(err).__name__}: {err}"
    results["refusals"] = refusals(rank, world)
    results["ddp"] = ddp_runs(rank, world)
    results["submodule"] = submodule_runs(rank, world)
    return results


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_workers(worker, WORLD, tmp_path_factory.mktemp("built-before"), timeout=SPAWN_TIMEOUT)


@pytest.fixture(scope="module")
def reference():
    """One process, no process group, the plain model on the full batch."""
    out = {}
    for name, kwargs in SCENARIOS.items():
        model = make_model()
        init = full_params(model)
        precond = KronPreconditioner(model, **kwargs)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)

        def step(precond=precond, opt=opt):
            precond.step()
            opt.step()
            opt.zero_grad()

        out[name] = (init, torch.stack(train(model, step, 0, 1)))
    return out


def _relative(got: torch.Tensor, want: torch.Tensor, init: torch.Tensor) -> float:
    return float(((got - want).norm(dim=-1) / (want - init).norm(dim=-1)).max())


def _run(spawned, rank: int, key):
    assert key not in spawned[rank]["errors"], spawned[rank]["errors"][key]
    return spawned[rank]["runs"][key]


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("order", ["before", "accelerate"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_built_before_fully_shard_steps_as_built_after(spawned, reference, name, order):
    init, want = reference[name]
    for rank in range(WORLD):
        after, got = _run(spawned, rank, (name, "after")), _run(spawned, rank, (name, order))
        assert got["sharded"] and got["params_are_dtensors"]
        assert got["exchange"] == after["exchange"] == (name == "kfac-mem")
        assert torch.equal(got["trajectory"], after["trajectory"]), (name, order, rank)
        assert got["memory"] == after["memory"], (name, order, rank)  # non-owners released the factors
        assert got["saved_layers"] == after["saved_layers"], (name, order, rank)
        assert _relative(got["trajectory"], want, init) <= TOL, (name, order, rank)


def test_mixed_precision_forward_does_not_pull_the_state_to_bfloat16(spawned):
    for rank in range(WORLD):
        after, before = _run(spawned, rank, ("kfac-bf16", "after")), _run(spawned, rank, ("kfac-bf16", "before"))
        assert before["factor_dtypes"] == after["factor_dtypes"] == {F64}
        assert torch.equal(before["trajectory"], after["trajectory"]), rank


def test_preconditioner_on_a_submodule_of_a_model_sharded_at_its_root(spawned):
    for rank in range(WORLD):
        (after, after_dtypes), (before, before_dtypes) = (spawned[rank]["submodule"][o] for o in ("after", "before"))
        assert after_dtypes == before_dtypes == {F64}
        assert torch.equal(before, after), float((before - after).norm() / after.norm())
        assert torch.equal(after, spawned[0]["submodule"]["after"][0])


def test_base_optimizer_left_on_the_plain_parameters_is_refused(spawned):
    for rank in range(WORLD):
        error, steps, unchanged = spawned[rank]["refusals"]["stale-optimizer"]
        assert error is not None and error.startswith("RuntimeError"), error
        assert "fully_shard" in error and "optimizer" in error and "'0'" in error, error
        assert steps == 0 and unchanged


def test_sharded_after_the_first_step_is_refused(spawned):
    for rank in range(WORLD):
        error, steps, grads_unchanged = spawned[rank]["refusals"]["stepped-then-sharded"]
        assert error is not None and error.startswith("RuntimeError"), error
        assert "build KronPreconditioner after fully_shard(model)" in error and "'0'" in error, error
        assert steps == 1 and grads_unchanged


@pytest.mark.parametrize("case", ["whitened-muon", "whitened-muon-remapped"])
def test_whitened_muon_built_before_fully_shard_is_refused(spawned, case):
    for rank in range(WORLD):
        error, steps, unchanged = spawned[rank]["refusals"][case]
        assert error is not None and error.startswith("RuntimeError"), error  # not a silent no-op
        assert "WhitenedMuon" in error and "fully_shard" in error, error
        assert steps == 0 and unchanged
    if case == "whitened-muon":
        assert "'0.weight'" in spawned[0]["refusals"][case][0]


def test_a_model_on_meta_on_some_ranks_only_is_refused_on_every_rank(spawned):
    for rank in range(WORLD):
        error = spawned[rank]["refusals"]["meta-on-some-ranks"]
        assert error is not None and error.startswith("ValueError") and "meta on ranks [1]" in error, error


def test_ddp_wrapped_after_building_matches_built_on_ddp(spawned, reference):
    init, want = reference["kfac"]
    for rank in range(WORLD):
        runs = spawned[rank]["ddp"]
        assert torch.equal(runs["before-ddp"], runs["on-ddp"]), rank
        assert _relative(runs["before-ddp"], want, init) <= TOL


def test_one_rank_mesh_built_before_fully_shard(tmp_path, reference):
    init, want = reference["kfac"]
    runs = run_workers(one_rank_worker, 1, tmp_path, timeout=120)[0]
    assert torch.equal(runs["before"], runs["after"])
    assert _relative(runs["before"], want, init) <= TOL


def _check_meta_runs(runs: dict, reference: dict) -> None:
    for name in [*META_SCENARIOS, "kfac-bf16"]:
        want = runs[(name, "after-to-empty")]
        assert isinstance(want, dict), want
        for order in META_ORDERS[1:]:
            got = runs[(name, order)]
            assert isinstance(got, dict), (name, order, got)  # not an error
            assert got["params_are_dtensors"] and got["devices"] == want["devices"] == {"cpu"}, (name, order, got)
            assert got["factor_dtypes"] == want["factor_dtypes"] == {F64}, (name, order, got)
            assert torch.equal(got["trajectory"], want["trajectory"]), (
                name, order, float((got["trajectory"] - want["trajectory"]).norm() / want["trajectory"].norm()))
    init, want = reference["kfac"]  # materialized with make_model()'s values: one process on the full batch
    assert _relative(runs[("kfac", "on-meta")]["trajectory"], want, init) <= TOL


def test_built_on_meta_before_fully_shard_follows_to_empty_one_rank(tmp_path, reference):
    _check_meta_runs(run_workers(meta_worker, 1, tmp_path, timeout=120)[0], reference)


def test_built_on_meta_follows_to_empty_two_ranks(tmp_path, reference):
    """At several ranks too: the constructor's agreement check compares the settings (no values
    on meta to compare) on the CPU, and every rank trains as one process on the full batch."""
    ranks = run_workers(meta_worker, 2, tmp_path, timeout=180)
    _check_meta_runs(ranks[0], reference)
    for key, got in ranks[1].items():
        assert isinstance(got, dict), (key, got)
        assert torch.equal(got["trajectory"], ranks[0][key]["trajectory"]), key
