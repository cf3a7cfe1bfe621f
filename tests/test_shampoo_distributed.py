"""Shampoo on 1-4 gloo ranks versus one process, with ``test_distributed``'s harness.

Same oracle, model, batches, trainer and tolerances as ``test_distributed.py`` (one process
on the full batch; parameter displacement within 1e-10 in float64, 1e-5 in float32; ranks
bitwise identical after every step), for Shampoo under every grad-worker fraction, split
placement (``colocate_factors=False``), diagonal sides and stale roots. Also:

* checkpoints saved on one world size resume on another (4 → 2, 2 → 3, 2 → 1), including
  mid-way through a refresh interval: the statistics travel in the state;
* each layer's statistics live on its gradient workers only (MEM_OPT: exactly one rank);
* nothing is all-reduced (DDP already averaged the gradients), and steps that neither refresh
  nor move gradients between ranks issue no collective at all.

One spawned group per world size runs every scenario; the tests compare numbers.
"""
from __future__ import annotations

import os

import pytest
import torch

from dist_utils import CollectiveCounter, run_workers
from test_distributed import (F32, F64, HYBRID, MEM, TOL, Trainer, batch, displacement_error, flat_params,
                              make_model)

STEPS = 6
WORLD_SIZES = (1, 2, 3, 4)
SPAWN_TIMEOUT = 150.0
RESUME_PAIRS = ((2, 3), (2, 1), (4, 2))
SAVE_AT, RESUME_STEPS = 4, 4

CONFIGS: dict[str, dict] = {
    "shampoo-comm-ddp": dict(kw=dict(method="shampoo"), ddp=True),
    "shampoo-hybrid-f2-i3-grafting": dict(kw=dict(method="shampoo", grad_worker_fraction=HYBRID,
                                                  factor_update_steps=2, inv_update_steps=3, grafting=True,
                                                  epsilon=1e-2, allreduce_bucket_cap_mb=1e-4)),
    "shampoo-mem-diagonal-cap0": dict(kw=dict(method="shampoo", grad_worker_fraction=MEM, max_factor_size=8,
                                              allreduce_bucket_cap_mb=0, exponent=0.125)),
    "shampoo-float-fraction": dict(kw=dict(method="shampoo", grad_worker_fraction="float")),
    "shampoo-nocolocate-memory": dict(kw=dict(method="shampoo", colocate_factors=False,
                                              assignment_strategy="memory")),
    "shampoo-hybrid-float32": dict(kw=dict(method="shampoo", grad_worker_fraction=HYBRID, epsilon=1e-2), dtype=F32),
}

# Refreshes every 3 steps: the resume at step 4 lands mid-interval.
CKPT_CONFIGS: dict[str, dict] = {
    "comm-nocolocate": dict(kw=dict(method="shampoo", colocate_factors=False, inv_update_steps=3,
                                    epsilon=1e-2)),
    "mem": dict(kw=dict(method="shampoo", grad_worker_fraction=MEM, inv_update_steps=3, factor_update_steps=2,
                        epsilon=1e-2, grafting=True)),
    "hybrid": dict(kw=dict(method="shampoo", grad_worker_fraction=HYBRID, inv_update_steps=3, epsilon=1e-2)),
}


def _statistics_bytes(trainer: Trainer) -> int:
    return trainer.precond.memory_usage()["shampoo_statistics"]


