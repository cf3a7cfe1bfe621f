"""WhitenedMuon: Muon's steepest descent measured in a K-FAC-whitened spectral norm.

Muon moves a weight matrix by ``-η msign(M)`` (``M`` the Nesterov momentum of the gradient,
``msign(M) = U Vᵀ`` for ``M = U S Vᵀ``): the steepest-descent step under ``||ΔW||_op``.
With ``A`` the running covariance of the layer's inputs (K-FAC's activation factor), the
steepest-descent step under ``||ΔW A^{1/2}||_op`` is, substituting ``Z = ΔW A^{1/2}``,

    ΔW ∝ -msign(M A^{-1/2}) A^{-1/2}

and with the output-gradient factor ``G`` as well (``output_side=True``), under
``||G^{1/2} ΔW A^{1/2}||_op``: ``-G^{-1/2} msign(G^{-1/2} M A^{-1/2}) A^{-1/2}``. The
whitening enters twice, before and after the orthogonalisation. A preconditioner in front
of ``torch.optim.Muon`` (rewrite ``.grad``, then Muon steps) can only do the first half;
the second half is why this is an optimizer of its own.

Scale: the result is rescaled to the Frobenius norm of ``msign(...)`` and the learning rate
is adjusted as ``torch.optim.Muon`` adjusts it (``adjust_lr_fn``: ``0.2·sqrt(max(m, n))`` by
default, or ``sqrt(max(1, m/n))``), so ``lr`` means what it means for Muon and only the
direction changes (its best value was 0.7x-2x a tuned Muon's: see ``lr``).

One optimizer for a whole model: ``WhitenedMuon(model, ...)`` whitens every Linear-like unit
the engine's module adapters know (:mod:`kron_precond.modules`) and steps every other
trainable parameter with AdamW in param groups of the same optimizer, each group tagged
``"algorithm": "whitened_muon"`` or ``"adamw"``. The statistics come through
:mod:`kron_precond.capture` and the adapters, as for the preconditioners
(:mod:`kron_precond.whitening`); a plain step costs two matmuls per side beyond Muon's,
weights of one shape stepped as one stack, and no host synchronisation.

Distributed (DDP): the row sums and counts are all-reduced on refresh steps (one bucketed
collective), so every world size gives one process's result (exact when every row enters the
factor; a ``statistics_rows`` cap takes each rank's first rows). FSDP2 and HSDP (DTensor
weights sharded on dim 0): the momentum stays in each rank's rows; per stack of weights one
all-gather assembles the update that goes into ``msign`` (an orthogonalisation needs the
whole matrix); every rank computes the same direction and keeps its rows.
"""
from __future__ import annotations

import functools
import logging
import math
import re
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from kron_precond import validation
from kron_precond.attention import (
    PackedInputAdapter,
    any_rank,
    attention_units,
    model_attention_units,
    replaced_forward,
    several_ranks,
)
from kron_precond.autocast import autocast_disabled
from kron_precond.capture import AbandonedIterations, ActivationCapture, grad_scaler_scale, refuse_fullgraph, weakly
from kron_precond.checkpoint import run_load_pre_hooks, stepped_by_torchs_state_dict_api
from kron_precond.compiled import step_eagerly
from kron_precond.distributed.collectives import failed_ranks
from kron_precond.distributed.sharded import ShardedLayout, is_dtensor, refuse_fsdp1
from kron_precond.health import WEIGHT_CHECK_EVERY, WeightGrowth, new_nonfinite_steps
from kron_precond.methods import state_checks as checks
from kron_precond.modules import (
    ParametrizationWatch,
    Selected,
    UnsupportedModule,
    check_layout,
    compile_skip_patterns,
    find_kfac_modules,
    is_skipped,
    kfac_adapter,
    owners_of,
    unknown_parameters,
    user_stacklevel,
    warn_unmatched_skips,
)
from kron_precond.modules import refuse_lazy as _refuse_lazy
from kron_precond.whitening import MatrixView, UnitObserver, WhiteningStatistics

logger = logging.getLogger("kron_precond")

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic Newton-Schulz
# Polar Express (Amsel et al., arXiv 2505.16932): one quintic per iteration, each the minimax
# approximation of sign() on the interval the previous ones leave, so 5 iterations bring
# every singular value closer to 1 than 5 of the fixed quintic. Its first iteration assumes
# singular values <= 1, which a Frobenius normalisation with a 2 % margin guarantees in bf16.
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
NS_SCHEDULES = {"muon": ((NS_COEFFICIENTS,), 1.0), "polar_express": (POLAR_EXPRESS, 1.02)}
WHITENED, ADAMW = "whitened_muon", "adamw"
# A statistics horizon this long draws a warning: statistics every 100 steps kept 1.03x-1.05x of
# the best Muon's steps on the d_model 64 GPT where the defaults' 25 steps keep 1.20x (6 seeds).
LONG_HORIZON = 100
ALGORITHMS = (WHITENED, ADAMW)
# torch.optim.Muon's lr adjustments by name (None: its default, "original")
ADJUST_LR_FNS = ("match_rms_adamw", "original", None)


def lr_ratio(adjust_lr_fn: str | None, shape: tuple[int, int]) -> float:
    """The factor ``torch.optim.Muon`` multiplies ``lr`` by for a weight ``[out, in]``:
    ``"match_rms_adamw"``: ``0.2·sqrt(max(out, in))`` (an update of AdamW's RMS, so one lr
    serves both halves); ``"original"`` or ``None``: ``sqrt(max(1, out / in))`` (Keller
    Jordan's Muon, whose lr is on the spectral scale, about 0.02)."""
    out_dim, in_dim = shape
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(out_dim, in_dim))
    if adjust_lr_fn in ("original", None):
        return math.sqrt(max(1.0, out_dim / in_dim))
    raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")


def native_ns_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where ``device`` multiplies it natively, float32 on a CPU whose oneDNN has no
    bfloat16 kernels (there torch's bfloat16 matmul takes a slow path, 25-100x slower than
    float32). One check per process: the answer is the CPU's."""
    if device.type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if _cpu_multiplies_bfloat16() else torch.float32


@functools.lru_cache(maxsize=None)
def _cpu_multiplies_bfloat16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: assume it does
        return True


def msign(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7,
          dtype: torch.dtype = torch.bfloat16, coefficients: str = "muon") -> torch.Tensor:
    """``≈ U Vᵀ`` of ``matrix = U S Vᵀ`` by a Newton-Schulz iteration, for one matrix or a
    stack ``[k, m, n]``, each normalised by its own norm.

    ``coefficients="muon"``: torch.optim.Muon's fixed quintic; in bfloat16 (the default) every
    matrix of a stack gets ``torch.optim.Muon``'s result (bitwise on CPU from 8 rows and
    columns, tested; on smaller matrices bfloat16's batched and unbatched kernels can round a
    last bit apart, for 3 in 200 random ``[4, 12]`` matrices).
    ``"polar_express"``: Polar Express's per-iteration quintics (iterations past the fifth
    repeat the fifth); the same cost, singular values closer to 1."""
    try:
        schedule, margin = NS_SCHEDULES[coefficients]
    except KeyError:
        raise ValueError(f"coefficients must be one of {sorted(NS_SCHEDULES)}, got {coefficients!r}") from None
    x = matrix.to(dtype)
    single = x.dim() == 2
    if single:
        x = x.unsqueeze(0)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)
    x = x / (norm.clamp(min=eps) if margin == 1.0 else norm * margin + eps)
    for i in range(steps):
        a, b, c = schedule[min(i, len(schedule) - 1)]
        gram = torch.bmm(x, x.mT)  # bmm, not @: see _whiten
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if transposed:
        x = x.mT
    return (x[0] if single else x).to(matrix.dtype)


@dataclass(frozen=True)
class _CaptureLayer:
    """One matrix as :class:`~kron_precond.capture.ActivationCapture` sees a layer."""

    module: nn.Module
    adapter: Any
    slot: int
    method: UnitObserver
    name: str  # the unit's, for the capture's messages


def _listed_units(modules: list) -> tuple[list[Selected], list[Selected]]:
    """(the units whitened, the units stepped unwhitened) of the modules of the list form;
    ``TypeError`` / ``ValueError`` naming a module that is not one, or whose kind no adapter
    describes."""
    if not modules:
        raise ValueError("WhitenedMuon: modules is empty")
    units: list[Selected] = []
    plain: list[Selected] = []
    for i, module in enumerate(modules):
        label = f"modules[{i}] ({type(module).__name__})"
        if not isinstance(module, nn.Module):
            raise TypeError(f"WhitenedMuon: modules[{i}] must be an nn.Module, got {type(module).__name__}")
        adapter, reason = kfac_adapter(module)  # a user's registration takes precedence
        if adapter is None and isinstance(module, nn.MultiheadAttention):  # self-attention unless kdim / vdim
            overridden = replaced_forward(module)
            if overridden:
                raise ValueError(f"WhitenedMuon: {label} cannot be whitened: {overridden}")
            found, unwhitened = attention_units(f"modules[{i}]", module, cross_attention=False,
                                                is_skipped=lambda name, m: False, owners={}, log=logger.info)
            if not found and not unwhitened:
                raise ValueError(f"WhitenedMuon: {label} has no trainable projection weight")
            units.extend(found)
            plain.extend(unwhitened)
            continue
        if adapter is None:
            raise ValueError(f"WhitenedMuon: {label} cannot be whitened: {reason}. Give its parameters to "
                             "another optimizer, or pass the model (WhitenedMuon(model, ...)), which "
                             "steps such parameters with AdamW")
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        if not own:
            raise ValueError(f"WhitenedMuon: {label} has no parameters of its own")
        unknown = unknown_parameters(adapter, own)
        if unknown:
            raise ValueError(f"WhitenedMuon: {label} cannot be whitened: {unknown}")
        try:
            found = adapter.units(f"modules[{i}]", own)
        except UnsupportedModule as err:
            raise ValueError(f"WhitenedMuon: {label} cannot be whitened: {err}") from err
        check_layout(found, label, "WhitenedMuon")
        units.extend(found)
    return units, plain


def _weight(unit: Selected) -> nn.Parameter:
    return unit.params[0][1]


def _trains_bias(unit: Selected) -> bool:
    """The unit has a bias that trains: a free shift of its outputs (one frozen gives none)."""
    return unit.has_bias and unit.params[-1][1].requires_grad


# The last part of a module's name that marks an attention's query or key projection: Hugging
# Face's and fairseq's q_proj / k_proj (Llama, Mistral, Mixtral, Qwen, Gemma, OPT), BERT's
# query / key, Meta's and torchtitan's Llama wq / wk, diffusers' to_q / to_k, T5's q / k.
QUERY_NAMES = frozenset({"q_proj", "query", "wq", "to_q", "q"})
KEY_NAMES = frozenset({"k_proj", "key", "wk", "to_k", "k"})
QUERY_KEY_NAMES = QUERY_NAMES | KEY_NAMES


# PEFT's LoRA wraps a projection in a module of the projection's name, its adapters below it:
# <projection>.lora_A.<adapter name> and <projection>.lora_B.<adapter name>, parts of that projection.
LORA_ADAPTER = re.compile(r"\.lora_[AB]\.[^.]+$")


def projection_name(unit_name: str) -> str:
    """The name of the projection a unit is part of: its own, or, for a LoRA adapter's matrix,
    the name of the projection the adapter wraps."""
    return LORA_ADAPTER.sub("", unit_name)


def _query_key_pairs(units: list[Selected]) -> list[Selected]:
    """The units named as a query or key projection whose parent module holds both a query and a
    key so named (one of the two alone, e.g. a fused ``kv``, is no pair); a LoRA adapter's
    matrices count as part of the projection they wrap."""
    by_parent: dict[str, list[Selected]] = {}
    for u in units:
        parent, _, last = projection_name(u.name).rpartition(".")
        if last in QUERY_KEY_NAMES:
            by_parent.setdefault(parent, []).append(u)
    pairs = []
    for members in by_parent.values():
        names = {projection_name(u.name).rpartition(".")[2] for u in members}
        if names & QUERY_NAMES and names & KEY_NAMES:
            pairs.extend(members)
    return pairs


def _matched_units(units: list[Selected], patterns: list[re.Pattern], argument: str) -> list[Selected]:
    """The units whose module name or class name a pattern matches (as ``skip_layers``);
    ``ValueError`` naming a pattern that matches none: most likely a typo, or a layer
    ``skip_layers`` sent to AdamW."""
    for pattern in patterns:
        if not any(is_skipped(u.name, u.module, [pattern]) for u in units):
            raise ValueError(f"{argument} entry {pattern.pattern!r} matches no whitened layer")
    return [u for u in units if is_skipped(u.name, u.module, patterns)]


