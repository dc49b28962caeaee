"""Gated DeltaNet on the GPU for one layer (cuda_src/gdn.cu): the decode step's conv + delta-rule update and the prompt's
conv + chunked delta rule, each beside its NumPy reference (engine/arch/qwen3next.py).

Buffers (fp32 unless said; C = 2 n_k D + n_v D conv channels, rows contiguous, every array C-contiguous unless said):
    qkv        (T, C)  the attn_qkv projection: [q of key heads 0..n_k-1 | k of them | v of value heads 0..n_v-1],
               each head D wide. Rows may be longer (a view of a wider (T, W) buffer, e.g. qkv and z from one GEMM):
               the row stride is read from the array. (Legacy qwen3next files fuse ssm_in per key head as
               [q, k, v of r heads, z of r heads]: permute ssm_in's rows once at load into [qkv; z] order.)
    conv_state (d_conv - 1, C)  the last inputs before this token, oldest first (HybridCache.conv[il]); in place.
    conv_w     (C, d_conv)  ssm_conv1d.weight.
    S          (n_v, D, D)  S[h, i, j]: value i, key j, o_h = S_h q (HybridCache.delta[il]); in place.
    b, a       the beta and alpha projections of the token(s): qwen35moe: b (T, n_v) = x @ ssm_beta^T and a (T, n_v) =
               x @ ssm_alpha^T (views of one (T, 2 n_v) buffer are fine: same row stride); qwen3next: b = x @ ssm_ba^T
               (T, 2 n_v), grouped per key head [b x r, a x r], and a = None.
    dt_bias, ssm_a  (n_v,)  ssm_dt.bias and ssm_a (= -exp(A_log)); g = softplus(alpha + dt_bias) * ssm_a.
    z          (T, n_v D)  attn_gate's projection (row stride from the array, as qkv).
    norm_w     (D,)  ssm_norm.weight.
    out        (T, n_v D)  rms_norm(o) * norm_w * gate(z) per head: the input of ssm_out; gate is silu, or sigmoid
               with GdnShape.sigmoid_gate (qwen4exp, spec 4.5 step 6: gdn.cu's GDN_GATE_SIGMOID build).
Value head h reads key head h // r (qwen3next) or h % n_k (qwen35moe), r = n_v / n_k. Launches go on the current
CuPy stream (`with stream:`); the decode ones allocate nothing and read every per-step value from device memory, so
they can be captured in the decode step's graph. The prompt needs a GdnScratch sized for its longest chunk
(scratch_bytes says how much VRAM to reserve; state_bytes one layer's recurrent state).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.arch.base import rms_norm, silu
from engine.arch.qwen3next import CHUNK, causal_conv, delta_rule, delta_rule_chunk, l2_norm, sigmoid, softplus

CONV_TT = 32          # gdn_conv_prefill's tokens per block (GDN_CONV_TT)


@dataclass(frozen=True)
class GdnShape:
    """One GDN layer's sizes. grouped: value head h reads key head h // r (qwen3next), else h % n_k (qwen35moe)."""
    n_k_heads: int
    n_v_heads: int
    head_dim: int             # key and value head width (ssm.state_size): 64 or 128
    conv_kernel: int          # ssm.conv_kernel
    grouped: bool
    eps: float                # rms_eps: the l2 norms' and the gated norm's epsilon
    sigmoid_gate: bool = False  # the output gate sigmoid(z) (qwen4exp), else silu(z)

    def __post_init__(self):
        if self.head_dim not in (64, 128):
            raise ValueError(f"GDN head width {self.head_dim}: the CUDA kernels are built for 64 and 128")
        if self.n_v_heads % self.n_k_heads:
            raise ValueError(f"{self.n_v_heads} value heads do not group over {self.n_k_heads} key heads")
        if not 2 <= self.conv_kernel <= 8:
            raise ValueError(f"conv kernel width {self.conv_kernel}: the CUDA kernels take 2 to 8")
        if self.sigmoid_gate and self.head_dim != 128:
            raise ValueError(f"GDN head width {self.head_dim} with the sigmoid gate: gdn.cu builds it for 128 "
                             f"(add a '@build GDN_D={self.head_dim} GDN_GATE_SIGMOID=1' line)")

    @classmethod
    def from_config(cls, cfg) -> "GdnShape":
        return cls(cfg.ssm_k_heads, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_conv, cfg.arch == "qwen3next",
                   cfg.rms_eps, cfg.arch == "qwen4exp")

    @property
    def channels(self) -> int:
        return (2 * self.n_k_heads + self.n_v_heads) * self.head_dim

    @property
    def r(self) -> int:
        return self.n_v_heads // self.n_k_heads

    @property
    def q_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


