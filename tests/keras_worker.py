"""Runs Keras ``Kron`` checks in a process of its own, for the backend in ``KERAS_BACKEND``.

Keras binds its backend when first imported, so ``tests/test_keras_kron.py`` starts this
script once per backend and asserts on the JSON it writes:

    KERAS_BACKEND=jax python tests/keras_worker.py OUT.json scenario[,scenario...]

Each scenario returns a dict of measurements (errors, accuracies, flags); an exception is
reported as ``{"error": traceback}`` so one failing scenario does not hide the others.
The references are independent of the code under test: the torch ``Kron`` for numerics,
``kron_precond.schedules.UpdateDecider`` for update decisions, a continuous run for resume.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
START = time.perf_counter()

import keras  # noqa: E402  (the backend is chosen by KERAS_BACKEND, set by the caller)
from keras import ops  # noqa: E402

from kron_precond.keras import Kron, PrecondUpdateProbSchedule  # noqa: E402

BACKEND = keras.backend.backend()
IMPORT_SECONDS = time.perf_counter() - START
JIT = BACKEND in ("jax", "tensorflow")  # backends whose fit() compiles (JAX jit, TF XLA)

if BACKEND == "torch":
    import torch

    torch.set_num_threads(1)


def to_numpy(x) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(x))


def rel_err(a, b) -> float:
    """``max|a − b| / max|b|`` (``max|a − b|`` if ``b`` is all zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if b.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)


# ----------------------------------------------------------------------------- numerics
SHAPES = [(6, 5), (5,), (2, 3, 4), (), (10, 3)]
EQUIVALENCE = {  # name: (Kron kwargs, steps, NaN gradient at (param, step) or None)
    "default": ({}, 4, (0, 2)),
    "smart_one_diag": (dict(memory_save_mode="smart_one_diag"), 4, None),
    "one_diag": (dict(memory_save_mode="one_diag"), 4, None),
    "all_diag": (dict(memory_save_mode="all_diag"), 4, None),
    "small_triangular": (dict(max_size_triangular=4, min_ndim_triangular=1), 4, None),
    "init_none_wd_grad_fit": (dict(precond_init_scale=None, weight_decay=0.1, b1=0.5,
                                   momentum_into_precond_update=False), 4, (1, 1)),
    "clipnorm": (dict(clipnorm=0.5), 3, None),
    "clipvalue": (dict(clipvalue=0.05), 3, None),
    "global_clipnorm": (dict(global_clipnorm=0.5), 3, (2, 2)),
    "merge_dims_half_prob": (dict(merge_dims=True, preconditioner_update_probability=0.5,
                                  precond_init_scale=0.5), 4, None),
    "float64_factors": (dict(precond_dtype="float64", precond_lr=0.3), 3, None),
}


def _torch_kwargs(kwargs: dict) -> dict:
    import torch

    out = dict(kwargs)
    out["lr"] = out.pop("learning_rate")
    for name in ("mu_dtype", "precond_dtype"):
        if out.get(name) is not None:
            out[name] = getattr(torch, out[name])
    return out


def compare_with_torch(kwargs: dict, steps: int, nan_at, shapes=SHAPES) -> dict:
    """Run the Keras and torch optimizers on identical gradients and probe vectors; the
    largest relative difference of parameters, momenta and factors after ``steps``."""
    import torch

    from kron_precond.methods.psgd_tensor import PSGDTensor
    from kron_precond.optim import Kron as TorchKron

    rng = np.random.default_rng(1)
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes]
             for _ in range(steps)]
    if nan_at is not None:
        grads[nan_at[1] - 1][nan_at[0]].flat[0] = np.nan
    probes = {(i, t): rng.standard_normal(s) for t in range(1, steps + 1)
              for i, s in enumerate(shapes)}
    kwargs = {"learning_rate": 0.05, "preconditioner_update_probability": 1.0, **kwargs}

    class InjectedKron(Kron):
        def _probe(self, slot, step, dtype):
            v = probes[(slot.index, int(step))].reshape(slot.work_shape)
            return ops.convert_to_tensor(v, dtype)

    k_vars = [keras.Variable(x) for x in init]
    k_opt = InjectedKron(**kwargs)
    for g in grads:
        with torch.no_grad():
            k_opt.apply([ops.convert_to_tensor(x) for x in g], k_vars)

    def torch_probe(self, step, dtype):  # PSGDTensor.probe; key = (parameter index,)
        v = probes[(self.key[0], step)]
        return torch.as_tensor(v, dtype=dtype).reshape(self.factors.work_shape)

    t_params = [torch.nn.Parameter(torch.tensor(x)) for x in init]
    original = PSGDTensor.probe
    PSGDTensor.probe = torch_probe
    try:
        t_opt = TorchKron(t_params, **_torch_kwargs(kwargs))
        for g in grads:
            for p, x in zip(t_params, g):
                p.grad = torch.tensor(x)
            t_opt.step()
    finally:
        PSGDTensor.probe = original

    errs = {"params": 0.0, "momentum": 0.0, "factors": 0.0}
    kinds = set()
    for slot, kv, tp in zip(k_opt._slots, k_vars, t_params):
        state = t_opt.state[tp]
        errs["params"] = max(errs["params"], rel_err(to_numpy(kv), tp.detach().numpy()))
        errs["momentum"] = max(errs["momentum"], rel_err(
            to_numpy(slot.momentum), state["momentum_buffer"].float().numpy()))
        for kq, tq in zip(slot.qs, state["Q"]):
            errs["factors"] = max(errs["factors"], rel_err(to_numpy(kq), tq.double().numpy()))
            kinds.add("diagonal" if tq.dim() == 1 else "triangular")
    moved = max(rel_err(to_numpy(kv), x) for kv, x in zip(k_vars, init))
    return {**errs, "kinds": sorted(kinds), "moved": moved,
            "q_updates": [k_opt.preconditioner_updates, t_opt._q_updates],
            "nonfinite": sorted(k_opt.nonfinite_steps().values())}


