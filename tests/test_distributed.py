"""KronPreconditioner on 1-4 gloo ranks versus one process.

Oracle: one process on the full batch (no process group). R ranks each hold 1/R of the
same batch and average their gradients (real ``DistributedDataParallel`` in the
configurations marked ``ddp``, a manual all-reduce otherwise); DESIGN.md §4 says the
preconditioned result must not depend on R.

Tolerances (relative, on the parameter *displacement* ``‖p_R − p_1‖ / ‖p_1 − p_init‖``
after every step, which is far stricter than relative to ``‖p‖``):

* float64 models (``inv_dtype`` / ``precond_dtype`` float64): 1e-10;
* the float32 model (library defaults, float32 decompositions): 1e-5.

Every rank must hold bitwise-identical parameters after every step (all_gather).

Spawning is slow (~2-4 s per process group on the 2-core test machines), so each world
size is ONE spawned group whose ranks run every scenario in turn (each configuration
builds a fresh model and preconditioner); the results come back to this process,
cached per module, and the individual tests below only compare numbers. World sizes
run in the order 4, 2, 3, 1 because checkpoints flow 4 → 2 and 2 → {3, 1}. A rank that
raises or hangs fails the tests of its world size within ``SPAWN_TIMEOUT`` seconds
(see ``dist_utils``).
"""
from __future__ import annotations

import math
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import CollectiveCounter, average_gradients_by_hand, ranks_identical, run_workers
from kron_precond import DistributedStrategy, KronPreconditioner

COMM, HYBRID, MEM = DistributedStrategy.COMM_OPT, DistributedStrategy.HYBRID_OPT, DistributedStrategy.MEM_OPT
F64, F32 = torch.float64, torch.float32
BATCH = 24  # divisible by 1, 2, 3 and 4
STEPS = 6
TOL = {F64: 1e-10, F32: 1e-5}
WORLD_SIZES = (1, 2, 3, 4)
SPAWN_TIMEOUT = 150.0
# A float grad_worker_fraction that divides each world size.
FLOAT_FRACTION = {1: 1.0, 2: 0.5, 3: 1 / 3, 4: 0.5}
# Checkpoints: (saved by, resumed on).
RESUME_PAIRS = ((2, 3), (2, 1), (4, 2))
SAVE_AT = 4  # steps before the checkpoint
RESUME_STEPS = 4  # steps after it


# ----------------------------------------------------------------------------- setup
def make_model(dtype=F64) -> nn.Module:
    """Conv2d + Linear layers and a LayerNorm (not a K-FAC layer; PSGD registers it)."""
    torch.manual_seed(1234)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(),        # 0: A 19x19, G 4x4
        nn.Conv2d(4, 4, 3, stride=2, bias=False),        # 2: A 36x36, G 4x4  -> [4, 2, 2]
        nn.Flatten(), nn.LayerNorm(16),                  # 4: unregistered for K-FAC
        nn.Linear(16, 10), nn.Tanh(),                    # 5: A 17x17, G 10x10
        nn.Linear(10, 3))                                # 7: A 11x11, G 3x3
    return model.to(dtype)


def batch(step: int, dtype=F64):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 2, 6, 6, generator=g)
    y = torch.randn(BATCH, 3, generator=g)
    return x.to(dtype), y.to(dtype)


