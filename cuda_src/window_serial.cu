// The token-serial window kernels (decode_window.py dense_mode "shared", expert_mode "union"): each weight row
// loaded once a warp for the window's T tokens, each routed expert once for the tokens of the window's union,
// the tokens' sums one after the other in the warp, in the one-token kernels' order (window.cuh). The H200
// measured a window of them at about T one-token steps (the step is latency-bound, not HBM-bound): the default
// window program is window.cu's token-parallel kernels; these load only when a mode asks for them.
#include "window_moe.cuh"

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
    const uint8_t* rg = win_slot_expert_row(table, rec, r, n_ff, row_bytes);
    const uint8_t* ru = rg + up_off;
    int pair[WIN_MAX];
    const float* xp[WIN_MAX];
    const int n = win_slot_in<true>(rec, x, k, ncols, pair, xp);
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
    unsigned long long addr[WIN_SLOT_REGS];
    win_slot_addrs(table, uni, n_uni, row_at, lane, addr);
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
                    const uint8_t* row = win_slot_row(addr, s);
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
            return win_slot_in<false>(uni + 1 + s * WIN_REC, h, k, n_ff, pr, xp);
        };
        auto park = [&](const int (&pr)[WIN_MAX], int n, const float (&acc)[WIN_MAX]) {
            win_park(part, per_tok, k, lane, pr, n, acc);
        };
        int s = 0;
        if constexpr (QT != STRATA_Q_Q4_K) {    // two slots at a time (dot_s = dotw = dot_row for these types)
            for (; s + 1 < n_uni; s += 2) {
                int pa[WIN_MAX], pb[WIN_MAX];
                const float *xa[WIN_MAX], *xb[WIN_MAX];
                const int na = slot_in(s, pa, xa), nb = slot_in(s + 1, pb, xb);
                float aa[WIN_MAX], ab[WIN_MAX];
                win_dot_row2<QT>(win_slot_row(addr, s), xa, na, win_slot_row(addr, s + 1), xb, nb, n_ff, lane, aa,
                                 ab);
                park(pa, na, aa);
                park(pb, nb, ab);
            }
        }
        for (; s < n_uni; ++s) {
            int pr[WIN_MAX];
            const float* xp[WIN_MAX];
            const int n = slot_in(s, pr, xp);
            const uint8_t* row = win_slot_row(addr, s);
            float acc[WIN_MAX];
            if (stage) win_dot_s<QT>(row, xp, n, n_ff, lane, acc);
            else win_dotw<QT>(row, xp, n, n_ff, lane, acc);
            park(pr, n, acc);
        }
    }
    win_down_sums<false>(part, per_tok, pairs, nu, weights, k, T, lane, r, n_embd, out, nullptr, nullptr);
}
