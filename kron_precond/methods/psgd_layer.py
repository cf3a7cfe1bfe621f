"""PSGD Kron as a preconditioning method: whitening factors for each parameter of a module.

Each parameter ("part") has one :class:`~kron_precond.methods.psgd_tensor.PSGDTensor`
(the same per-tensor state the ``Kron`` optimizer uses): factors, the optional fitted
gradient average, probe vectors that depend only on ``(seed, layer, parameter, step)`` --
so the result is the same whichever rank owns the layer and however many ranks there are --
and the update-RMS clip of kron_torch.

The factors are kept in ``precond_dtype``; their math runs in it too, except that float16
factors are computed in float32 (:func:`kron_precond.optim.compute_dtype`, as in ``Kron``):
float16's range ends at 65 504, which a gradient, a fitted average or ``P g`` passes easily.
The RMS clip runs before the result is rounded to the gradient's dtype (float32 for a float16
gradient), so a float16 model's clipped update does not overflow either. A preconditioned
gradient that is still not finite from a finite gradient (an overflow) is not written: the
gradient passes through, as a non-finite one does, and the skip is counted in ``nonfinite``.

A linear weight stored ``[in, out]`` (GPT-2 style ``Conv1D``) is preconditioned as its ``[out, in]``
matrix, as an ``nn.Linear`` twin's weight is: its factors, probes and fitted average are those of
the transposed gradient (the diagonal side under ``memory_save_mode`` included), and its result is
transposed back. Its state is saved in the stored layout, as versions before did (the factors in
the stored dims' order, the fitted average ``[in, out]``), so a checkpoint's format does not
depend on the version (``torch.save`` and ``torch.distributed.checkpoint`` alike).

A weight's dims of size 1 after the first two (a pointwise convolution's kernel) get no factor,
so it is preconditioned as its ``nn.Linear`` twin. Files still hold one factor per dim, a scalar
``1`` at such a dim; a load folds a saved scalar into the first factor (exact for this layout's
ones, one rounding of the factors' dtype otherwise), so states written with a fitted scalar there
(kron_torch's layout) load as the preconditioner they hold.
"""
from __future__ import annotations

import math
from typing import Any, Hashable, Mapping, Sequence

import torch

from kron_precond import validation as check
from kron_precond.methods import state_checks as checks
from kron_precond.methods.base import LayerMethod, MethodSpec, Option, Selected, moved, tensor_bytes
from kron_precond.methods.psgd import PSGDFactors, check_memory_save_mode, check_update_rule
from kron_precond.methods.psgd_tensor import RMS_CLIP, PSGDTensor, rms_clip_scale
from kron_precond.modules import find_parameter_modules
from kron_precond.optim import compute_dtype
from kron_precond.schedules import ProbabilitySchedule, StepContext, check_probability


