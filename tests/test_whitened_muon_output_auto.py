"""``WhitenedMuon(output_side="auto")``: the output side on the first layer of each ungated MLP.

The expected sets below come from the architectures, not from the code: GPT-2's MLP is
``c_fc`` (4x wide, GELU) then ``c_proj``; Llama's and the mixtures of experts' MLPs are gated
(SwiGLU: a gate and an up projection of one shape, or one fused gate-and-up weight); BERT's
two MLP layers sit under different parents (``intermediate.dense``, ``output.dense``), which
the rule does not recognise (documented).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import RoutedExperts, WhitenedMuon

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _stepped(model, opt, steps=2, dim=None, seed=0):
    """Train ``model`` a few steps on random regression targets (statistics on every step)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 3, dim, generator=g, dtype=torch.float64)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def _output_sides(opt, model) -> set[str]:
    """Names of the weights that keep an output factor after a statistics step."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)] for p, state in opt.state.items() if "output_factor" in state}


class UngatedMLP(nn.Module):
    def __init__(self, d=4, f=12):
        super().__init__()
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class GatedMLP(nn.Module):
    def __init__(self, d=4, f=12):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class FusedGatedMLP(nn.Module):
    def __init__(self, d=4, f=12):
        super().__init__()
        self.gate_up, self.down = nn.Linear(d, 2 * f, bias=False), nn.Linear(f, d)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SplitMLP(nn.Module):
    """BERT's layout: the two layers of one MLP under different parents."""

    def __init__(self, d=4, f=12):
        super().__init__()
        self.intermediate, self.output = nn.Sequential(nn.Linear(d, f)), nn.Sequential(nn.Linear(f, d))

    def forward(self, x):
        return self.output(F.gelu(self.intermediate(x)))


class Blocks(nn.Module):
    def __init__(self, *mlps):
        super().__init__()
        self.attn = nn.Linear(4, 4)  # a square sibling of every MLP
        self.mlps = nn.ModuleList(mlps)

    def forward(self, x):
        x = x + self.attn(x)
        for mlp in self.mlps:
            x = x + mlp(x)
        return x


def test_auto_whitens_the_first_layer_of_ungated_mlps_and_no_gated_one():
    torch.manual_seed(0)
    model = Blocks(UngatedMLP(), GatedMLP(), FusedGatedMLP(), SplitMLP(), nn.Sequential(nn.Linear(4, 8), nn.GELU(),
                                                                                         nn.Linear(8, 4))).double()
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=1, output_side="auto", ns_dtype=torch.float64)
    _stepped(model, opt, dim=4)
    assert _output_sides(opt, model) == {"mlps.0.up.weight", "mlps.4.0.weight"}
    # "wide" takes every wider output: the gated projections and the split MLP's first layer too
    wide = copy.deepcopy(model)
    opt = WhitenedMuon(wide, lr=1e-2, statistics_every=1, output_side="wide", ns_dtype=torch.float64)
    _stepped(wide, opt, dim=4)
    assert _output_sides(opt, wide) == {"mlps.0.up.weight", "mlps.1.gate.weight", "mlps.1.up.weight",
                                        "mlps.2.gate_up.weight", "mlps.3.intermediate.0.weight", "mlps.4.0.weight"}


class WideQueryAttention(nn.Module):
    """Grouped-query attention whose query is wider than the model (heads x head_dim > d, the
    proportions of Qwen3-0.6B/4B and Gemma2-9B): ``q_proj [f, d]`` beside ``o_proj [d, f]``."""

    def __init__(self, d=4, heads=4, head_dim=2, kv_heads=1):
        super().__init__()
        self.heads, self.head_dim, self.kv_heads = heads, head_dim, kv_heads
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (p(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2) for p in (self.k_proj, self.v_proj))
        k, v = (z.repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(attended.transpose(1, 2).reshape(b, t, -1))


def test_auto_takes_neither_a_wide_query_nor_a_gated_mlp_narrower_than_the_model():
    """A wide query beside its output projection, and a gated MLP narrower than the model (a
    shared expert of DeepSeek-V3's or GLM-4.5's proportions: its ``down [d, f]`` is the wider
    side, beside two ``[f, d]``), look like an ungated MLP's two layers by shape alone: neither
    is one, and "auto" whitens no output side there."""
    torch.manual_seed(0)
    model = Blocks(WideQueryAttention(), GatedMLP(d=4, f=2), UngatedMLP()).double()
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=1, output_side="auto", ns_dtype=torch.float64)
    _stepped(model, opt, dim=4)
    assert _output_sides(opt, model) == {"mlps.2.up.weight"}


