"""The README's main job and the examples run end to end (tiny sizes, a few steps).

These guard the commands a new user types, including the torchrun/DDP path on gloo;
whether the methods beat AdamW is measured by the benchmarks, not asserted here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_LM = ["--steps", "4", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
           "--batch-size", "4", "--seq-len", "16", "--eval-every", "2", "--eval-seqs", "4",
           "--corpus-mb", "0.2", "--warmup-steps", "1", "--threads", "1"]


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_main_job_runs_and_reports_every_method(tmp_path):
    out = _run([sys.executable, "examples/char_lm.py", *TINY_LM, "--out", str(tmp_path)], tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [run["name"] for run in results["runs"]] == ["adamw", "kfac", "psgd"]
    for run in results["runs"]:
        assert len(run["step_seconds"]) == 4
        assert all(loss == loss for loss in run["eval_losses"])  # no NaN
    assert results["runs"][1]["state_bytes"]["preconditioner"] > 0
    assert (tmp_path / "char_lm.png").stat().st_size > 0
    assert "final loss" in out


def test_main_job_under_torchrun_with_accumulation(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          "examples/char_lm.py", *TINY_LM, "--methods", "kfac,psgd_adamw", "--grad-accum", "2",
          "--out", str(tmp_path)], tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2


def test_digits_cnn_example_runs(tmp_path):
    out = _run([sys.executable, "examples/digits_cnn.py", "--method", "kfac", "--epochs", "1",
                "--device", "cpu"], tmp_path)
    assert "accuracy" in out.lower()


@pytest.mark.parametrize("script", ["examples/digits_cnn.py", "examples/char_lm.py",
                                    "benchmarks/step_overhead.py"])
def test_scripts_ignore_an_installed_top_level_examples_package(tmp_path, script):
    """kfac-pytorch's wheel installs a regular top-level package named ``examples``; it used
    to shadow the checkout's folder (``No module named 'examples.common'``). ``--help`` runs
    every import of the script."""
    fake = tmp_path / "site" / "examples"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("# stands in for another wheel's top-level `examples`\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "usage" in done.stdout.lower()


@pytest.mark.parametrize("script,framework,args", [
    ("hf_trainer.py", "transformers", ["--max-steps", "4", "--batch-size", "4", "--seq-len", "16",
                                       "--grad-accum", "2"]),
    ("lightning_digits.py", "lightning", ["--max-steps", "4", "--epochs", "1"]),
    ("accelerate_digits.py", "accelerate", ["--epochs", "1", "--cpu"]),
])
@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_trainer_framework_examples_run(tmp_path, monkeypatch, script, framework, args, method):
    """The examples/ scripts for each trainer framework, in-process with tiny settings."""
    import importlib.util

    from integration_common import require

    require(framework)
    if framework == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    monkeypatch.chdir(tmp_path)  # runs/ and checkpoints land here
    spec = importlib.util.spec_from_file_location(f"kron_example_{script[:-3]}", ROOT / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    metrics = module.main(["--method", method, *args])
    assert metrics and all(value == value for value in metrics.values()), metrics  # no NaN
