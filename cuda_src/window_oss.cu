// gpt-oss's routed experts for a window of T = 1..WIN_MAX tokens (window.cu's union of the window's experts, each
// read once for the tokens routed to it): moe_oss.cu's moe_gate_up_oai / moe_down_bias with the per-token arithmetic
// of those kernels (the same staging, lane schedules and fp32 sum orders, MXFP4's lane-rotated float4 walk included:
// a (token, pair) partial is computed with the lane the one-token kernel gives that pair), so a window's outputs are
// T one-token launches' bit for bit. Loaded by engine/cuda/decode_window.py's OssWindowStep.
#include "window_moe.cuh"
#include "moe_oss.cu"

// moe_gate_up_oai for a window: grid (ceil(n_ff / warps per block), min(T * k, n_expert)), block y a union slot;
// h[t, j, r] = swiglu_oai(gate_e[r] . xn_t + bg[e, r], up_e[r] . xn_t + bu[e, r]) for each pair (t, j) of the slot.
// Dynamic shared memory T * staged_bytes(ncols).
template <int QT>
__global__ __launch_bounds__(128) void moe_gate_up_oai_win(
    const unsigned long long* __restrict__ table, const int* __restrict__ uni, long long up_off, long long row_bytes,
    const float* __restrict__ x, const float* __restrict__ norm_w, float eps, float* __restrict__ h, int n_ff,
    int ncols, int k, const float* __restrict__ bg, const float* __restrict__ bu) {
    if ((int)blockIdx.y >= uni[0]) return;        // block-uniform, before any synchronisation
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int* rec = uni + 1 + blockIdx.y * WIN_REC;
    const int e = rec[0];
    const uint8_t* rg = win_slot_expert_row(table, rec, r, n_ff, row_bytes);
    const uint8_t* ru = rg + up_off;
    int pair[WIN_MAX];
    const float* xp[WIN_MAX];
    const int n = win_slot_in<true>(rec, x, k, ncols, pair, xp);
    float g[WIN_MAX], u[WIN_MAX];
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) g[i] = u[i] = 0.f;
    const float* xs[WIN_MAX];
    if constexpr (QT == STRATA_Q_MXFP4) {
        const int nb = ncols / 32;
        Mx4Raw pg[MX4_BATCH], pu[MX4_BATCH];
        auto first_batch = [&]() {
#pragma unroll
            for (int b = 0; b < MX4_BATCH; ++b)
                if (lane + 32 * b < nb) {
                    pg[b] = mx4_load(rg + 17 * (lane + 32 * b));
                    pu[b] = mx4_load(ru + 17 * (lane + 32 * b));
                }
        };
        first_batch();
        win_staged_ptrs(win_stage<QT>(xp, n, norm_w, eps, ncols), win_sl(ncols), xs);
#pragma unroll
        for (int i = 0; i < WIN_MAX; ++i) {         // unrolled: g, u and xs stay in registers
            if (i >= n) break;
            if (i > 0 && nb > 32 * MX4_BATCH) first_batch();     // rows wider than a batch walked the row again
            for (int c0 = 0;; c0 += 32 * MX4_BATCH) {
#pragma unroll
                for (int b = 0; b < MX4_BATCH; ++b) {
                    const int blk = c0 + lane + 32 * b;
                    if (blk < nb) mx4_dot2(pg[b], pu[b], xs[i] + 32 * blk, lane, g[i], u[i]);
                }
                if (c0 + 32 * MX4_BATCH >= nb) break;
#pragma unroll
                for (int b = 0; b < MX4_BATCH; ++b) {
                    const int blk = c0 + 32 * MX4_BATCH + lane + 32 * b;
                    if (blk < nb) {
                        pg[b] = mx4_load(rg + 17 * blk);
                        pu[b] = mx4_load(ru + 17 * blk);
                    }
                }
            }
        }
    } else {
        win_staged_ptrs(win_stage<QT>(xp, n, norm_w, eps, ncols), win_sl(ncols), xs);
        if constexpr (QT == STRATA_Q_Q4_K) {    // common.cuh dot2_s's Q4_K batches, each unit pair loaded once
            const int nu = ncols / 32;
            for (int u0 = lane; u0 < nu; u0 += 32 * Q4K_BATCH) {
                Q4KRaw p[Q4K_BATCH], q[Q4K_BATCH];
#pragma unroll
                for (int b = 0; b < Q4K_BATCH; ++b)
                    if (u0 + 32 * b < nu) {
                        p[b] = q4k_load(rg, u0 + 32 * b);
                        q[b] = q4k_load(ru, u0 + 32 * b);
                    }
#pragma unroll
                for (int b = 0; b < Q4K_BATCH; ++b)
                    if (u0 + 32 * b < nu)
#pragma unroll
                        for (int i = 0; i < WIN_MAX; ++i)
                            if (i < n) q4k_dot2(p[b], q[b], xs[i], u0 + 32 * b, g[i], u[i]);
            }
        } else {
            win_dot2_row<QT>(rg, ru, xs, n, ncols, lane, g, u);
        }
    }
    const long long eb = (long long)e * n_ff + min(r, n_ff - 1);
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        if (i >= n) break;
        const float gs = warp_sum(g[i]), us = warp_sum(u[i]);
        if (lane == 0 && r < n_ff) h[(long long)pair[i] * n_ff + r] = swiglu_oai(gs + bg[eb], us + bu[eb]);
    }
}

