// quant.cuh: the GGUF (ggml) quantization formats, shared by every Strata kernel.
//
// Contract (cuda-engine codes against this; owner: cuda-kernels)
// ---------------------------------------------------------------
// For every supported ggml type T with ggml type id Q (STRATA_Q_* below: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, MXFP4, Q2_0, Q1_0, NVFP4):
//
//   template <int Q> struct QTraits { static constexpr int QK; static constexpr int BYTES; };  // elements/bytes per block
//   template <int Q> QFN void dequant8(const uint8_t* __restrict__ block, int j, float (&v)[8]);
//       elements j*8 .. j*8+7 of one block (0 <= j < QK/8), as engine.quant_types.dequantize computes them (up to
//       fp32 rounding: nvcc may fuse a*b+c into one fma; Q2_0, Q1_0 and NVFP4 have no such sum and are bit-exact).
//   template <int Q> QFN float dot_row(const uint8_t* __restrict__ row, const float* __restrict__ x, int ncols, int lane);
//       THIS LANE's partial of dot(row, x); the caller sums the 32 lanes (strata_warp_sum) to get the row's dot.
//   template <int Q, int NV> QFN void dot_row_nv(const uint8_t* row, const float* x, int ldx, int ncols, int lane,
//                                                  float (&acc)[NV]);
//       the same for NV activation vectors x + v*ldx (v < NV), each weight chunk dequantized once; acc is added to.
//
// Layout and alignment: a row is ncols/QK blocks back to back (ggml layout: weight rows = output features, contiguous
// along the input dimension); ncols must be a multiple of QK. Row pointers must be 16-byte aligned (GGUF aligns tensor
// data to 32 bytes and every K-quant row is a multiple of 16 bytes; expert slabs must keep that), x 16-byte aligned.
// The blocks of the 18-byte types (Q4_0, IQ4_NL, Q2_0, Q1_0) and NVFP4's may sit at any even address, MXFP4's at any
// address (an expert blob's up and down start after gate's rows, whose bytes need not be a multiple of 4).
// F32/F16/BF16 have no blocks in ggml (block size 1); here they use pseudo-blocks of 8 elements (QK=8) so every type
// has the same shape; a float row is still just ncols values.
//
//   template <int Q, int R, int NV> QFN void dot_rows(const uint8_t* const (&rows)[R], const float* x, int ldx,
//                                                     int ncols, int lane, float (&acc)[R][NV]);
//       R rows at once, each x chunk loaded once for all of them: R=2 helps windows of several vectors, short rows
//       (R=4) and the simple types; the K-quants with one vector run fastest with R=1 (bench/matvec.py's
//       matvec_plan; docs/experiments.md).
//
// Differences from the first sketch of this contract: none in the signatures; dot_row returns the lane's partial (no
// shuffle inside, so the same code runs on the host for tests); dot_row_nv (windows of <= 8 tokens) and dot_rows
// (several rows per warp) were added.
// Activations stay fp32 (no int8 dp4a path yet): decode reads weights at a few bytes per 8 elements while x sits in L1.
//
// Host builds: define STRATA_HOST before including (tests compile this file with g++ to check it against gguf without
// a GPU); device builds need no headers at all, so NVRTC (CuPy RawModule) and nvcc compile it alike.
#pragma once

#if defined(STRATA_HOST)
#include <cstdint>
#include <cstdlib>
#include <cstring>
#define QFN inline
#define STRATA_TABLE static const
// the host test checks every load against the alignment the GPU's vector loads need
#define STRATA_ALIGNED(p, n) do { if ((uintptr_t)(p) % (n)) { fprintf(stderr, "misaligned %d-byte load at %p\n", n, (const void*)(p)); abort(); } } while (0)
#include <cstdio>
#else
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef signed char int8_t;
#define QFN __device__ __forceinline__
#define STRATA_TABLE static __device__ const
#endif

#include "iq_tables.cuh"

// ggml type ids (gguf.GGMLQuantizationType)
#define STRATA_Q_F32 0
#define STRATA_Q_F16 1
#define STRATA_Q_Q4_0 2
#define STRATA_Q_Q4_1 3
#define STRATA_Q_Q5_0 6
#define STRATA_Q_Q5_1 7
#define STRATA_Q_Q8_0 8
#define STRATA_Q_Q2_K 10
#define STRATA_Q_Q3_K 11
#define STRATA_Q_Q4_K 12
#define STRATA_Q_Q5_K 13
#define STRATA_Q_Q6_K 14
#define STRATA_Q_IQ2_XXS 16
#define STRATA_Q_IQ2_XS 17
#define STRATA_Q_IQ3_XXS 18
#define STRATA_Q_IQ4_NL 20
#define STRATA_Q_IQ3_S 21
#define STRATA_Q_IQ2_S 22
#define STRATA_Q_IQ4_XS 23
#define STRATA_Q_BF16 30
#define STRATA_Q_MXFP4 39
#define STRATA_Q_NVFP4 40
#define STRATA_Q_Q1_0 41
#define STRATA_Q_Q2_0 42

