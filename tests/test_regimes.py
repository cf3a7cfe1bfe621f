"""benchmarks/regimes.py on a 2-cell toy grid, against a closed-form calculation.

The training function is replaced by one that returns known loss curves: the held-out
loss falls linearly, ``L0 - slope * step``, with a slope that peaks at a chosen lr of each
family, and every family has a fixed cost per step. Crossings of a linear curve are exact
under linear interpolation, so the ratios the map reports have a closed form the test
computes by hand. A real (tiny) training run checks the wiring and the resume.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from benchmarks import regimes  # noqa: E402
from char_lm import RunResult  # noqa: E402

L0 = 3.0
SLOPE = {"adamw": 0.010, "muon": 0.020, "kfac_muon": 0.024, "psgd_muon": 0.026}  # loss per step at the best lr
SECONDS = {"adamw": 1.0, "muon": 1.1, "kfac_muon": 1.2, "psgd_muon": 1.4}  # per step
BEST_LR = {"adamw": 2e-3, "muon": 8e-2, "kfac_muon": 2e-2, "psgd_muon": 2e-2}  # muon's lies past its grid
GRID = ["--grid", "adamw=1e-3,2e-3,4e-3", "--grid", "muon=1e-2,2e-2,4e-2",
        "--grid", "kfac_muon=1e-2,2e-2,4e-2", "--grid", "psgd_muon=1e-2,2e-2,4e-2"]
TOY = ["--widths", "8", "--ratios", "10,20", "--tokens-per-step", "256", "--seq-len", "16",
       "--n-layers", "1", "--seeds", "0,1", "--max-extend", "2"]


def slope(family: str, lr: float) -> float:
    return SLOPE[family] * (1 - 0.2 * math.log2(lr / BEST_LR[family]) ** 2)


class FakeTrainer:
    """Stands in for char_lm.train_round_robin: known curves, counted calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, contenders, model, train, ctx, corpus=None, progress=True):
        self.calls.append([c.name for c in contenders])
        steps = list(range(0, train.steps + 1, train.eval_every))
        if steps[-1] != train.steps:
            steps.append(train.steps)
        results = []
        for c in contenders:
            family = c.name.split(" lr=")[0]
            s = slope(family, c.lr)
            results.append(RunResult(c.name, c.lr, eval_steps=steps, eval_losses=[L0 - s * k for k in steps],
                                     eval_train_seconds=[SECONDS[family] * k for k in steps],
                                     step_seconds=[SECONDS[family]] * train.steps))
        return results


