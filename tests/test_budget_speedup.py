"""benchmarks/budget_speedup.py: the budget-equivalent speed-up against hand-computed curves.

The interpolation is exact on a curve that is linear in log(steps), so such curves give
closed-form budgets; a worked example's Muon figures (0.6397 / 0.5937 / 0.5724 at 600 / 750 /
900 steps, 0.6174 to match) give its expected "about 670 steps". The report is checked on fake run
records whose speed-ups are worked out by hand below, and the tuning's edge rule on a grid
whose best point is known."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks import budget_speedup as bs  # noqa: E402

STEPS = [100, 125, 150]


def log_linear(steps: float) -> float:
    return 2.0 - 0.5 * math.log(steps / 100)


def test_issue_example_gives_about_670_steps():
    budget, how = bs.matching_budget([600, 750, 900], [0.6397, 0.5937, 0.5724], 0.6174)
    # 0.6174 lies (0.6397 - 0.6174) / (0.6397 - 0.5937) = 0.4848 of the way from 600 to 750 in log steps.
    assert how == "interpolated"
    assert budget == pytest.approx(600 * 1.25 ** (0.0223 / 0.0460), rel=1e-12)
    assert budget == pytest.approx(668.55, abs=0.01)


@pytest.mark.parametrize("steps, how", [(140, "interpolated"), (110, "interpolated"), (125, "interpolated"),
                                        (100, "interpolated"), (200, "extrapolated"), (80, "extrapolated")])
def test_log_linear_curve_is_recovered_exactly(steps, how):
    losses = [log_linear(s) for s in STEPS]
    budget, got = bs.matching_budget(STEPS, losses, log_linear(steps))
    assert got == how
    assert budget == pytest.approx(steps, rel=1e-12)


def test_points_need_not_be_sorted():
    losses = [log_linear(s) for s in STEPS]
    budget, _ = bs.matching_budget(STEPS[::-1], losses[::-1], log_linear(140))
    assert budget == pytest.approx(140, rel=1e-12)


def test_noisy_curve_takes_the_first_downward_crossing():
    # 1.1 at 125 steps is noise above the 100-step loss; 0.95 is first reached on the way to 150.
    budget, how = bs.matching_budget(STEPS, [1.0, 1.1, 0.9], 0.95)
    assert how == "interpolated"
    assert budget == pytest.approx(125 * 1.2 ** 0.75, rel=1e-12)
    # Above the smallest budget's loss, with a rising first segment: no trend to extrapolate.
    assert math.isnan(bs.matching_budget(STEPS, [1.0, 1.1, 0.9], 1.05)[0])
    # Below every loss, with a rising last segment: never reached.
    assert bs.matching_budget(STEPS, [1.0, 0.9, 0.95], 0.8) == (math.inf, "unreached")


def test_speedup_in_steps_and_wallclock():
    out = bs.speedup(STEPS, [log_linear(s) for s in STEPS], 100, log_linear(140), 1.1, 1.0)
    assert out["steps"] == pytest.approx(1.4)
    assert out["step_ratio"] == pytest.approx(1.1)
    assert out["wallclock"] == pytest.approx(1.4 / 1.1)


def test_mean_spread():
    stats = bs.mean_spread([1.0, 1.2, 1.4])
    assert stats["mean"] == pytest.approx(1.2)
    assert stats["sd"] == pytest.approx(0.2)  # sqrt((0.04 + 0 + 0.04) / 2)
    assert (stats["min"], stats["max"], stats["n"]) == (1.0, 1.4, 3)
    assert bs.mean_spread([1.3])["sd"] == 0.0


@pytest.mark.parametrize("odd", [math.inf, math.nan])
def test_a_seed_with_an_unreached_or_undetermined_budget_is_reported_not_a_crash(odd):
    """matching_budget returns inf (unreached) or nan (undetermined) for a seed; the seeds'
    mean is then inf or nan and the spread nan, reported as such."""
    stats = bs.mean_spread([1.2, odd])
    assert math.isnan(stats["sd"]) and stats["n"] == 2
    assert stats["mean"] == math.inf if odd == math.inf else math.isnan(stats["mean"])


def _run(name: str, lr: float, loss: float, seconds: float, steps: int = 4) -> dict:
    return {"name": name, "lr": lr, "eval_steps": [0, steps], "eval_losses": [5.0, loss],
            "eval_train_seconds": [0.0, seconds * steps], "step_seconds": [seconds] * steps, "state_bytes": {}}


def _write(out: Path, seed: int, budget: float, part: str, runs: list[dict], **record) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bs.record_path(out, seed, budget, part).write_text(json.dumps({"runs": runs, **record}))


def _two_seeds(out: Path, ours_loss: float, budgets_of_seed_1=(1.0, 1.25, 1.5)) -> None:
    """Seeds 0 and 1 (seed 1 0.1 higher everywhere): Muon at 1.90 / 1.80 / 1.70 over the three
    budgets, the default wmuon at ``ours_loss`` in the 1x run; seed 1 only at the budgets named."""
    for seed, shift in ((0, 0.0), (1, 0.1)):
        part = "grid" if seed == 0 else "chosen"
        muon = [_run("muon{mom=0.8} lr=0.01", 0.01, loss + shift, 1.0) for loss in (1.90, 1.80, 1.70)]
        records = {1.0: [muon[0], _run("wmuon lr=0.016", 0.016, ours_loss + shift, 1.1)], 1.25: [muon[1]],
                   1.5: [muon[2]]}
        for budget, runs in records.items():
            if seed == 0 or budget in budgets_of_seed_1:
                _write(out, seed, budget, part, runs)


def test_step_time_leaves_out_each_runs_first_step():
    # The first step carries one-off work (allocations, lazy initialisation, on a GPU the
    # kernels' first launches): seconds that no later step pays, and that differ by method.
    slow_start = _run("muon{mom=0.9} lr=0.01", 0.01, 2.0, 1.0)
    slow_start["step_seconds"] = [9.0, 1.0, 1.0, 1.0]
    other = _run("muon{mom=0.8} lr=0.01", 0.01, 2.0, 3.0)
    other["step_seconds"] = [0.5, 3.0, 3.0, 3.0]
    assert bs.mean_step([slow_start]) == pytest.approx(1.0)
    assert bs.mean_step([slow_start, other]) == pytest.approx(2.0)
    one = _run("wmuon lr=0.016", 0.016, 2.0, 1.0, steps=1)  # a run of one step keeps it
    assert bs.mean_step([one]) == pytest.approx(1.0)


def test_default_run_is_the_interleaved_ones(tmp_path):
    # An extension process may rerun the default wmuon next to its baselines (ext1 sorts before
    # grid): the row takes the interleaved 1x run's, whose step time sits beside the baselines'.
    out = tmp_path / "records"
    _write(out, 0, 1.0, "ext1", [_run("muon{mom=0.9} lr=0.005", 0.005, 1.95, 2.0),
                                 _run("wmuon lr=0.016", 0.016, 1.70, 2.2)])
    _write(out, 0, 1.0, "grid", [_run("muon{mom=0.9} lr=0.01", 0.01, 1.90, 1.0),
                                 _run("wmuon lr=0.016", 0.016, 1.80, 1.1)])
    _write(out, 0, 1.25, "grid", [_run("muon{mom=0.9} lr=0.01", 0.01, 1.80, 1.0)])
    _write(out, 0, 1.5, "grid", [_run("muon{mom=0.9} lr=0.01", 0.01, 1.70, 1.0)])
    measures = bs.seed_measures(out, 0, [1.0, 1.25, 1.5], 100, sweep_ours=False, baselines=("muon",))
    assert measures["rows"]["wmuon (defaults)"]["loss"] == pytest.approx(1.80)
    assert measures["step_seconds"]["wmuon (defaults)"] == pytest.approx(1.1)
    assert measures["rows"]["wmuon (defaults)"]["vs"]["muon"]["steps"] == pytest.approx(1.25)
    assert measures["rows"]["wmuon (defaults)"]["vs"]["muon"]["step_ratio"] == pytest.approx(1.1)


def test_report_on_hand_made_records(tmp_path):
    out = tmp_path / "records"
    # 1x: Muon's best point is momentum 0.8 (1.90); an extension run that is worse must not
    # change it, and its step time (3.0 s) must not enter the step-time ratio.
    _write(out, 0, 1.0, "grid", [
        _run("muon{mom=0.9} lr=0.01", 0.01, 2.00, 1.0), _run("muon{mom=0.8} lr=0.01", 0.01, 1.90, 1.0),
        _run("normuon{mom=0.9} lr=0.01", 0.01, 1.85, 1.2), _run("wmuon lr=0.016", 0.016, 1.80, 1.1)])
    _write(out, 0, 1.0, "ext1", [_run("muon{mom=0.6} lr=0.01", 0.01, 1.95, 3.0)])
    _write(out, 0, 1.25, "grid", [_run("muon{mom=0.8} lr=0.01", 0.01, 1.80, 1.0),
                                  _run("muon{mom=0.8} lr=0.02", 0.02, 1.82, 1.0),
                                  _run("normuon{mom=0.9} lr=0.01", 0.01, 1.75, 1.2)])
    _write(out, 0, 1.5, "grid", [_run("muon{mom=0.8} lr=0.01", 0.01, 1.70, 1.0),
                                 _run("normuon{mom=0.9} lr=0.01", 0.01, 1.70, 1.2)])
    measures = bs.seed_measures(out, 0, [1.0, 1.25, 1.5], 100, sweep_ours=False)
    ours = measures["rows"]["wmuon (defaults)"]
    # Muon: 1.90 / 1.80 / 1.70; ours 1.80 = Muon's 1.25x loss: 125 steps, 1.25x; step 1.1 s vs 1.0 s.
    assert ours["vs"]["muon"]["steps"] == pytest.approx(1.25)
    assert ours["vs"]["muon"]["step_ratio"] == pytest.approx(1.1)
    assert ours["vs"]["muon"]["wallclock"] == pytest.approx(1.25 / 1.1)
    # NorMuon: 1.85 / 1.75 / 1.70; 1.80 is halfway from 100 to 125 in log steps: 100 * sqrt(1.25).
    assert ours["vs"]["normuon"]["steps"] == pytest.approx(math.sqrt(1.25))
    assert ours["vs"]["normuon"]["wallclock"] == pytest.approx(math.sqrt(1.25) / (1.1 / 1.2))
    # NorMuon as "ours" against Muon: 1.85 is halfway from 1.90 to 1.80, in log steps.
    normuon = measures["rows"]["normuon (tuned)"]["vs"]["muon"]
    assert normuon["steps"] == pytest.approx(math.sqrt(1.25))
    assert normuon["step_ratio"] == pytest.approx(1.2)

    class Args:
        pass

    args = Args()
    args.out, args.budgets, args.steps, args.sweep_ours = out, [1.0, 1.25, 1.5], 100, False
    args.baselines = ("muon", "normuon")
    table = bs.report(args)
    assert "| wmuon (defaults) | 1.8000 ± 0.0000 (1.8000) | **1.25 ± 0.00** (1.25) |" in table
    # Muon alone as the baseline (--baselines muon): the same row, no NorMuon columns filled
    args.baselines = ("muon",)
    table = bs.report(args)
    ours = next(line for line in table.splitlines() if line.startswith("| wmuon (defaults)"))
    assert ours.startswith("| wmuon (defaults) | 1.8000 ± 0.0000 (1.8000) | **1.25 ± 0.00** (1.25) |")
    assert ours.endswith("| - | - | - |")
    assert not any(line.startswith("| normuon") for line in table.splitlines())


def test_adamw_as_the_baseline_has_columns_of_its_own(tmp_path):
    out = tmp_path / "records"
    # AdamW: 1.90 / 1.80 / 1.70 at its best lr; ours 1.80 at 1x = AdamW's 1.25x loss, its step 1.1x AdamW's
    _write(out, 0, 1.0, "grid", [_run("adamw{mom=0.9} lr=0.002", 0.002, 1.95, 1.0),
                                 _run("adamw{mom=0.9} lr=0.004", 0.004, 1.90, 1.0),
                                 _run("wmuon lr=0.016", 0.016, 1.80, 1.1)])
    _write(out, 0, 1.25, "grid", [_run("adamw{mom=0.9} lr=0.004", 0.004, 1.80, 1.0)])
    _write(out, 0, 1.5, "grid", [_run("adamw{mom=0.9} lr=0.004", 0.004, 1.70, 1.0)])

    class Args:
        pass

    args = Args()
    args.out, args.budgets, args.steps, args.sweep_ours, args.baselines = out, [1.0, 1.25, 1.5], 100, False, ("adamw",)
    table = bs.report(args).splitlines()
    header = next(line for line in table if line.startswith("| method"))
    assert header.endswith("| × best AdamW: steps | step time × AdamW | × best AdamW: wall-clock |")
    ours = next(line for line in table if line.startswith("| wmuon (defaults)"))
    assert ours.endswith(f"| **1.25 ± 0.00** (1.25) | **1.10 ± 0.00** (1.10) | **{1.25 / 1.1:.2f} ± 0.00** "
                         f"({1.25 / 1.1:.2f}) |")
    assert len(header.split("|")) == len(ours.split("|"))


def test_edge_points_extend_past_the_best_point():
    def runs(points):
        return [_run(f"muon{{mom={m:g}}} lr={lr:g}", lr, loss, 1.0) for m, lr, loss in points]

    grid = [(m, lr, 2.0) for m in (0.95, 0.9, 0.8) for lr in (0.01, 0.02, 0.04)]
    inside = runs([*grid[:4], (0.9, 0.02, 1.0), *grid[5:]])  # best at the grid's centre
    assert bs.edge_points(inside, "muon") == []
    corner = runs([*grid[:-1], (0.8, 0.04, 1.0)])  # best at the largest lr and smallest momentum
    new = bs.edge_points(corner, "muon")
    assert new[0] == (0.8, pytest.approx(0.04 * math.sqrt(2)))
    assert new[1] == (pytest.approx(0.6), 0.04)
    # the best lr found along one momentum (an extension): its momentum neighbours run next
    extended = runs([*grid, (0.9, 0.08, 1.5), (0.9, 0.16, 1.0), (0.9, 0.32, 1.8)])
    assert sorted(bs.edge_points(extended, "muon")) == [(0.8, 0.16), (0.95, 0.16)]
    done = runs([*grid, (0.9, 0.08, 1.5), (0.9, 0.16, 1.0), (0.9, 0.32, 1.8), (0.8, 0.16, 1.2),
                 (0.95, 0.16, 1.3)])
    assert bs.edge_points(done, "muon") == []  # a local minimum: nothing left to run


def _fake_training(calls: list):
    """A stand-in for ``train_part``: records what it is asked to train; a run's final loss
    is ``1 + log2(lr / 0.01)²`` (best at lr 0.01, whatever the budget)."""
    def train_part(args, seed, budget, part, points):
        calls.append((seed, budget, part, list(points)))
        return [_run(f"{bs.family_name(m, mom)} lr={lr:g}", lr, 1 + math.log2(lr / 0.01) ** 2, 1.0)
                for m, mom, lr in points]
    return train_part


@pytest.mark.parametrize("longer", ["around", "chosen"])
def test_longer_budgets_tune_around_the_1x_choice_or_take_it_alone(monkeypatch, tmp_path, longer):
    calls: list = []
    monkeypatch.setattr(bs, "train_part", _fake_training(calls))
    args = bs.parse_args(["--seeds", "0", "--lrs", "0.01,0.02", "--momenta", "0.9", "--baselines", "muon",
                          "--max-extend", "2", "--longer-lrs", longer, "--out", str(tmp_path)])
    chosen = bs.run_all(args)
    # 1x: the grid's best (0.01) is its lower edge, so lr 0.01 / sqrt(2) runs as an extension and loses
    first = [(b, part) for _, b, part, _ in calls if b == 1.0]
    assert first == [(1.0, "grid"), (1.0, "ext1")]
    assert calls[1][3] == [("muon", 0.9, pytest.approx(0.01 / math.sqrt(2)))]
    for budget in (1.25, 1.5):
        parts = [(part, points) for _, b, part, points in calls if b == budget]
        lrs = sorted(lr for _, points in parts for _, _, lr in points)
        if longer == "around":  # the 1x lr and sqrt(2) either side: 0.01 inside, no extension
            assert [part for part, _ in parts] == ["grid"]
            assert lrs == pytest.approx([0.01 / math.sqrt(2), 0.01, 0.01 * math.sqrt(2)])
        else:  # the 1x choice alone, never extended (it would be an edge of a one-point grid)
            assert parts == [("grid", [("muon", 0.9, pytest.approx(0.01))])]
        assert chosen[budget]["muon"] == (0.9, pytest.approx(0.01))


def test_train_part_trains_on_the_device_the_flags_name(monkeypatch, tmp_path):
    seen = {}

    def fake_round_robin(contenders, model, train, ctx, corpus=None, progress=True):
        seen["device"] = ctx.device
        return []

    monkeypatch.setattr(bs, "train_round_robin", fake_round_robin)
    monkeypatch.setattr(bs, "corpus_for", lambda *a: None)
    monkeypatch.setattr(bs, "resolve_device", lambda name: torch.device("meta") if name == "cuda" else None)
    args = bs.parse_args(["--device", "cuda", "--out", str(tmp_path)])
    bs.train_part(args, 0, 1.0, "grid", [])
    assert seen["device"] == torch.device("meta")  # what resolve_device made of --device, not a fixed CPU


def test_a_tuned_point_with_a_costlier_setting_leaves_its_step_time_unmeasured(tmp_path):
    """The tuned WhitenedMuon is charged the interleaved default run's step time. Where its
    record holds settings that change a step's cost (the output side, centring), from the
    default run's, the report must not print that time as its own; a cost-neutral change
    (damping) and records written before the settings were kept leave it measured."""
    defaults = bs.wmuon_settings(bs.PrecondConfig())
    cases = [(dict(wmuon_both_sides=True), True), (dict(wmuon_center_inputs=True), True),
             (dict(wmuon_damping=0.03), False), (None, False)]
    for i, (change, unmeasured) in enumerate(cases):
        out = tmp_path / f"records{i}"
        base = {} if change is None else {"wmuon": defaults}
        ours = {} if change is None else {"wmuon": {**defaults, **change}}
        _write(out, 0, 1.0, "grid", [_run("muon{mom=0.8} lr=0.01", 0.01, 1.90, 1.0),
                                     _run("wmuon lr=0.016", 0.016, 1.85, 1.1)], **base)
        _write(out, 0, 1.0, "ours_grid", [_run("wmuon{mom=0.8} lr=0.02", 0.02, 1.80, 1.1)], **ours)
        _write(out, 0, 1.25, "grid", [_run("muon{mom=0.8} lr=0.01", 0.01, 1.80, 1.0)], **base)
        _write(out, 0, 1.5, "grid", [_run("muon{mom=0.8} lr=0.01", 0.01, 1.70, 1.0)], **base)
        args = bs.parse_args(["--out", str(out), "--steps", "100", "--baselines", "muon", "--sweep-ours"])
        table = bs.report(args)
        tuned = next(line for line in table.splitlines() if line.startswith("| wmuon (tuned)"))
        assert tuned.startswith("| wmuon (tuned) | 1.8000 ± 0.0000 (1.8000) | **1.25 ± 0.00** (1.25) |")
        assert ("not measured" in tuned) == unmeasured, (change, tuned)
        vs = json.loads((out / "measures.json").read_text())[0]["rows"]["wmuon (tuned)"]["vs"]["muon"]
        assert (vs["wallclock"] is None) == unmeasured and vs["steps"] == pytest.approx(1.25)
        defaults_row = next(line for line in table.splitlines() if line.startswith("| wmuon (defaults)"))
        assert "not measured" not in defaults_row


def test_a_sweep_on_fewer_seeds_than_the_baselines_is_reported_over_its_own_seeds(tmp_path):
    """``--only-ours --sweep-ours --seeds 0`` into a folder whose baselines ran seeds 0 and 1:
    the report must not fail on seed 1's missing tuned run. Each row is the mean over the
    seeds that have it, and the table says which seeds a row leaves out."""
    out = tmp_path / "records"
    _two_seeds(out, 1.85)
    _write(out, 0, 1.0, "ours_grid", [_run("wmuon{mom=0.8} lr=0.02", 0.02, 1.80, 1.1)])
    args = bs.parse_args(["--out", str(out), "--steps", "100", "--baselines", "muon", "--sweep-ours"])
    table = bs.report(args)
    lines = table.splitlines()
    defaults = next(line for line in lines if line.startswith("| wmuon (defaults)"))
    tuned = next(line for line in lines if line.startswith("| wmuon (tuned)"))
    # defaults: 1.85 and 1.95 over seeds 0 and 1, each halfway from 1x to 1.25x in log steps
    assert defaults.startswith("| wmuon (defaults) | 1.9000 ± 0.0707 (1.8500, 1.9500) | **1.12 ± 0.00** (1.12, 1.12) |")
    # tuned: seed 0 alone, where 1.80 is Muon's 1.25x loss
    assert tuned.startswith("| wmuon (tuned) | 1.8000 ± 0.0000 (1.8000) | **1.25 ± 0.00** (1.25) |")
    assert "wmuon (tuned): seed 0 only (no run on seed 1)" in table


def test_report_only_on_a_folder_without_records_says_so(tmp_path, capsys):
    out = tmp_path / "never_written"
    assert bs.main(["--report-only", "--out", str(out)]) == "no complete seed yet"
    assert "no complete seed yet" in capsys.readouterr().out
    assert not out.exists()  # nothing written


def test_a_seed_without_every_budget_is_named_as_left_out(tmp_path):
    """A seed whose 1x records exist but whose baseline lacks a longer budget (a run stopped
    part-way) has no curve to read a speed-up off: the report leaves it out of every mean and
    says so under the table, naming the missing budgets, instead of dropping it silently."""
    out = tmp_path / "records"
    _two_seeds(out, 1.80, budgets_of_seed_1=(1.0, 1.25))  # seed 1 stopped before its 1.5x run
    args = bs.parse_args(["--out", str(out), "--steps", "100", "--baselines", "muon"])
    table = bs.report(args)
    assert table.startswith("seeds 0;")
    defaults = next(line for line in table.splitlines() if line.startswith("| wmuon (defaults)"))
    assert defaults.startswith("| wmuon (defaults) | 1.8000 ± 0.0000 (1.8000) | **1.25 ± 0.00** (1.25) |")
    assert "seed 1 left out: no records at 1.5x" in table


def test_report_with_one_seed_unreached_prints_it(tmp_path):
    """Seed 0's Muon curve rises after 1.25x and ours ends below all of it: unreached (inf).
    Seed 1 reads 1.25x. The report prints the row with an infinite mean, no crash."""
    out = tmp_path / "records"
    for seed, curve, ours, part in ((0, (1.90, 1.80, 1.85), 1.70, "grid"), (1, (1.90, 1.80, 1.70), 1.80, "chosen")):
        muon = [_run("muon{mom=0.8} lr=0.01", 0.01, loss, 1.0) for loss in curve]
        _write(out, seed, 1.0, part, [muon[0], _run("wmuon lr=0.016", 0.016, ours, 1.1)])
        _write(out, seed, 1.25, part, [muon[1]])
        _write(out, seed, 1.5, part, [muon[2]])

    class Args:
        pass

    args = Args()
    args.out, args.budgets, args.steps, args.sweep_ours, args.baselines = out, [1.0, 1.25, 1.5], 100, False, ("muon",)
    ours = next(line for line in bs.report(args).splitlines() if line.startswith("| wmuon (defaults)"))
    assert "| **inf ± nan** (inf, 1.25)" in ours, ours


def test_tuning_reads_extensions_already_stored_past_max_extend(monkeypatch, tmp_path):
    """A rerun with ``--max-extend 0`` (the held-out seeds' commands) must choose the point the
    tuning seed's stored extensions found, not the first grid's best."""
    calls: list = []
    monkeypatch.setattr(bs, "train_part", _fake_training(calls))
    args = bs.parse_args(["--seeds", "0", "--lrs", "0.02,0.04", "--momenta", "0.9", "--baselines", "muon",
                          "--max-extend", "0", "--out", str(tmp_path)])
    _write(tmp_path, 0, 1.0, "ext1", [])  # an extension round a run with --max-extend 2 stored
    chosen = bs.tune(args, 0, 1.0, [("muon", 0.9, 0.02), ("muon", 0.9, 0.04)], ["muon"])
    assert [part for _, _, part, _ in calls] == ["grid", "ext1"]
    assert chosen["muon"] == (0.9, pytest.approx(0.02 / math.sqrt(2)))  # the extension's point, nearer 0.01


def test_a_stored_record_without_the_points_asked_for_is_refused(tmp_path):
    """``train_part`` reuses a stored record only if it holds every point asked for: a record of
    other points (a rerun at another tuned lr) would otherwise be taken as the asked one."""
    args = bs.parse_args(["--out", str(tmp_path)])
    _write(tmp_path, 3, 1.0, "chosen", [_run("muon{mom=0.9} lr=0.0226", 0.0226, 1.0, 1.0)],
           **_settings(["--out", str(tmp_path)]))
    assert bs.train_part(args, 3, 1.0, "chosen", [("muon", 0.9, 0.0226)])[0]["lr"] == 0.0226
    with pytest.raises(ValueError, match=r"s3_b1_chosen\.json.*0\.032"):
        bs.train_part(args, 3, 1.0, "chosen", [("muon", 0.9, 0.032)])


def _settings(argv: list[str]) -> dict:
    """The ``model``, ``train`` and ``wmuon`` a record of the command ``argv`` holds (as train_part
    writes them: its per-record fields set for budget 1x, seed 0)."""
    args = bs.parse_args(argv)
    model, train, precond = bs.configs_from_args(args)
    train = bs.replace(train, steps=7, seed=5, warmup_steps=3, eval_every=2, stop_after=0)
    return json.loads(json.dumps({"model": bs.asdict(model), "train": bs.asdict(train),
                                  "wmuon": bs.wmuon_settings(precond), "steps": bs.budget_steps(args, 1.0)}))


RUN = [_run("muon{mom=0.9} lr=0.016", 0.016, 1.0, 1.0)]


@pytest.mark.parametrize("flags, fields", [
    (["--d-model", "48"], ["model d_model: stored 64, asked 48"]),
    (["--arch", "llama", "--n-heads", "2"], ["model n_heads: stored 4, asked 2",
                                             "model arch: stored 'gpt', asked 'llama'"]),
    (["--batch-size", "16", "--corpus-mb", "2"], ["train batch_size: stored 32, asked 16",
                                                  "train corpus_mb: stored 4.0, asked 2.0"]),
    (["--steps", "40"], ["steps: stored 350, asked 40"]),
])
def test_a_stored_record_of_another_model_batch_or_length_is_refused(tmp_path, flags, fields):
    """A rerun into the same --out with another model, batch or number of steps must not take
    the stored record (of the same points) as its own: it names the record and each field."""
    out = ["--out", str(tmp_path)]
    _write(tmp_path, 0, 1.0, "grid", RUN, **_settings(out))
    with pytest.raises(ValueError) as error:
        bs.train_part(bs.parse_args([*out, *flags]), 0, 1.0, "grid", [("muon", 0.9, 0.016)])
    message = str(error.value)
    assert "s0_b1_grid.json" in message and "another --out" in message
    for field in fields:
        assert field in message, message
    # the fields train_part sets per record (seed, warm-up, evaluations) are not compared
    assert bs.train_part(bs.parse_args(out), 0, 1.0, "grid", [("muon", 0.9, 0.016)]) == RUN


@pytest.mark.parametrize("flags, fields", [
    (["--wmuon-damping", "10"], ["wmuon wmuon_damping: stored 0.1, asked 10.0"]),
    (["--wmuon-output-side", "none"], ["wmuon wmuon_both_sides: stored 'auto', asked False"]),
])
def test_a_stored_record_of_other_whitened_muon_settings_is_used_and_said(tmp_path, capsys, flags, fields):
    """WhitenedMuon's settings: the committed records were written under earlier defaults their
    commands do not spell out, so a record of other settings is used as trained, and a note on
    stderr names the record and each field."""
    out = ["--out", str(tmp_path)]
    _write(tmp_path, 0, 1.0, "grid", RUN, **_settings(out))
    assert bs.train_part(bs.parse_args([*out, *flags]), 0, 1.0, "grid", [("muon", 0.9, 0.016)]) == RUN
    note = capsys.readouterr().err
    assert "s0_b1_grid.json" in note and "used as they were trained" in note
    for field in fields:
        assert field in note, note
    assert bs.train_part(bs.parse_args(out), 0, 1.0, "grid", [("muon", 0.9, 0.016)]) == RUN
    assert capsys.readouterr().err == ""


def test_a_record_of_an_older_version_is_read_with_the_settings_of_its_time(tmp_path, capsys):
    """Records written before a field was kept: a model without ``arch`` (the GPT), a train
    without ``amp_dtype`` ("auto"), WhitenedMuon settings without the later fields (their
    defaults) or none at all (before the "auto" output side: none, as same_step_cost reads them)."""
    settings = _settings(["--wmuon-output-side", "none"])
    del settings["model"]["arch"], settings["train"]["amp_dtype"]
    for field in ("wmuon_output_damping", "wmuon_ns_dtype", "wmuon_fused_qkv"):
        del settings["wmuon"][field]
    _write(tmp_path / "kept", 0, 1.0, "grid", RUN, **settings)
    del settings["wmuon"]
    _write(tmp_path / "none", 0, 1.0, "grid", RUN, **settings)
    for folder in ("kept", "none"):
        out = ["--out", str(tmp_path / folder)]
        args = bs.parse_args([*out, "--wmuon-output-side", "none"])
        assert bs.train_part(args, 0, 1.0, "grid", [("muon", 0.9, 0.016)]) == RUN
        assert capsys.readouterr().err == ""
        bs.train_part(bs.parse_args(out), 0, 1.0, "grid", [("muon", 0.9, 0.016)])
        assert "wmuon_both_sides: stored False, asked 'auto'" in capsys.readouterr().err


IGNORED = [("--stop-after", "5"), ("--eval-every", "3"), ("--warmup-steps", "2"), ("--seed", "1"),
           ("--damping", "0.01"), ("--factor-update-steps", "3"), ("--inv-update-steps", "3"),
           ("--kfac-compute-method", "inverse"), ("--kfac-statistics-rows", "64"), ("--kl-clip", "0.01"),
           ("--psgd-update-prob", "0.5"), ("--psgd-precond-update-prob", "0.5"), ("--psgd-init-scale", "1.0"),
           ("--psgd-update", "procrustes"), ("--ikfac-every", "3"), ("--ikfac-damping", "0.3"),
           ("--ikfac-decay", "0.5"), ("--ikfac-rows", "64"), ("--moment-decay", "0.5")]


@pytest.mark.parametrize("flag, value", IGNORED)
def test_a_flag_without_effect_here_is_refused(capsys, flag, value):
    """The shared training flags that budget_speedup.py sets per budget (--warmup-steps, ...),
    replaces (--seed: --seeds) or never reads (K-FAC, PSGD, input-side K-FAC, second moment)."""
    with pytest.raises(SystemExit):
        bs.parse_args([flag, value])
    assert flag in capsys.readouterr().err


def test_flags_at_their_defaults_and_the_used_ones_are_accepted():
    args = bs.parse_args(["--seed", "0", "--stop-after", "0", "--wmuon-damping", "0.3", "--muon-momentum", "0.8",
                          "--d-model", "32", "--amp", "--threads", "1", "--grad-accum", "2"])
    assert args.wmuon_damping == 0.3 and args.d_model == 32


@pytest.mark.parametrize("flag, value, says", [
    ("--seeds", "", "--seeds"), ("--seeds", "0,0", "--seeds"), ("--lrs", "", "--lrs"), ("--lrs", "0.01,-0.02", "--lrs"),
    ("--momenta", "", "--momenta"), ("--momenta", "1.5", "1.5"), ("--momenta", "0.9,1", "--momenta"),
    ("--momenta", "-0.1", "--momenta"), ("--steps", "0", "--steps"), ("--budgets", "1,1", "--budgets"),
    ("--budgets", "1,-1.25", "--budgets"), ("--budgets", "1,1.01", "--budgets"), ("--max-extend", "-1", "--max-extend"),
])
def test_invalid_values_are_refused_by_the_parser(capsys, flag, value, says):
    """Empty lists, a momentum outside [0, 1), budgets repeated, not positive, or of one step
    count (--budgets 1,1.01 at 8 steps), no steps, a negative extension: a usage error naming
    the flag, not a traceback after training or a silent run."""
    with pytest.raises(SystemExit):
        bs.parse_args([flag, value, "--steps", "8"] if flag != "--steps" else [flag, value])
    err = capsys.readouterr().err
    assert says in err and "error" in err, err