template <int Q> struct QTraits;
#define STRATA_TRAITS(T, qk, bytes) \
    template <> struct QTraits<STRATA_Q_##T> { static constexpr int QK = qk; static constexpr int BYTES = bytes; };
STRATA_TRAITS(F32, 8, 32)
STRATA_TRAITS(F16, 8, 16)
STRATA_TRAITS(BF16, 8, 16)
STRATA_TRAITS(Q4_0, 32, 18)
STRATA_TRAITS(Q4_1, 32, 20)
STRATA_TRAITS(Q5_0, 32, 22)
STRATA_TRAITS(Q5_1, 32, 24)
STRATA_TRAITS(Q8_0, 32, 34)
STRATA_TRAITS(Q2_K, 256, 84)
STRATA_TRAITS(Q3_K, 256, 110)
STRATA_TRAITS(Q4_K, 256, 144)
STRATA_TRAITS(Q5_K, 256, 176)
STRATA_TRAITS(Q6_K, 256, 210)
STRATA_TRAITS(IQ2_XXS, 256, 66)
STRATA_TRAITS(IQ2_XS, 256, 74)
STRATA_TRAITS(IQ2_S, 256, 82)
STRATA_TRAITS(IQ3_XXS, 256, 98)
STRATA_TRAITS(IQ3_S, 256, 110)
STRATA_TRAITS(IQ4_NL, 32, 18)
STRATA_TRAITS(IQ4_XS, 256, 136)
STRATA_TRAITS(MXFP4, 32, 17)
STRATA_TRAITS(Q2_0, 64, 18)
STRATA_TRAITS(Q1_0, 128, 18)
STRATA_TRAITS(NVFP4, 64, 36)
#undef STRATA_TRAITS

// ---- scalar helpers -------------------------------------------------------------------------------------------------

QFN float strata_h2f(uint16_t h) {
#if defined(STRATA_HOST)
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal half: renormalise
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f; memcpy(&f, &bits, 4); return f;
#else
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#endif
}

QFN uint32_t strata_f2u(float f) {
#if defined(STRATA_HOST)
    uint32_t u; memcpy(&u, &f, 4); return u;
#else
    return __float_as_uint(f);
#endif
}

QFN float strata_u2f(uint32_t u) {
#if defined(STRATA_HOST)
    float f; memcpy(&f, &u, 4); return f;
#else
    return __uint_as_float(u);
#endif
}

// Loads by the alignment the layout guarantees (rows 16-byte aligned; see the contract).
QFN uint16_t ld2(const uint8_t* p) {
#if defined(STRATA_HOST)
    STRATA_ALIGNED(p, 2);
    uint16_t v; memcpy(&v, p, 2); return v;
#else
    return *(const uint16_t*)p;
#endif
}
QFN uint32_t ld4_a2(const uint8_t* p) { return (uint32_t)ld2(p) | ((uint32_t)ld2(p + 2) << 16); }
QFN uint32_t ld4(const uint8_t* p) {
#if defined(STRATA_HOST)
    STRATA_ALIGNED(p, 4);
    uint32_t v; memcpy(&v, p, 4); return v;
#else
    return *(const uint32_t*)p;
#endif
}
QFN void ld8(const uint8_t* p, uint32_t& a, uint32_t& b) {
#if defined(STRATA_HOST)
    STRATA_ALIGNED(p, 8);
    memcpy(&a, p, 4); memcpy(&b, p + 4, 4);
#else
    uint2 t = *(const uint2*)p; a = t.x; b = t.y;
#endif
}
QFN void ld8_a2(const uint8_t* p, uint32_t& a, uint32_t& b) { a = ld4_a2(p); b = ld4_a2(p + 4); }

// the 32 bits at bit sh (0..31) of the 64-bit hi:lo
QFN uint32_t strata_funnel(uint32_t lo, uint32_t hi, uint32_t sh) {
#if defined(STRATA_HOST)
    return (uint32_t)((((unsigned long long)hi << 32) | lo) >> sh);
#else
    return __funnelshift_r(lo, hi, sh);
#endif
}

// Loads through the read-only (non-coherent) cache: weights only, which no kernel writes. Where the address depends on
// the pointer's own value (ld8_a1), nvcc can no longer prove that itself and would emit plain global loads.
QFN uint32_t ld1_nc(const uint8_t* p) {
#if defined(STRATA_HOST)
    return *p;
#else
    return __ldg(p);
#endif
}
QFN uint32_t ld4_nc(const uint8_t* p) {
#if defined(STRATA_HOST)
    return ld4(p);
#else
    return __ldg((const uint32_t*)p);
#endif
}

