"""qwen4exp's parts on the GPU, each one call of the family's layer programs (engine/cuda/families/qwen4exp.py): the
HC read / write (Hc: cuda_src/hc.cu, engine/cuda/hc.py), QSA (Qsa: cuda_src/qsa.cu, engine/cuda/qsa.py), the Gated
DeltaNet with the sigmoid gate (Gdn: cuda_src/gdn.cu, engine/cuda/families/gdn.py) and the PLE add-back (Ple) on
cuda_src/qwen4exp.cu, with the engine's mat-vecs (decode) or the prompt pass's projections (`proj(W, X)`: X @ W^T
for T rows). Beside them, the parts' NumPy references (ref_*), in the kernels' layouts, for the tests.

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
from engine.cuda.launch import F32, I32, I64, ptr

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


class Hc:
    """Spec 4.2 / 4.3 / 4.9 on cuda_src/hc.cu (engine/cuda/hc.py): the norm, the up projection and the mix fused
    (hc_up_mix, decode; hc_mix_rows, prompt), the prompt's GEMMs fp16 (prefill.linear_f16), and the embedding's
    broadcast to the streams (qwen4exp.cu). A read's iota (H a row) is 2 sigmoid(W_inj u / H), which the write takes.
    up_types: the quant types of every W_up (hc_up_mix is built per type); prefill: the prompt pass it serves (None:
    the decode step)."""

    def __init__(self, kern, launcher, shape: Q4Shape, up_types, prefill=None):
        from engine.cuda.hc import HcKernels, HcShape
        self.k, self.mv, self.sh = kern, launcher, shape
        self.hk = HcKernels(HcShape(shape.N, shape.H, shape.R, shape.eps), up_types)
        self.prefill = prefill

    def scratch(self):
        """The decode read's work vectors (engine/cuda/hc.py HcScratch: u, d, e)."""
        return self.hk.scratch()

    def broadcast(self, e, x, rows: int) -> None:
        """x (rows, H N) = H copies of e (rows, N)."""
        sh = self.sh
        self.k("q4_broadcast")(_grid(rows * sh.D), (BLOCK,), (ptr(e), ptr(x), I32(sh.N), I32(sh.H), I64(rows)))

    def read(self, x, w: HcWeights, y, iota, sc) -> None:
        """Decode: y (N,) the block input of x (H N,), iota (H,) (None for the final read, whose w.inject is None),
        through the engine's mat-vecs of W_down and W_inj."""
        self.hk.write_norm(x, w.gamma, u=sc.u)
        self.mv.mv(w.down, sc.u, sc.d, tag="hc")
        if w.inject is None:
            self.hk.up_mix(w.up, sc.d, sc.u, y)
            return
        self.mv.mv(w.inject, sc.u, sc.e, tag="hc")
        self.hk.up_mix(w.up, sc.d, sc.u, y, inj=sc.e, iota=iota)

    def read_rows(self, x, w: HcWeights, iota, T: int):
        """Prompt: the block inputs y (T, N) of x (T, H N); iota (T, H) filled unless None (the final read)."""
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
            self.hk.mix_rows(S, U, y, T, inj=e, iota=iota)
        return y

    def write(self, x, o, iota, rows: int) -> None:
        """x_c += iota_c o for each stream c (rows of x (rows, H N), o (rows, N), iota (rows, H))."""
        self.hk.write_norm(x, o=o, iota=iota, T=rows)


# --- GDN --------------------------------------------------------------------------------------------------------

@dataclass
class GdnScratch:
    qkv: object
    act: object
    z: object
    beta: object
    alpha: object
    out: object


def gdn_cu_shape(cfg, eps: float):
    """The GdnShape gdn.cu runs this model's GDN layers at (tiled value heads, the sigmoid gate), or None where it
    is not built for their width (Gdn then takes qwen4exp.cu's generic kernels)."""
    from engine.cuda.families.gdn import GdnShape
    try:
        return GdnShape(cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_conv, False, eps, True)
    except ValueError:
        return None


