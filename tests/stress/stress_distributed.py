"""Repeat the distributed suite's core cases many times and report every failure.

Not collected by pytest (no ``test_`` prefix, and ``tests/stress`` is outside the default
run's interest: it takes many minutes). Run it from the repository root::

    nice -n 19 python tests/stress/stress_distributed.py --repeats 50 --worlds 2 3

Each repeat spawns one gloo group per world size (``tests/dist_utils.run_workers``, hard
timeout) whose ranks run the core scenarios of ``tests/test_distributed.py`` --
single-process equivalence of every configuration and checkpoint save/resume across world
sizes -- plus a bare PSGD/COMM_OPT/DDP loop (the configuration of a rare
SIGABRT). Every result is compared with a single-process reference computed once here;
a rank that raises, dies (e.g. SIGABRT) or hangs is a failure (a hang also prints every
thread's stack, dumped shortly before the harness kills the group). Failures are printed
with their tracebacks as they happen, and a summary ``N of M repeats failed`` ends the run
(exit status 1 if any failed).

A longer check of the PSGD/DDP and equivalence scenarios on selected configurations; it
passes when it ends with ``0 of 50 repeats failed``::

    nice -n 10 python tests/stress/stress_distributed.py --repeats 50 --worlds 2 3 \
        --scenarios psgd-ddp equivalence --timeout 300 --configs kfac-eigen-comm-ddp \
        kfac-eigen-hybrid-tiny-f2-i3 kfac-inverse-mem-f2-i2 psgd-mem-cap0 psgd-float-fraction-p05
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: dist_utils, test_distributed

import torch  # noqa: E402

torch.set_num_threads(1)

import test_distributed as td  # noqa: E402
from dist_utils import run_workers  # noqa: E402

SCENARIOS = ("equivalence", "checkpoint", "psgd-ddp")


def psgd_ddp_loop(world: int, rank: int) -> list[torch.Tensor]:
    """The bare PSGD, COMM_OPT, DDP training loop of the reported SIGABRT."""
    trainer = td.Trainer(td.CONFIGS["psgd-comm-ddp"], world, rank).run(td.STEPS)
    trainer.precond.remove()
    return trainer.trajectory


def stress_worker(rank: int, world: int, out_dir: str, ckpt_dir: str, scenarios: tuple,
                  dump_after: float, configs: tuple) -> dict:
    # A hang is reported with every thread's stack, written shortly before the harness
    # kills the group.
    stacks = open(os.path.join(out_dir, f"stacks_{rank}.txt"), "w")
    faulthandler.dump_traceback_later(dump_after, exit=False, file=stacks)
    counter = td.CollectiveCounter()
    counter.enabled = False
    out = {}
    if "equivalence" in scenarios:  # as td._scenario_equivalence, on the chosen configurations
        out["equivalence"] = {}
        for name in configs:
            trainer = td.Trainer(td.CONFIGS[name], world, rank, collectives=counter.originals).run(td.STEPS)
            trainer.precond.remove()
            out["equivalence"][name] = {"trajectory": trainer.trajectory, "identical": trainer.identical}
    if "checkpoint" in scenarios:
        out["checkpoint"] = td._scenario_checkpoint(world, rank, counter, ckpt_dir)
    if "psgd-ddp" in scenarios:
        out["psgd-ddp"] = psgd_ddp_loop(world, rank)
    faulthandler.cancel_dump_traceback_later()
    return out


def references(configs) -> dict:
    refs = {}
    for name in dict.fromkeys([*configs, "psgd-comm-ddp"]):
        cfg = td.CONFIGS[name]
        trainer = td.Trainer(cfg).run(td.STEPS)
        trainer.precond.remove()
        refs[name] = (trainer.initial, trainer.trajectory, td.TOL[cfg.get("dtype", td.F64)])
    return refs


def check(results: list[dict], refs: dict, world: int) -> list[str]:
    """Mismatches against the single-process references (empty if all good)."""
    problems = []
    for rank, result in enumerate(results):
        for name, got in result.get("equivalence", {}).items():
            initial, ref, tol = refs[name]
            err = td.displacement_error(got["trajectory"], ref, initial)
            if not err <= tol:
                problems.append(f"world {world} rank {rank} {name}: displacement error {err:.3e} > {tol:.0e}")
            if world > 1 and not all(got["identical"]):
                problems.append(f"world {world} rank {rank} {name}: ranks not bitwise identical")
        for key, resumed in result.get("checkpoint", {}).get("resumed", {}).items():
            if resumed is not None and world > 1 and not all(resumed["identical"]):
                problems.append(f"world {world} rank {rank} resume {key}: ranks not bitwise identical")
        if "psgd-ddp" in result:
            initial, ref, tol = refs["psgd-comm-ddp"]
            err = td.displacement_error(result["psgd-ddp"], ref, initial)
            if not err <= tol:
                problems.append(f"world {world} rank {rank} psgd-ddp loop: error {err:.3e} > {tol:.0e}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per spawned group")
    parser.add_argument("--configs", nargs="+", default=list(td.CONFIGS), choices=list(td.CONFIGS),
                        help="equivalence configurations to run (default: all of tests/test_distributed.py)")
    args = parser.parse_args()

    refs = references(args.configs)
    failed_repeats = 0
    failures_by_world: dict[int, int] = {w: 0 for w in args.worlds}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kron_stress_") as base:
        for repeat in range(args.repeats):
            ckpt_dir = Path(base) / f"ckpt{repeat}"
            ckpt_dir.mkdir()
            bad = False
            for world in args.worlds:
                t0 = time.monotonic()
                out_dir = Path(base) / f"r{repeat}w{world}"
                try:
                    results = run_workers(stress_worker, world, out_dir, str(ckpt_dir), tuple(args.scenarios),
                                          max(args.timeout - 20.0, 1.0), tuple(args.configs),
                                          timeout=args.timeout)
                    problems = check(results, refs, world)
                except Exception as err:  # noqa: BLE001 - every failure is reported, none stops the run
                    problems = [f"world {world}: {type(err).__name__}: {err}\n{traceback.format_exc()}"]
                    for stacks in sorted(out_dir.glob("stacks_*.txt")):
                        text = stacks.read_text().strip()
                        if text:
                            problems.append(f"--- {stacks.name} (a hang: stacks of every thread) ---\n{text}")
                status = "FAIL" if problems else "ok"
                print(f"[repeat {repeat + 1}/{args.repeats}] world {world}: {status} "
                      f"({time.monotonic() - t0:.1f} s)", flush=True)
                for problem in problems:
                    print("    " + problem.replace("\n", "\n    "), flush=True)
                if problems:
                    bad = True
                    failures_by_world[world] += 1
            failed_repeats += bad
    print(f"\n{failed_repeats} of {args.repeats} repeats failed "
          f"(per world size: {failures_by_world}; {time.monotonic() - start:.0f} s)", flush=True)
    return 1 if failed_repeats else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