def shard(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = tensor.shape[0] // world
    return tensor[rank * n:(rank + 1) * n]


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# name -> settings. ``kw`` goes to KronPreconditioner ("float" = FLOAT_FRACTION[world]).
CONFIGS: dict[str, dict] = {
    "kfac-eigen-comm-ddp": dict(kw=dict(), ddp=True),
    "kfac-eigen-comm-cap0-sym": dict(kw=dict(allreduce_bucket_cap_mb=0, symmetry_aware=True)),
    "kfac-eigen-hybrid-tiny-f2-i3": dict(kw=dict(grad_worker_fraction=HYBRID, allreduce_bucket_cap_mb=1e-4,
                                                 factor_update_steps=2, inv_update_steps=3)),
    "kfac-eigen-mem-tiny-sym": dict(kw=dict(grad_worker_fraction=MEM, allreduce_bucket_cap_mb=1e-4,
                                            symmetry_aware=True)),
    "kfac-eigen-float-fraction": dict(kw=dict(grad_worker_fraction="float")),
    "kfac-eigen-nocolocate-memory": dict(kw=dict(colocate_factors=False, assignment_strategy="memory",
                                                 allreduce_bucket_cap_mb=0)),
    "kfac-inverse-comm-tiny-sym-i2": dict(kw=dict(compute_method="inverse", symmetry_aware=True,
                                                  allreduce_bucket_cap_mb=1e-4, inv_update_steps=2)),
    "kfac-inverse-mem-f2-i2": dict(kw=dict(compute_method="inverse", grad_worker_fraction=MEM,
                                           factor_update_steps=2, inv_update_steps=2, kl_clip=None)),
    "kfac-inverse-hybrid-memory-cap0": dict(kw=dict(compute_method="inverse", grad_worker_fraction=HYBRID,
                                                    assignment_strategy="memory", allreduce_bucket_cap_mb=0)),
    "kfac-eigen-hybrid-float32": dict(kw=dict(grad_worker_fraction=HYBRID), dtype=F32),
    "psgd-comm-ddp": dict(kw=dict(method="psgd"), ddp=True),
    "psgd-mem-cap0": dict(kw=dict(method="psgd", grad_worker_fraction=MEM, allreduce_bucket_cap_mb=0)),
    "psgd-hybrid-tiny-memory-momentum": dict(kw=dict(
        method="psgd", grad_worker_fraction=HYBRID, allreduce_bucket_cap_mb=1e-4, assignment_strategy="memory",
        momentum_into_precond_update=True, precond_init_scale=None)),
    "psgd-float-fraction-p05": dict(kw=dict(method="psgd", grad_worker_fraction="float",
                                            preconditioner_update_probability=0.5)),
    # EK-FAC: bases every inv_update_steps, s re-estimated on every statistics step
    "ekfac-comm-cap0-sym-i2": dict(kw=dict(method="ekfac", inv_update_steps=2, allreduce_bucket_cap_mb=0,
                                           symmetry_aware=True)),
    "ekfac-hybrid-tiny-f2-i3": dict(kw=dict(method="ekfac", grad_worker_fraction=HYBRID, factor_update_steps=2,
                                            inv_update_steps=3, allreduce_bucket_cap_mb=1e-4)),
    "ekfac-mem-tiny-sym-i3": dict(kw=dict(method="ekfac", grad_worker_fraction=MEM, inv_update_steps=3,
                                          allreduce_bucket_cap_mb=1e-4, symmetry_aware=True)),
    "ekfac-float-fraction-i4": dict(kw=dict(method="ekfac", grad_worker_fraction="float", inv_update_steps=4)),
    "ekfac-nocolocate-memory-i3": dict(kw=dict(method="ekfac", colocate_factors=False,
                                               assignment_strategy="memory", inv_update_steps=3)),
    "ekfac-hybrid-float32-i3": dict(kw=dict(method="ekfac", grad_worker_fraction=HYBRID, inv_update_steps=3),
                                    dtype=F32),
    # Shampoo: statistics from the (averaged) gradients, nothing reduced; stale roots (i3) with
    # a larger epsilon; diagonal sides (max_factor_size=8); split placement; float32 (the
    # relative epsilon bounds how much float32 rounding the roots amplify)
    "shampoo-comm-ddp": dict(kw=dict(method="shampoo"), ddp=True),
    "shampoo-hybrid-f2-i3-grafting": dict(kw=dict(method="shampoo", grad_worker_fraction=HYBRID,
                                                  factor_update_steps=2, inv_update_steps=3, grafting=True,
                                                  epsilon=1e-2, allreduce_bucket_cap_mb=1e-4)),
    "shampoo-mem-diagonal-cap0": dict(kw=dict(method="shampoo", grad_worker_fraction=MEM, max_factor_size=8,
                                              allreduce_bucket_cap_mb=0, exponent=0.125)),
    "shampoo-float-fraction": dict(kw=dict(method="shampoo", grad_worker_fraction="float")),
    "shampoo-nocolocate-memory": dict(kw=dict(method="shampoo", colocate_factors=False,
                                              assignment_strategy="memory")),
    "shampoo-hybrid-float32": dict(kw=dict(method="shampoo", grad_worker_fraction=HYBRID, epsilon=1e-2),
                                   dtype=F32),
}

# Checkpoint configurations (inverse refreshes every 3 steps, so the resume at step 4
# lands mid-interval: the resumed state must be usable without a refresh).
CKPT_CONFIGS: dict[str, dict] = {
    "kfac-comm": dict(kw=dict(factor_update_steps=2, inv_update_steps=3)),
    "kfac-mem": dict(kw=dict(grad_worker_fraction=MEM, inv_update_steps=3, symmetry_aware=True)),
    "kfac-hybrid": dict(kw=dict(grad_worker_fraction=HYBRID, compute_method="inverse", inv_update_steps=3)),
    "psgd-comm": dict(kw=dict(method="psgd", momentum_into_precond_update=True,
                              preconditioner_update_probability=0.5)),
    "psgd-mem": dict(kw=dict(method="psgd", grad_worker_fraction=MEM, precond_init_scale=None,
                             preconditioner_update_probability=0.5)),
    # saved mid-interval (bases at steps 0 and 3): the resumed s is used before any basis refresh
    "ekfac-mem": dict(kw=dict(method="ekfac", grad_worker_fraction=MEM, inv_update_steps=3)),
    "ekfac-hybrid-sym": dict(kw=dict(method="ekfac", grad_worker_fraction=HYBRID, inv_update_steps=3,
                                     symmetry_aware=True)),
    # Shampoo's L / R travel in the state (COMM_OPT with split placement: every rank holds
    # all of them; MEM / HYBRID: gathered from each layer's owner column)
    "shampoo-comm-nocolocate": dict(kw=dict(method="shampoo", colocate_factors=False, inv_update_steps=3,
                                            epsilon=1e-2)),
    "shampoo-mem": dict(kw=dict(method="shampoo", grad_worker_fraction=MEM, inv_update_steps=3,
                                factor_update_steps=2, epsilon=1e-2, grafting=True)),
    "shampoo-hybrid": dict(kw=dict(method="shampoo", grad_worker_fraction=HYBRID, inv_update_steps=3,
                                   epsilon=1e-2)),
}


def precond_kwargs(cfg: dict, world: int) -> dict:
    kw = dict(cfg["kw"])
    if kw.get("grad_worker_fraction") == "float":
        kw["grad_worker_fraction"] = FLOAT_FRACTION[world]
    if cfg.get("dtype", F64) == F64:
        kw.setdefault("precond_dtype" if kw.get("method") == "psgd" else "inv_dtype", F64)
    return kw


class Trainer:
    """One model + preconditioner + SGD on this rank's shard of each step's batch.

    ``collectives`` holds the unpatched ``all_reduce`` / ``all_gather`` used for the
    test's own traffic (gradient averaging, the identical-parameters check), so that a
    ``CollectiveCounter`` sees the library's calls only.
    """

    def __init__(self, cfg: dict, world: int = 1, rank: int = 0, collectives: dict | None = None,
                 **overrides) -> None:
        self.cfg, self.world, self.rank = cfg, world, rank
        self.dtype = cfg.get("dtype", F64)
        self.model = make_model(self.dtype)
        self.net = self.model
        if cfg.get("ddp") and dist.is_available() and dist.is_initialized():
            from torch.nn.parallel import DistributedDataParallel
            self.net = DistributedDataParallel(self.model)
        self.initial = flat_params(self.model)
        kw = precond_kwargs(cfg, world)
        kw.update(overrides)
        self.precond = KronPreconditioner(self.net, **kw)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.5)
        self.collectives = collectives or {"all_reduce": getattr(dist, "all_reduce", None),
                                           "all_gather": getattr(dist, "all_gather", None)}
        self.step_index = 0
        self.trajectory: list[torch.Tensor] = []
        self.identical: list[bool] = []

    def forward_backward(self) -> None:
        x, y = batch(self.step_index, self.dtype)
        x, y = shard(x, self.rank, self.world), shard(y, self.rank, self.world)
        self.opt.zero_grad()
        loss = ((self.net(x) - y) ** 2).mean()
        loss.backward()

    def average_gradients(self) -> None:
        if self.world == 1 or self.net is not self.model:  # DDP has averaged them
            return
        average_gradients_by_hand(list(self.model.parameters()), self.world, self.collectives["all_reduce"])

    def finish_step(self) -> None:
        self.opt.step()
        self.step_index += 1
        params = flat_params(self.model)
        self.trajectory.append(params)
        if self.world > 1:
            self.identical.append(ranks_identical(params, self.world, self.collectives["all_gather"]))

    def step(self) -> None:
        self.forward_backward()
        self.average_gradients()
        self.precond.step()
        self.finish_step()

    def run(self, steps: int) -> "Trainer":
        for _ in range(steps):
            self.step()
        return self

    # checkpoints
    def checkpoint(self) -> dict:
        # gather_state_dict: every rank calls it, and every rank gets the whole state even
        # where it holds only some layers (MEM_OPT / HYBRID_OPT).
        return {"precond": self.precond.gather_state_dict(), "model": self.model.state_dict(),
                "opt": self.opt.state_dict(), "step_index": self.step_index}

    def load(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["opt"])
        self.precond.load_state_dict(ckpt["precond"])
        self.step_index = ckpt["step_index"]


