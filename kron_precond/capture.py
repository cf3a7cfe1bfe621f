"""Activation and output-gradient capture: the module hooks of methods that need them.

A forward hook on each registered module hands the module's input rows to the layer's
method and registers a tensor hook on the output, which hands the output-gradient rows on
during backward. A tensor hook (rather than a module full-backward hook) keeps working when
an in-place activation follows the module. Hooks do nothing in ``eval()`` mode, under
``no_grad``, or on steps whose statistics are not gathered.

Output gradients are rescaled so that, for a loss averaged over the batch, the factors do
not depend on the batch size: ``δ = grad · batch · accumulation_steps`` (DESIGN.md §2).

Under ``torch.compile(model)`` the observation runs outside the compiled graph
(``torch.compiler.disable``): inductor cannot compile a graph that writes our statistics
and registers a tensor hook on one of its own intermediates ("Node addmm_N was invalid, but
is output"). The model's graph is then split at each registered module, and the tensor
hook sees the output gradient in eager autograd, exactly as without compile.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn


class ActivationCapture:
    """Hooks on the registered modules of one preconditioner.

    Args:
        layers: objects with ``module``, ``adapter`` (activation / output-gradient rows) and
            ``method`` (``observe_activations`` / ``observe_output_grads``).
        accumulation_steps: backward passes per optimizer step.
        loss_scale: returns the current loss scale to divide out of output gradients, or
            ``None`` (no mixed-precision scaler).
        before_write: called before the first write of a step's statistics (so that a
            reduction still reading last step's buffers can finish first).
        before_observe: called with the layer before its statistics are written (the engine
            moves the layer's state to where its parameters now are).
    """

    def __init__(self, layers: Sequence, *, accumulation_steps: int,
                 loss_scale: Callable[[], float | torch.Tensor | None],
                 before_write: Callable[[], None],
                 before_observe: Callable[[object], None] = lambda layer: None) -> None:
        self.accumulation_steps = accumulation_steps
        self._loss_scale = loss_scale
        self._before_write = before_write
        self._before_observe = before_observe
        self.collecting = False
        self._handles = [layer.module.register_forward_hook(self._forward_hook(layer), with_kwargs=True)
                         for layer in layers]

    def _forward_hook(self, layer):
        @torch.compiler.disable  # see the module docstring
        def observe(module: nn.Module, inputs, kwargs, output):
            # The input may also come as a keyword (``linear(input=x)``).
            candidates = list(inputs[:1]) or list(kwargs.values())[:1]
            if not candidates or not isinstance(candidates[0], torch.Tensor):
                return
            self._before_write()
            self._before_observe(layer)
            with torch.no_grad():
                # whatever the method returns comes back with this call's output gradient
                call = layer.method.observe_activations(layer.adapter.activation_rows(candidates[0].detach()))
            if isinstance(output, torch.Tensor) and output.requires_grad:
                spatial = len(getattr(module, "kernel_size", ())) or 0
                batch = output.shape[0] if output.dim() > max(spatial + 1, 1) else 1
                scale = float(batch * self.accumulation_steps)
                output.register_hook(lambda grad: self._observe_output_grad(layer, grad, scale, call))

        def hook(module: nn.Module, inputs, kwargs, output):
            if self.collecting and module.training and torch.is_grad_enabled():
                observe(module, inputs, kwargs, output)

        return hook

    def _observe_output_grad(self, layer, grad: torch.Tensor, scale: float, call) -> None:
        with torch.no_grad():
            rows = layer.adapter.output_grad_rows(grad.detach())
            loss_scale = self._loss_scale()
            if loss_scale is not None:
                rows = rows.to(layer.method.factor_dtype) / loss_scale
            if call is None:
                layer.method.observe_output_grads(rows, scale)
            else:
                layer.method.observe_output_grads(rows, scale, call)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def grad_scaler_scale(grad_scaler) -> Callable[[], float | torch.Tensor | None]:
    """A function returning the loss scale to divide out of output gradients (``None``: none).

    ``grad_scaler``: ``None``; a ``torch.amp.GradScaler``, whose scale tensor is read
    directly (no host sync; ``None`` before its first ``scale()`` and while disabled); or a
    callable returning the current scale, a float or a tensor (kfac-pytorch's
    ``grad_scaler=scaler.get_scale``). Anything else raises ``TypeError``.
    """
    if grad_scaler is None:
        return lambda: None
    if isinstance(grad_scaler, torch.amp.GradScaler):
        return lambda: grad_scaler._scale if grad_scaler.is_enabled() else None
    if callable(grad_scaler):
        return grad_scaler
    raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, a callable returning the current loss "
                    f"scale, or None; got {type(grad_scaler).__name__} {grad_scaler!r}")
