"""KronPreconditioner: registers a model's layers and rewrites their gradients in place.

One step, as data flows (DESIGN.md §1)::

    forward hook ─ a ─┐
    tensor hook  ─ g ─┴─> statistics (factor steps only) ─> fold + all-reduce (async, bucketed)
    step(): wait ─> refresh on owners ─> broadcast to grad workers ─> apply on grad workers
            ─> broadcast preconditioned grads to receivers ─> kl_clip ─> write .grad

Every rank issues the same collectives in the same order: each decision that changes
communication is a function of the step count and the registration, never of data.
"""
from __future__ import annotations

import hashlib
import logging
import math
import warnings
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from kron_precond.distributed import collectives
from kron_precond.distributed.assignment import WorkAssignment, assign_work
from kron_precond.distributed.groups import WorkerGrid
from kron_precond.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, Method
from kron_precond.methods.kfac import FACTORS, KFACLayer
from kron_precond.modules import compile_skip_patterns, find_modules
from kron_precond.schedules import UpdateDecider, resolve

logger = logging.getLogger("kron_precond")

_KL_CLIP_DEFAULT = object()  # 1e-3 for K-FAC; off for PSGD, whose output is already whitened
_NONFINITE_CHECK_INTERVAL = 100
_LR_FALLBACK = 0.1  # kl_clip's lr when none is given anywhere (with a warning)


class Layer:
    """A registered module: its parameters and its method state (read-only view)."""

    def __init__(self, owner: "KronPreconditioner", index: int, name: str, module: nn.Module,
                 params: list[tuple[str, nn.Parameter]], method_state, adapter) -> None:
        self._owner = owner
        self.index = index
        self.name = name
        self.module = module
        self.params = params
        self.method = method_state
        self.adapter = adapter

    @property
    def a_factor(self) -> torch.Tensor:
        """K-FAC activation factor ``[in(+1), in(+1)]`` (bias row/column last)."""
        self._owner._wait_for_statistics()
        return self.method.a_factor

    @property
    def g_factor(self) -> torch.Tensor:
        """K-FAC output-gradient factor ``[out, out]``."""
        self._owner._wait_for_statistics()
        return self.method.g_factor

    @property
    def q_factors(self) -> dict[str, list[torch.Tensor]]:
        """PSGD factors ``Q_i`` per parameter name."""
        return self.method.q_factors

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}{tuple(p.shape)}" for n, p in self.params)
        return f"Layer({self.name!r}, {type(self.module).__name__}, {shapes})"


