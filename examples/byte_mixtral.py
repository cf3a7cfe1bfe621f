"""A mixture-of-experts byte-level language model built from a ``transformers`` config.

Mixtral's block (``transformers.MixtralConfig``): the Llama-style attention of
examples/byte_llama.py (RMSNorm, rotary embeddings, half as many key/value heads as query
heads) and, in place of the dense SwiGLU MLP, 4 SwiGLU experts of about half its width (the
Llama width of ``d_model / 2``) with top-2 routing, so each token's MLP does about the dense
model's work. The experts are transformers'
fused ``MixtralExperts``: one ``[experts, 2·width, d_model]`` and one ``[experts, d_model,
width]`` parameter per layer, which ``WhitenedMuon`` whitens expert by expert and the Muon
baseline orthogonalises expert by expert (examples/expert_muon.py). The router is a bare
parameter (AdamW in both); no load-balancing loss. A fourth architecture for
examples/char_lm.py (``--arch mixtral``), on the same bytes, with nothing tuned on it.
"""
from __future__ import annotations

import torch
from torch import nn

from byte_llama import llama_settings, swiglu_width

NUM_EXPERTS, TOP_K = 4, 2


class ByteMixtral(nn.Module):
    """``MixtralForCausalLM`` over 256 byte values; ``forward(tokens) -> logits``."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int = 256,
                 tie_embeddings: bool = False):
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM
        config = MixtralConfig(intermediate_size=swiglu_width(d_model // 2), num_local_experts=NUM_EXPERTS,
                               num_experts_per_tok=TOP_K, router_jitter_noise=0.0,
                               **llama_settings("ByteMixtral", d_model, n_layers, n_heads, seq_len, vocab_size,
                                                tie_embeddings))
        self.inner = MixtralForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=tokens, use_cache=False).logits
