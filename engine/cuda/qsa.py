"""qwen4exp's QSA sparse attention on the GPU (cuda_src/qsa.cu), decode and prompt chunks, beside the NumPy reference
(engine/arch/qwen4exp.py: Qwen4Exp.qsa, pooled_block_keys, block_scores, select_tokens, masked_attention).

A query at position p sees n_b = (p+1) // r complete blocks of r cells plus the tail r n_b .. p. With n_b <= B =
budget // r it attends every position 0..p (dense); else the B complete blocks of the highest indexer score (ties to
the lower block) plus the tail. Either way at most budget + r - 1 keys, so decode time stays flat with the context:
only the scores (a 128-float dot per block and indexer head) and the top-B selection grow with it, and both stay on
the GPU (no host round trip).

Per QSA layer, in VRAM (QsaCache; QsaCache.nbytes says how much):
    kc, vc   (Hkv, max_ctx, hd) fp16   K (normed, rotated) and V: engine/cuda/kv.py's f16 layout of one layer
    kraw     (max_ctx, di) fp32        the raw indexer keys (W_ik y, no norm, no rope): pooling reads them
    kbar     (max_ctx // r, di) fp32   pooled block keys (4.6.6), written once a block completes; a rewind to pos0
                                       keeps blocks < pos0 // r valid (the next chunk re-pools block pos0 // r)
The projections come from the engine's mat-vecs / GEMMs, fp32, rows of a (T, W) buffer (the row stride is read from
the array, so they may be column views of one wider GEMM output):
    q   (T, >= Hq q_hs)  query head h at columns h q_hs .. + hd: attn_q's own interleaved [q_h | gate_h] rows give
                         q_hs = 2 hd (the default) and the gate as the view q[:, hd:] with gate_hs = 2 hd
    k, v (T, >= Hkv hd)  attn_k / attn_v;   qi (T, >= Hi di) indexer.q_proj;   ki (T, >= di) indexer.k_proj
    decode: the same as 1-D vectors (one row).
The norms (QsaNorms): attn_q_norm, attn_k_norm (hd,), indexer.q_norm, indexer.k_norm (di,) fp32. rope: the engine's
table (engine/cuda/rope.py rope_table: (max_ctx, n_rot/2, 2) fp32 cos, sin) as a device array.
Output: out (T, Hq hd) fp32 = the attention of each head times sigmoid(gate) (gate=None: ungated, for a caller that
gates in W_o's launch, Launcher.mv_gated); W_o is the caller's.

Decode (QsaKernels.decode, 4 or 5 launches, capture-safe: the position is state[1] on the device, the engine's
decode state array (int32); nothing allocates; every grid is fixed):
    qsa_prep (K/V and the raw key stored at p, the block p completes pooled) -> qsa_scores_dec (fixed grid striding
    over n_b; nothing when dense) -> qsa_select (one block: the unit list) -> qsa_attn (n_split x Hkv blocks)
    -> qsa_combine (when n_split > 1)
Prompt (QsaKernels.prompt; pos0 a host int, chunks of at most scratch.max_tokens): qsa_prep for T tokens, qsa_pool
of the blocks the chunk completes, then per sub-batch of scratch.q_rows queries the tiled scores (only when one of
them is sparse) and the selection, then qsa_attn with one split a query (final output).
Launches go on the current CuPy stream (`with stream:`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.arch.qwen4exp import select_tokens

# (head_dim, query heads per KV head) that qsa.cu is built for (its @build lines): the published model, make_moe's
# tiny-qwen4exp (4/2 heads of 64), the tiny fixture (4/2 heads of 32)
BUILDS = {(256, 12), (64, 2), (32, 2)}
MAX_IDX_DIM, MAX_IDX_HEADS = 256, 8           # qsa.cu QSA_MAXDI, QSA_MAXHI
PREP_THREADS = 256                             # QSA_PREP_THREADS: max(head_dim, QSA_MAXDI) for every build
WARPS = 8                                     # QSA_WARPS
SEL_THREADS = 1024                            # QSA_SEL_THREADS
TILE_B, TILE_Q = 64, 16                       # QSA_TB, QSA_TQ
UNITS_PER_SPLIT = 16                          # decode: 64 keys a split at r = 4 (33 splits at the published budget)


@dataclass(frozen=True)
class QsaShape:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    idx_heads: int
    idx_dim: int
    r: int                 # cells a block (the layer's compress ratio)
    budget: int            # tokens (attention.indexer.top_k): budget // r whole blocks
    eps: float
    scale: float           # the attention's q.k scale (1/sqrt(head_dim))

    def __post_init__(self):
        if self.n_head_kv < 1 or self.n_head % self.n_head_kv:
            raise ValueError(f"{self.n_head} query heads do not group over {self.n_head_kv} KV heads")
        if (self.head_dim, self.group) not in BUILDS:
            raise ValueError(f"QSA heads of {self.head_dim} with {self.group} query heads a KV head: qsa.cu is built "
                             f"for {sorted(BUILDS)} (add a '@build QSA_HD={self.head_dim} QSA_G={self.group}' line)")
        if not 1 <= self.idx_heads <= MAX_IDX_HEADS or not 1 <= self.idx_dim <= MAX_IDX_DIM:
            raise ValueError(f"{self.idx_heads} indexer heads of {self.idx_dim}: the kernels take up to "
                             f"{MAX_IDX_HEADS} heads of up to {MAX_IDX_DIM}")
        if self.n_rot % 2 or not 0 <= self.n_rot <= min(self.head_dim, self.idx_dim):
            raise ValueError(f"{self.n_rot} rotary dims for heads of {self.head_dim} and indexer heads of "
                             f"{self.idx_dim}")
        if self.r < 1 or self.budget < self.r or self.budget % self.r:
            raise ValueError(f"a QSA budget of {self.budget} tokens in blocks of {self.r}")

    @classmethod
    def from_config(cls, cfg, il: int) -> "QsaShape":
        p = cfg.family_params
        scale = cfg.attn_scale or 1.0 / math.sqrt(cfg.head_dim)
        return cls(cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot, p.indexer_heads, p.indexer_dim,
                   p.compress_ratios[il], p.qsa_budget, cfg.rms_eps, scale)

    @property
    def group(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def budget_blocks(self) -> int:
        return self.budget // self.r

    @property
    def max_units(self) -> int:
        """A query's unit list: budget_blocks + the tail (dense: at most as many)."""
        return self.budget_blocks + 1

    def n_blocks(self, max_ctx: int) -> int:
        return max_ctx // self.r


