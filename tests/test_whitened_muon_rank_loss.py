"""``WhitenedMuon``'s output side across ranks of unequal shards gives one process's factor on
the full batch, under either convention for the loss across ranks:

* each rank's loss is its own mean and the gradients are averaged (DDP, FSDP2's default): each
  rank scales its rows by its own count, which makes every row's ``δ`` the one process's for
  the layers every rank calls on all its rows (a layer some ranks call on part of theirs is
  the documented exception);
* each rank's loss is its share of the global batch's mean and the gradients are summed
  (torchtitan, whose container tells the optimizer: ``_statistics.loss_over_all_ranks``): the
  counts are summed over ranks with the sums, so also a layer that only some ranks call (a
  routed branch) gets one process's factor, and the parameters are one process's.

(The whiteners do not depend on the factors' overall scale; the factors are compared here.)
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
SHARDS = {2: [8, 16], 3: [4, 8, 12]}  # unequal local batches
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


def train(global_loss: bool, rank: int = 0, world: int = 1, steps: int = STEPS):
    model = make_net()
    opt = WhitenedMuon(model, lr=0.05, output_side=True, statistics_every=1, ns_dtype=F64, damping=0.3,
                       factor_decay=0.5)
    opt._statistics.loss_over_all_ranks = global_loss
    sizes = SHARDS.get(world, [BATCH])
    start = sum(sizes[:rank])
    trajectory, identical = [], []
    for step in range(steps):
        x, y = batch(step)
        x, y = x[start:start + sizes[rank]], y[start:start + sizes[rank]]
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
    return {"global": train(True, rank, world), "local, first step": train(False, rank, world, steps=1)}


@pytest.mark.parametrize("world", [2, 3])
def test_output_side_matches_one_process_under_either_loss_convention(world, tmp_path):
    initial = flat(make_net())
    results = run_workers(_worker, world, tmp_path, timeout=SPAWN_TIMEOUT)
    reference, reference_factors, _ = train(False)
    assert set(reference_factors) == {"a.weight", "b.weight", "c.weight"}
    _, first_factors, _ = train(False, steps=1)
    for rank, result in enumerate(results):
        trajectory, factors, identical = result["global"]
        assert all(identical), f"rank {rank}"
        for name, factor in reference_factors.items():
            torch.testing.assert_close(factors[name], factor, rtol=1e-10, atol=1e-14, msg=f"rank {rank} {name}")
        gap = max(((p - r).norm() / (r - initial).norm()).item() for p, r in zip(trajectory, reference))
        assert gap < 1e-10, f"rank {rank}: {gap:.2e}"
        # the layers every rank calls on all its rows, from the same weights
        _, factors, _ = result["local, first step"]
        for name in ("a.weight", "c.weight"):
            torch.testing.assert_close(factors[name], first_factors[name], rtol=1e-10, atol=1e-14,
                                       msg=f"DDP's convention, rank {rank} {name}")
