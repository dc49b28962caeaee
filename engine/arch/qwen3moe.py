"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder) and Mixtral-style llama (architecture `llama` with
`llama.expert_count` > 0): each layer's experts routed to the top k of a softmax, renormalized to sum 1 (norm_w =
true in llama.cpp's build_moe_ffn calls for both). qwen3moe has q/k norms and NEOX RoPE; llama turns NORM pairs.
A layer the config plans without experts (cfg.is_moe_layer) runs a dense SwiGLU.
"""
from __future__ import annotations

from engine.arch import tensors
from engine.arch.base import Transformer, dense_ffn, moe_ffn, route

ARCHS = ("qwen3moe", "llama")
EXPERTS = True
FUSED_QKV = True


def configure(cfg, get, model) -> None:
    cfg.rope_type = "norm" if cfg.arch == "llama" else "neox"   # llama.cpp: LLAMA_ROPE_TYPE_NORM for llama only
    cfg.expert_weights_norm = True


def check_tensors(model) -> None:
    tensors.check_standard(model)


class Qwen3MoE(Transformer):
    def ffn(self, il, x, decoding):
        cfg, b = self.cfg, f"blk.{il}."
        if not cfg.is_moe_layer(il):
            return dense_ffn(self.w, b, x)
        logits = x @ self.w.get(b + "ffn_gate_inp.weight").T
        ids, weights = route(logits, cfg.n_expert_used, cfg.expert_weights_norm, cfg.expert_weights_scale)
        return moe_ffn(self.w, il, x, ids, weights, decoding)


MODEL = Qwen3MoE
