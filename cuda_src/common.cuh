// Small helpers shared by the engine's kernels (not the quantization layer, which is quant.cuh).
#pragma once
#include "quant.cuh"   // the integer typedefs (NVRTC builds use no system headers)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `buf` needs blockDim.x/32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* buf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    float t = 0.f;
    for (int i = 0; i < nw; ++i) t += buf[i];
    return t;
}

// RoPE's pairing for dimension d < n_rot (half = n_rot / 2): its cos/sin index j, the partner dimension and the sign
// of the partner's term (NeoX: halves rotate together; otherwise adjacent pairs). Rotated value:
// x[d] * cos + sign * x[partner] * sin.
__device__ __forceinline__ void rope_pair(int d, int half, int neox, int& j, int& partner, float& sign) {
    if (neox) {
        j = d < half ? d : d - half;
        partner = d < half ? d + half : d - half;
        sign = d < half ? -1.f : 1.f;
    } else {
        j = d / 2;
        partner = d ^ 1;
        sign = (d & 1) ? 1.f : -1.f;
    }
}

// Element d of one q or k head (blockDim.x == head_dim, thread d holding val) after the optional per-head RMSNorm
// (weights nw, may be null) and RoPE at position pos: the body of the prompt pass's K/V stores for both cache
// layouts (norm_rope.cu qk_rope_store, attention.cu qk_rope_store_kv8). hv: head_dim floats of shared memory,
// buf: block_sum's 32.
__device__ __forceinline__ float norm_rope_value(float val, const float* __restrict__ nw,
                                                 const float2* __restrict__ rope_cs, int pos, int d, int head_dim,
                                                 int n_rot, int neox, float eps, float* hv, float* buf) {
    if (nw) {
        const float s = block_sum(val * val, buf);
        val = val * rsqrtf(s / head_dim + eps) * nw[d];
    }
    hv[d] = val;
    __syncthreads();
    if (d < n_rot) {
        const int half_rot = n_rot / 2;
        int i, partner;
        float sign;
        rope_pair(d, half_rot, neox, i, partner, sign);
        const float2 cs = rope_cs[(long long)pos * half_rot + i];
        val = hv[d] * cs.x + sign * hv[partner] * cs.y;
    }
    return val;
}

#define NEG_INF __int_as_float(0xff800000)

// fp16 <-> fp32 without cuda_fp16.h (NVRTC finds no CUDA headers unless told where they are)
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }
// gpt-oss's SWIGLU_OAI (engine/arch/gptoss.py swiglu_oai; ggml's alpha 1.702 and limit 7): the gate clamped above at
// 7, up clamped to +-7 and offset by 1
__device__ __forceinline__ float swiglu_oai(float g, float u) {
    const float x = fminf(g, 7.f), y = fminf(fmaxf(u, -7.f), 7.f);
    return x / (1.f + __expf(-1.702f * x)) * (y + 1.f);
}

// ---- "the last block does the epilogue" -------------------------------------------------------------------------
// A kernel whose blocks each write part of a vector can finish a reduction over all of it without another launch
// (inside a graph a launch costs more than the work here): every block fences its writes and counts itself in; the
// block that counts last sees everything and runs the epilogue, then resets the counter for the next launch.
// All threads of every block must call it (no early returns before it).
__device__ __forceinline__ bool last_block(int* counter) {
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int total = gridDim.x * gridDim.y * gridDim.z;
        is_last = atomicAdd(counter, 1) == total - 1;
        if (is_last) *counter = 0;
    }
    __syncthreads();
    if (is_last) __threadfence();
    return is_last;
}

// ---- wide Q4_K reads --------------------------------------------------------------------------------------------
// quant.cuh's dot_row reads 8 elements per lane per step; for Q4_K (the benchmark model's type) a lane here takes a
// 16-byte slice of a block's quants (32 elements: 16 low nibbles of one sub-block, 16 high of the next) in one load,
// which halves the load instructions and the dependent rounds per row. Checked against gguf by the same tests.

// scale and min of sub-block s (0..7) of a Q4_K block (ggml get_scale_min_k4)
__device__ __forceinline__ void q4k_sm(const uint8_t* __restrict__ b, int s, float& sc, float& mn) {
    const uint8_t* q = b + 4;
    if (s < 4) {
        sc = (float)(q[s] & 63);
        mn = (float)(q[s + 4] & 63);
    } else {
        sc = (float)((q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4));
        mn = (float)((q[s + 4] >> 4) | ((q[s] >> 6) << 4));
    }
}

