"""``kron_precond.keras.Kron`` on every Keras backend installed here.

Keras fixes its backend at first import, so each backend runs in a subprocess of its own
(``tests/keras_worker.py`` with ``KERAS_BACKEND`` set), once per test session, all of them
started together when the first test asks; the tests below assert on the measurements it
reports. A backend is skipped, with the reason, only
when its package is not installed (``.ci/run`` installs all three).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "keras_worker.py"
TOLERANCE = 1e-5

# Scenarios per backend. The torch-backend numerics are compared with the torch Kron;
# the eager scenarios are left off JAX, whose op-by-op mode compiles every op (slow).
SCENARIOS = {
    "torch": "equivalence,decisions,arguments,keras_arguments,train",
    "jax": "arguments,train",
    "tensorflow": "arguments,keras_arguments,train",
}
PACKAGES = {"torch": ("torch",), "jax": ("jax", "jaxlib"), "tensorflow": ("tensorflow",)}


def _missing(backend: str) -> str | None:
    for pkg in ("keras", *PACKAGES[backend]):
        if importlib.util.find_spec(pkg) is None:
            return (f"Keras backend {backend!r} not tested: package {pkg!r} is not installed "
                    "(pip install \"kron_precond[keras]\"; tensorflow-cpu for TensorFlow)")
    return None


class _Workers:
    """One worker subprocess per installed backend, all started together on the first request:
    they are independent and single-threaded, so on a 2-core machine the three overlap (about
    40 s instead of 60 s here)."""

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._procs: dict[str, subprocess.Popen] = {}
        self._results: dict[str, dict] = {}

    def _start(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        for backend in SCENARIOS:
            if _missing(backend) is None:
                folder = Path(self._tmp.name) / backend
                folder.mkdir()
                env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
                           CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1",
                           TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
                           XLA_FLAGS="--xla_cpu_multi_thread_eigen=false")
                with open(folder / "stderr.txt", "w") as stderr:  # a file: a full pipe would stall the worker
                    self._procs[backend] = subprocess.Popen(
                        [sys.executable, str(WORKER), str(folder / "result.json"), SCENARIOS[backend]],
                        env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=stderr)

    def result(self, backend: str) -> dict:
        if backend not in self._results:
            if self._tmp is None:
                self._start()
            proc, folder = self._procs[backend], Path(self._tmp.name) / backend
            try:
                proc.wait(timeout=900)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"keras worker ({backend}) still running after 900 s; killed") from None
            out = folder / "result.json"
            if proc.returncode != 0 or not out.exists():
                stderr = (folder / "stderr.txt").read_text()
                raise AssertionError(f"keras worker ({backend}) failed:\n{stderr[-4000:]}")
            self._results[backend] = json.loads(out.read_text())
            timings = {k: round(v, 1) for k, v in self._results[backend].items() if k.endswith("seconds")}
            print(f"\nkeras[{backend}] timings (s): {timings}", file=sys.stderr)
        return self._results[backend]

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()


WORKERS = _Workers()


@pytest.fixture(scope="module", autouse=True)
def _close_workers():
    yield
    WORKERS.close()


def scenario(backend: str, name: str) -> dict:
    reason = _missing(backend)
    if reason:
        pytest.skip(reason)
    result = WORKERS.result(backend)[name]
    assert "error" not in result, result.get("error")
    return result


def _backends_with(name: str) -> list[str]:
    return [b for b, names in SCENARIOS.items() if name in names.split(",")]


# ----------------------------------------------------------------------------- packaging
def test_importing_kron_precond_never_imports_keras():
    code = ("import sys, kron_precond, kron_precond.optim, kron_precond.schedules, "
            "kron_precond.methods.psgd\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('keras', 'jax', 'tensorflow'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr


def test_importing_kron_precond_loads_no_compiler():
    """``import kron_precond`` leaves ``torch._dynamo`` unloaded: loaded after TensorFlow, it
    aborts the process (LLVM's options registered twice), and Keras users import TensorFlow
    first. The library's compiler settings are applied when its objects are built."""
    code = ("import sys, kron_precond, kron_precond.optim, kron_precond.whitened_muon, kron_precond.methods.psgd\n"
            "assert 'torch._dynamo' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr


def test_the_keras_kron_imports_after_tensorflow():
    """The order of docs/keras.md on the TensorFlow backend: Keras (and TensorFlow) first."""
    missing = _missing("tensorflow")
    if missing:
        pytest.skip(missing)
    code = "import keras\nfrom kron_precond.keras import Kron\nprint(Kron.__name__)\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), KERAS_BACKEND="tensorflow"))
    assert proc.returncode == 0 and proc.stdout.strip() == "Kron", (proc.returncode, proc.stderr[-2000:])


def test_setup_declares_keras_extra_without_torch():
    text = (ROOT / "setup.py").read_text()
    start = text.index('"keras":')
    entry = text[start:text.index("]", start) + 1]
    assert "keras>=3" in entry and "jax" in entry and "torch" not in entry


# ----------------------------------------------------------------------------- numerics
EQUIVALENCE_CONFIGS = ["default", "smart_one_diag", "one_diag", "all_diag", "small_triangular",
                       "init_none_wd_grad_fit", "clipnorm", "clipvalue", "global_clipnorm",
                       "merge_dims_half_prob", "float64_factors", "balance_after_100_updates"]


@pytest.mark.parametrize("config", EQUIVALENCE_CONFIGS)
def test_matches_torch_kron(config):
    """Same gradients and probe vectors: parameters, momenta and factors of the Keras Kron
    (torch backend) equal the torch Kron's to 1e-5 relative after several steps."""
    r = scenario("torch", "equivalence")[config]
    assert r["params"] < TOLERANCE and r["momentum"] < TOLERANCE and r["factors"] < TOLERANCE, r
    assert r["moved"] > 1e-2, r  # the steps did something, so the comparison can fail
    assert r["q_updates"][0] == r["q_updates"][1] > 0, r
    expected_kinds = {"all_diag": ["diagonal"], "balance_after_100_updates": ["triangular"]}
    assert r["kinds"] == expected_kinds.get(config, ["diagonal", "triangular"]), r


def test_nonfinite_gradient_skips_tensor_and_is_counted():
    eq = scenario("torch", "equivalence")
    for config in ("default", "init_none_wd_grad_fit", "global_clipnorm"):  # one NaN each
        assert eq[config]["nonfinite"] == [0, 0, 0, 0, 1], eq[config]
    assert eq["smart_one_diag"]["nonfinite"] == [0] * 5


def test_update_decisions_follow_the_counter_schedule():
    """The in-graph fixed-point counter makes the torch ``UpdateDecider``'s decisions,
    step by step, for floats, the default schedule and annealed schedules."""
    for name, r in scenario("torch", "decisions").items():
        assert r["mismatches"] == 0 and r["counted"] == r["updates"], (name, r)


# ----------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("backend", _backends_with("arguments"))
def test_bad_arguments_raise_value_error_naming_them(backend):
    for name, exc_type, message in scenario(backend, "arguments")["raised"]:
        assert exc_type == "ValueError" and name in message, (name, exc_type, message)


@pytest.mark.parametrize("backend", _backends_with("arguments"))
def test_config_round_trip_and_defaults(backend):
    r = scenario(backend, "arguments")
    for label, c in r["configs"].items():
        assert c["round_trip_equal"] and c["keras_round_trip_equal"], (label, c)
        assert c["keras_deserialize_type"] == "Kron", (label, c)
    # The torch Kron's defaults (lr is learning_rate here).
    assert r["defaults"] == {
        "learning_rate": pytest.approx(3e-4), "b1": 0.9, "weight_decay": 0.0,
        "max_size_triangular": 8192, "min_ndim_triangular": 2, "memory_save_mode": None,
        "momentum_into_precond_update": True, "precond_lr": 0.1, "precond_init_scale": 1.0,
        "mu_dtype": None, "precond_dtype": "float32", "merge_dims": False, "seed": 0}
    assert r["default_probability"] == ("PrecondUpdateProbSchedule(max_prob=1.0, "
                                        "min_prob=0.03, decay=0.001, flat_start=500.0)")


@pytest.mark.parametrize("backend", _backends_with("keras_arguments"))
def test_keras_optimizer_arguments(backend):
    """gradient_accumulation_steps=2 equals one step on the mean gradient, over several steps
    of an update-probability schedule too (and holds the variables until then);
    loss_scale_factor unscales exactly; use_ema keeps the Keras moving average."""
    r = scenario(backend, "keras_arguments")
    assert r["step_moves"] > 1e-3, r
    assert r["accumulation_vs_average"] < TOLERANCE, r
    assert r["accumulation_over_a_schedule_vs_average"] < TOLERANCE, r
    assert r["accumulation_holds_until_update"] == 0.0, r
    assert r["loss_scale_vs_plain"] < TOLERANCE, r
    assert r["ema_vs_formula"] < TOLERANCE, r


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("backend", _backends_with("train"))
def test_fit_digits_accuracy(backend):
    """``model.fit`` (compiled on JAX and TensorFlow) reaches >= 95 % on held-out digits,
    and the compiled schedule made exactly the torch ``UpdateDecider``'s updates."""
    r = scenario(backend, "train")
    print(f"\nkeras[{backend}] digits accuracy {r['accuracy']:.4f}, fit {r['fit_seconds']:.1f}s,"
          f" jit_compile={r['jit_compile']}", file=sys.stderr)
    assert r["accuracy"] >= 0.95 and r["moved"] > 1e-2, r
    assert r["jit_compile"] == [backend != "torch"] * 2, r
    assert r["q_updates"] == r["q_updates_expected"] and 0 < r["q_updates"] < r["steps"], r


@pytest.mark.parametrize("backend", _backends_with("train"))
def test_save_load_mid_training_continues_identically(backend):
    """``model.save`` / ``keras.models.load_model`` mid-training (update counter
    mid-cycle): continuing equals the uninterrupted run exactly."""
    r = scenario(backend, "train")["resumed"]
    assert r["optimizer_type"] == "Kron", r
    assert 0 < r["acc_at_save"] < r["acc_unit"], r  # a pending fraction of an update
    assert r["n_optimizer_vars"][0] == r["n_optimizer_vars"][1], r
    assert r["iterations"][0] == r["iterations"][1] and r["q_updates"][0] == r["q_updates"][1]
    assert r["weights_rel_diff"] == 0.0 and r["optimizer_vars_rel_diff"] == 0.0, r


# ----------------------------------------------------------------------------- step scalars
_SCALARS_SCRIPT = r"""
import json, sys
import numpy as np, keras
from kron_precond.keras import Kron

def read(v):
    return np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float64)

out = {}
for pd in ("bfloat16", "float16"):
    v = keras.Variable(np.ones((4, 4), "float32"))
    opt = Kron(learning_rate=1e-3, weight_decay=0.1, precond_dtype=pd)
    for _ in range(100):
        opt.apply([keras.ops.zeros((4, 4))], [v])
    out[f"decay_{pd}"] = read(v).tolist()
    for lr in (2e-8, 1e-7, 3e-6):
        v = keras.Variable(np.zeros((4, 4), "float32"))
        opt = Kron(learning_rate=lr, precond_dtype=pd, preconditioner_update_probability=0.0)
        opt.apply([keras.ops.full((4, 4), 10.0)], [v])
        out[f"lr_{lr}_{pd}"] = read(v).tolist()
v = keras.Variable(np.zeros((200, 200), "float32"))
opt = Kron(learning_rate=1e-2, precond_dtype="float16", preconditioner_update_probability=0.0)
opt.apply([keras.ops.full((200, 200), 4000.0)], [v])
out["large_gradient"] = [float(read(v).min()), float(read(v).max())]
v = keras.Variable(np.ones((4, 3), "float32"))
opt = Kron(learning_rate=0.1, weight_decay=0.1, precond_dtype="float16")
opt.apply([keras.ops.full((4, 3), float("nan"))], [v])
out["nan_first"] = read(v).tolist()
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_step_scalars_are_computed_in_float32_with_half_precision_factors(backend, tmp_path):
    """lr, weight decay, the step scale and the RMS clip's norm are float32 even when the
    factors are bfloat16/float16 (in bfloat16 1 − 1e-4 is 1; in float16 2e-8 is 0 and a norm
    past 65 504 overflows). References: float64 formulas."""
    reason = _missing(backend)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "scalars.py"
    script.write_text(_SCALARS_SCRIPT)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out.json")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "out.json").read_text())
    import numpy as np

    def close(got, expected, rtol):
        got = np.asarray(got)
        return np.allclose(got, np.full_like(got, expected), rtol=rtol, atol=0.0)

    for pd in ("bfloat16", "float16"):
        # zero gradients: only the decoupled decay acts, p ← p·(1 − lr·wd) per step
        assert close(r[f"decay_{pd}"], (1.0 - 1e-3 * 0.1) ** 100, 1e-5), (pd, r[f"decay_{pd}"][0][0])
        for lr in (2e-8, 1e-7, 3e-6):
            # P = I, m̂ = 10 everywhere: the step is −lr·m̂ clipped to RMS 1.1
            assert close(r[f"lr_{lr}_{pd}"], -lr * 1.1, 1e-5), (pd, lr, r[f"lr_{lr}_{pd}"][0][0])
    assert close(r["large_gradient"], -1e-2 * 1.1, 1e-3), r["large_gradient"]
    assert close(r["nan_first"], 1.0, 0.0), r["nan_first"]  # a skipped step changes nothing
