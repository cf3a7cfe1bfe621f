"""torchtitan: its own ``Trainer`` on the llama3 debug model (6.2M parameters; FSDP2, selective
activation checkpointing) with ``--override.imports kron_precond.integrations.torchtitan.
kron_optimizers``, on 2 gloo ranks against one process.

Reference, independent of the code under test: one process training on the same global
batches (torchtitan then still wraps the model with ``fully_shard``, on a one-rank mesh). Both
runs start from one seed checkpoint (torchtitan's ``create_seed_checkpoint``: its sharded
initialisation on a CPU mesh draws other numbers than an unsharded one). Checked:

* the override swaps the container in, and all 31 leaf ``Linear`` layers are registered;
* 2 ranks x 2 sequences and 1 process x 4 sequences give the same logged losses, the same
  K-FAC factors (so the output-gradient scale, ``accumulation_steps`` = world size, is right:
  torchtitan divides each rank's summed loss by the global token count) and the same
  parameters after 4 steps, within float32 tolerance (float32 parameters: with torchtitan's
  bf16 mixed precision the two runs round at different places);
* a torchtitan DCP checkpoint saved by the one process at step 2 resumes on 2 ranks (the
  preconditioner's state resharded by DCP) to the same parameters as the run that went on;
* gradient accumulation without the matching ``accumulation_steps`` is refused on the first
  step with the value to set.

Data: a word-level tokenizer and documents of exactly ``SEQ + 1`` tokens (one document is one
training sequence), written per run in the order each layout reads them (torchtitan gives
each rank a contiguous half of the documents).

Run time: two spawns (1 and 2 ranks), each importing torchtitan once (~15 s) and running its
phases in turn; 222 s on the shared 2-core machine at a load of ~10, where a phase's trainer
build and 4 steps took 35 s (1 process) and 59 s (2 ranks).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

# triton (through torch's compiler) before torchtitan.trainer: see examples/torchtitan_debugmodel.py
import torch._dynamo  # noqa: E402,F401

# The trainer, not just the package: torchtitan's trainer also needs triton importable.
pytest.importorskip(
    "torchtitan.trainer", reason="torchtitan's trainer is not importable; install it with `pip install -e "
    "'.[torchtitan]'` beside the installed torch (README, Install) and `triton --no-deps`")

from dist_utils import run_workers  # noqa: E402
from torchtitan_worker import TITAN_EXAMPLE, run_phases  # noqa: E402

write_texts, write_tokenizer = TITAN_EXAMPLE.write_texts, TITAN_EXAMPLE.write_tokenizer
# torchtitan imports an override's module by this name; the example is loaded by path (under a
# name of its own, registered in sys.modules), so the name is the loaded module's.
SDPA_OVERRIDE = f"{TITAN_EXAMPLE.sdpa_attention.__module__}.sdpa_attention"

SEQ, STEPS, SAVE_AT, GLOBAL_BATCH, WORLD = 32, 4, 2, 4, 2
WORDS = [f"w{i}" for i in range(200)]
KFAC = {"method": "kfac", "damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 2}
OVERRIDE = "kron_precond.integrations.torchtitan.kron_optimizers"
TIMEOUT = 400.0
# float32 end to end; the runs differ only in summation order (batch split, reductions). The
# factors and losses agree to rounding (measured 1.5e-6, 1e-7); K-FAC's inverse (damping 0.01)
# and Adam's normalisation amplify it in the parameters (measured gap 4.6e-5).
PARAM_TOL, LOSS_TOL, FACTOR_TOL = 2e-4, 1e-5, 1e-5
# AdamW's eps, raised from the debug config's 1e-8: Adam's first step is g / (|g| + eps), so an
# entry of the preconditioned gradient near 1e-8, which the two runs round differently, moves by
# up to +-lr in one and not the other (measured with 1e-8: a parameter gap of 4.7e-4, entries off by
# up to lr). With 1e-5 the update is smooth in g there and rounding stays rounding.
ADAM = {"eps": 1e-5}


def _sequences() -> list[list[str]]:
    """``STEPS x GLOBAL_BATCH`` documents of ``SEQ - 1`` words (+ BOS / EOS = ``SEQ + 1`` tokens)."""
    rng = random.Random(0)
    return [[" ".join(rng.choice(WORDS) for _ in range(SEQ - 1)) for _ in range(GLOBAL_BATCH)]
            for _ in range(STEPS)]


def _layout(docs: list[list[str]], steps: range, world: int) -> list[str]:
    """File order so that at step s the ranks together read ``docs[s]``: rank r's contiguous
    part of the file holds its ``GLOBAL_BATCH // world`` documents of every step in turn."""
    per_rank = GLOBAL_BATCH // world
    return [doc for r in range(world) for s in steps for doc in docs[s][r * per_rank:(r + 1) * per_rank]]


