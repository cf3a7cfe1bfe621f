"""``WhitenedMuon(model)`` on the Hugging Face models users have: GPT-2 (``Conv1D``), Llama and
a fused-expert mixture of experts, built from configs (no downloads).

Each trains on a learnable next-token task beside the usual split it replaces, torch's Muon on
the same hidden weights (the benchmarks' split, ``muon_param_split``: the fused experts' 3-D
weights expert by expert through examples/expert_muon.py's ``ExpertMuon``, since
``torch.optim.Muon`` takes 2-D weights only) + AdamW on everything else, at the same lr,
momentum and number of steps; it must end at least as low, within a margin (GPT-2 does not
gain on this task; see ``MARGIN``).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")

import hf_zoo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from expert_muon import ExpertMuon  # noqa: E402
from kron_examples_common import muon_param_split  # noqa: E402
from kron_precond import WhitenedMuon  # noqa: E402

transformers.logging.set_verbosity_error()
LR, MOMENTUM, STEPS, BATCH = 2e-2, 0.9, 16, 16
SKIP = ["lm_head", "embed", "wte", "wpe"]
# WhitenedMuon's final loss at most this much above Muon's. Measured (library defaults, 16 steps):
# Llama 0.0099 vs 0.0106 and Mixtral below Muon; GPT-2 0.397 vs Muon's 0.246 at lr 2e-2 (1.071 vs
# 0.837 at 1e-2, 0.062 vs 0.043 at 4e-2; with the input side alone, output_side=False: 0.284, 0.944,
# 0.045): on this lookup task GPT-2 does not gain, and the output side of its MLP's c_fc (the
# default "auto") loses more; the bound says how far. (Trained on bytes for 350 steps,
# `benchmarks/budget_speedup.py --arch gpt2`, it gains as the other models do, the output side
# level with the input side alone: docs/results.md.)
MARGIN = {"gpt2": 1.7, "llama": 1.05, "mixtral": 1.05}


def _muon_split(model, whitened):
    """The benchmarks' Muon split, on exactly the weights ``WhitenedMuon`` whitens."""
    hidden, experts, rest = muon_param_split(model, SKIP)
    assert {id(p) for p in hidden + experts} == {id(p) for p in whitened}
    muon = dict(lr=LR, momentum=MOMENTUM, adjust_lr_fn="match_rms_adamw")
    split = [torch.optim.Muon(hidden, **muon), torch.optim.AdamW(rest, lr=LR)]
    if experts:  # torch.optim.Muon's step and defaults, expert by expert
        split.append(ExpertMuon(experts, **muon))
    return split


def _train(model, optimizers, permutation):
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        ids = hf_zoo.next_token_batch(g, BATCH, permutation)
        for o in optimizers:
            o.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        for o in optimizers:
            o.step()
    held_out = hf_zoo.next_token_batch(torch.Generator().manual_seed(99), 64, permutation)
    with torch.no_grad():
        return model(input_ids=held_out, labels=held_out).loss.item()


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_whitened_muon_trains_hf_models_at_least_as_well_as_muon(name):
    permutation = torch.randperm(hf_zoo.VOCAB, generator=torch.Generator().manual_seed(0))
    losses = {}
    for kind in ("muon", "wmuon"):
        torch.manual_seed(0)
        model = hf_zoo.build(name, transformers)
        optimizer = WhitenedMuon(model, lr=LR, momentum=MOMENTUM, skip_layers=SKIP)
        whitened = optimizer.param_groups[0]["params"]
        if name == "gpt2":  # every block's Conv1D, on its input side
            assert len(whitened) == 4 * model.config.n_layer
        if name == "mixtral":  # the fused experts, expert by expert
            assert any(p.dim() == 3 for p in whitened)
        if kind == "muon":
            optimizer.remove()
            optimizers = _muon_split(model, whitened)
        else:
            optimizers = [optimizer]
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # every whitened layer got statistics
            losses[kind] = _train(model, optimizers, permutation)
    initial = torch.log(torch.tensor(float(hf_zoo.VOCAB))).item()
    print(f"\n{name}: held-out loss {losses} (uniform {initial:.3f})")
    assert losses["muon"] < 0.2 * initial and losses["wmuon"] < 0.2 * initial, losses
    assert losses["wmuon"] <= MARGIN[name] * losses["muon"], losses


def test_lora_adapters_are_whitened_and_centred_as_the_projections_they_wrap():
    """PEFT's LoRA: the frozen base weights are left alone, the adapters' A and B matrices are
    whitened, and the default centring sees them as parts of the projection they wrap: those of
    the query and key are centred, as the unwrapped model's q_proj and k_proj are, and no other."""
    peft = pytest.importorskip("peft", reason="peft is an optional extra ([trainers])")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    torch.manual_seed(0)
    plain = hf_zoo.build("llama", transformers)
    unwrapped = WhitenedMuon(plain, lr=LR, skip_layers=SKIP)
    names = dict((id(p), n) for n, p in plain.named_parameters())
    centred_projections = {names[i].rsplit(".", 1)[0] for i in unwrapped._statistics.centered}
    assert centred_projections == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj")}
    unwrapped.remove()

    model = peft.get_peft_model(hf_zoo.build("llama", transformers),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = WhitenedMuon(model, lr=LR, skip_layers=SKIP)
    names = dict((id(p), n) for n, p in model.named_parameters())
    whitened = {names[id(p)] for p in optimizer.param_groups[0]["params"]}
    assert whitened == {n for n, p in model.named_parameters() if p.requires_grad and ".lora_" in n}
    assert len(whitened) == 2 * len(targets) * 2  # A and B of every target, in 2 layers
    centred = {names[i] for i in optimizer._statistics.centered}
    assert centred == {f"base_model.model.model.layers.{i}.self_attn.{p}.lora_{ab}.default.weight"
                       for i in range(2) for p in ("q_proj", "k_proj") for ab in "AB"}
    permutation = torch.randperm(hf_zoo.VOCAB, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # every adapter got statistics
        for _ in range(8):
            ids = hf_zoo.next_token_batch(g, BATCH, permutation)
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert losses[-1] < losses[0]
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n  # the base model is frozen
    assert all(optimizer.state[p]["input_whitener"] is not None for p in optimizer.param_groups[0]["params"])
