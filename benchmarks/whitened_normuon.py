"""WhitenedMuon with NorMuon's per-neuron normalisation, and the budget-lever runs.

``WhitenedNorMuon`` is ``kron_precond.whitened_muon.WhitenedMuon`` with one change: the
whitened direction ``D`` (after ``_direction``: ``Lᵀ msign(L M Rᵀ) R`` at msign's norm) is
normalised row by row (one row = one output neuron of a ``[out, in]`` matrix) as NorMuon
does (benchmarks/normuon.py, arXiv 2510.05491):

    v  <- β2 v + (1 - β2) mean_j D[:, j]²     one second moment per row, kept per weight
    D' =  D / (sqrt(v) + ε),   D' *= ||D||_F / ||D'||_F

before the step (weight decay, ``lr · 0.2 sqrt(max(m, n))`` scale) that WhitenedMuon takes
unchanged. ``v`` lives in ``self.state[weight]["row_second_moment"]`` (float32, shape
``[units, out, 1]``); a matrix whose direction is not finite leaves its ``v`` as it was.

Run as a script, it measures single levers on the tuned WhitenedMuon against the best
Muon of benchmarks/budget_speedup.py (seed 0, 1x budget; benchmarks/results/budget_levers.md):

    OMP_NUM_THREADS=1 python benchmarks/whitened_normuon.py --threads 1 --levers fresh,fresh_damp \\
        --part a --out benchmarks/results/budget_levers
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.append(str(REPO_ROOT))

from kron_precond.whitened_muon import WhitenedMuon  # noqa: E402

EPS = 1e-10  # NorMuon's ε (benchmarks/normuon.py)


def normalize_row_stack(direction: torch.Tensor, second_moment: torch.Tensor, beta2: float,
                        eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon's row normalisation of a stack ``[k, out, in]``, per matrix.

    Returns (the normalised stack in float32 at each matrix's Frobenius norm, the new
    ``[k, out, 1]`` second moment). A matrix with a non-finite entry keeps its old moment
    (and its direction, which the optimizer zeroes anyway)."""
    d = direction.float()
    finite = torch.isfinite(d).flatten(1).all(dim=1).reshape(-1, 1, 1)
    v = torch.where(finite, second_moment.lerp(d.square().mean(dim=-1, keepdim=True), 1 - beta2), second_moment)
    normalized = d / (v.sqrt() + eps)
    scale = d.norm(dim=(-2, -1), keepdim=True) / normalized.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    return torch.where(finite, normalized * scale, d), v


