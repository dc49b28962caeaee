"""The CPU expert kernels in numba: one token's routed experts of one layer, straight from their quantized rows.

A row's dot with x takes one of two ways, both exact to float32 rounding against the NumPy backend (dequantize,
then float32 BLAS):
- fused (row_X of engine/cpu_rows.py, dot_X here): each block's codes dotted with x in float32, then scaled by the
  block's scales, with its offset times the sum of x over it subtracted: the same sum as dequantizing first,
  factored, so it differs from that only by float32 rounding, bounded by eps times the terms' magnitudes (Q4_K,
  Q6_K, Q8_0 and, on AVX-512, the 4-bit table types as whole rows in IR; the rest a block at a time here);
- decoded (every type decode_row reads): the row to float32 in an L1 buffer, bit for bit as the reference
  dequantizes it (engine/cpu_decode.py), then vdot.
llama.cpp's CPU path rounds x to 8 bits instead (its q8_K / q8_0 vec_dot): docs/experiments.md has how far that is.

Every operation is strict IEEE float32 (no fast-math), every vector sum a fixed tree inside an intrinsic, so a result
has the same bits whatever the thread count, whatever LLVM inlined, and whether numba compiled it now or loaded it
from its cache (it once did not: docs/experiments.md, "CPU experts").

ffn_experts is a layer's k experts: gate and up rows (activation, optional biases) in one parallel loop, then each
down row over all k experts in a second, so every output element is one thread's fixed-order sum. Addresses are
plain integers (the pinned arena's host pointers, or a memory-mapped GGUF's); engine/cpu_experts.py checks them.
"""
from __future__ import annotations

import gguf.quants
import numpy as np
from numba import njit, prange

from engine.cpu_decode import UE4M3_HALF, _e8m0_half, _half, _u8, decode_row
from engine.cpu_rows import (HAS_AVX512, row_iq2_s, row_iq2_xs, row_iq2_xxs, row_iq3_s, row_iq3_xxs, row_iq4_nl,
                             row_iq4_xs, row_mxfp4, row_nvfp4, row_q2_k, row_q3_k, row_q4_0, row_q4_1, row_q4_k,
                             row_q5_0, row_q5_1, row_q5_k, row_q6_k, row_q8_0)
from engine.cpu_simd import (HAS_PSHUFB, _lut16_blocks, _nvfp4_block, band, bits_dot, bor, crumbs_dot,
                             isub, prefetch_rows, shl, shr, vdot)

FP4, IQ4, Q4_0 = gguf.quants.MXFP4.kvalues, gguf.quants.IQ4_NL.kvalues, [c - 8 for c in range(16)]
nvfp4_block = _nvfp4_block(FP4)
pair_fp4, pair_iq4, pair_q4_0 = _lut16_blocks(FP4, 2, 17), _lut16_blocks(IQ4, 2, 18), _lut16_blocks(Q4_0, 2, 18)
one_fp4, one_iq4, one_q4_0 = _lut16_blocks(FP4, 1, 17), _lut16_blocks(IQ4, 1, 18), _lut16_blocks(Q4_0, 1, 18)
iq4_xs_block = _lut16_blocks(IQ4, 8, 16)


# Each fused dot is its type's block function summed over a row's blocks in two running sums, the even blocks' and
# the odd ones': one sum would make every block's addition wait for the last (MXFP4: 3.1 -> 4.4 GB/s a thread).

@njit(inline="always")
def _nvfp4(a, ib, xa, sa):
    b = _u8(a + ib * 36, 4)
    return nvfp4_block(a + ib * 36 + 4, xa + ib * 256, UE4M3_HALF[b[0]], UE4M3_HALF[b[1]], UE4M3_HALF[b[2]],
                       UE4M3_HALF[b[3]])


@njit(inline="always")
def _q2_0(a, ib, xa, sa):
    return _half(_u8(a + ib * 18, 2), 0) * crumbs_dot(a + ib * 18 + 2, xa + ib * 256)


@njit(inline="always")
def _q1_0(a, ib, xa, sa):
    return _half(_u8(a + ib * 18, 2), 0) * bits_dot(a + ib * 18 + 2, xa + ib * 512)