def scenario_equivalence() -> dict:
    out = {name: compare_with_torch(kw, steps, nan_at)
           for name, (kw, steps, nan_at) in EQUIVALENCE.items()}
    # 100 preconditioner updates trigger the factor rebalancing of both implementations.
    out["balance_after_100_updates"] = compare_with_torch({}, 101, None,
                                                          shapes=[(4, 3), (2, 3, 2)])
    return out


# ----------------------------------------------------------------------------- schedule
def scenario_decisions() -> dict:
    """Per-step update decisions of the in-graph counter vs the torch ``UpdateDecider``."""
    from kron_precond.schedules import UpdateDecider, precond_update_prob_schedule

    specs = {  # name: (Keras probability, torch probability, steps)
        "default": (None, None, 2000),
        "p=0.1": (0.1, 0.1, 200), "p=0.3": (0.3, 0.3, 200), "p=0.7": (0.7, 0.7, 200),
        "p=1/3": (1 / 3, 1 / 3, 200), "p=0.25": (0.25, 0.25, 200), "p=0": (0.0, 0.0, 50),
        "fast_anneal": (PrecondUpdateProbSchedule(min_prob=0.05, decay=0.01, flat_start=10),
                        precond_update_prob_schedule(min_prob=0.05, decay=0.01,
                                                     flat_start=10), 400),
        "torch_schedule_object": (precond_update_prob_schedule(decay=0.01, flat_start=50),
                                  precond_update_prob_schedule(decay=0.01, flat_start=50),
                                  400),
    }
    out = {}
    for name, (keras_p, torch_p, steps) in specs.items():
        opt = Kron(preconditioner_update_probability=keras_p)
        opt.build([keras.Variable(np.zeros(1, np.float32))])
        ref = UpdateDecider(torch_p)
        mismatches, updates = 0, 0
        for step in range(steps):
            do_update, _ = opt._decide_update(ops.convert_to_tensor(step, "int32"))
            expected = ref()
            updates += expected
            mismatches += bool(to_numpy(do_update)) != expected
        out[name] = {"mismatches": mismatches, "updates": updates,
                     "counted": opt.preconditioner_updates}
    return out


