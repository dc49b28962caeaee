// The decode step's kernels for a window of T = 1..WIN_MAX tokens at consecutive positions (a speculative verify
// window, issue 34 item 4): each reads a weight row once for all T tokens, and each routed expert once for the
// tokens routed to it (the union of the window's experts; an expert read in place from pinned host memory is read
// over PCIe once a window as well).
//
// Every kernel here mirrors a one-token kernel's arithmetic per token (dense.cu mv / mv3 / swiglu_mv, moe.cu
// moe_gate_up / moe_down): the same staging (and the same block-wide norm sum), the same lane-to-chunk assignment
// and the same order of every fp32 sum, with only the weight loads shared. The H200 found every type's outputs equal
// to the one-token kernels' bit for bit but Q4_K's, whose unit sums the compiler contracts into FMAs otherwise here
// (1e-5..2e-4 absolute on random rows). It also measured these token-serial kernels at about T one-token steps a
// window (the step is latency-bound): the default window program is the token-parallel mv_tok / mv3_tok /
// swiglu_tok below and moe.cu's kernels with T in the grid (decode_window.py dense_mode / expert_mode).
// (engine/cuda/decode_window.py launches them; tests/test_cuda_window.py checks each against NumPy and against the
// one-token kernel run T times.)
//
// Inputs of T tokens are rows of ldx floats (x + t * ldx); outputs rows of ldy. Staged inputs take sl floats a token
// in shared memory (sl = n + 4 * (n / 64): stage_x's padded layout), so a launch passes T * staged_bytes(n).
#include "quant.cuh"
#include "common.cuh"
#include "router.cu"     // route_block, ROUTER_F4 (its kernels compile here too, unused)
#include "dense.cu"      // staged_row_dot, mv_store: the token-parallel kernels below are dense.cu's bodies

#define WIN_MAX 8           // tokens a window (engine/backend.py MAX_WINDOW)
#define WIN_MAX_PAIRS 128   // (token, expert) pairs of a window: WIN_MAX * ROUTER_MAX_K

__device__ __forceinline__ int win_sl(int n) { return n + 4 * (n >> 6); }

// stage_x for one token into xs (any offset of the dynamic shared memory): the same sums in the same order.
template <int QT>
__device__ __forceinline__ void win_stage_one(const float* x, const float* __restrict__ w, float eps, int n,
                                              float* xs, float* red) {
    float inv = 1.f;
    if (w) {
        float s = 0.f;
        for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x) {
            const float4 v = *reinterpret_cast<const float4*>(x + i);
            s += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        inv = rsqrtf(block_sum(s, red) / n + eps);
    }
    for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x) {
        float4 v = *reinterpret_cast<const float4*>(x + i);
        if (w) {
            const float4 g = *reinterpret_cast<const float4*>(w + i);
            v.x = v.x * inv * g.x;
            v.y = v.y * inv * g.y;
            v.z = v.z * inv * g.z;
            v.w = v.w * inv * g.w;
        }
        *reinterpret_cast<float4*>(xs + xs_at<QT>(i)) = v;
    }
}

// Tokens xp[0..n) staged one after the other (token i at xs + i * win_sl(ncols)); every thread calls it.
template <int QT>
__device__ __forceinline__ const float* win_stage(const float* const (&xp)[WIN_MAX], int n, const float* norm_w,
                                                  float eps, int ncols) {
    __shared__ float red[32];
    float* xs = reinterpret_cast<float*>(strata_smem4);
    const int sl = win_sl(ncols);
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i)
        if (i < n) win_stage_one<QT>(xp[i], norm_w, eps, ncols, xs + i * sl, red);
    __syncthreads();
    return xs;
}

// ---- lane partials of one row against n vectors, weights loaded once --------------------------------------------
// win_dot: acc[i] = dot_s<QT>(row, xp[i], ncols, lane) (= dot_row for all but Q4_K, whose staged unit read is
// dot_s's own batches), for every i < n, from one load of the row.
template <int QT, int U>
__device__ __forceinline__ void win_dot_step(const uint8_t* __restrict__ row, const float* const (&xp)[WIN_MAX],
                                             int n, int c0, float (&acc)[WIN_MAX]) {
    constexpr int CPB = QTraits<QT>::QK / 8, BYTES = QTraits<QT>::BYTES;
    float w[U][8];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = c0 + 32 * u;
        dequant8<QT>(row + (c / CPB) * BYTES, c % CPB, w[u]);
    }
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int i = 0; i < WIN_MAX; i++) {
            if (i >= n) break;
            float xv[8];
            strata_load8(xp[i] + (c0 + 32 * u) * 8, xv);
#pragma unroll
            for (int k = 0; k < 8; k++) acc[i] += w[u][k] * xv[k];
        }
}