// 8 bytes at any address (MXFP4's 17-byte blocks put them at every offset mod 4) in three aligned word loads instead
// of eight byte loads: the words at p & ~3, p & ~3 + 4 and (p + 7) & ~3 (the second again when p is aligned), joined by
// funnel shifts. Each of the three words holds at least one of the 8 bytes, so no load leaves an allocation that holds
// them (allocations are whole words: cudaMalloc's are 256-byte aligned). Same code on the host, whose ld4 checks the
// alignment.
QFN void ld8_a1(const uint8_t* p, uint32_t& a, uint32_t& b) {
    const uint32_t o = (uint32_t)(unsigned long long)p & 3;
    const uint8_t* w = p - o;
    const uint32_t w0 = ld4_nc(w), w1 = ld4_nc(w + 4), w2 = ld4_nc(w + ((o + 7) & ~3u));
    a = strata_funnel(w0, w1, 8 * o);
    b = strata_funnel(w1, w2, 8 * o);
}
QFN float h2f_at(const uint8_t* p) { return strata_h2f(ld2(p)); }

// 8 bytes at a 2-byte-aligned address in two or three loads, never past p+8. For 256-element blocks every lane of a
// step reads the same block, and NVFP4's 36-byte blocks of a row are all alike mod 4, so the branch is uniform across
// the warp.
QFN void ld8_blk(const uint8_t* p, uint32_t& a, uint32_t& b) {
#if defined(STRATA_HOST)
    ld8_a2(p, a, b);
#else
    if (((unsigned long long)p & 2) == 0) {
        a = ld4(p); b = ld4(p + 4);
    } else {
        const uint32_t m = ld4(p + 2);
        a = (uint32_t)ld2(p) | (m << 16);
        b = (m >> 16) | ((uint32_t)ld2(p + 6) << 16);
    }
#endif
}

// 16 bytes as 4 words (16-byte aligned)
QFN void ld16(const uint8_t* p, uint32_t (&w)[4]) {
#if defined(STRATA_HOST)
    STRATA_ALIGNED(p, 16);
    memcpy(w, p, 16);
#else
    const uint4 t = *(const uint4*)p; w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
#endif
}

// an integer 0 <= u < 2^23 as a float, exactly, without the quarter-rate int-to-float unit
QFN float u2f_small(uint32_t u) {
#if defined(STRATA_HOST)
    return (float)u;
#else
    return __uint_as_float(0x4B000000u | u) - 8388608.f;
#endif
}

// byte k (0..7) of the 8 bytes (a, b)
QFN uint32_t byte8(uint32_t a, uint32_t b, int k) { return ((k < 4 ? a : b) >> (8 * (k & 3))) & 0xff; }

// Byte k of (a, b) as a float, minus off. On the GPU one byte_perm builds the float 2^23 + byte and one add removes
// 2^23 + off, both exact: cheaper than an int-to-float conversion, whose quarter-rate pipe would bound the mat-vec.
QFN float bytef(uint32_t a, uint32_t b, int k, float off = 0.f) {
#if defined(STRATA_HOST)
    return (float)byte8(a, b, k) - off;
#else
    return __uint_as_float(__byte_perm(k < 4 ? a : b, 0x4B000000u, 0x7440 | (k & 3))) - (8388608.f + off);
#endif
}

// 4 bits (bit i -> bit 0 of byte i), the high bits of Q5 / Q3_K / Q5_K values
QFN uint32_t spread4(uint32_t bits) { return ((bits & 0xf) * 0x00204081u) & 0x01010101u; }

// ---- dequant8 --------------------------------------------------------------------------------------------------------

template <int Q> QFN void dequant8(const uint8_t* __restrict__ block, int j, float (&v)[8]);

template <> QFN void dequant8<STRATA_Q_F32>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
#if defined(STRATA_HOST)
    STRATA_ALIGNED(b, 16);
    memcpy(v, b, 32);
#else
    float4 p = ((const float4*)b)[0], q = ((const float4*)b)[1];
    v[0] = p.x; v[1] = p.y; v[2] = p.z; v[3] = p.w; v[4] = q.x; v[5] = q.y; v[6] = q.z; v[7] = q.w;
#endif
}

template <> QFN void dequant8<STRATA_Q_F16>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    uint32_t w[4];
#if defined(STRATA_HOST)
    STRATA_ALIGNED(b, 16);
    memcpy(w, b, 16);
#else
    uint4 t = *(const uint4*)b; w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
#endif
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] = strata_h2f((uint16_t)(w[k] & 0xffff));
        v[2 * k + 1] = strata_h2f((uint16_t)(w[k] >> 16));
    }
}

template <> QFN void dequant8<STRATA_Q_BF16>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    uint32_t w[4];
#if defined(STRATA_HOST)
    STRATA_ALIGNED(b, 16);
    memcpy(w, b, 16);
#else
    uint4 t = *(const uint4*)b; w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
#endif
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] = strata_u2f(w[k] << 16);
        v[2 * k + 1] = strata_u2f(w[k] & 0xffff0000u);
    }
}

// Q4_0 / Q4_1 / IQ4_NL / MXFP4 / Q5_x: 32 elements; element i < 16 is the low nibble of qs[i], i >= 16 the high
// nibble of qs[i-16]. Chunk j: bytes (j&1)*8 .. +8, nibble shift (j>>1)*4.
template <> QFN void dequant8<STRATA_Q_Q4_0>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = h2f_at(b);
    uint32_t q0, q1; ld8_a2(b + 2 + (j & 1) * 8, q0, q1);
    const int sh = (j >> 1) * 4;
    q0 = (q0 >> sh) & 0x0f0f0f0fu; q1 = (q1 >> sh) & 0x0f0f0f0fu;
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * bytef(q0, q1, k, 8.f);
}