def n_chunks(T: int) -> int:
    return (T + CHUNK - 1) // CHUNK


def scratch_layout(shape: GdnShape, max_tokens: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """GdnScratch's arrays for prompt chunks of up to max_tokens: name -> (shape, dtype name)."""
    nc, Hv = n_chunks(max_tokens), shape.n_v_heads
    return {"act16": ((max_tokens, shape.channels), "float16"), "gcum": ((Hv, nc * CHUNK), "float32"),
            "tcat": ((Hv, nc, CHUNK, 2 * CHUNK), "float16"), "qkm": ((Hv, nc, CHUNK, CHUNK), "float16")}


def scratch_bytes(shape: GdnShape, max_tokens: int) -> int:
    """VRAM a GdnScratch takes (one serves every GDN layer): 113 MiB at 4096 tokens of the published shapes."""
    return sum(int(np.prod(s)) * np.dtype(t).itemsize for s, t in scratch_layout(shape, max_tokens).values())


def state_bytes(shape: GdnShape) -> int:
    """One GDN layer's recurrent state in VRAM: the conv inputs and S, fp32 (as HybridCache.state_bytes counts)."""
    return 4 * ((shape.conv_kernel - 1) * shape.channels + shape.n_v_heads * shape.head_dim ** 2)


# --- NumPy references, in the kernels' layouts (float64 in, float64 out when given float64) ------------------------

def ref_beta_g(shape: GdnShape, b, a, dt_bias, ssm_a):
    """(beta, g), each (T, n_v), from the projections in the layout above (as Qwen3Next.beta_alpha then gdn)."""
    b = np.atleast_2d(b)
    if a is None:   # qwen3next: [b x r, a x r] per key head
        ba = b.reshape(len(b), shape.n_k_heads, 2 * shape.r)
        pre_b, pre_a = ba[:, :, :shape.r].reshape(len(b), -1), ba[:, :, shape.r:].reshape(len(b), -1)
    else:
        pre_b, pre_a = b, np.atleast_2d(a)
    return sigmoid(pre_b), softplus(pre_a + dt_bias) * ssm_a


def ref_conv_act(shape: GdnShape, qkv, conv_state, conv_w):
    """(act (T, C): the conv outputs after silu, q and k l2-normed per head and q scaled, as the kernels write them;
    the new conv state)."""
    T, Hk, D = len(qkv), shape.n_k_heads, shape.head_dim
    x, state = causal_conv(np.asarray(qkv)[:, :shape.channels], conv_state, conv_w)
    x = silu(x)
    q = l2_norm(x[:, :Hk * D].reshape(T, Hk, D), shape.eps) * (1.0 / math.sqrt(D))
    k = l2_norm(x[:, Hk * D:2 * Hk * D].reshape(T, Hk, D), shape.eps)
    return np.concatenate([q.reshape(T, -1), k.reshape(T, -1), x[:, 2 * Hk * D:]], axis=1), state


def ref_conv(shape: GdnShape, qkv, conv_state, conv_w):
    """(q, k, v, each (T, n_v, D), q and k repeated to the value heads as Qwen3Next.gdn does; the new conv state)."""
    T, Hk, Hv, D = len(qkv), shape.n_k_heads, shape.n_v_heads, shape.head_dim
    act, state = ref_conv_act(shape, qkv, conv_state, conv_w)
    q, k = act[:, :Hk * D].reshape(T, Hk, D), act[:, Hk * D:2 * Hk * D].reshape(T, Hk, D)
    v = act[:, 2 * Hk * D:].reshape(T, Hv, D)
    if shape.grouped:     # value head h reads key head h // r
        q, k = np.repeat(q, shape.r, axis=1), np.repeat(k, shape.r, axis=1)
    else:                 # h % n_k
        q, k = np.tile(q, (1, shape.r, 1)), np.tile(k, (1, shape.r, 1))
    return q, k, v, state


def ref_layer(shape: GdnShape, qkv, z, b, a, dt_bias, ssm_a, conv_w, norm_w, conv_state, S, chunked=False):
    """The GDN mixer before ssm_out, as Qwen3Next.gdn: (out (T, n_v D), new conv_state, new S). chunked: the prompt's
    chunk form (delta_rule_chunk over CHUNK tokens at a time), else token by token (delta_rule)."""
    T, Hv, D = len(qkv), shape.n_v_heads, shape.head_dim
    beta, g = ref_beta_g(shape, b, a, dt_bias, ssm_a)
    q, k, v, conv_state = ref_conv(shape, qkv, conv_state, conv_w)
    if chunked:
        outs = []
        for s in range(0, T, CHUNK):
            part, S = delta_rule_chunk(q[s:s + CHUNK], k[s:s + CHUNK], v[s:s + CHUNK], g[s:s + CHUNK],
                                       beta[s:s + CHUNK], S)
            outs.append(part)
        o = np.concatenate(outs)
    else:
        o, S = delta_rule(q, k, v, g, beta, S)
    out = rms_norm(o, norm_w, shape.eps) * gate_fn(shape)(np.asarray(z).reshape(T, Hv, D))
    return out.reshape(T, Hv * D), conv_state, S


def gate_fn(shape: GdnShape):
    """The output gate's activation: sigmoid (qwen4exp) or silu."""
    return sigmoid if shape.sigmoid_gate else silu


# --- the kernels ---------------------------------------------------------------------------------------------------

@dataclass
class GdnScratch:
    """The prompt pass's work buffers for chunks of up to max_tokens tokens (one set serves every GDN layer):
    act16 (max_tokens, C) fp16 conv outputs; per value head and chunk of 64: gcum (fp32 cumulative log decay),
    tcat (64 x 128 fp16, the UT-transform matrices) and qkm (64 x 64 fp16, the decay-masked Q K^T)."""
    max_tokens: int
    act16: object
    gcum: object
    tcat: object
    qkm: object

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.act16, self.gcum, self.tcat, self.qkm))