def non_embedding_params(d: int, layers: int) -> int:
    # per block: q, k, v, out (d*d + d each), MLP d->4d->d, two LayerNorms; then the final LayerNorm
    return layers * (4 * (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 4 * d) + 2 * d


def test_crossing_is_interpolated_between_evaluations():
    run = RunResult("x lr=1", 1.0, eval_steps=[0, 10, 20], eval_losses=[3.0, 2.0, 1.0])
    assert regimes.crossing_step(run, 1.5) == pytest.approx(15.0)
    assert regimes.crossing_step(run, 2.0) == 10.0
    assert regimes.crossing_step(run, 0.5) is None


def test_map_ratios_match_the_closed_form_and_the_run_resumes(tmp_path):
    fake = FakeTrainer()
    cells = regimes.main([*TOY, *GRID, "--out", str(tmp_path)], train_fn=fake)
    assert len(cells) == 2 and all(len(records) == 2 for records in cells.values())
    params = non_embedding_params(8, 1)
    for (_width, ratio, tokens), records in cells.items():
        steps = round(ratio * params / tokens)
        final = {f: L0 - SLOPE[f] * steps for f in SLOPE}  # every family at its best lr
        target = final["adamw"]
        seconds_to = {f: (L0 - target) / SLOPE[f] * SECONDS[f] for f in SLOPE}
        to_muon_loss = {f: (L0 - final["muon"]) / SLOPE[f] * SECONDS[f] for f in SLOPE}
        for record in records:
            m = record["measures"]
            assert record["steps"] == steps and record["params_non_embedding"] == params
            assert m["target"] == pytest.approx(target)
            assert m["time_ratio"] == pytest.approx(seconds_to["kfac_muon"] / seconds_to["muon"])
            assert m["time_ratio_by"] == "kfac_muon"  # psgd_muon's slope is higher, its step dearer
            assert m["time_ratio_muon_target"] == pytest.approx(to_muon_loss["kfac_muon"] / to_muon_loss["muon"])
            assert m["loss_ratio"] == pytest.approx(final["psgd_muon"] / final["muon"])
            assert m["loss_ratio_by"] == "psgd_muon"
            assert m["families"]["muon"]["lr_time"] == pytest.approx(8e-2)
            # steps alone (no timing): psgd_muon's higher slope wins; with its dearer step, K-FAC's
            assert m["steps_ratio"] == pytest.approx(SLOPE["muon"] / SLOPE["psgd_muon"])
            assert m["steps_ratio_by"] == "psgd_muon"
            assert m["time_ratio_pooled"] == pytest.approx(seconds_to["kfac_muon"] / seconds_to["muon"])
            assert m["time_ratio_muon_target_pooled"] == pytest.approx(to_muon_loss["kfac_muon"] / to_muon_loss["muon"])
        first = next(r for r in records if r["seed"] == 0)
        # Muon's best lay past its grid: two extensions (4e-2 -> 8e-2 -> 1.6e-1) put it inside.
        assert first["lr_grid"]["muon"] == pytest.approx([1e-2, 2e-2, 4e-2, 8e-2, 1.6e-1])
        assert first["edges_left"] == {} and first["lr_grid"]["adamw"] == pytest.approx([1e-3, 2e-3, 4e-3])
        second = next(r for r in records if r["seed"] == 1)
        assert sorted({run["name"] for run in second["runs"]}) == [
            "adamw lr=0.002", "kfac_muon lr=0.02", "muon lr=0.08", "psgd_muon lr=0.02"]
    calls = len(fake.calls)
    regimes.main([*TOY, *GRID, "--out", str(tmp_path)], train_fn=fake)
    assert len(fake.calls) == calls  # every cell was on disk: nothing retrained
    assert (tmp_path / "regimes.png").stat().st_size > 0
    assert "| 8 | 10;" in (tmp_path / "regimes.md").read_text()


def test_map_trains_for_real_on_a_toy_cell(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [sys.executable, "benchmarks/regimes.py", "--widths", "8", "--ratios", "2", "--tokens-per-step", "128",
            "--seq-len", "16", "--n-layers", "1", "--seeds", "0", "--eval-seqs", "4", "--threads", "1",
            "--max-extend", "0", "--grid", "adamw=4e-3", "--grid", "muon=1e-2", "--grid", "psgd_muon=1e-2",
            "--out", str(tmp_path)]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.loads((tmp_path / "w8_r2_t128_s0.json").read_text())
    assert record["steps"] == round(2 * non_embedding_params(8, 1) / 128)
    assert [run["name"] for run in record["runs"]] == ["adamw lr=0.004", "muon lr=0.01", "psgd_muon lr=0.01"]
    assert all(len(run["step_seconds"]) == record["steps"] for run in record["runs"])


def test_transfer_rule_reuses_the_lrs_swept_below_and_check_cells_sweep(tmp_path):
    fake = FakeTrainer()
    regimes.main([*TOY, "--ratios", "10,20,40", "--tokens-per-step", "256,512", "--seeds", "0",
                  "--sweep-ratios", "10", "--check", "8:40:512", *GRID, "--out", str(tmp_path)], train_fn=fake)
    source = json.loads((tmp_path / "w8_r10_t256_s0.json").read_text())
    for name in ("w8_r20_t256_s0", "w8_r40_t256_s0"):
        record = json.loads((tmp_path / f"{name}.json").read_text())
        assert record["lrs_from"] == "w8_r10_t256_s0" and record["extensions"] == []
        assert {run["name"] for run in record["runs"]} == {
            f"{family} lr={lr:g}" for family, lrs in source["chosen_lrs"].items() for lr in lrs}
    check = json.loads((tmp_path / "w8_r40_t512_s0.json").read_text())
    assert check["lrs_from"] is None and len(check["runs"]) > 4  # its own sweep
    assert "d=8, 40 tokens/param, 512 tokens/step: its own sweep chose" in (tmp_path / "regimes.md").read_text()


def test_configuration_rows_judge_each_family_and_lr_on_its_own(tmp_path, monkeypatch):
    # PSGD + Muon made twice Muon's speed per step at Muon's step cost: it alone meets all three targets.
    monkeypatch.setitem(SLOPE, "psgd_muon", 0.040)
    monkeypatch.setitem(SECONDS, "psgd_muon", 1.1)
    cells = regimes.main([*TOY, "--ratios", "10", *GRID, "--out", str(tmp_path)], train_fn=FakeTrainer())
    steps = round(10 * non_embedding_params(8, 1) / 256)
    final = {f: L0 - SLOPE[f] * steps for f in SLOPE}
    to_target = {f: (L0 - final["adamw"]) / SLOPE[f] * SECONDS[f] for f in SLOPE}
    to_muon = {f: (L0 - final["muon"]) / SLOPE[f] * SECONDS[f] for f in SLOPE}
    rows = {(row["family"], round(row["lr"], 9)): row for row in regimes.configuration_rows(cells)}
    assert sorted(rows) == [("kfac_muon", 2e-2), ("psgd_muon", 2e-2)]  # the lrs seed 0 chose
    for family, met in (("kfac_muon", [False, False, True]), ("psgd_muon", [True, True, True])):
        row = rows[(family, 2e-2)]
        assert row["seeds"] == [0, 1] and row["met"] == met
        for key in ("time", "time_pooled"):
            assert row["per_seed"][key] == pytest.approx([to_target[family] / to_target["muon"]] * 2)
        for key in ("to_muon", "to_muon_pooled"):
            assert row["per_seed"][key] == pytest.approx([to_muon[family] / to_muon["muon"]] * 2)
        assert row["mean"]["loss"] == pytest.approx(final[family] / final["muon"])
    text = (tmp_path / "regimes.md").read_text()
    assert "| 8 | 10 | 256 | psgd_muon | 0.02 | 0,1 |" in text and "3 of 3" in text


def test_a_muon_momentum_sweep_is_one_reference_the_best_of_its_members(tmp_path, monkeypatch):
    # Muon at momentum 0.85 descends faster than at 0.95: the reference must be the 0.85 run,
    # charged the members' mean step time, and neither member may count as one of ours.
    for family, slope_, seconds in (("muon{mom=0.95}", 0.020, 1.0), ("muon{mom=0.85}", 0.025, 1.2)):
        monkeypatch.setitem(SLOPE, family, slope_)
        monkeypatch.setitem(SECONDS, family, seconds)
        monkeypatch.setitem(BEST_LR, family, 2e-2)
    grid = ["--grid", "adamw=1e-3,2e-3,4e-3", "--grid", "muon{mom=0.95}=1e-2,2e-2,4e-2",
            "--grid", "muon{mom=0.85}=1e-2,2e-2,4e-2", "--grid", "kfac_muon=1e-2,2e-2,4e-2"]
    cells = regimes.main([*TOY, "--ratios", "10", *grid, "--out", str(tmp_path)], train_fn=FakeTrainer())
    steps = round(10 * non_embedding_params(8, 1) / 256)
    final = {f: L0 - SLOPE[f] * steps for f in SLOPE}
    muon_steps = (L0 - final["adamw"]) / SLOPE["muon{mom=0.85}"]
    kfac_seconds = (L0 - final["adamw"]) / SLOPE["kfac_muon"] * SECONDS["kfac_muon"]
    for record in next(iter(cells.values())):
        m = record["measures"]
        assert record["ours"] == ["kfac_muon"]
        muon = m["families"]["muon"]
        assert muon["time_by"] == muon["final_by"] == "muon{mom=0.85}"
        assert muon["step_seconds"] == pytest.approx(1.1)  # mean of the two members' 1.0 and 1.2
        assert m["muon_final_loss"] == pytest.approx(final["muon{mom=0.85}"])
        assert m["time_ratio"] == pytest.approx(kfac_seconds / (muon_steps * 1.1))
        assert m["loss_ratio"] == pytest.approx(final["kfac_muon"] / final["muon{mom=0.85}"])
        assert m["steps_ratio"] == pytest.approx(SLOPE["muon{mom=0.85}"] / SLOPE["kfac_muon"])
    first = next(r for r in next(iter(cells.values())) if r["seed"] == 0)
    assert "muon" not in first["chosen_lrs"] and set(first["chosen_lrs"]) == {
        "adamw", "muon{mom=0.95}", "muon{mom=0.85}", "kfac_muon"}
    second = next(r for r in next(iter(cells.values())) if r["seed"] == 1)
    assert {run["name"] for run in second["runs"]} == {
        "adamw lr=0.002", "muon{mom=0.95} lr=0.02", "muon{mom=0.85} lr=0.02", "kfac_muon lr=0.02"}
    assert "(mom=0.85/mom=0.85)" in (tmp_path / "regimes.md").read_text()
    with pytest.raises(SystemExit, match="spell out"):
        regimes.main([*TOY, "--ratios", "10", *grid, "--grid", "muon=1e-2", "--out", str(tmp_path / "x")],
                     train_fn=FakeTrainer())


class SeedDependentTrainer(FakeTrainer):
    """FakeTrainer whose families descend at a different slope on each seed."""

    def __init__(self, slopes: dict[tuple[str, int], float]):
        super().__init__()
        self.slopes = slopes

    def __call__(self, contenders, model, train, ctx, corpus=None, progress=True):
        results = super().__call__(contenders, model, train, ctx, corpus, progress)
        for run in results:
            family = run.name.split(" lr=")[0]
            scale = self.slopes.get((family, train.seed), SLOPE[family]) / SLOPE[family]
            run.eval_losses = [L0 - (L0 - loss) * scale for loss in run.eval_losses]
        return results


def test_one_configuration_is_also_judged_against_muons_best_single_configuration(tmp_path, monkeypatch):
    # Muon at momentum 0.95 is the best on seed 0 only; at 0.85 it is the better single setting
    # (fewer steps summed over the seeds). The per-seed reference takes 0.95 on seed 0; the
    # one-against-one columns must take 0.85 on both seeds.
    slopes = {("muon{mom=0.95}", 0): 0.030, ("muon{mom=0.95}", 1): 0.014,
              ("muon{mom=0.85}", 0): 0.020, ("muon{mom=0.85}", 1): 0.022}
    for family, seconds in (("muon{mom=0.95}", 1.0), ("muon{mom=0.85}", 1.2)):
        monkeypatch.setitem(SLOPE, family, 0.020)
        monkeypatch.setitem(SECONDS, family, seconds)
        monkeypatch.setitem(BEST_LR, family, 2e-2)
    grid = ["--grid", "adamw=1e-3,2e-3,4e-3", "--grid", "muon{mom=0.95}=1e-2,2e-2,4e-2",
            "--grid", "muon{mom=0.85}=1e-2,2e-2,4e-2", "--grid", "kfac_muon=1e-2,2e-2,4e-2"]
    cells = regimes.main([*TOY, "--ratios", "10", *grid, "--out", str(tmp_path)],
                         train_fn=SeedDependentTrainer(slopes))
    steps = round(10 * non_embedding_params(8, 1) / 256)
    drop = L0 - (L0 - SLOPE["adamw"] * steps)  # AdamW's final loss is L0 - drop
    muon_seconds = 1.1  # per step: the mean of the two Muon members
    per_seed_best = [drop / 0.030, drop / 0.022]
    single = [drop / 0.020, drop / 0.022]  # momentum 0.85 on both seeds
    ours = drop / SLOPE["kfac_muon"] * SECONDS["kfac_muon"]
    (row,) = [r for r in regimes.configuration_rows(cells) if math.isclose(r["lr"], 2e-2)]
    assert row["per_seed"]["time"] == pytest.approx([ours / (s * muon_seconds) for s in per_seed_best])
    assert row["per_seed"]["time_vs_one"] == pytest.approx([ours / (s * muon_seconds) for s in single])
    assert row["per_seed"]["time_pooled_vs_one"] == pytest.approx(
        [drop / SLOPE["kfac_muon"] * SECONDS["kfac_muon"] / muon_seconds / s for s in single])
    assert row["median"]["time_vs_one"] == pytest.approx(statistics.median(row["per_seed"]["time_vs_one"]))
    assert row["muon_one"]["time"] == "muon{mom=0.85} lr=0.02"
    # final loss: 0.95 ends lower summed over the seeds (0.030 + 0.014 > 0.020 + 0.022)
    final_095 = [L0 - 0.030 * steps, L0 - 0.014 * steps]
    assert row["muon_one"]["final"] == "muon{mom=0.95} lr=0.02"
    assert row["per_seed"]["loss_vs_one"] == pytest.approx(
        [(L0 - SLOPE["kfac_muon"] * steps) / f for f in final_095])
    assert "(muon{mom=0.85} lr=0.02)" in (tmp_path / "regimes.md").read_text()
