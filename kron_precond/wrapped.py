"""PreconditionedOptimizer: a base optimizer and a KronPreconditioner behind one ``step()``.

Trainer frameworks (Hugging Face ``Trainer``, PyTorch Lightning, Accelerate) call
``optimizer.step()``, ``optimizer.zero_grad()`` and ``optimizer.state_dict()`` and hand
``optimizer.param_groups`` to learning-rate schedulers; they never call a second object's
``step()``. This class is that one object: its ``step()`` rewrites the gradients with the
preconditioner, then steps the base optimizer. It owns no parameter groups of its own —
``param_groups``, ``state`` and ``defaults`` are the base optimizer's, so a scheduler built
on the wrapper changes the base optimizer's learning rate.
"""
from __future__ import annotations

import inspect
import operator
import warnings
from collections import OrderedDict
from typing import Any, Callable

import torch

from kron_precond.capture import AbandonedIterations
from kron_precond.checkpoint import called_by_torchs_state_dict_api, stepped_by_torchs_state_dict_api
from kron_precond.modules import user_stacklevel
from kron_precond.preconditioner import KronPreconditioner

_FORMAT = "kron_precond.PreconditionedOptimizer"
_FORMAT_VERSION = 1


class PreconditionedOptimizer(torch.optim.Optimizer):
    """``optimizer.step()`` = ``preconditioner.step()`` then ``base.step()``.

    Example::

        base = torch.optim.AdamW(model.parameters(), lr=3e-4)
        precond = KronPreconditioner(model, method="kfac", accumulation_steps=4)
        optimizer = PreconditionedOptimizer(base, precond)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)  # drives base's lr

    Args:
        optimizer: the base ``torch.optim.Optimizer`` that applies the update.
        preconditioner: a :class:`KronPreconditioner` built on the model whose
            parameters ``optimizer`` steps. Its ``accumulation_steps`` must equal the
            number of backward passes (micro-batches) per ``step()``.

    K-FAC's ``kl_clip`` reads, at every step (so it follows schedulers), the learning rate of
    the param groups that step the preconditioned layers (the largest, if they differ), unless
    the preconditioner was given its own ``lr``.

    ``state_dict()`` holds the base optimizer's state in torch's usual layout
    (``"state"``, ``"param_groups"``) plus the preconditioner's under
    ``"preconditioner"``; ``load_state_dict`` restores both or, if either part is
    rejected, neither. Under DDP with MEM_OPT / HYBRID_OPT ``state_dict()`` is a collective
    that every rank must call: a trainer that saves on rank 0 only (the Hugging Face
    ``Trainer``) needs ``grad_worker_fraction=COMM_OPT`` (see :meth:`state_dict`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, preconditioner: KronPreconditioner) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, PreconditionedOptimizer):
            raise TypeError("optimizer is already a PreconditionedOptimizer; wrap its base optimizer instead")
        if not isinstance(preconditioner, KronPreconditioner):
            raise TypeError(f"preconditioner must be a KronPreconditioner, got {type(preconditioner).__name__}")
        if _needs_closure(optimizer):
            raise TypeError(f"optimizer {type(optimizer).__name__} needs a closure in step(), which it calls several "
                            "times per step (a line search); the gradients preconditioned once before it cannot "
                            "follow those calls. Use an optimizer that steps from the gradients it is given")
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        # a frozen one need not be stepped (the layer passes through while it is frozen)
        missing = [f"{layer.name}.{name}" for layer in preconditioner.layers.values()
                   for name, p in layer.params if id(p) not in stepped and p.requires_grad]
        if missing:
            raise ValueError(f"preconditioner registers parameters that optimizer does not step: {missing}; "
                             "build both on the same model (or skip_layers= those modules)")
        self.optimizer = optimizer
        self.preconditioner = preconditioner
        # a GradScaler's skip never reaches step() (scaler.step calls nothing on an overflow;
        # zero_grad then drops the abandoned iteration's statistics): no second read of it there
        preconditioner._scaler_read_by_caller = True
        self._iterations = AbandonedIterations(  # see zero_grad
            lambda: [p for layer in preconditioner.layers.values() for _, p in layer.params])
        self._checked_rebinding = False  # see _check_rebinding
        # the base optimizer's state torch's state-dict API had it create (see step); None: none
        self._placeholder_state: Any = None
        self._lr_of_layers = KlClipLr(preconditioner)
        # What torch.optim.Optimizer.__init__ sets up, minus parameter groups of our own.
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()  # step pre/post hooks and the profiler label

    # The base optimizer's, looked up on every access: its load_state_dict replaces
    # the group dicts, and a scheduler must keep seeing the live ones.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer, "preconditioner": self.preconditioner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        type(self).__init__(self, state["optimizer"], state["preconditioner"])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Precondition the gradients, then step the base optimizer.

        ``closure`` (as torch.optim) recomputes the loss and its gradients; it is called
        once, before preconditioning, and its result is returned. The base optimizer is
        stepped without it, so the closure's forward/backward never runs twice.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.optimizer.state and stepped_by_torchs_state_dict_api():
            # torch's call that only creates the state entries (lr 0, zero gradients): the base
            # optimizer makes them, for the template; the preconditioner does not step
            self.optimizer.step()
            self._placeholder_state = self.optimizer.state
            return loss
        if self._placeholder_state is not None:
            # entries no load replaced (a load puts a new state dict in place) are placeholders:
            # dropped, so the base optimizer's first step is a fresh one (its moments, buffers,
            # counts, whatever the zero-gradient step left in them)
            if self.optimizer.state is self._placeholder_state:
                self.optimizer.state.clear()
            self._placeholder_state = None
        if not self._checked_rebinding:
            self._check_rebinding()
        self.preconditioner.step(lr=self._kl_clip_lr())
        self.optimizer.step()
        self._iterations.stepped()
        return loss

    def _kl_clip_lr(self) -> float | torch.Tensor | None:
        """The lr ``kl_clip`` reads (:class:`KlClipLr`)."""
        return self._lr_of_layers(self.param_groups)

    def _check_rebinding(self) -> None:
        """At the first step: a model sharded since construction (``fully_shard`` after this was
        built) has new parameters, which the preconditioner takes
        (:meth:`KronPreconditioner._bind_to_model`). The base optimizer must step them too --
        Accelerate's ``prepare()`` re-maps its param groups so -- or it would update nothing (the
        parameters it holds get no gradient any more): ``RuntimeError`` then, before anything
        changes. Once (ids only, no host sync)."""
        precond = self.preconditioner
        with torch.no_grad():
            precond._bind_before_first_step()
        if precond._adopted_sharding:
            stepped = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
            stale = [layer for layer in precond.layers.values() if any(id(p) not in stepped for _, p in layer.params)]
            if stale:
                names = ", ".join(repr(layer.name) for layer in stale[:4]) + (", ..." if len(stale) > 4 else "")
                raise RuntimeError(
                    f"PreconditionedOptimizer: fully_shard(model) replaced the parameters of module(s) {names} after "
                    f"the optimizer was built, and the base optimizer ({type(self.optimizer).__name__}) still steps "
                    f"the old ones, which get no gradient any more: it would not update the model. Nothing was "
                    f"changed. Build the base optimizer after fully_shard(model) (the KronPreconditioner may be "
                    f"built before it), or let the trainer re-map its param groups to the sharded parameters "
                    f"(Accelerate's prepare() does)")
        self._checked_rebinding = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's ``zero_grad`` (every parameter it steps). If a backward wrote
        gradients since the last ``zero_grad`` and no ``step()`` came (a ``GradScaler`` skipped
        it: ``scaler.step(optimizer)`` calls nothing on an overflow), that iteration was
        abandoned: its statistics are dropped, so they do not enter the next step's factors. A
        second ``zero_grad`` with no backward in between (after the forward, say) drops nothing.
        A loop that resets gradients otherwise (the HF ``Trainer``'s ``model.zero_grad()``)
        calls ``preconditioner.discard_statistics()`` itself after a skipped step (docs/API.md)."""
        if self._iterations.abandoned():
            self.preconditioner.discard_statistics()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._iterations.zeroed()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the base optimizer (its parameters are stepped, not preconditioned)."""
        self.optimizer.add_param_group(param_group)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict with the preconditioner's under ``"preconditioner"``.

        With ``grad_worker_fraction < 1`` (MEM_OPT, HYBRID_OPT; not sharded) no rank holds every
        layer's state and this is a collective (``gather_state_dict()``): call it on every rank.
        A rank that calls it alone -- a trainer that saves on rank 0 only, as the Hugging Face
        ``Trainer`` does -- raises ``RuntimeError`` (naming COMM_OPT) after waiting
        ``kron_precond.distributed.runtime.GATHER_ENTRY_TIMEOUT`` seconds (120) for the others,
        instead of hanging. With COMM_OPT it is local and safe on rank 0 only.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = dict(self.optimizer.state_dict())
        precond = self.preconditioner
        precond._bind_before_first_step()  # a model sharded since construction: its layout decides below
        # with grad_worker_fraction < 1 each rank holds some layers' refreshed state: assembled
        # on every rank (the same test on every rank, so every rank joins the collective); a rank
        # left alone there (a save on rank 0 only) raises after a bounded wait instead of hanging
        some_workers = precond._runtime.sharding is None and precond.grad_workers < precond.world_size
        state["preconditioner"] = (precond._gathered_state("PreconditionedOptimizer.state_dict()") if some_workers
                                   else precond.state_dict())
        state["format"] = _FORMAT
        state["format_version"] = _FORMAT_VERSION
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            if result is not None:
                state = result
        if called_by_torchs_state_dict_api():
            warnings.warn("PreconditionedOptimizer.state_dict() was called by torch.distributed.checkpoint's "
                          "state-dict API (get_state_dict / get_optimizer_state_dict; Accelerate's FSDP "
                          "checkpoints), which keeps only 'state' and 'param_groups': the preconditioner is not "
                          "in what it returns. Save optimizer.preconditioner as an entry of its own "
                          "(dcp.save({..., 'precond': optimizer.preconditioner})) and pass optimizer.optimizer, "
                          "the base optimizer, to get_state_dict / set_state_dict", UserWarning, stacklevel=2)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output: both parts, or — if either raises — neither."""
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or "preconditioner" not in state_dict:
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"state_dict has no 'preconditioner' entry (got {keys}); it was not saved by "
                             "PreconditionedOptimizer.state_dict() (torch.distributed.checkpoint's set_state_dict: "
                             "pass optimizer.optimizer, the base optimizer, and load optimizer.preconditioner "
                             "as an entry of its own)")
        saved_format = state_dict.get("format", _FORMAT)
        if saved_format != _FORMAT:
            raise ValueError(f"state_dict has format={saved_format!r}; PreconditionedOptimizer reads {_FORMAT!r}")
        version = state_dict.get("format_version", _FORMAT_VERSION)
        try:  # an integer of any kind (NumPy's, a 0-dim tensor), not a bool
            number = None if isinstance(version, bool) else operator.index(version)
        except TypeError:
            number = None
        if number is None or number > _FORMAT_VERSION:
            raise ValueError(f"state_dict has format_version={version!r}; this version of kron_precond "
                             f"reads an integer up to {_FORMAT_VERSION}")
        base = {k: v for k, v in state_dict.items()
                if k not in ("preconditioner", "format", "format_version")}
        # The base optimizer first; the preconditioner last: its load checks everything before it
        # changes anything, so it never needs rolling back (a reload would drop the statistics
        # gathered since the last step).
        # torch.optim's load puts new state and group objects in place and leaves the old ones
        # as they were: a rollback puts those back (the same objects, as torch's own failed
        # load keeps them; no copy of the whole state)
        before = (self.optimizer.state, self.optimizer.param_groups)
        try:
            self.optimizer.load_state_dict(base)
            self.preconditioner.load_state_dict(state_dict["preconditioner"])
        except Exception:
            self.optimizer.state, self.optimizer.param_groups = before
            raise
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __repr__(self) -> str:
        inner = "\n".join("  " + line for line in repr(self.optimizer).splitlines())
        return f"{type(self).__name__}(\n{inner},\n  preconditioner={str(self.preconditioner.method)!r} " \
               f"with {len(self.preconditioner.layers)} layers\n)"


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.step`` has a ``closure`` argument without a default (``torch.optim.LBFGS``)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: take it as torch.optim's
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


