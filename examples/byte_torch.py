"""A byte-level language model built from PyTorch's own ``nn.TransformerEncoderLayer``.

A fourth architecture for examples/char_lm.py's runs (``--arch torch``), on the same bytes:
the examples' GPT (pre-LN blocks, a 4x GELU MLP, learned positions, the same initialisation)
with its attention as PyTorch builds it, ``nn.MultiheadAttention``, whose query, key and value
projections are one packed ``in_proj_weight`` applied functionally, as in ``nn.Transformer``
models and torchvision's vision transformer. Causal through ``is_causal`` and a causal mask.
The module names keep the examples' ``skip_layers`` (``Embedding``, ``lm_head``) meaning the same.
"""
from __future__ import annotations

import torch
from torch import nn


class TorchLayersLM(nn.Module):
    """What the byte models built from PyTorch's layers share: token and position embeddings,
    the final norm and ``lm_head`` (tied to the embedding on request), the examples' GPT's
    initialisation (N(0, 0.02) weights, zero biases: PyTorch's layers initialise otherwise)
    and a causal mask. A subclass builds its layers between ``__init__`` and :meth:`finish`,
    so the parameters are created, and initialised, in the GPT's order."""

    def __init__(self, d_model: int, n_heads: int, seq_len: int, vocab_size: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"{type(self).__name__}: n_heads={n_heads} must divide d_model={d_model}")
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(seq_len, d_model)

    def finish(self, d_model: int, seq_len: int, vocab_size: int, tie_embeddings: bool) -> None:
        self.ln_final = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                nn.init.normal_(p, std=0.02)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token_embedding(tokens) + self.position_embedding(positions)

    def causal_mask(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        return self.mask[:length, :length].to(dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_final(x))


class ByteTorchTransformer(TorchLayersLM):
    """``nn.TransformerEncoderLayer`` blocks (pre-LN, GELU) over 256 byte values;
    ``forward(tokens) -> logits``."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int = 256,
                 tie_embeddings: bool = False):
        super().__init__(d_model, n_heads, seq_len, vocab_size)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(n_layers))
        self.finish(d_model, seq_len, vocab_size, tie_embeddings)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = self.causal_mask(tokens.shape[1], x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.logits(x)
