"""The KV cache in VRAM: fp16, (n_layer, n_head_kv, max_ctx, head_dim) for K and for V."""
from __future__ import annotations

import cupy as cp


class KVCache:
    def __init__(self, cfg, max_ctx: int):
        self.max_ctx = max_ctx
        shape = (cfg.n_layer, cfg.n_head_kv, max_ctx, cfg.head_dim)
        self.k = cp.zeros(shape, dtype=cp.float16)
        self.v = cp.zeros(shape, dtype=cp.float16)
        self._layer_bytes = cfg.n_head_kv * max_ctx * cfg.head_dim * 2

    @staticmethod
    def nbytes(cfg, max_ctx: int) -> int:
        return 2 * cfg.n_layer * cfg.n_head_kv * max_ctx * cfg.head_dim * 2

    def layer(self, i: int) -> tuple[int, int]:
        return (int(self.k.data.ptr) + i * self._layer_bytes, int(self.v.data.ptr) + i * self._layer_bytes)
