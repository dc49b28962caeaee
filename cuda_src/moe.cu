// The routed expert FFN of one token (or a small window), reading every expert through the per-(layer, expert)
// pointer table: an entry is the expert's VRAM cache slot or its address in the mapped pinned arena, so a missed
// expert is read over PCIe in place by these same kernels. An expert blob is gate | up | down, each the GGUF's
// rows for that expert.
//
// Both kernels read their input vector from shared memory (common.cuh stage_x: fewer L1 wavefronts than the weight
// bytes otherwise) and start the ids -> table -> weights chain before anything else, since every dependent load is
// ~0.5-1 us (several over PCIe) and the step is a chain of such latencies.
#include "quant.cuh"
#include "common.cuh"

// Grid (ceil(n_ff / warps per block), k, T); dynamic shared memory staged_bytes(ncols).
// h[t, j, r] = silu(gate_e[r] . xn_t) * (up_e[r] . xn_t), e = ids[t, j], xn_t = rmsnorm(x_t) * norm_w (the FFN
// norm, done here per block; x_t as is when norm_w is NULL).
template <int QT>
__global__ void moe_gate_up(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                            long long up_off, long long row_bytes, const float* __restrict__ x,
                            const float* __restrict__ norm_w, float eps, float* __restrict__ h, int n_ff, int ncols,
                            int k) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int j = blockIdx.y, t = blockIdx.z;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(table[ids[t * k + j]]);
    const uint8_t* rg = base + (long long)min(r, n_ff - 1) * row_bytes;   // a tail warp re-reads the last row
    const uint8_t* ru = rg + up_off;
    float g, u;
    if constexpr (QT == STRATA_Q_Q4_K) {       // the first units' loads go out before the staging
        Q4KRaw p[Q4K_BATCH], q[Q4K_BATCH];
        q4k_preload(rg, ncols, lane, p);
        q4k_preload(ru, ncols, lane, q);
        const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
        q4k_finish2(p, q, rg, ru, xs, ncols, lane, g, u);
    } else {
        const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
        dot2_s<QT>(rg, ru, xs, ncols, lane, g, u);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0 && r < n_ff) h[((long long)t * k + j) * n_ff + r] = silu(g) * u;
}

// Grid, block and shared memory as moe_gate_up's, for a layer whose gate and up differ in quant type (community
// quants mix them): two launches, gate (mul 0: h = gate_e[r] . xn) then up (mul 1: h = silu(h) * (up_e[r] . xn)),
// each with its own type's staging; off is the projection's offset in the blob. Uniform layers keep moe_gate_up.
template <int QT>
__global__ void moe_proj(const unsigned long long* __restrict__ table, const int* __restrict__ ids, long long off,
                         long long row_bytes, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                         float* __restrict__ h, int n_ff, int ncols, int k, int mul) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int j = blockIdx.y, t = blockIdx.z;
    const uint8_t* row = reinterpret_cast<const uint8_t*>(table[ids[t * k + j]]) + off +
                         (long long)min(r, n_ff - 1) * row_bytes;
    const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
    const float d = warp_sum(dot_s<QT>(row, xs, ncols, lane));
    if (lane == 0 && r < n_ff) {
        float* o = h + ((long long)t * k + j) * n_ff + r;
        *o = mul ? silu(*o) * d : d;
    }
}

// Grid (ceil(n_embd / warps per block), T). out[t, r] += sum_j w[t, j] * (down_e[r] . h[t, j]).
// One warp sums a row over all k experts, so the result does not depend on scheduling. With stage, h[t] (k * n_ff
// floats) is read from shared memory (dynamic shared memory staged_bytes(k * n_ff)), else from global memory.
// k <= 32. Lane j < k fetches expert j's address and weight, so the k chains run side by side, once per warp.
#define MOE_DOWN_BATCH 6    // (expert, unit) pairs per lane in flight: k = 8, n_ff = 768 is 6 a lane (registers: 4 blocks an SM)
template <int QT>
__global__ void moe_down(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                         const float* __restrict__ weights, long long down_off, long long row_bytes,
                         const float* __restrict__ h, float* __restrict__ out, int n_embd, int n_ff, int k,
                         int stage) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    unsigned long long addr = 0;
    float wl = 0.f;
    if (lane < k) {
        addr = table[ids[t * k + lane]] + down_off + (unsigned long long)min(r, n_embd - 1) * row_bytes;
        wl = weights[t * k + lane];
    }
    const float* ht = h + (long long)t * k * n_ff;
    float s = 0.f;
    if (stage) {
        if constexpr (QT == STRATA_Q_Q4_K) {
            // the k rows' units as one list of (expert, unit) pairs over the 32 lanes: every lane busy (n_ff = 768
            // is 24 units a row) and all of a lane's loads in flight before the staging
            const int nu = n_ff / 32, total = k * nu;
            Q4KRaw raw[MOE_DOWN_BATCH];
            int pj[MOE_DOWN_BATCH];
#pragma unroll
            for (int i = 0; i < MOE_DOWN_BATCH; ++i) {
                const int p = lane + 32 * i, jj = min(p / nu, k - 1);
                pj[i] = jj;
                const unsigned long long a = __shfl_sync(0xffffffffu, addr, jj);
                if (p < total) raw[i] = q4k_load(reinterpret_cast<const uint8_t*>(a), p - jj * nu);
            }
            const float* hs = stage_x<QT>(ht, nullptr, 0.f, k * n_ff);
#pragma unroll
            for (int i = 0; i < MOE_DOWN_BATCH; ++i) {
                const int p = lane + 32 * i, jj = pj[i];
                const float wj = __shfl_sync(0xffffffffu, wl, jj);
                if (p < total) s += wj * q4k_dot(raw[i], hs + xs_at<QT>(jj * n_ff), p - jj * nu);
            }
            for (int p0 = lane + 32 * MOE_DOWN_BATCH; __any_sync(0xffffffffu, p0 < total); p0 += 32) {
                const int jj = min(p0 / nu, k - 1);     // pairs beyond the first batch (large k * n_ff)
                const unsigned long long a = __shfl_sync(0xffffffffu, addr, jj);
                const float wj = __shfl_sync(0xffffffffu, wl, jj);
                if (p0 < total)
                    s += wj * q4k_dot(q4k_load(reinterpret_cast<const uint8_t*>(a), p0 - jj * nu),
                                      hs + xs_at<QT>(jj * n_ff), p0 - jj * nu);
            }
        } else {
            const float* hs = stage_x<QT>(ht, nullptr, 0.f, k * n_ff);
            for (int j = 0; j < k; ++j) {
                const uint8_t* row = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, addr, j));
                s += __shfl_sync(0xffffffffu, wl, j) * dot_s<QT>(row, hs + j * n_ff, n_ff, lane);
            }
        }
    } else {
        // Lane partials of all k rows first, one warp reduction at the end: the k rows' loads overlap, which is
        // what hides PCIe latency when some of the experts are read in place from host memory.
#pragma unroll 8
        for (int j = 0; j < k; ++j) {
            const uint8_t* row = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, addr, j));
            s += __shfl_sync(0xffffffffu, wl, j) * dotw<QT>(row, ht + (long long)j * n_ff, n_ff, lane);
        }
    }
    s = warp_sum(s);
    if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
}