# ----------------------------------------------------------------------------- workers
def _scenario_equivalence(world, rank, counter):
    out = {}
    for name, cfg in CONFIGS.items():
        trainer = Trainer(cfg, world, rank, collectives=counter.originals).run(STEPS)
        trainer.precond.remove()
        out[name] = {"trajectory": trainer.trajectory, "identical": trainer.identical,
                     "grad_workers": trainer.precond.grad_workers, "memory": trainer.precond.memory_usage()}
    return out


def _factor_bytes(precond, symmetric: bool) -> int:
    """Bytes of one factor step's reduction: the A and G sums (upper triangles when
    symmetric) plus each layer's two row counts (float32 or the factor dtype if wider)."""
    total = 0
    for layer in precond.layers.values():
        for factor in (layer.a_factor, layer.g_factor):
            n = factor.shape[0]
            total += (n * (n + 1) // 2 if symmetric else n * n) * factor.element_size()
        total += 2 * max(4, layer.a_factor.element_size())
    return total


def _registered_grad_bytes(precond) -> int:
    return sum(p.numel() * p.element_size() for layer in precond.layers.values() for _, p in layer.params)


def _counted_steps(trainer: Trainer, counter: CollectiveCounter, steps: int) -> list[dict]:
    """Per step: the library's collectives from forward through ``precond.step()``."""
    per_step = []
    for _ in range(steps):
        counter.reset()
        counter.enabled = True
        trainer.forward_backward()
        counter.enabled = False
        trainer.average_gradients()
        counter.enabled = True
        trainer.precond.step()
        counter.enabled = False
        per_step.append(counter.snapshot())
        trainer.finish_step()
    return per_step


def _scenario_communication(world, rank, counter):
    out = {"factor_step": {}, "plain_steps": {}}
    # One K-FAC factor (and inverse) step, every bucket cap, symmetric or not.
    for symmetric in (False, True):
        for cap_mb in (0.0, 1e-4, 0.002, 25.0):
            trainer = Trainer({"kw": dict(kl_clip=None, allreduce_bucket_cap_mb=cap_mb, symmetry_aware=symmetric)},
                              world, rank, collectives=counter.originals)
            (counts,) = _counted_steps(trainer, counter, 1)
            out["factor_step"][(symmetric, cap_mb)] = {
                "counts": counts, "factor_bytes": _factor_bytes(trainer.precond, symmetric),
                "cap_bytes": int(cap_mb * 2**20), "layers": len(trainer.precond.layers)}
            trainer.precond.remove()
    # Plain steps: factors and inverses every 10 steps, steps 0..9 counted.
    for strategy in (COMM, HYBRID, MEM):
        trainer = Trainer({"kw": dict(grad_worker_fraction=strategy, factor_update_steps=10, inv_update_steps=10)},
                          world, rank, collectives=counter.originals)
        out["plain_steps"][("kfac", strategy.name)] = {
            "per_step": _counted_steps(trainer, counter, 10),
            "grad_bytes": _registered_grad_bytes(trainer.precond),
            "grad_workers": trainer.precond.grad_workers,
            "owners": sorted(set(trainer.precond.assignment.owners.values()))}
        trainer.precond.remove()
    # PSGD: Q updates on every 4th step only (p = 0.25, deterministic decider).
    for strategy in (COMM, MEM):
        trainer = Trainer({"kw": dict(method="psgd", grad_worker_fraction=strategy,
                                      preconditioner_update_probability=0.25)},
                          world, rank, collectives=counter.originals)
        out["plain_steps"][("psgd", strategy.name)] = {
            "per_step": _counted_steps(trainer, counter, 8),
            "grad_bytes": _registered_grad_bytes(trainer.precond),
            "grad_workers": trainer.precond.grad_workers}
    # EK-FAC: statistics (and s) every step, bases every 4th step.
    for strategy in (COMM, HYBRID, MEM):
        trainer = Trainer({"kw": dict(method="ekfac", inv_update_steps=4, grad_worker_fraction=strategy)},
                          world, rank, collectives=counter.originals)
        out["plain_steps"][("ekfac", strategy.name)] = {
            "per_step": _counted_steps(trainer, counter, 5),
            "grad_bytes": _registered_grad_bytes(trainer.precond),
            "grad_workers": trainer.precond.grad_workers}
        trainer.precond.remove()
    # Shampoo: statistics every step (from the gradients: nothing to reduce), roots every 3rd.
    trainer = Trainer({"kw": dict(method="shampoo", inv_update_steps=3)}, world, rank, collectives=counter.originals)
    out["plain_steps"][("shampoo", "COMM_OPT")] = {"per_step": _counted_steps(trainer, counter, 6),
                                                   "grad_workers": trainer.precond.grad_workers}
    trainer.precond.remove()
    return out


def _scenario_checkpoint(world, rank, counter, ckpt_dir):
    out = {"saved": {}, "resumed": {}}
    originals = counter.originals
    for name, cfg in CKPT_CONFIGS.items():
        if world in {src for src, _ in RESUME_PAIRS}:
            trainer = Trainer(cfg, world, rank, collectives=originals).run(SAVE_AT)
            ckpt = trainer.checkpoint()  # a collective: every rank calls it
            path = os.path.join(ckpt_dir, f"ckpt-{name}-w{world}.pt")
            if rank == 0:
                torch.save(ckpt, path + ".tmp")
                os.replace(path + ".tmp", path)
            originals["barrier"]()
            # Training on after state_dict() must be unaffected by it.
            trainer.run(RESUME_STEPS)
            trainer.precond.remove()
            out["saved"][name] = trainer.trajectory
        for src, dst in RESUME_PAIRS:
            if dst != world:
                continue
            path = os.path.join(ckpt_dir, f"ckpt-{name}-w{src}.pt")
            if not os.path.exists(path):
                out["resumed"][(name, src)] = None  # the saving world size failed
                continue
            trainer = Trainer(cfg, world, rank, collectives=originals)
            trainer.load(torch.load(path, weights_only=False))
            trainer.run(RESUME_STEPS)
            trainer.precond.remove()
            out["resumed"][(name, src)] = {"trajectory": trainer.trajectory, "identical": trainer.identical}
    return out


def _try(fn):
    """(exception type, message, seconds) of ``fn()``, or None if it did not raise."""
    start = time.monotonic()
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err), time.monotonic() - start
    if isinstance(result, KronPreconditioner):
        result.remove()
    return None


