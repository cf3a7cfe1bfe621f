"""torchtitan: a preconditioner in front of torchtitan's optimizers, chosen in its config.

torchtitan builds its optimizers from ``Trainer.Config.optimizer`` (an
``OptimizersContainer.Config``) after the model is parallelised, and saves the container in
its DCP checkpoints. :class:`KronOptimizersContainer` is that container with a
:class:`~kron_precond.KronPreconditioner` on the model: its ``step()`` preconditions the
gradients (after torchtitan's gradient clipping), then steps the optimizers; its state dict
carries the preconditioner's state under ``"kron_precond"``. No torchtitan file changes.

A second container, :class:`WhitenedMuonOptimizersContainer`, replaces the stock optimizers by one
:class:`~kron_precond.WhitenedMuon` built from the model (its AdamW groups take the parameters it
does not whiten, with the stock AdamW group's settings)::

      torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports 'kron_precond.integrations.torchtitan.whitened_muon_optimizers={"lr": 0.02,
            "skip_layers": ["lm_head"]}'

Two ways in for the preconditioner:

* on any stock config, torchtitan's override mechanism (``@override`` swaps the optimizer
  config node; ``derive`` keeps every field the stock config set)::

      torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports 'kron_precond.integrations.torchtitan.kron_optimizers={"method": "kfac",
            "skip_layers": ["lm_head"], "grad_worker_fraction": "mem_opt", "damping": 0.003}'

  (one shell token; the JSON object holds :class:`KronOptimizersContainer.Config`'s fields,
  and every other key is a :class:`~kron_precond.KronPreconditioner` option);
* in a config function of one's own: ``config.optimizer = KronOptimizersContainer.Config(
  param_groups=..., method="kfac", options={"damping": 3e-3})``.

Scope: one model part per rank (no pipeline parallelism) whose parameters are plain, FSDP2
(``Shard(0)``) or HSDP sharded -- the layouts :class:`~kron_precond.KronPreconditioner`
accepts; it refuses tensor-parallel placements at construction.

This module imports torchtitan; ``import kron_precond`` never does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import derive, override

from kron_precond.enums import strategy_by_name
from kron_precond.methods import registry
from kron_precond.preconditioner import KronPreconditioner
from kron_precond.whitened_muon import WhitenedMuon

STATE_KEY = "kron_precond"

__all__ = ["KronOptimizersContainer", "kron_optimizers", "WhitenedMuonOptimizersContainer",
           "whitened_muon_optimizers", "STATE_KEY"]


class KronOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` with a :class:`~kron_precond.KronPreconditioner`.

    ``step()`` = ``preconditioner.step(lr=<lr of the first parameter group>)``, then every
    optimizer's step. ``state_dict()`` is the container's flat optimizer state plus the
    preconditioner's :meth:`~kron_precond.KronPreconditioner.state_dict` under
    :data:`STATE_KEY`: under FSDP2 each rank saves the layer state it holds, and a DCP
    checkpoint resumes on another number of ranks.

    ``accumulation_steps`` -- torchtitan divides each micro-batch's summed loss by the
    number of tokens in the *global* batch, so one rank's micro-batch weighs
    ``1 / (ranks x gradient-accumulation steps)`` of the step's mean loss; K-FAC's output
    gradients are rescaled by that count, which is
    ``training.global_batch_size // training.local_batch_size``. ``None`` takes the world
    size (torchtitan's default ``global_batch_size``, no gradient accumulation). Methods
    that capture statistics check it on the first step against the micro-batches the model
    actually ran and raise ``ValueError`` with the value to set if they differ.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        method: str = "kfac"
        """Preconditioner method: any registered method name, as KronPreconditioner's
        ``method`` ("kfac", "psgd", "ekfac", "shampoo", "ikfac", "second_moment", "soap")."""

        skip_layers: list[str] = field(default_factory=list)
        """Regexes of module names / class names to leave alone (e.g. "lm_head")."""

        accumulation_steps: int | None = None
        """Micro-batches the step's mean loss is spread over, across all ranks:
        training.global_batch_size // training.local_batch_size. None: the world size."""

        options: dict[str, Any] = field(default_factory=dict)
        """Every other KronPreconditioner keyword (damping, factor_update_steps,
        grad_worker_fraction as "comm_opt" / "hybrid_opt" / "mem_opt" or a float, ...)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        if len(model_parts) != 1:
            raise ValueError(f"KronOptimizersContainer takes one model part per rank, got {len(model_parts)} "
                             "(pipeline parallelism is not supported)")
        spec = registry.get(config.method)
        options = dict(config.options)
        fields = sorted({"method", "skip_layers", "accumulation_steps"} & set(options))
        if fields:
            raise ValueError(f"options={config.options!r}: {fields} are fields of the optimizer config, "
                             "not options; set them there")
        if "grad_worker_fraction" in options:
            options["grad_worker_fraction"] = strategy_by_name(options["grad_worker_fraction"])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if spec.captures:
            given = config.accumulation_steps
            options["accumulation_steps"] = world if given is None else given
        elif config.accumulation_steps is not None:
            raise ValueError(f"accumulation_steps={config.accumulation_steps!r} does not apply to "
                             f"method={config.method!r} (it only rescales captured statistics)")
        self.preconditioner = KronPreconditioner(model_parts[0], method=config.method,
                                                 skip_layers=_patterns(config.skip_layers), **options)
        # Micro-batches of the first step, counted to check accumulation_steps once; the hook
        # is removed at the first step, so later steps pay nothing.
        self._micro_batches = 0
        self._counter = (model_parts[0].register_forward_pre_hook(self._count_micro_batch)
                         if spec.captures else None)

    def _count_micro_batch(self, module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled():
            self._micro_batches += 1

    def _check_accumulation(self) -> None:
        assert self._counter is not None
        self._counter.remove()
        self._counter = None
        precond = self.preconditioner
        seen = self._micro_batches * precond.world_size
        if seen != precond.accumulation_steps:
            raise ValueError(
                f"accumulation_steps={precond.accumulation_steps} but the first step ran {self._micro_batches} "
                f"micro-batch(es) on each of {precond.world_size} rank(s): set the optimizer config's "
                f"accumulation_steps to {seen} (training.global_batch_size // training.local_batch_size)")

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Precondition every registered layer's ``.grad``, then step every optimizer."""
        if closure is not None:
            raise ValueError("KronOptimizersContainer does not support closures")
        if self._counter is not None:
            self._check_accumulation()
        self.preconditioner.step(lr=self.optimizers[0].param_groups[0]["lr"])
        super().step()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        precond = self.preconditioner.state_dict()
        # Layer names as torchtitan's checkpoints spell module names (without activation-
        # checkpoint and compile wrappers), so a resumed run may wrap differently.
        precond["layers"] = {canonical_fqn(name): value for name, value in precond["layers"].items()}
        state[STATE_KEY] = precond
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if STATE_KEY not in state_dict:
            raise ValueError(f"the optimizer checkpoint has no {STATE_KEY!r} entry: it was not saved by "
                             "KronOptimizersContainer")
        state = dict(state_dict)
        precond_state = dict(state.pop(STATE_KEY))
        names = {canonical_fqn(name): name for name in self.preconditioner.layers}
        precond_state["layers"] = {names.get(key, key): value for key, value in precond_state["layers"].items()}
        # the preconditioner checks everything before changing anything: load it first
        self.preconditioner.load_state_dict(precond_state)
        super().load_state_dict(state)