WMUON_OVERRIDE = "kron_precond.integrations.torchtitan.whitened_muon_optimizers"
# float32 Newton-Schulz so that the runs differ only by summation order, as above. Input side
# only: the output-gradient factor's float32 Cholesky turns summation-order noise into a 1e-3
# gap here; the output side's FSDP2 / HSDP equality is tested in float64 to 1e-10
# (test_whitened_muon_fsdp2.py).
WMUON = {"lr": 0.02, "statistics_every": 1, "factor_decay": 0.8, "ns_dtype": "float32",
         "skip_layers": ["lm_head"], "output_side": False}


def _args(tmp_path, name: str, *, data: str, local_batch: int, steps: int = STEPS, kron: dict | None = KFAC,
          extra: list[str] = (), override: str = OVERRIDE) -> list[str]:
    args = ["--module", "llama3", "--config", "llama3_debugmodel",
            "--training.steps", str(steps), "--training.seq_len", str(SEQ),
            "--training.local_batch_size", str(local_batch), "--training.mixed_precision_param", "float32",
            "--hf_assets_path", str(tmp_path / "tokenizer"), "--dataloader.dataset_path", str(tmp_path / data),
            "--dump_folder", str(tmp_path / name), "--validator.no-enable", "--metrics.log_freq", "1",
            "--override.imports", SDPA_OVERRIDE]
    if kron is not None:
        args.append(f"{override}={json.dumps(kron)}")
    return args + list(extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchtitan")
    write_tokenizer(tmp / "tokenizer", WORDS)
    docs = _sequences()
    write_texts(tmp / "data-one", _layout(docs, range(STEPS), 1))
    write_texts(tmp / "data-two", _layout(docs, range(STEPS), WORLD))
    write_texts(tmp / "data-two-resume", _layout(docs, range(SAVE_AT, STEPS), WORLD))
    seed = str(tmp / "seed" / "checkpoint" / "step-0")
    from_seed = ["--checkpoint.enable", "--checkpoint.initial_load_path", seed]
    no_saves = ["--checkpoint.interval", str(10 * STEPS), "--checkpoint.last_save_model_only"]
    resume = ["--checkpoint.enable", *no_saves,
              "--checkpoint.initial_load_path", str(tmp / "ref" / "checkpoint" / f"step-{SAVE_AT}"),
              "--checkpoint.no-initial-load-model-only", "--checkpoint.exclude_from_loading", "dataloader"]
    half = GLOBAL_BATCH // WORLD
    wmuon_resume = ["--checkpoint.enable", *no_saves,
                    "--checkpoint.initial_load_path", str(tmp / "wmuon-ref" / "checkpoint" / f"step-{SAVE_AT}"),
                    "--checkpoint.no-initial-load-model-only", "--checkpoint.exclude_from_loading", "dataloader"]
    one = run_workers(run_phases, 1, tmp / "out-one", [
        ("seed", {"seed_checkpoint": True, "args": _args(
            tmp, "seed", data="data-one", local_batch=GLOBAL_BATCH, kron=None,
            extra=["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--debug.seed", "0"])}),
        ("ref", {"optimizer_kwargs": ADAM, "args": _args(
            tmp, "ref", data="data-one", local_batch=GLOBAL_BATCH,
            extra=from_seed + ["--checkpoint.interval", str(SAVE_AT)])}),
        ("accumulating", {"expect_error": True, "args": _args(
            tmp, "accumulating", data="data-one", local_batch=half, steps=1,
            extra=["--training.global_batch_size", str(GLOBAL_BATCH)])}),
        ("accumulating-set", {"args": _args(
            tmp, "accumulating-set", data="data-one", local_batch=half, steps=1,
            kron={**KFAC, "accumulation_steps": GLOBAL_BATCH // half},
            extra=["--training.global_batch_size", str(GLOBAL_BATCH)])}),
        ("wmuon-ref", {"args": _args(
            tmp, "wmuon-ref", data="data-one", local_batch=GLOBAL_BATCH, kron=WMUON, override=WMUON_OVERRIDE,
            extra=from_seed + ["--checkpoint.interval", str(SAVE_AT)])}),
    ], timeout=TIMEOUT)[0]
    two = run_workers(run_phases, WORLD, tmp / "out-two", [
        ("fsdp", {"optimizer_kwargs": ADAM, "args": _args(
            tmp, "fsdp", data="data-two", local_batch=half, extra=from_seed + no_saves)}),
        ("resumed", {"optimizer_kwargs": ADAM, "args": _args(
            tmp, "resumed", data="data-two-resume", local_batch=half, extra=resume)}),
        ("wmuon-fsdp", {"args": _args(
            tmp, "wmuon-fsdp", data="data-two", local_batch=half, kron=WMUON, override=WMUON_OVERRIDE,
            extra=from_seed + no_saves)}),
        ("wmuon-resumed", {"args": _args(
            tmp, "wmuon-resumed", data="data-two-resume", local_batch=half, kron=WMUON, override=WMUON_OVERRIDE,
            extra=wmuon_resume)}),
    ], timeout=TIMEOUT)
    return one, two


def _relative_gap(params, reference, start) -> float:
    """``‖p − p_ref‖ / ‖p_ref − p_start‖`` over every parameter: 0 is identical, 1 is as far
    apart as the whole training displacement."""
    gap = sum(float((params[k].double() - reference[k].double()).pow(2).sum()) for k in reference)
    moved = sum(float((reference[k].double() - start[k].double()).pow(2).sum()) for k in reference)
    assert moved > 0, "the reference did not train"
    return (gap / moved) ** 0.5


def test_override_registers_every_linear_layer(runs):
    one, two = runs
    for run in (one["ref"], two[0]["fsdp"], two[1]["fsdp"]):
        assert run["container"] == "KronOptimizersContainer"
        assert run["method"] == "kfac" and run["steps"] == STEPS
        assert len(run["layers"]) == 31, run["layers"]  # 6 x (wqkv, wo, w1, w2, w3) + lm_head
        assert "lm_head" in run["layers"] and all("_checkpoint_wrapped_module" not in n for n in run["layers"])
    assert one["ref"]["accumulation_steps"] == 1
    assert two[0]["fsdp"]["accumulation_steps"] == WORLD and two[0]["fsdp"]["world_size"] == WORLD


def test_two_ranks_build_without_an_accumulation_warning(runs):
    """accumulation_steps counts every rank's micro-batches here; the container checks it, and
    the preconditioner's own first-step check (one rank's forwards) stays silent."""
    _, two = runs
    assert not [m for m in two[0]["fsdp"]["warnings"] if "accumulation_steps" in m], two[0]["fsdp"]["warnings"]


def test_two_ranks_match_one_process(runs):
    one, two = runs
    ref, fsdp = one["ref"], two[0]["fsdp"]
    assert len(ref["losses"]) == STEPS and all(loss == loss for loss in ref["losses"])
    for rank in range(WORLD):
        assert two[rank]["fsdp"]["losses"] == pytest.approx(ref["losses"], rel=LOSS_TOL, abs=0)
    for name in ("layers.0.attention.qkv_linear.wqkv", "layers.5.feed_forward.w2", "lm_head"):
        for factor in ("a_factor", "g_factor"):
            expected = ref["state"]["layers"][_state_name(ref["state"], name)][factor]
            got = fsdp["state"]["layers"][_state_name(fsdp["state"], name)][factor]
            err = float((got - expected).norm() / expected.norm())
            assert err < FACTOR_TOL, f"{name} {factor}: relative error {err:.2e}"
    gap = _relative_gap(fsdp["params"], ref["params"], one["seed"]["params"])
    assert gap < PARAM_TOL, f"2 ranks vs 1 process: relative gap {gap:.2e}"


def test_checkpoint_resumes_on_another_world_size(runs):
    one, two = runs
    resumed, ref = two[0]["resumed"], one["ref"]
    assert resumed["steps"] == STEPS  # the preconditioner's counters came back from step SAVE_AT
    assert resumed["losses"] == pytest.approx(ref["losses"][SAVE_AT:], rel=LOSS_TOL, abs=0)
    gap = _relative_gap(resumed["params"], ref["params"], one["seed"]["params"])
    assert gap < PARAM_TOL, f"resumed on 2 ranks from 1 process's step {SAVE_AT}: relative gap {gap:.2e}"


def test_gradient_accumulation_needs_matching_accumulation_steps(runs):
    one, _ = runs
    message = one["accumulating"]["error"]
    assert "accumulation_steps=1" in message and "to 2" in message, message
    matching = one["accumulating-set"]
    assert matching["accumulation_steps"] == 2 and matching["steps"] == 1
    assert all(loss == loss for loss in matching["losses"])


def test_whitened_muon_as_torchtitans_optimizer_matches_one_process_and_resumes_on_another_world_size(runs):
    """``whitened_muon_optimizers``: one WhitenedMuon whitens the 30 block Linear weights (not the
    embeddings, nor the output layer it is told to skip); FSDP2 on 2 ranks gives one process's run, and its state in
    torchtitan's DCP checkpoint, saved by one process, resumes on 2 ranks."""
    one, two = runs
    ref = one["wmuon-ref"]
    assert ref["container"] == "WhitenedMuonOptimizersContainer" and ref["steps"] == STEPS
    assert len(ref["whitened"]) == 30 and not any("lm_head" in n or "embed" in n for n in ref["whitened"])
    assert all(loss == loss for loss in ref["losses"]) and ref["losses"][-1] < ref["losses"][0]
    for rank in range(WORLD):
        assert two[rank]["wmuon-fsdp"]["losses"] == pytest.approx(ref["losses"], rel=LOSS_TOL, abs=0)
        assert two[rank]["wmuon-resumed"]["steps"] == STEPS
    gap = _relative_gap(two[0]["wmuon-fsdp"]["params"], ref["params"], one["seed"]["params"])
    assert gap < PARAM_TOL, f"2 ranks vs 1 process: relative gap {gap:.2e}"
    resumed = two[0]["wmuon-resumed"]
    assert resumed["losses"] == pytest.approx(ref["losses"][SAVE_AT:], rel=LOSS_TOL, abs=0)
    gap = _relative_gap(resumed["params"], ref["params"], one["seed"]["params"])
    assert gap < PARAM_TOL, f"resumed on 2 ranks from 1 process's step {SAVE_AT}: relative gap {gap:.2e}"


def test_whitened_muon_override_keeps_the_stock_adamw_settings_for_its_adamw_half():
    import copy

    from torchtitan.components.optimizer import default_adamw

    from kron_precond.integrations.torchtitan import whitened_muon_optimizers

    config = whitened_muon_optimizers(_for_loop(default_adamw(lr=1e-2)), skip_layers="^1$",
                                      lr=0.05, momentum=0.8)
    model = _tiny_model()
    twin = copy.deepcopy(model)
    container = config.build(model_parts=[model])
    optimizer = container.optimizers[0]
    groups = {g["algorithm"]: g for g in optimizer.param_groups}
    assert groups["whitened_muon"]["lr"] == 0.05 and groups["whitened_muon"]["momentum"] == 0.8
    assert groups["adamw"]["lr"] == 1e-2 and groups["adamw"]["param_names"] == ["0.0.bias", "1.weight", "1.bias"]
    assert groups["whitened_muon"]["param_names"] == ["0.0.weight"]
    # torchtitan divides each rank's summed loss by the global batch's tokens: the output side's
    # count is the one summed over ranks (tests/test_whitened_muon_rank_loss.py)
    assert optimizer._statistics.loss_over_all_ranks is True
    with pytest.raises(ValueError, match="nope"):
        whitened_muon_optimizers(default_adamw(lr=1e-2), nope=1)
    # torchtitan's flat, FQN-keyed state resumes bitwise in a new container
    x = torch.randn(4, 6)
    for _ in range(3):
        container.zero_grad()
        model(x).square().mean().backward()
        container.step()
    saved = copy.deepcopy(container.state_dict())
    assert any(key.endswith("input_whitener") for key in saved)
    twin.load_state_dict(model.state_dict())
    resumed = config.build(model_parts=[twin])
    resumed.load_state_dict(saved)
    for m, c in ((model, container), (twin, resumed)):
        c.zero_grad()
        m(x).square().mean().backward()
        c.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def _state_name(state: dict, canonical: str) -> str:
    matches = [n for n in state["layers"] if n.replace("_checkpoint_wrapped_module.", "") == canonical]
    assert len(matches) == 1, (canonical, sorted(state["layers"]))
    return matches[0]



# ---------------------------------------------------------------------- in-process, no trainer
def _plain_container(model, **fields):
    from torchtitan.components.optimizer import default_adamw

    from kron_precond.integrations.torchtitan import kron_optimizers

    return kron_optimizers(_for_loop(default_adamw(lr=1e-2)), **fields).build(model_parts=[model])


def _for_loop(config):
    """``config`` with torch's single-tensor optimizers: ``implementation`` is a field of the
    container's config (``default_adamw(implementation=...)`` would put it into AdamW's group
    settings and leave the container fused)."""
    import dataclasses

    return dataclasses.replace(config, implementation="for-loop")


def _tiny_model(wrap: bool = False):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(1)
    body = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh())
    return torch.nn.Sequential(checkpoint_wrapper(body) if wrap else body, torch.nn.Linear(5, 3))


def test_override_keeps_the_stock_groups_and_routes_settings():
    from torchtitan.components.optimizer import default_adamw

    from kron_precond.integrations.torchtitan import KronOptimizersContainer, kron_optimizers

    stock = default_adamw(lr=3e-4)
    config = kron_optimizers(stock, method="psgd", skip_layers="lm_head", precond_lr=0.2)
    assert isinstance(config, KronOptimizersContainer.Config)
    assert config.param_groups == stock.param_groups and config.implementation == stock.implementation
    assert (config.method, config.skip_layers, config.options) == ("psgd", ["lm_head"], {"precond_lr": 0.2})
    with pytest.raises(ValueError, match="method='nope'"):
        kron_optimizers(stock, method="nope")
    with pytest.raises(ValueError, match="accumulation_steps"):
        KronOptimizersContainer.Config(param_groups=stock.param_groups,
                                       options={"accumulation_steps": 2}).build(model_parts=[_tiny_model()])


def _assert_same_training(model, step, twin, twin_step) -> None:
    """Three steps of each on the same batches; then the parameters are bitwise equal."""
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        for net, take_step in ((model, step), (twin, twin_step)):
            net.zero_grad()
            ((net(x) - y) ** 2).mean().backward()
            take_step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q), float((p - q).abs().max())


