"""transformers' fused experts (Mixtral, Qwen2-MoE, GPT-OSS layouts) under K-FAC / EK-FAC.

* the experts module alone, every experts implementation transformers runs (eager,
  batched_mm, grouped_mm), against the dense per-expert reference of tests/test_moe.py;
* tiny config-built Mixtral and Qwen2-MoE: coverage, no warnings, training versus AdamW;
* DDP at world 2 equals one process on the full batch (ranks route differently).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")

import hf_zoo  # noqa: E402
from dist_utils import run_workers  # noqa: E402
from kron_precond import KronPreconditioner, PreconditionedOptimizer  # noqa: E402
from test_moe import DAMPING, covariance, dense_reference, kfac_solution, routing, unit_matrix  # noqa: E402

F64 = torch.float64
transformers.logging.set_verbosity_error()


def _mixtral_experts(implementation, dtype):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    config = transformers.MixtralConfig(hidden_size=8, intermediate_size=4, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = implementation
    module = MixtralExperts(config).to(dtype)
    torch.nn.init.normal_(module.gate_up_proj, std=0.5)
    torch.nn.init.normal_(module.down_proj, std=0.5)
    return module


def _swiglu(zs):  # Mixtral: silu(gate) * up on the concatenated [gate; up] output
    gate, up = zs[0].chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_mixtral_experts_equal_dense_reference(implementation):
    dtype = torch.float32 if implementation == "grouped_mm" else F64  # grouped_mm has no float64 kernel
    tol = dict(rtol=2e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-8, atol=1e-10)
    torch.manual_seed(0)
    module = _mixtral_experts(implementation, dtype)
    E, T = 4, 30
    x = torch.randn(T, 8, dtype=dtype)  # grouped_mm needs 16-byte strides
    index, weights = routing(T, E, 2, seed=1)
    weights = weights.to(dtype)
    precond = KronPreconditioner(module, method="kfac", damping=DAMPING, kl_clip=None, inv_dtype=F64)
    assert sorted(precond.layers) == sorted(f"{w}.{e}" for w in ("gate_up_proj", "down_proj") for e in range(E))
    module(x, index, weights).pow(2).mean().backward()
    precond.step()
    ref = dense_reference(x.to(F64), index, weights.to(F64), [(module.gate_up_proj.to(F64), None)],
                          (module.down_proj.to(F64), None), _swiglu)
    for e in range(E):
        rec = ref[e]
        for name, a, g, grad in (("gate_up_proj", rec["a0"], rec["g0"], rec["grads"][0]),
                                 ("down_proj", rec["a_out"], rec["g_out"], rec["grads"][1])):
            layer = precond.layers[f"{name}.{e}"]
            A, G = covariance(a, False), covariance(g, False)
            torch.testing.assert_close(layer.a_factor.to(F64), A, **tol)
            torch.testing.assert_close(layer.g_factor.to(F64), G, **tol)
            torch.testing.assert_close(getattr(module, name).grad[e].to(F64), kfac_solution(G, A, grad),
                                       rtol=tol["rtol"] * 10, atol=tol["atol"] * 10)


def test_pairs_routed_with_weight_zero_are_left_out_like_the_longcat_zero_experts():
    """LongCat-Flash sends a token's choices of its zero-computation experts to real experts with
    routing weight 0 (to spread the load): those rows feed no gradient, so they are left out of
    every factor, as the dense reference run on the pairs with a weight does."""
    torch.manual_seed(0)
    module = _mixtral_experts("eager", F64)
    E, T = 4, 30
    x = torch.randn(T, 8, dtype=F64)
    index, weights = routing(T, E, 2, seed=1)
    weights = weights.to(F64)
    weights[::3, 1] = 0.0  # a third of the second choices: a zero expert's dummy routing
    precond = KronPreconditioner(module, method="kfac", damping=DAMPING, kl_clip=None, inv_dtype=F64)
    module(x, index, weights).pow(2).mean().backward()
    precond.step()
    routed = torch.where(weights != 0, index, torch.full_like(index, -1))
    ref = dense_reference(x, routed, weights, [(module.gate_up_proj.to(F64), None)],
                          (module.down_proj.to(F64), None), _swiglu)
    for e in range(E):
        rec = ref[e]
        for name, a, g in (("gate_up_proj", rec["a0"], rec["g0"]), ("down_proj", rec["a_out"], rec["g_out"])):
            layer = precond.layers[f"{name}.{e}"]
            torch.testing.assert_close(layer.a_factor.to(F64), covariance(a, False), rtol=1e-8, atol=1e-10,
                                       msg=lambda m, name=name, e=e: f"{name}.{e} A: {m}")
            torch.testing.assert_close(layer.g_factor.to(F64), covariance(g, False), rtol=1e-8, atol=1e-10,
                                       msg=lambda m, name=name, e=e: f"{name}.{e} G: {m}")


def test_gpt_oss_layout_transposed_biased_interleaved_clamped():
    """GPT-OSS stores [E, in, out] weights with biases, interleaves gate and up and clamps
    them: the pull-back through its own gate must follow the clamp."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    config = transformers.GptOssConfig(hidden_size=5, intermediate_size=4, num_local_experts=3,
                                       num_experts_per_tok=2, swiglu_limit=0.7)
    config._experts_implementation = "eager"
    module = GptOssExperts(config).to(F64)
    torch.manual_seed(2)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.6)
    E, T = 3, 24
    x = torch.randn(T, 5, dtype=F64)
    index, weights = routing(T, E, 2, seed=3)
    precond = KronPreconditioner(module, method="kfac", damping=DAMPING, kl_clip=None, inv_dtype=F64)
    module(x, index, weights).pow(2).mean().backward()
    precond.step()
    alpha, limit = module.alpha, module.limit

    def gate(zs):
        g, u = zs[0][..., ::2].clamp(max=limit), zs[0][..., 1::2].clamp(-limit, limit)
        return (u + 1) * (g * torch.sigmoid(g * alpha))

    ref = dense_reference(x, index, weights, [(module.gate_up_proj.transpose(1, 2), module.gate_up_proj_bias)],
                          (module.down_proj.transpose(1, 2), module.down_proj_bias), gate)
    clamped = sum(int((r["a0"] @ module.gate_up_proj[e] + module.gate_up_proj_bias[e]).abs().gt(limit).sum())
                  for e, r in enumerate(ref) if r["rows"])
    assert clamped > 0  # the clamp is active on some rows
    for e in range(E):
        rec = ref[e]
        for name, a, g, grad in (("gate_up_proj", rec["a0"], rec["g0"], rec["grads"][0]),
                                 ("down_proj", rec["a_out"], rec["g_out"], rec["grads"][1])):
            A, G = covariance(a, True), covariance(g, False)
            layer = precond.layers[f"{name}.{e}"]
            torch.testing.assert_close(layer.a_factor, A, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(layer.g_factor, G, rtol=1e-10, atol=1e-12)
            got = unit_matrix(getattr(module, name), getattr(module, f"{name}_bias"), e, transposed=True)
            torch.testing.assert_close(got, kfac_solution(G, A, grad), rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------- tiny models
PERMUTATION_SEED, DATA_SEED, STEPS = 1, 2, 30


def _train(name, method, lr):
    torch.manual_seed(0)
    model = hf_zoo.build(name, transformers)
    permutation = torch.randperm(hf_zoo.VOCAB, generator=torch.Generator().manual_seed(PERMUTATION_SEED))
    data = torch.Generator().manual_seed(DATA_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if method is not None:
        options = dict(kl_clip=None, damping=1e-3)
        if method == "kfac":
            options["inv_update_steps"] = 5
        optimizer = PreconditionedOptimizer(optimizer, KronPreconditioner(model, method=method, **options))
    losses = []
    for _ in range(STEPS):
        ids = hf_zoo.next_token_batch(data, 8, permutation)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_tiny_moe_registers_experts_and_trains_at_least_as_well_as_adamw(name):
    model = hf_zoo.build(name, transformers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "registered but saw no data", no stale statistics
        for method in ("kfac", "ekfac"):
            precond = KronPreconditioner(model, method=method, kl_clip=None, inv_update_steps=2)
            _, experts = hf_zoo.expert_coverage(precond, model)
            assert experts >= 0.9, (name, method, experts)
            ids = hf_zoo.next_token_batch(torch.Generator().manual_seed(0), 8, torch.arange(hf_zoo.VOCAB).roll(1))
            for _ in range(4):
                model.zero_grad()
                model(input_ids=ids, labels=ids).loss.backward()
                precond.step()
            unseen = [n for n, layer in precond.layers.items() if not bool(layer.observed())]
            assert not unseen, unseen
            precond.remove()
    # Mean loss over the run (how fast it learns), each at its best learning rate of the grid.
    grid = (1e-2, 3e-2)
    best = {method: min(_train(name, method, lr) for lr in grid) for method in (None, "kfac", "ekfac")}
    print(f"{name}: mean loss over {STEPS} steps, best of lr {grid}: AdamW {best[None]:.3f}, "
          f"K-FAC+AdamW {best['kfac']:.3f}, EK-FAC+AdamW {best['ekfac']:.3f}")
    assert best["kfac"] <= best[None], best
    assert best["ekfac"] <= best[None], best


# ---------------------------------------------------------------------- DDP
DDP_STEPS, DDP_BATCH = 3, 4  # few rows per expert: nearly singular factors (see the test)


def _ddp_model():
    torch.manual_seed(0)
    return hf_zoo.build("mixtral", transformers, experts_implementation="batched_mm", num_hidden_layers=1).to(F64)


def _ddp_batches():
    """Per step, the full batch (both ranks' halves): random tokens, so the halves route differently."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, hf_zoo.VOCAB, (2 * DDP_BATCH, hf_zoo.SEQ), generator=g) for _ in range(DDP_STEPS)]


def _run(model, method, batches, rank=0, world=1):
    precond = KronPreconditioner(model, method=method, kl_clip=1e-2, lr=0.05, damping=1e-3,
                                 inv_update_steps=2, inv_dtype=F64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    inner = model.module if hasattr(model, "module") else model
    routed = []  # the first layer's expert choices on this rank's first batch
    hook = inner.model.layers[0].mlp.experts.register_forward_hook(
        lambda module, args, output: routed.append(args[1].clone()) if not routed else None)
    for full in batches:
        ids = full[rank * DDP_BATCH:(rank + 1) * DDP_BATCH] if world > 1 else full
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        precond.step()
        optimizer.step()
    hook.remove()
    owners = {name: precond.assignment.owner(name, "A") for name, layer in precond.layers.items()
              if layer.expert is not None}
    return {n: p.detach().clone() for n, p in inner.named_parameters()}, routed[0], owners


def ddp_worker(rank, world, out_dir):
    results = {}
    for method in ("kfac", "ekfac"):
        model = torch.nn.parallel.DistributedDataParallel(_ddp_model())
        params, routed, owners = _run(model, method, _ddp_batches(), rank, world)
        results[method] = {"params": params, "routed": torch.bincount(routed.reshape(-1), minlength=4),
                           "owners": owners}
    return results


def test_ddp_world_2_equals_one_process(tmp_path):
    """K-FAC and EK-FAC, float64: both ranks end where one process on the full batch does,
    although the ranks route their halves differently (expert row counts differ per rank).

    Experts get fewer rows than their factors' size, so the factors have null spaces whose
    eigenbasis the summation order decides; EK-FAC averages its scaling over such clusters
    (methods/ekfac.py), so it agrees too. Before that, with 4 or 8 sequences per rank EK-FAC
    drifted by 1e-9 to 1e-7 after three steps (K-FAC agreed)."""
    ranks = run_workers(ddp_worker, 2, tmp_path, timeout=240)
    initial = dict(_ddp_model().named_parameters())
    for method in ("kfac", "ekfac"):
        single, _, _ = _run(_ddp_model(), method, _ddp_batches())
        assert not torch.equal(ranks[0][method]["routed"], ranks[1][method]["routed"])
        owners = ranks[0][method]["owners"]
        assert len(owners) == 2 * 4 and set(owners.values()) == {0, 1}  # experts are placed like layers
        for name, value in single.items():
            for rank in ranks:
                torch.testing.assert_close(rank[method]["params"][name], value, rtol=1e-9, atol=1e-11,
                                           msg=lambda m, method=method, name=name: f"{method} {name}: {m}")
        moved = initial["model.layers.0.mlp.experts.gate_up_proj"] - single["model.layers.0.mlp.experts.gate_up_proj"]
        assert moved.abs().amax() > 1e-4  # the experts were trained
