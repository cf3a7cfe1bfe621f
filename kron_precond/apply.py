"""Apply, global scaling and write-back: the per-step path, batched over layers.

Layers whose methods give equal ``batch_key``s are preconditioned together by one
``apply_batch`` call (one batched matmul per product); the finiteness checks, ``kl_clip``'s
sum and the write-back into ``.grad`` use ``torch._foreach_*`` ops over all tensors at once.
So the number of kernels a plain step launches does not grow with the number of layers
(measured by ``benchmarks/op_count.py``).

A layer whose gradient holds a NaN or Inf is not preconditioned: its gradient passes through
(scaled by the same ``kl_clip`` factor as the others) and is left out of ``kl_clip``'s sum, so
it cannot poison the other layers; the engine warns naming it.

A layer without any gradient (not called this step) is not preconditioned, on any path: a
stateful method (moments, update counts) must not fold zeros in. Where other ranks receive
results from its holder, it still travels, as zeros, so every rank's collectives keep one layout.
An expert of a fused experts module that the router sent no token has a gradient, its slice of
the stacked parameter's ``.grad``, but of zeros: the stateful methods (``second_moment``,
``soap``, ``ikfac``'s moment) find it on the device, batched, and treat it as not called -- its
zeros pass through, its state is left as it is -- without counting it as non-finite
(:func:`kron_precond.methods.second_moment.idle_experts`); a layer of its own with an all-zero
gradient was called and folds it in.
A layer the engine passes through (``passed_through``: a layer whose parameters are
preconditioned together, some of them frozen after construction) is treated the same way, and
its gradients are left exactly as they are: not preconditioned, not scaled by ``kl_clip``,
nothing written. The engine decides it from ``requires_grad`` and ``.grad is None`` (host
reads, the same on every rank), so the collectives keep their layout there too.
"""
from __future__ import annotations

import functools
from typing import Callable, Collection, Sequence, cast

import torch

from kron_precond.schedules import StepContext


class _Work:
    __slots__ = ("layer", "raw", "grads", "holds")

    def __init__(self, layer, raw, grads, holds) -> None:
        self.layer, self.raw, self.grads, self.holds = layer, raw, grads, holds


def _zeros_for_none(layer, raw: list) -> list[torch.Tensor]:
    """``raw`` with a zero gradient of the parameter's shape where a parameter has none."""
    return [g if g is not None else torch.zeros(shape, dtype=p.dtype, device=p.device)
            for g, (_, p), shape in zip(raw, layer.params, layer.shapes)]


def _zeros(layer) -> list[torch.Tensor]:
    """A zero gradient for each of ``layer``'s parameters (what a layer left alone sends)."""
    return _zeros_for_none(layer, [None] * len(layer.params))


