"""``Kron``: PSGD Kron as a Keras 3 optimizer, written with ``keras.ops`` only.

The algorithm of the torch :class:`kron_precond.Kron` with its default ``'eq'`` Q update
(see its docstring; the arguments differ as :class:`Kron`'s docstring says): per step,
clip the gradients, update the momentum, on
preconditioner-update steps fit the Kronecker factors ``Q_i`` to the debiased momentum,
then step along ``P m̂`` clipped to RMS ≤ 1.1 with decoupled weight decay on tensors of
≥ 2 dims. A tensor whose gradient is zero in every element counts as having no gradient
(JAX hands a variable the loss did not reach zeros where the other backends hand ``None``):
it is left exactly as it is, state and weight decay included. A tensor whose gradient is
not finite skips the step, and so does the variable update of one whose preconditioned
update is not finite (an overflow); both are counted (arithmetic masks). Float16 factors
are computed in float32 (float16's range ends at 65 504); a variable with no elements is
left alone. ``tf.distribute`` strategies with more than one replica are refused.

Graph-safety: nothing branches in Python on a tensor value. The update decision is the
deterministic counter of :class:`kron_precond.schedules.UpdateDecider` kept in an int32
optimizer variable (fixed point, units of 2⁻³⁰, so a resumed run makes the same
decisions bit for bit), and the Q update runs in one ``keras.ops.cond`` whose branches
return new tensors and assign nothing, as ``jax.jit`` requires. Every piece of state is an
optimizer variable (``add_variable``), so ``model.save`` / ``keras.models.load_model``
restore it.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Literal, overload

import keras
from keras import ops

from ..methods.psgd import (
    MEMORY_SAVE_MODES,
    factor_is_diagonal,
    most_square_split,
    probe_seed,
)
from . import psgd_ops
from .schedules import PrecondUpdateProbSchedule, as_keras_schedule

_RMS_CLIP = 1.1
_UNIT = 1 << 30  # fixed-point unit of the update-decision accumulator (int32)
_TOLERANCE = 1 << 10  # ~1e-6: float32 probabilities like 0.7 must still sum to 1
_BALANCE_EVERY = 100  # Q updates between factor rebalancings, as in the torch PSGDTensor


_SEED_RANGE = (-(2**63), 2**64 - 1)  # torch.manual_seed's, as for the torch Kron


def _number(value: Any) -> int | float | None:
    """``value`` as a Python int or float -- NumPy scalars and one-element arrays included, as
    the torch ``Kron`` takes them --, or ``None`` for anything else; bools (NumPy's too) are
    not numbers."""
    if not isinstance(value, numbers.Real) and not isinstance(value, str):
        if "bool" in str(getattr(value, "dtype", "")):
            return None
        try:
            if hasattr(value, "item"):  # np.bool_, a one-element array or tensor
                value = value.item()
            elif hasattr(value, "__float__"):  # a keras.Variable holding one number
                value = float(value)
        except (TypeError, ValueError, RuntimeError):  # more than one element
            return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _check_positive(name: str, value: Any, *, allow_none: bool = False,
                    maximum: float | None = None, what: str = "") -> float | None:
    """``value`` as a positive finite Python float at most ``maximum`` (``None`` when allowed)."""
    if value is None and allow_none:
        return None
    number = _number(value)
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"Invalid {name}: {value!r}; expected a positive finite number"
                         + (" or None" if allow_none else ""))
    if maximum is not None and number > maximum:
        raise ValueError(f"Invalid {name}: {value!r}; expected at most {maximum:.3g}{what}")
    return float(number)


def _float_max(dtype: str) -> float:
    """The largest finite value of the floating dtype name ``dtype``."""
    import ml_dtypes  # a Keras dependency: NumPy's finfo does not know bfloat16

    return float(ml_dtypes.finfo(dtype).max)


# The dtypes momentum and factors may be kept in: float8 has no matmul or linalg to run the math in
STATE_DTYPES = ("float16", "bfloat16", "float32", "float64")


@overload
def _check_float_dtype(name: str, dtype: Any, *, allow_none: Literal[False] = False) -> str: ...
@overload
def _check_float_dtype(name: str, dtype: Any, *, allow_none: bool) -> str | None: ...
def _check_float_dtype(name: str, dtype: Any, *, allow_none: bool = False) -> str | None:
    """``dtype``'s standard name, one of :data:`STATE_DTYPES` (``None`` when allowed: Keras would
    read ``None`` as ``floatx()``, silently)."""
    if dtype is None:
        if allow_none:
            return None
        std = None
    else:
        try:
            std = keras.backend.standardize_dtype(dtype)
        except (TypeError, ValueError, AttributeError):
            std = None
    if std not in STATE_DTYPES:
        raise ValueError(f"Invalid {name}: {dtype!r}; expected one of {', '.join(map(repr, STATE_DTYPES))}"
                         + (" or None" if allow_none else ""))
    return std


def _check_bool(name: str, flag: Any) -> bool:
    """``flag`` as a Python bool: a bool or a NumPy bool (``bool("no")`` would be True)."""
    import numpy as np  # a Keras dependency

    if not isinstance(flag, (bool, np.bool_)):
        raise ValueError(f"Invalid {name}: {flag!r}; expected a bool")
    return bool(flag)


def _check_probability(p: Any):
    if p is None:
        return PrecondUpdateProbSchedule()
    if callable(p):
        return as_keras_schedule(p)
    value = _number(p)
    if value is None or not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"Invalid preconditioner_update_probability: {p!r}; expected a "
                         "probability in [0, 1], a callable of the step, or None")
    return float(value)


def _compute_dtype(precond_dtype: str) -> str:
    """The dtype of the factor math for factors kept in ``precond_dtype``: float32 for
    float16 (whose range ends at 65 504, which ``P m̂`` or a Gram matrix passes easily),
    else ``precond_dtype`` (bfloat16 has float32's range), as in the torch ``Kron``."""
    return "float32" if precond_dtype == "float16" else precond_dtype


def _refuse_tf_distribution() -> None:
    """``RuntimeError`` when a ``tf.distribute`` strategy with more than one replica is in
    scope: ``Kron`` replaces the TensorFlow optimizer's cross-replica update (which sums the
    gradients over the replicas), so every replica would step on its own gradients and the
    replicas would drift apart."""
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas > 1:
        raise RuntimeError(
            f"kron_precond.keras.Kron does not support tf.distribute strategies (a "
            f"{type(tf.distribute.get_strategy()).__name__} with {replicas} replicas is active): it "
            "updates all variables together, replacing the TensorFlow optimizer's cross-replica "
            "update, so each replica would step on its own gradients. For data-parallel training "
            "use the JAX backend with keras.distribution.DataParallel, or one replica")


class _StatelessSeed(keras.random.SeedGenerator):
    """A seed for ``keras.random`` computed in-graph: ``draw_seed`` asks a SeedGenerator
    for ``next()``, which here returns the given ``[2]`` tensor and advances nothing (a
    stateful generator cannot be advanced inside a ``jit``-ted ``cond`` branch)."""

    def __init__(self, seed):  # deliberately no state variable
        self._seed = seed

    def next(self, ordered=True):
        return self._seed


def _seed_dtype() -> str:
    """The dtype ``keras.random`` expects for a seed tensor on this backend."""
    from keras.src import backend as keras_backend  # not exported publicly

    return keras_backend.random_seed_dtype()


class _Slot:
    """Static layout and state variables of one parameter tensor."""

    def __init__(self, index: int, variable, work_shape: tuple, diagonal: list,
                 momentum, step, qs: list, initialized, nonfinite):
        self.index = index
        self.shape = tuple(int(n) for n in variable.shape)
        self.path = getattr(variable, "path", variable.name)
        self.work_shape = work_shape
        self.numel = math.prod(work_shape)
        self.diagonal = diagonal
        # x(QᵀQ) beats (xQᵀ)Q when the fibres outnumber n (flop count of dense products).
        self.form_p = [n < self.numel // n for n in work_shape] if self.numel else []
        self.momentum, self.step, self.qs = momentum, step, qs
        self.initialized, self.nonfinite = initialized, nonfinite

    @property
    def empty(self) -> bool:
        """A variable with no elements: it has no state and is left alone."""
        return self.numel == 0


@keras.saving.register_keras_serializable(package="kron_precond")
class Kron(keras.optimizers.Optimizer):
    """PSGD Kron (Xi-Lin Li) for Keras 3 on any backend (TensorFlow, JAX, PyTorch).

    Momentum preconditioned by a learned Kronecker-factored whitening preconditioner
    ``P = ⊗_i Q_iᵀQ_i`` per variable. The arguments and defaults of the torch
    :class:`kron_precond.Kron` (``lr`` is called ``learning_rate`` here), except that there
    is no ``precond_update`` (the Q update is always ``'eq'``, triangular factors) and
    ``max_size_triangular`` must be ≥ 1:

    Args:
        learning_rate: float > 0, a ``LearningRateSchedule`` or a callable (Keras rules).
        b1: momentum coefficient in [0, 1).
        weight_decay: decoupled weight decay ≥ 0, applied to variables with ≥ 2 dims
            (``exclude_from_weight_decay`` is honoured); ``None`` means 0.
        preconditioner_update_probability: a float in [0, 1]; a callable of the step
            count (an int32 tensor) returning a float tensor, written with ``keras.ops``
            (e.g. a ``LearningRateSchedule``); or ``None`` for
            :class:`~kron_precond.keras.PrecondUpdateProbSchedule` (1 → 0.03). Decided by
            a deterministic counter: ``acc += p``; update when ``acc ≥ 1``.
        max_size_triangular: dims larger than this get a diagonal factor (int ≥ 1).
        min_ndim_triangular: variables with fewer dims get diagonal factors only.
        memory_save_mode: ``None``, ``'smart_one_diag'``, ``'one_diag'`` or ``'all_diag'``.
        momentum_into_precond_update: fit Q to the debiased momentum (else the gradient).
        precond_lr: step size of the Q updates (> 0).
        precond_init_scale: initial ``P = s²·I``; ``None`` estimates ``s`` in-graph from
            the first finite, non-zero gradient of each variable.
        mu_dtype: dtype name of the momentum (default: the variable's).
        precond_dtype: dtype name of the factors and of the preconditioning math
            (float16 factors are computed in float32, as in torch); the learning rate,
            weight decay, update scale and RMS norm are computed in float32 or wider.
        merge_dims: view variables of rank > 2 as their most square 2-D matrix.
        seed: seeds the probe vectors, drawn statelessly from ``(seed, variable index,
            step)`` with ``keras.random.normal``.
        clipnorm, clipvalue, global_clipnorm: gradient clipping (at most one), as in
            Keras; the global norm leaves out tensors whose gradient is not finite.
        use_ema, ema_momentum, ema_overwrite_frequency, loss_scale_factor,
        gradient_accumulation_steps, name: the standard Keras optimizer arguments.
    """

    def __init__(self, learning_rate=3e-4, b1: float = 0.9, weight_decay: float | None = 0.0,
                 preconditioner_update_probability=None, max_size_triangular: int = 8192,
                 min_ndim_triangular: int = 2, memory_save_mode: str | None = None,
                 momentum_into_precond_update: bool = True, precond_lr: float = 0.1,
                 precond_init_scale: float | None = 1.0, mu_dtype: str | None = None,
                 precond_dtype: str = "float32", merge_dims: bool = False, seed: int = 0,
                 clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, use_ema: bool = False,
                 ema_momentum: float = 0.99, ema_overwrite_frequency: int | None = None,
                 loss_scale_factor: float | None = None,
                 gradient_accumulation_steps: int | None = None, name: str | None = None,
                 **kwargs):
        # Numbers may be NumPy scalars (as for the torch Kron), never bools; kept as Python numbers.
        if not (isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule)
                or callable(learning_rate)):
            learning_rate = _check_positive("learning_rate", learning_rate)
        precond_lr_number = _check_positive("precond_lr", precond_lr)
        assert precond_lr_number is not None  # for mypy: None is refused
        mu_dtype = _check_float_dtype("mu_dtype", mu_dtype, allow_none=True)
        precond_dtype = _check_float_dtype("precond_dtype", precond_dtype)
        # P = s²·I must be finite in the factors' dtype, as the torch Kron requires (a larger
        # scale overflows the first Q update, and the variable never trains)
        precond_init_scale = _check_positive(
            "precond_init_scale", precond_init_scale, allow_none=True,
            maximum=math.sqrt(_float_max(precond_dtype)),
            what=f" (its square, the initial preconditioner, must be finite in {precond_dtype})")
        # norms are taken in float32: a larger clip value overflows there (clipnorm / inf is NaN)
        clipnorm, clipvalue, global_clipnorm = (
            _check_positive(clip_name, clip, allow_none=True, maximum=_float_max("float32"),
                            what=" (clipping is computed in float32)") for clip_name, clip in (
                ("clipnorm", clipnorm), ("clipvalue", clipvalue), ("global_clipnorm", global_clipnorm)))
        wd = _number(0.0 if weight_decay is None else weight_decay)
        if wd is None or not (math.isfinite(wd) and wd >= 0):
            raise ValueError(f"Invalid weight_decay: {weight_decay!r}; expected a finite "
                             "float >= 0")
        b1_number = _number(b1)
        if b1_number is None or not 0.0 <= b1_number < 1.0:
            raise ValueError(f"Invalid b1: {b1!r}; expected a float in [0, 1)")
        if memory_save_mode not in MEMORY_SAVE_MODES:
            raise ValueError(f"Invalid memory_save_mode: {memory_save_mode!r}; expected one "
                             f"of {MEMORY_SAVE_MODES}")
        sizes = []
        for int_name, value, low in (("max_size_triangular", max_size_triangular, 1),
                                     ("min_ndim_triangular", min_ndim_triangular, 0)):
            number = _number(value)
            if not (isinstance(number, int) and number >= low):
                raise ValueError(f"Invalid {int_name}: {value!r}; expected an int >= {low}")
            sizes.append(number)
        max_size_triangular, min_ndim_triangular = sizes
        seed_number = _number(seed)
        if not (isinstance(seed_number, int) and _SEED_RANGE[0] <= seed_number <= _SEED_RANGE[1]):
            raise ValueError(f"Invalid seed: {seed!r}; expected an int in [-2**63, 2**64 - 1] "
                             "(torch.manual_seed's range)")
        momentum_into_precond_update, merge_dims, use_ema = (
            _check_bool(flag_name, flag) for flag_name, flag in (
                ("momentum_into_precond_update", momentum_into_precond_update), ("merge_dims", merge_dims),
                ("use_ema", use_ema)))
        probability = _check_probability(preconditioner_update_probability)
        # Keras's own arguments, which its base class passes through unchecked: a loss scale of 0
        # skipped every step and a negative one ascended; 2.5 accumulation steps were taken as
        # they came (use_ema is checked with the other flags above)
        loss_scale_factor = _check_positive("loss_scale_factor", loss_scale_factor, allow_none=True)
        ema_number = _number(ema_momentum)
        if ema_number is None or not 0.0 <= ema_number <= 1.0:
            raise ValueError(f"Invalid ema_momentum: {ema_momentum!r}; expected a float in [0, 1]")
        ema_momentum = float(ema_number)
        optional_counts: tuple[tuple[str, Any, int], ...] = (
            ("ema_overwrite_frequency", ema_overwrite_frequency, 1),
            ("gradient_accumulation_steps", gradient_accumulation_steps, 2))
        for count_name, given, least in optional_counts:
            count = None if given is None else _number(given)
            if given is not None and not (isinstance(count, int) and count >= least):
                raise ValueError(f"Invalid {count_name}: {given!r}; expected None or an int >= {least}")
        overwrite_every, accumulation = (None if v is None else int(v)
                                         for v in (ema_overwrite_frequency, gradient_accumulation_steps))

        super().__init__(learning_rate=learning_rate, weight_decay=float(wd),
                         clipnorm=clipnorm, clipvalue=clipvalue,
                         global_clipnorm=global_clipnorm, use_ema=use_ema,
                         ema_momentum=ema_momentum,
                         ema_overwrite_frequency=overwrite_every,
                         loss_scale_factor=loss_scale_factor,
                         gradient_accumulation_steps=accumulation,
                         name=name, **kwargs)
        self.b1 = float(b1_number)
        self.preconditioner_update_probability = probability
        self.max_size_triangular = max_size_triangular
        self.min_ndim_triangular = min_ndim_triangular
        self.memory_save_mode = memory_save_mode
        self.momentum_into_precond_update = momentum_into_precond_update
        self.precond_lr = precond_lr_number
        self.precond_init_scale = precond_init_scale
        self.mu_dtype = mu_dtype
        self.precond_dtype = precond_dtype
        self.merge_dims = merge_dims
        self.seed = seed_number

    # -- state ----------------------------------------------------------------------
    def build(self, var_list):
        """Create the per-variable state (momentum, step count, factors, counters) and the
        shared schedule counters, all as optimizer variables."""
        if self.built:
            return
        _refuse_tf_distribution()
        super().build(var_list)
        slots = []
        for index, var in enumerate(var_list):
            slots.append(self._make_slot(index, var))
        self._slots = slots
        self._update_acc = self.add_variable((), initializer="zeros", dtype="int32",
                                             name="precond_update_acc")
        self._q_update_count = self.add_variable((), initializer="zeros", dtype="int32",
                                                 name="precond_update_count")

    def _make_slot(self, index: int, var) -> _Slot:
        shape = tuple(int(n) for n in var.shape)
        if math.prod(shape) == 0:  # no elements: nothing to update, no state (as in torch)
            return _Slot(index, var, shape, [], None, None, [], None, None)
        work = shape or (1,)
        if self.merge_dims and len(work) > 2:
            work = most_square_split(work)
        work = tuple(int(n) for n in work)
        diagonal = factor_is_diagonal(
            work, max_size_triangular=self.max_size_triangular,
            min_ndim_triangular=self.min_ndim_triangular,
            memory_save_mode=self.memory_save_mode)
        prefix = str(getattr(var, "path", var.name)).replace("/", "_").replace(":", "_")
        per_factor = (self.precond_init_scale or 1.0) ** (1.0 / len(work))
        momentum = self.add_variable(shape, initializer="zeros",
                                     dtype=self.mu_dtype or var.dtype,
                                     name=f"{prefix}_momentum")
        step = self.add_variable((), initializer="zeros", dtype="float32",
                                 name=f"{prefix}_step")
        qs = []
        for i, (n, diag) in enumerate(zip(work, diagonal)):
            if diag:
                qs.append(self.add_variable(
                    (n,), initializer=keras.initializers.Constant(per_factor),
                    dtype=self.precond_dtype, name=f"{prefix}_q{i}"))
            else:
                qs.append(self.add_variable(
                    (n, n), initializer=keras.initializers.Identity(gain=per_factor),
                    dtype=self.precond_dtype, name=f"{prefix}_q{i}"))
        initialized = None
        if self.precond_init_scale is None:
            initialized = self.add_variable((), initializer="zeros", dtype="int32",
                                            name=f"{prefix}_q_initialized")
        nonfinite = self.add_variable((), initializer="zeros", dtype="int32",
                                      name=f"{prefix}_nonfinite_steps")
        return _Slot(index, var, work, diagonal, momentum, step, qs, initialized, nonfinite)

    @property
    def preconditioner_updates(self) -> int:
        """Number of optimizer steps so far that updated the preconditioners (eager read)."""
        return int(ops.convert_to_numpy(self._q_update_count))

    def nonfinite_steps(self) -> dict[str, int]:
        """Per model variable path: steps skipped because its gradient was not finite, or
        whose variable update was skipped because its preconditioned update was not (eager
        read; the torch optimizer's warning has no in-graph equivalent). Variables with no
        elements have no entry; an all-zero gradient is not counted (it is no gradient)."""
        return {slot.path: int(ops.convert_to_numpy(slot.nonfinite))
                for slot in self._slots if not slot.empty}

    # -- Keras hooks replaced by the step below ---------------------------------------
    def _clip_gradients(self, grads):
        # Clipping happens in _backend_update_step, after the finiteness test of the raw
        # gradient and with non-finite tensors left out of the global norm.
        return grads

    def _apply_weight_decay(self, variables):
        # Decoupled weight decay on variables of >= 2 dims only, masked for skipped steps.
        return

    def update_step(self, gradient, variable, learning_rate):
        raise NotImplementedError("Kron updates all variables together; use apply()")

    # -- the step -------------------------------------------------------------------
    def _update_units(self, step):
        """This step's update probability in fixed-point units (int32 tensor or int)."""
        p = self.preconditioner_update_probability
        if not callable(p):
            return int(round(p * _UNIT))
        value = ops.cast(p(step), "float32")
        value = ops.where(ops.isfinite(value), ops.clip(value, 0.0, 1.0), 0.0)
        return ops.cast(ops.round(value * float(_UNIT)), "int32")

    def _decide_update(self, step):
        """Advance the update schedule by one step (``acc += p(step)``; update when
        ``acc ≥ 1``, then ``acc -= 1``), in-graph. Returns 0-dim bool tensors: update the
        preconditioners on this step; rebalance the factors before that update (the
        1st, 101st, 201st, ... update, as the torch ``PSGDTensor`` does)."""
        acc = ops.add(self._update_acc, self._update_units(step))
        do_update = ops.greater_equal(acc, _UNIT - _TOLERANCE)
        self.assign(self._update_acc,
                    ops.where(do_update, ops.maximum(acc - _UNIT, 0), acc))
        q_count = ops.add(self._q_update_count, ops.cast(do_update, "int32"))
        self.assign(self._q_update_count, q_count)
        balance = ops.logical_and(do_update,
                                  ops.equal((q_count - 1) % _BALANCE_EVERY, 0))
        return do_update, balance

    def _probe(self, slot: _Slot, step, dtype: str):
        """Probe vector ``V ~ N(0, I)`` of the slot's work shape for optimizer step
        ``step`` (1-based, the step being taken), from a stateless seed."""
        seed = ops.cast(ops.stack([
            ops.convert_to_tensor(probe_seed(self.seed, slot.index) & 0x7FFFFFFF, "int32"),
            ops.cast(step, "int32")]), _seed_dtype())
        return keras.random.normal(slot.work_shape, dtype=dtype, seed=_StatelessSeed(seed))

    def _clip(self, grads, finite):
        if self.clipvalue is not None:
            return [ops.clip(g, -self.clipvalue, self.clipvalue) for g in grads]
        if self.clipnorm is not None:
            out = []
            for g in grads:
                norm = ops.sqrt(ops.sum(ops.square(ops.cast(g, "float32"))))
                out.append(g * ops.cast(self.clipnorm / ops.maximum(norm, self.clipnorm),
                                        g.dtype))
            return out
        if self.global_clipnorm is not None:
            sq = [ops.where(fin, ops.sum(ops.square(ops.cast(g, "float32"))), 0.0)
                  for g, fin in zip(grads, finite)]
            total = ops.sqrt(ops.sum(ops.stack(sq)))
            scale = self.global_clipnorm / ops.maximum(total, self.global_clipnorm)
            return [g * ops.cast(scale, g.dtype) for g in grads]
        return list(grads)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        _refuse_tf_distribution()
        pdtype = self.precond_dtype
        cdtype = _compute_dtype(pdtype)  # of the factor math: float32 for float16 factors
        step = ops.cast(self.iterations, "int32")  # optimizer steps before this one
        do_update, balance = self._decide_update(step)

        slots = [self._slots[self._get_variable_index(v)] for v in trainable_variables]
        kept = [i for i, slot in enumerate(slots) if not slot.empty]  # no elements: left alone
        if not kept:
            return
        slots = [slots[i] for i in kept]
        trainable_variables = [trainable_variables[i] for i in kept]
        grads = [ops.convert_to_tensor(grads[i]) for i in kept]
        finite = [ops.all(ops.isfinite(g)) for g in grads]
        # zero in every element counts as no gradient (JAX's gradient of a variable the loss
        # did not reach): the tensor is left exactly as it is, and not counted
        active = [ops.logical_and(fin, ops.any(ops.not_equal(g, 0))) for g, fin in zip(grads, finite)]
        grads = self._clip(grads, finite)

        work = []  # per tensor: (slot, var, finite, active, m, bias, qs, fit, lr_q, ready)
        for slot, var, g, fin, act in zip(slots, trainable_variables, grads, finite, active):
            g = ops.where(fin, g, ops.zeros_like(g))
            act_f = ops.cast(act, "float32")
            count = ops.add(slot.step, act_f)  # counts applied steps only
            self.assign(slot.step, count)
            mu = slot.momentum
            weight = ops.cast(act_f * (1.0 - self.b1), mu.dtype)
            m = ops.add(mu, weight * (ops.cast(g, mu.dtype) - mu))  # unchanged if skipped
            self.assign(mu, m)
            # in float32 (1/bias overflows float16); the fit divides by its pdtype rounding
            # 1 − b1^t as −expm1(t · log b1), log b1 in float64: accurate in float32 (pow there
            # rounds b1 first, and the subtraction magnifies it: 2e-4 at b1 = 0.9999)
            bias = ops.maximum(-ops.expm1(count * math.log(self.b1)) if self.b1 > 0.0
                               else ops.cast(ops.greater(count, 0.0), "float32"), 1e-30)

            qs = [ops.convert_to_tensor(q) for q in slot.qs]
            ready = None  # None: always initialised (precond_init_scale given)
            if slot.initialized is not None:
                qs, ready = self._initialize(slot, qs, g)
            if self.momentum_into_precond_update:
                fit = ops.cast(m, cdtype) / ops.cast(bias, cdtype)
            else:
                fit = ops.cast(g, cdtype)
            lr_q = ops.cast(act_f, cdtype) * self.precond_lr
            if ready is not None:
                lr_q = lr_q * ops.cast(ready, cdtype)
            fit = ops.reshape(fit, slot.work_shape)
            work.append((slot, var, fin, act, m, bias, qs, fit, lr_q, ready))

        def updated():
            out = []
            for slot, _, _, act, _, _, qs, fit, lr_q, ready in work:
                enabled = ops.logical_and(act, balance if ready is None else ops.logical_and(balance, ready))
                qs = psgd_ops.balance(qs, pdtype, enabled)  # in the factors' dtype, as torch does
                probe = ops.cast(self._probe(slot, step + 1, pdtype), cdtype)
                new = psgd_ops.q_update([ops.cast(q, cdtype) for q in qs], slot.diagonal,
                                        slot.work_shape, fit, probe, lr_q, cdtype)
                new = [ops.cast(q, pdtype) for q in new]
                # an idle tensor keeps its factors exactly; one rounded to float16 keeps them
                # where the rounding overflowed
                keep = act if cdtype == pdtype else ops.logical_and(act, psgd_ops.all_finite(new))
                out.append([ops.where(keep, q_new, q) for q, q_new in zip(qs, new)])
            return out

        def unchanged():
            return [list(item[6]) for item in work]

        new_qs = ops.cond(do_update, updated, unchanged)

        lr = ops.convert_to_tensor(learning_rate)
        for (slot, var, fin, act, m, bias, _, _, _, ready), qs in zip(work, new_qs):
            for q_var, q in zip(slot.qs, qs):
                self.assign(q_var, q)
            m_p = ops.reshape(ops.cast(m, cdtype), slot.work_shape)
            u = psgd_ops.precondition([ops.cast(q, cdtype) for q in qs], slot.diagonal, slot.form_p,
                                      slot.work_shape, m_p)
            if ready is not None:  # identity preconditioner until the scale is known
                u = ops.where(ready, u, m_p)
            # P m̂ = u / bias clipped to RMS ≤ 1.1 is u times min(1/bias, 1.1/rms(u)). The
            # norm, lr, weight decay and scale are computed in float32 or wider (the variable's
            # and the factors' dtypes promoted with float32): in bfloat16 1 − 1e-4 is 1, in
            # float16 2e-8 is 0 and a norm past 65 504 overflows.
            wide = keras.backend.result_type(var.dtype, pdtype, "float32")
            u_wide = ops.cast(u, wide)
            rms = ops.sqrt(ops.sum(u_wide * u_wide)) / math.sqrt(slot.numel)
            # a non-finite update (or norm) from a finite gradient, an overflow, is not
            # written: the variable is left as it was, and the step counted as non-finite
            stepped = ops.logical_and(act, ops.isfinite(rms))
            skipped = ops.logical_or(ops.logical_not(fin),
                                     ops.logical_and(act, ops.logical_not(stepped)))
            self.assign(slot.nonfinite, ops.add(slot.nonfinite, ops.cast(skipped, "int32")))
            u_wide = ops.where(stepped, u_wide, ops.zeros_like(u_wide))
            scale = ops.minimum(1.0 / ops.cast(bias, wide), _RMS_CLIP / (rms + 1e-12))
            lr_t = ops.cast(stepped, wide) * ops.cast(lr, wide)  # 0 skips this tensor
            p = ops.convert_to_tensor(var)
            if self.weight_decay and len(slot.shape) >= 2 and self._use_weight_decay(var):
                p = p * ops.cast(1.0 - lr_t * self.weight_decay, p.dtype)
            # skipped: p − 0, bitwise p (the scale may be NaN then)
            coefficient = ops.where(stepped, lr_t * scale, ops.zeros_like(lr_t))
            delta = ops.reshape(u_wide * coefficient, slot.shape)
            self.assign(var, p - ops.cast(delta, p.dtype))

    def _initialize(self, slot: _Slot, qs, g):
        """``precond_init_scale=None``: set the factors to ``s^(1/r)·I`` from the first
        finite non-zero gradient, in-graph; returns the factors and the 0-dim bool
        "initialised" flag."""
        was = ops.greater(slot.initialized, 0)
        s = psgd_ops.initial_scale(g)
        now = ops.logical_and(ops.logical_not(was),
                              ops.logical_and(ops.isfinite(s), ops.greater(s, 0.0)))
        per_factor = ops.power(ops.where(now, s, 1.0), 1.0 / len(qs))
        qs = [ops.where(now, psgd_ops.factor_init(n, d, per_factor, self.precond_dtype), q)
              for q, n, d in zip(qs, slot.work_shape, slot.diagonal)]
        ready = ops.logical_or(was, now)
        self.assign(slot.initialized, ops.cast(ready, "int32"))
        return qs, ready

    # -- config -----------------------------------------------------------------------
    def get_config(self):
        config = super().get_config()
        p = self.preconditioner_update_probability
        if callable(p):
            p = keras.saving.serialize_keras_object(p)
        config.update({
            "b1": self.b1,
            "preconditioner_update_probability": p,
            "max_size_triangular": self.max_size_triangular,
            "min_ndim_triangular": self.min_ndim_triangular,
            "memory_save_mode": self.memory_save_mode,
            "momentum_into_precond_update": self.momentum_into_precond_update,
            "precond_lr": self.precond_lr,
            "precond_init_scale": self.precond_init_scale,
            "mu_dtype": self.mu_dtype,
            "precond_dtype": self.precond_dtype,
            "merge_dims": self.merge_dims,
            "seed": self.seed,
        })
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        p = config.get("preconditioner_update_probability")
        if isinstance(p, dict):
            config["preconditioner_update_probability"] = keras.saving.deserialize_keras_object(
                p, custom_objects=custom_objects)
        return super().from_config(config, custom_objects=custom_objects)
