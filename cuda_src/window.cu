// The decode step's kernels for a window of T = 1..WIN_MAX tokens at consecutive positions (a speculative verify
// window, issue 34 item 4; engine/cuda/decode_window.py launches them): the token-parallel dense mat-vecs, the
// window's router (and the union of its routed experts), its per-token state. Each keeps the one-token kernel's
// arithmetic per token (dense.cu, router.cu), so token t of a window gets what a one-token step at its position gets
// (within fp32 rounding: the H200 found Q4_K's unit sums contracted into FMAs otherwise in another kernel, every other
// type bit for bit). The token-serial kernels (weights loaded once a warp for all T tokens) are window_serial.cu's.
//
// Inputs of T tokens are rows of ldx floats (x + t * ldx); outputs rows of ldy.
#include "window.cuh"
#include "router.cu"     // route_block, ROUTER_F4 (its kernels compile here too, unused)
#include "dense.cu"      // mv_block, mv3_block, swiglu_block: the token-parallel kernels below are their calls

// ---- token-parallel dense mat-vecs ------------------------------------------------------------------------------
// dense.cu's mv / mv3 / swiglu_mv with the window's token t in block x and the one-token grid's block in y (grid (T,
// their grid)): each block is the one-token kernel's block on token t's rows, so the outputs are the one-token
// kernel's, and the T tokens' blocks of the same rows are dispatched one after another (x first), so they run side
// by side and a row comes from HBM once, the other tokens' reads from L1/L2. With the token in y instead, the output
// head (~250 MB at Q6_K, beyond L2) would stream from HBM once per token. The H200 measured the token-serial kernels (window_serial.cu: the weights loaded
// once a warp, the tokens' sums one after the other) at about T one-token steps a window. Shared memory
// staged_bytes(ncols).
template <int QT>
__global__ void mv_tok(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x, int ldx,
                       float* __restrict__ y, int ldy, const float* __restrict__ bias,
                       const float* __restrict__ gate_logit, int nrows, int ncols, int accumulate,
                       const float* __restrict__ norm_w, float eps, int stage, int rows_per_warp) {
    const int t = blockIdx.x;
    mv_block<QT>(blockIdx.y, W, row_bytes, x + (long long)t * ldx, y + (long long)t * ldy, bias,
                 gate_logit ? gate_logit + t : nullptr, nrows, ncols, accumulate, norm_w, eps, stage,
                 rows_per_warp);
}

template <int QT>
__global__ void mv3_tok(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                        const uint8_t* __restrict__ W2, long long row_bytes, const float* __restrict__ x, int ldx,
                        const float* __restrict__ norm_w, float eps, float* __restrict__ y0, float* __restrict__ y1,
                        float* __restrict__ y2, const float* __restrict__ b0, const float* __restrict__ b1,
                        const float* __restrict__ b2, int n0, int n1, int n2, int ncols) {
    const int t = blockIdx.x;
    mv3_block<QT>(blockIdx.y, W0, W1, W2, row_bytes, x + (long long)t * ldx, norm_w, eps, y0, y1, y2, b0, b1, b2, n0,
                  n1, n2, ncols, t);
}

template <int QT>
__global__ void swiglu_tok(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long row_bytes,
                           const float* __restrict__ x, int ldx, const float* __restrict__ norm_w, float eps,
                           float* __restrict__ h, int nrows, int ncols) {
    const int t = blockIdx.x;
    swiglu_block<QT>(blockIdx.y, Wg, Wu, row_bytes, x + (long long)t * ldx, norm_w, eps, h + (long long)t * nrows,
                     nrows, ncols);
}

extern "C" __global__ void win_union(const int* __restrict__ ids, int n_pairs, int* __restrict__ uni) {
    win_union_block(ids, n_pairs, uni);
}