def precondition_gradients(layers: Sequence, *, holds: Callable, owner_of: Callable, runtime, ctx: StepContext,
                           kl_clip: float | None, lr: float | None, cache: dict,
                           grads: dict[str, list] | None = None, passed_through: Collection[str] = ()
                           ) -> tuple[torch.Tensor, list, torch.Tensor | None] | None:
    """Rewrite ``.grad`` of every registered parameter with its preconditioned value.

    Args:
        layers: the registered layers (``params``, ``shapes``, ``gradients()``, ``method``, ``name``;
            an expert's gradients are views into its stacked parameter's ``.grad``).
        holds: ``holds(layer)`` -- this rank holds the layer's state and preconditions it.
        owner_of: ``owner_of(layer)`` -- the rank that owns the layer's work.
        runtime: the distributed runtime (receives gradients computed elsewhere).
        kl_clip, lr: scale every update by ``min(1, sqrt(kl_clip / |lr² Σ⟨V, ∇⟩|))``.
        cache: kept by the engine until the next load; batched methods keep stacked state in it.
        grads: per layer name, the full gradients to precondition (sharded models: assembled
            from the DTensor shards); default: each parameter's ``.grad``. Results are
            written into ``.grad``; for a sharded parameter, this rank's rows into its shard.
        passed_through: names of layers left alone this step, as if they had no gradient
            (their gradients are neither preconditioned nor written).

    Returns ``(finite, layers, norms)``: per listed layer, whether its gradient was finite
    (for the engine's warning) and the norm of the update written for it (``None`` if nothing
    was written; see :func:`_update_norms`), or ``None`` when no layer had a gradient.
    """
    communicate = runtime.world_size > 1 and runtime.has_receivers
    work: list[_Work] = []
    # With receivers, every layer travels from its gradient workers, in registration order, so
    # that the broadcasts have one layout on every rank whatever has a gradient: a layer without
    # any (not called this step, so on every rank) travels as zeros. It is not preconditioned,
    # as with one process: a stateful method (moments, update counts) must not see it.
    travelling: list[tuple[object, int | None, list[torch.Tensor]]] = []
    for layer in layers:
        raw = grads[layer.name] if grads is not None else layer.gradients()
        if layer.name in passed_through or all(g is None for g in raw):
            if communicate:
                travelling.append((layer, None, _zeros(layer)))
            continue
        if communicate:
            travelling.append((layer, len(work), []))
        work.append(_Work(layer, raw, _zeros_for_none(layer, raw), holds(layer)))
    if not work:
        if communicate and travelling:  # nothing to write; the ranks' broadcasts still pair up
            runtime.receive_gradients(_by_owner([(layer, zeros) for layer, _, zeros in travelling], owner_of))
        return None

    finite = _finite_per_layer([w.grads for w in work], cache)
    held = [i for i, w in enumerate(work) if w.holds]
    outputs = _apply_held(work, held, finite, ctx, cache)
    if communicate:
        for i, w in enumerate(work):
            if not w.holds:  # receives its preconditioned gradient below
                outputs[i] = [torch.empty_like(g) for g in w.grads]
        runtime.receive_gradients(_by_owner([(layer, zeros if i is None else _output(outputs, i))
                                             for layer, i, zeros in travelling], owner_of))

    sources, destinations, tensor_layer, params = [], [], [], []
    for i, w in enumerate(work):
        for value, grad, (_, p) in zip(_output(outputs, i), w.raw, w.layer.params):
            if grad is not None:
                sources.append(value)
                destinations.append(grad)
                tensor_layer.append(i)
                params.append(p)
    norms = None
    if destinations:
        scale = None
        if kl_clip is not None:  # over full tensors: the same sum on every rank
            keep = finite[_index(tensor_layer, finite.device, cache)]
            scale = _kl_clip_factor(_kl_sum(sources, destinations, keep), kl_clip, lr)
        norms = _update_norms(sources, tensor_layer, _updated(work, finite, ctx, cache), scale, cache)
        if runtime.sharding is not None:  # this rank's rows, into its shards
            destinations = [runtime.local(p.grad) for p in params]
            sources = [runtime.local_rows(p, v) for p, v in zip(params, sources)]
        torch._foreach_copy_(destinations, sources if scale is None else torch._foreach_mul(sources, scale))
    return finite, [w.layer for w in work], norms


def precondition_exchanged(layers: Sequence, *, owner_of: Callable, runtime, ctx: StepContext,
                           kl_clip: float | None, lr: float | None, cache: dict,
                           grads: dict[str, list], passed_through: Collection[str] = ()
                           ) -> tuple[torch.Tensor, list, torch.Tensor | None] | None:
    """Owner-exchange mode (FSDP2, one gradient worker per layer): ``grads`` holds the full
    gradients of the layers this rank owns (gathered to it); it preconditions them, completes
    ``kl_clip``'s sum with one scalar all-reduce, and every rank writes the rows the owners
    scatter back into its gradient shards. Returns the owned layers' finiteness flags and
    update norms. ``passed_through``: as for :func:`precondition_gradients` (decided alike on
    every rank: such a layer still travels, as zeros, and no rank writes it)."""
    rank = runtime.rank
    owned = [layer for layer in layers if owner_of(layer) == rank]
    # The scatter sends each owner's results in order, one for every owned layer. A layer without
    # any gradient (not called this step, so on every rank) is not preconditioned, as with one
    # process (a stateful method must not see it): it travels as zeros and nobody writes it; so
    # does a layer passed through. A parameter without a gradient in a layer that has some (a
    # method that preconditions each parameter on its own) is preconditioned as zeros, as the
    # other paths do, and nothing is written to it.
    def computed_here(layer) -> bool:
        return layer.name not in passed_through and any(g is not None for g in grads[layer.name])

    work = [_Work(layer, grads[layer.name], _zeros_for_none(layer, grads[layer.name]), True) for layer in owned
            if computed_here(layer)]
    mine = [w.layer for w in work]
    finite: torch.Tensor | None = None
    results: list[list[torch.Tensor]] = []
    if work:
        finite = _finite_per_layer([w.grads for w in work], cache)
        # every layer of work is held here: _apply_held fills every output
        results = cast(list[list[torch.Tensor]], _apply_held(work, list(range(len(work))), finite, ctx, cache))
    computed = iter(results)
    outputs = [next(computed) if computed_here(layer) else _zeros(layer) for layer in owned]
    scale = None
    if kl_clip is not None:
        reference = layers[0].params[0][1]
        # one dtype on every rank (the sum is all-reduced), whatever dtypes this rank's layers have
        accumulate = functools.reduce(torch.promote_types, (p.dtype for layer in layers for _, p in layer.params),
                                      torch.float32)
        total = torch.zeros((), dtype=accumulate, device=reference.device)
        values = [v for out in results for v in out]
        if values:
            tensor_layer = [i for i, w in enumerate(work) for _ in w.grads]
            assert finite is not None  # values come from work
            keep = finite[_index(tensor_layer, finite.device, cache)]
            total = total + _kl_sum(values, [g for w in work for g in w.grads], keep).to(accumulate)
        runtime.sum_over_shards(total)
        scale = _kl_clip_factor(total, kl_clip, lr)
    by_owner: dict[int, list] = {r: [] for r in range(runtime.world_size)}
    written: dict[int, list[bool]] = {r: [] for r in range(runtime.world_size)}
    for layer in layers:
        by_owner[owner_of(layer)].extend(p for _, p in layer.params)
        written[owner_of(layer)].extend([layer.name not in passed_through] * len(layer.params))
    rows = runtime.scatter_from_owners(by_owner, [v for out in outputs for v in out])
    destinations, sources = [], []
    for owner, params in by_owner.items():
        for p, write, piece in zip(params, written[owner], rows.get(owner, [])):
            if write and p.grad is not None:
                destinations.append(runtime.local(p.grad))
                sources.append(piece)
    if destinations:
        torch._foreach_copy_(destinations, sources if scale is None else torch._foreach_mul(sources, scale))
    if not work:
        return None
    assert finite is not None  # set for a non-empty work
    norms = _update_norms([v for out in results for v in out], [i for i, w in enumerate(work) for _ in w.grads],
                          _updated(work, finite, ctx, cache), scale, cache)
    return finite, mine, norms


