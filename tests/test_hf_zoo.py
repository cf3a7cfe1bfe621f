"""The Hugging Face model zoo of the tests: tiny config-built models, K-FAC's coverage of each.

Run with ``-s`` to see the table (the share of trainable parameter elements K-FAC
preconditions, and for mixtures of experts the share of the stacked expert weights).
Every model must also take a K-FAC step with statistics in every registered layer.
"""
from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")

import hf_zoo  # noqa: E402
from kron_precond import KronPreconditioner  # noqa: E402

transformers.logging.set_verbosity_error()
# Before the fused-experts adapters (transformers 5.23.0, these configs) K-FAC skipped every
# expert: Mixtral 15.8 %, Qwen2-MoE 45.5 %, Qwen3-MoE 26.5 %, OLMoE 26.4 %, GPT-OSS 26.4 %;
# now 94-97 % (the rest: embeddings, norms, routers).
MIN_COVERAGE = {"gpt2": 0.5, "llama": 0.5, "bert": 0.5}


@pytest.mark.parametrize("name", hf_zoo.MODELS)
def test_kfac_coverage(name):
    torch.manual_seed(0)
    model = hf_zoo.build(name, transformers)
    precond = KronPreconditioner(model, method="kfac", kl_clip=None)
    total, experts = hf_zoo.expert_coverage(precond, model)
    kind = f", experts {experts:.1%}" if name in hf_zoo.MOE else ""
    print(f"\n{name:10s} K-FAC layers {len(precond.layers):3d}, parameters {total:.1%}{kind}")
    if name in hf_zoo.MOE:
        assert experts >= 0.9, f"{name}: only {experts:.1%} of the expert parameters registered"
        assert total >= 0.8
    else:
        assert total >= MIN_COVERAGE[name]
    ids = hf_zoo.next_token_batch(torch.Generator().manual_seed(0), 8, torch.arange(hf_zoo.VOCAB).roll(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=ids, labels=ids).loss.backward()
        precond.step()
    unseen = [n for n, layer in precond.layers.items() if not bool(layer.observed())]
    assert not unseen, f"{name}: no statistics for {unseen}"
    for layer in precond.layers.values():
        for grad in layer.gradients():
            assert grad is None or torch.isfinite(grad).all(), layer.name


def _centred_names(opt) -> set[str]:
    return {opt._names[i] for i in opt._statistics.centered}


def test_whitened_muon_centres_llamas_query_and_key_projections_and_nothing_else():
    """The default on a bias-free attention: exactly the q_proj and k_proj weights are centred."""
    from kron_precond import WhitenedMuon
    model = hf_zoo.build("llama", transformers)
    opt = WhitenedMuon(model, lr=0.01, skip_layers=["Embedding", "lm_head"])
    want = {f"{n}.weight" for n, m in model.named_modules() if n.endswith(("self_attn.q_proj", "self_attn.k_proj"))}
    assert len(want) == 2 * model.config.num_hidden_layers
    assert _centred_names(opt) == want


def test_whitened_muon_with_biased_query_and_key_centres_nothing():
    """Qwen2-MoE's q/k/v projections have biases, which carry the shift a centring would free:
    nothing is centred, though o_proj, the experts and the routers have no bias."""
    from kron_precond import WhitenedMuon
    model = hf_zoo.build("qwen2_moe", transformers)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    opt = WhitenedMuon(model, lr=0.01, skip_layers=["Embedding", "lm_head"])
    whitened = {opt._names[id(p)] for g in opt.param_groups if g["algorithm"] == "whitened_muon"
                for p in g["params"]}
    biased = {f"{n}.weight" for n, m in model.named_modules()
              if isinstance(getattr(m, "bias", None), torch.nn.Parameter)}
    assert any("o_proj" in n for n in whitened - biased)  # bias-free layers the earlier rule centred
    assert _centred_names(opt) == set()


def test_whitened_muon_steps_gpt2s_c_attn_as_three_matrices_and_nothing_else():
    """HF GPT-2: every ``attn.c_attn`` (``Conv1D``, ``[in, 3 in]``) is split in three by default
    and no other layer is; the default steps as naming ``c_attn`` by regex does, and otherwise
    than the fused matrix stepped whole."""
    import copy

    from kron_precond import WhitenedMuon
    torch.manual_seed(0)
    start = hf_zoo.build("gpt2", transformers)
    ids = hf_zoo.next_token_batch(torch.Generator().manual_seed(0), 8, torch.arange(hf_zoo.VOCAB).roll(1))
    weights = {}
    for fused_qkv in (None, [r"\.c_attn$"], False):
        model = copy.deepcopy(start)
        opt = WhitenedMuon(model, lr=0.02, statistics_every=1, fused_qkv=fused_qkv,
                           skip_layers=["Embedding", "lm_head"])
        split = {opt._names[i] for i, view in opt._views.items() if view.parts == 3}
        want = {f"{n}.weight" for n, _ in model.named_modules() if n.endswith("attn.c_attn")}
        assert split == (set() if fused_qkv is False else want) and len(want) == model.config.n_layer
        torch.manual_seed(1)  # GPT-2's dropout
        for _ in range(3):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        weights[str(fused_qkv)] = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    assert torch.equal(weights["None"], weights[str([r"\.c_attn$"])])
    assert not torch.allclose(weights["None"], weights["False"], atol=1e-4)


@pytest.mark.parametrize("kv_heads, split", [(4, True), (2, False)])
def test_whitened_muon_splits_phi3s_qkv_proj_only_into_three_equal_blocks(kv_heads, split):
    """Phi-3's fused ``qkv_proj`` holds the query, key and value in contiguous blocks: three
    equal ones with as many key/value heads as query heads (split by default), narrower key
    and value blocks with grouped-query attention (stepped whole)."""
    from kron_precond import WhitenedMuon
    config = transformers.Phi3Config(vocab_size=hf_zoo.VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=kv_heads, intermediate_size=64,
                                     max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.Phi3ForCausalLM(config)
    opt = WhitenedMuon(model, lr=0.01, skip_layers=["Embedding", "lm_head"])
    fused = {opt._names[i] for i, view in opt._views.items() if view.parts == 3}
    want = {f"{n}.weight" for n, _ in model.named_modules() if n.endswith("self_attn.qkv_proj")}
    assert len(want) == 2 and fused == (want if split else set())


def _codegen():
    return transformers.CodeGenForCausalLM(transformers.CodeGenConfig(
        vocab_size=hf_zoo.VOCAB, n_positions=64, n_ctx=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
        bos_token_id=1, eos_token_id=2))


def _gpt_bigcode():
    return transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
        vocab_size=hf_zoo.VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, multi_query=False,
        bos_token_id=1, eos_token_id=2))


