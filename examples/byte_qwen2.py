"""A Qwen2-style byte-level language model built from a ``transformers`` config.

The Llama-style model of examples/byte_llama.py (RMSNorm, rotary, SwiGLU, grouped-query
attention, the same widths) as ``transformers.Qwen2ForCausalLM`` builds it: the query, key and
value projections carry biases and the output projection and the MLP do not, as in Qwen2 and
Qwen2.5 (``--arch qwen2``). What it tests is the one difference that matters to
``WhitenedMuon``'s default ``center_inputs``: an attention whose query and key have a bias.
"""
from __future__ import annotations

import torch
from torch import nn

from byte_llama import llama_settings, swiglu_width


class ByteQwen2(nn.Module):
    """``Qwen2ForCausalLM`` over 256 byte values; ``forward(tokens) -> logits``."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int = 256,
                 tie_embeddings: bool = False):
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM
        config = Qwen2Config(intermediate_size=swiglu_width(d_model),
                             **llama_settings("ByteQwen2", d_model, n_layers, n_heads, seq_len, vocab_size,
                                              tie_embeddings))
        self.inner = Qwen2ForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens, use_cache=False).logits
