"""``WhitenedMuon``'s output side across ranks gives one process's factor on the full batch,
under either convention for the loss across ranks:

* each rank's loss is its own mean and the gradients are averaged (DDP, FSDP2's default);
* each rank's loss is its share of the global batch's mean and the gradients are summed
  (torchtitan, whose container tells the optimizer: ``_statistics.loss_over_all_ranks``);

also for a layer that only some ranks call (a routed branch): its steps then weigh in the
running average as one process's do. (The whiteners do not depend on the factors' overall
scale; the factors are compared here, and the parameters.)
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import ranks_identical, run_workers
from kron_precond import WhitenedMuon

F64 = torch.float64
BATCH = 24
STEPS = 4
SPAWN_TIMEOUT = 120.0


class BranchNet(nn.Module):
    """An ungated MLP whose second block ``b`` runs on the rows whose first input is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        routed = (x[:, 0] > 0).nonzero().squeeze(1)
        if routed.numel():
            h = h.index_add(0, routed, torch.tanh(self.b(h[routed])))
        return self.c(h)


def make_net() -> BranchNet:
    torch.manual_seed(3)
    return BranchNet().to(F64)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On odd steps only the last rank's rows (of 2 or 3 ranks) route any row to ``b``."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 6, generator=g, dtype=F64)
    if step % 2:
        x[: 2 * BATCH // 3, 0] = -x[: 2 * BATCH // 3, 0].abs()
    return x, torch.randn(BATCH, 3, generator=g, dtype=F64)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train(global_loss: bool, rank: int = 0, world: int = 1):
    model = make_net()
    opt = WhitenedMuon(model, lr=0.05, output_side=True, statistics_every=1, ns_dtype=F64, damping=0.3,
                       factor_decay=0.5)
    opt._statistics.loss_over_all_ranks = global_loss
    trajectory, identical = [], []
    for step in range(STEPS):
        x, y = batch(step)
        n = BATCH // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad(set_to_none=False)
        errors = (model(x) - y) ** 2
        (errors.sum() / (BATCH * 3) if global_loss else errors.mean()).backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                if not global_loss:
                    p.grad /= world
        opt.step()
        trajectory.append(flat(model))
        if world > 1:
            identical.append(ranks_identical(trajectory[-1], world, dist.all_gather))
    factors = {name: opt.state[p]["output_factor"].clone() for name, p in model.named_parameters()
               if "output_factor" in opt.state[p]}
    return trajectory, factors, identical


def _worker(rank: int, world: int, out_dir: str) -> dict:
    torch.set_num_threads(1)
    return {mode: train(mode, rank, world) for mode in (False, True)}


@pytest.mark.parametrize("world", [2, 3])
def test_output_side_matches_one_process_under_either_loss_convention(world, tmp_path):
    reference, reference_factors, _ = train(False)
    assert set(reference_factors) == {"a.weight", "b.weight", "c.weight"}
    initial = flat(make_net())
    results = run_workers(_worker, world, tmp_path, timeout=SPAWN_TIMEOUT)
    for global_loss in (False, True):
        for rank, result in enumerate(results):
            trajectory, factors, identical = result[global_loss]
            label = f"loss over all ranks: {global_loss}, rank {rank}"
            assert all(identical), label
            for name, factor in reference_factors.items():
                torch.testing.assert_close(factors[name], factor, rtol=1e-10, atol=1e-14, msg=f"{label} {name}")
            gap = max(((p - r).norm() / (r - initial).norm()).item() for p, r in zip(trajectory, reference))
            assert gap < 1e-10, f"{label}: {gap:.2e}"