def _centred_units(units: list[Selected], center_inputs: bool | list[re.Pattern] | None) -> list[Selected]:
    """The units whose input factor is centred (``center_inputs`` as the constructor documents it)."""
    if isinstance(center_inputs, bool):
        return list(units) if center_inputs else []
    if center_inputs is not None:
        return _matched_units(units, center_inputs, "center_inputs")
    pairs = _query_key_pairs(units)
    if pairs:  # the query and key recognised: the bias-free ones (with a bias, it carries the shift)
        return [u for u in pairs if not _trains_bias(u)]
    return [u for u in units if not _trains_bias(u)]


# The attention modules known to compute the query, key and value with one fused projection
# whose outputs hold them in three contiguous blocks (per class, in its MRO: the projection's
# attribute name): Hugging Face's GPT-2, Phi-3 and MPT, nanoGPT's, and Qwen's (remote code). A
# name alone is not enough: CodeGen's qkv_proj and GPTBigCode's c_attn interleave the heads.
FUSED_QKV_LAYOUTS = {"GPT2Attention": "c_attn", "CausalSelfAttention": "c_attn", "QWenAttention": "c_attn",
                     "Phi3Attention": "qkv_proj", "MptAttention": "Wqkv"}


def _fused_qkv_units(units: list[Selected], fused_qkv: list[re.Pattern] | None,
                     modules: dict[str, nn.Module]) -> set[int]:
    """``id`` of the weights stepped as three matrices, a fused projection's query, key and
    value (``fused_qkv`` as the constructor documents it; ``False`` is ``[]``). ``modules``:
    the model's modules by qualified name (empty for the list form)."""
    def shape(u: Selected) -> tuple[int, int]:  # [out, in]
        return MatrixView(_weight(u), u.index is not None, u.weight_transposed).shape

    def known_layout(u: Selected) -> bool:
        if isinstance(u.module, nn.MultiheadAttention):  # in_proj_weight: query, key, value
            return u.params[0][0] == "in_proj_weight"
        parent, _, last = u.name.rpartition(".")
        owner = modules.get(parent)
        return owner is not None and any(FUSED_QKV_LAYOUTS.get(c.__name__) == last for c in type(owner).__mro__)

    def three_wide(u: Selected) -> bool:  # no grouped-query attention: three square parts
        out_dim, in_dim = shape(u)
        return out_dim == 3 * in_dim

    if fused_qkv is None:  # a known layout
        return {id(_weight(u)) for u in units if u.index is None and known_layout(u) and three_wide(u)}
    chosen = set()
    for u in _matched_units(units, fused_qkv, "fused_qkv"):
        if u.index is not None:
            raise ValueError(f"fused_qkv matches {u.name!r}, a fused expert, not a query/key/value projection")
        if not three_wide(u):
            raise ValueError(f"fused_qkv matches {u.name!r}, whose [out, in] is {list(shape(u))}: a fused "
                             "query/key/value projection is stepped as three square parts, its outputs three "
                             "times its inputs")
        chosen.add(id(_weight(u)))
    return chosen


def _refuse_complex(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> None:
    """``TypeError`` naming a trainable complex parameter: neither half's step is written for
    complex numbers (AdamW's second moment would square instead of taking ``|g|²``)."""
    names = [name for name, p in named_parameters if p.requires_grad and p.is_complex()]
    if names:
        raise TypeError(f"WhitenedMuon does not support complex parameters; got {', '.join(names)}")


def _refuse_sparse(named_modules: Iterable[tuple[str, nn.Module]]) -> None:
    """``TypeError`` naming a module with a trainable weight that gets sparse gradients
    (``nn.Embedding(sparse=True)``): neither half's step takes them (as ``torch.optim.AdamW``)."""
    names = [name or "<root>" for name, m in named_modules if getattr(m, "sparse", False) is True
             and any(p.requires_grad for p in m.parameters(recurse=False))]
    if names:
        raise TypeError(f"WhitenedMuon does not support sparse gradients; {', '.join(names)} "
                        f"{'has' if len(names) == 1 else 'have'} sparse=True. Build it with sparse=False, or "
                        f"leave it to an optimizer that takes sparse gradients (torch.optim.SparseAdam)")


GROUP_RULES: dict[str, tuple[validation.GroupRule, ...]] = {  # per algorithm, checked before every step
    WHITENED: (("lr", ">= 0", lambda v: v >= 0), ("weight_decay", ">= 0", lambda v: v >= 0),
               ("momentum", "in [0, 1)", lambda v: 0 <= v < 1)),
    ADAMW: (("lr", ">= 0", lambda v: v >= 0), ("weight_decay", ">= 0", lambda v: v >= 0),
            ("eps", "> 0", lambda v: v > 0),
            ("betas", "a pair in [0, 1)", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v))),
}


def _layer_patterns(value: Any, argument: str, others: str) -> list[re.Pattern]:
    """``value``, a list or tuple of regexes naming layers, compiled; ``TypeError`` for anything
    else (a bare string too: it would read as one regex where a keyword was meant)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        raise TypeError(f"{argument} must be {others}, or a list or tuple of regexes (matched against module names "
                        f"and class names, as skip_layers is), got {value!r}")
    return compile_skip_patterns(value, argument)


def _check_center_inputs(center_inputs: Any) -> bool | list[re.Pattern] | None:
    """``center_inputs`` checked: ``None``, a bool, or a list or tuple of regexes (compiled). A
    bare string is refused: it would read as one regex where "auto" or "all" was meant."""
    if center_inputs is None or isinstance(center_inputs, bool):
        return center_inputs
    return _layer_patterns(center_inputs, "center_inputs", "None, a bool")


def _check_fused_qkv(fused_qkv: Any) -> list[re.Pattern] | None:
    """``fused_qkv`` checked: ``None``, ``False`` (returned as ``[]``: no layer), or a list or
    tuple of regexes (compiled)."""
    if fused_qkv is None:
        return None
    if fused_qkv is False:
        return []
    return _layer_patterns(fused_qkv, "fused_qkv", "None, False")


# module names wrappers put in front of a model's own (DDP, torch.compile, activation
# checkpointing, FSDP1): a checkpoint saved through one loads into the bare model and back
_WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _check_names(index: int, saved: Any, ours: Any) -> None:
    """``ValueError`` when a saved group's ``param_names`` (torch.optim keeps them for an
    optimizer built from named parameters, as the model form is) name other parameters than
    this optimizer's, wrappers' prefixes aside: torch.optim loads by position, so a model of
    the same shapes would take another weight's state silently."""
    if not isinstance(saved, (list, tuple)) or not isinstance(ours, (list, tuple)):
        return  # a checkpoint or optimizer without names: by position, as torch.optim loads
    for position, (theirs, mine) in enumerate(zip(saved, ours)):
        if _plain_name(str(theirs)) != _plain_name(str(mine)):
            raise ValueError(f"WhitenedMuon.load_state_dict: saved param group {index} holds {theirs!r} at "
                             f"position {position}, where this optimizer has {mine!r}: a checkpoint of another "
                             f"model. To load it by position anyway, remove 'param_names' from its param groups")


def _check_group(index: int, group: dict[str, Any]) -> None:
    """``ValueError`` for a setting on a param group that the step cannot use."""
    algorithm = group["algorithm"]
    validation.check_group_numbers(f"WhitenedMuon ({algorithm!r})", index, group, GROUP_RULES[algorithm],
                                   optional=("weight_decay",) if algorithm == WHITENED else ())
    if algorithm == WHITENED:
        lr_ratio(group.get("adjust_lr_fn", "match_rms_adamw"), (1, 1))
        if not isinstance(group.get("nesterov", True), bool):  # a string "False" would read as on
            raise ValueError(f"WhitenedMuon: param group {index} has nesterov={group['nesterov']!r}; "
                             f"it must be a bool")


def _wide_output(view: MatrixView) -> bool:
    """Whether the matrices ``msign`` steps for this weight (a fused projection's parts, a stack's
    experts) have more outputs than inputs: a plain MLP's first layer, a gated MLP's gate and up."""
    out_dim, in_dim = view.part_shape
    return out_dim > in_dim


def _ungated_mlp_inputs(units: list[Selected], views: dict[int, MatrixView],
                        parents: dict[int, int]) -> frozenset[int]:
    """``id(weight)`` of the first layers of ungated MLPs among ``units``: a weight ``[f, d]``
    (per part, per expert) with ``f > d`` beside exactly one weight ``[d, f]`` (the second
    layer, reading its output) and no other weight ``[f, d]`` (a gated MLP's gate and up
    projections share that shape; a fused gate-and-up projection ``[2f, d]`` has no ``[d, 2f]``
    beside it; a gated MLP narrower than the model has its ``down [d, f]`` beside two ``[f, d]``).
    An attention's query or key named as such (:data:`QUERY_KEY_NAMES`) is none, though a query
    wider than the model sits beside its output projection as an MLP's first layer does.
    Beside: under the same parent module (``parents``: ``id(module) -> id(parent)``), or in the
    same fused experts module."""
    attention = {id(_weight(u)) for u in _query_key_pairs(units)}
    groups: dict[int, dict[int, tuple[int, int]]] = {}  # parent -> id(weight) -> its matrices' shape
    for unit in units:
        parent = id(unit.module) if unit.index is not None else parents.get(id(unit.module))
        if parent is not None:
            key = id(_weight(unit))
            groups.setdefault(parent, {})[key] = views[key].part_shape
    chosen: set[int] = set()
    for shapes in groups.values():
        for key, (out_dim, in_dim) in shapes.items():
            beside = [shape for other, shape in shapes.items() if other != key]
            if (out_dim > in_dim and beside.count((in_dim, out_dim)) == 1 and (out_dim, in_dim) not in beside
                    and key not in attention):
                chosen.add(key)
    return frozenset(chosen)


def _check_state_tensor(item: str, value: Any, shape: tuple[int, ...], where: str) -> None:
    """A saved state tensor of the expected shape: floating and finite (factors, whiteners,
    moments), or, for ``nonfinite_steps``, an integer count >= 0. ``ValueError`` otherwise.
    Of a DTensor (a sharded model's moment) the global shape, then this rank's shard: each
    rank checks its own (``load_state_dict`` has the ranks agree on the outcome)."""
    if not torch.is_tensor(value):
        raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
    if is_dtensor(value):
        if tuple(value.shape) != shape:
            raise ValueError(f"{where}: expected shape {shape}, got {tuple(value.shape)}")
        value = value.to_local()
        shape = tuple(value.shape)
    if item == "nonfinite_steps":
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool or tuple(value.shape) != shape:
            raise ValueError(f"{where}: expected an integer tensor of shape {shape}, got {value.dtype} "
                             f"{tuple(value.shape)}")
        if bool((value < 0).any()):
            raise ValueError(f"{where}: a count must be >= 0, got {value.min().item()}")
    else:
        # shape, floating dtype and finiteness; AdamW's second moment, a mean of squares, also >= 0
        # (the step's square root of a negative one is NaN)
        checks.float_tensor(value, shape, where, non_negative=item == "exp_avg_sq")
        if item.endswith("_seen") and not bool(((value == 0) | (value == 1)).all()):
            raise ValueError(f"{where}: expected 0 or 1 per matrix")


def _check_step_count(value: Any, where: str) -> None:
    """A parameter's step count: a whole number >= 0 (AdamW's bias correction reads it)."""
    if torch.is_tensor(value):
        checks.count(value, where)
    else:
        checks.integer(value, where)


# what a parameter's saved state holds together (an entry without the rest cannot be stepped)
_TOGETHER = {ADAMW: (("step", "exp_avg", "exp_avg_sq"),),
             WHITENED: (("step", "momentum_buffer", "nonfinite_steps"),
                        ("input_factor", "input_whitener", "input_seen"),
                        ("output_factor", "output_whitener", "output_seen"))}


def _check_complete(entry: dict[str, Any], algorithm: str, where: str) -> None:
    for together in _TOGETHER[algorithm]:
        present = [item for item in together if item in entry]
        if present and len(present) < len(together):
            missing = [item for item in together if item not in entry]
            raise ValueError(f"{where}: the saved state holds {present} without {missing}")


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # only parameters with a gradient are stepped
    return p.grad


