"""Pieces shared by the examples and the benchmarks.

- ``init_distributed``: torchrun-aware process-group set-up (gloo on CPU, nccl on CUDA);
- ``METHODS`` / ``build_method``: one place that turns a method name into the optimizer
  and (optional) ``KronPreconditioner`` the examples compare;
- ``train_step``: the canonical loop (``backward -> precond.step -> optimizer.step``),
  with gradient accumulation and AMP;
- ``state_memory_bytes``, ``StepTimer``: what the result tables report.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from expert_muon import ExpertMuon
from kron_precond import Kron, KronPreconditioner, WhitenedMuon
from kron_precond.experts import is_transformers_experts
from kron_precond.modules import KFACAdapter, TransposedLinearAdapter, kfac_adapter


# --------------------------------------------------------------------------- distributed
@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when there is one, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def init_distributed(device_name: str) -> DistContext:
    """Join the process group torchrun describes in the environment, if any.

    Without ``WORLD_SIZE`` (a plain ``python`` launch) this is a single process.
    """
    device = resolve_device(device_name)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext(rank=0, world_size=1, device=device)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def close_distributed(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()
        dist.destroy_process_group()


def wrap_ddp(model: nn.Module, ctx: DistContext) -> nn.Module:
    """DDP-wrap for multi-process runs; a single process keeps the bare module."""
    if not ctx.enabled:
        return model
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def unwrap(model: nn.Module) -> nn.Module:
    """The module DDP wraps (what the preconditioner registers hooks on)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def all_reduce_mean(value: float, ctx: DistContext) -> float:
    if not ctx.enabled:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor)
    return tensor.item() / ctx.world_size


# --------------------------------------------------------------------------- methods
@dataclass(frozen=True)
class MethodSpec:
    """How one compared method is built: a base optimizer, maybe a preconditioner."""

    label: str
    base: str  # "adamw" | "sgd" | "muon" | "muon_kron" | "kron" (the library's PSGD optimizer)
    precond: str | None  # None | "kfac" | "psgd" | "ekfac" | "shampoo" | "ikfac" | "ikfac2" | "second_moment" | "soap"


METHODS: dict[str, MethodSpec] = {
    "adamw": MethodSpec("AdamW", base="adamw", precond=None),
    "kfac": MethodSpec("K-FAC + AdamW", base="adamw", precond="kfac"),
    "psgd": MethodSpec("PSGD (Kron optimizer)", base="kron", precond=None),
    "psgd_adamw": MethodSpec("PSGD precond + AdamW", base="adamw", precond="psgd"),
    "sgd": MethodSpec("SGD", base="sgd", precond=None),
    "kfac_sgd": MethodSpec("K-FAC + SGD", base="sgd", precond="kfac"),
    "psgd_sgd": MethodSpec("PSGD precond + SGD", base="sgd", precond="psgd"),
    "muon": MethodSpec("Muon (hidden 2-D weights) + AdamW (rest)", base="muon", precond=None),
    "muon_kron": MethodSpec("Muon (hidden 2-D weights) + PSGD Kron (rest)", base="muon_kron", precond=None),
    "kfac_muon_kron": MethodSpec("K-FAC + Muon (hidden) + PSGD Kron (rest)", base="muon_kron", precond="kfac"),
    "kfac_muon": MethodSpec("K-FAC + Muon", base="muon", precond="kfac"),
    "psgd_muon": MethodSpec("PSGD precond + Muon", base="muon", precond="psgd"),
    "ekfac": MethodSpec("EK-FAC + AdamW", base="adamw", precond="ekfac"),
    "ekfac_muon": MethodSpec("EK-FAC + Muon", base="muon", precond="ekfac"),
    "shampoo": MethodSpec("Shampoo (grafted) + AdamW", base="adamw", precond="shampoo"),
    # Cheap curvature in front of Muon.
    "ikfac_muon": MethodSpec("input-side K-FAC (A only) + Muon", base="muon", precond="ikfac"),
    "muon2": MethodSpec("elementwise second moment + Muon (Muon²)", base="muon", precond="second_moment"),
    "ikfac_muon2": MethodSpec("input-side K-FAC, then second moment + Muon", base="muon", precond="ikfac2"),
    "soap_muon": MethodSpec("SOAP-style eigenbasis second moment + Muon", base="muon", precond="soap"),
    # Muon's steepest descent in ||ΔW A^{1/2}||_op (kron_precond.WhitenedMuon), and its pre-only control.
    "wmuon": MethodSpec("Muon in the input-whitened norm", base="wmuon", precond=None),
    "wmuon_pre": MethodSpec("Muon after input whitening (pre only)", base="wmuon_pre", precond=None),
}


