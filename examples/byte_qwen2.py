"""A Qwen2-style byte-level language model built from a ``transformers`` config.

The Llama-style model of examples/byte_llama.py (RMSNorm, rotary, SwiGLU, grouped-query
attention, the same widths) as ``transformers.Qwen2ForCausalLM`` builds it: the query, key and
value projections carry biases and the output projection and the MLP do not, as in Qwen2 and
Qwen2.5 (``--arch qwen2``). What it tests is the one difference that matters to
``WhitenedMuon``'s default ``center_inputs``: an attention whose query and key have a bias.
"""
from __future__ import annotations

from byte_llama import ByteLlama


class ByteQwen2(ByteLlama):
    """``Qwen2ForCausalLM`` over 256 byte values; ``forward(tokens) -> logits``."""

    classes = ("Qwen2Config", "Qwen2ForCausalLM")