// ---- x staged in shared memory ------------------------------------------------------------------------------
// A decode mat-vec reads its whole input vector once per row; from L1 that costs more wavefronts than the weight
// bytes (a Q4_K unit's eight float4 x loads touch 16 cache lines per warp). Staged in shared memory once per block,
// with Q4_K's padded layout (4 floats after every 64: the 8 lanes of a quarter-warp read float4s 16 or 64 floats
// apart, which the padding spreads over all 32 banks), the same reads take 4 wavefronts. The staging block can
// apply the RMSNorm itself (the consumer recomputes sum(x^2) of an n_embd vector that sits in L2): no norm launch.
extern __shared__ float4 strata_smem4[];   // dynamic shared memory: the launch passes staged_bytes(n) (decode.py)

template <int QT> __device__ __forceinline__ int xs_at(int i) { return QT == STRATA_Q_Q4_K ? i + ((i >> 6) << 2) : i; }

// Stage x[0, n) into xs (any offset of the dynamic shared memory), as x / rms(x) * w when w is given (x 16-byte
// aligned, n a multiple of 4); red: 32 floats of shared memory for the block sum. Every thread of the block calls it;
// it does not synchronise after the writes (stage_x does; window.cuh win_stage stages several tokens, then does).
template <int QT>
__device__ __forceinline__ void stage_x_to(const float* x, const float* __restrict__ w, float eps, int n, float* xs,
                                           float* red) {
    float inv = 1.f;
    if (w) {
        float s = 0.f;
        for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x) {
            const float4 v = *reinterpret_cast<const float4*>(x + i);
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        inv = rsqrtf(block_sum(s, red) / n + eps);
    }
    for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        if (w) {
            const float4 g = *reinterpret_cast<const float4*>(w + i);
            v.x = v.x * inv * g.x;
            v.y = v.y * inv * g.y;
            v.z = v.z * inv * g.z;
            v.w = v.w * inv * g.w;
        }
        *reinterpret_cast<float4*>(xs + xs_at<QT>(i)) = v;
    }
}

// Stage x[0, n) into shared memory, as x / rms(x) * w when w is given (x16-byte aligned, n a multiple of 4). Every
// thread of the block calls it (it synchronises); returns the staged vector, laid out for readers of type QT.
template <int QT>
__device__ __forceinline__ const float* stage_x(const float* x, const float* __restrict__ w, float eps, int n) {
    __shared__ float red[32];
    float* xs = reinterpret_cast<float*>(strata_smem4);
    stage_x_to<QT>(x, w, eps, n, xs, red);
    __syncthreads();
    return xs;
}

// unit u of a row (8 per 256-element block): bytes 16 + 32j + 16hh of block u/8, j = (u/2)%4, hh = u%2
__device__ __forceinline__ float q4k_unit(const uint8_t* __restrict__ row, const float* __restrict__ x, int u) {
    const int blk = u >> 3, j = (u >> 1) & 3, hh = u & 1;
    const uint8_t* b = row + blk * 144;
    const uint4 qv = *reinterpret_cast<const uint4*>(b + 16 + 32 * j + 16 * hh);
    const unsigned int dd = *reinterpret_cast<const unsigned int*>(b);
    const float d = h2f((unsigned short)(dd & 0xffff)), dmin = h2f((unsigned short)(dd >> 16));
    float sc0, m0, sc1, m1;
    q4k_sm(b, 2 * j, sc0, m0);
    q4k_sm(b, 2 * j + 1, sc1, m1);
    const float4* x0 = reinterpret_cast<const float4*>(x + blk * 256 + 64 * j + 16 * hh);
    const float4* x1 = x0 + 8;   // +32 elements: the high nibbles
    const unsigned int w[4] = {qv.x, qv.y, qv.z, qv.w};
    float s0 = 0.f, s1 = 0.f, t0 = 0.f, t1 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 a = x0[i], c = x1[i];
        const unsigned int q = w[i];
        s0 += (float)(q & 15) * a.x + (float)((q >> 8) & 15) * a.y + (float)((q >> 16) & 15) * a.z +
              (float)((q >> 24) & 15) * a.w;
        s1 += (float)((q >> 4) & 15) * c.x + (float)((q >> 12) & 15) * c.y + (float)((q >> 20) & 15) * c.z +
              (float)(q >> 28) * c.w;
        t0 += a.x + a.y + a.z + a.w;
        t1 += c.x + c.y + c.z + c.w;
    }
    return d * (sc0 * s0 + sc1 * s1) - dmin * (m0 * t0 + m1 * t1);
}

