"""qwen4exp's hyper-connections on the GPU (cuda_src/hc.cu): the HC read (spec 4.2), write (4.3) and head (4.9) for one
token (decode) and for T tokens (prompt), beside the NumPy reference (engine/arch/qwen4exp.py hc_read, hc_write).

The residual is H streams of N floats a token, fp32 in VRAM, stream-major: x (T, D = H N), stream c of row t at
x[t, c N:(c+1) N] (decode: x (D,)). A read is

    u = GroupNorm_H(x; gamma); d = W_down u (R,); e = W_inj u (H,); a = silu(d / H); s = W_up a (D,)
    y = (1/H) sum_c sigmoid(s_c) * u_c (N,);  iota = 2 sigmoid(e / H) (H,)

and the write after the half-layer's output o (N,) is x_c += iota_c * o. The mat-vecs of W_down and W_inj (one input,
u) are the engine's (dense.cu mv4 through Launcher.mv_many; in the prompt one cuBLAS GEMM of [W_down; W_inj]); the
rest is here:

Decode, per half-layer (3 launches; `read_decode` does them):
    hc.write_norm(x, gamma, u=sc.u, o=o_prev, iota=iota_prev, add=ple)   the previous half-layer's write (and the PLE
                                                                          layer's add) fused with this GroupNorm
    launcher.mv_many([W.down, W.inject], sc.u, [sc.d, sc.e])
    hc.up_mix(W.up, sc.d, sc.u, y, inj=sc.e, iota=iota)                  y (N,), iota (H,)
  The first read of the step has no previous write: write_norm(x, gamma, u=...) alone. The head (4.9) is the same
  with inject None: mv of W.down alone, up_mix(..., inj=None); its y is the hidden state the output head multiplies
  (no further norm). The last layer's FFN write is fused into the head's write_norm.
Prompt, per half-layer, T rows:
    hc.write_norm(X, gamma, u=U, u16=U16, o=O_prev, iota=IOTA_prev)   X (T, D) in place; U (T, D) fp32 (the mix reads
                                                                       it), U16 (T, D) fp16 for the GEMM
    DE = U16 @ [W_down; W_inj]^T  (T, R + H) fp32 (the engine's GEMM)
    hc.act_rows(DE, out16=A16)                                         A16 (T, R) fp16; DE's row stride is read
    S = A16 @ W_up^T  (T, D) fp32
    hc.mix_rows(S, U, Y, inj=DE[:, R:], iota=IOTA)                     Y (T, N), IOTA (T, H)

Arguments are CuPy arrays (fp32 unless said; a (T, W) array's rows may be longer than W where said: the row stride is
read from the array), launches go on the current CuPy stream (`with stream:`). Nothing here allocates or reads a host
value per call (decode needs no position), so every decode launch can be captured in the step's graph. x is updated
in place; u/u16/y/iota/d/e must not alias x or o.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.arch.qwen4exp import hc_read, hc_write

UP_MIX_WARPS = 4          # hc_up_mix: output elements (warps) a block


@dataclass(frozen=True)
class HcShape:
    """N: one stream's width (n_embd); H: streams (hc_count); R: the low rank (hc_rank); eps: rms_eps."""
    N: int
    H: int
    R: int
    eps: float

    def __post_init__(self):
        if self.H < 2:
            raise ValueError(f"{self.H} hyper-connection streams: qwen4exp has more than one")
        if self.N % 8 or self.R % 8 or self.N <= 0 or self.R <= 0:
            raise ValueError(f"stream width {self.N} and low rank {self.R}: the kernels need multiples of 8")

    @classmethod
    def from_config(cls, cfg) -> "HcShape":
        p = cfg.family_params
        return cls(cfg.n_embd, p.hc_count, p.hc_rank, cfg.rms_eps)

    @property
    def D(self) -> int:
        return self.N * self.H


@dataclass
class HcWeights:
    """One HC module's weights on the device: gamma (D,) fp32 (hc_*_norm), down (R x D), up (D x R), inject (H x D,
    None for the head's output_hc): DevMatrix (engine/cuda/weights.py) in their GGUF quant types."""
    gamma: object
    down: object
    up: object
    inject: object = None


@dataclass
class HcScratch:
    """The decode read's work vectors: u (D,), d (R,), e (H,) fp32 (one set serves every layer)."""
    u: object
    d: object
    e: object


def ref_read(shape: HcShape, x, gamma, w_down, w_up, w_inject):
    """engine/arch/qwen4exp.py hc_read on host arrays: (y (T, N), iota (T, H) or None)."""
    return hc_read(np.atleast_2d(x), gamma, w_down, w_up, w_inject, shape.H, shape.eps)


