"""Warnings about what the per-step path skipped, read without stalling the device.

* Non-finite gradients: a layer whose gradient holds NaN/Inf is passed through (see
  :mod:`kron_precond.apply`); the warning names it on that step on the CPU, and as soon as
  the device has finished that step elsewhere (an event is polled, never waited on).
* Skipped state updates (non-finite statistics, failed Q updates), layers registered but
  never observed, and layers that had statistics and then stopped getting them: counters
  on the device, read on refresh steps (one host sync, next to the refresh's own work) or
  every ``check_every`` steps.
* Updates that blow up: per layer and step, the norm of the update written into ``.grad``
  over the layer's reference before that step, and over its first usable (finite, non-zero)
  update norm; the largest of each since the last read are read with the counters above. The
  reference is the larger of the first usable norm and a running geometric mean of the usable
  norms in which the k-th enters with weight ``min(1, UPDATE_REFERENCE_SPAN / k)`` (4: weights
  growing as k³, about the last quarter of the updates so far). A layer whose update reached
  ``UPDATE_GROWTH_WARNING`` (1e3) times its reference or ``UPDATE_FIRST_GROWTH_WARNING`` (1e6)
  times its first norm, or became non-finite from a finite gradient, is reported: training is
  diverging.

  - Not the first update alone: a layer's usual update may grow by orders of magnitude over
    a healthy start (a deep tanh stack passing more signal to its first layer; PSGD's factors,
    which start at the identity, learning the gradients' scale), while the base optimizer
    (AdamW) normalises it away.
  - A mean over a span that grows with the run: it follows such a shift within a fraction of
    the run, so a jump over the level a layer settled at is reported at 1e3; a steady climb
    ``r**k`` outruns it only as ``r**(k/5)``.
  - Its first norm, with a larger bar: a steady climb is reported when it reaches 1e6 times
    the first norm, at any rate (x1.1 a step: step 145; x1.3: 53; x2: 20). Healthy starts stay
    below 5.2e4 (PSGD learning its scale). Neither bar can be much lower, nor the mean slower
    (capped entries, a count of steps above it): that climb runs at x1.3-x1.6 a step for 25-45
    steps, as a diverging one does.
  - The first norm as a floor: updates shrink as a run converges, and a mean that followed
    them down would flag ordinary noise. With the floor the check is never stricter than
    against the first update.
  - Not the gradient: the ratio of a layer's update norm to its gradient norm is
    ``1 / damping`` (1e3) for K-FAC by design and unbounded for the normalised methods
    (Adam's second moment, SOAP, PSGD) where a gradient is near zero.

  Under MEM_OPT / HYBRID_OPT a rank that does not hold a layer judges its updates only if the
  layer's holders never hand its gradient on unpreconditioned; else (ikfac: no inverse yet
  for a layer first called after a refresh) it cannot tell such a gradient from an update,
  and records nothing for the layer (``LayerMethod.hands_on_gradients``). The holders' verdict
  then reaches every rank: at each check the ranks take the largest of each growth over the
  group (``combine``: one small all-reduce, on the check's steps only, which are the same on
  every rank), so a blow-up of any layer is reported on every rank, rank 0 included.

  The update check does not see a run whose first update is already far too large, nor one
  whose update grows at the start as a healthy one does and then stops while the loss stays
  high (an lr several times too large for SGD): the loss is the check there. docs/API.md
  ("Updates that blow up") gives the measurements behind it.
* Weights that grow by orders of magnitude (:class:`WeightGrowth`): a normalised method's
  update norm stays level while its weights climb and the loss diverges, so the weights' own
  norms are read on the first step and every ``WEIGHT_CHECK_EVERY`` steps.
"""
from __future__ import annotations

import math
import warnings
from typing import Callable, Sequence

import torch

from kron_precond.distributed.sharded import is_dtensor
from kron_precond.modules import user_stacklevel

