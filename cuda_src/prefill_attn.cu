// Prompt attention for the streamed prompt pass: causal, GQA, tiled with an online softmax (flash-attention style),
// so a 32K prompt never materialises its score matrix. Keys and values are read from the KV cache, which the chunk's
// own K/V were written into first (engine/cuda/kv.py KVCache.store: qk_rope_store for fp16, attention.cu's
// qk_rope_store_kv8 for int8), so a chunk attends to every earlier chunk and to itself alike.
// KV formats: fp16 (n_head_kv, max_ctx, head_dim) per layer, as the decode step reads it; int8 the same shape with
// one fp32 scale per 32 values (n_head_kv, max_ctx, head_dim / 32), half the bytes (cuda_src/kv_int8.cuh).
//
// On tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulators), as FlashAttention-2: a block holds 64 query rows
// (4 warps x 16) of one KV head and walks the keys in tiles of FA_BN; per tile each warp computes S = Q K^T into
// registers, masks, updates its running max and sum, rescales its output, and multiplies P (the same registers,
// repacked as fp16) by V. Row r of the T * G rows of a KV head is token r / G, head kvh * G + r % G, so the G query
// heads that share a KV head read each K/V tile once. Causal prompts over 48 layers x 32 heads at 4K are ~6.6 TFLOP:
// a CUDA-core kernel (the first version: a warp per row, a lane per key) took ~0.8 s of a 1.5 s 4K prompt.
// Head dims are compile-time (FA_HD, default 128; the pass loads the module with the model's head_dim).
// tests/test_cuda_prefill_kernels.py checks it against NumPy (passed on the H200, 2026-11-30).
#include "common.cuh"

#ifndef FA_HD
#define FA_HD 128
#endif
#if FA_HD % 16 != 0 || FA_HD > 256
#error "FA_HD must be a multiple of 16 and at most 256"
#endif
#define FA_WARPS 4
#define FA_BM (16 * FA_WARPS)            // query rows per block
#define FA_BN (FA_HD > 128 ? 32 : 64)    // keys per tile (two fp16 tiles of FA_BN x FA_HD stay under 48 KB)
#define FA_LD (FA_HD + 8)                // halves per shared row: 16-byte aligned rows, conflict-free fragment reads

__device__ __forceinline__ uint32_t fa_pack2(float a, float b) {
    return (uint32_t)f2h(a) | ((uint32_t)f2h(b) << 16);
}

__device__ __forceinline__ void fa_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t fa_smem_addr(const void* p) {
    uint32_t a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 fp16 matrices from shared memory, transposed (lanes 8i..8i+7 give the row addresses of matrix i).
__device__ __forceinline__ void fa_ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// The tile of FA_BN keys and values from position p0 into shared memory as fp16; zeros from position `end` on
// (never NaN from unwritten cache, which a zero softmax weight would not cancel). 16 bytes of fp16 (8 values) per
// load; int8: 8 values and their 32-value block's scale.
template <bool I8>
__device__ __forceinline__ void fa_load_tile(unsigned short* ks, unsigned short* vs, const void* kc, const void* vc,
                                             const float* ksc, const float* vsc, long long head_base, int p0,
                                             int end) {
    constexpr int CH = FA_HD / 8;
    for (int w = threadIdx.x; w < FA_BN * CH; w += FA_WARPS * 32) {
        const int r = w / CH, c = w % CH, p = p0 + r;
        uint4 kw = make_uint4(0u, 0u, 0u, 0u), vw = kw;
        if (p < end) {
            const long long row = head_base + p;
            if (I8) {
                const uint2 kq = *reinterpret_cast<const uint2*>(reinterpret_cast<const signed char*>(kc) + row * FA_HD + 8 * c);
                const uint2 vq = *reinterpret_cast<const uint2*>(reinterpret_cast<const signed char*>(vc) + row * FA_HD + 8 * c);
                const long long si = row * (FA_HD / 32) + (8 * c) / 32;
                const float a = ksc[si], b = vsc[si];
                const signed char* k8 = reinterpret_cast<const signed char*>(&kq);
                const signed char* v8 = reinterpret_cast<const signed char*>(&vq);
                kw = make_uint4(fa_pack2(a * k8[0], a * k8[1]), fa_pack2(a * k8[2], a * k8[3]),
                                fa_pack2(a * k8[4], a * k8[5]), fa_pack2(a * k8[6], a * k8[7]));
                vw = make_uint4(fa_pack2(b * v8[0], b * v8[1]), fa_pack2(b * v8[2], b * v8[3]),
                                fa_pack2(b * v8[4], b * v8[5]), fa_pack2(b * v8[6], b * v8[7]));
            } else {
                kw = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(kc) + row * FA_HD + 8 * c);
                vw = *reinterpret_cast<const uint4*>(reinterpret_cast<const unsigned short*>(vc) + row * FA_HD + 8 * c);
            }
        }
        *reinterpret_cast<uint4*>(ks + r * FA_LD + 8 * c) = kw;
        *reinterpret_cast<uint4*>(vs + r * FA_LD + 8 * c) = vw;
    }
}