@njit(inline="always")
def _f16_scale(a, ib):      # Q4_0's and IQ4_NL's 18-byte blocks: fp16 d, then 16 bytes of codes
    return _half(_u8(a + ib * 18, 2), 0)


@njit(inline="always")
def _e8m0_scale(a, ib):     # MXFP4's 17-byte blocks: one E8M0 exponent, then 16 bytes of codes
    return _e8m0_half(_u8(a + ib * 17, 1)[0])


def _fused_pairs(pair, one, scale, nbytes: int, codes: int):
    """The row dot over nb 32-value blocks of nbytes, codes at byte `codes`, dotted two at a time (one tree for 64
    values) into two running sums."""
    @njit(nogil=True, cache=True)
    def dot(a, nb, xa, sa):
        t0, t1 = np.float32(0), np.float32(0)
        ib = 0
        while ib + 3 < nb:
            t0 += pair(a + ib * nbytes + codes, xa + ib * 128, scale(a, ib), scale(a, ib + 1))
            t1 += pair(a + (ib + 2) * nbytes + codes, xa + (ib + 2) * 128, scale(a, ib + 2), scale(a, ib + 3))
            ib += 4
        if ib + 1 < nb:
            t0 += pair(a + ib * nbytes + codes, xa + ib * 128, scale(a, ib), scale(a, ib + 1))
            ib += 2
        if ib < nb:
            t1 += one(a + ib * nbytes + codes, xa + ib * 128, scale(a, ib))
        return t0 + t1
    return dot


