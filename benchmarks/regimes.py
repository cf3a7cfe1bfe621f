"""The regime map: where curvature in front of Muon beats Muon, by data-to-model ratio and batch.

For every cell of a grid -- model width x tokens per parameter x tokens per step -- this
trains the char-LM of examples/char_lm.py with AdamW, Muon and "ours" (preconditioner +
Muon methods, default ``kfac_muon`` and ``psgd_muon``) round-robin in one process (same
weights, same batches, load hits all alike), each over a learning-rate grid, and records

- ``time_ratio``: the best of ours' wall-clock to the target (AdamW's final held-out loss)
  divided by Muon's;
- ``time_ratio_muon_target``: the same to Muon's own final held-out loss;
- ``loss_ratio``: the best of ours' final held-out loss divided by Muon's.

"Muon" is the best of every Muon family in the grid: ``muon`` alone, or a sweep of its
settings (``muon{mom=0.95}``, ``muon{mom=0.85}``, ...) treated like more lrs of one family,
so a tuned momentum is part of the baseline (it moved Muon more than any preconditioner did).

Tokens per parameter count the **non-embedding** parameters (the transformer blocks and the
final LayerNorm: token / position embeddings and ``lm_head`` left out, as in Kaplan et al.);
the all-parameter ratio is written next to it. The step count of a cell is
``ratio x params / tokens_per_step``; the warm-up is 5 % of it (the main job's 30 of 600) and
held-out loss is evaluated ~30 times per run.

Learning rates (the same budget for every method in every cell): on the first seed every
family runs its whole ``--grid``; a family whose best point sits on a grid edge (for any of
the three measures) gets the next lr beyond that edge, up to ``--max-extend`` times, so best
points end inside their grids. With ``--sweep-ratios`` only the cells at those ratios sweep;
a cell at a larger ratio reuses, on its first seed, the lrs chosen at the largest swept ratio
below it (same width and tokens per step), and ``--check`` cells sweep anyway to test that
transfer (the report prints their own choice next to the transferred one). Later seeds rerun
each family at the lrs its cell's first seed used or chose (a different data order and
initialisation). A family's best point is chosen with
benchmarks/convergence.py's ``best_of`` (first evaluation to reach the target, final loss
breaking ties; lowest final loss for the final-loss measure).

Seconds to a target are ``crossing step x the family's mean step seconds`` in the process
where every family ran interleaved; the crossing step is linearly interpolated between the
two evaluations around the target. (lr does not change a step's cost, so an lr added by a
grid extension, which trains in a process of its own, is charged its family's step time.)

The headline ratios take, per seed and per measure, the best of ours at any lr chosen on
the first seed; the report also judges each configuration (one family at one chosen lr)
by itself over every seed, since one configuration has to meet all three targets
(``configuration_rows``).

Each (cell, seed) is written to ``OUT/w{width}_r{ratio}_t{tokens}_s{seed}.json`` as soon as
it is done and skipped when the script is rerun, so a partial map is usable and a killed run
resumes. ``--report-only`` rebuilds the table and the heat map from the JSON files.

    python benchmarks/regimes.py --threads 1 --seeds 0,1,2 --out runs/regimes  # the map (docs/img/regimes.png)
    python benchmarks/regimes.py --report-only --out runs/regimes --png docs/img/regimes.png
    python benchmarks/regimes.py --grid adamw=8e-3,1.6e-2,3.2e-2 --grid muon=3.2e-2,6.4e-2,1.28e-1 \
        --grid "kfac_muon{rows=all}=3.2e-2,6.4e-2,1.28e-1" --out runs/regimes_kfac_all   # other "ours"
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))

from benchmarks.convergence import best_of, family_of, grid_edges, parse_family, sweep_contenders  # noqa: E402
from char_lm import (  # noqa: E402
    ByteCorpus,
    ModelConfig,
    RunResult,
    add_training_args,
    build_model,
    configs_from_args,
    load_corpus,
    stdlib_source_files,
    train_round_robin,
)
from kron_examples_common import DistContext  # noqa: E402

REFERENCE, MUON = "adamw", "muon"
# Centred on the best points of the first cells (tiny models take large lrs: the main job's
# d=128 takes AdamW 2e-3, Muon 1.6e-2); a best point on an edge extends the grid anyway.
# Momentum is swept like the lr, the same four values for every Muon-based family (Muon
# preferred 0.8 in most cells of a first tuned map, below torch's 0.95): Muon is the best of
# its 4 x 3 points, "ours" the best of two methods' 2 x 4 x 3.
_MUON_LRS = "3.2e-2,6.4e-2,1.28e-1"
MOMENTA = (0.95, 0.85, 0.8, 0.7)
DEFAULT_GRID = ("adamw=8e-3,1.6e-2,3.2e-2",
                *(f"{method}{{mom={m}}}={_MUON_LRS}" for method in ("muon", "kfac_muon", "psgd_muon") for m in MOMENTA))
WARMUP_FRACTION = 0.05
EVALS_PER_RUN = 30
FEW_STEPS = 50  # cells with fewer steps are flagged: a handful of steps is not a training run
EMBEDDING_PARTS = ("token_embedding", "position_embedding", "embed_tokens", "lm_head")

TrainFn = Callable[..., list]


# --------------------------------------------------------------------------- cells
def parameter_counts(model: ModelConfig) -> tuple[int, int]:
    """(non-embedding, all) parameter counts of the char-LM ``model`` builds."""
    params = dict(build_model(model).named_parameters())
    body = sum(p.numel() for name, p in params.items() if not any(part in name for part in EMBEDDING_PARTS))
    return body, sum(p.numel() for p in params.values())


def cell_steps(ratio: float, params: int, tokens_per_step: int) -> int:
    return max(1, round(ratio * params / tokens_per_step))


def cell_name(width: int, ratio: float, tokens_per_step: int, seed: int) -> str:
    return f"w{width}_r{ratio:g}_t{tokens_per_step}_s{seed}"


# --------------------------------------------------------------------------- measures
def crossing_step(run: RunResult, target: float) -> float | None:
    """Step at which the held-out loss first reaches ``target``, linearly interpolated
    between the evaluation above it and the first one at or below it (None: never)."""
    previous = None
    for step, loss in zip(run.eval_steps, run.eval_losses):
        if loss <= target:
            if previous is None or previous[1] == loss:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def family_step_seconds(results: Sequence[RunResult]) -> dict[str, float]:
    """Mean seconds per step of each family (all its lrs) in one interleaved process."""
    per_family: dict[str, list[float]] = {}
    for run in results:
        per_family.setdefault(family_of(run), []).extend(run.step_seconds)
    return {family: sum(s) / len(s) for family, s in per_family.items()}


def _seconds_to(run: RunResult | None, target: float, step_seconds: dict[str, float]) -> float:
    step = crossing_step(run, target) if run is not None else None
    return math.inf if step is None else step * step_seconds[family_of(run)]


def method_of(family: str) -> str:
    """``kfac_muon{kl=0}`` -> ``kfac_muon``."""
    return family.partition("{")[0]


def settings_of(family: str) -> str:
    """``kfac_muon{kl=0}`` -> ``kl=0``; ``muon`` -> ``""``."""
    return family.partition("{")[2].rstrip("}")


def muon_members(families: Sequence[str]) -> list[str]:
    """The families that are Muon itself (any settings, e.g. ``muon{mom=0.85}``)."""
    return [f for f in families if method_of(f) == MUON]


def _muon_group(per_family: dict, members: Sequence[str]) -> dict:
    """Muon's entry when several Muon settings ran (a momentum sweep): per measure, the
    member (each at its own best lr) with the fewest interpolated steps to the target, or
    the lowest final loss. Seconds are those steps times the members' mean step time: the
    settings cost the same per step, so pooling them only averages out the timing noise."""
    seconds = sum(per_family[f]["step_seconds"] for f in members) / len(members)

    def pick(key: str) -> str:
        return min(members, key=lambda f: (math.inf if per_family[f][key] is None else per_family[f][key], f))

    def seconds_of(steps):
        return math.inf if steps is None else steps * seconds

    time_by, muon_target_by, final_by = pick("steps_to_target"), pick("steps_to_muon_loss"), pick("final_loss")
    to_target, to_muon, final = per_family[time_by], per_family[muon_target_by], per_family[final_by]
    return {
        "lr_time": to_target["lr_time"], "steps_to_target": to_target["steps_to_target"],
        "seconds_to_target": seconds_of(to_target["steps_to_target"]),
        "lr_time_muon_target": to_muon["lr_time_muon_target"], "steps_to_muon_loss": to_muon["steps_to_muon_loss"],
        "seconds_to_muon_loss": seconds_of(to_muon["steps_to_muon_loss"]),
        "lr_final": final["lr_final"], "final_loss": final["final_loss"], "step_seconds": seconds,
        "members": list(members), "time_by": time_by, "muon_target_by": muon_target_by, "final_by": final_by,
    }


def cell_measures(results: Sequence[RunResult], ours: Sequence[str], step_seconds: dict[str, float]) -> dict:
    """The map's three ratios (best of ``ours`` over Muon) and what they were built from.

    Muon is the best of every Muon family in ``results`` (``muon``, or a momentum sweep
    ``muon{mom=0.95}``, ``muon{mom=0.85}``, ...): its entry ``families["muon"]`` names the
    member behind each measure."""
    adamw = best_of(results, REFERENCE)
    target = adamw.final_loss
    members = muon_members(list(dict.fromkeys(family_of(r) for r in results)))
    muon_loss = min(best_of(results, f).final_loss for f in members)
    per_family = {}
    for family in [*members, *ours]:
        to_target, to_muon = best_of(results, family, target), best_of(results, family, muon_loss)
        final = best_of(results, family)
        per_family[family] = {
            "lr_time": to_target.lr, "seconds_to_target": _seconds_to(to_target, target, step_seconds),
            "steps_to_target": crossing_step(to_target, target),
            "lr_time_muon_target": to_muon.lr,
            "seconds_to_muon_loss": _seconds_to(to_muon, muon_loss, step_seconds),
            "steps_to_muon_loss": crossing_step(to_muon, muon_loss),
            "lr_final": final.lr, "final_loss": final.final_loss,
            "step_seconds": step_seconds[family],
        }
    if members != [MUON]:
        per_family[MUON] = _muon_group(per_family, members)
    muon = per_family[MUON]

    def best_ratio(key: str, reference: float) -> tuple[float, str]:
        value, family = min((per_family[f][key], f) for f in ours)
        if math.isinf(reference):  # Muon never got there: ours wins outright or ties at never
            return (math.inf if math.isinf(value) else 0.0), family
        return value / reference, family

    time_ratio, time_by = best_ratio("seconds_to_target", muon["seconds_to_target"])
    muon_target_ratio, muon_target_by = best_ratio("seconds_to_muon_loss", muon["seconds_to_muon_loss"])
    loss_ratio, loss_by = best_ratio("final_loss", muon_loss)
    return {
        "target": target, "adamw_lr": adamw.lr, "muon_final_loss": muon_loss,
        "time_ratio": time_ratio, "time_ratio_by": time_by,
        "time_ratio_muon_target": muon_target_ratio, "time_ratio_muon_target_by": muon_target_by,
        "loss_ratio": loss_ratio, "loss_ratio_by": loss_by, "families": per_family,
    }


def chosen_lrs(measures: dict) -> dict[str, list[float]]:
    """Each family's lrs picked by any measure on the first seed (AdamW: its best point)."""
    lrs = {REFERENCE: [measures["adamw_lr"]]}
    for family, m in measures["families"].items():
        if "members" in m:  # Muon's group entry: its members carry their own lrs
            continue
        lrs[family] = sorted({m["lr_time"], m["lr_time_muon_target"], m["lr_final"]})
    return lrs