@override(target=OptimizersContainer.Config,
          description="kron_precond: a Kronecker-factored preconditioner before the optimizers' step")
def kron_optimizers(cfg: OptimizersContainer.Config, *, method: str = "kfac",
                    skip_layers: list[str] | tuple[str, ...] = (), accumulation_steps: int | None = None,
                    **options: Any) -> KronOptimizersContainer.Config:
    """The ``--override.imports`` entry: the matched optimizer config with its parameter
    groups and implementation kept, and a preconditioner added. Keywords: the
    :class:`KronOptimizersContainer.Config` fields; any other keyword is a
    :class:`~kron_precond.KronPreconditioner` option."""
    registry.get(method)  # an unknown method fails here, before anything is built
    return derive(cfg, KronOptimizersContainer.Config, method=method, skip_layers=_patterns(skip_layers),
                  accumulation_steps=accumulation_steps, options=dict(options))


def _patterns(skip_layers) -> list[str]:
    """One regex or several, as ``KronPreconditioner(skip_layers=...)`` takes them."""
    return [skip_layers] if isinstance(skip_layers, str) else list(skip_layers)


class WhitenedMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` holding one :class:`~kron_precond.WhitenedMuon` built
    from the model part: the layers it whitens, and AdamW groups for every other parameter.

    The AdamW groups take the stock config's AdamW (or Adam) group settings (``lr``, ``betas``,
    ``eps``, ``weight_decay``) unless ``options`` sets ``adamw_*``; ``lr`` and ``weight_decay``
    of the whitened layers default to the same values. Checkpoints are torchtitan's own
    FQN-keyed optimizer state (the param groups carry ``param_names``): a DCP checkpoint
    resumes on another number of ranks.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        skip_layers: list[str] = field(default_factory=list)
        """Regexes of module names / class names not to whiten (their parameters go to AdamW)."""

        options: dict[str, Any] = field(default_factory=dict)
        """Every other WhitenedMuon keyword (lr, momentum, statistics_every, damping, ...);
        ``ns_dtype`` as a name ("bfloat16", "float32")."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if len(model_parts) != 1:
            raise ValueError(f"WhitenedMuonOptimizersContainer takes one model part per rank, got "
                             f"{len(model_parts)} (pipeline parallelism is not supported)")
        options = dict(config.options)
        if "skip_layers" in options:
            raise ValueError(f"options={config.options!r}: skip_layers is a field of the optimizer config")
        if isinstance(options.get("ns_dtype"), str):
            name = options["ns_dtype"]
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"ns_dtype={name!r} is not a torch dtype name")
            options["ns_dtype"] = dtype
        stock: dict[str, Any] = next((g.optimizer_kwargs for g in config.param_groups
                                      if g.optimizer_name in ("AdamW", "Adam")), {})
        for key, adamw_key in (("lr", "adamw_lr"), ("betas", "adamw_betas"), ("eps", "adamw_eps"),
                               ("weight_decay", "adamw_weight_decay")):
            if key in stock:
                options.setdefault(adamw_key, tuple(stock[key]) if key == "betas" else stock[key])
        for key in ("lr", "weight_decay"):
            if key in stock:
                options.setdefault(key, stock[key])
        self.model_parts = model_parts
        optimizer = WhitenedMuon(model_parts[0], skip_layers=_patterns(config.skip_layers), **options)
        for group in optimizer.param_groups:  # as torchtitan's checkpoints spell them
            group["param_names"] = [canonical_fqn(name) for name in group["param_names"]]
        self.optimizers = [optimizer]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._validate_params(params)
        self._post_init(params)


@override(target=OptimizersContainer.Config,
          description="kron_precond: WhitenedMuon (Muon in K-FAC's input-whitened norm) as the one optimizer")
def whitened_muon_optimizers(cfg: OptimizersContainer.Config, *,
                             skip_layers: list[str] | tuple[str, ...] = (),
                             **options: Any) -> WhitenedMuonOptimizersContainer.Config:
    """The ``--override.imports`` entry: the matched optimizer config replaced by one
    :class:`~kron_precond.WhitenedMuon` (the stock groups' AdamW settings kept for its AdamW
    half). Keywords: ``skip_layers`` and any :class:`~kron_precond.WhitenedMuon` keyword."""
    unknown = sorted(set(options) - set(WhitenedMuon.__init__.__code__.co_varnames[2:]))
    if unknown:
        raise ValueError(f"whitened_muon_optimizers: {unknown} are not WhitenedMuon keywords")
    return derive(cfg, WhitenedMuonOptimizersContainer.Config, skip_layers=_patterns(skip_layers),
                  options=dict(options))
