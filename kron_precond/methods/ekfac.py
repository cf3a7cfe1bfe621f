"""EK-FAC for one layer: K-FAC's eigenbases with a re-estimated diagonal scaling.

Eigenvalue-corrected K-FAC (George et al., 2018). With K-FAC's factors
``A = Q_A diag(d_A) Q_Aᵀ`` and ``G = Q_G diag(d_G) Q_Gᵀ`` (``methods/kfac.py``), K-FAC's
curvature in the Kronecker eigenbasis ``Q = Q_G ⊗ Q_A`` is the diagonal ``d_G d_Aᵀ``.
EK-FAC replaces that diagonal by the second moment of the per-row gradients measured in
the same basis: for a row with activation ``ã`` (a trailing 1 for the bias) and scaled
output gradient ``δ`` the row's gradient is ``δ ãᵀ``, its projection ``Q_Gᵀ δ ãᵀ Q_A``, and

    s = mean_rows (Q_Gᵀ δ)² (Q_Aᵀ ã)ᵀ²          an ``[out, in(+1)]`` matrix

(the outer product of the squared projections: the projection of a rank-one matrix is
rank one). The update is ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (s + λ)] Q_Aᵀ``, i.e.
``Q (diag(s) + λ)⁻¹ Qᵀ vec(∇)``.

Schedule. The eigenbases are recomputed every ``inv_update_steps`` steps, as in K-FAC;
``s`` is re-estimated on every statistics step (``factor_update_steps``). The per-row
pairing of ``ã`` and ``δ`` uses the capture's call token: ``observe_activations`` returns
the squared projected activation rows, which come back with the output gradient of the
same forward call. Rows are projected with the basis current during the forward and
backward passes, i.e. the one the last refresh produced. ``apply`` reads ``s``, so the
spec sets ``apply_reads_statistics``: on statistics steps the engine folds the (reduced)
statistics before it applies, at every world size alike.

Initialisation of ``s`` after a basis change. A new basis makes the old ``s`` meaningless
(it was measured along other directions), and the rows of the step that refreshed were
projected on the old basis. So a refresh sets ``s = d_G d_Aᵀ`` (K-FAC's scaling in
the new basis: the best estimate available before any row was projected on it) and
restarts the running average: the n-th statistics step after the refresh folds ``s_new``
with weight ``1 / w_n``, ``w_n = decay · w_{n−1} + 1``, ``w_0 = 0`` (a bias-corrected
exponential average: the first measurement replaces the K-FAC scaling, later ones
approach weight ``1 − decay``). Consequently ``inv_update_steps`` must exceed
``factor_update_steps`` for the correction to act at all (with both 1 every step refreshes
the basis and EK-FAC applies K-FAC's scaling); EK-FAC's default is ``inv_update_steps=10``.

Directions the basis cannot tell apart. Within a cluster of (numerically) equal
eigenvalues -- above all the null space of a factor that has seen fewer rows than its
dimension, e.g. a wide layer early in training -- ``eigh`` may return any orthonormal
basis of the cluster, and the last bits of the factor decide which: the same rows summed
in another order (one process, or several ranks' partial sums) give another basis. K-FAC
and Shampoo do not notice (their scaling is constant on a cluster), but a diagonal ``s``
measured in an arbitrary basis of the cluster is arbitrary too. So ``s`` is averaged over
each cluster (columns over A's clusters, rows over G's): ``Σ_{j∈C} (q_jᵀ ã)² = ‖P_C ã‖²``
does not depend on the basis, and neither does the update on the cluster,
``Q_C (s̄ + λ)⁻¹ Q_Cᵀ = (s̄ + λ)⁻¹ P_C``. A cluster takes the eigenvalues within
``(n · eps + √n · eps_factor) · max(d)`` of its smallest one (:func:`eigenvalue_clusters`):
``eps`` of the dtype ``eigh`` ran in (float32 for a bfloat16 ``inv_dtype``), ``eps_factor``
of the one the factors were summed in -- how far apart a null space's eigenvalues come out.
Anchored, not chained, so that distinct eigenvalues of a decaying spectrum stay apart; found
on refreshes, on the device, and applied where ``s`` is folded or reset.

Where things live. Every rank projects its own rows, so every rank needs the bases: they
are the layer's ``statistics_tensors`` (the engine broadcasts them to all ranks when a
layer has fewer gradient workers than ranks, and non-gradient-workers keep them when the
engine releases the rest). ``s`` is derived from the reduced statistics on each gradient
worker (every gradient worker folds the same sums, so they agree without a broadcast).
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence, cast

import torch

from kron_precond import validation as check
from kron_precond.enums import ComputeMethod
from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import Option, Selected, moved, tensor_bytes
from kron_precond.methods.kfac import FACTORS, KFACLayer, KFACSpec, _decomposition_dtype
from kron_precond.schedules import StepContext


class EKFACLayer(KFACLayer):
    """K-FAC's factors and eigenbases plus the eigenbasis scaling ``s`` of one layer.

    Takes :class:`KFACLayer`'s arguments; the decomposition is always EIGEN and no
    ``1 / (d_G d_Aᵀ + λ)`` is cached (``s`` changes on every statistics step).
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.update(compute_method=ComputeMethod.EIGEN, eigenvalue_outer_product=False)
        super().__init__(*args, **kwargs)
        # s and its sums in float32 or better: they hold fourth powers of the rows.
        self.scaling_dtype = torch.promote_types(self.factor_dtype, torch.float32)
        self._work_dtype = torch.promote_types(self.scaling_dtype, self.inv_dtype)
        # This step's Σ (Q_Gᵀδ)²(Q_Aᵀã)²ᵀ, kept flat: under symmetry_aware the engine
        # all-reduces 2-D statistics as symmetric matrices, which this one is not.
        self._s_sum: torch.Tensor | None = None
        self._s_rows = torch.zeros(1, dtype=self._rows.dtype, device=self._device)
        # The running scaling and its average's total weight (gradient workers only).
        self._scaling: torch.Tensor | None = None
        self._scaling_weight: torch.Tensor | None = None
        # Per factor, the cluster index of each eigenvalue and each cluster's size (see
        # "Directions the basis cannot tell apart"): found from the bases' eigenvalues when
        # first needed after a refresh, a load or a move.
        self._clusters: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ placement
    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """K-FAC's move, plus the scaling ``s`` (in float32 or better of the new factor dtype)."""
        super().to(device, dtype)
        self.scaling_dtype = torch.promote_types(self.factor_dtype, torch.float32)
        self._work_dtype = torch.promote_types(self.scaling_dtype, self.inv_dtype)
        self._s_sum = moved(self._s_sum, device, self.scaling_dtype)
        self._s_rows = moved(self._s_rows, device, self._rows.dtype)
        self._scaling = moved(self._scaling, device, self.scaling_dtype)
        self._scaling_weight = moved(self._scaling_weight, device, self.scaling_dtype)
        self._clusters = {}

    # ------------------------------------------------------------------ observe
    def activation_terms(self, rows: torch.Tensor) -> Any:
        """K-FAC's terms of A, ``(Q_Aᵀ ã)²`` per kept row and the call's row count: the last two
        are the token the capture hands back with this call's output gradient."""
        rows_seen = rows.shape[0]  # before the subset: the pairing check compares whole calls
        terms = super().activation_terms(rows)
        rows = self.statistics_subset(rows)
        q_a = self._basis("A")
        rows = rows.to(self._work_dtype)
        d = rows.shape[1]
        projected = rows @ q_a[:d]
        if self.has_bias:
            projected = projected + q_a[d]  # the ones column of ã
        return terms, projected.square_(), rows_seen

    def add_activation_terms(self, terms: Any) -> Any:
        """Accumulate A's statistics; returns the call's token."""
        a_terms, token, rows_seen = terms
        super().add_activation_terms(a_terms)
        return token, rows_seen

    def observe_output_grads(self, rows: torch.Tensor, scale: float, call: Any = None) -> None:
        """Accumulate G's statistics and, paired with the same call's activation token,
        ``Σ (Q_Gᵀ δ)² (Q_Aᵀ ã)²ᵀ`` over the rows (``δ = scale · rows``)."""
        super().observe_output_grads(rows, scale)
        if call is None:  # activations of this call were not seen: nothing to pair
            return
        call, activation_rows = call
        if activation_rows != rows.shape[0]:
            raise RuntimeError(f"kron_precond: {self.name} saw {activation_rows} activation rows but "
                               f"{rows.shape[0]} output-gradient rows in one call")
        rows, usable = self.usable_rows(rows)
        projected = (rows.to(self._work_dtype) @ self._basis("G")).mul_(scale).square_()
        self._held_s_sum().view(self.g_dim, self.a_dim).addmm_(projected.t().to(self.scaling_dtype),
                                                         call.to(self.scaling_dtype))
        self._s_rows.add_(usable.to(self._s_rows.dtype) * rows.shape[0])

    def _held_s_sum(self) -> torch.Tensor:
        """This step's flat sum of ``s``, allocated with K-FAC's sums (``_allocate_statistics``)."""
        assert self._s_sum is not None, f"{self.name}: the scaling's sum is not allocated"
        return self._s_sum

    def _held_scaling(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running scaling ``s`` and its average's weight (allocated together by ``_reset_scaling``)."""
        assert self._scaling is not None and self._scaling_weight is not None, f"{self.name}: no scaling held"
        return self._scaling, self._scaling_weight

    def _basis(self, part: str) -> torch.Tensor:
        return self._allocated()[part][0].to(self._work_dtype)

    def _allocate_statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        sums = super()._allocate_statistics()
        if self._s_sum is None:
            self._s_sum = torch.zeros(self.g_dim * self.a_dim, dtype=self.scaling_dtype, device=self._device)
        return sums

    def shared_statistics(self) -> list[torch.Tensor]:
        """K-FAC's sums and counts, then the scaling's sum (flat) and its row count."""
        shared = super().shared_statistics()  # allocates the sums, the scaling's too
        return shared + [self._held_s_sum(), self._s_rows]

    def fold_statistics(self, ctx: StepContext) -> None:
        """Fold ``s`` (on gradient workers), then K-FAC's factors."""
        if self._a_sum is None:  # nothing observed on this statistics step: K-FAC counts it as missed
            super().fold_statistics(ctx)
            return
        if self.holds_state and self._scaling is not None:
            self._fold_scaling(ctx["factor_decay"])
        super().fold_statistics(ctx)

    def _fold_scaling(self, decay: float) -> None:
        rows = self._s_rows[0]
        new = self._pooled(self._held_s_sum().view(self.g_dim, self.a_dim) / rows.clamp_min(1.0).to(self.scaling_dtype))
        finite = torch.isfinite(new).all()
        has_rows = rows > 0
        # rows projected on a basis that never held data say nothing
        refreshed = self._refreshed_state()
        basis_valid = (refreshed["A"][-1] * refreshed["G"][-1]).bool().reshape(())
        accept = finite & has_rows & basis_valid
        scaling, scaling_weight = self._held_scaling()
        weight = scaling_weight * decay + 1.0
        updated = scaling + (new - scaling) / weight
        scaling.copy_(torch.where(accept, updated, scaling))
        scaling_weight.copy_(torch.where(accept, weight, scaling_weight))
        self.nonfinite.add_((has_rows & ~finite).to(self.nonfinite.dtype))

    def discard_statistics(self) -> None:
        super().discard_statistics()
        self._s_sum = None
        self._s_rows.zero_()

    def has_pending_statistics(self) -> bool:
        return super().has_pending_statistics() or self._s_sum is not None

    # ------------------------------------------------------------------ refresh
    def statistics_tensors(self, part: str) -> list[torch.Tensor]:
        """The eigenbasis ``Q`` of ``part``: every rank projects its rows on it."""
        return [self._allocated()[part][0]]

    def finalize_refresh(self, ctx: StepContext) -> None:
        """Take this refresh's damping and the new bases' clusters; restart ``s`` from
        K-FAC's scaling ``d_G d_Aᵀ`` with weight 0 (the next statistics replace it)."""
        if not ctx.statistics_count:
            return
        super().finalize_refresh(ctx)
        self._reset_scaling()

    def _finalize(self, damping: float) -> None:
        """K-FAC's; the bases may have changed, so their clusters are found anew."""
        super()._finalize(damping)
        self._clusters = {}

    def _pooled(self, scaling: torch.Tensor) -> torch.Tensor:
        """``scaling`` averaged over each cluster of A's eigenvalues (columns) and of G's
        (rows): the part of it that does not depend on the basis ``eigh`` chose."""
        if not self._clusters:
            eps = torch.finfo(_decomposition_dtype(self.inv_dtype)).eps  # eigh's dtype, not the stored one
            factor_eps = torch.finfo(self.statistics_dtype).eps  # what the factors were summed in
            self._clusters = {part: eigenvalue_clusters(self._allocated()[part][1], eps, factor_eps)
                              for part in FACTORS}
        for dim, part in ((1, "A"), (0, "G")):
            index, size = self._clusters[part]
            sums = torch.zeros_like(scaling).index_add_(dim, index, scaling)
            means = sums / size.to(scaling.dtype).unsqueeze(1 - dim)
            scaling = means.index_select(dim, index)
        return scaling

    def _reset_scaling(self) -> None:
        d_a = self._allocated()["A"][1].to(self.scaling_dtype)
        d_g = self._allocated()["G"][1].to(self.scaling_dtype)
        if self._scaling is None:
            self._scaling = torch.empty(self.g_dim, self.a_dim, dtype=self.scaling_dtype, device=self._device)
            self._scaling_weight = torch.zeros((), dtype=self.scaling_dtype, device=self._device)
        scaling, scaling_weight = self._held_scaling()
        scaling.copy_(self._pooled(torch.outer(d_g, d_a)))
        scaling_weight.zero_()

    def release_refreshed(self) -> None:
        """Drop what only ``apply`` needs; keep the bases, which this rank still projects on."""
        self._scaling = self._scaling_weight = None
        self._inverse_denominator = None
        self.ready = False

    # ------------------------------------------------------------------ apply
    def apply(self, grads: list[torch.Tensor], ctx: StepContext | None = None) -> list[torch.Tensor]:
        if self._scaling is None:  # no scaling estimated yet: pass through
            return grads
        return super().apply(grads, ctx)  # K-FAC's, through this class's precondition_matrix

    def precondition_matrix(self, grad: torch.Tensor) -> torch.Tensor:
        """``Q_G [(Q_Gᵀ ∇ Q_A) / (s + λ)] Q_Aᵀ``."""
        refreshed = self._refreshed_state()
        q_a = refreshed["A"][0]
        q_g = refreshed["G"][0]
        rotated = q_g.t() @ grad @ q_a
        work = torch.promote_types(self._work_dtype, torch.float32)
        assert self._damping_used is not None, f"{self.name}: applied before its first refresh was finalised"
        inverse = (1.0 / (self._held_scaling()[0].to(work) + self._damping_used)).to(rotated.dtype)
        return q_g @ (rotated * inverse) @ q_a.t()

    def batch_key(self) -> Hashable | None:
        if not self.ready or self._scaling is None:
            return None  # passes gradients through: nothing to batch
        # the damping too, as K-FAC's: each layer holds the value of its own last refresh, and a
        # layer left alone on a refresh step (partly frozen) keeps an older one than its neighbours
        return (type(self), self.weight_shape, self.weight_transposed, self.has_bias, self.inv_dtype,
                self.scaling_dtype, self._damping_used)

    @classmethod
    def apply_batch(cls, layers: Sequence["EKFACLayer"], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """All layers of one shape at once: K-FAC's batched EIGEN products with the
        denominator ``1 / (s + λ)`` in place of ``1 / (d_G d_Aᵀ + λ)``.

        The first call stacks the layers' bases, validity flags and scalings and makes each
        layer's tensors views into the stacks (refreshes, broadcasts and folds write in
        place), so a step copies nothing; the denominator is formed once per group and step.
        """
        stacks = cache.get("ekfac")
        if stacks is None:
            stacks = cache["ekfac"] = _adopt_into_stacks(layers)
        q_a, valid_a, q_g, valid_g, scaling = stacks
        first = layers[0]
        work = torch.promote_types(first._work_dtype, torch.float32)
        assert first._damping_used is not None, "a ready layer holds the damping of its refresh"
        denominator = (1.0 / (scaling.to(work) + first._damping_used)).to(first.inv_dtype)
        # K-FAC's batched apply reads only Q, validity and the denominator of its stacks
        kfac_view = {"stacked": {"A": [q_a, None, valid_a], "G": [q_g, None, valid_g], "denominator": denominator}}
        return super().apply_batch(layers, grads, ctx, kfac_view, keep)  # K-FAC's, with cls bound

    # ------------------------------------------------------------------ estimates, state
    def memory_by_kind(self) -> dict[str, int]:
        held = [] if self._refreshed is None else [t for part in FACTORS for t in self._refreshed[part]]
        return {
            "factors": tensor_bytes([self.a_factor, self.g_factor]),
            "statistics": tensor_bytes([self._a_sum, self._g_sum, self._rows, self._s_sum, self._s_rows]),
            "decompositions": tensor_bytes(held),
            "scalings": tensor_bytes([self._scaling, self._scaling_weight]),
        }

    def state_dict(self) -> dict[str, Any]:
        """K-FAC's state and the scaling. The scaling is saved as tensors even before the first
        refresh (zeros, ``scaling_held=False``): ``torch.distributed.checkpoint`` loads into the
        entries of the state it is given, so a fresh preconditioner's must match a trained one's."""
        state = super().state_dict()
        held = self._scaling is not None and self._scaling_weight is not None
        if held:
            scaling, weight = self._held_scaling()
            state["scaling"], state["scaling_weight"] = scaling.clone(), weight.clone()
        else:
            state["scaling"] = torch.zeros(self.g_dim, self.a_dim, dtype=self.scaling_dtype, device=self._device)
            state["scaling_weight"] = torch.zeros((), dtype=self.scaling_dtype, device=self._device)
        state["scaling_held"] = held
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        if "scaling" not in state:
            raise ValueError(f"state of {self.name} has no EK-FAC scaling (saved by another method?)")
        scaling = state["scaling"]
        if scaling is None or not state.get("scaling_held", True):  # saved before the first refresh
            return
        where = f"state of {self.name}"
        # checked like the factors: a NaN scaling (a diverged run) is applied on every step until
        # the next refresh, so it is refused here rather than trusted. Both are >= 0: s is a mean
        # of squares (the step divides by s + damping), its weight a sum of decayed ones
        checks.float_tensor(scaling, (self.g_dim, self.a_dim), f"{where}: scaling", non_negative=True)
        checks.float_tensor(checks.entry(state, "scaling_weight", where), (), f"{where}: scaling_weight",
                            non_negative=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        super().load_state_dict(state)
        self._clusters = {}
        if state["scaling"] is None or not state.get("scaling_held", True):  # nothing measured yet
            self._scaling = self._scaling_weight = None
            return
        if self._scaling is None:
            self._reset_scaling()  # allocates
        scaling, scaling_weight = self._held_scaling()
        scaling.copy_(state["scaling"])
        scaling_weight.copy_(state["scaling_weight"])


def _adopt_into_stacks(layers: Sequence[EKFACLayer]) -> list[torch.Tensor]:
    """Stack ``Q_A``, A's validity, ``Q_G``, G's validity and ``s`` over the layers and
    re-point each layer at its slice."""
    count = len(layers)
    stacks = []
    refreshed = [layer._refreshed_state() for layer in layers]
    for part in FACTORS:
        for index in (0, -1):  # the basis and the one-element validity flag
            stack = torch.stack([state[part][index] for state in refreshed])
            for state, view in zip(refreshed, stack.unbind(0)):
                state[part][index] = view
            stacks.append(stack if index == 0 else stack.reshape(count))
    # batch_key groups only layers that hold a scaling
    stack = torch.stack(cast(list[torch.Tensor], [layer._scaling for layer in layers]))
    for layer, view in zip(layers, stack.unbind(0)):
        layer._scaling = view
    stacks.append(stack)
    return stacks


def eigenvalue_clusters(eigenvalues: torch.Tensor, eps: float | None = None,
                        factor_eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """For ascending ``eigenvalues`` of one factor: each one's cluster index and each
    cluster's size (``n`` entries, zero past the last cluster, clamped to 1).

    A cluster starts at its smallest eigenvalue and takes every later one within
    ``(n · eps + √n · factor_eps) · max|d|`` of it: how far apart eigenvalues that are equal
    in exact arithmetic (a null space) may come out. ``n · eps · ‖A‖`` bounds the error of a
    decomposition run at ``eps`` (by default the eigenvalues' dtype's, float32's for
    bfloat16: no decomposition runs coarser); ``√n · factor_eps · ‖A‖ ≥ ‖E‖_F`` bounds a
    factor rounded entrywise to ``factor_eps`` (what a float32 factor brings to a float64
    decomposition). Anchored, not chained: neighbours each closer than that to the previous
    one would chain a decaying spectrum's tail far up into one cluster of eigenvalues that
    differ many times over. Compared in float32 or finer.

    On the device, no host sync: the cluster starts are the orbit of the first eigenvalue
    under "the next eigenvalue out of reach", found by doubling the jump ``⌈log₂(n+1)⌉`` times.
    """
    n = eigenvalues.shape[0]
    values = eigenvalues.to(torch.promote_types(eigenvalues.dtype, torch.float32))
    eps = torch.finfo(values.dtype).eps if eps is None else eps
    tolerance = (n * eps + n**0.5 * factor_eps) * values.abs().max()
    # out of reach of i: the first index whose value exceeds values[i] + tolerance (n: none)
    jump = torch.searchsorted(values, values + tolerance, right=True)
    jump = torch.cat([jump, jump.new_full((1,), n)])  # n jumps to itself
    # starts reached from 0 in fewer than 2^k jumps, k = 0, 1, ... (at most n - 1 are needed)
    start = torch.zeros(n + 1, dtype=torch.long, device=values.device)
    start[0] = 1
    for _ in range(n.bit_length()):
        start = start | (torch.zeros_like(start).index_add_(0, jump, start) > 0).long()
        jump = jump[jump]
    index = start[:n].cumsum(0) - 1
    size = torch.zeros(n, dtype=torch.long, device=values.device).index_add_(0, index, torch.ones_like(index))
    return index, size.clamp_min(1)


class EKFACSpec(KFACSpec):
    """EK-FAC (George et al., 2018): K-FAC's eigenbases, refreshed every
    ``inv_update_steps``, with the diagonal scaling in that basis re-estimated from the
    projected per-row gradients on every statistics step. Linear / ConvNd layers."""

    name = "ekfac"
    owner_only_statistics = False  # gradient workers fold the scaling s themselves
    options = {name: option for name, option in KFACSpec.options.items()
               if name not in ("compute_method", "compute_eigenvalue_outer_product", "max_factor_size",
                                "grafting")}
    options["inv_update_steps"] = Option(10, check.check_int, per_step="always", collective=True)
    #: ``apply`` divides by the scaling folded from each statistics step
    apply_reads_statistics = True
    layer_class = EKFACLayer

    def make_layer(self, index: int, selected: Selected) -> EKFACLayer:
        # layer_class is EKFACLayer
        return cast(EKFACLayer, self._make_factored_layer(selected))

    def describe(self) -> dict[str, Any]:
        return dict(self.settings)