def ref_write(x, o, iota):
    """engine/arch/qwen4exp.py hc_write: x (T, D) + iota_c o per stream."""
    return hc_write(np.atleast_2d(x), np.atleast_2d(o), np.atleast_2d(iota))


def _ld(a, width: int, name: str, dtype="float32") -> int:
    """Row stride (elements) of a (T, >= width) array of `dtype`, or of a flat vector (one row)."""
    if a.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must be {dtype}, got {a.dtype}")
    if a.ndim == 1:
        if a.size < width:
            raise ValueError(f"{name}: {a.size} elements, {width} needed")
        return a.size
    if a.ndim != 2 or a.strides[1] != a.itemsize or a.shape[1] < width:
        raise ValueError(f"{name}: rows of {width} contiguous elements needed, got shape {a.shape} strides {a.strides}")
    return a.strides[0] // a.itemsize


def _rows_of(a) -> int:
    return 1 if a.ndim == 1 else a.shape[0]


def _dense(a, T: int, width: int, name: str, dtype="float32") -> None:
    """a must hold T contiguous rows of exactly width elements."""
    if _ld(a, width, name, dtype) != width or a.size < T * width:
        raise ValueError(f"{name}: {T} contiguous rows of {width} needed, got shape {a.shape} strides {a.strides}")


