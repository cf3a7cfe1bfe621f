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
def test_numpy_scalars_are_accepted_as_by_the_torch_kron(backend):
    """NumPy scalars are numbers (bools are not), as for the torch ``Kron``: the config holds
    the Python number the torch ``Kron`` makes of each, and a JSON round trip works."""
    import numpy as np
    import torch

    from kron_precond import Kron as TorchKron

    accepted = scenario(backend, "arguments")["accepted"]
    for label, config in accepted.items():
        assert "error" not in config, (label, config)
    numpy = accepted["numpy_scalars"]
    torch_kron = TorchKron([torch.nn.Parameter(torch.ones(2, 2))], b1=np.float32(0.9),
                           weight_decay=np.float32(0.1), precond_lr=np.float32(0.2), seed=np.int64(3),
                           precond_init_scale=np.float32(2.0), max_size_triangular=np.int64(64),
                           min_ndim_triangular=np.int32(1), clipnorm=np.float32(1.5))
    for key in ("b1", "weight_decay", "precond_lr", "precond_init_scale", "max_size_triangular",
                "min_ndim_triangular", "clipnorm"):
        assert numpy[key] == torch_kron.defaults[key] and type(numpy[key]) is type(torch_kron.defaults[key]), key
    assert numpy["seed"] == torch_kron.seed == 3
    assert numpy["learning_rate"] == pytest.approx(float(np.float32(0.01)))
    assert accepted["numpy_float64"] == {"b1": 0.8, "weight_decay": 0.2, "seed": 2**64 - 1}
    assert accepted["bounds"] == {"precond_init_scale": 1.8e19, "seed": -(2**63)}
    bools = accepted["numpy_bools"]
    assert bools == {"use_ema": True, "merge_dims": False, "momentum_into_precond_update": True}, bools
    assert all(type(v) is bool for v in bools.values()), bools
    assert accepted["keras_variable"]["learning_rate"] == pytest.approx(float(np.float32(0.01)))


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
    opt = Kron(learning_rate=1e-3, b1=0.0, weight_decay=0.1, precond_dtype=pd,
               preconditioner_update_probability=0.0)
    for _ in range(100):  # an all-zero gradient would be no step, its decay included
        opt.apply([keras.ops.full((4, 4), 2.0 ** -10)], [v])
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
    r = _run_script(backend, _SCALARS_SCRIPT, tmp_path)
    import numpy as np

    def close(got, expected, rtol):
        got = np.asarray(got)
        return np.allclose(got, np.full_like(got, expected), rtol=rtol, atol=0.0)

    expected = 1.0
    for _ in range(100):  # P = I, m̂ = g = 2⁻¹⁰ (b1 = 0): p ← p·(1 − lr·wd) − lr·g per step
        expected = expected * (1.0 - 1e-3 * 0.1) - 1e-3 * 2.0 ** -10
    for pd in ("bfloat16", "float16"):
        assert close(r[f"decay_{pd}"], expected, 1e-5), (pd, r[f"decay_{pd}"][0][0], expected)
        for lr in (2e-8, 1e-7, 3e-6):
            # P = I, m̂ = 10 everywhere: the step is −lr·m̂ clipped to RMS 1.1
            assert close(r[f"lr_{lr}_{pd}"], -lr * 1.1, 1e-5), (pd, lr, r[f"lr_{lr}_{pd}"][0][0])
    assert close(r["large_gradient"], -1e-2 * 1.1, 1e-3), r["large_gradient"]
    assert close(r["nan_first"], 1.0, 0.0), r["nan_first"]  # a skipped step changes nothing


def _run_script(backend: str, script: str, tmp_path) -> dict:
    """The JSON ``script`` wrote to ``argv[1]`` under ``KERAS_BACKEND=backend``. Starting a
    backend costs seconds, so every script of a backend runs in one subprocess, on the first
    request (:func:`_script_group`); a script that raises gives its traceback here."""
    reason = _missing(backend)
    if reason:
        pytest.skip(reason)
    if backend not in _SCRIPT_RESULTS:
        _SCRIPT_RESULTS[backend] = _script_group(backend, tmp_path)
    result = _SCRIPT_RESULTS[backend][_script_names()[script]]
    assert "__traceback__" not in result, result.get("__traceback__")
    return result


