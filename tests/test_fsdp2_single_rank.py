"""FSDP2 on a one-rank mesh: the parameters are still DTensors (torchtitan shards its models
at every world size, one process included). Reference: the same model unsharded, same
batches, in the same process; K-FAC and PSGD must give the same parameters (float64).

Before the fix, ``step()`` passed the DTensor gradients of a one-rank world straight to the
method (``aten.index.Tensor got mixed torch.Tensor and DTensor``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from dist_utils import run_workers
from kron_precond import KronPreconditioner

STEPS = 3


def _model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _train(model: nn.Module, kwargs: dict) -> list[torch.Tensor]:
    precond = KronPreconditioner(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    g = torch.Generator().manual_seed(11)
    for _ in range(STEPS):
        x = torch.randn(8, 5, generator=g, dtype=torch.float64)
        y = torch.randn(8, 3, generator=g, dtype=torch.float64)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        precond.step()
        opt.step()
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def one_rank_worker(rank: int, world: int, out_dir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    gaps = {}
    for name, kwargs in {"kfac": dict(method="kfac", inv_update_steps=2, inv_dtype=torch.float64),
                         "psgd": dict(method="psgd", precond_dtype=torch.float64)}.items():
        sharded = _model()
        for module in sharded:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        assert all(hasattr(p, "full_tensor") for p in sharded.parameters())
        got, expected = _train(sharded, kwargs), _train(_model(), kwargs)
        moved = max(float((e - p).abs().max()) for e, p in zip(expected, _model().parameters()))
        gaps[name] = (max(float((a - b).abs().max()) for a, b in zip(got, expected)), moved)
    return gaps


def test_one_rank_fsdp2_matches_the_unsharded_model(tmp_path):
    gaps = run_workers(one_rank_worker, 1, tmp_path, timeout=120)[0]
    for name, (gap, moved) in gaps.items():
        assert moved > 1e-3, f"{name}: the model did not train"
        assert gap < 1e-12, f"{name}: one-rank FSDP2 differs from the unsharded model by {gap:.2e}"


def mixed_precision_worker(rank: int, world: int, out_dir: str) -> dict:
    """A float64 model whose first Linear FSDP2 runs in bfloat16 (MixedPrecisionPolicy): its
    forward sees the gathered bfloat16 weight, which is not where the state lives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (1,))
    sharded = _model()
    # kept gathered after its forward (as FSDP2 keeps the root module): the hooks see the copy
    fully_shard(sharded[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                reshard_after_forward=False)
    fully_shard(sharded, mesh=mesh)
    plain = _model()
    factors, moves = [], []
    # the plain model's first layer reads what FSDP2 casts its input to
    plain[0].register_forward_pre_hook(lambda module, args: (args[0].bfloat16().double(),))
    sharded[0].register_forward_hook(lambda module, args, output: output.double())
    for model in (sharded, plain):
        precond = KronPreconditioner(model, method="kfac", factor_decay=0.5, inv_dtype=torch.float64)
        for layer in precond._layers:
            original = layer.method.to
            layer.method.to = lambda *a, _to=original, **k: (moves.append(a), _to(*a, **k))[1]
        g = torch.Generator().manual_seed(11)
        for _ in range(STEPS):
            model.zero_grad()
            model(torch.randn(8, 5, generator=g, dtype=torch.float64)).square().mean().backward()
            precond.step()
        factors.append(precond._layers[0].a_factor.clone())
    return {"factor_dtype": factors[0].dtype, "gap": float((factors[0] - factors[1]).abs().max()),
            "scale": float(factors[1].abs().max()), "moves": moves}


def test_fsdp2_mixed_precision_keeps_the_state_in_the_models_dtype(tmp_path):
    """FSDP2 swaps the gathered low-precision weight in for each forward: the state stays
    where the (sharded, float64) parameters are -- not cast to the forward's dtype and back,
    which rounded the float64 factors to float32 on every forward -- and nothing moves."""
    result = run_workers(mixed_precision_worker, 1, tmp_path, timeout=120)[0]
    assert result["moves"] == [], f"the state was moved on every forward: {result['moves']}"
    assert result["factor_dtype"] == torch.float64
    # the first layer's input factor, from the same bfloat16 inputs: float64 rounding only
    assert result["gap"] < 1e-13 * result["scale"], result


def penalty_worker(rank: int, world: int, out_dir: str) -> dict:
    """A gradient penalty's pass with respect to the inputs (another batch), then the training
    backward, on modules FSDP2 reshards after their forward or keeps gathered."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from kron_precond import WhitenedMuon

    mesh = init_device_mesh("cpu", (1,))
    gaps = {}
    for kind in ("kfac", "whitened_muon"):
        for reshard in (True, False):
            model = _model()
            for module in model:
                if isinstance(module, nn.Linear):
                    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh)
            if kind == "kfac":
                opt = KronPreconditioner(model, method="kfac", factor_update_steps=1, inv_update_steps=1)
            else:
                opt = WhitenedMuon(model, lr=1e-2, statistics_rows=None, statistics_every=1, center_inputs=False)
            g = torch.Generator().manual_seed(11)
            x = torch.randn(8, 5, generator=g, dtype=torch.float64)
            probe = (3 + torch.randn(8, 5, generator=g, dtype=torch.float64)).requires_grad_()
            torch.autograd.grad(model(probe).sum(), probe)  # writes no weight gradient
            F.mse_loss(model(x), torch.zeros(8, 3, dtype=torch.float64)).backward()
            opt.step()
            if kind == "kfac":
                got, rows = opt._layers[0].a_factor, torch.cat([x, torch.ones(8, 1, dtype=torch.float64)], 1)
            else:
                first = model[0].weight
                got, rows = opt.state[first]["input_factor"].reshape(5, 5), x
            gaps[f"{kind}, reshard_after_forward={reshard}"] = float((got.double() - rows.T @ rows / 8).abs().max())
    return gaps


def test_a_gradient_penalty_pass_stays_out_of_the_statistics_under_fsdp2(tmp_path):
    """The pass with respect to the inputs writes no weight gradient: the first layer's input
    factor holds the training batch's rows alone (float64 covariance), also where FSDP2
    reshards the weight right after the forward."""
    gaps = run_workers(penalty_worker, 1, tmp_path, timeout=120)[0]
    assert all(gap < 1e-12 for gap in gaps.values()), gaps