# ----------------------------------------------------------------------------- arguments
BAD_ARGUMENTS = [
    (dict(memory_save_mode="two_diag"), "memory_save_mode"),
    (dict(learning_rate=-1e-3), "learning_rate"),
    (dict(learning_rate=0.0), "learning_rate"),
    (dict(precond_lr=-0.1), "precond_lr"),
    (dict(weight_decay=-1e-4), "weight_decay"),
    (dict(precond_init_scale=-1.0), "precond_init_scale"),
    (dict(b1=1.0), "b1"),
    (dict(b1=-0.1), "b1"),
    (dict(max_size_triangular=0), "max_size_triangular"),
    (dict(max_size_triangular=-5), "max_size_triangular"),
    (dict(min_ndim_triangular=-1), "min_ndim_triangular"),
    (dict(preconditioner_update_probability=1.5), "preconditioner_update_probability"),
    (dict(preconditioner_update_probability=-0.1), "preconditioner_update_probability"),
    (dict(mu_dtype="int32"), "mu_dtype"),
    (dict(precond_dtype="no_such_dtype"), "precond_dtype"),
    (dict(clipnorm=-1.0), "clipnorm"),
    (dict(global_clipnorm=0.0), "global_clipnorm"),
    (dict(momentum_into_precond_update="no"), "momentum_into_precond_update"),  # bool("no") is True
    (dict(merge_dims=1), "merge_dims"),
    # P = s²·I must be finite in precond_dtype, as for the torch Kron: sqrt(float32 max) = 1.84e19
    (dict(precond_init_scale=1e30), "precond_init_scale"),
    (dict(precond_init_scale=300.0, precond_dtype="float16"), "precond_init_scale"),  # sqrt(65 504) = 256
    # torch.manual_seed's range, as for the torch Kron
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    # NumPy bools are bools, as for the torch Kron
    (dict(b1=np.False_), "b1"),
    (dict(weight_decay=np.True_), "weight_decay"),
    (dict(precond_lr=np.True_), "precond_lr"),
    (dict(learning_rate=np.True_), "learning_rate"),
    (dict(seed=np.True_), "seed"),
    (dict(clipnorm=np.True_), "clipnorm"),
    (dict(max_size_triangular=np.True_), "max_size_triangular"),
    # norms are taken in float32, as for the torch Kron: a larger clip value overflows there
    # (clipnorm / inf = NaN reached the momentum, and the variable never trained again)
    (dict(clipnorm=1e39), "clipnorm"),
    (dict(global_clipnorm=1e39), "global_clipnorm"),
    (dict(clipvalue=1e39), "clipvalue"),
    # the factors need a dtype (None meant floatx(), silently) that their math runs in
    (dict(precond_dtype=None), "precond_dtype"),
    (dict(precond_dtype="float8_e4m3fn"), "precond_dtype"),
    (dict(mu_dtype="float8_e4m3fn"), "mu_dtype"),
    # Keras's own arguments, which its base class takes unchecked (a loss scale of 0 skipped
    # every step, a negative one ascended)
    (dict(loss_scale_factor=0.0), "loss_scale_factor"),
    (dict(loss_scale_factor=-1.0), "loss_scale_factor"),
    (dict(gradient_accumulation_steps=2.5), "gradient_accumulation_steps"),
    (dict(gradient_accumulation_steps=1), "gradient_accumulation_steps"),
    (dict(use_ema="yes"), "use_ema"),
    (dict(ema_momentum=1.5), "ema_momentum"),
    (dict(ema_overwrite_frequency=0), "ema_overwrite_frequency"),
]

# NumPy scalars where a number is expected (the torch Kron takes them too), and the bounds
ACCEPTED_ARGUMENTS = {
    "numpy_scalars": dict(b1=np.float32(0.9), weight_decay=np.float32(0.1), seed=np.int64(3),
                          precond_lr=np.float32(0.2), precond_init_scale=np.float32(2.0),
                          max_size_triangular=np.int64(64), min_ndim_triangular=np.int32(1),
                          learning_rate=np.float32(0.01), clipnorm=np.float32(1.5)),
    "numpy_float64": dict(b1=np.float64(0.8), weight_decay=np.float64(0.2), seed=np.uint64(2**64 - 1)),
    "bounds": dict(precond_init_scale=1.8e19, seed=-(2**63)),
    # NumPy bools where a flag is expected: kept as Python bools
    "numpy_bools": dict(use_ema=np.True_, merge_dims=np.False_, momentum_into_precond_update=np.True_),
}