_SCRIPT_RESULTS: dict[str, dict[str, dict]] = {}


def _script_names() -> dict[str, str]:
    return {_SCALARS_SCRIPT: "scalars", _EDGE_SCRIPT: "edge", _JAX_SCRIPT: "jax_branch",
            _TF_DISTRIBUTE_SCRIPT: "tf_distribute", _JAX_DATA_PARALLEL_SCRIPT: "jax_data_parallel"}


def _script_groups() -> dict[str, tuple[str, ...]]:
    """Each backend's scripts, in the order they run: TensorFlow's logical devices are set
    before anything initialises TensorFlow, and JAX runs on two host devices throughout."""
    return {"tensorflow": (_TF_DISTRIBUTE_SCRIPT, _SCALARS_SCRIPT, _EDGE_SCRIPT),
            "torch": (_SCALARS_SCRIPT, _EDGE_SCRIPT),
            "jax": (_JAX_DATA_PARALLEL_SCRIPT, _JAX_SCRIPT)}


_DRIVER = r"""
import json, runpy, sys, traceback
for path, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = [path, out]
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        json.dump({"__traceback__": traceback.format_exc()}, open(out, "w"))
"""


def _script_group(backend: str, tmp_path) -> dict[str, dict]:
    names = _script_names()
    folder = tmp_path / f"keras_scripts_{backend}"
    folder.mkdir()
    arguments = []
    for script in _script_groups()[backend]:
        path = folder / f"{names[script]}.py"
        path.write_text(script)
        arguments += [str(path), str(folder / f"{names[script]}.json")]
    (folder / "driver.py").write_text(_DRIVER)
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="",
               JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1",
               TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, str(folder / "driver.py"), *arguments], env=env,
                          cwd=folder, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {names[script]: json.loads((folder / f"{names[script]}.json").read_text())
            for script in _script_groups()[backend]}