// dot_row's schedule (quant.cuh dot_rows with R = 1: four chunks a lane and step, then the tail one at a time)
template <int QT>
__device__ __forceinline__ void win_dot_row(const uint8_t* __restrict__ row, const float* const (&xp)[WIN_MAX],
                                            int n, int ncols, int lane, float (&acc)[WIN_MAX]) {
    constexpr int U = 4;
    const int nchunks = ncols >> 3;
    int c = lane;
    for (; c + 32 * (U - 1) < nchunks; c += 32 * U) win_dot_step<QT, U>(row, xp, n, c, acc);
    for (; c < nchunks; c += 32) win_dot_step<QT, 1>(row, xp, n, c, acc);
}

// win_dot_row for two rows, each against its own vectors: both rows' chunks loaded before the arithmetic (two
// experts' rows in flight in moe_down_win). A lane takes its chunks in ascending order whatever the step, so every
// (row, vector) sum is win_dot_row's.
template <int QT, int U>
__device__ __forceinline__ void win_dot_step2(const uint8_t* __restrict__ ra, const float* const (&xa)[WIN_MAX],
                                              int na, const uint8_t* __restrict__ rb,
                                              const float* const (&xb)[WIN_MAX], int nb, int c0,
                                              float (&aa)[WIN_MAX], float (&ab)[WIN_MAX]) {
    constexpr int CPB = QTraits<QT>::QK / 8, BYTES = QTraits<QT>::BYTES;
    float wa[U][8], wb[U][8];
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int c = c0 + 32 * u;
        dequant8<QT>(ra + (c / CPB) * BYTES, c % CPB, wa[u]);
        dequant8<QT>(rb + (c / CPB) * BYTES, c % CPB, wb[u]);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
#pragma unroll
        for (int i = 0; i < WIN_MAX; i++) {
            if (i >= na) break;
            float xv[8];
            strata_load8(xa[i] + (c0 + 32 * u) * 8, xv);
#pragma unroll
            for (int k = 0; k < 8; k++) aa[i] += wa[u][k] * xv[k];
        }
#pragma unroll
        for (int i = 0; i < WIN_MAX; i++) {
            if (i >= nb) break;
            float xv[8];
            strata_load8(xb[i] + (c0 + 32 * u) * 8, xv);
#pragma unroll
            for (int k = 0; k < 8; k++) ab[i] += wb[u][k] * xv[k];
        }
    }
}
template <int QT>
__device__ __forceinline__ void win_dot_row2(const uint8_t* __restrict__ ra, const float* const (&xa)[WIN_MAX],
                                             int na, const uint8_t* __restrict__ rb,
                                             const float* const (&xb)[WIN_MAX], int nb, int ncols, int lane,
                                             float (&aa)[WIN_MAX], float (&ab)[WIN_MAX]) {
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) aa[i] = ab[i] = 0.f;
    const int nchunks = ncols >> 3;
    int c = lane;
    for (; c + 32 < nchunks; c += 64) win_dot_step2<QT, 2>(ra, xa, na, rb, xb, nb, c, aa, ab);
    for (; c < nchunks; c += 32) win_dot_step2<QT, 1>(ra, xa, na, rb, xb, nb, c, aa, ab);
}

// Q4_K: q4k_dot of one loaded unit against staged x (padded layout) or an unpadded vector (global memory): the
// unit's 32 values sit in one 64-float stretch either way, so the floats read and the sums are the same.
__device__ __forceinline__ float win_q4k_dot(const Q4KRaw& r, const float4* x0, int u) {
    float d0, mn0, d1, mn1, s0, s1, t0, t1;
    q4k_unpack(r, u, d0, mn0, d1, mn1);
    q4k_sums(r.qs, x0, s0, s1, t0, t1);
    return d0 * s0 + d1 * s1 - (mn0 * t0 + mn1 * t1);
}
__device__ __forceinline__ const float4* win_q4k_flat(const float* x, int u) {
    return reinterpret_cast<const float4*>(x + (u >> 3) * 256 + 64 * ((u >> 1) & 3) + 16 * (u & 1));
}