def _scenario_errors(world, rank, counter):
    originals = counter.originals
    out = {}

    def differing_params(method):
        model = make_model()
        with torch.no_grad():
            model[0].weight[0, 0, 0, 0] += 1e-3 * rank
        return KronPreconditioner(model, method=method)

    bad_fraction = {2: 0.3, 3: 0.5, 4: 0.75}[world]
    cases = {
        "params-differ-kfac": lambda: differing_params("kfac"),
        "params-differ-psgd": lambda: differing_params("psgd"),
        "seed-differs": lambda: (torch.manual_seed(rank), KronPreconditioner(
            nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()))[1],
        "skip-layers-differ": lambda: KronPreconditioner(make_model(), skip_layers=["^7$"] if rank == 0 else []),
        "skip-layers-differ-psgd": lambda: KronPreconditioner(make_model(), method="psgd",
                                                              skip_layers=["LayerNorm"] if rank == world - 1 else []),
        "fraction-not-divisor": lambda: KronPreconditioner(make_model(), grad_worker_fraction=bad_fraction),
        "nocolocate-mem": lambda: KronPreconditioner(make_model(), colocate_factors=False, grad_worker_fraction=MEM),
        "nocolocate-hybrid": lambda: KronPreconditioner(make_model(), colocate_factors=False,
                                                        grad_worker_fraction=HYBRID),
    }
    for name, case in cases.items():
        outcome = _try(case)
        probe = torch.ones(1)
        originals["all_reduce"](probe)  # the group still works afterwards
        out[name] = {"error": outcome, "group_alive": probe.item() == world}
    return out