class KronPreconditioner:
    """Kronecker-factored preconditioning of ``.grad`` for any base optimizer.

    Use it between ``loss.backward()`` and ``optimizer.step()``::

        precond = KronPreconditioner(model, method="kfac", skip_layers=["Embedding"])
        loss.backward(); precond.step(); optimizer.step()

    Args (keyword-only after ``model``; numeric ones also accept a callable of the step):
        model: the module to scan (a DDP-wrapped model or its ``.module``).
        method: ``"kfac"`` or ``"psgd"`` (:class:`Method`).
        skip_layers: regex or list of regexes; a module is skipped when one matches
            (``re.search``) its qualified name or its class name.
        factor_update_steps: K-FAC statistics are gathered every this many steps.
        inv_update_steps: K-FAC eigendecompositions / inverses are recomputed every this
            many steps.
        damping: Tikhonov damping λ of ``(G ⊗ A + λI)``.
        factor_decay: running-average decay of the factors, in (0, 1].
        kl_clip: scale preconditioned gradients by
            ``min(1, sqrt(kl_clip / |Σ lr² ⟨V, ∇⟩|))``; ``None`` disables. Default 1e-3
            for K-FAC and off for PSGD.
        lr: learning rate used only by ``kl_clip``. ``None`` (default): the ``lr`` given to
            :meth:`step` — :class:`PreconditionedOptimizer` passes its current learning
            rate at every step, so ``kl_clip`` follows the optimizer and its scheduler.
        accumulation_steps: backward passes per step; each micro-batch loss is assumed
            divided by it (statistics are averaged over all micro-batches).
        compute_method: ``"eigen"`` (default) or ``"inverse"`` (:class:`ComputeMethod`).
        compute_eigenvalue_outer_product: cache ``1 / (d_G d_Aᵀ + λ)`` at refresh time.
        factor_dtype: dtype of the factors (default: the parameters' dtype).
        inv_dtype: dtype of decompositions / inverses (decomposed in ≥ float32).
        grad_scaler: a ``torch.amp.GradScaler`` whose scale is divided out of the
            output gradients seen by the hooks (mixed precision).
        preconditioner_update_probability, max_size_triangular, min_ndim_triangular,
        memory_save_mode, momentum_into_precond_update, precond_b1, precond_lr,
        precond_init_scale, precond_dtype, merge_dims: PSGD Kron settings (see
            :class:`kron_precond.Kron`); ``precond_b1`` is the decay of the gradient
            average fitted when ``momentum_into_precond_update`` (the base optimizer keeps
            its own momentum, so the default is False).
        seed: seeds PSGD's probe vectors, per layer, independently of rank and world size.
        allreduce_bucket_cap_mb: size of factor all-reduce buckets (0: one call per tensor).
        assignment_strategy: ``"compute"`` or ``"memory"``: what placing work on ranks balances.
        colocate_factors: keep all of a layer's expensive work on one rank. ``False``
            needs ``grad_worker_fraction=COMM_OPT``.
        grad_worker_fraction: :class:`DistributedStrategy` or a float f in (0, 1]; each
            layer has ``world·f`` gradient workers (HYBRID_OPT rounds down to a divisor).
        symmetry_aware: all-reduce only the upper triangles of the factors.
        process_group: the data-parallel group (default: the world, if initialised).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        method: Method | str = Method.KFAC,
        skip_layers: str | list[str] | tuple[str, ...] = (),
        factor_update_steps: int | Callable[[int], int] = 1,
        inv_update_steps: int | Callable[[int], int] = 1,
        damping: float | Callable[[int], float] = 1e-3,
        factor_decay: float | Callable[[int], float] = 0.95,
        kl_clip: float | None | Callable[[int], float] = _KL_CLIP_DEFAULT,  # type: ignore[assignment]
        lr: float | Callable[[int], float] | None = None,
        accumulation_steps: int = 1,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        factor_dtype: torch.dtype | None = None,
        inv_dtype: torch.dtype = torch.float32,
        grad_scaler=None,
        preconditioner_update_probability: float | Callable[[int], float] | None = None,
        max_size_triangular: int = 8192,
        min_ndim_triangular: int = 2,
        memory_save_mode: str | None = None,
        momentum_into_precond_update: bool = False,
        precond_b1: float = 0.9,
        precond_lr: float | Callable[[int], float] = 0.1,
        precond_init_scale: float | None = 1.0,
        precond_dtype: torch.dtype = torch.float32,
        merge_dims: bool = False,
        seed: int = 0,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        grad_worker_fraction: DistributedStrategy | float = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        process_group=None,
    ) -> None:
        _warn_inapplicable(dict(locals()))
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        model = _unwrap(model)
        self.method = Method.parse(method, "method")
        self.compute_method = ComputeMethod.parse(compute_method, "compute_method")
        self.assignment_strategy = AssignmentStrategy.parse(assignment_strategy, "assignment_strategy")
        if kl_clip is _KL_CLIP_DEFAULT:
            kl_clip = 1e-3 if self.method is Method.KFAC else None
        self.hparams: dict[str, Any] = dict(
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps,
            damping=damping, factor_decay=factor_decay, kl_clip=kl_clip, lr=lr,
            precond_lr=precond_lr)
        for name, value in self.hparams.items():
            if not callable(value) and not (name == "lr" and value is None):
                _check_hparam(name, value)
        _check_int("accumulation_steps", accumulation_steps)
        _check_int("max_size_triangular", max_size_triangular)
        _check_int("min_ndim_triangular", min_ndim_triangular, minimum=0)
        if not 0.0 <= precond_b1 < 1.0:
            raise ValueError(f"precond_b1 must be in [0, 1), got {precond_b1!r}")
        if not (isinstance(allreduce_bucket_cap_mb, (int, float)) and allreduce_bucket_cap_mb >= 0):
            raise ValueError(f"allreduce_bucket_cap_mb must be >= 0, got {allreduce_bucket_cap_mb!r}")
        if factor_dtype is not None and not _is_float_dtype(factor_dtype):
            raise ValueError(f"factor_dtype must be a floating torch.dtype or None, got {factor_dtype!r}")
        if inv_dtype not in (torch.float32, torch.float64, torch.bfloat16):
            raise ValueError(f"inv_dtype must be torch.float32, torch.float64 or torch.bfloat16 "
                             f"(float16 overflows 1/λ-sized values), got {inv_dtype!r}")
        if not _is_float_dtype(precond_dtype):
            raise ValueError(f"precond_dtype must be a floating torch.dtype, got {precond_dtype!r}")
        self.accumulation_steps = accumulation_steps
        self.skip_layers = skip_layers
        self.symmetry_aware = bool(symmetry_aware)
        self.colocate_factors = bool(colocate_factors)
        self.seed = int(seed)
        self._bucket_cap_bytes = int(allreduce_bucket_cap_mb * 2**20)
        self._grad_scaler = grad_scaler
        self._psgd_settings = dict(
            max_size_triangular=max_size_triangular, min_ndim_triangular=min_ndim_triangular,
            memory_save_mode=memory_save_mode, init_scale=precond_init_scale,
            dtype=precond_dtype, merge_dims=merge_dims)
        self._psgd_momentum = (bool(momentum_into_precond_update), float(precond_b1))
        self._decider = UpdateDecider(preconditioner_update_probability)

        # ---- distributed context
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
        else:
            self.world_size, self.rank = 1, 0
        self.grad_workers = _grad_workers(grad_worker_fraction, self.world_size)
        self.grad_worker_fraction = grad_worker_fraction
        if not self.colocate_factors and self.grad_workers != self.world_size:
            raise ValueError("colocate_factors=False needs grad_worker_fraction=COMM_OPT: a layer's "
                             "preconditioned gradient is computed where all of its state lives")

        # ---- registration
        patterns = compile_skip_patterns(skip_layers)
        found = find_modules(model, kfac=self.method is Method.KFAC, patterns=patterns,
                             log=logger.info)
        if not found:
            raise ValueError(f"no module of {type(model).__name__} can be preconditioned with "
                             f"method={self.method.value!r} (skip_layers={skip_layers!r})")
        self._layers = [self._make_layer(i, *entry, factor_dtype, inv_dtype, compute_eigenvalue_outer_product)
                        for i, entry in enumerate(found)]
        self.layers: Mapping[str, Layer] = MappingProxyType({l.name: l for l in self._layers})

        # ---- placement
        self.assignment: WorkAssignment = assign_work(
            {l.name: l.method.factor_costs() for l in self._layers}, self.world_size,
            self.assignment_strategy, self.colocate_factors)
        if self.world_size > 1:  # before creating groups: disagreeing ranks would hang there
            self._check_ranks_agree(model)
        self._grid = WorkerGrid(self.world_size, self.rank, self.grad_workers, process_group)
        if self.rank == 0:
            logger.info("%s", self.assignment.summary())

        self._steps = 0
        self._step_lr = None  # the lr passed to step(), for kl_clip
        self._warned_lr_fallback = False
        self._pending_statistics: tuple[collectives.PendingCollective, float] | None = None
        self._factor_steps = 0  # factor steps so far (identical on every rank)
        self._observed_checked = False
        self._psgd_updates = 0  # PSGD Q updates so far (identical on every rank)
        self._collecting = False
        self._hooks: list = []
        if self.method is Method.KFAC:
            for layer in self._layers:
                self._hooks.append(layer.module.register_forward_hook(
                    self._make_forward_hook(layer), with_kwargs=True))
        self._update_collecting()

    # ------------------------------------------------------------------ construction
    def _make_layer(self, index, name, module, params, adapter, factor_dtype, inv_dtype, outer):
        device = params[0][1].device
        if self.method is Method.KFAC:
            weight = dict(params)["weight"]
            params = [(n, p) for n, p in params if n == "weight"] + [(n, p) for n, p in params if n == "bias"]
            state = KFACLayer(name, weight.shape, adapter.has_bias, compute_method=self.compute_method,
                              eigenvalue_outer_product=outer,
                              factor_dtype=factor_dtype or weight.dtype, inv_dtype=inv_dtype,
                              device=device, weight_transposed=adapter.weight_transposed)
        else:
            from kron_precond.methods.psgd_layer import PSGDLayer
            use_momentum, b1 = self._psgd_momentum
            state = PSGDLayer(name, [(n, p.shape) for n, p in params], device=device,
                              momentum_into_precond_update=use_momentum, b1=b1,
                              seed=self.seed, layer_index=index, **self._psgd_settings)
        return Layer(self, index, name, module, params, state, adapter)

    def _check_ranks_agree(self, model: nn.Module) -> None:
        """Fail on every rank (instead of hanging later) if ranks disagree on the setup."""
        description = ";".join(f"{l.name}:{[tuple(p.shape) for _, p in l.params]}" for l in self._layers)
        description += (f"|{self.method.value}|{self.grad_workers}|{self.compute_method.value}"
                        f"|{self.symmetry_aware}|{self._bucket_cap_bytes}|{self.colocate_factors}"
                        f"|{self.assignment_strategy.value}|{self.seed}")
        fingerprint = int(hashlib.sha256(description.encode()).hexdigest()[:15], 16)
        device = next(iter(model.parameters())).device
        with torch.no_grad():
            # Position-weighted, so permuted values do not cancel out.
            checksum = torch.zeros((), dtype=torch.float64, device=device)
            for i, p in enumerate(model.parameters()):
                flat = p.detach().double().reshape(-1)
                weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=device)
                checksum += (i + 1) * (flat * weights).sum()
        local = torch.tensor([float(fingerprint % 2**52), 0.0], dtype=torch.float64, device=device)
        local[1] = checksum
        gathered = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(gathered, local, group=self.process_group)
        fingerprints = {int(t[0].item()) for t in gathered}
        if len(fingerprints) > 1:
            raise ValueError("ranks registered different layers or use different settings: check "
                             "skip_layers, method, compute_method, grad_worker_fraction, symmetry_aware, "
                             "allreduce_bucket_cap_mb, colocate_factors, assignment_strategy and seed")
        checksums = [t[1].item() for t in gathered]
        if any(c != checksums[0] for c in checksums):
            raise ValueError(f"model parameters differ across ranks (checksums {checksums}); "
                             "initialise every rank from the same seed or broadcast the model first")

    # ------------------------------------------------------------------ hooks
    def _make_forward_hook(self, layer: Layer):
        def forward_hook(module, inputs, kwargs, output):
            if not (self._collecting and module.training and torch.is_grad_enabled()):
                return
            # The input may also come as a keyword (``linear(input=x)``).
            candidates = list(inputs[:1]) or list(kwargs.values())[:1]
            if not candidates or not isinstance(candidates[0], torch.Tensor):
                return
            if self._pending_statistics is not None:  # last reduction still owns the buffers
                self._wait_for_statistics()
            with torch.no_grad():
                layer.method.observe_activations(layer.adapter.activation_rows(candidates[0].detach()))
            if isinstance(output, torch.Tensor) and output.requires_grad:
                spatial = len(getattr(module, "kernel_size", ())) or 0
                batch = output.shape[0] if output.dim() > max(spatial + 1, 1) else 1
                scale = float(batch * self.accumulation_steps)
                output.register_hook(lambda grad: self._observe_output_grad(layer, grad, scale))
        return forward_hook

    def _observe_output_grad(self, layer: Layer, grad: torch.Tensor, scale: float) -> None:
        with torch.no_grad():
            rows = layer.adapter.output_grad_rows(grad.detach())
            loss_scale = getattr(self._grad_scaler, "_scale", None)
            if loss_scale is not None:
                rows = rows.to(layer.method.factor_dtype) / loss_scale
            layer.method.observe_output_grads(rows, scale)

    def _update_collecting(self) -> None:
        every = resolve(self.hparams["factor_update_steps"], self._steps)
        _check_hparam("factor_update_steps", every)
        self._collecting = self.method is Method.KFAC and self._steps % every == 0

    # ------------------------------------------------------------------ step
    def step(self, *, lr: float | torch.Tensor | None = None) -> None:
        """Replace ``.grad`` of every registered parameter with its preconditioned value.

        Args:
            lr: the base optimizer's current learning rate, read by ``kl_clip`` when the
                constructor was given no ``lr`` (e.g.
                ``precond.step(lr=optimizer.param_groups[0]["lr"])``).

        With AMP's ``GradScaler``, call ``scaler.unscale_(optimizer)`` first: the update
        (and ``kl_clip``) must see true gradients.
        """
        with torch.no_grad():
            self._step_lr = lr
            step = self._steps
            if self.method is Method.KFAC:
                check_health = self._kfac_statistics_and_refresh(step)
            else:
                self._psgd_refresh(step)
                check_health = step % _NONFINITE_CHECK_INTERVAL == 0
            self._apply_and_write(step)
            if check_health:
                self._report_nonfinite()
            self._steps += 1
            self._update_collecting()

    def _kfac_statistics_and_refresh(self, step: int) -> bool:
        """Fold / reduce statistics on factor steps; refresh on refresh steps (-> True)."""
        if self._collecting:
            decay = resolve(self.hparams["factor_decay"], step)
            _check_hparam("factor_decay", decay)
            self._factor_steps += 1
            if self.world_size == 1:
                for layer in self._layers:
                    layer.method.fold_statistics(decay)
            else:
                tensors = [t for layer in self._layers for t in layer.method.shared_statistics()]
                # Sums and row counts are reduced, then folded when waited on: lazily, so
                # the reduction overlaps with the rest of this step and the next ones,
                # until a refresh needs the factors or the next forward hook the buffers.
                handle = collectives.all_reduce(tensors, group=self.process_group,
                                                cap_bytes=self._bucket_cap_bytes,
                                                symmetric=self.symmetry_aware)
                self._pending_statistics = (handle, decay)
        every = resolve(self.hparams["inv_update_steps"], step)
        _check_hparam("inv_update_steps", every)
        if step % every:
            return False
        damping = resolve(self.hparams["damping"], step)
        _check_hparam("damping", damping)
        self._wait_for_statistics()
        for layer in self._layers:
            for part in FACTORS:
                if self.assignment.owner(layer.name, part) == self.rank:
                    layer.method.refresh(part, damping)
        self._share_refreshed_state()
        if self._factor_steps:
            for layer in self._layers:
                if self._holds_state(layer):
                    layer.method.finalize_refresh(damping)
        return True

    def _psgd_refresh(self, step: int) -> None:
        # Parameters without a gradient this step are left out (None), not zero-filled:
        # a zero gradient would corrupt the running average and the initial scale.
        grads = {layer.name: [p.grad for _, p in layer.params] for layer in self._layers}
        for layer in self._layers:
            layer.method.observe_gradients(grads[layer.name])
            if self._holds_state(layer):
                layer.method.initialize_from(grads[layer.name])
        if not self._decider():
            return
        precond_lr = resolve(self.hparams["precond_lr"], step)
        _check_hparam("precond_lr", precond_lr)
        for layer in self._layers:
            for part in layer.method.parts:
                if self.assignment.owner(layer.name, part) == self.rank:
                    layer.method.refresh(part, grads[layer.name], precond_lr, step=step,
                                         update_index=self._psgd_updates)
        self._psgd_updates += 1
        self._share_refreshed_state()

    def _share_refreshed_state(self) -> None:
        """Owners broadcast refreshed tensors to the gradient workers of their layers."""
        if self.world_size == 1:
            return
        by_owner: dict[int, list[torch.Tensor]] = {}
        for (name, part), owner in self.assignment.owners.items():
            layer = self.layers[name]
            if self._grid.state_group(owner) is not None and self._grid.is_grad_worker(owner):
                by_owner.setdefault(owner, []).extend(layer.method.refreshed_tensors(part))
        pending = [collectives.broadcast(tensors, src=self._grid.global_rank(owner),
                                         group=self._grid.state_group(owner),
                                         cap_bytes=self._bucket_cap_bytes)
                   for owner, tensors in sorted(by_owner.items())]
        for handle in pending:
            handle.wait()

    def _apply_and_write(self, step: int) -> None:
        communicate = self._grid.has_receivers
        outputs: dict[str, list[torch.Tensor]] = {}
        originals: dict[str, list[torch.Tensor | None]] = {}
        for layer in self._layers:
            raw = [p.grad for _, p in layer.params]
            originals[layer.name] = raw
            if all(g is None for g in raw) and not communicate:
                continue
            grads = self._grads(layer)
            if self._holds_state(layer):
                outputs[layer.name] = layer.method.apply(grads)
            else:  # receives its preconditioned gradient below
                outputs[layer.name] = [torch.empty_like(g) for g in grads]
        if communicate:
            self._receive_gradients(outputs)
        kl_clip = resolve(self.hparams["kl_clip"], step)
        scale = None
        if kl_clip is not None:
            _check_hparam("kl_clip", kl_clip)
            lr = self._kl_clip_lr(step)
            scale = self._kl_clip_scale(outputs, originals, kl_clip, lr)
        for layer in self._layers:
            new = outputs.get(layer.name)
            if new is None:
                continue
            for grad, value in zip(originals[layer.name], new):
                if grad is None:
                    continue
                if scale is not None:
                    torch.mul(value, scale, out=grad)
                else:
                    grad.copy_(value)

    def _receive_gradients(self, outputs: dict[str, list[torch.Tensor]]) -> None:
        by_source: dict[int, list[torch.Tensor]] = {}
        for layer in self._layers:
            source = self._grid.gradient_source(self._layer_owner(layer))
            by_source.setdefault(source, []).extend(outputs[layer.name])
        pending = [collectives.broadcast(tensors, src=self._grid.global_rank(source),
                                         group=self._grid.row_group, cap_bytes=self._bucket_cap_bytes)
                   for source, tensors in sorted(by_source.items())]
        for handle in pending:
            handle.wait()

    def _kl_clip_lr(self, step: int):
        lr = resolve(self.hparams["lr"], step)
        if lr is None and self._step_lr is not None:
            # An optimizer's lr, which warm-up schedules start at 0: then ν = 1 (no clip).
            lr = self._step_lr
            if isinstance(lr, torch.Tensor):  # a tensor lr (capturable optimizers): no host sync
                return lr
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
                raise ValueError(f"step(lr=...) must be a finite number >= 0, got {lr!r}")
            return lr
        if lr is None:
            if not self._warned_lr_fallback:
                self._warned_lr_fallback = True
                warnings.warn(f"kron_precond: kl_clip needs the learning rate but none was given; using "
                              f"lr={_LR_FALLBACK}. Pass lr= to KronPreconditioner, call "
                              "step(lr=optimizer.param_groups[0]['lr']), or use PreconditionedOptimizer",
                              UserWarning, stacklevel=4)
            return _LR_FALLBACK
        _check_hparam("lr", lr)
        return lr

    def _kl_clip_scale(self, outputs, originals, kl_clip: float, lr: float) -> torch.Tensor | None:
        total = None
        for layer in self._layers:
            new = outputs.get(layer.name)
            if new is None:
                continue
            for grad, value in zip(originals[layer.name], new):
                if grad is not None:
                    term = (value * grad).sum(dtype=torch.promote_types(grad.dtype, torch.float32))
                    total = term if total is None else total + term
        if total is None:
            return None
        # min(1, sqrt(κ / |lr² Σ⟨V, ∇⟩|)); a zero sum gives inf, clamped to 1.
        return torch.sqrt(kl_clip / (total * lr**2).abs()).clamp(max=1.0)

    def _grads(self, layer: Layer) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in layer.params]

    def _layer_owner(self, layer: Layer) -> int:
        return self.assignment.owner(layer.name, layer.method.parts[0])

    def _holds_state(self, layer: Layer) -> bool:
        return self._grid.is_grad_worker(self._layer_owner(layer))

    def _wait_for_statistics(self) -> None:
        if self._pending_statistics is not None:
            handle, decay = self._pending_statistics
            self._pending_statistics = None
            handle.wait()
            for layer in self._layers:
                layer.method.fold_statistics(decay)

    def _report_nonfinite(self) -> None:
        """Warn about skipped non-finite updates and, once, about registered layers that
        were never observed (one host sync, on refresh steps / every 100 PSGD steps)."""
        flags = [layer.method.nonfinite for layer in self._layers]
        check_observed = self.method is Method.KFAC and self._factor_steps and not self._observed_checked
        if check_observed:
            flags += [layer.method.observed().to(torch.int64) for layer in self._layers]
        values = torch.stack(flags).tolist()
        for layer, count in zip(self._layers, values):
            if count:
                warnings.warn(f"kron_precond: skipped {count} non-finite update(s) of {layer.name}; "
                              "its state was left unchanged", RuntimeWarning, stacklevel=3)
                layer.method.nonfinite.zero_()
        if check_observed:
            self._observed_checked = True
            unseen = [l.name for l, seen in zip(self._layers, values[len(self._layers):]) if not seen]
            if unseen:
                warnings.warn(f"kron_precond: layers {unseen} are registered but their hooks saw no data "
                              "before the first refresh (is the module called functionally?); until "
                              "they do, their gradients pass through unpreconditioned",
                              RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ public helpers
    @property
    def steps(self) -> int:
        """Number of completed :meth:`step` calls."""
        return self._steps

    def memory_usage(self) -> dict[str, int]:
        """Bytes of preconditioner state held on this rank, by kind of state."""
        usage: dict[str, int] = {}
        for layer in self._layers:
            for kind, size in layer.method.memory_by_kind().items():
                usage[kind] = usage.get(kind, 0) + size
        return usage

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume, on any number of ranks.

        With ``grad_worker_fraction < 1`` this is a collective (each layer's state comes
        from its owner): call it on every rank.
        """
        self._wait_for_statistics()
        layers = {}
        for layer in self._layers:
            layers[layer.name] = self._layer_state(layer)
        return {"steps": self._steps, "method": self.method.value, "decider": self._decider.state_dict(),
                "factor_steps": self._factor_steps, "psgd_updates": self._psgd_updates, "layers": layers}

    def _layer_state(self, layer: Layer) -> dict[str, Any]:
        holds = self._holds_state(layer)
        if self.grad_workers == self.world_size:
            return layer.method.state_dict()
        # Only the owner's column holds this layer: its owner sends the whole state
        # (tensors and flags), moved to the CPU so it unpickles on any device.
        state = [_to_cpu(layer.method.state_dict()) if holds else None]
        owner = self._grid.global_rank(self._layer_owner(layer))
        dist.broadcast_object_list(state, src=owner, group=self.process_group)
        return state[0]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (saved with any number of ranks)."""
        if state.get("method") != self.method.value:
            raise ValueError(f"state_dict is for method={state.get('method')!r}, "
                             f"this preconditioner uses {self.method.value!r}")
        missing = set(self.layers) - set(state["layers"])
        if missing:
            raise ValueError(f"state_dict has no state for layers {sorted(missing)}")
        for layer in self._layers:  # all checks first: a rejected state changes nothing
            layer.method.check_state(state["layers"][layer.name])
        self._wait_for_statistics()
        self._steps = int(state["steps"])
        self._factor_steps = int(state.get("factor_steps", 0))
        self._psgd_updates = int(state.get("psgd_updates", 0))
        self._decider.load_state_dict(state["decider"])
        for layer in self._layers:
            layer.method.load_state_dict(state["layers"][layer.name])
            if not self._holds_state(layer):
                layer.method.release_refreshed()
        self._update_collecting()

    def remove(self) -> None:
        """Remove the hooks; the preconditioner no longer observes the model."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __enter__(self) -> "KronPreconditioner":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        settings = {k: (getattr(v, "__name__", "<callable>") if callable(v) else v)
                    for k, v in self.hparams.items()}
        if self.method is Method.KFAC:
            settings.pop("precond_lr")
            settings.update(compute_method=self.compute_method.value,
                            accumulation_steps=self.accumulation_steps)
        else:
            for key in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay"):
                settings.pop(key)
            settings.update({k: v for k, v in self._psgd_settings.items()})
        settings.update(world_size=self.world_size, grad_workers=self.grad_workers,
                        assignment_strategy=self.assignment_strategy.value,
                        colocate_factors=self.colocate_factors, symmetry_aware=self.symmetry_aware,
                        allreduce_bucket_cap_mb=self._bucket_cap_bytes / 2**20)
        body = ",\n".join(f"  {k}={v!r}" for k, v in settings.items())
        return (f"KronPreconditioner(method={self.method.value!r}, layers={len(self._layers)}, "
                f"steps={self._steps},\n{body}\n)")


