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
// The k largest of lg[0..n_expert) by one warp (every lane gets the same): their ids into chosen[0..k), largest
// first, ties to the lower id, NaN ranked last; their logits into chosen_l; the row's max into mx and the sum of
// exp(l - mx) over its real logits into s. Each lane holds n_expert / 32 logits in registers, so the k rounds of
// argmax are shuffles only.
__device__ __forceinline__ void warp_topk(const float* lg, int n_expert, int k, int* chosen, float* chosen_l,
                                          float& mx, float& s) {
    const int lane = threadIdx.x & 31;
    float v[ROUTER_MAX_PER_LANE];
    mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < ROUTER_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < n_expert ? __ldcg(lg + e) : NEG_INF;
        mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    // Ranked on the logits (as route_block): exp(logit - max) underflows to ties far below the max.
    s = 0.f;
    unsigned free_mask = 0;                             // bit i: v[i] is a real expert not chosen yet
#pragma unroll
    for (int i = 0; i < ROUTER_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        if (e < n_expert) {
            free_mask |= 1u << i;
            if (v[i] != v[i]) v[i] = NEG_INF;          // NaN: ranked last, weight 0
            s += expf(v[i] - mx);
        }
    }
    s = warp_sum(s);
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; ++j) {
        if (j >= k) break;
        bool bok = false;
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTER_MAX_PER_LANE; ++i)     // ascending ids: the first max wins
            if (((free_mask >> i) & 1u) && (!bok || v[i] > bv)) { bok = true; bv = v[i]; bi = lane + 32 * i; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const bool ook = __shfl_xor_sync(0xffffffffu, (int)bok, o) != 0;
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ook && (!bok || ov > bv || (ov == bv && oi < bi))) { bok = true; bv = ov; bi = oi; }
        }
        chosen[j] = bi;
        chosen_l[j] = bv;
        if ((bi & 31) == lane) free_mask &= ~(1u << (bi >> 5));
    }
}