class Gdn:
    """Spec 4.5 with the sigmoid gate. Where cuda_src/gdn.cu is built for the head width (its GDN_GATE_SIGMOID build:
    128, the published models'), the hybrids' kernels through engine/cuda/families/gdn.py: decode, the four
    projections in one shared-input launch with the conv in its epilogue (Launcher.mv_many), then the delta rule
    with the q/k l2 norms and the gated norm (gdn_delta_decode); prompt, the conv and the chunked delta rule on tensor
    cores (GdnKernels.prefill); value head h reads key head h % n_k (not grouped: the GGUF's tiled order). Other
    widths (the tiny test models' 16) take cuda_src/qwen4exp.cu's q4_gdn_conv, q4_gdn_qk_norm and q4_gdn_delta, a
    thread a state row over the tokens in order: at the real shape on the H200 that took 1.8 ms of a decode step and
    most of a 4K prompt's 9 s (docs/experiments.md). ssm_out is the caller's."""

    def __init__(self, kern, launcher, shape: Q4Shape, prompt_chunk: int = 0):
        """prompt_chunk: the prompt pass's longest chunk (0: the decode step's), which gdn.cu's prompt scratch is
        sized for (allocated here, on the current stream)."""
        from engine.cuda.families.gdn import GdnKernels
        self.k, self.mv, self.sh = kern, launcher, shape
        c = shape.cfg
        self.n_k, self.n_v, self.S, self.K = c.ssm_k_heads, c.ssm_v_heads, c.ssm_state, c.ssm_conv
        self.C, self.inner = 2 * self.n_k * self.S + c.ssm_inner, c.ssm_inner
        self.threads = max(32, -(-self.S // 32) * 32)
        gshape = gdn_cu_shape(c, shape.eps)
        self.gk = None if gshape is None else GdnKernels(gshape)
        if self.gk is None and self.threads > 1024:
            raise ValueError(f"GDN heads of {self.S}: q4_gdn_delta takes a head a block, at most 1024 wide")
        # gdn.cu's prompt: a GdnScratch for the longest chunk (one serves every GDN layer; prompt_buffers counts it)
        self.prompt_scratch = self.gk.scratch(prompt_chunk) if self.gk is not None and prompt_chunk else None

    @staticmethod
    def projections(g) -> tuple:
        """A GDN layer's decode projections in mv_many's order (qkv first: the conv is its epilogue)."""
        return g.qkv, g.z, g.beta, g.alpha

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

    def decode(self, g, y, conv_state, S, sc: GdnScratch, keeps=lambda kind: True) -> None:
        """sc.out (n_v D,) = the mixer before ssm_out of the block input y (N,). keeps: the decode step's filter of
        launch kinds (its per-kind profile), which gdn.py's kernels ask as the hybrids' do."""
        if self.gk is None:
            for W, out in zip(self.projections(g), (sc.qkv, sc.z, sc.beta, sc.alpha)):
                self.mv.mv(W, y, out, tag="gdn_in")
            self._core(sc.qkv, sc.act, sc.z, sc.beta, sc.alpha, g, conv_state, S, sc.out, 1)
            return
        self.mv.mv_many(self.projections(g), y, (sc.qkv, sc.z, sc.beta, sc.alpha),
                        conv=(conv_state, g.conv, g.conv.shape[1]), tag="gdn_in", mixed=True)
        if keeps("gdn"):
            self.gk.delta_decode(sc.qkv, sc.beta, sc.alpha, g.dt_bias, g.a, S, sc.z, g.norm, sc.out, qk_norm=True)

    def prompt(self, g, y, conv_state, S, T: int, proj):
        """(T, n_v D) the mixer before ssm_out of the chunk's block inputs y (T, N)."""
        import cupy as cp
        qkv, z, beta, alpha = (proj(W, y) for W in self.projections(g))
        out = cp.empty((T, self.inner), dtype=cp.float32)
        if self.gk is None:
            self._core(qkv, cp.empty_like(qkv), z, beta, alpha, g, conv_state, S, out, T)
            return out
        if self.prompt_scratch is None or self.prompt_scratch.max_tokens < T:
            raise ValueError(f"a GDN prompt chunk of {T} tokens without a gdn.cu scratch for it (Gdn's prompt_chunk)")
        self.gk.prefill(qkv, z, beta, alpha, g.dt_bias, g.a, g.conv, g.norm, conv_state, S, out,
                        self.prompt_scratch, T)
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
    """The decode step's indexer projections (qi: heads * dim, kraw: dim) and qsa.py's decode scratch."""
    qi: object
    kraw: object
    dsc: object


class Qsa:
    """Spec 4.6 after the caller's q / k / v / gate projections, on cuda_src/qsa.cu (engine/cuda/qsa.py): prep
    (norms, RoPE, K/V and the raw indexer key stored, the decode's pooling), scores, the radix select, the split
    attention with the output gate; over Q4KV's arrays (K/V as kv.py's layer addresses). One QsaKernels per distinct
    layer shape; chunk: the prompt pass's (its scratch), 0 for the decode step."""
    PROMPT_SCORE_BYTES = 64 * MiB       # the prompt's block scores of a sub-batch of queries at most

    def __init__(self, launcher, shape: Q4Shape, kv, chunk: int = 0):
        from engine.cuda.qsa import QsaKernels, QsaShape
        c = shape.cfg
        self.mv, self.sh, self.kv = launcher, shape, kv
        self.Hi, self.di, self.hd = c.family_params.indexer_heads, c.family_params.indexer_dim, c.head_dim
        built, self.qk = {}, {}
        for li in kv.qsa_layers:
            qs = QsaShape.from_config(c, li)
            if qs not in built:
                built[qs] = QsaKernels(qs)
            self.qk[li] = built[qs]
        first = next(iter(built.values()))
        self.psc = None
        if chunk:
            n_blocks = first.shape.n_blocks(kv.max_ctx)
            q_rows = max(1, min(chunk, self.PROMPT_SCORE_BYTES // (4 * max(n_blocks, 1))))
            self.psc = first.prompt_scratch(chunk, kv.max_ctx, q_rows=q_rows)
        self._first = first

    def decode_scratch(self) -> QsaScratch:
        import cupy as cp
        return QsaScratch(cp.zeros(self.Hi * self.di, cp.float32), cp.zeros(self.di, cp.float32),
                          self._first.decode_scratch(self.kv.max_ctx))

    def cache(self, li):
        from engine.cuda.qsa import QsaCache
        kc, vc = self.kv.layer(li)
        return QsaCache(self.kv.rows[li], int(kc), int(vc), self.kv.index_keys[li], self.kv.pooled[li])

    @staticmethod
    def norms(L):
        from engine.cuda.qsa import QsaNorms
        return QsaNorms(L.q_norm, L.k_norm, L.qsa.idx_q_norm, L.qsa.idx_k_norm)

    def decode(self, li, L, q, k, v, gate, y, rope, state, att, sc: QsaScratch) -> None:
        """att (n_head head_dim,) = the attention of the step's token at state[1] times sigmoid(gate), from its raw
        projections q, k, v, gate (each head's query and gate apart) and its block input y (the indexer's input); its
        K/V and indexer key stored."""
        self.mv.mv_many((L.qsa.idx_q, L.qsa.idx_k), y, (sc.qi, sc.kraw), tag="qsa")
        self.qk[li].decode(state, q, k, v, sc.qi, sc.kraw, self.norms(L), rope, self.cache(li), sc.dsc, att,
                           gate=gate, gate_hs=self.hd, q_hs=self.hd)

    def prompt(self, li, L, q, k, v, gate, y, rope, T: int, pos0: int, proj):
        """att (T, n_head head_dim) for the chunk's T queries at pos0.. (q, k, v, gate: (T, width))."""
        import cupy as cp
        c = self.sh.cfg
        qi, ki = proj(L.qsa.idx_q, y), proj(L.qsa.idx_k, y)
        att = cp.empty((T, c.n_head * c.head_dim), dtype=cp.float32)
        self.qk[li].prompt(pos0, T, q, k, v, qi, ki, self.norms(L), rope, self.cache(li), self.psc, att,
                           gate=gate, gate_hs=self.hd, q_hs=self.hd)
        return att


# --- NumPy references of the kernels (their layouts; float64 in gives float64 out) ------------------------------

def ref_group_rmsnorm(x, gamma, H: int, eps: float):
    return ref.group_rms_norm(np.atleast_2d(x), gamma, H, eps)


def ref_gdn(qkv, conv_state, conv_w, b, a, dt_bias, ssm_a, S, z, norm_w, n_k: int, D: int, eps: float):
    """Gdn's mixer before ssm_out over T tokens (q4_gdn_conv + q4_gdn_qk_norm + q4_gdn_delta, or gdn.cu's): (out
    (T, n_v D), new conv_state, new S), as engine/arch/qwen3next.py gated_delta_net token by token with the sigmoid
    gate and tiled value heads."""
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