def _rows(x, width: int, name: str) -> int:
    """Row stride (elements) of a (T, >= width) fp32 array or a flat one-row vector, after checking it."""
    import cupy as cp
    if x.dtype != cp.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}")
    if x.ndim == 1:
        return x.size
    if x.strides[1] != 4 or x.shape[1] < width:
        raise ValueError(f"{name}: rows of {width} contiguous floats needed, got shape {x.shape} strides {x.strides}")
    return x.strides[0] // 4


class GdnKernels:
    """The compiled kernels for one GdnShape (a module per head width; load before READY, nothing compiles later)."""

    def __init__(self, shape: GdnShape, defines: dict | None = None):
        """defines: extra gdn.cu build defines for an A/B (bench.gdn --define GDN_BV=128)."""
        import cupy as cp

        from engine.cuda import kernels

        self.shape = shape
        gate = {"GDN_GATE_SIGMOID": 1} if shape.sigmoid_gate else {}
        mod = kernels.load("gdn", {**(defines or {}), "GDN_D": shape.head_dim, **gate})
        self.f = {n: mod.get_function(n) for n in ("gdn_conv_decode", "gdn_delta_decode", "gdn_conv_prefill",
                                                   "gdn_chunk_prep", "gdn_chunk_scan", "gdn_gated_norm")}
        out = cp.zeros(8, cp.int32)
        mod.get_function("gdn_shape")((1,), (1,), (out,))
        (self.prep_threads, self.prep_smem, self.scan_threads, self.scan_smem, self.bv,
         self.dec_threads) = (int(v) for v in out.get()[:6])
        for name, nb in (("gdn_chunk_prep", self.prep_smem), ("gdn_chunk_scan", self.scan_smem)):
            self.f[name].max_dynamic_shared_size_bytes = nb

    def _ba(self, b, a):
        """(b pointer, a pointer, row stride, group stride) for gdn_beta_g."""
        from engine.cuda.launch import I32, I64, U64, ptr
        sh = self.shape
        if a is None:
            if not sh.grouped:
                raise ValueError("qwen35moe takes b (ssm_beta) and a (ssm_alpha) apart; a is None only for qwen3next")
            ld = _rows(b, 2 * sh.n_v_heads, "b (ssm_ba)")
            return ptr(b), U64(int(ptr(b)) + 4 * sh.r), I64(ld), I32(2 * sh.r)
        ld = _rows(b, sh.n_v_heads, "b")
        if _rows(a, sh.n_v_heads, "a") != ld:
            raise ValueError("b and a need the same row stride")
        return ptr(b), ptr(a), I64(ld), I32(sh.r)

    # --- decode: one token ---
    def conv_decode(self, qkv, conv_state, conv_w, act) -> None:
        """act (C,) = the conv of qkv (C,) over conv_state, silu, q/k l2-normed (q scaled); conv_state shifts in place.
        act may be qkv."""
        from engine.cuda.launch import F32, I32, ptr
        sh = self.shape
        self.f["gdn_conv_decode"]((2 * sh.n_k_heads + sh.n_v_heads,), (sh.head_dim,),
                                  (ptr(qkv), ptr(conv_state), ptr(conv_w), ptr(act), I32(sh.channels),
                                   I32(sh.n_k_heads), I32(sh.conv_kernel), F32(sh.eps), F32(sh.q_scale)))

    def delta_decode(self, act, b, a, dt_bias, ssm_a, S, z, norm_w, out, qk_norm: bool = False) -> None:
        """One delta-rule step of every value head on S in place, then out (n_v D,) = gated rms_norm of o with z.
        act: conv_decode's output, or with qk_norm the conv and silu alone (dense.cu mv4's conv epilogue): the
        kernel then l2-norms q and k (and scales q) itself."""
        from engine.cuda.launch import F32, I32, ptr
        sh = self.shape
        pb, pa, _, grp = self._ba(b, a)
        self.f["gdn_delta_decode"]((sh.n_v_heads,), (self.dec_threads,),
                                   (ptr(act), pb, pa, grp, ptr(dt_bias), ptr(ssm_a), ptr(S), ptr(z), ptr(norm_w),
                                    ptr(out), I32(sh.n_k_heads), I32(sh.n_v_heads), I32(int(sh.grouped)),
                                    F32(sh.eps), I32(int(qk_norm)), F32(sh.q_scale)))

    def decode(self, qkv, z, b, a, dt_bias, ssm_a, conv_w, norm_w, conv_state, S, out, act) -> None:
        """The GDN mixer before ssm_out in two launches, conv_decode then delta_decode (act: (C,) fp32 scratch, or
        qkv itself). The engine's decode step has the conv in its projection launch instead (hybrid.py);
        this stays as the tests' reference for it."""
        self.conv_decode(qkv, conv_state, conv_w, act)
        self.delta_decode(act, b, a, dt_bias, ssm_a, S, z, norm_w, out)

    # --- prompt: T tokens ---
    def scratch(self, max_tokens: int) -> GdnScratch:
        import cupy as cp
        return GdnScratch(max_tokens, **{k: cp.empty(s, t) for k, (s, t) in
                                         scratch_layout(self.shape, max_tokens).items()})

    def _check_T(self, T: int, scratch: GdnScratch) -> None:
        if not 1 <= T <= scratch.max_tokens:
            raise ValueError(f"{T} tokens for a GDN scratch of {scratch.max_tokens}; make it with scratch(max_tokens)")

    def conv_prefill(self, qkv, T: int, conv_state, conv_w, scratch: GdnScratch) -> None:
        """scratch.act16[:T] = conv of qkv's first T rows after conv_state, silu, q/k l2-normed (q scaled), fp16;
        conv_state becomes the last d_conv - 1 inputs (carried to the next chunk or the decode step)."""
        from engine.cuda.launch import F32, I32, I64, ptr
        sh = self.shape
        self._check_T(T, scratch)
        ld = _rows(qkv, sh.channels, "qkv")
        self.f["gdn_conv_prefill"]((2 * sh.n_k_heads + sh.n_v_heads, (T + CONV_TT - 1) // CONV_TT), (sh.head_dim,),
                                   (ptr(qkv), I64(ld), I32(T), ptr(conv_state), ptr(conv_w), ptr(scratch.act16),
                                    I32(sh.channels), I32(sh.n_k_heads), I32(sh.conv_kernel), F32(sh.eps),
                                    F32(sh.q_scale)))

    def delta_prefill(self, T: int, b, a, dt_bias, ssm_a, S, o, scratch: GdnScratch) -> None:
        """The chunked gated delta rule over scratch.act16[:T]: o[:T] (T, n_v D) fp32 (ungated), S carried in place
        (so prompt chunks chain, and decode follows)."""
        from engine.cuda.launch import I32, ptr
        sh = self.shape
        self._check_T(T, scratch)
        if _rows(o, sh.n_v_heads * sh.head_dim, "o") != sh.n_v_heads * sh.head_dim:
            raise ValueError("o must be a contiguous (T, n_v * D) array")
        pb, pa, ld, grp = self._ba(b, a)
        nc = n_chunks(T)
        common = (I32(sh.n_k_heads), I32(sh.n_v_heads), I32(int(sh.grouped)))
        self.f["gdn_chunk_prep"]((nc, sh.n_v_heads), (self.prep_threads,),
                                 (ptr(scratch.act16), I32(T), I32(sh.channels), pb, pa, ld, grp, ptr(dt_bias),
                                  ptr(ssm_a), *common, ptr(scratch.gcum), ptr(scratch.tcat), ptr(scratch.qkm)),
                                 shared_mem=self.prep_smem)
        self.f["gdn_chunk_scan"]((sh.head_dim // self.bv, sh.n_v_heads), (self.scan_threads,),
                                 (ptr(scratch.act16), I32(T), I32(sh.channels), ptr(scratch.gcum), ptr(scratch.tcat),
                                  ptr(scratch.qkm), ptr(S), ptr(o), *common),
                                 shared_mem=self.scan_smem)

    def gated_norm(self, o, z, norm_w, out, T: int) -> None:
        """out[:T] = rms_norm(o) * norm_w * gate(z) per (token, value head); out may be o."""
        from engine.cuda.launch import F32, I32, I64, ptr
        sh = self.shape
        ld = _rows(z, sh.n_v_heads * sh.head_dim, "z")
        self.f["gdn_gated_norm"](((T * sh.n_v_heads + 7) // 8,), (256,),
                                 (ptr(o), ptr(z), I64(ld), ptr(norm_w), ptr(out), I32(T), I32(sh.n_v_heads),
                                  F32(sh.eps)))

    def prefill(self, qkv, z, b, a, dt_bias, ssm_a, conv_w, norm_w, conv_state, S, out, scratch: GdnScratch,
                T: int | None = None) -> None:
        """The prompt chunk's GDN mixer before ssm_out for T tokens (default len(qkv)): out (T, n_v D) fp32, conv_state
        and S carried in place."""
        T = len(qkv) if T is None else T
        self.conv_prefill(qkv, T, conv_state, conv_w, scratch)
        self.delta_prefill(T, b, a, dt_bias, ssm_a, S, out, scratch)
        self.gated_norm(out, z, norm_w, out, T)