@dataclass
class PrecondConfig:
    """The preconditioner knobs the examples expose (the rest keep library defaults)."""

    skip_layers: Sequence[str] = ()
    # Modules Muon leaves to AdamW (default: ``skip_layers``); set apart so that a variant can
    # precondition a layer (e.g. lm_head) without handing it to Muon.
    muon_exclude: Sequence[str] | None = None
    # torch.optim.Muon's momentum for Muon and every method in front of it. 0.9, not torch's
    # 0.95: on the main job 0.9 reaches AdamW's loss 3-9 % sooner and ends lower on 3 of 3
    # seeds (benchmarks/results/lab_notebook.md, "Muon's momentum"); a sweep variant (mom=) may change it.
    muon_momentum: float = 0.9
    # (start, steps): Muon's momentum rises linearly from start to muon_momentum over the
    # first `steps` optimizer steps (modded-nanogpt's warm-up, 0.85 -> 0.95 over 300 there).
    muon_momentum_warmup: tuple[float, int] | None = None
    # The peak lr of the other half of a Muon split (AdamW on embeddings, head, norms, biases);
    # None: the same lr as the hidden weights (torch.optim.Muon's match_rms_adamw convention).
    muon_rest_lr: float | None = None
    # torch.optim.Muon's adjust_lr_fn, for Muon and WhitenedMuon alike: "match_rms_adamw" (one lr
    # on AdamW's scale for both halves) or "original" (torch's default: lr on Muon's spectral
    # scale; then set muon_rest_lr for the AdamW half)
    muon_adjust_lr_fn: str = "match_rms_adamw"
    # Precondition Muon's (Nesterov) momentum instead of the raw gradient: the momentum is
    # kept outside Muon (run at momentum 0) and rewritten by the preconditioner before
    # Newton-Schulz, the order of modded-nanogpt's SOAP + Muon record and of kron_torch.
    precond_momentum: bool = False
    factor_update_steps: int = 10
    inv_update_steps: int = 100
    damping: float = 3e-3
    kl_clip: float | None = 1e-3
    # PSGD (the Kron optimizer and method="psgd"):
    update_probability: float | Callable[[int], float] | None = None  # None: annealed default
    # method="psgd" in front of another optimizer (psgd_muon, ...): "same" takes update_probability.
    precond_update_probability: float | Callable[[int], float] | None | str = "same"
    psgd_init_scale: float | None = 1.0  # None: estimated from the first gradient
    accumulation_steps: int = 1
    psgd_precond_lr: float | Callable[[int], float] = 0.1
    psgd_update: str = "eq"  # how PSGD fits Q: "eq" (triangular) or "procrustes"
    # PSGD factor shapes: dims above this get a diagonal factor; "one_diag" etc. (None: library's)
    psgd_max_size_triangular: int | None = None
    psgd_memory_save_mode: str | None = None
    # K-FAC extras (library defaults unless a sweep variant sets them):
    factor_decay: float = 0.95
    compute_method: str = "eigen"  # "eigen" (exact damping) or "inverse" (half the apply's matmuls)
    statistics_rows: int | None = None  # rows per module call in K-FAC's statistics (None: all)
    # K-FAC sides wider than this keep a diagonal factor (None: the library's default, 8192)
    kfac_max_size: int | None = None
    # K-FAC's update rescaled per layer to its gradient's norm (the library's grafting=)
    kfac_grafting: bool = False
    # Fraction of the run after which the preconditioner is removed (its hooks too) and the
    # base optimizer sees the raw gradients: curvature early, the base optimizer alone late.
    precond_until: float = 1.0
    # Input-side K-FAC (method="ikfac"): statistics and refresh every ikfac_every steps,
    # damping relative to tr(A)/dim, its own decay and row cap.
    ikfac_every: int = 32
    ikfac_damping: float = 0.2
    ikfac_factor_decay: float = 0.95
    ikfac_statistics_rows: int | None = None
    # Elementwise second moment (second_moment, and ikfac2 after the inverse; soap's, in its
    # eigenbasis): its decay β.
    moment_decay: float = 0.95
    # SOAP-style (method="soap"): statistics every soap_statistics_every steps, bases by a
    # warm-started QR step every soap_every steps, sides wider than soap_max_size one-sided.
    soap_statistics_every: int = 1
    soap_every: int = 10
    soap_factor_decay: float = 0.95
    soap_max_size: int = 4096
    # Input-whitened Muon (wmuon, wmuon_pre): statistics / refresh interval, relative damping.
    wmuon_every: int = 5
    wmuon_damping: float = 0.1
    wmuon_output_damping: float | None = None  # the output side's factors' damping (None: wmuon_damping)
    # WhitenedMuon's output_side: "auto" (the library's default: the first layers of ungated MLPs),
    # "wide" (every weight whose output is wider than its input), True (every weight), False (none)
    wmuon_both_sides: bool | str = "auto"
    wmuon_center_inputs: bool | tuple[str, ...] | None = None  # centred input factors (None: the library default)
    # WhitenedMuon's fused_qkv: None (the library default: a fused query/key/value projection of a
    # known layout, GPT-2's c_attn, stepped as three matrices), False (orthogonalised whole) or regexes
    wmuon_fused_qkv: bool | tuple[str, ...] | None = None
    wmuon_statistics_rows: int | None = 1024
    wmuon_root: str = "cholesky"
    wmuon_block_size: int | None = None
    wmuon_factor_decay: float = 0.8  # per refresh: the factors' exponential-average decay
    wmuon_ns_coefficients: str = "muon"  # or "polar_express"
    # the Newton-Schulz dtype: torch.optim.Muon's "bfloat16", to compare like for like, or "float32"
    wmuon_ns_dtype: str = "bfloat16"

    @property
    def muon_excluded(self) -> Sequence[str]:
        """The modules Muon (and WhitenedMuon) leave to AdamW: ``muon_exclude``, else ``skip_layers``."""
        return self.skip_layers if self.muon_exclude is None else self.muon_exclude