# ----------------------------------------------------------------------------- edge cases
_EDGE_SCRIPT = r"""
import json, sys, traceback, warnings
import numpy as np, keras
from keras import ops
from kron_precond.keras import Kron

def read(v):
    return np.asarray(ops.convert_to_numpy(v), dtype=np.float64)

rng = np.random.default_rng(0)
SHAPES = [(6, 5), (5,), (4, 3)]  # the idle one last: the others keep their probe seeds
INIT = [rng.standard_normal(s).astype("float32") for s in SHAPES]
GRADS = [[rng.standard_normal(s).astype("float32") for s in SHAPES] for _ in range(14)]
IDLE = range(3, 11)

def zeros_vs_none():
    # an all-zero gradient against no gradient (None, which Keras filters out)
    out, runs = {}, []
    for zeros in (True, False):
        vs = [keras.Variable(x) for x in INIT]
        opt = Kron(learning_rate=1e-2, weight_decay=0.1, global_clipnorm=1.0,
                   preconditioner_update_probability=1.0)
        history, unchanged = [], 0.0
        for t, gs in enumerate(GRADS):
            gs = [ops.convert_to_tensor(g) for g in gs]
            if t in IDLE:
                gs[2] = ops.zeros(SHAPES[2]) if zeros else None
            if t == IDLE.start:  # built on the first step
                slot = opt._slots[2]
                state = [vs[2], slot.momentum, slot.step, slot.nonfinite, *slot.qs]
                before = [read(x) for x in state]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Keras' warning about the None gradient
                opt.apply(gs, vs)
            if t in IDLE and zeros:
                unchanged = max(unchanged, max(float(np.max(np.abs(read(x) - b))) for x, b in zip(state, before)))
            history.append([read(x) for x in [*vs, *[y for s in opt._slots for y in (s.momentum, s.step, *s.qs)]]])
        runs.append(history)
        if zeros:
            out["unchanged"] = unchanged
            out["nonfinite"] = opt.nonfinite_steps()
            out["moved_after"] = float(np.max(np.abs(read(vs[2]) - history[IDLE.stop - 1][2])))
    out["zeros_vs_none"] = max(float(np.max(np.abs(a - b))) for ha, hb in zip(*runs) for a, b in zip(ha, hb))
    return out

def float16_factors():
    # the momentum of a constant gradient of 1e5 passes float16's 65 504 at step 11
    v = keras.Variable(np.ones((4, 3), "float32"))
    opt = Kron(learning_rate=1e-3, precond_dtype="float16", preconditioner_update_probability=0.0)
    weights = []
    for t in range(20):
        opt.apply([ops.full((4, 3), 1e5)], [v])
        weights.append(read(v).tolist())
    return {"weights": weights, "nonfinite": opt.nonfinite_steps(), "factor_dtype": str(opt._slots[0].qs[0].dtype)}

def overflow():
    # a finite gradient whose update overflows the float32 factors' math: not written, counted
    v = keras.Variable(np.ones((4, 3)), dtype="float64")
    opt = Kron(learning_rate=1e-3, weight_decay=0.1, preconditioner_update_probability=0.0)
    opt.apply([ops.full((4, 3), 1e40, dtype="float64")], [v])
    return {"weights": read(v).tolist(), "nonfinite": list(opt.nonfinite_steps().values())}

def empty():
    # a variable with no elements is left alone; the other steps as without it
    out, results = {}, []
    for with_empty in (False, True):
        vs = [keras.Variable(INIT[0])] + ([keras.Variable(np.zeros((0, 4), "float32"))] if with_empty else [])
        opt = Kron(learning_rate=1e-2, weight_decay=0.1, global_clipnorm=1.0, preconditioner_update_probability=1.0)
        for gs in GRADS[:3]:
            opt.apply([ops.convert_to_tensor(gs[0])] + ([ops.zeros((0, 4))] if with_empty else []), vs)
        results.append(read(vs[0]))
        if with_empty:
            out["shape"] = list(vs[1].shape)
            out["nonfinite_keys"] = len(opt.nonfinite_steps())
    only = [keras.Variable(np.zeros((0, 4), "float32"))]
    opt = Kron()
    opt.apply([ops.zeros((0, 4))], only)
    out["only_empty_iterations"] = int(ops.convert_to_numpy(opt.iterations))
    out["vs_without"] = float(np.max(np.abs(results[0] - results[1])))
    return out

out = {}
for part in (zeros_vs_none, float16_factors, overflow, empty):
    try:
        out[part.__name__] = part()
    except Exception:  # reported to the test, which fails on it
        out[part.__name__] = {"error": traceback.format_exc()}
json.dump(out, open(sys.argv[1], "w"))
"""


def _identity_preconditioner_reference(steps: int, g: float, lr: float, b1: float = 0.9) -> list[float]:
    """The documented step in float64 with P = I, on a constant gradient ``g`` of a tensor whose
    entries are all equal: m = b1·m + (1 − b1)·g, u = m scaled by min(1/(1 − b1^t), 1.1/rms(u)),
    p ← p − lr·u (from p = 1)."""
    w, m, out = 1.0, 0.0, []
    for t in range(1, steps + 1):
        m = b1 * m + (1 - b1) * g
        w -= lr * m * min(1.0 / (1.0 - b1 ** t), 1.1 / (abs(m) + 1e-12))
        out.append(w)
    return out


@pytest.mark.parametrize("backend", ["torch", "tensorflow"])
def test_edge_cases_of_the_step(backend, tmp_path):
    """Eager ``apply`` on the torch and TensorFlow backends:

    - an all-zero gradient counts as no gradient: the variable, its momentum, step count,
      factors and counter stay bitwise as they were, exactly as with ``None`` (which Keras
      filters out), and the other variables step as in that run;
    - float16 factors: a constant gradient of 1e5 (the momentum passes 65 504 at step 11)
      follows the float64 reference instead of writing NaN;
    - a finite gradient whose preconditioned update overflows is not written and is counted;
    - a variable with no elements is left alone (it raised ZeroDivisionError)."""
    import numpy as np

    r = _run_script(backend, _EDGE_SCRIPT, tmp_path)
    for part in r.values():
        assert "error" not in part, part["error"]
    z = r["zeros_vs_none"]
    assert z["zeros_vs_none"] == 0.0 and z["unchanged"] == 0.0 and z["moved_after"] > 0, z
    assert sorted(z["nonfinite"].values()) == [0, 0, 0], z
    f = r["float16_factors"]
    expected = _identity_preconditioner_reference(20, 1e5, 1e-3)
    got = [w[0][0] for w in f["weights"]]
    assert np.all(np.isfinite(f["weights"])) and np.allclose(got, expected, rtol=1e-6, atol=0.0), (got, expected)
    assert list(f["nonfinite"].values()) == [0] and f["factor_dtype"] == "float16", f
    o = r["overflow"]
    assert o["weights"] == [[1.0] * 3] * 4 and o["nonfinite"] == [1], o
    e = r["empty"]
    assert e["shape"] == [0, 4] and e["nonfinite_keys"] == 1, e
    assert e["vs_without"] == 0.0 and e["only_empty_iterations"] == 1, e