// The routing of token t by one warp.
__device__ __forceinline__ void route_warp(int t, const float* logits, int n_expert, int k, int renorm, float scale,
                                           int* __restrict__ ids, float* __restrict__ weights,
                                           const unsigned long long* __restrict__ table, unsigned long long slot_lo,
                                           unsigned long long slot_hi, int* __restrict__ counts,
                                           unsigned long long* __restrict__ stats) {
    const int lane = threadIdx.x & 31;
    int chosen[ROUTER_MAX_K];
    float chosen_v[ROUTER_MAX_K];
    float mx, s;
    warp_topk(logits + (long long)t * n_expert, n_expert, k, chosen, chosen_v, mx, s);
    float tot = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; ++j) {
        if (j >= k) break;
        chosen_v[j] = expf(chosen_v[j] - mx);
        tot += chosen_v[j];
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

// Decode (one token): the router logits (one warp per expert row of W, x staged normed in every block: the FFN
// norm needs no launch of its own) and, in the last block, the routing. Grid ceil(n_expert / warps per block),
// dynamic shared memory staged_bytes(ncols); n_expert <= ROUTER_MAX_EXPERTS, k <= ROUTER_MAX_K.
#define ROUTER_MAX_EXPERTS 512
// Most experts a block ranks (route_block, prefetch.cu's rank_topk); more go to one warp's argmax rounds. 128
// ranked: a thread an expert, 32 float4 compares each; 512 ranked took 4 experts a thread and 128 float4 each
// (router_fused 24 us a layer of Qwen3.8-Flash-Next's 512 experts on the H200, beside 7 for 128 experts).
#ifndef RANK_MAX_EXPERTS
#define RANK_MAX_EXPERTS 128
#endif
// float4 of an F32 row per lane in flight at once. 24: a 3072-wide row in one round (gpt-oss's 2880; at 16 its last
// 832 columns went through the loop below, seven dependent HBM round trips of one float4 a lane, ~5 of the launch's
// ~11 us on the H200). The sum's order is the same at any value (the loop continues where the batch ends), so the
// prefetch's router_predict still routes bit for bit as router_fused; narrower rows leave the extra loads predicated
// off (the router's grid is n_expert / 4 blocks: its registers bound nothing).
#ifndef ROUTER_F4           // a define, so that bench/decode_kernels.py can build the earlier 16 beside it
#define ROUTER_F4 24
#endif

// Expert e's place among the n4 * 4 values in shared memory (v4; e's own value ve): how many are larger, or equal
// with a lower id (ties go to the lower id, as route_warp's argmax rounds pick). route_block and prefetch.cu's
// rank_topk rank every expert this way in one pass.
__device__ __forceinline__ int rank_among(const float4* v4, int n4, float ve, int e) {
    int rank = 0;
    for (int i = 0; i < n4; ++i) {
        const float4 o = v4[i];
        const int f = 4 * i;
        rank += (o.x > ve || (o.x == ve && f < e)) + (o.y > ve || (o.y == ve && f + 1 < e)) +
                (o.z > ve || (o.z == ve && f + 2 < e)) + (o.w > ve || (o.w == ve && f + 3 < e));
    }
    return rank;
}

// The routing of one token by a whole block (after every logit is written): each expert's rank among the logits
// counted against all others in shared memory (ties: the lower id first, as route_warp's argmax
// rounds pick), so the k choices come out in one pass instead of k rounds of warp shuffles. Above RANK_MAX_EXPERTS
// the ranking's n^2 / blockDim compares cost more than the rounds: warp 0 routes by route_warp (same ids, same
// weights with renorm; without it the softmax's sum is added in another order).
__device__ __forceinline__ void route_block(const float* logits, int n_expert, int k, int renorm, float scale,
                                            int* __restrict__ ids, float* __restrict__ weights,
                                            const unsigned long long* __restrict__ table, unsigned long long slot_lo,
                                            unsigned long long slot_hi, int* __restrict__ counts,
                                            unsigned long long* __restrict__ stats) {
    if (n_expert > RANK_MAX_EXPERTS) {             // block-uniform
        if (threadIdx.x < 32)
            route_warp(0, logits, n_expert, k, renorm, scale, ids, weights, table, slot_lo, slot_hi, counts, stats);
        return;
    }
    __shared__ float4 v4[ROUTER_MAX_EXPERTS / 4];
    __shared__ float red[32];
    __shared__ int sel[ROUTER_MAX_K];
    __shared__ float selv[ROUTER_MAX_K];
    float* v = reinterpret_cast<float*>(v4);
    const int n4 = (n_expert + 3) / 4;
    float mx = NEG_INF;
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) mx = fmaxf(mx, __ldcg(logits + e));
    mx = warp_max(mx);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = red[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) mx = fmaxf(mx, red[i]);
    // Ranked on the logits, not on exp(logit - max): a logit ~100 below the max underflows to 0 in fp32, and ranks
    // among zeros would fall back to expert ids (the H200 test with quantized router rows caught that).
    float s = 0.f;
    for (int e = threadIdx.x; e < 4 * n4; e += blockDim.x) {
        float l = NEG_INF;                         // padding: after every real expert (ties go to the lower id)
        if (e < n_expert) {
            l = __ldcg(logits + e);
            if (l != l) l = NEG_INF;               // NaN: ranked last, weight 0
            else s += expf(l - mx);
        }
        v[e] = l;
    }
    s = block_sum(s, red);                         // synchronises: v is complete
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) {
        const float ve = v[e];
        const int rank = rank_among(v4, n4, ve, e);
        if (rank < k) {
            sel[rank] = e;
            selv[rank] = expf(ve - mx);
        }
    }
    __syncthreads();
    float tot = 0.f;
    for (int j = 0; j < k; ++j) tot += selv[j];
    const float div = renorm ? tot : s;
    const int j = threadIdx.x;
    if (j < k) {
        const int e = sel[j];
        ids[j] = e;
        weights[j] = selv[j] / div * scale;
        if (counts) atomicAdd(counts + e, 1);
        if (stats && table) {
            const unsigned long long a = table[e];
            if (a >= slot_lo && a < slot_hi) atomicAdd(stats, 1ull);
        }
        if (stats && j == 0) atomicAdd(stats + 1, (unsigned long long)k);
    }
}

