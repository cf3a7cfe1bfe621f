"""``torch.optim.Muon``'s step for fused expert weights ``[experts, out, in]``, expert by expert.

``torch.optim.Muon`` takes 2-D parameters only, so a Muon baseline on a mixture-of-experts
model would leave the experts (most of its weights) to AdamW. ``ExpertMuon`` applies torch's
own step (the same momentum, Nesterov, Newton-Schulz and lr adjustment calls) to each
``[out, in]`` slice, as if every expert were a parameter of its own: what a user who splits
the experts into separate matrices gets from ``torch.optim.Muon``.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.optim._muon import (
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from kron_precond.experts import is_transformers_experts


class ExpertMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` on 3-D ``[experts, out, in]`` parameters, one expert at a time
    (same arguments and defaults as ``torch.optim.Muon``)."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, adjust_lr_fn: str | None = None,
                 ns_steps: int = DEFAULT_NS_STEPS) -> None:
        params = list(params)
        for p in params:
            if p.dim() != 3:
                raise ValueError(f"ExpertMuon takes [experts, out, in] parameters, got shape {tuple(p.shape)}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      adjust_lr_fn=adjust_lr_fn, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                p.mul_(1 - lr * group["weight_decay"])
                for e in range(p.shape[0]):
                    ortho = _zeropower_via_newtonschulz(update[e], (DEFAULT_A, DEFAULT_B, DEFAULT_C),
                                                        group["ns_steps"], EPS)
                    p[e].add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p[e].shape))
        return loss


def expert_weights(model: nn.Module) -> list[nn.Parameter]:
    """The 3-D weights of transformers' fused experts modules, held ``[experts, out, in]`` (as
    ``MixtralExperts`` holds them; a transposed layout is refused: Muon's lr factor reads the
    shape)."""
    weights = []
    for name, module in model.named_modules():
        if is_transformers_experts(module):
            if module.is_transposed:
                raise ValueError(f"{name}: experts stored [experts, in, out] are not supported by ExpertMuon")
            weights += [p for p in module.parameters(recurse=False) if p.dim() == 3]
    return weights
