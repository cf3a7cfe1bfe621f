"""A layer that only part of a step's rows reach (a routed branch, an unfused expert), split
over micro-batches or ranks, gets one process's K-FAC / EK-FAC statistics on the full batch.

In one process on the full batch, the branch is called once on the ``n′`` routed rows and its
output-gradient rows are scaled by ``n′``. Split over micro-batches (and ranks), each call sees
a share of those rows, some calls none; the scale must still be ``n′``, the step's routed rows,
not a call's own rows times the micro-batches.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import average_gradients_by_hand, ranks_identical, run_workers
from kron_precond import KronPreconditioner

F64 = torch.float64
BATCH = 24  # divisible by 2, 3 and 4
STEPS = 5
SPAWN_TIMEOUT = 120.0

METHODS = {
    "kfac-eigen": dict(method="kfac", damping=1e-2, kl_clip=None, factor_decay=0.8),
    "kfac-inverse": dict(method="kfac", damping=1e-2, kl_clip=None, factor_decay=0.8, compute_method="inverse",
                         inv_update_steps=2),
    "ekfac": dict(method="ekfac", damping=1e-2, kl_clip=None, factor_decay=0.8, inv_update_steps=2),
}


class RoutedNet(nn.Module):
    """``c(h + tanh(b(h_routed)))`` with ``h = tanh(a(x))``: ``b`` runs on the rows whose first
    input is positive, and not at all on a slice that routes none."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        routed = (x[:, 0] > 0).nonzero().squeeze(1)
        if routed.numel():
            h = h.index_add(0, routed, torch.tanh(self.b(h[routed])))
        return self.c(h)


def make_net() -> RoutedNet:
    torch.manual_seed(7)
    return RoutedNet().to(F64)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows routed unevenly over the batch's slices; on even steps the first quarter routes none."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 4, generator=g, dtype=F64)
    x[:, 0] += torch.linspace(-1.5, 1.5, BATCH, dtype=F64)
    if step % 2 == 0:
        x[: BATCH // 4, 0] = -x[: BATCH // 4, 0].abs()
    return x, torch.randn(BATCH, 3, generator=g, dtype=F64)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def train(kw: dict, slices: int, rank: int = 0, world: int = 1) -> tuple[list[torch.Tensor], torch.Tensor, list[bool]]:
    """SGD + the preconditioner; this rank's share of each batch split into ``slices``
    micro-batches (losses divided by their number); gradients averaged over ranks as DDP does."""
    model = make_net()
    precond = KronPreconditioner(model, accumulation_steps=slices, inv_dtype=F64, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trajectory, identical = [], []
    for step in range(STEPS):
        x, y = batch(step)
        n = BATCH // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.chunk(slices), y.chunk(slices)):
            (F.mse_loss(model(xs), ys) / slices).backward()
        if world > 1:
            params = list(model.parameters())
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            average_gradients_by_hand(params, world, dist.all_reduce)
        precond.step()
        opt.step()
        trajectory.append(flat(model))
        if world > 1:
            identical.append(ranks_identical(trajectory[-1], world, dist.all_gather))
    g_factor = precond.layers["b"].g_factor.clone()
    precond.remove()
    return trajectory, g_factor, identical


def relative_gap(run: list[torch.Tensor], reference: list[torch.Tensor], initial: torch.Tensor) -> float:
    return max(((p - r).norm() / (r - initial).norm()).item() for p, r in zip(run, reference, strict=True))


def test_branch_g_is_the_routed_rows_mean_scaled_by_their_count():
    """The dense formula on the full batch: ``G = mean_routed(δ δᵀ)``, ``δ = grad · n′``."""
    model = make_net()
    precond = KronPreconditioner(model, method="kfac", kl_clip=None, inv_dtype=F64)
    seen = {}
    model.b.register_forward_hook(lambda m, i, o: seen.update(out=o.retain_grad() or o))
    x, y = batch(1)
    F.mse_loss(model(x), y).backward()
    precond.step()
    delta = seen["out"].grad * seen["out"].shape[0]
    torch.testing.assert_close(precond.layers["b"].g_factor, delta.t() @ delta / delta.shape[0],
                               rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("slices", [2, 3, 4])
def test_micro_batches_match_one_process_on_the_full_batch(name, slices):
    kw = METHODS[name]
    reference, g_reference, _ = train(kw, 1)
    run, g_run, _ = train(kw, slices)
    initial = flat(make_net())
    assert relative_gap(run, reference, initial) < 1e-10
    torch.testing.assert_close(g_run, g_reference, rtol=1e-10, atol=1e-14)


def _ranks_worker(rank: int, world: int, out_dir: str) -> dict:
    torch.set_num_threads(1)
    return {name: train(kw, 2 if name == "ekfac" else 1, rank, world) for name, kw in METHODS.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_match_one_process_on_the_full_batch(world, tmp_path):
    results = run_workers(_ranks_worker, world, tmp_path, timeout=SPAWN_TIMEOUT)
    initial = flat(make_net())
    for name, kw in METHODS.items():
        reference, g_reference, _ = train(kw, 1)
        for rank, result in enumerate(results):
            run, g_run, identical = result[name]
            assert all(identical), f"{name}: ranks differ"
            assert relative_gap(run, reference, initial) < 1e-10, f"{name} rank {rank}"
            torch.testing.assert_close(g_run, g_reference, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_unequal_micro_batches_under_a_loss_over_the_step_match_one_process(name):
    """Micro-batches of 5, 8 and 11 rows, each loss summed and divided by the step's elements
    (HF Trainer's ``num_items_in_batch``): the gradient is one process's, and so are G and the
    parameters."""
    kw = METHODS[name]
    reference, g_reference, _ = train(kw, 1)
    model = make_net()
    precond = KronPreconditioner(model, accumulation_steps=3, inv_dtype=F64, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(x.split([5, 8, 11]), y.split([5, 8, 11])):
            (F.mse_loss(model(xs), ys, reduction="sum") / y.numel()).backward()
        precond.step()
        opt.step()
        run.append(flat(model))
    assert relative_gap(run, reference, flat(make_net())) < 1e-10
    torch.testing.assert_close(precond.layers["b"].g_factor, g_reference, rtol=1e-10, atol=1e-14)
