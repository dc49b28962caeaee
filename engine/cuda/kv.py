"""The KV cache in VRAM, in one of two layouts, and the decode step's use of it (store at the position, attend).

Layouts, per layer (the kernels take one layer's addresses):
- f16:  K and V (n_head_kv, max_ctx, head_dim) fp16. `layer(i) -> (k, v)`.
- int8: K and V (n_head_kv, max_ctx, head_dim) int8 plus their scales (n_head_kv, max_ctx, head_dim / 32) fp32,
  value = scale * q with one scale per 32 values (absmax / 127; cuda_src/kv_int8.cuh). `layer_i8(i) -> (k_q, k_scale,
  v_q, v_scale)`, the argument order of attention.cu's qk_rope_store_kv8 / attn_gqa_i8 (and prefill_attn.cu's
  qk_rope_store_kv8 / flash_attn_i8).
  A row is head_dim + head_dim / 8 bytes instead of 2 * head_dim: 56% of the fp16 cache.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

KV_DTYPES = ("f16", "int8")

# cuda_src/attention.cu's attn_gqa_* (keep in step with the #defines there)
AT_T = 32                 # positions per tile
AT_MAX_SPLITS = 64
AT_MAX_G = 16

U64, I32, F32 = np.uint64, np.int32, np.float32
# The decode step's K/V store folded into its attention launch (attn_gqa_rope_*: one launch a layer instead of two).
# False: qk_rope_store(_kv8) then attn_gqa_* (both variants are tested alike).
FUSED_STORE = True


def _ptr(a) -> U64:
    return U64(0) if a is None else U64(a.data.ptr)


def row_bytes(head_dim: int, dtype: str) -> int:
    """Bytes of one position of one KV head, for K or for V."""
    return 2 * head_dim if dtype == "f16" else head_dim + head_dim // 32 * 4


class KVCache:
    def __init__(self, cfg, max_ctx: int, dtype: str = "f16"):
        check_dtype(cfg, dtype)
        self.dtype = dtype
        self.max_ctx = max_ctx
        self.head_dim = hd = cfg.head_dim
        shape = (cfg.n_layer, cfg.n_head_kv, max_ctx, hd)
        if dtype == "f16":
            self.k = cp.zeros(shape, dtype=cp.float16)
            self.v = cp.zeros(shape, dtype=cp.float16)
            self.k_scale = self.v_scale = None
        else:
            self.k = cp.zeros(shape, dtype=cp.int8)
            self.v = cp.zeros(shape, dtype=cp.int8)
            self.k_scale = cp.zeros(shape[:-1] + (hd // 32,), dtype=cp.float32)
            self.v_scale = cp.zeros(shape[:-1] + (hd // 32,), dtype=cp.float32)

    @staticmethod
    def nbytes(cfg, max_ctx: int, dtype: str = "f16") -> int:
        return 2 * cfg.n_layer * cfg.n_head_kv * max_ctx * row_bytes(cfg.head_dim, dtype)

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)

    def layer(self, i: int) -> tuple[int, int]:
        """(k, v) addresses of layer i's fp16 cache."""
        if self.dtype != "f16":
            raise ValueError("this pass reads the fp16 KV cache, but the cache is int8 (--kv int8): run with --kv f16, "
                             "or use layer_i8() for the int8 layout")
        return int(self.k[i].data.ptr), int(self.v[i].data.ptr)

    def store(self, kernels, cfg, li, q, k_rows, v, q_norm, k_norm, rope, state=None, pos0: int = 0,
              T: int = 1) -> None:
        """The step between the Q/K/V projections and attention, for T tokens at positions pos0 + t (+ state[1] when
        state, a device int32 array, is given): optional q/k RMSNorm and RoPE (rotated q written back into q), K and
        V into layer li in this cache's layout. q: (T, n_head * head_dim), k_rows, v: (T, n_head_kv * head_dim) fp32;
        rope: (max_ctx, n_rot / 2) float2 (cos, sin). kernels: the engine's kernel table (kernels.Kernels)."""
        c = cfg
        grid, blk = (c.n_head + 2 * c.n_head_kv, T), (c.head_dim,)
        head = (_ptr(q), _ptr(k_rows), _ptr(v), _ptr(q_norm), _ptr(k_norm), _ptr(rope), _ptr(state), I32(pos0))
        tail = (I32(c.n_head), I32(c.n_head_kv), I32(c.head_dim), I32(c.n_rot), I32(1 if c.rope_type == "neox" else 0),
                F32(c.rms_eps), I32(self.max_ctx))
        if self.dtype == "f16":
            kc, vc = self.layer(li)
            kernels("qk_rope_store")(grid, blk, (*head, U64(kc), U64(vc), *tail))
        else:
            kernels("qk_rope_store_kv8")(grid, blk, (*head, *(U64(a) for a in self.layer_i8(li)), *tail))

    def layer_i8(self, i: int) -> tuple[int, int, int, int]:
        """(k_q, k_scale, v_q, v_scale) addresses of layer i's int8 cache."""
        if self.dtype != "int8":
            raise ValueError("layer_i8() needs the int8 KV cache (--kv int8); this one is fp16: use layer()")
        return (int(self.k[i].data.ptr), int(self.k_scale[i].data.ptr), int(self.v[i].data.ptr),
                int(self.v_scale[i].data.ptr))