class OptimizerChain(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped as one.

    ``param_groups`` lists the children's group dicts themselves, so an LR scheduler or a
    GradScaler acting on the chain acts on every child (as ``torch.optim`` users expect
    of one optimizer). Used for the usual Muon split: Muon on hidden 2-D weights, AdamW
    on the rest."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        self.defaults = {}
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        # torch.optim.Optimizer bookkeeping that schedulers and hooks look for.
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}
        self._zero_grad_profile_name = "Optimizer.zero_grad#OptimizerChain.zero_grad"

    @property
    def state(self) -> dict:  # type: ignore[override]
        merged = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # as torch.optim: the closure runs backward
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        for opt, sd in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(sd)


def _matches(name: str, module: nn.Module, patterns: Sequence[str]) -> bool:
    """``skip_layers`` semantics: a pattern names a module class or occurs in the module name."""
    return any(type(module).__name__ == p or p in name for p in patterns)


def _linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` or GPT-2's ``Conv1D``, as the library's module adapters read them."""
    return type(kfac_adapter(module)[0]) in (KFACAdapter, TransposedLinearAdapter)


def muon_modules(model: nn.Module, exclude: Sequence[str]) -> list[nn.Module]:
    """The Linear-like modules (``nn.Linear``, GPT-2's ``Conv1D``) whose weights Muon takes:
    those not matched by ``exclude`` (e.g. ``("Embedding", "lm_head")``, like ``skip_layers``)."""
    return [m for name, m in model.named_modules() if _linear_like(m) and not _matches(name, m, exclude)]


def muon_transposed(model: nn.Module, exclude: Sequence[str]) -> list[nn.Parameter]:
    """The weights of :func:`muon_modules` stored ``[in, out]`` (GPT-2's ``Conv1D``). Muon's
    ``msign`` and ``match_rms_adamw`` treat them as their transposes; torch's ``"original"``
    factor and NorMuon's per-neuron rows do not."""
    return [m.weight for m in muon_modules(model, exclude) if kfac_adapter(m)[0].weight_transposed]


def attention_weights(model: nn.Module, exclude: Sequence[str] = ()) -> list[nn.Parameter]:
    """The projection weights ``nn.MultiheadAttention`` holds itself (the packed ``in_proj_weight``,
    or ``q/k/v_proj_weight``) of the modules ``exclude`` does not match: 2-D hidden weights,
    Muon's as a ``torch.optim.Muon`` user passes them (its ``out_proj`` is an ``nn.Linear``)."""
    names = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
    return [w for name, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)
            and not _matches(name, m, exclude) for w in (getattr(m, n) for n in names) if w is not None]


def expert_weights(model: nn.Module, exclude: Sequence[str] = ()) -> list[nn.Parameter]:
    """The 3-D weights of transformers' fused experts modules not matched by ``exclude``,
    held ``[experts, out, in]`` (as ``MixtralExperts`` holds them; a transposed layout is
    refused: Muon's lr factor reads the shape)."""
    weights = []
    for name, module in model.named_modules():
        if is_transformers_experts(module) and not _matches(name, module, exclude):
            if module.is_transposed:
                raise ValueError(f"{name}: experts stored [experts, in, out] are not supported by ExpertMuon")
            weights += [p for p in module.parameters(recurse=False) if p.dim() == 3]
    return weights


def muon_param_split(model: nn.Module, exclude: Sequence[str]) -> tuple[list, list, list]:
    """(hidden 2-D weights, fused expert weights, everything else): the usual Muon split.

    Muon takes the weights of :func:`muon_modules` and :func:`attention_weights` and, expert by
    expert, those of :func:`expert_weights`; embeddings, the output layer, norms, biases and routers go to AdamW."""
    hidden_ids = {id(m.weight) for m in muon_modules(model, exclude)}
    hidden_ids |= {id(w) for w in attention_weights(model, exclude)}
    experts = expert_weights(model, exclude)
    taken = hidden_ids | {id(p) for p in experts}
    hidden = [p for p in model.parameters() if id(p) in hidden_ids]
    rest = [p for p in model.parameters() if id(p) not in taken]
    return hidden, experts, rest


def build_muon(model: nn.Module, lr: float, weight_decay: float, exclude: Sequence[str],
               rest_optimizer: str = "adamw", psgd: PrecondConfig | None = None) -> OptimizerChain:
    """``torch.optim.Muon`` on hidden 2-D weights + ``rest_optimizer`` (AdamW, or the library's
    ``Kron``) on the rest, one peak ``lr``. ``psgd`` also carries Muon's momentum
    (``muon_momentum``) and its warm-up.

    ``adjust_lr_fn="match_rms_adamw"`` (``psgd.muon_adjust_lr_fn``'s default) scales Muon's
    orthogonalised update to AdamW's typical RMS, so one learning rate (and one schedule)
    serves both halves; ``Kron``'s update has AdamW's scale too (its best lr alone equals
    AdamW's)."""
    hidden, experts, rest = muon_param_split(model, exclude)
    config = psgd or PrecondConfig()
    if config.muon_adjust_lr_fn == "original" and muon_transposed(model, exclude):
        # torch's "original" factor sqrt(max(1, rows / cols)) reads the stored shape, which a
        # Conv1D holds transposed ([in, out]): its weights would be scaled as their transposes
        raise ValueError("muon_adjust_lr_fn='original' scales a Conv1D weight by its stored [in, out] shape; "
                         "use 'match_rms_adamw' (symmetric in the two) for models with Conv1D layers")
    muon = torch.optim.Muon(hidden, lr=lr, weight_decay=weight_decay, momentum=config.muon_momentum,
                            adjust_lr_fn=config.muon_adjust_lr_fn)
    if psgd is not None and psgd.muon_momentum_warmup is not None:
        warm_muon_momentum(muon, *psgd.muon_momentum_warmup, end=config.muon_momentum)
    rest_lr = lr if psgd is None or psgd.muon_rest_lr is None else psgd.muon_rest_lr
    chain = [muon, build_optimizer(rest_optimizer, rest, rest_lr, weight_decay, psgd)]
    if experts:
        expert_muon = ExpertMuon(experts, lr=lr, weight_decay=weight_decay, momentum=config.muon_momentum,
                                 adjust_lr_fn=config.muon_adjust_lr_fn)
        if psgd is not None and psgd.muon_momentum_warmup is not None:
            warm_muon_momentum(expert_muon, *psgd.muon_momentum_warmup, end=config.muon_momentum)
        chain.append(expert_muon)
    return OptimizerChain(chain)


_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_whitened_muon(model: nn.Module, lr: float, weight_decay: float, exclude: Sequence[str],
                        config: PrecondConfig, post: bool, optimizer_class: Callable | None = None,
                        grad_scaler: torch.amp.GradScaler | None = None) -> WhitenedMuon:
    """``kron_precond.WhitenedMuon(model)``: one optimizer, the Linear units ``exclude`` leaves
    (``skip_layers``) whitened, AdamW on the rest. ``post=False`` is the whitening-before-only
    control (``examples/whitened_muon_pre.py``); ``optimizer_class`` builds a variant (a
    benchmark's subclass) with the same settings. ``grad_scaler``: the float16 AMP scaler, whose
    scale the output side's statistics divide out."""
    settings = dict(momentum=config.muon_momentum, statistics_every=config.wmuon_every,
                    damping=config.wmuon_damping, output_damping=config.wmuon_output_damping,
                    statistics_rows=config.wmuon_statistics_rows,
                    output_side=config.wmuon_both_sides, center_inputs=config.wmuon_center_inputs,
                    root=config.wmuon_root,
                    block_size=config.wmuon_block_size, factor_decay=config.wmuon_factor_decay,
                    skip_layers=list(exclude), adamw_lr=config.muon_rest_lr, adjust_lr_fn=config.muon_adjust_lr_fn,
                    ns_coefficients=config.wmuon_ns_coefficients,
                    # torch.optim.Muon's bfloat16 iteration on every device unless asked otherwise, so
                    # that the examples compare the two like for like (the library's default takes
                    # float32 on a CPU without bfloat16 kernels, where bfloat16 is far slower)
                    ns_dtype=_NS_DTYPES[config.wmuon_ns_dtype],
                    grad_scaler=grad_scaler)  # a disabled scaler reads as none
    # None is the library's default: left out, so that an optimizer_class passing its own fused_qkv
    # (benchmarks/whitening_levers.py's input_fused_whole) keeps it
    if config.wmuon_fused_qkv is not None:
        settings["fused_qkv"] = config.wmuon_fused_qkv
    if optimizer_class is not None:
        return optimizer_class(model, lr, weight_decay, **settings)
    if post:
        return WhitenedMuon(model, lr, weight_decay, **settings)
    from whitened_muon_pre import PreWhitenedMuon
    return PreWhitenedMuon(model, lr, weight_decay, **settings)


def warm_muon_momentum(muon: torch.optim.Optimizer, start: float, steps: int, end: float) -> None:
    """Raise ``muon``'s momentum linearly from ``start`` to ``end`` over its first ``steps``
    steps (a step pre-hook, so every training loop gets it).

    Early in training the gradient norm falls by 10-30x within ~50 steps; a momentum of
    0.95 keeps those first large gradients in the buffer long after they stopped pointing
    anywhere useful (benchmarks/results/lab_notebook.md, "Muon's momentum"). The step count lives in the
    hook, not in the optimizer's state: a run resumed from a checkpoint restarts the warm-up."""
    calls = [0]

    def set_momentum(optimizer, args, kwargs) -> None:
        fraction = min(1.0, calls[0] / steps) if steps > 0 else 1.0
        for group in optimizer.param_groups:
            group["momentum"] = start + (end - start) * fraction
        calls[0] += 1

    muon.register_step_pre_hook(set_momentum)


def _psgd_update_option(config: PrecondConfig) -> dict:
    """``precond_update`` only when it is not the default, so that the examples also run
    against a library without the (opt-in) Procrustes rule."""
    return {} if config.psgd_update == "eq" else {"precond_update": config.psgd_update}


def build_optimizer(
    name: str,
    params: Iterable[nn.Parameter],
    lr: float,
    weight_decay: float,
    psgd: PrecondConfig | None = None,
) -> torch.optim.Optimizer:
    """``psgd`` holds the PSGD settings of the ``kron`` optimizer (default: library defaults)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "kron":
        psgd = psgd or PrecondConfig()
        return Kron(
            params, lr=lr, weight_decay=weight_decay,
            preconditioner_update_probability=psgd.update_probability,
            precond_init_scale=psgd.psgd_init_scale,
            **_psgd_update_option(psgd),
            **({} if callable(psgd.psgd_precond_lr) else {"precond_lr": psgd.psgd_precond_lr}),
        )
    raise ValueError(f"unknown base optimizer {name!r}")


def build_preconditioner(
    kind: str,
    model: nn.Module,
    lr: float | None,
    config: PrecondConfig,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> KronPreconditioner:
    """``model``: the bare module (``unwrap`` a DDP model first). ``lr``: the learning rate
    K-FAC's and EK-FAC's ``kl_clip`` reads, for a loop without a schedule; None for a loop that
    passes the optimizer's current lr to ``step(lr=...)`` (:func:`train_step`), so that the clip
    follows the schedule. ``grad_scaler``: the AMP scaler, whose scale K-FAC divides out of the
    output gradients its hooks capture."""
    if grad_scaler is not None and not grad_scaler.is_enabled():
        grad_scaler = None
    if kind == "kfac":
        return KronPreconditioner(
            model,
            method="kfac",
            skip_layers=list(config.skip_layers),
            factor_update_steps=config.factor_update_steps,
            inv_update_steps=config.inv_update_steps,
            damping=config.damping,
            factor_decay=config.factor_decay,
            compute_method=config.compute_method,
            statistics_rows=config.statistics_rows,
            **({} if config.kfac_max_size is None else {"max_factor_size": config.kfac_max_size}),
            grafting=config.kfac_grafting,
            kl_clip=config.kl_clip,
            lr=lr,  # only read by kl_clip; None: the lr given to step()
            accumulation_steps=config.accumulation_steps,
            grad_scaler=grad_scaler,
        )
    if kind == "ekfac":  # K-FAC's settings; the scaling is re-estimated on every statistics step
        return KronPreconditioner(
            model, method="ekfac", skip_layers=list(config.skip_layers),
            factor_update_steps=config.factor_update_steps, inv_update_steps=config.inv_update_steps,
            damping=config.damping, factor_decay=config.factor_decay, kl_clip=config.kl_clip, lr=lr,
            statistics_rows=config.statistics_rows,
            accumulation_steps=config.accumulation_steps, grad_scaler=grad_scaler)
    if kind == "shampoo":  # statistics every step, roots refreshed with K-FAC's interval, grafted
        return KronPreconditioner(
            model, method="shampoo", skip_layers=list(config.skip_layers),
            inv_update_steps=max(1, config.inv_update_steps // 10), grafting=True)
    if kind in ("ikfac", "ikfac2"):  # ikfac2: the second moment stacked after the inverse
        return KronPreconditioner(
            model, method="ikfac", skip_layers=list(config.skip_layers),
            factor_update_steps=config.ikfac_every, inv_update_steps=config.ikfac_every,
            damping=config.ikfac_damping, factor_decay=config.ikfac_factor_decay,
            statistics_rows=config.ikfac_statistics_rows,
            moment_decay=config.moment_decay if kind == "ikfac2" else None,
            accumulation_steps=config.accumulation_steps)
    if kind == "second_moment":
        return KronPreconditioner(model, method="second_moment", skip_layers=list(config.skip_layers),
                                  moment_decay=config.moment_decay)
    if kind == "soap":
        return KronPreconditioner(model, method="soap", skip_layers=list(config.skip_layers),
                                  factor_update_steps=config.soap_statistics_every, inv_update_steps=config.soap_every,
                                  factor_decay=config.soap_factor_decay, moment_decay=config.moment_decay,
                                  max_factor_size=config.soap_max_size)
    if kind == "psgd":
        return KronPreconditioner(
            model,
            method="psgd",
            skip_layers=list(config.skip_layers),
            preconditioner_update_probability=(config.update_probability
                                               if config.precond_update_probability == "same"
                                               else config.precond_update_probability),
            precond_init_scale=config.psgd_init_scale,
            precond_lr=config.psgd_precond_lr,
            **_psgd_update_option(config),
            **({} if config.psgd_max_size_triangular is None
               else {"max_size_triangular": config.psgd_max_size_triangular}),
            **({} if config.psgd_memory_save_mode is None else {"memory_save_mode": config.psgd_memory_save_mode}),
        )  # PSGD reads only the (accumulated) gradient: no accumulation setting
    raise ValueError(f"unknown preconditioner {kind!r}")


def build_method(
    method: str,
    model: nn.Module,
    lr: float,
    weight_decay: float,
    config: PrecondConfig,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> tuple[torch.optim.Optimizer, KronPreconditioner | None]:
    """Optimizer and preconditioner for ``method`` (a key of ``METHODS``)."""
    spec = METHODS[method]
    bare = unwrap(model)
    exclude = config.muon_excluded  # Muon's split
    if spec.base in ("wmuon", "wmuon_pre"):
        optimizer = build_whitened_muon(bare, lr, weight_decay, exclude, config, post=spec.base == "wmuon",
                                        grad_scaler=grad_scaler)
    elif spec.base in ("muon", "muon_kron"):
        rest = "kron" if spec.base == "muon_kron" else "adamw"
        optimizer = build_muon(bare, lr, weight_decay, exclude, rest, config)
    else:
        optimizer = build_optimizer(spec.base, bare.parameters(), lr, weight_decay, config)
    precond = None
    if spec.precond:
        # lr None: kl_clip reads the scheduled lr train_step passes to step(), not the peak
        precond = build_preconditioner(spec.precond, bare, None, config, grad_scaler)
    if config.precond_momentum:
        precond = _momentum_first(spec, optimizer, precond, config)
    return optimizer, precond


class MomentumFirst:
    """A preconditioner whose ``step()`` first folds the gradients of Muon's parameters into
    a Nesterov momentum (torch.optim.Muon's own rule, ``buf.lerp_(g, 1 - mu)`` then
    ``g.lerp(buf, mu)``) and writes it into ``.grad``, so the preconditioner rewrites the
    momentum and Muon (built with momentum 0) orthogonalises the result. Everything else
    is the wrapped preconditioner's."""

    def __init__(self, precond: KronPreconditioner, params: Sequence[nn.Parameter], momentum: float):
        self.precond = precond
        self.params = list(params)
        self.momentum = momentum
        self.buffers: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, *, lr: float | torch.Tensor | None = None) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.buffers.get(id(p))
            if buf is None:
                buf = self.buffers[id(p)] = torch.zeros_like(p.grad)
            buf.lerp_(p.grad, 1 - self.momentum)
            p.grad.lerp_(buf, self.momentum)
        self.precond.step(lr=lr)

    def memory_usage(self) -> dict[str, int]:
        usage = dict(self.precond.memory_usage())
        usage["momentum"] = sum(b.numel() * b.element_size() for b in self.buffers.values())
        return usage

    def __getattr__(self, name: str):
        return getattr(self.precond, name)


def _momentum_first(spec: MethodSpec, optimizer: torch.optim.Optimizer,
                    precond: KronPreconditioner | None, config: PrecondConfig) -> MomentumFirst:
    if spec.base != "muon" or precond is None:
        raise ValueError(f"precond_momentum needs a preconditioner in front of Muon, not {spec.label!r}")
    if config.muon_momentum_warmup is not None or config.precond_until < 1.0:
        raise ValueError("precond_momentum does not combine with muon_momentum_warmup or precond_until")
    if any(isinstance(o, ExpertMuon) for o in optimizer.optimizers):
        raise ValueError("precond_momentum is not supported on models with fused experts")
    muon = optimizer.optimizers[0]
    for group in muon.param_groups:
        group["momentum"] = 0.0  # the momentum is MomentumFirst's; Muon orthogonalises
    params = [p for group in muon.param_groups for p in group["params"]]
    return MomentumFirst(precond, params, config.muon_momentum)


# --------------------------------------------------------------------------- training
@dataclass
class AmpState:
    """Autocast settings plus the GradScaler (a no-op scaler when AMP is off).

    One per training run: the scaler's scale and growth tracker belong to one optimizer."""

    enabled: bool
    device_type: str
    dtype: torch.dtype
    scaler: torch.amp.GradScaler

    @classmethod
    def create(cls, enabled: bool, device: torch.device, dtype_name: str = "auto") -> "AmpState":
        """``dtype_name``: ``"float16"``, ``"bfloat16"`` or ``"auto"`` (float16 on CUDA, bfloat16
        elsewhere). float16 needs loss scaling; bfloat16's range makes it unnecessary, so the
        scaler is only switched on for float16."""
        if dtype_name == "auto":
            dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        elif dtype_name in ("float16", "bfloat16"):
            dtype = getattr(torch, dtype_name)
        else:
            raise ValueError(f"amp dtype must be 'auto', 'float16' or 'bfloat16', got {dtype_name!r}")
        use_scaler = enabled and dtype == torch.float16
        return cls(enabled, device.type, dtype, torch.amp.GradScaler(device.type, enabled=use_scaler))

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precond: KronPreconditioner | None,
    micro_batches: Sequence[tuple[torch.Tensor, ...]],
    loss_fn: Callable[..., torch.Tensor],
    amp: AmpState,
) -> float:
    """One optimizer step over ``micro_batches`` (gradient accumulation); returns the loss.

    ``loss_fn(model, *batch)`` returns a mean loss for one micro-batch. Gradients of
    non-final micro-batches skip DDP's all-reduce (``no_sync``).
    """
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for i, batch in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with amp.autocast():
                loss = loss_fn(model, *batch) / len(micro_batches)
            amp.scaler.scale(loss).backward()
        total += loss.item()
    # The preconditioner must see true gradients: unscale before it rewrites them.
    amp.scaler.unscale_(optimizer)
    if isinstance(precond, (KronPreconditioner, MomentumFirst)):
        # the optimizer's current lr, for kl_clip (param_groups[0] steps the preconditioned
        # layers: the base optimizer's, or Muon's in an OptimizerChain)
        precond.step(lr=optimizer.param_groups[0]["lr"])
    elif precond is not None:  # another library's (kfac-pytorch's step() takes no lr)
        precond.step()
    amp.scaler.step(optimizer)  # skipped by the scaler when unscale_ found inf/NaN
    amp.scaler.update()
    return total


class StepTimer:
    """Wall-clock of a code block. On CUDA: CUDA events around the block, after a
    synchronisation, so the time counts the GPU's work and any gap in which it waits for
    the host (launch overhead is part of a step's cost); elsewhere the host clock."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0
        self._events: tuple | None = None

    def __enter__(self) -> "StepTimer":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing earlier inside the timed span
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._events is not None:
            start, end = self._events
            end.record()
            end.synchronize()
            self.seconds = start.elapsed_time(end) / 1000.0
        else:
            self.seconds = time.perf_counter() - self._start


# --------------------------------------------------------------------------- memory
def _tensor_bytes(value, seen: set[int]) -> int:
    """Bytes of every distinct tensor inside ``value`` (nested dicts / lists / tuples)."""
    if isinstance(value, torch.Tensor):
        key = value.untyped_storage().data_ptr() if value.numel() else id(value)
        if key in seen:
            return 0
        seen.add(key)
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in value)
    return 0


def state_memory_bytes(
    optimizer: torch.optim.Optimizer, precond: KronPreconditioner | None
) -> dict[str, int]:
    """Optimizer state (tensors in ``optimizer.state``) and preconditioner state bytes."""
    optimizer_bytes = _tensor_bytes(list(optimizer.state.values()), set())
    precond_bytes = sum(precond.memory_usage().values()) if precond is not None else 0
    return {"optimizer": optimizer_bytes, "preconditioner": precond_bytes}

