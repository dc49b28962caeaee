// Tensor-core building blocks shared by the prompt pass's kernels (moe_gemm.cu, prefill_attn.cu): the fp16 mma with
// fp32 accumulators, ldmatrix fragment loads from shared memory, and the fp16x2 packing of two floats.
#pragma once
#include "quant.cuh"   // the integer typedefs (NVRTC builds use no system headers)

// d += a (16x16, row-major fp16) * b (16x8, column-major fp16), fp32 accumulators (PTX ISA fragment layout:
// g = lane / 4, t = lane % 4; a: rows g, g+8 x cols 2t.., 2t+8..; b: rows 2t.., 2t+8.. x col g; d: rows g, g+8 x 2t..)
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The 32-bit shared-memory address ldmatrix and cp.async take.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// Four 8x8 fp16 matrices from shared memory in one instruction (lanes 8i..8i+7 give the row addresses of matrix i),
// each lane receiving the mma fragment layout; _t: transposed.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// Two floats as fp16 (round to nearest) in one register, lo in the low half (mma fragment order).
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
    uint32_t d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
