"""qwen4exp's parts on the GPU, each one call of the family's layer programs (engine/cuda/families/qwen4exp.py): the
HC read / write (Hc), the Gated DeltaNet with the sigmoid gate (Gdn), the PLE add-back (Ple) and QSA (Qsa), over
cuda_src/qwen4exp.cu's kernels and the engine's mat-vecs (decode) or the prompt pass's projections (`proj(W, X)`:
X @ W^T for T rows). Beside them, the kernels' NumPy references (ref_*), in the kernels' layouts, for the tests.

Launches go on the current CuPy stream; the decode calls allocate nothing and read the position from state[1], so
the decode step captures them in its graph. `kern(name)` is the engine's kernel table (the decode step's filtering
one, or the prompt pass's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.arch import qwen4exp as ref
from engine.arch.base import rms_norm, silu
from engine.arch.qwen3next import causal_conv, l2_norm, sigmoid, softplus
from engine.cuda.launch import F32, I32, I64, NULL, U64, ptr

BLOCK = 256
MiB = 1 << 20


def _grid(n: int, per: int = BLOCK) -> tuple[int]:
    return (max(1, min(4096, (n + per - 1) // per)),)


@dataclass(frozen=True)
class Q4Shape:
    N: int          # n_embd: one stream
    H: int          # HC streams
    R: int          # HC low rank
    eps: float
    cfg: object

    @property
    def D(self) -> int:
        return self.N * self.H


def q4_shape(cfg) -> Q4Shape:
    p = cfg.family_params
    return Q4Shape(cfg.n_embd, p.hc_count, p.hc_rank, float(cfg.rms_eps), cfg)


@dataclass
class HcWeights:
    """One HC module on the device: gamma (H N,) float32 (hc_*_norm, 1 already added), down (R x H N), up (H N x R),
    inject (H x H N; None for the final read, output_hc_*), DevMatrix in their GGUF types."""
    gamma: object
    down: object
    up: object
    inject: object = None

    def matrices(self) -> list:
        return [m for m in (self.down, self.up, self.inject) if m is not None]


@dataclass
class HcScratch:
    u: object       # (rows, D) the normalised streams
    a: object       # (rows, R)
    s: object       # (rows, D) the up projection's logits


class Hc:
    """Spec 4.2 / 4.3 / 4.9."""

    def __init__(self, kern, launcher, shape: Q4Shape):
        self.k, self.mv, self.sh = kern, launcher, shape

    def scratch(self, rows: int) -> HcScratch:
        import cupy as cp
        sh = self.sh
        return HcScratch(cp.zeros(rows * sh.D, cp.float32), cp.zeros(rows * sh.R, cp.float32),
                         cp.zeros(rows * sh.D, cp.float32))

    def broadcast(self, e, x, rows: int) -> None:
        """x (rows, H N) = H copies of e (rows, N)."""
        sh = self.sh
        self.k("q4_broadcast")(_grid(rows * sh.D), (BLOCK,), (ptr(e), ptr(x), I32(sh.N), I32(sh.H), I64(rows)))

    def group_norm(self, x, gamma, out, rows: int) -> None:
        sh = self.sh
        self.k("q4_group_rmsnorm")((rows * sh.H,), (BLOCK,), (ptr(x), ptr(gamma), ptr(out), I32(sh.N), I32(sh.H),
                                                               F32(sh.eps)))

    def _mix(self, u, s, y, rows: int) -> None:
        sh = self.sh
        self.k("q4_hc_mix")(_grid(rows * sh.N), (BLOCK,), (ptr(u), ptr(s), ptr(y), I32(sh.N), I32(sh.H), I64(rows)))

    def _silu(self, a, n: int) -> None:
        self.k("q4_silu_scale")(_grid(n), (BLOCK,), (ptr(a), I64(n), F32(1.0 / self.sh.H)))

    def read(self, x, w: HcWeights, y, inj, sc: HcScratch, rows: int = 1) -> None:
        """Decode: y (N,) the block input of x (H N,), inj (H,) the inject logits (None for the final read; the write
        takes 2 sigmoid(inj / H)), through the engine's mat-vecs."""
        self.group_norm(x, w.gamma, sc.u, rows)
        self.mv.mv(w.down, sc.u, sc.a, tag="hc")
        self._silu(sc.a, rows * self.sh.R)
        self.mv.mv(w.up, sc.a, sc.s, tag="hc")
        self._mix(sc.u, sc.s, y, rows)
        if w.inject is not None:
            self.mv.mv(w.inject, sc.u, inj, tag="hc")

    def read_rows(self, x, w: HcWeights, inj, T: int, proj):
        """Prompt: the block inputs y (T, N) of x (T, H N), inj (T, H) filled unless None."""
        import cupy as cp
        sh = self.sh
        u = cp.empty((T, sh.D), dtype=cp.float32)
        self.group_norm(x, w.gamma, u, T)
        a = proj(w.down, u)
        self._silu(a, T * sh.R)
        s = proj(w.up, a)
        y = cp.empty((T, sh.N), dtype=cp.float32)
        self._mix(u, s, y, T)
        if w.inject is not None:
            inj[...] = proj(w.inject, u)
        return y

    def write(self, x, o, inj, rows: int) -> None:
        """x_c += 2 sigmoid(inj_c / H) o for each stream c."""
        sh = self.sh
        self.k("q4_hc_write")(_grid(rows * sh.D), (BLOCK,),
                              (ptr(x), ptr(o), ptr(inj), I32(sh.N), I32(sh.H), I64(rows), F32(1.0 / sh.H)))


