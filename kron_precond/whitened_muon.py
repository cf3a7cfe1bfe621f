"""WhitenedMuon: Muon's steepest descent measured in a K-FAC-whitened spectral norm.

Muon moves a weight matrix by ``-η msign(M)`` (``M`` the Nesterov momentum of the gradient,
``msign(M) = U Vᵀ`` for ``M = U S Vᵀ``): the steepest-descent step under ``||ΔW||_op``.
With ``A`` the running covariance of the layer's inputs (K-FAC's activation factor), the
steepest-descent step under ``||ΔW A^{1/2}||_op`` is, substituting ``Z = ΔW A^{1/2}``,

    ΔW ∝ -msign(M A^{-1/2}) A^{-1/2}

and with the output-gradient factor ``G`` as well (``output_side=True``), under
``||G^{1/2} ΔW A^{1/2}||_op``: ``-G^{-1/2} msign(G^{-1/2} M A^{-1/2}) A^{-1/2}``. The
whitening enters twice, before and after the orthogonalisation. A preconditioner in front
of ``torch.optim.Muon`` (the library's usual contract: rewrite ``.grad``, then the
optimizer steps) can only do the first half, which on the main job saves 5 % of Muon's
steps and ends above it (docs/benchmarks.md, "Issue 17: `WhitenedMuon`"); the second half
is why this is an optimizer of its own.

Scale: the result is rescaled to the Frobenius norm of ``msign(...)`` and the learning rate
is adjusted like ``torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`` (``0.2·sqrt(max(m, n))``),
so ``lr`` means what it means for Muon (and AdamW) and only the direction changes.

Statistics are read only on statistics steps (every ``statistics_every`` steps): a forward
pre-hook sums ``x xᵀ`` over the input rows (and, with ``output_side``, a tensor hook on the
output sums ``g gᵀ`` over the output gradients). On the same step ``step()`` folds them into
exponential averages and recomputes the whitener of ``A + λI`` (``L⁻¹`` of its Cholesky
factor by default, or its inverse square root), with ``λ = damping · tr(A) / dim``: a damping
relative to the mean eigenvalue, so the whitener is invariant to the scale of the inputs
(and of the loss). A plain step costs two matmuls per side beyond Muon's, weights of one
shape stepped as one stack, and no host synchronisation.

Distributed (DDP): the sums and row counts are all-reduced on refresh steps (one collective),
so the factors are those of the full global batch and every world size gives one process's
result (exact when ``statistics_rows`` is ``None``; a row cap takes each rank's first rows).
FSDP2 and HSDP (DTensor weights sharded by rows, ``Shard(0)``): the momentum stays in each
rank's rows; per stack of weights one all-gather assembles the update that goes into
``msign`` (an orthogonalisation needs the whole matrix), every rank computes the same
direction and keeps its rows, and the statistics are all-reduced as under DDP.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from kron_precond import validation
from kron_precond.autocast import autocast_disabled
from kron_precond.distributed import collectives
from kron_precond.distributed.sharded import ShardedLayout, is_dtensor
from kron_precond.health import new_nonfinite_steps

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic Newton-Schulz
ALLREDUCE_BUCKET_BYTES = 25 * 2**20  # KronPreconditioner's default allreduce_bucket_cap_mb


def msign(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7,
          dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``≈ U Vᵀ`` of ``matrix = U S Vᵀ`` by torch.optim.Muon's Newton-Schulz iteration, for one
    matrix or a stack ``[k, m, n]``, each normalised by its own norm. In bfloat16 (the default)
    every matrix of a stack gets ``torch.optim.Muon``'s result (bitwise on CPU, tested)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    single = x.dim() == 2
    if single:
        x = x.unsqueeze(0)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if transposed:
        x = x.mT
    return (x[0] if single else x).to(matrix.dtype)


def _weight_of(module: Any, index: int) -> nn.Parameter:
    if not isinstance(module, nn.Module):
        raise TypeError(f"WhitenedMuon: modules[{index}] must be an nn.Module, got {type(module).__name__}")
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or weight.ndim != 2:
        raise TypeError(f"WhitenedMuon: modules[{index}] ({type(module).__name__}) needs a 2-D weight "
                        f"[out, in] applied to the last dim of its input, like nn.Linear")
    return weight


def _sharded_layout(weights: list[nn.Parameter], process_group: Any) -> ShardedLayout | None:
    """The FSDP2 / HSDP mesh of the DTensor weights (``None`` when none is one); ``ValueError``
    names a weight with another placement or on another mesh."""
    named = [(f"modules[{i}].weight", w) for i, w in enumerate(weights)]
    if not any(is_dtensor(w) for _, w in named):
        return None
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    return ShardedLayout.detect(named, world)


class WhitenedMuon(torch.optim.Optimizer):
    """Muon on the weights of ``modules``, its steps measured in ``||ΔW A^{1/2}||_op``.

    Give it the hidden 2-D weights Muon would take (``nn.Linear`` modules, or Linear-like ones
    with a 2-D ``[out, in]`` weight applied to the last dim of the input); their biases,
    embeddings, the output layer and norms go to another optimizer (AdamW), as with Muon.

    Args:
        modules: the layers whose ``weight`` this optimizer owns (hooks are put on them).
        lr: learning rate, on AdamW's scale (``match_rms_adamw``); an LR scheduler may change it.
        weight_decay: decoupled weight decay.
        momentum, nesterov: ``torch.optim.Muon``'s momentum (``buf.lerp_(g, 1 - momentum)``).
        statistics_every: steps between statistics steps (which also refresh the whiteners).
        damping: ``λ = damping · tr(F) / dim F`` for each factor ``F``. With fresh statistics
            (``statistics_every=1``) ``0.03`` reached AdamW's loss sooner than ``0.1`` at d_model
            32 and 48, ending as low (32) or higher (48) (docs/benchmarks.md, "Issue 17, round 4").
        factor_decay: exponential-average decay of the factors, per refresh: they average
            over about ``statistics_every / (1 - factor_decay)`` steps (200 by default). For
            short or big-batch runs a few steps is better: ``statistics_every=1,
            factor_decay=0.8`` (docs/benchmarks.md, "Fresher statistics").
        statistics_rows: at most this many rows per module call enter a factor (``None``: all).
        output_side: also whiten the output side with K-FAC's ``G`` (a tensor hook on each
            output on statistics steps; a backward cost then).
        root: how the factor ``F + λI`` is whitened: ``"cholesky"`` (``T = L⁻¹`` for
            ``F + λI = L Lᵀ``; cheap to refresh) or ``"symmetric"`` (``T = (F + λI)^{-1/2}``, an
            ``eigh``). ``||ΔW L||_op = ||ΔW (F+λI)^{1/2}||_op``, so both define the same norm and
            the same exact step; they differ only through Newton-Schulz's approximation.
        block_size: a side wider than this (and divisible by it) keeps only the diagonal
            ``block_size``-blocks of its factor: the statistics, refresh and whitening cost of
            a ``d``-wide side fall by ``d / block_size`` (Newton-Muon blocks the 4d-wide MLP
            input the same way). ``None``: every side whole.
        ns_steps: Newton-Schulz iterations.
        ns_dtype: dtype of the Newton-Schulz iteration (bfloat16, as ``torch.optim.Muon``).
        process_group: where the statistics are all-reduced; ``None``: the default group when
            ``torch.distributed`` is initialised with more than one rank.

    A step whose gradient (for one weight) is not finite leaves that weight, its momentum and
    its weight decay untouched; such steps are counted on the device and reported by a warning
    when the counters are read: on the first step and then once every
    ``nonfinite_warn_interval`` (100) steps, the only host synchronisation of ``step()``
    (as :class:`~kron_precond.Kron`). Not on refresh steps: with ``statistics_every=1`` those
    are every step.
    """

    nonfinite_warn_interval = 100

    def __init__(self, modules: Iterable[nn.Module], lr: float = 1e-3, weight_decay: float = 0.0,
                 momentum: float = 0.9, nesterov: bool = True, statistics_every: int = 10,
                 damping: float = 0.1, factor_decay: float = 0.95, statistics_rows: int | None = None,
                 output_side: bool = False, root: str = "cholesky", block_size: int | None = None,
                 ns_steps: int = 5, ns_dtype: torch.dtype = torch.bfloat16, process_group: Any = None):
        modules = list(modules)
        if not modules:
            raise ValueError("WhitenedMuon: modules is empty")
        weights = [_weight_of(m, i) for i, m in enumerate(modules)]
        if len({id(w) for w in weights}) != len(weights):
            raise ValueError("WhitenedMuon: a weight appears twice in modules (tied or repeated module)")
        defaults = dict(lr=validation.check_positive("lr", lr),
                        weight_decay=validation.check_non_negative("weight_decay", weight_decay),
                        momentum=validation.check_unit_interval("momentum", momentum, low_open=False, high_open=True),
                        nesterov=validation.check_bool("nesterov", nesterov))
        self.statistics_every = validation.check_int("statistics_every", statistics_every)
        self.damping = validation.check_positive("damping", damping)
        self.factor_decay = validation.check_unit_interval("factor_decay", factor_decay, low_open=False,
                                                           high_open=True)
        self.statistics_rows = None if statistics_rows is None else validation.check_int("statistics_rows",
                                                                                         statistics_rows)
        self.output_side = validation.check_bool("output_side", output_side)
        if root not in ("cholesky", "symmetric"):
            raise ValueError(f"root must be 'cholesky' or 'symmetric', got {root!r}")
        self.root = root
        self.block_size = None if block_size is None else validation.check_int("block_size", block_size)
        self.ns_steps = validation.check_int("ns_steps", ns_steps)
        self.ns_dtype = validation.check_float_dtype("ns_dtype", ns_dtype)
        super().__init__(weights, defaults)
        self.process_group = process_group
        self._sharded = _sharded_layout(weights, process_group)
        self._sides = ("input", "output") if self.output_side else ("input",)
        # per weight and side: [sums of row outer products per diagonal block, row count] since
        # the last refresh
        self._pending: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._weights = {id(w): w for w in weights}
        self._reported: dict[int, int] = {}
        self._steps = 0  # step() calls, for the interval of the non-finite report
        self._casts: dict[tuple[int, ...], tuple] = {}  # stacked whiteners in ns_dtype, per stack
        # (width, blocks) -> (weak reference to the last input, its version, its row product)
        self._last_product: dict[tuple[int, int], tuple] = {}
        self._handles = []
        for module, weight in zip(modules, weights):
            self._handles.append(module.register_forward_pre_hook(self._input_hook(weight)))
            if self.output_side:
                self._handles.append(module.register_forward_hook(self._output_hook(weight)))

    # -- statistics --------------------------------------------------------------------
    def _collecting(self, weight: nn.Parameter) -> bool:
        return self.state[weight].get("step", 0) % self.statistics_every == 0

    @torch.no_grad()
    def _observe(self, weight: nn.Parameter, side: str, rows: torch.Tensor) -> None:
        width = weight.shape[1] if side == "input" else weight.shape[0]
        if rows.shape[-1] != width:
            raise ValueError(f"WhitenedMuon: the {side} of the layer with weight {tuple(weight.shape)} has "
                             f"last dim {rows.shape[-1]}, expected {width} (not a Linear-like layer)")
        with autocast_disabled(rows.device.type):  # the sum in float32, not autocast's dtype
            self._accumulate(weight, side, rows, width)

    def _accumulate(self, weight: nn.Parameter, side: str, rows: torch.Tensor, width: int) -> None:
        x = rows.detach().reshape(-1, width)
        if self.statistics_rows is not None:
            x = x[: self.statistics_rows]
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        key = (id(weight), side)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = self._zero_pending(width, x.dtype, x.device)
        blocks = pending[0].shape[0]
        # Layers fed the same input tensor (q, k and v projections) share one product: the
        # last input per width is remembered by a weak reference (so it is not kept alive) and
        # its version. Output gradients are never shared between layers: not remembered.
        shared = (width, blocks)
        last = self._last_product.get(shared) if side == "input" else None
        if last is not None and last[0]() is rows and last[1] == rows._version:
            product = last[2]
        else:
            xb = x.reshape(x.shape[0], blocks, -1).transpose(0, 1)  # [blocks, rows, block]
            product = torch.bmm(xb.transpose(1, 2), xb)
            if side == "input":
                self._last_product[shared] = (weakref.ref(rows), rows._version, product)
        pending[0].add_(product)
        pending[1].add_(x.shape[0])

    def _blocks(self, width: int) -> int:
        """Number of diagonal blocks a side of this width is whitened in."""
        b = self.block_size
        return width // b if b is not None and width > b and width % b == 0 else 1

    def _zero_pending(self, width: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        blocks = self._blocks(width)
        size = width // blocks
        return [torch.zeros(blocks, size, size, dtype=dtype, device=device), torch.zeros((), dtype=dtype, device=device)]

    def _input_hook(self, weight: nn.Parameter):
        def hook(module: nn.Module, args) -> None:
            if module.training and torch.is_grad_enabled() and args and self._collecting(weight):
                self._observe(weight, "input", args[0])
        return hook

    def _output_hook(self, weight: nn.Parameter):
        def hook(module: nn.Module, args, output) -> None:
            if (module.training and isinstance(output, torch.Tensor) and output.requires_grad
                    and self._collecting(weight)):
                output.register_hook(lambda grad: self._observe(weight, "output", grad))
        return hook

    def _all_reduce_pending(self, keys: list[tuple[int, str]]) -> None:
        group = self.process_group
        if group is None and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        # the engine's bucketed all-reduce; each block is symmetric, so only its upper triangle travels
        tensors = [t for key in keys for t in (*self._pending[key][0].unbind(0), self._pending[key][1])]
        collectives.all_reduce(tensors, group=group, cap_bytes=ALLREDUCE_BUCKET_BYTES, symmetric=True).wait()

    @torch.no_grad()
    def _refresh(self, weights: list[nn.Parameter]) -> None:
        """Fold the pending sums into the factors and recompute their whiteners. Every rank
        allocates every factor it owns, so the collective has the same shape everywhere."""
        keys = []
        for w in weights:
            for side in self._sides:
                key = (id(w), side)
                if key not in self._pending:  # not called here: zeros, so that every rank agrees
                    width = w.shape[1] if side == "input" else w.shape[0]
                    self._pending[key] = self._zero_pending(width, torch.promote_types(w.dtype, torch.float32),
                                                            w.device)
                keys.append(key)
        self._all_reduce_pending(keys)
        # The factors of one layout are updated and decomposed as one batch: a refresh costs a
        # fixed number of ops per layout, not per layer (it runs every step with statistics_every=1).
        layouts: dict[tuple, list[tuple[dict, str, torch.Tensor, torch.Tensor]]] = {}
        for key in keys:
            total, count = self._pending.pop(key)
            state = self.state[self._weights[key[0]]]
            side = key[1]
            if state.get(f"{side}_factor") is None:
                state[f"{side}_factor"] = torch.zeros_like(total)
                # 0 / 1: a float, because torch.optim's load casts state tensors
                state[f"{side}_seen"] = torch.zeros((), dtype=total.dtype, device=total.device)
            layouts.setdefault((tuple(total.shape), total.dtype, total.device), []).append((state, side, total, count))
        for members in layouts.values():
            factors = [state[f"{side}_factor"] for state, side, _, _ in members]
            seens = [state[f"{side}_seen"] for state, side, _, _ in members]
            counts = torch.stack([count for *_, count in members])
            batch = torch.stack([total for _, _, total, _ in members]) / counts.clamp(min=1)[:, None, None, None]
            usable = (counts > 0) & torch.isfinite(batch.sum(dim=(1, 2, 3)))  # one reduction each, not a mask
            seen = torch.stack(seens)
            stacked = torch.stack(factors)
            # first observation: take it whole; later: the exponential average; unusable: keep
            weight = (torch.where(seen > 0, 1 - self.factor_decay, 1.0) * usable).to(stacked.dtype)
            stacked = stacked.lerp(torch.where(usable[:, None, None, None], batch, stacked), weight[:, None, None, None])
            torch._foreach_copy_(factors, list(stacked.unbind()))
            torch._foreach_copy_(seens, list(torch.maximum(seen, usable.to(seen.dtype)).unbind()))
            previous = [state.get(f"{side}_whitener") for state, side, _, _ in members]
            if all(p is None for p in previous):
                stacked_previous = None
            else:
                eye = torch.eye(stacked.shape[-1], dtype=stacked.dtype, device=stacked.device)
                stacked_previous = torch.cat([eye.expand_as(f) if p is None else p for p, f in zip(previous, factors)])
            whiteners = self._whitener(stacked.flatten(0, 1), stacked_previous).unflatten(0, stacked.shape[:2])
            for (state, side, _, _), whitener in zip(members, whiteners.unbind()):
                # its own tensor, as torch.optim's per-parameter state (not a view of the batch)
                state[f"{side}_whitener"] = whitener.clone()
        self._casts.clear()

    def _whitener(self, factor: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """``T`` per diagonal block of ``factor`` (``[blocks, b, b]``), with ``Tᵀ T = (F + λI)⁻¹``
        and ``λ = damping · tr(F)/b`` per block: ``L⁻¹`` (Cholesky) or ``(F + λI)^{-1/2}``. The
        identity for an all-zero block; the previous ``T`` where the decomposition fails."""
        size = factor.shape[-1]
        eye = torch.eye(size, dtype=factor.dtype, device=factor.device)
        lam = (self.damping * factor.diagonal(dim1=-2, dim2=-1).sum(-1) / size)[:, None, None]
        # an all-zero block (a layer never called) becomes the identity: never a zero matrix
        safe = factor + torch.where(lam > 0, lam, 1.0) * eye
        if self.root == "cholesky":
            lower, info = torch.linalg.cholesky_ex(safe)
            # a failed block (info > 0) may hold anything, even zeros on the diagonal: replaced below
            whitener = torch.linalg.solve_triangular(lower, eye.expand_as(lower), upper=False)
            good = (info == 0)[:, None, None]
        else:
            values, vectors = torch.linalg.eigh(safe)
            floor = torch.where(lam > 0, lam, 1.0)[:, :, 0]
            whitener = (vectors * values.clamp(min=floor).rsqrt()[:, None, :]) @ vectors.transpose(1, 2)
            good = torch.isfinite(whitener.sum(dim=(1, 2), keepdim=True))
        fallback = eye.expand_as(whitener) if previous is None else previous
        return torch.where(good, whitener, fallback)

    # -- the step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One step for every weight with a gradient; refreshes the whiteners on statistics steps."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with autocast_disabled():  # a step called inside an autocast region: still in ns_dtype / float32
            self._step()
        return loss

    def _step(self) -> None:
        self._last_product.clear()  # the products: one step's statistics only
        due = [p for group in self.param_groups for p in group["params"]
               if p.grad is not None and self._collecting(p)]
        if due:
            self._refresh(due)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise TypeError("WhitenedMuon does not support sparse gradients")
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                    state["nonfinite_steps"] = torch.zeros((), dtype=torch.int64, device=p.grad.device)
            # Weights of one shape (and whitener layout) step as one stack: a fixed number of ops
            # per shape, not per layer.
            stacks: dict[tuple, list[nn.Parameter]] = {}
            for p in params:
                stacks.setdefault(self._layout(p), []).append(p)
            for members in stacks.values():
                self._step_stack(members, group)
                for p in members:
                    self.state[p]["step"] = self.state[p].get("step", 0) + 1
        self._steps += 1
        if (self._steps - 1) % self.nonfinite_warn_interval == 0:
            self._report_nonfinite()

    def _layout(self, p: nn.Parameter) -> tuple:
        state = self.state[p]
        sides = tuple(None if state.get(f"{side}_whitener") is None else tuple(state[f"{side}_whitener"].shape)
                      for side in ("input", "output"))
        return (tuple(p.shape), p.dtype, p.device, sides, self._is_sharded(p))

    def _is_sharded(self, p: nn.Parameter) -> bool:
        return self._sharded is not None and self._sharded.is_sharded(p)

    def _gather_rows(self, local: torch.Tensor, rows: int) -> torch.Tensor:
        """The full ``[k, rows, n]`` stack from every shard's ``[k, rows_here, n]`` (FSDP2's
        ``Shard(0)`` split: ``ceil(rows / S)`` per rank, padded on the wire): one all-gather."""
        layout = self._sharded
        k, here, n = local.shape
        chunk = layout.chunk(rows)
        padded = local.new_zeros(k, chunk, n)
        padded[:, :here] = local
        pieces = [torch.empty_like(padded) for _ in range(layout.shard_size)]
        dist.all_gather(pieces, padded, group=layout.shard_group)
        return torch.cat(pieces, dim=1)[:, :rows]

    def _step_stack(self, params: list[nn.Parameter], group: dict[str, Any]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        states = [self.state[p] for p in params]
        sharded = self._is_sharded(params[0])
        local = (lambda t: t) if self._sharded is None else self._sharded.local  # a DTensor's piece
        # FSDP2 / HSDP: the momentum lives in each rank's rows of the weight; only the update
        # that goes into msign is gathered whole (one all-gather per stack).
        grads = torch.stack([local(p.grad) for p in params])
        # A gradient whose norm is not finite (a NaN, an Inf, or an overflow) leaves its weight,
        # its momentum and its weight decay as they were.
        if sharded:  # the whole gradient's: its shards' sums of squares, summed over the shards
            wide = torch.promote_types(grads.dtype, torch.float32)
            squares = torch.linalg.vector_norm(grads.flatten(1), dim=1, dtype=wide).square()
            dist.all_reduce(squares, group=self._sharded.shard_group)
            finite = torch.isfinite(squares)
        else:
            finite = torch.isfinite(torch.linalg.vector_norm(grads.flatten(1), dim=1))
        mask = finite[:, None, None]
        buffers = [local(s["momentum_buffer"]) for s in states]
        stacked = torch.stack(buffers)
        stacked = torch.where(mask, stacked.lerp(grads, 1 - momentum), stacked)
        torch._foreach_copy_(buffers, list(stacked.unbind()))
        update = grads.lerp(stacked, momentum) if group["nesterov"] else stacked
        if sharded:
            update = self._gather_rows(update, params[0].shape[0])
        left, right = self._stacked_whiteners(params)
        direction = torch.where(mask, self._direction(update, left, right), 0.0)
        if sharded:
            start, stop = self._sharded.rows(params[0].shape[0])
            direction = direction[:, start:stop]
        decay = torch.full(finite.shape, 1 - lr * group["weight_decay"], dtype=params[0].dtype, device=finite.device)
        decay = torch.where(finite, decay, 1.0)
        adjusted = lr * 0.2 * max(params[0].shape) ** 0.5  # torch.optim.Muon's match_rms_adamw
        for i, p in enumerate(params):
            weight = local(p)
            weight.mul_(decay[i])
            weight.add_(direction[i], alpha=-adjusted)
        torch._foreach_add_([s["nonfinite_steps"] for s in states], list((~finite).long().unbind()))

    def _stacked_whiteners(self, params: list[nn.Parameter]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(output, input) whiteners of ``params`` stacked ``[k, blocks, b, b]`` in ``ns_dtype``;
        built once per refresh (the whitening's result is rounded to that dtype anyway)."""
        key = tuple(id(p) for p in params)
        cached = self._casts.get(key)
        if cached is None:
            cached = tuple(None if self.state[params[0]].get(f"{side}_whitener") is None else
                           torch.stack([self.state[p][f"{side}_whitener"] for p in params]).to(self.ns_dtype)
                           for side in ("output", "input"))
            self._casts[key] = cached
        return cached

    def _direction(self, update: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> torch.Tensor:
        """``Lᵀ msign(L M Rᵀ) R`` rescaled to ``||msign(L M Rᵀ)||_F``, for a stack ``[k, out, in]``
        with ``L``, ``R`` the output- and input-side whiteners (block-diagonal ``[k, blocks, b, b]``;
        either may be absent), in ``ns_dtype``."""
        update = update.to(self.ns_dtype)
        ortho = msign(self._whiten(update, left, right, transpose=True), self.ns_steps, dtype=self.ns_dtype)
        if left is None and right is None:
            return ortho
        direction = self._whiten(ortho, left, right, transpose=False)
        wide = torch.promote_types(direction.dtype, torch.float32)  # norms of bfloat16 in float32
        scale = (ortho.to(wide).norm(dim=(-2, -1), keepdim=True)
                 / direction.to(wide).norm(dim=(-2, -1), keepdim=True).clamp(min=1e-30))
        return direction * scale.to(direction.dtype)

    @staticmethod
    def _whiten(matrix: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None,
                transpose: bool) -> torch.Tensor:
        """``L X Rᵀ`` (``transpose``) or ``Lᵀ X R`` for a stack ``X = [k, out, in]``, block by block."""
        k, out_dim, in_dim = matrix.shape
        if right is not None:
            r = right.to(matrix.dtype)
            if r.shape[1] == 1:  # one block: a batched matmul
                matrix = matrix @ (r[:, 0].mT if transpose else r[:, 0])
            else:
                x = matrix.reshape(k, out_dim, r.shape[1], -1)
                x = torch.einsum("kojb,kjcb->kojc" if transpose else "kojb,kjbc->kojc", x, r)
                matrix = x.reshape(k, out_dim, in_dim)
        if left is not None:
            g = left.to(matrix.dtype)
            if g.shape[1] == 1:
                matrix = (g[:, 0] if transpose else g[:, 0].mT) @ matrix
            else:
                x = matrix.reshape(k, g.shape[1], -1, in_dim)
                x = torch.einsum("kjcb,kjbi->kjci" if transpose else "kjbc,kjbi->kjci", g, x)
                matrix = x.reshape(k, out_dim, in_dim)
        return matrix

    def _report_nonfinite(self) -> None:
        lines = [f"weight {i} (shape {tuple(p.shape)}): {new} step(s)"
                 for i, p, new, _ in new_nonfinite_steps(self, self._reported)]
        if lines:
            warnings.warn("WhitenedMuon: non-finite gradients; those steps left these weights and their "
                          "momentum unchanged: " + "; ".join(lines), RuntimeWarning, stacklevel=3)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's load, then the factors and whiteners back to float32 or better
        (torch.optim casts every state tensor to its parameter's dtype, e.g. bfloat16)."""
        super().load_state_dict(state_dict)
        self._casts.clear()
        for state in self.state.values():
            for key, value in state.items():
                if key.endswith(("_factor", "_whitener")) and value.dtype not in (torch.float32, torch.float64):
                    state[key] = value.float()

    def remove(self) -> None:
        """Remove the statistics hooks (the optimizer then steps with its last whiteners)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
