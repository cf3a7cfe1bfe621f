"""KronPreconditioner: the façade over the engine.

One step, as data flows (docs/design.md, "The engine")::

    forward hook ─ a ─┐                                       (capture.py, methods that capture)
    tensor hook  ─ g ─┴─> statistics ─> reduce (async, bucketed; distributed/runtime.py)
    step(): plan (schedule + hyperparameters; schedules.py) ─> fold ─> observe gradients
            ─> refresh on owners ─> share with gradient workers ─> apply, batched
            ─> receive on other ranks ─> kl_clip ─> write .grad   (apply.py)
            ─> warnings (health.py)

The engine asks each method only through its contract (methods/base.py); methods are
looked up by name in methods/registry.py. Every rank issues the same collectives in the same
order: each decision that changes communication is a function of the step count and the
registration, never of data.
"""
from __future__ import annotations

import functools
import logging
import math
import types
import warnings
import weakref
from types import MappingProxyType
from typing import Any, Callable, Mapping, cast

import torch
from torch import nn

from kron_precond import checkpoint, validation
from kron_precond.apply import precondition_exchanged, precondition_gradients
from kron_precond.attention import PackedInputAdapter, any_rank, refuse_cross_attention, several_ranks
from kron_precond.autocast import autocast_disabled
from kron_precond.capture import (
    FULLGRAPH_REASON,
    ActivationCapture,
    ForwardHook,
    grad_scaler_scale,
    refuse_fullgraph,
    weakly,
)
from kron_precond.compiled import run_eagerly
from kron_precond.distributed.assignment import WorkAssignment, assign_work
from kron_precond.distributed.runtime import Runtime
from kron_precond.distributed.sharded import ShardedLayout, is_dtensor, refuse_fsdp1
from kron_precond.enums import AssignmentStrategy, DistributedStrategy, strategy_by_name
from kron_precond.health import WEIGHT_CHECK_EVERY, Health, WeightGrowth
from kron_precond.methods import registry
from kron_precond.methods.base import LayerMethod, MethodSpec
from kron_precond.modules import (
    ParametrizationWatch,
    Selected,
    compile_skip_patterns,
    is_fsdp_module,
    is_skipped,
    recording_frozen,
    refuse_lazy,
    user_stacklevel,
    warn_unmatched_skips,
)
from kron_precond.schedules import StepContext, resolve

logger = logging.getLogger("kron_precond")


def _no_rows(weight: torch.Tensor, name: str) -> bool:
    """A packed attention's call read as cross-attention under several ranks: no rows; the next
    refresh step refuses it on every rank (``KronPreconditioner._refuse_cross_attention_on_any_rank``)."""
    return False

_KL_CLIP_DEFAULT = object()  # the method's default: 1e-3 for K-FAC; off for PSGD (already whitened)
_LR_FALLBACK = 0.1  # kl_clip's lr when none is given anywhere (with a warning)


def _computed(tensor: Any) -> bool:
    """Whether a module attribute that held a parameter now holds a tensor computed from others
    (not a leaf ``nn.Parameter``; FSDP2's gathered and sharded copies are parameters)."""
    return isinstance(tensor, torch.Tensor) and not isinstance(tensor, nn.Parameter)


class Layer:
    """A registered module: its parameters and its method state (read-only view).

    Attributes the method state holds (K-FAC's ``a_factor`` / ``g_factor``, PSGD's
    ``q_factors``, ...) are readable here too, after pending reductions have finished.

    A layer may be one expert of a fused experts module: ``expert`` is then its row (dim 0)
    of each parameter, its gradients are views ``param.grad[expert]`` and the preconditioned
    values are written back into them in place.
    """

    def __init__(self, owner: "KronPreconditioner", index: int, unit: Selected, method_state: LayerMethod) -> None:
        self._owner = weakref.ref(owner)  # the hooks reach layers: they must not keep the owner alive
        self.index = index
        self.name = unit.name
        self.module = unit.module
        self.params = unit.params
        self.method = method_state
        self.adapter = unit.adapter
        self.expert = unit.index
        self.slot = unit.slot
        self.shapes = unit.shapes
        # The parameters' device and dtype when the state was made: when the model is moved
        # after construction, the state follows (KronPreconditioner._follow_parameters).
        self.placement = (self.params[0][1].device, self.params[0][1].dtype)
        self.parametrization = ParametrizationWatch(unit.module)  # one put on since is refused

    def gradients(self) -> list[torch.Tensor | None]:
        """This layer's gradients: ``.grad`` of each parameter (its row for an expert)."""
        if self.expert is None:
            return [p.grad for _, p in self.params]
        return [None if p.grad is None else p.grad[self.expert] for _, p in self.params]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        owner = self._owner()
        if owner is not None:
            owner._wait_for_statistics()
        return getattr(self.method, name)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}{'' if self.expert is None else f'[{self.expert}]'}{tuple(shape)}"
                           for (n, _), shape in zip(self.params, self.shapes))
        return f"Layer({self.name!r}, {type(self.module).__name__}, {shapes})"