def test_container_step_is_precondition_then_adamw():
    """Reference: KronPreconditioner + torch.optim.AdamW driven by hand on a copy of the model,
    with the implementation the container's config names ("for-loop": torch's single-tensor
    AdamW), so the two agree bitwise."""
    from kron_precond import KronPreconditioner

    model, twin = _tiny_model(), _tiny_model()
    container = _plain_container(model, **KFAC)
    group = container.optimizers[0].param_groups[0]
    # the config's implementation, not a group setting (it would be saved into checkpoints)
    assert "implementation" not in group and group["fused"] is False and group["foreach"] is False, group
    precond = KronPreconditioner(twin, **KFAC)
    adamw = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                              foreach=False, fused=False)
    _assert_same_training(model, container.step, twin, lambda: (precond.step(lr=1e-2), adamw.step()))


def test_kl_clip_reads_the_lr_of_the_groups_holding_the_preconditioned_layers():
    """torchtitan's param groups may put other parameters first (biases, a router at an lr of
    its own): kl_clip reads the lr of the group stepping the registered weights, as a
    KronPreconditioner + AdamW loop given that lr does (the reference, bitwise)."""
    from kron_precond import KronPreconditioner

    settings = {**KFAC, "kl_clip": 1e-6}  # a clip that binds: the lr it reads shows
    model, twin = _tiny_model(), _tiny_model()
    container = _plain_container(model, **settings)
    optimizer = container.optimizers[0]
    group = optimizer.param_groups[0]
    first = {**group, "params": [p for p in group["params"] if p.ndim == 1], "lr": 0.0}
    group["params"] = [p for p in group["params"] if p.ndim > 1]
    optimizer.param_groups.insert(0, first)  # the biases first, at lr 0
    precond = KronPreconditioner(twin, **settings)
    adamw = torch.optim.AdamW([{"params": [p for p in twin.parameters() if p.ndim == 1], "lr": 0.0},
                               {"params": [p for p in twin.parameters() if p.ndim > 1]}],
                              lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False, fused=False)
    _assert_same_training(model, container.step, twin, lambda: (precond.step(lr=1e-2), adamw.step()))


