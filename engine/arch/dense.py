"""Dense llama-style decoders: llama (SmolLM2, Llama), qwen2 (attention biases), qwen3 (q/k norms).

The attention differences follow the tensors in the file (see base.Transformer); the feed-forward is one SwiGLU.
A llama file with experts (Mixtral) runs in qwen3moe.py.
"""
from __future__ import annotations

from engine.arch import tensors
from engine.arch.base import Transformer, dense_ffn

ARCHS = ("llama", "qwen2", "qwen3")
EXPERTS = False
FUSED_QKV = True


def configure(cfg, get, model) -> None:
    cfg.rope_type = "norm" if cfg.arch == "llama" else "neox"   # llama.cpp: LLAMA_ROPE_TYPE_NORM for llama only


def check_tensors(model) -> None:
    tensors.check_standard(model)


class Dense(Transformer):
    def ffn(self, il, x, decoding):
        return dense_ffn(self.w, f"blk.{il}.", x)


MODEL = Dense
