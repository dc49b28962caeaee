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

// Per-step values the host writes into mapped pinned memory before it launches the step graph; the first kernel
// of a step copies them to device memory so later kernels do not cross PCIe for them.
// params[0] = token, params[1] = position.   state[0] = token, state[1] = position, state[2..3] = argmax word.
#define P_TOKEN 0
#define P_POS 1