STALE_STATISTICS_STEPS = 3  # statistics steps in a row without rows before a layer is reported
# Growth of a layer's update norm over its reference that is reported as a blow-up. Healthy
# runs of every method in front of AdamW or SGD on the digits MLP and autoencoder, at lrs up
# to 8x the tuned ones, stay below 330 (PSGD learning its scale; the others below 30);
# Shampoo's stale roots without grafting reach 2e5 and more on the digits MLP.
UPDATE_GROWTH_WARNING = 1e3
# The reference's running geometric mean takes a layer's k-th usable update norm with weight
# min(1, UPDATE_REFERENCE_SPAN / k): about the last 1/UPDATE_REFERENCE_SPAN of the updates so
# far. Larger follows a healthy start sooner (PSGD on the autoencoder: 760 times its reference
# at 3) and reports a steady growth later.
UPDATE_REFERENCE_SPAN = 4
# Growth of a layer's update norm over its first usable one that is reported as well: a steady
# climb outruns the running mean only slowly (as r**(k/5) for r**k), so it is caught here, at
# this growth whatever its rate. Healthy runs reach 5.2e4 (PSGD in front of AdamW on the digits
# autoencoder, lr 1e-4 to 3e-3, learning its scale from the identity: a climb of x1.3-x1.6 a step
# that then stops; it grows as the first gradient is smaller, hence the margin).
UPDATE_FIRST_GROWTH_WARNING = 1e6


# A weight whose norm reached this many times its reference (the larger of its norm at the first
# check and the norm torch's default initialisation gives its shape) is reported: training is
# diverging. Measured on an MLP over 250 steps: healthy runs of every method (the working lr, a
# 0.05x initialisation, a separable task whose cross-entropy grows the weights without end) up to
# 18 (K-FAC + SGD; the others below 6.5); at 100x the lr PSGD 1.3e3, SOAP 6.1e2, second_moment
# 5.4e2, WhitenedMuon 1.8e2, Kron 1.5e2 -- the methods whose normalised update norms stay level.
WEIGHT_GROWTH_WARNING = 100.0
WEIGHT_CHECK_EVERY = 100  # steps between checks (one host read of the weights' norms each)