template <int QT>
__device__ __forceinline__ void win_dot_s(const uint8_t* __restrict__ row, const float* const (&xp)[WIN_MAX], int n,
                                          int ncols, int lane, float (&acc)[WIN_MAX]) {
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) acc[i] = 0.f;
    if constexpr (QT == STRATA_Q_Q4_K) {
        const int nu = ncols / 32;
        for (int u0 = lane; u0 < nu; u0 += 32 * Q4K_BATCH) {
            Q4KRaw r[Q4K_BATCH];
#pragma unroll
            for (int b = 0; b < Q4K_BATCH; ++b)
                if (u0 + 32 * b < nu) r[b] = q4k_load(row, u0 + 32 * b);
#pragma unroll
            for (int b = 0; b < Q4K_BATCH; ++b)
                if (u0 + 32 * b < nu)
#pragma unroll
                    for (int i = 0; i < WIN_MAX; ++i)
                        if (i < n) acc[i] += q4k_dot(r[b], xp[i], u0 + 32 * b);
        }
    } else {
        win_dot_row<QT>(row, xp, n, ncols, lane, acc);
    }
}

// dotw<QT> (x unstaged, in global memory) for n vectors: Q4_K's q4k_unit sums, each unit loaded once.
template <int QT>
__device__ __forceinline__ void win_dotw(const uint8_t* __restrict__ row, const float* const (&xp)[WIN_MAX], int n,
                                         int ncols, int lane, float (&acc)[WIN_MAX]) {
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) acc[i] = 0.f;
    if constexpr (QT == STRATA_Q_Q4_K) {
        const int nu = ncols / 32;
        for (int u = lane; u < nu; u += 32) {
            const int blk = u >> 3, j = (u >> 1) & 3, hh = u & 1;
            const uint8_t* b = row + blk * 144;
            const uint4 qv = *reinterpret_cast<const uint4*>(b + 16 + 32 * j + 16 * hh);
            const unsigned int dd = *reinterpret_cast<const unsigned int*>(b);
            const float d = h2f((unsigned short)(dd & 0xffff)), dmin = h2f((unsigned short)(dd >> 16));
            float sc0, m0, sc1, m1;
            q4k_sm(b, 2 * j, sc0, m0);
            q4k_sm(b, 2 * j + 1, sc1, m1);
#pragma unroll
            for (int i = 0; i < WIN_MAX; ++i) {
                if (i >= n) break;
                float s0, s1, t0, t1;
                q4k_sums(qv, win_q4k_flat(xp[i], u), s0, s1, t0, t1);
                acc[i] += d * (sc0 * s0 + sc1 * s1) - dmin * (m0 * t0 + m1 * t1);
            }
        }
    } else {
        win_dot_row<QT>(row, xp, n, ncols, lane, acc);
    }
}

// The staged vectors' addresses (token i at xs + i * sl).
__device__ __forceinline__ void win_staged_ptrs(const float* xs, int sl, const float* (&out)[WIN_MAX]) {
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) out[i] = xs + i * sl;
}

// First row of a staged mat-vec warp: preload (Q4_K, B units a lane), stage the n tokens, finish per token.
template <int QT, int B>
__device__ __forceinline__ void win_first_row(const uint8_t* __restrict__ row, const float* const (&xp)[WIN_MAX],
                                              int n, const float* __restrict__ norm_w, float eps, int ncols, int lane,
                                              float (&acc)[WIN_MAX], const float* (&xs)[WIN_MAX]) {
    if constexpr (QT == STRATA_Q_Q4_K) {
        Q4KRaw p[B];
        q4k_preload<B>(row, ncols, lane, p);
        win_staged_ptrs(win_stage<QT>(xp, n, norm_w, eps, ncols), win_sl(ncols), xs);
#pragma unroll
        for (int i = 0; i < WIN_MAX; ++i) acc[i] = i < n ? q4k_finish<B>(p, row, xs[i], ncols, lane) : 0.f;
    } else {
        win_staged_ptrs(win_stage<QT>(xp, n, norm_w, eps, ncols), win_sl(ncols), xs);
        win_dot_s<QT>(row, xs, n, ncols, lane, acc);
    }
}

// ---- dense mat-vecs ---------------------------------------------------------------------------------------------
// dense.cu's mv_store: y[r] = (accumulate ? y[r] : 0) + gate * (s + bias[r])
__device__ __forceinline__ void win_store(int r, float s, float* __restrict__ y, const float* __restrict__ bias,
                                          const float* __restrict__ gate_logit, int accumulate) {
    if (bias) s += bias[r];
    if (gate_logit) s *= 1.f / (1.f + __expf(-gate_logit[0]));
    y[r] = accumulate ? y[r] + s : s;
}