def _unwrap(model: nn.Module) -> nn.Module:
    """The module inside DDP / ``torch.compile`` wrappers, so that layer names (and so
    checkpoints) are the same with and without them."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


# ---------------------------------------------------------------------- validation
_POSITIVE_INT = ("factor_update_steps", "inv_update_steps")


def _check_hparam(name: str, value) -> None:
    if name in _POSITIVE_INT:
        _check_int(name, value)
        return
    if name == "kl_clip" and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if name == "factor_decay":
        if not 0.0 < value <= 1.0:
            raise ValueError(f"factor_decay must be in (0, 1], got {value!r}")
    elif value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _is_float_dtype(value) -> bool:
    return isinstance(value, torch.dtype) and value.is_floating_point


_KFAC_ONLY = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay",
              "accumulation_steps", "compute_method", "compute_eigenvalue_outer_product",
              "factor_dtype", "inv_dtype", "grad_scaler", "symmetry_aware")
_PSGD_ONLY = ("preconditioner_update_probability", "max_size_triangular", "min_ndim_triangular",
              "memory_save_mode", "momentum_into_precond_update", "precond_b1", "precond_lr",
              "precond_init_scale", "precond_dtype", "merge_dims", "seed")


def _warn_inapplicable(arguments: dict[str, Any]) -> None:
    """Warn about settings given a non-default value that the chosen method ignores."""
    import inspect

    try:
        method = Method.parse(arguments["method"], "method")
    except ValueError:
        return  # reported by the constructor
    ignored = _PSGD_ONLY if method is Method.KFAC else _KFAC_ONLY
    defaults = inspect.signature(KronPreconditioner.__init__).parameters
    changed = [name for name in ignored if arguments[name] is not defaults[name].default
               and arguments[name] != defaults[name].default]
    if changed:
        warnings.warn(f"{', '.join(changed)} do(es) not apply to method={method.value!r} and "
                      "will be ignored", UserWarning, stacklevel=3)


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


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
    workers = world_size * fraction
    if abs(workers - round(workers)) > 1e-9 or round(workers) < 1 or world_size % round(workers):
        raise ValueError(f"grad_worker_fraction={fraction!r} gives {workers:g} gradient workers, "
                         f"which does not divide the world size {world_size}")
    return int(round(workers))
