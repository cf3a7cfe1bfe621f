"""``torch.optim.Muon``'s step for fused expert weights ``[experts, out, in]``, expert by expert.

``torch.optim.Muon`` takes 2-D parameters only, so a Muon baseline on a mixture-of-experts
model would leave the experts (most of its weights) to AdamW. ``ExpertMuon`` applies torch's
own step (the same momentum, Nesterov, Newton-Schulz and lr adjustment calls) to each
``[out, in]`` slice, as if every expert were a parameter of its own. That is bitwise
``torch.optim.Muon`` on the experts split into parameters of their own whenever each expert
receives tokens; an expert that receives none in a step has a zero gradient slice here and
still takes its momentum's step and the weight decay, where a separate parameter left without
a gradient would be skipped.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

ADJUST_LR_FNS = ("original", "match_rms_adamw", None)


class ExpertMuon(torch.optim.Optimizer):
    """``torch.optim.Muon`` on 3-D ``[experts, out, in]`` parameters, one expert at a time.

    ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``adjust_lr_fn`` and ``ns_steps`` are
    ``torch.optim.Muon``'s, with its defaults; its Newton-Schulz coefficients and ``eps`` are
    used as they are."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr_fn: str | None = None) -> None:
        params = list(params)
        for p in params:
            if p.dim() != 3:
                raise ValueError(f"ExpertMuon takes [experts, out, in] parameters, got shape {tuple(p.shape)}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                      adjust_lr_fn=adjust_lr_fn, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        # torch's own step function, on each expert's [out, in] views of the weight, its gradient
        # and its momentum buffer (private, imported here so that importing this module needs none)
        from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _single_tensor_muon
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            views: tuple[list, list, list] = ([], [], [])
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    for tensors, whole in zip(views, (p, p.grad, buf)):
                        tensors.extend(whole.unbind())
            _single_tensor_muon(*views, lr=group["lr"], weight_decay=group["weight_decay"],
                                momentum=group["momentum"], nesterov=group["nesterov"],
                                ns_coefficients=(DEFAULT_A, DEFAULT_B, DEFAULT_C), ns_steps=group["ns_steps"],
                                eps=EPS, adjust_lr_fn=group["adjust_lr_fn"], has_complex=False)
        return loss