// dense.cu mv for T tokens: y_t[r] = (accumulate ? y_t[r] : 0) + gate_t * (W[r] . xn_t + bias[r]), gate_t =
// sigmoid(gate_logit[t]) when given. stage: x staged (then normed when norm_w is given; dynamic shared memory
// T * staged_bytes(ncols)), else read from global memory, as the one-token launch of the same matrix does (launch.py
// Launcher.mv's rule). Grid ceil(nrows / (warps * rows_per_warp)).
template <int QT>
__global__ void mv_win(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x, int ldx,
                       float* __restrict__ y, int ldy, const float* __restrict__ bias,
                       const float* __restrict__ gate_logit, int nrows, int ncols, int accumulate,
                       const float* __restrict__ norm_w, float eps, int stage, int rows_per_warp, int T) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int r0 = blockIdx.x * rows_per_warp * nw + (threadIdx.x >> 5);
    const float* xp[WIN_MAX];
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) xp[i] = x + (long long)min(i, T - 1) * ldx;
    float acc[WIN_MAX];
    auto store = [&](int r) {
#pragma unroll
        for (int i = 0; i < WIN_MAX; ++i) {
            if (i >= T) break;
            const float s = warp_sum(acc[i]);
            if (lane == 0) win_store(r, s, y + (long long)i * ldy, bias, gate_logit ? gate_logit + i : nullptr,
                                    accumulate);
        }
    };
    if (stage) {
        const float* xs[WIN_MAX];
        // 4 units a lane up front, as mv's staged path
        win_first_row<QT, 4>(W + (long long)min(r0, nrows - 1) * row_bytes, xp, T, norm_w, eps, ncols, lane, acc, xs);
        if (r0 < nrows) store(r0);
        for (int k = 1; k < rows_per_warp; ++k) {
            const int r = r0 + k * nw;
            if (r >= nrows) break;
            win_dot_s<QT>(W + (long long)r * row_bytes, xs, T, ncols, lane, acc);
            store(r);
        }
    } else {
        for (int k = 0; k < rows_per_warp; ++k) {
            const int r = r0 + k * nw;
            if (r >= nrows) break;
            win_dotw<QT>(W + (long long)r * row_bytes, xp, T, ncols, lane, acc);
            store(r);
        }
    }
}

// dense.cu mv3 for T tokens: rows [0, n0) of W0, then W1, then W2, outputs y0 + t * n0 (y1 + t * n1, ...); x staged
// (normed by norm_w when given); dynamic shared memory T * staged_bytes(ncols).
template <int QT>
__global__ void mv3_win(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                        const uint8_t* __restrict__ W2, long long row_bytes, const float* __restrict__ x, int ldx,
                        const float* __restrict__ norm_w, float eps, float* __restrict__ y0, float* __restrict__ y1,
                        float* __restrict__ y2, const float* __restrict__ b0, const float* __restrict__ b1,
                        const float* __restrict__ b2, int n0, int n1, int n2, int ncols, int T) {
    const int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool valid = r < n0 + n1 + n2;
    if (!valid) r = n0 + n1 + n2 - 1;            // a tail warp re-reads the last row (it must join the staging)
    const uint8_t* W = W0;
    float* y = y0;
    const float* b = b0;
    int ld = n0;
    if (r >= n0) {
        r -= n0;
        W = W1; y = y1; b = b1; ld = n1;
        if (r >= n1) {
            r -= n1;
            W = W2; y = y2; b = b2; ld = n2;
        }
    }
    const float* xp[WIN_MAX];
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) xp[i] = x + (long long)min(i, T - 1) * ldx;
    float acc[WIN_MAX];
    const float* xs[WIN_MAX];
    win_first_row<QT, Q4K_BATCH>(W + (long long)r * row_bytes, xp, T, norm_w, eps, ncols, lane, acc, xs);
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        if (i >= T) break;
        const float s = warp_sum(acc[i]);
        if (lane == 0 && valid) y[(long long)i * ld + r] = b ? s + b[r] : s;
    }
}

// Gate and up of two rows against n staged vectors, each row's units (chunks) loaded once: per vector what
// dense.cu's swiglu_mv / moe.cu's moe_gate_up compute (Q4_K: q4k_preload before the staging, then q4k_finish2;
// others: dot2_s = dot2_row).
template <int QT>
__device__ __forceinline__ void win_dot2_row(const uint8_t* __restrict__ ra, const uint8_t* __restrict__ rb,
                                             const float* const (&xp)[WIN_MAX], int n, int ncols, int lane,
                                             float (&a)[WIN_MAX], float (&b)[WIN_MAX]) {
    constexpr int CPB = QTraits<QT>::QK / 8, BYTES = QTraits<QT>::BYTES;
    const int nchunks = ncols >> 3;
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) a[i] = b[i] = 0.f;
#pragma unroll 2
    for (int c = lane; c < nchunks; c += 32) {
        float wa[8], wb[8];
        dequant8<QT>(ra + (c / CPB) * BYTES, c % CPB, wa);
        dequant8<QT>(rb + (c / CPB) * BYTES, c % CPB, wb);
#pragma unroll
        for (int i = 0; i < WIN_MAX; ++i) {
            if (i >= n) break;
            float xv[8];
            strata_load8(xp[i] + c * 8, xv);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                a[i] += wa[k] * xv[k];
                b[i] += wb[k] * xv[k];
            }
        }
    }
}