// Grid (ceil(T * G / FA_BM), n_head_kv), block 32 * FA_WARPS; G = n_head / n_head_kv, head_dim == FA_HD.
// q, out: (T, n_head * head_dim) fp32, q already rotated; the query rows of token t see positions 0 .. pos0 + t.
template <bool I8>
__device__ __forceinline__ void fa_body(const float* __restrict__ q, const void* kc, const void* vc,
                                        const float* ksc, const float* vsc, float* __restrict__ out, int T, int pos0,
                                        int n_head, int n_head_kv, int max_ctx, float scale) {
    __shared__ __align__(16) unsigned short ks[FA_BN * FA_LD];
    __shared__ __align__(16) unsigned short vs[FA_BN * FA_LD];
    constexpr int KS = FA_HD / 16, NS = FA_BN / 8, NO = FA_HD / 8;
    const int G = n_head / n_head_kv, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int rows = T * G;
    // the last row tiles see the most keys: start them first
    const int r0 = (gridDim.x - 1 - blockIdx.x) * FA_BM;
    const int end = pos0 + (min(rows, r0 + FA_BM) - 1) / G + 1;          // keys this block reads: 0 .. end-1
    const int wr0 = r0 + 16 * warp;
    const int w_last = pos0 + min(rows - 1, wr0 + 15) / G;                // the warp's last key
    const int ra = wr0 + g, rb = ra + 8;                                  // this lane's two rows
    const int ta = min(ra, rows - 1) / G, tb = min(rb, rows - 1) / G;
    const int lim_a = pos0 + ta, lim_b = pos0 + tb;
    const int ha = kvh * G + min(ra, rows - 1) % G, hb = kvh * G + min(rb, rows - 1) % G;
    const long long qo_a = (long long)ta * n_head * FA_HD + ha * FA_HD;
    const long long qo_b = (long long)tb * n_head * FA_HD + hb * FA_HD;

    // Q as A fragments (rows g, g+8; columns 2*t4.. and 2*t4+8..), scaled by scale * log2(e) for exp2
    const float qs = scale * 1.4426950408889634f;
    uint32_t qa[KS][4];
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
        const int c = 16 * kk + 2 * t4;
        const float2 a0 = *reinterpret_cast<const float2*>(q + qo_a + c);
        const float2 a1 = *reinterpret_cast<const float2*>(q + qo_b + c);
        const float2 a2 = *reinterpret_cast<const float2*>(q + qo_a + c + 8);
        const float2 a3 = *reinterpret_cast<const float2*>(q + qo_b + c + 8);
        qa[kk][0] = fa_pack2(a0.x * qs, a0.y * qs);
        qa[kk][1] = fa_pack2(a1.x * qs, a1.y * qs);
        qa[kk][2] = fa_pack2(a2.x * qs, a2.y * qs);
        qa[kk][3] = fa_pack2(a3.x * qs, a3.y * qs);
    }
    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.f, l_b = 0.f;            // l: this lane's part of the row sums
    const long long head_base = (long long)kvh * max_ctx;
    // ldmatrix row addresses for V: lanes 0-7 keys 0-7, 8-15 keys 8-15 (columns d0..), 16-31 the same at d0 + 8
    const uint32_t v_addr = fa_smem_addr(vs + ((lane & 7) + ((lane >> 3) & 1) * 8) * FA_LD + (lane >> 4) * 8);

    for (int p0 = 0; p0 < end; p0 += FA_BN) {
        __syncthreads();                       // every warp is done with the previous tile
        fa_load_tile<I8>(ks, vs, kc, vc, ksc, vsc, head_base, p0, end);
        __syncthreads();
        if (p0 > w_last) continue;             // warp-uniform: no key of this tile is visible to the warp's rows
        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KS; ++kk)
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                const unsigned short* kp = ks + (8 * n + g) * FA_LD + 16 * kk + 2 * t4;
                fa_mma(s[n], qa[kk], *reinterpret_cast<const uint32_t*>(kp), *reinterpret_cast<const uint32_t*>(kp + 8));
            }
        float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            const int key = p0 + 8 * n + 2 * t4;
            if (key > lim_a) s[n][0] = NEG_INF;
            if (key + 1 > lim_a) s[n][1] = NEG_INF;
            if (key > lim_b) s[n][2] = NEG_INF;
            if (key + 1 > lim_b) s[n][3] = NEG_INF;
            mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        // key 0 is in every row's first tile, so the running max is finite from the first tile on
        const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        const float c_a = exp2f(m_a - mn_a), c_b = exp2f(m_b - mn_b);   // exp2(-inf) = 0 on the first tile
        m_a = mn_a;
        m_b = mn_b;
        l_a *= c_a;
        l_b *= c_b;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            o[j][0] *= c_a;
            o[j][1] *= c_a;
            o[j][2] *= c_b;
            o[j][3] *= c_b;
        }
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            s[n][0] = exp2f(s[n][0] - mn_a);
            s[n][1] = exp2f(s[n][1] - mn_a);
            s[n][2] = exp2f(s[n][2] - mn_b);
            s[n][3] = exp2f(s[n][3] - mn_b);
            l_a += s[n][0] + s[n][1];
            l_b += s[n][2] + s[n][3];
        }
        // O += P V: P's accumulator layout is the A fragment layout of keys 16c .. 16c+15