class HcKernels:
    """hc.cu compiled for one HcShape; hc_up_mix instantiated for the quant types W_up comes in (qtypes: ggml ids or
    names; load before READY: nothing compiles later)."""

    def __init__(self, shape: HcShape, qtypes):
        from engine.cuda import kernels
        from engine.cuda.quant_types import qtype

        self.shape = shape
        self.qtype_ids = sorted({qtype(t).id for t in qtypes})
        mod = kernels.load("hc", qtypes=self.qtype_ids)
        self.f = {n: mod.get_function(n) for n in ("hc_write_norm", "hc_act_rows", "hc_mix_rows")}
        self.up = {q: mod.get_function(f"hc_up_mix<{q}>") for q in self.qtype_ids}

    def scratch(self) -> HcScratch:
        import cupy as cp
        sh = self.shape
        return HcScratch(cp.zeros(sh.D, cp.float32), cp.zeros(sh.R, cp.float32), cp.zeros(sh.H, cp.float32))

    # --- both: the write and the norm ---
    def write_norm(self, x, gamma=None, u=None, o=None, iota=None, add=None, u16=None, T: int | None = None) -> None:
        """Rows 0..T-1 (default: all of x's) of x (T, D) or x (D,): x_c += iota[t, c] o[t] when o is given (o (T, N),
        iota (T, H) contiguous), x += add[t] when add (T, D) is given; then, when u (T, D) fp32 and/or u16 (T, D) fp16
        are given, u = GroupNorm_H(x; gamma) (gamma (D,))."""
        from engine.cuda.launch import F32, I32, I64, ptr
        sh = self.shape
        T = _rows_of(x) if T is None else T
        ld_x = _ld(x, sh.D, "x")
        if T < 1 or _rows_of(x) < T:
            raise ValueError(f"{T} rows asked of x with {_rows_of(x)}")
        ld_o = ld_add = 0
        if o is not None:
            if iota is None:
                raise ValueError("a write (o given) needs its iota")
            ld_o = _ld(o, sh.N, "o")
            _dense(iota, T, sh.H, "iota")
        if add is not None:
            ld_add = _ld(add, sh.D, "add")
        if (u is not None or u16 is not None) and gamma is None:
            raise ValueError("the norm (u or u16 given) needs gamma")
        if u is not None:
            _dense(u, T, sh.D, "u")
        if u16 is not None:
            _dense(u16, T, sh.D, "u16", "float16")
        if o is None and add is None and u is None and u16 is None:
            raise ValueError("write_norm with nothing to do")
        self.f["hc_write_norm"]((sh.H, T), (256,),
                                (ptr(x), I64(ld_x), ptr(o), I64(ld_o), ptr(iota), ptr(add), I64(ld_add), ptr(gamma),
                                 ptr(u), ptr(u16), I32(sh.N), I32(sh.H), F32(sh.eps)))

    # --- decode: one token ---
    def up_mix(self, W_up, d, u, y, inj=None, iota=None) -> None:
        """y (N,) = (1/H) sum_c sigmoid(W_up[c] silu(d / H)) u_c, from d (R,) = W_down u and u (D,); with inj (H,) =
        W_inj u, iota (H,) = 2 sigmoid(inj / H). W_up: a DevMatrix of D rows of R."""
        from engine.cuda.launch import I32, I64, U64, ptr
        sh = self.shape
        if (W_up.rows, W_up.cols) != (sh.D, sh.R):
            raise ValueError(f"W_up is {W_up.rows} x {W_up.cols}, want {sh.D} x {sh.R}")
        f = self.up.get(int(W_up.qt))
        if f is None:
            raise ValueError(f"hc_up_mix was not built for quant type {W_up.qt} (built: {self.qtype_ids})")
        if (inj is None) != (iota is None):
            raise ValueError("inj and iota go together (the head has neither)")
        for a, n, name in ((d, sh.R, "d"), (u, sh.D, "u"), (y, sh.N, "y")) + \
                (((inj, sh.H, "inj"), (iota, sh.H, "iota")) if inj is not None else ()):
            _dense(a, 1, n, name)
        f(((sh.N + UP_MIX_WARPS - 1) // UP_MIX_WARPS,), (32 * UP_MIX_WARPS,),
          (U64(W_up.ptr), I64(W_up.row_bytes), ptr(d), ptr(inj), ptr(u), ptr(y), ptr(iota), I32(sh.N), I32(sh.H),
           I32(sh.R)),
          shared_mem=4 * sh.R)

    def read_decode(self, mv, x, w: HcWeights, sc: HcScratch, y, iota=None, o=None, iota_prev=None, add=None,
                    mixed: bool = False) -> None:
        """One token's HC read of x (D,) with the previous write fused in (o, iota_prev) and an optional add (D,):
        y (N,), and iota (H,) unless w.inject is None (the head). mv: the engine's Launcher (its kernel table holds
        mv4 for the types of w.down and w.inject; mixed: as Launcher.mv_many)."""
        self.write_norm(x, w.gamma, u=sc.u, o=o, iota=iota_prev, add=add)
        if w.inject is None:
            mv.mv(w.down, sc.u, sc.d, tag="hc_down")
            self.up_mix(w.up, sc.d, sc.u, y)
        else:
            mv.mv_many([w.down, w.inject], sc.u, [sc.d, sc.e], tag="hc_down", mixed=mixed)
            self.up_mix(w.up, sc.d, sc.u, y, inj=sc.e, iota=iota)

    # --- prompt: T rows ---
    def act_rows(self, d, T: int | None = None, out=None, out16=None) -> None:
        """a = silu(d / H) for rows 0..T-1 of d (T, >= R; the row stride is read): out (T, R) fp32 and/or out16 (T, R)
        fp16."""
        from engine.cuda.launch import I32, I64, ptr
        sh = self.shape
        T = _rows_of(d) if T is None else T
        ld = _ld(d, sh.R, "d")
        if out is None and out16 is None:
            raise ValueError("act_rows needs out or out16")
        if out is not None:
            _dense(out, T, sh.R, "out")
        if out16 is not None:
            _dense(out16, T, sh.R, "out16", "float16")
        n = T * sh.R
        self.f["hc_act_rows"](((n + 255) // 256,), (256,),
                              (ptr(d), I64(ld), ptr(out), ptr(out16), I32(T), I32(sh.R), I32(sh.H)))

    def mix_rows(self, s, u, y, T: int | None = None, inj=None, iota=None) -> None:
        """Rows 0..T-1: y (T, >= N) = (1/H) sum_c sigmoid(s_c) u_c from s (T, >= D) (the W_up GEMM) and u (T, D); with
        inj (T, >= H) (the W_inj GEMM, e.g. a column view of the down GEMM's output), iota (T, H) = 2 sigmoid(inj /
        H)."""
        from engine.cuda.launch import I32, I64, ptr
        sh = self.shape
        T = _rows_of(s) if T is None else T
        ld_s, ld_y = _ld(s, sh.D, "s"), _ld(y, sh.N, "y")
        _dense(u, T, sh.D, "u")
        if (inj is None) != (iota is None):
            raise ValueError("inj and iota go together (the head has neither)")
        ld_inj = 0
        if inj is not None:
            ld_inj = _ld(inj, sh.H, "inj")
            _dense(iota, T, sh.H, "iota")
        self.f["hc_mix_rows"](((sh.N + 255) // 256, T), (256,),
                              (ptr(s), I64(ld_s), ptr(u), ptr(inj), I64(ld_inj), ptr(y), I64(ld_y), ptr(iota),
                               I32(sh.N), I32(sh.H)))
