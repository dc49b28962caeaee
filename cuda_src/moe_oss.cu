// gpt-oss's routed experts in the decode step: moe.cu's moe_gate_up / moe_down with each expert's biases (kept in VRAM
// for every expert, (n_expert, n_ff) and (n_expert, n_embd) fp32 per layer, indexed by the routed id) and SWIGLU_OAI
// between (common.cuh swiglu_oai). Experts through the same pointer table (VRAM slot or pinned arena, read in place).
// Separate kernels, so the uniform models' launches stay as they are.
#include "quant.cuh"
#include "common.cuh"

// Grid (ceil(n_ff / warps per block), k, T); dynamic shared memory staged_bytes(ncols).
// h[t, j, r] = swiglu_oai(gate_e[r] . xn_t + bg[e, r], up_e[r] . xn_t + bu[e, r]), e = ids[t, j], xn_t =
// rmsnorm(x_t) * norm_w (x_t as is when norm_w is NULL).
template <int QT>
__global__ void moe_gate_up_oai(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                                long long up_off, long long row_bytes, const float* __restrict__ x,
                                const float* __restrict__ norm_w, float eps, float* __restrict__ h, int n_ff, int ncols,
                                int k, const float* __restrict__ bg, const float* __restrict__ bu) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int j = blockIdx.y, t = blockIdx.z;
    const int e = ids[t * k + j];
    const uint8_t* rg = reinterpret_cast<const uint8_t*>(table[e]) + (long long)min(r, n_ff - 1) * row_bytes;
    const uint8_t* ru = rg + up_off;
    const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
    float g, u;
    dot2_s<QT>(rg, ru, xs, ncols, lane, g, u);
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0 && r < n_ff)
        h[((long long)t * k + j) * n_ff + r] = swiglu_oai(g + bg[(long long)e * n_ff + r], u + bu[(long long)e * n_ff + r]);
}

// Grid (ceil(n_embd / warps per block), T). out[t, r] += sum_j w[t, j] * (down_e[r] . h[t, j] + bd[e, r]), one warp a
// row over all k experts (k <= 32); with stage, h[t] (k * n_ff floats) from shared memory (staged_bytes(k * n_ff)).
template <int QT>
__global__ void moe_down_bias(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                              const float* __restrict__ weights, long long down_off, long long row_bytes,
                              const float* __restrict__ h, float* __restrict__ out, int n_embd, int n_ff, int k,
                              int stage, const float* __restrict__ bd) {
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
    const float* hs = stage ? stage_x<QT>(ht, nullptr, 0.f, k * n_ff) : nullptr;
    float s = 0.f;
    for (int j = 0; j < k; ++j) {
        const uint8_t* row = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, addr, j));
        const float wj = __shfl_sync(0xffffffffu, wl, j);
        s += wj * (stage ? dot_s<QT>(row, hs + xs_at<QT>(j * n_ff), n_ff, lane)
                         : dotw<QT>(row, ht + (long long)j * n_ff, n_ff, lane));
    }
    if (lane < k) s += wl * bl;                         // lane j < k adds expert j's weighted bias
    s = warp_sum(s);
    if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
}
