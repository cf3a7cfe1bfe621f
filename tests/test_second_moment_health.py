"""Non-finite gradients under the moment-based methods: the moment keeps its value, the
gradient passes through, and the health report names the layer whose update was skipped."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from kron_precond import KronPreconditioner

F64 = torch.float64
STEPS = 101  # the moment-only method reports every 100 steps: steps 0 and 100


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)  # the same shape as ``a``: the two are stepped as one stack
        self.c = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def moments(precond: KronPreconditioner) -> dict[str, torch.Tensor]:
    return {name: state["moment"].clone() for name, state in precond.state_dict()["layers"].items()}


@pytest.mark.parametrize("method, options", [("second_moment", {}), ("ikfac", {"moment_decay": 0.9})])
def test_a_nan_gradient_skips_the_moment_and_is_reported(method, options):
    torch.manual_seed(0)
    net = Net().to(F64)
    precond = KronPreconditioner(net, method=method, **options)
    x, y = torch.randn(8, 4, dtype=F64), torch.randn(8, 3, dtype=F64)
    caught: list[warnings.WarningMessage] = []
    for step in range(STEPS):
        net.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        if step == 3:
            before = moments(precond)
            net.b.weight.grad[0, 0] = float("nan")
        with warnings.catch_warnings(record=True) as now:
            warnings.simplefilter("always")
            precond.step()
        caught.extend(now)
        if step == 3:
            assert torch.isnan(net.b.weight.grad[0, 0])  # passed through, as every method does
            after = moments(precond)
            assert torch.equal(after["b"], before["b"]), "a non-finite gradient entered the moment"
            assert not torch.equal(after["a"], before["a"])  # the stack's other layer moved on
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    skipped = [m for m in messages if "non-finite update" in m]
    assert skipped == ["kron_precond: skipped 1 non-finite update(s) of b; its state was left unchanged"], messages
