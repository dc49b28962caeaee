"""qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): q/k norms, every layer routed to top-k experts.

llama.cpp renormalizes the top-k router weights for this architecture (norm_w = true in its build_moe_ffn call).
"""
from __future__ import annotations

from engine.arch.base import Transformer, moe_ffn, route


class Qwen3MoE(Transformer):
    def ffn(self, il, x, decoding):
        cfg = self.cfg
        logits = x @ self.w.get(f"blk.{il}.ffn_gate_inp.weight").T
        ids, weights = route(logits, cfg.n_expert_used, cfg.expert_weights_norm, cfg.expert_weights_scale)
        return moe_ffn(self.w, il, x, ids, weights, decoding)
