"""The covariance factors of a whitened matrix's sides and their whiteners, for ``WhitenedMuon``.

A whitened parameter holds ``k`` matrices ``[out, in]`` (one for an ``nn.Linear``, HF
``Conv1D`` or convolution, one per expert for fused experts). For each matrix and side
(``"input"``; ``"output"`` with the output side on) this keeps

    F ← decay·F + (1 − decay)·mean over the rows of a statistics step of  r rᵀ

(for a centred input side, of ``(r − r̄)(r − r̄)ᵀ``, ``r̄`` the mean of the step's rows)
and the whitener ``T`` of ``F + λI`` (``Tᵀ T = (F + λI)⁻¹``, ``λ = damping · tr(F) / dim``, so
the whitener is invariant to the scale of the rows), per diagonal block when ``block_size``
splits the side. The rows come through :mod:`kron_precond.capture` and the module adapters of
:mod:`kron_precond.modules`, the same rows K-FAC reads (without the bias's trailing 1: a bias
is not whitened), so every module kind the engine knows is whitened on the right side.

State lives in the optimizer's per-parameter state (``input_factor``, ``input_seen``,
``input_whitener``, and ``output_*``; shape ``units + [blocks, b, b]`` with ``units`` ``()`` for
one matrix and ``(E,)`` for experts) so that checkpoints carry it. Sums since the last refresh
are pending here and are all-reduced (one bucketed collective, upper triangles) on the refresh,
so every world size gets one process's factors.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef

from kron_precond.capture import backward_pass
from kron_precond.distributed import collectives

ALLREDUCE_BUCKET_BYTES = 25 * 2**20  # KronPreconditioner's default allreduce_bucket_cap_mb
SIDES = ("input", "output")


class MatrixView:
    """How a parameter's tensor is read as a stack of ``k`` matrices ``[out, in]`` and written back.

    ``stacked``: dim 0 indexes the matrices (fused experts, ``k = E``); otherwise ``k = 1``.
    ``stored``: one matrix as stored (``[in, out]`` when ``transposed``, HF ``Conv1D``); a
    convolution's ``[out, in, *kernel]`` is read as ``[out, in · Π kernel]``, the layout of the
    rows its adapter unfolds. ``parts``: the matrix's outputs are that many equal matrices
    fused along ``out`` (a fused query/key/value projection), each orthogonalised on its own;
    ``part_shape`` is one part's ``[out / parts, in]``. ``part_inputs``: the parts read inputs of
    their own (a packed query/key/value projection called as cross-attention), so the input side
    holds a factor per part, its unit index the part's; it may be switched on or off later (the
    side's statistics are then dropped by the owner)."""

    def __init__(self, param: torch.Tensor, stacked: bool, transposed: bool, parts: int = 1,
                 part_inputs: bool = False) -> None:
        shape = param.shape[1:] if stacked else param.shape
        self.units = param.shape[0] if stacked else 1
        self.state_units: tuple[int, ...] = (self.units,) if stacked else ()
        self.transposed = transposed
        self.stored = (shape[0], shape[1:].numel())
        self.shape = (self.stored[1], self.stored[0]) if transposed else self.stored  # [out, in]
        if parts < 1 or self.shape[0] % parts:
            raise ValueError(f"{parts} parts do not divide the output width {self.shape[0]}")
        self.parts = parts
        if part_inputs and (stacked or parts < 2):
            raise ValueError("inputs per part need an unstacked matrix of several parts")
        self.part_inputs = part_inputs

    def side_units(self, side: str) -> tuple[int, ...]:
        """The leading shape of ``side``'s factor and whitener: ``(k,)`` for a stack, ``(parts,)``
        for an input side per part, ``()`` for one matrix."""
        return (self.parts,) if side == "input" and self.part_inputs else self.state_units

    def side_count(self, side: str) -> int:
        """How many factors ``side`` holds (the unit indices its rows may carry)."""
        return self.parts if side == "input" and self.part_inputs else self.units

    @property
    def part_shape(self) -> tuple[int, int]:
        return (self.shape[0] // self.parts, self.shape[1])

    def matrices(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[n, *param shape]`` (a stack of ``n`` parameters' tensors) as ``[n·k, out, in]``."""
        x = tensor.reshape(-1, *self.stored)
        return x.mT if self.transposed else x

    def tensors(self, matrices: torch.Tensor, like: torch.Size) -> torch.Tensor:
        """The inverse of :meth:`matrices`: ``[n·k, out, in]`` back to ``[n, *like]``."""
        x = matrices.mT if self.transposed else matrices
        return x.reshape(-1, *like)

    def width(self, side: str) -> int:
        return self.shape[1] if side == "input" else self.shape[0]


class UnitObserver:
    """What :class:`~kron_precond.capture.ActivationCapture` calls with one matrix's rows."""

    def __init__(self, statistics: "WhiteningStatistics", param: torch.Tensor, index: int, name: str) -> None:
        self.statistics, self.param, self.index, self.name = statistics, param, index, name

    @property
    def statistics_dtype(self) -> torch.dtype:  # loss-scaled output gradients are cast to it first
        return torch.promote_types(self.param.dtype, torch.float32)

    def observe_activations(self, rows: torch.Tensor) -> None:
        self.statistics.observe(self, "input", rows, 1.0)

    def activation_terms(self, rows: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], bool] | None:
        """The call's terms, with the form its rows came in (a packed in_proj's input side: one
        input for every part, or the part's own), which may change before the backward adds them."""
        terms = self.statistics.terms(self, "input", rows, 1.0)
        return None if terms is None else (terms, self.statistics.views[id(self.param)].part_inputs)

    def add_activation_terms(self, staged: tuple[tuple[torch.Tensor, ...], bool] | None) -> None:
        """Called in the backward: a forward after it reads new rows, even from a buffer refilled
        without a version bump, so the product shared within one forward (q, k and v) is dropped."""
        self.statistics.forget_products()
        if staged is None:
            return
        terms, part_inputs = staged
        view = self.statistics.views[id(self.param)]
        if part_inputs == view.part_inputs:
            self.statistics.add(self, "input", terms)
        elif view.part_inputs:
            # a self-attention call's rows (one input for every part), staged before a later call
            # of the step, as cross-attention, gave the parts inputs of their own: they are the
            # query's, the key's and the value's alike, as the pending ones carried over then
            for index in range(view.parts):
                self.statistics.add(self, "input", terms, index)
        # else: staged per part, then a checkpoint's load took the side back to one input, which
        # dropped its statistics: these rows go with them

    def observe_output_grads(self, rows: torch.Tensor, scale: float, call: Any = None) -> None:
        """One call's output-gradient rows, unscaled, and its row count ``scale`` (the factor
        each row's gradient carries ``1/`` of under a mean loss): the refresh scales the step's
        sums by the square of the step's count (:meth:`WhiteningStatistics.terms`)."""
        self.statistics.observe(self, "output", rows, scale)

    def count_output_call(self, scale: float) -> None:
        """A call of the module gave this unit no rows (an expert it sent no token): its count
        still adds to the step's, as the loss averages over the call's every row."""
        self.statistics.count_call(self, scale)


class WhiteningStatistics:
    """Pending row sums, their all-reduce and the batched refresh of factors and whiteners.

    Args:
        state: the optimizer's per-parameter state (factors and whiteners are kept there).
        views: ``id(param) -> MatrixView`` of every whitened parameter.
        due: ``due(param)``: whether this step gathers the parameter's statistics.
        sides: ``("input",)`` or ``("input", "output")``.
        outputs: with ``sides`` holding ``"output"``, ``id(param)`` of the parameters whose output
            side is whitened (``None``: every parameter's).
        centered: ``id(param)`` of the parameters whose input side is centred.
        damping, output_damping, factor_decay, statistics_rows, root, block_size, process_group: as
            :class:`~kron_precond.WhitenedMuon` (``output_damping=None``: ``damping``).

    ``loss_over_all_ranks`` (an attribute, ``False``): each rank's loss is its share of the
    global batch's mean and the gradients are summed (torchtitan, whose container sets it),
    rather than its own mean with the gradients averaged (DDP). The output side's sums are then
    scaled by the count summed over ranks, after the all-reduce, where under DDP each rank
    scales its own by its own count before it. The whiteners do not depend on the factors'
    overall scale (the damping is relative to each factor's trace); a running average carried
    into a run on another number of ranks does.
    """

    def __init__(self, state: dict, views: dict[int, MatrixView], due: Callable[[torch.Tensor], bool], *,
                 sides: tuple[str, ...], damping: float, factor_decay: float, statistics_rows: int | None,
                 root: str, block_size: int | None, process_group: Any, centered: Iterable[int] = (),
                 outputs: Iterable[int] | None = None, output_damping: float | None = None) -> None:
        self.state, self.views, self.due, self.sides = state, views, due, sides
        self.outputs = None if outputs is None else frozenset(outputs)
        self._without_output = tuple(side for side in sides if side != "output")
        self.centered = frozenset(centered)
        self.damping, self.factor_decay, self.statistics_rows = damping, factor_decay, statistics_rows
        self.output_damping = damping if output_damping is None else output_damping
        self.root, self.block_size, self.process_group = root, block_size, process_group
        self.loss_over_all_ranks = False
        # (id(param), side) -> [row-product sums [k, blocks, b, b], row counts [k]] since the last refresh
        # (an output side's: [unscaled sums, row counts, each unit's step count [k]]);
        # a centred input side: [scatter about each call's mean, counts, row sums [k, width] (float64),
        # Σ s sᵀ / n per call [k, blocks, b, b] (float64)] (see _centred_terms)
        self.pending: dict[tuple[int, str], list[torch.Tensor]] = {}
        # (width, blocks, centred) -> (weak reference to the last input's storage, its key, its row statistics)
        self._last_product: dict[tuple[int, int, bool], tuple] = {}
        self.observed: set[int] = set()  # parameters whose rows were seen at least once
        # (id(param), unit) -> the backward pass (autograd graph task) whose call was counted last
        self._counted: dict[tuple[int, int], int] = {}
        self.observed_this_step = False

    # -- statistics --------------------------------------------------------------------
    def sides_of(self, param: torch.Tensor) -> tuple[str, ...]:
        """The sides of ``param`` that are whitened."""
        if self.outputs is None or id(param) in self.outputs:
            return self.sides
        return self._without_output

    def blocks(self, width: int) -> int:
        """Number of diagonal blocks a side of this width is whitened in."""
        b = self.block_size
        return width // b if b is not None and width > b and width % b == 0 else 1

    def side_blocks(self, param: torch.Tensor, side: str) -> int:
        """Number of diagonal blocks ``param``'s side is whitened in: a fused matrix's output
        side in at least one block per part (each part is whitened by its own outputs' factor)."""
        view = self.views[id(param)]
        if side == "output" and view.parts > 1:
            return view.parts * self.blocks(view.part_shape[0])
        return self.blocks(view.width(side))

    @torch.no_grad()
    def observe(self, unit: UnitObserver, side: str, rows: torch.Tensor, scale: float) -> None:
        """Add one call's rows of ``side`` (:meth:`terms`, then :meth:`add`)."""
        terms = self.terms(unit, side, rows, scale)
        if terms is not None:
            self.add(unit, side, terms)

    @torch.no_grad()
    def terms(self, unit: UnitObserver, side: str, rows: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...] | None:
        """What one call's rows of ``side`` add to the pending sums (``None`` where the side is
        not gathered this step): the product, the row count, and a centred input side's terms."""
        param = unit.param
        if not self.due(param) or side not in self.sides_of(param):
            return None
        view = self.views[id(param)]
        width = view.width(side)
        if rows.shape[-1] != width:  # the adapters guarantee it; a user adapter may not
            raise ValueError(f"WhitenedMuon: the {side} rows of {unit.name} have width {rows.shape[-1]}, "
                             f"expected {width} for its weight {tuple(param.shape)}")
        x = rows.reshape(-1, width)
        if self.statistics_rows is not None:
            x = x[: self.statistics_rows]
        wide = torch.promote_types(x.dtype, torch.float32)
        blocks = self.side_blocks(param, side)
        centred = side == "input" and id(param) in self.centered
        cache = (width, blocks, centred)
        terms = self._shared_terms(rows, cache) if side == "input" else None
        if terms is None:
            xs = x.to(wide)
            products = self._centred_terms(xs, blocks) if centred else (self._product(xs, blocks),)
            # rows that are not finite (an fp16 overflow that GradScaler will skip) are left out:
            # the call's terms are zeroed where they are computed (once for the layers that share
            # them), out of place: selective activation checkpointing keeps the matmul's output and
            # refuses a recompute that finds it changed
            finite = torch.isfinite(products[0].sum())
            product, *centring = (torch.where(finite, t, 0.0) for t in products)
            terms = (product, finite.to(wide) * x.shape[0], *centring)
            if side == "input":
                self._remember(rows, cache, terms)
            else:  # the call's count, where its rows are finite
                terms += (finite.to(wide) * (scale if self._first_in_backward(unit) else 0.0),)
        return terms

    def _first_in_backward(self, unit: UnitObserver) -> bool:
        """Whether this is the first call of ``unit`` whose count this backward pass adds. Under
        a mean loss over ``N`` rows each row's gradient carries ``1/N``: a backward pass (one
        micro-batch) counts one call's rows, however many calls of the module it reaches (a
        block applied several times per forward), and the step sums its backward passes."""
        task = backward_pass()
        if task < 0:  # not inside a backward pass: every call counts
            return True
        key = (id(unit.param), unit.index)
        if self._counted.get(key) == task:
            return False
        self._counted[key] = task
        return True

    @torch.no_grad()
    def add(self, unit: UnitObserver, side: str, terms: tuple[torch.Tensor, ...], index: int | None = None) -> None:
        """Add one call's :meth:`terms` to the pending sums of ``unit``'s side (of its matrix
        ``index``, ``unit.index`` unless given)."""
        param = unit.param
        # Every call adds to zeroed sums: a forward recomputed under selective activation
        # checkpointing must run the same ops as the original forward (torch.utils.checkpoint
        # replays the ops it saved by their order), and the recompute finds the sums already there.
        pending = self.pending.get((id(param), side))
        if pending is None:
            pending = self.pending[(id(param), side)] = self._zeros(param, side, terms[0].dtype, terms[0].device)
        for total, term in zip(pending, terms):  # product, count (a centred side's: row sum, s sᵀ / n)
            total[unit.index if index is None else index].add_(term)
        self.observed.add(id(param))
        self.observed_this_step = True

    def count_call(self, unit: UnitObserver, scale: float) -> None:
        """Add a call's row count to ``unit``'s output side (a call that gave it no rows)."""
        param = unit.param
        if not self.due(param) or "output" not in self.sides_of(param) or not self._first_in_backward(unit):
            return
        pending = self.pending.get((id(param), "output"))
        if pending is None:
            pending = self.pending[(id(param), "output")] = self._zeros(param, "output", torch.promote_types(
                param.dtype, torch.float32), param.device)
        pending[2][unit.index] += scale

    @staticmethod
    def _product(xs: torch.Tensor, blocks: int) -> torch.Tensor:
        """``Σ x xᵀ`` over the rows, per diagonal block: ``[blocks, b, b]``."""
        xb = xs.reshape(xs.shape[0], blocks, xs.shape[1] // blocks).transpose(0, 1)  # [blocks, rows, block]
        return gram(xb)

    @classmethod
    def _centred_terms(cls, xs: torch.Tensor, blocks: int) -> tuple[torch.Tensor, ...]:
        """One call's centred statistics: ``Σ (x − m)(x − m)ᵀ`` about the call's own mean ``m``
        (in the rows' dtype: no cancellation, however far the rows are from the origin), and,
        in float64, the row sum ``s = Σ x`` and ``s sᵀ / n``. Summed over calls and ranks,
        ``Σ (x − m)(x − m)ᵀ + Σ s sᵀ / n − S Sᵀ / N`` (``S``, ``N``: the totals) is the scatter
        of all the rows about their common mean; its float64 part cancels only digits of the
        calls' means, not of their spread."""
        sums = xs.sum(dim=0, dtype=_exact(xs.device))
        count = max(xs.shape[0], 1)
        centred = xs - (sums / count).to(xs.dtype)
        blocked = sums.reshape(blocks, -1)
        return (cls._product(centred, blocks), sums, torch.einsum("jb,jc->jbc", blocked, blocked) / count)

    def _shared_terms(self, rows: torch.Tensor, cache: tuple) -> tuple[torch.Tensor, ...] | None:
        """The row statistics of the input the last layer of this width, blocking and
        centring read, when this is that input unchanged (q, k and v projections read one
        tensor: one product). The input is remembered by a weak reference to its storage (no
        activation kept alive) and its offset, shape, strides and version."""
        last = self._last_product.get(cache)
        if last is None:
            return None
        ref, key, terms = last
        return terms if not ref.expired() and key == _rows_key(rows) else None

    def _remember(self, rows: torch.Tensor, cache: tuple, terms: tuple[torch.Tensor, ...]) -> None:
        self._last_product[cache] = (StorageWeakRef(rows.untyped_storage()), _rows_key(rows), terms)

    def forget_products(self) -> None:
        """Share no product with a later call."""
        self._last_product.clear()

    def forget_inputs(self) -> None:
        """One step's inputs only: called at every step."""
        self.forget_products()
        self.observed_this_step = False

    def discard(self) -> None:
        """Drop what the iteration since the last step gathered (one whose step will not come:
        abandoned, skipped, rolled back): every pending sum, and the inputs' products."""
        self.pending.clear()
        self.forget_inputs()

    def drop_pending(self, params: set[int]) -> None:
        """Drop the pending sums of the weights whose ``id`` is in ``params``."""
        for key in [key for key in self.pending if key[0] in params]:
            del self.pending[key]

    def _zeros(self, param: torch.Tensor, side: str, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """Empty pending sums of ``param``'s side (four tensors for a centred input side)."""
        view = self.views[id(param)]
        width = view.width(side)
        blocks = self.side_blocks(param, side)
        size = width // blocks
        units = view.side_count(side)
        zeros = [torch.zeros(units, blocks, size, size, dtype=dtype, device=device),
                 torch.zeros(units, dtype=dtype, device=device)]
        if side == "input" and id(param) in self.centered:
            exact = _exact(device)
            zeros += [torch.zeros(units, width, dtype=exact, device=device),
                      torch.zeros(units, blocks, size, size, dtype=exact, device=device)]
        if side == "output":
            zeros.append(torch.zeros(units, dtype=dtype, device=device))  # the step's counts
        return zeros

    # -- refresh -----------------------------------------------------------------------
    def _scale_output_sums(self, keys: list[tuple[int, str]]) -> None:
        """Multiply the pending sums of the output sides among ``keys`` by the square of their
        step counts; the counts are then dropped from the pending entry."""
        for key in keys:
            if key[1] == "output":
                total, count, steps = self.pending[key]
                self.pending[key] = [total.mul_(steps.square()[:, None, None, None]), count]

    def _all_reduce_pending(self, keys: list[tuple[int, str]]) -> None:
        group = self.process_group
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if world <= 1:
            return
        # the engine's bucketed all-reduce; each block is symmetric, so only its upper triangle travels
        # (counts and row sums flattened: a [k, width] sum with k == width is not a symmetric matrix)
        tensors = [t for key in keys for t in (*self.pending[key][0].flatten(0, 1).unbind(0),
                                               *(p.view(-1) for p in self.pending[key][1:3]),
                                               *(p for m in self.pending[key][3:] for p in m.flatten(0, 1).unbind(0)))]
        collectives.all_reduce(tensors, group=group, cap_bytes=ALLREDUCE_BUCKET_BYTES, symmetric=True).wait()

    @torch.no_grad()
    def refresh(self, params: Iterable[torch.Tensor]) -> None:
        """Fold the pending sums of ``params`` into their factors and recompute their whiteners.
        Every rank allocates every factor it refreshes, so the collective has the same shape
        everywhere (a layer not called on a rank contributes zeros)."""
        keys = []
        for p in params:
            for side in self.sides_of(p):
                key = (id(p), side)
                if key not in self.pending:
                    self.pending[key] = self._zeros(p, side, torch.promote_types(p.dtype, torch.float32), p.device)
                keys.append((key, p))
        # Under a mean loss a row's gradient carries 1/n of the count the loss divides by: each
        # rank's own where its loss is its own mean (DDP), scaled back before the sum over ranks;
        # the count over all ranks where it is its share of the global mean (torchtitan), summed
        # with the sums and scaled back after.
        pending = [key for key, _ in keys]
        if not self.loss_over_all_ranks:
            self._scale_output_sums(pending)
        self._all_reduce_pending(pending)
        if self.loss_over_all_ranks:
            self._scale_output_sums(pending)
        # The factors of one layout are updated and decomposed as one batch: a refresh costs a
        # fixed number of ops per layout, not per matrix (it runs every step with statistics_every=1).
        layouts: dict[tuple, list[tuple[dict, str, torch.Tensor, torch.Tensor, MatrixView]]] = {}
        for key, p in keys:
            total, count, *centring = self.pending.pop(key)
            if centring:  # after the all-reduce, so the common mean is the global batch's
                sums, means = centring
                s = sums.reshape(total.shape[0], total.shape[1], -1)
                scale = count.to(s.dtype).clamp(min=1)[:, None, None, None]
                between = means - torch.einsum("kjb,kjc->kjbc", s, s) / scale
                total = total + between.to(total.dtype)
            state, side, view = self.state[p], key[1], self.views[id(p)]
            if state.get(f"{side}_factor") is None:
                state[f"{side}_factor"] = torch.zeros(view.side_units(side) + total.shape[1:], dtype=total.dtype,
                                                      device=total.device)
                # 0 / 1 per matrix: a float, because torch.optim's load casts state tensors
                state[f"{side}_seen"] = torch.zeros(view.side_units(side), dtype=total.dtype, device=total.device)
            layouts.setdefault((tuple(total.shape[1:]), total.dtype, total.device), []).append(
                (state, side, total, count, view))
        for members in layouts.values():
            self._refresh_layout(members)

    def _refresh_layout(self, members: list[tuple[dict, str, torch.Tensor, torch.Tensor, MatrixView]]) -> None:
        # Each pass over the batch writes in place where it can: at a few hundred wide the
        # bookkeeping around the decomposition is bound by memory traffic, not arithmetic.
        # Input sides first, then output sides: each side's factors are a contiguous run of the
        # batch, decomposed with the side's own damping.
        members = sorted(members, key=lambda m: m[1] == "output")
        factors = [state[f"{side}_factor"] for state, side, *_ in members]
        seens = [state[f"{side}_seen"] for state, side, *_ in members]
        counts = torch.cat([count for _, _, _, count, _ in members])
        batch = torch.cat([total for _, _, total, _, _ in members])
        batch.div_(counts.clamp(min=1)[:, None, None, None])
        usable = (counts > 0) & torch.isfinite(batch.sum(dim=(1, 2, 3)))  # one reduction each, not a mask
        seen = torch.cat([s.reshape(-1) for s in seens])
        stacked = torch.cat([f.reshape(-1, *f.shape[-3:]) for f in factors])
        # first observation: take it whole; later: the exponential average; unusable: keep
        # (1 - decay rounded to the factors' dtype: a Python float in where() makes the weights float32)
        decay = torch.full_like(seen, 1 - self.factor_decay, dtype=stacked.dtype)
        weight = torch.where(seen > 0, decay, 1.0) * usable
        # an unusable factor's batch becomes zeros, which weight 0 leaves out of the average exactly
        # (a multiply by the mask: a where with a broadcast mask costs twice a pass)
        batch.nan_to_num_(0.0, 0.0, 0.0).mul_(usable[:, None, None, None])
        stacked.lerp_(batch, weight[:, None, None, None])
        del batch
        sizes = [f.reshape(-1, *f.shape[-3:]).shape[0] for f in factors]
        torch._foreach_copy_(factors, [s.reshape(f.shape) for s, f in zip(stacked.split(sizes), factors)])
        new_seen = torch.maximum(seen, usable.to(seen.dtype))
        torch._foreach_copy_(seens, [s.reshape(f.shape) for s, f in zip(new_seen.split(sizes), seens)])
        # the factors are stored: the batch is the decomposition's to overwrite
        flat = stacked.flatten(0, 1)
        split = sum(n for (_, side, *_), n in zip(members, sizes) if side == "input") * stacked.shape[1]
        runs = ([(flat, self.damping)] if self.output_damping == self.damping  # one damping: one decomposition
                else [(run, d) for run, d in ((flat[:split], self.damping), (flat[split:], self.output_damping))
                      if run.shape[0]])
        pieces = [self.decompose(run, overwrite=True, damping=d) for run, d in runs]
        whiteners, good = pieces[0] if len(pieces) == 1 else (torch.cat(p) for p in zip(*pieces))
        whiteners = whiteners.unflatten(0, stacked.shape[:2]).split(sizes)
        good = good.unflatten(0, stacked.shape[:2]).split(sizes)
        for (state, side, *_), whitener, ok, factor in zip(members, whiteners, good, factors):
            # a new tensor per parameter, as torch.optim's per-parameter state (not a view of the batch)
            state[f"{side}_whitener"] = _or_previous(whitener.reshape(factor.shape),
                                                     ok.reshape(*factor.shape[:-2], 1, 1),
                                                     state.get(f"{side}_whitener"))

    def whitener(self, factor: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """``T`` per diagonal block of ``factor`` (``[blocks, b, b]``), with ``Tᵀ T = (F + λI)⁻¹``
        and ``λ = damping · tr(F)/b`` per block: ``L⁻¹`` (Cholesky) or ``(F + λI)^{-1/2}``. The
        identity for an all-zero block; the previous ``T`` where the decomposition fails (at the
        input side's ``damping``)."""
        return _or_previous(*self.decompose(factor, overwrite=False, damping=self.damping), previous)

    def decompose(self, factor: torch.Tensor, overwrite: bool, damping: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(``T`` per block of ``factor`` ``[blocks, b, b]``, whether it is usable ``[blocks, 1, 1]``):
        :meth:`whitener` before its fallback, and what the refresh calls. ``overwrite``: ``factor``
        may be used as scratch (the refresh's copy; it then holds ``F + λI`` or less).
        ``damping``: the side's (``λ = damping · tr(F)/b``)."""
        size = factor.shape[-1]
        lam = (damping * factor.diagonal(dim1=-2, dim2=-1).sum(-1) / size)[:, None, None]
        # an all-zero block (a layer never called) becomes the identity: never a zero matrix
        safe = factor if overwrite else factor.clone()
        safe.diagonal(dim1=-2, dim2=-1).add_(torch.where(lam > 0, lam, 1.0)[..., 0])
        if self.root == "cholesky":
            whitener, info = inverse_cholesky(safe)
            # a failed block (info > 0) may hold anything: replaced by the caller
            return whitener, ((info == 0) & torch.isfinite(whitener.sum(dim=(1, 2))))[:, None, None]
        values, vectors = torch.linalg.eigh(safe)
        floor = torch.where(lam > 0, lam, 1.0)[:, :, 0]
        whitener = (vectors * values.clamp(min=floor).rsqrt()[:, None, :]) @ vectors.transpose(1, 2)
        return whitener, torch.isfinite(whitener.sum(dim=(1, 2), keepdim=True))


def _or_previous(whitener: torch.Tensor, good: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """``whitener`` where ``good``; elsewhere ``previous``, or the identity before there is one
    (the refresh's and :meth:`WhiteningStatistics.whitener`'s one fallback rule)."""
    if previous is None:
        previous = torch.eye(whitener.shape[-1], dtype=whitener.dtype, device=whitener.device)
    return torch.where(good, whitener, previous)


GRAM_STRIPE = 128  # from 3x this wide, a product is formed by stripes of this many rows, upper part only


def gram(x: torch.Tensor, stripe: int = GRAM_STRIPE) -> torch.Tensor:
    """``xᵀ x`` for a batch ``[k, rows, n]``: ``[k, n, n]``, exactly symmetric (the upper
    triangle's values, mirrored).

    From three times ``stripe`` wide, only the blocks on and above the diagonal are multiplied,
    one stripe of ``stripe`` rows of the result at a time, and the rest is their transpose:
    ``(1 + s/n) / 2`` of the multiply-adds (0.56 at 1,024 wide). From 1,024 rows on one CPU
    thread the product took 18-24 % less time from 384 to 1,024 wide; at 256 wide it saved 6 %
    and below nothing, so narrower products stay one matmul."""
    n = x.shape[-1]
    if n < 3 * stripe:  # out of place: selective activation checkpointing caches the product
        return _mirror_upper(torch.bmm(x.mT, x), inplace=False)
    out = x.new_empty(x.shape[0], n, n)
    for start in range(0, n, stripe):
        stop = min(start + stripe, n)
        torch.bmm(x[:, :, start:stop].mT, x[:, :, start:], out=out[:, start:stop, start:])
        _mirror_upper(out[:, start:stop, start:stop], inplace=True)
        out[:, stop:, start:stop] = out[:, start:stop, stop:].mT
    return out


def _mirror_upper(square: torch.Tensor, inplace: bool) -> torch.Tensor:
    """``square`` (``[k, n, n]``) with its strict lower triangle replaced by the transpose of
    its upper one, in place or as a new tensor. Some CPUs' BLAS kernels round the two
    triangles of ``xᵀ x`` differently (a few ulps): the statistics are exactly symmetric on
    every machine."""
    n = square.shape[-1]
    lower = torch.ones(n, n, dtype=torch.bool, device=square.device).tril_(-1)
    mirrored = torch.where(lower, square.mT, square)
    return square.copy_(mirrored) if inplace else mirrored


CHOLESKY_LEAF = 96  # below this width LAPACK's Cholesky and a triangular solve beat the matmuls that replace them
# From twice this wide, a product with a triangular or symmetric result skips the zero (or mirrored)
# quarter, recursively; narrower, one matmul is faster than the three that replace it.
TRIANGLE_LEAF = 128


def inverse_cholesky(matrix: torch.Tensor, leaf: int = CHOLESKY_LEAF,
                     triangle: int = TRIANGLE_LEAF) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L⁻¹, info)`` for a batch of symmetric positive-definite ``[..., n, n]`` with ``L Lᵀ``
    their Cholesky factors; ``info`` is ``0`` per matrix where every pivot was positive. Only
    the lower triangle of ``matrix`` is read.

    By halves, never forming ``L``: with ``F = [[A, Bᵀ], [B, C]]``, ``T₁ = chol(A)⁻¹``,
    ``W = B T₁ᵀ`` and the Schur complement ``S = C − W Wᵀ`` (``T₂ = chol(S)⁻¹``),

        L⁻¹ = [[T₁, 0], [−T₂ W T₁, T₂]],

    recursively down to ``leaf`` wide, where LAPACK decomposes and a triangular solve
    inverts. The blocked Cholesky's arithmetic, in batched matmuls: three of the four products
    per halving have a triangular operand (``T₁``, ``T₂``) and the fourth needs only the lower
    triangle of ``S``, so from ``2 · triangle`` wide each skips its zero quarter, recursively
    (about a third fewer multiply-adds than full products at 1,024 wide). 1.2x to 2x faster
    than LAPACK's Cholesky followed by an inverse by halves, at 256 to 2,048 wide on one CPU
    thread (narrower, within a fraction of a millisecond either way), and equal to it to
    rounding. A matrix that is not positive definite (in any leaf, the Schur complements
    included) gets ``info > 0``; its ``L⁻¹`` may then hold anything, so the caller replaces it."""
    n = matrix.shape[-1]
    flat = matrix.reshape(-1, n, n)
    inverse = torch.zeros_like(flat)
    info = _inverse_cholesky_into(flat, inverse, leaf, max(triangle, 1))
    return inverse.reshape(matrix.shape), info.reshape(matrix.shape[:-2])


def _inverse_cholesky_into(matrix: torch.Tensor, out: torch.Tensor, leaf: int, triangle: int) -> torch.Tensor:
    """Writes ``L⁻¹`` of ``matrix`` (``[k, n, n]``; its lower triangle) into the lower triangle
    of ``out`` (a zeroed view), block by block in place rather than by concatenation; returns
    ``info``."""
    n = matrix.shape[-1]
    if n <= leaf:
        lower, info = torch.linalg.cholesky_ex(matrix)  # reads the lower triangle only
        eye = torch.eye(n, dtype=matrix.dtype, device=matrix.device)
        out.copy_(torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False))
        return info
    h = n // 2
    top, bottom = out[:, :h, :h], out[:, h:, h:]
    info_top = _inverse_cholesky_into(matrix[:, :h, :h], top, leaf, triangle)
    w = matrix.new_empty(matrix.shape[0], n - h, h)
    _times_lower(matrix[:, h:, :h], top, w, triangle, transposed=True)  # B T₁ᵀ: the lower-left block of L
    schur = matrix[:, h:, h:].clone()
    _subtract_gram_lower(schur, w, triangle)  # its upper triangle is stale, and never read
    info_bottom = _inverse_cholesky_into(schur, bottom, leaf, triangle)
    del schur
    y = torch.empty_like(w)
    _times_lower(w, top, y, triangle, transposed=False)  # W T₁
    corner = out[:, h:, :h]
    _lower_times(bottom, y, corner, triangle)  # T₂ W T₁
    corner.neg_()
    return torch.maximum(info_top, info_bottom)


def _times_lower(x: torch.Tensor, lower: torch.Tensor, out: torch.Tensor, triangle: int, transposed: bool) -> None:
    """``out = x L`` (or ``x Lᵀ``) for ``L`` lower triangular ``[k, n, n]`` (its upper triangle
    is not read), ``x`` ``[k, m, n]``: with ``L = [[a, 0], [b, c]]``, ``x L = [x₁ a + x₂ b, x₂ c]``
    and ``x Lᵀ = [x₁ aᵀ, x₁ bᵀ + x₂ cᵀ]``, ``a`` and ``c`` by the same rule."""
    n = lower.shape[-1]
    if n < 2 * triangle:
        torch.bmm(x, lower.mT if transposed else lower, out=out)
        return
    q = n // 2
    a, b, c = lower[:, :q, :q], lower[:, q:, :q], lower[:, q:, q:]
    x1, x2, o1, o2 = x[:, :, :q], x[:, :, q:], out[:, :, :q], out[:, :, q:]
    _times_lower(x1, a, o1, triangle, transposed)
    _times_lower(x2, c, o2, triangle, transposed)
    if transposed:
        o2.baddbmm_(x1, b.mT)
    else:
        o1.baddbmm_(x2, b)


def _lower_times(lower: torch.Tensor, x: torch.Tensor, out: torch.Tensor, triangle: int) -> None:
    """``out = L x`` for ``L`` lower triangular ``[k, n, n]``, ``x`` ``[k, n, m]``:
    ``[[a, 0], [b, c]] [x₁; x₂] = [a x₁; b x₁ + c x₂]``."""
    n = lower.shape[-1]
    if n < 2 * triangle:
        torch.bmm(lower, x, out=out)
        return
    q = n // 2
    _lower_times(lower[:, :q, :q], x[:, :q], out[:, :q], triangle)
    _lower_times(lower[:, q:, q:], x[:, q:], out[:, q:], triangle)
    out[:, q:].baddbmm_(lower[:, q:, :q], x[:, :q])


def _subtract_gram_lower(s: torch.Tensor, w: torch.Tensor, triangle: int) -> None:
    """``s −= w wᵀ`` on the lower triangle of ``s`` (``[k, n, n]``; ``w`` ``[k, n, r]``): the
    blocks strictly above the diagonal are left as they were once ``n`` reaches ``2 · triangle``."""
    n = s.shape[-1]
    if n < 2 * triangle:
        s.baddbmm_(w, w.mT, alpha=-1)
        return
    q = n // 2
    _subtract_gram_lower(s[:, :q, :q], w[:, :q], triangle)
    _subtract_gram_lower(s[:, q:, q:], w[:, q:], triangle)
    s[:, q:, :q].baddbmm_(w[:, q:], w[:, :q].mT, alpha=-1)


def _exact(device: torch.device) -> torch.dtype:
    """The dtype of a centred side's mean terms: float64, where the device has it (not MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _rows_key(rows: torch.Tensor) -> tuple:
    """What identifies a tensor's contents while its storage lives: where it starts, how it is
    laid out and its version (shared by views and ``detach()``, bumped by in-place writes)."""
    return (rows.untyped_storage().data_ptr(), rows.storage_offset(), tuple(rows.shape), rows.stride(),
            rows._version, rows.dtype)
