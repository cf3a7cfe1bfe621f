"""Which modules can be preconditioned, and how K-FAC reads their inputs and gradients.

One adapter per module kind describes the module to the engine: the *units of work* it
holds (:class:`Selected`; a Linear is one unit, a fused experts module one unit per expert
and weight) and, per forward call, each unit's activation rows and, in backward, its
output-gradient rows, so that a unit's gradient matrix ``[W.reshape(out, -1) | b]`` equals
``Σ_rows g_rowᵀ a_row`` (with a 1 appended for b).

The adapter protocol (what :mod:`kron_precond.capture` and the methods use):

* ``units(name, params) -> list[Selected]`` -- the module's units, each naming its
  parameters, its ``slot`` (the key of its rows) and, for a slice of a stacked parameter,
  its ``index`` along dim 0;
* ``forward_rows(inputs, kwargs, output) -> (list[(slot, rows)], context) | None`` -- the
  activation rows of one call, per unit (units that saw no row are left out);
* ``backward_rows(grad_output, context) -> list[(slot, rows, scale)]`` -- the same call's
  output-gradient rows and the factor ``scale`` that undoes the loss's mean.

Adapters describe modules; they know nothing of any method. Methods and the engine use
them (:class:`Selected` is re-exported by :mod:`kron_precond.methods.base`). Another
library's module kind is added with :func:`register_adapter` (fused MoE experts:
:mod:`kron_precond.experts`).
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

_logger = logging.getLogger("kron_precond")


class UnsupportedModule(ValueError):
    """Raised by an adapter's constructor for a module it cannot describe; the message is
    logged as the reason the module is skipped."""


@dataclass(frozen=True)
class Selected:
    """One unit of work a method takes: a module, or one expert of a fused experts module.

    Attributes:
        name: the unit's name (the module's qualified name; ``<module>.<weight>.<expert>``
            for an expert), used for layer names, checkpoints and work placement.
        module: the module whose hooks deliver the unit's rows.
        params: ``(attribute name, parameter)`` of the module, weight first.
        adapter: the module's adapter (``None`` for methods that need only gradients).
        index: ``None``, or the unit is row ``index`` (dim 0) of each parameter: its gradient
            is ``param.grad[index]``, a view written back in place.
        slot: the key of this unit's rows in the adapter's ``forward_rows`` / ``backward_rows``.
        has_bias: the last parameter is a bias (a trailing 1 on every activation row).
        weight_transposed: the weight is stored ``[in, out]``.
    """

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    adapter: Any = None
    index: int | None = None
    slot: int = 0
    has_bias: bool = False
    weight_transposed: bool = False

    @property
    def shapes(self) -> list[torch.Size]:
        """The shapes of the unit's gradients (a slice of each parameter when ``index`` is set)."""
        return [p.shape if self.index is None else p.shape[1:] for _, p in self.params]


class KFACAdapter:
    """Rows of activations and output gradients of a Linear-like module (one unit)."""

    weight_transposed = False  # weight stored [out, in]

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def units(self, name: str, params: list[tuple[str, nn.Parameter]]) -> list[Selected]:
        # weight first, then bias: the order of the gradient matrix [W | b]. A bias that is no
        # parameter of the module (a buffer: a fixed shift) is no column of it.
        params = [(n, p) for n, p in params if n == "weight"] + [(n, p) for n, p in params if n == "bias"]
        return [Selected(name, self.module, params, self, has_bias=any(n == "bias" for n, _ in params),
                         weight_transposed=self.weight_transposed)]

    def forward_rows(self, inputs: tuple, kwargs: dict, output: Any):
        """The call's activation rows (slot 0) and, as context, its gradient scale."""
        # The input may also come as a keyword (``linear(input=x)``).
        candidates = list(inputs[:1]) or list(kwargs.values())[:1]
        if not candidates or not isinstance(candidates[0], torch.Tensor):
            return None
        scale = self.gradient_scale(output) if isinstance(output, torch.Tensor) else 1
        return [(0, self.activation_rows(candidates[0].detach()))], scale

    def backward_rows(self, grad: torch.Tensor, scale: int) -> list[tuple[int, torch.Tensor, float]]:
        return [(0, self.output_grad_rows(grad), scale)]

    def activation_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, in]``: every leading index of the input is a row."""
        return x.reshape(-1, x.shape[-1])

    def output_grad_rows(self, g: torch.Tensor) -> torch.Tensor:
        return g.reshape(-1, g.shape[-1])

    def gradient_scale(self, output: torch.Tensor) -> int:
        """Factor by which output gradients are multiplied before ``G = mean(δδᵀ)``: the
        number of rows of the call, ``N = output.numel() / out_features``.

        For the usual mean loss over every row (per-sample for ``[B, D]`` inputs,
        per-token for ``[B, T, D]`` or ``[T, B, D]``) each row's gradient carries a factor
        ``1/N``; undoing it makes G -- and so the meaning of one damping value --
        independent of the batch size and of the sequence length.
        """
        return max(1, output.numel() // max(1, output.shape[-1])) if output.dim() else 1


class TransposedLinearAdapter(KFACAdapter):
    """GPT-2 style ``Conv1D`` (Hugging Face, and look-alikes): ``y = x @ W + b``, W ``[in, out]``."""

    weight_transposed = True


def _fsdp_module_class() -> type | None:
    """FSDP2's ``FSDPModule`` (``None`` where torch has no FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) wrapped ``module`` (it changes the module's class in place)."""
    fsdp = _fsdp_module_class()
    return fsdp is not None and isinstance(module, fsdp)


class ParametrizationWatch:
    """Notices a ``torch.nn.utils.parametrize`` parametrization put on a module since it was
    registered. The weight is then computed from ``parametrizations.<name>.original``, whose
    gradient is not the weight's: the registered parameter gets no gradient any more, or (an
    optimizer holding the original) a step in the wrong geometry. Registering a parametrization
    swaps the module's class for a generated subclass, so the usual check is one identity test
    (a module already parametrized at registration is asked every time)."""

    __slots__ = ("module", "built_class")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.built_class = None if parametrize.is_parametrized(module) else type(module)

    def since(self, names: Iterable[str]) -> list[str]:
        """Which of ``names`` (plain parameters of the module at registration) are parametrized now."""
        if type(self.module) is self.built_class:
            return []
        return [name for name in names if parametrize.is_parametrized(self.module, name)]


def _unsharded(cls: type) -> type:
    """``cls``, or for FSDP2's class the one it was made from: the first class of its MRO that is
    not an FSDP2 class."""
    fsdp = _fsdp_module_class()
    if fsdp is None or not issubclass(cls, fsdp):
        return cls
    return next((c for c in cls.__mro__ if not issubclass(c, fsdp)), cls)


def module_class(module: nn.Module) -> type:
    """The class ``module`` was written as: ``fully_shard`` (FSDP2) changes a module's class to
    a subclass it makes on the fly (``FSDPConv1D``: ``FSDPModule`` and the original class), whose
    ``forward`` is the original's."""
    return _unsharded(type(module))