// q4k_finish2 for n staged vectors (the first Q4K_BATCH units a lane preloaded), the rest of a wide row per vector
__device__ __forceinline__ void win_q4k_finish2(const Q4KRaw (&p)[Q4K_BATCH], const Q4KRaw (&q)[Q4K_BATCH],
                                                const uint8_t* __restrict__ ra, const uint8_t* __restrict__ rb,
                                                const float* const (&xs)[WIN_MAX], int n, int ncols, int lane,
                                                float (&a)[WIN_MAX], float (&b)[WIN_MAX]) {
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        a[i] = b[i] = 0.f;
        if (i < n) q4k_finish2(p, q, ra, rb, xs[i], ncols, lane, a[i], b[i]);
    }
}

// The gate/up pair of one row for n tokens: loads, staging (normed by norm_w) and sums as swiglu_mv / moe_gate_up.
template <int QT>
__device__ __forceinline__ void win_gate_up(const uint8_t* __restrict__ rg, const uint8_t* __restrict__ ru,
                                            const float* const (&xp)[WIN_MAX], int n, const float* __restrict__ norm_w,
                                            float eps, int ncols, int lane, float (&g)[WIN_MAX], float (&u)[WIN_MAX]) {
    const float* xs[WIN_MAX];
    if constexpr (QT == STRATA_Q_Q4_K) {
        Q4KRaw p[Q4K_BATCH], q[Q4K_BATCH];
        q4k_preload(rg, ncols, lane, p);
        q4k_preload(ru, ncols, lane, q);
        win_staged_ptrs(win_stage<QT>(xp, n, norm_w, eps, ncols), win_sl(ncols), xs);
        win_q4k_finish2(p, q, rg, ru, xs, n, ncols, lane, g, u);
    } else {
        win_staged_ptrs(win_stage<QT>(xp, n, norm_w, eps, ncols), win_sl(ncols), xs);
        win_dot2_row<QT>(rg, ru, xs, n, ncols, lane, g, u);
    }
}

// dense.cu swiglu_mv for T tokens: h_t[r] = silu(Wg[r] . xn_t) * (Wu[r] . xn_t), h_t = h + t * nrows; dynamic
// shared memory T * staged_bytes(ncols).
template <int QT>
__global__ void swiglu_win(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long row_bytes,
                           const float* __restrict__ x, int ldx, const float* __restrict__ norm_w, float eps,
                           float* __restrict__ h, int nrows, int ncols, int T) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const float* xp[WIN_MAX];
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) xp[i] = x + (long long)min(i, T - 1) * ldx;
    float g[WIN_MAX], u[WIN_MAX];
    win_gate_up<QT>(Wg + (long long)min(r, nrows - 1) * row_bytes, Wu + (long long)min(r, nrows - 1) * row_bytes, xp,
                    T, norm_w, eps, ncols, lane, g, u);
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        if (i >= T) break;
        const float gs = warp_sum(g[i]), us = warp_sum(u[i]);
        if (lane == 0 && r < nrows) h[(long long)i * nrows + r] = silu(gs) * us;
    }
}

// ---- token-parallel dense mat-vecs ------------------------------------------------------------------------------
// dense.cu's mv / mv3 / swiglu_mv with the window's token t in block y (grid (their grid, T)): each block is the
// one-token kernel's block on token t's rows, so the outputs are the one-token kernel's, and the T tokens' blocks run
// side by side (the one-token step leaves most of the GPU idle; a matrix's rows come from HBM about once, the other
// tokens' reads of them from L2). The H200 measured the token-serial kernels above (the weights loaded once in a
// warp, the tokens' sums one after the other) at about T one-token steps a window. Shared memory staged_bytes(ncols).
template <int QT>
__global__ void mv_tok(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x, int ldx,
                       float* __restrict__ y, int ldy, const float* __restrict__ bias,
                       const float* __restrict__ gate_logit, int nrows, int ncols, int accumulate,
                       const float* __restrict__ norm_w, float eps, int stage, int rows_per_warp) {
    const int t = blockIdx.y;
    x += (long long)t * ldx;
    y += (long long)t * ldy;
    if (gate_logit) gate_logit += t;
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int r0 = blockIdx.x * rows_per_warp * nw + (threadIdx.x >> 5);
    if (stage) {
        const float* xs;
        const float s = warp_sum(staged_row_dot<QT, 4>(W + (long long)min(r0, nrows - 1) * row_bytes, x, norm_w,
                                                       eps, ncols, lane, xs));
        if (lane == 0 && r0 < nrows) mv_store(r0, s, y, bias, gate_logit, accumulate);
        for (int i = 1; i < rows_per_warp; ++i) {
            const int r = r0 + i * nw;
            if (r >= nrows) break;
            const float u = warp_sum(dot_s<QT>(W + (long long)r * row_bytes, xs, ncols, lane));
            if (lane == 0) mv_store(r, u, y, bias, gate_logit, accumulate);
        }
    } else {
        for (int i = 0; i < rows_per_warp; ++i) {
            const int r = r0 + i * nw;
            if (r >= nrows) break;
            const float u = warp_sum(dotw<QT>(W + (long long)r * row_bytes, x, ncols, lane));
            if (lane == 0) mv_store(r, u, y, bias, gate_logit, accumulate);
        }
    }
}