template <> QFN void dequant8<STRATA_Q_Q4_1>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const uint32_t dm = ld4(b);
    const float d = strata_h2f((uint16_t)(dm & 0xffff)), m = strata_h2f((uint16_t)(dm >> 16));
    uint32_t q0 = ld4(b + 4 + (j & 1) * 8), q1 = ld4(b + 8 + (j & 1) * 8);
    const int sh = (j >> 1) * 4;
    q0 = (q0 >> sh) & 0x0f0f0f0fu; q1 = (q1 >> sh) & 0x0f0f0f0fu;
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * bytef(q0, q1, k) + m;
}

template <> QFN void dequant8<STRATA_Q_Q5_0>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = h2f_at(b);
    const uint32_t qh = ld4_a2(b + 2) >> (j * 8);
    uint32_t q0, q1; ld8_a2(b + 6 + (j & 1) * 8, q0, q1);
    const int sh = (j >> 1) * 4;
    q0 = ((q0 >> sh) & 0x0f0f0f0fu) | (spread4(qh) << 4); q1 = ((q1 >> sh) & 0x0f0f0f0fu) | (spread4(qh >> 4) << 4);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * bytef(q0, q1, k, 16.f);
}

template <> QFN void dequant8<STRATA_Q_Q5_1>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = h2f_at(b), m = h2f_at(b + 2);
    const uint32_t qh = ld4(b + 4) >> (j * 8);
    uint32_t q0, q1; ld8(b + 8 + (j & 1) * 8, q0, q1);
    const int sh = (j >> 1) * 4;
    q0 = ((q0 >> sh) & 0x0f0f0f0fu) | (spread4(qh) << 4); q1 = ((q1 >> sh) & 0x0f0f0f0fu) | (spread4(qh >> 4) << 4);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * bytef(q0, q1, k) + m;
}

template <> QFN void dequant8<STRATA_Q_Q8_0>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = h2f_at(b);
    uint32_t q0, q1; ld8_a2(b + 2 + j * 8, q0, q1);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = bytef(q0 ^ 0x80808080u, q1 ^ 0x80808080u, k, 128.f) * d;  // int8 + 128
}

template <> QFN void dequant8<STRATA_Q_IQ4_NL>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = h2f_at(b);
    uint32_t q0, q1; ld8_a2(b + 2 + (j & 1) * 8, q0, q1);
    const int sh = (j >> 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * (float)strata_kvalues_iq4nl[(byte8(q0, q1, k) >> sh) & 0xf];
}

// e8m0 exponent to float, halved (ggml_e8m0_to_fp32_half): the doubled e2m1 values in kvalues undo the half.
QFN float strata_e8m0_half(uint32_t x) {
    return strata_u2f(x < 2 ? (0x00200000u << x) : ((x - 1) << 23));
}

// __byte_perm for selectors whose four nibbles are all < 8 (no sign-replicate bytes): byte i of the result is byte
// (s >> 4i) & 7 of b:a; the selector's bits 16..31 are ignored.
QFN uint32_t strata_prmt(uint32_t a, uint32_t b, uint32_t s) {
#if defined(STRATA_HOST)
    const unsigned long long v = ((unsigned long long)b << 32) | a;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
#else
    return __byte_perm(a, b, s);
#endif
}

// MXFP4 codes (e2m1: sign bit 3, magnitude bits 0..2), doubled as in strata_kvalues_mxfp4, in fp16 without a table:
// the doubled magnitudes 0, 1, 2, 3, 4, 6, 8, 12 are fp16 values whose low byte is 0 and whose high bytes are these 8.
// Four codes (bits 0..3 of each byte of q) become two fp16x2 words, lo = codes of bytes 0, 1 and hi = bytes 2, 3: one
// byte permute looks up two magnitudes (the selector's odd nibbles are the codes, its even ones pick a 0 byte), one
// more puts the two signs at bits 15 and 31. Exact; no memory load, no int-to-float conversion.
#define STRATA_E2M1_F16HI_0_3 0x42403C00u
#define STRATA_E2M1_F16HI_4_7 0x4A484644u
QFN void strata_e2m1x4(uint32_t q, uint32_t& lo, uint32_t& hi) {
    const uint32_t m = q & 0x07070707u, s = (q & 0x08080808u) << 4;  // magnitudes; each byte's sign at its bit 7
    lo = strata_prmt(STRATA_E2M1_F16HI_0_3, STRATA_E2M1_F16HI_4_7, m << 4) | strata_prmt(s, 0u, 0x1404u);
    hi = strata_prmt(STRATA_E2M1_F16HI_0_3, STRATA_E2M1_F16HI_4_7, m >> 12) | strata_prmt(s, 0u, 0x3424u);
}