def _is_transposed_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (module_class(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf)


class ConvAdapter(KFACAdapter):
    """Conv1d/2d/3d: each output position of each sample is a row of unfolded patches.

    A module registered with it holds ``nn.Conv*d``'s settings: ``kernel_size``, ``stride``,
    ``dilation`` (tuples, one entry per spatial dim), ``padding`` (a tuple, ``"same"`` or
    ``"valid"``), ``padding_mode`` and ``groups`` (1: a grouped convolution is skipped), and for
    a ``padding_mode`` other than ``"zeros"`` ``_reversed_padding_repeated_twice``, as torch's
    convolutions do; its ``weight`` is ``[out, in, *kernel_size]``."""

    SETTINGS = ("kernel_size", "stride", "dilation", "padding", "padding_mode", "groups")

    def __init__(self, module: nn.Module) -> None:
        name = type(module).__name__
        missing = [a for a in self.SETTINGS if not hasattr(module, a)]
        padded = "_reversed_padding_repeated_twice"  # what torch pads by in modes other than zeros
        if getattr(module, "padding_mode", "zeros") != "zeros" and not hasattr(module, padded):
            missing.append(padded)
        if missing:
            raise TypeError(f"ConvAdapter: {name} has no {', '.join(missing)}: a module read as a "
                            f"convolution holds nn.Conv2d's settings (or register an adapter of its own)")
        if getattr(module, "transposed", False):  # its rows are not its input's patches
            raise TypeError(f"ConvAdapter: {name} is a transposed convolution (transposed=True), whose weight "
                            f"does not multiply its input's patches: no adapter of the library reads it")
        weight = getattr(module, "weight", None)
        spatial = weight.dim() - 2 if isinstance(weight, torch.Tensor) else -1
        for setting in ("kernel_size", "stride", "dilation", "padding"):
            value = getattr(module, setting)
            if setting == "padding" and value in ("same", "valid"):
                continue
            if not (isinstance(value, tuple) and len(value) == spatial and all(isinstance(v, int) for v in value)):
                raise TypeError(f"ConvAdapter: {name}.{setting}={value!r}: expected a tuple of {spatial} ints, one "
                                f"per spatial dim of its weight (as nn.Conv{max(spatial, 1)}d holds it)")
        if module.groups != 1:
            raise UnsupportedModule(f"grouped convolution (groups={module.groups}) is not supported by K-FAC")
        super().__init__(module)

    def activation_rows(self, x: torch.Tensor) -> torch.Tensor:
        conv: nn.modules.conv._ConvNd = self.module  # type: ignore[assignment]
        spatial = len(conv.kernel_size)
        if x.dim() == spatial + 1:  # unbatched input
            x = x.unsqueeze(0)
        x = _pad_like_conv(conv, x)
        for dim, (k, s, d) in enumerate(zip(conv.kernel_size, conv.stride, conv.dilation)):
            # A window spanning the dilated kernel, then every d-th element of it.
            x = x.unfold(2 + dim, (k - 1) * d + 1, s)
            if d > 1:
                x = x[..., ::d]
        # x: [B, C, o_1..o_n, k_1..k_n] -> rows [B·Π o, C·Π k] matching weight.reshape(out, -1)
        batch, channels = x.shape[:2]
        out_dims = list(range(2, 2 + spatial))
        kernel_dims = list(range(2 + spatial, 2 + 2 * spatial))
        x = x.permute(0, *out_dims, 1, *kernel_dims)
        return x.reshape(-1, channels * conv.weight.shape[2:].numel())

    def gradient_scale(self, output: torch.Tensor) -> int:
        """The batch size: a convolution's loss is usually a mean over samples (each
        sample's output positions are summed, not averaged), so each position's gradient
        carries ``1/B``; undoing it makes G independent of the batch size."""
        return output.shape[0] if output.dim() > self._spatial + 1 else 1

    @property
    def _spatial(self) -> int:
        conv: nn.modules.conv._ConvNd = self.module  # type: ignore[assignment]
        return len(conv.kernel_size)

    def output_grad_rows(self, g: torch.Tensor) -> torch.Tensor:
        if g.dim() == self._spatial + 1:
            g = g.unsqueeze(0)
        return g.movedim(1, -1).reshape(-1, g.shape[1])


def _pad_like_conv(conv: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``x`` padded as the conv's own forward pads it at this call. Zeros padding is read from
    the conv's settings now, as torch's forward reads them (a dilation surgery sets ``padding``
    and ``dilation`` on a built conv, and ``"same"`` follows the dilation); other modes pad by
    ``_reversed_padding_repeated_twice``, set at construction, which is what torch pads by."""
    pad: list[int]
    if conv.padding_mode != "zeros":
        pad = list(conv._reversed_padding_repeated_twice)
    elif conv.padding == "same":  # d·(k − 1) zeros, the odd one on the right (torch's split)
        pad = []
        for d, k in zip(reversed(conv.dilation), reversed(conv.kernel_size)):
            total = d * (k - 1)
            pad += [total // 2, total - total // 2]
    elif conv.padding == "valid":
        pad = []
    else:
        spatial = len(conv.kernel_size)
        padding: Sequence[int] = (conv.padding if isinstance(conv.padding, (tuple, list))
                                  else (int(conv.padding),) * spatial)
        pad = [p for p in reversed(padding) for _ in range(2)]
    if not any(pad):
        return x
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    return F.pad(x, pad, mode=mode)


# Subclasses whose own forward multiplies its input as the base class's does (the rows are its
# input): transformers' Falcon projections, ``input @ weight.T + bias``.
# torchtitan's row-parallel projection divides its bias by the tensor-parallel degree (1 without
# tensor parallelism, which the library refuses).
_SAME_ROWS_FORWARD = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear",
                                "torchtitan.models.common.linear.ScaledBiasRowwiseLinear"})


def overridden_forward(module: nn.Module, base: type, methods: tuple[str, ...]) -> str | None:
    """Why ``module``'s rows may not be the input of ``base``'s forward, or ``None``: its class
    overrides one of ``methods`` (its forward may change its input before its weight multiplies
    it: a causal pad, a scale, a transpose, a standardised weight), or one is replaced on the
    instance or on torch's own class (monkey-patched). A replacement on the instance that
    declares, through ``__wrapped__``, that it calls the class's own method on this module
    (accelerate's device and autocast hooks) is taken: it is trusted, as a registered adapter
    is, to hand that method its arguments."""
    cls = module_class(module)  # FSDP2's class (forward the original's) is not an override
    base = _unsharded(base)  # FSDP2's class (made in torch.distributed) stands for the original
    if base.__module__.startswith("torch."):  # torch's own method, not one patched onto its class
        patched = [m for m in methods if not getattr(getattr(base, m), "__module__", "").startswith("torch.")]
        if patched:
            return (f"nn.{base.__name__}.{' and '.join(patched)} is replaced (patched onto torch's class): the "
                    f"rows its weight multiplies may not be its input; register an adapter (register_adapter) "
                    f"that reads them")
    overridden = [m for m in methods if getattr(cls, m, None) is not getattr(base, m)]
    if overridden and f"{cls.__module__}.{cls.__qualname__}" not in _SAME_ROWS_FORWARD:
        return (f"{cls.__name__} overrides {' and '.join(overridden)}: the rows its weight multiplies may not be "
                f"its input; register an adapter (register_adapter) that reads them")
    replaced = [m for m in methods if m in vars(module) and not _calls_own(module, vars(module)[m], getattr(cls, m))]
    if replaced:
        return (f"{cls.__name__}'s {' and '.join(replaced)} is replaced on the instance: the rows its weight "
                f"multiplies may not be its input; register an adapter (register_adapter) that reads them")
    return None


def _calls_own(module: nn.Module, replacement: Any, own: Any) -> bool:
    """``replacement`` declares (``__wrapped__``, followed to its end) that it wraps ``own``,
    the class's method, bound to ``module`` or plain."""
    try:
        inner = inspect.unwrap(replacement)
    except ValueError:  # a cycle of __wrapped__
        return False
    return getattr(inner, "__func__", inner) is own and getattr(inner, "__self__", module) is module


class RowsUnknown(UnsupportedModule):
    """A Linear-like module the built-in adapter cannot read: its forward is its own, or it
    holds parameters beyond ``weight`` and ``bias``. Named in a warning at construction (it is
    most likely meant to be preconditioned), not only logged."""


def _refuse_overridden(module: nn.Module, base: type, methods: tuple[str, ...]) -> None:
    """:class:`UnsupportedModule` for a module whose rows may not be the input of ``base``'s
    forward (:func:`overridden_forward`). A module with parameters beyond weight and bias is
    refused for those (the more specific reason; :func:`unknown_parameters`)."""
    reason = overridden_forward(module, base, methods)
    if reason is None:
        return
    raise RowsUnknown(_beyond_weight_and_bias(list(module.named_parameters(recurse=False))) or reason)


def _linear_adapter(module: nn.Module) -> KFACAdapter:
    _refuse_overridden(module, nn.Linear, ("forward",))
    return KFACAdapter(module)


def _transposed_linear_adapter(module: nn.Module) -> TransposedLinearAdapter:
    _refuse_overridden(module, type(module), ("forward",))  # its class's forward is the definition
    return TransposedLinearAdapter(module)


def _conv_adapter(module: nn.Module) -> ConvAdapter:
    if module.groups != 1:  # the reason before any other (ConvAdapter checks it too)
        raise UnsupportedModule(f"grouped convolution (groups={module.groups}) is not supported by K-FAC")
    base = next(c for c in (nn.Conv1d, nn.Conv2d, nn.Conv3d) if isinstance(module, c))
    _refuse_overridden(module, base, ("forward", "_conv_forward"))
    return ConvAdapter(module)


# (matches, factory): consulted in order; register_adapter puts user entries first. The Linear
# and Conv entries take a subclass only if it keeps the base class's forward (_refuse_overridden).
_ADAPTERS: list[tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Any]]] = [
    (lambda m: isinstance(m, nn.Linear), _linear_adapter),
    (_is_transposed_linear, _transposed_linear_adapter),
    (lambda m: isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)), _conv_adapter),
]