# ----------------------------------------------------------------------------- worker
def shampoo_worker(rank: int, world: int, out_dir: str, ckpt_dir: str) -> dict:
    out: dict = {"equivalence": {}, "saved": {}, "resumed": {}, "collectives": []}
    with CollectiveCounter() as counter:
        counter.enabled = False
        originals = counter.originals
        for name, cfg in CONFIGS.items():
            trainer = Trainer(cfg, world, rank, collectives=originals).run(STEPS)
            out["equivalence"][name] = {"trajectory": trainer.trajectory, "identical": trainer.identical,
                                        "grad_workers": trainer.precond.grad_workers,
                                        "statistics_bytes": _statistics_bytes(trainer)}
            trainer.precond.remove()

        # Collectives per step: refreshes every 3 steps, COMM_OPT.
        trainer = Trainer({"kw": dict(method="shampoo", inv_update_steps=3)}, world, rank, collectives=originals)
        for _ in range(6):
            counter.reset()
            counter.enabled = True
            trainer.forward_backward()
            counter.enabled = False
            trainer.average_gradients()
            counter.enabled = True
            trainer.precond.step()
            counter.enabled = False
            out["collectives"].append(counter.snapshot()["calls"])
            trainer.finish_step()

        for name, cfg in CKPT_CONFIGS.items():
            if world in {src for src, _ in RESUME_PAIRS}:
                trainer = Trainer(cfg, world, rank, collectives=originals).run(SAVE_AT)
                ckpt = trainer.checkpoint()  # a collective under MEM / HYBRID: every rank calls it
                path = os.path.join(ckpt_dir, f"shampoo-{name}-w{world}.pt")
                if rank == 0:
                    torch.save(ckpt, path + ".tmp")
                    os.replace(path + ".tmp", path)
                originals["barrier"]()
                trainer.run(RESUME_STEPS)  # state_dict() must not disturb training
                out["saved"][name] = trainer.trajectory
            for src, dst in RESUME_PAIRS:
                if dst != world:
                    continue
                path = os.path.join(ckpt_dir, f"shampoo-{name}-w{src}.pt")
                if not os.path.exists(path):
                    out["resumed"][(name, src)] = None
                    continue
                trainer = Trainer(cfg, world, rank, collectives=originals)
                trainer.load(torch.load(path, weights_only=False))
                trainer.run(RESUME_STEPS)
                out["resumed"][(name, src)] = {"trajectory": trainer.trajectory, "identical": trainer.identical,
                                               "statistics_bytes": _statistics_bytes(trainer)}
    return out


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(world)``: per-rank results of that world size's spawned group (cached; the
    worlds that save checkpoints run before those that resume them)."""
    base = tmp_path_factory.mktemp("shampoo_distributed")
    ckpt_dir = base / "checkpoints"
    ckpt_dir.mkdir()
    cache: dict[int, object] = {}
    needs = {2: 4, 3: 2, 1: 2}

    def get(world: int):
        if world not in cache:
            if world in needs:
                try:
                    get(needs[world])
                except Exception:  # noqa: BLE001 - its own tests report it
                    pass
            try:
                cache[world] = run_workers(shampoo_worker, world, base / f"world{world}", str(ckpt_dir),
                                           timeout=SPAWN_TIMEOUT)
            except Exception as err:  # noqa: BLE001
                cache[world] = err
        if isinstance(cache[world], Exception):
            raise cache[world]
        return cache[world]

    return get


@pytest.fixture(scope="module")
def reference():
    """Single-process trajectories (and statistics held), cached per configuration."""
    cache: dict[tuple, tuple] = {}

    def get(configs: dict, name: str, steps: int):
        key = (id(configs), name, steps)
        if key not in cache:
            trainer = Trainer(configs[name]).run(steps)
            trainer.precond.remove()
            cache[key] = (trainer.initial, trainer.trajectory, _statistics_bytes(trainer))
        return cache[key]

    return get


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_shampoo_ranks_match_single_process(runs, reference, world, name):
    initial, ref, _ = reference(CONFIGS, name, STEPS)
    tol = TOL[CONFIGS[name].get("dtype", F64)]
    for rank, result in enumerate(runs(world)):
        got = result["equivalence"][name]
        err = displacement_error(got["trajectory"], ref, initial)
        assert err <= tol, f"{name} world {world} rank {rank}: error {err:.3e} (grad_workers={got['grad_workers']})"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shampoo_ranks_hold_identical_parameters(runs, world):
    results = runs(world)
    for name in CONFIGS:
        assert len(results[0]["equivalence"][name]["identical"]) == STEPS
        assert all(results[0]["equivalence"][name]["identical"]), f"{name} world {world}"
        for rank, result in enumerate(results):
            for a, b in zip(result["equivalence"][name]["trajectory"], results[0]["equivalence"][name]["trajectory"]):
                assert torch.equal(a, b), f"{name} world {world}: rank {rank} differs"


def test_shampoo_configurations_precondition_and_cover_the_grid(runs, reference):
    sgd = make_model()
    opt = torch.optim.SGD(sgd.parameters(), lr=0.05, momentum=0.5)
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        ((sgd(x) - y) ** 2).mean().backward()
        opt.step()
    for name, cfg in CONFIGS.items():
        if cfg.get("dtype", F64) != F64:
            continue
        initial, ref, _ = reference(CONFIGS, name, STEPS)
        gap = ((ref[-1] - flat_params(sgd)).norm() / (ref[-1] - initial).norm()).item()
        assert gap > 1e-2, f"{name}: indistinguishable from SGD ({gap:.2e})"
    workers = {w: {n: runs(w)[0]["equivalence"][n]["grad_workers"] for n in CONFIGS} for w in (2, 3, 4)}
    assert workers[4]["shampoo-hybrid-f2-i3-grafting"] == 2 and workers[4]["shampoo-mem-diagonal-cap0"] == 1
    assert workers[3]["shampoo-comm-ddp"] == 3 and workers[4]["shampoo-float-fraction"] == 2


@pytest.mark.parametrize("world", [2, 3, 4])
def test_statistics_live_on_gradient_workers_only(runs, reference, world):
    """Each layer's L / R are held by its owner's column: summed over ranks, MEM_OPT holds
    them once, HYBRID_OPT ``grad_workers`` times, COMM_OPT (split placement too) on every rank."""
    results = runs(world)
    for name in ("shampoo-mem-diagonal-cap0", "shampoo-hybrid-f2-i3-grafting", "shampoo-comm-ddp",
                 "shampoo-nocolocate-memory"):
        _, _, single = reference(CONFIGS, name, STEPS)
        held = [r["equivalence"][name]["statistics_bytes"] for r in results]
        workers = results[0]["equivalence"][name]["grad_workers"]
        assert sum(held) == workers * single, f"{name} world {world}: {held} vs {single} per copy"
        if workers == world:
            assert held == [single] * world


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nothing_is_all_reduced_and_plain_steps_are_silent(runs, world):
    for rank, result in enumerate(runs(world)):
        calls = result["collectives"]
        for step, counts in enumerate(calls):
            assert "all_reduce" not in counts, f"rank {rank} step {step}: {counts}"
            if step % 3:  # neither a refresh nor any gradient traffic under COMM_OPT
                assert counts == {}, f"rank {rank} step {step}: {counts}"
            else:  # the owners share the roots
                assert set(counts) == {"broadcast"}, f"rank {rank} step {step}: {counts}"


@pytest.mark.parametrize("name", list(CKPT_CONFIGS))
@pytest.mark.parametrize("src,dst", RESUME_PAIRS, ids=[f"{s}to{d}" for s, d in RESUME_PAIRS])
def test_shampoo_checkpoint_resumes_on_another_world_size(runs, reference, name, src, dst):
    initial, ref, _ = reference(CKPT_CONFIGS, name, SAVE_AT + RESUME_STEPS)
    for rank, result in enumerate(runs(dst)):
        resumed = result["resumed"][(name, src)]
        assert resumed is not None, f"no checkpoint from world {src} (its run failed)"
        err = displacement_error(resumed["trajectory"], ref[SAVE_AT:], initial)
        assert err <= TOL[F64], f"{name}: saved on {src}, resumed on {dst}, rank {rank}: error {err:.3e}"
        assert all(resumed["identical"]), f"{name}: ranks diverged after resuming"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(CKPT_CONFIGS))
def test_shampoo_state_dict_does_not_disturb_training(runs, reference, world, name):
    initial, ref, _ = reference(CKPT_CONFIGS, name, SAVE_AT + RESUME_STEPS)
    for rank, result in enumerate(runs(world)):
        err = displacement_error(result["saved"][name], ref, initial)
        assert err <= TOL[F64], f"{name} world {world} rank {rank}: error {err:.3e} after state_dict()"