// This lane's partial of row . x: quant.cuh's dot_row, or the wide Q4_K read.
template <int QT>
__device__ __forceinline__ float dotw(const uint8_t* __restrict__ row, const float* __restrict__ x, int ncols,
                                      int lane) {
    return dot_row<QT>(row, x, ncols, lane);
}
template <>
__device__ __forceinline__ float dotw<STRATA_Q_Q4_K>(const uint8_t* __restrict__ row, const float* __restrict__ x,
                                                     int ncols, int lane) {
    // unrolled so that each lane has several 16-byte loads in flight: that, not arithmetic, sets the speed
    float acc = 0.f;
    const int n = ncols / 32;
#pragma unroll 4
    for (int u = lane; u < n; u += 32) acc += q4k_unit(row, x, u);
    return acc;
}

// A Q4_K unit as two 16-byte loads: the block header (d, dmin, the 12 scale bytes) and the unit's quants. Loaded
// apart from the arithmetic, so a kernel can have all its units' loads in flight (or issue them before it stages
// x) and unpack the scales from registers.
struct Q4KRaw {
    uint4 hd, qs;
};
__device__ __forceinline__ Q4KRaw q4k_load(const uint8_t* __restrict__ row, int u) {
    const uint8_t* b = row + (u >> 3) * 144;
    Q4KRaw r;
    r.hd = *reinterpret_cast<const uint4*>(b);
    r.qs = *reinterpret_cast<const uint4*>(b + 16 + 32 * ((u >> 1) & 3) + 16 * (u & 1));
    return r;
}
// the unit's 32 elements and their d*scale, dmin*min (sub-blocks 2j and 2j+1), x staged padded
__device__ __forceinline__ void q4k_unpack(const Q4KRaw& r, int u, float& d0, float& mn0, float& d1, float& mn1) {
    const int j = (u >> 1) & 3;
    const float d = h2f((unsigned short)(r.hd.x & 0xffff)), dmin = h2f((unsigned short)(r.hd.x >> 16));
    unsigned int sc0, m0, sc1, m1;
    if (j < 2) {          // sub-blocks 0..3: 6-bit scale in q[s], min in q[s + 4]
        const int sh = 16 * j;
        sc0 = (r.hd.y >> sh) & 63;
        m0 = (r.hd.z >> sh) & 63;
        sc1 = (r.hd.y >> (sh + 8)) & 63;
        m1 = (r.hd.z >> (sh + 8)) & 63;
    } else {              // sub-blocks 4..7: low 4 bits in q[s + 4], high 2 bits in the top of q[s - 4] / q[s]
        const int sh = 16 * (j - 2);
        const unsigned int lo0 = r.hd.w >> sh, lo1 = r.hd.w >> (sh + 8);
        sc0 = (lo0 & 0xF) | (((r.hd.y >> (sh + 6)) & 3) << 4);
        m0 = ((lo0 >> 4) & 0xF) | (((r.hd.z >> (sh + 6)) & 3) << 4);
        sc1 = (lo1 & 0xF) | (((r.hd.y >> (sh + 14)) & 3) << 4);
        m1 = ((lo1 >> 4) & 0xF) | (((r.hd.z >> (sh + 14)) & 3) << 4);
    }
    d0 = d * (float)sc0;
    mn0 = dmin * (float)m0;
    d1 = d * (float)sc1;
    mn1 = dmin * (float)m1;
}
// the staged x of unit u: its low-nibble run (the high run is 32 floats on, in the same padded 64-float stretch)
__device__ __forceinline__ const float4* q4k_xs(const float* xs, int u) {
    const int e0 = (u >> 3) * 256 + 64 * ((u >> 1) & 3) + 16 * (u & 1);
    return reinterpret_cast<const float4*>(xs + e0 + ((e0 >> 6) << 2));
}
// sum over the unit of (q * x) for the low and high nibbles, and of x (for the mins)
__device__ __forceinline__ void q4k_sums(const uint4& qv, const float4* x0, float& s0, float& s1, float& t0,
                                         float& t1) {
    const float4* x1 = x0 + 8;
    const unsigned int w[4] = {qv.x, qv.y, qv.z, qv.w};
    s0 = s1 = t0 = t1 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float4 a = x0[i], c = x1[i];
        const unsigned int q = w[i];
        s0 += (float)(q & 15) * a.x + (float)((q >> 8) & 15) * a.y + (float)((q >> 16) & 15) * a.z +
              (float)((q >> 24) & 15) * a.w;
        s1 += (float)((q >> 4) & 15) * c.x + (float)((q >> 12) & 15) * c.y + (float)((q >> 20) & 15) * c.z +
              (float)(q >> 28) * c.w;
        t0 += a.x + a.y + a.z + a.w;
        t1 += c.x + c.y + c.z + c.w;
    }
}
__device__ __forceinline__ float q4k_dot(const Q4KRaw& r, const float* xs, int u) {
    float d0, mn0, d1, mn1, s0, s1, t0, t1;
    q4k_unpack(r, u, d0, mn0, d1, mn1);
    q4k_sums(r.qs, q4k_xs(xs, u), s0, s1, t0, t1);
    return d0 * s0 + d1 * s1 - (mn0 * t0 + mn1 * t1);
}
// two rows' units against one staged x (gate and up): x read once
__device__ __forceinline__ void q4k_dot2(const Q4KRaw& ra, const Q4KRaw& rb, const float* xs, int u, float& a,
                                         float& b) {
    const float4* x0 = q4k_xs(xs, u);
    float d0, mn0, d1, mn1, s0, s1, t0, t1;
    q4k_unpack(ra, u, d0, mn0, d1, mn1);
    q4k_sums(ra.qs, x0, s0, s1, t0, t1);
    a += d0 * s0 + d1 * s1 - (mn0 * t0 + mn1 * t1);
    const unsigned int w[4] = {rb.qs.x, rb.qs.y, rb.qs.z, rb.qs.w};
    const float4* x1 = x0 + 8;
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {      // the x sums t0, t1 are the same for the second row
        const float4 c0 = x0[i], c1 = x1[i];
        const unsigned int q = w[i];
        p0 += (float)(q & 15) * c0.x + (float)((q >> 8) & 15) * c0.y + (float)((q >> 16) & 15) * c0.z +
              (float)((q >> 24) & 15) * c0.w;
        p1 += (float)((q >> 4) & 15) * c1.x + (float)((q >> 12) & 15) * c1.y + (float)((q >> 20) & 15) * c1.z +
              (float)(q >> 28) * c1.w;
    }
    q4k_unpack(rb, u, d0, mn0, d1, mn1);
    b += d0 * p0 + d1 * p1 - (mn0 * t0 + mn1 * t1);
}

