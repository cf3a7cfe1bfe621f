"""benchmarks/ema_nesterov.py against the paper's rule written out in float64.

θ_{t+1} = A_t(θ_t + β_t m_t), m_{t+1} = γ m_t + (1 - γ)(θ_{t+1} - θ_t), the gradient taken at
the lookahead point, β_t = β · lr_t / lr_peak; here A_t is plain SGD (with a step-decay
schedule), so the reference tracks θ and m explicitly while the hooked optimizer only holds
the lookahead point in its parameters.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ema_nesterov import add_ema_nesterov  # noqa: E402

GAMMA, BETA, LR = 0.8, 2.0, 0.1


def loss_fn(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ w) - y).square().mean()


def problem(steps: int = 6):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(4, 3, generator=g, dtype=torch.float64)
    data = [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(steps)]
    return w0, data


def lr_at(t: int) -> float:
    return LR * 0.5 ** (t // 2)


def reference(w0: torch.Tensor, data) -> list[torch.Tensor]:
    """The lookahead point y_{t+1} = θ_{t+1} + β_{t+1} m_{t+1} after each step."""
    theta, m, out = w0.clone(), torch.zeros_like(w0), []
    beta = 0.0  # β_0: no lookahead before the first step
    for t, (x, y) in enumerate(data):
        look = (theta + beta * m).requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_fn(look, x, y), look)
        new_theta = look.detach() - lr_at(t) * grad
        m = GAMMA * m + (1 - GAMMA) * (new_theta - theta)
        theta = new_theta
        beta = BETA * lr_at(t) / LR  # the lr of the step just taken, as the hook reads it
        out.append(theta + beta * m)
    return out


def test_the_hooked_optimizer_is_the_written_out_rule():
    w0, data = problem()
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=LR)
    add_ema_nesterov(opt, gamma=GAMMA, beta=BETA)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_at(t) / LR)
    want = reference(w0, data)
    for (x, y), expected in zip(data, want):
        opt.zero_grad()
        loss_fn(w, x, y).backward()
        opt.step()
        sched.step()
        torch.testing.assert_close(w.detach(), expected, rtol=1e-12, atol=1e-14)
    plain = torch.nn.Parameter(w0.clone())
    sgd = torch.optim.SGD([plain], lr=LR)
    for x, y in data[:2]:
        sgd.zero_grad()
        loss_fn(plain, x, y).backward()
        sgd.step()
    assert not torch.allclose(plain.detach(), want[1])  # the lookahead changes the trajectory


def test_beta_zero_is_the_base_optimizer():
    w0, data = problem(3)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    hooked, plain = torch.optim.SGD([a], lr=LR, momentum=0.9), torch.optim.SGD([b], lr=LR, momentum=0.9)
    add_ema_nesterov(hooked, gamma=GAMMA, beta=0.0)
    for x, y in data:
        for w, opt in ((a, hooked), (b, plain)):
            opt.zero_grad()
            loss_fn(w, x, y).backward()
            opt.step()
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs", [dict(gamma=1.0), dict(gamma=-0.1), dict(beta=-1.0)])
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError):
        add_ema_nesterov(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), **kwargs)