def test_auto_on_fused_experts_whitens_an_ungated_up_projection():
    """``RoutedExperts`` is an ungated expert MLP: up ``[E, 5, 4]``, GELU, down ``[E, 4, 5]``."""
    torch.manual_seed(0)
    experts = RoutedExperts(3, 4, 5).double()

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.experts = nn.Linear(4, 3, bias=False).double(), experts

        def forward(self, x):
            flat = x.reshape(-1, 4)
            weights, index = self.router(flat).softmax(-1).topk(2, dim=-1)
            return self.experts(flat, index, weights)

    model = MoE()
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=1, output_side="auto", skip_layers=["router"],
                       ns_dtype=torch.float64)
    _stepped(model, opt, dim=4)
    assert _output_sides(opt, model) == {"experts.up_weight"}


def test_auto_in_the_list_form_whitens_no_output_side():
    torch.manual_seed(0)
    mlp = UngatedMLP().double()
    opt = WhitenedMuon([mlp.up, mlp.down], lr=1e-2, statistics_every=1, output_side="auto", ns_dtype=torch.float64)
    _stepped(mlp, opt, dim=4)
    assert not _output_sides(opt, mlp)


def test_auto_on_the_examples_gpt_steps_exactly_as_wide():
    """The examples' GPT (``nn.Linear`` q/k/v/out, MLP ``Linear(d, 4d)``, GELU, ``Linear(4d, d)``):
    its wider outputs are the MLPs' first layers alone, so ``"auto"`` and ``"wide"`` whiten the
    same weights and step bitwise alike; both differ from the input side alone."""
    from char_lm import ModelConfig, build_model
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=16, n_layers=2, n_heads=2, seq_len=8))
    ids = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(1))
    finals, sides = {}, {}
    for output_side in (False, "wide", "auto"):
        twin = copy.deepcopy(model)
        opt = WhitenedMuon(twin, lr=1e-2, statistics_every=1, output_side=output_side,
                           skip_layers=["Embedding", "lm_head"])
        for _ in range(3):
            opt.zero_grad()
            logits = twin(ids[:, :-1])
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
            opt.step()
        finals[output_side] = [p.detach().clone() for p in twin.parameters()]
        sides[output_side] = _output_sides(opt, twin)
    assert sides["auto"] == {"blocks.0.mlp.0.weight", "blocks.1.mlp.0.weight"} == sides["wide"]
    for a, b in zip(finals["auto"], finals["wide"]):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(finals["auto"], finals[False]))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
                                  "gpt_oss"])
def test_auto_on_the_hugging_face_zoo(name):
    """GPT-2: ``c_fc`` of each block (its ``Conv1D`` read as ``[out, in]``); every gated model
    (Llama, the mixtures of experts: gate and up apart, or fused): none; BERT: none (its MLP's
    layers under different parents). A model without an output side steps as ``False`` does,
    bitwise, and registers no output hook."""
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    import hf_zoo
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = hf_zoo.build(name, transformers)
    ids = hf_zoo.next_token_batch(torch.Generator().manual_seed(0), 4, torch.arange(hf_zoo.VOCAB).roll(1))
    finals, sides = {}, {}
    for output_side in (False, "auto"):
        twin = copy.deepcopy(model)
        opt = WhitenedMuon(twin, lr=1e-2, statistics_every=1, output_side=output_side,
                           skip_layers=["Embedding", "lm_head", "embed", "wte", "wpe", "router", "gate$"])
        torch.manual_seed(1)  # the same dropout masks in both runs
        for _ in range(2):
            opt.zero_grad()
            twin(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        finals[output_side] = [p.detach().clone() for p in twin.parameters()]
        sides[output_side] = _output_sides(opt, twin)
    assert not sides[False]
    if name == "gpt2":
        assert sides["auto"] == {"transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.weight"}
        assert any(not torch.equal(a, b) for a, b in zip(finals["auto"], finals[False]))
    else:
        assert sides["auto"] == set()
        for a, b in zip(finals["auto"], finals[False]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name,targets", [("llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]),
                                          ("gpt2", ["c_attn", "c_proj", "c_fc"])])
def test_auto_whitens_no_output_side_of_lora_adapters(name, targets):
    """PEFT's LoRA matrices (``lora_A`` ``[r, d]``, ``lora_B`` ``[out, r]``, each alone under its
    adapter's ``ModuleDict``) form no MLP: ``"auto"`` gives them no output side, on a gated and
    on an ungated base model alike."""
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    peft = pytest.importorskip("peft", reason="peft is an optional extra ([trainers])")
    import hf_zoo
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = peft.get_peft_model(hf_zoo.build(name, transformers),
                                peft.LoraConfig(r=4, target_modules=targets, fan_in_fan_out=name == "gpt2"))
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=1, skip_layers=["lm_head", "embed", "wte", "wpe"])
    assert any("lora_B" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = hf_zoo.next_token_batch(torch.Generator().manual_seed(0), 4, torch.arange(hf_zoo.VOCAB).roll(1))
    opt.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert _output_sides(opt, model) == set()
    assert any("input_factor" in state for state in opt.state.values())