// router.cu router_fused for a window: the router logits of T tokens (each router row read once, x of every token
// staged normed: the same sums as router_fused's row_dot), then in the last block the routing of each token in turn
// (route_block: ids, weights, counts and hit statistics as T router_fused launches give them) and, with uni given,
// the window's expert union (win_union's records). With bias (gpt-oss), router_fused_bias's: the router's bias
// added to the logits before the routing. logits: (T, n_expert); ids, weights: (T, k). Grid
// ceil(n_expert / warps per block), blockDim WIN_MAX_PAIRS (4 warps); dynamic shared memory T * staged_bytes(ncols).
template <int QT>
__global__ void router_win(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x, int ldx,
                           const float* __restrict__ norm_w, float eps, int ncols, float* __restrict__ logits,
                           int n_expert, int k, int renorm, float scale, int* __restrict__ ids,
                           float* __restrict__ weights, const unsigned long long* __restrict__ table,
                           unsigned long long slot_lo, unsigned long long slot_hi, int* __restrict__ counts,
                           unsigned long long* __restrict__ stats, int* __restrict__ counter, int* __restrict__ uni,
                           int T, const float* __restrict__ bias) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const uint8_t* row = W + (long long)min(r, n_expert - 1) * row_bytes;
    const float* xp[WIN_MAX];
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) xp[i] = x + (long long)min(i, T - 1) * ldx;
    float acc[WIN_MAX];
    const float* xs[WIN_MAX];
    if constexpr (QT == STRATA_Q_F32) {         // router.cu row_dot's F32 path: the row's float4s before the staging
        const float4* w4 = reinterpret_cast<const float4*>(row);
        const int nf = ncols / 4;
        float4 wv[ROUTER_F4];
#pragma unroll
        for (int i = 0; i < ROUTER_F4; ++i)
            if (lane + 32 * i < nf) wv[i] = w4[lane + 32 * i];
        win_staged_ptrs(win_stage<QT>(xp, T, norm_w, eps, ncols), win_sl(ncols), xs);
#pragma unroll
        for (int t = 0; t < WIN_MAX; ++t) {
            acc[t] = 0.f;
            if (t >= T) continue;
            const float4* x4 = reinterpret_cast<const float4*>(xs[t]);
#pragma unroll
            for (int i = 0; i < ROUTER_F4; ++i)
                if (lane + 32 * i < nf) {
                    const float4 a = x4[lane + 32 * i];
                    acc[t] += wv[i].x * a.x + wv[i].y * a.y + wv[i].z * a.z + wv[i].w * a.w;
                }
            for (int f = lane + 32 * ROUTER_F4; f < nf; f += 32) {
                const float4 w = w4[f], a = x4[f];
                acc[t] += w.x * a.x + w.y * a.y + w.z * a.z + w.w * a.w;
            }
        }
    } else {
        win_staged_ptrs(win_stage<QT>(xp, T, norm_w, eps, ncols), win_sl(ncols), xs);
        win_dot_s<QT>(row, xs, T, ncols, lane, acc);
    }
#pragma unroll
    for (int t = 0; t < WIN_MAX; ++t) {
        if (t >= T) break;
        const float s = warp_sum(acc[t]);
        if (lane == 0 && r < n_expert) logits[(long long)t * n_expert + r] = bias ? s + bias[r] : s;
    }
    if (last_block(counter)) {
        for (int t = 0; t < T; ++t) {
            route_block(logits + (long long)t * n_expert, n_expert, k, renorm, scale, ids + t * k, weights + t * k,
                        table, slot_lo, slot_hi, counts, stats);
            __syncthreads();
        }
        if (uni) win_union_block(ids, T * k, uni);
    }
}

// ---- the window's per-token state ------------------------------------------------------------------------------
// What dense.cu's embed does for a one-token step, for each of the window's T tokens: state row t (8 ints) gets the
// token and its position params[P_POS] + t and a cleared argmax word and NaN count; the attention launches of token t
// read row t, so token t sees positions 0 .. pos0 + t. tokens: mapped host memory (the window's ids).
extern "C" __global__ void win_setup(const int* __restrict__ tokens, const int* __restrict__ params,
                                     int* __restrict__ state, int T) {
    const int t = threadIdx.x;
    if (t < T) {
        int* s = state + 8 * t;
        s[0] = tokens[t];
        s[1] = params[P_POS] + t;
        s[2] = s[3] = s[4] = 0;
    }
}
