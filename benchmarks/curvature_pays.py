"""Where Kronecker-factored curvature pays in wall-clock, against AdamW and SGD (momentum 0.9).

Two small problems where curvature is known to help, each trained for a fixed number of
steps with every method's learning-rate grid, interleaved step by step in one process (the
same initial weights and the same batches for every run of a seed, so background load hits
all of them alike):

- ``--task autoencoder``: the deep autoencoder of the K-FAC paper's experiments, on
  scikit-learn's digits: 64-400-200-100-30-100-200-400-64, tanh after every hidden layer,
  logistic output, per-pixel binary cross-entropy (the K-FAC paper's loss), batch 100.
- ``--task cnn``: examples/digits_cnn.py's CNN and data, cross-entropy, batch 64, 500 steps.

The train/test split is fixed (split seed 0); ``--seeds`` vary the initial weights and the
batch order. A family is ``BASE`` (adamw, sgd) or ``PRECOND+BASE{k=v,...}`` with PRECOND a
``KronPreconditioner`` method (kfac, ekfac, ikfac, shampoo, soap, psgd) or ``kfacpt`` (kfac-pytorch's
``KFACPreconditioner``, when importable) and the settings k of benchmarks/convergence.py's
``--grid`` (fu: statistics every fu steps, iu: refresh every iu steps, damping, cm, ...).

    OMP_NUM_THREADS=1 python benchmarks/curvature_pays.py --task autoencoder --seeds 0
    python benchmarks/curvature_pays.py --task autoencoder --grid adamw=1e-3,2e-3 \
        --grid "kfac+adamw{fu=10,iu=100,damping=1e-4}=1e-3,2e-3"
    python benchmarks/curvature_pays.py --task autoencoder --profile "kfac+adamw{fu=1,iu=10}=3e-3"

Reported per family: the learning rate with the lowest mean final test loss (and where it
sits in the grid), that loss (mean ± standard deviation over seeds), and, for the learning
rate that reaches its base optimizer's final test loss first, the steps to get there, the
step-time ratio to the base optimizer's best run and the wall-clock speed-up
(steps ratio / step-time ratio).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import math
import pstats
import re
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run from a checkout: `benchmarks.*`, uninstalled kron_precond
    sys.path.append(str(REPO_ROOT))
# The examples' modules are imported by file from examples/, never through a package named
# `examples` (other wheels, e.g. kfac-pytorch's, install a top-level `examples`).
sys.path.insert(0, str(REPO_ROOT / "examples"))

from benchmarks.convergence import VARIANT_KEYS, _variant_value  # noqa: E402
from digits_cnn import DigitsCNN, classification_loss, load_digits_tensors  # noqa: E402
from kron_examples_common import (  # noqa: E402
    AmpState,
    PrecondConfig,
    build_optimizer,
    build_preconditioner,
    train_step,
)

BASES = ("adamw", "sgd")
PRECONDS = ("kfac", "ekfac", "ikfac", "shampoo", "soap", "psgd", "kfacpt")


# --------------------------------------------------------------------------- tasks
class DeepAutoencoder(nn.Module):
    """64-400-200-100-30 and mirrored; tanh after every hidden layer (the 30-wide code
    included); returns the logits of the 64 reconstructed pixels."""

    WIDTHS = (64, 400, 200, 100, 30, 100, 200, 400, 64)

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(self.WIDTHS, self.WIDTHS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def reconstruction_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-pixel binary cross-entropy of the logistic output (pixels in [0, 1])."""
    return F.binary_cross_entropy_with_logits(model(x), target.flatten(1))


