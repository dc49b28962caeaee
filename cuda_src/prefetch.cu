// Next-layer expert prefetch for decode (engine/cuda/prefetch.py drives it; pre-gating as in Pre-gated MoE / ProMoE /
// AdapMoE): right after layer l's router, `predict` runs layer l+1's router on layer l's FFN input, and on a side
// stream `prefetch_copy` pulls the predicted experts that have no VRAM cache slot from the mapped pinned arena into
// VRAM staging slots and points layer l+1's table entries at them. The PCIe link then works while layer l's experts
// and layer l+1's attention compute, instead of only inside layer l+1's expert kernels.
//
// Staging: 2 banks (layer parity) of k slots. A bank's record (rec: layer, n, expert ids; rec_addr: the entries'
// original addresses) lets the next user of the bank, two layers on, restore the table first; prefetch_finish
// restores both banks at the end of the step, so the table is clean between steps.
#include "quant.cuh"
#include "common.cuh"

#define PF_MAX_PER_LANE 16   // n_expert <= 512
#define PF_MAX_K 16
// stats: look-ups with a prediction, of them predicted right, experts staged (copied over PCIe), staged and used
#define PF_PREDICTED 0
#define PF_CORRECT 1
#define PF_STAGED 2
#define PF_USED 3

// Layer l's routing as the prediction bookkeeping needs it (one warp): ids copied to actual (the restore two layers
// on counts staged experts that were used), and, when the layer had a prediction, how many of ids it named.
__device__ __forceinline__ void note_routing(const int* __restrict__ ids, const int* __restrict__ pred, int check,
                                             int* __restrict__ actual, int k, unsigned long long* __restrict__ stats) {
    const int lane = threadIdx.x & 31;
    unsigned long long hit = 0;
    if (lane < k) {
        const int e = __ldcg(ids + lane);
        actual[lane] = e;
        if (check)
            for (int j = 0; j < k; ++j) hit += __ldcg(pred + j) == e ? 1ull : 0ull;
    }
    if (check) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) hit += __shfl_xor_sync(0xffffffffu, hit, o);
        if (lane == 0) {
            atomicAdd(stats + PF_PREDICTED, (unsigned long long)k);
            atomicAdd(stats + PF_CORRECT, hit);
        }
    }
}

// Put a bank's rewritten table entries back (one thread) and count the staged experts its layer used.
__device__ __forceinline__ void restore_bank(unsigned long long* __restrict__ table, int n_expert, int k,
                                             int* __restrict__ rec, const unsigned long long* __restrict__ rec_addr,
                                             const int* __restrict__ actual, unsigned long long* __restrict__ stats) {
    const int n = rec[1];
    if (n <= 0) return;
    const int l = rec[0];
    unsigned long long used = 0;
    for (int c = 0; c < n; ++c) {
        const int e = rec[2 + c];
        table[(long long)l * n_expert + e] = rec_addr[c];
        for (int j = 0; j < k; ++j) used += actual[(long long)l * k + j] == e ? 1ull : 0ull;
    }
    rec[1] = 0;
    atomicAdd(stats + PF_USED, used);
}

// The k largest of logits[0..n) by one warp, largest first, ties to the lowest id (as the router picks); NaN counts
// as -inf so the choice is always k valid ids.
__device__ __forceinline__ void topk_warp(const float* logits, int n, int k, int* __restrict__ out) {
    const int lane = threadIdx.x & 31;
    float v[PF_MAX_PER_LANE];
    unsigned int taken = 0;
#pragma unroll
    for (int i = 0; i < PF_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        const float a = e < n ? __ldcg(logits + e) : NEG_INF;
        v[i] = a == a ? a : NEG_INF;
        if (e >= n) taken |= 1u << i;
    }
    for (int j = 0; j < k; ++j) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PF_MAX_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (!(taken >> i & 1u) && (v[i] > bv || (v[i] == bv && e < bi))) { bv = v[i]; bi = e; }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) out[j] = bi;
        if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    }
}

// Grid ceil(n_expert / warps per block), one warp per router row; dynamic shared memory n_embd floats.
// logits = R . (rmsnorm(x) * norm_w), the next layer's router on this layer's FFN input (x is the residual before this
// layer's experts add to it; each block normalises it itself). The last block writes the top-k into pred_out and
// notes this layer's routing (ids) against the prediction made for it (pred_in) when `check`.
// R == nullptr: the bookkeeping only (a layer with no next router).
template <int QT>
__global__ void predict(const float* __restrict__ x, const float* __restrict__ norm_w, float eps, int n_embd,
                        const uint8_t* __restrict__ R, long long row_bytes, int n_expert, int k,
                        float* __restrict__ logits, int* __restrict__ pred_out, const int* __restrict__ ids,
                        const int* __restrict__ pred_in, int check, int* __restrict__ actual,
                        unsigned long long* __restrict__ stats, int* __restrict__ counter) {
    extern __shared__ float4 xs4[];
    float* xs = reinterpret_cast<float*>(xs4);
    __shared__ float red[32];
    const int lane = threadIdx.x & 31;
    if (R) {
        float s = 0.f;
        for (int i = threadIdx.x; i < n_embd; i += blockDim.x) {
            const float a = __ldcg(x + i);
            s += a * a;
        }
        s = block_sum(s, red);
        const float inv = rsqrtf(s / n_embd + eps);
        for (int i = threadIdx.x; i < n_embd; i += blockDim.x) xs[i] = __ldcg(x + i) * inv * norm_w[i];
        __syncthreads();
        const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
        if (r < n_expert) {
            const float d = warp_sum(dotw<QT>(R + (long long)r * row_bytes, xs, n_embd, lane));
            if (lane == 0) logits[r] = d;
        }
    }
    if (last_block(counter) && threadIdx.x < 32) {
        if (R) topk_warp(logits, n_expert, k, pred_out);
        note_routing(ids, pred_in, check, actual, k, stats);
    }
}