class KronPreconditioner:
    """Kronecker-factored preconditioning of ``.grad`` for any base optimizer.

    Use it between ``loss.backward()`` and ``optimizer.step()``::

        precond = KronPreconditioner(model, method="kfac", skip_layers=["Embedding"])
        loss.backward(); precond.step(lr=optimizer.param_groups[0]["lr"]); optimizer.step()

    (``lr``: the optimizer's current one, which K-FAC's ``kl_clip`` reads.)

    Args (keyword-only after ``model``):
        model: the module to scan (a DDP- or ``torch.compile``-wrapped model or its module).
        method: a registered method name: ``"kfac"``, ``"psgd"``, ``"ekfac"``, ``"shampoo"``,
            ``"ikfac"``, ``"second_moment"``, ``"soap"``
            (or a :class:`~kron_precond.Method`).
        skip_layers: regex or list of regexes; a module is skipped when one matches
            (``re.search``) its qualified name or its class name.
        kl_clip: scale preconditioned gradients by
            ``min(1, sqrt(kl_clip / |Σ lr² ⟨V, ∇⟩|))``; ``None`` disables. Default: the
            method's (1e-3 for K-FAC and EK-FAC, off for the others). A value or a callable of
            the step.
        lr: learning rate used only by ``kl_clip`` (a value or a callable of the step).
            ``None`` (default): the ``lr`` given to :meth:`step` —
            :class:`~kron_precond.PreconditionedOptimizer` passes its current learning rate
            at every step, so ``kl_clip`` follows the optimizer and its scheduler.
        accumulation_steps: backward passes per step for methods that capture activations;
            each micro-batch loss is assumed divided by it. The attribute of that name may
            be set between steps.
        grad_scaler: a ``torch.amp.GradScaler``, or a callable returning the current loss
            scale (float or tensor; kfac-pytorch's ``scaler.get_scale``), whose scale is
            divided out of the output gradients seen by the hooks (mixed precision).
            Anything else raises ``TypeError``. Without it, output gradients that arrive in
            float16 (almost always a scaler's) warn once.
        allreduce_bucket_cap_mb: size of statistic all-reduce buckets (0: one call per tensor).
        assignment_strategy: ``"compute"`` or ``"memory"``: what placing work on ranks balances.
        colocate_factors: keep all of a layer's expensive work on one rank. ``False``
            needs ``grad_worker_fraction=COMM_OPT``.
        grad_worker_fraction: :class:`DistributedStrategy` (or its name, case-insensitive) or a
            float f in (0, 1]; each layer has ``world·f`` gradient workers (HYBRID_OPT rounds
            down to a divisor).
        symmetry_aware: all-reduce only the upper triangles of symmetric statistics.
        process_group: the data-parallel group (default: the world, if initialised).
        **options: the method's own settings; see ``docs/API.md`` and each method's spec
            (e.g. K-FAC: ``factor_update_steps``, ``inv_update_steps``, ``damping``,
            ``factor_decay``, ``compute_method``, ``factor_dtype``, ``inv_dtype``,
            ``statistics_rows``; PSGD:
            ``preconditioner_update_probability``, ``precond_lr``, ``memory_save_mode``, ...).
            Numeric ones marked per-step also accept a callable of the step. A setting of
            another method is ignored, with a warning when its value differs from that
            setting's default; an unknown name raises ``TypeError``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        method: str = "kfac",
        skip_layers: str | list[str] | tuple[str, ...] = (),
        kl_clip: float | None | Callable[[int], float] = _KL_CLIP_DEFAULT,  # type: ignore[assignment]
        lr: float | Callable[[int], float] | None = None,
        accumulation_steps: int = 1,
        grad_scaler=None,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        process_group=None,
        **options,
    ) -> None:
        spec_class = registry.get(method)
        engine_args = dict(accumulation_steps=accumulation_steps, grad_scaler=grad_scaler,
                           symmetry_aware=symmetry_aware)
        self._spec: MethodSpec = spec_class(_method_settings(spec_class, options, engine_args))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        given, model = model, _unwrap(model)  # the wrappers' own settings are read from given
        self._model = model
        self.method = spec_class.name
        self.assignment_strategy = AssignmentStrategy.parse(assignment_strategy, "assignment_strategy")
        if kl_clip is _KL_CLIP_DEFAULT:
            kl_clip = spec_class.default_kl_clip
        if kl_clip is not None and not callable(kl_clip):
            kl_clip = validation.check_positive("kl_clip", kl_clip)
        if lr is not None and not callable(lr):  # 0 is meaningful: a warm-up from 0 (scale 1)
            lr = validation.check_non_negative("lr", lr)
        self._kl_clip, self._lr = kl_clip, lr
        self._accumulation_steps = validation.check_int("accumulation_steps", accumulation_steps)
        bucket_cap = validation.check_non_negative("allreduce_bucket_cap_mb", allreduce_bucket_cap_mb)
        self.skip_layers = skip_layers
        self.symmetry_aware = validation.check_bool("symmetry_aware", symmetry_aware)
        self.colocate_factors = validation.check_bool("colocate_factors", colocate_factors)
        self._grad_scaler = grad_scaler
        # set by PreconditionedOptimizer: scaler.step(optimizer) calls step() only after finding the
        # gradients finite, so the scaler's record is not read again (a second host sync, and under
        # sharding a collective that a rank whose scaler skipped would never join)
        self._scaler_read_by_caller = False
        loss_scale = grad_scaler_scale(grad_scaler)  # TypeError for anything else, whatever the method

        # ---- distributed context
        self._runtime = Runtime(process_group, bucket_cap_bytes=int(bucket_cap * 2**20),
                                symmetric=self.symmetry_aware)
        self.process_group = process_group
        self.world_size, self.rank = self._runtime.world_size, self._runtime.rank
        # FSDP2 / HSDP: DTensor parameters are validated before anything touches them
        self._runtime.detect_sharding(model.named_parameters())
        self.grad_worker_fraction = grad_worker_fraction = strategy_by_name(grad_worker_fraction)
        self.grad_workers = _grad_workers(grad_worker_fraction, self.world_size)
        if not self.colocate_factors and self.grad_workers != self.world_size:
            raise ValueError("colocate_factors=False needs grad_worker_fraction=COMM_OPT: a layer's "
                             "preconditioned gradient is computed where all of its state lives")

        # ---- registration
        refuse_fsdp1(model.named_parameters(), "KronPreconditioner")
        patterns = compile_skip_patterns(skip_layers)
        warn_unmatched_skips(model, patterns, "KronPreconditioner")
        # a lazy module's shapes are unknown until its first forward (skip_layers may leave it out)
        refuse_lazy(((n, m) for n, m in model.named_modules() if not is_skipped(n, m, patterns)),
                    "KronPreconditioner")
        with recording_frozen() as frozen_at_build:
            selected = self._spec.select(model, lambda name, module: is_skipped(name, module, patterns),
                                         logger.info)
        # Modules left out (in whole or in part) because parameters of them were frozen: one of
        # those parameters with a gradient later (unfrozen) is said once (_report_unfrozen).
        self._frozen_at_build = frozen_at_build
        if not selected:
            raise ValueError(f"no module of {type(model).__name__} can be preconditioned with "
                             f"method={self.method!r} (skip_layers={skip_layers!r})")
        if self._runtime.sharding is not None and any(s.index is not None for s in selected):
            raise ValueError("fused experts (one layer per expert of a stacked parameter) are not supported on "
                             "FSDP2 / HSDP sharded models yet; skip_layers= the experts modules or use DDP")
        self._layers = [Layer(self, i, s, self._spec.make_layer(i, s)) for i, s in enumerate(selected)]
        self.layers: Mapping[str, Layer] = MappingProxyType({l.name: l for l in self._layers})

        # ---- placement
        self.assignment: WorkAssignment = assign_work(
            {l.name: l.method.factor_costs() for l in self._layers}, self.world_size,
            self.assignment_strategy, self.colocate_factors)
        # before creating groups: disagreeing ranks would hang there
        if self.world_size > 1:
            self._runtime.check_agreement(self._agreement_description(), model)
        self._runtime.create_grid(self.grad_workers)
        for layer in self._layers:
            layer.method.holds_state = self._holds_state(layer)
        self._setup_sharding()
        if self.rank == 0:
            logger.info("%s", self.assignment.summary())

        # ---- per-step machinery
        self._schedule = self._spec.make_schedule()
        self._steps = 0
        self._statistics_steps = 0  # identical on every rank
        self._refreshes = 0  # identical on every rank
        self._pending_statistics: tuple[Any, StepContext, frozenset[str]] | None = None
        self._warned_lr_fallback = False
        self._warned_lr_override = False  # step(lr=...) unlike the constructor's lr, said once
        self._warned_pending_save = False  # see _pack
        self._weight_growth = WeightGrowth("kron_precond")
        self._warned_frozen_in_part: set[str] = set()
        self._apply_cache: dict = {}
        # ranks that do not hold a layer whose holders may hand its gradient on record nothing for
        # it (kron_precond.health): the holders' verdict is combined into every rank's at each check
        judged_elsewhere = (self.world_size > 1 and self.grad_workers < self.world_size
                            and any(layer.method.hands_on_gradients for layer in self._layers))
        self._health = Health(self._layers, captures=self._spec.captures,
                              combine=functools.partial(_max_over_ranks, group=self.process_group)
                              if judged_elsewhere else None)
        # a schedule that cannot give step 0's values is refused before any hook is on the model
        # (a callable setting is called by the step that reads it: it may read objects built
        # after this one, or cover only the steps a resumed run takes)
        self._schedule.collects(0)
        self._schedule.refreshes(0)
        if self._spec.captures:
            refuse_fullgraph(given, [layer.module for layer in self._layers], "KronPreconditioner")
        self._capture = (ActivationCapture(self._layers, accumulation_steps=self._accumulation_steps,
                                           loss_scale=loss_scale, before_write=weakly(self._wait_for_statistics),
                                           before_observe=weakly(self._follow_parameters),
                                           output_grads=self._spec.captures_output_grads)
                         if self._spec.captures else None)
        # packed attentions a call as cross-attention is refused for: in one process at that call;
        # across ranks at the next refresh step, on every rank (another rank may not have read the
        # call so, or not made it: a raise on one rank alone would leave the others waiting)
        self._packed_attention = [adapter for adapter in {id(layer.adapter): layer.adapter
                                                          for layer in self._layers}.values()
                                  if isinstance(adapter, PackedInputAdapter)]
        if several_ranks(self.process_group):
            for adapter in self._packed_attention:
                adapter.on_cross_attention = _no_rows
        self._collecting = False
        self._update_collecting()
        # fully_shard(model) after construction: the first step takes the sharded parameters
        # (_bind_to_model); _follow_parameters leaves the plain ones alone until then
        self._bound = False
        # per layer module (by id): it and the modules above it in the model, the last walk's (_fsdp_managed)
        self._module_chains: dict[int, tuple[nn.Module, ...]] | None = None
        self._module_chains_step = -1
        self._adopted_sharding = False
        # The model's training forwards since the last step (a Python int per forward), counted
        # to check accumulation_steps, which scales the output-gradient statistics by its square:
        # against the first step's forwards, then for a change of the count during the run.
        self._forwards_since_step = [0]
        self._forward_counter = (model.register_forward_hook(
            ForwardHook(_count_training_forwards(self._forwards_since_step)), with_kwargs=True)
            if self._spec.captures and self._spec.captures_output_grads else None)
        # The hooks reach this object only weakly: one the caller drops is freed, and this
        # takes its hooks off the modules (they would keep gathering statistics).
        self._finalizer = (weakref.finalize(self, _remove_hooks, self._capture, self._forward_counter)
                           if self._capture is not None else None)
        if self._finalizer is not None:
            self._finalizer.atexit = False
        self._forwards_checked = False  # the first step's check
        # (forwards per step when accumulation_steps was last set or first used, the last step's)
        self._forwards_per_step: int | None = None
        self._last_forwards = 0
        self._warned_forwards_change = False

    @property
    def accumulation_steps(self) -> int:
        """Backward passes (micro-batches) per step, each micro-batch loss assumed divided by it;
        methods that capture statistics scale the output-gradient rows by it. It may be set
        between steps (on every rank alike): checked as the constructor checks it
        (``ValueError``), it scales the rows captured from then on."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        value = validation.check_int("accumulation_steps", value)
        self._accumulation_steps = value
        self._forwards_per_step = None  # the next step's count is the new one's
        if self._capture is not None:  # the hooks read the capture's copy
            self._capture.accumulation_steps = value

    def _check_accumulation(self) -> None:
        """Warn if the model's training forwards before the first step differ from
        ``accumulation_steps`` (each forward one micro-batch, as usual), and, once, if the
        forwards per step change during the run while ``accumulation_steps`` stays (on two
        steps in a row: a short last window is one step)."""
        if self._forward_counter is None:
            return
        ran, self._forwards_since_step[0] = self._forwards_since_step[0], 0
        if not self._forwards_checked:
            self._forwards_checked = True
            if ran not in (0, self.accumulation_steps):
                warnings.warn(f"KronPreconditioner: accumulation_steps={self.accumulation_steps}, but the model ran "
                              f"forward {ran} times in training mode before the first step. If each forward is a "
                              f"micro-batch of one optimizer step, set accumulation_steps={ran}: the output-gradient "
                              f"statistics are scaled by its square (K-FAC's damping is then off by that factor). "
                              f"If the model runs forward more than once per micro-batch (a forward no backward "
                              f"follows adds no statistics), ignore this",
                              UserWarning, stacklevel=3)  # the caller of step()
        known, previous, self._last_forwards = self._forwards_per_step, self._last_forwards, ran
        if not ran:
            return
        if known is None:
            self._forwards_per_step = ran
        elif ran != known and ran == previous and not self._warned_forwards_change:
            self._warned_forwards_change = True
            steps = self.accumulation_steps
            value = (f"set accumulation_steps={steps * ran // known}" if steps * ran % known == 0
                     else f"scale accumulation_steps by {ran}/{known}")
            warnings.warn(f"KronPreconditioner: the model now runs forward {ran} times in training mode per step "
                          f"(the last two steps), against {known} when accumulation_steps={steps} was set or first "
                          f"used. If the micro-batches per step changed (a GradientAccumulationScheduler, a resume "
                          f"with another count), {value}: the output-gradient statistics are scaled by its square "
                          f"(K-FAC's damping is off by that factor from the change on). Said once",
                          UserWarning, stacklevel=3)  # the caller of step()

    def _refuse_cross_attention_on_any_rank(self) -> None:
        """On a refresh step under several ranks: ``RuntimeError`` on every rank if any rank read
        a call of a packed attention as cross-attention (one small all-reduce and host read, on
        refresh steps only)."""
        adapters = self._packed_attention
        if not adapters or not several_ranks(self.process_group):
            return
        seen = any_rank([a.cross_seen for a in adapters], adapters[0].weight.device, self.process_group)
        for adapter, cross in zip(adapters, seen):
            if cross:
                refuse_cross_attention(adapter.weight, adapter.name)

    def _setup_sharding(self) -> None:
        """Sharded models (docs/design.md, "FSDP2 and HSDP"): statistics are reduced to each
        layer's owner, which alone keeps the running state; with one gradient worker per
        layer on a 1-D mesh, gradients travel to owners and back instead of being all-gathered."""
        sharded = self._runtime.sharding is not None and self.world_size > 1
        self._reduce_to_owners = (sharded and self._spec.reduces_statistics and self._spec.owner_only_statistics
                                  and self.colocate_factors)
        if self._reduce_to_owners:
            for layer in self._layers:
                if self._layer_owner(layer) != self.rank:
                    layer.method.release_statistics_state()
        self._exchange = sharded and self._runtime.use_owner_exchange(
            [p for layer in self._layers for _, p in layer.params])

    def _gradients(self) -> dict[str, list]:
        """Per layer, the gradients this rank works with (``None`` where a parameter has none):
        ``.grad``; for sharded models the full values, all-gathered, or in owner-exchange mode
        gathered to the owner only (other ranks see ``None`` for layers they do not own)."""
        raw = {layer.name: layer.gradients() for layer in self._layers}
        if self._runtime.sharding is None:
            return raw  # (a one-rank mesh still gives DTensors, e.g. torchtitan at any size)
        if not self._exchange:
            return self._runtime.full_gradients(raw)
        by_owner: dict[int, list] = {r: [] for r in range(self.world_size)}
        for layer in self._layers:
            by_owner[self._layer_owner(layer)].extend((p, p.grad) for _, p in layer.params)
        mine = iter(self._runtime.gather_to_owners(by_owner))
        # A parameter without a gradient (a layer not called this step: so on every rank) travels
        # as zeros; its owner takes it as None again, as every other path does.
        return {layer.name: ([full if p.grad is not None else None for (_, p), full in
                              zip(layer.params, [next(mine) for _ in layer.params])]
                             if self._layer_owner(layer) == self.rank else [None] * len(layer.params))
                for layer in self._layers}

    # ------------------------------------------------------------------ step
    def step(self, *, lr: float | torch.Tensor | None = None) -> None:
        """Replace ``.grad`` of every registered parameter with its preconditioned value.

        Args:
            lr: the base optimizer's current learning rate, read by ``kl_clip`` when the
                constructor was given no ``lr`` (e.g.
                ``precond.step(lr=optimizer.param_groups[0]["lr"])``).

        With AMP's ``GradScaler``, call ``scaler.unscale_(optimizer)`` first: the update
        (and ``kl_clip``) must see true gradients. Inside an autocast region the step still
        runs in its own dtypes (autocast is turned off for it).
        """
        with torch.no_grad(), autocast_disabled():
            self._bind_before_first_step()  # the parameters fully_shard put in since construction
            self._bound = True
            for layer in self._layers:  # first: a model sharded since the first step is refused here
                self._follow_parameters(layer, at_step=True)
        if self._skipped_by_scaler():
            # the scaler will skip the optimizer's step: this step never happens here either (its
            # statistics dropped, nothing counted), so the schedule and the first refresh see the
            # next iteration's data, as in a run without it
            self.discard_statistics()
            return
        if not any(p.grad is not None for p in self._model.parameters()):
            # no gradient in the whole model: a trainer's skipped iteration (Lightning's training_step
            # returning None steps without a backward), no step -- its forwards' statistics dropped,
            # nothing counted, as the scaler's skip above. A step where only unregistered parameters
            # have gradients (a head-only phase) counts. Host reads only, the same on every rank.
            self.discard_statistics()
            return
        self._check_accumulation()
        self._report_unfrozen()
        with torch.no_grad(), autocast_disabled():
            self._health.poll()
            ctx = self._plan(lr)  # raises before any state changes
            if ctx.refresh:  # the call gave no rows (no layout to keep): a refresh step may read
                self._refuse_cross_attention_on_any_rank()
            passed, frozen = self._left_alone()
            grads = self._gradients()
            if passed or frozen:  # seen as layers (parameters) without gradients by every method verb below
                grads = {layer.name: [None] * len(grads[layer.name]) if layer.name in passed else
                         [None if id(p) in frozen else g for (_, p), g in zip(layer.params, grads[layer.name])]
                         for layer in self._layers}
            if ctx.statistics:
                self._statistics_steps += 1
                self._fold_or_reduce(ctx, passed)
            for layer in self._layers:
                layer.method.observe_gradients(grads[layer.name], ctx)
            if ctx.refresh:
                self._refresh(ctx, grads, passed)
            elif ctx.statistics and self._spec.apply_reads_statistics:
                self._wait_for_statistics()
            apply = precondition_exchanged if self._exchange else functools.partial(
                precondition_gradients, holds=self._holds_state)
            written = apply(self._layers, owner_of=self._layer_owner, runtime=self._runtime, ctx=ctx,
                            kl_clip=ctx.hparams.get("kl_clip"), lr=ctx.hparams.get("lr"),
                            cache=self._apply_cache, grads=grads, passed_through=passed)
            if written is not None:
                finite, written_layers, update_norms = written
                self._health.record_gradients(finite, written_layers)
                self._health.record_updates(update_norms, written_layers)
            every = self._spec.health_check_every
            if (ctx.refresh if every is None else ctx.step % every == 0):
                self._health.report_state(self._statistics_steps > 0)
            if ctx.step % WEIGHT_CHECK_EVERY == 0:  # weights grown by orders of magnitude: diverging
                self._weight_growth.check([(f"{layer.name}.{name}", p) for layer in self._layers
                                           for name, p in layer.params])
            self._schedule.advance(ctx.step)
            self._steps += 1
            self._update_collecting(after_step=True)

    def _left_alone(self) -> tuple[frozenset[str], frozenset[int]]:
        """``(layers, parameters)`` this step leaves alone although they may hold gradients.

        Layers: those whose parameters are preconditioned together (``joint_gradients``: K-FAC's
        ``[W | b]``) of which a parameter is frozen (``requires_grad=False``, even with a stale
        ``.grad``), or has no ``.grad`` while another has one. Such a layer is treated as one
        not called this step: not preconditioned, its gradients unchanged, its state (statistics
        gathered by its hooks, factors, moments, refreshes) untouched, as a layer frozen so at
        construction is not registered. Said once per layer. Parameters (``id``): the frozen
        ones of the methods that precondition each parameter alone (Shampoo, PSGD), seen as
        having no gradient. Reads flags and ``.grad is None`` only: no host sync, and the same
        on every rank (the collectives keep one layout)."""
        left: list[str] = []
        frozen_params: list[int] = []
        for layer in self._layers:
            frozen = [n for n, p in layer.params if not p.requires_grad]
            if not layer.method.joint_gradients:  # each parameter alone: one without a gradient is left out
                frozen_params.extend(id(p) for _, p in layer.params if not p.requires_grad)
                continue
            missing = [n for n, p in layer.params if p.grad is None or not p.requires_grad]
            if not missing or (len(missing) == len(layer.params) and not frozen):
                continue  # every gradient, or none (not called this step): the usual paths
            left.append(layer.name)
            if layer.name not in self._warned_frozen_in_part:
                self._warned_frozen_in_part.add(layer.name)
                what = ("is frozen (requires_grad=False)" if len(frozen) == len(layer.params) else
                        f"has no gradient for {', '.join(missing)} (requires_grad=False or .grad is None) while "
                        f"its other parameters have one")
                warnings.warn(
                    f"kron_precond: layer {layer.name!r} {what}. method={self.method!r} preconditions the layer's "
                    f"parameters together, so while this lasts its gradients pass through unpreconditioned and its "
                    f"state is left unchanged, as for a layer frozen so when the preconditioner is built (which is "
                    f"not registered). Unfreeze {', '.join(missing)} to have it preconditioned again",
                    UserWarning, stacklevel=3)  # the caller of step()
        return frozenset(left), frozenset(frozen_params)

    def _report_unfrozen(self) -> None:
        """Modules left out at construction, in whole or in part, because parameters of them were
        frozen, once one of those parameters has a gradient: it is never preconditioned (no state,
        no hooks were made for it). Said once per module; host reads only (``.grad is None``)."""
        if not self._frozen_at_build:
            return
        unfrozen = [(module, module.unfrozen()) for module in self._frozen_at_build]
        said = [(module, names) for module, names in unfrozen if names]
        if not said:
            return
        self._frozen_at_build = [module for module, names in unfrozen if not names]
        described = "; ".join(f"{module.label} ({', '.join(names)})" for module, names in said)
        warnings.warn(f"kron_precond: {described} now have gradients but were frozen (requires_grad=False) when "
                      f"the KronPreconditioner was built, so method={self.method!r} did not register them: they "
                      f"stay unpreconditioned (their gradients pass through unchanged). Build the preconditioner "
                      f"after unfreezing them to precondition them", UserWarning, stacklevel=3)  # the caller of step()

    def _skipped_by_scaler(self) -> bool:
        """Whether the ``torch.amp.GradScaler`` given as ``grad_scaler`` found an Inf or NaN when
        it unscaled this iteration's gradients, so that its ``step()`` will skip the optimizer.
        Read from the scaler's record of ``unscale_`` (the one host read its own ``step()``
        makes too); ``False`` for another ``grad_scaler`` or before ``unscale_``."""
        scaler = self._grad_scaler
        if self._scaler_read_by_caller or not isinstance(scaler, torch.amp.GradScaler) or not scaler.is_enabled():
            return False
        try:
            from torch.amp.grad_scaler import OptState
            unscaled = [list(state["found_inf_per_device"].values())
                        for state in scaler._per_optimizer_states.values() if state["stage"] is OptState.UNSCALED]
        except (AttributeError, ImportError, KeyError, TypeError):  # another torch's GradScaler internals
            return False
        if not unscaled:  # unscale_ not called yet (or after update()): nothing to read
            return False
        device = self._layers[0].params[0][1].device
        found = [v.reshape(()).float().to(device) for per_device in unscaled for v in per_device]
        skipped = torch.stack(found).sum() if found else torch.zeros((), device=device)
        if len(unscaled) > 1:
            # several optimizers share the scaler, each skipped on its own: this one's is the one
            # holding the registered layers, skipped here only if one of their gradients overflowed
            grads = [self._runtime.local(g) for layer in self._layers for g in layer.gradients() if g is not None]
            finite = [torch.isfinite(g).all().to(device) for g in grads]
            overflowed = ~torch.stack(finite).all() if finite else torch.zeros((), dtype=torch.bool, device=device)
            skipped = skipped * overflowed.to(skipped.dtype)
        if self._runtime.sharding is not None and self.world_size > 1:
            # each rank unscaled its own shards: the ranks skip together, or none does
            self._runtime.sum_over_shards(skipped)
        return bool(skipped > 0)

    def discard_statistics(self) -> None:
        """Drop the statistics gathered since the last step (the forward and backward of an
        iteration whose step will not happen). :class:`PreconditionedOptimizer` calls it when a
        ``GradScaler`` skipped its step; ``step()`` itself, when the ``grad_scaler`` it was given
        found an overflow."""
        self._wait_for_statistics()  # a reduction still in flight belongs to the last step
        self._forwards_since_step[0] = 0  # the abandoned iteration's forwards were no micro-batches
        for layer in self._layers:
            layer.method.discard_statistics()

    def _plan(self, step_lr=None) -> StepContext:
        """This step's decisions and hyperparameters, all checked before anything changes."""
        step = self._steps
        if self._collects_failed:  # after the last step the schedule could not give this one's
            self._schedule.collects(step)
        statistics = self._collecting
        refresh = self._schedule.refreshes(step)
        hparams: dict[str, Any] = dict(self._schedule.hparams(step))
        for name, option in self._spec.options.items():
            when = option.per_step
            if when is None:
                continue
            if when == "always" or (when == "statistics" and statistics) or (when == "refresh" and refresh):
                hparams[name] = option.check(name, resolve(self._spec.settings[name], step))
        kl_clip = resolve(self._kl_clip, step)
        if kl_clip is not None:
            hparams["kl_clip"] = validation.check_positive("kl_clip", kl_clip)
            hparams["lr"] = self._kl_clip_lr(step, step_lr)
        return StepContext(step=step, statistics=statistics, refresh=refresh, refresh_index=self._refreshes,
                           statistics_count=self._statistics_steps + int(statistics), hparams=hparams)

    def _kl_clip_lr(self, step: int, step_lr):
        """kl_clip's lr: the constructor's, else the one given to step(), else 0.1 (warned once)."""
        if self._lr is not None:
            lr = validation.check_non_negative("lr", resolve(self._lr, step))
            differs = False  # compared until said once; never a tensor (a host read)
            if not self._warned_lr_override and step_lr is not None and not any(
                    isinstance(v, torch.Tensor) for v in (step_lr, lr)):
                try:  # a value step() would refuse with lr=None is not read here either: no comparison
                    differs = not math.isclose(float(step_lr), float(lr), rel_tol=1e-6, abs_tol=0.0)
                except (TypeError, ValueError):
                    pass
            if differs:
                self._warned_lr_override = True
                warnings.warn(f"kron_precond: kl_clip reads the lr={lr!r} given at construction, not "
                              f"step(lr={step_lr!r}): build the preconditioner with lr=None to follow the "
                              f"optimizer's lr (its schedule)", UserWarning, stacklevel=user_stacklevel())
            return lr
        if step_lr is not None:
            # An optimizer's lr, which warm-up schedules start at 0: then ν = 1 (no clip).
            if isinstance(step_lr, torch.Tensor):  # a tensor lr (capturable optimizers): no host sync
                return step_lr
            return validation.check_non_negative("step(lr=...)", step_lr)
        if not self._warned_lr_fallback:
            self._warned_lr_fallback = True
            warnings.warn(f"kron_precond: kl_clip needs the learning rate but none was given; using "
                          f"lr={_LR_FALLBACK}. Pass lr= to KronPreconditioner, call "
                          "step(lr=optimizer.param_groups[0]['lr']), or use PreconditionedOptimizer",
                          UserWarning, stacklevel=4)
        return _LR_FALLBACK

    def _fold_or_reduce(self, ctx: StepContext, passed: frozenset[str] = frozenset()) -> None:
        """Fold this step's statistics, or start their reduction (folded when waited on); the
        layers ``passed`` (:meth:`_left_alone`) drop theirs instead (after the reduction, whose
        layout they keep)."""
        if self.world_size == 1 or not self._spec.reduces_statistics:
            self._fold(ctx, passed)
            return
        # Sums and row counts are reduced, then folded when waited on: lazily, so the
        # reduction overlaps with the rest of this step and the next ones, until a refresh
        # needs the results or the next forward hook the buffers.
        if self._reduce_to_owners:  # only owners fold (sharded models)
            by_owner: dict[int, list[torch.Tensor]] = {}
            for layer in self._layers:
                by_owner.setdefault(self._layer_owner(layer), []).extend(layer.method.shared_statistics())
            handle = self._runtime.reduce_statistics_to_owners(by_owner)
        else:
            tensors = [t for layer in self._layers for t in layer.method.shared_statistics()]
            handle = self._runtime.reduce_statistics(tensors)
        self._pending_statistics = (handle, ctx, passed)

    def _wait_for_statistics(self) -> None:
        if self._pending_statistics is not None:
            handle, ctx, passed = self._pending_statistics
            self._pending_statistics = None
            handle.wait()
            self._fold(ctx, passed)

    def _fold(self, ctx: StepContext, passed: frozenset[str]) -> None:
        for layer in self._layers:
            if layer.name in passed:
                layer.method.discard_statistics()
            else:
                layer.method.fold_statistics(ctx)

    def _refresh(self, ctx: StepContext, grads: dict[str, list], passed: frozenset[str] = frozenset()) -> None:
        """Refresh every part on its owner, share the results; the layers ``passed``
        (:meth:`_left_alone`) are not refreshed (their refreshed tensors still travel)."""
        self._wait_for_statistics()
        for layer in self._layers:
            if layer.name in passed:
                continue
            for part in layer.method.parts:
                if self.assignment.owner(layer.name, part) == self.rank:
                    layer.method.refresh(part, grads[layer.name], ctx)
        self._refreshes += 1
        if self.world_size > 1:
            shared: dict[int, list[torch.Tensor]] = {}
            for (name, part), owner in self.assignment.owners.items():
                if self._runtime.shares_with(owner):
                    shared.setdefault(owner, []).extend(self.layers[name].method.refreshed_tensors(part))
            self._runtime.share_refreshed(shared)
            if self.grad_workers < self.world_size:  # else every rank got them above
                self._share_statistics_tensors()
        for layer in self._layers:
            if self._holds_state(layer) and layer.name not in passed:
                layer.method.finalize_refresh(ctx)

    def _share_statistics_tensors(self) -> None:
        """From each part's owner to every rank: the refreshed tensors every rank needs to gather
        statistics (EK-FAC's bases, on which each rank projects its rows). A collective."""
        for_all: dict[int, list[torch.Tensor]] = {}
        for (name, part), owner in self.assignment.owners.items():
            for_all.setdefault(owner, []).extend(self.layers[name].method.statistics_tensors(part))
        self._runtime.share_with_all(for_all)

    def _update_collecting(self, *, after_step: bool = False) -> None:
        """Whether the next forward gathers statistics. ``after_step``: a scheduled value that
        is invalid for the next step does not fail the step just completed; that step's own
        plan raises it, before anything changes."""
        self._collects_failed = False
        try:
            self._collecting = self._schedule.collects(self._steps)
        except Exception:  # a user's callable may raise anything (an IndexError from a table)
            if not after_step:
                raise
            self._collecting = False
            self._collects_failed = True  # the next step's plan asks again, and raises before it changes anything
        if self._capture is not None:
            self._capture.collecting = self._collecting

    # ------------------------------------------------------------------ placement
    def _follow_parameters(self, layer: Layer, at_step: bool = False) -> None:
        """Move ``layer``'s state to its parameters if the model was moved since the state
        was made (``model.to(device / dtype)`` after construction, ``to_empty`` from
        ``meta``). Compares metadata only: no host sync. ``at_step``: called by :meth:`step`
        (outside any forward), where a model sharded since the first step is refused."""
        if layer.parametrization.since(n for n, _ in layer.params):
            raise self._computed_since()
        name, param = layer.params[0]
        current = getattr(layer.module, name, param)
        if current is not param and _computed(current):
            raise self._computed_since()
        if is_dtensor(param) and not is_dtensor(current):
            # FSDP2's gathered copy, swapped in around the forward in its mixed-precision dtype:
            # the layer keeps the sharded parameters, and the state their dtype (following the
            # copy would round float64 state through the copy's dtype every forward). Only a copy
            # on another device moves the state there, as its rows are (CPU offload; sharded on
            # meta, then to_empty): the step follows the sharded parameters again
            self._place_state(layer, current.device, layer.placement[1])
            return
        if (current is not param and not is_dtensor(param)
                and (is_dtensor(current) or self._fsdp_managed(layer.module))):
            # fully_shard(model) since construction: the first step takes the sharded parameters
            # (_bind_to_model); until then a hook sees them or FSDP2's gathered copy (in the
            # forward's mixed-precision dtype), which is not taken. The state still goes to their
            # device (built on meta, then to_empty; Accelerate's prepare() moving a CPU-built
            # model during fully_shard), in the sharded parameters' dtype (the copy's: kept)
            if at_step:  # the first step bound what fully_shard put in: sharded since (all named)
                raise self._sharded_late([other for other in self._layers
                                          if getattr(other.module, other.params[0][0]) is not other.params[0][1]])
            self._place_state(layer, current.device, current.dtype if is_dtensor(current) else layer.placement[1])
            return
        if current is not param and not at_step:
            # in a forward: new Parameter objects (to_empty() from meta; a conversion that overwrites
            # the parameters), or FSDP2's gathered copy of a model that fully_shard wrapped at a
            # module above the preconditioner's (which _fsdp_managed cannot see), there only for the
            # forward in its mixed-precision dtype, narrower than the parameters at rest. The state
            # follows the device now (the statistics are about to be gathered there) and a dtype at
            # least as wide as its own; the step takes the parameters at rest, with their dtype
            kept = layer.placement[1]
            wider = torch.promote_types(current.dtype, kept) == current.dtype
            self._place_state(layer, current.device, current.dtype if wider else kept)
            return
        if current is not param:  # to_empty() from meta makes new Parameter objects
            layer.params = [(n, getattr(layer.module, n, p)) for n, p in layer.params]
            param = current
        self._place_state(layer, param.device, param.dtype)

    def _computed_since(self) -> RuntimeError:
        """The error for layers whose tensors are computed from other parameters since they were
        registered (a ``torch.nn.utils.parametrize`` parametrization, ``torch.nn.utils.prune``,
        the legacy ``weight_norm``): all of them named."""
        found = []
        for layer in self._layers:
            tensors = layer.parametrization.since(n for n, _ in layer.params)
            tensors += [n for n, p in layer.params if n not in tensors and _computed(getattr(layer.module, n, p))]
            if tensors:
                found.append(f"{layer.name!r} ({', '.join(tensors)})")
        return RuntimeError(
            f"KronPreconditioner: layers {', '.join(found)} are computed from other parameters since the "
            f"preconditioner was built (torch.nn.utils.parametrize, torch.nn.utils.prune, nn.utils.weight_norm): "
            f"the gradient that reaches those parameters is not the computed tensor's, and the parameter the "
            f"preconditioner holds gets none. Refused before the step changes anything. Apply them before "
            f"building the preconditioner (such a layer is then not preconditioned: its gradients pass through), "
            f"or remove them")

    def _place_state(self, layer: Layer, device: torch.device, dtype: torch.dtype) -> None:
        """Move ``layer``'s state to ``device`` / ``dtype`` unless it is there (metadata only)."""
        placement = (device, dtype)
        if placement == layer.placement:
            return
        self._wait_for_statistics()
        layer.method.to(device, dtype)
        layer.placement = placement
        self._apply_cache.clear()  # batched apply stacked the old tensors

    def _fsdp_managed(self, module: nn.Module) -> bool:
        """Whether FSDP2 manages ``module``'s parameters: it or a module above it in the model
        was wrapped by ``fully_shard`` (which changes the wrapped module's class in place). Read
        only where a layer holds a plain parameter its module no longer holds (``to_empty`` from
        meta, a parametrization, fully_shard). The modules above each layer's module are found
        by one walk of the model, at most once per step (forwards and step), kept until the next
        step; each query checks that chain's classes: metadata, no host sync."""
        chains = self._module_chains
        if chains is None or self._module_chains_step != self._steps:
            chains = self._module_chains = _chains_above(self._model, {id(layer.module) for layer in self._layers})
            self._module_chains_step = self._steps
        return any(is_fsdp_module(above) for above in chains.get(id(module), ()))

    def _bind_to_model(self) -> None:
        """Before the first step: if ``fully_shard(model)`` replaced the registered modules'
        parameters with DTensors since construction (a trainer that shards the model after the
        optimizer is built: Accelerate's FSDP2 ``prepare()``), take them, and the sharded layout,
        as if built after ``fully_shard``: the layers' parameters are re-read from their modules,
        the layout is validated (``ValueError`` as at construction), and the statistics and
        gradient paths of sharded models are set up.

        Metadata only (no collective, no host sync), the same on every rank; a no-op for a model
        not sharded since construction. The statistics gathered so far are kept: no step has
        folded them yet, and they do not depend on the layout."""
        found = [(layer, [(n, getattr(layer.module, n, p)) for n, p in layer.params]) for layer in self._layers]
        moved = [(layer, current) for layer, current in found
                 if any(c is not p for (_, c), (_, p) in zip(current, layer.params))]
        if not any(is_dtensor(c) and not is_dtensor(p)
                   for layer, current in moved for (_, c), (_, p) in zip(current, layer.params)):
            return  # not sharded since construction (to_empty() from meta: _follow_parameters)
        # FSDP2 shards every parameter of a module: each replaced one must now be the module's DTensor
        # of the same global shape. One replaced by a plain tensor (a module FSDP2 keeps gathered
        # after the backward) would leave a stale parameter, whose gradient no backward writes
        odd = [layer for layer, current in moved
               if not all(c is p or (is_dtensor(c) and not is_dtensor(p) and c.shape == p.shape)
                          for (_, c), (_, p) in zip(current, layer.params))]
        if odd:
            raise self._sharded_late(odd, after_step=False)
        if any(layer.expert is not None for layer in self._layers):
            raise ValueError("fused experts (one layer per expert of a stacked parameter) are not supported on "
                             "FSDP2 / HSDP sharded models yet; skip_layers= the experts modules or use DDP")
        layout = ShardedLayout.detect(list(self._model.named_parameters()), self.world_size)
        for layer, current in moved:
            layer.params = current
        self._runtime.sharding = layout
        self._setup_sharding()
        self._apply_cache.clear()
        self._adopted_sharding = True
        logger.info("kron_precond: the model was sharded (fully_shard) after the KronPreconditioner was built: "
                    "took the sharded parameters of %d layers at the first step", len(moved))

    def _bind_before_first_step(self) -> None:
        """:meth:`_bind_to_model` where the first step has not come yet (the state-dict calls a
        trainer may make before it: the layout decides which rank saves and loads what)."""
        if not self._bound:
            self._bind_to_model()

    def _sharded_late(self, layers: list[Layer], after_step: bool = True) -> RuntimeError:
        """The error for layers whose modules now hold other parameters than the preconditioner's,
        which it cannot take (after its first step, or not FSDP2's sharded ones)."""
        names = ", ".join(repr(layer.name) for layer in layers[:4]) + (", ..." if len(layers) > 4 else "")
        when = ("after its first step: its state and the statistics' layout were set up for the unsharded model"
                if after_step else "but not all as FSDP2's sharded parameters of the same shapes (a module kept "
                "gathered after the backward, or parameters replaced otherwise)")
        return RuntimeError(
            f"KronPreconditioner: the parameters of module(s) {names} were replaced (fully_shard(model) swaps each "
            f"for a DTensor) {when}. Nothing was changed: build KronPreconditioner after fully_shard(model), as "
            f"PyTorch asks of optimizers (one built before fully_shard takes the sharded parameters at its first "
            f"step)")

    def _layer_owner(self, layer: Layer) -> int:
        return self.assignment.owner(layer.name, layer.method.parts[0])

    def _holds_state(self, layer: Layer) -> bool:
        return self._runtime.is_grad_worker(self._layer_owner(layer))

    def _agreement_description(self) -> str:
        """Everything that decides which collectives run when, and every setting of the step
        (under COMM_OPT each rank preconditions on its own: another damping, kl_clip or lr would
        let the ranks drift apart with no error), as text ranks compare."""
        # a callable of a setting that changes no collective is described by its name alone: it
        # is the user's, and is called on the steps that read it, not ahead of them here
        settings = {name: _describe_schedule(self._spec.settings[name], sample=option.collective)
                    for name, option in self._spec.options.items()}
        settings.update(kl_clip=_describe_schedule(self._kl_clip, sample=False),
                        lr=_describe_schedule(self._lr, sample=False))
        layers = ";".join(f"{l.name}:{l.expert}:{[(tuple(p.shape), str(p.dtype)) for _, p in l.params]}"
                          for l in self._layers)
        return (f"{layers}|{self.method}|{sorted(settings.items())}|{self.grad_workers}"
                f"|{self.symmetry_aware}|{self._runtime.bucket_cap_bytes}|{self.colocate_factors}"
                f"|{self.assignment_strategy.value}|{self.accumulation_steps}")

    # ------------------------------------------------------------------ public helpers
    @property
    def steps(self) -> int:
        """Number of completed :meth:`step` calls."""
        return self._steps

    @property
    def hparams(self) -> dict[str, Any]:
        """The per-step hyperparameters as given (values or callables)."""
        values = {name: self._spec.settings[name] for name, option in self._spec.options.items()
                  if option.per_step}
        values.update(kl_clip=self._kl_clip, lr=self._lr)
        return values

    def coverage(self) -> dict[str, float]:
        """How much of the model is preconditioned, in parameter elements: ``{"registered": n,
        "trainable": N, "fraction": n / N}``. ``trainable`` counts each parameter of the model
        that requires grad once (tied weights once); ``registered`` the elements of the
        registered layers (an expert counts its row of the stacked weight)."""
        trainable = sum(p.numel() for p in self._model.parameters() if p.requires_grad)
        registered = sum(shape.numel() for layer in self._layers for shape in layer.shapes)
        return {"registered": registered, "trainable": trainable,
                "fraction": registered / trainable if trainable else 0.0}

    def memory_usage(self) -> dict[str, int]:
        """Bytes of preconditioner state held on this rank, by kind of state (after finishing
        any statistics reduction still in flight)."""
        self._bind_before_first_step()
        self._wait_for_statistics()
        usage: dict[str, int] = {}
        for layer in self._layers:
            for kind, size in layer.method.memory_by_kind().items():
                usage[kind] = usage.get(kind, 0) + size
        return usage

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, on any number of ranks (format: :mod:`kron_precond.checkpoint`).

        Local: never communicates, so it is safe to call on rank 0 only (the usual
        ``if rank == 0: torch.save(...)``). With ``grad_worker_fraction < 1`` a rank holds
        the refreshed state (decompositions, PSGD factors) only of the layers it is a
        gradient worker of; on a rank lacking some, this raises ``ValueError`` at once
        rather than return a partial checkpoint -- call :meth:`gather_state_dict` on every
        rank there.

        Sharded (FSDP2 / HSDP) models: each rank returns only the layer state it holds (K-FAC
        factors from their owner, decompositions / PSGD factors from the layer's gradient
        workers), which is what ``torch.distributed.checkpoint`` (DCP) expects of a
        ``Stateful``: ``dcp.save({"precond": precond, ...})`` writes each piece once, and
        ``dcp.load`` on any number of ranks asks each rank for the pieces it will hold.
        :meth:`gather_state_dict` still assembles the whole state on every rank.
        """
        self._bind_before_first_step()
        if self._runtime.sharding is not None:
            self._wait_for_statistics()
            return self._pack({layer.name: layer.method.state_dict() for layer in self._layers
                               if self._needs_layer_state(layer)})
        missing = [layer.name for layer in self._layers if not self._holds_state(layer)]
        if missing:
            raise ValueError(
                f"state_dict(): rank {self.rank} does not hold the state of layers {missing} "
                f"(grad_worker_fraction={self.grad_worker_fraction!r}: {self.grad_workers} of "
                f"{self.world_size} ranks hold each layer); call gather_state_dict() on every rank "
                "instead -- it is a collective")
        self._wait_for_statistics()
        return self._pack({layer.name: layer.method.state_dict() for layer in self._layers})

    def gather_state_dict(self) -> dict[str, Any]:
        """:meth:`state_dict` assembled from the ranks that hold each layer: a collective,
        to be called on every rank of the process group; every rank gets the whole state.

        A rank that calls it while another rank does not (a save on rank 0 only) raises
        ``RuntimeError`` after waiting ``kron_precond.distributed.runtime.GATHER_ENTRY_TIMEOUT``
        seconds (120) for the others to call it too, instead of hanging in the gather; a rank
        that calls it after another gave up raises at once. Where every rank holds every
        layer (COMM_OPT, not sharded) it is local and may be called on one rank."""
        return self._gathered_state("gather_state_dict()")

    def _gathered_state(self, caller: str) -> dict[str, Any]:
        """:meth:`gather_state_dict` for ``caller`` (named in the error of a rank left alone)."""
        self._bind_before_first_step()
        if self.world_size > 1 and (self._runtime.sharding is not None or self.grad_workers < self.world_size):
            # it gathers: check (bounded wait) that every rank entered, before any collective
            self._runtime.enter_gather(caller, self._gather_advice(caller))
        self._wait_for_statistics()
        return self._pack({layer.name: self._layer_state(layer) for layer in self._layers})

    def _gather_advice(self, caller: str) -> str:
        """What the error of a rank left alone in a gather says to do."""
        fraction = self.grad_worker_fraction
        name = fraction.name if isinstance(fraction, DistributedStrategy) else repr(fraction)
        if self._runtime.sharding is not None:
            return (f"On a sharded (FSDP2 / HSDP) model {caller} is a collective that every rank of the process "
                    "group must call. To checkpoint without it, save the preconditioner itself with "
                    "torch.distributed.checkpoint on every rank (state_dict() returns each rank's part).")
        layout = (f"With grad_worker_fraction={name} ({self.grad_workers} of {self.world_size} ranks hold each "
                  f"layer's state) no rank holds every layer, so {caller} is a collective that every rank of the "
                  "process group must call.")
        if caller.startswith("PreconditionedOptimizer"):
            return (f"{layout} A trainer that saves on rank 0 only (the Hugging Face Trainer calls "
                    "optimizer.state_dict() under `if args.should_save`) cannot checkpoint this layout: use "
                    "grad_worker_fraction=DistributedStrategy.COMM_OPT (every rank holds every layer, and "
                    "state_dict() is local), or make the save call optimizer.state_dict() on every rank.")
        return (f"{layout} To save on rank 0 only, use grad_worker_fraction=DistributedStrategy.COMM_OPT (every "
                "rank holds every layer, and state_dict() is local), or call gather_state_dict() on every rank "
                "and save its result on one.")

    def _pack(self, layers: dict[str, Any]) -> dict[str, Any]:
        if not self._warned_pending_save and any(layer.method.has_pending_statistics() for layer in self._layers):
            self._warned_pending_save = True
            warnings.warn("KronPreconditioner: a checkpoint was taken inside an unfinished accumulation window: "
                          "the statistics its forwards and backwards gathered since the last step() are not in "
                          "it, so a run resumed from it goes on without those micro-batches. Save between step() "
                          "(or zero_grad()) and the next forward (after a step a GradScaler skipped, zero_grad() "
                          "drops them anyway: then ignore this)", UserWarning, stacklevel=user_stacklevel())
        return checkpoint.pack(method=self.method, steps=self._steps, statistics_steps=self._statistics_steps,
                               refreshes=self._refreshes, schedule=self._schedule.state_dict(), layers=layers)

    def _needs_layer_state(self, layer: Layer) -> bool:
        """Whether this rank saves / loads ``layer``'s state (sharded models: its holders)."""
        return self._runtime.sharding is None or self._holds_state(layer)

    def _layer_state(self, layer: Layer) -> dict[str, Any]:
        if self._runtime.sharding is not None and self.world_size > 1:
            # the owner alone holds everything (factors and refreshed state)
            local = layer.method.state_dict() if self._layer_owner(layer) == self.rank else None
            return self._runtime.gather_state(self._layer_owner(layer), local)
        if self.grad_workers == self.world_size:
            return layer.method.state_dict()
        local = layer.method.state_dict() if self._holds_state(layer) else None
        return self._runtime.gather_state(self._layer_owner(layer), local)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Restore :meth:`state_dict` output (saved with any number of ranks, by this or an
        earlier version).

        All or nothing: the format, method, counters, schedule and every layer's entries
        (presence, shapes, floating dtypes, finiteness -- NaN and integer factors are
        rejected) are checked before anything changes; a rejected state raises
        ``ValueError`` and changes nothing. Layers this model does not have raise too,
        unless ``strict=False`` (they are then ignored with a warning, as
        ``nn.Module.load_state_dict(strict=False)`` does); a layer of this model missing
        from the checkpoint always raises. On a sharded (FSDP2 / HSDP) model over several
        ranks it is a collective (as ``dcp.load`` is), whatever ``grad_worker_fraction``: call
        it on every rank. Each rank then checks the state it holds (a layer's factors live on
        its owner alone; with ``grad_worker_fraction < 1`` its refreshed state on its gradient
        workers alone), and the ranks agree on the outcome before anything changes: a state
        rejected on any rank raises ``ValueError`` on every rank (naming the ranks that
        rejected it, and on those ranks why), and no rank loads it. On a model that is not
        sharded (DDP) it is not a collective: each rank checks and loads its copy on its own
        (one rank may load alone), so give every rank the same checkpoint.
        """
        self._bind_before_first_step()  # a model sharded since construction loads as a sharded one
        # Sharded: each rank checks (and loads) only the state it holds -- a layer's factors on
        # its owner alone under any strategy (_layer_state), its refreshed state on its gradient
        # workers -- so the checks' outcome differs by rank and must be agreed on
        per_rank = self._runtime.sharding is not None and self.world_size > 1
        error: Exception | None = None
        try:
            checked = self._checked_state(state, strict)
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            if not per_rank:
                raise
            error = err
        if per_rank:
            # a collective entered by every rank (every rank calls load_state_dict), before
            # anything changes and before any other collective of the load
            failed = self._runtime.failed_ranks(error is not None, self._layers[0].params[0][1].device)
            if failed:
                reason = ("see the error raised there" if error is None else
                          f"on this rank ({self.rank}): "
                          f"{error if isinstance(error, ValueError) else f'{type(error).__name__}: {error}'}")
                raise ValueError(f"load_state_dict(): the state was rejected on rank(s) {failed} (each rank checks "
                                 f"the layers it holds); no rank loaded it; {reason}") from error
        layers, needed, counters, schedule, unexpected = checked
        if unexpected:
            warnings.warn(f"kron_precond: ignored the state of layers this model does not have: "
                          f"{unexpected}", UserWarning, stacklevel=2)
        self._wait_for_statistics()
        self._steps = counters["steps"]
        self._statistics_steps = counters["statistics_steps"]
        self._refreshes = counters["refreshes"]
        self._schedule.load_state_dict(schedule)
        self._apply_cache.clear()
        self._health.forget_updates()  # the loaded state's updates are measured afresh
        for layer in needed:
            layer.method.load_state_dict(layers[layer.name])
            if not self._holds_state(layer):
                layer.method.release_refreshed()
        if per_rank and self.grad_workers < self.world_size:
            # A sharded load with fewer gradient workers than ranks gives a rank only the layers'
            # refreshed state it holds; the tensors every rank needs to gather statistics come
            # from their owners, as after a refresh (the same test on every rank: every rank
            # joins). Every rank holds them otherwise, as it loaded them.
            self._share_statistics_tensors()
        self._update_collecting()

    def _checked_state(self, state: dict[str, Any], strict: bool
                       ) -> tuple[dict[str, Any], list[Layer], dict[str, int], Any, list[str]]:
        """:meth:`load_state_dict`'s checks, changing nothing: ``ValueError`` for a rejected
        state; else the layer entries, the layers this rank loads, the counters, the schedule's
        state and the names of the checkpoint's layers this model does not have."""
        state = checkpoint.upgrade(state)
        if state["method"] != self.method:
            raise ValueError(f"state_dict is for method={state['method']!r}, "
                             f"this preconditioner uses {self.method!r}")
        layers = state["layers"]
        if not isinstance(layers, dict):
            raise ValueError(f"state_dict['layers'] must be a dict, got {type(layers).__name__}")
        needed = [layer for layer in self._layers if self._needs_layer_state(layer)]
        missing = {layer.name for layer in needed} - set(layers)
        if missing:
            raise ValueError(f"state_dict has no state for layers {sorted(missing)}")
        unexpected = sorted(set(layers) - set(self.layers))
        if unexpected and strict:
            raise ValueError(f"state_dict holds layers this model does not have: {unexpected} "
                             "(pass strict=False to ignore them)")
        counters = {}
        for key in ("steps", "statistics_steps", "refreshes"):
            try:
                counters[key] = validation.check_int(key, state.get(key), minimum=0)
            except ValueError as err:
                raise ValueError(f"state_dict: {err}") from None
        probe = self._spec.make_schedule()  # its load checks the counters (PSGD: UpdateDecider.checked_state)
        try:
            probe.load_state_dict(state["schedule"])
        except ValueError as err:  # names the entry and the value
            raise ValueError(f"state_dict: bad 'schedule' entry: {err}") from None
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"state_dict: bad 'schedule' entry ({err!r})") from None
        # the loaded step's schedule values (a callable may refuse that step): before anything loads
        probe.collects(counters["steps"])
        probe.refreshes(counters["steps"])
        for layer in needed:  # all checks first: a rejected state changes nothing
            layer.method.check_state(layers[layer.name])
        return layers, needed, counters, state["schedule"], unexpected

    def remove(self) -> None:
        """Remove the hooks; the preconditioner no longer observes the model."""
        if self._finalizer is not None:
            self._finalizer()
        self._forward_counter = None

    def __reduce_ex__(self, protocol):
        raise TypeError("KronPreconditioner cannot be copied or pickled: it holds hooks on the model's modules, "
                        "which a copy would not have. Save precond.state_dict() and load it into a "
                        "KronPreconditioner built on the model")

    def __enter__(self) -> "KronPreconditioner":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        settings = {k: _describe_value(v) for k, v in self._spec.describe().items()}
        settings.update(kl_clip=_describe_value(self._kl_clip), lr=_describe_value(self._lr))
        if self._spec.captures:
            settings.update(accumulation_steps=self.accumulation_steps)
        settings.update(world_size=self.world_size, grad_workers=self.grad_workers,
                        assignment_strategy=self.assignment_strategy.value,
                        colocate_factors=self.colocate_factors, symmetry_aware=self.symmetry_aware,
                        allreduce_bucket_cap_mb=self._runtime.bucket_cap_bytes / 2**20)
        body = ",\n".join(f"  {k}={v!r}" for k, v in settings.items())
        return (f"KronPreconditioner(method={self.method!r}, layers={len(self._layers)}, "
                f"steps={self._steps},\n{body}\n)")