def scenario_arguments() -> dict:
    raised = []
    for kwargs, name in BAD_ARGUMENTS:
        try:
            Kron(**kwargs)
            raised.append([name, None, ""])
        except Exception as exc:  # noqa: BLE001 -- the type is what is checked
            raised.append([name, type(exc).__name__, str(exc)])

    configs = {}
    for label, kwargs in {
        "float_probability": dict(learning_rate=1e-3, b1=0.8, weight_decay=1e-4,
                                  preconditioner_update_probability=0.25,
                                  max_size_triangular=64, min_ndim_triangular=1,
                                  memory_save_mode="one_diag",
                                  momentum_into_precond_update=False, precond_lr=0.3,
                                  precond_init_scale=None, mu_dtype="bfloat16",
                                  precond_dtype="float32", merge_dims=True, seed=7,
                                  global_clipnorm=2.0, use_ema=True,
                                  gradient_accumulation_steps=3),
        "schedule_probability": dict(
            preconditioner_update_probability=PrecondUpdateProbSchedule(0.9, 0.1, 0.01, 5)),
        "defaults": {},
    }.items():
        opt = Kron(**kwargs)
        config = opt.get_config()
        again = Kron.from_config(json.loads(json.dumps(config))).get_config()
        via_keras = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
        configs[label] = {"round_trip_equal": again == config,
                          "keras_deserialize_type": type(via_keras).__name__,
                          "keras_round_trip_equal": via_keras.get_config() == config,
                          "config": {k: repr(v) for k, v in config.items()}}
    accepted = {}
    # a keras.Variable learning rate holds one number too
    for label, kwargs in {**ACCEPTED_ARGUMENTS, "keras_variable": dict(learning_rate=keras.Variable(0.01))}.items():
        try:
            config = Kron(**kwargs).get_config()
            json.dumps(config)  # plain Python numbers, as a saved model needs
            accepted[label] = {k: config[k] for k in kwargs}
        except Exception as exc:  # noqa: BLE001 -- reported to the test
            accepted[label] = {"error": f"{type(exc).__name__}: {exc}"}
    defaults = Kron().get_config()
    return {"raised": raised, "configs": configs, "accepted": accepted,
            "defaults": {k: defaults[k] for k in (
                "learning_rate", "b1", "weight_decay", "max_size_triangular",
                "min_ndim_triangular", "memory_save_mode", "momentum_into_precond_update",
                "precond_lr", "precond_init_scale", "mu_dtype", "precond_dtype",
                "merge_dims", "seed")},
            "default_probability": repr(Kron().preconditioner_update_probability)}


def scenario_keras_arguments() -> dict:
    """Keras' own optimizer arguments on top of Kron: gradient accumulation, loss scale,
    EMA -- each against a plain Kron given the equivalent gradients."""
    rng = np.random.default_rng(3)
    shapes = [(4, 3), (3,)]
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    g1 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    g2 = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def run(opt, grad_lists):
        variables = [keras.Variable(x) for x in init]
        for grads in grad_lists:
            opt.apply([ops.convert_to_tensor(g) for g in grads], variables)
        return [to_numpy(v) for v in variables]

    kw = dict(learning_rate=0.05, weight_decay=0.1)
    accumulated = run(Kron(gradient_accumulation_steps=2, **kw), [g1, g2])
    averaged = run(Kron(**kw), [[(a + b) / 2 for a, b in zip(g1, g2)]])
    first_only = run(Kron(gradient_accumulation_steps=2, **kw), [g1])
    # over several updates with a schedule of the step: Keras counts the optimizer's steps,
    # not the micro-batches, so the schedule and the probes follow the updates
    micro = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(8)]
    schedule = lambda step: ops.where(step < 2, 1.0, 0.0)  # noqa: E731
    scheduled = run(Kron(gradient_accumulation_steps=2, preconditioner_update_probability=schedule, **kw), micro)
    scheduled_mean = run(Kron(preconditioner_update_probability=schedule, **kw),
                         [[(a + b) / 2 for a, b in zip(micro[i], micro[i + 1])] for i in range(0, 8, 2)])
    scaled = run(Kron(loss_scale_factor=64.0, **kw), [[g * 64.0 for g in g1]])
    plain = run(Kron(**kw), [g1])
    ema_opt = Kron(use_ema=True, ema_momentum=0.5, **kw)
    ema_vars = [keras.Variable(x) for x in init]
    for grads in (g1, g2):
        ema_opt.apply([ops.convert_to_tensor(g) for g in grads], ema_vars)
    after_two = [to_numpy(v) for v in ema_vars]
    # EMA: average = v after step 1; then 0.5·average + 0.5·v after step 2.
    after_one = run(Kron(**kw), [g1])
    expected_avg = [0.5 * a + 0.5 * b for a, b in zip(after_one, after_two)]
    got_avg = [to_numpy(v) for v in ema_opt._model_variables_moving_average]
    return {
        "accumulation_vs_average": max(rel_err(a, b) for a, b in zip(accumulated, averaged)),
        "accumulation_over_a_schedule_vs_average": max(rel_err(a, b) for a, b in zip(scheduled, scheduled_mean)),
        "accumulation_holds_until_update": max(rel_err(a, b)
                                               for a, b in zip(first_only, init)),
        "loss_scale_vs_plain": max(rel_err(a, b) for a, b in zip(scaled, plain)),
        "ema_vs_formula": max(rel_err(a, b) for a, b in zip(got_avg, expected_avg)),
        "step_moves": max(rel_err(a, b) for a, b in zip(plain, init)),
    }


