"""The KV cache in VRAM, in one of two layouts, and the decode step's use of it (store at the position, attend).

Layouts, per layer (the kernels take one layer's addresses):
- f16:  K and V (n_head_kv, max_ctx, head_dim) fp16. `layer(i) -> (k, v)`.
- int8: K and V (n_head_kv, max_ctx, head_dim) int8 plus their scales (n_head_kv, max_ctx, head_dim / 32) fp32,
  value = scale * q with one scale per 32 values (absmax / 127; cuda_src/kv_int8.cuh). `layer_i8(i) -> (k_q, k_scale,
  v_q, v_scale)`, the argument order of attention.cu's qk_rope_store_kv8 / attn_gqa_i8 (and prefill_attn.cu's
  qk_rope_store_kv8 / flash_attn_i8).
  A row is head_dim + head_dim / 8 bytes instead of 2 * head_dim: 56% of the fp16 cache.
Window layers (gpt-oss): a layer whose attention sees only the last n_swa positions holds `rows[i]` rows a head
instead of max_ctx, a ring (position p at row p % rows[i]) long enough for the window plus the longest prompt chunk
(whose own K/V are written before its queries read the window behind them): ring_rows(). The kernels take a layer's
rows as their max_ctx; `chunk_cap` is the longest chunk the rings allow.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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


def ring_rows(cfg, max_ctx: int, chunk: int) -> list[int]:
    """Rows a head per layer: max_ctx, or for a window layer the window plus a chunk less one (the chunk's first query
    still sees n_swa - 1 positions before it), rounded up to 64 rows and at most max_ctx."""
    ring = min(max_ctx, -(-(cfg.n_swa + max(1, chunk) - 1) // 64) * 64)
    return [ring if cfg.is_swa(i) and cfg.n_swa > 0 else max_ctx for i in range(cfg.n_layer)]


class KVCache:
    def __init__(self, cfg, max_ctx: int, dtype: str = "f16", rows: list[int] | None = None):
        check_dtype(cfg, dtype)
        self.dtype = dtype
        self.max_ctx = max_ctx
        self.head_dim = hd = cfg.head_dim
        self.rows = list(rows) if rows is not None else [max_ctx] * cfg.n_layer
        n_swa = getattr(cfg, "n_swa", 0)
        # the longest chunk whose own K/V and window fit every ring (store() splits a chunk where its ring wraps)
        self.chunk_cap = min([max_ctx] + [r - n_swa + 1 for r in self.rows if r < max_ctx])
        # rows a ring holds beyond its window: a truncation further back than that lost the window (backend.truncate)
        self.spare = min([r - n_swa for r in self.rows if r < max_ctx], default=None)
        if self.chunk_cap < 1:
            raise ValueError(f"KV rings of {min(self.rows)} rows are shorter than the window of {n_swa}")
        if any(r != max_ctx for r in self.rows):     # per layer: one flat allocation, layer i at _off[i] rows
            self._off = np.concatenate([[0], np.cumsum([cfg.n_head_kv * r for r in self.rows])]).tolist()
            shape = (self._off[-1], hd)
        else:
            self._off = None
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
    def nbytes(cfg, max_ctx: int, dtype: str = "f16", rows: list[int] | None = None) -> int:
        n = sum(rows) if rows is not None else cfg.n_layer * max_ctx
        return 2 * cfg.n_head_kv * n * row_bytes(cfg.head_dim, dtype)

    def _at(self, a, i: int) -> int:
        """Address of layer i in array a (K, V or a scale array)."""
        if self._off is None:
            return int(a[i].data.ptr)
        return int(a.data.ptr) + self._off[i] * a.strides[0]

    @property
    def total_bytes(self) -> int:
        return sum(a.nbytes for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)

    def layer(self, i: int) -> tuple[int, int]:
        """(k, v) addresses of layer i's fp16 cache."""
        if self.dtype != "f16":
            raise ValueError("this pass reads the fp16 KV cache, but the cache is int8 (--kv int8): run with --kv f16, "
                             "or use layer_i8() for the int8 layout")
        return self._at(self.k, i), self._at(self.v, i)

    def store(self, kernels, cfg, li, q, k_rows, v, q_norm, k_norm, rope, state=None, pos0: int = 0,
              T: int = 1) -> None:
        """The step between the Q/K/V projections and attention, for T tokens at positions pos0 + t (+ state[1] when
        state, a device int32 array, is given): optional q/k RMSNorm and RoPE (rotated q written back into q), K and
        V into layer li in this cache's layout. q: (T, n_head * head_dim), k_rows, v: (T, n_head_kv * head_dim) fp32;
        rope: (max_ctx, n_rot / 2) float2 (cos, sin). kernels: the engine's kernel table (kernels.Kernels)."""
        c = cfg
        R = self.rows[li]
        if R < self.max_ctx:
            # a ring: the chunk in pieces that do not wrap, each stored at its rows with the RoPE table shifted so
            # that row pos0 % R + t still turns by position pos0 + t (state is None: the prompt pass)
            if state is not None:
                raise ValueError("a window layer's ring takes the decode step's K/V in its fused attention launch "
                                 "(DecodeAttention with fused=True), not through store()")
            t = 0
            while t < T:
                p = pos0 + t
                n = min(T - t, R - p % R)
                self._store(kernels, c, li, q[t:t + n], k_rows[t:t + n], v[t:t + n], q_norm, k_norm,
                            U64(int(rope.data.ptr) + (p - p % R) * rope.strides[0]), p % R, n, R)
                t += n
            return
        self._store(kernels, c, li, q, k_rows, v, q_norm, k_norm, _ptr(rope), pos0, T, self.max_ctx, state)

    def _store(self, kernels, c, li, q, k_rows, v, q_norm, k_norm, rope_ptr, pos0, T, rows, state=None) -> None:
        grid, blk = (c.n_head + 2 * c.n_head_kv, T), (c.head_dim,)
        head = (_ptr(q), _ptr(k_rows), _ptr(v), _ptr(q_norm), _ptr(k_norm), rope_ptr, _ptr(state), I32(pos0))
        tail = (I32(c.n_head), I32(c.n_head_kv), I32(c.head_dim), I32(c.n_rot), I32(1 if c.rope_type == "neox" else 0),
                F32(c.rms_eps), I32(rows))
        if self.dtype == "f16":
            kc, vc = self.layer(li)
            kernels("qk_rope_store")(grid, blk, (*head, U64(kc), U64(vc), *tail))
        else:
            kernels("qk_rope_store_kv8")(grid, blk, (*head, *(U64(a) for a in self.layer_i8(li)), *tail))

    def layer_i8(self, i: int) -> tuple[int, int, int, int]:
        """(k_q, k_scale, v_q, v_scale) addresses of layer i's int8 cache."""
        if self.dtype != "int8":
            raise ValueError("layer_i8() needs the int8 KV cache (--kv int8); this one is fp16: use layer()")
        return self._at(self.k, i), self._at(self.k_scale, i), self._at(self.v, i), self._at(self.v_scale, i)


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


