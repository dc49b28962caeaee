"""qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B): attention biases; routed experts whose softmax weights are NOT
renormalized, plus a shared expert scaled by a sigmoid gate of its own (ffn_gate_inp_shexp), as in llama.cpp.
"""
from __future__ import annotations

import numpy as np

from engine.arch.base import Transformer, dense_ffn, moe_ffn, route


class Qwen2MoE(Transformer):
    def ffn(self, il, x, decoding):
        cfg, b = self.cfg, f"blk.{il}."
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