# ---------------------------------------------------------------------- arguments
# Engine arguments that only some methods use: warn (and ignore) when given to others.
_ENGINE_ONLY_IF = {  # name: (applies(spec, value), default)
    "accumulation_steps": (lambda spec, value: spec.captures, 1),
    # every method skips a step its GradScaler skips; a callable (a scale alone) serves the statistics
    "grad_scaler": (lambda spec, value: spec.captures or isinstance(value, torch.amp.GradScaler), None),
    "symmetry_aware": (lambda spec, value: spec.reduces_statistics, False),
}


def _method_settings(spec_class: type[MethodSpec], given: dict[str, Any], engine_args: dict[str, Any]) -> dict:
    """The method's settings from the user's keywords: checked, defaults filled in.
    Settings of other registered methods warn and are ignored; unknown names raise."""
    known = {name: option for spec in registry.all_specs() for name, option in spec.options.items()}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"KronPreconditioner() got unexpected keyword argument(s) {unknown}; "
                        f"method={spec_class.name!r} takes {sorted(spec_class.options)}")
    # A setting this method does not have is ignored, said so unless its value is the default of
    # the first registered method that has it (K-FAC for K-FAC's settings, PSGD for PSGD's): a
    # config shared between methods. Not "any method's default": Shampoo's grafting=True would
    # then pass silently with method="ekfac", which does not graft.
    ignored = [name for name, value in given.items() if name not in spec_class.options
               and not _is_default(value, [s.options[name].default for s in registry.all_specs()
                                           if name in s.options][:1])]
    ignored += [name for name, (applies, default) in _ENGINE_ONLY_IF.items()
                if not applies(spec_class, engine_args[name]) and not _is_default(engine_args[name], [default])]
    if ignored:
        warnings.warn(f"{', '.join(ignored)} do(es) not apply to method={spec_class.name!r} and "
                      "will be ignored", UserWarning, stacklevel=3)
    settings = {}
    for name, option in spec_class.options.items():
        value = given.get(name, option.default)
        if not (option.per_step and callable(value)):
            value = option.check(name, value)
        settings[name] = value
    return settings