template <> QFN void dequant8<STRATA_Q_MXFP4>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = strata_e8m0_half(ld1_nc(b));
    uint32_t q0, q1; ld8_a1(b + 1 + (j & 1) * 8, q0, q1);
    const int sh = (j >> 1) * 4;
    uint32_t h[4];
    strata_e2m1x4(q0 >> sh, h[0], h[1]);
    strata_e2m1x4(q1 >> sh, h[2], h[3]);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] = d * strata_h2f((uint16_t)(h[k] & 0xffff));
        v[2 * k + 1] = d * strata_h2f((uint16_t)(h[k] >> 16));
    }
}

// ---- Q2_0, Q1_0, NVFP4 (llama.cpp 0c1e570; engine/quant_blocks.py is the reference) ---------------------------------

// Q2_0: d @0, qs[16] @2, 64 elements; element i is bits 2(i%4) of qs[i/4], w = (q - 1) d. Chunk j is the 16 bits at
// 2 + 2j. Element k is read in place as the float 2^23 + q 4^(k%4) (one and-or: the chunk's high byte shifted down
// once), so (f - 2^23 - 4^(k%4)) * (d / 4^(k%4)) = (q - 1) d: both factors exact (d / 64 is a normal float even for
// a subnormal fp16 d), hence the reference's one rounding, with no conversion and no per-element shift.
template <> QFN void dequant8<STRATA_Q_Q2_0>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = h2f_at(b);
    const uint32_t u = ld2(b + 2 + 2 * j);
    const float dk[4] = {d, d * 0.25f, d * 0.0625f, d * 0.015625f};
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int s = 2 * (k & 3);
        const uint32_t q = (k < 4 ? u : u >> 8) & (3u << s);
        v[k] = (strata_u2f(0x4B000000u | q) - (8388608.f + (float)(1 << s))) * dk[k & 3];
    }
}

// Q1_0: d @0, qs[16] @2, 128 elements; element i is bit i%8 of qs[i/8], w = bit ? d : -d. Chunk j is byte 2 + j; a
// clear bit flips d's sign bit (the reference's -d, NaN included).
template <> QFN void dequant8<STRATA_Q_Q1_0>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const uint32_t d = strata_f2u(h2f_at(b)), neg = ~(uint32_t)b[2 + j];
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = strata_u2f(d ^ ((neg << (31 - k)) & 0x80000000u));
}

// UE4M3 (NVFP4's scale: 4 exponent bits, bias 7, 3 mantissa bits) to float, halved as ggml_ue4m3_to_fp32's E2M1
// values are doubled. Its low 7 bits moved up to fp16's exponent and mantissa are the same number times 2^-8,
// subnormals included, so one fp16 conversion and an exact scaling decode it; ggml ignores the top bit and reads 0x7F
// (E4M3's NaN) as zero.
QFN float strata_ue4m3_half(uint32_t x) {
    return x == 0x7Fu ? 0.f : strata_h2f((uint16_t)((x & 0x7Fu) << 7)) * 128.f;
}

// strata_e2m1x4 with code 8 (E2M1's -0) as +0: ggml's table has one zero, and the NVFP4 reference's floats carry its
// sign. A byte's sign bit is kept where its magnitude m is not 0 (m + 0x7F reaches bit 7; no carry leaves the byte).
QFN void strata_e2m1x4_pz(uint32_t q, uint32_t& lo, uint32_t& hi) {
    const uint32_t m = q & 0x07070707u, s = ((q & 0x08080808u) << 4) & (m + 0x7F7F7F7Fu);
    lo = strata_prmt(STRATA_E2M1_F16HI_0_3, STRATA_E2M1_F16HI_4_7, m << 4) | strata_prmt(s, 0u, 0x1404u);
    hi = strata_prmt(STRATA_E2M1_F16HI_0_3, STRATA_E2M1_F16HI_4_7, m >> 12) | strata_prmt(s, 0u, 0x3424u);
}

// NVFP4: 4 UE4M3 scales @0 (one per 16 elements), qs[32] @4, 64 elements; sub-block s: element i < 8 is the low
// nibble of qs[8s + i], i + 8 its high nibble. Chunk j: the 8 bytes at 4 + 8(j/2), nibble shift (j%2)*4. The codes
// are MXFP4's; scale times code is exact (4 significant bits each), as in the reference.
template <> QFN void dequant8<STRATA_Q_NVFP4>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    const float d = strata_ue4m3_half(b[j >> 1]);
    uint32_t q0, q1; ld8_blk(b + 4 + (j >> 1) * 8, q0, q1);
    const int sh = (j & 1) * 4;
    uint32_t h[4];
    strata_e2m1x4_pz(q0 >> sh, h[0], h[1]);
    strata_e2m1x4_pz(q1 >> sh, h[2], h[3]);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        v[2 * k] = d * strata_h2f((uint16_t)(h[k] & 0xffff));
        v[2 * k + 1] = d * strata_h2f((uint16_t)(h[k] >> 16));
    }
}

// ---- K-quants (256 elements) -----------------------------------------------------------------------------------------

