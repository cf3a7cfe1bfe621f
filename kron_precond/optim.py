"""``Kron``: the standalone PSGD Kron optimizer (a ``torch.optim.Optimizer``).

Per step, for every parameter with a gradient (the Q update's formula:
:mod:`kron_precond.methods.psgd`'s docstring):

1. clip the gradient (``clipvalue`` elementwise, ``clipnorm`` per tensor, or
   ``global_clipnorm`` over all tensors -- at most one of them, as in Keras);
2. momentum ``m = b1·m + (1 − b1)·g`` (in ``mu_dtype``), debiased ``m̂ = m / (1 − b1^t)``;
3. on preconditioner-update steps (one decision per optimizer step, shared by every
   parameter) one Q update with ``m̂`` (or ``g`` if not ``momentum_into_precond_update``);
4. ``u = P m̂`` clipped to RMS ≤ 1.1, plus ``weight_decay·p`` for tensors of ≥ 2 dims;
5. ``p −= lr·u``.

A tensor whose gradient is zero in every element counts as having no gradient (a parameter
the loss did not reach after ``zero_grad(set_to_none=False)``, an expert the router sent no
token): it skips 2–5, its weight decay included, and is not counted. A tensor whose gradient
is not finite skips 2–5 too, and so does the parameter update of one whose preconditioned
update ``P m̂`` is not finite (an overflow: the momentum and factors were updated); those
are counted per parameter and a warning names the parameter. A group setting held as a
0-dim tensor (``lr``, ``b1``, ...) that is not finite or breaks its rule leaves the group's
tensors exactly as they were too (Python numbers raise ``ValueError`` instead); those steps
are counted per setting and warned about. All of this is chosen with ``torch.where``-style
masks on the device, no host sync. The counters are read once every
``nonfinite_warn_interval`` steps, and the weights' norms on the first step and every
``health.WEIGHT_CHECK_EVERY`` (100) steps (a divergence check, :class:`~kron_precond.health.WeightGrowth`)
-- the only host syncs in :meth:`Kron.step` besides the one-time scale estimate of
``precond_init_scale=None``.

The factors are kept in ``precond_dtype``; their math runs in it too, except that float16
factors are computed in float32 (:func:`compute_dtype`): float16's range ends at 65 504,
which a momentum or a Gram matrix passes easily.
"""
from __future__ import annotations

import copy
import math
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch

from . import validation
from .autocast import autocast_disabled
from .checkpoint import run_load_pre_hooks, stepped_by_torchs_state_dict_api
from .compiled import step_eagerly
from .distributed.sharded import is_dtensor, refuse_fsdp1
from .health import WEIGHT_CHECK_EVERY, WeightGrowth, new_nonfinite_steps
from .methods import state_checks as checks
from .methods.psgd import PSGDFactors, check_memory_save_mode, check_update_rule
from .methods.psgd_tensor import RMS_CLIP, PSGDTensor
from .schedules import UpdateDecider, check_probability

_FLOAT32_MAX = torch.finfo(torch.float32).max


