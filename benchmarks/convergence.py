"""Steps and wall-clock to a target held-out loss, against AdamW and Muon, on the char-LM.

Every method family runs a learning-rate sweep; every sweep point is reported, then the
best point of each family -- the first to reach the target, final loss breaking ties -- with
where its lr sits in the family's grid (a best point at a grid edge means the grid must be
extended). All runs train round-robin in one process on
the same batches from the same initial weights (see examples/char_lm.py), so background
load hits them alike.

The target is the final held-out loss of the best AdamW sweep point (or ``--target``).
"x AdamW time" / "x Muon time" divide a run's training seconds to the target by the best
AdamW / Muon point's.

A family is a method of examples/kron_examples_common.py's METHODS, optionally with preconditioner
settings: ``kfac_muon{fu=5,iu=25}`` (K-FAC statistics every 5 steps, refresh every 25, in
front of Muon), ``psgd_muon{rule=procrustes,p=anneal:25:0.02}``; see ``--help``.

    python benchmarks/convergence.py --threads 1                       # the fair sweep (21 runs)
    python benchmarks/convergence.py --grid adamw=2e-3 --grid muon=8e-3 --grid "kfac_muon{fu=10,iu=50}=8e-3"
    python benchmarks/convergence.py --grid adamw=1e-3,2e-3 --peers kron_torch --steps 200
"""
from __future__ import annotations

import argparse
import json
import re
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

from benchmarks.peers import ALL_PEERS, available_peers, parse_peers  # noqa: E402
from char_lm import (  # noqa: E402
    Contender,
    RunResult,
    _optional_rows,
    _psgd_init_scale,
    _psgd_update_probability,
    add_training_args,
    configs_from_args,
    method_contender,
    plot_curves,
    results_table,
    train_round_robin,
)
from kron_examples_common import METHODS, PrecondConfig, close_distributed, init_distributed  # noqa: E402

# The fair sweep: every family gets the same number of learning rates (3), centred on the
# best point of earlier sweeps, so that each family's best point can land inside its grid.
# The Muon-based families share Muon's grid, centred on 1.6e-2, their best point at the
# examples' Muon momentum of 0.9 (8e-3 was, at torch's 0.95). Each preconditioner runs in
# the main job's setting and in the other methods' one (K-FAC on every row with the
# eigenbasis; PSGD with the annealed update probability).
DEFAULT_GRID = {
    "adamw": (1e-3, 2e-3, 4e-3),
    "muon": (8e-3, 1.6e-2, 3.2e-2),
    "psgd": (1e-3, 2e-3, 4e-3),
    "kfac_muon": (8e-3, 1.6e-2, 3.2e-2),
    "kfac_muon{rows=all,cm=eigen}": (8e-3, 1.6e-2, 3.2e-2),
    "psgd_muon": (8e-3, 1.6e-2, 3.2e-2),
    "psgd_muon{p=anneal:100:0.01}": (8e-3, 1.6e-2, 3.2e-2),
}
DEFAULT_PEER_LRS = (2e-3,)

# Short names for the PrecondConfig fields a grid family may override, e.g.
# ``kfac_muon{fu=5,iu=25,damping=1e-2}=4e-3,8e-3``.
VARIANT_KEYS = {
    "fu": "factor_update_steps", "iu": "inv_update_steps", "damping": "damping",
    "decay": "factor_decay", "kl": "kl_clip", "p": "update_probability",
    "plr": "psgd_precond_lr", "init": "psgd_init_scale", "rule": "psgd_update",
    "cm": "compute_method", "skip": "skip_layers", "rows": "statistics_rows",
    "maxtri": "psgd_max_size_triangular", "msm": "psgd_memory_save_mode",
    "ie": "ikfac_every", "idamp": "ikfac_damping", "idecay": "ikfac_factor_decay",
    "irows": "ikfac_statistics_rows", "m2": "moment_decay",
    "mom": "muon_momentum", "momw": "muon_momentum_warmup", "kmax": "kfac_max_size", "graft": "kfac_grafting",
    "until": "precond_until", "pm": "precond_momentum",
    "we": "wmuon_every", "wdamp": "wmuon_damping", "wodamp": "wmuon_output_damping", "wboth": "wmuon_both_sides",
    "wrows": "wmuon_statistics_rows",
    "wroot": "wmuon_root", "wblock": "wmuon_block_size", "wdecay": "wmuon_factor_decay", "rlr": "muon_rest_lr",
    "se": "soap_statistics_every", "sb": "soap_every", "sdecay": "soap_factor_decay", "smax": "soap_max_size",
}
_FAMILY = re.compile(r"^(?P<method>\w+)(?:\{(?P<variant>[^}]*)\})?=(?P<lrs>.+)$")