template <> QFN void dequant8<STRATA_Q_Q2_K>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // scales[16] @0, qs[64] @16, d @80, dmin @82; element e = 128h + 32s + l: (qs[32h + l] >> 2s) & 3, scale e/16
    const uint32_t sc = b[j >> 1];
    const uint32_t dd = ld4(b + 80);
    const float dl = strata_h2f((uint16_t)(dd & 0xffff)) * u2f_small(sc & 0xf);
    const float ml = strata_h2f((uint16_t)(dd >> 16)) * u2f_small(sc >> 4);
    const uint8_t* qs = b + 16 + (j >> 4) * 32 + (j & 3) * 8;  // 84-byte blocks: 4-byte aligned only
    uint32_t q0 = ld4(qs), q1 = ld4(qs + 4);
    const int sh = ((j >> 2) & 3) * 2;
    q0 = (q0 >> sh) & 0x03030303u; q1 = (q1 >> sh) & 0x03030303u;
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = dl * bytef(q0, q1, k) - ml;
}

template <> QFN void dequant8<STRATA_Q_Q3_K>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // hmask[32] @0, qs[64] @32, scales[12] @96, d @108
    const int s = j >> 1;  // 16-element sub-block
    const uint8_t* sc = b + 96;
    const uint32_t lo = s < 8 ? (sc[s] & 0xf) : (sc[s - 8] >> 4);
    const uint32_t hi = (sc[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    const float dl = h2f_at(b + 108) * (u2f_small(lo | (hi << 4)) - 32.f);
    const int l0 = (j & 3) * 8;
    uint32_t q0, q1; ld8_blk(b + 32 + (j >> 4) * 32 + l0, q0, q1);
    uint32_t h0, h1; ld8_blk(b + l0, h0, h1);
    const int sh = ((j >> 2) & 3) * 2, hb = j >> 2;
    // q = low2 - 4 * (1 - hbit) = (low2 | hbit << 2) - 4
    q0 = ((q0 >> sh) & 0x03030303u) | (((h0 >> hb) & 0x01010101u) << 2);
    q1 = ((q1 >> sh) & 0x03030303u) | (((h1 >> hb) & 0x01010101u) << 2);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = dl * bytef(q0, q1, k, 4.f);
}

// Q4_K / Q5_K block header, one 16-byte load: w[0] = d | dmin << 16, w[1..3] = the 12 packed scale bytes q[0..11].
// dl = d * scale and ml = dmin * min of sub-block s (0..7), as gguf's Q4_K.get_scale_min unpacks them.
QFN void strata_k4_header(const uint8_t* __restrict__ b, int s, float& dl, float& ml) {
    uint32_t w[4]; ld16(b, w);
    const int sh = 8 * (s & 3);
    const uint32_t q_lo = (w[1] >> sh) & 0xff, q_mid = (w[2] >> sh) & 0xff, q_hi = (w[3] >> sh) & 0xff;
    // s < 4: sc = q[s] & 63, m = q[s+4] & 63; s >= 4: sc = (q[s+4] & 15) | (q[s-4] >> 6) << 4,
    //                                               m = (q[s+4] >> 4) | (q[s] >> 6) << 4
    const uint32_t sc = s < 4 ? (q_lo & 0x3f) : ((q_hi & 0x0f) | ((q_lo >> 2) & 0x30));
    const uint32_t m = s < 4 ? (q_mid & 0x3f) : ((q_hi >> 4) | ((q_mid >> 2) & 0x30));
    dl = strata_h2f((uint16_t)(w[0] & 0xffff)) * u2f_small(sc);
    ml = strata_h2f((uint16_t)(w[0] >> 16)) * u2f_small(m);
}

template <> QFN void dequant8<STRATA_Q_Q4_K>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, dmin @2, scales[12] @4, qs[128] @16; sub-block s = j/4 takes nibble s&1 of qs[32(s/2) ..]
    const int s = j >> 2;
    float dl, ml; strata_k4_header(b, s, dl, ml);
    uint32_t q0, q1; ld8(b + 16 + (s >> 1) * 32 + (j & 3) * 8, q0, q1);
    const int sh = (s & 1) * 4;
    q0 = (q0 >> sh) & 0x0f0f0f0fu; q1 = (q1 >> sh) & 0x0f0f0f0fu;
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = dl * bytef(q0, q1, k) - ml;
}

template <> QFN void dequant8<STRATA_Q_Q5_K>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48; high bit s of qh[l]
    const int s = j >> 2, l0 = (j & 3) * 8;
    float dl, ml; strata_k4_header(b, s, dl, ml);
    uint32_t q0, q1; ld8(b + 48 + (s >> 1) * 32 + l0, q0, q1);
    uint32_t h0, h1; ld8(b + 16 + l0, h0, h1);
    const int sh = (s & 1) * 4;
    q0 = ((q0 >> sh) & 0x0f0f0f0fu) | (((h0 >> s) & 0x01010101u) << 4);
    q1 = ((q1 >> sh) & 0x0f0f0f0fu) | (((h1 >> s) & 0x01010101u) << 4);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = dl * bytef(q0, q1, k) - ml;
}