// dotw over x staged by stage_x<QT> (padded for Q4_K): a lane's Q4_K units, all loads issued before the arithmetic.
#define Q4K_BATCH 2     // units per row and lane in flight at once (2 covers a 2048-wide row; registers bound occupancy)
template <int QT>
__device__ __forceinline__ float dot_s(const uint8_t* __restrict__ row, const float* xs, int ncols, int lane) {
    if constexpr (QT == STRATA_Q_Q4_K) {
        float acc = 0.f;
        const int n = ncols / 32;
        for (int u0 = lane; u0 < n; u0 += 32 * Q4K_BATCH) {
            Q4KRaw r[Q4K_BATCH];
#pragma unroll
            for (int i = 0; i < Q4K_BATCH; ++i)
                if (u0 + 32 * i < n) r[i] = q4k_load(row, u0 + 32 * i);
#pragma unroll
            for (int i = 0; i < Q4K_BATCH; ++i)
                if (u0 + 32 * i < n) acc += q4k_dot(r[i], xs, u0 + 32 * i);
        }
        return acc;
    } else {
        return dot_row<QT>(row, xs, ncols, lane);
    }
}

// This lane's partials of two rows' dot products with one x (gate and up): the two rows' loads interleave.
template <int QT>
__device__ __forceinline__ void dot2_row(const uint8_t* __restrict__ ra, const uint8_t* __restrict__ rb,
                                         const float* __restrict__ x, int ncols, int lane, float& a, float& b) {
    constexpr int CPB = QTraits<QT>::QK / 8, BYTES = QTraits<QT>::BYTES;
    const int nchunks = ncols >> 3;
    a = 0.f;
    b = 0.f;
#pragma unroll 2
    for (int c = lane; c < nchunks; c += 32) {
        float wa[8], wb[8], xv[8];
        dequant8<QT>(ra + (c / CPB) * BYTES, c % CPB, wa);
        dequant8<QT>(rb + (c / CPB) * BYTES, c % CPB, wb);
        strata_load8(x + c * 8, xv);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            a += wa[i] * xv[i];
            b += wb[i] * xv[i];
        }
    }
}

