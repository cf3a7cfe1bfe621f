"""The owner exchange of FSDP2 models (``grad_worker_fraction=MEM_OPT`` on a 1-D mesh: full
gradients gathered to each layer's owner, its results scattered back as rows) on cases the
main FSDP2 suite's uniform float64 model does not reach, 2 gloo ranks against one process:

- layers of different dtypes on one owner (a float32 body and a float64 head) with ``kl_clip``:
  one wire dtype per owner on every rank, one dtype for the all-reduced sum (a rank-dependent
  dtype failed the collective on one rank and left the other waiting);
- a layer not called on one step: its owner sees no gradient (``None``), as one process does,
  not zeros (Shampoo's statistics and mass, PSGD's momentum moved on zeros);
- EK-FAC resumed from ``gather_state_dict()``: every rank projects its rows on the bases, so
  every rank gets them back on load, not only the layers' holders (the run resumed must equal
  the run uninterrupted).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dist_utils import run_workers
from kron_precond import DistributedStrategy, KronPreconditioner

F64 = torch.float64
BATCH = 8
STEPS = 4
SKIPPED_AT = 1  # the step on which layer b is not called


class Net(nn.Module):
    def __init__(self, head_dtype: torch.dtype = F64, body_dtype: torch.dtype = F64) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(4, 6).to(body_dtype)
        self.b = nn.Linear(6, 6).to(body_dtype)
        self.head = nn.Linear(6, 3).to(head_dtype)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x.to(self.a.weight.dtype)))
        if use_b:
            h = torch.tanh(self.b(h))
        return self.head(h.to(self.head.weight.dtype))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, 4, generator=g, dtype=F64), torch.randn(BATCH, 3, generator=g, dtype=F64)


CASES = {
    # name -> (KronPreconditioner kwargs, body dtype, whether layer b skips a step)
    "kfac-mixed-dtypes-kl": (dict(kl_clip=1e-3, lr=0.1, inv_dtype=F64), torch.float32, False),
    "shampoo-skipped-layer": (dict(method="shampoo", inv_update_steps=1, kl_clip=None), F64, True),
    "psgd-skipped-layer": (dict(method="psgd", precond_dtype=F64), F64, True),
}


def train(name: str, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    options, body_dtype, skips = CASES[name]
    model = Net(body_dtype=body_dtype)
    extra = {}
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.a, model.b, model.head):
            fully_shard(layer, mesh=mesh)
        extra = dict(grad_worker_fraction=DistributedStrategy.MEM_OPT)
    precond = KronPreconditioner(model, **options, **extra)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rows = BATCH // world
    trajectory = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        out = model(x[rank * rows:(rank + 1) * rows], use_b=not (skips and step == SKIPPED_AT))
        ((out.to(F64) - y[rank * rows:(rank + 1) * rows]) ** 2).mean().backward()
        precond.step()
        opt.step()
        trajectory.append(torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(F64)
                                     .reshape(-1) for p in model.parameters()]))
    return trajectory


def _ekfac_resumed(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build():
        model = Net()
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.a, model.b, model.head):
            fully_shard(layer, mesh=mesh)
        precond = KronPreconditioner(model, method="ekfac", inv_dtype=F64, inv_update_steps=3, kl_clip=None,
                                     grad_worker_fraction=DistributedStrategy.MEM_OPT)
        return model, precond, torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, precond, opt, s):
        x, y = batch(s)
        rows = BATCH // world
        opt.zero_grad()
        ((model(x[rank * rows:(rank + 1) * rows]) - y[rank * rows:(rank + 1) * rows]) ** 2).mean().backward()
        precond.step()
        opt.step()

    def params(model):
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])

    model, precond, opt = build()
    for s in range(4):  # a refresh at step 3: bases that differ from a fresh model's
        step(model, precond, opt, s)
    state = precond.gather_state_dict()
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    for s in range(4, 6):
        step(model, precond, opt, s)
    model2, precond2, opt2 = build()
    set_model_state_dict(model2, weights, options=StateDictOptions(full_state_dict=True))
    precond2.load_state_dict(state)
    for s in range(4, 6):
        step(model2, precond2, opt2, s)
    return {"uninterrupted": params(model), "resumed": params(model2)}


def _worker(rank: int, world: int, out_dir: str) -> dict:
    result: dict = {name: train(name, rank, world) for name in CASES}
    result["ekfac-resumed"] = _ekfac_resumed(rank, world)
    return result


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_workers(_worker, 2, tmp_path_factory.mktemp("exchange"), timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_the_owner_exchange_matches_one_process_on_every_rank(two_ranks, name):
    reference = train(name)
    tolerance = 1e-5 if CASES[name][1] == torch.float32 else 1e-10
    start = torch.cat([p.detach().to(F64).reshape(-1)
                       for p in Net(body_dtype=CASES[name][1]).parameters()])
    for rank, result in enumerate(two_ranks):
        for step, (got, expected) in enumerate(zip(result[name], reference)):
            moved = (expected - start).norm()
            assert (got - expected).norm() <= tolerance * moved, f"{name}, rank {rank}, step {step}"
            assert torch.equal(got, two_ranks[0][name][step]), f"{name}: rank {rank} differs from rank 0"


def test_kl_clip_over_layers_of_different_dtypes_in_one_process():
    """``kl_clip``'s sum accumulates in the widest of the layers' dtypes, whatever the first
    layer's dtype (a float32 layer first and a float64 one later once raised): the clipped
    gradients are the unclipped ones times ``min(1, sqrt(κ / |lr² Σ⟨V, ∇⟩|))``, computed here
    in float64 from the unclipped run."""
    kl_clip, lr = 1e-3, 0.1
    x, y = batch(0)
    written = {}
    for clip in (kl_clip, None):
        model = Net(head_dtype=F64, body_dtype=torch.float32)
        precond = KronPreconditioner(model, kl_clip=clip, lr=lr)
        ((model(x) - y) ** 2).mean().backward()
        raw = [p.grad.detach().clone().to(F64) for p in model.parameters()]
        precond.step()
        written[clip] = [p.grad.detach().clone().to(F64) for p in model.parameters()]
    total = sum((v * g).sum() for v, g in zip(written[None], raw))
    nu = min(1.0, (kl_clip / abs(lr ** 2 * total)).sqrt().item())
    assert nu < 1  # the clip acts here
    for clipped, unclipped in zip(written[kl_clip], written[None]):
        torch.testing.assert_close(clipped, nu * unclipped, rtol=1e-5, atol=1e-9)