def _apply_held(work: list[_Work], held: list[int], finite: torch.Tensor, ctx: StepContext,
                cache: dict) -> list[list[torch.Tensor] | None]:
    """Precondition the held layers of ``work``, batched by ``batch_key``."""
    outputs: list[list[torch.Tensor] | None] = [None] * len(work)
    groups: dict[object, list[int]] = {}
    for i in held:
        key = work[i].layer.method.batch_key()
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    for key, members in groups.items():
        methods = [work[i].layer.method for i in members]
        keep = finite if len(members) == len(work) else finite[_index(members, finite.device, cache)]
        entry = ("batch", key, tuple(id(m) for m in methods))
        if entry not in cache:
            # A method's batched apply stacks its members' state and re-points each member at its
            # slice, so a layer's state lives in one stack at a time: the stacks built for other
            # members or another batch key (a layer without a gradient on one step, a damping
            # schedule) are left behind by it and must not be used again, nor kept alive.
            adopted = set(entry[2])
            for stale in [k for k in cache if k[0] == "batch" and adopted.intersection(k[2])]:
                del cache[stale]
        batch_cache = cache.setdefault(entry, {})
        results = type(methods[0]).apply_batch(methods, [work[i].grads for i in members], ctx,
                                               batch_cache, keep)
        for i, result in zip(members, results):
            outputs[i] = result
    return outputs


def _by_owner(travelling: list[tuple[object, list[torch.Tensor]]], owner_of: Callable
              ) -> dict[int, list[torch.Tensor]]:
    """Each layer's tensors (in registration order), keyed by the layer's owner."""
    by_owner: dict[int, list[torch.Tensor]] = {}
    for layer, tensors in travelling:
        by_owner.setdefault(owner_of(layer), []).extend(tensors)
    return by_owner


def _output(outputs: list[list[torch.Tensor] | None], i: int) -> list[torch.Tensor]:
    """Layer ``i``'s preconditioned gradients: computed here (held) or received."""
    out = outputs[i]
    assert out is not None, "kron_precond: a layer's gradient was neither preconditioned here nor received"
    return out


def _index(members: list[int], device, cache: dict) -> torch.Tensor:
    key = ("index", tuple(members), device)
    if key not in cache:
        cache[key] = torch.tensor(members, device=device)
    return cache[key]


def _finite_per_layer(grads: list[list[torch.Tensor]], cache: dict) -> torch.Tensor:
    """One bool per layer: all of its gradients are finite (a fixed number of ops).

    A tensor is finite iff its L2 norm is: a NaN or Inf entry makes the norm NaN or Inf. The
    L2 norm is vectorised on every backend, unlike the max-abs norm (about 15x slower on
    CPU: ``benchmarks/engine_checks.py``). Accumulated in float32 (float64 for float64
    gradients), so a float32 gradient whose norm overflows (> 1.8e19) also counts as
    non-finite; it would overflow the preconditioner's products anyway."""
    flat = [g for layer in grads for g in layer]
    counts = tuple(len(layer) for layer in grads)
    accumulate = torch.float64 if any(g.dtype == torch.float64 for g in flat) else torch.float32
    norms = torch.stack(torch._foreach_norm(flat, 2, dtype=accumulate))
    bad = (~torch.isfinite(norms)).to(torch.float32)
    if all(c == 1 for c in counts):
        return bad == 0
    key = ("segments", counts, norms.device)
    if key not in cache:
        cache[key] = torch.repeat_interleave(torch.arange(len(counts), device=norms.device),
                                             torch.tensor(counts, device=norms.device))
    per_layer = torch.zeros(len(counts), dtype=torch.float32, device=norms.device)
    return per_layer.index_add_(0, cache[key], bad) == 0


