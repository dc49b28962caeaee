"""Row decoders for the CPU expert kernels: a quantized GGUF row to float32, bit for bit as the reference does it.

dec_X(a, nb, y, L) writes the nb blocks of type X at address a as float32 at address y, with the reference
dequantizer's float32 operations in its order (gguf.quants; engine.quant_blocks for Q2_0 and Q1_0): the same bits
(tests/test_cpu_experts.py). decode_row dispatches on the ggml type id; DECODED_TYPES lists what it reads, and a new
quant type is a decoder here plus one branch there. The kernels (engine/cpu_expert_kernels.py) decode the rows of
types without a fused dot into an L1 buffer and dot that (engine/cpu_simd.py vdot).

L is 32, passed in at run time: with constant trip counts LLVM unrolls the per-block loops into straight-line code
that its SLP pass does not vectorize (it cannot tell the raw pointers apart), while a loop of unknown length is
vectorized with one alias check (Q8_0: 3.5 -> 10.4 GB/s a thread). Loops of 16, 8 and 4 use L // 2, L // 4, L // 8.
"""
from __future__ import annotations

import gguf.quants
import numpy as np
from numba import carray, njit

from engine.cpu_simd import band, bor, f16_to_f32, f32_bits, i32, isub, ptr_f32, ptr_i8, ptr_u16, ptr_u8, shl, shr


@njit(inline="always")
def _u8(a, n):
    return carray(ptr_u8(a), n)


@njit(inline="always")
def _f32(a, n):
    return carray(ptr_f32(a), n)


@njit(inline="always")
def _half(b, o):
    return f16_to_f32(bor(b[o], shl(b[o + 1], 8)))


@njit(inline="always")
def _u32(b, o):
    return np.uint32(bor(bor(b[o], shl(b[o + 1], 8)), bor(shl(b[o + 2], 16), shl(b[o + 3], 24))))


# --- tables (gguf.quants', as float32 or bytes) ------------------------------------------------------------------

def _grid_table(cls) -> np.ndarray:
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(-1), dtype=np.float32)


_Q = gguf.quants
KSIGNS = np.frombuffer(_Q.IQ2_XXS.ksigns, dtype=np.uint8).copy()
GRID_IQ2_XXS, GRID_IQ2_XS, GRID_IQ2_S = _grid_table(_Q.IQ2_XXS), _grid_table(_Q.IQ2_XS), _grid_table(_Q.IQ2_S)
GRID_IQ3_XXS, GRID_IQ3_S = _grid_table(_Q.IQ3_XXS), _grid_table(_Q.IQ3_S)
KVALUES_IQ4 = np.array(_Q.IQ4_NL.kvalues, dtype=np.float32)
KVALUES_FP4 = np.array(_Q.MXFP4.kvalues, dtype=np.float32)   # E2M1 doubled, as ggml stores it (MXFP4, NVFP4)


def _ue4m3_half() -> np.ndarray:
    """ggml_ue4m3_to_fp32(x) * 0.5 for every byte (NVFP4's scale; exact in float32: at most 4 significant bits)."""
    x = np.arange(256)
    e, m = (x >> 3) & 0xF, (x & 7).astype(np.float64)
    v = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    v[(x == 0) | (x == 0x7F)] = 0.0
    return (v * 0.5).astype(np.float32)


UE4M3_HALF = _ue4m3_half()

# the ggml type ids decode_row reads (engine/cpu_experts.py QUANT_BLOCKS has their block shapes)
DECODED_TYPES = frozenset((0, 1, 30, 8, 2, 3, 6, 7, 10, 11, 12, 13, 14, 20, 23, 16, 17, 22, 18, 21, 39, 40, 41, 42))


# --- the decoders ------------------------------------------------------------------------------------------------

@njit(inline="always")
def dec_f32(a, nb, y, L):
    s, d = _f32(a, nb), _f32(y, nb)
    for i in range(nb):
        d[i] = s[i]