class WeightGrowth:
    """Reports weights (2-D and more, not sharded) whose norm grew ``WEIGHT_GROWTH_WARNING``
    times over their reference, once per weight. The reference is taken at a weight's first
    check (the first step: its initial norm), floored by the norm of torch's default
    initialisation for its shape (:func:`default_init_norm`), so a weight started at zero
    or far below it (LoRA's B, a scaled-down initialisation) is measured from that scale.
    ``check`` costs one host read; its callers run it every ``WEIGHT_CHECK_EVERY`` steps."""

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._reference: dict[int, float] = {}
        self._warned: set[int] = set()

    def check(self, named_weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        seen: set[int] = set()
        weights = []
        for name, w in named_weights:
            if (w.dim() < 2 or not w.numel() or w.is_meta or not w.is_floating_point() or id(w) in seen
                    or id(w) in self._warned):
                continue
            if is_dtensor(w):  # a rank holds a shard: its norm is not the weight's
                continue
            seen.add(id(w))
            weights.append((name, w))
        if not weights:
            return
        device = weights[0][1].device
        # float32 (float64 is not available on every device); an overflow is inf, which is skipped
        norms = torch.stack([torch.linalg.vector_norm(w.detach(), dtype=torch.promote_types(w.dtype, torch.float32))
                             .to(device, torch.float32) for _, w in weights]).tolist()  # one host sync
        grown = []
        for (name, w), norm in zip(weights, norms):
            reference = self._reference.get(id(w))
            if reference is None:
                if math.isfinite(norm):
                    self._reference[id(w)] = max(norm, default_init_norm(w.shape))
                continue
            if math.isfinite(norm) and norm > WEIGHT_GROWTH_WARNING * reference:
                self._warned.add(id(w))
                grown.append(f"{name} ({norm / reference:.0f}x)")
        if grown:
            warnings.warn(f"{self._owner}: the norm of {', '.join(grown)} grew to more than "
                          f"{WEIGHT_GROWTH_WARNING:.0f}x its start (or torch's default initialisation's, the "
                          f"larger): training is diverging. Lower the lr (or, for K-FAC-type methods, raise "
                          f"the damping)", RuntimeWarning, stacklevel=user_stacklevel())


def default_init_norm(shape: Sequence[int]) -> float:
    """The norm torch's default initialisation (``kaiming_uniform_(a=√5)``: entries of variance
    ``1 / (3 · fan_in)``) gives a weight of ``shape``, read as rows of its last dimension: a
    Linear's ``[out, in]``, a fused experts weight's ``[E, out, in]`` (each expert a Linear), a
    learned position table's ``[1, T, d]``. For a convolution ``[out, in, k…]`` it is larger
    than torch's (which takes ``in · k…`` as the fan-in): a floor that errs high, which only
    makes the check less sensitive."""
    numel = math.prod(shape)
    return math.sqrt(numel / (3 * shape[-1]))


def new_nonfinite_steps(optimizer: torch.optim.Optimizer, reported: dict[int, int]) -> list[tuple]:
    """``(index, parameter, new, total)`` for every parameter of ``optimizer`` whose
    ``state["nonfinite_steps"]`` counter grew since ``reported`` (updated in place); the
    counters are read in one host sync. A counter on the meta device (a model not yet
    materialized) holds no value and is left out. Shared by the standalone optimizers' warnings."""
    entries = [(i, p, optimizer.state[p]["nonfinite_steps"])
               for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
               if "nonfinite_steps" in optimizer.state.get(p, {})]
    entries = [entry for entry in entries if not entry[2].is_meta]
    if not entries:
        return []
    device = entries[0][2].device
    counts = torch.stack([c.to(device) for _, _, c in entries]).tolist()  # one host sync
    grown = []
    for (i, p, _), total in zip(entries, counts):
        total = int(total)  # torch.optim's load may have cast the counter to a float
        if total > reported.get(i, 0):
            grown.append((i, p, total - reported.get(i, 0), total))
        reported[i] = total
    return grown


class Health:
    """``combine``: where some rank records nothing for layers another rank judges (see the
    module's docstring), a collective that takes the elementwise maximum of an int64 tensor over
    the ranks, in place; called with the same shape on every rank at every check."""

    def __init__(self, layers: Sequence, *, captures: bool,
                 combine: Callable[[torch.Tensor], None] | None = None) -> None:
        self._layers = list(layers)
        self._captures = captures
        self._combine = combine
        self._observed_checked = False
        self._stale: set[str] = set()  # layers reported as no longer receiving statistics
        self._pending: list[tuple[torch.Tensor, torch.cuda.Event | None, list]] = []
        # [5, layers] on the device, per layer (by column): the first usable update norm, the
        # mean log of the usable update norms so far, their count, and the largest growths since
        # the last read of the update norm over the reference before it and over the first norm
        self._updates: torch.Tensor | None = None
        # per (layers, judged by this rank): their column indices and the mask of those judged
        self._update_index: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}

    # ------------------------------------------------------------------ gradients
    def record_gradients(self, finite: torch.Tensor, layers: list) -> None:
        """``finite[i]``: the gradient of ``layers[i]`` was finite this step."""
        if finite.device.type == "cpu":
            self._warn_gradients(finite.tolist(), layers)
            return
        host = finite.to("cpu", non_blocking=True)
        event = torch.cuda.Event() if finite.device.type == "cuda" else None
        if event is not None:
            event.record()
        self._pending.append((host, event, layers))

    def poll(self) -> None:
        """Report the steps whose flags have reached the host."""
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            host, _, layers = self._pending.pop(0)
            self._warn_gradients(host.tolist(), layers)

    def flush(self) -> None:
        for host, event, layers in self._pending:
            if event is not None:
                event.synchronize()
            self._warn_gradients(host.tolist(), layers)
        self._pending.clear()

    @staticmethod
    def _warn_gradients(flags: list, layers: list) -> None:
        bad = [layer.name for layer, ok in zip(layers, flags) if not ok]
        if bad:
            warnings.warn(f"kron_precond: the gradient of {', '.join(bad)} is not finite (NaN/Inf); "
                          "passed through unpreconditioned and left out of kl_clip's sum",
                          RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ updates
    def record_updates(self, norms: torch.Tensor | None, layers: list) -> None:
        """``norms[i]``: the norm of the update written for ``layers[i]`` this step (0: none,
        or a non-finite gradient passed through). Device ops only: read in :meth:`report_state`.

        The step's growths are its norm over the layer's reference *before* this step and over
        its first norm (0 before any; NaN for a non-finite norm, kept by the running maxima until
        the next read). A usable norm (finite, > 0) then enters the reference: it sets the first
        norm if there is none, and the running geometric mean (see the module's docstring)."""
        if norms is None:
            return
        if self._updates is None or self._updates.device != norms.device:
            self._updates = torch.zeros(5, len(self._layers), dtype=torch.float32, device=norms.device)
            self._update_index.clear()
        # a rank that does not hold a layer whose holders may hand its gradient on unchanged
        # (LayerMethod.hands_on_gradients) cannot tell that gradient from an update: it records
        # nothing for the layer (as for a gradient handed on), and the holders' verdict counts
        judged = tuple(getattr(layer.method, "holds_state", True)
                       or not getattr(layer.method, "hands_on_gradients", False) for layer in layers)
        key = (tuple(layer.index for layer in layers), judged)
        cached = self._update_index.get(key)
        if cached is None:
            index = torch.tensor(key[0], dtype=torch.int64, device=norms.device)
            mask = None if all(judged) else torch.tensor(judged, dtype=torch.bool, device=norms.device)
            cached = self._update_index[key] = (index, mask)
        index, mask = cached
        norms = norms.to(torch.float32)  # (float64 is not available on every device)
        if mask is not None:
            norms = torch.where(mask, norms, 0.0)
        updates = self._updates.index_select(1, index)
        first, log_mean, count = updates[:3].unbind(0)
        seen = count > 0  # the reference exists
        finite = norms < float("inf")  # a norm is >= 0: false for +inf and NaN
        # [2, n]: over the reference and over the first norm (where a condition is false, the
        # other branch's inf or NaN is discarded); NaN for a non-finite norm: torch.maximum
        # keeps it visible until the next read
        growth = norms / torch.stack([torch.maximum(first, log_mean.exp()), first])
        growth = torch.where(finite, torch.where(seen, growth.clamp(max=2.0**62), 0.0), float("nan"))
        usable = finite & (norms > 0)
        count = count + usable  # float32: exact up to 2**24 norms, then still a running mean
        # the k-th usable norm enters with weight min(1, UPDATE_REFERENCE_SPAN / k)
        log_mean = torch.where(usable, log_mean.addcdiv(norms.log() - log_mean, count.clamp(min=UPDATE_REFERENCE_SPAN),
                                                        value=UPDATE_REFERENCE_SPAN), log_mean)
        first = torch.where(seen, first, norms)  # (not read while the count is 0)
        self._updates.index_copy_(1, index, torch.cat([torch.stack([first, log_mean, count]),
                                                       torch.maximum(updates[3:], growth)]))

    def forget_updates(self) -> None:
        """Drop every layer's update references and peaks (after a checkpoint is loaded: a run
        rolled back from a blow-up must not keep the blown-up norms in its reference)."""
        self._updates = None
        self._update_index.clear()

    def _update_growth(self) -> torch.Tensor:
        """As int64, per layer the largest growth over the reference since the last read, then per
        layer the largest over the first norm (rounded down; 0 before any reference), ``-1`` if
        it is not finite. Resets them."""
        if self._updates is None:
            return torch.zeros(0, dtype=torch.int64)
        peak = self._updates[3:].reshape(-1)
        growth = torch.where(torch.isfinite(peak), peak.floor(), torch.full_like(peak, -1.0))
        growth = growth.to(torch.int64)
        peak.zero_()
        return growth

    def _combined(self, growth: torch.Tensor, device: torch.device) -> torch.Tensor:
        """:meth:`_update_growth` with each value the largest over the ranks (``combine``), a
        non-finite one (``-1``) kept as such; every layer's, also on a rank that recorded none."""
        if not len(growth):
            growth = torch.zeros(2 * len(self._layers), dtype=torch.int64, device=device)
        top = torch.iinfo(torch.int64).max  # non-finite above every growth (at most 2**62)
        values = torch.where(growth < 0, top, growth)
        assert self._combine is not None
        self._combine(values)
        return torch.where(values == top, -1, values)

    def _report_updates(self, growth: list[int]) -> None:
        if not growth:
            return
        n = len(self._layers)
        described = []
        for layer, g, g_first in zip(self._layers, growth[:n], growth[n:]):
            if g < 0 or g_first < 0:
                described.append(f"{layer.name} (non-finite)")
            elif g >= UPDATE_GROWTH_WARNING:
                described.append(f"{layer.name} ({g:.3g}x)")
            elif g_first >= UPDATE_FIRST_GROWTH_WARNING:
                described.append(f"{layer.name} ({g_first:.3g}x its first norm)")
        if not described:
            return
        warnings.warn(f"kron_precond: the preconditioned update of {', '.join(described)} grew to at least "
                      f"{UPDATE_GROWTH_WARNING:g} times its usual norm (the larger of its first norm and a "
                      f"running geometric mean of its recent norms), or {UPDATE_FIRST_GROWTH_WARNING:g} times "
                      "its first norm, since the last check: training is diverging. "
                      "Lower the learning rate or refresh the preconditioner more often "
                      "(method='shampoo': grafting=True)", RuntimeWarning, stacklevel=4)

    # ------------------------------------------------------------------ state updates
    def report_state(self, statistics_seen: bool) -> None:
        """Warn about skipped non-finite state updates and, once statistics were gathered,
        about registered layers whose hooks saw no data (one host sync)."""
        flags = [layer.method.nonfinite for layer in self._layers]
        check_observed = self._captures and statistics_seen and not self._observed_checked
        observed = [layer.method.observed() for layer in self._layers] if check_observed else []
        if check_observed and any(o is None for o in observed):
            check_observed, observed = False, []
        watched = [layer for layer in self._layers if hasattr(layer.method, "statistics_health")] \
            if self._captures and statistics_seen else []
        health = [layer.method.statistics_health() for layer in watched]
        growth = self._update_growth()
        every = [f.reshape(-1) for f in flags + [o.to(torch.int64) for o in observed] + health]
        if self._combine is not None:
            growth = self._combined(growth, every[0].device)
        values = torch.cat([growth.to(every[0].device)] + every).tolist()  # one host sync for every check
        self._report_updates(values[:len(growth)])
        values = values[len(growth):]
        if watched:
            tail = values[len(values) - 4 * len(watched):]
            self._report_stale(watched, [tail[4 * i:4 * i + 4] for i in range(len(watched))])
        for layer, count in zip(self._layers, values):
            if count:
                warnings.warn(f"kron_precond: skipped {count} non-finite update(s) of {layer.name}; "
                              "its state was left unchanged", RuntimeWarning, stacklevel=3)
                layer.method.nonfinite.zero_()
        if check_observed:
            self._observed_checked = True
            n = len(self._layers)
            unseen = [l.name for l, seen in zip(self._layers, values[n:2 * n]) if not seen]
            if unseen:
                warnings.warn(f"kron_precond: layers {unseen} are registered but their hooks saw no data "
                              "before the first refresh (did the model run in eval() mode? statistics are "
                              "gathered in training mode only; did it run as nn.DataParallel replicas, whose "
                              "hooks gather nothing (use DistributedDataParallel)? is the module called "
                              "functionally? an expert routed no token?); until they do, their gradients pass through "
                              "unpreconditioned",
                              RuntimeWarning, stacklevel=3)

    def _report_stale(self, layers: list, flags: list[list[int]]) -> None:
        """Warn (once, until it recovers) about a layer that had statistics and then got
        none for ``STALE_STATISTICS_STEPS`` statistics steps in a row -- a module no longer
        called, or whose output-gradient hook was lost: its factors silently go stale.
        (Shorter gaps -- a layer skipped now and then -- are normal and not reported.)"""
        for layer, (had_a, had_g, missed_a, missed_g) in zip(layers, flags):
            if not (missed_a or missed_g):
                self._stale.discard(layer.name)
                continue
            if not (had_a or had_g) or layer.name in self._stale \
                    or max(missed_a, missed_g) < STALE_STATISTICS_STEPS:
                continue  # never observed at all: the first-refresh check reports it
            self._stale.add(layer.name)
            if not missed_a:
                what = ("activations but no usable output gradients (none arrived: is its output detached or "
                        "unused? or they held NaN or Inf, which are left out: a diverging run, or float16 without "
                        "a GradScaler?)")
            elif not missed_g:
                what = "output gradients but no activations"
            elif getattr(layer, "expert", None) is not None:
                what = "no rows (the router sent this expert no token)"
            else:
                what = "no statistics (is the module still called, in training mode?)"
            warnings.warn(f"kron_precond: layer '{layer.name}' received {what} in the last "
                          f"{max(missed_a, missed_g)} statistics steps, after having had statistics; "
                          "its preconditioner is no longer updated", RuntimeWarning, stacklevel=4)