def edge_families(results: Sequence[RunResult], measures: dict) -> dict[str, str]:
    """Families whose best point, for any measure, is their grid's smallest or largest lr."""
    edges = {}
    for target in (None, measures["target"], measures["muon_final_loss"]):
        for family, where in grid_edges(results, target).items():
            if where != "inside":
                edges.setdefault(family, where)
    return edges


# --------------------------------------------------------------------------- running
_CORPORA: dict[tuple[int, int], ByteCorpus] = {}


def corpus_for(corpus_bytes: int, seq_len: int) -> ByteCorpus:
    key = (corpus_bytes, seq_len)
    if key not in _CORPORA:
        _CORPORA[key] = ByteCorpus(load_corpus(corpus_bytes), seq_len)
    return _CORPORA[key]


def _grid_entries(grid: Sequence[tuple], lrs: dict[str, Sequence[float]]) -> list[tuple]:
    return [(family, method, overrides, tuple(lrs[family])) for family, method, overrides, _ in grid if lrs.get(family)]


def run_cell(width: int, ratio: float, tokens_per_step: int, seed: int, args, grid, ours, first_seed_json: dict | None,
             train_fn: TrainFn, transfer_from: str | None = None) -> dict:
    """Train one (cell, seed) and return its JSON record."""
    model, base_train, precond = configs_from_args(args)
    model = replace(model, d_model=width)
    body, total = parameter_counts(model)
    steps = cell_steps(ratio, body, tokens_per_step)
    train = replace(base_train, steps=steps, batch_size=tokens_per_step // model.seq_len, seed=seed,
                    warmup_steps=max(1, round(WARMUP_FRACTION * steps)), eval_every=max(1, steps // EVALS_PER_RUN),
                    stop_after=0)
    ctx = DistContext(0, 1, torch.device("cpu"))
    corpus = corpus_for(int(args.corpus_mb * 2**20), model.seq_len) if train_fn is train_round_robin else None

    def train_grid(entries):
        contenders = sweep_contenders(entries, {}, [], train.weight_decay, precond)
        return train_fn(contenders, model, train, ctx, corpus=corpus, progress=False)

    if first_seed_json is None:  # the full sweep, extended past any edge it picks
        lrs = {family: list(family_lrs) for family, _, _, family_lrs in grid}
        results = train_grid(grid)
        step_seconds = family_step_seconds(results)
        extensions = []
        for _ in range(args.max_extend):
            measures = cell_measures(results, ours, step_seconds)
            new = {}
            for family, where in edge_families(results, measures).items():
                lr = min(lrs[family]) / 2 if where == "low edge" else max(lrs[family]) * 2
                lrs[family].append(lr)
                new[family] = [lr]
                extensions.append({"family": family, "edge": where, "added_lr": lr})
            if not new:
                break
            results += train_grid(_grid_entries(grid, new))
    else:
        lrs = first_seed_json["chosen_lrs"]
        results = train_grid(_grid_entries(grid, lrs))
        step_seconds = family_step_seconds(results)
        extensions = []
    measures = cell_measures(results, ours, step_seconds)
    return {
        "width": width, "ratio": ratio, "tokens_per_step": tokens_per_step, "seed": seed,
        "params_non_embedding": body, "params_all": total, "ratio_all_params": ratio * body / total,
        "steps": steps, "model": asdict(model), "train": asdict(train), "ours": list(ours),
        "lr_grid": {family: sorted(v) for family, v in lrs.items()}, "extensions": extensions,
        "lrs_from": transfer_from,
        "edges_left": edge_families(results, measures) if first_seed_json is None else {},
        "chosen_lrs": chosen_lrs(measures) if first_seed_json is None else first_seed_json["chosen_lrs"],
        "measures": measures, "runs": [asdict(r) for r in results],
    }


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def run_map(args, train_fn: TrainFn = train_round_robin) -> None:
    grid = [parse_family(entry) for entry in (args.grid or DEFAULT_GRID)]
    families = [family for family, *_ in grid]
    muons = muon_members(families)
    if REFERENCE not in families or not muons:
        raise SystemExit("--grid needs an adamw family (the target) and a muon family (the reference)")
    if len(muons) > 1 and MUON in muons:
        raise SystemExit(f"--grid: several Muon families {muons} are one reference, the best of them, which is "
                         "named 'muon'; spell out every member's settings (e.g. muon{mom=0.9}) instead of a plain "
                         "'muon'")
    ours = [f for f in families if f != REFERENCE and f not in muons]
    if not ours:
        raise SystemExit("--grid needs at least one family besides adamw and muon")
    model, _, _ = configs_from_args(args)
    cells = [(w, r, t) for w in args.widths for r in args.ratios for t in args.tokens_per_step]
    if not args.sweep_ratios:
        args.sweep_ratios = list(args.ratios)
    if min(args.ratios) not in args.sweep_ratios:
        raise SystemExit(f"--sweep-ratios {args.sweep_ratios} must hold the smallest ratio {min(args.ratios)}")

    def cost(cell):  # training tokens of one run: run the cheap cells first
        width, ratio, _ = cell
        return ratio * parameter_counts(replace(model, d_model=width))[0]

    args.out.mkdir(parents=True, exist_ok=True)
    first = args.seeds[0]
    for seed in args.seeds:
        for width, ratio, tokens in sorted(cells, key=cost):
            path = args.out / f"{cell_name(width, ratio, tokens, seed)}.json"
            if path.exists():
                continue
            source = None
            if seed != first:
                source = cell_name(width, ratio, tokens, first)
            elif ratio not in args.sweep_ratios and (width, ratio, tokens) not in args.check:
                source = cell_name(width, max(r for r in args.sweep_ratios if r < ratio), tokens, first)
            first_json = None if source is None else json.loads((args.out / f"{source}.json").read_text())
            record = run_cell(width, ratio, tokens, seed, args, grid, ours, first_json, train_fn,
                              transfer_from=source if seed == first else None)
            m = record["measures"]
            print(f"{path.stem}: {record['steps']} steps, time x Muon {m['time_ratio']:.3f} ({m['time_ratio_by']}), "
                  f"to Muon's loss {m['time_ratio_muon_target']:.3f}, final loss x Muon {m['loss_ratio']:.4f} "
                  f"({m['loss_ratio_by']}), extensions {record['extensions']}", flush=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(_json_safe(record)))
            tmp.replace(path)  # a killed run never leaves a half-written cell behind


# --------------------------------------------------------------------------- report
def _ratio(value) -> float:
    return math.inf if value is None else float(value)


def load_cells(out: Path) -> dict[tuple, list[dict]]:
    """(width, ratio, tokens per step) -> the JSON record of each seed done."""
    cells: dict[tuple, list[dict]] = {}
    for path in sorted(out.glob("w*_r*_t*_s*.json")):
        record = json.loads(path.read_text())
        cells.setdefault((record["width"], record["ratio"], record["tokens_per_step"]), []).append(record)
    return cells


def pooled_step_costs(cells: dict[tuple, list[dict]]) -> dict[tuple, dict[str, float]]:
    """(width, tokens per step) -> each family's step cost over Muon's, pooled over every
    cell and seed of that width and batch: the step-weighted geometric mean of the ratio
    inside each interleaved process. One process's ratio carries the machine's load noise
    (tens of per cent at a few dozen steps on a shared machine); the pool averages it out."""
    sums: dict[tuple, dict[str, list[float]]] = {}
    for (width, _, tokens), records in cells.items():
        for record in records:
            families = record["measures"]["families"]
            muon = families[MUON]["step_seconds"]
            for family, m in families.items():
                acc = sums.setdefault((width, tokens), {}).setdefault(family, [0.0, 0.0])
                acc[0] += record["steps"] * math.log(m["step_seconds"] / muon)
                acc[1] += record["steps"]
    return {key: {f: math.exp(a / n) for f, (a, n) in fams.items()} for key, fams in sums.items()}


def add_pooled_measures(cells: dict[tuple, list[dict]]) -> None:
    """Adds to each record's measures ``steps_ratio`` (best of ours' interpolated steps to
    AdamW's final loss over Muon's: free of timing noise) and ``time_ratio_pooled`` (steps
    ratio x pooled step-cost ratio, best over ours)."""
    costs = pooled_step_costs(cells)
    for (width, _, tokens), records in cells.items():
        for record in records:
            m = record["measures"]
            fams, muon_steps = m["families"], m["families"][MUON]["steps_to_target"]
            steps = {f: math.inf if fams[f]["steps_to_target"] is None else fams[f]["steps_to_target"]
                     for f in record["ours"]}
            m["steps_ratio"], m["steps_ratio_by"] = min((steps[f] / muon_steps, f) for f in record["ours"])
            m["time_ratio_pooled"], m["time_ratio_pooled_by"] = min(
                (steps[f] / muon_steps * costs[(width, tokens)][f], f) for f in record["ours"])
            # to Muon's own final loss: steps recovered from seconds / the process's step time
            to_muon = {f: _ratio(fams[f]["seconds_to_muon_loss"]) / fams[f]["step_seconds"]
                       for f in [MUON, *record["ours"]]}
            m["time_ratio_muon_target_pooled"] = min(
                to_muon[f] / to_muon[MUON] * costs[(width, tokens)][f] for f in record["ours"])


def seed_mean(records: Sequence[dict], key: str) -> float:
    values = [_ratio(r["measures"][key]) for r in records]
    return sum(values) / len(values)


def _fmt(x: float, digits: int = 2) -> str:
    return "never" if math.isinf(x) else f"{x:.{digits}f}"


def markdown_table(cells: dict[tuple, list[dict]]) -> str:
    costs = pooled_step_costs(cells)
    rows = ["| width | tokens/param (non-emb; all) | tokens/step | steps | lrs | seeds | time to AdamW's loss x Muon "
            "(per seed) | steps to it x Muon | time to it x Muon, pooled step cost (step x Muon) | "
            "time to Muon's loss x Muon (measured; pooled step cost) | final loss x Muon | "
            "final losses Muon / best of ours (seed 0) | lrs AdamW / Muon / ours (seed 0) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (width, ratio, tokens), records in sorted(cells.items()):
        records = sorted(records, key=lambda r: r["seed"])
        first = records[0]
        m = first["measures"]
        fams = m["families"]
        ours_lrs = ", ".join(f"{f} {fams[f]['lr_time']:g}/{fams[f]['lr_final']:g}" for f in first["ours"])

        def per_seed(key: str, digits: int, records: Sequence[dict] = records) -> str:
            values = [_fmt(_ratio(r["measures"][key]), digits) for r in records]
            return f"**{_fmt(seed_mean(records, key), digits)}** ({', '.join(values)})"

        best_final = min(fams[f]["final_loss"] for f in first["ours"])
        rows.append(
            f"| {width} | {ratio:g}; {first['ratio_all_params']:.0f} | {tokens} | {first['steps']}"
            f"{'*' if first['steps'] < FEW_STEPS else ''} | {_lr_origin(first)} | "
            f"{','.join(str(r['seed']) for r in records)} | "
            f"{per_seed('time_ratio', 2)} ({m['time_ratio_by']}) | {per_seed('steps_ratio', 2)} | "
            f"{per_seed('time_ratio_pooled', 2)} ({m['time_ratio_pooled_by']}; "
            f"{', '.join(f'{costs[(width, tokens)][f]:.2f}' for f in first['ours'])}) | "
            f"{per_seed('time_ratio_muon_target', 2)}; pooled {per_seed('time_ratio_muon_target_pooled', 2)} | "
            f"{per_seed('loss_ratio', 4)} ({m['loss_ratio_by']}) | {m['muon_final_loss']:.4f} / {best_final:.4f} | "
            f"{m['adamw_lr']:g} / {fams[MUON]['lr_time']:g}/{fams[MUON]['lr_final']:g}{_muon_settings(fams[MUON])} / "
            f"{ours_lrs} |")
    return "\n".join(rows)


def _muon_settings(muon: dict) -> str:
    """' (mom=0.85/mom=0.9)': the Muon settings behind the time and final-loss measures."""
    if "members" not in muon:
        return ""
    return f" ({settings_of(muon['time_by'])}/{settings_of(muon['final_by'])})"


TARGET_RATIO = 0.8  # the target: <= 0.8x Muon's wall-clock to each target


def _over(value: float, reference: float) -> float:
    """value / reference, where Muon never reaching a target makes ours win outright or tie at never."""
    if math.isinf(reference):
        return math.inf if math.isinf(value) else 0.0
    return value / reference


def _run_of(record: dict, family: str, lr: float) -> RunResult | None:
    return next((RunResult(**r) for r in record["runs"]
                 if family_of(RunResult(**r)) == family and math.isclose(r["lr"], lr)), None)


def muon_configuration(records: Sequence[dict]) -> dict:
    """Muon's best single configuration (one momentum and one lr on every seed), per measure:
    the fewest interpolated steps to AdamW's final loss, and the lowest final loss, each by
    the mean over seeds. Per seed: its steps and seconds (at the Muon members' mean step
    time, as in the map) to AdamW's loss, and its final loss. Only (family, lr) pairs run on
    every seed compete."""
    members = muon_members(list(records[0]["measures"]["families"]))
    members = [f for f in members if f != MUON] or [MUON]
    candidates = sorted({(family_of(RunResult(**r)), r["lr"]) for r in records[0]["runs"]
                         if family_of(RunResult(**r)) in members})
    per_config = {}
    for family, lr in candidates:
        runs = [_run_of(record, family, lr) for record in records]
        if any(run is None for run in runs):
            continue
        steps = [crossing_step(run, record["measures"]["target"]) for run, record in zip(runs, records)]
        steps = [math.inf if s is None else s for s in steps]
        per_config[(family, lr)] = {
            "steps": steps,
            "seconds": [s * r["measures"]["families"][MUON]["step_seconds"] for s, r in zip(steps, records)],
            "final_loss": [run.final_loss for run in runs]}
    time_key = min(per_config, key=lambda k: (sum(per_config[k]["steps"]), k))
    final_key = min(per_config, key=lambda k: (sum(per_config[k]["final_loss"]), k))
    return {"time": (time_key, per_config[time_key]), "final": (final_key, per_config[final_key])}


def configuration_rows(cells: dict[tuple, list[dict]]) -> list[dict]:
    """Each of ours at each lr its cell's first seed chose, over every seed: the three
    ratios of that one (family, lr) against Muon's best point per measure in the same
    process. The map's headline takes, per seed and per measure, the best of all ours at
    any chosen lr; a single configuration has to win all three measures by itself.

    Against Muon's best point per seed, one configuration of ours competes with a Muon
    re-tuned on every seed's noise; ``*_vs_one`` (time to AdamW's loss, measured and with
    pooled step cost, and final loss) compare it with Muon's best single configuration
    instead (``muon_configuration``): one setting against one setting."""
    costs = pooled_step_costs(cells)
    rows = []
    for (width, ratio, tokens), records in sorted(cells.items()):
        records = sorted(records, key=lambda r: r["seed"])
        first = records[0]
        muon_one = muon_configuration(records)
        (_, muon_time), (_, muon_final) = muon_one["time"], muon_one["final"]
        for family in first["ours"]:
            for lr in first["chosen_lrs"][family]:
                per_seed = {"time": [], "time_pooled": [], "to_muon": [], "to_muon_pooled": [], "loss": [],
                            "time_vs_one": [], "time_pooled_vs_one": [], "loss_vs_one": []}
                for i, record in enumerate(records):
                    m = record["measures"]
                    fams, muon = m["families"], m["families"][MUON]
                    run = _run_of(record, family, lr)
                    step_s, cost = fams[family]["step_seconds"], costs[(width, tokens)][family]
                    for key, target, muon_seconds in (("time", m["target"], muon["seconds_to_target"]),
                                                      ("to_muon", m["muon_final_loss"], muon["seconds_to_muon_loss"])):
                        crossing = crossing_step(run, target)
                        steps = math.inf if crossing is None else crossing
                        muon_steps = _ratio(muon_seconds) / muon["step_seconds"]
                        per_seed[key].append(_over(steps * step_s, _ratio(muon_seconds)))
                        per_seed[key + "_pooled"].append(_over(steps * cost, muon_steps))
                    per_seed["loss"].append(run.final_loss / m["muon_final_loss"])
                    crossing = crossing_step(run, m["target"])
                    steps = math.inf if crossing is None else crossing
                    per_seed["time_vs_one"].append(_over(steps * step_s, muon_time["seconds"][i]))
                    per_seed["time_pooled_vs_one"].append(_over(steps * cost, muon_time["steps"][i]))
                    per_seed["loss_vs_one"].append(run.final_loss / muon_final["final_loss"][i])
                mean = {key: sum(v) / len(v) for key, v in per_seed.items()}
                met = [max(mean["time"], mean["time_pooled"]) <= TARGET_RATIO,
                       max(mean["to_muon"], mean["to_muon_pooled"]) <= TARGET_RATIO, mean["loss"] < 1.0]
                median = {key: statistics.median(v) for key, v in per_seed.items()}
                rows.append({"cell": (width, ratio, tokens), "family": family, "lr": lr,
                             "seeds": [r["seed"] for r in records], "per_seed": per_seed, "mean": mean,
                             "median": median, "met": met,
                             "muon_one": {k: f"{f} lr={lr_:g}" for k, ((f, lr_), _) in muon_one.items()}})
    return rows


def configuration_table(cells: dict[tuple, list[dict]]) -> str:
    rows = ["| width | tokens/param | tokens/step | family | lr | seeds | time to AdamW's loss x Muon "
            "(per seed; pooled step cost) | time to Muon's loss x Muon (per seed; pooled) | final loss x Muon "
            f"(per seed) | targets met (both times <= {TARGET_RATIO:g}x Muon's, final loss below Muon's) | "
            "one setting against Muon's best one: time to AdamW's loss "
            "(per seed; pooled), median; final loss, median |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in configuration_rows(cells):
        width, ratio, tokens = row["cell"]
        s, mean = row["per_seed"], row["mean"]

        def col(key: str, digits: int, mean: dict = mean, s: dict = s) -> str:
            return f"**{_fmt(mean[key], digits)}** ({', '.join(_fmt(v, digits) for v in s[key])})"

        def median(key: str, digits: int, row: dict = row, s: dict = s) -> str:
            return f"**{_fmt(row['median'][key], digits)}** ({', '.join(_fmt(v, digits) for v in s[key])})"

        verdict = ", ".join(name for name, ok in zip(("time", "to Muon's loss", "final loss"), row["met"]) if ok)
        rows.append(f"| {width} | {ratio:g} | {tokens} | {row['family']} | {row['lr']:g} | "
                    f"{','.join(map(str, row['seeds']))} | {col('time', 2)}; pooled {col('time_pooled', 2)} | "
                    f"{col('to_muon', 2)}; pooled {col('to_muon_pooled', 2)} | {col('loss', 4)} | "
                    f"{sum(row['met'])} of 3{': ' + verdict if verdict else ''} | {median('time_vs_one', 2)}; "
                    f"pooled {median('time_pooled_vs_one', 2)} ({row['muon_one']['time']}); "
                    f"{median('loss_vs_one', 4)} ({row['muon_one']['final']}) |")
    return "\n".join(rows)


def _lr_origin(record: dict) -> str:
    source = record.get("lrs_from")
    return "swept" if not source else "from " + source.split("_")[1].replace("r", "ratio ")


def transfer_check(cells: dict[tuple, list[dict]]) -> str:
    """For each swept cell at a ratio where other cells took transferred lrs: the lrs its own
    sweep chose against those the transfer rule gives (the cell it would have taken them from)."""
    first = {cell: min(records, key=lambda r: r["seed"]) for cell, records in cells.items()}
    transferred = {(c[0], c[1]): r["lrs_from"] for c, r in first.items() if r.get("lrs_from")}
    lines = []
    for (width, ratio, tokens), record in sorted(first.items()):
        if record.get("lrs_from") or not any(r == ratio for _, r in transferred):
            continue
        source_ratio = float(next(v for (w, r), v in transferred.items() if r == ratio).split("_")[1][1:])
        source = first.get((width, source_ratio, tokens))
        if source is None:
            continue
        lines.append(f"- d={width}, {ratio:g} tokens/param, {tokens} tokens/step: its own sweep chose "
                     f"{record['chosen_lrs']} (grid {record['lr_grid']}); the transfer rule (ratio "
                     f"{source_ratio:g}) gives {source['chosen_lrs']}; with its own lrs: time x Muon "
                     f"{_fmt(_ratio(record['measures']['time_ratio']))}, final loss x Muon "
                     f"{_fmt(_ratio(record['measures']['loss_ratio']), 4)}")
    return "\n".join(lines)


def _short(family: str) -> str:
    """A heat-map label: ``kfac_muon{mom=0.8}`` -> ``kfac+Muon (0.8)``."""
    settings = settings_of(family).replace("mom=", "")
    return method_of(family).replace("_muon", "+Muon") + (f" ({settings})" if settings else "")


def plot_map(cells: dict[tuple, list[dict]], path: Path) -> None:
    """One row per width: seed-mean time ratio and final-loss ratio (ours / Muon) per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    widths = sorted({c[0] for c in cells})
    ratios = sorted({c[1] for c in cells})
    tokens = sorted({c[2] for c in cells})
    fig, axes = plt.subplots(len(widths), 2, figsize=(9, 2.2 + 1.6 * len(widths)), squeeze=False)
    panels = (("time_ratio_pooled", "wall-clock to AdamW's final loss (pooled step\ncost), best of ours / Muon",
               TwoSlopeNorm(1.0, 0.6, 1.4), 2),
              ("loss_ratio", "final held-out loss,\nbest of ours / Muon", TwoSlopeNorm(1.0, 0.97, 1.03), 3))
    for row, width in enumerate(widths):
        for col, (key, label, norm, digits) in enumerate(panels):
            ax = axes[row][col]
            grid = [[math.nan] * len(ratios) for _ in tokens]
            for i, t in enumerate(tokens):
                for j, r in enumerate(ratios):
                    records = cells.get((width, r, t))
                    if not records:
                        continue
                    value = seed_mean(records, key)
                    grid[i][j] = min(value, 10.0)
                    few = records[0]["steps"] < FEW_STEPS
                    text = (_fmt(value, digits) + ("*" if few else "")
                            + f"\n{_short(records[0]['measures'][key + '_by'])}"
                            + f"\n{records[0]['steps']} steps, {len(records)} seed{'s' * (len(records) > 1)}")
                    shade = float(norm(min(value, 10.0)))
                    ax.text(j, i, text, ha="center", va="center", fontsize=7,
                            color="white" if shade < 0.15 or shade > 0.85 else "black")
            image = ax.imshow(grid, cmap="RdBu_r", norm=norm, origin="lower", aspect="auto")
            ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
            ax.set_yticks(range(len(tokens)), [f"{t // 1024}k" for t in tokens])
            ax.set_xlabel("tokens per non-embedding parameter")
            ax.set_ylabel("tokens per step")
            ax.set_title(f"d_model={width}: {label}", fontsize=8)
            fig.colorbar(image, ax=ax, fraction=0.046)
    swept = any("members" in r["measures"]["families"][MUON] for records in cells.values() for r in records)
    fig.suptitle("char-LM regime map: blue = curvature + Muon beats Muon (mean of seeds; * = fewer than "
                 f"{FEW_STEPS} steps)"
                 + ("\nevery Muon-based family at its best lr and momentum per cell" if swept else ""),
                 fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _cells(text: str) -> list[tuple[int, float, int]]:
    cells = []
    for item in filter(None, text.split(",")):
        width, ratio, tokens = item.split(":")
        cells.append((int(width), float(ratio), int(tokens)))
    return cells


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--widths", type=_ints, default=[12, 16], help="d_model of the two (or more) panels")
    p.add_argument("--ratios", type=_floats, default=[5.0, 40.0, 160.0],
                   help="training tokens per non-embedding parameter (Chinchilla: ~20)")
    p.add_argument("--tokens-per-step", type=_ints, default=[4096, 16384], help="tokens per optimizer step")
    p.add_argument("--seeds", type=_ints, default=[0, 1],
                   help="seeds (weights and data order); the first runs the lr sweep")
    p.add_argument("--grid", action="append", metavar="METHOD=LR,LR",
                   help=f"families and lrs as in benchmarks/convergence.py (repeatable); default {DEFAULT_GRID}; "
                        "every family but adamw and the muon ones is one of ours; several muon families (e.g. "
                        "muon{mom=0.95} and muon{mom=0.85}) form one reference, the best of them per measure")
    p.add_argument("--max-extend", type=int, default=2, help="grid extensions past an edge per cell")
    p.add_argument("--sweep-ratios", type=_floats, default=[],
                   help="ratios whose cells run the lr sweep on the first seed (default: all); a cell at "
                        "another ratio reuses the lrs chosen at the largest swept ratio below it (same width "
                        "and tokens per step): the transfer rule")
    p.add_argument("--check", type=_cells, default=[],
                   help="cells WIDTH:RATIO:TOKENS that run the full sweep anyway, to check the transfer rule")
    p.add_argument("--report-only", action="store_true", help="only rebuild the table and heat map from --out")
    p.add_argument("--png", type=Path, default=None, help="heat map path (default OUT/regimes.png)")
    p.add_argument("--out", type=Path, default=Path("runs/regimes"), help="folder of the per-cell JSON files")
    add_training_args(p)  # --seq-len, --n-layers, --n-heads, preconditioner flags; --steps etc. are per cell
    p.set_defaults(n_heads=2, corpus_mb=0.0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, train_fn: TrainFn = train_round_robin) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.report_only:
        if args.corpus_mb <= 0:  # twice the largest cell's training tokens (held-out 10 % on top)
            model, _, _ = configs_from_args(args)
            most = max(r * parameter_counts(replace(model, d_model=w))[0] for w in args.widths for r in args.ratios)
            stdlib = sum(path.stat().st_size for path in stdlib_source_files())
            args.corpus_mb = min(stdlib, 2 * most / 0.9) / 2**20
        run_map(args, train_fn)
    cells = load_cells(args.out)
    add_pooled_measures(cells)
    table = markdown_table(cells)
    check = transfer_check(cells)
    if check:
        table += "\n\ntransfer-rule check (cells swept at a ratio where others reuse lrs):\n" + check
    if cells:
        table += ("\n\none configuration (family, lr) over every seed, against Muon's best point per measure "
                  f"(a target is met when the seed mean is <= {TARGET_RATIO}x, measured and with pooled step "
                  "cost; final loss: below Muon's):\n" + configuration_table(cells))
    print(table)
    (args.out / "regimes.md").write_text(table + "\n")
    if cells:
        png = args.png or args.out / "regimes.png"
        plot_map(cells, png)
        print(f"saved {png} and {args.out / 'regimes.md'}")
    return cells


if __name__ == "__main__":
    main()
