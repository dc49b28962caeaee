// The int8 KV cache layout, shared by the kernels that write and read it (attention.cu; prefill_attn.cu may include
// it too). Per layer: values (n_head_kv, max_ctx, head_dim) int8 and scales (n_head_kv, max_ctx, head_dim / 32) fp32;
// a value is scale * q, one scale per 32 consecutive values of a row (absmax / 127, round to nearest).
#pragma once
#include "common.cuh"

#define KV8_BLOCK 32

// Quantize value d of row `row` (a row is hd values). The 32 values of a scale block must be held by the 32 lanes of
// one warp (blockDim.x == head_dim, d = threadIdx.x), every lane calling.
__device__ __forceinline__ void kv8_store(float val, signed char* __restrict__ q, float* __restrict__ sc, long long row,
                                          int d, int hd) {
    const float amax = warp_max(fabsf(val));
    const float s = amax / 127.f;
    q[row * hd + d] = (signed char)__float2int_rn(s > 0.f ? val / s : 0.f);
    if ((d & (KV8_BLOCK - 1)) == 0) sc[row * (hd / KV8_BLOCK) + d / KV8_BLOCK] = s;
}