template <> QFN void dequant8<STRATA_Q_Q6_K>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // ql[128] @0, qh[64] @128, scales int8[16] @192, d @208; element e = 128h + r:
    // low 4 bits: nibble r/64 of ql[64h + r%64]; high 2 bits: (qh[32h + r%32] >> 2(r/32)) & 3
    const int h = j >> 4, r0 = (j & 15) * 8;
    const float dl = h2f_at(b + 208) * (u2f_small(b[192 + (j >> 1)] ^ 0x80u) - 128.f);  // int8 + 128
    uint32_t q0, q1; ld8_blk(b + h * 64 + (r0 & 63), q0, q1);
    uint32_t h0, h1; ld8_blk(b + 128 + h * 32 + (r0 & 31), h0, h1);
    const int sl = (r0 >> 6) * 4, shh = (r0 >> 5) * 2;
    q0 = ((q0 >> sl) & 0x0f0f0f0fu) | (((h0 >> shh) & 0x03030303u) << 4);
    q1 = ((q1 >> sl) & 0x0f0f0f0fu) | (((h1 >> shh) & 0x03030303u) << 4);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = dl * bytef(q0, q1, k, 32.f);
}

template <> QFN void dequant8<STRATA_Q_IQ4_XS>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, scales_h u16 @2, scales_l[4] @4, qs[128] @8; sub-block s = j/4: 16 bytes at 8+16s, low nibbles first
    const int s = j >> 2;
    const uint32_t lo = (b[4 + (s >> 1)] >> (4 * (s & 1))) & 0xf, hi = (ld2(b + 2) >> (2 * s)) & 3;
    const float dl = h2f_at(b) * (u2f_small(lo | (hi << 4)) - 32.f);
    uint32_t q0, q1; ld8(b + 8 + s * 16 + (j & 1) * 8, q0, q1);
    const int sh = ((j >> 1) & 1) * 4;
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = dl * (float)strata_kvalues_iq4nl[(byte8(q0, q1, k) >> sh) & 0xf];
}

// ---- i-quants with grids (256 elements) -------------------------------------------------------------------------------

QFN void strata_grid8(float db, unsigned long long g, uint32_t signs, float (&v)[8]) {
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float x = db * (float)((g >> (8 * k)) & 0xff);
        v[k] = ((signs >> k) & 1) ? -x : x;
    }
}

template <> QFN void dequant8<STRATA_Q_IQ2_XXS>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, then 8 groups of (aux0: 4 grid indices, aux1: 4x7 sign bits + 4-bit scale) for 32 elements each
    const int g = j >> 2, i = j & 3;
    const uint32_t aux0 = ld4_a2(b + 2 + 8 * g), aux1 = ld4_a2(b + 6 + 8 * g);
    const float db = h2f_at(b) * (0.5f + (float)(aux1 >> 28)) * 0.25f;
    strata_grid8(db, strata_iq2xxs_grid[(aux0 >> (8 * i)) & 0xff], strata_ksigns[(aux1 >> (7 * i)) & 0x7f], v);
}

template <> QFN void dequant8<STRATA_Q_IQ2_XS>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, qs u16[32] @2 (9-bit grid index, 7-bit sign index), scales[8] @66 (a 4-bit scale per 16 elements)
    const uint32_t q = ld2(b + 2 + 2 * j);
    const uint32_t sc = (b[66 + (j >> 2)] >> (4 * ((j >> 1) & 1))) & 0xf;
    const float db = h2f_at(b) * (0.5f + (float)sc) * 0.25f;
    strata_grid8(db, strata_iq2xs_grid[q & 511], strata_ksigns[q >> 9], v);
}

template <> QFN void dequant8<STRATA_Q_IQ2_S>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, qs[32] @2, signs[32] @34, qh[8] @66 (2 high index bits per chunk), scales[8] @74
    const uint32_t idx = b[2 + j] | (((b[66 + (j >> 2)] >> (2 * (j & 3))) & 3) << 8);
    const uint32_t sc = (b[74 + (j >> 2)] >> (4 * ((j >> 1) & 1))) & 0xf;
    const float db = h2f_at(b) * (0.5f + (float)sc) * 0.25f;
    strata_grid8(db, strata_iq2s_grid[idx], b[34 + j], v);
}

QFN void strata_grid4x2(float db, uint32_t g0, uint32_t g1, uint32_t signs, float (&v)[8]) {
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const float x = db * (float)(((k < 4 ? g0 : g1) >> (8 * (k & 3))) & 0xff);
        v[k] = ((signs >> k) & 1) ? -x : x;
    }
}

template <> QFN void dequant8<STRATA_Q_IQ3_XXS>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, qs[64] @2 (one 4-value grid index each), then u32[8] @66: 4x7 sign bits + 4-bit scale per 32 elements
    const uint32_t aux = ld4_a2(b + 66 + 4 * (j >> 2));
    const float db = h2f_at(b) * (0.5f + (float)(aux >> 28)) * 0.5f;
    strata_grid4x2(db, strata_iq3xxs_grid[b[2 + 2 * j]], strata_iq3xxs_grid[b[3 + 2 * j]],
                   strata_ksigns[(aux >> (7 * (j & 3))) & 0x7f], v);
}