_JAX_SCRIPT = r"""
import json, sys
import numpy as np, keras, jax, jax.numpy as jnp
from keras import ops
from kron_precond.keras import Kron

def read(v):
    return np.asarray(ops.convert_to_numpy(v), dtype=np.float64)

class TwoBranch(keras.Model):
    def __init__(self):
        super().__init__()
        self.use_b = True
        init = keras.initializers.GlorotUniform
        self.a = keras.layers.Dense(3, kernel_initializer=init(seed=0))
        self.b = keras.layers.Dense(3, kernel_initializer=init(seed=1))  # its variables come last

    def call(self, x):
        return self.a(x) + self.b(x) if self.use_b else self.a(x)

rng = np.random.default_rng(0)
X = rng.standard_normal((64, 8)).astype("float32")
Y = rng.integers(0, 3, 64).astype("int32")
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
out = {}
runs = []
for freeze in (False, True):
    m = TwoBranch()
    opt = Kron(learning_rate=3e-3, weight_decay=0.1, preconditioner_update_probability=1.0)
    m.compile(optimizer=opt, loss=loss, jit_compile=True)
    m.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)  # 8 steps with branch b
    b_vars = [m.b.kernel, m.b.bias, *[x for s in opt._slots[2:] for x in (s.momentum, s.step, s.nonfinite, *s.qs)]]
    held = [read(x) for x in b_vars]
    m.use_b = False  # branch b leaves the loss: JAX hands it zeros
    if freeze:  # the reference: b frozen, a Kron of a's variables alone carrying on a's state
        m.b.trainable = False
        alone = Kron(learning_rate=3e-3, weight_decay=0.1, preconditioner_update_probability=1.0)
        alone.build([m.a.kernel, m.a.bias])
        by_name = {x.name: x for x in opt.variables}
        for x in alone.variables:
            x.assign(by_name[x.name])
        opt = alone
    m.compile(optimizer=opt, loss=loss, jit_compile=True)
    m.fit(X, Y, batch_size=16, epochs=25, shuffle=False, verbose=0)  # 100 steps without b
    runs.append([read(x) for x in (m.a.kernel, m.a.bias)])
    if not freeze:
        out["b_moved"] = max(float(np.max(np.abs(read(x) - h))) for x, h in zip(b_vars, held))
        out["b_nonfinite"] = opt.nonfinite_steps()
        out["iterations"] = int(ops.convert_to_numpy(opt.iterations))
out["a_vs_without_b"] = max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in zip(*runs))

# float16 factors under jit (the JAX trainer's stateless_apply)
v = keras.Variable(np.ones((4, 3), "float32"))
opt = Kron(learning_rate=1e-3, precond_dtype="float16", preconditioner_update_probability=0.0)
opt.build([v])
apply = jax.jit(opt.stateless_apply)
opt_vars, train_vars = [x.value for x in opt.variables], [v.value]
weights = []
for _ in range(20):
    train_vars, opt_vars = apply(opt_vars, [jnp.full((4, 3), 1e5, jnp.float32)], train_vars)
    weights.append(read(train_vars[0]).tolist())
for var, value in zip(opt.variables, opt_vars):
    var.assign(value)
out["f16_weights"] = weights
out["f16_nonfinite"] = opt.nonfinite_steps()
json.dump(out, open(sys.argv[1], "w"))
"""


