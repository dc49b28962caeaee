"""Mixtral-style MoE: architecture `llama` with `llama.expert_count` > 0. NORM-ordered RoPE like llama, and the
top-k softmax router weights renormalized to sum 1 (llama.cpp's build_moe_ffn call for llama with experts).
"""
from __future__ import annotations

from engine.arch.base import Transformer, moe_ffn, route


class Mixtral(Transformer):
    def ffn(self, il, x, decoding):
        cfg = self.cfg
        logits = x @ self.w.get(f"blk.{il}.ffn_gate_inp.weight").T
        ids, weights = route(logits, cfg.n_expert_used, cfg.expert_weights_norm, cfg.expert_weights_scale)
        return moe_ffn(self.w, il, x, ids, weights, decoding)