def _mpt():
    return transformers.MptForCausalLM(transformers.MptConfig(vocab_size=hf_zoo.VOCAB, d_model=32, n_heads=4,
                                                               n_layers=2, max_seq_len=64))


@pytest.mark.parametrize("build, fused", [
    (_mpt, "attn.Wqkv"),  # chunk(3): contiguous thirds
    (_codegen, None),  # qkv_proj, three inputs wide, but its outputs interleave model-parallel chunks
    (_gpt_bigcode, None),  # c_attn, three inputs wide, but per head (multi_query=False)
])
def test_whitened_muon_splits_only_fused_projections_of_a_known_layout(build, fused):
    """The default splits a fused projection by its attention module's class, not by its name:
    MPT's ``Wqkv`` is split; CodeGen's ``qkv_proj`` and GPTBigCode's ``c_attn``, as wide but
    laid out otherwise, are stepped whole."""
    from kron_precond import WhitenedMuon
    model = build()
    opt = WhitenedMuon(model, lr=0.01, skip_layers=["Embedding", "lm_head"])
    split = {opt._names[i] for i, view in opt._views.items() if view.parts == 3}
    wide = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | transformers.Conv1D)
            and m.weight.numel() == 3 * model.config.hidden_size ** 2}
    assert len(wide) == 2  # one per block: the fused projection, three inputs wide
    assert split == ({w for w in wide if w.endswith(f"{fused}.weight")} if fused else set())
    if fused:
        assert len(split) == 2
