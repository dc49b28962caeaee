// The routed expert FFN of one token (or a small window), reading every expert through the per-(layer, expert)
// pointer table: an entry is the expert's VRAM cache slot or its address in the mapped pinned arena, so a missed
// expert is read over PCIe in place by these same kernels. An expert blob is gate | up | down, each the GGUF's
// rows for that expert.
#include "quant.cuh"
#include "common.cuh"

// Grid (ceil(n_ff / warps per block), k, T). h[t, j, r] = silu(gate_e[r] . x_t) * (up_e[r] . x_t), e = ids[t, j].
template <int QT>
__global__ void moe_gate_up(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                            long long up_off, long long row_bytes, const float* __restrict__ x,
                            float* __restrict__ h, int n_ff, int ncols, int k) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= n_ff) return;
    const int j = blockIdx.y, t = blockIdx.z;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(table[ids[t * k + j]]);
    float g, u;
    dot2_row<QT>(base + (long long)r * row_bytes, base + up_off + (long long)r * row_bytes,
                 x + (long long)t * ncols, ncols, lane, g, u);
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) h[((long long)t * k + j) * n_ff + r] = silu(g) * u;
}

// Grid (ceil(n_embd / warps per block), T). out[t, r] += sum_j w[t, j] * (down_e[r] . h[t, j]).
// One warp sums a row over all k experts, so the result does not depend on scheduling. With norm_w given (decode,
// T = 1), the last block writes norm_out = rmsnorm(out) * norm_w, the next layer's input.
template <int QT>
__global__ void moe_down(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                         const float* __restrict__ weights, long long down_off, long long row_bytes,
                         const float* __restrict__ h, float* __restrict__ out, int n_embd, int n_ff, int k,
                         const float* __restrict__ norm_w, float* __restrict__ norm_out, int* __restrict__ counter,
                         float eps) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    if (r < n_embd) {
        // Lane partials of all k rows first, one warp reduction at the end: the k rows' loads overlap, which is
        // what hides PCIe latency when some of the experts are read in place from host memory.
        float s = 0.f;
#pragma unroll 8
        for (int j = 0; j < k; ++j) {
            const uint8_t* base = reinterpret_cast<const uint8_t*>(table[ids[t * k + j]]);
            s += weights[t * k + j] * dotw<QT>(base + down_off + (long long)r * row_bytes,
                                               h + ((long long)t * k + j) * n_ff, n_ff, lane);
        }
        s = warp_sum(s);
        if (lane == 0) out[(long long)t * n_embd + r] += s;
    }
    if (norm_w && last_block(counter)) block_rmsnorm(out, norm_w, norm_out, n_embd, eps);
}