def _variant_value(field: str, text: str):
    if field in ("factor_update_steps", "inv_update_steps", "psgd_max_size_triangular", "ikfac_every",
                 "soap_statistics_every", "soap_every", "soap_max_size", "kfac_max_size", "wmuon_every",
                 "wmuon_block_size"):
        return int(text)
    if field in ("statistics_rows", "ikfac_statistics_rows", "wmuon_statistics_rows"):
        return _optional_rows(text)
    if field == "update_probability":
        return _psgd_update_probability(text)
    if field == "psgd_init_scale":
        return _psgd_init_scale(text)
    if field in ("psgd_update", "compute_method", "psgd_memory_save_mode", "wmuon_root"):
        return text
    if field == "wmuon_both_sides" and text.lower() in ("wide", "auto"):  # output_side="wide" / "auto"
        return text.lower()
    if field in ("kfac_grafting", "precond_momentum", "wmuon_both_sides"):
        return text.lower() in ("1", "true", "yes")
    if field == "skip_layers":  # '+'-separated; e.g. skip=Embedding: lm_head is preconditioned too
        return tuple(filter(None, text.split("+")))
    if field == "muon_momentum_warmup":  # START:STEPS, e.g. 0.85:300
        start, _, steps = text.partition(":")
        return float(start), int(steps)
    if field == "kl_clip":
        return None if float(text) <= 0 else float(text)
    return float(text)


def parse_family(entry: str) -> tuple[str, str, dict, tuple[float, ...]]:
    """``METHOD[{k=v,...}]=LR,LR`` -> (family name, method, PrecondConfig overrides, lrs)."""
    match = _FAMILY.match(entry.replace(" ", ""))
    if not match or match["method"] not in METHODS:
        raise SystemExit(f"--grid {entry!r}: expected METHOD[{{k=v,...}}]=LR[,LR...] with METHOD in "
                         f"{list(METHODS)} and k in {list(VARIANT_KEYS)}")
    overrides = {}
    for item in filter(None, (match["variant"] or "").split(",")):
        key, _, value = item.partition("=")
        if key not in VARIANT_KEYS:
            raise SystemExit(f"--grid {entry!r}: unknown setting {key!r}; choose from {list(VARIANT_KEYS)}")
        overrides[VARIANT_KEYS[key]] = _variant_value(VARIANT_KEYS[key], value)
    family = match["method"] + (f"{{{match['variant']}}}" if match["variant"] else "")
    return family, match["method"], overrides, tuple(float(lr) for lr in match["lrs"].split(","))


def parse_grid(entries: Sequence[str] | None) -> list[tuple[str, str, dict, tuple[float, ...]]]:
    """``--grid`` entries (repeatable); the default grid when none is given."""
    if not entries:
        entries = [f"{family}={','.join(map(str, lrs))}" for family, lrs in DEFAULT_GRID.items()]
    return [parse_family(entry) for entry in entries]


def peer_contender(name: str, builder, lr: float, weight_decay: float, psgd: PrecondConfig) -> Contender:
    """A peer PSGD optimizer (kron_torch, heavyball); it gets the same update probability.

    Its initial preconditioner scale stays at the peer's own default (kron_torch has no
    estimate-from-gradient option)."""
    probability = psgd.update_probability
    return Contender(
        name=f"{name} lr={lr:g}", lr=lr,
        build=lambda model, scaler: (builder(model.parameters(), lr, weight_decay, probability), None),
    )


