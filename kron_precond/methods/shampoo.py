"""Shampoo on the gradient (Gupta et al., 2018; Anil et al., 2020), one layer at a time.

Each registered parameter's gradient is viewed as a matrix ``M`` of shape ``[m, n]``:
a 2-D tensor as it is, a tensor of more dims as ``[shape[0], -1]`` (rows are output units:
the same matrix as K-FAC's weight gradient, e.g. ``[out, in·kh·kw]`` for Conv2d), a 1-D or
0-D tensor as a column ``[numel, 1]``. A *side* of the matrix is a dimension of size > 1
(if both have size 1, the left one is kept), and each side has a statistic, decayed on
statistics steps with ``β = factor_decay``::

    L ← β L + M Mᵀ      R ← β R + Mᵀ M      c ← β c + 1      (c: the weight of the average)

The preconditioner uses the normalised averages ``L̂ = L / c`` and ``R̂ = R / c`` (so that
``β = 1`` is the plain mean of every statistic seen and ``β < 1`` an exponential average
without the bias of its first steps). A side larger than ``max_factor_size`` keeps only
the diagonal of its statistic. On refresh steps the owner of a side computes its root
from an eigendecomposition::

    L̂ = Q diag(λ) Qᵀ,   λ clamped at 0,   root = Q diag((λ + ε · max λ)^(−e)) Qᵀ

with ``ε = epsilon`` relative to the largest eigenvalue (so its meaning does not depend on
the gradients' scale) and ``e = 2·exponent / k`` for a matrix with ``k`` sides: with the
default ``exponent = 1/4``, a matrix gets ``L̂^{-1/4} M R̂^{-1/4}`` and a one-sided tensor
(a bias, a norm weight, a ``[1, n]`` weight) gets ``L̂^{-1/2} M`` -- the ``-1/(2k)`` rule
of Shampoo for a tensor of order ``k``. A parameter passes through unchanged until each of
its sides has a valid root (its statistic holds data and is not all zero).

With ``grafting=True`` (the default) the layer's preconditioned update is rescaled to the
norm of its incoming gradient (all of the layer's parameters together): Shampoo's direction
with SGD's step size. It is on by default because roots are applied unchanged between
refreshes: without it the update is ``L̂^{-e} M R̂^{-e}`` with roots computed for the gradients
of the last refresh, so a gradient that grows between refreshes (or one in a direction the
statistics had not yet seen) gives a step up to ``ε^(-2e)`` times larger, the loss grows,
the gradient with it, and with ``inv_update_steps`` of 10 or 100 training diverges. Grafted,
the step is never larger than SGD's, whatever the roots.

The statistics come from the gradients themselves, which are already averaged under DDP:
nothing is reduced. They are kept by every gradient worker of the layer (its owner's column
of ranks) -- the owner refreshes from them, and a checkpoint gathered from that column is
complete whichever world size resumes it; other ranks hold neither statistics nor roots.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import torch

from kron_precond import validation as check
from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import (
    LayerMethod,
    MethodSpec,
    Option,
    Selected,
    graft_to_gradient_norm,
    moved,
    tensor_bytes,
)
from kron_precond.modules import find_parameter_modules
from kron_precond.schedules import IntervalSchedule, StepContext


@dataclass(frozen=True)
class _Side:
    """One side of one parameter's gradient matrix: ``L`` (rows) or ``R`` (columns)."""

    param: int  # index of the parameter in the layer
    side: str  # "L" or "R"
    dim: int
    diagonal: bool  # keep only the diagonal of the statistic (dim > max_factor_size)
    sides_of_param: int  # k: the root exponent is 2·exponent / k


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The ``[m, n]`` matrix a gradient of ``shape`` is viewed as (see the module docstring)."""
    if len(shape) >= 2:
        return int(shape[0]), int(math.prod(shape[1:]))
    return int(math.prod(shape)), 1


def gradient_sides(shape: torch.Size) -> tuple[str, ...]:
    """The sides that get a statistic: dimensions of size > 1 (``("L",)`` if there is none)."""
    m, n = matrix_shape(shape)
    sides = tuple(side for side, dim in (("L", m), ("R", n)) if dim > 1)
    return sides or ("L",)


class ShampooLayer(LayerMethod):
    """Shampoo statistics and roots for the parameters of one module.

    Args:
        name: qualified module name (used in warnings).
        shapes: ``(parameter name, shape)`` for each registered parameter.
        max_factor_size: sides larger than this keep a diagonal statistic.
        grafting: rescale the layer's update to the norm of its gradient.
        factor_dtype: dtype of the statistics.
        inv_dtype: dtype of the roots (and of the products in ``apply``).
        device: where the state lives.
    """

    def __init__(self, name: str, shapes: Sequence[tuple[str, torch.Size]], *, max_factor_size: int,
                 grafting: bool, factor_dtype: torch.dtype, inv_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.name = name
        self.param_names = [n for n, _ in shapes]
        self.shapes = [torch.Size(s) for _, s in shapes]
        self.grafting = grafting
        self.factor_dtype = factor_dtype
        self.inv_dtype = inv_dtype
        self.device = device
        self.sides: dict[str, _Side] = {}
        for index, (pname, shape) in enumerate(zip(self.param_names, self.shapes)):
            m, n = matrix_shape(shape)
            sides = gradient_sides(shape)
            for side in sides:
                dim = m if side == "L" else n
                self.sides[f"{pname}.{side}"] = _Side(index, side, dim, dim > max_factor_size, len(sides))
        self.parts = tuple(self.sides)
        # Statistics (on gradient workers only, allocated on first use): the decayed sums per
        # side and, per parameter, the weight c of the average (0: nothing seen yet).
        self._stats: dict[str, torch.Tensor] | None = None
        self._mass: list[torch.Tensor] | None = None
        # Refreshed: per side its root and a one-element validity flag (1: the root is from
        # a statistic holding data); broadcast in place from the side's owner.
        self._roots: dict[str, list[torch.Tensor]] | None = None
        # Count of statistic updates skipped for non-finite gradients (read on refresh steps).
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        # True once a refresh step has finalised this layer (decided from the step count).
        self.ready = False

    # ------------------------------------------------------------------ placement
    factor_dtype_follows = False  # factor_dtype was not given: float32 or better of the parameters'

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the state to ``device``; statistics also to the parameters' new dtype (in
        float32 or better) when ``factor_dtype`` follows them. Roots keep ``inv_dtype``."""
        if self.factor_dtype_follows:
            self.factor_dtype = torch.promote_types(dtype, torch.float32)
        mass_dtype = torch.promote_types(self.factor_dtype, torch.float32)
        if self._stats is not None:
            self._stats = {k: moved(t, device, self.factor_dtype) for k, t in self._stats.items()}
        if self._mass is not None:
            self._mass = [moved(t, device, mass_dtype) for t in self._mass]
        if self._roots is not None:
            self._roots = {k: [moved(t, device) for t in v] for k, v in self._roots.items()}
        self.nonfinite = moved(self.nonfinite, device)
        self.device = device

    # ------------------------------------------------------------------ state allocation
    def _side_shape(self, part: str) -> tuple[int, ...]:
        side = self.sides[part]
        return (side.dim,) if side.diagonal else (side.dim, side.dim)

    def _statistics(self) -> dict[str, torch.Tensor]:
        if self._stats is None:
            kw: dict[str, Any] = dict(device=self.device, dtype=self.factor_dtype)
            self._stats = {part: torch.zeros(self._side_shape(part), **kw) for part in self.parts}
            mass_dtype = torch.promote_types(self.factor_dtype, torch.float32)
            self._mass = [torch.zeros((), device=self.device, dtype=mass_dtype) for _ in self.shapes]
        return self._stats

    def _allocated_roots(self) -> dict[str, list[torch.Tensor]]:
        if self._roots is None:
            kw: dict[str, Any] = dict(device=self.device, dtype=self.inv_dtype)
            self._roots = {part: [torch.zeros(self._side_shape(part), **kw), torch.zeros(1, **kw)]
                           for part in self.parts}
        return self._roots

    def _held_mass(self) -> list[torch.Tensor]:
        """The statistics' masses (allocated with the statistics)."""
        self._statistics()
        assert self._mass is not None
        return self._mass

    # ------------------------------------------------------------------ statistics
    def observe_gradients(self, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:
        """On statistics steps, fold ``M Mᵀ`` / ``Mᵀ M`` of each gradient into its sides'
        statistics (gradient workers only). A non-finite gradient (or statistic) leaves its
        parameter's statistics unchanged (decided on the device) and is counted."""
        if not ctx.statistics or not self.holds_state:
            return
        decay = ctx["factor_decay"]
        stats = self._statistics()
        for index, grad in enumerate(grads):
            if grad is None:  # not used this step: nothing to observe
                continue
            matrix = grad.detach().to(self.factor_dtype).reshape(matrix_shape(self.shapes[index]))
            parts = [part for part, side in self.sides.items() if side.param == index]
            updated = [_decayed(stats[part], matrix, self.sides[part], decay) for part in parts]
            # all sides or none: a NaN/Inf gradient, or products that overflow the dtype
            finite = torch.stack([torch.isfinite(u).all() for u in updated]).all()
            for part, new in zip(parts, updated):
                stats[part].copy_(torch.where(finite, new, stats[part]))
            mass = self._held_mass()[index]
            mass.copy_(torch.where(finite, mass * decay + 1.0, mass))
            self.nonfinite.add_((~finite).to(self.nonfinite.dtype))

    # ------------------------------------------------------------------ refresh
    def refresh(self, part: str, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:
        """The root of one side's averaged statistic (on the side's owner); the previous root
        is kept if the statistic is all zero or the decomposition fails."""
        side = self.sides[part]
        stat = self._statistics()[part]
        mass = self._held_mass()[side.param]
        work = _decomposition_dtype(self.inv_dtype, self.factor_dtype)
        average = stat.to(work) / mass.to(work).clamp_min(torch.finfo(work).tiny)
        exponent = 2.0 * ctx["exponent"] / side.sides_of_param
        if side.diagonal:
            root, largest = _diagonal_root(average, ctx["epsilon"], exponent)
        else:
            result = _matrix_root(average, ctx["epsilon"], exponent, f"{self.name}.{part}")
            if result is None:
                return
            root, largest = result
        valid = (mass > 0) & (largest > 0) & torch.isfinite(root).all()
        target, flag = self._allocated_roots()[part]
        target.copy_(torch.where(valid, root.to(self.inv_dtype), target))
        flag.copy_(torch.where(valid, torch.ones_like(flag), flag))

    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        roots = self._allocated_roots()
        parts = self.parts if part is None else (part,)
        return [t for p in parts for t in roots[p]]

    def finalize_refresh(self, ctx: StepContext) -> None:
        self._allocated_roots()
        self.ready = True

    def release_refreshed(self) -> None:
        """Drop every state (on ranks that are not gradient workers of this layer)."""
        self._roots = None
        self._stats = None
        self._mass = None
        self.ready = False

    # ------------------------------------------------------------------ apply
    def apply(self, grads: list[torch.Tensor], ctx: StepContext | None = None) -> list[torch.Tensor]:
        """``L̂^{-e} M R̂^{-e}`` per parameter (grafted to the layer's gradient norm if asked);
        a parameter without valid roots on all of its sides passes through."""
        if not self.ready:
            return grads
        roots = {part: [t.unsqueeze(0) for t in pair] for part, pair in self._allocated_roots().items()}
        return [out[0] for out in self._precondition([g.unsqueeze(0) for g in grads], roots)]

    def batch_key(self) -> Hashable | None:
        if not self.ready:
            return None  # passes gradients through: nothing to batch
        layout = tuple((part, side.param, side.side, side.dim, side.diagonal, side.sides_of_param)
                       for part, side in self.sides.items())
        return (type(self), tuple(self.shapes), layout, self.inv_dtype, self.grafting)

    @classmethod
    def apply_batch(cls, layers: Sequence["ShampooLayer"], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """Layers of one layout at once: one batched product per side, not one per layer.

        The first call stacks the layers' roots and flags side by side and makes each layer's
        tensors views into the stacks, so later refreshes and broadcasts (in place) update
        them: nothing is copied per step and no memory is duplicated.
        """
        if not all(layer.ready for layer in layers):
            # a layer without roots yet (before its first refresh) is alone in its group
            # (``batch_key`` is None) and passes its gradients through
            return super().apply_batch(layers, grads, ctx, cache, keep)
        stacks = cache.get("stacks")
        if stacks is None:
            stacks = cache["stacks"] = _adopt_into_stacks(layers)
        count = len(layers)
        stacked = [torch.stack([g[index] for g in grads]) for index in range(len(grads[0]))]
        out = layers[0]._precondition(stacked, stacks)
        # non-finite gradients pass through, after grafting (whose scale they would poison)
        out = [torch.where(keep.reshape((count,) + (1,) * (o.dim() - 1)), o, g) for o, g in zip(out, stacked)]
        return [[o[i] for o in out] for i in range(count)]

    def _precondition(self, grads: list[torch.Tensor], roots: dict[str, list[torch.Tensor]]) -> list[torch.Tensor]:
        """The update for a batch of layers of this layout: ``grads[i]`` is parameter ``i`` of
        every layer, stacked ``[B, *shape]``; ``roots[part]`` the stacked roots and flags."""
        out = []
        for index, grad in enumerate(grads):
            count = grad.shape[0]
            matrix = grad.to(self.inv_dtype).reshape(count, *matrix_shape(self.shapes[index]))
            result = matrix
            valid = None
            for part, side in self.sides.items():
                if side.param != index:
                    continue
                root, flag = roots[part]
                if side.side == "L":
                    result = root.unsqueeze(2) * result if side.diagonal else torch.matmul(root, result)
                else:
                    result = result * root.unsqueeze(1) if side.diagonal else torch.matmul(result, root)
                valid = flag if valid is None else valid * flag
            assert valid is not None  # every parameter has at least one side
            result = torch.where(valid.reshape(count, 1, 1).bool(), result, matrix)
            out.append(result.reshape(grad.shape).to(grad.dtype))
        if self.grafting:
            out = graft_to_gradient_norm(out, grads)
        return out

    # ------------------------------------------------------------------ estimates
    def factor_costs(self) -> dict[str, tuple[float, float]]:
        """Per side: (refresh cost ~ n³, or n for a diagonal; bytes of statistic + root)."""
        costs = {}
        for part, side in self.sides.items():
            elements = side.dim if side.diagonal else side.dim**2
            flops = float(side.dim) if side.diagonal else float(side.dim) ** 3
            size = elements * (_element_size(self.factor_dtype) + _element_size(self.inv_dtype))
            costs[part] = (flops, float(size))
        return costs

    def memory_by_kind(self) -> dict[str, int]:
        stats = [] if self._stats is None else list(self._stats.values()) + list(self._held_mass())
        roots = [] if self._roots is None else [t for pair in self._roots.values() for t in pair]
        return {"shampoo_statistics": tensor_bytes(stats), "shampoo_roots": tensor_bytes(roots)}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        stats = self._statistics()
        return {
            "layout": {part: list(self._side_shape(part)) for part in self.parts},
            "statistics": {part: t.clone() for part, t in stats.items()},
            "mass": [m.clone() for m in self._held_mass()],
            "roots": {part: [t.clone() for t in pair] for part, pair in self._allocated_roots().items()},
            "ready": self.ready,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` unless ``state`` was saved by a layer with the same sides and
        holds what :meth:`load_state_dict` can trust (floating, finite tensors of the right
        shapes)."""
        where = f"state of {self.name}"
        expected = {part: list(self._side_shape(part)) for part in self.parts}
        layout = checks.entry(state, "layout", where)
        if layout != expected:
            raise ValueError(f"{where} has sides {layout}, expected {expected} "
                             "(other parameters, or another max_factor_size)")
        statistics = checks.entry(state, "statistics", where)
        roots = checks.entry(state, "roots", where)
        for part, shape in expected.items():
            checks.float_tensor(checks.entry(statistics, part, f"{where}: statistics"), shape,
                                f"{where}: statistics[{part!r}]")
            checks.tensor_list(checks.entry(roots, part, f"{where}: roots"), [shape, [1]], f"{where}: roots[{part!r}]")
        mass = checks.entry(state, "mass", where)
        checks.tensor_list(mass, [[]] * len(self.shapes), f"{where}: mass")
        if any(bool(m < 0) for m in mass):
            raise ValueError(f"{where}: mass holds a negative weight")
        checks.boolean(checks.entry(state, "ready", where), f"{where}: ready")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        if not self.holds_state:
            self.release_refreshed()
            return
        for part, value in state["statistics"].items():
            self._statistics()[part].copy_(value)
        for mass, value in zip(self._held_mass(), state["mass"]):
            mass.copy_(value)
        for part, pair in state["roots"].items():
            for dst, src in zip(self._allocated_roots()[part], pair, strict=True):
                dst.copy_(src)
        self.ready = bool(state["ready"])


# ---------------------------------------------------------------------- math
def _decayed(stat: torch.Tensor, matrix: torch.Tensor, side: _Side, decay: float) -> torch.Tensor:
    """``decay · stat`` plus this gradient's ``M Mᵀ`` (L) or ``Mᵀ M`` (R), or their diagonals."""
    if side.diagonal:
        dim = 1 if side.side == "L" else 0
        return stat * decay + (matrix * matrix).sum(dim)
    if side.side == "L":
        return torch.addmm(stat, matrix, matrix.t(), beta=decay)
    return torch.addmm(stat, matrix.t(), matrix, beta=decay)


def eigh_with_retry(matrix: torch.Tensor, label: str, keeping: str):
    """``(eigenvalues, eigenvectors)`` of a symmetric matrix, in its dtype and, if ``eigh``
    raises or returns non-finite values (seen on GPUs), again in float64; ``None`` with a
    warning naming ``label`` (and what the caller keeps) if both fail. The finiteness check
    is a host sync, on refresh steps only (``eigh`` itself synchronises to report errors)."""
    dtypes = tuple(dict.fromkeys((matrix.dtype, torch.float64)))
    for dtype in dtypes:
        try:
            eigenvalues, eigenvectors = torch.linalg.eigh(matrix.to(dtype))
        except RuntimeError:  # torch.linalg.LinAlgError: no convergence
            continue
        if bool(torch.isfinite(eigenvalues).all() & torch.isfinite(eigenvectors).all()):
            return eigenvalues, eigenvectors
    tried = " and ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
    warnings.warn(f"kron_precond: eigendecomposition of {label} failed in {tried} "
                  f"(raised or returned non-finite values); keeping the previous {keeping}",
                  RuntimeWarning, stacklevel=4)
    return None


def _matrix_root(average: torch.Tensor, epsilon: float, exponent: float, label: str):
    """``(root, largest eigenvalue)`` of a symmetric PSD matrix, eigenvalues clamped at 0 plus
    ``epsilon · max λ``; ``None`` if the decomposition fails (:func:`eigh_with_retry`)."""
    result = eigh_with_retry(average, label, "root")
    if result is None:
        return None
    eigenvalues, eigenvectors = result
    eigenvalues = eigenvalues.clamp_min(0.0)
    largest = eigenvalues.max()
    # a zero statistic gives inf here; the caller keeps the previous root then
    powers = (eigenvalues + epsilon * largest).pow(-exponent)
    return (eigenvectors * powers) @ eigenvectors.t(), largest


def _diagonal_root(average: torch.Tensor, epsilon: float, exponent: float):
    values = average.clamp_min(0.0)
    largest = values.max()
    return (values + epsilon * largest).pow(-exponent), largest


def _adopt_into_stacks(layers: Sequence[ShampooLayer]) -> dict[str, list[torch.Tensor]]:
    """Stack the layers' roots and flags part by part and re-point each layer at its slice."""
    stacks = {}
    for part in layers[0].parts:
        pair = []
        for i in range(2):
            stack = torch.stack([layer._allocated_roots()[part][i] for layer in layers])
            for layer, view in zip(layers, stack.unbind(0)):
                layer._allocated_roots()[part][i] = view
            pair.append(stack)
        stacks[part] = pair
    return stacks


def _decomposition_dtype(inv_dtype: torch.dtype, factor_dtype: torch.dtype) -> torch.dtype:
    """Roots are computed in float32, or float64 when the roots or statistics are float64."""
    return torch.float64 if torch.float64 in (inv_dtype, factor_dtype) else torch.float32


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------- options

def _check_inv_dtype(name: str, value) -> torch.dtype:
    if value not in (torch.float32, torch.float64, torch.bfloat16):
        raise ValueError(f"{name} must be torch.float32, torch.float64 or torch.bfloat16, got {value!r}")
    return value


def _check_decay(name: str, value) -> float:
    return check.check_unit_interval(name, value, low_open=False, high_open=False)


def _check_exponent(name: str, value) -> float:
    number = check.check_positive(name, value)
    if number > 0.5:
        raise ValueError(f"{name} must be in (0, 0.5] (the root of each side of a matrix), got {value!r}")
    return number


class ShampooSpec(MethodSpec):
    """Shampoo (Gupta et al., 2018; Anil et al., 2020): per-parameter left and right
    statistics of the gradient matrix and their inverse roots; needs only the gradient
    (no hooks, nothing reduced under DDP)."""

    name = "shampoo"
    options = {
        "factor_update_steps": Option(1, check.check_int, per_step="always", collective=True),
        "inv_update_steps": Option(1, check.check_int, per_step="always", collective=True),
        "factor_decay": Option(0.99, _check_decay, per_step="statistics"),
        "epsilon": Option(1e-4, check.check_positive, per_step="refresh"),
        "exponent": Option(0.25, _check_exponent, per_step="refresh"),
        # on by default: ungrafted, stale roots between refreshes can diverge (module docstring)
        "grafting": Option(True, check.check_bool),
        "max_factor_size": Option(8192, check.check_int, collective=True),
        "factor_dtype": Option(None, check.check_statistics_dtype,
                               collective=True),
        "inv_dtype": Option(torch.float32, _check_inv_dtype, collective=True),
    }

    def select(self, model, is_skipped, log) -> list[Selected]:
        return find_parameter_modules(model, is_skipped, log)

    def make_layer(self, index: int, selected: Selected) -> ShampooLayer:
        first = selected.params[0][1]
        factor_dtype = self.settings["factor_dtype"] or torch.promote_types(first.dtype, torch.float32)
        layer = ShampooLayer(selected.name, [(n, p.shape) for n, p in selected.params],
                             max_factor_size=self.settings["max_factor_size"], grafting=self.settings["grafting"],
                             factor_dtype=factor_dtype, inv_dtype=self.settings["inv_dtype"], device=first.device)
        layer.factor_dtype_follows = self.settings["factor_dtype"] is None
        return layer

    def make_schedule(self) -> IntervalSchedule:
        # warm-up statistics and roots on steps 1, 2, 4, ... below the intervals: a root from the
        # first gradient alone, kept for a whole interval of 100, stalled a grafted run and sent an
        # ungrafted one to NaN after an unusual first batch
        return IntervalSchedule(self.settings["factor_update_steps"], self.settings["inv_update_steps"],
                                check=check.check_int, warmup=True)