# ----------------------------------------------------------------------------- training
def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = x.astype(np.float32), y.astype(np.int32)
    perm = np.random.default_rng(0).permutation(len(x))
    train, test = perm[:1400], perm[1400:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-3
    x = (x - mean) / std
    return x[train], y[train], x[test], y[test]


def mlp(optimizer, jit):
    init = keras.initializers.GlorotUniform
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu", kernel_initializer=init(seed=0)),
        keras.layers.Dense(10, kernel_initializer=init(seed=1))])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit)
    return model


TRAIN_SCHEDULE = dict(max_prob=1.0, min_prob=0.1, decay=0.02, flat_start=20)
EPOCHS, SAVE_AFTER, BATCH = 6, 2, 56  # 56 divides 1400: one batch shape, one compilation


def scenario_train() -> dict:
    """``model.fit`` on the digits (1400 train / 397 test), compiled where the backend
    compiles, with an annealed update schedule (a callable of the step). The model
    is saved after ``SAVE_AFTER`` epochs; the loaded copy trains the remaining epochs on
    the same batches and must end identical to the uninterrupted run (two compilations
    in all, which is most of this scenario's time on JAX and TensorFlow)."""
    from kron_precond.schedules import UpdateDecider, precond_update_prob_schedule

    xtr, ytr, xte, yte = digits()
    orders = [np.random.default_rng(10 + e).permutation(len(xtr)) for e in range(EPOCHS)]
    opt = Kron(learning_rate=3e-3, weight_decay=1e-4, memory_save_mode="smart_one_diag",
               preconditioner_update_probability=PrecondUpdateProbSchedule(**TRAIN_SCHEDULE))
    model = mlp(opt, JIT)
    initial = model.get_weights()

    def epoch(m, e):
        m.fit(xtr[orders[e]], ytr[orders[e]], batch_size=BATCH, epochs=1, shuffle=False,
              verbose=0)

    t0 = time.perf_counter()
    for e in range(SAVE_AFTER):
        epoch(model, e)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mid.keras")
        model.save(path)
        resumed = keras.models.load_model(path)
    acc_at_save = int(to_numpy(opt._update_acc))
    for e in range(SAVE_AFTER, EPOCHS):
        epoch(model, e)
    fit_seconds = time.perf_counter() - t0
    _, accuracy = model.evaluate(xte, yte, verbose=0)
    for e in range(SAVE_AFTER, EPOCHS):
        epoch(resumed, e)

    steps = int(to_numpy(opt.iterations))
    ref = UpdateDecider(precond_update_prob_schedule(**TRAIN_SCHEDULE))
    expected = sum(ref() for _ in range(steps))
    b = resumed.optimizer
    # What Keras actually ran with (it silently falls back to no compilation when a
    # model does not support it).
    jit = [bool(model.jit_compile), bool(resumed.jit_compile)]
    return {"accuracy": float(accuracy), "fit_seconds": fit_seconds, "jit_compile": jit,
            "steps": steps, "q_updates": opt.preconditioner_updates,
            "q_updates_expected": expected,
            "moved": rel_err(model.get_weights()[0], initial[0]),
            "resumed": {
                "optimizer_type": type(b).__name__,
                "weights_rel_diff": max(rel_err(u, v) for u, v in
                                        zip(resumed.get_weights(), model.get_weights())),
                "optimizer_vars_rel_diff": max(rel_err(to_numpy(u), to_numpy(v))
                                               for u, v in zip(b.variables, opt.variables)),
                "n_optimizer_vars": [len(opt.variables), len(b.variables)],
                "q_updates": [opt.preconditioner_updates, b.preconditioner_updates],
                "iterations": [steps, int(to_numpy(b.iterations))],
                "acc_at_save": acc_at_save, "acc_unit": 1 << 30}}


SCENARIOS = {
    "equivalence": scenario_equivalence,
    "decisions": scenario_decisions,
    "arguments": scenario_arguments,
    "keras_arguments": scenario_keras_arguments,
    "train": scenario_train,
}


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2].split(",")
    results = {"backend": BACKEND, "keras": keras.__version__,
               "import_seconds": IMPORT_SECONDS}
    for name in names:
        t0 = time.perf_counter()
        try:
            results[name] = SCENARIOS[name]()
        except Exception:  # noqa: BLE001 -- reported to the test, which fails on it
            results[name] = {"error": traceback.format_exc()}
        results[name + "_seconds"] = time.perf_counter() - t0
    results["total_seconds"] = time.perf_counter() - START
    times = os.times()  # CPU time, a fairer figure than wall time on a shared machine
    results["cpu_seconds"] = times.user + times.system
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
