"""qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): attention biases; routed experts whose softmax weights are NOT
renormalized, plus a shared expert scaled by a sigmoid gate of its own (ffn_gate_inp_shexp), as in llama.cpp.
A layer the config plans without experts (cfg.is_moe_layer) runs a dense SwiGLU.
"""
from __future__ import annotations

import numpy as np

from engine.arch import tensors
from engine.arch.base import Transformer, dense_ffn, moe_ffn, route

ARCHS = ("qwen2moe",)
EXPERTS = True
FUSED_QKV = True


def configure(cfg, get, model) -> None:
    cfg.expert_weights_norm = False     # llama.cpp's build_moe_ffn call for qwen2moe: norm_w = false


def check_tensors(model) -> None:
    tensors.check_standard(model)


class Qwen2MoE(Transformer):
    def ffn(self, il, x, decoding):
        cfg, b = self.cfg, f"blk.{il}."
        if not cfg.is_moe_layer(il):
            return dense_ffn(self.w, b, x)
        logits = x @ self.w.get(b + "ffn_gate_inp.weight").T
        ids, weights = route(logits, cfg.n_expert_used, cfg.expert_weights_norm, cfg.expert_weights_scale)
        out = moe_ffn(self.w, il, x, ids, weights, decoding)
        if cfg.shared_expert:
            shared = dense_ffn(self.w, b, x, "_shexp")
            if cfg.shared_expert_gate:
                g = x @ self.w.get(b + "ffn_gate_inp_shexp.weight").T     # (T, 1)
                shared = shared / (1.0 + np.exp(-g))
            out = out + shared
        return out


MODEL = Qwen2MoE