def _mem_opt_worker(rank, world, out_dir):
    """A container over a plain (unsharded) model whose layers' state lives on some ranks only
    (MEM_OPT): its state_dict, which torchtitan's checkpointer asks every rank for, holds every
    layer."""
    torch.manual_seed(1)
    model = _tiny_model()
    container = _plain_container(model, **{**KFAC, "grad_worker_fraction": "mem_opt"})
    g = torch.Generator().manual_seed(2 + rank)
    model.zero_grad()
    ((model(torch.randn(4, 6, generator=g)) - torch.randn(4, 3, generator=g)) ** 2).mean().backward()
    for p in model.parameters():  # what DDP does: every rank steps the mean gradient
        torch.distributed.all_reduce(p.grad)
        p.grad /= world
    container.step()
    return sorted(container.state_dict()["kron_precond"]["layers"])


def test_a_plain_model_at_mem_opt_saves_every_layer_on_every_rank(tmp_path):
    from kron_precond.integrations.torchtitan import STATE_KEY

    assert STATE_KEY == "kron_precond"
    results = run_workers(_mem_opt_worker, WORLD, tmp_path, timeout=TIMEOUT)
    assert results[0] == results[1] == ["0.0", "1"], results


def test_container_state_round_trips_under_canonical_names():
    model = _tiny_model(wrap=True)
    container = _plain_container(model, **KFAC)
    x = torch.randn(4, 6)
    model(x).pow(2).mean().backward()
    container.step()
    state = container.state_dict()
    assert sorted(state["kron_precond"]["layers"]) == ["0.0", "1"]  # no "_checkpoint_wrapped_module."
    fresh = _plain_container(_tiny_model(wrap=True), **KFAC)
    fresh.load_state_dict(state)
    assert fresh.preconditioner.steps == 1
    for name, layer in container.preconditioner.state_dict()["layers"].items():
        loaded = fresh.preconditioner.state_dict()["layers"][name]
        for factor in ("a_factor", "g_factor"):
            torch.testing.assert_close(loaded[factor], layer[factor], rtol=0, atol=0)
    with pytest.raises(ValueError, match="kron_precond"):
        fresh.load_state_dict({k: v for k, v in state.items() if k != "kron_precond"})