class WhitenedNorMuon(WhitenedMuon):
    """``WhitenedMuon`` + NorMuon's per-neuron second-moment normalisation (``beta2``)."""

    def __init__(self, *args: Any, beta2: float = 0.95, row_eps: float = EPS, **kwargs: Any):
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1), got {beta2}")
        super().__init__(*args, **kwargs)
        if self._sharded is not None:
            raise NotImplementedError("WhitenedNorMuon: sharded weights are not supported")
        self.beta2 = beta2
        self.row_eps = row_eps
        self._stack: list[nn.Parameter] | None = None

    def _step_stack(self, params: list[nn.Parameter], group: dict[str, Any]) -> None:
        self._stack = params  # _direction's stack belongs to these weights, in this order
        try:
            super()._step_stack(params, group)
        finally:
            self._stack = None

    def _direction(self, update: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> torch.Tensor:
        direction = super()._direction(update, left, right)
        params = self._stack
        if params is None:  # called outside a step (e.g. a test of the base direction)
            return direction
        per = direction.shape[0] // len(params)
        states = [self.state[p] for p in params]
        for s in states:
            if "row_second_moment" not in s:
                s["row_second_moment"] = torch.zeros(per, direction.shape[1], 1, dtype=torch.float32,
                                                     device=direction.device)
        moments = torch.cat([s["row_second_moment"] for s in states])
        normalized, moments = normalize_row_stack(direction, moments, self.beta2, self.row_eps)
        for s, v in zip(states, moments.split(per)):
            s["row_second_moment"] = v.clone()
        return normalized.to(direction.dtype)


# --------------------------------------------------------------------------- the lever runs
# the tuned WhitenedMuon of benchmarks/results/budget_speedup.md and the best Muon there, as the
# sqrt(2) grid spells them (4.53e-2 = 1.6e-2 x 2 sqrt(2), 3.2e-2 = 1.6e-2 x 2)
LR, MOMENTUM = 1.6e-2 * math.sqrt(2.0) ** 3, 0.9
MUON_LR, MUON_MOMENTUM = 1.6e-2 * math.sqrt(2.0) ** 2, 0.8
# seed 0, best Muon's final held-out loss at 1x / 1.25x / 1.5x (350 / 438 / 525 steps)
MUON_CURVE = ((350, 1.0299), (438, 0.9512), (525, 0.9264))
LEVERS = {  # name: (PrecondConfig overrides, with the row normalisation)
    "fresh": (dict(wmuon_every=1, wmuon_factor_decay=0.8), False),
    "fresh_damp": (dict(wmuon_every=1, wmuon_factor_decay=0.8, wmuon_damping=0.03), False),
    "both": (dict(wmuon_both_sides=True), False),
    "normuon": ({}, True),
    "polar": (dict(wmuon_ns_coefficients="polar_express"), False),
    "spread128": (dict(wmuon_every=1, wmuon_statistics_rows=128), False),
    "spread256": (dict(wmuon_every=1, wmuon_statistics_rows=256, wmuon_factor_decay=0.9), False),
    "ema_nesterov1": ({}, False),
    "ema_nesterov3": ({}, False),
    "ema_b05": ({}, False),
    "ema_b03": ({}, False),
    "decay08": (dict(wmuon_factor_decay=0.8), False),
    "decay05": (dict(wmuon_factor_decay=0.5), False),
    "every5_decay08": (dict(wmuon_every=5, wmuon_factor_decay=0.8), False),
    "every5_decay05": (dict(wmuon_every=5, wmuon_factor_decay=0.5), False),
    "every3_decay07": (dict(wmuon_every=3, wmuon_factor_decay=0.7), False),
    "every2_decay08": (dict(wmuon_every=2, wmuon_factor_decay=0.8), False),
    "every5_decay08_damp005": (dict(wmuon_every=5, wmuon_factor_decay=0.8, wmuon_damping=0.05), False),
}
# EMA-Nesterov levers: β at peak lr (γ 0.9). In a steady state the lookahead multiplies the
# step by 1 / (1 - β) (β >= 1 diverges), so the β < 1 levers take the lr times (1 - β).
EMA_NESTEROV = {"ema_nesterov1": 1.0, "ema_nesterov3": 3.0, "ema_b05": 0.5, "ema_b03": 0.3}
LEVER_LR = {"ema_b05": 0.5, "ema_b03": 0.7}  # the lever's lr, times the tuned lr
LABELS = {
    "baseline": "wmuon (tuned), no lever",
    "fresh": "fresh statistics: every 1, factor_decay 0.8",
    "fresh_damp": "fresh statistics + damping 0.03",
    "both": "output side too (output_side=True)",
    "normuon": "row (per-neuron) normalisation, β2 0.95",
    "polar": "Polar Express coefficients in msign",
    "spread128": "statistics every step on 128 rows (refresh every step, factor_decay 0.95)",
    "spread256": "statistics every step on 256 rows (refresh every step, factor_decay 0.9)",
    "ema_nesterov1": "EMA-Nesterov lookahead, γ 0.9, β 1 (scaled by the lr schedule)",
    "ema_nesterov3": "EMA-Nesterov lookahead, γ 0.9, β 3 (scaled by the lr schedule)",
    "ema_b05": "EMA-Nesterov lookahead, γ 0.9, β 0.5, lr × 0.5",
    "ema_b03": "EMA-Nesterov lookahead, γ 0.9, β 0.3, lr × 0.7",
    "decay08": "shorter statistics horizon: factor_decay 0.8 (50 steps)",
    "decay05": "shorter statistics horizon: factor_decay 0.5 (20 steps)",
    "every5_decay08": "statistics and refresh every 5 steps, factor_decay 0.8 (25 steps)",
    "every5_decay05": "statistics and refresh every 5 steps, factor_decay 0.5 (10 steps)",
    "every3_decay07": "statistics and refresh every 3 steps, factor_decay 0.7 (10 steps)",
    "every2_decay08": "statistics and refresh every 2 steps, factor_decay 0.8 (10 steps)",
    "every5_decay08_damp005": "every 5 steps, factor_decay 0.8, damping 0.05",
}


def build_whitened_normuon(model: nn.Module, lr: float, weight_decay: float, config) -> WhitenedNorMuon:
    """As examples/kron_examples_common.build_whitened_muon, with the row normalisation."""
    from kron_examples_common import build_whitened_muon, unwrap
    exclude = config.muon_excluded
    optimizer = build_whitened_muon(unwrap(model), lr, weight_decay, exclude, config, post=True,
                                    optimizer_class=WhitenedNorMuon)
    assert isinstance(optimizer, WhitenedNorMuon)
    return optimizer


def _with_ema_nesterov(built: tuple, beta: float) -> tuple:
    from benchmarks.ema_nesterov import add_ema_nesterov
    optimizer, precond = built
    add_ema_nesterov(optimizer, gamma=0.9, beta=beta)
    return optimizer, precond


# the WhitenedMuon settings a lever changes one thing of: the library's defaults, or the earlier
# defaults' 200-step statistics horizon (statistics and refresh every 10 steps, decay 0.95)
BASES = {"defaults": {}, "horizon200": dict(wmuon_every=10, wmuon_factor_decay=0.95)}


def lever_contenders(levers: list[str], weight_decay: float, precond) -> list:
    """Best Muon, the tuned WhitenedMuon, and each lever on it, as char_lm Contenders."""
    from benchmarks.budget_speedup import contender
    from char_lm import Contender, method_contender
    tuned = replace(precond, muon_momentum=MOMENTUM)
    out = [contender("muon", MUON_MOMENTUM, MUON_LR, weight_decay, precond),
           replace(method_contender("wmuon", LR, weight_decay, tuned), name="baseline")]
    for name in levers:
        overrides, rows = LEVERS[name]
        config = replace(tuned, **overrides)
        if rows:
            out.append(Contender(name, LR, build=lambda model, scaler, c=config:
                                 (build_whitened_normuon(model, LR, weight_decay, c), None)))
        elif name in EMA_NESTEROV:
            lr = LR * LEVER_LR.get(name, 1.0)
            base = method_contender("wmuon", lr, weight_decay, config)
            out.append(Contender(name, lr, build=lambda model, scaler, b=base.build, beta=EMA_NESTEROV[name]:
                                 _with_ema_nesterov(b(model, scaler), beta)))
        else:
            out.append(replace(method_contender("wmuon", LR, weight_decay, config), name=name))
    return out


def run_part(args) -> Path:
    """Train best Muon, the tuned WhitenedMuon and ``args.levers`` interleaved (seed 0, 1x)."""
    from benchmarks.budget_speedup import EVALS_PER_RUN, WARMUP_FRACTION
    from benchmarks.regimes import _json_safe, corpus_for
    from char_lm import configs_from_args, train_round_robin
    from kron_examples_common import DistContext
    path = args.out / f"s{args.seed}_b1_{args.part}.json"
    if path.exists():
        return path
    model, base_train, precond = configs_from_args(args)
    steps = args.steps
    train = replace(base_train, steps=steps, seed=args.seed, warmup_steps=max(1, round(WARMUP_FRACTION * steps)),
                    eval_every=max(1, steps // EVALS_PER_RUN), stop_after=0)
    contenders = lever_contenders(args.levers, train.weight_decay, replace(precond, **BASES[args.base]))
    corpus = corpus_for(int(train.corpus_mb * 2**20), model.seq_len)
    results = train_round_robin(contenders, model, train, DistContext(0, 1, torch.device("cpu")),
                                corpus=corpus, progress=False)
    runs = [asdict(r) for r in results]
    for run in runs:
        run["step_seconds"] = [round(s, 6) for s in run["step_seconds"]]
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe({"seed": args.seed, "steps": steps, "model": asdict(model),
                                           "train": asdict(train), "runs": runs})))
    print(f"{path.stem}: " + ", ".join(f"{r['name']} {r['eval_losses'][-1]:.4f}" for r in runs), flush=True)
    return path


def table(out: Path, steps: int) -> str:
    """One row per lever (and per process's baseline): loss, speed-up in steps over best
    Muon's seed-0 curve, step time over Muon's in the same interleaved process."""
    from benchmarks.budget_speedup import mean_step, speedup
    lines = ["| lever | process | final loss at 350 | × best Muon: steps (matching budget) | "
             "step time × Muon | × best Muon: wall-clock |", "|---|---|---|---|---|---|"]
    for path in sorted(out.glob("s0_b1_*.json")):
        runs = json.loads(path.read_text())["runs"]
        muon = next(r for r in runs if r["name"].startswith("muon"))
        muon_step = mean_step([muon])  # without the first step, as budget_speedup.py's report
        part = path.stem.split("_", 2)[2]
        lines.append(f"| best Muon (in this process) | {part} | {muon['eval_losses'][-1]:.4f} | - | 1 | - |")
        for r in runs:
            if r is muon:
                continue
            loss = r["eval_losses"][-1]
            if loss is None or not math.isfinite(loss):  # recorded as null: the run diverged
                lines.append(f"| {LABELS.get(r['name'], r['name'])} | {part} | diverged | - | - | - |")
                continue
            step = mean_step([r])
            s = speedup([b for b, _ in MUON_CURVE], [x for _, x in MUON_CURVE], steps, loss, step, muon_step)
            flag = "" if s["how"] == "interpolated" else f" ({s['how']})"
            lines.append(f"| {LABELS.get(r['name'], r['name'])} | {part} | {loss:.4f} | "
                         f"**{s['steps']:.3f}** ({s['matching_budget']:.0f} steps){flag} | "
                         f"{s['step_ratio']:.2f} | {s['wallclock']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    import argparse
    sys.path.insert(0, str(REPO_ROOT / "examples"))
    from char_lm import add_training_args
    p = argparse.ArgumentParser(description="single levers on the tuned WhitenedMuon (seed 0, 1x budget)")
    p.add_argument("--levers", type=lambda t: [x for x in t.split(",") if x], default=list(LEVERS),
                   help=f"from {list(LEVERS)}")
    p.add_argument("--part", default="levers", help="names this process's record, s0_b1_PART.json")
    p.add_argument("--base", choices=list(BASES), default="defaults",
                   help="the settings each lever changes one thing of (horizon200: the earlier defaults)")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/budget_levers"))
    add_training_args(p)
    p.set_defaults(d_model=64, batch_size=32, steps=350, eval_seqs=256, corpus_mb=4.0, seed=0)  # budget_speedup
    args = p.parse_args(argv)
    unknown = [x for x in args.levers if x not in LEVERS]
    if unknown:
        p.error(f"unknown levers {unknown}; choose from {list(LEVERS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.report_only:
        run_part(args)
    print(table(args.out, args.steps))


if __name__ == "__main__":
    main()
