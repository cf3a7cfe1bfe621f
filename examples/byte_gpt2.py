"""GPT-2 as Hugging Face builds it, over bytes, from a ``transformers.GPT2Config``.

A third architecture for examples/char_lm.py's runs (``--arch gpt2``), on the same bytes: the
model users take from ``transformers``, with what sets it apart from the examples' GPT kept as
it is there: ``Conv1D`` projections (weights stored ``[in, out]``), the query, key and value
fused into one ``c_attn``, ``gelu_new`` and GPT-2's initialisation (the residual projections
scaled by ``1/sqrt(2 n_layer)``). Dropout is off, as in the other two
architectures, so that runs are deterministic per seed. The module names are GPT-2's
(``transformer.wte``, ``...attn.c_attn``, ``...mlp.c_proj``, ``lm_head``), so the examples'
``skip_layers`` (``Embedding``, ``lm_head``) apply unchanged.
"""
from __future__ import annotations

import torch
from torch import nn


class ByteGPT2(nn.Module):
    """``GPT2LMHeadModel`` over 256 byte values; ``forward(tokens) -> logits``."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int = 256,
                 tie_embeddings: bool = False):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        if d_model % n_heads:
            raise ValueError(f"ByteGPT2: n_heads={n_heads} must divide d_model={d_model}")
        config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=d_model, n_layer=n_layers,
                            n_head=n_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=tie_embeddings, use_cache=False, attn_implementation="sdpa",
                            bos_token_id=None, eos_token_id=None)  # GPT-2's 50256 is not a byte
        self.inner = GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens, use_cache=False).logits