template <int QT>
__global__ void mv3_tok(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                        const uint8_t* __restrict__ W2, long long row_bytes, const float* __restrict__ x, int ldx,
                        const float* __restrict__ norm_w, float eps, float* __restrict__ y0, float* __restrict__ y1,
                        float* __restrict__ y2, const float* __restrict__ b0, const float* __restrict__ b1,
                        const float* __restrict__ b2, int n0, int n1, int n2, int ncols) {
    const int t = blockIdx.y;
    x += (long long)t * ldx;
    const int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool valid = r < n0 + n1 + n2;
    if (!valid) r = n0 + n1 + n2 - 1;
    const uint8_t* W = W0;
    float* y = y0 + (long long)t * n0;
    const float* b = b0;
    if (r >= n0) {
        r -= n0;
        W = W1; y = y1 + (long long)t * n1; b = b1;
        if (r >= n1) {
            r -= n1;
            W = W2; y = y2 + (long long)t * n2; b = b2;
        }
    }
    const float* xs;
    const float s = warp_sum(staged_row_dot<QT>(W + (long long)r * row_bytes, x, norm_w, eps, ncols, lane, xs));
    if (lane == 0 && valid) y[r] = b ? s + b[r] : s;
}

template <int QT>
__global__ void swiglu_tok(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long row_bytes,
                           const float* __restrict__ x, int ldx, const float* __restrict__ norm_w, float eps,
                           float* __restrict__ h, int nrows, int ncols) {
    const int t = blockIdx.y;
    x += (long long)t * ldx;
    h += (long long)t * nrows;
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const uint8_t* rg = Wg + (long long)min(r, nrows - 1) * row_bytes;
    const uint8_t* ru = Wu + (long long)min(r, nrows - 1) * row_bytes;
    float g, u;
    if constexpr (QT == STRATA_Q_Q4_K) {
        Q4KRaw p[Q4K_BATCH], q[Q4K_BATCH];
        q4k_preload(rg, ncols, lane, p);
        q4k_preload(ru, ncols, lane, q);
        const float* xs = stage_x<QT>(x, norm_w, eps, ncols);
        q4k_finish2(p, q, rg, ru, xs, ncols, lane, g, u);
    } else {
        const float* xs = stage_x<QT>(x, norm_w, eps, ncols);
        dot2_s<QT>(rg, ru, xs, ncols, lane, g, u);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0 && r < nrows) h[r] = silu(g) * u;
}

