"""Budget-equivalent speed-up of WhitenedMuon over the best-tuned Muon and NorMuon.

"Time to a target loss" on one fixed schedule only sees the last few per cent of a run,
where every Muon-family curve has nearly converged. What a user gains is how many more
steps the baseline needs to end where we end, with its own full schedule. So:

1. each baseline (``muon``: torch.optim.Muon, fused experts through examples/expert_muon.py;
   ``normuon``: benchmarks/normuon.py) runs
   at 1x, 1.25x and 1.5x the step budget ``N``, each with its own warm-up + cosine
   schedule spanning that budget (warm-up 5 % of it, the main job's 30 of 600);
2. its final held-out loss is interpolated between those budgets, linearly in log(steps)
   (``matching_budget``), and the budget ``B*`` at which it equals our final loss after
   ``N`` steps is read off: speed-up in steps ``= B* / N``;
3. in wall-clock, ``speed-up in steps / (our step time / the baseline's step time)``, the
   step-time ratio taken from the 1x run, where every method trains interleaved
   (examples/char_lm.py's ``train_round_robin``: step 1 of each, then step 2, ...), so
   load from other processes slows them all alike; each run's first step (one-off work) is
   left out of its mean.

Tuning (the same budget for every baseline): on the first seed, every baseline runs the
grid ``--lrs`` x ``--momenta`` (lr in sqrt(2) steps) at 1x. Where a baseline's best point
(lowest final loss) is on an edge of its grid -- the lr at its best momentum, or the
momentum at its best lr -- the next point beyond that edge is trained (lr x or / sqrt(2);
``1 - momentum`` halved or doubled), up to ``--max-extend`` rounds, so best points end
inside their grids; extension runs train in a process of their own and are not used for
step times. At 1.25x and 1.5x each baseline runs its 1x best momentum at its best lr and
the lrs sqrt(2) either side (extended the same way if the best one is an edge), since a
longer run may prefer a smaller lr: a baseline held at its 1x lr would be under-tuned at
the longer budgets and would inflate our speed-up. Later seeds rerun, per budget, the
point the first seed chose (another initialisation and data order), like
benchmarks/regimes.py. ``--longer-lrs chosen`` runs only the 1x choice at the longer budgets
(to save device time): a baseline held at its 1x lr is at best as good there as a
re-tuned one, which can only flatter ours: say so wherever such a figure is quoted.

"Ours" is ``wmuon`` of the examples at the examples' defaults (lr fixed at ``DEFAULT_LRS["wmuon"]``, momentum
0.9, ``PrecondConfig``'s wmuon settings), untuned: what a user gets. ``--sweep-ours`` also
tunes it on the baselines' grid at 1x (a "wmuon (tuned)" row; charged the default run's
step time, since lr and momentum do not change a step's cost). NorMuon is also measured as
if it were ours against Muon, to check the baseline against the paper's claim.

Each (seed, budget, part) is written to ``OUT/s{seed}_b{budget}_{part}.json`` when done and
skipped on a rerun, so a killed run resumes; ``--report-only`` rebuilds the tables.

    OMP_NUM_THREADS=1 python benchmarks/budget_speedup.py --threads 1 --seeds 0,1,2 --sweep-ours \\
        --max-extend 3 --out benchmarks/results/budget_speedup     # ~21 CPU-minutes on one thread
    python benchmarks/budget_speedup.py --report-only --sweep-ours --out benchmarks/results/budget_speedup
    python benchmarks/budget_speedup.py --wmuon-output-side none --device cuda --amp --amp-dtype bfloat16 \\
        --d-model 768 --n-layers 12 --n-heads 12 --seq-len 256 --batch-size 256 --steps 200 --eval-seqs 256 \\
        --corpus-mb 12 --seeds 0 --lrs 0.002828,0.004,0.005657 --momenta 0.9 --baselines muon \\
        --max-extend 0 --longer-lrs chosen --out runs/gpu               # docs/results.md, "On a GPU"
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "examples"))

from benchmarks.convergence import family_of  # noqa: E402
from benchmarks.normuon import NorMuon  # noqa: E402
from benchmarks.regimes import _json_safe, corpus_for, parameter_counts  # noqa: E402
from char_lm import (  # noqa: E402
    DEFAULT_LRS,
    Contender,
    RunResult,
    add_training_args,
    configs_from_args,
    method_contender,
    train_round_robin,
)
from kron_examples_common import (  # noqa: E402
    DistContext,
    OptimizerChain,
    PrecondConfig,
    build_optimizer,
    muon_param_split,
    muon_transposed,
    resolve_device,
    unwrap,
)

BASELINES = ("muon", "normuon", "adamw")
DEFAULT_BASELINES = ("muon", "normuon")  # AdamW on request (--baselines adamw): its momentum grid is one point
LABELS = {"muon": "Muon", "normuon": "NorMuon", "adamw": "AdamW"}  # the tables' names of the baselines
OURS = "wmuon"  # the examples' method, at the examples' defaults
BUDGETS = (1.0, 1.25, 1.5)
WARMUP_FRACTION = 0.05
EVALS_PER_RUN = 5  # only the final loss enters the measure (256 held-out windows of 64 bytes)
SQRT2 = math.sqrt(2.0)


# --------------------------------------------------------------------------- the measure
def matching_budget(steps: Sequence[float], losses: Sequence[float], target: float) -> tuple[float, str]:
    """The smallest step budget at which a baseline's final loss reaches ``target``.

    ``losses[i]`` is the final loss of a run with its own full schedule over ``steps[i]``
    steps; between budgets the loss is taken to be linear in ``log(steps)``. From the
    smallest budget up, the first segment that falls through ``target`` gives the answer
    (``"interpolated"``). A target outside the measured range is extrapolated along the
    end segment nearest to it (``"extrapolated"``: a rough figure, reported as such): below
    the smallest budget when that budget already ends at or under the target (ours is no
    better than the baseline's 1x), past the largest when no budget reaches it. Where that
    end segment does not fall, the budget is ``nan`` (``"undetermined"``: the noise is
    larger than the trend there) or, past the largest, ``inf`` (``"unreached"``)."""
    if len(steps) != len(losses) or len(steps) < 2:
        raise ValueError("need at least two (steps, loss) points")
    points = sorted(zip(steps, losses))
    xs = [math.log(s) for s, _ in points]
    ys = [loss for _, loss in points]

    def along(i: int) -> float:  # exp of the log-steps where segment i's line takes the target
        return math.exp(xs[i] + (xs[i + 1] - xs[i]) * (ys[i] - target) / (ys[i] - ys[i + 1]))

    if target == ys[0]:
        return math.exp(xs[0]), "interpolated"
    if target > ys[0]:  # the smallest budget is already there: B* <= N
        return (along(0), "extrapolated") if ys[1] < ys[0] else (math.nan, "undetermined")
    for i in range(len(xs) - 1):
        if ys[i] > target >= ys[i + 1]:
            return along(i), "interpolated"
    if ys[-1] < ys[-2]:  # no budget reaches the target: past the largest
        return along(len(xs) - 2), "extrapolated"
    return math.inf, "unreached"


def speedup(budget_steps: Sequence[float], budget_losses: Sequence[float], our_steps: float, our_loss: float,
            our_step_seconds: float, baseline_step_seconds: float) -> dict:
    """Budget-equivalent speed-up of one of our runs over one baseline, in steps and in
    wall-clock (the step-time ratio from the same interleaved run)."""
    budget, how = matching_budget(budget_steps, budget_losses, our_loss)
    steps_x = budget / our_steps
    step_ratio = our_step_seconds / baseline_step_seconds
    return {"matching_budget": budget, "how": how, "steps": steps_x, "step_ratio": step_ratio,
            "wallclock": steps_x / step_ratio}


def mean_spread(values: Sequence[float]) -> dict:
    """Mean, sample standard deviation (n - 1; 0 for one value), min and max. A seed whose
    budget is unreached (inf) or undetermined (nan) makes the mean inf or nan and the spread
    nan: reported as such, not dropped."""
    values = list(values)
    if not values:
        raise ValueError("no values")
    if not all(math.isfinite(v) for v in values):
        sd = math.nan
    else:
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "min": min(values), "max": max(values), "n": len(values)}


# --------------------------------------------------------------------------- contenders
def family_name(method: str, momentum: float | None) -> str:
    return method if momentum is None else f"{method}{{mom={momentum:g}}}"


def parse_family(family: str) -> tuple[str, float | None]:
    """``muon{mom=0.8}`` -> ("muon", 0.8); ``wmuon`` -> ("wmuon", None)."""
    method, _, rest = family.partition("{")
    return method, (float(rest.rstrip("}").split("=")[1]) if rest else None)


def build_normuon(model: torch.nn.Module, lr: float, weight_decay: float, momentum: float,
                  config: PrecondConfig) -> OptimizerChain:
    """NorMuon on Muon's usual hidden weights and fused experts (expert by expert) + AdamW on
    the rest (embeddings, head, norms, biases) at the same peak lr, as
    kron_examples_common.build_muon splits Muon."""
    hidden, experts, rest = muon_param_split(unwrap(model), config.skip_layers)
    return OptimizerChain([NorMuon(hidden + experts, lr=lr, weight_decay=weight_decay, momentum=momentum,
                                   transposed=muon_transposed(unwrap(model), config.skip_layers)),
                           build_optimizer("adamw", rest, lr, weight_decay, config)])


def contender(method: str, momentum: float | None, lr: float, weight_decay: float,
              precond: PrecondConfig) -> Contender:
    """One point: ``method`` (muon, normuon, or a METHODS key) at ``lr`` and ``momentum``
    (None: the examples' default momentum)."""
    name = f"{family_name(method, momentum)} lr={lr:g}"
    config = precond if momentum is None else replace(precond, muon_momentum=momentum)
    if method == "normuon":
        m = config.muon_momentum
        return Contender(name, lr,
                         build=lambda model, scaler: (build_normuon(model, lr, weight_decay, m, config), None))
    return replace(method_contender(method, lr, weight_decay, config), name=name)


# --------------------------------------------------------------------------- tuning
def _point(run: dict) -> tuple[str, float, float]:
    method, momentum = parse_family(family_of(_as_result(run)))
    return method, momentum, run["lr"]


def _as_result(run: dict) -> RunResult:
    return RunResult(**{k: v for k, v in run.items() if k != "wmuon"})


def best_point(runs: Sequence[dict], method: str) -> dict | None:
    """The run of ``method`` with the lowest final loss (ties: smaller lr, then name)."""
    mine = [r for r in runs if _point(r)[0] == method]
    return min(mine, key=lambda r: (r["eval_losses"][-1], r["lr"], r["name"])) if mine else None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6)


def _same_momentum(a: float | None, b: float | None) -> bool:
    return (a is None) == (b is None) and (a is None or _close(a, b))


def _neighbours(values: Sequence[float], at: float, below: float, above: float) -> list[float]:
    """The next value of ``values`` either side of ``at``; past the outermost, ``below`` / ``above``."""
    lower = [v for v in values if v < at and not _close(v, at)]
    higher = [v for v in values if v > at and not _close(v, at)]
    return [lower[-1] if lower else below, higher[0] if higher else above]


def edge_points(runs: Sequence[dict], method: str) -> list[tuple[float, float]]:
    """The (momentum, lr) neighbours of ``method``'s best point that have not run: at its
    momentum the next lr either side among the lrs the method ran (past the outermost, lr /
    or x sqrt(2)), and at its lr the next momentum either side among the momenta it ran
    (past the outermost, ``1 - momentum`` doubled or halved; momentum only where >= 2 ran).
    A best point all of whose neighbours ran is a local minimum of the grid; a best lr
    reached along one momentum (the grid's edge extended) gets its momentum neighbours too."""
    best = best_point(runs, method)
    if best is None:
        return []
    _, mom, lr = _point(best)
    points = [_point(r)[1:] for r in runs if _point(r)[0] == method]
    lrs = sorted({x for _, x in points})
    moms = sorted({m for m, _ in points})
    candidates = [(mom, x) for x in _neighbours(lrs, lr, lr / SQRT2, lr * SQRT2)]
    if len(moms) >= 2:
        candidates += [(m, lr) for m in _neighbours(moms, mom, 1 - 2 * (1 - mom), 1 - (1 - mom) / 2)
                       if 0.3 <= m <= 0.995]
    return [(m, x) for m, x in candidates if not any(_close(m, pm) and _close(x, px) for pm, px in points)]


# --------------------------------------------------------------------------- running
def record_path(out: Path, seed: int, budget: float, part: str) -> Path:
    return out / f"s{seed}_b{budget:g}_{part}.json"


def load_runs(out: Path, seed: int, budget: float) -> list[dict]:
    """Every run of ``seed`` at ``budget``, each with its record's WhitenedMuon settings under
    ``"wmuon"`` (``None`` in records written before they were kept)."""
    runs = []
    for path in sorted(out.glob(f"s{seed}_b{budget:g}_*.json")):
        record = json.loads(path.read_text())
        runs.extend({**run, "wmuon": record.get("wmuon")} for run in record["runs"])
    return runs


# WhitenedMuon settings that leave its step's cost as it is (the others change what a step does)
COST_NEUTRAL = ("wmuon_damping", "wmuon_output_damping", "wmuon_factor_decay", "wmuon_ns_coefficients")


def wmuon_settings(precond: PrecondConfig) -> dict:
    return {f: v for f, v in asdict(precond).items() if f.startswith("wmuon_")}


def stored_wmuon(settings: dict | None) -> dict:
    """A record's WhitenedMuon settings with the fields it lacks at their values when it was
    written: a record without settings predates the "auto" output side (it ran without one),
    a field added later (output damping, Newton-Schulz dtype, fused q/k/v) its default."""
    if settings is None:
        return {**wmuon_settings(PrecondConfig()), "wmuon_both_sides": False}
    return {**wmuon_settings(PrecondConfig()), **settings}


def same_step_cost(a: dict | None, b: dict | None) -> bool:
    """Whether two records' WhitenedMuon settings give a step of the same cost (a record
    without them is taken to hold the examples' defaults, without the output side)."""
    a, b = stored_wmuon(a), stored_wmuon(b)
    return all(a[f] == b[f] for f in a if f not in COST_NEUTRAL)


# the train fields train_part sets per record, whatever the flags say
PER_RECORD_TRAIN = ("steps", "seed", "warmup_steps", "eval_every", "stop_after")


def _as_stored(value):
    """``value`` as a record holds it (tuples as lists, non-finite floats as None)."""
    return json.loads(json.dumps(_json_safe(value)))


def record_mismatches(record: dict, model, train, precond: PrecondConfig) -> list[str]:
    """The settings in which a stored ``record`` differs from ``model``, ``train`` (but for
    ``PER_RECORD_TRAIN``) and ``precond``'s WhitenedMuon settings, as ``"model d_model: stored
    64, asked 48"``. A field the record lacks (written before it was kept) is taken at its value
    then: the dataclasses' defaults, and ``stored_wmuon``'s rule for WhitenedMuon."""
    asked = {"model": asdict(model), "train": asdict(train), "wmuon": wmuon_settings(precond)}
    stored = {"model": {**asdict(type(model)()), **record.get("model", {})},
              "train": {**asdict(type(train)()), **record.get("train", {})},
              "wmuon": stored_wmuon(record.get("wmuon"))}
    differing = []
    for part, fields in _as_stored(asked).items():
        for field, value in fields.items():
            if part == "train" and field in PER_RECORD_TRAIN:
                continue
            if _as_stored(stored[part].get(field)) != value:
                differing.append(f"{part} {field}: stored {stored[part].get(field)!r}, asked {value!r}")
    return differing


def budget_steps(args, budget: float) -> int:
    return round(args.steps * budget)


def train_part(args, seed: int, budget: float, part: str,
               points: Sequence[tuple[str, float | None, float]], extra: Sequence[Contender] = ()) -> list[dict]:
    """Train ``points`` (method, momentum, lr), then the ``extra`` contenders, interleaved at
    ``budget`` and save them."""
    path = record_path(args.out, seed, budget, part)
    model, base_train, precond = configs_from_args(args)
    if path.exists():
        record = json.loads(path.read_text())
        differing = record_mismatches(record, model, base_train, precond)
        if "steps" in record and record["steps"] != budget_steps(args, budget):
            differing.append(f"steps: stored {record['steps']}, asked {budget_steps(args, budget)}")
        refused = [d for d in differing if not d.startswith("wmuon ")]
        if refused:  # another command's record (another model, batch or length)
            raise ValueError(f"{path} was written with other settings than asked for: {'; '.join(refused)}; "
                             f"use another --out or move the record away")
        if differing:
            # WhitenedMuon's settings: the committed records were written under earlier defaults
            # (an output side, centring, fused q/k/v) that their commands do not spell out, and a
            # benchmark's variants set their own; said, not refused, so those tables still rebuild
            print(f"note: {path.name} was trained with other WhitenedMuon settings than this command's "
                  f"({'; '.join(differing)}); its runs are used as they were trained", file=sys.stderr, flush=True)
        stored = record["runs"]
        missing = [p for p in points if not any(_point(r)[0] == p[0] and _same_momentum(_point(r)[1], p[1])
                                                 and _close(_point(r)[2], p[2]) for r in stored)]
        if missing:  # another command's record (another tuned point): not the runs asked for
            raise ValueError(f"{path} holds other runs than the points asked for {missing} (method, momentum, "
                             f"lr); move it away to train them")
        return stored
    steps = budget_steps(args, budget)
    train = replace(base_train, steps=steps, seed=seed, warmup_steps=max(1, round(WARMUP_FRACTION * steps)),
                    eval_every=max(1, steps // EVALS_PER_RUN), stop_after=0)
    contenders = [contender(m, mom, lr, train.weight_decay, precond) for m, mom, lr in points] + list(extra)
    corpus = corpus_for(int(train.corpus_mb * 2**20), model.seq_len)
    ctx = DistContext(0, 1, resolve_device(args.device))
    results = train_round_robin(contenders, model, train, ctx, corpus=corpus, progress=False)
    runs = [asdict(r) for r in results]
    for run in runs:  # keep the raw per-step times, at a precision that does not bloat the file
        run["step_seconds"] = [round(s, 6) for s in run["step_seconds"]]
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(_json_safe({"seed": seed, "budget": budget, "part": part, "steps": steps,
                                          "model": asdict(model), "train": asdict(train),
                                          "wmuon": wmuon_settings(precond), "runs": runs})))
    tmp.replace(path)
    summary = ", ".join(f"{r['name']} {r['eval_losses'][-1]:.4f}" for r in runs)
    print(f"{path.stem}: {steps} steps: {summary}", flush=True)
    return runs


def tune(args, seed: int, budget: float, first_points: list, methods: Sequence[str],
         prefix: str = "", max_extend: int | None = None) -> dict[str, tuple[float, float]]:
    """Train ``first_points`` at ``budget`` and extend ``methods`` past the edges of their
    grids (``max_extend`` rounds, default ``args.max_extend``); each one's chosen (momentum,
    lr). ``prefix`` names the parts (``ours_``)."""
    runs = train_part(args, seed, budget, f"{prefix}grid", first_points)
    limit = args.max_extend if max_extend is None else max_extend
    round_ = 1
    # past the limit, the rounds another command already stored still count (a rerun with
    # --max-extend 0 must choose the point they found, not the first grid's best)
    while round_ <= limit or record_path(args.out, seed, budget, f"{prefix}ext{round_}").exists():
        new = [(m, mom, lr) for m in methods for mom, lr in edge_points(runs, m)]
        new = [p for p in new if not any(_point(r)[0] == p[0] and _close(_point(r)[1], p[1])
                                         and _close(_point(r)[2], p[2]) for r in runs)]
        if not new:
            break
        runs = runs + train_part(args, seed, budget, f"{prefix}ext{round_}", new)
        round_ += 1
    chosen = {}
    for m in methods:
        _, mom, lr = _point(best_point(runs, m))
        chosen[m] = (mom, lr)
    return chosen


def ours_default() -> tuple[str, float | None, float]:
    return (OURS, None, DEFAULT_LRS[OURS])


def run_all(args) -> dict:
    """Train every (seed, budget); returns the tuning seed's choices per budget."""
    first = args.seeds[0]
    chosen: dict[float, dict] = {}
    if not args.only_ours:
        grid = [(m, mom, lr) for m in args.baselines for mom in args.momenta for lr in args.lrs]
        chosen[1.0] = tune(args, first, 1.0, grid + [ours_default()], args.baselines)
        for budget in args.budgets:
            if budget == 1.0:
                continue
            factors = (1 / SQRT2, 1.0, SQRT2) if args.longer_lrs == "around" else (1.0,)
            around = [(m, mom, lr * f) for m in args.baselines for mom, lr in [chosen[1.0][m]] for f in factors]
            chosen[budget] = tune(args, first, budget, around, args.baselines,
                                  max_extend=args.max_extend if args.longer_lrs == "around" else 0)
        for seed in args.seeds[1:]:
            for budget in args.budgets:
                points = [(m, *chosen[budget][m]) for m in args.baselines]
                train_part(args, seed, budget, "chosen", points + ([ours_default()] if budget == 1.0 else []))
    if args.sweep_ours:  # ours on the baselines' grid, at 1x only (its step time: the default run's)
        grid = [(OURS, mom, lr) for mom in args.momenta for lr in args.lrs]
        chosen["ours"] = tune(args, first, 1.0, grid, [OURS], prefix="ours_")
        for seed in args.seeds[1:]:
            train_part(args, seed, 1.0, "ours_chosen", [(OURS, *chosen["ours"][OURS])])
    return chosen


# --------------------------------------------------------------------------- report
def _loss(run: dict) -> float:
    return run["eval_losses"][-1]


def mean_step(runs: Sequence[dict]) -> float:
    """Mean step time of ``runs``, each without its first step: that one carries one-off work
    (allocations, lazy initialisation, a GPU's first launches) that no later step pays."""
    seconds = [s for r in runs for s in (r["step_seconds"][1:] or r["step_seconds"])]
    return sum(seconds) / len(seconds)


def seed_measures(out: Path, seed: int, budgets: Sequence[float], base_steps: int, sweep_ours: bool,
                  baselines: Sequence[str] = DEFAULT_BASELINES) -> dict:
    """Per seed: each baseline's final loss per budget (its chosen point there), each
    method's step time in the 1x interleaved run, and every (ours, baseline) speed-up."""
    by_budget = {b: load_runs(out, seed, b) for b in budgets}
    swept = [r for r in by_budget[1.0] if _point(r)[0] == OURS and _point(r)[1] is not None]
    methods = list(baselines) + ([OURS] if sweep_ours and swept else [])
    main = _main_runs(out, seed)
    curves = {}
    for m in baselines:
        points = []
        for b in budgets:
            best = best_point(by_budget[b], m)
            points.append({"budget": b, "steps": round(base_steps * b), "loss": _loss(best), "run": best["name"]})
        curves[m] = points
    # Step times from the 1x interleaved process only; the tuned wmuon (swept in a process of
    # its own) is charged the default wmuon's: lr and momentum do not change a step's cost.
    step_seconds = {m: mean_step([r for r in main if _point(r)[0] == m]) for m in methods}
    # the default wmuon from that same process (its loss and step time beside the baselines'); a
    # grid extension (a process of its own) may hold another run of it, which is not used here
    default_name = f"{OURS} lr={DEFAULT_LRS[OURS]:g}"
    default = next((r for r in main if r["name"] == default_name), None) or next(
        r for r in by_budget[1.0] if r["name"] == default_name)
    step_seconds["wmuon (defaults)"] = mean_step([default])
    rows = {"wmuon (defaults)": {"loss": _loss(default), "run": default["name"]}}
    unmeasured = set()
    for m in methods:
        best = best_point([r for r in by_budget[1.0] if _point(r)[1] is not None], m)
        rows[f"{m} (tuned)"] = {"loss": _loss(best), "run": best["name"]}
        step_seconds[f"{m} (tuned)"] = step_seconds[m]
        if m == OURS and not same_step_cost(best["wmuon"], default["wmuon"]):
            # swept with settings that change the step (--only-ours on another command's
            # records): the default run's step time is not this run's
            unmeasured.add(f"{m} (tuned)")
    for name, row in rows.items():
        row["vs"] = {}
        for base in baselines:
            if name.startswith(base):
                continue
            c = curves[base]
            row["vs"][base] = speedup([p["steps"] for p in c], [p["loss"] for p in c], base_steps, row["loss"],
                                      step_seconds[name], step_seconds[base])
            if name in unmeasured:
                row["vs"][base].update(step_ratio=None, wallclock=None)
    return {"seed": seed, "curves": curves, "step_seconds": step_seconds, "rows": rows}


def _main_runs(out: Path, seed: int) -> list[dict]:
    """The runs of the 1x interleaved process (not the grid extensions): step times."""
    part = "grid" if record_path(out, seed, 1.0, "grid").exists() else "chosen"
    record = json.loads(record_path(out, seed, 1.0, part).read_text())
    return [{**run, "wmuon": record.get("wmuon")} for run in record["runs"]]


def _fmt(stats: dict, digits: int = 2) -> str:
    return f"{stats['mean']:.{digits}f} ± {stats['sd']:.{digits}f}"


def _per_seed(values: Sequence[float], digits: int = 2) -> str:
    return ", ".join(f"{v:.{digits}f}" for v in values)


def report(args) -> str:
    started = sorted(int(p.name.split("_")[0][1:]) for p in args.out.glob("s*_b1_*.json") if "_ext" not in p.name)
    # a seed needs every budget's records for its baselines' curves; one that lacks some is named below
    lacking = {s: [b for b in args.budgets if not load_runs(args.out, s, b)] for s in dict.fromkeys(started)}
    seeds = [s for s, missing in lacking.items() if not missing]
    if not seeds:
        return "no complete seed yet"
    per_seed = [seed_measures(args.out, s, args.budgets, args.steps, args.sweep_ours, args.baselines) for s in seeds]
    # Muon's and NorMuon's columns always (the tables before AdamW had them), AdamW's when it ran
    columns = [b for b in BASELINES if b != "adamw" or b in args.baselines]
    lines = [f"seeds {', '.join(map(str, seeds))}; mean ± sample sd over seeds (per-seed values in brackets); "
             f"step budget N = {args.steps}", "",
             "| method | final loss at N | " + " | ".join(
                 f"× best {LABELS[b]}: steps | step time × {LABELS[b]} | × best {LABELS[b]}: wall-clock"
                 for b in columns) + " |",
             "|---|---|" + "---|---|---|" * len(columns)]
    # a row's seeds: those with its run (a --sweep-ours on fewer seeds than the baselines ran)
    names = list(dict.fromkeys(name for m in per_seed for name in m["rows"]))
    partial = []
    unmeasured = False
    for name in names:
        rows = [m["rows"][name] for m in per_seed if name in m["rows"]]
        if len(rows) < len(per_seed):
            have = [m["seed"] for m in per_seed if name in m["rows"]]
            missing = [m["seed"] for m in per_seed if name not in m["rows"]]
            partial.append(f"{name}: seed{'s' if len(have) > 1 else ''} {', '.join(map(str, have))} only "
                           f"(no run on seed{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))})")
        cells = [name, f"{_fmt(mean_spread([r['loss'] for r in rows]), 4)} ({_per_seed([r['loss'] for r in rows], 4)})"]
        for base in columns:
            if base not in args.baselines or base not in rows[0]["vs"]:
                cells += ["-", "-", "-"]
                continue
            for key in ("steps", "step_ratio", "wallclock"):
                values = [r["vs"][base][key] for r in rows]
                if any(v is None for v in values):
                    unmeasured = True
                    cells.append("not measured")
                    continue
                flags = "".join("*" for r in rows if r["vs"][base]["how"] != "interpolated")
                flags = flags if key != "step_ratio" else ""  # the step time is measured, never extrapolated
                cells.append(f"**{_fmt(mean_spread(values))}** ({_per_seed(values)}){flags}")
        lines.append("| " + " | ".join(cells) + " |")
    if partial:
        lines += [""] + partial
    left_out = [f"seed {s} left out: no records at {', '.join(f'{b:g}x' for b in missing)}"
                for s, missing in lacking.items() if missing]
    if left_out:
        lines += [""] + left_out
    if unmeasured:
        lines += ["", "not measured: the tuned point ran with WhitenedMuon settings that change the step's cost, "
                  "and the records' interleaved default run (whose step time it would take) had others; "
                  "benchmarks/whitening_levers.py measures its step beside Muon"]
    lines += ["", f"\\* one asterisk per seed whose matching budget lies outside {args.budgets[0]:g}x-"
              f"{args.budgets[-1]:g}x (extrapolated "
              "along the end segment: rough; inf: the baseline's curve never reaches it, nan: undetermined)", "",
              "baselines' final loss per budget (the point chosen on the tuning seed at that budget):", "",
              "| baseline | " + " | ".join(f"{b:g}x ({round(args.steps * b)} steps)" for b in args.budgets) + " |",
              "|---|" + "---|" * len(args.budgets)]
    for base in args.baselines:
        cells = []
        for i in range(len(args.budgets)):
            losses = [m["curves"][base][i]["loss"] for m in per_seed]
            cells.append(f"{_fmt(mean_spread(losses), 4)} ({_per_seed(losses, 4)}; "
                         f"{per_seed[0]['curves'][base][i]['run']})")
        lines.append(f"| {base} | " + " | ".join(cells) + " |")
    (args.out / "measures.json").write_text(json.dumps(_json_safe(per_seed), indent=1))
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


# add_training_args' flags (shared with examples/char_lm.py) that this benchmark sets itself or
# never reads: given another value than their default, a usage error says why
_PER_BUDGET = "set per budget by this benchmark"
_UNUSED = "read only by methods this benchmark never runs (it runs Muon, NorMuon, AdamW and WhitenedMuon)"
IGNORED_FLAGS = {
    "--stop-after": ("stop_after", "every run spans its budget's full schedule"),
    "--eval-every": ("eval_every", f"{_PER_BUDGET}: {EVALS_PER_RUN} evaluations per run"),
    "--warmup-steps": ("warmup_steps", f"{_PER_BUDGET}: {WARMUP_FRACTION:.0%} of its steps"),
    "--seed": ("seed", "the runs' seeds are --seeds"),
    **{flag: (flag[2:].replace("-", "_"), f"K-FAC: {_UNUSED}")
       for flag in ("--damping", "--factor-update-steps", "--inv-update-steps", "--kfac-compute-method",
                    "--kfac-statistics-rows", "--kl-clip")},
    **{flag: (flag[2:].replace("-", "_"), f"PSGD: {_UNUSED}")
       for flag in ("--psgd-update-prob", "--psgd-precond-update-prob", "--psgd-init-scale", "--psgd-update")},
    **{flag: (flag[2:].replace("-", "_"), f"input-side K-FAC: {_UNUSED}")
       for flag in ("--ikfac-every", "--ikfac-damping", "--ikfac-decay", "--ikfac-rows")},
    "--moment-decay": ("moment_decay", f"the second moment (muon2, ikfac_muon2): {_UNUSED}"),
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seeds", type=_ints, default=[0, 1, 2], help="the first one tunes")
    p.add_argument("--budgets", type=_floats, default=list(BUDGETS), help="baseline budgets, multiples of --steps")
    p.add_argument("--lrs", type=_floats, default=[1.6e-2 / SQRT2, 1.6e-2, 1.6e-2 * SQRT2],
                   help="the baselines' lr grid (sqrt(2) apart)")
    p.add_argument("--momenta", type=_floats, default=[0.95, 0.9, 0.8], help="the baselines' momentum grid")
    p.add_argument("--baselines", type=lambda t: tuple(x for x in t.split(",") if x), default=DEFAULT_BASELINES,
                   help=f"comma-separated, from {BASELINES}")
    p.add_argument("--max-extend", type=int, default=2, help="rounds of grid extension past an edge")
    p.add_argument("--longer-lrs", choices=("around", "chosen"), default="around",
                   help="the baselines' lrs at the budgets past 1x: 'around' (the 1x choice and sqrt(2) "
                        "either side, extended past an edge) or 'chosen' (the 1x choice alone: a cheaper, "
                        "under-tuned baseline at longer budgets, which can only flatter ours)")
    p.add_argument("--sweep-ours", action="store_true",
                   help="also tune wmuon on the baselines' grid (a 'wmuon (tuned)' row next to the defaults)")
    p.add_argument("--only-ours", action="store_true",
                   help="with --sweep-ours: only the wmuon sweep (e.g. in a second process next to the baselines)")
    p.add_argument("--report-only", action="store_true", help="rebuild the tables from --out")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/budget_speedup"))
    add_training_args(p)
    # The main job's model at d_model 64 (2 layers, 4 heads, 64-byte windows) and half its
    # batch, for 350 steps: 5.2 tokens per parameter at 1x, the main job's ratio at d=128 (600
    # steps of 4096 tokens), i.e. Muon's regime, small enough for one shared CPU thread.
    p.set_defaults(d_model=64, batch_size=32, steps=350, eval_seqs=256, corpus_mb=4.0)
    args = p.parse_args(argv)
    defaults = p.parse_args([])  # each flag's default as parsed (a PSGD schedule compares by its repr)
    ignored = [f"{flag} {getattr(args, dest)!r} ({why})" for flag, (dest, why) in IGNORED_FLAGS.items()
               if getattr(args, dest) != getattr(defaults, dest)
               and repr(getattr(args, dest)) != repr(getattr(defaults, dest))]
    if ignored:
        p.error(f"flags without effect in this benchmark: {'; '.join(ignored)}")
    for flag, values in (("--seeds", args.seeds), ("--budgets", args.budgets), ("--lrs", args.lrs),
                         ("--momenta", args.momenta)):
        if not values:
            p.error(f"{flag} must name at least one value, got none")
    if len(set(args.seeds)) < len(args.seeds):
        p.error(f"--seeds must be distinct, got {args.seeds}")
    if any(lr <= 0 for lr in args.lrs):
        p.error(f"--lrs must be > 0, got {args.lrs}")
    if any(not 0 <= m < 1 for m in args.momenta):
        p.error(f"--momenta must lie in [0, 1), got {args.momenta}")
    if any(b <= 0 for b in args.budgets) or len(set(args.budgets)) < len(args.budgets):
        p.error(f"--budgets must be distinct and > 0, got {args.budgets}")
    if 1.0 not in args.budgets or len(args.budgets) < 2:
        p.error("--budgets must hold 1 and at least one more")
    args.budgets = sorted(args.budgets)
    if args.steps <= 0:
        p.error(f"--steps must be > 0, got {args.steps}")
    steps = [budget_steps(args, b) for b in args.budgets]
    if steps[0] < 1 or len(set(steps)) < len(steps):
        p.error(f"--budgets {args.budgets} give {steps} steps at --steps {args.steps}: each budget needs "
                f"steps of its own (at least one)")
    if args.max_extend < 0:
        p.error(f"--max-extend must be >= 0, got {args.max_extend}")
    unknown = [b for b in args.baselines if b not in BASELINES]
    if unknown or not args.baselines:
        p.error(f"--baselines must name some of {BASELINES}, got {args.baselines}")
    return args


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, train, _ = configs_from_args(args)
    body, total = parameter_counts(model)
    tokens = train.batch_size * model.seq_len
    print(f"{total:,} parameters ({body:,} non-embedding), {tokens} tokens/step, N = {args.steps} steps: "
          f"{args.steps * tokens / total:.1f} tokens/parameter ({args.steps * tokens / body:.1f} non-embedding); "
          f"{torch.get_num_threads()} thread(s)", flush=True)
    if not args.report_only:
        chosen = run_all(args)
        print(f"chosen (momentum, lr) per budget on seed {args.seeds[0]}: {chosen}", flush=True)
    table = report(args)
    print(table)
    if args.out.is_dir():  # --report-only on a folder never written: nothing to keep
        (args.out / "table.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    main()