@dataclass(frozen=True)
class Task:
    name: str
    build_model: Callable[[], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    batch_size: int
    weight_decay: float
    steps: int
    grid: tuple[str, ...]
    targets_are_inputs: bool  # the autoencoder reconstructs its input
    metric: str  # what the "loss" column is


# The default grids: 3 learning rates per family, x2 apart, placed by the sweeps recorded in
# benchmarks/results/curvature_pays.md (AdamW's best point 1e-3 and SGD's 1.6 lie inside
# theirs). On the autoencoder's per-pixel mean loss K-FAC's factor products d_G d_A stay
# below ~1e-3 on most layers, so the examples' damping of 3e-3 turns K-FAC into a scaled
# identity; damping=1e-4 lets the curvature act. The full grid is ~1 h on one loaded core:
# split it with --grid (each --grid family needs its base optimizer in the same run).
AE_GRID = (
    "adamw=5e-4,1e-3,2e-3",
    "sgd=0.8,1.6,3.2",
    "kfac+adamw{fu=10,iu=100}=1e-3,2e-3,4e-3",
    "kfac+adamw{fu=10,iu=100,damping=1e-4}=1e-3,2e-3,4e-3",
    "ikfac+adamw{ie=32}=1e-3,2e-3,4e-3",
    "kfac+sgd{fu=10,iu=100,damping=1e-4}=0.0125,0.025,0.05",
)
CNN_GRID = (
    "adamw=3e-3,6e-3,1.2e-2",
    "sgd=0.025,0.05,0.1",
    "kfac+sgd{fu=10,iu=100,damping=1e-2}=0.00625,0.0125,0.025",
    "kfac+adamw{fu=10,iu=100,damping=1e-2}=1.5e-3,3e-3,6e-3",
)


def _ae_model() -> nn.Module:
    return DeepAutoencoder()


TASKS = {
    "autoencoder": Task("autoencoder", _ae_model, reconstruction_loss, batch_size=100, weight_decay=0.0,
                        steps=1500, grid=AE_GRID, targets_are_inputs=True,
                        metric="test binary cross-entropy per pixel"),
    "cnn": Task("cnn", DigitsCNN, classification_loss, batch_size=64, weight_decay=5e-4,
                steps=500, grid=CNN_GRID, targets_are_inputs=False, metric="test cross-entropy"),
}


# --------------------------------------------------------------------------- families
_FAMILY = re.compile(r"^(?:(?P<precond>\w+)\+)?(?P<base>\w+)(?:\{(?P<variant>[^}]*)\})?=(?P<lrs>.+)$")


@dataclass(frozen=True)
class Contender:
    family: str
    base: str
    precond: str | None
    lr: float
    config: PrecondConfig

    @property
    def name(self) -> str:
        return f"{self.family} lr={self.lr:g}"


def parse_family(entry: str) -> list[Contender]:
    """``[PRECOND+]BASE[{k=v,...}]=LR,LR,...`` -> one contender per learning rate."""
    match = _FAMILY.match(entry.replace(" ", ""))
    if not match or match["base"] not in BASES or (match["precond"] and match["precond"] not in PRECONDS):
        raise SystemExit(f"--grid {entry!r}: expected [PRECOND+]BASE[{{k=v,...}}]=LR[,LR...] with PRECOND in "
                         f"{PRECONDS} and BASE in {BASES}")
    overrides = {}
    for item in filter(None, (match["variant"] or "").split(",")):
        key, _, value = item.partition("=")
        if key not in VARIANT_KEYS:
            raise SystemExit(f"--grid {entry!r}: unknown setting {key!r}; choose from {list(VARIANT_KEYS)}")
        overrides[VARIANT_KEYS[key]] = _variant_value(VARIANT_KEYS[key], value)
    family = (f"{match['precond']}+" if match["precond"] else "") + match["base"] + \
        (f"{{{match['variant']}}}" if match["variant"] else "")
    config = replace(PrecondConfig(), **overrides)
    return [Contender(family, match["base"], match["precond"], float(lr), config)
            for lr in match["lrs"].split(",")]


def build_kfac_pytorch(model: nn.Module, lr: float, config: PrecondConfig):
    """kfac-pytorch's ``KFACPreconditioner`` with the same settings as the library's K-FAC."""
    from kfac.enums import ComputeMethod
    from kfac.preconditioner import KFACPreconditioner

    return KFACPreconditioner(
        model, factor_update_steps=config.factor_update_steps, inv_update_steps=config.inv_update_steps,
        damping=config.damping, factor_decay=config.factor_decay, kl_clip=config.kl_clip, lr=lr,
        compute_method=ComputeMethod.EIGEN if config.compute_method == "eigen" else ComputeMethod.INVERSE,
        loglevel=logging.DEBUG,  # its registration messages, at a level nothing here prints
    )


def build_run(contender: Contender, model: nn.Module, task: Task):
    optimizer = build_optimizer(contender.base, model.parameters(), contender.lr, task.weight_decay)
    if contender.precond is None:
        return optimizer, None
    if contender.precond == "kfacpt":
        return optimizer, build_kfac_pytorch(model, contender.lr, contender.config)
    return optimizer, build_preconditioner(contender.precond, model, contender.lr, contender.config)


def remove_hooks(precond) -> None:
    if precond is None:
        return
    if hasattr(precond, "remove"):  # KronPreconditioner: unhook, so the model can be freed
        precond.remove()
    # kfac-pytorch keeps no handles of its hooks: its models are simply dropped after the run


# --------------------------------------------------------------------------- training
@dataclass
class Run:
    name: str
    family: str
    base: str
    lr: float
    seed: int
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    eval_accuracy: list[float] = field(default_factory=list)
    eval_seconds: list[float] = field(default_factory=list)  # training seconds so far
    train_seconds: float = 0.0
    steps_done: int = 0
    diverged_at: int | None = None

    @property
    def final_loss(self) -> float:
        return math.inf if self.diverged_at is not None else self.eval_losses[-1]

    @property
    def seconds_per_step(self) -> float:
        return self.train_seconds / max(self.steps_done, 1)

    def first_reaching(self, target: float) -> int | None:
        """The first evaluated step whose test loss is at most ``target``."""
        for step, loss in zip(self.eval_steps, self.eval_losses):
            if loss <= target:
                return step
        return None


def batches(n_train: int, batch_size: int, steps: int, seed: int):
    """Indices of ``steps`` full batches, epoch after epoch of fresh permutations."""
    order = torch.Generator().manual_seed(seed)
    produced = 0
    while produced < steps:
        for batch in torch.randperm(n_train, generator=order).split(batch_size)[: n_train // batch_size]:
            if produced == steps:
                return
            produced += 1
            yield batch


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    target = x if task.targets_are_inputs else y
    loss = task.loss_fn(model, x, target).item()
    accuracy = math.nan if task.targets_are_inputs else (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return loss, accuracy


def train_seed(task: Task, contenders: Sequence[Contender], seed: int, steps: int, eval_every: int) -> list[Run]:
    """Every contender from the same initial weights on the same batches, one step of each in
    turn (the order rotates every step)."""
    x_train, y_train, x_test, y_test = load_digits_tensors(0)  # the split is fixed
    torch.manual_seed(seed)
    initial = task.build_model().state_dict()
    amp = AmpState.create(False, torch.device("cpu"))
    live = []
    for c in contenders:
        model = task.build_model()
        model.load_state_dict(initial)
        optimizer, precond = build_run(c, model, task)
        live.append((Run(c.name, c.family, c.base, c.lr, seed), model, optimizer, precond))

    def record(step: int) -> None:
        for run, model, _, _ in live:
            if run.diverged_at is None:
                loss, accuracy = evaluate(model, task, x_test, y_test)
                run.eval_steps.append(step)
                run.eval_losses.append(loss)
                run.eval_accuracy.append(accuracy)
                run.eval_seconds.append(run.train_seconds)

    record(0)
    for step, index in enumerate(batches(len(y_train), task.batch_size, steps, seed), start=1):
        x = x_train[index]
        micro = [(x, x if task.targets_are_inputs else y_train[index])]
        shift = step % len(live)
        for run, model, optimizer, precond in live[shift:] + live[:shift]:
            if run.diverged_at is not None:
                continue
            start = time.perf_counter()
            loss = train_step(model, optimizer, precond, micro, task.loss_fn, amp)
            run.train_seconds += time.perf_counter() - start
            run.steps_done += 1
            if not math.isfinite(loss) or loss > 1e3:
                run.diverged_at = step
                remove_hooks(precond)
        if step % eval_every == 0 or step == steps:
            record(step)
        if step % max(steps // 10, 1) == 0:
            best = min((r for r, *_ in live), key=lambda r: r.final_loss)
            print(f"  seed {seed} step {step}: best {best.name} {best.final_loss:.4f}", flush=True)
    for run, _, _, precond in live:
        if run.diverged_at is None:
            remove_hooks(precond)
    return [run for run, *_ in live]


# --------------------------------------------------------------------------- analysis
def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values) or not finite:
        return math.inf, math.nan
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else 0.0)


def _fmt(mean: float, std: float, digits: int = 4) -> str:
    if not math.isfinite(mean):
        return "diverged"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if math.isfinite(std) else f"{mean:.{digits}f}"


def _position(lr: float, lrs: Sequence[float]) -> str:
    return "low edge" if lr == min(lrs) else "high edge" if lr == max(lrs) else "inside"


def analyse(runs: Sequence[Run], task: Task) -> tuple[str, dict]:
    """Tables (markdown) and the summary numbers."""
    seeds = sorted({r.seed for r in runs})
    families = list(dict.fromkeys(r.family for r in runs))
    by = {(r.family, r.lr, r.seed): r for r in runs}
    lrs = {f: sorted({r.lr for r in runs if r.family == f}) for f in families}

    def mean_final(f: str, lr: float) -> float:
        return _mean_std([by[f, lr, s].final_loss for s in seeds])[0]

    best_lr = {f: min(lrs[f], key=lambda lr: mean_final(f, lr)) for f in families}
    base_best = {b: best_lr[b] for b in BASES if b in best_lr}
    # Per seed and base optimizer: its best lr's final loss, the steps and seconds its run takes to reach it.
    ref = {}
    for b, lr in base_best.items():
        for s in seeds:
            run = by[b, lr, s]
            ref[b, s] = (run.final_loss, run.first_reaching(run.final_loss), run.seconds_per_step)
    overall = min(base_best, key=lambda b: mean_final(b, base_best[b])) if base_best else None

    def reach(f: str, lr: float, b: str) -> list[int | None]:
        return [by[f, lr, s].first_reaching(ref[b, s][0]) for s in seeds]

    def speed_rank(f: str, lr: float, b: str):
        steps = reach(f, lr, b)
        missed = sum(x is None for x in steps)
        return missed, (statistics.fmean(x for x in steps if x is not None) if missed < len(steps) else math.inf), \
            mean_final(f, lr)

    rows, summary = [], {}
    for f in families:
        base = next(r.base for r in runs if r.family == f)
        lr = best_lr[f]
        final = _mean_std([by[f, lr, s].final_loss for s in seeds])
        row = [f, f"{lr:g} ({_position(lr, lrs[f])})", _fmt(*final)]
        entry = {"best_lr": lr, "final_mean": final[0], "final_std": final[1]}
        if task.targets_are_inputs is False:
            acc = [by[f, lr, s].eval_accuracy[-1] if by[f, lr, s].diverged_at is None else math.nan for s in seeds]
            row.append(_fmt(*_mean_std(acc), digits=3))
        if base in base_best:
            fast = min(lrs[f], key=lambda x: speed_rank(f, x, base))
            steps = reach(f, fast, base)
            ratios, speedups = [], []
            for s, st in zip(seeds, steps):
                _, base_steps, base_sps = ref[base, s]
                time_ratio = by[f, fast, s].seconds_per_step / base_sps
                ratios.append(time_ratio)
                if st is not None and base_steps is not None:
                    speedups.append((base_steps / st) / time_ratio)
            reached = len(seeds) - steps.count(None)
            step_text = (f"{statistics.fmean(x for x in steps if x is not None):.0f}" if reached else "never") + \
                (f" ({reached}/{len(seeds)} seeds)" if reached < len(seeds) else "")
            base_steps = statistics.fmean(ref[base, s][1] for s in seeds)
            sp = _mean_std(speedups) if speedups else (math.nan, math.nan)
            row += [f"{fast:g} ({_position(fast, lrs[f])})", f"{step_text} / {base_steps:.0f}",
                    _fmt(*_mean_std(ratios), digits=2),
                    ("—" if f == base else _fmt(*sp, digits=2)) if speedups else "never"]
            entry.update(speed_lr=fast, steps_to_base=steps, base_steps=[ref[base, s][1] for s in seeds],
                         step_time_ratio=ratios, speedup=speedups)
        if overall is not None:
            overall_steps = reach(f, lr, overall)
            got = [x for x in overall_steps if x is not None]
            row.append(f"{statistics.fmean(got):.0f}" + (f" ({len(got)}/{len(seeds)})" if len(got) < len(seeds) else "")
                       if got else "never")
        lows = [min(zip(by[f, l, s].eval_losses, by[f, l, s].eval_steps)) for l in lrs[f] for s in seeds
                if by[f, l, s].diverged_at is None]
        low = min(lows) if lows else (math.inf, 0)
        row.append(f"{low[0]:.4f} (step {low[1]})" if math.isfinite(low[0]) else "diverged")
        row.append(f"{statistics.fmean(by[f, lr, s].seconds_per_step for s in seeds) * 1e3:.2f}")
        rows.append(row)
        summary[f] = entry

    headers = ["family", "best lr (grid)", f"final {task.metric} (mean ± std)"]
    if not task.targets_are_inputs:
        headers.append("final test accuracy")
    headers += ["fastest lr (grid)", "steps to own base's final loss / base's",
                "step-time ratio vs base", "wall-clock speed-up vs base"]
    if overall is not None:
        headers.append(f"steps (best lr) to best baseline's ({overall}) final loss")
    headers += ["lowest test loss on the way, any lr (step)", "ms/step"]
    text = [f"seeds {seeds}; best baseline: {overall} lr={base_best.get(overall)}", "",
            markdown_table(headers, rows), "",
            "every grid point (final test loss, mean ± std over seeds; ms/step):", ""]
    point_rows = []
    for f in families:
        for lr in lrs[f]:
            finals = [by[f, lr, s].final_loss for s in seeds]
            diverged = [s for s in seeds if by[f, lr, s].diverged_at is not None]
            point_rows.append([f, f"{lr:g}", _fmt(*_mean_std(finals)),
                               ", ".join(f"s{s}@{by[f, lr, s].diverged_at}" for s in diverged) or "",
                               f"{statistics.fmean(by[f, lr, s].seconds_per_step for s in seeds) * 1e3:.2f}"])
    text.append(markdown_table(["family", "lr", "final loss", "diverged (seed@step)", "ms/step"], point_rows))
    return "\n".join(text), summary


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- profile
def _step_kind(step: int, config: PrecondConfig) -> str:
    """The library counts steps from 0: the k-th step (1-based) collects statistics when
    (k-1) % factor_update_steps == 0 and refreshes when (k-1) % inv_update_steps == 0."""
    if (step - 1) % config.inv_update_steps == 0:
        return "refresh"
    return "statistics" if (step - 1) % config.factor_update_steps == 0 else "plain"


def profile(task: Task, entries: Sequence[str], steps: int, seed: int) -> str:
    """Where one step of each of ``entries`` (one family and lr each) goes, interleaved step
    by step with their base optimizer's: forward+backward (with the preconditioner's hooks),
    precond.step() and optimizer.step(), each split by the kind of step (plain, statistics,
    refresh); then the preconditioner's top functions (cProfile, first entry only)."""
    contenders = [parse_family(entry)[0] for entry in entries]
    bases = {c.base: Contender(c.base, c.base, None, c.lr, PrecondConfig()) for c in contenders}
    contenders = list(bases.values()) + contenders
    x_train, y_train, _, _ = load_digits_tensors(0)
    live = []
    for c in contenders:
        torch.manual_seed(seed)
        model = task.build_model()
        optimizer, precond = build_run(c, model, task)
        live.append((c, model, optimizer, precond, {}, cProfile.Profile()))
    for step, index in enumerate(batches(len(y_train), task.batch_size, steps, seed), start=1):
        x = x_train[index]
        target = x if task.targets_are_inputs else y_train[index]
        shift = step % len(live)
        for c, model, optimizer, precond, parts, profiler in live[shift:] + live[:shift]:
            kind = _step_kind(step, c.config) if precond is not None else "plain"
            optimizer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            task.loss_fn(model, x, target).backward()
            t1 = time.perf_counter()
            if precond is not None:
                if c is contenders[len(bases)] and step > 1:
                    profiler.enable()
                precond.step()
                profiler.disable()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            for part, seconds in (("forward+backward", t1 - t0), ("precond.step", t2 - t1),
                                  ("optimizer.step", t3 - t2)):
                total, calls = parts.get((part, kind), (0.0, 0))
                parts[part, kind] = (total + seconds, calls + 1)
    rows = []
    base_step = {c.base: sum(t for t, _ in parts.values()) / steps for c, _, _, p, parts, _ in live if p is None}
    for c, _, _, precond, parts, _ in live:
        remove_hooks(precond)
        ref = base_step[c.base]
        for (part, kind), (seconds, calls) in parts.items():
            if part == "precond.step" and precond is None:
                continue
            rows.append([c.name, f"{part} ({kind} steps)", str(calls), f"{seconds / calls * 1e3:.2f}",
                         f"{seconds / steps * 1e3:.2f}", f"{seconds / steps / ref:.2f}"])
        whole = sum(t for t, _ in parts.values()) / steps
        rows.append([c.name, "**whole step**", str(steps), "", f"{whole * 1e3:.2f}", f"{whole / ref:.2f}"])
    stream = io.StringIO()
    pstats.Stats(live[len(bases)][5], stream=stream).sort_stats("tottime").print_stats(12)
    top = "\n".join(line.replace(f"{REPO_ROOT}/", "") for line in stream.getvalue().splitlines() if line.strip())
    return "\n".join([
        f"{task.name}: {steps} steps, interleaved, one thread; parts of each step in ms", "",
        markdown_table(["run", "part", "calls", "ms per call", "ms per step (amortised)",
                        "x base optimizer's whole step"], rows),
        "", f"top functions of {contenders[len(bases)].name}'s precond.step() by own time "
            "(cProfile, steps 2 onwards):", "", "```", top, "```"])


# --------------------------------------------------------------------------- main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--task", choices=list(TASKS), default="autoencoder")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (weights and batch order)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: the task's: autoencoder 1500, cnn 500)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between test-set evaluations")
    p.add_argument("--grid", action="append", metavar="FAMILY=LR,LR",
                   help="[PRECOND+]BASE[{k=v,...}]=LR,... (repeatable; default: the task's grid)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--profile", metavar="FAMILY=LR", action="append",
                   help="instead of training the grid, break the step of this family down (repeatable)")
    p.add_argument("--include", type=Path, action="append", default=[],
                   help="results .json of an earlier run whose runs (of the grid's families and "
                        "lrs) join this one's analysis, e.g. seed 0's full grid")
    p.add_argument("--reanalyse", type=Path, default=None, metavar="RESULTS.json",
                   help="print the tables of an earlier run's results .json instead of training")
    p.add_argument("--out", type=Path, default=None,
                   help="results prefix (default: benchmarks/results/curvature_pays_<task>)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    task = TASKS[args.task]
    steps = args.steps or task.steps
    out = args.out or Path("benchmarks/results") / f"curvature_pays_{task.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.profile:
        text = profile(task, args.profile, steps, int(args.seeds.split(",")[0]))
        print(text)
        Path(f"{out}_profile.md").write_text(text + "\n")
        return text
    if args.reanalyse:  # the tables again from a results .json, no training
        saved = json.loads(args.reanalyse.read_text())
        text, _ = analyse([Run(**r) for r in saved["runs"]], task)
        print(text)
        return text
    contenders = [c for entry in (args.grid or task.grid) for c in parse_family(entry)]
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{task.name}: {len(contenders)} runs x {steps} steps x seeds {seeds}, {args.threads} thread(s)", flush=True)
    runs = []
    wanted = {(c.family, c.lr) for c in contenders}
    for path in args.include:
        runs += [Run(**r) for r in json.loads(path.read_text())["runs"] if (r["family"], r["lr"]) in wanted]
    started = time.perf_counter()
    for seed in seeds:
        runs += train_seed(task, contenders, seed, steps, args.eval_every)
    text, summary = analyse(runs, task)
    header = (f"{task.name}, {steps} steps, batch {task.batch_size}, weight decay {task.weight_decay:g}, "
              f"{args.threads} thread(s), {time.perf_counter() - started:.0f} s in all\n"
              f"grid: {list(args.grid or task.grid)}\n")
    print(header + text)
    Path(f"{out}.md").write_text(header + "\n" + text + "\n")
    with open(f"{out}.json", "w") as f:
        json.dump({"task": task.name, "steps": steps, "seeds": sorted({r.seed for r in runs}),
                   "grid": list(args.grid or task.grid), "summary": summary,
                   "runs": [vars(r) for r in runs]}, f, default=str)
    return text


if __name__ == "__main__":
    main()