// ---- the window's experts ---------------------------------------------------------------------------------------
// The union of a window's routed experts, in order of first appearance over ids (T, k) token by token:
// uni[0] = its size U, then U records of (expert, count, pairs[WIN_MAX]) (WIN_REC ints each, from uni + 1): the
// pairs t * k + j with ids[t, j] == expert, in token order (a token routes to an expert at most once). One block of
// WIN_MAX_PAIRS threads; T * k <= WIN_MAX_PAIRS.
#define WIN_REC (2 + WIN_MAX)
// The body, for the whole block (every thread calls it; blockDim.x == WIN_MAX_PAIRS): ids complete and visible.
__device__ __forceinline__ void win_union_block(const int* __restrict__ ids, int n_pairs, int* __restrict__ uni) {
    __shared__ int e_of[WIN_MAX_PAIRS];
    __shared__ int first_of[WIN_MAX_PAIRS];     // pair i -> the first pair with its expert
    __shared__ int slot_of[WIN_MAX_PAIRS];      // a first pair -> its union slot
    const int i = threadIdx.x;
    const int e = i < n_pairs ? ids[i] : -1;
    e_of[i] = e;
    __syncthreads();
    int first = i, rank = 0;
    if (i < n_pairs)
        for (int p = i - 1; p >= 0; --p)
            if (e_of[p] == e) {
                first = p;
                ++rank;
            }
    first_of[i] = first;
    __syncthreads();
    if (i == 0) {       // slots in order of first appearance (at most WIN_MAX_PAIRS steps, once a window and layer)
        int n = 0;
        for (int p = 0; p < n_pairs; ++p)
            if (first_of[p] == p) slot_of[p] = n++;
        uni[0] = n;
    }
    __syncthreads();
    if (i < n_pairs) {
        int* rec = uni + 1 + slot_of[first] * WIN_REC;
        if (first == i) {
            rec[0] = e;
            int cnt = 0;
            for (int p = i; p < n_pairs; ++p) cnt += e_of[p] == e;
            rec[1] = cnt;
        }
        rec[2 + rank] = i;
    }
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

// moe.cu moe_gate_up for a window: grid (ceil(n_ff / warps per block), min(T * k, n_expert)); block y is a slot of
// the union (blocks past its size exit at once), and its rows of the slot's expert are read once for the tokens there:
// h[t, j, r] = silu(gate_e[r] . xn_t) * (up_e[r] . xn_t) for each pair (t, j) of the slot. x: T rows of ncols;
// dynamic shared memory T * staged_bytes(ncols) (the tokens of one slot, at most T).
template <int QT>
__global__ void moe_gate_up_win(const unsigned long long* __restrict__ table, const int* __restrict__ uni,
                                long long up_off, long long row_bytes, const float* __restrict__ x,
                                const float* __restrict__ norm_w, float eps, float* __restrict__ h, int n_ff,
                                int ncols, int k) {
    if ((int)blockIdx.y >= uni[0]) return;        // block-uniform, before any synchronisation
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int* rec = uni + 1 + blockIdx.y * WIN_REC;
    const int n = rec[1];
    const uint8_t* base = reinterpret_cast<const uint8_t*>(table[rec[0]]);
    const uint8_t* rg = base + (long long)min(r, n_ff - 1) * row_bytes;
    const uint8_t* ru = rg + up_off;
    int pair[WIN_MAX];
    const float* xp[WIN_MAX];
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        pair[i] = rec[2 + min(i, n - 1)];
        xp[i] = x + (long long)(pair[i] / k) * ncols;
    }
    float g[WIN_MAX], u[WIN_MAX];
    win_gate_up<QT>(rg, ru, xp, n, norm_w, eps, ncols, lane, g, u);
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        if (i >= n) break;
        const float gs = warp_sum(g[i]), us = warp_sum(u[i]);
        if (lane == 0 && r < n_ff) h[(long long)pair[i] * n_ff + r] = silu(gs) * us;
    }
}

// moe.cu moe_down for a window: out[t, r] += sum_j w[t, j] * (down_{ids[t, j]}[r] . h[t, j]) for every token of the
// window, grid ceil(n_embd / warps per block), one warp a row. The warp walks the union's experts, reading each
// one's row once, and parks each (token, pair) partial in shared memory; then it sums every token's partials in the
// order the one-token moe_down sums them (the slots' table reads all issued first, one slot a lane):
//   pairs (Q4_K with stage): a lane sums pairs p = lane + 32 i of the token's k * nu (expert, unit) list, nu = n_ff / 32
//     (shared memory per warp T * k * nu floats);
//   lanes (other types, or no staging): a lane sums its own partial of each expert j in order (T * k * 32 floats).
// stage: as the one-token launch (staged_bytes(k * n_ff) within moe_down's limit); the h values are read from
// global memory here (the staged layout holds the same floats). Dynamic shared memory: warps * that per-warp count
// * 4 bytes (decode_window.py down_smem). k <= 16.
#define WIN_DOWN_BATCH 6    // (slot, unit) pairs a lane has in flight (moe.cu MOE_DOWN_BATCH)
#define WIN_SLOT_REGS (WIN_MAX_PAIRS / 32)
template <int QT>
__global__ void moe_down_win(const unsigned long long* __restrict__ table, const int* __restrict__ uni,
                             const float* __restrict__ weights, long long down_off, long long row_bytes,
                             const float* __restrict__ h, float* __restrict__ out, int n_embd, int n_ff, int k, int T,
                             int stage) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x * (blockDim.x >> 5) + warp;
    const bool pairs = QT == STRATA_Q_Q4_K && stage;
    const int nu = n_ff / 32;
    const int per_tok = pairs ? k * nu : k * 32;
    float* part = reinterpret_cast<float*>(strata_smem4) + (long long)warp * T * per_tok;
    const int n_uni = uni[0];
    const unsigned long long row_at = down_off + (unsigned long long)min(r, n_embd - 1) * row_bytes;
    // lane s holds the row address of slots s, s + 32, ...: every slot's table read in flight at once
    unsigned long long addr[WIN_SLOT_REGS];