def _updated(work: list[_Work], finite: torch.Tensor, ctx: StepContext, cache: dict) -> torch.Tensor:
    """``finite`` less the layers whose method handed their gradient on unpreconditioned (no
    preconditioner yet, on a rank that holds the layer; :meth:`LayerMethod.preconditions`): a
    raw gradient is no update of theirs to measure. The flags change at refreshes (and loads,
    which clear ``cache``) only: read once per refresh, no op per layer on the other steps."""
    generation = ctx.refresh_index + ctx.refresh  # refreshes done, this step's included
    key = ("updated", tuple(id(w.layer) for w in work), finite.device)
    cached = cache.get(key)
    if cached is None or cached[0] != generation:
        flags = [w.layer.method.preconditions() if w.holds else True for w in work]
        applied = None
        if not all(flag is True for flag in flags):
            constant = (torch.zeros(1, device=finite.device), torch.ones(1, device=finite.device))
            applied = torch.cat([flag.reshape(1).to(device=finite.device, dtype=torch.float32)
                                 if isinstance(flag, torch.Tensor) else constant[int(flag)] for flag in flags]) != 0
        cached = cache[key] = (generation, applied)
    return finite if cached[1] is None else finite & cached[1]


def _update_norms(values: list[torch.Tensor], tensor_layer: list[int], finite: torch.Tensor,
                  scale: torch.Tensor | None, cache: dict) -> torch.Tensor:
    """Per layer of ``finite``: the L2 norm of the update written into ``.grad`` (its
    tensors ``values``, layer ``tensor_layer[i]``, times ``kl_clip``'s ``scale``), on the
    device with a fixed number of ops; 0 for a layer whose gradient was not finite (it passed
    through and is reported as such). The health checks follow it to notice an update that
    grows by orders of magnitude (:mod:`kron_precond.health`)."""
    accumulate = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
    squares = torch.stack(torch._foreach_norm(values, 2, dtype=accumulate)).square()
    per_layer = torch.zeros(len(finite), dtype=accumulate, device=squares.device)
    norms = per_layer.index_add_(0, _index(tensor_layer, squares.device, cache), squares).sqrt()
    if scale is not None:
        norms = norms * scale
    return torch.where(finite, norms, torch.zeros((), dtype=accumulate, device=norms.device))


def _kl_sum(values, grads, keep: torch.Tensor) -> torch.Tensor:
    """``Σ⟨V, ∇⟩`` over the tensors of finite layers (``keep``), summed in float32 or better.

    Σ x = ‖max(x, 0)‖₁ − ‖min(x, 0)‖₁: one foreach norm per sign instead of a sum per tensor,
    so the op count does not grow with the number of layers. On CPU the L1 norms are not
    vectorised: one ``torch.dot`` per tensor would be ~8x faster there (0.8 against 6.8 ms
    per step at d = 256, ``benchmarks/engine_checks.py``) at the price of one op per
    tensor; the L2-norm identity ``2⟨V, ∇⟩ = ‖V + ∇‖² − ‖V‖² − ‖∇‖²`` is as fast and keeps
    the op count, but cancels badly where ‖V‖ ≫ ‖∇‖ (K-FAC with small damping) and failed
    the world-size suite's float32 tolerance. Neither was adopted; ``kl_clip=None`` skips
    the sum."""
    accumulate = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    products = torch._foreach_mul(values, grads)
    positive = torch.stack(torch._foreach_norm(torch._foreach_clamp_min(products, 0.0), 1, dtype=accumulate))
    negative = torch.stack(torch._foreach_norm(torch._foreach_clamp_max(products, 0.0), 1, dtype=accumulate))
    terms = torch.where(keep, positive - negative, torch.zeros((), dtype=accumulate, device=keep.device))
    return terms.sum()


def _kl_clip_factor(total: torch.Tensor, kl_clip: float, lr: float | None) -> torch.Tensor:
    """``min(1, sqrt(κ / |lr² total|))``; a zero sum gives inf, clamped to 1. A sum past the
    accumulation dtype's range (both signs overflowing to ``inf − inf``) is NaN: read as the
    infinite sum it is, so the scale is 0 instead of NaN in every layer."""
    assert lr is not None, "kron_precond: kl_clip needs the learning rate"
    total = torch.nan_to_num(total, nan=float("inf"))
    return torch.sqrt(kl_clip / (total * lr**2).abs()).clamp(max=1.0)