class PSGDLayer(LayerMethod):
    """Kronecker whitening factors for the parameters of one module.

    Args:
        name: qualified module name (used in warnings).
        shapes: ``(parameter name, shape)`` for each registered parameter, as stored.
        transposed: the names of 2-D parameters stored ``[in, out]`` (a transposed linear weight):
            their state is that of the ``[out, in]`` matrix (:attr:`shapes` holds that shape),
            gradients are transposed in and the results back; :meth:`state_dict` writes it in the
            stored layout (:meth:`_swap_layout`) and the loads read it back.
        momentum_into_precond_update: fit the factors to a debiased running average of
            the gradient (decay ``b1``) instead of the gradient itself.
        seed, layer_index: determine the probe vectors.
        **factor_settings: passed to :class:`PSGDFactors` (``max_size_triangular``,
            ``min_ndim_triangular``, ``memory_save_mode``, ``init_scale``, ``dtype``,
            ``merge_dims``, ``update_rule``; ``compute_dtype`` defaults to
            :func:`~kron_precond.optim.compute_dtype` of ``dtype``: float32 for float16).
    """

    def __init__(self, name: str, shapes: Sequence[tuple[str, torch.Size]], *, device: torch.device,
                 momentum_into_precond_update: bool, b1: float, seed: int, layer_index: int,
                 transposed: Sequence[str] = (), **factor_settings) -> None:
        self.name = name
        stored = {part: torch.Size(shape) for part, shape in shapes}
        unknown = [part for part in transposed if part not in stored or len(stored[part]) != 2]
        if unknown:
            raise ValueError(f"{name}: transposed parameters must be 2-D parameters of the layer, got {unknown}")
        #: per part, the shape its state has: a transposed part's ``[out, in]``
        self.shapes = {part: torch.Size(reversed(shape)) if part in transposed else shape
                       for part, shape in stored.items()}
        self.parts = tuple(self.shapes)
        #: per part (in :attr:`parts` order): its gradient is stored ``[in, out]``
        self.transposed = tuple(part in transposed for part in self.parts)
        self.device = device
        self.b1 = b1
        self.seed = seed
        self.layer_index = layer_index
        self.use_momentum = bool(momentum_into_precond_update)
        self.factor_dtype = factor_settings.get("dtype", torch.float32)
        factor_settings.setdefault("compute_dtype", compute_dtype(self.factor_dtype))
        self._settings = factor_settings
        # Built on first use: ranks that are not gradient workers never hold factors.
        self._tensors: dict[str, PSGDTensor | None] = {part: None for part in self.parts}
        # The fitted average is advanced on every rank (it is cheap and rank-independent).
        self._averages: dict[str, PSGDTensor] | None = (
            {part: self._new_tensor(part, momentum=True) for part in self.parts}
            if self.use_momentum else None)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self.holds_state = True

    def _new_tensor(self, part: str, momentum: bool = False) -> PSGDTensor:
        return PSGDTensor(self.shapes[part], device=self.device, seed=self.seed,
                          key=(self.layer_index, self.parts.index(part)), momentum=momentum,
                          b1=self.b1, **self._settings)

    def tensor(self, part: str) -> PSGDTensor:
        tensor = self._tensors[part]
        if tensor is None:
            tensor = self._tensors[part] = self._new_tensor(part)
        return tensor

    def factor(self, part: str) -> PSGDFactors:
        return self.tensor(part).factors

    @property
    def q_factors(self) -> dict[str, list[torch.Tensor]]:
        return {part: self.factor(part).tensors() for part in self.parts}

    # ------------------------------------------------------------------ placement
    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the state to ``device`` (``precond_dtype`` is an explicit setting, so
        ``dtype`` is not followed). State made on ``meta`` is made afresh, lazily."""
        self.device = device
        for part, state in self._tensors.items():
            if state is not None:
                if state.is_meta():
                    self._tensors[part] = None  # rebuilt on first use, on ``device``
                else:
                    state.to(device)
        if self._averages is not None:
            self._averages = {part: self._new_tensor(part, momentum=True) if state.is_meta() else state
                              for part, state in self._averages.items()}
            for state in self._averages.values():
                state.to(device)
        self.nonfinite = moved(self.nonfinite, device)

    # ------------------------------------------------------------------ observe
    def observe_gradients(self, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:
        """Advance the fitted average; estimate initial scales (``precond_init_scale=None``)
        on ranks that hold the factors."""
        for part, flip, grad in zip(self.parts, self.transposed, grads):
            if grad is None:
                continue
            if flip:
                grad = grad.T
            if self._averages is not None:
                self._averages[part].accumulate(grad, torch.isfinite(grad).all())
            if self.holds_state:
                factors = self.factor(part)
                if not factors.initialized:
                    try:
                        factors.initialize_from(grad)
                    except ValueError:  # zero or non-finite first gradient: try again next step
                        pass

    # ------------------------------------------------------------------ refresh
    def refresh(self, part: str, grads: Sequence[torch.Tensor | None], ctx: StepContext) -> None:
        """One Q update of ``part`` (run by its owner); nothing to fit without a gradient
        or before the initial scale could be estimated."""
        index = self.parts.index(part)
        grad = grads[index]
        state = self.tensor(part)
        if grad is None or not state.factors.initialized:
            return
        if self.transposed[index]:
            grad = grad.T
        fit = self._averages[part].debiased_momentum(state.factors.compute_dtype) if self._averages else grad
        applied = state.update_factors(fit, ctx["precond_lr"], step=ctx.step, update_index=ctx.refresh_index)
        self.nonfinite.add_((~applied).to(self.nonfinite.dtype))

    def refreshed_tensors(self, part: str | None = None) -> list[torch.Tensor]:
        """The Q factors, and the Procrustes-style fit's running Lipschitz estimates (0-dim):
        the next update of a part owned elsewhere, and a checkpoint saved here, need them."""
        parts = self.parts if part is None else (part,)
        return [t for p in parts for t in self.factor(p).tensors() + self.factor(p).lipschitz]

    def finalize_refresh(self, ctx: StepContext) -> None:
        uses = 1.0 / max(ctx.hparams.get("update_probability", 1.0), 1e-3)
        for state in self._tensors.values():  # factors were rewritten in place (update or broadcast)
            if state is not None:
                state.uses_per_update = uses
                state.invalidate()

    def release_refreshed(self) -> None:
        self._tensors = {part: None for part in self.parts}
        self.holds_state = False

    # ------------------------------------------------------------------ apply
    def apply(self, grads: list[torch.Tensor], ctx: StepContext | None = None) -> list[torch.Tensor]:
        """``P g`` RMS-clipped, per parameter; a gradient that is not finite, or whose result is
        not (an overflow, counted in ``nonfinite``), is returned as it is."""
        return self._apply(grads, None)

    def _apply(self, grads: list[torch.Tensor], keep: torch.Tensor | None) -> list[torch.Tensor]:
        """:meth:`apply`; ``keep`` (0-dim bool): every gradient of the layer is finite (the
        engine's flag; ``None``: judged per gradient here)."""
        out = []
        overflowed = []
        for part, flip, grad in zip(self.parts, self.transposed, grads):
            state = self.tensor(part)
            if not state.factors.initialized:  # initial scale not estimated yet
                out.append(grad)
                continue
            if flip:  # [in, out] stored: preconditioned as [out, in], the result transposed back
                grad = grad.T
            # in float32 for a float16 gradient: P g may pass 65 504 before the clip
            wide = compute_dtype(grad.dtype)
            update = state.precondition(grad.to(wide))
            update = (update * rms_clip_scale(update).to(wide)).to(grad.dtype)
            given = _finite(grad.unsqueeze(0))[0] if keep is None else keep
            written = given & _finite(update.unsqueeze(0))[0]
            overflowed.append(given & ~written)
            result = torch.where(written, update, grad)
            out.append(result.T if flip else result)
        if overflowed:
            self.nonfinite.add_(torch.stack(overflowed).sum().to(self.nonfinite.dtype))
        return out

    def batch_key(self) -> Hashable | None:
        """Layers whose parameters have equal shapes and factor structures (which products are
        formed), all initialised, of rank at most 2, are preconditioned together; a weight stored
        ``[in, out]`` beside one stored ``[out, in]`` too (both are preconditioned as ``[out, in]``)."""
        key: list[Hashable] = [type(self)]
        for part in self.parts:
            state = self.tensor(part)
            factors = state.factors
            if not factors.initialized or len(factors.work_shape) > 2:
                return None
            formed = tuple(p is not None for p in state.products())
            key.append((self.shapes[part], factors.work_shape, tuple(factors.diagonal), factors.dtype, formed))
        return tuple(key)

    @classmethod
    def apply_batch(cls, layers: Sequence["PSGDLayer"], grads: Sequence[list[torch.Tensor]],
                    ctx: StepContext | None, cache: dict, keep: torch.Tensor) -> list[list[torch.Tensor]]:
        """``P g`` for every parameter of every layer with one batched product per factor:
        ``P_0 G P_1`` on stacks of equal-shape gradients, the RMS clip per tensor.

        Per factor the stack holds the formed ``Q_iᵀQ_i`` (or ``q_i²``), else ``Q_i`` itself
        (two products). Built when a factor changes; each layer's tensors are then re-pointed
        at their slice of the stack, so nothing is held twice and in-place updates reach it.
        The products are in the factors' compute dtype, a stacked ``Q_i`` is cast to it per step
        (as :meth:`PSGDFactors.precondition` does). A gradient stored ``[in, out]`` is stacked
        transposed and its result transposed back. Where ``keep`` is False (a non-finite
        gradient) or the result is not finite (an overflow, counted in the layer's
        ``nonfinite``), the gradient is returned as it is."""
        if len(layers) == 1:
            return [layers[0]._apply(grads[0], keep[0])]
        states = [[layer.tensor(part) for part in layer.parts] for layer in layers]
        versions = tuple(t.version for row in states for t in row)
        if cache.get("versions") != versions:  # factors changed since the stacks were built
            cache["versions"] = versions
            cache["stacks"] = [[_adopt_stack(states, j, i) for i in range(len(states[0][j].factors.q))]
                               for j in range(len(states[0]))]
        count = len(layers)
        columns = []
        overflowed = torch.zeros(count, dtype=torch.int64, device=keep.device)
        for j, stacks in enumerate(cache["stacks"]):
            factors = states[0][j].factors
            flips = [layer.transposed[j] for layer in layers]
            raw = torch.stack([g[j].T if flip else g[j] for g, flip in zip(grads, flips)])
            x = raw.reshape(count, *factors.work_shape).to(factors.compute_dtype)
            if x.dim() == 2:  # one dim: [L, n] -> x P (row vectors)
                x = _right_multiply(x.unsqueeze(1), *stacks[0]).squeeze(1)
            else:  # [L, m, n]: P_0 X P_1, each side diagonal or a matrix
                x = _right_multiply(x.transpose(1, 2), *stacks[0]).transpose(1, 2)
                x = _right_multiply(x, *stacks[1])
            # clipped in float32 for float16 gradients: P g may pass 65 504 before the clip
            x = x.reshape(raw.shape).to(compute_dtype(raw.dtype))
            rms = torch.linalg.vector_norm(x.float().reshape(count, -1), dim=1) / (x[0].numel() ** 0.5)
            scale = (RMS_CLIP / (rms + 1e-12)).clamp(max=1.0).to(x.dtype)
            shape = (count,) + (1,) * (x.dim() - 1)
            x = (x * scale.reshape(shape)).to(raw.dtype)
            written = keep & _finite(x)
            overflowed += keep & ~written
            x = torch.where(written.reshape(shape), x, raw)
            columns.append([v.T if flip else v for v, flip in zip(x.unbind(0), flips)])
        torch._foreach_add_([layer.nonfinite for layer in layers], list(overflowed.unbind(0)))
        return [list(row) for row in zip(*columns)]

    # ------------------------------------------------------------------ estimates
    def factor_costs(self) -> dict[str, tuple[float, float]]:
        costs = {}
        for part in self.parts:
            probe = PSGDFactors(self.shapes[part], device="meta", **self._settings)
            costs[part] = (probe.cost(), float(probe.memory()))
        return costs

    def memory_by_kind(self) -> dict[str, int]:
        held = [t for t in self._tensors.values() if t is not None]
        usage = {"psgd_factors": tensor_bytes([q for t in held for q in t.factors.tensors()])}
        cached = sum(t.cache_bytes() for t in held)
        if cached:
            usage["psgd_cached_products"] = cached
        if self._averages is not None:
            usage["psgd_momentum"] = tensor_bytes(t.momentum for t in self._averages.values())
        return usage

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The state, a weight stored ``[in, out]``'s in that stored layout (:meth:`_swap_layout`):
        the format does not depend on whether the weight is preconditioned as ``[out, in]``."""
        return self._swap_layout({
            # the factors, their initialised flag and, for the Procrustes-style fit, its running
            # Lipschitz estimates (without them a resumed run takes other steps)
            "factors": {part: self._with_skipped_dims(part, {
                key: [t.clone() for t in value] if isinstance(value, list) else value
                for key, value in self.factor(part).state_dict().items()})
                        for part in self.parts},
            "momentum": None if self._averages is None else
            {k: v.held_momentum().clone() for k, v in self._averages.items()},
            "momentum_steps": None if self._averages is None else
            {k: v.steps.clone() for k, v in self._averages.items()},
            # decides whether Q_iᵀQ_i is formed: saved so that a resumed run is bitwise the same
            "uses_per_update": {part: self.tensor(part).uses_per_update for part in self.parts},
        }, copy=True)

    def _skipped_dims(self, part: str) -> list[int]:
        """Positions of the size-1 dims that get no factor (``squeeze_dims``) in a file's
        per-dimension lists, which keep one entry per dim: kron_torch's layout, and that of the
        states written before those dims lost their factor. There a file holds a ``ones(1)``
        factor, which a load folds into the first factor (it only scales ``P``), so that
        such a state loads, through ``torch.load`` and through a DCP template alike (a file written
        here holds scalars of 1: bitwise; a fitted scalar: up to one rounding of the factors' dtype,
        and a product that overflows or underflows it is refused). Merged dims
        (``merge_dims``) have the same 2-D layout with or without the size-1 dims."""
        shape = self.shapes[part]
        if self._settings.get("merge_dims") and len(shape) > 2:
            return []
        return [i for i, n in enumerate(shape) if i >= 2 and n == 1]

    def _with_skipped_dims(self, part: str, entry: dict[str, Any]) -> dict[str, Any]:
        """A factor entry in the file layout: a ``ones(1)`` factor (and a zero Lipschitz
        estimate) at each skipped dim."""
        skipped = self._skipped_dims(part)
        if not skipped:
            return entry
        entry = dict(entry)
        for key, fill in (("q", torch.ones), ("lipschitz", lambda *_, **kw: torch.zeros((), **kw))):
            if isinstance(entry.get(key), list) and entry[key]:
                values = list(entry[key])
                like = values[0]
                for i in skipped:
                    values.insert(i, fill(1, dtype=like.dtype, device=like.device))
                entry[key] = values
        return entry

    def _folded_first(self, part: str, qs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The first factor with the skipped dims' scalars multiplied in: computed in float64 on
        the CPU (a load, not a step; some devices lack float64), rounded once to the factors'
        dtype, on the CPU (the load copies it to the factor's device)."""
        skipped = self._skipped_dims(part)
        scale = math.prod(float(qs[i].reshape(())) for i in skipped)
        first = next(q for i, q in enumerate(qs) if i not in skipped)
        return (first.detach().to("cpu", torch.float64) * scale).to(self.factor_dtype)

    def _without_skipped_dims(self, part: str, entry: Mapping[str, Any]) -> dict[str, Any]:
        """A checked factor entry in this layer's layout: the skipped dims' scalar factors
        multiplied into the first factor, their Lipschitz estimates dropped."""
        skipped = self._skipped_dims(part)
        entry = dict(entry)
        if not skipped:
            return entry
        qs = list(entry["q"])
        entry["q"] = [self._folded_first(part, qs)] + [q for i, q in enumerate(qs) if i not in skipped][1:]
        if isinstance(entry.get("lipschitz"), (list, tuple)) and entry["lipschitz"]:
            entry["lipschitz"] = [v for i, v in enumerate(entry["lipschitz"]) if i not in skipped]
        return entry

    def _swap_layout(self, state: Any, copy: bool = False) -> Any:
        """``state`` with the entries of the parts stored ``[in, out]`` swapped between the stored
        layout (files) and the ``[out, in]`` one this layer keeps (the swap is its own inverse):
        their per-dimension lists (factors, Lipschitz estimates) reversed and their fitted
        average transposed (``copy``: into a new contiguous tensor, else a view). A new dict
        where anything changes (``state`` is not modified); entries of unexpected kinds are left
        as they are, for :meth:`check_state` to reject."""
        flipped = [part for part, flip in zip(self.parts, self.transposed) if flip]
        if not flipped or not isinstance(state, Mapping):
            return state
        state = dict(state)
        if isinstance(state.get("factors"), Mapping):
            factors = state["factors"] = dict(state["factors"])
            for part in flipped:
                if isinstance(factors.get(part), Mapping):
                    entry = factors[part] = dict(factors[part])
                    for key, value in entry.items():
                        if isinstance(value, (list, tuple)):  # per dimension: q, lipschitz
                            entry[key] = list(value)[::-1]
        if isinstance(state.get("momentum"), Mapping):
            momentum = state["momentum"] = dict(state["momentum"])
            for part in flipped:
                value = momentum.get(part)
                if isinstance(value, torch.Tensor) and value.dim() == 2:
                    momentum[part] = value.T.clone(memory_format=torch.contiguous_format) if copy else value.T
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if ``state`` does not hold loadable factors for these
        parameters (missing entries, wrong shapes, integer or non-finite tensors). ``state`` is
        as :meth:`state_dict` writes it (a weight stored ``[in, out]``'s in that layout)."""
        self._check_state(self._swap_layout(state))

    def _check_state(self, state: dict[str, Any]) -> None:
        where = f"state of {self.name}"
        factors = checks.entry(state, "factors", where)
        missing = set(self.parts) - set(factors if isinstance(factors, dict) else ())
        if missing:
            raise ValueError(f"{where} has no factors for {sorted(missing)}")
        for part in self.parts:
            probe = PSGDFactors(self.shapes[part], device="meta", **self._settings)
            expected = [tuple(q.shape) for q in probe.tensors()]
            skipped = self._skipped_dims(part)
            for i in skipped:  # the file layout: a scalar factor per skipped dim
                expected.insert(i, (1,))
            saved = factors[part]
            self._check_structure(part, saved, expected)
            checks.tensor_list(checks.entry(saved, "q", f"{where}.{part}"), expected, f"{where}.{part}: q")
            checks.boolean(checks.entry(saved, "initialized", f"{where}.{part}"), f"{where}.{part}: initialized")
            if skipped:
                folded = self._folded_first(part, saved["q"])
                first = next(q for i, q in enumerate(saved["q"]) if i not in skipped).detach().cpu()
                if not bool(torch.isfinite(folded).all()) or bool(((folded == 0) & (first != 0)).any()):
                    raise ValueError(f"{where}.{part}: its size-1 dims' scalar factors, multiplied into the first "
                                     f"factor, overflow or underflow {self.factor_dtype}")
            if "lipschitz" in saved and probe.lipschitz:  # Procrustes-style fit (older files lack it)
                checks.tensor_list(saved["lipschitz"], [()] * (len(probe.lipschitz) + len(skipped)),
                                   f"{where}.{part}: lipschitz")
            if not probe.lipschitz:  # the eq rule: triangular solves read the upper triangle alone
                if saved.get("lipschitz"):
                    raise ValueError(f"{where}.{part}: saved with precond_update='procrustes' (dense factors); "
                                     f"this preconditioner uses precond_update='eq'")
                if any(q.dim() == 2 and bool(q.tril(-1).any()) for q in saved["q"]):
                    raise ValueError(f"{where}.{part}: a factor is not upper-triangular (saved with "
                                     f"precond_update='procrustes'?); precond_update='eq' needs triangular ones")
        momentum = state.get("momentum")
        if self._averages is not None and momentum is not None:
            for part, shape in self.shapes.items():
                checks.float_tensor(checks.entry(momentum, part, f"{where}: momentum"), shape,
                                    f"{where}: momentum[{part!r}]")
            steps = state.get("momentum_steps", 0)
            if isinstance(steps, dict):  # per tensor (files before that: one count for the layer)
                for part in self.parts:
                    checks.count(checks.entry(steps, part, f"{where}: momentum_steps"),
                                 f"{where}: momentum_steps[{part!r}]", shape=())  # copied in place
            else:
                checks.integer(steps, f"{where}: momentum_steps")
        self._checked_uses(state)

    def _check_structure(self, part: str, saved: Any, expected: list[tuple[int, ...]]) -> None:
        """``ValueError`` for the factors of a weight stored ``[in, out]`` saved with the structure
        versions before gave it (square, ``memory_save_mode="one_diag"``: the diagonal factor on
        the stored layout's first side, the input; it now follows the ``nn.Linear`` twin's
        ``[out, in]``, the output side): as saved, in the stored order, they have the shapes this
        layer's factors have in its own order."""
        if not self.transposed[self.parts.index(part)] or not isinstance(saved, Mapping):
            return
        qs = saved.get("q")
        if not isinstance(qs, list) or not all(isinstance(q, torch.Tensor) for q in qs):
            return
        got = [tuple(q.shape) for q in qs]  # in this layer's order (swapped)
        if got == expected or got[::-1] != expected:
            return
        raise ValueError(
            f"state of {self.name}.{part}: the factor layout of a weight stored [in, out] (GPT-2 style "
            f"Conv1D) changed: it is preconditioned as its nn.Linear twin's [out, in] matrix, and under "
            f"memory_save_mode={self._settings.get('memory_save_mode')!r} the diagonal side now follows the "
            f"nn.Linear twin (the output side of a square weight); this state has the factor structure "
            f"of the stored layout (saved by an earlier version: diagonal on the input side), factor "
            f"shapes {got[::-1]} where {expected[::-1]} are expected, and cannot be loaded into this "
            f"structure (start its preconditioner afresh, or load it with the version that saved it)")

    def _checked_uses(self, state: dict[str, Any]) -> dict[str, float]:
        """The saved ``uses_per_update`` of each part (1 where older files lack it): 1 / the update
        probability, a finite number >= 1; ``ValueError`` naming the part otherwise."""
        where = f"state of {self.name}: uses_per_update"
        uses = state.get("uses_per_update", {})
        if not isinstance(uses, Mapping):
            raise ValueError(f"{where} must be a dict of numbers by parameter, got {uses!r}")
        return {part: checks.number(uses.get(part, 1.0), f"{where}[{part!r}]", minimum=1.0) for part in self.parts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = self._swap_layout(state)
        self._check_state(state)
        uses = self._checked_uses(state)
        for part in self.parts:
            self.factor(part).load_state_dict(self._without_skipped_dims(part, state["factors"][part]))
            self.tensor(part).uses_per_update = uses[part]
            self.tensor(part).invalidate()
        if self._averages is not None and state.get("momentum") is not None:
            steps = state.get("momentum_steps", 0)
            for part in self.shapes:  # the entries checked
                value = state["momentum"][part]
                self._averages[part].held_momentum().copy_(value)
                # files written before the per-tensor state kept one count for the layer
                self._averages[part].steps.fill_(steps) if not isinstance(steps, dict) else \
                    self._averages[part].steps.copy_(steps[part])


def _adopt_stack(states, part: int, factor: int) -> tuple[str, torch.Tensor]:
    """Stack factor ``factor`` of parameter ``part`` across layers: its formed product, or the
    factor itself; each layer's tensor becomes a view into the stack."""
    if states[0][part].products()[factor] is not None:
        stack = torch.stack([row[part].products()[factor] for row in states])
        for row, view in zip(states, stack.unbind(0)):
            row[part].products()[factor] = view
        return "product", stack
    stack = torch.stack([row[part].factors.q[factor] for row in states])
    for row, view in zip(states, stack.unbind(0)):
        row[part].factors.q[factor] = view
    return "factor", stack


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``[L]`` bool: each of the ``L`` tensors stacked in ``x`` is finite (a NaN or Inf makes its
    L2 norm NaN or Inf; taken in float32 or wider, so a clipped update's norm cannot overflow)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return torch.isfinite(torch.linalg.vector_norm(x.reshape(x.shape[0], -1), dim=1, dtype=wide))


def _right_multiply(x: torch.Tensor, kind: str, stack: torch.Tensor) -> torch.Tensor:
    """``x P`` for row vectors ``x`` ``[L, r, n]``: ``P`` = the stacked product (``[L, n]`` for
    a diagonal factor, else ``[L, n, n]``, symmetric) or ``QᵀQ`` from the stacked factor (cast
    to ``x``'s dtype, the compute dtype, when the factors are kept in another)."""
    stack = stack.to(x.dtype)
    if stack.dim() == 2:
        return x * stack.unsqueeze(1)
    if kind == "product":
        return torch.matmul(x, stack)
    return torch.matmul(torch.matmul(x, stack.transpose(1, 2)), stack)


def _check_memory_save_mode(name: str, value):
    check_memory_save_mode(value)
    return value


# P = s²·I must be finite in float32 (and bfloat16): s at most sqrt(3.4e38) ≈ 1.8e19.
_INIT_SCALE_MAX = torch.finfo(torch.float32).max ** 0.5


def _check_init_scale(name: str, value):
    if value is None:
        return None
    scale = check.check_positive(name, value)
    if scale > _INIT_SCALE_MAX:
        raise ValueError(f"{name} must be at most {_INIT_SCALE_MAX:.3g} (its square, the initial "
                         f"preconditioner, must be finite in float32), got {value!r}")
    return scale


def _check_update_rule(name: str, value) -> str:
    check_update_rule(value)
    return value


def _check_b1(name: str, value) -> float:
    return check.check_unit_interval(name, value, low_open=False, high_open=True)


def _check_update_probability(name: str, value):
    if value is None or callable(value):
        return value
    return check_probability(check.as_number(name, value), name)  # no bools


def _check_seed(name: str, value) -> int:
    return check.check_int(name, value, minimum=-(2**63))


class PSGDSpec(MethodSpec):
    """PSGD Kron (Xi-Lin Li): learned Kronecker-factored whitening of each parameter's
    gradient; needs only the gradient (no hooks, nothing to reduce under DDP)."""

    name = "psgd"
    options = {
        "preconditioner_update_probability": Option(None, _check_update_probability, collective=True),
        # 0: every dim gets a diagonal factor (as in Kron)
        # The factors' shapes and dtype are collective: owners broadcast them under
        # grad_worker_fraction < 1, so ranks must agree on them.
        "max_size_triangular": Option(8192, lambda n, v: check.check_int(n, v, minimum=0), collective=True),
        "min_ndim_triangular": Option(2, lambda n, v: check.check_int(n, v, minimum=0), collective=True),
        "memory_save_mode": Option(None, _check_memory_save_mode, collective=True),
        "momentum_into_precond_update": Option(False, check.check_bool),
        "precond_b1": Option(0.9, _check_b1),
        # 0 is meaningful (a warm-up from 0: no Q change)
        "precond_lr": Option(0.1, check.check_non_negative, per_step="refresh"),
        "precond_init_scale": Option(1.0, _check_init_scale),
        "precond_dtype": Option(torch.float32, check.check_float_dtype, collective=True),
        "merge_dims": Option(False, check.check_bool, collective=True),
        "precond_update": Option("eq", _check_update_rule, collective=True),
        "seed": Option(0, _check_seed, collective=True),
    }
    health_check_every = 100

    def __init__(self, settings: dict) -> None:
        super().__init__(settings)
        # Q = s·I is stored in the factors' dtype (P = QᵀQ is formed in float32 or wider)
        scale, dtype = settings.get("precond_init_scale"), settings.get("precond_dtype")
        if isinstance(scale, (int, float)) and isinstance(dtype, torch.dtype) and scale > torch.finfo(dtype).max:
            raise ValueError(f"precond_init_scale must be at most {torch.finfo(dtype).max:.6g} (the initial "
                             f"factors s·I are stored in {dtype}), got {scale!r}")

    def select(self, model, is_skipped, log) -> list[Selected]:
        return find_parameter_modules(model, is_skipped, log)

    def make_layer(self, index: int, selected: Selected) -> PSGDLayer:
        s = self.settings
        # a linear weight stored [in, out] is preconditioned as [out, in], as an nn.Linear twin's
        transposed = [n for n, p in selected.params
                      if selected.weight_transposed and n == "weight" and p.dim() == 2 and selected.index is None]
        return PSGDLayer(
            selected.name, [(n, p.shape) for n, p in selected.params], device=selected.params[0][1].device,
            transposed=transposed,
            momentum_into_precond_update=s["momentum_into_precond_update"], b1=s["precond_b1"],
            seed=s["seed"], layer_index=index, max_size_triangular=s["max_size_triangular"],
            min_ndim_triangular=s["min_ndim_triangular"], memory_save_mode=s["memory_save_mode"],
            init_scale=s["precond_init_scale"], dtype=s["precond_dtype"], merge_dims=s["merge_dims"],
            update_rule=s["precond_update"],
            squeeze_dims=True)  # a pointwise convolution is preconditioned as its nn.Linear twin

    def make_schedule(self) -> ProbabilitySchedule:
        return ProbabilitySchedule(self.settings["preconditioner_update_probability"])
