"""torchtitan: a preconditioner in front of torchtitan's optimizers, chosen in its config.

torchtitan builds its optimizers from ``Trainer.Config.optimizer`` (an
``OptimizersContainer.Config``) after the model is parallelised, and saves the container in
its DCP checkpoints. :class:`KronOptimizersContainer` is that container with a
:class:`~kron_precond.KronPreconditioner` on the model: its ``step()`` preconditions the
gradients (after torchtitan's gradient clipping), then steps the optimizers; its state dict
carries the preconditioner's state under ``"kron_precond"``. No torchtitan file changes.

A second container, :class:`WhitenedMuonOptimizersContainer`, replaces the stock optimizers by one
:class:`~kron_precond.WhitenedMuon` built from the model (its AdamW groups take the parameters it
does not whiten; every parameter keeps the lr and weight decay of the stock param group that
claims it, and an AdamW-half parameter its betas and eps too)::

      torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports 'kron_precond.integrations.torchtitan.whitened_muon_optimizers={"lr": 0.02,
            "skip_layers": ["lm_head"]}'

Two ways in for the preconditioner:

* on any stock config, torchtitan's override mechanism (``@override`` swaps the optimizer
  config node; ``derive`` keeps every field the stock config set)::

      torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_8b \\
        --override.imports 'kron_precond.integrations.torchtitan.kron_optimizers={"method": "kfac",
            "skip_layers": ["lm_head"], "grad_worker_fraction": "mem_opt", "damping": 0.003}'

  (one shell token; the JSON object holds ``method``, ``skip_layers`` and
  ``accumulation_steps``, and every other key is a :class:`~kron_precond.KronPreconditioner`
  option; the stock config keeps its ``param_groups`` and ``implementation``);
* in a config function of one's own: ``config.optimizer = KronOptimizersContainer.Config(
  param_groups=..., method="kfac", options={"damping": 3e-3})``.

Scope: one model part per rank (no pipeline parallelism) whose parameters are plain, FSDP2
(``Shard(0)``) or HSDP sharded -- the layouts :class:`~kron_precond.KronPreconditioner`
accepts; it refuses tensor-parallel placements at construction.

This module imports torchtitan; ``import kron_precond`` never does.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import derive, override

from kron_precond import validation
from kron_precond.enums import strategy_by_name
from kron_precond.methods import registry
from kron_precond.preconditioner import KronPreconditioner
from kron_precond.whitened_muon import WhitenedMuon
from kron_precond.wrapped import KlClipLr

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
        # accumulation_steps counts every rank's micro-batches here (torchtitan's loss is over the
        # global batch): this container checks it at the first step (_check_accumulation), the
        # preconditioner's own check, which counts one rank's forwards, would misread it
        self.preconditioner._forwards_checked = True
        self._lr_of_layers = KlClipLr(self.preconditioner)
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
        # kl_clip's lr: that of the groups stepping the preconditioned layers (KlClipLr)
        self.preconditioner.step(lr=self._lr_of_layers([g for o in self.optimizers for g in o.param_groups]))
        super().step()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        owner = self.preconditioner
        # DCP asks every rank: where no rank holds every layer of an unsharded model (MEM_OPT,
        # HYBRID_OPT), assemble the state (a collective every rank joins); else each rank's own
        gathers = owner._runtime.sharding is None and owner.grad_workers < owner.world_size
        precond = owner.gather_state_dict() if gathers else owner.state_dict()
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
    _refuse_objects("kron_optimizers", options)
    # KronPreconditioner's own keywords and every registered method's options (a setting of
    # another method warns when the preconditioner is built, as KronPreconditioner does)
    known = (_keywords(KronPreconditioner.__init__, "method", "skip_layers", "accumulation_steps")
             | {name for spec in registry.all_specs() for name in spec.options})
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"kron_optimizers: {unknown} are not KronPreconditioner options (nor fields of "
                         f"KronOptimizersContainer.Config)")
    return derive(cfg, KronOptimizersContainer.Config, method=method, skip_layers=_patterns(skip_layers),
                  accumulation_steps=accumulation_steps, options=dict(options))


# Keywords whose values are Python objects, which an --override.imports JSON cannot hold.
_OBJECT_KEYWORDS = ("process_group", "grad_scaler")


def _refuse_objects(factory: str, options: dict[str, Any]) -> None:
    given = [key for key in _OBJECT_KEYWORDS if key in options]
    if given:
        raise ValueError(f"{factory}: {given} take Python objects, not config values: leave them out (the "
                         "default process group; torchtitan scales no loss)")


def _keywords(function, *fields: str) -> set[str]:
    """``function``'s named keywords, less ``self``, the first positional one and ``fields``."""
    parameters = list(inspect.signature(function).parameters.values())[2:]
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - set(fields)


