"""EMA-Nesterov lookahead around any torch optimizer (Yau et al., arXiv 2605.25395).

The paper's rule, with ``A_t`` the base optimizer's step (Muon, WhitenedMuon, AdamW, ...):

    θ_{t+1} = A_t(θ_t + β_t m_t)
    m_{t+1} = γ m_t + (1 - γ)(θ_{t+1} - θ_t)

``m`` is an exponential average of the parameter increments (a low-pass filter of the
trajectory), and the gradient is taken at the lookahead point ``y_t = θ_t + β_t m_t``. The
parameters therefore hold ``y_t`` between steps. A step hook recovers ``θ_t = y_t - β_t m_t``
after the base step has moved ``y_t`` to ``θ_{t+1}``, updates ``m`` and moves to the next
lookahead point.

``β_t`` follows the learning-rate schedule, ``β_t = β · lr_t / lr_peak``. The paper switches the
lookahead off during warm-up and the final decay; tying it to the lr does both under a
warm-up + cosine schedule and leaves ``y = θ`` when the lr reaches 0.
"""
from __future__ import annotations

from typing import Any

import torch


def add_ema_nesterov(optimizer: torch.optim.Optimizer, gamma: float = 0.9, beta: float = 1.0) -> Any:
    """Turn ``optimizer`` into its EMA-Nesterov version in place (a step post-hook).

    ``gamma``: the increments' averaging decay; ``beta``: the lookahead at peak lr. The peak lr
    is each group's lr when this is called (or its ``initial_lr`` if a scheduler set one).
    Returns the hook's handle (``.remove()`` stops the lookahead where it is)."""
    if not 0.0 <= gamma < 1.0:
        raise ValueError(f"gamma must be in [0, 1), got {gamma}")
    if beta < 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    peaks = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    ema: dict[torch.Tensor, torch.Tensor] = {}      # m, per parameter
    before: dict[torch.Tensor, torch.Tensor] = {}   # y_t, the parameters before the base step
    applied: dict[int, float] = {}                  # group index: the β_t its parameters hold

    def stepped(group: dict) -> list[torch.Tensor]:
        return [p for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in opt.param_groups:
            for p in stepped(group):
                if p in before:
                    before[p].copy_(p)
                else:
                    before[p] = p.detach().clone()

    @torch.no_grad()
    def post_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for i, group in enumerate(opt.param_groups):
            params = stepped(group)
            if not params:
                continue
            old_beta, new_beta = applied.get(i, 0.0), beta * group["lr"] / peaks[i]
            ms = [ema[p] if p in ema else ema.setdefault(p, torch.zeros_like(p)) for p in params]
            # θ_{t+1} - θ_t = p - (y_t - β_t m_t)
            increments = torch._foreach_sub(params, [before[p] for p in params])
            torch._foreach_add_(increments, ms, alpha=old_beta)
            torch._foreach_lerp_(ms, increments, 1 - gamma)
            torch._foreach_add_(params, ms, alpha=new_beta)  # y_{t+1} = θ_{t+1} + β_{t+1} m_{t+1}
            applied[i] = new_beta

    pre = optimizer.register_step_pre_hook(pre_step)
    post = optimizer.register_step_post_hook(post_step)

    class _Handles:
        def remove(self) -> None:
            pre.remove()
            post.remove()

    return _Handles()