@dataclass(frozen=True)
class AttnVariant:
    """A family's variant of the fused decode attention: attn_gqa_rope<suffix>_<f16|i8>, always fused when
    fused_only, its launch taking layer_args(li) after the shared arguments (gpt-oss: the layer's sinks and window,
    engine/cuda/families/gptoss.py)."""
    suffix: str = ""
    fused_only: bool = False
    layer_args: Callable[[int], tuple] = field(default=lambda li: ())


PLAIN = AttnVariant()


# cuda_src/attn_split.cu (flash-decoding on tensor cores; keep in step with the #defines there)
AS_CMIN = 128             # fewest keys a chunk
AS_MAX_CHUNKS = 128
AS_MAX_ROWS = 64          # n_q * G query rows per KV head
AS_MAX_WARPS = 8
AS_MAX_NQ = 8             # query tokens per launch (speculative verify windows)
# The decode attention's kernels: attn_split.cu's (True) or attention.cu's attn_gqa_* (False; bench.attn_decode's
# "old" side). Measured at 32K on the H200: see docs/experiments.md "Flash-decoding".
SPLIT_ATTN = True


def split_tile(head_dim: int) -> int:
    """Keys per tile of attn_split.cu (AS_BN)."""
    return 32 if head_dim > 128 else 64


