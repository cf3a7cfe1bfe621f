"""Steps and wall-clock to a target held-out loss, against AdamW, on the char-LM.

Every method runs a small learning-rate sweep; every sweep point is reported. All runs
(sweep points and peers) train round-robin in one process on the same batches from the
same initial weights (see examples/char_lm.py), so background load hits them alike.

The target is the final held-out loss of the best AdamW sweep point (or ``--target``).
"x AdamW time" divides a run's training seconds to the target by the best AdamW run's.

    python benchmarks/convergence.py                                   # the documented sweep
    python benchmarks/convergence.py --grid adamw=1e-3,2e-3 --grid kfac=2e-3 --steps 200
    python benchmarks/convergence.py --peers none --out docs/img/convergence.png
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: `benchmarks.*`, uninstalled kron_precond
    sys.path.append(str(REPO_ROOT))
# The examples' modules are imported by file from examples/, never through a package named
# `examples` (other wheels, e.g. kfac-pytorch's, install a top-level `examples`).
sys.path.insert(0, str(REPO_ROOT / "examples"))

from benchmarks.peers import ALL_PEERS, DEFAULT_PEERS, available_peers, parse_peers  # noqa: E402
from char_lm import (  # noqa: E402
    Contender,
    RunResult,
    add_training_args,
    configs_from_args,
    method_contender,
    plot_curves,
    results_table,
    train_round_robin,
)
from kron_examples_common import METHODS, PrecondConfig, close_distributed, init_distributed  # noqa: E402

DEFAULT_GRID = {
    "adamw": (1e-3, 2e-3, 4e-3),
    "kfac": (2e-3, 4e-3),
    "psgd": (2e-3, 4e-3),
}
DEFAULT_PEER_LRS = (2e-3,)


def parse_grid(entries: Sequence[str] | None) -> dict[str, tuple[float, ...]]:
    """``--grid method=lr,lr`` entries (repeatable); the default grid when none is given."""
    if not entries:
        return dict(DEFAULT_GRID)
    grid = {}
    for entry in entries:
        method, _, lrs = entry.partition("=")
        if method not in METHODS or not lrs:
            raise SystemExit(f"--grid {entry!r}: expected METHOD=LR[,LR...] with METHOD in {list(METHODS)}")
        grid[method] = tuple(float(lr) for lr in lrs.split(","))
    return grid


def peer_contender(name: str, builder, lr: float, weight_decay: float, psgd: PrecondConfig) -> Contender:
    """A peer PSGD optimizer (kron_torch, heavyball); it gets the same update probability.

    Its initial preconditioner scale stays at the peer's own default (kron_torch has no
    estimate-from-gradient option)."""
    probability = psgd.update_probability
    return Contender(
        name=f"{name} lr={lr:g}", lr=lr,
        build=lambda model, scaler: (builder(model.parameters(), lr, weight_decay, probability), None),
    )


def sweep_contenders(grid: dict[str, tuple[float, ...]], peers: dict, peer_lrs: Sequence[float],
                     weight_decay: float, precond: PrecondConfig) -> list[Contender]:
    contenders = []
    for method, lrs in grid.items():
        for lr in lrs:
            contender = method_contender(method, lr, weight_decay, precond)
            contenders.append(replace(contender, name=f"{method} lr={lr:g}"))
    for name, builder in peers.items():
        contenders.extend(peer_contender(name, builder, lr, weight_decay, precond) for lr in peer_lrs)
    return contenders


def best_adamw(results: Sequence[RunResult]) -> RunResult:
    adamw = [r for r in results if r.name.startswith("adamw ")]
    if not adamw:
        raise SystemExit("the sweep needs at least one adamw point (the reference)")
    return min(adamw, key=lambda r: r.final_loss)


def _best_per_family(results: Sequence[RunResult]) -> list[RunResult]:
    """The lowest-final-loss run of each method / peer (names are 'family lr=...')."""
    best: dict[str, RunResult] = {}
    for r in results:
        family = r.name.split(" lr=")[0]
        if family not in best or r.final_loss < best[family].final_loss:
            best[family] = r
    return list(best.values())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--grid", action="append", metavar="METHOD=LR,LR",
                   help=f"learning rates to sweep for one method (repeatable); default {DEFAULT_GRID}")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"other PSGD implementations to run, from {ALL_PEERS}, or none")
    p.add_argument("--peer-lrs", default=",".join(map(str, DEFAULT_PEER_LRS)), help="learning rates of the peers")
    p.add_argument("--target", type=float, default=None,
                   help="held-out loss to reach (default: the best AdamW point's final loss)")
    add_training_args(p)
    p.add_argument("--out", type=Path, default=Path("runs/convergence"), help="directory for the plot and results.json")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ctx = init_distributed(args.device)
    model_config, train, precond = configs_from_args(args)
    peers = available_peers(parse_peers(args.peers))
    peer_lrs = [float(lr) for lr in args.peer_lrs.split(",")]
    contenders = sweep_contenders(parse_grid(args.grid), peers, peer_lrs, train.weight_decay, precond)
    if ctx.is_main:
        print(f"{len(contenders)} runs x {train.steps} steps, "
              f"{train.batch_size * model_config.seq_len} tokens/step: {', '.join(c.name for c in contenders)}")
    results = train_round_robin(contenders, model_config, train, ctx)
    if ctx.is_main:
        reference = best_adamw(results)
        target = args.target if args.target is not None else reference.final_loss
        print(f"\ntarget held-out loss {target:.4f} (best AdamW point: {reference.name})")
        print(results_table(results, reference, target))
        args.out.mkdir(parents=True, exist_ok=True)
        best = _best_per_family(results)
        plot_curves(best, target, args.out / "convergence.png",
                    f"best sweep point per method, {train.steps} steps, {train.batch_size * model_config.seq_len} tokens/step")
        with open(args.out / "results.json", "w") as f:
            json.dump({"model": asdict(model_config), "train": asdict(train), "target": target,
                       "runs": [asdict(r) for r in results]}, f)
        print(f"saved {args.out / 'convergence.png'} and {args.out / 'results.json'}")
    close_distributed(ctx)
    return results


if __name__ == "__main__":
    main()