template <> QFN void dequant8<STRATA_Q_IQ3_S>(const uint8_t* __restrict__ b, int j, float (&v)[8]) {
    // d @0, qs[64] @2, qh[8] @66 (9th index bit), signs[32] @74, scales[4] @106 (a 4-bit scale per 32 elements)
    const uint32_t qh = b[66 + (j >> 2)] >> (2 * (j & 3));
    const uint32_t i0 = b[2 + 2 * j] | ((qh & 1) << 8), i1 = b[3 + 2 * j] | (((qh >> 1) & 1) << 8);
    const uint32_t sc = (b[106 + (j >> 3)] >> (4 * ((j >> 2) & 1))) & 0xf;
    const float db = h2f_at(b) * (float)(1 + 2 * sc);
    strata_grid4x2(db, strata_iq3s_grid[i0], strata_iq3s_grid[i1], b[74 + j], v);
}

// ---- dot products ---------------------------------------------------------------------------------------------------

QFN void strata_load8(const float* __restrict__ x, float (&xv)[8]) {
#if defined(STRATA_HOST)
    STRATA_ALIGNED(x, 16);
    memcpy(xv, x, 32);
#else
    const float4 a = ((const float4*)x)[0], c = ((const float4*)x)[1];
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w; xv[4] = c.x; xv[5] = c.y; xv[6] = c.z; xv[7] = c.w;
#endif
}

// U chunks per lane and step, c0, c0+32, ..., c0+32(U-1), for R rows and NV vectors. The step has no branch, so the
// compiler can issue all U*R chunks' loads before the arithmetic (docs/experiments.md, "Loads before arithmetic").
template <int Q, int R, int NV, int U>
QFN void strata_dot_step(const uint8_t* const (&rows)[R], const float* __restrict__ x, int ldx, int c0,
                         float (&acc)[R][NV]) {
    constexpr int CPB = QTraits<Q>::QK / 8, BYTES = QTraits<Q>::BYTES;
    float w[U][R][8];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = c0 + 32 * u, off = (c / CPB) * BYTES, j = c % CPB;
#pragma unroll
        for (int r = 0; r < R; r++) dequant8<Q>(rows[r] + off, j, w[u][r]);
    }
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int n = 0; n < NV; n++) {
            float xv[8];
            strata_load8(x + n * ldx + (c0 + 32 * u) * 8, xv);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int k = 0; k < 8; k++) acc[r][n] += w[u][r][k] * xv[k];
        }
}

// R rows (any addresses) x NV vectors: acc[r][n] += this lane's partial of dot(rows[r], x + n*ldx). Lane `lane` of 32
// takes the 8-element chunks lane, lane+32, ...: consecutive lanes read consecutive bytes of a block, so a warp's
// loads coalesce. Each x chunk is loaded once for all R rows (x comes from L1 at 32 bytes per 8 weights).
template <int Q, int R, int NV>
QFN void dot_rows(const uint8_t* const (&rows)[R], const float* __restrict__ x, int ldx, int ncols, int lane,
                  float (&acc)[R][NV]) {
    constexpr int U = R >= 4 ? 1 : 4 / R;  // about four chunks of loads in flight per lane
    const int nchunks = ncols >> 3;
    int c = lane;
    for (; c + 32 * (U - 1) < nchunks; c += 32 * U) strata_dot_step<Q, R, NV, U>(rows, x, ldx, c, acc);
    for (; c < nchunks; c += 32) strata_dot_step<Q, R, NV, 1>(rows, x, ldx, c, acc);
}

template <int Q> QFN float dot_row(const uint8_t* __restrict__ row, const float* __restrict__ x, int ncols, int lane) {
    const uint8_t* rows[1] = {row};
    float acc[1][1] = {{0.f}};
    dot_rows<Q, 1, 1>(rows, x, 0, ncols, lane, acc);
    return acc[0][0];
}

template <int Q, int NV>
QFN void dot_row_nv(const uint8_t* __restrict__ row, const float* __restrict__ x, int ldx, int ncols, int lane,
                    float (&acc)[NV]) {
    const uint8_t* rows[1] = {row};
    float a[1][NV];
#pragma unroll
    for (int n = 0; n < NV; n++) a[0][n] = 0.f;
    dot_rows<Q, 1, NV>(rows, x, ldx, ncols, lane, a);
#pragma unroll
    for (int n = 0; n < NV; n++) acc[n] += a[0][n];
}

#if !defined(STRATA_HOST)
QFN float strata_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
#endif

// Every type id above, for X-macro instantiation: STRATA_FOR_EACH_QTYPE(M) expands M(NAME) for each.
#define STRATA_FOR_EACH_QTYPE(M) \
    M(F32) M(F16) M(BF16) M(Q4_0) M(Q4_1) M(Q5_0) M(Q5_1) M(Q8_0) M(Q2_K) M(Q3_K) M(Q4_K) M(Q5_K) M(Q6_K) \
    M(IQ4_NL) M(IQ4_XS) M(IQ2_XXS) M(IQ2_XS) M(IQ2_S) M(IQ3_XXS) M(IQ3_S) M(MXFP4) M(Q2_0) M(Q1_0) M(NVFP4)