class AdapterHandle:
    """What :func:`register_adapter` returns: ``remove()`` takes the registration back (for
    preconditioners built afterwards), as a torch hook's handle does; a second call does nothing."""

    __slots__ = ("entry",)

    def __init__(self, entry: tuple) -> None:
        self.entry = entry

    def remove(self) -> None:
        for i, entry in enumerate(_ADAPTERS):
            if entry is self.entry:
                del _ADAPTERS[i]
                return


def register_adapter(matches: type | Callable[[nn.Module], bool], factory: Callable[..., Any], *,
                     builtin: bool = False) -> AdapterHandle:
    """Teach the library a module kind: the capturing methods (K-FAC, EK-FAC, input-side K-FAC)
    and ``WhitenedMuon`` read its rows through the adapter.

    Args:
        matches: a module class (``isinstance``) or a predicate ``matches(module) -> bool``.
        factory: ``factory(module) -> adapter``, an object following this module's adapter
            protocol (:class:`KFACAdapter` for a Linear-like module, :class:`TransposedLinearAdapter`
            for one storing its weight ``[in, out]``, :class:`ConvAdapter` for a convolution; for
            routed experts, a subclass of :class:`kron_precond.experts.RoutedExpertsAdapter`); it
            may raise :class:`UnsupportedModule` with the reason the module is skipped.
        builtin: append after the library's adapters instead of before them (used by the
            library itself); user registrations take precedence, the latest first.

    Returns:
        a handle whose ``remove()`` takes the registration back.

    Registrations apply to preconditioners built afterwards. A class registered after one of
    its subclasses takes that subclass's modules too (the latest registration is consulted
    first): a ``UserWarning`` says so; register the subclass again to give it back its own.
    """
    if isinstance(matches, nn.Module):  # callable, but a module instance is no predicate
        raise TypeError(f"matches must be a module class or a predicate, got the module instance "
                        f"{type(matches).__name__}(...): pass its class, {type(matches).__name__}")
    cls = matches if isinstance(matches, type) else None
    if cls is not None:
        matches = _IsInstance(cls)
    if not callable(matches):
        raise TypeError(f"matches must be a module class or a predicate, got {matches!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable (module -> adapter), got {factory!r}")
    entry = (matches, factory)
    if builtin:
        _ADAPTERS.append(entry)
    else:
        if cls is not None:
            earlier = sorted({m.cls.__name__ for m, _ in _ADAPTERS
                              if isinstance(m, _IsInstance) and m.cls is not cls and issubclass(m.cls, cls)})
            if earlier:
                warnings.warn(f"register_adapter: {cls.__name__}'s adapter now takes the {', '.join(earlier)} "
                              f"modules too, registered earlier with an adapter of their own (the latest "
                              f"registration is consulted first): register {', '.join(earlier)} again after "
                              f"{cls.__name__} to keep theirs", UserWarning, stacklevel=2)
        _ADAPTERS.insert(0, entry)
    return AdapterHandle(entry)