def cache_bytes(shape: QsaShape, max_ctx: int) -> int:
    """One QSA layer's cache: K and V fp16, raw indexer keys and pooled keys fp32."""
    return (2 * shape.n_head_kv * max_ctx * shape.head_dim * 2 + max_ctx * shape.idx_dim * 4
            + shape.n_blocks(max_ctx) * shape.idx_dim * 4)


def decode_splits(shape: QsaShape, units_per_split: int = UNITS_PER_SPLIT) -> tuple[int, int]:
    """(n_split, units a split) of the decode attention: every split but the last full at the largest unit list."""
    ups = max(1, min(units_per_split, shape.max_units))
    return -(-shape.max_units // ups), ups


def prompt_scratch_bytes(shape: QsaShape, max_tokens: int, max_ctx: int, q_rows: int | None = None) -> int:
    """QsaPromptScratch's VRAM: q (T, Hq, hd), qi (T, Hi, di), scores (q_rows, max_ctx // r), units (T, B + 1),
    n_units (T,)."""
    q_rows = min(max_tokens, q_rows or max_tokens)
    return 4 * (max_tokens * (shape.n_head * shape.head_dim + shape.idx_heads * shape.idx_dim + shape.max_units + 1)
                + q_rows * shape.n_blocks(max_ctx))


# --- NumPy references ---------------------------------------------------------------------------------------------

def ref_units(scores: np.ndarray, pos, r: int, nb_budget: int) -> list[np.ndarray]:
    """The unit list qsa_select writes for each query, from select_tokens' mask (the reference's selection): scores
    (T, >= n_b) of the complete blocks, pos (T,) the queries' positions. Dense: 0 .. ceil((p+1)/r) - 1; sparse: the
    selected complete blocks in increasing order, then the tail block n_b when (p+1) % r."""
    pos = np.asarray(pos, np.int64)
    mask = select_tokens(np.asarray(scores), pos, int(pos.max()) + 1, r, nb_budget)
    out = []
    for i, p in enumerate(pos):
        n_b = (int(p) + 1) // r
        if n_b <= nb_budget:
            out.append(np.arange((int(p) + r) // r))
            continue
        cells = np.nonzero(mask[i])[0]
        blocks = np.unique(cells[cells < r * n_b] // r)
        out.append(np.concatenate([blocks, [n_b] if (p + 1) % r else []]).astype(np.int64))
    return out


def units_mask(units, p: int, r: int, n_keys: int) -> np.ndarray:
    """The cells 0 .. n_keys - 1 a unit list covers for a query at p (those <= p): select_tokens' mask row."""
    m = np.zeros(n_keys, dtype=bool)
    for u in units:
        m[int(u) * r:min(int(u) * r + r, p + 1)] = True
    return m


# --- device buffers -----------------------------------------------------------------------------------------------

@dataclass
class QsaNorms:
    q_norm: object
    k_norm: object
    iq_norm: object
    ik_norm: object


@dataclass
class QsaCache:
    """One QSA layer's cache (module docstring). Each of kc, vc, kraw, kbar is a CuPy array or a device address (an
    int: e.g. kv.py KVCache.layer(li)'s K and V of a layer whose max_ctx is kv.rows[li])."""
    max_ctx: int
    kc: object
    vc: object
    kraw: object
    kbar: object

    @classmethod
    def alloc(cls, shape: QsaShape, max_ctx: int) -> "QsaCache":
        import cupy as cp
        s = shape
        return cls(max_ctx, cp.zeros((s.n_head_kv, max_ctx, s.head_dim), cp.float16),
                   cp.zeros((s.n_head_kv, max_ctx, s.head_dim), cp.float16),
                   cp.zeros((max_ctx, s.idx_dim), cp.float32), cp.zeros((s.n_blocks(max_ctx), s.idx_dim), cp.float32))

    def nbytes(self) -> int:
        """The arrays' bytes (addresses count nothing)."""
        return sum(getattr(a, "nbytes", 0) for a in (self.kc, self.vc, self.kraw, self.kbar))


@dataclass
class QsaDecodeScratch:
    """The decode step's work buffers (one set serves every QSA layer): q (Hq, hd), qi (Hi, di) rotated; scores
    (max_ctx // r,); units (B + 1,) int32, n_units (1,) int32; part (n_split, Hq, hd + 2) (n_split > 1)."""
    n_split: int
    ups: int
    q: object
    qi: object
    scores: object
    units: object
    n_units: object
    part: object


@dataclass
class QsaPromptScratch:
    """The prompt's work buffers for chunks of up to max_tokens: q (T, Hq, hd), qi (T, Hi, di), scores (q_rows,
    max_ctx // r) for a sub-batch of q_rows queries, units (T, B + 1) int32, n_units (T,) int32."""
    max_tokens: int
    q_rows: int
    q: object
    qi: object
    scores: object
    units: object
    n_units: object


def _addr(a):
    """A kernel's pointer argument for a CuPy array or a device address."""
    from engine.cuda.launch import U64, ptr
    return U64(a) if isinstance(a, (int, np.integer)) else ptr(a)


def _ld(a, width: int, name: str, dtype="float32") -> int:
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must be {dtype}, got {a.dtype}")
    if a.ndim == 1:
        if a.size < width:
            raise ValueError(f"{name}: {a.size} elements, {width} needed")
        return a.size
    if a.ndim != 2 or a.strides[1] != a.itemsize or a.shape[1] < width:
        raise ValueError(f"{name}: rows of {width} contiguous elements needed, got shape {a.shape} strides {a.strides}")
    return a.strides[0] // a.itemsize


def _rows(a) -> int:
    return 1 if a.ndim == 1 else a.shape[0]


class QsaKernels:
    """qsa.cu built for one QsaShape's head width and group (load before READY: nothing compiles later)."""

    NAMES = ("qsa_prep", "qsa_pool", "qsa_scores_dec", "qsa_scores_rows", "qsa_select", "qsa_attn", "qsa_combine")

    def __init__(self, shape: QsaShape, n_sm: int | None = None):
        import cupy as cp

        from engine.cuda import kernels
        self.shape = shape
        mod = kernels.load("qsa", {"QSA_HD": shape.head_dim, "QSA_G": shape.group})
        self.f = {n: mod.get_function(n) for n in self.NAMES}
        self.n_sm = n_sm or cp.cuda.Device().attributes["MultiProcessorCount"]

    # --- buffers ---
    def cache(self, max_ctx: int) -> QsaCache:
        return QsaCache.alloc(self.shape, max_ctx)

    def decode_scratch(self, max_ctx: int, units_per_split: int = UNITS_PER_SPLIT) -> QsaDecodeScratch:
        import cupy as cp
        s = self.shape
        n_split, ups = decode_splits(s, units_per_split)
        return QsaDecodeScratch(n_split, ups, cp.zeros((s.n_head, s.head_dim), cp.float32),
                                cp.zeros((s.idx_heads, s.idx_dim), cp.float32),
                                cp.zeros(s.n_blocks(max_ctx), cp.float32),
                                cp.zeros(s.max_units, cp.int32), cp.zeros(1, cp.int32),
                                cp.zeros((n_split, s.n_head, s.head_dim + 2), cp.float32) if n_split > 1 else None)

    def prompt_scratch(self, max_tokens: int, max_ctx: int, q_rows: int | None = None) -> QsaPromptScratch:
        import cupy as cp
        s = self.shape
        q_rows = min(max_tokens, q_rows or max_tokens)
        return QsaPromptScratch(max_tokens, q_rows, cp.zeros((max_tokens, s.n_head, s.head_dim), cp.float32),
                                cp.zeros((max_tokens, s.idx_heads, s.idx_dim), cp.float32),
                                cp.zeros((q_rows, s.n_blocks(max_ctx)), cp.float32),
                                cp.zeros((max_tokens, s.max_units), cp.int32), cp.zeros(max_tokens, cp.int32))

    # --- the kernels one by one ---
    def prep(self, T: int, q, k, v, qi, ki, norms: QsaNorms, rope, cache: QsaCache, q_out, qi_out, state=None,
             pos0: int = 0, pool: bool = False, q_hs: int | None = None) -> None:
        """Tokens 0..T-1 at positions pos0 + t (+ state[1]): q_out (T, Hq, hd) and qi_out (T, Hi, di) normed and
        rotated; K (normed, rotated), V and the raw indexer key stored at each position; pool (decode, T = 1): the
        block the token completes pooled into cache.kbar."""
        from engine.cuda.launch import F32, I32, I64, ptr
        s = self.shape
        q_hs = 2 * s.head_dim if q_hs is None else q_hs
        if q_hs < s.head_dim:
            raise ValueError(f"query head stride {q_hs} below the head width {s.head_dim}")
        if pool and T != 1:
            raise ValueError("prep pools inline only for one token (decode); a prompt chunk calls pool()")
        lds = [_ld(a, w, n) for a, w, n in ((q, (s.n_head - 1) * q_hs + s.head_dim, "q"),
                                             (k, s.n_head_kv * s.head_dim, "k"), (v, s.n_head_kv * s.head_dim, "v"),
                                             (qi, s.idx_heads * s.idx_dim, "qi"), (ki, s.idx_dim, "ki"))]
        for a, n in ((q, "q"), (k, "k"), (v, "v"), (qi, "qi"), (ki, "ki")):
            if _rows(a) < T:
                raise ValueError(f"{n} has {_rows(a)} rows for {T} tokens")
        if q_out.size < T * s.n_head * s.head_dim or qi_out.size < T * s.idx_heads * s.idx_dim:
            raise ValueError("q_out / qi_out too small for T tokens")
        if state is None and pos0 + T > cache.max_ctx:
            raise ValueError(f"positions {pos0}..{pos0 + T - 1} past the cache's {cache.max_ctx}")
        self.f["qsa_prep"]((s.n_head + s.n_head_kv + s.idx_heads + 1, T), (PREP_THREADS,),
                           (ptr(q), I64(lds[0]), I32(q_hs), ptr(k), I64(lds[1]), ptr(v), I64(lds[2]), ptr(qi),
                            I64(lds[3]), ptr(ki), I64(lds[4]), ptr(norms.q_norm), ptr(norms.k_norm),
                            ptr(norms.iq_norm), ptr(norms.ik_norm), ptr(rope), I32(s.n_rot), F32(s.eps), ptr(state),
                            I32(pos0), ptr(q_out), ptr(qi_out), _addr(cache.kc), _addr(cache.vc), I32(cache.max_ctx),
                            _addr(cache.kraw), _addr(cache.kbar), I32(s.n_head), I32(s.n_head_kv), I32(s.idx_heads),
                            I32(s.idx_dim), I32(s.r), I32(1 if pool else 0)))

    def pool(self, cache: QsaCache, norms: QsaNorms, rope, b0: int, nb: int) -> None:
        """cache.kbar[b0 : b0 + nb] from the raw keys of those blocks (all stored)."""
        from engine.cuda.launch import F32, I32, ptr
        s = self.shape
        if nb <= 0:
            return
        if (b0 + nb) * s.r > cache.max_ctx:
            raise ValueError(f"blocks {b0}..{b0 + nb - 1} past the cache's {cache.max_ctx} cells")
        self.f["qsa_pool"]((nb,), (PREP_THREADS,),
                           (_addr(cache.kraw), _addr(cache.kbar), ptr(norms.ik_norm), ptr(rope), I32(s.n_rot),
                            F32(s.eps), I32(b0), I32(s.idx_dim), I32(s.r)))

    def scores_decode(self, qi_out, cache: QsaCache, scores, state, pos0: int = 0) -> None:
        """scores[b] (b < n_b) of the query at state[1] (+ pos0) from its rotated qi (Hi, di); nothing when dense."""
        from engine.cuda.launch import I32, ptr
        s = self.shape
        if scores.size < s.n_blocks(cache.max_ctx):
            raise ValueError(f"scores holds {scores.size} blocks, the cache {s.n_blocks(cache.max_ctx)}")
        self.f["qsa_scores_dec"]((2 * self.n_sm,), (32 * WARPS,),
                                 (ptr(qi_out), _addr(cache.kbar), ptr(scores), ptr(state), I32(pos0),
                                  I32(s.idx_heads), I32(s.idx_dim), I32(s.r), I32(s.budget_blocks)))

    def scores_rows(self, qi_out, t0: int, Tq: int, cache: QsaCache, scores, pos0: int) -> None:
        """scores[tq, b] (b < n_b of query t0 + tq at pos0 + t0 + tq) for tq < Tq, from qi_out (T, Hi, di)."""
        from engine.cuda.launch import I32, I64, ptr
        s = self.shape
        ld = _ld(scores, 1, "scores")
        nb_max = (pos0 + t0 + Tq) // s.r
        if nb_max > scores.shape[-1] or Tq > _rows(scores):
            raise ValueError(f"scores ({scores.shape}) too small for {Tq} queries of {nb_max} blocks")
        self.f["qsa_scores_rows"](((nb_max + TILE_B - 1) // TILE_B, (Tq + TILE_Q - 1) // TILE_Q), (256,),
                                  (ptr(qi_out), I32(t0), I32(Tq), _addr(cache.kbar), ptr(scores), I64(ld), I32(pos0),
                                   I32(s.idx_heads), I32(s.idx_dim), I32(s.r), I32(s.budget_blocks)))

    def select(self, scores, t0: int, Tq: int, units, n_units, state=None, pos0: int = 0) -> None:
        """units[t] / n_units[t] for queries t0 .. t0 + Tq - 1 (scores: their rows, row 0 = query t0)."""
        from engine.cuda.launch import I32, I64, ptr
        s = self.shape
        ld_s = _ld(scores, 1, "scores")
        ld_u = _ld(units, s.max_units, "units", "int32")
        if _rows(units) < t0 + Tq or n_units.size < t0 + Tq:
            raise ValueError(f"units / n_units too small for queries up to {t0 + Tq}")
        self.f["qsa_select"]((Tq,), (SEL_THREADS,),
                             (ptr(scores), I64(ld_s), I32(t0), ptr(state), I32(pos0), I32(s.r), I32(s.budget_blocks),
                              ptr(units), I32(ld_u), ptr(n_units)))

    def attend(self, T: int, q_out, cache: QsaCache, units, n_units, out, state=None, pos0: int = 0, gate=None,
               gate_hs: int | None = None, part=None, n_split: int = 1, ups: int | None = None) -> None:
        """The attention of T queries (q_out (T, Hq, hd)) over their unit lists. part None: out (T, >= Hq hd) =
        attention * sigmoid(gate) (gate None: ungated); else part gets n_split partials (decode, T = 1)."""
        from engine.cuda.launch import F32, I32, I64, ptr
        s = self.shape
        ups = s.max_units if ups is None else ups
        if n_split * ups < s.max_units:
            raise ValueError(f"{n_split} splits of {ups} units cover fewer than {s.max_units}")
        if (part is None) != (n_split == 1):
            raise ValueError("several splits need part (and one split writes out directly)")
        if part is not None and (T != 1 or part.size < n_split * s.n_head * (s.head_dim + 2)):
            raise ValueError("split partials are for one token, part (n_split, Hq, hd + 2)")
        ld_u = _ld(units, s.max_units, "units", "int32")
        ld_out = _ld(out, s.n_head * s.head_dim, "out") if part is None else 0
        ld_g, gate_hs = self._gate(gate, gate_hs)
        self.f["qsa_attn"]((n_split, s.n_head_kv, T), (32 * WARPS,),
                           (ptr(q_out), _addr(cache.kc), _addr(cache.vc), I32(cache.max_ctx), ptr(units), I32(ld_u),
                            ptr(n_units), ptr(state), I32(pos0), I32(s.r), I32(ups), ptr(gate), I64(ld_g),
                            I32(gate_hs), ptr(out if part is None else None), I64(ld_out), ptr(part),
                            I32(s.n_head_kv), F32(s.scale)))

    def combine(self, part, n_split: int, out, gate=None, gate_hs: int | None = None) -> None:
        """out (Hq hd,) = the decode splits merged (times sigmoid(gate) when given)."""
        from engine.cuda.launch import I32, ptr
        s = self.shape
        _, gate_hs = self._gate(gate, gate_hs)
        if out.size < s.n_head * s.head_dim:
            raise ValueError(f"out holds {out.size} floats, {s.n_head * s.head_dim} needed")
        self.f["qsa_combine"]((s.n_head,), (s.head_dim,),
                              (ptr(part), I32(n_split), ptr(gate), I32(gate_hs), ptr(out), I32(s.n_head)))

    def _gate(self, gate, gate_hs):
        s = self.shape
        if gate is None:
            return 0, 0
        gate_hs = 2 * s.head_dim if gate_hs is None else gate_hs
        return _ld(gate, (s.n_head - 1) * gate_hs + s.head_dim, "gate"), gate_hs

    # --- the whole attention block ---
    def decode(self, state, q, k, v, qi, ki, norms: QsaNorms, rope, cache: QsaCache, sc: QsaDecodeScratch, out,
               gate=None, gate_hs: int | None = None, q_hs: int | None = None) -> None:
        """One token at position state[1]: out (Hq hd,) from its projections (1-D; module docstring)."""
        self.prep(1, q, k, v, qi, ki, norms, rope, cache, sc.q, sc.qi, state=state, pool=True, q_hs=q_hs)
        self.scores_decode(sc.qi, cache, sc.scores, state)
        self.select(sc.scores, 0, 1, sc.units, sc.n_units, state=state)
        if sc.n_split == 1:
            self.attend(1, sc.q, cache, sc.units, sc.n_units, out, state=state, gate=gate, gate_hs=gate_hs,
                        ups=sc.ups)
        else:
            self.attend(1, sc.q, cache, sc.units, sc.n_units, None, state=state, part=sc.part, n_split=sc.n_split,
                        ups=sc.ups)
            self.combine(sc.part, sc.n_split, out, gate, gate_hs)

    def prompt(self, pos0: int, T: int, q, k, v, qi, ki, norms: QsaNorms, rope, cache: QsaCache,
               sc: QsaPromptScratch, out, gate=None, gate_hs: int | None = None, q_hs: int | None = None) -> None:
        """A chunk of T tokens at positions pos0 .. pos0 + T - 1 (the cache holds every earlier position): out
        (T, >= Hq hd)."""
        s = self.shape
        if not 1 <= T <= sc.max_tokens:
            raise ValueError(f"{T} tokens for a QSA scratch of {sc.max_tokens}")
        if sc.scores.shape[1] < s.n_blocks(cache.max_ctx):
            raise ValueError("the prompt scratch was made for a shorter cache")
        self.prep(T, q, k, v, qi, ki, norms, rope, cache, sc.q, sc.qi, pos0=pos0, q_hs=q_hs)
        lo, hi = pos0 // s.r, (pos0 + T) // s.r
        self.pool(cache, norms, rope, lo, hi - lo)
        for t0 in range(0, T, sc.q_rows):
            Tq = min(sc.q_rows, T - t0)
            if (pos0 + t0 + Tq) // s.r > s.budget_blocks:        # the sub-batch's last query is sparse
                self.scores_rows(sc.qi, t0, Tq, cache, sc.scores, pos0)
            self.select(sc.scores, t0, Tq, sc.units, sc.n_units, pos0=pos0)
        self.attend(T, sc.q, cache, sc.units, sc.n_units, out, pos0=pos0, gate=gate, gate_hs=gate_hs)