// A lane's first batch of a Q4_K row, loaded before the kernel stages x (their latency overlaps the staging), and
// the row's dot product once x is staged: that batch, then the rest of the row (rows wider than 32 * 32 * batch).
template <int B = Q4K_BATCH>
__device__ __forceinline__ void q4k_preload(const uint8_t* __restrict__ row, int ncols, int lane, Q4KRaw (&p)[B]) {
#pragma unroll
    for (int i = 0; i < B; ++i)
        if (lane + 32 * i < ncols / 32) p[i] = q4k_load(row, lane + 32 * i);
}
#define Q4K_PRE_COLS (32 * 32 * Q4K_BATCH)    // the columns a preloaded batch covers (a multiple of 256)
template <int B = Q4K_BATCH>
__device__ __forceinline__ float q4k_finish(const Q4KRaw (&p)[B], const uint8_t* __restrict__ row, const float* xs,
                                            int ncols, int lane) {
    constexpr int PRE = 32 * 32 * B;
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < B; ++i)
        if (lane + 32 * i < ncols / 32) acc += q4k_dot(p[i], xs, lane + 32 * i);
    if (ncols > PRE)
        acc += dot_s<STRATA_Q_Q4_K>(row + PRE / 256 * 144, xs + xs_at<STRATA_Q_Q4_K>(PRE), ncols - PRE, lane);
    return acc;
}

// dot2_row over x staged by stage_x<QT> (padded for Q4_K): both rows' loads issued before the arithmetic.
template <int QT>
__device__ __forceinline__ void dot2_s(const uint8_t* __restrict__ ra, const uint8_t* __restrict__ rb,
                                       const float* xs, int ncols, int lane, float& a, float& b) {
    if constexpr (QT == STRATA_Q_Q4_K) {
        a = 0.f;
        b = 0.f;
        const int n = ncols / 32;
        for (int u0 = lane; u0 < n; u0 += 32 * Q4K_BATCH) {
            Q4KRaw p[Q4K_BATCH], q[Q4K_BATCH];
#pragma unroll
            for (int i = 0; i < Q4K_BATCH; ++i)
                if (u0 + 32 * i < n) {
                    p[i] = q4k_load(ra, u0 + 32 * i);
                    q[i] = q4k_load(rb, u0 + 32 * i);
                }
#pragma unroll
            for (int i = 0; i < Q4K_BATCH; ++i)
                if (u0 + 32 * i < n) q4k_dot2(p[i], q[i], xs, u0 + 32 * i, a, b);
        }
    } else {
        dot2_row<QT>(ra, rb, xs, ncols, lane, a, b);
    }
}

// the two-row (gate and up) version of q4k_finish
__device__ __forceinline__ void q4k_finish2(const Q4KRaw (&p)[Q4K_BATCH], const Q4KRaw (&q)[Q4K_BATCH],
                                            const uint8_t* __restrict__ ra, const uint8_t* __restrict__ rb,
                                            const float* xs, int ncols, int lane, float& a, float& b) {
    a = 0.f;
    b = 0.f;
#pragma unroll
    for (int i = 0; i < Q4K_BATCH; ++i)
        if (lane + 32 * i < ncols / 32) q4k_dot2(p[i], q[i], xs, lane + 32 * i, a, b);
    if (ncols > Q4K_PRE_COLS) {
        float a2, b2;
        dot2_s<STRATA_Q_Q4_K>(ra + Q4K_PRE_COLS / 256 * 144, rb + Q4K_PRE_COLS / 256 * 144,
                              xs + xs_at<STRATA_Q_Q4_K>(Q4K_PRE_COLS), ncols - Q4K_PRE_COLS, lane, a2, b2);
        a += a2;
        b += b2;
    }
}

// Per-step values a decode step reads (device memory): written by the previous step's step_advance (sample.cu), or
// by the host (a stream-ordered copy) before a step whose input it gives; the first kernel copies them into state.
// params[0] = token, params[1] = position.   state[0] = token, state[1] = position, state[2..3] = argmax word.
#define P_TOKEN 0
#define P_POS 1
