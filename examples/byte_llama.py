"""A Llama-style byte-level language model built from a ``transformers`` config.

RMSNorm, rotary position embeddings, a SwiGLU MLP and grouped-query attention (half as many
key/value heads as query heads), from ``transformers.LlamaConfig``: a second architecture for
examples/char_lm.py's runs (``--arch llama``), on the same bytes, with nothing tuned on it.
The module names are Llama's (``model.embed_tokens``, ``...self_attn.q_proj``, ``mlp.down_proj``,
``lm_head``), so the examples' ``skip_layers`` (``Embedding``, ``lm_head``) apply unchanged.
"""
from __future__ import annotations

import torch
from torch import nn


def swiglu_width(d_model: int, multiple: int = 16) -> int:
    """Llama's MLP width, ``8/3 d_model`` rounded up to ``multiple`` (the parameters of a
    4x GELU MLP in three matrices)."""
    return -(-8 * d_model // 3 // multiple) * multiple


def llama_settings(model: str, d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int,
                   tie_embeddings: bool) -> dict:
    """The ``transformers`` config arguments of the Llama-style attention stack that ByteLlama
    and examples/byte_mixtral.py's ByteMixtral share: half as many key/value heads as query
    heads, no dropout, no cache, SDPA attention."""
    if n_heads % 2 or d_model % n_heads:
        raise ValueError(f"{model}: n_heads={n_heads} must be even and divide d_model={d_model}")
    return dict(vocab_size=vocab_size, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
                num_key_value_heads=n_heads // 2, max_position_embeddings=seq_len,
                tie_word_embeddings=tie_embeddings, attention_dropout=0.0, initializer_range=0.02, use_cache=False,
                attn_implementation="sdpa")


class ByteLlama(nn.Module):
    """``LlamaForCausalLM`` over 256 byte values; ``forward(tokens) -> logits``. A subclass
    names another ``transformers`` model of Llama's layout in ``classes`` (config, model)."""

    classes = ("LlamaConfig", "LlamaForCausalLM")

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int = 256,
                 tie_embeddings: bool = False):
        super().__init__()
        import transformers
        config_class, model_class = (getattr(transformers, name) for name in self.classes)
        config = config_class(intermediate_size=swiglu_width(d_model),
                              **llama_settings(type(self).__name__, d_model, n_layers, n_heads, seq_len, vocab_size,
                                               tie_embeddings))
        self.inner = model_class(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens, use_cache=False).logits
