"""K-FAC for one layer: Kronecker factors A (activations) and G (output gradients).

For a layer with gradient matrix ``∇ = [W | b]`` of shape ``[out, in(+1)]`` the Fisher
block is approximated by ``G ⊗ A`` with

    A = mean_rows(ã ãᵀ)      ã = activation row with a trailing 1 when there is a bias
    G = mean_rows(δ δᵀ)      δ = output gradient · n · accumulation steps

where ``n`` is the number of rows of the call for a Linear-like layer (``B`` for a
``[B, D]`` input, ``B·T`` for ``[B, T, D]`` or ``[T, B, D]``) and the batch size for a
convolution, so that for the usual mean losses (per sample, per token) neither factor
depends on the batch size or the sequence length, and one damping value means the same
at any batch size, sequence length or world size (:meth:`KFACAdapter.gradient_scale`).

Preconditioning (``compute_method``):

* EIGEN:   ``A = Q_A diag(d_A) Q_Aᵀ``, ``G = Q_G diag(d_G) Q_Gᵀ`` and
  ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (d_G d_Aᵀ + λ)] Q_Aᵀ``, which is exactly
  ``(G ⊗ A + λI)⁻¹ vec(∇)``.
* INVERSE: ``V = (G + γ_G I)⁻¹ ∇ (A + γ_A I)⁻¹`` with the factored-Tikhonov split of
  Martens & Grosse (2015, §6.3): ``γ_A = π √λ``, ``γ_G = √λ / π`` and
  ``π = √((tr A / dim A) / (tr G / dim G))`` (π = 1 when either trace is zero). The
  split keeps the damping proportionate when A and G have very different scales.

A side wider than ``max_factor_size`` keeps only the diagonal of its factor (its running
average of ``ã²`` or ``δ²`` per coordinate, the full factor's diagonal): its statistics
cost ``N·d`` instead of ``N·d²``, it needs no decomposition, and ``apply`` scales by it
instead of multiplying by a ``d × d`` matrix. Both formulas above hold with that factor
replaced by its diagonal (EIGEN: its eigenbasis is the identity, its eigenvalues the
diagonal). This is what makes K-FAC affordable on a wide MLP side or a vocabulary-sized
``lm_head``.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Hashable, Sequence, cast

import torch

from kron_precond import validation as check
from kron_precond.enums import ComputeMethod
from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import (
    GradientMatrix,
    LayerMethod,
    MethodSpec,
    Option,
    Selected,
    graft_to_gradient_norm,
    moved,
    tensor_bytes,
)
from kron_precond.modules import find_kfac_modules
from kron_precond.schedules import IntervalSchedule, StepContext

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11

FACTORS = ("A", "G")


class KFACLayer(GradientMatrix, LayerMethod):
    """Factors, pending statistics and decompositions of one Linear/ConvNd layer.

    Args:
        name: qualified module name, used in warnings.
        weight_shape: shape of the module's weight; the gradient matrix is
            ``weight.reshape(out, -1)`` with the bias (if any) as last column.
        weight_transposed: the weight is stored ``[in, out]`` (GPT-2 style ``Conv1D``).
        has_bias: whether the layer has a bias (adds the last row/column of A).
        compute_method: EIGEN or INVERSE.
        eigenvalue_outer_product: cache ``1 / (d_G d_Aᵀ + λ)`` at refresh time (EIGEN),
            trading ``out·in`` memory for a cheaper ``apply``.
        factor_dtype: dtype of A and G; their statistics are summed in it, or in float32 if it is narrower.
        inv_dtype: dtype of the stored decompositions / inverses.
        statistics_rows: at most this many rows of each module call enter the factor
            statistics, the first in the layer's row order: for a batch-first Linear input
            ``[B, T, d]`` whole samples when it is a multiple of ``T``; for a sequence-first
            input the first time steps of every sample; for a convolution the first output
            positions of the first samples. ``None`` keeps every row.
        max_factor_size: a side (``in(+1)`` for A, ``out`` for G) wider than this keeps a
            diagonal factor; ``None``: no limit.
        grafting: rescale the layer's preconditioned gradient to the norm of its gradient
            (direction from K-FAC, step size from the gradient).
    """

    def __init__(
        self,
        name: str,
        weight_shape: torch.Size,
        has_bias: bool,
        *,
        compute_method: ComputeMethod,
        eigenvalue_outer_product: bool,
        factor_dtype: torch.dtype,
        inv_dtype: torch.dtype,
        device: torch.device,
        weight_transposed: bool = False,
        statistics_rows: int | None = None,
        max_factor_size: int | None = None,
        grafting: bool = False,
    ) -> None:
        self.name = name
        self.grafting = grafting
        self.statistics_rows = statistics_rows
        self.set_matrix_layout(weight_shape, has_bias, weight_transposed)  # [in, out] storage: seen as [out, in]
        self.compute_method = compute_method
        self.eigenvalue_outer_product = eigenvalue_outer_product
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        kw: dict[str, Any] = dict(device=device, dtype=factor_dtype)
        # Statistics are summed in float32 or better: a float16 sum overflows past 65,504
        # rows and a bfloat16 one stops growing at 256 equal terms.
        self.statistics_dtype = torch.promote_types(factor_dtype, torch.float32)
        # Per factor: keep only its diagonal (a vector) because the side is too wide.
        self.diagonal = {part: max_factor_size is not None and dim > max_factor_size
                         for part, dim in (("A", self.a_dim), ("G", self.g_dim))}
        # ``None`` on a rank that keeps no factors (release_statistics_state).
        self.a_factor: torch.Tensor | None = torch.zeros(self._factor_shape("A"), **kw)
        self.g_factor: torch.Tensor | None = torch.zeros(self._factor_shape("G"), **kw)
        # Statistics of the current factor step, summed over rows and micro-batches.
        # Sums and row counts (not means) are what ranks reduce, so a layer that saw no
        # rows on one rank still gets the same global mean on every rank.
        # Allocated on factor steps only and freed once folded: between factor steps a
        # layer holds its factors and decompositions, nothing else.
        self._a_sum: torch.Tensor | None = None
        self._g_sum: torch.Tensor | None = None
        self._rows = torch.zeros(2, dtype=self.statistics_dtype, device=device)
        # Whether A / G hold data (on device: deciding it must not need a host sync).
        self._seen = torch.zeros(2, dtype=torch.bool, device=device)
        # Consecutive factor steps in which A / G received no rows (on device): a layer
        # that had statistics and stops getting them is reported by name.
        self._missed = torch.zeros(2, dtype=torch.int64, device=device)
        # Count of factor updates skipped for non-finite statistics; read on refresh steps
        # only, so the per-step path never synchronises with the device.
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        # Refreshed state, allocated on first use: ranks that are not gradient workers of
        # this layer never hold it (MEM_OPT / HYBRID_OPT memory savings). Each part ends
        # with a one-element validity flag: 1 once a refresh of a factor holding data
        # succeeded. ``apply`` passes gradients through until both flags are set.
        self._device = device
        self._refreshed: dict[str, list[torch.Tensor]] | None = None
        self._inverse_denominator: torch.Tensor | None = None
        self._damping_used: float | None = None
        # True once a refresh step has finalised this layer (decided from the step count).
        self.ready = False
        # factor_dtype was not given: factors take the parameters' dtype, float32 or wider (a
        # bfloat16 running average stalls once (1 - decay)(new - F) is below half an ulp), also
        # after a move.
        self.factor_dtype_follows = False

    def _factor_shape(self, part: str) -> tuple[int, ...]:
        dim = self.a_dim if part == "A" else self.g_dim
        return (dim,) if self.diagonal[part] else (dim, dim)

    # ------------------------------------------------------------------ observe
    def activation_terms(self, rows: torch.Tensor) -> Any:
        """``(Σ a aᵀ, Σ a, N)`` for activation rows ``[N, in]`` (no bias column; ``(Σ a², None,
        N)`` for a diagonal A): what the call adds to ``Σ ã ãᵀ``, ones column included."""
        self.check_row_width(rows, "input")
        rows = self.statistics_subset(rows).to(self.statistics_dtype)
        if self.diagonal["A"]:
            return rows.square().sum(0), None, rows.shape[0]
        return rows.t() @ rows, rows.sum(0) if self.has_bias else None, rows.shape[0]

    def add_activation_terms(self, terms: Any) -> Any:
        product, col_sum, count = terms
        a_sum, _ = self._allocate_statistics()
        if self.diagonal["A"]:
            d = product.shape[0]
            a_sum[:d].add_(product)
            if self.has_bias:
                a_sum[d].add_(count)
        else:
            self.add_augmented(a_sum, product, col_sum, count)
        self._rows[0].add_(count)  # counted on the device: no host round trip

    def observe_output_grads(self, rows: torch.Tensor, scale: float, call: Any = None) -> None:
        """Accumulate ``Σ δ δᵀ`` (``Σ δ²`` for a diagonal G) for output-gradient rows
        ``[N, out]``, ``δ = scale · rows`` (``call`` is not needed here). A call whose rows are
        not finite is left out (:meth:`usable_rows`)."""
        self.check_row_width(rows, "output")
        rows, usable = self.usable_rows(rows)
        _, g_sum = self._allocate_statistics()
        if self.diagonal["G"]:
            g_sum.add_(rows.square().sum(0), alpha=scale * scale)
        else:
            g_sum.addmm_(rows.t(), rows, alpha=scale * scale)
        self._rows[1].add_(usable.to(self._rows.dtype) * rows.shape[0])

    def usable_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, usable)``: the call's statistics rows in the statistics dtype, zeros in place
        of a call holding a NaN or Inf (a micro-batch whose loss scale overflowed), and whether
        they were finite, decided on the device. Such a call is left out of the sum and its rows
        out of the count, so the step's other calls still make the factor."""
        rows = self.statistics_subset(rows).to(self.statistics_dtype)
        usable = torch.isfinite(rows).all()
        return torch.where(usable, rows, torch.zeros((), dtype=rows.dtype, device=rows.device)), usable

    def statistics_subset(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows that enter the statistics: a prefix, so that the activation and
        output-gradient sides of one call keep the same rows. The factors are means, so
        fewer rows change their noise, not their scale; the ``N·d²`` products shrink in
        proportion (building the rows, e.g. a convolution's unfold, still sees them all)."""
        return rows if self.statistics_rows is None else rows[: self.statistics_rows]

    def shared_statistics(self) -> list[torch.Tensor]:
        """This step's sums of ``ã ãᵀ`` and ``δ δᵀ`` and their row counts, to be summed
        across ranks before :meth:`fold_statistics`."""
        a_sum, g_sum = self._allocate_statistics()  # every rank sends the same layout, data or not
        return [a_sum, g_sum, self._rows]

    def _allocate_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This factor step's sums ``(A, G)``, allocated (zero) on first use."""
        if self._a_sum is None or self._g_sum is None:
            kw: dict[str, Any] = dict(device=self._device, dtype=self.statistics_dtype)
            self._a_sum = torch.zeros(self._factor_shape("A"), **kw)
            self._g_sum = torch.zeros(self._factor_shape("G"), **kw)
        return self._a_sum, self._g_sum

    def release_statistics_state(self) -> None:
        """Free the running factors on a rank that never refreshes this layer (sharded
        models: statistics are reduced to the owner only). ``a_factor`` / ``g_factor`` are
        then ``None``; statistics are still gathered here and sent to the owner."""
        self.a_factor = self.g_factor = None

    def fold_statistics(self, ctx: StepContext) -> None:
        """Fold the (reduced) statistics into the running averages ``F ← d·F + (1−d)·F_new``
        with ``d = ctx["factor_decay"]``.

        The first update of a factor takes the statistics as they are. A factor with no
        rows, or with non-finite statistics, keeps its value; all decided on the device.
        """
        if self._a_sum is None or self._g_sum is None:  # nothing observed on this factor step
            self._missed.add_(1)
            return
        if self.a_factor is None or self.g_factor is None:  # factors live on the owner (sharded models)
            self.discard_statistics()
            return
        decay = ctx["factor_decay"]
        for index, (factor, total) in enumerate(((self.a_factor, self._a_sum), (self.g_factor, self._g_sum))):
            rows = self._rows[index]
            new = total / rows.clamp_min(1.0).to(total.dtype)
            if new.dim() == 2:
                new = (new + new.t()) * 0.5  # exact symmetry; accumulation rounding can break it
            blended = torch.where(self._seen[index], torch.lerp(factor.to(new.dtype), new, 1.0 - decay), new)
            blended = blended.to(factor.dtype)
            # Checked after the cast: a float32 mean may still overflow a float16 factor.
            finite = torch.isfinite(blended).all()
            has_rows = rows > 0
            accept = finite & has_rows
            self._missed[index] = torch.where(has_rows, 0, self._missed[index] + 1)
            factor.copy_(torch.where(accept, blended, factor))
            self._seen[index] |= accept
            self.nonfinite.add_((has_rows & ~finite).to(self.nonfinite.dtype))
        self.discard_statistics()

    def discard_statistics(self) -> None:
        self._a_sum = self._g_sum = None
        self._rows.zero_()

    def has_pending_statistics(self) -> bool:
        return self._a_sum is not None or self._g_sum is not None  # allocated by the first rows, freed by the fold

    def statistics_health(self) -> torch.Tensor:
        """``[ever had A, ever had G, factor steps since A had rows, same for G]`` (int64,
        on the device)."""
        return torch.cat([self._seen.to(torch.int64), self._missed])

    def observed(self) -> torch.Tensor:
        """Whether both factors hold data (a 0-dim bool tensor); ``True`` where the factors
        were dropped (their owner judges)."""
        if self.a_factor is None:
            return torch.ones((), dtype=torch.bool, device=self._device)
        return self._seen.all()

    # ------------------------------------------------------------------ refresh
    parts = FACTORS

    def _allocated(self) -> dict[str, list[torch.Tensor]]:
        if self._refreshed is None:
            kw: dict[str, Any] = dict(device=self._device, dtype=self.inv_dtype)
            self._refreshed = {part: [torch.zeros(shape, **kw) for shape in self._refreshed_shapes(part)]
                               for part in FACTORS}
        return self._refreshed

    def _refreshed_shapes(self, part: str) -> list[tuple[int, ...]]:
        """EIGEN: ``[Q, eigenvalues, valid]``; INVERSE: ``[inverse, valid]``. A diagonal
        factor has no ``Q`` (the identity) and its inverse is a vector."""
        n = self.a_dim if part == "A" else self.g_dim
        if self.diagonal[part]:
            return [(n,), (1,)]
        return [(n, n), (n,), (1,)] if self.compute_method is ComputeMethod.EIGEN else [(n, n), (1,)]

    def release_refreshed(self) -> None:
        """Drop refreshed state (on ranks that are not gradient workers of this layer)."""
        self._refreshed = None
        self._inverse_denominator = None
        self.ready = False

    def refreshed_tensors(self, factor: str | None = None) -> list[torch.Tensor]:
        refreshed = self._allocated()
        if factor is None:
            return refreshed["A"] + refreshed["G"]
        return refreshed[factor]

    def refresh(self, factor: str, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:
        """Decompose (EIGEN) or invert (INVERSE) one factor; keep the old result on failure."""
        damping = ctx["damping"]
        result: tuple[torch.Tensor, ...] | None
        if self.compute_method is ComputeMethod.EIGEN:
            matrix = self._held_factor(factor)
            if self.diagonal[factor]:  # already diagonal: its eigenvalues, basis the identity
                result = (matrix.clamp_min(0.0).to(self.inv_dtype),)
            else:
                result = _robust_eigh(matrix, self.inv_dtype, f"{self.name}.{factor}")
        else:
            result = self._damped_inverse(factor, damping)
        if result is None:
            return
        *targets, valid = self.refreshed_tensors(factor)
        for dst, src in zip(targets, result, strict=True):
            dst.copy_(src)
        valid.fill_(1.0).mul_(self._seen[FACTORS.index(factor)])

    def finalize_refresh(self, ctx: StepContext) -> None:
        """Derive what ``apply`` needs from the refreshed tensors (run by every grad worker)."""
        if ctx.statistics_count:  # nothing to finalise before the first statistics
            self._finalize(ctx["damping"])

    def _finalize(self, damping: float) -> None:
        self._allocated()  # a refresh that failed from the start left nothing allocated
        if self.compute_method is ComputeMethod.EIGEN and self.eigenvalue_outer_product:
            d_a = self.refreshed_tensors("A")[-2]  # the eigenvalues (a diagonal factor: all it has)
            d_g = self.refreshed_tensors("G")[-2]
            denominator = _inverse_denominator(d_g, d_a, damping)
            if self._inverse_denominator is None:
                self._inverse_denominator = denominator
            else:  # in place: it may be a view into a batch of layers (apply_batch)
                self._inverse_denominator.copy_(denominator)
        self._damping_used = damping
        self.ready = True

    def _held_factor(self, part: str) -> torch.Tensor:
        """The running factor ``part`` ("A" or "G") of a rank that keeps the factors."""
        factor = self.a_factor if part == "A" else self.g_factor
        assert factor is not None, f"{self.name}: the factors were released on this rank"
        return factor

    def _damped_inverse(self, factor: str, damping: float) -> tuple[torch.Tensor] | None:
        work_dtype = _decomposition_dtype(self.inv_dtype)
        a = self._held_factor("A").to(work_dtype)
        g = self._held_factor("G").to(work_dtype)
        trace_a = _trace(a) / self.a_dim
        trace_g = _trace(g) / self.g_dim
        both_positive = (trace_a > 0) & (trace_g > 0)
        pi = torch.where(both_positive, torch.sqrt(trace_a / trace_g.clamp_min(1e-30)), 1.0)
        sqrt_damping = damping**0.5
        if factor == "A":
            matrix, gamma = a, pi * sqrt_damping
        else:
            matrix, gamma = g, sqrt_damping / pi
        try:
            if matrix.dim() == 1:  # a diagonal factor (its entries are ≥ 0, so no failure)
                inverse = (1.0 / (matrix.clamp_min(0.0) + gamma)).to(self.inv_dtype)
            else:
                eye = torch.eye(matrix.shape[0], dtype=work_dtype, device=matrix.device)
                inverse = torch.linalg.inv(matrix + gamma * eye).to(self.inv_dtype)
            if not bool(torch.isfinite(inverse).all()):  # refresh steps only: a host sync
                raise RuntimeError("the inverse is not finite")
        except RuntimeError as err:  # singular despite damping: keep the previous inverse
            warnings.warn(f"kron_precond: inverting {self.name}.{factor} failed ({err}); "
                          "keeping the previous inverse", RuntimeWarning, stacklevel=2)
            return None
        return (inverse,)

    # ------------------------------------------------------------------ apply
    def apply(self, grads: list[torch.Tensor], ctx: StepContext | None = None) -> list[torch.Tensor]:
        if not self.ready:
            return grads
        matrix = self.grads_to_matrix(grads)
        out = self.precondition_matrix(matrix.to(self.inv_dtype)).to(matrix.dtype)
        if self.grafting:
            out = graft_to_gradient_norm([out.unsqueeze(0)], [matrix.unsqueeze(0)])[0].squeeze(0)
        # Until both factors have a valid refresh (data seen, decomposition succeeded),
        # the gradient passes through; chosen on the device.
        refreshed = self._refreshed_state()
        valid = refreshed["A"][-1] * refreshed["G"][-1]
        return self.matrix_to_grads(torch.where(valid.bool(), out, matrix))

    def _refreshed_state(self) -> dict[str, list[torch.Tensor]]:
        """The refreshed tensors of a layer that is ``ready`` (allocated by its refresh)."""
        assert self._refreshed is not None, f"{self.name}: no refreshed state (not a gradient worker?)"
        return self._refreshed

    def precondition_matrix(self, grad: torch.Tensor) -> torch.Tensor:
        refreshed = self._refreshed_state()
        parts = {part: refreshed[part] for part in FACTORS}
        return _precondition(grad, parts, self.compute_method, self._inverse_denominator, self._damping_used)

    def batch_key(self) -> Hashable | None:
        if not self.ready:
            return None  # passes gradients through: nothing to batch
        return (type(self), self.compute_method, self.weight_shape, self.weight_transposed, self.has_bias,
                self.inv_dtype, self._inverse_denominator is not None, self._damping_used,
                self.diagonal["A"], self.diagonal["G"], self.grafting)

    @classmethod
    def apply_batch(cls, layers: Sequence[Self], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """All layers of one shape at once: one batched matmul per product, not one per layer.

        The first call stacks the layers' refreshed tensors into one tensor per kind and makes
        each layer's tensors views into it, so later refreshes and broadcasts (in place)
        update the stack: nothing is copied per step, and no memory is duplicated.
        """
        first = layers[0]
        stacked = cache.get("stacked")
        if stacked is None:
            stacked = cache["stacked"] = _adopt_into_stacks(layers)
        count = len(layers)
        weight = torch.stack([g[0] for g in grads])
        if first.weight_transposed:
            weight = weight.transpose(1, 2)
        else:
            weight = weight.reshape(count, first.g_dim, -1)
        if first.has_bias:
            matrix = torch.cat([weight, torch.stack([g[1] for g in grads]).unsqueeze(2)], dim=2)
        else:
            matrix = weight
        work = matrix.to(first.inv_dtype)
        out = _precondition(work, stacked, first.compute_method, stacked["denominator"], first._damping_used)
        if first.grafting:
            out = graft_to_gradient_norm([out], [work])[0]
        valid = ((stacked["A"][-1] * stacked["G"][-1]).bool() & keep).reshape(count, 1, 1)
        out = torch.where(valid, out.to(matrix.dtype), matrix)
        if first.has_bias:
            weights, biases = out[:, :, :-1], out[:, :, -1].unbind(0)
        else:
            weights, biases = out, None
        if first.weight_transposed:
            weights = weights.transpose(1, 2)
        else:
            weights = weights.reshape(count, *first.weight_shape)
        unstacked = weights.unbind(0)
        if biases is None:
            return [[w] for w in unstacked]
        return [[w, b] for w, b in zip(unstacked, biases)]


    # ------------------------------------------------------------------ estimates
    def factor_costs(self) -> dict[str, tuple[float, float]]:
        """Per factor: (compute cost ~ n³, memory cost ~ n²); ~ n and n for a diagonal one."""
        costs = {}
        for part, dim in (("A", float(self.a_dim)), ("G", float(self.g_dim))):
            costs[part] = (dim, dim) if self.diagonal[part] else (dim ** 3, dim ** 2)
        return costs

    def memory_by_kind(self) -> dict[str, int]:
        held = [] if self._refreshed is None else self.refreshed_tensors()
        refreshed = tensor_bytes(held) + tensor_bytes([self._inverse_denominator])
        return {
            "factors": tensor_bytes([self.a_factor, self.g_factor]),
            "statistics": tensor_bytes([self._a_sum, self._g_sum, self._rows]),
            "decompositions" if self.compute_method is ComputeMethod.EIGEN else "inverses": refreshed,
        }

    # ------------------------------------------------------------------ placement
    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the state to ``device``; factors and statistics also to ``dtype`` (float32 or
        wider) when ``factor_dtype`` follows the parameters. Decompositions keep ``inv_dtype``."""
        factor_dtype = default_factor_dtype(dtype) if self.factor_dtype_follows else self.factor_dtype
        statistics_dtype = torch.promote_types(factor_dtype, torch.float32)
        self.a_factor = moved(self.a_factor, device, factor_dtype)
        self.g_factor = moved(self.g_factor, device, factor_dtype)
        self._a_sum = moved(self._a_sum, device, statistics_dtype)
        self._g_sum = moved(self._g_sum, device, statistics_dtype)
        self._rows = moved(self._rows, device, statistics_dtype)
        self._seen = moved(self._seen, device)
        self._missed = moved(self._missed, device)
        self.nonfinite = moved(self.nonfinite, device)
        if self._refreshed is not None:
            self._refreshed = {k: [moved(t, device) for t in v] for k, v in self._refreshed.items()}
        self._inverse_denominator = moved(self._inverse_denominator, device)
        self.factor_dtype, self.statistics_dtype = factor_dtype, statistics_dtype
        self._device = device

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The layer's state. What this rank does not hold is left out: the running factors
        (with their ``seen`` flags) where they were dropped, the decompositions where this
        rank is not a gradient worker (sharded checkpoints store each piece where it lives)."""
        state: dict[str, Any] = {"compute_method": self.compute_method.value}
        if self.a_factor is not None and self.g_factor is not None:  # both or neither
            state.update(a_factor=self.a_factor.clone(), g_factor=self.g_factor.clone(),
                         seen=self._seen.clone())
        if self.holds_state:
            state.update(refreshed={k: [t.clone() for t in v] for k, v in self._allocated().items()},
                         damping_used=self._damping_used, ready=self.ready)
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` was not saved by a layer like this one, or holds
        something :meth:`load_state_dict` would choke on or should not trust (missing
        entries, wrong shapes, integer or non-finite tensors). The factors are required where
        this rank keeps them, the refreshed state where it is a gradient worker (sharded
        checkpoints hold each piece only where it lives); present entries are always checked."""
        where = f"state of {self.name}"
        method = checks.entry(state, "compute_method", where)
        if method != self.compute_method.value:
            raise ValueError(f"{where} was saved with compute_method={method!r}, "
                             f"this layer uses {self.compute_method.value!r}")
        if self.a_factor is not None or "a_factor" in state:
            a_shape, g_shape = self._factor_shape("A"), self._factor_shape("G")
            checks.float_tensor(checks.entry(state, "a_factor", where), a_shape, f"{where}: a_factor")
            checks.float_tensor(checks.entry(state, "g_factor", where), g_shape, f"{where}: g_factor")
            # copied in place, as is: a [1, 2] tensor would fail the load after other layers loaded
            checks.flags(checks.entry(state, "seen", where), self._seen.shape, f"{where}: seen")
        if not (self.holds_state or "refreshed" in state):
            return
        refreshed = checks.entry(state, "refreshed", where)
        for factor in FACTORS:
            tensors = checks.entry(refreshed, factor, f"{where}: refreshed")
            checks.tensor_list(tensors, self._refreshed_shapes(factor), f"{where}: refreshed[{factor!r}]")
            if self.compute_method is ComputeMethod.EIGEN:
                # every refresh clamps the eigenvalues at 0 (a saved one is never negative): a
                # negative one makes d_G d_Aᵀ + damping, which the step divides by, near 0 or < 0
                index = len(tensors) - 2
                checks.no_negatives(tensors[index], f"{where}: refreshed[{factor!r}][{index}]")
        ready = checks.entry(state, "ready", where)
        checks.boolean(ready, f"{where}: ready")
        damping = checks.entry(state, "damping_used", where)
        if ready and (isinstance(damping, bool) or not isinstance(damping, (int, float))
                      or not damping > 0 or damping == float("inf")):
            raise ValueError(f"{where}: damping_used must be a positive number, got {damping!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if self.a_factor is not None and self.g_factor is not None:  # both or neither
            self.a_factor.copy_(state["a_factor"])
            self.g_factor.copy_(state["g_factor"])
            self._seen.copy_(state["seen"])
        self.discard_statistics()
        if "refreshed" not in state:
            return
        for key in FACTORS:  # the entries checked (another key would fail halfway through the load)
            for dst, src in zip(self.refreshed_tensors(key), state["refreshed"][key], strict=True):
                dst.copy_(src)
        if state["ready"]:
            self._finalize(state["damping_used"])
        else:
            self.ready = False


def _precondition(grad: torch.Tensor, parts: dict, compute_method: ComputeMethod,
                  denominator: torch.Tensor | None, damping: float | None) -> torch.Tensor:
    """K-FAC's product for one gradient matrix ``[out, in]`` or a stack ``[k, out, in]``.

    ``parts["A"]`` / ``parts["G"]``: the factor's refreshed tensors (``_refreshed_shapes``);
    a diagonal factor is recognised by its 1-D (stacked: 2-D) first tensor. EIGEN:
    ``Q_G [(Q_Gᵀ ∇ Q_A) · denominator] Q_Aᵀ`` with an identity ``Q`` skipped; INVERSE:
    ``G⁻¹ ∇ A⁻¹`` with a diagonal inverse applied as a scaling.
    """
    def is_diagonal(tensors):  # [d, valid] or [inverse, valid] whose first holds one vector per layer
        return tensors[0].dim() == grad.dim() - 1

    diagonal_a, diagonal_g = is_diagonal(parts["A"]), is_diagonal(parts["G"])
    if compute_method is ComputeMethod.EIGEN:
        q_a = None if diagonal_a else parts["A"][0]
        q_g = None if diagonal_g else parts["G"][0]
        if denominator is None:
            assert damping is not None, "the eigenvalue product needs the damping it was built with"
            denominator = _inverse_denominator(parts["G"][-2], parts["A"][-2], damping)
        rotated = grad if q_g is None else q_g.transpose(-1, -2) @ grad
        rotated = rotated if q_a is None else rotated @ q_a
        out = rotated * denominator
        out = out if q_g is None else q_g @ out
        return out if q_a is None else out @ q_a.transpose(-1, -2)
    a_inv, g_inv = parts["A"][0], parts["G"][0]
    out = grad * g_inv.unsqueeze(-1) if diagonal_g else g_inv @ grad
    return out * a_inv.unsqueeze(-2) if diagonal_a else out @ a_inv


def default_factor_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The factors' dtype when ``factor_dtype`` is not given: the parameters', float32 or wider.
    A half-precision running average ``F ← F + (1 − decay)(new − F)`` stops moving once the
    step is below half an ulp of F (bfloat16, decay 0.99: stuck 20% short of the average)."""
    return torch.promote_types(param_dtype, torch.float32)


def _trace(factor: torch.Tensor) -> torch.Tensor:
    return factor.sum() if factor.dim() == 1 else torch.trace(factor)


def _inverse_denominator(d_g: torch.Tensor, d_a: torch.Tensor, damping: float) -> torch.Tensor:
    """``1 / (d_G d_Aᵀ + λ)``, computed in float32 or better, stored in the eigenvalues' dtype."""
    work = _decomposition_dtype(d_a.dtype)
    # d_g[..., :, None] * d_a[..., None, :]: an outer product, batched over leading dims
    return (1.0 / (d_g.to(work).unsqueeze(-1) * d_a.to(work).unsqueeze(-2) + damping)).to(d_a.dtype)


def _decomposition_dtype(dtype: torch.dtype) -> torch.dtype:
    """Decompositions run in float32 or better whatever the storage dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _robust_eigh(matrix: torch.Tensor, out_dtype: torch.dtype, label: str):
    """Eigendecomposition with eigenvalues clamped at 0; float64 retry; ``None`` on failure.

    A decomposition that returns NaN/Inf without raising (it happens on GPUs) is a
    failure like one that raises. The finiteness check is a host sync, on refresh steps
    only (``eigh`` itself synchronises to report convergence errors).
    """
    work_dtype = _decomposition_dtype(out_dtype)
    for dtype in dict.fromkeys((work_dtype, torch.float64)):
        try:
            eigenvalues, eigenvectors = torch.linalg.eigh(matrix.to(dtype))
        except RuntimeError:  # torch.linalg.LinAlgError: no convergence
            continue
        eigenvalues = eigenvalues.clamp_min(0.0)
        result = eigenvectors.to(out_dtype), eigenvalues.to(out_dtype)
        # Checked in the stored dtype: float64 results may overflow a narrower one.
        if bool(torch.isfinite(result[0]).all() & torch.isfinite(result[1]).all()):
            return result
    warnings.warn(f"kron_precond: eigendecomposition of {label} failed in float32 and float64 "
                  "(raised or returned non-finite values); keeping the previous decomposition",
                  RuntimeWarning, stacklevel=3)
    return None


def _adopt_into_stacks(layers: Sequence[KFACLayer]) -> dict[str, Any]:
    """Stack the layers' refreshed tensors kind by kind and re-point each layer at its slice:
    ``{"A": [...], "G": [...], "denominator": stack or None}`` (the parts' lists as in
    ``_refreshed_shapes``, each validity flag stacked to ``[k]``)."""
    first = layers[0]
    refreshed = [layer._refreshed_state() for layer in layers]
    stacks: dict[str, Any] = {"denominator": None}
    for part in FACTORS:
        stacks[part] = []
        for i in range(len(refreshed[0][part])):
            stack = torch.stack([state[part][i] for state in refreshed])
            for state, view in zip(refreshed, stack.unbind(0)):
                state[part][i] = view
            if i == len(refreshed[0][part]) - 1:
                stack = stack.reshape(len(layers))  # the one-element validity flags
            stacks[part].append(stack)
    if first.compute_method is ComputeMethod.EIGEN and first._inverse_denominator is not None:
        # batch_key groups layers by whether it is set: all of them hold one here.
        stack = torch.stack(cast(list[torch.Tensor], [layer._inverse_denominator for layer in layers]))
        for layer, view in zip(layers, stack.unbind(0)):
            layer._inverse_denominator = view
        stacks["denominator"] = stack
    return stacks



def _check_inv_dtype(name: str, value) -> torch.dtype:
    if value not in (torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"{name} must be torch.float32, torch.float64 or torch.bfloat16 "
                         f"(float16 overflows 1/λ-sized values), got {value!r}")
    return value


def _check_compute_method(name: str, value) -> ComputeMethod:
    return ComputeMethod.parse(value, name)


def _check_statistics_rows(name: str, value) -> int | None:
    return None if value is None else check.check_int(name, value)


def _check_decay(name: str, value) -> float:
    return check.check_unit_interval(name, value, low_open=True, high_open=False)




class KFACSpec(MethodSpec):
    """K-FAC (Martens & Grosse, 2015; KAISA's distributed form): Kronecker factors of the
    activations and output gradients of Linear / ConvNd layers, from module hooks."""

    name = "kfac"
    captures = True
    reduces_statistics = True
    owner_only_statistics = True
    default_kl_clip = 1e-3
    options = {
        "factor_update_steps": Option(1, check.check_int, per_step="always", collective=True),
        "inv_update_steps": Option(1, check.check_int, per_step="always", collective=True),
        "damping": Option(1e-3, check.check_positive, per_step="refresh"),
        "factor_decay": Option(0.95, _check_decay, per_step="statistics"),
        "compute_method": Option(ComputeMethod.EIGEN, _check_compute_method, collective=True),
        "compute_eigenvalue_outer_product": Option(True, check.check_bool),
        "factor_dtype": Option(None, check.check_statistics_dtype,
                               collective=True),
        "inv_dtype": Option(torch.float32, _check_inv_dtype, collective=True),
        "statistics_rows": Option(None, _check_statistics_rows),
        # Shampoo's default: a 8192-wide side is the largest one worth a dense factor.
        "max_factor_size": Option(8192, lambda n, v: None if v is None else check.check_int(n, v),
                                  collective=True),
        "grafting": Option(False, check.check_bool),
    }
    layer_class = KFACLayer

    def select(self, model, is_skipped, log) -> list[Selected]:
        return find_kfac_modules(model, is_skipped, log)

    def make_layer(self, index: int, selected: Selected) -> KFACLayer:
        return self._make_factored_layer(
            selected, compute_method=self.settings["compute_method"],
            eigenvalue_outer_product=self.settings["compute_eigenvalue_outer_product"],
            max_factor_size=self.settings["max_factor_size"], grafting=self.settings["grafting"])

    def _make_factored_layer(self, selected: Selected, **method_kwargs) -> KFACLayer:
        """``layer_class`` for ``selected``'s weight with the factor settings shared by the
        K-FAC family (subclasses pass their own extra arguments)."""
        weight = selected.params[0][1]  # weight first (an expert: its row of the stacked weight)
        layer = self.layer_class(
            selected.name, selected.shapes[0], selected.has_bias,
            factor_dtype=self.settings["factor_dtype"] or default_factor_dtype(weight.dtype),
            inv_dtype=self.settings["inv_dtype"], device=weight.device,
            weight_transposed=selected.weight_transposed,
            statistics_rows=self.settings["statistics_rows"], **method_kwargs)
        layer.factor_dtype_follows = self.settings["factor_dtype"] is None
        return layer

    def make_schedule(self) -> IntervalSchedule:
        return IntervalSchedule(self.settings["factor_update_steps"], self.settings["inv_update_steps"],
                                check=check.check_int)

    def describe(self) -> dict[str, Any]:
        settings = dict(self.settings)
        settings["compute_method"] = settings["compute_method"].value
        return settings