#pragma unroll
    for (int i = 0; i < WIN_SLOT_REGS; ++i) {
        const int s = lane + 32 * i;
        addr[i] = s < n_uni ? table[uni[1 + s * WIN_REC]] + row_at : 0ull;
    }
    auto slot_row = [&](int s) {         // every lane calls it (shuffles); s is this lane's slot
        unsigned long long a = 0;
#pragma unroll
        for (int i = 0; i < WIN_SLOT_REGS; ++i) {
            const unsigned long long o = __shfl_sync(0xffffffffu, addr[i], s & 31);
            if ((s >> 5) == i) a = o;
        }
        return reinterpret_cast<const uint8_t*>(a);
    };
    if (pairs) {
        if constexpr (QT == STRATA_Q_Q4_K) {
            // the (slot, unit) pairs over the 32 lanes, WIN_DOWN_BATCH loads a lane in flight before the arithmetic
            const int total = n_uni * nu;
            for (int base = 0; base < total; base += 32 * WIN_DOWN_BATCH) {
                Q4KRaw raw[WIN_DOWN_BATCH];
                int ps[WIN_DOWN_BATCH];
#pragma unroll
                for (int b = 0; b < WIN_DOWN_BATCH; ++b) {
                    const int p = base + lane + 32 * b, s = min(p / nu, n_uni - 1);
                    ps[b] = s;
                    const uint8_t* row = slot_row(s);
                    if (p < total) raw[b] = q4k_load(row, p - s * nu);
                }
#pragma unroll
                for (int b = 0; b < WIN_DOWN_BATCH; ++b) {
                    const int p = base + lane + 32 * b, s = ps[b], u = p - s * nu;
                    if (p >= total) continue;
                    const int* rec = uni + 1 + s * WIN_REC;
                    const int n = rec[1];
                    for (int i = 0; i < n; ++i) {
                        const int pr = rec[2 + i], t = pr / k, j = pr - t * k;
                        part[t * per_tok + j * nu + u] =
                            win_q4k_dot(raw[b], win_q4k_flat(h + (long long)pr * n_ff, u), u);
                    }
                }
            }
        }
    } else {
        // a slot's pairs and their h rows
        auto slot_in = [&](int s, int (&pr)[WIN_MAX], const float* (&xp)[WIN_MAX]) {
            const int* rec = uni + 1 + s * WIN_REC;
            const int n = rec[1];
#pragma unroll
            for (int i = 0; i < WIN_MAX; ++i) {
                pr[i] = rec[2 + min(i, n - 1)];
                xp[i] = h + (long long)pr[i] * n_ff;
            }
            return n;
        };
        auto park = [&](const int (&pr)[WIN_MAX], int n, const float (&acc)[WIN_MAX]) {
#pragma unroll
            for (int i = 0; i < WIN_MAX; ++i) {
                if (i >= n) break;
                const int t = pr[i] / k, j = pr[i] - t * k;
                part[t * per_tok + j * 32 + lane] = acc[i];
            }
        };
        int s = 0;
        if constexpr (QT != STRATA_Q_Q4_K) {    // two slots at a time (dot_s = dotw = dot_row for these types)
            for (; s + 1 < n_uni; s += 2) {
                int pa[WIN_MAX], pb[WIN_MAX];
                const float *xa[WIN_MAX], *xb[WIN_MAX];
                const int na = slot_in(s, pa, xa), nb = slot_in(s + 1, pb, xb);
                float aa[WIN_MAX], ab[WIN_MAX];
                win_dot_row2<QT>(slot_row(s), xa, na, slot_row(s + 1), xb, nb, n_ff, lane, aa, ab);
                park(pa, na, aa);
                park(pb, nb, ab);
            }
        }
        for (; s < n_uni; ++s) {
            int pr[WIN_MAX];
            const float* xp[WIN_MAX];
            const int n = slot_in(s, pr, xp);
            const uint8_t* row = slot_row(s);
            float acc[WIN_MAX];
            if (stage) win_dot_s<QT>(row, xp, n, n_ff, lane, acc);
            else win_dotw<QT>(row, xp, n, n_ff, lane, acc);
            park(pr, n, acc);
        }
    }
    __syncwarp();
    for (int t = 0; t < T; ++t) {
        const float* pt = part + t * per_tok;
        const float* wt = weights + t * k;
        float s = 0.f;
        if (pairs) {
            for (int p = lane; p < per_tok; p += 32) s += wt[p / nu] * pt[p];
        } else {
            for (int j = 0; j < k; ++j) s += wt[j] * pt[j * 32 + lane];
        }
        s = warp_sum(s);
        if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
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