#pragma unroll
        for (int c = 0; c < FA_BN / 16; ++c) {
            uint32_t pa[4];
            pa[0] = fa_pack2(s[2 * c][0], s[2 * c][1]);
            pa[1] = fa_pack2(s[2 * c][2], s[2 * c][3]);
            pa[2] = fa_pack2(s[2 * c + 1][0], s[2 * c + 1][1]);
            pa[3] = fa_pack2(s[2 * c + 1][2], s[2 * c + 1][3]);
#pragma unroll
            for (int jj = 0; jj < FA_HD / 16; ++jj) {
                uint32_t b0, b1, b2, b3;
                fa_ldsm_x4_t(v_addr + (uint32_t)((16 * c * FA_LD + 16 * jj) * 2), b0, b1, b2, b3);
                fa_mma(o[2 * jj], pa, b0, b1);
                fa_mma(o[2 * jj + 1], pa, b2, b3);
            }
        }
    }
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    const float ia = 1.f / l_a, ib = 1.f / l_b;
#pragma unroll
    for (int j = 0; j < NO; ++j) {
        const int c = 8 * j + 2 * t4;
        if (ra < rows) *reinterpret_cast<float2*>(out + qo_a + c) = make_float2(o[j][0] * ia, o[j][1] * ia);
        if (rb < rows) *reinterpret_cast<float2*>(out + qo_b + c) = make_float2(o[j][2] * ib, o[j][3] * ib);
    }
}

extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)
flash_attn_f16(const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
               float* __restrict__ out, int T, int pos0, int n_head, int n_head_kv, int head_dim, int max_ctx,
               float scale) {
    fa_body<false>(q, kc, vc, nullptr, nullptr, out, T, pos0, n_head, n_head_kv, max_ctx, scale);
}

extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)
flash_attn_i8(const float* __restrict__ q, const signed char* __restrict__ kc, const signed char* __restrict__ vc,
              const float* __restrict__ k_scale, const float* __restrict__ v_scale, float* __restrict__ out, int T,
              int pos0, int n_head, int n_head_kv, int head_dim, int max_ctx, float scale) {
    fa_body<true>(q, kc, vc, k_scale, v_scale, out, T, pos0, n_head, n_head_kv, max_ctx, scale);
}