class _IsInstance:
    """A registration by class: ``isinstance(module, cls)``, the class kept for the warning above."""

    __slots__ = ("cls",)

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def __call__(self, module: nn.Module) -> bool:
        return isinstance(module, self.cls)


def kfac_adapter(module: nn.Module) -> tuple[Any | None, str]:
    """Adapter for ``module`` under K-FAC, or ``(None, reason)`` when it is not supported."""
    adapter, reason, _ = adapter_lookup(module)
    return adapter, reason


def adapter_lookup(module: nn.Module) -> tuple[Any | None, str, bool]:
    """:func:`kfac_adapter`, and whether a module it has no adapter for looks Linear-like (a
    trainable weight of two or more dims, not an embedding's): no registration matches it, or
    the built-in one cannot read its rows (:class:`RowsUnknown`). Such a module is most
    likely meant to be preconditioned; the searches name it in a warning."""
    for matches, factory in _ADAPTERS:
        if matches(module):
            try:
                return factory(module), "", False
            except UnsupportedModule as err:
                return None, str(err), isinstance(err, RowsUnknown) and _linear_like(module)
    return None, (f"{type(module).__name__} is not a K-FAC layer kind (Linear, Conv1d/2d/3d, "
                  "GPT-2 style Conv1D, fused MoE experts; see register_adapter)"), _linear_like(module)