# ---------------------------------------------------------------------- whitened_muon_optimizers: stock groups
class _MoELike(torch.nn.Module):
    """The parameter names of torchtitan's qwen3 MoE model where its ``param_groups`` debug
    config's patterns look (``tok_embeddings.``, ``output.``, ``.router.gate.``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.tok_embeddings = torch.nn.Embedding(11, 6)
        block = torch.nn.Module()
        block.attention_norm = torch.nn.LayerNorm(6)
        block.moe = torch.nn.Module()
        block.moe.router = torch.nn.Module()
        block.moe.router.gate = torch.nn.Linear(6, 3, bias=False)
        block.w1 = torch.nn.Linear(6, 6)
        self.layers = torch.nn.ModuleList([block])
        self.norm = torch.nn.LayerNorm(6)
        self.output = torch.nn.Linear(6, 11, bias=False)

    def forward(self, ids):
        x = self.tok_embeddings(ids)
        block = self.layers[0]
        h = block.attention_norm(x)
        x = x + block.w1(h) + block.moe.router.gate(h).sum(-1, keepdim=True)
        return self.output(self.norm(x))


def _qwen3_param_groups_config():
    """torchtitan's own ``qwen3_debugmodel_moe_param_groups`` optimizer config: embeddings and
    output AdamW without weight decay, the router gate Adam at lr 1e-4, the rest AdamW wd 0.1."""
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel_moe_param_groups

    return qwen3_debugmodel_moe_param_groups().optimizer


def _settings_by_name(optimizer) -> dict[str, dict]:
    keys = ("algorithm", "lr", "weight_decay", "betas", "eps")
    return {name: {k: group[k] for k in keys if k in group}
            for group in optimizer.param_groups for name in group["param_names"]}


def test_whitened_muon_override_maps_every_stock_group_onto_its_parameters():
    """Each parameter takes the settings of the stock group whose pattern claims it (first match
    wins, as torchtitan assigns them): a whitened weight its group's lr and weight decay, an
    AdamW-half parameter its group's lr, betas, eps and weight decay (an Adam group without
    weight decay: 0). Keywords given explicitly apply to every group of their half."""
    from kron_precond.integrations.torchtitan import whitened_muon_optimizers

    stock = _qwen3_param_groups_config()
    adamw = {"algorithm": "adamw", "betas": (0.9, 0.95), "eps": 1e-8}
    expected = {
        "tok_embeddings.weight": {**adamw, "lr": 8e-4, "weight_decay": 0.0},
        "layers.0.attention_norm.weight": {**adamw, "lr": 8e-4, "weight_decay": 0.1},
        "layers.0.attention_norm.bias": {**adamw, "lr": 8e-4, "weight_decay": 0.1},
        "layers.0.moe.router.gate.weight": {"algorithm": "whitened_muon", "lr": 1e-4, "weight_decay": 0.0},
        "layers.0.w1.weight": {"algorithm": "whitened_muon", "lr": 8e-4, "weight_decay": 0.1},
        "layers.0.w1.bias": {**adamw, "lr": 8e-4, "weight_decay": 0.1},
        "norm.weight": {**adamw, "lr": 8e-4, "weight_decay": 0.1},
        "norm.bias": {**adamw, "lr": 8e-4, "weight_decay": 0.1},
        "output.weight": {"algorithm": "whitened_muon", "lr": 8e-4, "weight_decay": 0.0},
    }
    container = whitened_muon_optimizers(stock).build(model_parts=[_MoELike()])
    assert _settings_by_name(container.optimizers[0]) == expected
    # explicit keywords: every group of their half; the others keep the stock groups' values
    container = whitened_muon_optimizers(stock, lr=0.02, adamw_betas=[0.8, 0.9]).build(model_parts=[_MoELike()])
    settings = _settings_by_name(container.optimizers[0])
    for name, want in expected.items():
        if want["algorithm"] == "whitened_muon":
            want = {**want, "lr": 0.02}
        else:
            want = {**want, "betas": (0.8, 0.9)}
        assert settings[name] == want, name
    # it trains, and torchtitan's flat state resumes bitwise in a new container
    import copy

    model = _MoELike()
    twin = copy.deepcopy(model)
    config = whitened_muon_optimizers(stock, statistics_every=1)
    container = config.build(model_parts=[model])
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        container.zero_grad()
        model(ids).square().mean().backward()
        container.step()
    resumed = config.build(model_parts=[twin])
    twin.load_state_dict(model.state_dict())
    resumed.load_state_dict(copy.deepcopy(container.state_dict()))
    for net, c in ((model, container), (twin, resumed)):
        c.zero_grad()
        net(ids).square().mean().backward()
        c.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_whitened_muon_override_refuses_stock_settings_it_cannot_honour():
    """An Adam group's weight decay is L2 added to the gradient, which neither half of
    WhitenedMuon does: refused, naming the group, unless the keyword of the half it would feed
    is given. Settings neither half has (amsgrad, maximize, a key torch's Adam does not take)
    are refused too, and so is a parameter no stock pattern claims (torchtitan refuses it)."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    from kron_precond.integrations.torchtitan import whitened_muon_optimizers

    def stock(gate_kwargs, rest=".*"):
        return OptimizersContainer.Config(param_groups=[
            ParamGroupConfig(pattern=r"\.router\.gate\.", optimizer_name="Adam", optimizer_kwargs=gate_kwargs),
            ParamGroupConfig(pattern=rest, optimizer_name="AdamW",
                             optimizer_kwargs={"lr": 8e-4, "weight_decay": 0.1})])

    coupled = stock({"lr": 1e-4, "weight_decay": 0.01})
    with pytest.raises(ValueError, match=r"param_groups\[0\] \(Adam, .*weight_decay=0.01.*set weight_decay explicitly "
                                         r"\(for its whitened weights \['layers.0.moe.router.gate.weight'\]\)"):
        whitened_muon_optimizers(coupled).build(model_parts=[_MoELike()])
    container = whitened_muon_optimizers(coupled, weight_decay=0.05).build(model_parts=[_MoELike()])
    settings = _settings_by_name(container.optimizers[0])
    assert settings["layers.0.moe.router.gate.weight"]["weight_decay"] == 0.05
    assert settings["layers.0.w1.bias"]["weight_decay"] == 0.1
    for key, value in (("amsgrad", True), ("maximize", True), ("nope", 1)):
        with pytest.raises(ValueError, match=key):
            whitened_muon_optimizers(stock({"lr": 1e-4, key: value})).build(model_parts=[_MoELike()])
    # implementation switches change no number: accepted
    whitened_muon_optimizers(stock({"lr": 1e-4, "fused": False, "foreach": True})).build(model_parts=[_MoELike()])
    with pytest.raises(ValueError, match=r"no stock param group.*norm\.weight"):
        whitened_muon_optimizers(stock({"lr": 1e-4}, rest=r"^(tok_embeddings|layers\.0\.w1|output)\.")).build(
            model_parts=[_MoELike()])


# ---------------------------------------------------------------------- config keys
@pytest.mark.parametrize("factory", ["kron_optimizers", "whitened_muon_optimizers"])
def test_skip_layers_of_another_type_is_refused_by_name(factory):
    from torchtitan.components.optimizer import default_adamw

    import kron_precond.integrations.torchtitan as titan

    with pytest.raises(TypeError, match="skip_layers"):
        getattr(titan, factory)(default_adamw(lr=1e-3), skip_layers=5)


def test_unknown_and_unserialisable_keys_are_refused_when_configured():
    from torchtitan.components.optimizer import default_adamw

    from kron_precond.integrations.torchtitan import kron_optimizers, whitened_muon_optimizers

    stock = default_adamw(lr=1e-3)
    for key in ("horizon", "defaults", "nope"):  # the first two: local variables of WhitenedMuon.__init__
        with pytest.raises(ValueError, match=rf"\['{key}'\] are not WhitenedMuon keywords"):
            whitened_muon_optimizers(stock, **{key: 1})
    for factory in (kron_optimizers, whitened_muon_optimizers):
        for key in ("process_group", "grad_scaler"):
            with pytest.raises(ValueError, match=key):
                factory(stock, **{key: "x"})
    with pytest.raises(ValueError, match=r"\['dampin'\] are not KronPreconditioner options"):
        kron_optimizers(stock, dampin=0.01)
    # every method's options pass (a setting of another method warns when built, as KronPreconditioner does)
    kron_optimizers(stock, method="psgd", precond_lr=0.2, damping=0.01, kl_clip=None)


# ---------------------------------------------------------------------- the example's command line
def test_example_merges_the_users_override_imports_and_runs_whitened_muon(tmp_path):
    """``examples/torchtitan_debugmodel.py``: a user's ``--override.imports`` (after ``--``)
    joins the script's own entries (the CPU SDPA workaround stays); an entry of kron_precond's
    torchtitan module takes the place of the script's ``--method`` entry; ``--method
    whitened_muon`` is the README's WhitenedMuon command."""
    sdpa = f"{TITAN_EXAMPLE.sdpa_attention.__module__}.sdpa_attention"
    wmuon = WMUON_OVERRIDE + '={"lr": 0.02, "skip_layers": ["lm_head"]}'
    paths = dict(tokenizer=tmp_path / "t", data=tmp_path / "d", dump=tmp_path / "o")

    def imports(args):
        assert args.count("--override.imports") == 1, args
        start = args.index("--override.imports") + 1
        end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
        return args[start:end], args[:start - 1] + args[end:]

    args = TITAN_EXAMPLE.torchtitan_args(steps=2, method=None, cpu=True, **paths,
                                         extra=["--override.imports", wmuon, "--training.local_batch_size", "4"])
    entries, rest = imports(args)
    assert entries == [sdpa, wmuon]
    assert rest[-2:] == ["--training.local_batch_size", "4"]
    # the user's optimizer override replaces the script's K-FAC entry; = form too
    args = TITAN_EXAMPLE.torchtitan_args(steps=2, method="kfac", settings={"damping": 0.01}, cpu=True, **paths,
                                         extra=[f"--override.imports={wmuon}"])
    assert imports(args)[0] == [sdpa, wmuon]
    # --method whitened_muon: the README's command
    settings = TITAN_EXAMPLE.default_settings("whitened_muon")
    assert settings == {"lr": 0.02, "skip_layers": ["lm_head"]}
    args = TITAN_EXAMPLE.torchtitan_args(steps=2, method="whitened_muon", settings=settings, cpu=False, **paths)
    assert imports(args)[0] == [wmuon]
    assert TITAN_EXAMPLE.default_settings("kfac") == TITAN_EXAMPLE.KFAC_SETTINGS
    assert TITAN_EXAMPLE.default_settings("psgd") == {}