def sweep_contenders(grid, peers: dict, peer_lrs: Sequence[float],
                     weight_decay: float, precond: PrecondConfig) -> list[Contender]:
    contenders = []
    for family, method, overrides, lrs in grid:
        if "skip_layers" in overrides and precond.muon_exclude is None:  # Muon's split stays
            overrides = {"muon_exclude": precond.skip_layers, **overrides}
        if "update_probability" in overrides:  # p= sets it for PSGD in every role
            overrides = {**overrides, "precond_update_probability": overrides["update_probability"]}
        config = replace(precond, **overrides)
        for lr in lrs:
            contender = method_contender(method, lr, weight_decay, config)
            contenders.append(replace(contender, name=f"{family} lr={lr:g}"))
    for name, builder in peers.items():
        contenders.extend(peer_contender(name, builder, lr, weight_decay, precond) for lr in peer_lrs)
    return contenders


def family_of(run: RunResult) -> str:
    return run.name.split(" lr=")[0]


def _rank(run: RunResult, target: float | None) -> tuple[float, float]:
    """Sort key of a sweep point: the evaluation step that first reaches ``target`` (never:
    last), then the final loss. Points of one family cost the same per step, so steps rank
    them by wall-clock without the timing jitter; with no target (the AdamW reference,
    which defines it) final loss only."""
    if target is None:
        return 0.0, run.final_loss
    reach = run.first_reaching(target)
    return (reach[0] if reach else float("inf")), run.final_loss


def best_of(results: Sequence[RunResult], family: str, target: float | None = None) -> RunResult | None:
    """The best point of ``family``: the first to reach ``target`` (the time-to-target measure),
    or the lowest final loss when ``target`` is None."""
    runs = [r for r in results if family_of(r) == family]
    return min(runs, key=lambda r: _rank(r, target)) if runs else None


def best_adamw(results: Sequence[RunResult]) -> RunResult:
    """The AdamW point with the lowest final loss: its final loss is the target."""
    best = best_of(results, "adamw")
    if best is None:
        raise SystemExit("the sweep needs at least one adamw point (the reference)")
    return best


def _best_per_family(results: Sequence[RunResult], target: float | None) -> list[RunResult]:
    """The best run of each method / peer (names are 'family lr=...'); see ``best_of``."""
    families = dict.fromkeys(family_of(r) for r in results)
    return [best_of(results, f, None if f == "adamw" else target) for f in families]


def grid_edges(results: Sequence[RunResult], target: float | None = None) -> dict[str, str]:
    """Per family with >= 2 points: 'low edge' / 'high edge' if its best lr is the grid's
    smallest / largest, else 'inside'."""
    verdict = {}
    for best in _best_per_family(results, target):
        lrs = sorted(r.lr for r in results if family_of(r) == family_of(best))
        if len(lrs) < 2:
            continue
        verdict[family_of(best)] = ("low edge" if best.lr == lrs[0] else
                                    "high edge" if best.lr == lrs[-1] else "inside")
    return verdict


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--grid", action="append", metavar="METHOD=LR,LR",
                   help="learning rates of one family, METHOD[{k=v,...}]=LR,LR (repeatable); the "
                        f"settings k are {VARIANT_KEYS}; default {DEFAULT_GRID}")
    p.add_argument("--peers", default="none",
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
        # With a fixed --target the AdamW reference may be left out (its columns then use
        # the first run).
        reference = best_adamw(results) if args.target is None or best_of(results, "adamw") else results[0]
        target = args.target if args.target is not None else reference.final_loss
        muon = best_of(results, "muon", target)
        print(f"\ntarget held-out loss {target:.4f} (best AdamW point: {reference.name}"
              + (f"; best Muon point: {muon.name})" if muon else ")"))
        print(results_table(results, reference, target, muon))
        best = _best_per_family(results, target)
        edges = grid_edges(results, target)
        print("\nbest point of each family, the first to reach the target (grid position of its lr: " +
              ", ".join(f"{f}: {v}" for f, v in edges.items()) + ")")
        print(results_table(best, reference, target, muon))
        args.out.mkdir(parents=True, exist_ok=True)
        plot_curves(best, target, args.out / "convergence.png",
                    f"best sweep point per method, {train.steps} steps, "
                    f"{train.batch_size * model_config.seq_len} tokens/step")
        with open(args.out / "results.json", "w") as f:
            json.dump({"model": asdict(model_config), "train": asdict(train), "target": target,
                       "runs": [asdict(r) for r in results]}, f)
        print(f"saved {args.out / 'convergence.png'} and {args.out / 'results.json'}")
    close_distributed(ctx)
    return results


if __name__ == "__main__":
    main()