def _chains_above(model: nn.Module, targets: set[int]) -> dict[int, tuple[nn.Module, ...]]:
    """For each module of ``model`` whose id is in ``targets``: ``model``, the modules between,
    and the module itself, along the first path :meth:`nn.Module.modules` reaches it by. One walk."""
    chains: dict[int, tuple[nn.Module, ...]] = {}
    visited: set[int] = set()
    stack: list[tuple[nn.Module, tuple[nn.Module, ...]]] = [(model, (model,))]
    while stack:
        module, chain = stack.pop()
        if id(module) in visited:
            continue
        visited.add(id(module))
        if id(module) in targets:
            chains[id(module)] = chain
        stack.extend((child, chain + (child,)) for child in reversed(list(module.children())))
    return chains


def _max_over_ranks(values: torch.Tensor, group) -> None:
    """In place: the elementwise maximum of ``values`` over the ranks of ``group`` (a collective)."""
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX, group=group)


def _remove_hooks(capture: ActivationCapture, forward_counter: Any) -> None:
    capture.remove()
    if forward_counter is not None:
        forward_counter.remove()


def _count_training_forwards(count: list[int]) -> Callable[..., None]:
    @run_eagerly(FULLGRAPH_REASON)  # a counter of Python ints: outside any compiled graph
    def hook(module: nn.Module, inputs, kwargs, output) -> None:
        if module.training and torch.is_grad_enabled():
            count[0] += 1
    return hook