def test_jax_fit_leaves_a_branch_out_of_the_loss_alone(tmp_path):
    """On JAX a variable the loss does not reach gets a gradient of zeros (the torch backend
    gets ``None``): under a compiled ``model.fit`` it and its optimizer state stay bitwise as
    they were (it drifted by 0.1-0.3 per 200 steps), and the other variables step as when it
    is frozen. Float16 factors follow the float64 reference under ``jax.jit`` too."""
    import numpy as np

    r = _run_script("jax", _JAX_SCRIPT, tmp_path)
    assert r["iterations"] == 108, r
    assert r["b_moved"] == 0.0, r
    assert sorted(r["b_nonfinite"].values()) == [0] * 4, r
    assert r["a_vs_without_b"] < 1e-6, r
    expected = _identity_preconditioner_reference(20, 1e5, 1e-3)
    got = [w[0][0] for w in r["f16_weights"]]
    assert np.allclose(got, expected, rtol=1e-6, atol=0.0), (got, expected)
    assert list(r["f16_nonfinite"].values()) == [0], r


_TF_DISTRIBUTE_SCRIPT = r"""
import json, sys
import numpy as np, tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from kron_precond.keras import Kron

rng = np.random.default_rng(0)
X = rng.standard_normal((32, 8)).astype("float32")
Y = rng.integers(0, 3, 32).astype("int32")

def fit(strategy, devices):
    with strategy.scope():
        m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
        m.compile(optimizer=Kron(learning_rate=0.02), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        m.fit(X, Y, batch_size=16, epochs=1, verbose=0)
        return {"raised": None, "iterations": int(m.optimizer.iterations.numpy())}
    except Exception as exc:  # the type and message are what is checked
        return {"raised": type(exc).__name__, "message": str(exc)}

out = {"two": fit(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), 2),
       "one": fit(tf.distribute.MirroredStrategy(["/cpu:0"]), 1)}
json.dump(out, open(sys.argv[1], "w"))
"""


def test_a_tf_distribute_strategy_with_several_replicas_is_refused(tmp_path):
    """``Kron`` replaces the TensorFlow optimizer's cross-replica update, so under a
    ``MirroredStrategy`` each replica stepped on its own gradients and the replicas drifted
    apart (4.8e-2 and 3.1e-2 from one device). Two replicas (two logical CPUs) raise
    ``RuntimeError`` naming tf.distribute and the supported alternative; one replica trains."""
    r = _run_script("tensorflow", _TF_DISTRIBUTE_SCRIPT, tmp_path)
    two = r["two"]
    assert two["raised"] == "RuntimeError", two
    assert "tf.distribute" in two["message"] and "keras.distribution.DataParallel" in two["message"], two
    assert r["one"] == {"raised": None, "iterations": 2}, r["one"]


_JAX_DATA_PARALLEL_SCRIPT = r"""
import json, sys
import numpy as np, keras, jax
from kron_precond.keras import Kron

rng = np.random.default_rng(0)
X = rng.standard_normal((64, 8)).astype("float32")
Y = rng.integers(0, 3, 64).astype("int32")

def fit(data_parallel):
    if data_parallel:
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    try:
        init = keras.initializers.GlorotUniform
        m = keras.Sequential([keras.Input((8,)),
                              keras.layers.Dense(6, activation="tanh", kernel_initializer=init(seed=0)),
                              keras.layers.Dense(3, kernel_initializer=init(seed=1))])
        m.compile(optimizer=Kron(learning_rate=0.02, preconditioner_update_probability=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return m.get_weights()
    finally:
        keras.distribution.set_distribution(None)

one, split = fit(False), fit(True)
json.dump({"devices": len(jax.devices()),
           "diff": max(float(np.max(np.abs(a - b))) for a, b in zip(one, split)),
           "moved": max(float(np.max(np.abs(a))) for a in one)}, open(sys.argv[1], "w"))
"""


def test_jax_data_parallel_over_two_devices_equals_one_device(tmp_path):
    """The supported data-parallel path (the tf.distribute refusal names it): JAX's
    ``keras.distribution.DataParallel`` over two host devices, each with half of every batch,
    gives the weights of one device on the whole batch."""
    r = _run_script("jax", _JAX_DATA_PARALLEL_SCRIPT, tmp_path)
    assert r["devices"] == 2, r
    assert r["diff"] < 1e-5, r