@njit(inline="always")
def _xs_scale(b, sh, k):
    """IQ4_XS sub-block k's 6-bit scale minus 32."""
    return np.float32(isub(bor(band(shr(b[4 + k // 2], 4 * (k % 2)), 15), shl(band(shr(sh, 2 * k), 3), 4)), 32))


@njit(inline="always")
def _iq4_xs(a, ib, xa, sa):
    b = _u8(a + ib * 136, 8)
    sh = bor(b[2], shl(b[3], 8))
    return _half(b, 0) * iq4_xs_block(a + ib * 136 + 8, xa + ib * 1024, _xs_scale(b, sh, 0), _xs_scale(b, sh, 1),
                                      _xs_scale(b, sh, 2), _xs_scale(b, sh, 3), _xs_scale(b, sh, 4),
                                      _xs_scale(b, sh, 5), _xs_scale(b, sh, 6), _xs_scale(b, sh, 7))


def _fused(block):
    """The row dot over nb blocks of `block`'s type: even blocks into one sum, odd ones into another."""
    @njit(nogil=True, cache=True)
    def dot(a, nb, xa, sa):
        t0, t1 = np.float32(0), np.float32(0)
        for ib in range(0, nb - 1, 2):
            t0 += block(a, ib, xa, sa)
            t1 += block(a, ib + 1, xa, sa)
        if nb % 2:
            t0 += block(a, nb - 1, xa, sa)
        return t0 + t1
    return dot


dot_iq4_xs = _fused(_iq4_xs)
dot_nvfp4 = _fused(_nvfp4)
dot_q4_0 = _fused_pairs(pair_q4_0, one_q4_0, _f16_scale, 18, 2)
dot_iq4_nl = _fused_pairs(pair_iq4, one_iq4, _f16_scale, 18, 2)
dot_mxfp4 = _fused_pairs(pair_fp4, one_fp4, _e8m0_scale, 17, 1)
dot_q2_0, dot_q1_0 = _fused(_q2_0), _fused(_q1_0)


LUT_TYPES = frozenset((2, 20, 23, 39, 40))          # through vpermps (AVX-512) or else pshufb (x86 since 2006)
FUSED_TYPES = frozenset((3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 21, 22, 41, 42)) | (
    LUT_TYPES if HAS_PSHUFB or HAS_AVX512 else frozenset())


@njit(nogil=True, cache=True)
def dot_row(qt, a, n, xa, sa, ya):
    """The row of n values of type qt at address a dotted with x (n float32 at xa; sa: x's sums over every 32
    values): a whole-row dot (engine/cpu_rows.py) or a fused one where the type has one, else decoded into ya (n
    float32 of scratch) and dotted."""
    if qt == 12:
        return row_q4_k(a, n // 256, xa, sa)
    if qt == 39:
        if HAS_AVX512:
            return row_mxfp4(a, n // 32, xa, sa)
        if HAS_PSHUFB:
            return dot_mxfp4(a, n // 32, xa, sa)
    if qt == 14:
        return row_q6_k(a, n // 256, xa, sa)
    if qt == 8:
        return row_q8_0(a, n // 32, xa, sa)
    if qt == 17:
        return row_iq2_xs(a, n // 256, xa, sa)
    if qt == 20:
        if HAS_AVX512:
            return row_iq4_nl(a, n // 32, xa, sa)
        if HAS_PSHUFB:
            return dot_iq4_nl(a, n // 32, xa, sa)
    if qt == 42:
        return dot_q2_0(a, n // 64, xa, sa)
    if qt == 41:
        return dot_q1_0(a, n // 128, xa, sa)
    if qt == 23:
        if HAS_AVX512:
            return row_iq4_xs(a, n // 256, xa, sa)
        if HAS_PSHUFB:
            return dot_iq4_xs(a, n // 256, xa, sa)
    if qt == 22:
        return row_iq2_s(a, n // 256, xa, sa)
    if qt == 16:
        return row_iq2_xxs(a, n // 256, xa, sa)
    if qt == 18:
        return row_iq3_xxs(a, n // 256, xa, sa)
    if qt == 21:
        return row_iq3_s(a, n // 256, xa, sa)
    if qt == 40:
        if HAS_AVX512:
            return row_nvfp4(a, n // 64, xa, sa)
        if HAS_PSHUFB:
            return dot_nvfp4(a, n // 64, xa, sa)
    if qt == 2:
        if HAS_AVX512:
            return row_q4_0(a, n // 32, xa, sa)
        if HAS_PSHUFB:
            return dot_q4_0(a, n // 32, xa, sa)
    if qt == 13:
        return row_q5_k(a, n // 256, xa, sa)
    if qt == 6:
        return row_q5_0(a, n // 32, xa, sa)
    if qt == 3:
        return row_q4_1(a, n // 32, xa, sa)
    if qt == 7:
        return row_q5_1(a, n // 32, xa, sa)
    if qt == 11:
        return row_q3_k(a, n // 256, xa, sa)
    if qt == 10:
        return row_q2_k(a, n // 256, xa, sa)
    decode_row(qt, a, n, ya)
    return vdot(ya, xa, n)


FUSED_IDS = np.array(sorted(FUSED_TYPES), np.int64)


@njit(nogil=True, cache=True)
def is_fused(qt):
    """Whether dot_row dots type qt without decoding it (FUSED_TYPES)."""
    for f in FUSED_IDS:
        if f == qt:
            return True
    return False


@njit(nogil=True, cache=True)
def sums32(v, out):
    """out[i] = v[32 i: 32 i + 32].sum(), in order (the fused dots' offsets)."""
    for i in range(len(out)):
        s = np.float32(0)
        for j in range(32 * i, min(len(v), 32 * i + 32)):
            s += v[j]
        out[i] = s


@njit(nogil=True, cache=True)
def dot_rows(qt, a, row_bytes, n_rows, n, x, out):
    """out[r] = row r of a matrix at address a dotted with x (n,): the fused dots' test entry."""
    xs = np.empty((n + 31) // 32, np.float32)
    sums32(x, xs)
    buf = np.empty(n, np.float32)
    for r in range(n_rows):
        out[r] = dot_row(qt, a + r * row_bytes, n, x.ctypes.data, xs.ctypes.data, buf.ctypes.data)


# --- the layer ----------------------------------------------------------------------------------------------------

ACT_SWIGLU, ACT_SWIGLU_OAI = 0, 1


@njit(inline="always")
def _activate(act, g, u, alpha, limit):
    """engine.arch.base's silu(g) * u, or engine.arch.gptoss.swiglu_oai(g, u), in float32 as NumPy does them."""
    one = np.float32(1)
    if act == ACT_SWIGLU:
        return g / (one + np.exp(-g)) * u
    x = g if g < limit or g != g else limit        # np.minimum: NaN passes
    y = u if u < limit or u != u else limit        # np.clip(u, -limit, limit)
    y = y if y > -limit or y != y else -limit
    return x / (one + np.exp(-alpha * x)) * (y + one)


# Rows prefetched ahead of the one being read: the hardware's streams alone left a thread's reads at 2.4 GB/s from
# DRAM against 3.9 from cache (Q4_K, 1 thread); 2, 4 and 8 ahead all gave ~3.2-3.8.
AHEAD = 4
ROWS_PER_TASK = 32      # rows a parallel task takes: small enough to spread k * n_ff rows over 16 threads


@njit(parallel=True, nogil=True, cache=True)
def ffn_experts(gate, up, down, qg, qu, qd, rbg, rbu, rbd, n_ff, n_embd, x, w, act, alpha, limit,
                bg, bu, bd, h, out, ahead=AHEAD):
    """out[:] = sum_e w[e] * (down_e @ act(gate_e @ x + bg[e], up_e @ x + bu[e]) + bd[e]) over the k experts whose
    rows start at addresses gate[e], up[e], down[e] (rows of rbg, rbu, rbd bytes; types qg, qu, qd).

    x (n_embd,) and out (n_embd,) float32; h (k, n_ff) float32 scratch; bg, bu (k, n_ff) and bd (k, n_embd) the
    experts' biases, or arrays of size 0 for none; ahead: rows prefetched ahead of the one read (0: none, the
    hardware's streams alone)."""
    k = len(gate)
    has_bias = bg.size > 0
    xs = np.empty((n_embd + 31) // 32, np.float32)
    sums32(x, xs)
    xa, sa = x.ctypes.data, xs.ctypes.data
    per = (n_ff + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    # decode buffers, one a task, made here and only for types without a fused dot: an allocation in each task is a
    # malloc and the runtime's atomic counters, from every thread at once
    dec_gu = not (is_fused(qg) and is_fused(qu))
    gscr = np.empty((k * per if dec_gu else 1, n_embd), np.float32)
    for t in prange(k * per):
        e, r0 = t // per, (t % per) * ROWS_PER_TASK
        ya = gscr.ctypes.data + np.int64(t) * np.int64(dec_gu) * n_embd * 4
        for r in range(r0, min(n_ff, r0 + ROWS_PER_TASK)):
            if ahead and r + ahead < n_ff:
                prefetch_rows(gate[e] + (r + ahead) * rbg, rbg)
                prefetch_rows(up[e] + (r + ahead) * rbu, rbu)
            g = dot_row(qg, gate[e] + r * rbg, n_embd, xa, sa, ya)
            u = dot_row(qu, up[e] + r * rbu, n_embd, xa, sa, ya)
            if has_bias:
                g += bg[e, r]
                u += bu[e, r]
            h[e, r] = _activate(act, g, u, alpha, limit)
    hs = np.empty((k, (n_ff + 31) // 32), np.float32)
    for e in range(k):
        sums32(h[e], hs[e])
    per = (n_embd + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    dec_d = not is_fused(qd)
    dscr = np.empty((per if dec_d else 1, n_ff), np.float32)
    for t in prange(per):
        ya = dscr.ctypes.data + np.int64(t) * np.int64(dec_d) * n_ff * 4
        for r in range(t * ROWS_PER_TASK, min(n_embd, (t + 1) * ROWS_PER_TASK)):
            acc = np.float32(0)
            for e in range(k):
                if ahead and r + ahead < n_embd:
                    prefetch_rows(down[e] + (r + ahead) * rbd, rbd)
                v = dot_row(qd, down[e] + r * rbd, n_ff, h[e].ctypes.data, hs[e].ctypes.data, ya)
                if has_bias:
                    v += bd[e, r]
                acc += w[e] * v
            out[r] = acc