def _would_take(owners: dict[int, list[str]], name: str, own: Sequence[tuple[str, torch.Tensor]],
                weight_only: bool) -> bool:
    """Whether a search would take the module, given an adapter: its parameters belong to it
    alone, and they train (its weight, for ``weight_only``)."""
    trains = all(p.requires_grad for n, p in own if n == "weight" or not weight_only)
    return trains and not tied_elsewhere(owners, name, (p for _, p in own))


def _linear_like(module: nn.Module) -> bool:
    weight = module._parameters.get("weight")
    return (weight is not None and weight.dim() >= 2 and weight.requires_grad
            and not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and not _known_router(module))


def _known_router(module: nn.Module) -> bool:
    """transformers' MoE routers (``MixtralTopKRouter``: ``F.linear`` of the hidden states, then
    a top-k): their weight is left to the optimizer by design, as most MoE recipes leave it."""
    cls = module_class(module)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("Router")


def check_layout(units: Sequence[Selected], label: str, owner: str) -> None:
    """``ValueError`` naming the module when an adapter's unit cannot be a gradient matrix
    ``[W | b]``: a bias takes one column, so it has one entry per output row of the weight as
    the unit lays it out (``[out, in…]``, or ``[in, out]`` transposed); a unit holds its weight
    and at most that bias. A per-head ``[H, oh, in]`` weight with an ``[H, oh]`` bias, read as
    ``[H, oh·in]``, would otherwise fail at the first step with a shape error naming nothing."""
    for unit in units:
        shapes = unit.shapes
        if not shapes or len(shapes) != 1 + int(unit.has_bias):
            raise ValueError(f"{owner}: module {label!r}: its adapter's unit holds {len(shapes)} parameter(s) "
                             f"({[n for n, _ in unit.params]}) with has_bias={unit.has_bias}: a unit is its "
                             f"weight and, if has_bias, its bias")
        if unit.has_bias:
            weight, bias = shapes
            rows = weight[-1] if unit.weight_transposed else weight[0]
            if bias.numel() != rows:
                raise ValueError(f"{owner}: module {label!r}: its bias {tuple(bias)} has {bias.numel()} entries, and "
                                 f"its adapter lays the weight {tuple(weight)} out with {rows} output rows "
                                 f"([{rows}, -1]{', transposed' if unit.weight_transposed else ''}): the bias "
                                 f"must have one entry per output row. Register an adapter whose units "
                                 f"give the weight as [out, in…] (or skip_layers= the module)")


def unknown_parameters(adapter: Any, own: Sequence[tuple[str, torch.Tensor]]) -> str:
    """Why a Linear-like adapter cannot describe a module with parameters ``own`` (``""`` if
    it can): it knows a ``weight`` and a ``bias``. Any other parameter of the module's own (the
    legacy ``nn.utils.weight_norm`` / ``spectral_norm``, whose weight is an attribute computed
    from ``weight_g``, ``weight_v`` / ``weight_orig``; a subclass whose forward uses a parameter
    of its own) enters the output in a way the adapter cannot know: it would take the bias for
    the weight, or whiten by the wrong rows."""
    if not isinstance(adapter, KFACAdapter) or type(adapter).units is not KFACAdapter.units:
        return ""  # an adapter whose units() says which parameters it takes (a registration's)
    return _beyond_weight_and_bias(own)


