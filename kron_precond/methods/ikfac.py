"""Input-side (one-sided) K-FAC: the gradient right-multiplied by ``(A + λI)⁻¹``.

For a Linear / ConvNd layer with gradient matrix ``∇ = [W | b]`` (``[out, in(+1)]``):

    A = running mean of ã ãᵀ     (ã: activation row, with a trailing 1 when there is a bias)
    λ = damping · tr(A) / dim A   (damping relative to A's mean eigenvalue)
    V = ∇ (A + λI)⁻¹

This is K-FAC without its output-gradient factor G (Newton-Muon, arXiv 2604.01472: in
front of Muon, the left factor is what the orthogonalisation already equalises). So the
method reads no output gradient: on statistics steps its forward hooks compute each call's
``ã ãᵀ`` from whole batches (or their first ``statistics_rows`` rows), added once a backward
reaches the call's output (a hook that reads nothing else), folds them into A by an
exponential average, and on refresh steps inverts ``A + λI`` by a
Cholesky factorisation (float32 or better; float64 retry; on failure the previous inverse
is kept). A plain step is one batched matmul per group of layers of equal shape.

Start of a run. The first refresh has one batch to invert; with the long default intervals
(32) an unusual first batch (all zeros, or scaled by 1e-2: a tiny ``tr A``, so a tiny λ)
would set ``(A + λI)⁻¹`` ~1e4 too large for a whole interval. So the schedule warms up
(:class:`~kron_precond.schedules.IntervalSchedule` ``warmup``: statistics and a refresh on
steps 1, 2, 4, ... below the interval too), and the k-th statistics step folds with weight
``max(1 − decay, 1/k)`` (the ``ε = min(1 − 1/k, decay)`` of Martens & Grosse 2015, §5; this
library's ``kfac`` takes its first statistics whole, then the plain exponential average):
A is the plain mean of the first statistics until the exponential average takes over, so
each warm-up refresh dilutes the first batch to 1/k instead of keeping ``decay^(k−1)`` of it
(``k`` counts the run's statistics steps, one count for all layers: a layer first called
later goes over to the exponential average sooner).
Both follow the step counters alone (same on every rank, restored by checkpoints).

Optionally (``moment_decay``) the result is then divided elementwise by the root of its
running second moment, as :mod:`kron_precond.methods.second_moment` does.
"""
from __future__ import annotations

import warnings
from typing import Any, Hashable, Sequence

import torch
from torch import nn

from kron_precond import validation as check
from kron_precond.attention import input_side_attention_units
from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import GradientMatrix, LayerMethod, MethodSpec, Option, Selected, moved, tensor_bytes
from kron_precond.methods.second_moment import (
    MomentOnHolders,
    adopt_stack,
    check_moment_decay,
    count_skipped,
    count_updates,
    idle_experts,
    scale_by_moment,
    update_counter,
)
from kron_precond.modules import find_kfac_modules
from kron_precond.schedules import IntervalSchedule, StepContext


