"""Dense llama-style decoders: llama (SmolLM2, Llama), qwen2 (attention biases), qwen3 (q/k norms).

The attention differences follow the tensors in the file (see base.Transformer); the feed-forward is one SwiGLU.
"""
from __future__ import annotations

from engine.arch.base import Transformer, dense_ffn


class Dense(Transformer):
    def ffn(self, il, x, decoding):
        return dense_ffn(self.w, f"blk.{il}.", x)
