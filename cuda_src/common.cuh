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

// out = x / rms(x) * w over n values, by the calling block (x read past L1: other blocks wrote it).
__device__ __forceinline__ void block_rmsnorm(const float* x, const float* __restrict__ w, float* __restrict__ out,
                                              int n, float eps) {
    __shared__ float nbuf[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = __ldcg(x + i);
        s += v * v;
    }
    s = block_sum(s, nbuf);
    const float inv = rsqrtf(s / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = __ldcg(x + i) * inv * w[i];
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
template <>
__device__ __forceinline__ void dot2_row<STRATA_Q_Q4_K>(const uint8_t* __restrict__ ra,
                                                        const uint8_t* __restrict__ rb, const float* __restrict__ x,
                                                        int ncols, int lane, float& a, float& b) {
    a = 0.f;
    b = 0.f;
    const int n = ncols / 32;
#pragma unroll 4
    for (int u = lane; u < n; u += 32) {
        a += q4k_unit(ra, x, u);
        b += q4k_unit(rb, x, u);
    }
}

// Per-step values the host writes into mapped pinned memory before it launches the step graph; the first kernel
// of a step copies them to device memory so later kernels do not cross PCIe for them.
// params[0] = token, params[1] = position.   state[0] = token, state[1] = position, state[2..3] = argmax word.
#define P_TOKEN 0
#define P_POS 1
