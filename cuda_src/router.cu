// The MoE router's second half on the GPU: softmax over the expert logits, top-k, optional renormalisation and
// scale; it also counts routing per (layer, expert) for the adaptive tier and cache hits for DONE.
#include "common.cuh"

// One warp per token (grid.x = T, blockDim.x = 32): each lane holds n_expert/32 logits in registers, so softmax
// and the k rounds of argmax are shuffles only. n_expert <= 512, k <= 16.
// logits: (T, n_expert). ids/weights: (T, k). table: this layer's pointer-table row; an entry inside
// [slot_lo, slot_hi) is a VRAM cache hit. counts: this layer's routing counters (n_expert int32).
// stats[0] += hits, stats[1] += k (when stats given).
#define ROUTER_MAX_PER_LANE 16
#define ROUTER_MAX_K 16
// The routing of token t by one warp.
__device__ __forceinline__ void route_warp(int t, const float* logits, int n_expert, int k, int renorm, float scale,
                                           int* __restrict__ ids, float* __restrict__ weights,
                                           const unsigned long long* __restrict__ table, unsigned long long slot_lo,
                                           unsigned long long slot_hi, int* __restrict__ counts,
                                           unsigned long long* __restrict__ stats) {
    const int lane = threadIdx.x & 31;
    const float* lg = logits + (long long)t * n_expert;
    float v[ROUTER_MAX_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < ROUTER_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < n_expert ? __ldcg(lg + e) : NEG_INF;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < ROUTER_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < n_expert ? expf(v[i] - mx) : -1.f;   // -1: never chosen
        s += e < n_expert ? v[i] : 0.f;
    }
    s = warp_sum(s);
    int chosen[ROUTER_MAX_K];
    float chosen_v[ROUTER_MAX_K];
    float tot = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; ++j) {
        if (j >= k) break;
        float bv = -2.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTER_MAX_PER_LANE; ++i)
            if (v[i] > bv) { bv = v[i]; bi = lane + 32 * i; }     // ascending ids: the first max wins
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        chosen[j] = bi;
        chosen_v[j] = bv;
        tot += bv;
        if ((bi & 31) == lane) {
#pragma unroll
            for (int i = 0; i < ROUTER_MAX_PER_LANE; ++i)
                if (i == (bi >> 5)) v[i] = -1.f;
        }
    }
    // lane j < k writes choice j: the k counter updates and table reads run side by side
    const float div = renorm ? tot : s;
    unsigned long long hit = 0;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; ++j) {
        if (j < k && lane == j) {
            const int e = chosen[j];
            ids[t * k + j] = e;
            weights[t * k + j] = chosen_v[j] / div * scale;
            if (counts) atomicAdd(counts + e, 1);
            if (table) {
                const unsigned long long a = table[e];
                hit = (a >= slot_lo && a < slot_hi) ? 1ull : 0ull;
            }
        }
    }
    if (stats) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) hit += __shfl_xor_sync(0xffffffffu, hit, o);
        if (lane == 0) {
            atomicAdd(stats, hit);
            atomicAdd(stats + 1, (unsigned long long)k);
        }
    }
}

extern "C" __global__ void router_topk(const float* __restrict__ logits, int n_expert, int k, int renorm,
                                       float scale, int* __restrict__ ids, float* __restrict__ weights,
                                       const unsigned long long* __restrict__ table, unsigned long long slot_lo,
                                       unsigned long long slot_hi, int* __restrict__ counts,
                                       unsigned long long* __restrict__ stats) {
    route_warp(blockIdx.x, logits, n_expert, k, renorm, scale, ids, weights, table, slot_lo, slot_hi, counts, stats);
}

// Decode (one token): the router logits (one warp per expert row of W) and, in the last block, the routing.
// Grid ceil(n_expert / warps per block).
template <int QT>
__global__ void router_fused(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                             int ncols, float* __restrict__ logits, int n_expert, int k, int renorm, float scale,
                             int* __restrict__ ids, float* __restrict__ weights,
                             const unsigned long long* __restrict__ table, unsigned long long slot_lo,
                             unsigned long long slot_hi, int* __restrict__ counts,
                             unsigned long long* __restrict__ stats, int* __restrict__ counter) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r < n_expert) {
        const float s = warp_sum(dotw<QT>(W + (long long)r * row_bytes, x, ncols, lane));
        if (lane == 0) logits[r] = s;
    }
    if (last_block(counter) && threadIdx.x < 32)
        route_warp(0, logits, n_expert, k, renorm, scale, ids, weights, table, slot_lo, slot_hi, counts, stats);
}