// moe_down_bias for a window: out[t, r] += sum_j w[t, j] * (down_{ids[t, j]}[r] . h[t, j] + bd[e, r]), grid
// ceil(n_embd / warps per block), a warp a row; the union's rows each read once. Each (token, pair) partial is parked
// in shared memory and summed per token in moe_down_bias's order:
//   MXFP4: pairs p of the token's k * nb (expert, block) list, nb = n_ff / 32, lane p % 32 (its float4 walk too);
//   others: a lane's partial of each expert j in order (dot_s staged, dotw not: Q4_K's two unit reads differ);
// then lane j < k adds w[t, j] * bd[e, r]. Dynamic shared memory: warps * T * k * (nb or 32) floats.
template <int QT>
__global__ __launch_bounds__(128) void moe_down_bias_win(
    const unsigned long long* __restrict__ table, const int* __restrict__ uni, const int* __restrict__ ids,
    const float* __restrict__ weights, long long down_off, long long row_bytes, const float* __restrict__ h,
    float* __restrict__ out, int n_embd, int n_ff, int k, int T, int stage, const float* __restrict__ bd) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r = blockIdx.x * (blockDim.x >> 5) + warp;
    const int rr = min(r, n_embd - 1);
    constexpr bool MX = QT == STRATA_Q_MXFP4;
    const int nb = n_ff / 32;
    const int per_tok = MX ? k * nb : k * 32;
    float* part = reinterpret_cast<float*>(strata_smem4) + (long long)warp * T * per_tok;
    const int n_uni = uni[0];
    const unsigned long long row_at = down_off + (unsigned long long)rr * row_bytes;
    unsigned long long addr[WIN_SLOT_REGS];
    win_slot_addrs(table, uni, n_uni, row_at, lane, addr);
    auto slot_row = [&](int s) { return win_slot_row(addr, s); };
    if constexpr (MX) {
        const int total = n_uni * nb;
        for (int base = 0; base < total; base += 32 * MX4_DOWN_BATCH) {
            Mx4Raw raw[MX4_DOWN_BATCH];
            int ps[MX4_DOWN_BATCH];
#pragma unroll
            for (int b = 0; b < MX4_DOWN_BATCH; ++b) {
                const int p = base + lane + 32 * b, s = min(p / nb, n_uni - 1);
                ps[b] = s;
                const uint8_t* row = slot_row(s);
                if (p < total) raw[b] = mx4_load(row + 17 * (p - s * nb));
            }
#pragma unroll
            for (int b = 0; b < MX4_DOWN_BATCH; ++b) {
                const int p = base + lane + 32 * b, s = ps[b], blk = p - s * nb;
                if (p >= total) continue;
                const int* rec = uni + 1 + s * WIN_REC;
                const int n = rec[1];
                for (int i = 0; i < n; ++i) {
                    const int pr = rec[2 + i], t = pr / k, j = pr - t * k, q = j * nb + blk;
                    part[t * per_tok + q] = mx4_dot(raw[b], h + (long long)pr * n_ff + 32 * blk, q & 31);
                }
            }
        }
    } else {
        for (int s = 0; s < n_uni; ++s) {
            const int* rec = uni + 1 + s * WIN_REC;
            const int n = rec[1];
            const uint8_t* row = slot_row(s);
            int pr[WIN_MAX];
            const float* xp[WIN_MAX];
            win_slot_in<false>(rec, h, k, n_ff, pr, xp);
            float acc[WIN_MAX];
            if (stage) {
                if constexpr (QT == STRATA_Q_Q4_K) {   // dot_s's batches against unpadded h: the same floats
#pragma unroll
                    for (int i = 0; i < WIN_MAX; ++i) acc[i] = 0.f;
                    const int nu = n_ff / 32;
                    for (int u0 = lane; u0 < nu; u0 += 32 * Q4K_BATCH) {
                        Q4KRaw q[Q4K_BATCH];
#pragma unroll
                        for (int b = 0; b < Q4K_BATCH; ++b)
                            if (u0 + 32 * b < nu) q[b] = q4k_load(row, u0 + 32 * b);
#pragma unroll
                        for (int b = 0; b < Q4K_BATCH; ++b)
                            if (u0 + 32 * b < nu)
#pragma unroll
                                for (int i = 0; i < WIN_MAX; ++i)
                                    if (i < n)
                                        acc[i] += win_q4k_dot(q[b], win_q4k_flat(xp[i], u0 + 32 * b), u0 + 32 * b);
                    }
                } else {
                    win_dot_s<QT>(row, xp, n, n_ff, lane, acc);
                }
            } else {
                win_dotw<QT>(row, xp, n, n_ff, lane, acc);
            }
#pragma unroll
            for (int i = 0; i < WIN_MAX; ++i) {
                if (i >= n) break;
                const int t = pr[i] / k, j = pr[i] - t * k;
                part[t * per_tok + j * 32 + lane] = acc[i];
            }
        }
    }
    __syncwarp();
    for (int t = 0; t < T; ++t) {
        const float* pt = part + t * per_tok;
        const float* wt = weights + t * k;
        float s = 0.f;
        if (MX) {
            for (int p = lane; p < per_tok; p += 32) s += wt[p / nb] * pt[p];
        } else {
            for (int j = 0; j < k; ++j) s += wt[j] * pt[j * 32 + lane];
        }
        if (lane < k) s += wt[lane] * bd[(long long)ids[t * k + lane] * n_embd + rr];
        s = warp_sum(s);
        if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
    }
}