def compute_dtype(precond_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the preconditioning math for factors kept in ``precond_dtype``: float32
    for float16 factors (whose range ends at 65 504: ``P m̂`` of a momentum past it, or the
    Gram matrices of the Q update, would overflow), else ``precond_dtype`` itself (bfloat16
    has float32's range)."""
    return torch.float32 if precond_dtype == torch.float16 else precond_dtype


def _wide_dtype(p: torch.Tensor, group: dict[str, Any]) -> torch.dtype:
    """The dtype of a step's scalars (lr, weight decay, bias correction, update scale, RMS
    norm): the parameter's and the factors' dtypes promoted with float32."""
    return torch.promote_types(torch.promote_types(p.dtype, group["precond_dtype"]), torch.float32)


def _check_positive(name: str, value: Any, *, allow_none: bool = False,
                    maximum: float | None = None, what: str = "") -> float | None:
    """``value`` as a positive finite Python float (or ``None`` when allowed)."""
    if value is None and allow_none:
        return None
    number = validation.check_positive(name, value)
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be at most {maximum:.3g}{what}, got {value!r}")
    return number


# The dtypes momentum and factors may be kept in: float8 has no matmul or linalg to run the math in
STATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_group(group: dict[str, Any], global_clipnorm: float | None, *, scheduled: bool = False) -> dict[str, Any]:
    """Validate one parameter group's hyperparameters (``ValueError`` naming the argument);
    return the numeric ones as plain Python numbers. ``scheduled``: a group a scheduler has
    run (a checkpoint's), whose lr may have reached 0."""
    out: dict[str, Any] = {}
    for name in ("mu_dtype", "precond_dtype"):
        dtype = group[name]
        if dtype not in STATE_DTYPES and not (name == "mu_dtype" and dtype is None):
            raise ValueError(f"Invalid {name}: {dtype!r}; expected one of torch.float16, torch.bfloat16, "
                             f"torch.float32, torch.float64")
    out["lr"] = (validation.check_non_negative("lr", group["lr"]) if scheduled
                 else _check_positive("lr", group["lr"]))
    out["precond_lr"] = _check_positive("precond_lr", group["precond_lr"])
    # P = s²·I must be representable in the factors' dtype.
    scale_max = math.sqrt(torch.finfo(group["precond_dtype"]).max)
    out["precond_init_scale"] = _check_positive(
        "precond_init_scale", group["precond_init_scale"], allow_none=True, maximum=scale_max,
        what=f" (its square, the initial preconditioner, must be finite in {group['precond_dtype']})")
    # Norms are taken in float32: larger clip values overflow there and zero the update.
    for name in ("clipnorm", "clipvalue"):
        out[name] = _check_positive(name, group[name], allow_none=True, maximum=_FLOAT32_MAX,
                                    what=" (clipping is computed in float32)")
    out["weight_decay"] = validation.check_non_negative("weight_decay", group["weight_decay"])
    out["b1"] = validation.check_unit_interval("b1", group["b1"], low_open=False, high_open=True)
    check_memory_save_mode(group["memory_save_mode"])
    check_update_rule(group.get("precond_update", "eq"))
    for name in ("momentum_into_precond_update", "merge_dims"):  # bool("no") would be True
        validation.check_bool(name, group[name])
    for name in ("max_size_triangular", "min_ndim_triangular"):
        out[name] = validation.check_int(name, group[name], minimum=0)
    clips = [n for n in ("clipnorm", "clipvalue") if group[n] is not None]
    if global_clipnorm is not None:
        clips.append("global_clipnorm")
    if len(clips) > 1:
        raise ValueError(f"Only one of clipnorm, clipvalue and global_clipnorm may be set; "
                         f"got {clips}")
    return out


# The group settings that fix the shapes and dtypes of a parameter's state when it is made:
# the step cannot follow a change of them, so a change is refused (see Kron._check_structure).
STRUCTURE_KEYS = ("precond_dtype", "mu_dtype", "merge_dims", "max_size_triangular",
                  "min_ndim_triangular", "memory_save_mode", "precond_update")


def _structure(group: dict[str, Any], p: torch.Tensor) -> tuple[Any, ...]:
    """The values of :data:`STRUCTURE_KEYS` for ``p`` in ``group``, resolved (``mu_dtype=None``:
    the parameter's dtype), so that a setting spelled another way with the same effect passes."""
    values = {key: group.get(key, "eq" if key == "precond_update" else None) for key in STRUCTURE_KEYS}
    values["mu_dtype"] = values["mu_dtype"] or p.dtype
    return tuple(values[key] for key in STRUCTURE_KEYS)


# A param group's settings, checked before every step (a scheduler or a user may set any value).
# The tests are written with ``&`` so that they also run on a 0-dim tensor, on its device
# (see _tensor_settings_valid); a clip value of None is no clipping (not checked).
_CLIP_RULE = f"> 0 and at most {_FLOAT32_MAX:.3g} (clipping is computed in float32)"
STEP_RULES: tuple[validation.GroupRule, ...] = (
    ("lr", ">= 0", lambda v: v >= 0), ("precond_lr", "> 0", lambda v: v > 0),
    ("weight_decay", ">= 0", lambda v: v >= 0), ("b1", "in [0, 1)", lambda v: (v >= 0) & (v < 1)),
    ("clipnorm", _CLIP_RULE, lambda v: (v > 0) & (v <= _FLOAT32_MAX)),
    ("clipvalue", _CLIP_RULE, lambda v: (v > 0) & (v <= _FLOAT32_MAX)))
_STEP_NUMBERS = tuple(key for key, _, _ in STEP_RULES)


def _check_one_clip(index: int, group: dict[str, Any], global_clipnorm: float | None) -> None:
    """``ValueError`` when a group set later holds more than one of the clip settings."""
    clips = [name for name in ("clipnorm", "clipvalue") if group.get(name) is not None]
    if global_clipnorm is not None:
        clips.append("global_clipnorm")
    if len(clips) > 1:
        raise ValueError(f"Kron: param group {index} sets {clips}; only one of clipnorm, clipvalue and "
                         "global_clipnorm may be set")


def _tensor_settings(index: int, group: dict[str, Any]) -> tuple[str, ...]:
    """The settings of :data:`STEP_RULES` that ``group`` holds as tensors; ``ValueError`` for one
    that is not a single floating-point number (read from its metadata: no host sync)."""
    keys = []
    for key in _STEP_NUMBERS:
        value = group.get(key)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or not value.is_floating_point():
                raise ValueError(f"Kron: param group {index} has {key} as a tensor of shape {tuple(value.shape)} "
                                 f"and dtype {value.dtype}; a setting held as a tensor must be one floating-point "
                                 "number")
            keys.append(key)
    return tuple(keys)


def _times(flag: torch.Tensor, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """``flag · value`` in ``dtype``: 0 where ``flag`` is False. A setting held as a tensor is
    masked as well (an unusable one may be NaN, and NaN · 0 is NaN); a number needs no mask."""
    product = flag.to(dtype) * value
    if isinstance(value, torch.Tensor):
        product = torch.where(flag, product, 0.0).to(dtype)
    return product


def _local_settings(group: dict[str, Any], keys: tuple[str, ...], device: torch.device,
                    dtype: torch.dtype) -> dict[str, Any]:
    """The numbers of :data:`STEP_RULES` for one parameter: a Python number as it is, one held
    as a tensor (``keys``) as a 0-dim ``dtype`` tensor on ``device``, copied there by a kernel
    (a CPU value is read as a scalar operand: no host-device sync)."""
    values: dict[str, Any] = {key: group.get(key) for key in _STEP_NUMBERS}
    for key in keys:
        values[key] = torch.zeros((), dtype=dtype, device=device).add_(group[key].reshape(()))
    return values


# A traced step would reuse the code traced for one parameter for the others of its shape, whose
# states its Python lookups would then cross: the step runs eagerly inside compiled functions.
_EAGER_REASON = ("Kron's step runs eagerly: its per-parameter state is read by Python lookups that a traced "
                 "step would share between parameters of one shape")


class Kron(torch.optim.Optimizer):
    """PSGD Kron (Xi-Lin Li): momentum preconditioned by a learned Kronecker-factored
    whitening preconditioner ``P = ⊗_i Q_iᵀQ_i`` per parameter tensor.

    Args:
        params: parameters or parameter groups. Every argument below except
            ``preconditioner_update_probability``, ``global_clipnorm`` and ``seed`` can be
            set per group (and an LR scheduler may write ``group['lr']``); those that fix
            the state's shapes and dtypes (:data:`STRUCTURE_KEYS`) cannot change once a
            parameter has state (``ValueError`` at the next step).
        lr: learning rate (> 0).
        b1: momentum coefficient in [0, 1).
        weight_decay: decoupled weight decay (≥ 0), applied to tensors with ≥ 2 dims.
        preconditioner_update_probability: probability of a Q update per step: a float in
            [0, 1], a callable of the number of steps so far, or ``None`` for
            :func:`~kron_precond.schedules.precond_update_prob_schedule` (1 → 0.03).
            Decided deterministically (:class:`~kron_precond.schedules.UpdateDecider`).
        max_size_triangular: dims larger than this get a diagonal factor.
        min_ndim_triangular: tensors with fewer dims get diagonal factors only.
        memory_save_mode: ``None``, ``'smart_one_diag'``, ``'one_diag'`` or ``'all_diag'``.
        momentum_into_precond_update: fit Q to the debiased momentum (else the gradient).
        precond_lr: step size of the Q updates (> 0).
        precond_init_scale: initial ``P = s²·I``; ``None`` estimates ``s`` from the first
            finite gradient (one host sync per parameter, once).
        mu_dtype: dtype of the momentum (default: the parameter's).
        precond_dtype: dtype of the factors and of the preconditioning math (float16
            factors are computed in float32, see :func:`compute_dtype`); the learning
            rate, weight decay, update scale and RMS norm are computed in float32 or wider.
        clipnorm, clipvalue, global_clipnorm: Keras-style gradient clipping (at most one).
        merge_dims: view tensors of rank > 2 as their most square 2-D matrix.
        precond_update: how Q is fitted: ``'eq'`` (default; triangular factors, the update
            in :mod:`kron_precond.methods.psgd`'s docstring) or ``'procrustes'`` (dense
            near-SPD factors, Xi-Lin Li's matmul-only ``Q0.5EQ1.5`` rule; see
            :class:`~kron_precond.methods.psgd.PSGDFactors`).
        seed: seeds the probe vectors, drawn from ``(seed, parameter index, step)``.
    """

    nonfinite_warn_interval = 100

    def __init__(self, params: Iterable, lr: float = 3e-4, b1: float = 0.9,
                 weight_decay: float = 0.0,
                 preconditioner_update_probability: float | Callable[[int], float] | None = None,
                 max_size_triangular: int = 8192, min_ndim_triangular: int = 2,
                 memory_save_mode: str | None = None, momentum_into_precond_update: bool = True,
                 precond_lr: float = 0.1, precond_init_scale: float | None = 1.0,
                 mu_dtype: torch.dtype | None = None, precond_dtype: torch.dtype = torch.float32,
                 clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, merge_dims: bool = False, seed: int = 0,
                 precond_update: str = "eq"):
        if not callable(preconditioner_update_probability) and (
                preconditioner_update_probability is not None):
            preconditioner_update_probability = check_probability(validation.check_finite(
                "preconditioner_update_probability", preconditioner_update_probability))
        self.global_clipnorm = _check_positive("global_clipnorm", global_clipnorm, allow_none=True,
                                               maximum=_FLOAT32_MAX, what=" (clipping is computed in float32)")
        self.seed = validation.check_int("seed", seed, minimum=-(2**63))
        if self.seed > 2**64 - 1:  # torch.manual_seed's range; the probe seeds use it modulo 2**64
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1] (torch.manual_seed's range), "
                             f"got {seed!r}")
        self._decider = UpdateDecider(preconditioner_update_probability)
        self._q_updates = 0
        # the schedule's counters (step, accumulator, Q updates), in every parameter's live entry
        # (see _mark_schedule); on the CPU: kept current by host writes, no device work
        self._schedule = torch.zeros(3, dtype=torch.float64)
        self._reported: dict[int, int] = {}
        self._weight_growth = WeightGrowth("Kron")  # see step
        self._tensors: dict[torch.Tensor, PSGDTensor] = {}
        # per parameter, the state entries its PSGDTensor was built on (see _tensor_of)
        self._bound: dict[torch.Tensor, tuple[Any, ...]] = {}
        # per parameter with state, the group settings its state was made or loaded under
        self._made_with: dict[torch.Tensor, tuple[Any, ...]] = {}
        # per (param group, setting) held as a tensor: steps on which its value was unusable,
        # on the setting's device; read with the non-finite counters
        self._bad_settings: dict[tuple[int, str], torch.Tensor] = {}
        defaults = dict(lr=lr, b1=b1, weight_decay=weight_decay,
                        max_size_triangular=max_size_triangular,
                        min_ndim_triangular=min_ndim_triangular,
                        memory_save_mode=memory_save_mode,
                        momentum_into_precond_update=momentum_into_precond_update,
                        precond_lr=precond_lr, precond_init_scale=precond_init_scale,
                        mu_dtype=mu_dtype, precond_dtype=precond_dtype, clipnorm=clipnorm,
                        clipvalue=clipvalue, merge_dims=merge_dims, precond_update=precond_update)
        defaults.update(_check_group(defaults, self.global_clipnorm))
        step_eagerly(Kron, _EAGER_REASON)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (validated like the constructor's arguments)."""
        params = param_group["params"]
        if isinstance(params, set):  # as torch.optim: a set's order changes between runs
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the "
                            "ordering of tensors in sets will change between runs. Please use a list instead.")
        params = [params] if isinstance(params, torch.Tensor) else list(params)  # a generator: read once
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]  # (name, parameter) pairs too
        complex_ = [tuple(t.shape) for t in tensors if t.is_complex()]
        if complex_:  # its step would train the real part alone
            raise TypeError(f"Kron does not support complex parameters; got complex parameters of shapes {complex_}")
        refuse_fsdp1(((p[0] if isinstance(p, tuple) else f"params[{i}] of shape {tuple(t.shape)}", t)
                      for i, (p, t) in enumerate(zip(params, tensors))), "Kron",
                     "Use KronPreconditioner(model, method=\"psgd\") in front of a torch optimizer, on a model "
                     "sharded with torch.distributed.fsdp.fully_shard (FSDP2)")
        sharded = [p[0] if isinstance(p, tuple) else f"params[{i}] of shape {tuple(t.shape)}"
                   for i, (p, t) in enumerate(zip(params, tensors)) if is_dtensor(t)]
        if sharded:  # a rank holds a shard: the factors of the whole tensor cannot be fitted to it
            listed = ", ".join(map(str, sharded[:4])) + (", ..." if len(sharded) > 4 else "")
            raise TypeError(f"Kron does not support DTensor parameters (FSDP2, HSDP, tensor parallel): got {listed}. "
                            "Use KronPreconditioner(model, method=\"psgd\") in front of a torch optimizer, which "
                            "takes FSDP2 / HSDP models, or WhitenedMuon(model)")
        param_group = {**param_group, "params": params}
        numbers = _check_group({**self.defaults, **param_group}, self.global_clipnorm)
        param_group = dict(param_group)
        for name, value in numbers.items():
            if name in param_group:
                param_group[name] = value
        super().add_param_group(param_group)

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim keeps only defaults, state and param_groups, so a copy (deepcopy, pickle)
        # would lack the update schedule and the per-tensor preconditioners and fail at its next
        # step; the whole object is copied instead (the tensors keep their sharing in the memo).
        # Left out, as torch.optim leaves them: what an LR scheduler puts on this object -- a
        # ``step`` wrapping this object's (any instance attribute shadowing a method is bound to
        # the object it was made for) and ``_opt_called`` --, so the copy steps its own parameters
        # and a scheduler attached to the copy wraps the copy's step.
        cls = type(self)
        return {key: value for key, value in self.__dict__.items()
                if key != "_opt_called" and not callable(getattr(cls, key, None))}

    def __setstate__(self, state: dict[str, Any]) -> None:
        step_eagerly(Kron, _EAGER_REASON)  # unpickled in a process that has built no Kron
        super().__setstate__(state)
        # an optimizer pickled by a version without it: its per-parameter tensors are rebuilt
        self.__dict__.setdefault("_bound", {})
        self.__dict__.setdefault("_made_with", {})
        self.__dict__.setdefault("_bad_settings", {})
        if "_schedule" not in self.__dict__:  # and before the counters rode in the live entries
            self._schedule = torch.zeros(3, dtype=torch.float64)
            for entry in self.state.values():
                if entry:  # an empty one is a parameter without state yet
                    entry[SCHEDULE_KEY] = self._schedule
            self._mark_schedule()

    @property
    def steps(self) -> int:
        """Number of completed :meth:`step` calls (a call with no gradient at all is none)."""
        return self._decider.step

    @property
    def update_decider(self) -> UpdateDecider:
        """The shared preconditioner-update schedule (its counters are in :meth:`state_dict`)."""
        return self._decider

    # -- per-parameter state ---------------------------------------------------------
    def _make_tensor(self, p: torch.Tensor, index: int, group: dict[str, Any], init_scale) -> PSGDTensor:
        return PSGDTensor(
            p.shape, device=p.device, seed=self.seed, key=(index,), momentum=True, b1=group["b1"],
            momentum_dtype=group["mu_dtype"] or p.dtype,
            max_size_triangular=group["max_size_triangular"],
            min_ndim_triangular=group["min_ndim_triangular"],
            memory_save_mode=group["memory_save_mode"], init_scale=init_scale,
            dtype=group["precond_dtype"], merge_dims=group["merge_dims"],
            update_rule=group.get("precond_update", "eq"),  # groups saved before the option
            compute_dtype=compute_dtype(group["precond_dtype"]))

    def _init_state(self, p: torch.Tensor, index: int, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        tensor = self._make_tensor(p, index, group, group["precond_init_scale"])
        self._tensors[p] = tensor
        # torch.optim's state holds the very tensors the per-tensor state updates in place
        state["step"] = tensor.steps
        state["momentum_buffer"] = tensor.momentum
        state["Q"] = tensor.factors.q
        state["q_initialized"] = tensor.factors.initialized
        if tensor.factors.lipschitz:  # the Procrustes-style fit's running estimates (updated in place)
            state["lipschitz"] = tensor.factors.lipschitz
        state["nonfinite_steps"] = torch.zeros((), dtype=torch.int32, device=p.device)
        state["uses_per_update"] = 1.0  # decides whether Q_iᵀQ_i is formed (saved: bitwise resume)
        state[SCHEDULE_KEY] = self._schedule
        self._bound[p] = self._state_entries(state)
        self._made_with[p] = _structure(group, p)
        return state

    @staticmethod
    def _state_entries(state: dict[str, Any]) -> tuple[Any, ...]:
        """The objects in ``state`` that the step reads and writes in place."""
        lipschitz = state.get("lipschitz")
        return (state["momentum_buffer"], state["step"], state["Q"], *state["Q"], lipschitz, *(lipschitz or ()))

    def _tensor_of(self, p: torch.Tensor, index: int, group: dict[str, Any], state) -> PSGDTensor:
        """The PSGDTensor working on ``state``'s tensors. Rebuilt from ``state`` whenever an
        entry is no longer the object it was built on (after ``load_state_dict``, or after
        ``state[key] = value.to(device)``), so the step always uses what ``opt.state``
        holds; the check compares identities only (no host sync)."""
        tensor = self._tensors.get(p)
        bound = self._bound.get(p)
        entries = self._state_entries(state)
        if tensor is None or bound is None or len(bound) != len(entries) or any(
                a is not b for a, b in zip(bound, entries)):
            # entries written in without Kron's load (ZeroRedundancyOptimizer's load_state_dict):
            # the factors as a checkpoint holds them (by position), the 0-dim counters ZeRO puts
            # on the CPU back on the parameter's device
            for key in ("Q", "lipschitz"):
                if isinstance(state.get(key), dict):
                    state[key] = _positional(state[key], f"Kron: state of parameter {index}: {key}")
            for key, value in list(state.items()):  # a 0-dim parameter's momentum is 0-dim too
                if (key != SCHEDULE_KEY and isinstance(value, torch.Tensor) and value.dim() == 0
                        and value.device != p.device):
                    state[key] = value.to(p.device)
            tensor = self._make_tensor(p, index, group, 1.0)
            tensor.factors.load_state_dict({"q": state["Q"], "initialized": state["q_initialized"],
                                            "lipschitz": state.get("lipschitz", ())})
            state["Q"] = tensor.factors.q
            if tensor.factors.lipschitz:
                state["lipschitz"] = tensor.factors.lipschitz
            tensor.momentum = state["momentum_buffer"]
            tensor.steps = state["step"]
            tensor.uses_per_update = state.get("uses_per_update", 1.0)
            self._tensors[p] = tensor
            self._bound[p] = self._state_entries(state)
        return tensor

    # -- the step --------------------------------------------------------------------
    @staticmethod
    def _clip_local(grad: torch.Tensor, values: dict[str, Any]) -> torch.Tensor:
        clipvalue, clipnorm = values["clipvalue"], values["clipnorm"]
        if clipvalue is not None:
            return grad.clamp(-clipvalue, clipvalue)
        if clipnorm is not None:
            norm = torch.linalg.vector_norm(grad.float())
            return grad * (clipnorm / norm.clamp_min(clipnorm)).to(grad.dtype)
        return grad

    def _tensor_settings_valid(self, index: int, group: dict[str, Any], keys: tuple[str, ...]) -> torch.Tensor | None:
        """For the settings of ``group`` held as tensors (``keys``), a 0-dim bool tensor: every
        one is finite in float32 and within its rule of :data:`STEP_RULES`, computed where the
        tensors live (no host sync); the steps on which one is not are counted per setting,
        and reported with the non-finite gradients. ``None`` when there are none (the Python
        numbers were checked by ``check_group_numbers``)."""
        valid = None
        for key, _, ok in STEP_RULES:
            if key not in keys:
                continue
            value = group[key].reshape(())
            flag = torch.isfinite(value) & (value.abs() <= _FLOAT32_MAX) & ok(value)
            counter = self._bad_settings.get((index, key))
            if counter is None or counter.device != flag.device:
                counter = self._bad_settings[(index, key)] = torch.zeros((), dtype=torch.int32, device=flag.device)
            counter.add_((~flag).to(torch.int32))
            valid = flag if valid is None else valid & flag
        return valid

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        """One optimization step. ``closure``, if given, re-evaluates the model and returns the
        loss, which ``step`` returns. Under ``torch.compile`` it runs eagerly (a graph break)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with autocast_disabled():  # called inside an autocast region: the preconditioner's matmuls stay full precision
            if not self.state and stepped_by_torchs_state_dict_api():
                # torch's call that only creates the state entries: its schedule draw is not a step
                decider, q_updates = copy.deepcopy(self._decider), self._q_updates
                self._step()
                self._decider, self._q_updates = decider, q_updates
            else:
                self._step()
            self._mark_schedule()
        return loss

    def _mark_schedule(self) -> None:
        """Write the schedule's counters into the tensor each parameter's live entry holds under
        ``SCHEDULE_KEY``. A flattened checkpoint (torch.distributed.checkpoint's
        ``flatten_optimizer_state_dict``, torchtitan's) rebuilds a saved entry from the keys of
        the live one, so the key must be there for the counters to come back."""
        counters = self._decider.state_dict()
        self._schedule.copy_(torch.tensor([counters["step"], counters["acc"], self._q_updates], dtype=torch.float64))

    def _adopt_written_schedule(self) -> None:
        """Entries written into the state without :meth:`load_state_dict` hold other counters
        than this optimizer's own tensor, or none. ``ZeroRedundancyOptimizer``'s load writes a
        checkpoint's entries (the factors by position) in for every parameter of the partition:
        when every entry is such a write, their counters are the saved schedule, loaded here as
        a load reads them (the largest step where they differ: a partition that had no gradient
        on a step did not count it), with one host read on the first step after the write only.
        An entry put back by hand among others resets its parameter alone: the schedule stays
        this optimizer's. Either way every entry then holds this optimizer's counters."""
        # an empty entry (torch.optim's state is a defaultdict: reading opt.state[p] makes one) is a
        # parameter without state yet: left empty, its first step makes it
        entries = [entry for entry in self.state.values() if entry]
        foreign = [entry for entry in entries if entry.get(SCHEDULE_KEY) is not self._schedule]
        if not foreign:
            return
        counters = [entry.get(SCHEDULE_KEY) for entry in foreign]
        if len(foreign) == len(entries) and all(
                isinstance(entry.get("Q"), dict) and isinstance(c, torch.Tensor) and c.shape == (3,)
                and c.is_floating_point() for entry, c in zip(foreign, counters)):
            read = torch.stack([c.to(counters[0].device) for c in counters]).cpu()  # one host read
            # not raised on: each rank reads its own partition's entries, and a raise on one rank
            # would leave the others waiting in ZeRO's broadcast
            usable = [row for row in read.tolist() if all(math.isfinite(v) for v in row)
                      and row[0] == int(row[0]) and row[2] == int(row[2]) and row[0] >= 0 and row[2] >= 0
                      and 0 <= row[1] < 1]
            if usable:
                step, acc, q_updates = max(usable, key=lambda row: row[0])
                self._decider.load_state_dict({"step": int(step), "acc": acc}, "kron.decider")
                self._q_updates = int(q_updates)
            else:
                warnings.warn(f"Kron: the '{SCHEDULE_KEY}' counters written into the state (not through "
                              f"load_state_dict) are not a schedule's ({read.tolist()}): this optimizer's own "
                              f"schedule goes on", RuntimeWarning, stacklevel=4)
        for entry in foreign:
            entry[SCHEDULE_KEY] = self._schedule
        self._mark_schedule()

    def _step(self) -> None:
        self._adopt_written_schedule()
        tensor_keys = []
        for index, group in enumerate(self.param_groups):  # before anything moves
            validation.check_group_numbers("Kron", index, group, STEP_RULES, optional=("clipnorm", "clipvalue"))
            _check_one_clip(index, group, self.global_clipnorm)
            tensor_keys.append(_tensor_settings(index, group))
            if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
                raise RuntimeError("Kron does not support sparse gradients")
            self._check_structure(index, group)
        # settings held as tensors cannot be read without a host sync: checked on their device,
        # an unusable one leaves the group's parameters as they are (a mask, as a NaN gradient)
        if all(p.grad is None for group in self.param_groups for p in group["params"]):
            return  # no gradient at all (a trainer's skipped batch): no step, as for torch.optim's
        valid = [self._tensor_settings_valid(index, group, keys) if keys else None
                 for index, (group, keys) in enumerate(zip(self.param_groups, tensor_keys))]
        if self._decider.step % WEIGHT_CHECK_EVERY == 0:  # before the step: the first check reads the initial weights
            self._weight_growth.check([(f"parameter {i} (shape {tuple(p.shape)})", p)
                                       for i, p in enumerate(p for g in self.param_groups for p in g["params"])])
        probability = self._decider.current_probability()
        do_update = self._decider()
        if do_update:
            self._q_updates += 1

        # per parameter: (index, param, group, its settings, clipped grad, raw grad finite,
        # clipped grad finite too, active: that, not all zero and the group's settings usable)
        work = []
        index = -1
        for group_index, group in enumerate(self.param_groups):
            for p in group["params"]:
                index += 1
                if p.grad is None or p.numel() == 0:  # a zero-element tensor: nothing to update
                    continue
                values = _local_settings(group, tensor_keys[group_index], p.device, _wide_dtype(p, group))
                grad = self._clip_local(p.grad, values)
                peak = torch.linalg.vector_norm(p.grad, float("inf"))
                raw_finite = finite = torch.isfinite(peak)
                if grad is not p.grad:  # the gradient the step uses: a bad clip value makes it NaN
                    finite = finite & torch.isfinite(torch.linalg.vector_norm(grad, float("inf")))
                # all zeros counts as no gradient: not stepped, and not counted as non-finite
                active = finite & (peak > 0)
                if valid[group_index] is not None:
                    active = active & valid[group_index]
                work.append((index, p, group, values, grad, raw_finite, finite, active))

        if self.global_clipnorm is not None and work:
            sq = [torch.where(item[6], torch.linalg.vector_norm(item[4].float()) ** 2, 0.0) for item in work]
            total = torch.stack([s.to(sq[0].device) for s in sq]).sum().sqrt()
            scale = self.global_clipnorm / total.clamp_min(self.global_clipnorm)
            work = [(i, p, gr, v, g * scale.to(g.device, g.dtype), raw, fin, active)
                    for i, p, gr, v, g, raw, fin, active in work]

        for index, p, group, values, grad, raw_finite, finite, active in work:
            self._update_param(index, p, group, values, grad, raw_finite, finite, active, do_update, probability)

        if (self._decider.step - 1) % self.nonfinite_warn_interval == 0:
            self._report_nonfinite()
            self._report_bad_settings()

    def _check_structure(self, index: int, group: dict[str, Any]) -> None:
        """``ValueError`` when a setting in :data:`STRUCTURE_KEYS` differs from the one a
        parameter's state was made under: its factors and momentum keep their shapes and
        dtypes, so the step would silently ignore the new value."""
        resolved: dict[torch.dtype, tuple[Any, ...]] = {}  # the group's settings, per parameter dtype
        for p in group["params"]:
            made = self._made_with.get(p)
            if made is None:
                continue
            now = resolved.get(p.dtype)
            if now is None:
                now = resolved[p.dtype] = _structure(group, p)
            if made != now:
                changed = [f"{key} from {a!r} to {b!r}" for key, a, b in zip(STRUCTURE_KEYS, made, now) if a != b]
                raise ValueError(
                    f"Kron: param group {index} changed {', '.join(changed)} after its parameters' "
                    "preconditioner state was made; these settings fix the state's shapes and dtypes, so the "
                    "step cannot follow them. Set them back; they can only be chosen before a parameter's "
                    "first step (a loaded checkpoint brings its own)")

    def _update_param(self, index: int, p: torch.Tensor, group: dict[str, Any], values: dict[str, Any],
                      grad: torch.Tensor, raw_finite: torch.Tensor, finite: torch.Tensor, active: torch.Tensor,
                      do_update: bool, probability: float) -> None:
        """Step ``p`` with the group's ``values`` (:func:`_local_settings`); ``raw_finite``: its
        gradient is finite; ``finite``: the clipped one too; ``active``: finite, not all zero
        and the settings usable (the rest is left exactly as it was, by masks)."""
        state = self.state[p]
        if len(state) == 0:
            state = self._init_state(p, index, group)
        tensor = self._tensor_of(p, index, group, state)
        tensor.b1 = values["b1"]  # a scheduler may change it
        factors = tensor.factors
        cdtype = factors.compute_dtype  # of the preconditioning math (float32 for float16 factors)
        m = state["momentum_buffer"]
        g = torch.where(finite, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))

        tensor.accumulate(grad, active)  # unchanged if skipped; counts applied steps only
        # lr, weight decay, the step scale and the bias correction in float32 or wider (the
        # parameter's and the factors' dtypes promoted with float32): in bfloat16 1 − 1e-4 is 1,
        # in float16 2e-8 is 0 and 1/debias overflows
        wide = _wide_dtype(p, group)
        bias = tensor.debias(wide)

        if not factors.initialized:  # from a gradient the step uses (not one a bad setting skips)
            self._try_initialize(factors, torch.where(active, g, torch.zeros((), dtype=g.dtype, device=g.device)),
                                 state)
        if factors.initialized:
            if do_update:
                fit = m.to(cdtype) / bias.to(cdtype) if group["momentum_into_precond_update"] \
                    else g.to(cdtype)
                lr_q = _times(active, values["precond_lr"], cdtype)
                tensor.uses_per_update = state["uses_per_update"] = 1.0 / max(probability, 1e-3)
                tensor.update_factors(fit, lr_q, step=self._decider.step, update_index=self._q_updates - 1,
                                      enabled=active)
            u = tensor.precondition(m.to(cdtype))
        else:
            u = m.to(cdtype)  # identity preconditioner until the scale is known

        # The update P m̂ = u / bias clipped to RMS ≤ 1.1 is u times min(1/bias, 1.1/rms(u)).
        # The norm is taken in float32 or wider too: a float16 one overflows past 65 504.
        rms = torch.linalg.vector_norm(u, dtype=wide) / math.sqrt(u.numel())
        # A non-finite u (or norm) from a finite gradient, an overflow, is not written: the
        # parameter is left as it was and the step counted with the non-finite gradients.
        stepped = active & torch.isfinite(rms)
        state["nonfinite_steps"].add_((~raw_finite | (active & ~stepped)).to(torch.int32))
        u = torch.where(stepped, u, torch.zeros((), dtype=u.dtype, device=u.device))
        scale = torch.minimum(1.0 / bias, RMS_CLIP / (rms + 1e-12))
        lr = _times(stepped, values["lr"], wide)  # 0 skips this tensor
        weight_decay = values["weight_decay"]
        if (isinstance(weight_decay, torch.Tensor) or weight_decay != 0) and p.dim() >= 2:
            decay = lr * weight_decay
            if isinstance(weight_decay, torch.Tensor):  # an unusable one may be NaN: 0 · NaN is NaN
                decay = torch.where(stepped, decay, 0.0)
            p.mul_(1.0 - decay)  # p -= lr·(u + wd·p), decoupled
        # skipped: p + 0·(−0), bitwise p (the scale may be NaN then)
        p.addcmul_(u, -torch.where(stepped, lr * scale, 0.0))

    @staticmethod
    def _try_initialize(factors: PSGDFactors, g: torch.Tensor, state: dict[str, Any]) -> None:
        """``precond_init_scale=None``: estimate the scale from the first usable gradient
        (``g`` is zero where the gradient was non-finite); one host sync per parameter
        while it is uninitialized, none after."""
        try:
            factors.initialize_from(g)
        except ValueError:  # e.g. an all-zero gradient: try again on the next step
            return
        state["q_initialized"] = True

    def _report_bad_settings(self) -> None:
        """Warn about param-group settings held as tensors whose value the step could not use
        since the last report (one host read of each counter, at the report's cadence)."""
        rules = {key: rule for key, rule, _ in STEP_RULES}
        lines = []
        for (index, key), counter in sorted(self._bad_settings.items(), key=lambda item: item[0]):
            count = int(counter)
            if count:
                counter.zero_()
                lines.append(f"param group {index}: {key} (must be finite and {rules[key]}) on {count} step(s)")
        if lines:
            warnings.warn("Kron: a param-group setting held as a tensor had a value the step cannot use; those "
                          "steps left the group's parameters, momenta and preconditioners as they were: "
                          + "; ".join(lines), RuntimeWarning, stacklevel=3)

    def _report_nonfinite(self) -> None:
        """Warn about parameters whose gradient (or preconditioned update) was non-finite
        since the last report."""
        lines = [f"parameter {i} (shape {tuple(p.shape)}): {new} step(s), {total} in total"
                 for i, p, new, total in new_nonfinite_steps(self, self._reported)]
        if lines:
            warnings.warn("Kron: non-finite gradients; those steps skipped the momentum, "
                          "preconditioner and parameter updates (a finite gradient whose preconditioned "
                          "update overflowed: the parameter update) of: " + "; ".join(lines),
                          RuntimeWarning, stacklevel=3)

    # -- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict plus ``'kron'``: the update-schedule counters. Hooks as in
        ``torch.optim``: the ``register_state_dict_post_hook`` hooks see the whole dict
        (``'kron'`` included), and what one returns is what is returned.

        The counters also ride in every parameter's entry (``'kron_schedule'``: step,
        accumulator, Q updates): torch.distributed.checkpoint's state-dict API
        (``get_optimizer_state_dict``, Accelerate's FSDP checkpoints) keeps only ``'state'`` and
        ``'param_groups'``, and a load reads them there when ``'kron'`` is absent."""
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(post_hooks)()  # torch's would run before 'kron' is in
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        sd["kron"] = {"decider": self._decider.state_dict(), "q_updates": self._q_updates}
        self._mark_schedule()  # (current after every step and load; a decider changed by hand too)
        schedule = self._schedule
        # new dicts: torch's state_dict hands out the live per-parameter ones
        # the factors by position ({"0": Q_0, ...}): torch.distributed.checkpoint's flattened
        # optimizer state dict takes tensors, numbers and dicts only
        sd["state"] = {key: {**entry, SCHEDULE_KEY: schedule.clone(),
                             **{k: _by_position(entry[k]) for k in ("Q", "lipschitz") if k in entry}}
                       for key, entry in sd["state"].items()}
        for post_hook in post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; keeps the saved dtypes of momentum and factors (torch's
        default would cast them to the parameter dtype).

        All or nothing: every entry is checked (and converted) before anything changes, so
        a checkpoint that does not fit raises ``ValueError`` and leaves the optimizer as it
        was. Hooks as in ``torch.optim``: the ``register_load_state_dict_pre_hook`` hooks run
        first, on a shallow copy, and what they return is what is checked and loaded; the
        post-hooks run once everything is loaded.
        """
        state_dict = run_load_pre_hooks(self, state_dict)
        extra = state_dict.pop("kron", None)
        missing = [key for key in ("state", "param_groups") if key not in state_dict]
        if missing:
            raise ValueError(f"Kron.load_state_dict: the checkpoint has no {missing} (not an optimizer's state_dict)")
        saved_state = state_dict["state"]
        saved_groups = state_dict["param_groups"]
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError("Kron.load_state_dict: the saved param_groups do not match this "
                             "optimizer's groups")
        new_states: dict[torch.Tensor, dict[str, Any]] = {}
        saved_settings: dict[torch.Tensor, dict[str, Any]] = {}
        for index, (saved_group, group) in enumerate(zip(saved_groups, self.param_groups)):
            if not isinstance(saved_group, dict) or len(saved_group.get("params", ())) != len(group["params"]):
                raise ValueError(f"Kron.load_state_dict: param group {index} has a different "
                                 "number of parameters than this optimizer's")
            settings = {**group, **{k: v for k, v in saved_group.items() if k != "params"}}
            try:
                _check_group(settings, self.global_clipnorm, scheduled=True)
            except (TypeError, ValueError) as err:  # e.g. a flag saved as "no" (TypeError at construction)
                raise ValueError(f"Kron.load_state_dict: param group {index}: {err}") from None
            for key, p in zip(saved_group["params"], group["params"]):
                if key in saved_state:
                    new_states[p] = self._load_param_state(saved_state[key], p, settings, f"state[{key!r}]")
                    saved_settings[p] = settings
        decider = None
        if extra is None:  # a checkpoint through torch.distributed.checkpoint: the counters in the entries
            extra = _schedule_from_entries(saved_state)
        if extra is not None:
            try:
                # the schedule's counters, by the rule KronPreconditioner's checkpoints follow too:
                # a NaN accumulator would stop every later update
                decider = UpdateDecider.checked_state(extra["decider"], "kron.decider")
                q_updates = validation.check_int("kron.q_updates", extra["q_updates"], minimum=0)
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"Kron.load_state_dict: bad 'kron' entry: {type(err).__name__}: {err}") from None
        # Everything is checked: install it as torch.optim's loader does after its hooks (the
        # saved group settings on this optimizer's params), with the converted per-parameter state.
        groups = []
        for saved_group, group in zip(saved_groups, self.param_groups):
            new_group = copy.deepcopy({k: v for k, v in saved_group.items() if k != "params"})
            new_group["params"] = group["params"]
            if "param_names" in group and "param_names" not in new_group:
                new_group["param_names"] = group["param_names"]
            groups.append(new_group)
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        state.update({p: {**entry, SCHEDULE_KEY: self._schedule} for p, entry in new_states.items()})
        self.__setstate__({"state": state, "param_groups": groups})
        self._tensors.clear()
        self._bound.clear()
        self._made_with = {p: _structure(saved_settings[p], p) for p in new_states}
        # the loaded counters were reported by the run that saved them: report what comes after
        self._reported.clear()
        new_nonfinite_steps(self, self._reported)
        if decider is not None:
            self._decider.load_state_dict(decider, "kron.decider")
            self._q_updates = q_updates
        self._mark_schedule()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    @staticmethod
    def _load_param_state(saved: dict[str, Any], p: torch.Tensor, group: dict[str, Any],
                          where: str) -> dict[str, Any]:
        """The per-parameter state to install, checked and on ``p``'s device."""
        dev = p.device
        for key in ("step", "momentum_buffer", "Q", "q_initialized", "nonfinite_steps"):
            checks.entry(saved, key, f"Kron.load_state_dict: {where}")
        where = f"Kron.load_state_dict: {where}"
        saved = {**saved, **{k: _positional(saved[k], f"{where}: {k}") for k in ("Q", "lipschitz") if k in saved}}
        expected = [tuple(q.shape) for q in PSGDFactors(
            p.shape, max_size_triangular=group["max_size_triangular"],
            min_ndim_triangular=group["min_ndim_triangular"], memory_save_mode=group["memory_save_mode"],
            dtype=group["precond_dtype"], device="meta", merge_dims=group["merge_dims"]).q]
        checks.tensor_list(saved["Q"], expected, f"{where}: Q")
        checks.float_tensor(saved["momentum_buffer"], p.shape, f"{where}: momentum_buffer")
        for key in ("step", "nonfinite_steps"):
            # 0-dim, as made: the non-finite counts are stacked (health report), the step is read as
            # the momentum's bias correction
            checks.count(saved[key], f"{where}: {key}", shape=())
        checks.boolean(saved["q_initialized"], f"{where}: q_initialized")
        # 1 / (update probability), >= 1 (older files lack it): checked here, before anything is installed
        uses = checks.number(saved.get("uses_per_update", 1.0), f"{where}: uses_per_update", minimum=1.0)
        lipschitz = saved.get("lipschitz", [])  # Procrustes-style fit only; older files lack it
        if lipschitz:
            checks.tensor_list(lipschitz, [()] * len(lipschitz), f"{where}: lipschitz")
        loaded = {
            "step": saved["step"].to(dev, torch.float32, copy=True),
            "momentum_buffer": saved["momentum_buffer"].to(
                dev, group["mu_dtype"] or p.dtype, copy=True),
            "Q": [q.to(dev, group["precond_dtype"], copy=True) for q in saved["Q"]],
            "q_initialized": bool(saved["q_initialized"]),
            "nonfinite_steps": saved["nonfinite_steps"].to(dev, torch.int32, copy=True),
            "uses_per_update": uses,
        }
        if lipschitz:
            loaded["lipschitz"] = [t.to(dev, group["precond_dtype"], copy=True) for t in lipschitz]
        return loaded


SCHEDULE_KEY = "kron_schedule"  # the schedule's counters in each parameter's entry (see Kron.state_dict)


def _by_position(tensors: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A list of state tensors as a checkpoint holds it: ``{"0": t_0, "1": t_1, ...}``."""
    return {str(i): t for i, t in enumerate(tensors)}


def _positional(value: Any, where: str) -> Any:
    """The list :func:`_by_position` saved (a list as it is: files written before); ``ValueError``
    for a dict whose keys are not the positions ``"0"`` to ``"n-1"``."""
    if not isinstance(value, dict):
        return value
    if set(value) != {str(i) for i in range(len(value))}:
        raise ValueError(f"{where}: expected the tensors by position (keys '0' to '{len(value) - 1}'), "
                         f"got keys {sorted(map(repr, value))}")
    return [value[str(i)] for i in range(len(value))]


def _schedule_from_entries(saved_state: Any) -> dict[str, Any] | None:
    """The ``'kron'`` entry rebuilt from the counters a parameter's entry carries, or ``None``
    where none does (a checkpoint from before they did, or of an optimizer that never stepped).
    ``ValueError`` for counters that are not three finite numbers."""
    if not isinstance(saved_state, dict):
        return None
    found: list[list[float]] = []
    for entry in saved_state.values():
        if isinstance(entry, dict) and SCHEDULE_KEY in entry:
            counters = entry[SCHEDULE_KEY]
            if (not isinstance(counters, torch.Tensor) or counters.shape != (3,) or not counters.is_floating_point()
                    or not torch.isfinite(counters).all()):
                raise ValueError(f"Kron.load_state_dict: bad '{SCHEDULE_KEY}' entry (three finite numbers: step, "
                                 f"accumulator, Q updates): {counters!r}")
            found.append(counters.tolist())
    if not found:
        return None
    if any(values != found[0] for values in found):  # one optimizer's counters, saved in every entry
        raise ValueError(f"Kron.load_state_dict: the '{SCHEDULE_KEY}' entries disagree "
                         f"({sorted({tuple(v) for v in found})}): not one optimizer's checkpoint")
    step, acc, q_updates = found[0]
    integral = [value for value in (step, q_updates) if value != int(value)]
    if integral:
        raise ValueError(f"Kron.load_state_dict: bad '{SCHEDULE_KEY}' entry: counts must be whole, got {integral}")
    return {"decider": {"step": int(step), "acc": acc}, "q_updates": int(q_updates)}