# --- GDN --------------------------------------------------------------------------------------------------------

@dataclass
class GdnScratch:
    qkv: object
    act: object
    z: object
    beta: object
    alpha: object
    out: object


class Gdn:
    """Spec 4.5 with the sigmoid gate: q4_gdn_conv, q4_gdn_qk_norm, q4_gdn_delta on the state in place (the
    projections before and ssm_out after are the caller's: decode mat-vecs here, the prompt's proj)."""

    def __init__(self, kern, launcher, shape: Q4Shape):
        self.k, self.mv, self.sh = kern, launcher, shape
        c = shape.cfg
        self.n_k, self.n_v, self.S, self.K = c.ssm_k_heads, c.ssm_v_heads, c.ssm_state, c.ssm_conv
        self.C, self.inner = 2 * self.n_k * self.S + c.ssm_inner, c.ssm_inner
        self.threads = max(32, -(-self.S // 32) * 32)
        if self.threads > 1024:
            raise ValueError(f"GDN heads of {self.S}: q4_gdn_delta takes a head a block, at most 1024 wide")

    def scratch(self, rows: int) -> GdnScratch:
        import cupy as cp
        f = lambda n: cp.zeros(rows * n, cp.float32)     # noqa: E731
        return GdnScratch(f(self.C), f(self.C), f(self.inner), f(self.n_v), f(self.n_v), f(self.inner))

    def _core(self, qkv, act, z, beta, alpha, g, conv_state, S, out, T: int) -> None:
        self.k("q4_gdn_conv")(_grid(self.C, 128), (128,),
                              (ptr(qkv), I64(self.C), I32(T), ptr(conv_state), ptr(g.conv), ptr(act), I64(self.C),
                               I32(self.C), I32(self.K)))
        self.k("q4_gdn_qk_norm")((2 * self.n_k, T), (32,),
                                 (ptr(act), I64(self.C), I32(self.n_k), I32(self.S), F32(self.sh.eps),
                                  F32(1.0 / math.sqrt(self.S))))
        self.k("q4_gdn_delta")((self.n_v,), (self.threads,),
                               (ptr(act), I64(self.C), I32(T), ptr(beta), ptr(alpha), I64(self.n_v), ptr(g.dt_bias),
                                ptr(g.a), ptr(S), ptr(z), I64(self.inner), ptr(g.norm), ptr(out), I64(self.inner),
                                I32(self.n_k), I32(self.S), F32(self.sh.eps), I32(1)),
                               shared_mem=8 * self.S)

    def decode(self, g, y, conv_state, S, sc: GdnScratch) -> None:
        """sc.out (n_v D,) = the mixer before ssm_out of the block input y (N,)."""
        for W, out in ((g.qkv, sc.qkv), (g.z, sc.z), (g.beta, sc.beta), (g.alpha, sc.alpha)):
            self.mv.mv(W, y, out, tag="gdn_in")
        self._core(sc.qkv, sc.act, sc.z, sc.beta, sc.alpha, g, conv_state, S, sc.out, 1)

    def prompt(self, g, y, conv_state, S, T: int, proj):
        """(T, n_v D) the mixer before ssm_out of the chunk's block inputs y (T, N)."""
        import cupy as cp
        qkv, z, beta, alpha = (proj(W, y) for W in (g.qkv, g.z, g.beta, g.alpha))
        act = cp.empty_like(qkv)
        out = cp.empty((T, self.inner), dtype=cp.float32)
        self._core(qkv, act, z, beta, alpha, g, conv_state, S, out, T)
        return out


# --- PLE --------------------------------------------------------------------------------------------------------

@dataclass
class PleScratch:
    k: object       # (rows, D)
    v: object       # (rows, N)
    q: object       # (rows, D)
    g: object       # (rows, D)
    gn: object      # (rows, D)


class Ple:
    """Spec 4.8's post-ops: x += G + SiLU(conv(GroupNorm(G))), G the gated values of the n-gram embedding eta."""

    def __init__(self, kern, launcher, shape: Q4Shape):
        self.k, self.mv, self.sh = kern, launcher, shape
        p = shape.cfg.family_params
        self.K, self.dil = p.ple_conv, p.ngram_size

    def scratch(self, rows: int) -> PleScratch:
        import cupy as cp
        sh = self.sh
        f = lambda n: cp.zeros(rows * n, cp.float32)     # noqa: E731
        return PleScratch(f(sh.D), f(sh.N), f(sh.D), f(sh.D), f(sh.D))

    def _tail(self, w, x, hist, sc: PleScratch, T: int) -> None:
        sh = self.sh
        norm = lambda a, gamma, out: self.k("q4_group_rmsnorm")(     # noqa: E731
            (T * sh.H,), (BLOCK,), (ptr(a), ptr(gamma), ptr(out), I32(sh.N), I32(sh.H), F32(sh.eps)))
        norm(sc.k, w.norm_key, sc.k)
        norm(x, w.norm_query, sc.q)
        self.k("q4_ple_gate")((T * sh.H,), (BLOCK,), (ptr(sc.k), ptr(sc.q), ptr(sc.v), ptr(sc.g), I32(sh.N),
                                                       I32(sh.H)))
        norm(sc.g, w.norm_conv, sc.gn)
        self.k("q4_ple_conv")(_grid(sh.D, 128), (128,), (ptr(sc.gn), ptr(hist), ptr(w.conv), ptr(sc.g), ptr(x),
                                                          I32(T), I32(sh.D), I32(self.K), I32(self.dil)))

    def decode(self, w, eta, x, hist, sc: PleScratch) -> None:
        self.mv.mv(w.key, eta, sc.k, tag="ple")
        self.mv.mv(w.value, eta, sc.v, tag="ple")
        self._tail(w, x, hist, sc, 1)

    def prompt(self, w, eta, x, hist, T: int, proj) -> None:
        import cupy as cp
        sh = self.sh
        sc = PleScratch(proj(w.key, eta), proj(w.value, eta), cp.empty((T, sh.D), cp.float32),
                        cp.empty((T, sh.D), cp.float32), cp.empty((T, sh.D), cp.float32))
        self._tail(w, x, hist, sc, T)


# --- QSA --------------------------------------------------------------------------------------------------------

@dataclass
class QsaScratch:
    qi: object      # (indexer heads * indexer dim,)
    kraw: object    # (indexer dim,)
    scores: object  # (n_cols,)
    sel: object     # (n_cols,) uint8
    n_cols: int


class Qsa:
    """Spec 4.6 steps 4-9 after the caller's q/k/v projections and the K/V store (q normed and turned in place):
    the indexer query (normed, turned), the raw key into the layer's indexer keys, the pooled keys of the blocks
    completed, the block scores, the selection, the attention over the selected positions."""
    PROMPT_SCORE_BYTES = 64 * MiB       # the prompt's scores + selections of a sub-chunk of queries at most

    def __init__(self, kern, launcher, shape: Q4Shape):
        self.k, self.mv, self.sh = kern, launcher, shape
        c, p = shape.cfg, shape.cfg.family_params
        self.Hi, self.di, self.n_rot = p.indexer_heads, p.indexer_dim, c.n_rot
        self.budget = p.qsa_budget
        self.scale = c.attn_scale or 1.0 / math.sqrt(c.head_dim)
        from engine.cuda.families.hybrid import gate_kernel
        self.gate_fn = gate_kernel()
        if c.head_dim % 32 or c.head_dim > 256 or self.di > 512:
            raise ValueError(f"QSA heads of {c.head_dim} (a multiple of 32 up to 256) and indexer heads of {self.di} "
                             f"(up to 512): cuda_src/qwen4exp.cu is built for those")

    @classmethod
    def prompt_score_bytes(cls, c, p) -> int:
        return cls.PROMPT_SCORE_BYTES

    def decode_scratch(self, kv) -> QsaScratch:
        import cupy as cp
        n = max([len(a) for a in kv.pooled.values()], default=1)
        return QsaScratch(cp.zeros(self.Hi * self.di, cp.float32), cp.zeros(self.di, cp.float32),
                          cp.zeros(n, cp.float32), cp.zeros(n, cp.uint8), n)

    def _index_query(self, w, qi, rope, state, pos0: int, T: int) -> None:
        self.k("q4_norm_rope")((self.Hi, T), (32,), (ptr(qi), I64(self.Hi * self.di), I32(self.di), ptr(w.idx_q_norm),
                                                      ptr(rope), I32(self.n_rot), F32(self.sh.eps), ptr(state),
                                                      I32(pos0)))

    def _select_attend(self, li, w, q, qi, kv, scores, sel, n_cols, att, state, pos0: int, T: int) -> None:
        c, r = self.sh.cfg, w.ratio
        pooled = kv.pooled[li]
        self.k("q4_qsa_scores")(((n_cols + 3) // 4, T), (128,),
                                (ptr(qi), I64(self.Hi * self.di), I32(self.Hi), I32(self.di), ptr(pooled), ptr(scores),
                                 I64(n_cols), I32(n_cols), I32(r), ptr(state), I32(pos0)))
        self.k("q4_qsa_select")(((n_cols + BLOCK - 1) // BLOCK, T), (BLOCK,),
                                (ptr(scores), I64(n_cols), ptr(sel), I64(n_cols), I32(n_cols), I32(self.budget // r),
                                 I32(r), ptr(state), I32(pos0)))
        kc, vc = kv.layer(li)
        qw = c.n_head * c.head_dim
        self.k("q4_qsa_attend")((c.n_head, T), (32,),
                                (ptr(q), I64(qw), U64(kc), U64(vc), I32(kv.rows[li]), ptr(sel), I64(n_cols), ptr(att),
                                 I64(qw), I32(c.n_head), I32(c.n_head_kv), I32(c.head_dim), F32(self.scale), I32(r),
                                 I32(self.budget // r), ptr(state), I32(pos0)))

    def decode(self, li, L, q, k, v, gate, y, kv, rope, state, att, sc: QsaScratch) -> None:
        """att (n_head head_dim,) = the attention of the step's token at state[1] times sigmoid(gate), from its raw
        projections q, k, v, gate (each head's q and gate apart) and its block input y (the indexer's input); K/V
        stored (q/k normed and turned: qk_rope_store, q written back)."""
        w = L.qsa
        kv.store(self.k, self.sh.cfg, li, q, k, v, L.q_norm, L.k_norm, rope, state)
        self.mv.mv(w.idx_q, y, sc.qi, tag="qsa")
        self._index_query(w, sc.qi, rope, state, 0, 1)
        self.mv.mv(w.idx_k, y, sc.kraw, tag="qsa")
        keys = kv.index_keys[li]
        self.k("q4_qsa_store_keys")((1,), (128,), (ptr(sc.kraw), ptr(keys), I32(self.di), ptr(state), I32(0)))
        self.k("q4_qsa_pool")((1,), (32,), (ptr(keys), ptr(kv.pooled[li]), I32(self.di), I32(w.ratio),
                                            ptr(w.idx_k_norm), ptr(rope), I32(self.n_rot), F32(self.sh.eps),
                                            ptr(state), I32(0)))
        self._select_attend(li, w, q, sc.qi, kv, sc.scores, sc.sel, sc.n_cols, att, state, 0, 1)
        self._gate(att, gate, att.size)

    def _gate(self, att, gate, n: int) -> None:
        from engine.cuda.families.hybrid import gate_mul
        gate_mul(self.gate_fn, att, gate, n)

    def prompt(self, li, L, q, k, v, gate, y, kv, rope, T: int, pos0: int, proj):
        """att (T, n_head head_dim) for the chunk's T queries at pos0.., as decode (q, k, v, gate: (T, width))."""
        import cupy as cp
        c, w = self.sh.cfg, L.qsa
        r = w.ratio
        kv.store(self.k, c, li, q, k, v, L.q_norm, L.k_norm, rope, None, pos0, T)
        qi = proj(w.idx_q, y)
        self._index_query(w, qi, rope, None, pos0, T)
        keys = kv.index_keys[li]
        keys[pos0:pos0 + T] = proj(w.idx_k, y)
        # blocks complete by the chunk's end, from the one the chunk starts in (its earlier keys are cached)
        lo, hi = pos0 // r, (pos0 + T) // r
        if hi > lo:
            self.k("q4_qsa_pool")((hi - lo,), (32,), (ptr(keys), ptr(kv.pooled[li]), I32(self.di), I32(r),
                                                      ptr(w.idx_k_norm), ptr(rope), I32(self.n_rot), F32(self.sh.eps),
                                                      NULL, I32(lo)))
        n_cols = max(hi, 1)
        att = cp.empty((T, c.n_head * c.head_dim), dtype=cp.float32)
        rows = max(1, min(T, self.PROMPT_SCORE_BYTES // (5 * n_cols)))     # scores fp32 + selection uint8 a row
        for t0 in range(0, T, rows):
            n = min(rows, T - t0)
            scores = cp.empty((n, n_cols), dtype=cp.float32)
            sel = cp.empty((n, n_cols), dtype=cp.uint8)
            self._select_attend(li, w, q[t0:t0 + n], qi[t0:t0 + n], kv, scores, sel, n_cols, att[t0:t0 + n], None,
                                pos0 + t0, n)
        self._gate(att, gate, att.size)
        return att


# --- the same parts on q4kern's kernels (engine/cuda/hc.py, engine/cuda/qsa.py) --------------------------------

class HcQ4kern(Hc):
    """Hc on cuda_src/hc.cu (engine/cuda/hc.py): the norm, the up projection and the mix fused (hc_up_mix, decode;
    hc_mix_rows, prompt), the prompt's GEMMs fp16 (prefill.linear_f16). inj holds iota = 2 sigmoid(W_inj u / H)
    itself here (hc.py's write takes it), not its logits: only this class's read fills what its write reads."""

    def __init__(self, kern, launcher, shape: Q4Shape, up_types, prefill=None):
        super().__init__(kern, launcher, shape)
        from engine.cuda.hc import HcKernels, HcShape
        self.hs = HcShape(shape.N, shape.H, shape.R, shape.eps)
        self.hk = HcKernels(self.hs, up_types)
        self.prefill = prefill

    def scratch(self, rows: int):
        if rows != 1:
            raise ValueError("HcQ4kern.scratch serves the decode step (one row)")
        return self.hk.scratch()

    def read(self, x, w: HcWeights, y, inj, sc, rows: int = 1) -> None:
        self.hk.write_norm(x, w.gamma, u=sc.u)
        self.mv.mv(w.down, sc.u, sc.d, tag="hc")
        if w.inject is None:
            self.hk.up_mix(w.up, sc.d, sc.u, y)
            return
        self.mv.mv(w.inject, sc.u, sc.e, tag="hc")
        self.hk.up_mix(w.up, sc.d, sc.u, y, inj=sc.e, iota=inj)

    def read_rows(self, x, w: HcWeights, inj, T: int, proj):
        import cupy as cp
        sh, p = self.sh, self.prefill
        U = cp.empty((T, sh.D), dtype=cp.float32)
        U16 = cp.empty((T, sh.D), dtype=cp.float16)
        self.hk.write_norm(x, w.gamma, u=U, u16=U16, T=T)
        d = p.linear_f16(w.down, U16, cp.empty((T, sh.R), dtype=cp.float32))
        A16 = cp.empty((T, sh.R), dtype=cp.float16)
        self.hk.act_rows(d, T, out16=A16)
        S = p.linear_f16(w.up, A16, cp.empty((T, sh.D), dtype=cp.float32))
        y = cp.empty((T, sh.N), dtype=cp.float32)
        if w.inject is None:
            self.hk.mix_rows(S, U, y, T)
        else:
            e = p.linear_f16(w.inject, U16, cp.empty((T, sh.H), dtype=cp.float32))
            self.hk.mix_rows(S, U, y, T, inj=e, iota=inj)
        return y

    def write(self, x, o, inj, rows: int) -> None:
        self.hk.write_norm(x, o=o, iota=inj, T=rows)


class QsaQ4kern(Qsa):
    """Qsa on cuda_src/qsa.cu (engine/cuda/qsa.py): prep (norms, RoPE, K/V and the raw indexer key stored, the
    decode's pooling), scores, the radix select, the split attention with the gate; over Q4KV's arrays (K/V as
    kv.py's layer addresses)."""

    def __init__(self, kern, launcher, shape: Q4Shape, kv, chunk: int = 0):
        super().__init__(kern, launcher, shape)
        from engine.cuda.qsa import QsaKernels, QsaShape
        c = shape.cfg
        self.kv = kv
        self.qk = {}            # per QSA layer, one QsaKernels per distinct shape
        built = {}
        for li in kv.qsa_layers:
            qs = QsaShape.from_config(c, li)
            if qs not in built:
                built[qs] = QsaKernels(qs)
            self.qk[li] = built[qs]
        self.hd = c.head_dim
        self.dsc = self.psc = None
        if chunk:
            qk = next(iter(built.values()))
            n_blocks = qk.shape.n_blocks(kv.max_ctx)
            q_rows = max(1, min(chunk, self.PROMPT_SCORE_BYTES // (4 * max(n_blocks, 1))))
            self.psc = qk.prompt_scratch(chunk, kv.max_ctx, q_rows=q_rows)
        else:
            self.dsc = next(iter(built.values())).decode_scratch(kv.max_ctx)

    def cache(self, li):
        from engine.cuda.qsa import QsaCache
        kc, vc = self.kv.layer(li)
        return QsaCache(self.kv.rows[li], int(kc), int(vc), self.kv.index_keys[li], self.kv.pooled[li])

    def norms(self, L):
        from engine.cuda.qsa import QsaNorms
        return QsaNorms(L.q_norm, L.k_norm, L.qsa.idx_q_norm, L.qsa.idx_k_norm)

    def decode(self, li, L, q, k, v, gate, y, kv, rope, state, att, sc: QsaScratch) -> None:
        self.mv.mv(L.qsa.idx_q, y, sc.qi, tag="qsa")
        self.mv.mv(L.qsa.idx_k, y, sc.kraw, tag="qsa")
        self.qk[li].decode(state, q, k, v, sc.qi, sc.kraw, self.norms(L), rope, self.cache(li), self.dsc, att,
                           gate=gate, gate_hs=self.hd, q_hs=self.hd)

    def prompt(self, li, L, q, k, v, gate, y, kv, rope, T: int, pos0: int, proj):
        import cupy as cp
        c = self.sh.cfg
        qi, ki = proj(L.qsa.idx_q, y), proj(L.qsa.idx_k, y)
        att = cp.empty((T, c.n_head * c.head_dim), dtype=cp.float32)
        self.qk[li].prompt(pos0, T, q, k, v, qi, ki, self.norms(L), rope, self.cache(li), self.psc, att,
                           gate=gate, gate_hs=self.hd, q_hs=self.hd)
        return att


KINDS = ("q4kern", "own")


def make_parts(kind: str, kern, launcher, shape: Q4Shape, kv, hc_up_types, prefill=None):
    """(Hc, Qsa) of this kind: "q4kern" (cuda_src/hc.cu, qsa.cu) or "own" (cuda_src/qwen4exp.cu's first versions);
    prefill: the prompt pass the parts serve (None: the decode step)."""
    if kind not in KINDS:
        raise ValueError(f"qwen4exp kernels {kind!r}: one of {', '.join(KINDS)}")
    if kind == "own":
        return Hc(kern, launcher, shape), Qsa(kern, launcher, shape)
    chunk = prefill.chunk if prefill is not None else 0
    return (HcQ4kern(kern, launcher, shape, hc_up_types, prefill),
            QsaQ4kern(kern, launcher, shape, kv, chunk))


# --- NumPy references of the kernels (their layouts; float64 in gives float64 out) ------------------------------

def ref_group_rmsnorm(x, gamma, H: int, eps: float):
    return ref.group_rms_norm(np.atleast_2d(x), gamma, H, eps)


def ref_hc_mix(u, s, H: int):
    """q4_hc_mix: (1/H) sum_c sigmoid(s_c) u_c."""
    u, s = np.atleast_2d(u), np.atleast_2d(s)
    return np.mean((sigmoid(s) * u).reshape(len(u), H, -1), axis=1)


def ref_hc_write(x, o, inj, H: int):
    """q4_hc_write: x_c += 2 sigmoid(inj_c / H) o."""
    return ref.hc_write(np.atleast_2d(x), np.atleast_2d(o), 2.0 * sigmoid(np.atleast_2d(inj) / H))


def ref_gdn(qkv, conv_state, conv_w, b, a, dt_bias, ssm_a, S, z, norm_w, n_k: int, D: int, eps: float):
    """q4_gdn_conv + q4_gdn_qk_norm + q4_gdn_delta over T tokens: (out (T, n_v D), new conv_state, new S), as
    engine/arch/qwen3next.py gated_delta_net token by token with the sigmoid gate and tiled value heads."""
    qkv, b, a, z = (np.atleast_2d(v) for v in (qkv, b, a, z))
    T, n_v = len(qkv), b.shape[1]
    x, conv_state = causal_conv(qkv, conv_state, conv_w)
    x = silu(x)
    q = l2_norm(x[:, :n_k * D].reshape(T, n_k, D), eps) * (1.0 / math.sqrt(D))
    k = l2_norm(x[:, n_k * D:2 * n_k * D].reshape(T, n_k, D), eps)
    v = x[:, 2 * n_k * D:].reshape(T, n_v, D)
    r = n_v // n_k
    q, k = np.tile(q, (1, r, 1)), np.tile(k, (1, r, 1))
    beta = sigmoid(b)
    g = softplus(a + dt_bias) * ssm_a
    S = np.array(S, copy=True)
    o = np.empty_like(v)
    for t in range(T):
        S *= np.exp(g[t])[:, None, None]
        err = v[t] - np.einsum("hij,hj->hi", S, k[t])
        S += (beta[t][:, None] * err)[:, :, None] * k[t][:, None, :]
        o[t] = np.einsum("hij,hj->hi", S, q[t])
    out = rms_norm(o, norm_w, eps) * sigmoid(z.reshape(T, n_v, D))
    return out.reshape(T, n_v * D), conv_state, S


def ref_ple(x, kp, v, norm_key, norm_query, norm_conv, conv_w, hist, H: int, dil: int, eps: float):
    """q4_group_rmsnorm x3 + q4_ple_gate + q4_ple_conv from the key / value projections kp (T, D), v (T, N): (x
    with G + SiLU(conv) added, new history), as engine/arch/qwen4exp.py ple_mix after its projections."""
    x, kp, v = (np.atleast_2d(a) for a in (x, kp, v))
    T, D = x.shape
    N = D // H
    k = ref.group_rms_norm(kp, norm_key, H, eps).reshape(T, H, N)
    q = ref.group_rms_norm(x, norm_query, H, eps).reshape(T, H, N)
    lam = np.sum(k * q, axis=-1) / np.sqrt(N)
    lam = np.sign(lam) * np.sqrt(np.maximum(np.abs(lam), 1e-6))
    g = (sigmoid(lam)[:, :, None] * v[:, None, :]).reshape(T, D)
    c, hist = ref.dilated_conv(ref.group_rms_norm(g, norm_conv, H, eps), hist, conv_w, dil)
    return x + g + silu(c), hist


def ref_qsa_select(scores, pos, r: int, budget_blocks: int, n_cols: int):
    """q4_qsa_scores' mask and q4_qsa_select: (T, n_cols) uint8, 1 where query t keeps block b."""
    T = len(pos)
    sel = np.zeros((T, n_cols), np.uint8)
    for t, p in enumerate(pos):
        nb = (p + 1) // r
        if nb <= budget_blocks:
            sel[t, :nb] = 1
        else:
            order = np.argsort(-scores[t, :nb], kind="stable")[:budget_blocks]
            sel[t, order] = 1
    return sel


def ref_qsa_attend(q, K, V, sel, pos, r: int, budget_blocks: int, scale: float):
    """q4_qsa_attend: q (T, Hq, d), K, V (Hkv, S, d) -> (T, Hq d) over each query's kept positions."""
    T, S = len(pos), K.shape[1]
    mask = np.zeros((T, S), dtype=bool)
    for t, p in enumerate(pos):
        nb = (p + 1) // r
        keys = np.arange(p + 1)
        mask[t, :p + 1] = (nb <= budget_blocks) | (keys >= r * nb) | (sel[t, np.minimum(keys // r, sel.shape[1] - 1)]
                                                                      .astype(bool))
    return ref.masked_attention(q, K, V, mask, scale)