// Side stream, grid of a few dozen blocks. For layer `layer` (this bank): block 0 first restores the entries the
// bank's previous layer rewrote (its experts finished before this layer's prediction was made); every block finds
// the predicted experts whose entry is neither a VRAM cache slot (inside [slot_lo, slot_hi)) nor 0 (only in the
// file, memory modes) and copies its share of their blobs (units of 16 bytes) from where the entry points into the
// bank's staging slots, several 16-byte loads in flight per thread to keep the link busy; the last block then points
// the entries at the staging slots and records them. Nothing else writes this layer's entries during the step, so
// every block sees the same plan.
#define PF_UNROLL 4
extern "C" __global__ void prefetch_copy(unsigned long long* __restrict__ table, int layer, int n_expert, int k,
                                         const int* __restrict__ pred, uint8_t* __restrict__ staging, long long stride,
                                         unsigned int units, unsigned long long slot_lo, unsigned long long slot_hi,
                                         int* __restrict__ rec, unsigned long long* __restrict__ rec_addr,
                                         const int* __restrict__ actual, unsigned long long* __restrict__ stats,
                                         int* __restrict__ counter) {
    __shared__ unsigned long long src[PF_MAX_K];
    __shared__ int who[PF_MAX_K];
    __shared__ int n_sh;
    unsigned long long* row = table + (long long)layer * n_expert;
    if (threadIdx.x == 0) {
        int n = 0;
        for (int j = 0; j < k; ++j) {
            const int e = pred[j];
            const unsigned long long a = __ldcg(row + e);
            if (a && (a < slot_lo || a >= slot_hi)) {     // 0: only in the file (memory modes)
                src[n] = a;
                who[n] = e;
                ++n;
            }
        }
        n_sh = n;
        if (blockIdx.x == 0) restore_bank(table, n_expert, k, rec, rec_addr, actual, stats);
    }
    __syncthreads();
    const unsigned int n = n_sh;
    const unsigned int total = n * units;
    const unsigned int step = gridDim.x * blockDim.x;
    for (unsigned int base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += PF_UNROLL * step) {
        uint4 v[PF_UNROLL];
#pragma unroll
        for (int i = 0; i < PF_UNROLL; ++i) {
            const unsigned int u = base + i * step;
            if (u < total) v[i] = reinterpret_cast<const uint4*>(src[u / units])[u % units];
        }
#pragma unroll
        for (int i = 0; i < PF_UNROLL; ++i) {
            const unsigned int u = base + i * step;
            if (u < total) reinterpret_cast<uint4*>(staging + (u / units) * stride)[u % units] = v[i];
        }
    }
    if (last_block(counter) && threadIdx.x == 0) {
        rec[0] = layer;
        for (int c = 0; c < (int)n; ++c) {
            rec[2 + c] = who[c];
            rec_addr[c] = src[c];
            row[who[c]] = (unsigned long long)(staging + c * stride);
        }
        rec[1] = n;
        if (n) atomicAdd(stats + PF_STAGED, (unsigned long long)n);
        __threadfence();
    }
}

// End of the step (one warp, after the last layer's experts): the last layer's routing noted as predict does for the
// others, then both banks restored.
extern "C" __global__ void prefetch_finish(unsigned long long* __restrict__ table, int n_expert, int k,
                                           const int* __restrict__ ids, const int* __restrict__ pred, int check,
                                           int last_layer, int* __restrict__ actual, int* __restrict__ rec0,
                                           const unsigned long long* __restrict__ rec_addr0, int* __restrict__ rec1,
                                           const unsigned long long* __restrict__ rec_addr1,
                                           unsigned long long* __restrict__ stats) {
    note_routing(ids, pred, check, actual + (long long)last_layer * k, k, stats);
    __syncwarp();
    if (threadIdx.x == 0) {
        restore_bank(table, n_expert, k, rec0, rec_addr0, actual, stats);
        restore_bank(table, n_expert, k, rec1, rec_addr1, actual, stats);
        __threadfence();
    }
}
