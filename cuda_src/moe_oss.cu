// gpt-oss's routed experts in the decode step: moe.cu's moe_gate_up / moe_down with each expert's biases (kept in VRAM
// for every expert, (n_expert, n_ff) and (n_expert, n_embd) fp32 per layer, indexed by the routed id) and SWIGLU_OAI
// between (common.cuh swiglu_oai). Experts through the same pointer table (VRAM slot or pinned arena, read in place).
// Separate kernels, so the uniform models' launches stay as they are.
#include "quant.cuh"
#include "common.cuh"

// MXFP4 in the decode step, a lane a 32-element block (the generic path gives a lane 8 elements, so it loads the
// scale and 8 bytes for 4 bytes of codes, and has two such chunks in flight): the 17-byte block as the five aligned
// words that hold it (from b & ~3; the fifth starts at or before b + 16, the block's last byte, so no load leaves the
// allocation), all of a lane's blocks of a batch in flight before any arithmetic.
#define MX4_BATCH 3     // blocks per lane and row in flight: 3 x 32 lanes x 32 = 3072 columns (gpt-oss: 2880 wide)
#define MX4_DOWN_BATCH 6    // (expert, block) pairs per lane in flight in the down projection (k = 4, n_ff = 2880: 12)
struct Mx4Raw {
    uint32_t w[5], o;
};
__device__ __forceinline__ Mx4Raw mx4_load(const uint8_t* b) {
    Mx4Raw r;
    r.o = (uint32_t)(unsigned long long)b & 3;
    const uint8_t* a = b - r.o;
#pragma unroll
    for (int i = 0; i < 5; ++i) r.w[i] = ld4_nc(a + 4 * i);
    return r;
}
// the block's scale (e8m0, halved: the codes below are doubled) and its 16 code bytes as 4 words
__device__ __forceinline__ float mx4_unpack(const Mx4Raw& r, uint32_t (&q)[4]) {
    const uint32_t sh = 8 * r.o;
#pragma unroll
    for (int m = 0; m < 4; ++m) q[m] = __funnelshift_rc(r.w[m], r.w[m + 1], sh + 8);   // sh + 8 = 32: w[m + 1]
    return strata_e8m0_half((r.w[0] >> sh) & 0xff);
}
// The 4 codes of float4 f (0..7) of a block: f < 4 are the low nibbles of word f (elements 4f..4f+3), f >= 4 the
// high nibbles of word f - 4 (elements 16 + 4(f - 4).. = 4f..), as floats.
__device__ __forceinline__ float4 mx4_codes(const uint32_t (&q)[4], int f) {
    const int m = f & 3;
    const uint32_t w = (m == 0 ? q[0] : m == 1 ? q[1] : m == 2 ? q[2] : q[3]) >> ((f >> 2) * 4);
    uint32_t lo, hi;
    strata_e2m1x4(w, lo, hi);
    return make_float4(strata_h2f((uint16_t)(lo & 0xffff)), strata_h2f((uint16_t)(lo >> 16)),
                       strata_h2f((uint16_t)(hi & 0xffff)), strata_h2f((uint16_t)(hi >> 16)));
}
// A block's dot with its 32 x (xb, 16-byte aligned); mx4_dot2: two rows' blocks (gate, up) against the same x. The lane
// walks the block's float4s from its own start, (k + lane) % 8: the 8 lanes of a shared-memory phase read 8
// different banks' quads though their blocks lie 128 bytes apart (in order they would all hit the same 4 banks).
__device__ __forceinline__ float mx4_dot(const Mx4Raw& r, const float* xb, int lane) {
    uint32_t q[4];
    const float d = mx4_unpack(r, q);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int f = (k + lane) & 7;
        const float4 x = *reinterpret_cast<const float4*>(xb + 4 * f), v = mx4_codes(q, f);
        s += v.x * x.x + v.y * x.y + v.z * x.z + v.w * x.w;
    }
    return d * s;
}
__device__ __forceinline__ void mx4_dot2(const Mx4Raw& ra, const Mx4Raw& rb, const float* xb, int lane, float& a,
                                         float& b) {
    uint32_t qa[4], qb[4];
    const float da = mx4_unpack(ra, qa), db = mx4_unpack(rb, qb);
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int f = (k + lane) & 7;
        const float4 x = *reinterpret_cast<const float4*>(xb + 4 * f), va = mx4_codes(qa, f), vb = mx4_codes(qb, f);
        sa += va.x * x.x + va.y * x.y + va.z * x.z + va.w * x.w;
        sb += vb.x * x.x + vb.y * x.y + vb.z * x.z + vb.w * x.w;
    }
    a += da * sa;
    b += db * sb;
}

