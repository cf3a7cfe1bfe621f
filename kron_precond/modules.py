"""Which modules can be preconditioned, and how K-FAC reads their inputs and gradients.

One adapter per module kind turns the module's input into activation rows and its
output gradient into gradient rows, so that the layer's gradient matrix
``[W.reshape(out, -1) | b]`` equals ``Σ_rows g_rowᵀ a_row`` (with a 1 appended for b).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn


class KFACAdapter:
    """Rows of activations and output gradients of a Linear-like module."""

    weight_transposed = False  # weight stored [out, in]

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def has_bias(self) -> bool:
        return getattr(self.module, "bias", None) is not None

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


def _is_transposed_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == module.nf)


class ConvAdapter(KFACAdapter):
    """Conv1d/2d/3d: each output position of each sample is a row of unfolded patches."""

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
        spatial = len(self.module.kernel_size)
        return output.shape[0] if output.dim() > spatial + 1 else 1

    def output_grad_rows(self, g: torch.Tensor) -> torch.Tensor:
        spatial = len(self.module.kernel_size)
        if g.dim() == spatial + 1:
            g = g.unsqueeze(0)
        return g.movedim(1, -1).reshape(-1, g.shape[1])


def _pad_like_conv(conv: nn.modules.conv._ConvNd, x: torch.Tensor) -> torch.Tensor:
    # _reversed_padding_repeated_twice is what nn.ConvNd itself passes to F.pad for
    # non-zero padding modes and for padding="same"; it is set for every padding kind.
    pad = getattr(conv, "_reversed_padding_repeated_twice", None)
    if pad is None:
        pad = [p for p in reversed(conv.padding) for _ in range(2)]
    if not any(pad):
        return x
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    return F.pad(x, list(pad), mode=mode)


def kfac_adapter(module: nn.Module) -> tuple[KFACAdapter | None, str]:
    """Adapter for ``module`` under K-FAC, or ``(None, reason)`` when it is not supported."""
    if isinstance(module, nn.Linear):
        return KFACAdapter(module), ""
    if _is_transposed_linear(module):
        return TransposedLinearAdapter(module), ""
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        if module.groups != 1:
            return None, f"grouped convolution (groups={module.groups}) is not supported by K-FAC"
        return ConvAdapter(module), ""
    return None, (f"{type(module).__name__} is not a K-FAC layer kind "
                  "(Linear, Conv1d/2d/3d, GPT-2 style Conv1D)")


def compile_skip_patterns(skip_layers) -> list[re.Pattern]:
    """Validate ``skip_layers`` (a regex or a sequence of regexes) and compile it."""
    if skip_layers is None:
        return []
    patterns: Iterable = [skip_layers] if isinstance(skip_layers, str) else skip_layers
    try:
        patterns = list(patterns)
    except TypeError:
        raise TypeError(f"skip_layers must be a string or a sequence of strings, got {skip_layers!r}") from None
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"skip_layers entries must be strings (regexes), got {pattern!r}")
        try:
            compiled.append(re.compile(pattern))
        except re.error as err:
            raise ValueError(f"skip_layers entry {pattern!r} is not a valid regex: {err}") from None
    return compiled


def is_skipped(name: str, module: nn.Module, patterns: list[re.Pattern]) -> bool:
    class_name = type(module).__name__
    return any(p.search(name) or p.search(class_name) for p in patterns)


def _owners(model: nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    return owners


def _candidates(model: nn.Module, is_skipped, log):
    """``(name, module, own parameters, label)`` of every module with parameters of its own
    that ``skip_layers`` does not exclude (a skip is logged)."""
    for name, module in model.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        label = name or "<root>"
        if is_skipped(name, module):
            log(f"skipping {label} ({type(module).__name__}): matches skip_layers")
            continue
        yield name, module, own, label


def find_kfac_modules(model: nn.Module, is_skipped, log) -> list:
    """Leaf Linear/ConvNd-like modules whose parameters all train and belong to no other
    module (a tied weight's gradient mixes two layers' statistics), in
    ``model.named_modules()`` order, as :class:`~kron_precond.methods.base.Selected`."""
    from kron_precond.methods.base import Selected

    owners = _owners(model)
    # MultiheadAttention uses its out_proj's weight functionally: out_proj.forward never
    # runs, so K-FAC's hooks would never see it.
    functional = {f"{name}.out_proj" if name else "out_proj" for name, module in model.named_modules()
                  if isinstance(module, nn.MultiheadAttention)}
    found = []
    for name, module, own, label in _candidates(model, is_skipped, log):
        adapter, reason = kfac_adapter(module)
        if adapter is None:
            log(f"skipping {label}: {reason}")
            continue
        if any(True for _ in module.children()):
            log(f"skipping {label}: not a leaf module")
            continue
        if name in functional:
            log(f"skipping {label}: nn.MultiheadAttention applies it functionally (no forward hook)")
            continue
        if not all(p.requires_grad for _, p in own):
            log(f"skipping {label}: not all of its parameters require grad")
            continue
        shared = sorted({o for _, p in own for o in owners[id(p)] if o != name})
        if shared:
            log(f"skipping {label}: a parameter is shared with {', '.join(shared)} (tied weights)")
            continue
        # weight first, then bias: the order of the gradient matrix [W | b]
        own = [(n, p) for n, p in own if n == "weight"] + [(n, p) for n, p in own if n == "bias"]
        found.append(Selected(name, module, own, adapter))
    return found


def find_parameter_modules(model: nn.Module, is_skipped, log) -> list:
    """Every module with trainable parameters of its own, each parameter once (so tied
    weights are preconditioned once); for methods that need only the gradient."""
    from kron_precond.methods.base import Selected

    found, taken = [], set()
    for name, module, own, label in _candidates(model, is_skipped, log):
        if getattr(module, "sparse", False) is True:
            log(f"skipping {label}: sparse gradients cannot be preconditioned")
            continue
        own = [(n, p) for n, p in own if p.requires_grad and id(p) not in taken]
        if own:
            taken.update(id(p) for _, p in own)
            found.append(Selected(name, module, own, None))
    return found
