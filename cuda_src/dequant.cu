// dequant.cu: whole tensors of one GGUF quant type (-DSTRATA_QT=<id>) to fp32 or fp16, for tests and the prompt pass's GEMM
// scratch. src: n_blocks blocks back to back (16-byte aligned); dst: n_blocks * QK values. A thread per 8 elements.
// @build per-qtype
#include "quant.cuh"

#ifndef STRATA_QT
#error "compile dequant.cu with -DSTRATA_QT=<ggml type id> (engine/cuda/kernels.py does)"
#endif

extern "C" __global__ void dequant_f32(const uint8_t* __restrict__ src, float* __restrict__ dst, long long n_blocks) {
    constexpr int CPB = QTraits<STRATA_QT>::QK / 8;
    const long long n = n_blocks * CPB;
    for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < n; c += (long long)gridDim.x * blockDim.x) {
        float v[8];
        dequant8<STRATA_QT>(src + (c / CPB) * QTraits<STRATA_QT>::BYTES, (int)(c % CPB), v);
        float4* o = (float4*)(dst + c * 8);
        o[0] = make_float4(v[0], v[1], v[2], v[3]);
        o[1] = make_float4(v[4], v[5], v[6], v[7]);
    }
}

__device__ __forceinline__ uint32_t strata_pack_h2(float a, float b) {
    unsigned short ha, hb;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(ha) : "f"(a));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(b));
    return (uint32_t)ha | ((uint32_t)hb << 16);
}

// dst holds IEEE fp16 bits (CuPy float16)
extern "C" __global__ void dequant_f16(const uint8_t* __restrict__ src, unsigned short* __restrict__ dst,
                                       long long n_blocks) {
    constexpr int CPB = QTraits<STRATA_QT>::QK / 8;
    const long long n = n_blocks * CPB;
    for (long long c = blockIdx.x * (long long)blockDim.x + threadIdx.x; c < n; c += (long long)gridDim.x * blockDim.x) {
        float v[8];
        dequant8<STRATA_QT>(src + (c / CPB) * QTraits<STRATA_QT>::BYTES, (int)(c % CPB), v);
        *(uint4*)(dst + c * 8) = make_uint4(strata_pack_h2(v[0], v[1]), strata_pack_h2(v[2], v[3]),
                                            strata_pack_h2(v[4], v[5]), strata_pack_h2(v[6], v[7]));
    }
}