def _beyond_weight_and_bias(own: Sequence[tuple[str, torch.Tensor]]) -> str:
    names = [n for n, _ in own]
    if "weight" not in names:
        return (f"its weight is not a parameter of its own (its parameters: {', '.join(names)}): a "
                f"reparametrisation computes it (nn.utils.weight_norm / spectral_norm or "
                f"torch.nn.utils.parametrizations), and the gradient that reaches it is not the weight's")
    others = [n for n in names if n not in ("weight", "bias")]
    if others:
        return (f"it holds parameters of its own beyond weight and bias ({', '.join(others)}): how they "
                f"enter its output is unknown (teach the module with register_adapter)")
    return ""


def refuse_lazy(named_modules: Iterable[tuple[str, nn.Module]], owner: str = "WhitenedMuon") -> None:
    """``ValueError`` naming a module whose parameters are not materialised yet (``nn.LazyLinear``
    before its first forward): its shape, and so its factors or whitener, is unknown. ``owner``:
    the class being built, which the message names."""
    for name, module in named_modules:
        if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(recurse=False)):
            raise ValueError(f"{owner}: module {name!r} ({type(module).__name__}) has uninitialised (lazy) "
                             f"parameters: run one forward pass before building {owner}")


def compile_skip_patterns(skip_layers, argument: str = "skip_layers") -> list[re.Pattern]:
    """Validate ``skip_layers`` (a regex or a sequence of regexes) and compile it; errors name
    ``argument``, the constructor argument the patterns came from."""
    if skip_layers is None:
        return []
    patterns: Iterable = [skip_layers] if isinstance(skip_layers, str) else skip_layers
    try:
        patterns = list(patterns)
    except TypeError:
        raise TypeError(f"{argument} must be a string or a sequence of strings, got {skip_layers!r}") from None
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{argument} entries must be strings (regexes), got {pattern!r}")
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"{argument} entry {pattern!r} is not a valid regex: {err}") from None
    return compiled


# Name segments torch's wrappers insert (checkpoint_wrapper, torch.compile): a pattern is also
# searched in the name without them, as a model's own names and checkpoints spell it
_WRAPPER_SEGMENT = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod)(?=\.|$)")


def is_skipped(name: str, module: nn.Module, patterns: list[re.Pattern]) -> bool:
    """Whether a pattern matches the module's name (with or without the segments torch's
    checkpoint and compile wrappers insert) or its class's name -- the class it was written as
    too, where FSDP2 renamed it (``FSDPConv1D``: ``^Conv1D$`` skips it)."""
    names = {type(module).__name__, module_class(module).__name__}
    plain = _WRAPPER_SEGMENT.sub("", name).lstrip(".")
    paths = {name, plain}
    return any(any(p.search(n) for n in paths) or any(p.search(c) for c in names) for p in patterns)