class WhitenedMuon(torch.optim.Optimizer):
    """Muon whose step is measured in ``||ΔW A^{1/2}||_op`` (``A``: the layer's input covariance).

    Two forms:

    * ``WhitenedMuon(model, lr=..., skip_layers=["Embedding", "lm_head"])``: one optimizer for
      the whole model. Every unit the module adapters know (``nn.Linear`` and subclasses, HF
      ``Conv1D`` with its ``[in, out]`` weight, ``nn.Conv1d/2d/3d``, fused MoE experts expert by
      expert, a module taught with :func:`~kron_precond.register_adapter`) and ``skip_layers``
      does not exclude is whitened, and so are the projections of ``nn.MultiheadAttention``,
      read from its arguments (:mod:`kron_precond.attention`: its ``out_proj``, whose input no
      hook sees, takes Muon's step unwhitened); every other trainable parameter (embeddings,
      norms, biases, skipped layers, a weight tied to another module, modules no adapter knows)
      is stepped by AdamW in a group of the same optimizer. Param groups carry
      ``"algorithm"``: ``"whitened_muon"`` or ``"adamw"``. "Trainable" is read when the
      optimizer is built: build it after unfreezing what will train (a parameter unfrozen
      later is in no group, and a warning names it once it has a gradient).
    * ``WhitenedMuon([module, ...], lr=...)``: only the weights of these modules (their
      biases, embeddings, norms and the output layer go to another optimizer). A module no
      adapter describes (nor ``nn.MultiheadAttention``) is refused with a ``ValueError`` naming it.

    Args:
        params: the model, or a list of modules.
        lr: learning rate, on AdamW's scale with the default ``adjust_lr_fn``; an LR scheduler
            scales it (and ``adamw_lr``) like any torch optimizer's. Coming from a tuned Muon, keep
            its momentum and ``adjust_lr_fn`` and multiply its lr by 1.4 (measured with the
            default ``adjust_lr_fn``: level with Muon's own lr on small models, ahead from
            d_model 128 up); from d_model 768 up try 2x too (the best lr measured ranged from
            0.7x to 2x the best Muon's).
        weight_decay: decoupled weight decay of the whitened weights.
        momentum, nesterov: ``torch.optim.Muon``'s momentum (``buf.lerp_(g, 1 - momentum)``).
        skip_layers: regex or list of regexes (model form only); a module whose qualified name
            or class name matches is not whitened (its parameters go to AdamW), as
            :class:`~kron_precond.KronPreconditioner`'s ``skip_layers``.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW groups' settings
            (model form); ``adamw_lr`` defaults to ``lr`` (one schedule serves both halves, as
            ``match_rms_adamw`` intends; keep it so with the lr rule above), ``adamw_weight_decay``
            to ``weight_decay``.
        statistics_every: steps between statistics steps (which also refresh the whiteners).
            A statistics step adds up to ``statistics_rows`` rows' products per layer and a
            decomposition per factor. Where that is a large share of the step (a few thousand
            tokens per step on a small model), halve it with ``statistics_every=10,
            factor_decay=0.6``, the same 25-step horizon. Where the forward and backward
            dominate (16k tokens per step), the statistics cost about 1 % and fewer of them
            lose steps: keep 5.
        damping: ``λ = damping · tr(F) / dim F`` for each input-side factor ``F``.
        factor_decay: exponential-average decay of the factors, per refresh: they average over
            about ``statistics_every / (1 - factor_decay)`` steps, the statistics horizon (25 by
            default). Keep the horizon short, a few tens of steps: the inputs' covariance moves
            with the weights, and a factor averaged over hundreds of steps whitens for weights
            the model no longer has. Lengthen it (``factor_decay`` towards 0.95) only when a
            statistics step sees few rows (small batches): ``statistics_rows`` times the
            horizon's statistics steps should stay well above the widest input. A horizon of
            100 steps or more is warned about at construction.
        statistics_rows: at most this many rows per module call enter a factor (``None``: all).
            Rows beyond a thousand or so change the factor little and cost a product each.
        output_side: also whiten the output side with K-FAC's ``G`` (a tensor hook on each
            output on statistics steps; a backward cost then). ``True``: every weight's;
            ``"wide"``: only the weights whose output is wider than their input (per part of a
            fused projection, per expert), such as an MLP's first layer, where the output side
            saves the most steps and the other weights pay no cost for it; ``"auto"`` (the
            default): of those, the first layers of ungated MLPs (GELU or ReLU, as GPT-2's), recognised by
            their shapes: a weight ``[f, d]`` with ``f > d`` beside (under the same parent
            module, or in the same fused experts module) exactly one ``[d, f]`` that reads its
            output, and no other ``[f, d]``, not named as an attention's query or key. A gated
            MLP's gate and up projections share a shape, and a fused gate-and-up ``[2f, d]`` has
            no ``[d, 2f]`` beside it, so gated MLPs (SwiGLU, as Llama's and Mixtral's), where the
            output side cost more time than it saved, get none. The list form names no parent
            modules: there ``"auto"`` whitens no output side. An MLP whose two layers sit under
            different parents (BERT's ``intermediate.dense`` and ``output.dense``) is not
            recognised: set ``"wide"``.
        output_damping: ``damping`` for the output side's factors (K-FAC's ``G``); ``None``
            (default): ``damping``, as the input side's.
        center_inputs: whiten with the covariance of a layer's inputs about their mean (over
            each statistics step's rows) instead of their second moment. ``None`` (default):
            centre the query and key projections of an attention that have no trainable bias,
            recognised by the last part of their module name (``q_proj``, ``k_proj``, ``query``,
            ``key``, ``wq``, ``wk``, ``to_q``, ``to_k``, ``q``, ``k``), a query and a key under
            one parent module (a LoRA adapter's matrices, ``<projection>.lora_A.<adapter>`` and
            ``lora_B``, as parts of the projection they wrap); where the query and key so named
            have biases (Qwen2), nothing; where no query and key are so named (a fused ``qkv``,
            the list form), every layer without a trainable bias.
            ``True`` / ``False``: every layer / none. A list or tuple of regexes: exactly the
            layers whose module name or class name matches one (as ``skip_layers``; a fused
            expert's name is ``<module>.<weight>.<index>``); a regex that matches no whitened
            layer (a typo, or a layer ``skip_layers`` sends to AdamW) raises ``ValueError``.
            A layer without a bias shifts all its outputs together only through the inputs'
            mean, which the second moment makes the stiffest direction of the whitened norm;
            centring leaves that shift free. A free query shift sets a per-key offset of the
            attention scores, and centring query and key saves steps (bias-free Llama-style and
            Mixtral models); the other bias-free layers write to the residual stream, and there
            the second moment did as well or better. A layer with a trainable bias has the bias
            (stepped by AdamW) for the shift: centring it changed nothing or lost steps, and it
            is left uncentred; a frozen bias counts as none. Centring costs, per call on
            statistics steps, a mean and a rank-1 product; until the step's refresh a centred
            side keeps, besides its product, a float64 ``width²`` term (per expert for fused
            experts) that joins the all-reduce.
        fused_qkv: the fused query/key/value projections, whose ``[3d, d]`` weight is stepped as
            three ``[d, d]`` matrices: each part orthogonalised on its own and scaled by
            ``adjust_lr_fn`` for its own shape, the input whitener shared (the parts read one
            input; an ``nn.MultiheadAttention`` called as cross-attention: a whitener per part,
            each from its own input), the output side, if on, whitened per part. ``None`` (default): the fused
            projections of the attention modules whose layout is known to be three contiguous
            blocks, query, key, value (``nn.MultiheadAttention``'s ``in_proj_weight``, Hugging
            Face's GPT-2 ``c_attn``, Phi-3 ``qkv_proj`` and MPT ``Wqkv``, nanoGPT's and Qwen's
            ``c_attn``: ``FUSED_QKV_LAYOUTS``, read from the module's class and its bases), where
            the outputs are exactly three times the inputs (with grouped-query attention they are
            narrower, and the layer is stepped whole). The list form (``WhitenedMuon([module,
            ...])``) has no attention modules to read: nothing but an ``nn.MultiheadAttention``
            is split there unless named. A list or tuple of regexes: exactly the layers
            whose module name or class name matches one (as ``skip_layers``); each must be a
            whitened matrix whose outputs are three times its inputs, and a regex that matches
            no whitened layer raises ``ValueError``. ``False``: none. Orthogonalising the fused
            matrix whole couples the three projections' singular values; the split saved steps
            for Muon and ``WhitenedMuon`` alike on GPT-2. Name a fused projection only when its
            outputs are three contiguous blocks: GPT-NeoX's, BLOOM's and Falcon's
            ``query_key_value``, CodeGen's ``qkv_proj`` and GPTBigCode's ``c_attn`` interleave
            the heads.
        root: how ``F + λI`` is whitened: ``"cholesky"`` (``T = L⁻¹``, cheap) or
            ``"symmetric"`` (``(F + λI)^{-1/2}``, an ``eigh``). Both define the same norm and give
            the same step, Newton-Schulz's approximate ``msign`` included (it commutes with the
            orthogonal factor between the two roots); they differ in cost and rounding alone. On
            CUDA, ``torch.linalg.eigh`` waits for the host: keep ``"cholesky"`` where the
            refresh's steps must not synchronise.
        block_size: a side wider than this (and divisible by it) keeps only the diagonal
            ``block_size``-blocks of its factor: its statistics, refresh and whitening cost fall
            by ``width / block_size``. A wider side it does not divide is whitened whole, and a
            warning at construction names it. ``None``: every side whole.
        ns_steps: Newton-Schulz iterations. Keep Muon's 5; lower it only where Newton-Schulz
            dominates the step and a run of your own shows the loss unchanged (four lost
            steps on GPT-2 and at 16k tokens per step).
        ns_dtype: dtype of the Newton-Schulz iteration and the whitening around it. ``None``
            (the default): bfloat16, as ``torch.optim.Muon``, wherever the weights' device
            multiplies it natively (CUDA and other accelerators; a CPU whose oneDNN has
            bfloat16 kernels: AVX-512 or AMX on x86), and float32 on a CPU without them
            (AVX2-only x86, such as AMD Zen 3), where a bfloat16 matmul runs 25-100x slower than a
            float32 one. Set ``torch.bfloat16`` to match ``torch.optim.Muon``'s arithmetic
            everywhere, ``torch.float32`` for a more exact ``msign``.
        ns_coefficients: ``"muon"`` (``torch.optim.Muon``'s fixed quintic) or ``"polar_express"``
            (Polar Express's per-iteration quintics, as the NanoGPT speedrun uses: the same cost,
            a more exact ``msign``).
        adjust_lr_fn: ``torch.optim.Muon``'s lr adjustment per weight ``[out, in]``:
            ``"match_rms_adamw"`` (default) multiplies ``lr`` by ``0.2·sqrt(max(out, in))``, so
            one lr suits the AdamW groups too; ``"original"`` (``None`` means the same, as in
            ``torch.optim.Muon``, whose default it is) by ``sqrt(max(1, out / in))``, with ``lr``
            on Muon's spectral scale (about 0.02): then set ``adamw_lr`` (about 3e-4), or the AdamW
            groups take that lr too. A param-group setting, kept by ``state_dict``.
        grad_scaler: the ``torch.amp.GradScaler`` of an fp16 run (or a callable returning the
            loss scale): its scale is divided out of the output-side statistics. Without it,
            output gradients that arrive in float16 (almost always a scaler's) warn once.
        process_group: where the statistics are all-reduced; ``None``: the default group when
            ``torch.distributed`` is initialised with more than one rank. There, construction is
            a collective: the ranks compare the weights they whiten and every setting, and a
            difference raises ``ValueError`` naming it on every rank.

    A step whose gradient (for one whitened weight; for fused experts, one expert) is not finite
    leaves that weight, its momentum and its weight decay untouched, and so does an all-zero
    gradient of an expert (the router sent it no token: a Linear of its own would have had no
    gradient, and no step from its stale momentum; the experts' biases are AdamW's, and step as
    ``torch.optim.AdamW`` steps them); the non-finite steps (per weight) are counted on the
    device and reported by a warning when the counters are read: on the first step and then
    once every ``nonfinite_warn_interval`` (100) steps. Those reads and the whitened weights'
    norms on the same steps (a divergence check: :class:`~kron_precond.health.WeightGrowth`)
    are the only host synchronisation of ``step()`` (with ``root="cholesky"``, the default;
    under several ranks, also one small host read per statistics step while a packed attention
    is not yet known to be cross-attention).
    """

    nonfinite_warn_interval = 100

    def __init__(self, params: nn.Module | Iterable[nn.Module], lr: float = 1e-3, weight_decay: float = 0.0,
                 momentum: float = 0.9, nesterov: bool = True, *, skip_layers: str | Iterable[str] = (),
                 adamw_lr: float | None = None, adamw_betas: tuple[float, float] = (0.9, 0.999),
                 adamw_eps: float = 1e-8, adamw_weight_decay: float | None = None, statistics_every: int = 5,
                 damping: float = 0.1, factor_decay: float = 0.8, statistics_rows: int | None = 1024,
                 output_side: bool | Literal["wide", "auto"] = "auto", output_damping: float | None = None,
                 center_inputs: bool | list[str] | tuple[str, ...] | None = None,
                 fused_qkv: Literal[False] | list[str] | tuple[str, ...] | None = None,
                 root: str = "cholesky", block_size: int | None = None,
                 ns_steps: int = 5, ns_dtype: torch.dtype | None = None, ns_coefficients: str = "muon",
                 adjust_lr_fn: str | None = "match_rms_adamw", grad_scaler: Any = None, process_group: Any = None):
        lr_ratio(adjust_lr_fn, (1, 1))  # ValueError for an unknown name, before anything is built
        defaults = dict(lr=validation.check_positive("lr", lr),
                        weight_decay=validation.check_non_negative("weight_decay", weight_decay),
                        momentum=validation.check_unit_interval("momentum", momentum, low_open=False, high_open=True),
                        nesterov=validation.check_bool("nesterov", nesterov), adjust_lr_fn=adjust_lr_fn,
                        algorithm=WHITENED)
        # the normalised numbers (a numpy or 0-dim tensor lr is a float in both halves)
        self._adamw_defaults = self._check_adamw(defaults["lr"], defaults["weight_decay"], adamw_lr, adamw_betas,
                                                 adamw_eps, adamw_weight_decay)
        self.statistics_every = validation.check_int("statistics_every", statistics_every)
        damping = validation.check_positive("damping", damping)
        if output_damping is not None:
            output_damping = validation.check_positive("output_damping", output_damping)
        self._output_damping = output_damping
        factor_decay = validation.check_unit_interval("factor_decay", factor_decay, low_open=False, high_open=True)
        if statistics_rows is not None:
            statistics_rows = validation.check_int("statistics_rows", statistics_rows)
        horizon = self.statistics_every / (1 - factor_decay)
        if horizon >= LONG_HORIZON:  # e.g. a Shampoo-style "root every 100 steps" brought along
            warnings.warn(f"WhitenedMuon: statistics_every={statistics_every} and factor_decay={factor_decay} "
                          f"average the whiteners' statistics over about {horizon:.0f} steps (statistics_every / "
                          f"(1 - factor_decay)). The inputs' covariance moves with the weights: horizons of "
                          f"{LONG_HORIZON} steps or more lost most of the gain over Muon where measured. Keep it "
                          f"to a few tens of steps (the defaults: 5 and 0.8, 25 steps)", UserWarning, stacklevel=2)
        if isinstance(output_side, str) and output_side not in ("wide", "auto"):
            raise ValueError(f"output_side must be True, False, 'wide' or 'auto', got {output_side!r}")
        if not isinstance(output_side, (bool, str)):
            raise TypeError(f"output_side must be True, False, 'wide' or 'auto', got {output_side!r}")
        self.output_side: bool | str = output_side
        centring = _check_center_inputs(center_inputs)
        self._center_inputs = center_inputs
        fused = _check_fused_qkv(fused_qkv)
        self._fused_qkv = fused_qkv
        if root not in ("cholesky", "symmetric"):
            raise ValueError(f"root must be 'cholesky' or 'symmetric', got {root!r}")
        if block_size is not None:
            block_size = validation.check_int("block_size", block_size)
        self.ns_steps = validation.check_int("ns_steps", ns_steps)
        if ns_coefficients not in NS_SCHEDULES:
            raise ValueError(f"ns_coefficients must be one of {sorted(NS_SCHEDULES)}, got {ns_coefficients!r}")
        self.ns_coefficients = ns_coefficients
        self._ns_dtype = validation.check_float_dtype("ns_dtype", ns_dtype, allow_none=True)
        loss_scale = grad_scaler_scale(grad_scaler)  # TypeError for anything else

        units, plain, rest = self._select(params, skip_layers)
        # the model form's parameters frozen when it is built: in no group. One unfrozen later
        # gets gradients no group steps, which is said (when the counters are read)
        self._frozen_at_build = ([(n, p) for n, p in params.named_parameters() if not p.requires_grad]
                                 if isinstance(params, nn.Module) else [])
        self._views: dict[int, MatrixView] = {}
        # qualified parameter names: the model's, or modules[i].<name> in the list form
        self._names: dict[int, str] = {}
        if isinstance(params, nn.Module):
            for name, p in params.named_parameters():
                self._names.setdefault(id(p), name)
        whitened: list[nn.Parameter] = []
        # an nn.MultiheadAttention's name is its in_proj unit's and the prefix of its out_proj's:
        # a fused_qkv regex naming the attention means the in_proj
        split = _fused_qkv_units(units + [u for u in plain if isinstance(u.module, nn.MultiheadAttention)], fused,
                                 dict(params.named_modules()) if isinstance(params, nn.Module) else {})
        # a packed in_proj known to be cross-attention, orthogonalised whole: no whitening serves it
        whole = [u for u in units if isinstance(u.adapter, PackedInputAdapter) and u.adapter.separate
                 and id(_weight(u)) not in split]
        for unit in whole:
            logger.info("%s.in_proj_weight: cross-attention orthogonalised whole (fused_qkv): Muon's step, "
                        "unwhitened", unit.name or "<root>")
        units = [u for u in units if u not in whole]
        plain = plain + whole
        # weights no hook can observe (nn.MultiheadAttention's out_proj): Muon's step, unwhitened
        self._plain = {id(_weight(u)) for u in plain}
        # packed in_proj weights -> their adapter, whose mode (one input, or one per part) the view follows
        self._packed = {id(_weight(u)): u.adapter for u in units if isinstance(u.adapter, PackedInputAdapter)}
        for unit in units + plain:
            weight = _weight(unit)
            if id(weight) not in self._views:
                packed = self._packed.get(id(weight))
                self._views[id(weight)] = MatrixView(weight, stacked=unit.index is not None,
                                                     transposed=unit.weight_transposed,
                                                     parts=3 if id(weight) in split else 1,
                                                     part_inputs=packed is not None and packed.separate)
                # an expert unit is named <module>.<weight>.<e>
                self._names.setdefault(id(weight), f"{unit.name}.{unit.params[0][0]}" if unit.index is None
                                       else unit.name.rsplit(".", 1)[0])
                whitened.append(weight)
        # where each weight lives, read once at the first step (_refuse_sharded_since_built)
        self._homes = [(unit.module, unit.params[0][0], _weight(unit)) for unit in units + plain]
        # a parametrization put on a whitened weight since is refused at every step (_refuse_parametrized)
        # (once per weight: a fused experts weight has a unit per expert)
        self._parametrizations = list({id(weight): (ParametrizationWatch(module), attr, weight)
                                       for module, attr, weight in self._homes}.values())
        self._homes_checked = False
        groups: list[dict[str, Any]] = [dict(params=whitened, algorithm=WHITENED)]
        if rest:
            groups.append(dict(params=rest, algorithm=ADAMW))
        if isinstance(params, nn.Module):  # named parameters: torch.optim keeps "param_names" per group,
            for group in groups:           # which FQN-keyed checkpoints (torchtitan, DCP) read
                group["params"] = [(self._names[id(p)], p) for p in group["params"]]
        # the stacks and whiteners change at each refresh, outside what a traced step can guard
        step_eagerly(WhitenedMuon, "WhitenedMuon's step runs eagerly: its stacked whiteners change at each "
                                   "refresh, outside what a traced step can guard")
        super().__init__(groups, defaults)
        self.process_group = process_group
        self._sharded = self._sharded_layout([(self._names[id(w)], w) for w in whitened], process_group)
        # the weights whitened on their output side: output_side="wide" -- those whose output (per
        # part of a fused projection, per expert) is wider than their input and observable (no
        # output side to pay for where the adapter delivers no output gradient: an attention's
        # projections); "auto" -- of those, the first layers of ungated MLPs
        outputs: frozenset[int] = frozenset()
        if self.output_side is True:
            outputs = frozenset(id(w) for w in whitened)
        elif self.output_side in ("wide", "auto"):
            outputs = frozenset(id(_weight(u)) for u in units if getattr(u.adapter, "delivers_output_grads", True)
                                and _wide_output(self._views[id(_weight(u))]))
        if self.output_side == "auto":  # the list form names no parent modules: no MLP to recognise
            parents = ({id(child): id(module) for module in params.modules() for child in module.children()}
                       if isinstance(params, nn.Module) else {})
            outputs = outputs & _ungated_mlp_inputs(units, self._views, parents)
        sides = ("input", "output") if outputs else ("input",)
        centered = {id(_weight(u)) for u in _centred_units(units, centring)}
        # The hooks reach the statistics, which must not keep the optimizer alive: an optimizer the
        # caller drops (an lr sweep on one model) is freed, and the finaliser removes its hooks.
        self._statistics = WhiteningStatistics(self.state, self._views, weakly(self._due, default=False),
                                               sides=sides, damping=damping, factor_decay=factor_decay,
                                               statistics_rows=statistics_rows,
                                               root=root, block_size=block_size, process_group=process_group,
                                               centered=centered, outputs=outputs, output_damping=output_damping)
        if block_size is not None:
            self._warn_undivided(whitened, block_size)
        self._check_ranks_agree(outputs, centered)
        # a packed in_proj's rows come in three slots once its parts read inputs of their own
        # (the query's, the key's, the value's), each its part's unit
        layers = [_CaptureLayer(unit.module, unit.adapter, slot,
                                UnitObserver(self._statistics, _weight(unit), index, unit.name), unit.name)
                  for unit in units
                  for slot, index in (((0, 0), (1, 1), (2, 2)) if isinstance(unit.adapter, PackedInputAdapter)
                                      else ((unit.slot, unit.index or 0),))]
        for adapter in self._packed.values():
            adapter.on_cross_attention = weakly(self._cross_attention, default=False)
        # packed in_proj weights taken for self-attention: a call that one rank reads as
        # cross-attention switches it there at once; the others follow at the next statistics step
        self._undecided_attention = [a.weight for a in self._packed.values() if not a.separate]
        if isinstance(params, nn.Module):
            refuse_fullgraph(params, [layer.module for layer in layers], "WhitenedMuon")
        self._capture = ActivationCapture(layers, accumulation_steps=1, loss_scale=loss_scale,
                                          before_write=lambda: None,
                                          output_grads=lambda layer: id(layer.method.param) in outputs)
        self._capture.collecting = True
        self._finalizer = weakref.finalize(self, self._capture.remove)
        self._finalizer.atexit = False
        self._reported: dict[int, int] = {}
        self._unobserved_warned: set[int] = set()
        self._eval_warned = False
        self._replica_warned = False
        self._iterations = AbandonedIterations(self._whitened_params)  # see zero_grad
        self._warned_pending_save = False  # see state_dict
        self._weight_growth = WeightGrowth("WhitenedMuon")
        self._steps = 0  # step() calls: the statistics schedule and the non-finite report's interval
        self._casts: dict[tuple[int, ...], tuple] = {}  # stacked whiteners in ns_dtype, per stack

    # the arguments' values, read back (torch.optim keeps per-group ones in param_groups)
    damping = property(lambda self: self._statistics.damping)
    output_damping = property(lambda self: self._output_damping)
    factor_decay = property(lambda self: self._statistics.factor_decay)
    statistics_rows = property(lambda self: self._statistics.statistics_rows)
    root = property(lambda self: self._statistics.root)
    block_size = property(lambda self: self._statistics.block_size)
    center_inputs = property(lambda self: self._center_inputs)
    fused_qkv = property(lambda self: self._fused_qkv)

    # -- construction ------------------------------------------------------------------
    @staticmethod
    def _check_adamw(lr, weight_decay, adamw_lr, betas, eps, adamw_weight_decay) -> dict[str, Any]:
        try:
            beta1, beta2 = betas
        except (TypeError, ValueError):
            raise TypeError(f"adamw_betas must be a pair of floats, got {betas!r}") from None
        for name, beta in (("adamw_betas[0]", beta1), ("adamw_betas[1]", beta2)):
            validation.check_unit_interval(name, beta, low_open=False, high_open=True)
        return dict(lr=lr if adamw_lr is None else validation.check_positive("adamw_lr", adamw_lr),
                    betas=(float(beta1), float(beta2)), eps=validation.check_positive("adamw_eps", eps),
                    weight_decay=weight_decay if adamw_weight_decay is None else
                    validation.check_non_negative("adamw_weight_decay", adamw_weight_decay))

    @staticmethod
    def _select(params, skip_layers) -> tuple[list[Selected], list[Selected], list[nn.Parameter]]:
        """(the units to whiten, the units stepped unwhitened, the parameters AdamW takes)."""
        if isinstance(params, nn.Module):
            refuse_fsdp1(params.named_parameters(), "WhitenedMuon")
            _refuse_lazy(params.named_modules())
            patterns = compile_skip_patterns(skip_layers)
            warn_unmatched_skips(params, patterns, "WhitenedMuon")

            def skipped(name: str, module: nn.Module) -> bool:
                return is_skipped(name, module, patterns)
            # model_attention_units takes nn.MultiheadAttention and its out_proj (and logs what it skips)
            attention_names = [n for name, m in params.named_modules() if isinstance(m, nn.MultiheadAttention)
                               for n in (name, f"{name}.out_proj" if name else "out_proj")]
            # weight_only: a frozen bias is AdamW's business, not the whitening's
            units = find_kfac_modules(params, skipped, logger.info, taken_elsewhere=attention_names,
                                      weight_only=True, owner="WhitenedMuon")
            attention, plain = model_attention_units(params, skipped, owners_of(params), logger.info)
            if attention:  # in the model's module order, as the adapters' units
                order = {id(m): i for i, m in enumerate(params.modules())}
                units = sorted(units + attention, key=lambda u: order[id(u.module)])
            if not units and not plain:
                raise ValueError(f"WhitenedMuon: no module of {type(params).__name__} can be whitened (nn.Linear, "
                                 f"HF Conv1D, convolutions, fused experts, nn.MultiheadAttention; see "
                                 f"register_adapter) with skip_layers={skip_layers!r}")
            taken = {id(_weight(u)) for u in units + plain}
            rest = [p for p in params.parameters() if p.requires_grad and id(p) not in taken]
            _refuse_complex(params.named_parameters())
            _refuse_sparse(params.named_modules())
            return units, plain, rest
        if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
            raise TypeError(f"WhitenedMuon: params must be an nn.Module (the model) or a list of modules, "
                            f"got {type(params).__name__}")
        if skip_layers not in ((), None, []):
            raise ValueError("WhitenedMuon: skip_layers applies to the model form (WhitenedMuon(model, ...)); "
                             "with a list of modules, leave the skipped ones out of the list")
        modules = list(params)
        if modules and not isinstance(modules[0], nn.Module) and isinstance(modules[0], (torch.Tensor, tuple, dict)):
            # model.parameters(), named_parameters() or torch.optim's param groups (what the
            # Hugging Face Trainer builds for optimizer_cls_and_kwargs): no module to hook
            raise TypeError(f"WhitenedMuon: modules[0] is a {type(modules[0]).__name__}, not a module. It reads "
                            f"each layer's inputs through hooks on its module: pass the model, "
                            f"WhitenedMuon(model, ...) (with the Hugging Face Trainer: optimizers=(WhitenedMuon("
                            f"model, ...), scheduler)), or a list of its modules")
        refuse_fsdp1(((f"modules[{i}].{n}", p) for i, m in enumerate(modules) if isinstance(m, nn.Module)
                      for n, p in m.named_parameters()), "WhitenedMuon")
        _refuse_lazy((f"modules[{i}]", m) for i, m in enumerate(modules) if isinstance(m, nn.Module))
        units, plain = _listed_units(modules)
        _refuse_complex((f"modules[{i}].{n}", p) for i, m in enumerate(modules) if isinstance(m, nn.Module)
                        for n, p in m.named_parameters())
        weights = [_weight(u) for u in units + plain if u.index is None or u.index == 0]
        if len({id(w) for w in weights}) != len(weights):
            raise ValueError("WhitenedMuon: a weight appears twice in modules (tied or repeated module)")
        return units, plain, []

    def _check_ranks_agree(self, outputs: frozenset[int], centered: set[int]) -> None:
        """Under several ranks, every rank must whiten the same weights with the same settings:
        another statistics interval would hang the statistics' all-reduce, another layout abort it,
        and another damping or lr let the ranks drift apart with no error. One all-gather at
        construction; a ``ValueError`` naming the settings that differ, on every rank."""
        group = self.process_group
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) <= 1:
            return
        names = self._names
        settings: dict[str, Any] = {
            name: repr(getattr(self, name)) for name in
            ("statistics_every", "damping", "output_damping", "factor_decay", "statistics_rows", "root",
             "block_size", "ns_steps", "ns_coefficients", "output_side", "center_inputs", "fused_qkv")}
        settings["ns_dtype"] = repr(self._ns_dtype)
        settings["whitened weights"] = [(names[id(p)], tuple(p.shape), self._views[id(p)].parts)
                                        for p in self._whitened_params()]
        settings["output sides"] = sorted(names[i] for i in outputs)
        settings["centred inputs"] = sorted(names[i] for i in centered)
        for index, group_settings in enumerate(self.param_groups):
            for key, value in group_settings.items():
                if key not in ("params", "param_names"):
                    settings[f"param_groups[{index}].{key}"] = repr(value)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, settings, group=group)
        keys = sorted({key for ranks in gathered for key in ranks})
        differing = [key for key in keys if any(ranks.get(key) != gathered[0].get(key) for ranks in gathered)]
        if differing:
            values = "; ".join(f"{key}: {[ranks.get(key) for ranks in gathered]}" for key in differing[:4])
            raise ValueError(f"WhitenedMuon: the ranks disagree on {', '.join(differing)} (by rank: {values}): "
                             "build the optimizer with the same model and settings on every rank")

    def _warn_undivided(self, whitened: list[nn.Parameter], block_size: int) -> None:
        """Names the sides wider than ``block_size`` that it does not divide: they are whitened
        whole, at the dense whitener's cost a blocked run is set to avoid."""
        undivided = []
        for weight in whitened:
            view = self._views[id(weight)]
            for side in self._statistics.sides_of(weight):
                width = view.part_shape[0] if side == "output" and view.parts > 1 else view.width(side)
                if width > block_size and self._statistics.blocks(width) == 1:
                    undivided.append(f"{self._names[id(weight)]!r} {side} ({width} wide)")
        if undivided:
            warnings.warn(f"WhitenedMuon: block_size={block_size} does not divide these sides, which are "
                          f"whitened whole: {', '.join(undivided)}; a block size that divides them blocks "
                          f"them too", UserWarning, stacklevel=3)

    @staticmethod
    def _sharded_layout(named: list[tuple[str, nn.Parameter]], process_group: Any) -> ShardedLayout | None:
        """The FSDP2 / HSDP mesh of the DTensor weights (``None`` when none is one); ``ValueError``
        names a weight with another placement or on another mesh."""
        if not any(is_dtensor(w) for _, w in named):
            return None
        world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        return ShardedLayout.detect(named, world)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's ``add_param_group``; ``"algorithm"`` says which half steps the group. A
        ``"whitened_muon"`` group may only hold weights this optimizer whitens (their statistics
        hooks are placed at construction). Without ``"algorithm"``, a group of such weights is
        ``"whitened_muon"`` and a group of none of them ``"adamw"`` (said by a warning: a callback
        that unfreezes a backbone frozen at construction adds its weights so). ``"params"`` may
        be any iterable (a generator too) of parameters or ``(name, parameter)`` pairs; the group
        follows the optimizer's naming (the model form keeps parameter names, as checkpoints
        keyed by names read them; a parameter of the model gets its own name)."""
        given = param_group["params"]
        given = [given] if isinstance(given, torch.Tensor) else list(given)  # a generator is read once, here
        pairs = [p if isinstance(p, tuple) else (None, p) for p in given]
        params = [p for _, p in pairs]
        unknown = [self._names.get(id(p), name or f"a parameter of shape {tuple(p.shape)}")
                   for name, p in pairs if id(p) not in self._views]
        algorithm = param_group.get("algorithm", ADAMW if params and len(unknown) == len(params) else WHITENED)
        if algorithm not in ALGORITHMS:
            raise ValueError(f"param group algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm == WHITENED and unknown:
            raise ValueError(f"WhitenedMuon: a 'whitened_muon' group may only hold the weights whitened since "
                             f"construction (their hooks are placed then); {', '.join(unknown)} are not: add them "
                             f"in a group of their own with 'algorithm': 'adamw', or build WhitenedMuon with them "
                             f"trainable to whiten them")
        if "algorithm" not in param_group and algorithm == ADAMW:
            warnings.warn(f"WhitenedMuon: the added group ({', '.join(unknown)}) holds no weight whitened since "
                          f"construction: AdamW steps it (pass 'algorithm': 'adamw' to say so; build WhitenedMuon "
                          f"with them trainable to whiten them)", UserWarning, stacklevel=2)
        param_group = dict(param_group, params=given, algorithm=algorithm)
        # torch.optim wants every group named or none: the first group (at construction) sets it
        named = ("param_names" in self.param_groups[0] if self.param_groups
                 else bool(pairs) and all(name is not None for name, _ in pairs))
        if named:
            index = len(self.param_groups)
            param_group["params"] = [(name if name is not None else
                                      self._names.setdefault(id(p), f"param_groups.{index}.{i}"), p)
                                     for i, (name, p) in enumerate(pairs)]
        else:
            param_group["params"] = params
        param_group.pop("param_names", None)
        if algorithm == ADAMW:
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
        super().add_param_group(param_group)
        if algorithm == ADAMW:
            for key in ("momentum", "nesterov", "adjust_lr_fn"):  # Muon's settings, filled in by torch.optim
                self.param_groups[-1].pop(key, None)

    @property
    def ns_dtype(self) -> torch.dtype:
        """The dtype of the Newton-Schulz iteration: ``ns_dtype`` as given, or the default for
        the whitened weights' device (:func:`native_ns_dtype`)."""
        if self._ns_dtype is not None:
            return self._ns_dtype
        first = next((g["params"][0] for g in self.param_groups if g["algorithm"] == WHITENED and g["params"]), None)
        return native_ns_dtype(torch.device("cpu") if first is None else first.device)

    # -- the step ----------------------------------------------------------------------
    def _due(self, weight: torch.Tensor) -> bool:
        """Whether this step gathers (and refreshes) ``weight``'s statistics: every
        ``statistics_every``-th step of the optimizer, for every weight that trains. One count
        for all weights: a weight that misses steps (an expert no token reached) stays in phase
        with the rest, so the hooks collect on one step in ``statistics_every``; a frozen one
        costs no products."""
        return weight.requires_grad and id(weight) not in self._plain and self._statistics_step()

    def _statistics_step(self) -> bool:
        return self._steps % self.statistics_every == 0

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every parameter with a gradient; refreshes the whiteners on statistics steps.
        Under ``torch.compile`` it runs eagerly (a graph break)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with autocast_disabled():  # a step called inside an autocast region: still in ns_dtype / float32
            creating = not self.state and stepped_by_torchs_state_dict_api()
            self._step()
            if creating:
                self._uncount_state_creation()
        return loss

    def _uncount_state_creation(self) -> None:
        """After torch's call that only creates the state entries (a step at lr 0 with zero
        gradients, :func:`~kron_precond.checkpoint.stepped_by_torchs_state_dict_api`): the
        entries stay, at step 0, and nothing is counted, so the first training step is the
        first step (the statistics schedule and AdamW's bias correction in phase)."""
        self._steps = 0
        for state in self.state.values():
            if "step" in state:
                state["step"] = 0
        self._capture.collecting = self._statistics_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's ``zero_grad``. If a backward wrote gradients since the last one and no
        ``step()`` came (a ``GradScaler`` skipped it: ``scaler.step(optimizer)`` calls nothing on
        an overflow), that iteration was abandoned: the statistics it gathered are dropped, so
        the next step's whiteners do not see them. A second ``zero_grad`` with no backward in
        between drops nothing."""
        if self._iterations.abandoned():
            self._statistics.discard()
        super().zero_grad(set_to_none=set_to_none)
        self._iterations.zeroed()

    def _whitened_params(self) -> list[nn.Parameter]:
        return [p for g in self.param_groups if g["algorithm"] == WHITENED for p in g["params"]]

    def _step(self) -> None:
        if not self._homes_checked:
            self._refuse_sharded_since_built()
            self._homes_checked = True
        self._refuse_parametrized()
        for index, group in enumerate(self.param_groups):  # a value set since: checked before anything moves
            _check_group(index, group)
            if group["algorithm"] == WHITENED:
                self._check_known(index, group["params"])
            sparse = [i for i, p in enumerate(group["params"]) if p.grad is not None and p.grad.is_sparse]
            if sparse:
                raise TypeError(f"WhitenedMuon does not support sparse gradients: param group {index}, entries "
                                f"{sparse} ({', '.join(self._names.get(id(group['params'][i]), '?') for i in sparse)})")
        if not any(p.grad is not None for group in self.param_groups for p in group["params"]):
            # no gradient at all: a trainer's skipped iteration (Lightning's training_step returning
            # None steps without a backward), no step -- its forwards' rows dropped, nothing counted
            self._statistics.discard()
            return
        if self._steps % WEIGHT_CHECK_EVERY == 0:  # before the step: the first check reads the initial weights
            self._weight_growth.check([(self._names.get(id(p), f"parameter {i}"), p)
                                       for i, p in enumerate(self._whitened_params())])
        if self._statistics_step():
            self._agree_on_cross_attention()
        # a forward in eval() mode since the last step (the hooks flag it on statistics steps only)
        eval_forward, self._capture.eval_forward = self._capture.eval_forward, False
        replica_forward, self._capture.replica_forward = self._capture.replica_forward, False
        due = [p for p in self._whitened_params() if p.grad is not None and self._due(p)]
        if due:
            self._warn_unobserved(due, eval_forward, replica_forward)
            self._statistics.refresh(due)
            self._casts.clear()
        if self._statistics.pending:  # rows of a weight with no gradient fed no step (a backward
            # reached its output but not it, as torch.autograd.grad with respect to the inputs does)
            self._statistics.drop_pending({id(p) for p in self._whitened_params() if p.grad is None})
        self._statistics.forget_inputs()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == ADAMW:
                self._adamw_step(params, group)
                continue
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                    state["nonfinite_steps"] = torch.zeros((), dtype=torch.int64, device=p.grad.device)
            # Weights of one layout step as one stack: a fixed number of ops per layout, not per layer.
            stacks: dict[tuple, list[nn.Parameter]] = {}
            for p in params:
                stacks.setdefault(self._layout(p), []).append(p)
            for members in stacks.values():
                self._step_stack(members, group)
                for p in members:
                    # the optimizer's step() count after this step, not the weight's own: steps
                    # without a whitened gradient (a head-only phase) count too, so a resumed
                    # statistics schedule stays in phase (load_state_dict reads the latest)
                    self.state[p]["step"] = self._steps + 1
        self._steps += 1
        self._iterations.stepped()
        self._capture.collecting = self._statistics_step()
        if (self._steps - 1) % self.nonfinite_warn_interval == 0:
            self._report_nonfinite()
        self._report_unfrozen()  # every step: host-side checks only, none once each is said

    def _warn_unobserved(self, due: list[nn.Parameter], eval_forward: bool, replica_forward: bool = False) -> None:
        """A weight with a gradient whose module never delivered rows is applied outside its
        module's forward (e.g. a functional call): it is stepped as plain Muon. Said once. A
        statistics step whose forwards all ran in ``eval()`` mode, or in replicas of the model
        (``nn.DataParallel``), gathers nothing: said once too."""
        if not self._statistics.observed_this_step:  # no training forward (e.g. a state-initialising step)
            if replica_forward and not self._replica_warned:
                self._replica_warned = True
                warnings.warn("WhitenedMuon: the model ran forward as replicas of itself (nn.DataParallel, which "
                              "Hugging Face's Trainer uses on several GPUs without torchrun), whose hooks gather no "
                              "whitening statistics: every weight takes Muon's step with the identity whitener. "
                              "Use DistributedDataParallel (launch with torchrun)", RuntimeWarning,
                              stacklevel=6)  # the caller of step()
            if eval_forward and not self._eval_warned:
                self._eval_warned = True
                names = ", ".join(self._names[id(p)] for p in due)
                warnings.warn(f"WhitenedMuon: the model ran forward in eval() mode and never in training mode "
                              f"before this statistics step. Whitening statistics are gathered in training mode "
                              f"only (so that validation passes stay out of them): {names} took Muon's step with "
                              f"the whiteners of the last training-mode statistics (the identity if none). Call "
                              f"model.train() before the training forward (set dropout's p to 0 to turn it off)",
                              RuntimeWarning, stacklevel=6)  # the caller of step()
            return
        missing = [p for p in due if id(p) not in self._statistics.observed and id(p) not in self._unobserved_warned]
        if missing:
            self._unobserved_warned.update(id(p) for p in missing)
            names = ", ".join(self._names[id(p)] for p in missing)
            warnings.warn(f"WhitenedMuon: {names} had a gradient but its module's forward never ran in training "
                          "mode with grad enabled; it is stepped as plain Muon (identity whitener)",
                          RuntimeWarning, stacklevel=6)  # the caller of step()

    def _listed(self, weights: list[nn.Parameter]) -> str:
        """The names of ``weights`` for a message: the first four, quoted."""
        return ", ".join(repr(self._names[id(w)]) for w in weights[:4]) + (", ..." if len(weights) > 4 else "")

    def _refuse_sharded_since_built(self) -> None:
        """At the first step, before anything changes: ``RuntimeError`` if ``fully_shard(model)``
        replaced whitened weights with DTensors since this optimizer was built. Its param groups,
        statistics hooks, views and whiteners belong to the weights of construction, which get no
        gradient any more: it would step nothing, silently. A module attribute read per weight,
        once (the first step only: no cost on later steps)."""
        replaced = [w for module, attr, w in self._homes if not is_dtensor(w) and is_dtensor(getattr(module, attr, w))]
        if replaced:
            names = self._listed(replaced)
            raise RuntimeError(
                f"WhitenedMuon: fully_shard(model) replaced {names} with DTensor parameters after WhitenedMuon was "
                f"built. Its param groups, statistics hooks and whiteners hold the old weights, which no gradient "
                f"reaches any more (re-mapping the param groups, as Accelerate's prepare() does, does not move the "
                f"rest): it would not update them. Nothing was changed: build WhitenedMuon after fully_shard(model)")

    def _refuse_parametrized(self) -> None:
        """``RuntimeError``, before anything changes, for whitened weights given a
        ``torch.nn.utils.parametrize`` parametrization since this optimizer was built: the
        weight is then computed from ``parametrizations.<name>.original``, and whitening the
        original's gradient by the module's inputs is a step in the wrong geometry (built after,
        the original is an AdamW parameter). One class identity test per weight and step."""
        found = [weight for watch, attr, weight in self._parametrizations if watch.since((attr,))]
        if found:
            names = self._listed(found)
            raise RuntimeError(
                f"WhitenedMuon: {names} were reparametrized (torch.nn.utils.parametrize) after WhitenedMuon was "
                f"built: each is now computed from parametrizations.<name>.original, whose gradient is not the "
                f"weight's, so whitening it by the module's inputs would step in the wrong geometry. Nothing was "
                f"changed: parametrize before building WhitenedMuon (the original is then stepped by AdamW), or "
                f"remove the parametrization")

    def _check_known(self, index: int, params: list[nn.Parameter]) -> None:
        """``RuntimeError`` for a whitened group's parameter this optimizer was not built on: its
        hooks, views and whiteners belong to the parameters of construction."""
        unknown = [i for i, p in enumerate(params) if id(p) not in self._views]
        if unknown:
            raise RuntimeError(
                f"WhitenedMuon: param group {index} holds a parameter that is not one it was built on "
                f"(entries {unknown}, shapes {[tuple(params[i].shape) for i in unknown]}). Something replaced the "
                f"model's parameters after the optimizer was built (Accelerate's prepare() with FSDP2 swaps each "
                f"for its sharded copy; fully_shard or a .to_empty() of its own): the statistics hooks and the "
                f"whiteners stay on the old ones. Build WhitenedMuon on the model once it is sharded, after "
                f"the wrapper has replaced its parameters")

    def _agree_on_cross_attention(self) -> None:
        """On a statistics step under several ranks: a packed attention that any rank read as
        cross-attention since the last one is cross-attention on every rank, so that every rank
        takes the same path into the statistics' all-reduce (one small all-reduce and a host read
        per statistics step, while a packed attention is still taken for self-attention)."""
        undecided = self._undecided_attention
        if not undecided or not several_ranks(self.process_group):
            return
        seen = any_rank([self._packed[id(w)].cross_seen for w in undecided], undecided[0].device,
                        self.process_group)
        for weight, cross in zip(undecided, seen):
            adapter = self._packed[id(weight)]
            if cross and not adapter.cross_seen:  # another rank's call: this rank follows
                adapter.cross_seen = True
                self._cross_attention(weight, adapter.name)
        self._undecided_attention = [w for w, cross in zip(undecided, seen) if not cross]

    def _cross_attention(self, weight: torch.Tensor, name: str) -> bool:
        """An ``nn.MultiheadAttention``'s packed ``in_proj_weight`` called as cross-attention:
        its parts read different inputs. Stepped as three parts, each is whitened from now on by
        its own input (``True``: the call's rows are taken so). Orthogonalised whole, no
        whitening serves the three: it takes Muon's step unwhitened from now on (``False``),
        said once. Either way its statistics so far are dropped."""
        if id(weight) in self._plain:
            return False
        if self._views[id(weight)].parts == 3:
            self._set_part_inputs(weight, True)
            return True
        self._plain.add(id(weight))
        self._drop_statistics(weight, ("input", "output"))
        warnings.warn(f"WhitenedMuon: nn.MultiheadAttention {name!r} is called as cross-attention (a key or value "
                      f"other than its query) and its in_proj_weight is orthogonalised whole (fused_qkv): one "
                      f"whitener cannot serve its query, key and value projections, which read different inputs, "
                      f"so it takes Muon's step unwhitened from here on. Leave fused_qkv at its default (the three "
                      f"parts stepped each, each whitened by its own input) to whiten it", UserWarning, stacklevel=2)
        return False

    def _settle_attention(self, loaded: dict[nn.Parameter, bool]) -> None:
        """After a load (the same checkpoint on every rank): the packed in_proj weights it set to
        one input per part are agreed cross-attention; those it set back to one input are taken
        for self-attention again, and a call that reads otherwise is agreed on anew. Weights
        without saved input statistics keep their standing."""
        undecided = {id(w) for w in self._undecided_attention}
        for p, on in loaded.items():
            self._packed[id(p)].cross_seen = on
            if on:
                undecided.discard(id(p))
            elif id(p) not in self._plain:
                undecided.add(id(p))
        self._undecided_attention = [a.weight for a in self._packed.values() if id(a.weight) in undecided]

    def _set_part_inputs(self, weight: torch.Tensor, on: bool) -> None:
        """A packed in_proj's input side as one factor (self-attention) or one per part
        (cross-attention); the side's statistics so far are dropped when it changes."""
        view, adapter = self._views[id(weight)], self._packed[id(weight)]
        if view.part_inputs != on:
            # rows read as self-attention are the query's, the key's and the value's alike: the
            # pending ones carry over to each part (a rank that follows another's call then sums
            # what one process gathering both calls would)
            pending = self._statistics.pending.get((id(weight), "input")) if on else None
            self._drop_statistics(weight, ("input",))
            if pending is not None:
                self._statistics.pending[(id(weight), "input")] = [t.expand(3, *t.shape[1:]).clone() for t in pending]
        view.part_inputs = adapter.separate = on

    def _drop_statistics(self, weight: torch.Tensor, sides: tuple[str, ...]) -> None:
        # .get: an entry made empty would stand for state this weight does not have
        state = self.state.get(weight, {})
        for key in [k for k in state if k.startswith(tuple(f"{side}_" for side in sides))]:
            del state[key]
        for side in sides:
            self._statistics.pending.pop((id(weight), side), None)
        self._casts.clear()

    def _layout(self, p: nn.Parameter) -> tuple:
        state, view = self.state[p], self._views[id(p)]
        sides = tuple(None if state.get(f"{side}_whitener") is None else tuple(state[f"{side}_whitener"].shape)
                      for side in ("input", "output"))
        return (tuple(p.shape), view.units, view.transposed, view.parts, p.dtype, p.device, sides,
                self._is_sharded(p))

    def _is_sharded(self, p: nn.Parameter) -> bool:
        return self._sharded is not None and self._sharded.is_sharded(p)

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._sharded is None else self._sharded.local(tensor)  # a DTensor's piece

    def _gather_rows(self, local: torch.Tensor, rows: int) -> torch.Tensor:
        """The full ``[n, rows, ...]`` stack from every shard's ``[n, rows_here, ...]`` (FSDP2's
        ``Shard(0)`` split: ``ceil(rows / S)`` per rank, padded on the wire): one all-gather."""
        layout = self._sharded
        assert layout is not None
        chunk = layout.chunk(rows)
        padded = local.new_zeros(local.shape[0], chunk, *local.shape[2:])
        padded[:, :local.shape[1]] = local
        pieces = [torch.empty_like(padded) for _ in range(layout.shard_size)]
        dist.all_gather(pieces, padded, group=layout.shard_group)
        return torch.cat(pieces, dim=1)[:, :rows]

    def _step_stack(self, params: list[nn.Parameter], group: dict[str, Any]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        states = [self.state[p] for p in params]
        view = self._views[id(params[0])]
        sharded = self._is_sharded(params[0])
        # FSDP2 / HSDP: the momentum lives in each rank's rows of the weight; only the update
        # that goes into msign is gathered whole (one all-gather per stack).
        grads = torch.stack([self._local(_grad(p)) for p in params])
        # A gradient whose norm is not finite (a NaN, an Inf, or an overflow) leaves its weight,
        # its momentum and its weight decay as they were. The norm is taken in float32 at least:
        # a float16 gradient of finite entries can have a norm beyond float16's range. Fused
        # experts are judged expert by expert, as Linears of their own would be, and an expert
        # whose slice is all zeros (the router sent it no token: a Linear of its own would have
        # no gradient) is left as it was too, rather than stepped from its stale momentum.
        wide = torch.promote_types(grads.dtype, torch.float32)
        experts = bool(view.state_units)
        rows = grads.flatten(2) if experts else grads.flatten(1)[:, None]  # [weights, units, -1]
        norms = torch.linalg.vector_norm(rows, dim=2, dtype=wide)
        if sharded and not experts:  # the whole gradient's: its shards' sums of squares, summed over the shards
            assert self._sharded is not None
            squares = norms.square()
            dist.all_reduce(squares, group=self._sharded.shard_group)
            finite = torch.isfinite(squares)
        else:  # a sharded experts weight is split between experts: each rank judges its own whole
            finite = torch.isfinite(norms)
        moves = finite & (norms > 0) if experts else finite
        nonfinite = ~finite.all(dim=1)  # a step with any expert's gradient not finite counts once
        if sharded and experts:  # the count is the weight's: the same on every rank
            assert self._sharded is not None
            counted = nonfinite.to(torch.int32)
            dist.all_reduce(counted, op=dist.ReduceOp.MAX, group=self._sharded.shard_group)
            nonfinite = counted > 0
        # [weights, units] -> a mask of the gradient's shape, and one factor per weight (0-dim) or expert
        mask = moves.reshape(*moves.shape[:1 + experts], *[1] * (grads.dim() - 1 - experts))
        per_weight = moves.reshape(moves.shape[0], *moves.shape[1:] if experts else ())
        unit_shape = (-1, *[1] * (grads.dim() - 2)) if experts else ()
        # Every pass below is over the whole stack and bound by memory traffic, so each is in
        # place where it can be: a non-finite gradient is replaced by its momentum, which the
        # lerp then leaves exactly as it was, and its step is multiplied by 0 below (its
        # direction is finite: the momentum's).
        buffers = [self._local(s["momentum_buffer"]) for s in states]
        stacked = torch.stack(buffers)
        torch.where(mask, grads, stacked, out=grads)
        stacked.lerp_(grads, 1 - momentum)
        torch._foreach_copy_(buffers, list(stacked.unbind()))
        update = grads.lerp_(stacked, momentum) if group["nesterov"] else stacked
        full_shape = params[0].shape
        if sharded:
            update = self._gather_rows(update, full_shape[0])
        left, right = self._stacked_whiteners(params)
        matrices = view.matrices(update)
        if view.parts > 1:  # a fused projection: its parts as matrices of their own (cast first, as
            # _direction would: the reshape copies a transposed view, and in ns_dtype copies half the bytes)
            matrices = matrices.to(self.ns_dtype).reshape(-1, *view.part_shape)
        direction = view.tensors(self._direction(matrices, left, right).reshape(-1, *view.shape), full_shape)
        if sharded:
            assert self._sharded is not None
            start, stop = self._sharded.rows(full_shape[0])
            direction = direction[:, start:stop]
        # -lr·ratio per weight, 0 where the gradient was not finite (no host read); on float32
        # weights the 0-dim factor rounds as add_'s alpha does (torch.optim.Muon's step, tested bitwise)
        coefficient = per_weight.to(wide) * -(lr * lr_ratio(group["adjust_lr_fn"], view.part_shape))
        decay = None
        if group["weight_decay"]:  # a multiply by 1 is a pass for nothing
            decay = torch.where(per_weight, torch.full(per_weight.shape, 1 - lr * group["weight_decay"],
                                                       dtype=wide, device=per_weight.device), 1.0)
        for i, p in enumerate(params):
            weight = self._local(p)
            if decay is not None:
                weight.mul_(decay[i].reshape(unit_shape))
            # per expert: the factor in the weight's dtype, as the 0-dim one enters addcmul_ (bitwise
            # a Linear's step on bfloat16 weights; a multiply, as the decay's, reads it in float32)
            weight.addcmul_(direction[i], coefficient[i].reshape(unit_shape).to(weight.dtype) if experts
                            else coefficient[i])
        torch._foreach_add_([s["nonfinite_steps"] for s in states], list(nonfinite.long().unbind()))

    def _stacked_whiteners(self, params: list[nn.Parameter]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(output, input) whiteners of ``params``' matrices stacked ``[n·k, blocks, b, b]`` in
        ``ns_dtype`` (a fused projection's: per part, ``[n·k·parts, ...]``, the input whitener
        shared by its parts); built once per refresh (the whitening's result is rounded to it anyway)."""
        key = tuple(id(p) for p in params)
        cached = self._casts.get(key)
        if cached is None:
            parts = self._views[id(params[0])].parts
            stacked = [None if self.state[params[0]].get(f"{side}_whitener") is None else
                       torch.cat([w.reshape(-1, *w.shape[-3:]) for w in
                                  (self.state[p][f"{side}_whitener"] for p in params)]).to(self.ns_dtype)
                       for side in ("output", "input")]
            left, right = stacked
            if parts > 1:
                left = None if left is None else left.reshape(-1, left.shape[1] // parts, *left.shape[2:])
                if right is not None and not self._views[id(params[0])].part_inputs:  # one input for every part
                    right = right.repeat_interleave(parts, dim=0)
            cached = self._casts[key] = (left, right)
        return cached

    def _direction(self, update: torch.Tensor, left: torch.Tensor | None, right: torch.Tensor | None) -> torch.Tensor:
        """``Lᵀ msign(L M Rᵀ) R`` rescaled to ``||msign(L M Rᵀ)||_F``, for a stack ``[k, out, in]``
        with ``L``, ``R`` the output- and input-side whiteners (block-diagonal ``[k, blocks, b, b]``;
        either may be absent), in ``ns_dtype``."""
        update = update.to(self.ns_dtype)
        ortho = msign(self._whiten(update, left, right, transpose=True), self.ns_steps, dtype=self.ns_dtype,
                      coefficients=self.ns_coefficients)
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
        """``L X Rᵀ`` (``transpose``) or ``Lᵀ X R`` for a stack ``X = [k, out, in]``, block by block.

        One block is a ``bmm``, never ``@``: on a stack of one (a weight with no twin of its shape)
        ``@`` folds the batch away and, with a transposed bfloat16 operand, takes a CPU kernel
        4-5x slower than ``bmm``'s and rounding otherwise, so a weight's step would depend on
        how many weights share its shape."""
        k, out_dim, in_dim = matrix.shape
        if right is not None:
            r = right.to(matrix.dtype)
            if r.shape[1] == 1:  # one block: a batched matmul
                matrix = torch.bmm(matrix, r[:, 0].mT if transpose else r[:, 0])
            else:
                x = matrix.reshape(k, out_dim, r.shape[1], -1)
                x = torch.einsum("kojb,kjcb->kojc" if transpose else "kojb,kjbc->kojc", x, r)
                matrix = x.reshape(k, out_dim, in_dim)
        if left is not None:
            g = left.to(matrix.dtype)
            if g.shape[1] == 1:
                matrix = torch.bmm(g[:, 0] if transpose else g[:, 0].mT, matrix)
            else:
                x = matrix.reshape(k, g.shape[1], -1, in_dim)
                x = torch.einsum("kjcb,kjbi->kjci" if transpose else "kjbc,kjbi->kjci", g, x)
                matrix = x.reshape(k, out_dim, in_dim)
        return matrix

    def _adamw_step(self, params: list[nn.Parameter], group: dict[str, Any]) -> None:
        """``torch.optim.AdamW``'s step (its single-tensor arithmetic, bitwise), batched over the
        parameters that share a step count; the count is a Python int (no host read)."""
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        by_step: dict[int, list[nn.Parameter]] = {}
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = int(state["step"]) + 1
            by_step.setdefault(state["step"], []).append(p)
        for step, members in by_step.items():
            weights = [self._local(p) for p in members]
            grads = [self._local(_grad(p)) for p in members]
            exp_avgs = [self._local(self.state[p]["exp_avg"]) for p in members]
            exp_avg_sqs = [self._local(self.state[p]["exp_avg_sq"]) for p in members]
            if wd != 0:
                self._scale(weights, 1 - lr * wd)
            torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
            self._scale(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            step_size = lr / (1 - beta1 ** step)
            denom = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_div_(denom, (1 - beta2 ** step) ** 0.5)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(weights, exp_avgs, denom, value=-step_size)

    @staticmethod
    def _scale(tensors: list[torch.Tensor], factor: float) -> None:
        """``t.mul_(factor)`` for each tensor, as torch.optim.AdamW's single-tensor step: in
        float32 or wider, the product rounded once. ``torch._foreach_mul_`` matches it on float32
        and float64 tensors; on narrower ones it first rounds ``factor`` to their dtype
        (bfloat16(0.99) is 0.98828125, bfloat16(0.999) is 1), so those take ``mul_`` one by one."""
        narrow = [t for t in tensors if t.element_size() < 4]
        if len(narrow) < len(tensors):
            torch._foreach_mul_([t for t in tensors if t.element_size() >= 4], factor)
        for t in narrow:
            t.mul_(factor)

    def _report_nonfinite(self) -> None:
        lines = [f"{self._names.get(id(p), f'parameter {i}')} (shape {tuple(p.shape)}): {new} step(s)"
                 for i, p, new, _ in new_nonfinite_steps(self, self._reported)]
        if lines:
            warnings.warn("WhitenedMuon: non-finite gradients; those steps left these weights and their "
                          "momentum unchanged: " + "; ".join(lines), RuntimeWarning,
                          stacklevel=6)  # the caller of step()

    def _report_unfrozen(self) -> None:
        """Parameters frozen when the optimizer was built, in no param group, that now have a
        gradient: nothing steps them. Said once."""
        if not any(p.grad is not None for _, p in self._frozen_at_build):
            return
        grouped = {id(p) for g in self.param_groups for p in g["params"]}
        unfrozen = [(n, p) for n, p in self._frozen_at_build if p.grad is not None and id(p) not in grouped]
        gone = grouped | {id(p) for _, p in unfrozen}  # said once, or stepped by a group now
        self._frozen_at_build = [(n, p) for n, p in self._frozen_at_build if id(p) not in gone]
        if unfrozen:
            warnings.warn(f"WhitenedMuon: {', '.join(n for n, _ in unfrozen)} have gradients but were frozen "
                          f"(requires_grad=False) when the optimizer was built, so they are in no param group and "
                          f"nothing steps them. Build WhitenedMuon after unfreezing them (a weight can only be "
                          f"whitened if its hooks were placed at construction), or add them with "
                          f"add_param_group({{'params': [...], 'algorithm': 'adamw'}})",
                          RuntimeWarning, stacklevel=6)  # the caller of step()

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch.optim's ``state_dict``, each whitened weight's ``step`` saved as the optimizer's
        ``step()`` count (in the running optimizer it is the count when that weight last stepped):
        the statistics schedule's clock, which the load resumes from, so steps on which no
        whitened weight had a gradient (a head-only phase) count too. Every parameter that trains
        has an entry: one that has not stepped is saved as its first step starts (zero moments,
        the count in ``step``, factors no refresh has measured; :meth:`_fresh_entries`). The
        count travels in ``step``, an entry every checkpoint has, rather than in a key of its
        own: torch.distributed.checkpoint's templates refuse a checkpoint without one of their
        keys, and torchtitan's flat state keeps only the keys the live optimizer has. The
        ``register_state_dict_post_hook`` hooks see the state dict as saved."""
        if self._statistics.pending and not self._warned_pending_save:
            self._warned_pending_save = True
            warnings.warn("WhitenedMuon: a checkpoint was taken inside an unfinished accumulation window: the input "
                          "rows its forwards gathered since the last step() are not in it, so a run resumed from "
                          "it goes on without those micro-batches. Save between step() (or zero_grad()) and the "
                          "next forward (after a step a GradScaler skipped, zero_grad() drops them anyway: then ignore "
                          "this)", UserWarning, stacklevel=user_stacklevel())
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = OrderedDict()  # run below, on the state dict as saved
        try:
            state_dict = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        saved = state_dict["state"]
        whitened = [(key, p) for packed, group in zip(state_dict["param_groups"], self.param_groups)
                    if group["algorithm"] == WHITENED for key, p in zip(packed["params"], group["params"])]
        stepped = [key for key, _ in whitened if "step" in saved.get(key, {})]
        for key in stepped:
            saved[key] = {**saved[key], "step": self._steps}  # a copy: the live entry keeps its own
        for packed, group in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(packed["params"], group["params"]):
                fresh = self._fresh_entries(p, group["algorithm"], saved.get(key, {})) if p.requires_grad else {}
                if fresh:
                    saved[key] = {**saved.get(key, {}), **fresh}
        for post_hook in post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def _fresh_entries(self, p: nn.Parameter, algorithm: str, entry: dict[str, Any]) -> dict[str, Any]:
        """The entries ``p``'s saved state lacks, as a parameter that has not stepped (or whose
        side no refresh has measured yet) starts from: a checkpoint holds every entry of every
        parameter that trains, as the template torch.distributed.checkpoint loads into does
        (torch's initialising step gives each one), so DCP resumes a run saved before a weight's
        first gradient (a branch not taken yet). They load as a parameter that has not stepped
        (:meth:`_checked_state`): AdamW's as no state, a whitened weight's unmeasured sides as none."""
        if algorithm == ADAMW:
            if "exp_avg" in entry:
                return {}
            return {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        fresh: dict[str, Any] = {}
        if "momentum_buffer" not in entry:
            fresh.update(step=self._steps, momentum_buffer=torch.zeros_like(p),
                         nonfinite_steps=torch.zeros((), dtype=torch.int64, device=p.device))
        shapes = self._state_shapes(p, algorithm)
        dtype = torch.promote_types(p.dtype, torch.float32)
        for side in self._statistics.sides_of(p):
            if f"{side}_factor" in entry:
                continue
            square = shapes[f"{side}_factor"]
            fresh[f"{side}_factor"] = torch.zeros(square, dtype=dtype, device=p.device)
            fresh[f"{side}_seen"] = torch.zeros(shapes[f"{side}_seen"], dtype=dtype, device=p.device)
            # what a refresh without rows makes: the identity
            fresh[f"{side}_whitener"] = torch.eye(square[-1], dtype=dtype, device=p.device).expand(square).clone()
        return fresh

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch.optim's load, all or nothing: a checkpoint that does not fit this optimizer (param
        groups of other algorithms or sizes, a state tensor of another shape -- another model,
        another ``block_size`` --, a factor, whitener or moment that is not finite, a setting the
        step cannot use) raises ``ValueError`` naming it and changes nothing. A checkpoint's
        output side is not loaded for the weights this optimizer does not whiten on that side
        (every weight without ``output_side``; all but those it chooses with ``"wide"`` or
        ``"auto"``).
        Factors, whiteners and counters keep their saved dtype and values (torch.optim's load
        would cast them to each parameter's dtype, e.g. bfloat16).
        On a sharded (FSDP2 / HSDP) model over several ranks it is a collective (as
        ``set_optimizer_state_dict`` and ``dcp.load`` are): call it on every rank. Each rank
        checks its own shards of the moments, and the ranks agree on the outcome before
        anything changes: a state rejected on any rank raises ``ValueError`` on every rank
        (naming the ranks that rejected it, and on those ranks why), and no rank loads it."""
        # the moments of a sharded model are DTensors, each rank checking its own shards: the
        # outcome may differ by rank and is agreed on (the same test on every rank: the weights')
        per_rank = self._sharded is not None and several_ranks(self.process_group)
        error: Exception | None = None
        try:
            # torch.optim's order: the pre-hooks adapt the checkpoint first, then it is checked
            state_dict = run_load_pre_hooks(self, state_dict)
            kept, exact, part_inputs = self._checked_load(state_dict)
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            if not per_rank:
                raise
            error = err
        if per_rank:
            # before anything changes: one small all-gather, entered by every rank
            device = self._whitened_params()[0].device  # a sharded weight's (the mesh's device)
            failed = failed_ranks(error is not None, device, self.process_group)
            if failed:
                reason = ("see the error raised there" if error is None else
                          f"on this rank ({dist.get_rank(self.process_group)}): "
                          f"{error if isinstance(error, ValueError) else f'{type(error).__name__}: {error}'}")
                raise ValueError(f"WhitenedMuon.load_state_dict: the state was rejected on rank(s) {failed} (each "
                                 f"rank checks its own shards of the sharded state); no rank loaded it; "
                                 f"{reason}") from error
        settings = [{k: v for k, v in group.items() if k not in ("params", "param_names")}
                    for group in self.param_groups]
        for p, on in part_inputs.items():  # a packed in_proj resumes as saved: one input, or one per part
            self._set_part_inputs(p, on)
        self._settle_attention(part_inputs)
        hooks = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()  # ran above
        self._optimizer_load_state_dict_post_hooks = OrderedDict()  # run below, once the load is whole
        try:
            super().load_state_dict({**state_dict, "state": kept})
        finally:
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = hooks
        for group, ours_before in zip(self.param_groups, settings):
            # a checkpoint from before a setting existed: stepped by the default (adjust_lr_fn) or,
            # for any other setting it lacks, by this optimizer's value (as torch.optim's
            # __setstate__ fills the settings an old optimizer did not have)
            if group["algorithm"] == WHITENED:
                group.setdefault("adjust_lr_fn", "match_rms_adamw")
            for setting, value in ours_before.items():
                group.setdefault(setting, value)
        self._statistics.state = self.state  # torch.optim's load puts a new state dict in place
        self._casts.clear()
        for p, values in exact.items():
            for key, value in values.items():
                # factors and whiteners in the dtype this optimizer makes them in (the parameter's,
                # float32 or wider: a checkpoint of a float64 run loads into a float32 model)
                dtype = value.dtype if key == "nonfinite_steps" else torch.promote_types(p.dtype, torch.float32)
                self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)
        # the statistics schedule resumes from the latest clock a whitened weight holds: its saved
        # "step" is the optimizer's step() count at the save (earlier checkpoints: when it last
        # stepped, or the count of its own steps, which is that clock for a weight with a gradient
        # on every step). .get: an empty entry would make the state look initialised
        self._steps = max((int(self.state.get(p, {}).get("step", 0)) for p in self._whitened_params()), default=0)
        # statistics gathered since the last step belong to a batch the load discards (a rollback)
        self._statistics.discard()
        self._capture.collecting = self._statistics_step()
        # the loaded counters were reported by the run that saved them: report what comes after
        self._reported.clear()
        new_nonfinite_steps(self, self._reported)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _checked_load(self, state_dict: dict[str, Any]) -> tuple[dict, dict[nn.Parameter, dict],
                                                                 dict[nn.Parameter, bool]]:
        """:meth:`load_state_dict`'s checks, changing nothing: ``ValueError`` for a checkpoint
        that does not fit; else :meth:`_checked_state`'s result."""
        missing = [key for key in ("state", "param_groups") if key not in state_dict]
        if missing:
            raise ValueError(f"WhitenedMuon.load_state_dict: the checkpoint has no {missing} (not an optimizer's "
                             f"state_dict)")
        saved_groups = state_dict["param_groups"]
        saved = [g.get("algorithm", WHITENED) for g in saved_groups]
        ours = [g["algorithm"] for g in self.param_groups]
        if saved != ours:
            raise ValueError(f"WhitenedMuon.load_state_dict: the saved param groups' algorithms {saved} "
                             f"differ from this optimizer's {ours}")
        for index, group in enumerate(saved_groups):  # checked before anything changes
            if len(group["params"]) != len(self.param_groups[index]["params"]):
                raise ValueError(f"WhitenedMuon.load_state_dict: saved param group {index} holds "
                                 f"{len(group['params'])} parameters, this optimizer's "
                                 f"{len(self.param_groups[index]['params'])}")
            _check_group(index, {**self.param_groups[index], **{k: v for k, v in group.items() if k != "params"}})
            _check_names(index, group.get("param_names"), self.param_groups[index].get("param_names"))
        return self._checked_state(state_dict)

    def _checked_state(self, state_dict: dict[str, Any]) -> tuple[dict, dict[nn.Parameter, dict],
                                                                  dict[nn.Parameter, bool]]:
        """(the saved per-parameter state this optimizer loads, the entries torch.optim's load
        would cast, by parameter, and whether each packed in_proj with saved input statistics
        had them per part); ``ValueError`` for the first entry that does not fit."""
        saved_state = state_dict["state"]
        kept: dict[Any, dict[str, Any]] = {}
        exact: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        part_inputs: dict[nn.Parameter, bool] = {}
        for saved_group, group in zip(state_dict["param_groups"], self.param_groups):
            for key, p in zip(saved_group["params"], group["params"]):
                if key not in saved_state:
                    continue
                saved_entry = saved_state[key]
                saved_input = saved_entry.get("input_factor", saved_entry.get("input_whitener"))
                if id(p) in self._packed and torch.is_tensor(saved_input):
                    # a cross-attention's factor per part leads with the parts: [3, blocks, b, b]
                    # (a weight orthogonalised whole has no parts to whiten so: its shape check refuses it)
                    part_inputs[p] = saved_input.dim() == 4 and self._views[id(p)].parts > 1
                shapes = self._state_shapes(p, group["algorithm"], part_inputs.get(p))
                name = self._names.get(id(p), f"parameter {key}")
                entry = {}
                for item, value in saved_entry.items():
                    if item.startswith("output_") and "output" not in self._statistics.sides_of(p):
                        continue  # a side this optimizer does not whiten
                    where = f"WhitenedMuon.load_state_dict: {name}'s {item}"
                    if item in shapes:
                        # another model's checkpoint, or one of other settings such as block_size
                        _check_state_tensor(item, value, shapes[item], where)
                        if item.endswith(("_factor", "_whitener", "_seen")) or item == "nonfinite_steps":
                            exact.setdefault(p, {})[item] = value
                    elif item == "step":
                        _check_step_count(value, where)
                    entry[item] = value
                _check_complete(entry, group["algorithm"], f"WhitenedMuon.load_state_dict: {name}")
                # what a parameter that has not stepped starts from (state_dict's entries for one
                # that had no gradient yet) loads as no state, so it goes on as the saved run did
                if group["algorithm"] == ADAMW and "step" in entry and int(entry["step"]) == 0:
                    continue
                for side in ("input", "output"):
                    seen = entry.get(f"{side}_seen")
                    if torch.is_tensor(seen) and not bool(seen.any()):  # no refresh measured the side
                        for item in (f"{side}_factor", f"{side}_whitener", f"{side}_seen"):
                            entry.pop(item)
                            exact.get(p, {}).pop(item, None)
                kept[key] = entry
        return kept, exact, part_inputs

    def _state_shapes(self, p: nn.Parameter, algorithm: str,
                      part_inputs: bool | None = None) -> dict[str, tuple[int, ...]]:
        """The shape of each state tensor of ``p`` that a checkpoint must match (``part_inputs``:
        a packed in_proj's input side per part or not, instead of as it is now)."""
        shape = tuple(p.shape)
        if algorithm == ADAMW:
            return {"exp_avg": shape, "exp_avg_sq": shape}
        view = self._views[id(p)]
        shapes = {"momentum_buffer": shape, "nonfinite_steps": ()}
        for side in self._statistics.sides_of(p):
            width = view.width(side)
            blocks = self._statistics.side_blocks(p, side)
            units = view.side_units(side)
            if side == "input" and part_inputs is not None:
                units = (view.parts,) if part_inputs else view.state_units
            square = units + (blocks, width // blocks, width // blocks)
            shapes.update({f"{side}_factor": square, f"{side}_whitener": square, f"{side}_seen": units})
        return shapes

    def __reduce_ex__(self, protocol):
        raise TypeError("WhitenedMuon cannot be copied or pickled: it holds statistics hooks on the model's "
                        "modules, which a copy would not have. Save optimizer.state_dict() and load it into a "
                        "WhitenedMuon built on the model (torch.save(optimizer.state_dict(), ...))")

    def remove(self) -> None:
        """Remove the statistics hooks (the optimizer then steps with its last whiteners). An
        optimizer that is no longer referenced removes them when it is freed."""
        self._finalizer()