def _patterns(skip_layers) -> list[str]:
    """One regex or several, as ``KronPreconditioner(skip_layers=...)`` takes them."""
    if isinstance(skip_layers, str):
        return [skip_layers]
    if isinstance(skip_layers, (list, tuple)):
        return list(skip_layers)
    raise TypeError(f"skip_layers must be a regex or a list of regexes (module names / class names), "
                    f"got {skip_layers!r}")


class WhitenedMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` holding one :class:`~kron_precond.WhitenedMuon` built
    from the model part: the layers it whitens, and AdamW groups for every other parameter.

    Each parameter keeps the settings of the stock param group that claims it (torchtitan's
    rule: the first ``pattern`` that matches its name): a whitened weight that group's ``lr``
    and ``weight_decay``; a parameter of the AdamW half its ``lr``, ``betas``, ``eps`` and
    ``weight_decay`` -- what the group leaves out is torch's default for its optimizer, as
    torchtitan would have run it. WhitenedMuon's param groups are split so: one whitened and
    one AdamW group per stock group that has such parameters (one stock group: the usual two).
    A keyword set in ``options`` overrides its setting in every group of its half: ``lr`` and
    ``weight_decay`` the whitened groups, ``adamw_lr``, ``adamw_betas``, ``adamw_eps`` and
    ``adamw_weight_decay`` the AdamW groups. A stock setting neither half can honour raises
    ``ValueError`` naming the group, unless the keyword it would feed is set: an Adam group's
    non-zero ``weight_decay`` (an L2 term in the gradient, where WhitenedMuon decays weights
    decoupled, as AdamW), a group of another optimizer (``DistMuon``), ``amsgrad`` or
    ``maximize``, a key torch's optimizer does not take. The switches that change no number
    (``fused``, ``foreach``, ``capturable``, ``differentiable``) are ignored. No stock groups at
    all: WhitenedMuon's own defaults.

    Checkpoints are torchtitan's own FQN-keyed optimizer state (the param groups carry
    ``param_names``): a DCP checkpoint resumes on another number of ranks.

    torchtitan divides each rank's summed token loss by the tokens of the global batch, where
    DDP's loss is each rank's own mean: the container tells the optimizer, so that the output
    side's factors keep one process's scale at every world size (the whiteners do not depend on
    it; a running average resumed on another number of ranks does).
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
        model = model_parts[0]
        stock = _StockGroups(config.param_groups, model) if config.param_groups else None
        if stock is not None:
            # the constructor's defaults (for groups added later): a value every stock group agrees on
            for keys in _HALVES.values():
                for setting, keyword in keys.items():
                    if keyword not in options:
                        agreed = stock.agreed(setting)
                        if agreed is not None:
                            options[keyword] = agreed
        self.model_parts = model_parts
        optimizer = WhitenedMuon(model, skip_layers=_patterns(config.skip_layers), **options)
        # torchtitan divides each rank's summed token loss by the tokens of the global batch: the
        # output side's factors keep one process's scale, also into a run on another number of ranks
        optimizer._statistics.loss_over_all_ranks = True
        if stock is not None:
            stock.split(optimizer, config.options)
        for group in optimizer.param_groups:  # as torchtitan's checkpoints spell them
            group["param_names"] = [canonical_fqn(name) for name in group["param_names"]]
        self.optimizers = [optimizer]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._validate_params(params)
        self._post_init(params)


# The settings of each half of WhitenedMuon that a stock group gives, and the keyword of each.
_HALVES: dict[str, dict[str, str]] = {
    "whitened_muon": {"lr": "lr", "weight_decay": "weight_decay"},
    "adamw": {"lr": "adamw_lr", "betas": "adamw_betas", "eps": "adamw_eps", "weight_decay": "adamw_weight_decay"},
}
_STOCK_OPTIMIZERS = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}


class _StockGroups:
    """The stock config's param groups over the model: which one claims each parameter (as
    torchtitan assigns them), and the settings each gives, checked; ``ValueError`` for a
    parameter no group claims (torchtitan's container refuses it too) and a group that matches
    none (torchtitan: "matched no parameters")."""

    def __init__(self, configs: list[ParamGroupConfig], model: nn.Module) -> None:
        built, _ = OptimizersContainer._build_param_groups(model, configs, {})
        seen: dict[str, int] = {}
        self.owner: dict[int, int] = {}
        for index, cfg in enumerate(configs):  # _build_param_groups lists them by optimizer, in order
            group = built[cfg.optimizer_name][seen.get(cfg.optimizer_name, 0)]
            seen[cfg.optimizer_name] = seen.get(cfg.optimizer_name, 0) + 1
            for p in group["params"]:
                self.owner[id(p)] = index
        unclaimed = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in self.owner]
        if unclaimed:
            raise ValueError(f"whitened_muon_optimizers: no stock param group's pattern claims these trainable "
                             f"parameters: {unclaimed} (patterns: {[c.pattern for c in configs]})")
        self.settings = [self._settings(index, cfg) for index, cfg in enumerate(configs)]

    @staticmethod
    def where(index: int, cfg: ParamGroupConfig) -> str:
        return f"param_groups[{index}] ({cfg.optimizer_name}, pattern {cfg.pattern!r})"

    def _settings(self, index: int, cfg: ParamGroupConfig) -> dict[str, Any]:
        """lr, betas, eps, weight_decay as torch's optimizer runs the group (its defaults for what
        the group leaves out), checked; a setting WhitenedMuon cannot honour maps to the reason."""
        where = self.where(index, cfg)
        optimizer = _STOCK_OPTIMIZERS.get(cfg.optimizer_name)
        if optimizer is None:
            reason = (f"{where} is a {cfg.optimizer_name} group, whose settings WhitenedMuon does not read "
                      f"(Adam and AdamW groups only)")
            return {key: _Refused(reason) for key in ("lr", "betas", "eps", "weight_decay")}
        kwargs = dict(cfg.optimizer_kwargs)
        defaults = {name: p.default for name, p in inspect.signature(optimizer).parameters.items()
                    if p.default is not p.empty}
        unknown = sorted(key for key in kwargs if key not in defaults)  # fused, foreach, ... are known: ignored
        if unknown:
            raise ValueError(f"whitened_muon_optimizers: {where} sets {unknown}, which torch.optim."
                             f"{cfg.optimizer_name} does not take and WhitenedMuon cannot honour")
        on = sorted(key for key in ("amsgrad", "maximize") if kwargs.get(key))
        if on:
            raise ValueError(f"whitened_muon_optimizers: {where} sets {on}, which WhitenedMuon's AdamW half "
                             f"does not have")
        settings: dict[str, Any] = {key: kwargs.get(key, defaults[key]) for key in ("lr", "betas", "eps",
                                                                                    "weight_decay")}
        settings["lr"] = validation.check_positive(f"{where} lr", settings["lr"])
        settings["eps"] = validation.check_positive(f"{where} eps", settings["eps"])
        settings["weight_decay"] = validation.check_non_negative(f"{where} weight_decay", settings["weight_decay"])
        try:
            beta1, beta2 = settings["betas"]
        except (TypeError, ValueError):
            raise TypeError(f"{where} betas must be a pair of floats, got {settings['betas']!r}") from None
        settings["betas"] = tuple(validation.check_unit_interval(f"{where} betas[{i}]", beta, low_open=False,
                                                                 high_open=True)
                                  for i, beta in enumerate((beta1, beta2)))
        decoupled = kwargs.get("decoupled_weight_decay", cfg.optimizer_name == "AdamW")
        if not decoupled and settings["weight_decay"] != 0:
            settings["weight_decay"] = _Refused(
                f"{where} has weight_decay={settings['weight_decay']!r}, an L2 term added to the gradient "
                f"({cfg.optimizer_name} without decoupled weight decay), which WhitenedMuon does not have (its "
                f"weight decay is decoupled, as AdamW's)")
        return settings

    def agreed(self, setting: str) -> Any:
        """The value every stock group gives ``setting`` (``None`` if they differ or one cannot)."""
        values = [s[setting] for s in self.settings]
        if any(isinstance(v, _Refused) for v in values) or any(v != values[0] for v in values):
            return None
        return values[0]

    def split(self, optimizer: WhitenedMuon, explicit: dict[str, Any]) -> None:
        """``optimizer``'s groups split by stock group (in the model's order within each), each
        with the settings of its stock group, unless set in ``explicit``."""
        groups = []
        for group in optimizer.param_groups:
            half = group["algorithm"]
            parts: dict[int, list[tuple[str, nn.Parameter]]] = {}
            for name, p in zip(group["param_names"], group["params"]):
                parts.setdefault(self.owner[id(p)], []).append((name, p))
            for index in sorted(parts):
                settings = {}
                for setting, keyword in _HALVES[half].items():
                    value = group[setting] if keyword in explicit else self.settings[index][setting]
                    if isinstance(value, _Refused):
                        held = "whitened weights" if half == "whitened_muon" else "AdamW-half parameters"
                        raise ValueError(f"whitened_muon_optimizers: {value.reason}: set {keyword} explicitly "
                                         f"(for its {held} {[name for name, _ in parts[index]]})")
                    settings[setting] = value
                kept = {k: v for k, v in group.items() if k not in ("params", "param_names")}
                groups.append({**kept, **settings, "params": parts[index]})
        optimizer.param_groups.clear()
        for group in groups:
            optimizer.add_param_group(group)


@dataclass(frozen=True)
class _Refused:
    """A stock setting WhitenedMuon cannot honour, and why."""

    reason: str


@override(target=OptimizersContainer.Config,
          description="kron_precond: WhitenedMuon (Muon in K-FAC's input-whitened norm) as the one optimizer")
def whitened_muon_optimizers(cfg: OptimizersContainer.Config, *,
                             skip_layers: list[str] | tuple[str, ...] = (),
                             **options: Any) -> WhitenedMuonOptimizersContainer.Config:
    """The ``--override.imports`` entry: the matched optimizer config replaced by one
    :class:`~kron_precond.WhitenedMuon`, each parameter in a group with its stock param group's
    settings (:class:`WhitenedMuonOptimizersContainer`). Keywords: ``skip_layers`` and any
    :class:`~kron_precond.WhitenedMuon` keyword but ``process_group`` and ``grad_scaler`` (Python
    objects); one given overrides the stock groups' setting it names in every group of its half."""
    _refuse_objects("whitened_muon_optimizers", options)
    unknown = sorted(set(options) - _keywords(WhitenedMuon.__init__, "skip_layers"))
    if unknown:
        raise ValueError(f"whitened_muon_optimizers: {unknown} are not WhitenedMuon keywords")
    return derive(cfg, WhitenedMuonOptimizersContainer.Config, skip_layers=_patterns(skip_layers),
                  options=dict(options))