@njit(inline="always")
def dec_f16(a, nb, y, L):
    s, d = carray(ptr_u16(a), nb), _f32(y, nb)
    for i in range(nb):
        d[i] = f16_to_f32(s[i])


@njit(inline="always")
def dec_bf16(a, nb, y, L):
    s, d = carray(ptr_u16(a), nb), _f32(y, nb)
    for i in range(nb):
        d[i] = f32_bits(shl(s[i], 16))


@njit(inline="always")
def dec_q8_0(a, nb, y, L):
    for ib in range(nb):
        d = _half(_u8(a + ib * 34, 2), 0)
        q, o = carray(ptr_i8(a + ib * 34 + 2), L), _f32(y + ib * 128, L)
        for j in range(L):
            o[j] = np.float32(i32(q[j])) * d


@njit(inline="always")
def dec_q4_0(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        d = _half(_u8(a + ib * 18, 2), 0)
        q, lo, hi = _u8(a + ib * 18 + 2, H), _f32(y + ib * 128, H), _f32(y + ib * 128 + 64, H)
        for j in range(H):
            lo[j] = d * np.float32(isub(band(q[j], 15), 8))
            hi[j] = d * np.float32(isub(shr(q[j], 4), 8))


@njit(inline="always")
def dec_q4_1(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        b = _u8(a + ib * 20, 4)
        d, m = _half(b, 0), _half(b, 2)
        q, lo, hi = _u8(a + ib * 20 + 4, H), _f32(y + ib * 128, H), _f32(y + ib * 128 + 64, H)
        for j in range(H):
            lo[j] = d * np.float32(band(q[j], 15)) + m
            hi[j] = d * np.float32(shr(q[j], 4)) + m


@njit(inline="always")
def dec_q5_0(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        b = _u8(a + ib * 22, 6)
        d, qh = _half(b, 0), _u32(b, 2)
        q, lo, hi = _u8(a + ib * 22 + 6, H), _f32(y + ib * 128, H), _f32(y + ib * 128 + 64, H)
        for j in range(H):
            lo[j] = d * np.float32(isub(bor(band(q[j], 15), band(shl(shr(qh, j), 4), 16)), 16))
            hi[j] = d * np.float32(isub(bor(shr(q[j], 4), band(shr(qh, j + 12), 16)), 16))


@njit(inline="always")
def dec_q5_1(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        b = _u8(a + ib * 24, 8)
        d, m, qh = _half(b, 0), _half(b, 2), _u32(b, 4)
        q, lo, hi = _u8(a + ib * 24 + 8, H), _f32(y + ib * 128, H), _f32(y + ib * 128 + 64, H)
        for j in range(H):
            lo[j] = d * np.float32(bor(band(q[j], 15), band(shl(shr(qh, j), 4), 16))) + m
            hi[j] = d * np.float32(bor(shr(q[j], 4), band(shr(qh, j + 12), 16))) + m


@njit(inline="always")
def dec_q2_k(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        b = _u8(a + ib * 84, 84)
        d, dmin = _half(b, 80), _half(b, 82)
        for n in range(2):
            for s in range(4):              # 32 values: 2-bit pair s of the half's 32 bytes, 2 scales of 16
                for half in range(2):
                    sc = b[n * 8 + s * 2 + half]
                    dl, ml = d * np.float32(band(sc, 15)), dmin * np.float32(shr(sc, 4))
                    q = _u8(a + ib * 84 + 16 + n * 32 + half * 16, H)
                    o = _f32(y + (ib * 256 + n * 128 + s * 32 + half * 16) * 4, H)
                    for l in range(H):
                        o[l] = dl * np.float32(band(shr(q[l], 2 * s), 3)) - ml


@njit(inline="always")
def _q3_k_scale(b, k):
    lo = band(shr(b[96 + (k % 8)], 4 * (k // 8)), 15)
    hi = band(shr(b[104 + (k % 4)], 2 * (k // 4)), 3)
    return np.float32(np.int8(bor(lo, shl(hi, 4))) - 32)


@njit(inline="always")
def dec_q3_k(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        b = _u8(a + ib * 110, 110)
        d = _half(b, 108)
        for m in range(8):                  # 32 values each: bit m of hmask, 2-bit pair (m % 4) of qs' half m // 4
            for half in range(2):
                dl = d * _q3_k_scale(b, m * 2 + half)
                q = _u8(a + ib * 110 + 32 + (m // 4) * 32 + half * 16, H)
                hm = _u8(a + ib * 110 + half * 16, H)
                o = _f32(y + (ib * 256 + m * 32 + half * 16) * 4, H)
                for l in range(H):
                    off = isub(4, shl(band(shr(hm[l], m), 1), 2))        # 4 where the hmask bit is clear
                    o[l] = dl * np.float32(isub(band(shr(q[l], 2 * (m % 4)), 3), off))


@njit(inline="always")
def _k4_scale_min(b, j):
    """get_scale_min_k4 of a Q4_K/Q5_K block b (scales at b[4:16]) for sub-block j: (scale, min) as int32."""
    if j < 4:
        return band(b[4 + j], 63), band(b[8 + j], 63)
    return (bor(band(b[12 + j - 4], 15), shl(shr(b[4 + j - 4], 6), 4)),
            bor(shr(b[12 + j - 4], 4), shl(shr(b[8 + j - 4], 6), 4)))


@njit(inline="always")
def dec_q4_k(a, nb, y, L):
    for ib in range(nb):
        b = _u8(a + ib * 144, 16)
        d, dmin = _half(b, 0), _half(b, 2)
        for j in range(4):
            s0, m0 = _k4_scale_min(b, 2 * j)
            s1, m1 = _k4_scale_min(b, 2 * j + 1)
            d1, mm1 = d * np.float32(s0), dmin * np.float32(m0)
            d2, mm2 = d * np.float32(s1), dmin * np.float32(m1)
            q = _u8(a + ib * 144 + 16 + j * 32, L)
            lo, hi = _f32(y + (ib * 256 + j * 64) * 4, L), _f32(y + (ib * 256 + j * 64 + 32) * 4, L)
            for l in range(L):
                lo[l] = d1 * np.float32(band(q[l], 15)) - mm1
                hi[l] = d2 * np.float32(shr(q[l], 4)) - mm2


@njit(inline="always")
def dec_q5_k(a, nb, y, L):
    for ib in range(nb):
        b = _u8(a + ib * 176, 16)
        d, dmin = _half(b, 0), _half(b, 2)
        qh = _u8(a + ib * 176 + 16, L)
        for j in range(4):
            s0, m0 = _k4_scale_min(b, 2 * j)
            s1, m1 = _k4_scale_min(b, 2 * j + 1)
            d1, mm1 = d * np.float32(s0), dmin * np.float32(m0)
            d2, mm2 = d * np.float32(s1), dmin * np.float32(m1)
            q = _u8(a + ib * 176 + 48 + j * 32, L)
            lo, hi = _f32(y + (ib * 256 + j * 64) * 4, L), _f32(y + (ib * 256 + j * 64 + 32) * 4, L)
            for l in range(L):
                lo[l] = d1 * np.float32(bor(band(q[l], 15), shl(band(shr(qh[l], 2 * j), 1), 4))) - mm1
                hi[l] = d2 * np.float32(bor(shr(q[l], 4), shl(band(shr(qh[l], 2 * j + 1), 1), 4))) - mm2


@njit(inline="always")
def dec_q6_k(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        b = _u8(a + ib * 210, 210)
        d = _half(b, 208)
        sc = carray(ptr_i8(a + ib * 210 + 192), 16)
        for h in range(2):
            for s in range(4):              # 32 values: ql nibble (s // 2) of bytes h*64 + (s % 2)*32 .., qh pair s
                for half in range(2):
                    dl = d * np.float32(sc[h * 8 + s * 2 + half])
                    ql = _u8(a + ib * 210 + h * 64 + (s % 2) * 32 + half * 16, H)
                    qh = _u8(a + ib * 210 + 128 + h * 32 + half * 16, H)
                    o = _f32(y + (ib * 256 + h * 128 + s * 32 + half * 16) * 4, H)
                    for l in range(H):
                        q = bor(band(shr(ql[l], 4 * (s // 2)), 15), shl(band(shr(qh[l], 2 * s), 3), 4))
                        o[l] = dl * np.float32(isub(q, 32))


@njit(inline="always")
def _iq4(c):
    """kvalues_iq4nl[c] (c in 0..15) without a table load, which would keep the loop from vectorizing."""
    lo = np.float32(-127) if c == 0 else np.float32(-104) if c == 1 else np.float32(-83) if c == 2 else \
        np.float32(-65) if c == 3 else np.float32(-49) if c == 4 else np.float32(-35) if c == 5 else \
        np.float32(-22) if c == 6 else np.float32(-10)
    hi = np.float32(1) if c == 8 else np.float32(13) if c == 9 else np.float32(25) if c == 10 else \
        np.float32(38) if c == 11 else np.float32(53) if c == 12 else np.float32(69) if c == 13 else \
        np.float32(89) if c == 14 else np.float32(113)
    return hi if c >= 8 else lo


@njit(inline="always")
def dec_iq4_nl(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        d = _half(_u8(a + ib * 18, 2), 0)
        q, lo, hi = _u8(a + ib * 18 + 2, H), _f32(y + ib * 128, H), _f32(y + ib * 128 + 64, H)
        for j in range(H):
            lo[j] = d * _iq4(band(q[j], 15))
            hi[j] = d * _iq4(shr(q[j], 4))


@njit(inline="always")
def dec_iq4_xs(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        b = _u8(a + ib * 136, 8)
        d = _half(b, 0)
        sh = bor(b[2], shl(b[3], 8))
        for k in range(8):
            ls = bor(band(shr(b[4 + k // 2], 4 * (k % 2)), 15), shl(band(shr(sh, 2 * k), 3), 4))
            dl = d * np.float32(isub(ls, 32))
            q = _u8(a + ib * 136 + 8 + k * 16, H)
            lo, hi = _f32(y + (ib * 256 + k * 32) * 4, H), _f32(y + (ib * 256 + k * 32 + 16) * 4, H)
            for j in range(H):
                lo[j] = dl * _iq4(band(q[j], 15))
                hi[j] = dl * _iq4(shr(q[j], 4))


@njit(inline="always")
def _grid(o, db, grid, gi, signs, shift, n):
    """n values: db * grid[gi * n ..], negated where bit shift + j of `signs` is set."""
    g = grid[gi * n: gi * n + n]
    for j in range(n):
        v = db * g[j]
        o[j] = -v if band(shr(signs, shift + j), 1) else v


@njit(inline="always")
def dec_iq2_xxs(a, nb, y, L):
    E = L // 4
    for ib in range(nb):
        b = _u8(a + ib * 66, 66)
        d = _half(b, 0)
        for g in range(8):
            aux1 = _u32(b, 2 + g * 8 + 4)
            db = d * (np.float32(0.5) + np.float32(shr(aux1, 28))) * np.float32(0.25)
            for l in range(4):
                _grid(_f32(y + (ib * 256 + g * 32 + l * 8) * 4, E), db, GRID_IQ2_XXS, b[2 + g * 8 + l],
                      KSIGNS[band(shr(aux1, 7 * l), 127)], 0, E)


@njit(inline="always")
def dec_iq2_xs(a, nb, y, L):
    E = L // 4
    for ib in range(nb):
        b = _u8(a + ib * 74, 74)
        d = _half(b, 0)
        for g in range(32):                 # 8 values each; scale nibble g // 2 (16 values)
            sc = band(shr(b[66 + g // 4], 4 * ((g // 2) % 2)), 15)
            db = d * (np.float32(0.5) + np.float32(sc)) * np.float32(0.25)
            q = bor(b[2 + 2 * g], shl(b[3 + 2 * g], 8))
            _grid(_f32(y + (ib * 256 + g * 8) * 4, E), db, GRID_IQ2_XS, band(q, 511), KSIGNS[shr(q, 9)], 0, E)


@njit(inline="always")
def dec_iq2_s(a, nb, y, L):
    E = L // 4
    for ib in range(nb):
        b = _u8(a + ib * 82, 82)
        d = _half(b, 0)
        for g in range(32):
            sc = band(shr(b[74 + g // 4], 4 * ((g // 2) % 2)), 15)
            db = d * (np.float32(0.5) + np.float32(sc)) * np.float32(0.25)
            gi = bor(b[2 + g], shl(band(shr(b[66 + g // 4], 2 * (g % 4)), 3), 8))
            _grid(_f32(y + (ib * 256 + g * 8) * 4, E), db, GRID_IQ2_S, gi, b[34 + g], 0, E)


@njit(inline="always")
def dec_iq3_xxs(a, nb, y, L):
    F = L // 8
    for ib in range(nb):
        b = _u8(a + ib * 98, 98)
        d = _half(b, 0)
        for g in range(8):
            aux = _u32(b, 66 + 4 * g)
            db = d * (np.float32(0.5) + np.float32(shr(aux, 28))) * np.float32(0.5)
            for l in range(4):
                signs = KSIGNS[band(shr(aux, 7 * l), 127)]
                o = y + (ib * 256 + g * 32 + l * 8) * 4
                _grid(_f32(o, F), db, GRID_IQ3_XXS, b[2 + g * 8 + 2 * l], signs, 0, F)
                _grid(_f32(o + 16, F), db, GRID_IQ3_XXS, b[3 + g * 8 + 2 * l], signs, 4, F)


@njit(inline="always")
def dec_iq3_s(a, nb, y, L):
    F = L // 8
    for ib in range(nb):
        b = _u8(a + ib * 110, 110)
        d = _half(b, 0)
        for g in range(64):                 # 4 values each; scale nibble g // 8 (32 values)
            sc = band(shr(b[106 + g // 16], 4 * ((g // 8) % 2)), 15)
            db = d * np.float32(bor(shl(sc, 1), 1))
            gi = bor(b[2 + g], shl(band(shr(b[66 + g // 8], g % 8), 1), 8))
            _grid(_f32(y + (ib * 256 + g * 4) * 4, F), db, GRID_IQ3_S, gi, b[74 + g // 2], 4 * (g % 2), F)


@njit(inline="always")
def _e8m0_half(e):
    """ggml_e8m0_to_fp32_half."""
    if e < 2:
        return f32_bits(shl(0x00200000, e))
    return f32_bits(shl(isub(e, 1), 23))


@njit(inline="always")
def _e2m1(c):
    """kvalues_mxfp4[c] (E2M1 doubled: 0 1 2 3 4 6 8 12, codes 8..15 negative) from its bits, as an int32."""
    v = band(c, 7)
    e, m = shr(v, 1), band(v, 1)
    mag = m if e == 0 else shl(bor(m, 2), isub(e, 1))
    return isub(0, mag) if band(c, 8) else mag


@njit(inline="always")
def dec_mxfp4(a, nb, y, L):
    H = L // 2
    for ib in range(nb):
        d = _e8m0_half(_u8(a + ib * 17, 1)[0])
        q, lo, hi = _u8(a + ib * 17 + 1, H), _f32(y + ib * 128, H), _f32(y + ib * 128 + 64, H)
        for j in range(H):
            lo[j] = d * np.float32(_e2m1(band(q[j], 15)))
            hi[j] = d * np.float32(_e2m1(shr(q[j], 4)))


@njit(inline="always")
def dec_nvfp4(a, nb, y, L):
    E = L // 4
    for ib in range(nb):
        b = _u8(a + ib * 36, 4)
        for s in range(4):
            d = UE4M3_HALF[b[s]]
            q = _u8(a + ib * 36 + 4 + s * 8, E)
            lo, hi = _f32(y + (ib * 64 + s * 16) * 4, E), _f32(y + (ib * 64 + s * 16 + 8) * 4, E)
            for j in range(E):
                lo[j] = np.float32(_e2m1(band(q[j], 15))) * d
                hi[j] = np.float32(_e2m1(shr(q[j], 4))) * d


@njit(inline="always")
def dec_q1_0(a, nb, y, L):
    for ib in range(nb):
        d = _half(_u8(a + ib * 18, 2), 0) * np.float32(1)
        q, o = _u8(a + ib * 18 + 2, 16), _f32(y + ib * 512, 4 * L)
        for j in range(4 * L):
            o[j] = d if band(shr(q[j // 8], j % 8), 1) else -d


@njit(inline="always")
def dec_q2_0(a, nb, y, L):
    for ib in range(nb):
        d = _half(_u8(a + ib * 18, 2), 0)
        q, o = _u8(a + ib * 18 + 2, 16), _f32(y + ib * 256, 2 * L)
        for j in range(2 * L):
            o[j] = (np.float32(band(shr(q[j // 4], 2 * (j % 4)), 3)) - np.float32(1)) * d


@njit(nogil=True, cache=True)
def decode_row(qt, a, n, y):
    """Decode one row of n values of ggml type qt at address a into float32 at address y."""
    L = min(n, 32)      # 32: every block holds at least 32 values (see the decoders' comment)
    if qt == 12:
        dec_q4_k(a, n // 256, y, L)
    elif qt == 14:
        dec_q6_k(a, n // 256, y, L)
    elif qt == 13:
        dec_q5_k(a, n // 256, y, L)
    elif qt == 39:
        dec_mxfp4(a, n // 32, y, L)
    elif qt == 8:
        dec_q8_0(a, n // 32, y, L)
    elif qt == 17:
        dec_iq2_xs(a, n // 256, y, L)
    elif qt == 20:
        dec_iq4_nl(a, n // 32, y, L)
    elif qt == 42:
        dec_q2_0(a, n // 64, y, L)
    elif qt == 41:
        dec_q1_0(a, n // 128, y, L)
    elif qt == 23:
        dec_iq4_xs(a, n // 256, y, L)
    elif qt == 10:
        dec_q2_k(a, n // 256, y, L)
    elif qt == 11:
        dec_q3_k(a, n // 256, y, L)
    elif qt == 2:
        dec_q4_0(a, n // 32, y, L)
    elif qt == 3:
        dec_q4_1(a, n // 32, y, L)
    elif qt == 6:
        dec_q5_0(a, n // 32, y, L)
    elif qt == 7:
        dec_q5_1(a, n // 32, y, L)
    elif qt == 16:
        dec_iq2_xxs(a, n // 256, y, L)
    elif qt == 22:
        dec_iq2_s(a, n // 256, y, L)
    elif qt == 18:
        dec_iq3_xxs(a, n // 256, y, L)
    elif qt == 21:
        dec_iq3_s(a, n // 256, y, L)
    elif qt == 40:
        dec_nvfp4(a, n // 64, y, L)
    elif qt == 0:
        dec_f32(a, n, y, L)
    elif qt == 1:
        dec_f16(a, n, y, L)
    elif qt == 30:
        dec_bf16(a, n, y, L)


@njit(nogil=True, cache=True)
def decode_rows(qt, a, row_bytes, n_rows, n, out):
    """Rows 0..n_rows of a matrix at address a into out (n_rows, n) float32: the decoders' test entry."""
    for r in range(n_rows):
        decode_row(qt, a + r * row_bytes, n, out[r].ctypes.data)
