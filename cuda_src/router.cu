// The MoE router's second half on the GPU: softmax over the expert logits, top-k, optional renormalisation and
// scale; it also counts routing per (layer, expert) for the adaptive tier and cache hits for DONE.
#include "common.cuh"

// One block. logits: (T, n_expert) for T tokens (grid.x = T). ids/weights: (T, k).
// table: this layer's pointer-table row; an entry inside [slot_lo, slot_hi) is a VRAM cache hit.
// counts: this layer's routing counters (n_expert int32). stats[0] += hits, stats[1] += k (when stats given).
extern "C" __global__ void router_topk(const float* __restrict__ logits, int n_expert, int k, int renorm,
                                       float scale, int* __restrict__ ids, float* __restrict__ weights,
                                       const unsigned long long* __restrict__ table, unsigned long long slot_lo,
                                       unsigned long long slot_hi, int* __restrict__ counts,
                                       unsigned long long* __restrict__ stats) {
    extern __shared__ float p[];   // n_expert
    __shared__ float buf[32];
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    __shared__ int chosen[16];
    __shared__ float chosen_w[16];
    const int t = blockIdx.x;
    const float* lg = logits + (long long)t * n_expert;
    float mx = NEG_INF;
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) mx = fmaxf(mx, lg[i]);
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) best_v[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = NEG_INF;
    for (int w = 0; w < (blockDim.x + 31) / 32; ++w) mx = fmaxf(mx, best_v[w]);
    __syncthreads();
    float s = 0.f;
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
        const float e = expf(lg[i] - mx);
        p[i] = e;
        s += e;
    }
    s = block_sum(s, buf);
    for (int i = threadIdx.x; i < n_expert; i += blockDim.x) p[i] /= s;
    __syncthreads();
    for (int j = 0; j < k; ++j) {
        float bv = -1.f;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < n_expert; i += blockDim.x) {
            const float v = p[i];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if ((threadIdx.x & 31) == 0) { best_v[threadIdx.x >> 5] = bv; best_i[threadIdx.x >> 5] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            bv = best_v[0]; bi = best_i[0];
            for (int w = 1; w < (blockDim.x + 31) / 32; ++w)
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) { bv = best_v[w]; bi = best_i[w]; }
            chosen[j] = bi;
            chosen_w[j] = bv;
            p[bi] = -2.f;   // taken
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float tot = 0.f;
        for (int j = 0; j < k; ++j) tot += chosen_w[j];
        unsigned long long hits = 0;
        for (int j = 0; j < k; ++j) {
            const int e = chosen[j];
            ids[t * k + j] = e;
            weights[t * k + j] = (renorm ? chosen_w[j] / tot : chosen_w[j]) * scale;
            if (counts) atomicAdd(counts + e, 1);
            if (table) {
                const unsigned long long a = table[e];
                hits += (a >= slot_lo && a < slot_hi) ? 1ull : 0ull;
            }
        }
        if (stats) {
            atomicAdd(stats, hits);
            atomicAdd(stats + 1, (unsigned long long)k);
        }
    }
}