class InputKFACLayer(MomentOnHolders, GradientMatrix, LayerMethod):
    """The activation factor, its damped inverse and (optionally) a second moment of one layer.

    Args:
        name: qualified module name, used in warnings.
        weight_shape: the module's weight shape; the gradient matrix is
            ``weight.reshape(out, -1)`` with the bias (if any) as last column.
        has_bias: adds the trailing ones column to the activation rows.
        weight_transposed: the weight is stored ``[in, out]`` (GPT-2 style ``Conv1D``).
        factor_dtype: dtype of A (statistics are summed in float32 or better); not float16
            (refused by the spec: A overflows or underflows there).
        inv_dtype: dtype of the stored inverse.
        statistics_rows: at most this many rows of each module call enter A (a prefix).
        moment_decay: ``None``, or β of the elementwise second moment applied after the inverse.
        moment_eps: ε of that second moment.
    """

    parts = ("A",)
    hands_on_gradients = True  # preconditions(): 0 until a refresh saw rows of the layer
    expert = False  # one expert of a fused experts module (second_moment.idle_experts); set by make_layer

    def __init__(self, name: str, weight_shape: torch.Size, has_bias: bool, *, weight_transposed: bool,
                 factor_dtype: torch.dtype, inv_dtype: torch.dtype, device: torch.device,
                 statistics_rows: int | None, moment_decay: float | None, moment_eps: float) -> None:
        self.name = name
        self.set_matrix_layout(weight_shape, has_bias, weight_transposed)
        self.statistics_rows = statistics_rows
        self.factor_dtype, self.inv_dtype = factor_dtype, inv_dtype
        self.statistics_dtype = torch.promote_types(factor_dtype, torch.float32)
        self._device = device
        # ``None`` on a rank that keeps no factor (release_statistics_state).
        self.a_factor: torch.Tensor | None = torch.zeros(self.a_dim, self.a_dim, dtype=factor_dtype, device=device)
        # This statistics step's sum of ã ãᵀ and its row count: what ranks reduce. Allocated
        # on statistics steps only and freed once folded.
        self._a_sum: torch.Tensor | None = None
        self._rows = torch.zeros(1, dtype=self.statistics_dtype, device=device)
        self._seen = torch.zeros((), dtype=torch.bool, device=device)
        self._missed = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        # [inverse, validity flag]: the flag is 1 once an inverse of a factor holding data exists
        self._refreshed: list[torch.Tensor] | None = None
        self.ready = False
        self.factor_dtype_follows = False
        self.moment_decay, self.moment_eps = moment_decay, moment_eps
        self.moment = (torch.zeros(self.g_dim, self.a_dim, dtype=self.statistics_dtype, device=device)
                       if moment_decay is not None else None)
        self.updates = update_counter(device)  # second-moment updates

    # ------------------------------------------------------------------ statistics
    def activation_terms(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``(Σ a aᵀ, Σ a, N)`` for activation rows ``[N, in]`` (no bias column): what the call
        adds to ``Σ ã ãᵀ``, ones column included."""
        self.check_row_width(rows, "input")
        if self.statistics_rows is not None:
            rows = rows[: self.statistics_rows]
        rows = rows.to(self.statistics_dtype)
        return rows.t() @ rows, rows.sum(0) if self.has_bias else None, rows.shape[0]

    def add_activation_terms(self, terms: tuple[torch.Tensor, torch.Tensor | None, int]) -> None:
        product, col_sum, count = terms
        self.add_augmented(self._allocate_statistics(), product, col_sum, count)
        self._rows.add_(count)

    def _allocate_statistics(self) -> torch.Tensor:
        """This statistics step's sum of ``ã ãᵀ``, allocated (zero) on first use."""
        if self._a_sum is None:
            self._a_sum = torch.zeros(self.a_dim, self.a_dim, dtype=self.statistics_dtype, device=self._device)
        return self._a_sum

    def shared_statistics(self) -> list[torch.Tensor]:
        """This step's ``Σ ã ãᵀ`` and row count, summed across ranks before folding."""
        a_sum = self._allocate_statistics()
        return [a_sum, self._rows]

    def release_statistics_state(self) -> None:
        self.a_factor = None

    def fold_statistics(self, ctx: StepContext) -> None:
        """``A ← lerp(A, mean, max(1 − decay, 1/k))`` on the k-th statistics step (a running
        mean of the first ones); a layer's first statistics are taken as they are; no rows
        or non-finite statistics leave A unchanged (decided on the device)."""
        if self._a_sum is None:
            self._missed.add_(1)
            return
        if self.a_factor is None:  # the owner keeps A (sharded models)
            self.discard_statistics()
            return
        rows = self._rows[0]
        new = self._a_sum / rows.clamp_min(1.0)
        new = (new + new.t()) * 0.5
        weight = max(1.0 - ctx["factor_decay"], 1.0 / max(ctx.statistics_count, 1))
        blended = torch.where(self._seen, torch.lerp(self.a_factor.to(new.dtype), new, weight),
                              new).to(self.a_factor.dtype)
        finite = torch.isfinite(blended).all()
        has_rows = rows > 0
        accept = finite & has_rows
        self._missed.copy_(torch.where(has_rows, 0, self._missed + 1))
        self.a_factor.copy_(torch.where(accept, blended, self.a_factor))
        self._seen |= accept
        self.nonfinite.add_((has_rows & ~finite).to(self.nonfinite.dtype))
        self.discard_statistics()

    def discard_statistics(self) -> None:
        self._a_sum = None
        self._rows.zero_()

    def has_pending_statistics(self) -> bool:
        return self._a_sum is not None

    def statistics_health(self) -> torch.Tensor:
        """The engine's ``[had A, had G, missed A, missed G]``: one factor, reported twice."""
        seen, missed = self._seen.to(torch.int64).reshape(1), self._missed.reshape(1)
        return torch.cat([seen, seen, missed, missed])

    def observed(self) -> torch.Tensor:
        if self.a_factor is None:
            return torch.ones((), dtype=torch.bool, device=self._device)
        return self._seen.clone()

    # ------------------------------------------------------------------ refresh
    def _allocated(self) -> list[torch.Tensor]:
        if self._refreshed is None:
            kw: dict[str, Any] = dict(device=self._device, dtype=self.inv_dtype)
            self._refreshed = [torch.zeros(self.a_dim, self.a_dim, **kw), torch.zeros(1, **kw)]
        return self._refreshed

    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        return self._allocated()

    def release_refreshed(self) -> None:
        self._refreshed = None
        self.ready = False

    def refresh(self, part: str, grads, ctx: StepContext) -> None:
        """``(A + λI)⁻¹`` by Cholesky, ``λ = damping · tr(A) / dim``; previous inverse kept on failure."""
        inverse = damped_inverse(self._held_factor(), ctx["damping"], self.inv_dtype, self.name)
        if inverse is None:
            return
        target, valid = self._allocated()
        target.copy_(inverse)
        valid.fill_(1.0).mul_(self._seen)

    def _held_factor(self) -> torch.Tensor:
        """The running factor A of a rank that keeps it (its owner, on sharded models)."""
        assert self.a_factor is not None, f"{self.name}: the factor was released on this rank"
        return self.a_factor

    def _refreshed_state(self) -> list[torch.Tensor]:
        """``[inverse, validity flag]`` of a layer that is ``ready`` (allocated by its refresh)."""
        assert self._refreshed is not None, f"{self.name}: no refreshed state (not a gradient worker?)"
        return self._refreshed

    def finalize_refresh(self, ctx: StepContext) -> None:
        if ctx.statistics_count:
            self._allocated()
            self.ready = True

    # ------------------------------------------------------------------ apply
    def preconditions(self) -> bool | torch.Tensor:
        # the refresh's validity flag: 0 until a refresh saw rows of the layer (one first called late)
        return self._refreshed[1] if self.ready and self._refreshed is not None else False

    def apply(self, grads: list[torch.Tensor], ctx: StepContext) -> list[torch.Tensor]:
        if not self.ready:
            return grads
        keep = torch.ones(1, dtype=torch.bool, device=grads[0].device)
        return type(self).apply_batch([self], [grads], ctx, {}, keep)[0]

    def batch_key(self) -> Hashable | None:
        if not self.ready:
            return None
        return (type(self), self.weight_shape, self.weight_transposed, self.has_bias, self.inv_dtype,
                self.moment is not None)

    @classmethod
    def apply_batch(cls, layers: Sequence["InputKFACLayer"], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """All layers of one shape at once: one batched matmul. The first call stacks the
        layers' inverses (and moments) and makes each layer's tensors views into the stacks,
        so refreshes and broadcasts, in place, update them: nothing is copied per step."""
        first = layers[0]
        if not all(layer.ready for layer in layers):  # no refresh yet: nothing to apply
            return [list(g) for g in grads]
        stacked = cache.get("stacked")
        if stacked is None:
            stacked = cache["stacked"] = _adopt(layers)
        inverses, valid, moments = stacked
        matrix = cls.stack_matrices(layers, grads)
        out = torch.matmul(matrix.to(first.inv_dtype), inverses)
        use = valid.bool() & keep
        if moments is not None:
            idle = idle_experts(layers, matrix, cache)  # a layer not called: its moment left alone
            if idle is not None:
                use = use & ~idle
            count_skipped(layers, valid.bool() & ~keep, cache)
            updates = count_updates(layers, use, cache)
            assert first.moment_decay is not None  # a layer holds moments only with a moment_decay
            out = scale_by_moment(out, moments, first.moment_decay, first.moment_eps, updates, use)
        return cls.unstack_matrices(layers, torch.where(use.reshape(-1, 1, 1), out.to(matrix.dtype), matrix))

    # ------------------------------------------------------------------ estimates, placement
    def factor_costs(self) -> dict[str, tuple[float, float]]:
        return {"A": (float(self.a_dim) ** 3, float(self.a_dim) ** 2)}

    def memory_by_kind(self) -> dict[str, int]:
        return {"factors": tensor_bytes([self.a_factor]),
                "statistics": tensor_bytes([self._a_sum, self._rows]),
                "inverses": tensor_bytes(self._refreshed or []),
                "moments": tensor_bytes([self.moment])}

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        factor_dtype = torch.promote_types(dtype, torch.float32) if self.factor_dtype_follows else self.factor_dtype
        self.statistics_dtype = torch.promote_types(factor_dtype, torch.float32)
        self.a_factor = moved(self.a_factor, device, factor_dtype)
        self._a_sum = moved(self._a_sum, device, self.statistics_dtype)
        self._rows = moved(self._rows, device, self.statistics_dtype)
        self._seen, self._missed = moved(self._seen, device), moved(self._missed, device)
        self.nonfinite = moved(self.nonfinite, device)
        if self._refreshed is not None:
            self._refreshed = [moved(t, device) for t in self._refreshed]
        self.moment = moved(self.moment, device, self.statistics_dtype)  # as made: the statistics' dtype
        self.updates = moved(self.updates, device)
        self.factor_dtype, self._device = factor_dtype, device

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"updates": int(self.updates)}
        if self.a_factor is not None:
            state.update(a_factor=self.a_factor.clone(), seen=self._seen.clone())
        if self.holds_state:
            state.update(refreshed=[t.clone() for t in self._allocated()], ready=self.ready)
            if self.moment is not None:
                state["moment"] = self.moment.clone()
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` does not fit this layer (missing entries, wrong
        shapes, non-finite tensors)."""
        where = f"state of {self.name}"
        checks.integer(checks.entry(state, "updates", where), f"{where}: updates")
        if self.a_factor is not None or "a_factor" in state:
            checks.float_tensor(checks.entry(state, "a_factor", where), (self.a_dim, self.a_dim),
                                f"{where}: a_factor")
            seen = checks.entry(state, "seen", where)
            if not isinstance(seen, torch.Tensor) or seen.numel() != 1:
                raise ValueError(f"{where}: seen must be a one-element tensor, got {seen!r}")
            checks.flags(seen.reshape(()), (), f"{where}: seen")  # a NaN or a 2 would read as True
        if not (self.holds_state or "refreshed" in state):
            return
        refreshed = checks.entry(state, "refreshed", where)
        checks.tensor_list(refreshed, [(self.a_dim, self.a_dim), (1,)], f"{where}: refreshed")
        checks.flags(refreshed[1], (1,), f"{where}: refreshed[1]")  # the inverse's validity
        checks.boolean(checks.entry(state, "ready", where), f"{where}: ready")
        if self.moment is not None:
            # a mean of squares: a negative one makes the step's square root NaN
            checks.float_tensor(checks.entry(state, "moment", where), (self.g_dim, self.a_dim),
                                f"{where}: moment", non_negative=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.updates.fill_(int(state["updates"]))
        if self.a_factor is not None:
            self.a_factor.copy_(state["a_factor"])
            self._seen.copy_(state["seen"].reshape(()))
        self.discard_statistics()
        if "refreshed" not in state:
            return
        for dst, src in zip(self._allocated(), state["refreshed"], strict=True):
            dst.copy_(src)  # in place: they may be views into a batch of layers
        if self.moment is not None and self.holds_state:  # elsewhere no moment is kept (MomentOnHolders)
            self.moment.copy_(state["moment"])
        self.ready = bool(state["ready"])


def damped_inverse(factor: torch.Tensor, damping: float, out_dtype: torch.dtype, label: str) -> torch.Tensor | None:
    """``(F + λI)⁻¹`` with ``λ = damping · tr(F) / dim`` (``damping`` itself when ``tr F = 0``), by
    Cholesky in float32 or better, retried in float64; ``None`` (warned) when both fail.
    The success checks are host syncs: refresh steps only."""
    n = factor.shape[0]
    work = torch.float64 if out_dtype == torch.float64 else torch.float32
    for dtype in dict.fromkeys((work, torch.float64)):
        matrix = factor.to(dtype)
        mean_eigenvalue = torch.trace(matrix) / n
        ridge = torch.where(mean_eigenvalue > 0, damping * mean_eigenvalue, torch.full_like(mean_eigenvalue, damping))
        lower, info = torch.linalg.cholesky_ex(matrix + ridge * torch.eye(n, dtype=dtype, device=matrix.device))
        if int(info) != 0:
            continue
        inverse = torch.cholesky_inverse(lower).to(out_dtype)
        if bool(torch.isfinite(inverse).all()):
            return inverse
    warnings.warn(f"kron_precond: the Cholesky factorisation of {label}.A + λI failed in float32 and float64; "
                  "keeping the previous inverse", RuntimeWarning, stacklevel=3)
    return None


def _adopt(layers: Sequence[InputKFACLayer]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stack the layers' inverses, flags and moments; re-point each layer at its slices."""
    inverses = torch.stack([layer._refreshed_state()[0] for layer in layers])
    flags = torch.stack([layer._refreshed_state()[1] for layer in layers])
    for layer, inverse, flag in zip(layers, inverses.unbind(0), flags.unbind(0)):
        layer._refreshed = [inverse, flag]
    moments = adopt_stack(layers, "moment") if layers[0].moment is not None else None
    return inverses, flags.reshape(len(layers)), moments


def _check_decay(name: str, value) -> float:
    return check.check_unit_interval(name, value, low_open=True, high_open=False)


def _check_rows(name: str, value) -> int | None:
    return None if value is None else check.check_int(name, value)



def _check_inv_dtype(name: str, value) -> torch.dtype:
    if value not in (torch.float32, torch.float64):
        raise ValueError(f"{name} must be torch.float32 or torch.float64 (the Cholesky inverse runs in "
                         f"float32 or better), got {value!r}")
    return value


class InputKFACSpec(MethodSpec):
    """One-sided K-FAC: ``∇ (A + λI)⁻¹`` with A the activation factor alone (Newton-Muon's
    right preconditioner), from forward hooks only; optionally an elementwise second moment
    after it."""

    name = "ikfac"
    captures = True
    captures_output_grads = False  # no output gradient read (the output hook only adds A's terms)
    reduces_statistics = True
    owner_only_statistics = True
    options = {
        "factor_update_steps": Option(32, check.check_int, per_step="always", collective=True),
        "inv_update_steps": Option(32, check.check_int, per_step="always", collective=True),
        "damping": Option(0.2, check.check_positive, per_step="refresh"),
        "factor_decay": Option(0.95, _check_decay, per_step="statistics"),
        "factor_dtype": Option(None, check.check_statistics_dtype, collective=True),
        "inv_dtype": Option(torch.float32, _check_inv_dtype, collective=True),
        "statistics_rows": Option(None, _check_rows),
        "moment_decay": Option(None, check_moment_decay),
        "moment_eps": Option(1e-8, check.check_positive),
    }

    def select(self, model, is_skipped, log) -> list[Selected]:
        # nn.MultiheadAttention applies its projections functionally: its self-attention in_proj is
        # read from its arguments (kron_precond.attention), which the module search passes over
        attention = {name for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
        units = find_kfac_modules(model, is_skipped, log, taken_elsewhere=attention)
        packed = input_side_attention_units(model, is_skipped, log)
        if not packed:
            return units
        order = {id(m): i for i, m in enumerate(model.modules())}  # the model's module order
        return sorted(units + packed, key=lambda u: order[id(u.module)])

    def make_layer(self, index: int, selected: Selected) -> InputKFACLayer:
        weight = selected.params[0][1]  # weight first (an expert: its row of the stacked weight)
        s = self.settings
        layer = InputKFACLayer(
            selected.name, selected.shapes[0], selected.has_bias,
            weight_transposed=selected.weight_transposed,
            factor_dtype=s["factor_dtype"] or torch.promote_types(weight.dtype, torch.float32),
            inv_dtype=s["inv_dtype"], device=weight.device, statistics_rows=s["statistics_rows"],
            moment_decay=s["moment_decay"], moment_eps=s["moment_eps"])
        layer.factor_dtype_follows = s["factor_dtype"] is None
        layer.expert = selected.index is not None
        return layer

    def make_schedule(self) -> IntervalSchedule:
        # warm-up refreshes (and statistics) on steps 1, 2, 4, ...: see the module docstring
        return IntervalSchedule(self.settings["factor_update_steps"], self.settings["inv_update_steps"],
                                check=check.check_int, warmup=True)
