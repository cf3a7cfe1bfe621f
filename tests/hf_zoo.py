"""Tiny config-built Hugging Face models (no downloads) for the integration tests, and a
learnable next-token task to train them on.

Every builder takes a vocabulary size and returns a causal LM (or, for BERT, a masked LM
used as a plain encoder); ``MOE`` names the mixture-of-experts ones.
"""
from __future__ import annotations

import torch

VOCAB = 32
SEQ = 16


def build(name: str, transformers, experts_implementation: str | None = None, **overrides):
    """The zoo model ``name``; ``overrides`` replace config entries (not for gpt2 / bert)."""
    t = transformers

    def _tiny(**extra) -> dict:
        config = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
        config.update(extra, **overrides)
        return config

    if name == "gpt2":
        model = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4))
    elif name == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(**_tiny(intermediate_size=64)))
    elif name == "bert":
        model = t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=4, intermediate_size=64,
                                               max_position_embeddings=64))
    elif name == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(**_tiny(intermediate_size=48, num_local_experts=4,
                                                             num_experts_per_tok=2)))
    elif name == "qwen2_moe":
        model = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**_tiny(intermediate_size=64, moe_intermediate_size=24,
                                                               shared_expert_intermediate_size=48, num_experts=4,
                                                               num_experts_per_tok=2)))
    elif name == "qwen3_moe":
        model = t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**_tiny(intermediate_size=64, moe_intermediate_size=24,
                                                               num_experts=4, num_experts_per_tok=2, head_dim=8)))
    elif name == "olmoe":
        model = t.OlmoeForCausalLM(t.OlmoeConfig(**_tiny(intermediate_size=24, num_experts=4, num_experts_per_tok=2)))
    elif name == "gpt_oss":
        model = t.GptOssForCausalLM(t.GptOssConfig(**_tiny(intermediate_size=24, num_local_experts=4,
                                                           num_experts_per_tok=2, head_dim=8,
                                                           layer_types=["full_attention"] * 2)))
    else:
        raise ValueError(f"unknown zoo model {name!r}")
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    return model


MODELS = ["gpt2", "llama", "bert", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"}


def next_token_batch(generator: torch.Generator, batch: int, permutation: torch.Tensor) -> torch.Tensor:
    """Sequences that follow a fixed permutation of the vocabulary from a random first token:
    every next token is determined by the current one, so the loss can go to zero."""
    tokens = torch.empty(batch, SEQ, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (batch,), generator=generator)
    for t in range(1, SEQ):
        tokens[:, t] = permutation[tokens[:, t - 1]]
    return tokens


def expert_coverage(precond, model) -> tuple[float, float]:
    """(fraction of the trainable parameters registered, fraction of the stacked expert
    parameters registered), counted in elements."""
    coverage = precond.coverage()
    expert_params = {id(p): p for name, p in model.named_parameters() if p.dim() == 3 and "expert" in name}
    total = sum(p.numel() for p in expert_params.values())
    registered = sum(shape.numel() for layer in precond.layers.values() if layer.expert is not None
                     for (_, p), shape in zip(layer.params, layer.shapes) if id(p) in expert_params)
    return coverage["fraction"], (registered / total if total else float("nan"))
