// The routed-expert kernels' common steps for a window (window_serial.cu's moe_gate_up_win / moe_down_win,
// window_oss.cu's gpt-oss moe_gate_up_oai_win / moe_down_bias_win): a union slot's pairs and input rows, the slots'
// row addresses a warp holds, the (token, pair) partials parked in shared memory and each token's sum of them in the
// one-token down kernels' order. The union itself is window.cuh's win_union_block.
// Why the kernels call these one by one, window_serial.cu through a park lambda and window_oss.cu through a slot_row
// lambda with its own park and bias-sum loops: so each window kernel's PTX stays byte for byte what it was when each
// kernel had its own copy (nvcc -arch=sm_90 --ptx, compared). Forms that folded more (one call setting the expert
// rows, the count and the pairs through references; direct calls for the lambdas; win_park / win_down_sums<true> in
// moe_down_bias_win) moved nvcc's FMA contraction of sums such as Q4_K's d0 * s0 + d1 * s1 (which product it fuses):
// a last-bit change of the results.
#pragma once
#include "window.cuh"

#define WIN_SLOT_REGS (WIN_MAX_PAIRS / 32)   // slots a lane holds the row address of (win_slot_addrs)

// A union record's pairs t * k + j for i < WIN_MAX (past its count the last one again, so every load stays inside
// the record; the loops stop at the count, which it returns) and each one's input row: x + (pair / k) * ld when
// BY_TOKEN (x a row a token: the gate/up input), else x + pair * ld (a row a pair: the down input h).
template <bool BY_TOKEN>
__device__ __forceinline__ int win_slot_in(const int* rec, const float* x, int k, int ld, int (&pair)[WIN_MAX],
                                           const float* (&xp)[WIN_MAX]) {
    const int n = rec[1];
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        pair[i] = rec[2 + min(i, n - 1)];
        xp[i] = x + (long long)(BY_TOKEN ? pair[i] / k : pair[i]) * ld;
    }
    return n;
}

// Warp row r (clamped to the last of n_ff) of a union record's expert: its table entry + r * row_bytes.
__device__ __forceinline__ const uint8_t* win_slot_expert_row(const unsigned long long* __restrict__ table,
                                                              const int* rec, int r, int n_ff, long long row_bytes) {
    return reinterpret_cast<const uint8_t*>(table[rec[0]]) + (long long)min(r, n_ff - 1) * row_bytes;
}

// Lane s holds the row address (the expert's base from table, + row_at) of slots s, s + 32, ...: every slot's table
// read in flight at once.
__device__ __forceinline__ void win_slot_addrs(const unsigned long long* __restrict__ table,
                                               const int* __restrict__ uni, int n_uni, unsigned long long row_at,
                                               int lane, unsigned long long (&addr)[WIN_SLOT_REGS]) {
#pragma unroll
    for (int i = 0; i < WIN_SLOT_REGS; ++i) {
        const int s = lane + 32 * i;
        addr[i] = s < n_uni ? table[uni[1 + s * WIN_REC]] + row_at : 0ull;
    }
}

// Slot s's row address from the lane that holds it; every lane calls it (shuffles); s is this lane's slot.
__device__ __forceinline__ const uint8_t* win_slot_row(const unsigned long long (&addr)[WIN_SLOT_REGS], int s) {
    unsigned long long a = 0;
#pragma unroll
    for (int i = 0; i < WIN_SLOT_REGS; ++i) {
        const unsigned long long o = __shfl_sync(0xffffffffu, addr[i], s & 31);
        if ((s >> 5) == i) a = o;
    }
    return reinterpret_cast<const uint8_t*>(a);
}

// A lane's partials acc[i] of a slot's n pairs pr[i] = t * k + j, parked at part[t * per_tok + j * 32 + lane].
__device__ __forceinline__ void win_park(float* part, int per_tok, int k, int lane, const int (&pr)[WIN_MAX], int n,
                                         const float (&acc)[WIN_MAX]) {
#pragma unroll
    for (int i = 0; i < WIN_MAX; ++i) {
        if (i >= n) break;
        const int t = pr[i] / k, j = pr[i] - t * k;
        part[t * per_tok + j * 32 + lane] = acc[i];
    }
}

// out[t, r] += each token t's sum of its parked partials (part + t * per_tok), weighted by weights[t, :], in the
// one-token down kernel's order: by_unit, lane p sums entries p, p + 32, ... of the token's k * nu (expert, unit)
// list (weight p / nu); else a lane its own partial of each expert j in turn (j * 32 + lane). BIAS (moe_down_bias):
// then lane j < k adds w[t, j] * bd[ids[t, j], r]. The warp's partials must all be parked (it synchronises first).
template <bool BIAS>
__device__ __forceinline__ void win_down_sums(const float* part, int per_tok, bool by_unit, int nu,
                                              const float* __restrict__ weights, int k, int T, int lane, int r,
                                              int n_embd, float* __restrict__ out, const int* __restrict__ ids,
                                              const float* __restrict__ bd) {
    __syncwarp();
    for (int t = 0; t < T; ++t) {
        const float* pt = part + t * per_tok;
        const float* wt = weights + t * k;
        float s = 0.f;
        if (by_unit) {
            for (int p = lane; p < per_tok; p += 32) s += wt[p / nu] * pt[p];
        } else {
            for (int j = 0; j < k; ++j) s += wt[j] * pt[j * 32 + lane];
        }
        if constexpr (BIAS) {
            if (lane < k) s += wt[lane] * bd[(long long)ids[t * k + lane] * n_embd + min(r, n_embd - 1)];
        }
        s = warp_sum(s);
        if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
    }
}