def _is_default(value, defaults) -> bool:
    for default in defaults:
        try:
            if value is default or bool(value == default):
                return True
        except Exception:  # e.g. a tensor compared with a float
            continue
    return False


_SCHEDULE_SAMPLE_STEPS = 32


def _describe_schedule(value, sample: bool = True) -> str:
    """A rank-independent description of a setting that may be a callable of the step: its
    repr (or, for plain functions, whose repr holds an address, its qualified name) and, with
    ``sample``, its values over the first steps -- so two lambdas with different constants differ."""
    if not callable(value) or isinstance(value, type):
        return repr(value)
    if isinstance(value, functools.partial):
        name = f"partial({_describe_schedule(value.func)}, {value.args!r}, {value.keywords!r})"
    elif isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)) \
            or type(value).__repr__ is object.__repr__:
        name = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    else:
        name = repr(value)
    if not sample:
        return name
    try:
        values = [value(step) for step in range(_SCHEDULE_SAMPLE_STEPS)]
    except Exception as err:  # noqa: BLE001 - step() reports it, on every rank alike
        values = [f"raises {type(err).__name__}"]
    return f"{name}:{values!r}"


def _describe_value(value):
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", None) or repr(value)
    return value


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / ``torch.compile`` wrappers, so that layer names (and so
    checkpoints) are the same with and without them."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = cast(nn.Module, model.module)
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            # nn.Module.__getattr__ types submodule attributes as Tensor | Module
            model = cast(nn.Module, model._orig_mod)
        else:
            return model


def _grad_workers(fraction, world_size: int) -> int:
    """Number of gradient workers per layer for a strategy or fraction of the world."""
    if isinstance(fraction, DistributedStrategy):
        if fraction is DistributedStrategy.COMM_OPT:
            return world_size
        if fraction is DistributedStrategy.MEM_OPT:
            return 1
        workers = max(1, world_size // 2)
        while world_size % workers:  # HYBRID_OPT: the largest divisor not above half
            workers -= 1
        return workers
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"grad_worker_fraction must be a DistributedStrategy or a float in (0, 1], "
                         f"got {fraction!r}")
    exact = world_size * fraction
    if abs(exact - round(exact)) > 1e-9 or round(exact) < 1 or world_size % round(exact):
        raise ValueError(f"grad_worker_fraction={fraction!r} gives {exact:g} gradient workers, "
                         f"which does not divide the world size {world_size}")
    return int(round(exact))
