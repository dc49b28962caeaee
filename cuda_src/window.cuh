// Device helpers of the window kernels (window.cu, window_serial.cu, window_oss.cu): a window of T = 1..WIN_MAX
// tokens staged in shared memory as common.cuh stage_x stages one (its stage_x_to), lane partials of a row against
// several vectors in the one-token kernels' schedules, and the union of a window's routed experts.
#pragma once
#include "quant.cuh"
#include "common.cuh"

#define WIN_MAX 8           // tokens a window (engine/backend.py MAX_WINDOW)
#define WIN_MAX_PAIRS 128   // (token, expert) pairs of a window: WIN_MAX * ROUTER_MAX_K

__device__ __forceinline__ int win_sl(int n) { return n + 4 * (n >> 6); }

// Tokens xp[0..n) staged one after the other (token i at xs + i * win_sl(ncols)); every thread calls it.
template <int QT>
__device__ __forceinline__ const float* win_stage(const float* const (&xp)[WIN_MAX], int n, const float* norm_w,
                                                  float eps, int ncols) {
    __shared__ float red[32];
    float* xs = reinterpret_cast<float*>(strata_smem4);
    const int sl = win_sl(ncols);
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i)
        if (i < n) stage_x_to<QT>(xp[i], norm_w, eps, ncols, xs + i * sl, red);
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

#define WIN_DOWN_BATCH 6    // (slot, unit) pairs a lane has in flight (moe.cu MOE_DOWN_BATCH)