class KlClipLr:
    """The lr ``kl_clip`` reads from an optimizer's param groups: that of the groups stepping
    the preconditioner's layers (group 0 may hold only other parameters: an embedding, a
    head or the biases at an lr of their own). Layers spread over groups of different lrs
    take the largest (the strongest clip), said once: the clip is one bound on the step of all
    layers. Which groups hold them is found again only when the groups change (a load,
    ``add_param_group``): no per-parameter walk a step, and no host read of a tensor lr."""

    def __init__(self, preconditioner: KronPreconditioner) -> None:
        self._preconditioner = preconditioner
        self._held: tuple[tuple, list[int]] | None = None
        self._warned = False

    def __call__(self, groups: list[dict[str, Any]]) -> float | torch.Tensor | None:
        precond = self._preconditioner
        if precond._lr is not None or precond._kl_clip is None:
            return None  # kl_clip reads the lr given at construction, or is off: nothing to pick
        key = (len(groups), *(id(g) for g in groups))
        if self._held is None or self._held[0] != key:
            registered = {id(p) for layer in self._preconditioner.layers.values() for _, p in layer.params}
            held = [i for i, g in enumerate(groups) if any(id(p) in registered for p in g["params"])]
            self._held = (key, held or [0])
        lrs = [groups[i]["lr"] for i in self._held[1]]
        if len(lrs) == 1:
            return lrs[0]
        tensors = [lr for lr in lrs if isinstance(lr, torch.Tensor)]
        if tensors:  # the largest, on the tensors' device: no host read
            device = tensors[0].device
            return torch.stack([torch.as_tensor(lr, dtype=torch.float64, device=device).reshape(())
                                for lr in lrs]).max()
        if len(set(lrs)) > 1 and not self._warned:
            self._warned = True
            warnings.warn(f"kron_precond: kl_clip takes one lr, and the preconditioned layers are stepped at lrs "
                          f"{sorted(set(lrs))} (param groups {self._held[1]}): it uses the largest, which clips "
                          f"the most", UserWarning, stacklevel=user_stacklevel())
        return max(lrs)
