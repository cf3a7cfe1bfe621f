"""A byte-level encoder-decoder built from PyTorch's ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer``: cross-attention through ``nn.MultiheadAttention``.

A fifth architecture for examples/char_lm.py's runs (``--arch seq2seq``), on the same bytes and
the same next-byte loss, so that its runs compare with the others': each window is read as a
source (its first half) and a target (its second half). The encoder is a causal language
model of the source; the decoder predicts the target byte by byte with causal self-attention
and cross-attention to the whole encoded source, which precedes every target byte, so every
position still predicts its next byte from the bytes before it. The cross-attention's packed
``in_proj_weight`` projects the decoder's stream (the query) and the encoder's output (the key
and value): three inputs for one weight. ``n_layers`` counts the encoder's layers and the
decoder's together (half each; the examples' default 2 gives one of each).
"""
from __future__ import annotations

import torch
from torch import nn

from byte_torch import TorchLayersLM


class ByteSeq2Seq(TorchLayersLM):
    """Pre-LN ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` blocks (GELU, a 4x
    MLP) over 256 byte values; ``forward(tokens) -> logits`` for every position of the window."""

    def __init__(self, d_model: int, n_layers: int, n_heads: int, seq_len: int, vocab_size: int = 256,
                 tie_embeddings: bool = False):
        if n_layers < 2 or n_layers % 2:
            raise ValueError(f"ByteSeq2Seq: n_layers={n_layers} must be even and at least 2 (encoder + decoder)")
        if seq_len < 2:
            raise ValueError(f"ByteSeq2Seq: seq_len={seq_len} must be at least 2 (a source and a target)")
        super().__init__(d_model, n_heads, seq_len, vocab_size)
        layer = dict(d_model=d_model, nhead=n_heads, dim_feedforward=4 * d_model, dropout=0.0, activation="gelu",
                     batch_first=True, norm_first=True)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(**layer) for _ in range(n_layers // 2))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(**layer) for _ in range(n_layers // 2))
        self.ln_memory = nn.LayerNorm(d_model)  # the encoder's output, as nn.Transformer normalises it
        self.finish(d_model, seq_len, vocab_size, tie_embeddings)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        split = seq // 2
        x = self.embed(tokens)
        source, target = x[:, :split], x[:, split:]
        source_mask = self.causal_mask(split, x.dtype)
        target_mask = self.causal_mask(seq - split, x.dtype)
        for block in self.encoder:
            source = block(source, src_mask=source_mask, is_causal=True)
        memory = self.ln_memory(source)
        for block in self.decoder:
            target = block(target, memory, tgt_mask=target_mask, tgt_is_causal=True)
        return self.logits(torch.cat([source, target], dim=1))