// Row r of R (n_rows rows) . (rmsnorm(x) * norm_w), one warp a row, x staged by the whole block (every thread calls
// it): an F32 row's first ROUTER_F4 float4 a lane loaded before the staging (their HBM latency overlaps it), x staged
// as float4 by stage_x; other row types through stage_x / dot_s (Q4_K: the padded layout). router_fused and
// prefetch.cu's predictors (which include this file) share it.
template <int QT>
__device__ __forceinline__ float row_dot(const uint8_t* __restrict__ R, long long row_bytes, int r, int n_rows,
                                         const float* x, const float* __restrict__ norm_w, float eps, int n_embd) {
    const int lane = threadIdx.x & 31;
    const uint8_t* row = R + (long long)min(r, n_rows - 1) * row_bytes;
    float acc = 0.f;
    if constexpr (QT == STRATA_Q_F32) {
        const float4* w4 = reinterpret_cast<const float4*>(row);
        const int nf = n_embd / 4;
        float4 wv[ROUTER_F4];
#pragma unroll
        for (int i = 0; i < ROUTER_F4; ++i)
            if (lane + 32 * i < nf) wv[i] = w4[lane + 32 * i];
        const float4* x4 = reinterpret_cast<const float4*>(stage_x<QT>(x, norm_w, eps, n_embd));
#pragma unroll
        for (int i = 0; i < ROUTER_F4; ++i)
            if (lane + 32 * i < nf) {
                const float4 a = x4[lane + 32 * i];
                acc += wv[i].x * a.x + wv[i].y * a.y + wv[i].z * a.z + wv[i].w * a.w;
            }
        for (int f = lane + 32 * ROUTER_F4; f < nf; f += 32) {      // rows wider than 4 * 32 * ROUTER_F4
            const float4 w = w4[f], a = x4[f];
            acc += w.x * a.x + w.y * a.y + w.z * a.z + w.w * a.w;
        }
    } else {
        const float* xs = stage_x<QT>(x, norm_w, eps, n_embd);
        acc = dot_s<QT>(row, xs, n_embd, lane);
    }
    return warp_sum(acc);
}

template <int QT>
__global__ void router_fused(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                             const float* __restrict__ norm_w, float eps, int ncols, float* __restrict__ logits,
                             int n_expert, int k, int renorm, float scale, int* __restrict__ ids,
                             float* __restrict__ weights, const unsigned long long* __restrict__ table,
                             unsigned long long slot_lo, unsigned long long slot_hi, int* __restrict__ counts,
                             unsigned long long* __restrict__ stats, int* __restrict__ counter) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const float s = row_dot<QT>(W, row_bytes, r, n_expert, x, norm_w, eps, ncols);
    if (lane == 0 && r < n_expert) logits[r] = s;
    if (last_block(counter))
        route_block(logits, n_expert, k, renorm, scale, ids, weights, table, slot_lo, slot_hi, counts, stats);
}

// router_fused for gpt-oss: the logits get the router's bias (n_expert floats) before the routing. Its top-k weights
// (renorm 1) are the softmax over the chosen logits alone, which is gpt-oss's SOFTMAX_WEIGHT gating.
template <int QT>
__global__ void router_fused_bias(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                                  const float* __restrict__ norm_w, float eps, int ncols, float* __restrict__ logits,
                                  int n_expert, int k, int renorm, float scale, int* __restrict__ ids,
                                  float* __restrict__ weights, const unsigned long long* __restrict__ table,
                                  unsigned long long slot_lo, unsigned long long slot_hi, int* __restrict__ counts,
                                  unsigned long long* __restrict__ stats, int* __restrict__ counter,
                                  const float* __restrict__ bias) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const float s = row_dot<QT>(W, row_bytes, r, n_expert, x, norm_w, eps, ncols);
    if (lane == 0 && r < n_expert) logits[r] = s + bias[r];
    if (last_block(counter))
        route_block(logits, n_expert, k, renorm, scale, ids, weights, table, slot_lo, slot_hi, counts, stats);
}