def split_warps(group: int, n_q: int, head_dim: int) -> tuple[int, int]:
    """(m-tiles, warps per m-tile) of an attn_split block: a warp per 8 query rows (its 16-row mma tile holds each
    row's fp16 hi and lo parts), and up to 4 warps in all sharing each tile's 16-key slices when the rows are few."""
    rows = n_q * group
    if not 1 <= rows <= AS_MAX_ROWS:
        raise ValueError(f"the split decode attention takes 1 to {AS_MAX_ROWS} query rows per KV head "
                         f"(n_q * group = {n_q} * {group})")
    mt = -(-rows // 8)
    ks = max(1, min(4 // mt, split_tile(head_dim) // 16))
    return mt, ks


def split_chunks(n_head_kv: int, max_ctx: int, n_sm: int, per_sm: int = 1) -> int:
    """Most chunks per KV head (the grid's second dimension; the device uses as many as the position needs, each at
    least AS_CMIN keys): one block an SM at long contexts, never more than the context has AS_CMIN spans. One block
    an SM beat the two that fit (bench.attn_decode --chunks, Qwen3 shape on the H200: 33 against 66 chunks, f16
    30.8 / 32.1 us at 32K, int8 36.6 / 43.0; fewer, longer chunks keep more of each block's cp.async ring busy)."""
    return max(1, min(AS_MAX_CHUNKS, -(-per_sm * n_sm // n_head_kv), -(-max_ctx // AS_CMIN)))


def split_range(P0: int, n_q: int, n_swa: int, max_chunks: int, head_dim: int) -> tuple[int, int, int, int]:
    """attn_split.cu's as_range, for the host (bench, tests): the window at position P0 reads keys kb .. kend - 1 in
    n chunks of clen keys (whole tiles; the last may be shorter). (kb, kend, clen, n)."""
    bn = split_tile(head_dim)
    kb = max(0, P0 - n_swa + 1) if n_swa > 0 else 0
    kend = P0 + n_q
    span = kend - kb
    n = min(max_chunks, max(1, -(-span // AS_CMIN)))
    clen = -(-(-(-span // n)) // bn) * bn
    return kb, kend, clen, -(-span // clen)


def split_module(head_dim: int):
    """attn_split.cu built for this head dim (compile-time in its mma loops)."""
    from engine.cuda import kernels as loader
    return loader.load("attn_split", {"AS_HD": head_dim})


class DecodeAttention:
    """The decode step's attention over a KVCache, for one token at position state[1]: `step` norms and rotates q
    and k, writes K/V there and attends, in one launch (fused) or two (`store`, then `attend`); `attend` also takes a
    window of n_q <= n_q_max tokens at consecutive positions (causal among them). Buffers are sized once from max_ctx;
    the position is read on the device, so a captured graph serves every step.
    split (default SPLIT_ATTN): attn_split.cu, chunks over the sequence merged by attn_split_reduce (n_split: the
    most chunks a KV head); else attention.cu's attn_gqa_* (n_split: its splits; n_q 1 only)."""

    def __init__(self, kernels, cfg, kv: KVCache, n_split: int | None = None, fused: bool | None = None,
                 variant: AttnVariant = PLAIN, n_q_max: int = 1, split: bool | None = None):
        G = cfg.n_head // cfg.n_head_kv
        if cfg.n_head % cfg.n_head_kv or not 1 <= G <= AT_MAX_G:
            raise ValueError(f"the CUDA decode attention takes 1 to {AT_MAX_G} q heads per KV head "
                             f"(this model: {cfg.n_head} / {cfg.n_head_kv}); use --backend cpu")
        if cfg.head_dim % 32 or cfg.head_dim > 256:
            raise ValueError(f"the CUDA decode attention needs head_dim a multiple of 32, <= 256 "
                             f"(this model: {cfg.head_dim}); use --backend cpu")
        self.cfg, self.kv, self.group = cfg, kv, G
        self.split = SPLIT_ATTN if split is None else split
        self.fused = variant.fused_only or (FUSED_STORE if fused is None else fused)
        self.variant = variant
        self.n_q_max = n_q_max
        dt = "f16" if kv.dtype == "f16" else "i8"
        if self.split:
            self._init_split(kernels, cfg, kv, n_split, n_q_max, dt)
            return
        if n_q_max != 1:
            raise ValueError("attention.cu's attn_gqa_* take one query token; windows need split=True")
        if n_split is None:
            n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
            n_split = attn_splits(cfg.n_head_kv, kv.max_ctx, n_sm)
        if not 1 <= n_split <= AT_MAX_SPLITS:
            raise ValueError(f"n_split must be 1..{AT_MAX_SPLITS}, got {n_split}")
        self.n_split = n_split
        self.block = attn_block(G)
        self.smem = attn_smem(kv.dtype, G, cfg.head_dim)
        self.name = f"attn_gqa_{dt}"
        self.name_fused = f"attn_gqa_rope{variant.suffix}_{dt}"
        self.part = cp.zeros(cfg.n_head * n_split * (cfg.head_dim + 2), dtype=cp.float32)
        self.counters = cp.zeros(cfg.n_head_kv, dtype=cp.int32)
        # past 48 KiB (head_dim 256) a block must opt in; set before any capture, harmless below
        kernels(self.name).max_dynamic_shared_size_bytes = self.smem
        kernels(self.name_fused).max_dynamic_shared_size_bytes = self.smem
        kernels("qk_rope_store" if kv.dtype == "f16" else "qk_rope_store_kv8")     # loaded now, not mid-capture

    def _init_split(self, kernels, cfg, kv, n_split, n_q_max, dt) -> None:
        if not 1 <= n_q_max <= AS_MAX_NQ:
            raise ValueError(f"n_q_max must be 1..{AS_MAX_NQ}, got {n_q_max}")
        split_warps(self.group, n_q_max, cfg.head_dim)           # the widest window fits (or a clear error)
        mod = split_module(cfg.head_dim)
        sfx, hd = self.variant.suffix, cfg.head_dim
        self.fn = mod.get_function(f"attn_split{sfx}_{dt}")
        self.fn_fused = mod.get_function(f"attn_split_rope{sfx}_{dt}")
        self.fn_reduce = mod.get_function("attn_split_reduce")
        # into the engine's table under names with the build's head dim, so the step launches them as its own (a
        # tracer's kind filter sees them: bench.decode's profile) and builds of two head dims never collide
        self.names = (f"attn_split{sfx}_{dt}:hd{hd}", f"attn_split_rope{sfx}_{dt}:hd{hd}", f"attn_split_reduce:hd{hd}")
        for name, fn in zip(self.names, (self.fn, self.fn_fused, self.fn_reduce)):
            kernels.register(name, None, fn)
        # launch shapes per window size, shared memory asked of the build (attn_split_shape)
        shape = cp.zeros(5, cp.int32)

        def smem(fuse, mt, nw):
            mod.get_function("attn_split_shape")((1,), (1,), (shape, I32(dt == "i8"), I32(fuse), I32(mt), I32(nw)))
            return int(shape.get()[0])
        self.shapes = {}              # n_q -> (warps an m-tile, threads, shared memory); the fused launch: n_q 1
        for n_q in range(1, n_q_max + 1):
            mt, ks = split_warps(self.group, n_q, cfg.head_dim)
            self.shapes[n_q] = (ks, 32 * mt * ks, smem(0, mt, mt * ks))
        mt, ks = split_warps(self.group, 1, cfg.head_dim)
        self.smem_fused = smem(1, mt, mt * ks)
        bn, cmin, max_chunks, max_rows = (int(x) for x in shape.get()[1:])
        if (bn, cmin, max_chunks, max_rows) != (split_tile(cfg.head_dim), AS_CMIN, AS_MAX_CHUNKS, AS_MAX_ROWS):
            raise RuntimeError(f"attn_split.cu's constants {bn, cmin, max_chunks, max_rows} differ from kv.py's")
        if n_split is None:       # one wave of the one-token step's blocks
            n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
            n_split = split_chunks(cfg.n_head_kv, kv.max_ctx, n_sm)
        if not 1 <= n_split <= AS_MAX_CHUNKS:
            raise ValueError(f"n_split (chunks) must be 1..{AS_MAX_CHUNKS}, got {n_split}")
        self.n_split = n_split
        # past 48 KiB a block must opt in; set before any capture, never lowered (the function is the module's,
        # shared with any other DecodeAttention of this head dim, e.g. a verify window's wider one)
        for fn, need in ((self.fn, max(s[2] for s in self.shapes.values())), (self.fn_fused, self.smem_fused)):
            if getattr(fn, "max_dynamic_shared_size_bytes", 0) < need:
                fn.max_dynamic_shared_size_bytes = need
        rows = n_q_max * self.group
        self.part = cp.zeros(n_split * cfg.n_head_kv * rows * cfg.head_dim, dtype=cp.float32)
        self.part_ml = cp.zeros(n_split * cfg.n_head_kv * rows * 2, dtype=cp.float32)
        kernels("qk_rope_store" if kv.dtype == "f16" else "qk_rope_store_kv8")     # loaded now, not mid-capture

    def _cache(self, li) -> tuple:
        """Layer li's cache addresses in the split kernels' order (k, v, k_scale, v_scale; null scales for fp16)."""
        if self.kv.dtype == "f16":
            k, v = self.kv.layer(li)
            return U64(k), U64(v), U64(0), U64(0)
        k, ks, v, vs = self.kv.layer_i8(li)
        return U64(k), U64(v), U64(ks), U64(vs)

    def _layer_extra(self, li) -> tuple:
        """(sinks, window) of layer li: the variant's, or none."""
        extra = tuple(self.variant.layer_args(li))
        return extra if extra else (U64(0), I32(0))

    def _split_launch(self, kernels, li, q, out, state, pos0, n_q, scale, fused_args=None) -> None:
        c = self.cfg
        if not 1 <= n_q <= self.n_q_max:
            raise ValueError(f"n_q must be 1..{self.n_q_max} (this DecodeAttention's n_q_max), got {n_q}")
        ks, block, smem = self.shapes[n_q]
        sinks, n_swa = self._layer_extra(li)
        args = (_ptr(q), *self._cache(li), _ptr(state), I32(pos0), I32(n_q), _ptr(self.part), _ptr(self.part_ml),
                _ptr(out), I32(c.n_head_kv), I32(self.group), I32(self.kv.rows[li]), F32(scale), I32(self.n_split),
                I32(ks), sinks, n_swa)
        if fused_args is None:
            kernels(self.names[0])((c.n_head_kv, self.n_split), (block,), args, shared_mem=smem)
        else:
            kernels(self.names[1])((c.n_head_kv, self.n_split), (block,), args + fused_args,
                                   shared_mem=self.smem_fused)
        if self.n_split == 1:         # never more than one chunk (a fixed bound, not the position): no merge
            return
        kernels(self.names[2])((n_q * self.group, c.n_head_kv), (512,),
                               (_ptr(self.part), _ptr(self.part_ml), _ptr(state), I32(pos0), I32(n_q),
                                I32(self.n_split), _ptr(out), I32(c.n_head_kv), I32(self.group), sinks, n_swa))

    def step(self, kernels, li, q, k_rows, v, q_norm, k_norm, rope, out, state, scale) -> None:
        """This step's attention block between the Q/K/V projections (q, k_rows, v: raw, fp32) and wo: out gets the
        attention of the token at position state[1] over positions 0 .. state[1] of layer li, whose K/V it stores."""
        if not self.fused:
            self.store(kernels, li, q, k_rows, v, q_norm, k_norm, rope, state)
            self.attend(kernels, li, q, out, state, scale)
            return
        c = self.cfg
        rotary = (_ptr(rope), I32(c.n_rot), I32(1 if c.rope_type == "neox" else 0), F32(c.rms_eps))
        if self.split:
            self._split_launch(kernels, li, q, out, state, 0, 1, scale,
                               (_ptr(k_rows), _ptr(v), _ptr(q_norm), _ptr(k_norm), *rotary))
            return
        addrs = self.kv.layer(li) if self.kv.dtype == "f16" else self.kv.layer_i8(li)
        rows = (_ptr(q), _ptr(k_rows), _ptr(v), _ptr(q_norm), _ptr(k_norm))
        cache = tuple(U64(a) for a in addrs)
        work = (_ptr(state), _ptr(self.part), _ptr(self.counters), _ptr(out))
        shape = (I32(c.n_head_kv), I32(self.group), I32(c.head_dim), I32(self.kv.rows[li]), F32(scale))
        kernels(self.name_fused)((c.n_head_kv, self.n_split), (self.block,),
                                 (*rows, *rotary, *cache, *work, *shape, *self.variant.layer_args(li)),
                                 shared_mem=self.smem)

    def store(self, kernels, li, q, k_rows, v, q_norm, k_norm, rope, state, pos0: int = 0, T: int = 1) -> None:
        """K/V of this step's T tokens at positions pos0 + t (+ state[1]) (KVCache.store)."""
        self.kv.store(kernels, self.cfg, li, q, k_rows, v, q_norm, k_norm, rope, state, pos0=pos0, T=T)

    def attend(self, kernels, li, q, out, state, scale, n_fixed: int = 0, n_q: int = 1, pos0: int = 0) -> None:
        """out (n_q, n_head * head_dim) = softmax(q K^T * scale) V for the rotated q (n_q, n_head * head_dim) of n_q
        tokens at positions P0 + t, P0 = pos0 + state[1] (state None: n_fixed - 1 + pos0), token t over positions
        0 .. P0 + t of layer li (a window layer: its last n_swa of them; gpt-oss's sinks join the softmax)."""
        c = self.cfg
        if self.split:
            self._split_launch(kernels, li, q, out, state, pos0 + (0 if state is not None else n_fixed - 1), n_q,
                               scale)
            return
        if n_q != 1 or pos0:
            raise ValueError("attention.cu's attn_gqa_* take one query token at state[1] or n_fixed - 1")
        addrs = self.kv.layer(li) if self.kv.dtype == "f16" else self.kv.layer_i8(li)
        kernels(self.name)((c.n_head_kv, self.n_split), (self.block,),
                           (_ptr(q), *(U64(a) for a in addrs), _ptr(state), I32(n_fixed), _ptr(self.part),
                            _ptr(self.counters), _ptr(out), I32(c.n_head_kv), I32(self.group), I32(c.head_dim),
                            I32(self.kv.max_ctx), F32(scale)),
                           shared_mem=self.smem)