// Grid (ceil(n_ff / warps per block), k, T); dynamic shared memory staged_bytes(ncols).
// h[t, j, r] = swiglu_oai(gate_e[r] . xn_t + bg[e, r], up_e[r] . xn_t + bu[e, r]), e = ids[t, j], xn_t =
// rmsnorm(x_t) * norm_w (x_t as is when norm_w is NULL).
// Launch bounds: blocks of 128 threads (launch.py's MV_WARPS = 4); MXFP4's batches of loads in flight take 159
// registers unbounded (3 blocks an SM), 94 at 5 blocks an SM, without spills.
template <int QT>
__global__ __launch_bounds__(128, 5) void moe_gate_up_oai(
    const unsigned long long* __restrict__ table, const int* __restrict__ ids, long long up_off, long long row_bytes,
    const float* __restrict__ x, const float* __restrict__ norm_w, float eps, float* __restrict__ h, int n_ff,
    int ncols, int k, const float* __restrict__ bg, const float* __restrict__ bu) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int j = blockIdx.y, t = blockIdx.z;
    const int e = ids[t * k + j];
    const uint8_t* rg = reinterpret_cast<const uint8_t*>(table[e]) + (long long)min(r, n_ff - 1) * row_bytes;
    const uint8_t* ru = rg + up_off;
    float g = 0.f, u = 0.f;
    if constexpr (QT == STRATA_Q_MXFP4) {
        const int nb = ncols / 32;
        Mx4Raw pg[MX4_BATCH], pu[MX4_BATCH];
#pragma unroll
        for (int i = 0; i < MX4_BATCH; ++i)             // the first batch's loads go out before the staging
            if (lane + 32 * i < nb) {
                pg[i] = mx4_load(rg + 17 * (lane + 32 * i));
                pu[i] = mx4_load(ru + 17 * (lane + 32 * i));
            }
        const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
        for (int c0 = 0;; c0 += 32 * MX4_BATCH) {      // c0: the batch's first block, the same in every lane
#pragma unroll
            for (int i = 0; i < MX4_BATCH; ++i) {
                const int b = c0 + lane + 32 * i;
                if (b < nb) mx4_dot2(pg[i], pu[i], xs + 32 * b, lane, g, u);
            }
            if (c0 + 32 * MX4_BATCH >= nb) break;       // rows wider than a batch (none in gpt-oss)
#pragma unroll
            for (int i = 0; i < MX4_BATCH; ++i) {
                const int b = c0 + 32 * MX4_BATCH + lane + 32 * i;
                if (b < nb) {
                    pg[i] = mx4_load(rg + 17 * b);
                    pu[i] = mx4_load(ru + 17 * b);
                }
            }
        }
    } else {
        const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
        dot2_s<QT>(rg, ru, xs, ncols, lane, g, u);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0 && r < n_ff)
        h[((long long)t * k + j) * n_ff + r] = swiglu_oai(g + bg[(long long)e * n_ff + r], u + bu[(long long)e * n_ff + r]);
}

// Grid (ceil(n_embd / warps per block), T). out[t, r] += sum_j w[t, j] * (down_e[r] . h[t, j] + bd[e, r]), one warp a
// row over all k experts (k <= 32); with stage, h[t] (k * n_ff floats) from shared memory (staged_bytes(k * n_ff)).
// 4 blocks an SM: what the staged h of gpt-oss (4 x 2880 floats, 46 KiB) leaves room for anyway.
template <int QT>
__global__ __launch_bounds__(128, 4) void moe_down_bias(
    const unsigned long long* __restrict__ table, const int* __restrict__ ids, const float* __restrict__ weights,
    long long down_off, long long row_bytes, const float* __restrict__ h, float* __restrict__ out, int n_embd,
    int n_ff, int k, int stage, const float* __restrict__ bd) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    const int rr = min(r, n_embd - 1);
    unsigned long long addr = 0;
    float wl = 0.f, bl = 0.f;
    if (lane < k) {
        const int e = ids[t * k + lane];
        addr = table[e] + down_off + (unsigned long long)rr * row_bytes;
        wl = weights[t * k + lane];
        bl = bd[(long long)e * n_embd + rr];
    }
    const float* ht = h + (long long)t * k * n_ff;
    float s = 0.f;
    if constexpr (QT == STRATA_Q_MXFP4) {
        // the k rows' blocks as one list of (expert, block) pairs over the 32 lanes, a batch in flight at a time
        const int nb = n_ff / 32, total = k * nb;
        Mx4Raw raw[MX4_DOWN_BATCH];
        int pj[MX4_DOWN_BATCH];
        const float* hs = nullptr;
        for (int p0 = 0; p0 < total; p0 += 32 * MX4_DOWN_BATCH) {      // uniform across the warp (shuffles)
#pragma unroll
            for (int i = 0; i < MX4_DOWN_BATCH; ++i) {
                const int p = p0 + lane + 32 * i, jj = min(p / nb, k - 1);
                pj[i] = jj;
                const unsigned long long a = __shfl_sync(0xffffffffu, addr, jj);
                if (p < total) raw[i] = mx4_load(reinterpret_cast<const uint8_t*>(a) + 17 * (p - jj * nb));
            }
            if (p0 == 0) hs = stage ? stage_x<QT>(ht, nullptr, 0.f, k * n_ff) : ht;   // after the first loads
#pragma unroll
            for (int i = 0; i < MX4_DOWN_BATCH; ++i) {
                const int p = p0 + lane + 32 * i, jj = pj[i];
                const float wj = __shfl_sync(0xffffffffu, wl, jj);
                if (p < total) s += wj * mx4_dot(raw[i], hs + 32 * p, lane);   // pair p's 32 h: j * n_ff + 32 blk
            }
        }
    } else {
        const float* hs = stage ? stage_x<QT>(ht, nullptr, 0.f, k * n_ff) : nullptr;
        for (int j = 0; j < k; ++j) {
            const uint8_t* row = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, addr, j));
            const float wj = __shfl_sync(0xffffffffu, wl, j);
            s += wj * (stage ? dot_s<QT>(row, hs + xs_at<QT>(j * n_ff), n_ff, lane)
                             : dotw<QT>(row, ht + (long long)j * n_ff, n_ff, lane));
        }
    }
    if (lane < k) s += wl * bl;                         // lane j < k adds expert j's weighted bias
    s = warp_sum(s);
    if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
}