# Frames a warning is not attributed to: this package's, and torch's (a hook runs under
# torch's autograd engine or module call)
_OWN_FRAMES = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
               os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def user_stacklevel() -> int:
    """For ``warnings.warn`` in the function that calls this: the ``stacklevel`` of the first
    frame outside this package and torch, the user's call (``loss.backward()`` for a hook in a
    backward), however deep inside them the warning is made. A backward run on a device's
    thread has no such frame: its outermost one then."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_OWN_FRAMES):
        frame, level = frame.f_back, level + 1
    return level


def warn_unmatched_skips(model: nn.Module, patterns: list[re.Pattern], owner: str) -> None:
    """One ``UserWarning`` naming the ``skip_layers`` patterns that match no module of ``model``:
    a typo, or a parameter's or an expert's name (the patterns are searched in module and class
    names only), skips nothing, and the layer it meant trains preconditioned. ``owner``: the
    class being built, which the message names. Construction only: one pass over the modules."""
    if not patterns:
        return
    modules = list(model.named_modules())
    unmatched = [p.pattern for p in patterns if not any(is_skipped(name, module, [p]) for name, module in modules)]
    if unmatched:
        listed = ", ".join(repr(p) for p in unmatched)
        warnings.warn(f"{owner}: skip_layers pattern{'s' if len(unmatched) > 1 else ''} {listed} match"
                      f"{'' if len(unmatched) > 1 else 'es'} no module of {type(model).__name__}, so "
                      f"{'they skip' if len(unmatched) > 1 else 'it skips'} nothing. Patterns are searched in "
                      f"module names (model.named_modules(): 'blocks.0.mlp.fc') and class names ('Linear'), not "
                      f"in parameter or expert names; a fused experts module is skipped whole. A list shared "
                      f"across models may name modules this one lacks: then ignore this warning",
                      UserWarning, stacklevel=user_stacklevel())


def tied_elsewhere(owners: dict[int, list[str]], name: str, params: Iterable[torch.Tensor]) -> list[str]:
    """The other modules holding one of ``params`` (``owners``: :func:`owners_of`), sorted: a tied
    weight's gradient mixes two layers' statistics, so such a module is not registered."""
    return sorted({o for p in params for o in owners.get(id(p), []) if o != name})


def owners_of(model: nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> the qualified names of the modules holding it`` (two or more: tied)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    return owners


def _candidates(model: nn.Module, is_skipped, log, passed_over: frozenset[str] = frozenset()):
    """``(name, module, own parameters, label)`` of every module with parameters of its own
    that ``skip_layers`` does not exclude (a skip is logged); the modules named in
    ``passed_over`` are left out without a log (their caller's other search reports them)."""
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        if not own or name in passed_over:
            continue
        label = name or "<root>"
        if is_skipped(name, module):
            log(f"skipping {label} ({type(module).__name__}): matches skip_layers")
            continue
        yield name, module, own, label


def find_kfac_modules(model: nn.Module, is_skipped, log, *, weight_only: bool = False,
                      taken_elsewhere: Iterable[str] = (), owner: str = "KronPreconditioner") -> list[Selected]:
    """The units of modules an adapter describes (Linear/ConvNd-like, fused experts, ...)
    whose parameters all train and belong to no other module (a tied weight's gradient
    mixes two layers' statistics), in ``model.named_modules()`` order; modules with a child
    that holds parameters are skipped (its own hooks would see part of the work).

    ``weight_only``: only the units' weights must train (an optimizer that leaves the bias to
    another, as ``WhitenedMuon``); K-FAC's ``[W | b]`` units need the bias's gradient too.
    ``taken_elsewhere``: names of modules the caller handles another way (``WhitenedMuon``'s
    ``nn.MultiheadAttention``): passed over without a log, even where ``skip_layers`` excludes
    them (the other search reports that)."""
    owners = owners_of(model)
    elsewhere = frozenset(taken_elsewhere)
    # MultiheadAttention uses its out_proj's weight functionally: out_proj.forward never
    # runs, so K-FAC's hooks would never see it.
    functional = {f"{name}.out_proj" if name else "out_proj" for name, module in model.named_modules()
                  if isinstance(module, nn.MultiheadAttention)}
    found = []
    unread: list[str] = []  # Linear-like modules no adapter reads: named in a warning
    for name, module, own, label in _candidates(model, is_skipped, log, elsewhere):
        try:
            adapter, reason, linear_like = adapter_lookup(module)
        except Exception as err:  # a registration's predicate or factory failed: name the module
            if hasattr(err, "add_note"):  # Python 3.11+: the exception as raised, with the module's name
                err.add_note(f"{owner}: raised for module {label!r} ({type(module).__name__})")
            raise
        if adapter is None:
            log(f"skipping {label}: {reason}")
            if linear_like and _would_take(owners, name, own, weight_only):
                unread.append(f"{label!r} ({reason})")
            continue
        if any(True for child in module.children() for _ in child.parameters()):
            log(f"skipping {label}: not a leaf module (a child module holds parameters)")
            continue
        unknown = unknown_parameters(adapter, own)
        if unknown:
            log(f"skipping {label}: {unknown}")
            if _linear_like(module) and _would_take(owners, name, own, weight_only):
                unread.append(f"{label!r} ({type(module).__name__}: {unknown})")
            continue
        if name in functional:
            log(f"skipping {label}: nn.MultiheadAttention applies it functionally (no forward hook)")
            continue
        try:  # an adapter whose units() judges the parameters (fused experts' layout) refuses here
            units = adapter.units(name, own)
        except UnsupportedModule as err:
            log(f"skipping {label}: {err}")
            continue
        if weight_only and not all(u.params[0][1].requires_grad for u in units):
            log(f"skipping {label}: its weight does not require grad")
            continue
        if not usable_parameters(owners, name, label, own, log, frozen_ok=weight_only, module=module):
            continue
        check_layout(units, label, owner)  # of a module taken: a frozen or tied one is skipped as before
        found.extend(units)
    if unread:
        fate = ("AdamW steps its weight, unwhitened" if owner == "WhitenedMuon"
                else "its gradient reaches the optimizer unpreconditioned")
        shown = "; ".join(unread[:4]) + (f"; and {len(unread) - 4} more" if len(unread) > 4 else "")
        warnings.warn(f"{owner}: no adapter reads the rows of {len(unread)} Linear-like module"
                      f"{'s' if len(unread) > 1 else ''}, so {fate}: {shown}. Teach a module kind of your own "
                      f"with register_adapter (torch's transposed convolutions and nn.Bilinear have none), or "
                      f"pass the module in skip_layers to leave it out without this warning",
                      UserWarning, stacklevel=user_stacklevel())
    return found


@dataclass(frozen=True, eq=False)
class FrozenModule:
    """A module a search left out (or took only in part) because parameters of it were frozen
    (``requires_grad=False``) then; it would have been taken had they trained.

    Attributes:
        label: the module's qualified name (``<root>`` for the model itself).
        params: ``(attribute name, parameter)`` of its parameters that were frozen.
        module: the module, if known: its parameters are then looked up by name (``to_empty()``
            makes new ones).
    """

    label: str
    params: tuple[tuple[str, torch.Tensor], ...]
    module: nn.Module | None = None

    def unfrozen(self) -> list[str]:
        """The names of those parameters that have a gradient now (host reads, no sync; checked
        at every step, so the module's parameter dict is read directly, not through
        ``nn.Module.__getattr__``)."""
        return [n for n, p in self.params if getattr(self._current(n, p), "grad", None) is not None]

    def _current(self, name: str, param: torch.Tensor) -> Any:
        if self.module is None:
            return param
        found = self.module._parameters.get(name)
        return found if found is not None else getattr(self.module, name, param)


_FROZEN: contextvars.ContextVar[list[FrozenModule] | None] = contextvars.ContextVar("kron_precond_frozen",
                                                                                   default=None)


@contextlib.contextmanager
def recording_frozen() -> Iterator[list[FrozenModule]]:
    """Within the block, the searches below (:func:`find_kfac_modules`,
    :func:`find_parameter_modules`, :func:`usable_parameters`) list in the yielded list every
    module they leave out, in whole or in part, only because parameters of it are frozen: the
    engine tells the user when such a parameter gets a gradient later (it was never registered)."""
    found: list[FrozenModule] = []
    token = _FROZEN.set(found)
    try:
        yield found
    finally:
        _FROZEN.reset(token)


def _record_frozen(label: str, params: Iterable[tuple[str, torch.Tensor]], module: nn.Module | None) -> None:
    found = _FROZEN.get()
    frozen = tuple((n, p) for n, p in params if not p.requires_grad)
    if found is not None and frozen:
        found.append(FrozenModule(label, frozen, module))


def usable_parameters(owners: dict[int, list[str]], name: str, label: str, own: Sequence[tuple[str, torch.Tensor]],
                      log, *, frozen_ok: bool = False, module: nn.Module | None = None) -> bool:
    """Whether a unit's parameters ``own`` all train (unless ``frozen_ok``) and belong to the
    module ``name`` alone (``owners``: :func:`owners_of`); a refusal is logged under ``label``.
    A refusal because of frozen parameters alone is also recorded (:func:`recording_frozen`;
    ``module``: the module holding ``own``, if it is one)."""
    if not frozen_ok and not all(p.requires_grad for _, p in own):
        log(f"skipping {label}: not all of its parameters require grad")
        if not tied_elsewhere(owners, name, (p for _, p in own)):
            _record_frozen(label, own, module)
        return False
    shared = tied_elsewhere(owners, name, (p for _, p in own))
    if shared:
        log(f"skipping {label}: a parameter is shared with {', '.join(shared)} (tied weights)")
        return False
    return True


def stores_weight_transposed(module: nn.Module) -> bool:
    """Whether ``module`` is a linear layer whose 2-D ``weight`` is stored ``[in, out]`` (GPT-2
    style ``Conv1D``, or a module kind registered with a :class:`TransposedLinearAdapter`): the
    adapter K-FAC would take says so, or, where that adapter refuses the module (an overridden
    forward: a reason about its rows, not its weight's layout), the built-in recognition does."""
    weight = module._parameters.get("weight")
    if weight is None or weight.dim() != 2:
        return False
    try:
        adapter, _ = kfac_adapter(module)
    except Exception as err:  # a registered factory's own failure: PSGD needs no adapter
        _logger.debug("kron_precond: the K-FAC adapter of %s raised %s: %s; its weight layout is judged by "
                      "the built-in recognition", type(module).__name__, type(err).__name__, err)
        return _is_transposed_linear(module)
    if adapter is None:
        return _is_transposed_linear(module)
    return isinstance(adapter, KFACAdapter) and adapter.weight_transposed


def find_parameter_modules(model: nn.Module, is_skipped, log) -> list[Selected]:
    """Every module with trainable parameters of its own, each parameter once (so tied
    weights are preconditioned once); for methods that need only the gradient. A unit's
    ``weight_transposed`` says its ``weight`` is a linear map stored ``[in, out]``
    (:func:`stores_weight_transposed`), for methods that precondition it as ``[out, in]``."""
    found: list[Selected] = []
    taken: set[int] = set()
    for name, module, own, label in _candidates(model, is_skipped, log):
        if getattr(module, "sparse", False) is True:
            log(f"skipping {label}: sparse gradients cannot be preconditioned")
            continue
        _record_frozen(label, [(n, p) for n, p in own if id(p) not in taken], module)
        taken.update(id(p) for _, p in own if not p.requires_grad)  # a frozen tied weight: recorded once
        own = [(n, p) for n, p in own if p.requires_grad and id(p) not in taken]
        if own:
            taken.update(id(p) for _, p in own)
            found.append(Selected(name, module, own, None, weight_transposed=stores_weight_transposed(module)))
    return found