def check_dtype(cfg, dtype: str) -> None:
    if dtype not in KV_DTYPES:
        raise ValueError(f"--kv takes one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    if dtype == "int8" and cfg.head_dim % 32:
        raise ValueError(f"--kv int8 needs head_dim a multiple of 32 (this model: {cfg.head_dim}); use --kv f16")


def attn_block(group: int) -> int:
    """Threads of an attn_gqa block: a warp per q head of the group, at least 4 (they share the tile loads), at most
    8 (two heads a warp beyond)."""
    return 32 * min(max(group, 4), 8)


def attn_smem(dtype: str, group: int, head_dim: int) -> int:
    """Dynamic shared memory of an attn_gqa block: the group's scaled q, then two tile buffers (attention.cu)."""
    i8 = dtype == "int8"
    rb = head_dim if i8 else 2 * head_dim
    buf = 2 * AT_T * (rb + 16) + (2 * AT_T * (head_dim // 32) * 4 if i8 else 0)
    return group * head_dim * 4 + 2 * buf


def attn_splits(n_head_kv: int, max_ctx: int, n_sm: int) -> int:
    """Most splits per KV head: one wave of blocks over the GPU at long contexts (more would only lengthen the merge,
    whose cost grows with the split count), never more than the context has tiles."""
    return max(1, min(AT_MAX_SPLITS, n_sm // n_head_kv, -(-max_ctx // AT_T)))


class DecodeAttention:
    """The decode step's attention over a KVCache, for one token at position state[1]: `step` norms and rotates q
    and k, writes K/V there and attends, in one launch (fused) or two (`store`, then `attend`). Buffers are sized
    once from max_ctx; the position is read on the device, so a captured graph serves every step."""

    def __init__(self, kernels, cfg, kv: KVCache, n_split: int | None = None, fused: bool | None = None):
        G = cfg.n_head // cfg.n_head_kv
        if cfg.n_head % cfg.n_head_kv or not 1 <= G <= AT_MAX_G:
            raise ValueError(f"the CUDA decode attention takes 1 to {AT_MAX_G} q heads per KV head "
                             f"(this model: {cfg.n_head} / {cfg.n_head_kv}); use --backend cpu")
        if cfg.head_dim % 32 or cfg.head_dim > 256:
            raise ValueError(f"the CUDA decode attention needs head_dim a multiple of 32, <= 256 "
                             f"(this model: {cfg.head_dim}); use --backend cpu")
        self.cfg, self.kv, self.group = cfg, kv, G
        if n_split is None:
            n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
            n_split = attn_splits(cfg.n_head_kv, kv.max_ctx, n_sm)
        if not 1 <= n_split <= AT_MAX_SPLITS:
            raise ValueError(f"n_split must be 1..{AT_MAX_SPLITS}, got {n_split}")
        self.n_split = n_split
        self.block = attn_block(G)
        self.smem = attn_smem(kv.dtype, G, cfg.head_dim)
        self.fused = FUSED_STORE if fused is None else fused
        self.name = "attn_gqa_f16" if kv.dtype == "f16" else "attn_gqa_i8"
        self.name_fused = "attn_gqa_rope_f16" if kv.dtype == "f16" else "attn_gqa_rope_i8"
        self.part = cp.zeros(cfg.n_head * n_split * (cfg.head_dim + 2), dtype=cp.float32)
        self.counters = cp.zeros(cfg.n_head_kv, dtype=cp.int32)
        # past 48 KiB (head_dim 256) a block must opt in; set before any capture, harmless below
        kernels(self.name).max_dynamic_shared_size_bytes = self.smem
        kernels(self.name_fused).max_dynamic_shared_size_bytes = self.smem
        kernels("qk_rope_store" if kv.dtype == "f16" else "qk_rope_store_kv8")     # loaded now, not mid-capture

    def step(self, kernels, li, q, k_rows, v, q_norm, k_norm, rope, out, state, scale) -> None:
        """This step's attention block between the Q/K/V projections (q, k_rows, v: raw, fp32) and wo: out gets the
        attention of the token at position state[1] over positions 0 .. state[1] of layer li, whose K/V it stores."""
        if not self.fused:
            self.store(kernels, li, q, k_rows, v, q_norm, k_norm, rope, state)
            self.attend(kernels, li, q, out, state, scale)
            return
        c = self.cfg
        addrs = self.kv.layer(li) if self.kv.dtype == "f16" else self.kv.layer_i8(li)
        rows = (_ptr(q), _ptr(k_rows), _ptr(v), _ptr(q_norm), _ptr(k_norm))
        rotary = (_ptr(rope), I32(c.n_rot), I32(1 if c.rope_type == "neox" else 0), F32(c.rms_eps))
        cache = tuple(U64(a) for a in addrs)
        work = (_ptr(state), _ptr(self.part), _ptr(self.counters), _ptr(out))
        shape = (I32(c.n_head_kv), I32(self.group), I32(c.head_dim), I32(self.kv.max_ctx), F32(scale))
        kernels(self.name_fused)((c.n_head_kv, self.n_split), (self.block,), (*rows, *rotary, *cache, *work, *shape),
                                 shared_mem=self.smem)

    def store(self, kernels, li, q, k_rows, v, q_norm, k_norm, rope, state) -> None:
        """K/V of this step's token at position state[1] (KVCache.store)."""
        self.kv.store(kernels, self.cfg, li, q, k_rows, v, q_norm, k_norm, rope, state)

    def attend(self, kernels, li, q, out, state, scale, n_fixed: int = 0) -> None:
        """out (n_head * head_dim) = softmax(q K^T * scale) V over positions 0 .. state[1] (0 .. n_fixed - 1 when state
        is None) of layer li, for the rotated q (n_head * head_dim)."""
        c = self.cfg
        addrs = self.kv.layer(li) if self.kv.dtype == "f16" else self.kv.layer_i8(li)
        kernels(self.name)((c.n_head_kv, self.n_split), (self.block,),
                           (_ptr(q), *(U64(a) for a in addrs), _ptr(state), I32(n_fixed), _ptr(self.part),
                            _ptr(self.counters), _ptr(out), I32(c.n_head_kv), I32(self.group), I32(c.head_dim),
                            I32(self.kv.max_ctx), F32(scale)),
                           shared_mem=self.smem)