def _scenario_grid(world, rank):
    from kron_precond.distributed.groups import WorkerGrid

    out = {}
    for workers in [w for w in range(1, world + 1) if world % w == 0]:
        grid = WorkerGrid(world, rank, workers)
        groups = {}
        for owner in range(world):
            group = grid.state_group(owner)
            if group is None:
                groups[owner] = None
            elif grid.is_grad_worker(owner):  # only members may ask a group for its ranks
                groups[owner] = dist.get_process_group_ranks(group)
            else:
                groups[owner] = "not a member"
        out[workers] = {
            "is_grad_worker": [grid.is_grad_worker(o) for o in range(world)],
            "gradient_source": [grid.gradient_source(o) for o in range(world)],
            "state_group": groups,
            "row_group": None if grid.row_group is None else dist.get_process_group_ranks(grid.row_group),
            "has_receivers": grid.has_receivers,
        }
    return out


def dist_worker(rank: int, world: int, out_dir: str, ckpt_dir: str) -> dict:
    results, timings = {}, {}
    with CollectiveCounter() as counter:
        counter.enabled = False
        for name, scenario in (
            ("equivalence", lambda: _scenario_equivalence(world, rank, counter)),
            ("communication", lambda: _scenario_communication(world, rank, counter)),
            ("checkpoint", lambda: _scenario_checkpoint(world, rank, counter, ckpt_dir)),
            ("errors", lambda: _scenario_errors(world, rank, counter) if world > 1 else {}),
            ("grid", lambda: _scenario_grid(world, rank) if world > 1 else {}),
        ):
            start = time.monotonic()
            results[name] = scenario()
            timings[name] = time.monotonic() - start
    results["timings"] = timings
    return results


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: the per-rank results of the spawned group of that size (cached)."""
    base = tmp_path_factory.mktemp("distributed")
    ckpt_dir = base / "checkpoints"
    ckpt_dir.mkdir()
    cache: dict[int, object] = {}
    needs = {2: 4, 3: 2, 1: 2}  # resumes from checkpoints saved at this world size

    def get(world: int):
        if world not in cache:
            if world in needs:
                try:
                    get(needs[world])
                except Exception:  # noqa: BLE001 - its own tests report it
                    pass
            try:
                cache[world] = run_workers(dist_worker, world, base / f"world{world}", str(ckpt_dir),
                                           timeout=SPAWN_TIMEOUT)
            except Exception as err:  # noqa: BLE001
                cache[world] = err
        if isinstance(cache[world], Exception):
            raise cache[world]
        return cache[world]

    return get


@pytest.fixture(scope="module")
def reference():
    """Single-process (no process group) trajectories, cached per configuration."""
    cache: dict[tuple, list] = {}

    def get(configs: dict, name: str, steps: int):
        key = (id(configs), name, steps)
        if key not in cache:
            trainer = Trainer(configs[name]).run(steps)
            trainer.precond.remove()
            cache[key] = (trainer.initial, trainer.trajectory)
        return cache[key]

    return get


def displacement_error(trajectory, ref_trajectory, initial) -> float:
    """max over steps of ‖p − p_ref‖ / ‖p_ref − p_init‖."""
    worst = 0.0
    for p, ref in zip(trajectory, ref_trajectory, strict=True):
        worst = max(worst, ((p - ref).norm() / (ref - initial).norm()).item())
    return worst


# ----------------------------------------------------------------------------- 1, 2: equivalence
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ranks_match_single_process(runs, reference, world, name):
    cfg = CONFIGS[name]
    initial, ref = reference(CONFIGS, name, STEPS)
    results = runs(world)
    tol = TOL[cfg.get("dtype", F64)]
    for rank, result in enumerate(results):
        got = result["equivalence"][name]
        err = displacement_error(got["trajectory"], ref, initial)
        assert err <= tol, (f"{name} world {world} rank {rank}: relative error {err:.3e} > {tol:.0e} "
                            f"(grad_workers={got['grad_workers']})")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_hold_identical_parameters_after_every_step(runs, world):
    results = runs(world)
    for name in CONFIGS:
        flags = results[0]["equivalence"][name]["identical"]
        assert len(flags) == STEPS and all(flags), f"{name} world {world}: identical per step {flags}"
        # and each rank's own trajectory equals rank 0's bit for bit
        for rank, result in enumerate(results):
            for step, (a, b) in enumerate(zip(result["equivalence"][name]["trajectory"],
                                              results[0]["equivalence"][name]["trajectory"])):
                assert torch.equal(a, b), f"{name} world {world}: rank {rank} differs at step {step}"


def test_configurations_precondition_and_cover_the_grid(runs, reference):
    """The equivalence is not vacuous: every configuration moves away from plain SGD, and
    the strategies produce the intended number of gradient workers."""
    sgd = make_model()
    opt = torch.optim.SGD(sgd.parameters(), lr=0.05, momentum=0.5)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ((sgd(x) - y) ** 2).mean().backward()
        opt.step()
    sgd_params = flat_params(sgd)
    for name in CONFIGS:
        if CONFIGS[name].get("dtype", F64) != F64:
            continue
        initial, ref = reference(CONFIGS, name, STEPS)
        gap = ((ref[-1] - sgd_params).norm() / (ref[-1] - initial).norm()).item()
        assert gap > 1e-2, f"{name}: preconditioned run is indistinguishable from SGD ({gap:.2e})"
    workers = {w: {n: runs(w)[0]["equivalence"][n]["grad_workers"] for n in CONFIGS} for w in (2, 3, 4)}
    assert workers[4]["kfac-eigen-hybrid-tiny-f2-i3"] == 2  # a real 2x2 grid
    assert workers[4]["kfac-eigen-mem-tiny-sym"] == 1
    assert workers[3]["kfac-eigen-comm-ddp"] == 3
    assert workers[4]["kfac-eigen-float-fraction"] == 2 and workers[3]["kfac-eigen-float-fraction"] == 1
    assert workers[4]["shampoo-hybrid-f2-i3-grafting"] == 2 and workers[4]["shampoo-mem-diagonal-cap0"] == 1


# ----------------------------------------------------------------------------- 3: communication
@pytest.mark.parametrize("world", [2, 3, 4])
def test_factor_allreduce_is_bucketed(runs, world):
    for rank, result in enumerate(runs(world)):
        for (symmetric, cap_mb), info in result["communication"]["factor_step"].items():
            calls = info["counts"]["calls"].get("all_reduce", 0)
            sent = info["counts"]["bytes"].get("all_reduce", 0)
            sizes = info["counts"]["sizes"].get("all_reduce", [])
            label = f"world {world} rank {rank} symmetric={symmetric} cap={cap_mb} MB"
            assert sent == info["factor_bytes"], f"{label}: all-reduced {sent} B, factors are {info['factor_bytes']} B"
            if info["cap_bytes"] == 0:
                assert calls == 3 * info["layers"], f"{label}: {calls} calls, expected one per statistic"
            else:
                bound = math.ceil(info["factor_bytes"] / info["cap_bytes"]) + 1
                assert 1 <= calls <= bound, f"{label}: {calls} all-reduces > {bound}"
                assert max(sizes) <= info["cap_bytes"], f"{label}: a bucket of {max(sizes)} B exceeds the cap"
        default = result["communication"]["factor_step"][(False, 25.0)]["counts"]["calls"]["all_reduce"]
        assert default == 1, f"world {world}: {default} all-reduces with the default 25 MB cap"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_symmetry_aware_halves_allreduce_bytes(runs, world):
    steps = runs(world)[0]["communication"]["factor_step"]
    for cap_mb in (0.0, 1e-4, 0.002, 25.0):
        full = steps[(False, cap_mb)]["counts"]["bytes"]["all_reduce"]
        half = steps[(True, cap_mb)]["counts"]["bytes"]["all_reduce"]
        assert 0.45 <= half / full <= 0.65, f"cap {cap_mb}: symmetric/full bytes = {half / full:.3f}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_comm_opt_sends_nothing_on_plain_steps(runs, world):
    for rank, result in enumerate(runs(world)):
        per_step = result["communication"]["plain_steps"][("kfac", "COMM_OPT")]["per_step"]
        assert per_step[0]["calls"].get("all_reduce", 0) >= 1  # the factor step does talk
        for step in range(1, 10):
            assert per_step[step]["calls"] == {}, f"rank {rank} step {step}: {per_step[step]['calls']}"
        psgd = result["communication"]["plain_steps"][("psgd", "COMM_OPT")]["per_step"]
        update_steps = [s for s in range(8) if psgd[s]["calls"]]
        assert update_steps == [3, 7], f"rank {rank}: PSGD COMM_OPT talked on steps {update_steps}"
        assert set(psgd[3]["calls"]) == {"broadcast"}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("strategy", ["MEM_OPT", "HYBRID_OPT"])
def test_gradient_broadcast_every_step_without_comm_opt(runs, world, strategy):
    for rank, result in enumerate(runs(world)):
        info = result["communication"]["plain_steps"][("kfac", strategy)]
        if info["grad_workers"] == world:
            continue  # HYBRID_OPT at world 1 only
        for step in range(10):
            counts = info["per_step"][step]
            assert counts["calls"].get("broadcast", 0) >= 1, f"rank {rank} step {step}: {counts['calls']}"
            if step > 0:  # (step 0 also all-reduces factors and, for HYBRID_OPT, shares state)
                # every rank takes part in the broadcast of every registered gradient, once
                assert counts["bytes"]["broadcast"] == info["grad_bytes"], f"rank {rank} step {step}"
                assert set(counts["calls"]) == {"broadcast"}
        if strategy == "MEM_OPT":
            assert info["per_step"][1]["calls"]["broadcast"] == len(info["owners"])
            psgd = result["communication"]["plain_steps"][("psgd", "MEM_OPT")]
            for step in range(8):
                assert psgd["per_step"][step]["bytes"].get("broadcast", 0) == psgd["grad_bytes"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ekfac_statistics_only_steps_share_no_bases(runs, world):
    """EK-FAC steps that re-estimate s but keep the bases all-reduce the statistics and
    (without COMM_OPT) broadcast gradients, like a K-FAC factor step: nothing refreshed is
    broadcast (s is folded from the all-reduced sums on every gradient worker)."""
    for rank, result in enumerate(runs(world)):
        for strategy in ("COMM_OPT", "HYBRID_OPT", "MEM_OPT"):
            info = result["communication"]["plain_steps"][("ekfac", strategy)]
            per_step = info["per_step"]
            for step in (0, 4):  # basis steps share the refreshed bases
                assert per_step[step]["calls"].get("broadcast", 0) >= 1, (strategy, rank, step, per_step[step])
            for step in (1, 2, 3):
                calls, sent = per_step[step]["calls"], per_step[step]["bytes"]
                expected = {"all_reduce"} if info["grad_workers"] == world else {"all_reduce", "broadcast"}
                assert set(calls) == expected, f"{strategy} rank {rank} step {step}: {calls}"
                if info["grad_workers"] < world:
                    assert sent["broadcast"] == info["grad_bytes"], f"{strategy} rank {rank} step {step}: {sent}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shampoo_reduces_nothing_and_plain_steps_are_silent(runs, world):
    """Shampoo's statistics come from gradients DDP has already averaged: no all-reduce ever;
    under COMM_OPT a step without a refresh issues no collective, a refresh step only the
    owners' broadcasts of the roots (every 3 steps, and on step 1 and 2: the warm-up's)."""
    for rank, result in enumerate(runs(world)):
        for step, counts in enumerate(result["communication"]["plain_steps"][("shampoo", "COMM_OPT")]["per_step"]):
            calls = counts["calls"]
            refresh = step % 3 == 0 or step in (1, 2)
            assert set(calls) == ({"broadcast"} if refresh else set()), f"rank {rank} step {step}: {calls}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shampoo_statistics_live_on_gradient_workers_only(runs, world):
    """Each layer's L / R are held by its owner's column (the ranks a checkpoint is gathered
    from): summed over ranks, MEM_OPT holds them once, HYBRID_OPT ``grad_workers`` times,
    COMM_OPT (split placement too) on every rank."""
    results = runs(world)
    for name in [n for n in CONFIGS if n.startswith("shampoo-") and CONFIGS[n].get("dtype", F64) == F64]:
        single = Trainer(CONFIGS[name]).run(1)
        single.precond.remove()
        one_copy = single.precond.memory_usage()["shampoo_statistics"]
        held = [r["equivalence"][name]["memory"]["shampoo_statistics"] for r in results]
        workers = results[0]["equivalence"][name]["grad_workers"]
        assert sum(held) == workers * one_copy, f"{name} world {world}: {held} vs {one_copy} per copy"
        if workers == world:
            assert held == [one_copy] * world, f"{name} world {world}: {held}"


def test_single_rank_group_issues_no_collectives(runs):
    (result,) = runs(1)
    for info in result["communication"]["factor_step"].values():
        assert info["counts"]["calls"] == {}
    for info in result["communication"]["plain_steps"].values():
        assert all(s["calls"] == {} for s in info["per_step"])


# ----------------------------------------------------------------------------- 4: checkpoints
@pytest.mark.parametrize("name", list(CKPT_CONFIGS))
@pytest.mark.parametrize("src,dst", RESUME_PAIRS, ids=[f"{s}to{d}" for s, d in RESUME_PAIRS])
def test_checkpoint_resumes_on_another_world_size(runs, reference, name, src, dst):
    initial, ref = reference(CKPT_CONFIGS, name, SAVE_AT + RESUME_STEPS)
    results = runs(dst)
    for rank, result in enumerate(results):
        resumed = result["checkpoint"]["resumed"][(name, src)]
        assert resumed is not None, f"no checkpoint from world {src} (its run failed)"
        err = displacement_error(resumed["trajectory"], ref[SAVE_AT:], initial)
        assert err <= TOL[F64], f"{name}: saved on {src} ranks, resumed on {dst}, rank {rank}: error {err:.3e}"
        assert all(resumed["identical"]), f"{name}: ranks diverged after resuming: {resumed['identical']}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CKPT_CONFIGS))
def test_state_dict_does_not_disturb_training(runs, reference, world, name):
    initial, ref = reference(CKPT_CONFIGS, name, SAVE_AT + RESUME_STEPS)
    for rank, result in enumerate(runs(world)):
        err = displacement_error(result["checkpoint"]["saved"][name], ref, initial)
        assert err <= TOL[F64], f"{name} world {world} rank {rank}: error {err:.3e} after state_dict()"


# ----------------------------------------------------------------------------- 5: bad input
ERROR_CASES = {
    "params-differ-kfac": "parameters differ",
    "params-differ-psgd": "parameters differ",
    "seed-differs": "parameters differ",
    "skip-layers-differ": "skip_layers",
    "skip-layers-differ-psgd": "skip_layers",
    "fraction-not-divisor": "does not divide",
    "nocolocate-mem": "colocate_factors=False",
    "nocolocate-hybrid": "colocate_factors=False",
}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_input_raises_on_every_rank(runs, world, case):
    for rank, result in enumerate(runs(world)):
        info = result["errors"][case]
        assert info["error"] is not None, f"{case} world {world}: rank {rank} raised nothing"
        kind, message, seconds = info["error"]
        assert kind == "ValueError", f"{case} rank {rank}: {kind}: {message}"
        assert ERROR_CASES[case] in message, f"{case} rank {rank}: unclear message {message!r}"
        assert seconds < 10, f"{case} rank {rank}: took {seconds:.1f} s to fail"
        assert info["group_alive"], f"{case} rank {rank}: process group unusable afterwards"


# ----------------------------------------------------------------------------- grid
@pytest.mark.parametrize("world", [2, 3, 4])
def test_worker_grid_in_a_process_group(runs, world):
    """KAISA grid, checked against its definition: W grad workers per layer, C = R / W
    columns; the grad workers of owner o are the ranks r with r ≡ o (mod C); every rank
    receives from the grad worker of its own row."""
    results = runs(world)
    for workers, _ in results[0]["grid"].items():
        columns = world // workers
        for rank, result in enumerate(results):
            info = result["grid"][workers]
            assert info["is_grad_worker"] == [rank % columns == o % columns for o in range(world)]
            assert info["gradient_source"] == [(rank // columns) * columns + o % columns for o in range(world)]
            assert info["has_receivers"] == (columns > 1)
            for owner in range(world):
                column = [r for r in range(world) if r % columns == owner % columns]
                if workers == 1:
                    assert info["state_group"][owner] is None  # MEM_OPT: nobody to share state with
                elif rank in column:
                    assert info["state_group"][owner] == column
                else:
                    assert info["state_group"][owner] == "not a member"
            row = [(rank // columns) * columns + c for c in range(columns)]
            assert info["row_group"] == (row if columns > 1 else None)
            for owner in range(world):  # the source holds the state and sits in my row
                source = info["gradient_source"][owner]
                assert source in (row if columns > 1 else [rank]) and source % columns == owner % columns


# ----------------------------------------------------------------------------- the harness itself
def _raising_worker(rank, world, out_dir):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever
    return rank


def _hanging_worker(rank, world, out_dir):
    if rank == 0:
        time.sleep(3600)  # never joins the collective below
    dist.barrier()
    return rank


def _aborting_worker(rank, world, out_dir):
    if rank == 1:
        # Both ways a dying rank writes: Python's sys.stderr and C++ straight to fd 2 (as
        # libstdc++'s "terminate called ..." does), then SIGABRT without a traceback.
        print("rank 1 python stderr before the abort", file=sys.stderr, flush=True)
        os.write(2, b"rank 1 native stderr: terminate called without an active exception\n")
        os.abort()
    dist.barrier()  # rank 0 would wait here until the harness kills it
    return rank


def test_harness_reports_a_rank_killed_by_a_signal_with_its_stderr(tmp_path):
    from dist_utils import WorkerFailed

    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        run_workers(_aborting_worker, 2, tmp_path, timeout=60)
    message = str(failed.value)
    assert "rank 1 was killed by signal SIGABRT" in message, message
    assert "rank 1: killed by signal SIGABRT" in message, message
    assert "rank 0: killed by the harness" in message, message  # not blamed for rank 1's death
    assert "rank 1 python stderr before the abort" in message, message
    assert "rank 1 native stderr: terminate called without an active exception" in message, message
    assert time.monotonic() - start < 30


def _raising_worker_with_exit_handler(rank, world, out_dir):
    import atexit

    # Writes only if the rank goes through the interpreter's shutdown, where gloo's threads,
    # still alive after destroy_process_group, meet the interpreter's finalization.
    atexit.register(lambda: os.write(2, b"interpreter shutdown ran\n"))
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()
    return rank


def test_harness_ranks_leave_without_the_interpreter_shutdown_also_on_failure(tmp_path):
    from dist_utils import WorkerFailed

    with pytest.raises(WorkerFailed, match="boom on rank 1") as failed:
        run_workers(_raising_worker_with_exit_handler, 2, tmp_path, timeout=60)
    assert "interpreter shutdown ran" not in str(failed.value), str(failed.value)
    assert "rank 1: raised" in str(failed.value), str(failed.value)


def test_harness_reports_a_failing_rank_quickly(tmp_path):
    from dist_utils import WorkerFailed

    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="boom on rank 1"):
        run_workers(_raising_worker, 2, tmp_path, timeout=60)
    assert time.monotonic() - start < 30


def test_harness_kills_a_hanging_group(tmp_path):
    from dist_utils import WorkerTimeout

    start = time.monotonic()
    with pytest.raises(WorkerTimeout, match=r"rank\(s\) \[0, 1\] still running"):
        run_workers(_hanging_worker, 2, tmp_path, timeout=6)
    assert time.monotonic() - start < 6 + 10  # killed promptly, not left to hang
