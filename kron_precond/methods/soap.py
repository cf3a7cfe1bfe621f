"""SOAP-style second moments in Shampoo's eigenbasis, in front of another optimizer.

SOAP (Vyas et al., 2024) runs Adam in the eigenbasis of Shampoo's statistics; modded-nanogpt's
optimisation track puts that rotation in front of Muon's Newton-Schulz with bases refreshed by
one warm-started QR step. Here, for a Linear / ConvNd layer with gradient matrix
``V = [W | b]`` (``[out, in(+1)]``):

    statistics steps:  L ← β L + V Vᵀ     R ← β R + Vᵀ V     c ← β c + 1
    refresh steps:     Q_L, Q_R: eigenbases of L / c and R / c, from ``eigh`` the first time
                       and then by one step of subspace iteration, ``Q ← qr((L / c) Q)``
                       on Q's columns sorted by ``diag(Qᵀ (L / c) Q)``, descending (SOAP's rule)
    every step:        V' = Q_Lᵀ V Q_R      m ← β₂ m + (1 − β₂) V'²
                       V ← Q_L (V' / (√(m / (1 − β₂ᵗ)) + ε)) Q_Rᵀ

A side wider than ``max_factor_size`` keeps the identity as its basis (one-sided SOAP).
The moment ``m`` is plain per-step state on the layer's gradient workers; a new basis does
not rotate it (as SOAP). A plain step is four batched matmuls per group of equally shaped
layers and an elementwise update: no statistics, no host sync.

**Bases ``eigh`` may choose freely.** Where the statistic has a repeated eigenvalue (at
float64's resolution; e.g. a rank-deficient ``L`` or ``R``: early steps, small batches) the
eigenbasis of that
eigenspace is arbitrary -- the last bits of the statistic decide it, so it differs between
world sizes -- and an elementwise moment measured in it would differ too. As for EK-FAC
(``docs/design.md``), such a layer's moment is averaged over each block of (cluster of
``L``'s eigenvalues) x (cluster of ``R``'s): the block average and the update it gives do
not depend on the basis chosen inside a cluster. A warm start from an arbitrary basis would
carry the arbitrariness into the next basis, so a side whose basis had a repeated eigenvalue
is decomposed afresh by ``eigh`` at its next refresh. With distinct eigenvalues (the usual
case once the statistics hold more gradients than the side's dimension) neither applies.
A side whose eigenvalue estimates are all zero -- no refresh has measured it yet (its starting
identity), or its statistic holds nothing -- has no eigenvalues to pool over or warm-start
from: its moment stays elementwise, as before the first refresh, and its next refresh uses
``eigh``.

**Checkpoints.** Everything a step reads is saved or derived from what is: the warm-start flags
and clusters come from the bases, and ``used_since_refresh`` holds whether the layer had a
finite gradient (an expert: one that is not all zeros) since its last refresh, which decides whether
the next refresh moves it. A checkpoint without that entry loads as a layer without gradients
since its last refresh.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence, cast

import torch

from kron_precond import validation as check
from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import GradientMatrix, LayerMethod, MethodSpec, Option, Selected, moved, tensor_bytes
from kron_precond.methods.ekfac import eigenvalue_clusters
from kron_precond.methods.second_moment import (
    count_updates,
    idle_experts,
    is_zero,
    scale_by_moment,
    stacked,
    update_counter,
)
from kron_precond.methods.shampoo import eigh_with_retry
from kron_precond.modules import find_kfac_modules
from kron_precond.schedules import IntervalSchedule, StepContext

SIDES = ("L", "R")


class SOAPLayer(GradientMatrix, LayerMethod):
    """Statistics, eigenbases and the rotated second moment of one Linear / ConvNd layer.

    Args:
        name: qualified module name, used in warnings.
        weight_shape, has_bias, weight_transposed: the gradient matrix's layout.
        max_factor_size: a side wider than this keeps the identity basis.
        moment_decay, moment_eps: β₂ and ε of the rotated second moment.
        factor_dtype: dtype of the statistics and bases (float32 or better).
    """

    def __init__(self, name: str, weight_shape: torch.Size, has_bias: bool, *, weight_transposed: bool,
                 max_factor_size: int, moment_decay: float, moment_eps: float, factor_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.name = name
        self.set_matrix_layout(weight_shape, has_bias, weight_transposed)
        self.dims = {"L": self.g_dim, "R": self.a_dim}
        self.active = tuple(side for side in SIDES if self.dims[side] <= max_factor_size)
        # a part per side with a basis; a layer with none still needs one for its placement
        self.parts = self.active or ("moment",)
        self.moment_decay, self.moment_eps = moment_decay, moment_eps
        self.factor_dtype = factor_dtype
        self.device = device
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self._stats: dict[str, torch.Tensor] | None = None  # gradient workers, on first use
        self._mass: torch.Tensor | None = None
        self._bases: dict[str, list[torch.Tensor]] | None = None  # side -> [Q, eigenvalue estimates]
        self.moment: torch.Tensor | None = None
        self.updates = update_counter(device)  # moment updates
        # whether the layer had gradients (not None) since its last refresh, on the host, the same
        # on every rank: a refresh of a layer that had none (a branch not taken) is skipped, where
        # it would move the basis by another warm-started iteration and re-pool the moment
        self._used = False
        # The same on the device, for the gradients that count: whether the layer had a finite
        # gradient since its last refresh (an expert of a fused experts module: also not all
        # zeros; an idle expert's zeros are no gradient: second_moment.idle_experts). A non-finite
        # gradient leaves every state unchanged, so a refresh after only such gradients (``_used``
        # set, this not) is that of a layer not used: its result is dropped on the device, no host
        # sync. Set by observe_gradients on refresh steps and by apply on the others (the
        # gradient's finiteness, as apply's); read by refresh on the device and by finalize_refresh
        # in the host read it makes anyway.
        self._fresh = torch.zeros((), dtype=torch.bool, device=device)
        # Derived at each refresh from the (broadcast) bases, identically on every gradient
        # worker, and at a load from the loaded ones (a function of the bases alone, so a resumed
        # run holds what the uninterrupted one does): the sides whose next refresh may
        # warm-start, and the clusters to average the moment over (None: every eigenvalue
        # distinct, or none measured yet).
        self._warm = {side: False for side in self.active}
        self._clusters: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    factor_dtype_follows = False  # factor_dtype was not given: float32 or better of the parameters'
    expert = False  # one expert of a fused experts module (second_moment.idle_experts); set by make_layer

    # ------------------------------------------------------------------ state allocation
    def _statistics(self) -> dict[str, torch.Tensor]:
        if self._stats is None:
            kw: dict[str, Any] = dict(device=self.device, dtype=self.factor_dtype)
            self._stats = {side: torch.zeros(self.dims[side], self.dims[side], **kw) for side in self.active}
            self._mass = torch.zeros((), **kw)
        return self._stats

    def _allocated(self) -> dict[str, list[torch.Tensor]]:
        """Bases start as the identity (the moment alone, Adam's, until the first refresh)."""
        if self._bases is None:
            kw: dict[str, Any] = dict(device=self.device, dtype=self.factor_dtype)
            self._bases = {side: [torch.eye(self.dims[side], **kw), torch.zeros(self.dims[side], **kw)]
                           for side in self.active}
            self.moment = torch.zeros(self.g_dim, self.a_dim, **kw)
        return self._bases

    def _held_mass(self) -> torch.Tensor:
        """The statistics' total weight ``c``, allocated with them (:meth:`_statistics`)."""
        assert self._mass is not None, f"{self.name}: no statistics held on this rank"
        return self._mass

    def _held_moment(self) -> torch.Tensor:
        """The rotated second moment, allocated with the bases (:meth:`_allocated`)."""
        assert self.moment is not None, f"{self.name}: no moment held on this rank"
        return self.moment

    # ------------------------------------------------------------------ statistics
    def observe_gradients(self, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:
        """On statistics steps, fold ``V Vᵀ`` and ``Vᵀ V`` into the statistics (gradient workers
        only); a non-finite gradient leaves them unchanged (decided on the device) and is counted.
        So does an idle expert's gradient of zeros (not counted: a layer not called). On refresh
        steps, whether this gradient counts for the refresh (``_fresh``: finite, and an expert's
        not all zeros)."""
        if any(g is None for g in grads):
            return
        self._used = True
        gather = ctx.statistics and bool(self.active)
        if not self.holds_state or not (gather or ctx.refresh):
            return
        present = cast(Sequence[torch.Tensor], grads)  # none is None: returned above otherwise
        raw = self.grads_to_matrix([g.detach() for g in present])
        idle = None
        if self.expert:  # per layer, on statistics and refresh steps only (per layer anyway)
            idle = is_zero(raw)
        if ctx.refresh:  # this step's gradient counts for this refresh (apply: the other steps)
            counts = torch.isfinite(raw).all()
            self._fresh |= counts if idle is None else counts & ~idle
        if not gather:
            return
        decay = ctx["factor_decay"]
        stats = self._statistics()
        matrix = raw.to(self.factor_dtype)
        products = {"L": (matrix, matrix.t()), "R": (matrix.t(), matrix)}
        updated = {side: torch.addmm(stats[side], *products[side], beta=decay) for side in self.active}
        finite = torch.stack([torch.isfinite(u).all() for u in updated.values()]).all()
        accept = finite if idle is None else finite & ~idle
        for side, new in updated.items():
            stats[side].copy_(torch.where(accept, new, stats[side]))
        mass = self._held_mass()
        mass.copy_(torch.where(accept, mass * decay + 1.0, mass))
        self.nonfinite.add_((~finite).to(self.nonfinite.dtype))

    # ------------------------------------------------------------------ refresh
    def refresh(self, part: str, grads, ctx: StepContext) -> None:
        """The eigenbasis of one side (on its owner): ``eigh`` the first time and after a
        repeated eigenvalue, else one warm-started subspace-iteration step. The previous basis
        is kept if the statistic holds nothing or the decomposition fails; a layer without
        gradients since its last refresh is left as it is: skipped on the host (none was given),
        or its result dropped on the device (none was finite; an expert's: none was not all
        zeros)."""
        if part not in self.active or not self._used:
            return
        basis, estimates = self._allocated()[part]
        stats = self._statistics()
        mass = self._held_mass()
        average = stats[part] / mass.clamp_min(torch.finfo(self.factor_dtype).tiny)
        if self._warm[part]:
            # SOAP's refresh: one QR step on the columns sorted by their estimated eigenvalues
            # diag(Qᵀ L Q), descending, so that a column keeps its direction when eigenvalues
            # change order (unsorted, the QR step turns each column toward the eigenvector of its
            # rank, and the moment entries it carries to another). The result is put back in the
            # old column order, where the moment (on the gradient workers) already is.
            power = average @ basis
            order = torch.argsort((basis * power).sum(0), descending=True, stable=True)
            restore = torch.argsort(order)
            q, r = torch.linalg.qr(power[:, order])
            q, values = q[:, restore], r.diagonal().abs()[restore]
        else:
            result = _descending_eigh(average, f"{self.name}.{part}")
            if result is None:
                return
            values, q = result
        # a layer whose gradients since its last refresh were all non-finite (an expert: also
        # idle) is left as it is, as one not used
        valid = (mass > 0) & torch.isfinite(q).all() & torch.isfinite(values).all() & self._fresh
        basis.copy_(torch.where(valid, q, basis))
        estimates.copy_(torch.where(valid, values, estimates))

    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        bases = self._allocated()
        sides = self.active if part is None else [side for side in self.active if side == part]
        return [t for side in sides for t in bases[side]]

    def finalize_refresh(self, ctx: StepContext) -> None:
        """Find each side's clusters of equal eigenvalues (one host sync per layer, on refresh
        steps only); with any repeated eigenvalue, average the moment over the blocks. A layer
        without gradients since its last refresh (none given; none finite, read in the same host
        sync) is left as it is."""
        if not self._used:
            return
        self._used = False
        fresh = self._fresh.clone()
        self._fresh.zero_()
        self._derive_from_bases(pool_moment=True, fresh=fresh)

    def _derive_from_bases(self, pool_moment: bool, fresh: torch.Tensor | None = None) -> None:
        """The warm-start flags and clusters of equal eigenvalues, from the bases; with
        ``pool_moment``, the moment averaged over the blocks (a checkpoint holds it averaged
        already: averaging it again moves its last bits, which near-equal eigenvalues grow).
        A side whose estimates are all zero (none measured: the starting identity, or a
        statistic holding nothing) is neither warm-started nor pooled over, as before the
        first refresh: a function of the bases alone, so a load derives what the run held.
        ``fresh`` False (no finite gradient since its last refresh; an expert: none not all
        zeros; read in the same host sync): nothing changes, as for a layer not used."""
        bases = self._allocated()
        if not self.active:
            return
        clusters = {side: _unsorted_clusters(bases[side][1]) for side in self.active}
        flags = [size.max() > 1 for _, size in clusters.values()]
        flags += [bases[side][1].any() for side in self.active]
        read = torch.stack(flags if fresh is None else flags + [fresh]).tolist()  # one host sync
        if fresh is not None and not read.pop():
            return
        count = len(self.active)
        repeated, measured = read[:count], read[count:]
        self._warm = {side: meas and not rep for side, rep, meas in zip(self.active, repeated, measured)}
        pooled = any(rep and meas for rep, meas in zip(repeated, measured))
        self._clusters = ({side: clusters[side] for side, meas in zip(self.active, measured) if meas}
                          if pooled else None)
        if self._clusters is not None and pool_moment:
            moment = self._held_moment()
            moment.copy_(self._pooled(moment))

    def _pooled(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (``[out, in(+1)]``) averaged over each block of equal eigenvalues."""
        clusters = self._clusters
        assert clusters is not None, f"{self.name}: pooled without repeated eigenvalues"
        for dim, side in ((0, "L"), (1, "R")):
            if side not in clusters:
                continue
            index, size = clusters[side]
            sums = torch.zeros_like(values).index_add_(dim, index, values)
            values = (sums / size.to(values.dtype).unsqueeze(1 - dim)).index_select(dim, index)
        return values

    def release_refreshed(self) -> None:
        """Drop every state (on ranks that are not gradient workers of this layer)."""
        self._bases = self._stats = self._mass = self.moment = None
        self._clusters = None

    # ------------------------------------------------------------------ apply
    def apply(self, grads: list[torch.Tensor], ctx: StepContext | None = None) -> list[torch.Tensor]:
        matrix = self.grads_to_matrix(grads)
        keep = torch.isfinite(matrix).all()
        use = keep
        if self.expert:  # an idle expert is a layer not called: its moment and count left alone
            use = keep & ~is_zero(matrix)
        if ctx is None or not ctx.refresh:  # counts for the next refresh (on refresh steps: observe_gradients)
            self._fresh |= use
        bases = self._allocated()
        self.updates.add_(use.to(self.updates.dtype))
        pool = self._pooled if self._clusters is not None else None
        out = _rotated_step(matrix, {side: bases[side][0] for side in self.active}, self._held_moment(),
                            self.moment_decay, self.moment_eps, self.updates, use, pool)
        return self.matrix_to_grads(torch.where(use, out, matrix))

    def batch_key(self) -> Hashable | None:
        if self._clusters is not None:
            return None  # the block averages are per layer
        return (type(self), self.weight_shape, self.weight_transposed, self.has_bias, self.active, self.factor_dtype)

    @classmethod
    def apply_batch(cls, layers: Sequence["SOAPLayer"], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """Layers of one shape at once: bases and moments are stacked once (each layer's
        tensors become views, so refreshes and broadcasts in place update the stacks). A
        layer whose moment is averaged over blocks comes alone (``batch_key``)."""
        if layers[0]._clusters is not None:
            return super().apply_batch(layers, grads, ctx, cache, keep)
        stacks = cache.get("stacks")
        # a layer that was averaged alone in the meantime may have joined another stack
        if stacks is None or any(layer.moment is not view for layer, view in zip(layers, stacks["views"])):
            stacks = cache["stacks"] = _adopt_into_stacks(layers)
        first = layers[0]
        matrices = cls.stack_matrices(layers, grads)
        idle = idle_experts(layers, matrices, cache)
        use = keep
        if idle is not None:  # an idle expert is a layer not called: its moment and count left alone
            use = keep & ~idle
        if not ctx.refresh:  # counts for the next refresh (on refresh steps: observe_gradients)
            stacked(layers, "_fresh", cache).logical_or_(use.reshape(-1))
        updates = count_updates(layers, use, cache)
        out = _rotated_step(matrices, stacks["bases"], stacks["moment"], first.moment_decay, first.moment_eps,
                            updates, use, None)
        return cls.unstack_matrices(layers, torch.where(use.reshape(-1, 1, 1), out, matrices))

    # ------------------------------------------------------------------ estimates
    def factor_costs(self) -> dict[str, tuple[float, float]]:
        size = torch.empty((), dtype=self.factor_dtype).element_size()
        if not self.active:
            return {"moment": (0.0, float(self.g_dim * self.a_dim * size))}
        return {side: (float(self.dims[side]) ** 3, float(2 * self.dims[side] ** 2 * size)) for side in self.active}

    def memory_by_kind(self) -> dict[str, int]:
        stats = [] if self._stats is None else [*self._stats.values(), self._mass]
        bases = [] if self._bases is None else [t for pair in self._bases.values() for t in pair]
        return {"soap_statistics": tensor_bytes(stats), "soap_bases": tensor_bytes(bases),
                "moments": tensor_bytes([self.moment])}

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        if self.factor_dtype_follows:
            self.factor_dtype = torch.promote_types(dtype, torch.float32)
        fd = self.factor_dtype
        if self._stats is not None:
            self._stats = {k: moved(t, device, fd) for k, t in self._stats.items()}
            self._mass = moved(self._mass, device, fd)
        if self._bases is not None:
            self._bases = {k: [moved(t, device, fd) for t in v] for k, v in self._bases.items()}
            self.moment = moved(self.moment, device, fd)
        if self._clusters is not None:
            self._clusters = {k: (moved(index, device), moved(size, device))
                              for k, (index, size) in self._clusters.items()}
        self.nonfinite = moved(self.nonfinite, device)
        self.updates = moved(self.updates, device)
        self._fresh = moved(self._fresh, device)
        self.device = device

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The statistics, bases, moment and count, and ``used_since_refresh``: whether the next
        refresh moves the layer without another gradient (:meth:`_used_since_refresh`)."""
        stats, bases = self._statistics(), self._allocated()
        return {"sides": list(self.active), "statistics": {k: t.clone() for k, t in stats.items()},
                "mass": self._held_mass().clone(), "bases": {k: [t.clone() for t in v] for k, v in bases.items()},
                "moment": self._held_moment().clone(), "updates": int(self.updates),
                "used_since_refresh": self._used_since_refresh()}

    def _used_since_refresh(self) -> bool:
        """Whether the layer had a gradient since its last refresh, which its next refresh then
        acts on. Only a finite one counts (an expert's: also not all zeros): a layer whose
        gradients since its last refresh were all non-finite (or idle) is refreshed as a layer
        not used (its basis, moment and clusters stay as they are), so ``_used`` and ``_fresh``
        come down to one flag."""
        return self._used and bool(self._fresh)

    def check_state(self, state: dict[str, Any]) -> None:
        where = f"state of {self.name}"
        sides = checks.entry(state, "sides", where)
        if list(sides) != list(self.active):
            raise ValueError(f"{where} has bases for sides {list(sides)}, expected {list(self.active)} "
                             "(another layer shape, or another max_factor_size)")
        statistics, bases = checks.entry(state, "statistics", where), checks.entry(state, "bases", where)
        for side in self.active:
            dim = self.dims[side]
            checks.float_tensor(checks.entry(statistics, side, f"{where}: statistics"), (dim, dim),
                                f"{where}: statistics[{side!r}]")
            checks.tensor_list(checks.entry(bases, side, f"{where}: bases"), [[dim, dim], [dim]],
                               f"{where}: bases[{side!r}]")
        mass = checks.entry(state, "mass", where)
        checks.tensor_list([mass], [[]], f"{where}: mass")
        if bool(mass < 0):
            raise ValueError(f"{where}: mass holds a negative weight")
        # the rotated second moment, a mean of squares: a negative one makes the step's square root NaN
        checks.float_tensor(checks.entry(state, "moment", where), (self.g_dim, self.a_dim), f"{where}: moment",
                            non_negative=True)
        checks.integer(checks.entry(state, "updates", where), f"{where}: updates")
        if "used_since_refresh" in state:  # optional: a checkpoint without it loads with the default
            checks.boolean(state["used_since_refresh"], f"{where}: used_since_refresh")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        # a checkpoint without the flag: a layer without gradients since its last refresh
        used = bool(state.get("used_since_refresh", False))
        self._used = used
        self._fresh.fill_(used)  # in place: it may be a view into a stack
        if not self.holds_state:
            self.release_refreshed()
            return
        stats, bases = self._statistics(), self._allocated()
        for side in self.active:
            stats[side].copy_(state["statistics"][side])
            for dst, src in zip(bases[side], state["bases"][side]):
                dst.copy_(src)
        self._held_mass().copy_(state["mass"])
        self._held_moment().copy_(state["moment"])
        self.updates.fill_(int(state["updates"]))
        self._derive_from_bases(pool_moment=False)


# ---------------------------------------------------------------------- math
def _rotated_step(matrix: torch.Tensor, bases: dict[str, torch.Tensor], moment: torch.Tensor, decay: float,
                  eps: float, updates, keep: torch.Tensor, pool: Callable | None) -> torch.Tensor:
    """``Q_L (V' / (√m̂ + ε)) Q_Rᵀ`` with ``V' = Q_Lᵀ V Q_R``, ``matrix`` ``[(k,) out, in]``."""
    work = matrix.to(moment.dtype)
    if "L" in bases:
        work = bases["L"].transpose(-1, -2) @ work
    if "R" in bases:
        work = work @ bases["R"]
    work = scale_by_moment(work, moment, decay, eps, updates, keep, pool=pool)
    if "L" in bases:
        work = bases["L"] @ work
    if "R" in bases:
        work = work @ bases["R"].transpose(-1, -2)
    return work.to(matrix.dtype)


def _descending_eigh(average: torch.Tensor, label: str):
    """``(eigenvalues, eigenvectors)`` in descending order (what a warm-started QR step keeps:
    its leading columns converge to the leading eigenvectors), negative rounding clamped to 0,
    in ``average``'s dtype; ``None`` if the decomposition fails (:func:`eigh_with_retry`)."""
    result = eigh_with_retry(average, label, "basis")
    if result is None:
        return None
    values, vectors = result
    return values.flip(0).clamp_min(0.0).to(average.dtype), vectors.flip(1).to(average.dtype)


def _unsorted_clusters(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`eigenvalue_clusters` for estimates in any order (a QR step does not sort them),
    at float64's resolution whatever the dtype: in float32 the statistics' spectrum spans
    more decades than float32 resolves near its top, so float32's tolerance would pool most
    of it into one block (on a character-level language model, 450-500 of an MLP side's 512
    eigenvalues) and SOAP would no longer be SOAP. Float32 runs promise no bitwise agreement across world
    sizes anyway; in float64, where the promise is tested, the two tolerances agree."""
    order = torch.argsort(values, stable=True)
    sorted_index, size = eigenvalue_clusters(values[order], eps=torch.finfo(torch.float64).eps)
    return torch.empty_like(sorted_index).scatter_(0, order, sorted_index), size


def _adopt_into_stacks(layers: Sequence[SOAPLayer]) -> dict[str, Any]:
    """Stack the layers' bases and moments and re-point each layer at its slice."""
    allocated = [layer._allocated() for layer in layers]
    bases = {}
    for side in layers[0].active:
        stack = torch.stack([layer_bases[side][0] for layer_bases in allocated])
        for layer_bases, view in zip(allocated, stack.unbind(0)):
            layer_bases[side][0] = view
        bases[side] = stack
    moment = torch.stack([layer._held_moment() for layer in layers])
    for layer, view in zip(layers, moment.unbind(0)):
        layer.moment = view
    return {"bases": bases, "moment": moment, "views": [layer.moment for layer in layers]}


# ---------------------------------------------------------------------- options
def _check_decay(name: str, value) -> float:
    return check.check_unit_interval(name, value, low_open=False, high_open=True)


def _check_factor_dtype(name: str, value) -> torch.dtype | None:
    """None (the parameters' dtype, float32 or better), torch.float32 or torch.float64. Not
    float16 (the moment, a mean of squares, underflows: ``moment_eps=1e-8`` is 0 there) nor
    bfloat16 (no QR on CPU; and 8 bits of mantissa for the bases)."""
    if value is not None and value not in (torch.float32, torch.float64):
        raise ValueError(f"{name} must be None, torch.float32 or torch.float64, got {value!r}")
    return value


class SOAPSpec(MethodSpec):
    """SOAP-style second moments in the eigenbases of Shampoo's statistics (Vyas et al.,
    2024), bases refreshed by warm-started QR; Linear / ConvNd layers; needs only the
    gradient (no hooks, nothing reduced under DDP)."""

    name = "soap"
    options = {
        "factor_update_steps": Option(1, check.check_int, per_step="always", collective=True),
        "inv_update_steps": Option(10, check.check_int, per_step="always", collective=True),
        "factor_decay": Option(0.95, _check_decay, per_step="statistics"),
        "moment_decay": Option(0.95, _check_decay),
        "moment_eps": Option(1e-8, check.check_positive),
        "max_factor_size": Option(4096, check.check_int, collective=True),
        "factor_dtype": Option(None, _check_factor_dtype, collective=True),
    }

    def select(self, model, is_skipped, log) -> list[Selected]:
        return find_kfac_modules(model, is_skipped, log)

    def make_layer(self, index: int, selected: Selected) -> SOAPLayer:
        weight = selected.params[0][1]
        given = self.settings["factor_dtype"]
        layer = SOAPLayer(selected.name, selected.shapes[0], selected.has_bias,
                          weight_transposed=selected.weight_transposed,
                          max_factor_size=self.settings["max_factor_size"],
                          moment_decay=self.settings["moment_decay"], moment_eps=self.settings["moment_eps"],
                          factor_dtype=given or torch.promote_types(weight.dtype, torch.float32),
                          device=weight.device)
        layer.factor_dtype_follows = given is None
        layer.expert = selected.index is not None
        return layer

    def make_schedule(self) -> IntervalSchedule:
        return IntervalSchedule(self.settings["factor_update_steps"], self.settings["inv_update_steps"],
                                check=check.check_int)
