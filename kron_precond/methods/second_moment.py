"""An elementwise second moment in front of another optimizer ("Muon²").

Each registered layer's gradient matrix ``V = [W | b]`` is divided elementwise by the
root of a running mean of its squares, bias-corrected as Adam's:

    m ← β m + (1 − β) V²          V ← V / (√(m / (1 − βᵗ)) + ε)

with ``t`` the number of updates of ``m``. In front of Muon this evens out the entries
before Newton-Schulz orthogonalises them (Adam's preconditioner, then Muon's). The moment
is plain per-step state: no statistics, no refresh, no hooks, no host sync; layers of equal
shape are updated with one op per kind (:meth:`SecondMomentLayer.apply_batch`).

:func:`scale_by_moment` is shared with the input-side K-FAC method (``method="ikfac"``),
which stacks the same scaling after its inverse.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from kron_precond import validation as check
from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import GradientMatrix, LayerMethod, MethodSpec, Option, Selected, moved, tensor_bytes
from kron_precond.modules import find_kfac_modules
from kron_precond.schedules import IntervalSchedule, StepContext


def scale_by_moment(values: torch.Tensor, moment: torch.Tensor, decay: float, eps: float,
                    updates: torch.Tensor, keep: torch.Tensor, pool=None) -> torch.Tensor:
    """``values / (√(m̂) + eps)`` after folding ``values²`` into ``moment`` in place.

    ``values`` and ``moment``: ``[k, out, in]`` (k layers, or one without the leading dim);
    ``keep``: ``[k]`` bools, False for a layer whose values are not finite: its moment keeps
    its value (one bad step must not poison it for good). ``updates``: the moment's update
    count including this one, ``[k]`` (or 0-d) on the device (Adam's bias correction; a step a
    layer skipped, without a gradient or with a non-finite one, is not counted: see
    :func:`count_updates`). ``pool``: an optional
    map of the squares before they are folded (SOAP's averages over blocks of equal
    eigenvalues)."""
    work = values.to(moment.dtype)
    flags = keep.reshape(keep.shape + (1,) * (moment.dim() - keep.dim()))
    squares = work * work if pool is None else pool(work * work)
    blended = torch.lerp(moment, squares, 1.0 - decay)
    moment.copy_(torch.where(flags, blended, moment))
    # 1 − βᵗ in float64 (where the device has it): in float32, β rounded first and the
    # subtraction's cancellation cost 1e-5 of the correction at β = 0.999
    wide = torch.float32 if moment.device.type == "mps" else torch.float64
    counts = updates.to(wide)
    correction = (1.0 - decay**counts).to(moment.dtype)
    correction = correction.reshape(counts.shape + (1,) * (moment.dim() - counts.dim()))
    # a layer whose moment has never been updated: any finite correction (its moment is 0)
    correction = correction.clamp(min=torch.finfo(moment.dtype).tiny)
    scaled = work / ((moment / correction).sqrt() + eps)
    return scaled.to(values.dtype)


def check_moment_decay(name: str, value) -> float | None:
    """``None`` (off) or a decay in [0, 1)."""
    if value is None:
        return None
    return check.check_unit_interval(name, value, low_open=False, high_open=True)


#: Estimated flops per moment entry and step (square, blend, root, add, divide; the count
#: matters only relative to other layers of the same method: placement by compute cost).
MOMENT_FLOPS_PER_ENTRY = 6.0


class MomentOnHolders:
    """``holds_state`` for a layer whose ``moment`` (``[g_dim, a_dim]``, or ``None``) only its
    gradient workers apply (MEM_OPT: its owner): elsewhere the moment is an empty tensor (no
    bytes), made whole again (and its update count reset) if the rank holds the layer once
    more. The engine sets ``holds_state`` after construction."""

    moment: torch.Tensor | None
    g_dim: int
    a_dim: int
    updates: torch.Tensor
    _holds = True

    @property
    def holds_state(self) -> bool:
        return self._holds

    @holds_state.setter
    def holds_state(self, value: bool) -> None:
        self._holds = bool(value)
        if self.moment is None:
            return
        if not value:
            self.moment = self.moment.new_zeros((0, self.a_dim))
        elif self.moment.numel() == 0:
            self.moment = self.moment.new_zeros((self.g_dim, self.a_dim))
            self.updates.zero_()


class SecondMomentLayer(MomentOnHolders, GradientMatrix, LayerMethod):
    """The running second moment of one Linear / ConvNd layer's gradient matrix."""

    moment: torch.Tensor  # always kept (empty where this rank does not hold the layer)
    parts = ("moment",)
    expert = False  # one expert of a fused experts module (see idle_experts); set by make_layer

    def __init__(self, name: str, weight_shape: torch.Size, has_bias: bool, *, weight_transposed: bool,
                 decay: float, eps: float, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.name = name
        self.set_matrix_layout(weight_shape, has_bias, weight_transposed)
        self.decay, self.eps = decay, eps
        # float32 or better: squares of small gradients underflow a half-precision moment
        self.moment = torch.zeros(self.g_dim, self.a_dim, dtype=torch.promote_types(dtype, torch.float32),
                                  device=device)
        self.updates = update_counter(device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)

    # the moment is per-step state: nothing to refresh or broadcast
    def refresh(self, part: str, grads, ctx: StepContext) -> None:
        pass

    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        return []

    def release_refreshed(self) -> None:
        """Drop the moment: this rank does not hold the layer (after a load: the engine loads
        every layer on every rank, then releases those another rank holds)."""
        self.holds_state = False

    def apply(self, grads: list[torch.Tensor], ctx: StepContext) -> list[torch.Tensor]:
        matrix = self.grads_to_matrix(grads)
        keep = torch.isfinite(matrix).all()
        use = keep if not self.expert else keep & ~is_zero(matrix)  # an idle expert: not called
        self.updates.add_(use.to(self.updates.dtype))
        self.nonfinite.add_((~keep).to(self.nonfinite.dtype))
        out = scale_by_moment(matrix, self.moment, self.decay, self.eps, self.updates, use)
        return self.matrix_to_grads(out if not self.expert else torch.where(use, out, matrix))

    def batch_key(self) -> Hashable:
        return (type(self), self.weight_shape, self.weight_transposed, self.has_bias)

    @classmethod
    def apply_batch(cls, layers: Sequence["SecondMomentLayer"], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """Every layer of one shape with one op per kind: the moments are stacked once and
        each layer's moment becomes a view into the stack. An idle expert (:func:`idle_experts`)
        is left as a layer not called: its zeros pass through, its moment and count unchanged."""
        stack = cache.get("moments")
        if stack is None:
            stack = cache["moments"] = adopt_stack(layers, "moment")
        matrices = cls.stack_matrices(layers, grads)
        idle = idle_experts(layers, matrices, cache)
        use = keep if idle is None else keep & ~idle
        updates = count_updates(layers, use, cache)
        count_skipped(layers, ~keep, cache)
        first = layers[0]
        out = scale_by_moment(matrices, stack, first.decay, first.eps, updates, use)
        return cls.unstack_matrices(layers, torch.where(use.reshape(-1, 1, 1), out, matrices))

    def factor_costs(self) -> dict[str, tuple[float, float]]:
        """The moment's holder does elementwise work on each of its entries every step (square,
        blend, root, divide: a few flops each): placed as such, not as free work (which put every
        layer on rank 0)."""
        entries = float(self.g_dim * self.a_dim)
        return {"moment": (MOMENT_FLOPS_PER_ENTRY * entries, entries)}

    def memory_by_kind(self) -> dict[str, int]:
        return {"moments": tensor_bytes([self.moment])}

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the state to ``device``; the moment to the parameters' new dtype, float32 or
        wider (as when it is made)."""
        self.moment = moved(self.moment, device, torch.promote_types(dtype, torch.float32))
        self.nonfinite = moved(self.nonfinite, device)
        self.updates = moved(self.updates, device)

    def state_dict(self) -> dict[str, Any]:
        if not self._holds:
            raise RuntimeError(f"{self.name}: this rank does not hold the layer's moment (its gradient "
                               "workers do); gather the state from them")
        return {"moment": self.moment.clone(), "updates": int(self.updates)}

    def check_state(self, state: dict[str, Any]) -> None:
        where = f"state of {self.name}"
        # a mean of squares: a negative one makes the step's square root NaN
        checks.float_tensor(checks.entry(state, "moment", where), (self.g_dim, self.a_dim), f"{where}: moment",
                            non_negative=True)
        checks.integer(checks.entry(state, "updates", where), f"{where}: updates")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if self._holds:  # elsewhere no moment is kept (release_refreshed follows such a load)
            self.moment.copy_(state["moment"])  # in place: it may be a view into a stack
        self.updates.fill_(int(state["updates"]))


def adopt_stack(layers: Sequence, attr: str) -> torch.Tensor:
    """Stack the layers' ``attr`` tensors and re-point each layer at its slice, so an in-place
    update of either (the batched step, a load, the health report's reset) reaches both."""
    stack = torch.stack([getattr(layer, attr) for layer in layers])
    for layer, view in zip(layers, stack.unbind(0)):
        setattr(layer, attr, view)
    return stack


def update_counter(device: torch.device) -> torch.Tensor:
    """A layer's count of moment updates, on the device: advanced by whether each step's update
    happened, so that a skipped one (a non-finite gradient) leaves the bias correction as if it
    never was, without a host sync."""
    return torch.zeros((), dtype=torch.int64, device=device)


def stacked(layers: Sequence, attr: str, cache: dict) -> torch.Tensor:
    """The stack of the layers' ``attr`` tensors, whose slices they are (:func:`adopt_stack`),
    kept in ``cache`` and re-adopted when a layer's tensor is no longer its slice (a load,
    another stack, a move)."""
    entry = cache.get(attr)
    if entry is None or any(getattr(layer, attr) is not view for layer, view in zip(layers, entry[1])):
        stack = adopt_stack(layers, attr)
        entry = cache[attr] = (stack, [getattr(layer, attr) for layer in layers])
    return entry[0]


def count_updates(layers: Sequence, counted: torch.Tensor, cache: dict) -> torch.Tensor:
    """Advance each layer's ``updates`` by ``counted[i]`` (bools): one op on a stack whose slices
    the layers' counters become (:func:`stacked`). Returns the stack, the counts including this
    step."""
    stack = stacked(layers, "updates", cache)
    stack.add_(counted.reshape(-1).to(stack.dtype))
    return stack


def is_zero(matrix: torch.Tensor) -> torch.Tensor:
    """0-d bool on the device: every entry of ``matrix`` is zero (a NaN is not)."""
    return torch.count_nonzero(matrix) == 0


def idle_experts(layers: Sequence, matrices: torch.Tensor, cache: dict) -> torch.Tensor | None:
    """``[k]`` bools on the device: layer ``i`` is one expert of a fused experts module (its
    ``expert`` flag) whose gradient matrix ``matrices[i]`` (``[k, out, in]``) is all zeros.

    The router sent it no token: its slice of the stacked parameter's ``.grad`` is zeros where
    the same expert as a Linear of its own would not have been called and have no gradient, so
    a stateful method treats it as a layer not called (kron_precond/apply.py): its moment,
    update count and statistics are left as they are, its zeros pass through. Not a skipped
    non-finite update (a NaN or Inf is no zero). A Linear's all-zero gradient is a gradient.
    Decided on the device from the (already averaged) gradient, so alike on every rank, with a
    fixed number of ops; ``None`` (no op) when no layer of the batch is an expert."""
    if not any(layer.expert for layer in layers):
        return None
    flags = cache.get("experts")
    if flags is None:
        flags = cache["experts"] = torch.tensor([layer.expert for layer in layers], device=matrices.device)
    return flags & (torch.count_nonzero(matrices, dim=(-2, -1)) == 0)


def count_skipped(layers: Sequence, skipped: torch.Tensor, cache: dict) -> None:
    """Count a skipped moment update (``skipped[i]`` True: a non-finite gradient) in each layer's
    ``nonfinite`` counter, which the health report reads: one op on a stack whose slices the
    layers' counters become."""
    counters = cache.get("nonfinite")
    if counters is None:
        counters = cache["nonfinite"] = adopt_stack(layers, "nonfinite")
    counters.add_(skipped.reshape(-1).to(counters.dtype))


class _NoSchedule(IntervalSchedule):
    """Neither statistics nor refreshes: the moment is updated in ``apply``. (Stateless, like
    its base, whose no-op counters it keeps.)"""

    def __init__(self) -> None:
        super().__init__(None, None, check=lambda name, value: value)

    def collects(self, step: int) -> bool:
        return False

    def refreshes(self, step: int) -> bool:
        return False


def _check_decay(name: str, value) -> float:
    return check.check_unit_interval(name, value, low_open=False, high_open=True)


class SecondMomentSpec(MethodSpec):
    """Adam's elementwise second moment on each Linear / ConvNd gradient matrix, to sit in
    front of another optimizer (``second_moment`` + Muon = "Muon²")."""

    name = "second_moment"
    # no refreshes to ride on: read the health counters (one host sync) every 100 steps
    health_check_every = 100
    options = {
        "moment_decay": Option(0.95, _check_decay),
        "moment_eps": Option(1e-8, check.check_positive),
    }

    def select(self, model, is_skipped, log) -> list[Selected]:
        return find_kfac_modules(model, is_skipped, log)

    def make_layer(self, index: int, selected: Selected) -> SecondMomentLayer:
        weight = selected.params[0][1]  # weight first (an expert: its row of the stacked weight)
        layer = SecondMomentLayer(selected.name, selected.shapes[0], selected.has_bias,
                                  weight_transposed=selected.weight_transposed,
                                  decay=self.settings["moment_decay"], eps=self.settings["moment_eps"],
                                  device=weight.device, dtype=weight.dtype)
        layer.expert = selected.index is not None
        return layer

    def make_schedule(self) -> _NoSchedule:
        return _NoSchedule()
