// QSA sparse attention (qwen4exp: ../shared/qwen4exp.md 4.6) for one token (decode) or a prompt chunk of T tokens.
// NumPy reference: engine/arch/qwen4exp.py (Qwen4Exp.qsa, pooled_block_keys, block_scores, select_tokens,
// masked_attention); launch wrappers and every buffer's layout: engine/cuda/qsa.py.
//
// A query at position p sees n_b = (p+1)/r complete blocks of r cells and the tail r n_b .. p. With n_b <= B (the
// budget in blocks) it attends every position 0..p (dense); otherwise the B complete blocks of the highest indexer
// score (ties to the lower block) plus the tail. Either way it reads at most B r + r - 1 keys: decode time stays flat
// as the context grows. The kernels:
//   qsa_prep         per token: q heads normed + rotated (fp32 out), k heads normed + rotated and v into the fp16
//                    cache at p, indexer q heads normed + rotated, the raw indexer key stored at p; decode (pool=1)
//                    also pools the block this token completes (the previous r - 1 raw keys are in VRAM already)
//   qsa_pool         prompt: the blocks the chunk completes, after qsa_prep has stored every raw key
//   qsa_scores_dec   decode: s_b = sum_h relu(qi_h . kbar_b) / sqrt(di), a warp a block, a fixed grid that strides
//                    over n_b read on the device (nothing when dense)
//   qsa_scores_rows  prompt: the same for a tile of 16 queries x 64 blocks a thread block (a plain SGEMM tile: the
//                    ReLU per head sits between the head's dot product and the sum, so each head has its own
//                    accumulators)
//   qsa_select       a block per query: the dense unit list 0 .. ceil((p+1)/r)-1, or a 4-pass radix select of the
//                    B-th largest score (float bits: every score is >= 0) and the selected blocks in block order
//                    (the equals at the threshold by lowest block, as a stable argsort gives), then the tail block
//   qsa_attn         grid (splits, KV heads, T): the QSA_G query heads of a KV head over a split's units, online
//                    softmax a warp, merged through shared memory; one split writes the gated output, several write
//                    partials for qsa_combine (decode)
// Query heads per KV head (QSA_G) and the head width (QSA_HD) are compile-time (the per-key registers).
// @build QSA_HD=256 QSA_G=12
// @build QSA_HD=64 QSA_G=2
// @build QSA_HD=32 QSA_G=2
#include "common.cuh"

#ifndef QSA_HD
#define QSA_HD 256
#endif
#ifndef QSA_G
#define QSA_G 12
#endif
#if QSA_HD % 32 != 0 || QSA_HD > 256 || QSA_HD < 32
#error "QSA_HD (the QSA head width) is a multiple of 32, 32 to 256"
#endif
#if QSA_G < 1 || QSA_G > 16
#error "QSA_G (query heads per KV head) is 1 to 16"
#endif
#define QSA_L (QSA_HD / 32)         // a lane's dims of a head
#define QSA_MAXDI 256               // widest indexer head
#define QSA_MAXHI 8                 // most indexer heads
#define QSA_WARPS 8                 // qsa_attn, qsa_scores_dec: warps a block
#define QSA_SEL_THREADS 1024        // qsa_select
#define QSA_TB 64                   // qsa_scores_rows: blocks (of cells) a tile
#define QSA_TQ 16                   // qsa_scores_rows: queries a tile
#define QSA_PREP_THREADS (QSA_HD > QSA_MAXDI ? QSA_HD : QSA_MAXDI)

__device__ __forceinline__ float qsa_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// position of token t: pos0 + t, plus state[1] (the decode step's position) when state is given
__device__ __forceinline__ int qsa_pos(const int* state, int pos0, int t) { return pos0 + t + (state ? state[1] : 0); }

// A score as an unsigned key of the same order (scores are sums of ReLUs: >= 0; -0 and NaN become 0)
__device__ __forceinline__ unsigned int qsa_key(float s) { return s > 0.f ? __float_as_uint(s) : 0u; }

// Element d of one head of `width` (threads d < width hold val; every thread of the block calls it): RMSNorm by nw
// (when given), then NeoX RoPE of the first n_rot dims with cs = the position's n_rot/2 (cos, sin) pairs (spec 3
// "IMRoPE": for text every section selects the token position). hv: width floats of shared memory, buf: 32.
__device__ __forceinline__ float qsa_norm_rope(float val, int d, int width, const float* __restrict__ nw,
                                               const float2* __restrict__ cs, int n_rot, float eps, float* hv,
                                               float* buf) {
    const bool on = d < width;
    if (nw) {
        const float s = block_sum(on ? val * val : 0.f, buf);
        if (on) val = val * rsqrtf(s / (float)width + eps) * nw[d];
    }
    __syncthreads();                              // hv may still be read by a previous call's threads
    if (on) hv[d] = val;
    __syncthreads();
    if (on && d < n_rot) {
        const int half = n_rot / 2;
        const int j = d < half ? d : d - half;
        const float2 c = cs[j];
        val = d < half ? hv[d] * c.x - hv[d + half] * c.y : hv[d] * c.x + hv[d - half] * c.y;
    }
    return val;
}

// Pooled key of block b from the sum of its r raw keys (thread d < di holds element d): mean, RMSNorm by ik_norm,
// RoPE at the block's first position r b; into kbar (rows of di).
__device__ __forceinline__ void qsa_pool_store(float sum, int d, int di, int r, int b,
                                               const float* __restrict__ ik_norm, const float2* __restrict__ rope,
                                               int n_rot, float eps, float* __restrict__ kbar, float* hv, float* buf) {
    const float mean = sum / (float)r;
    const float val = qsa_norm_rope(mean, d, di, ik_norm, rope + (long long)b * r * (n_rot / 2), n_rot, eps, hv, buf);
    if (d < di) kbar[(long long)b * di + d] = val;
}

// Grid (Hq + Hkv + Hi + 1, T), block QSA_PREP_THREADS. Token t at p = qsa_pos(state, pos0, t); block x picks:
//   [0, Hq)            query head h: q + t ld_q + h q_hs (QSA_HD used) -> RMSNorm(q_norm), RoPE -> q_out (T, Hq, HD)
//   [Hq, Hq+Hkv)       KV head h: k + t ld_k + h HD -> RMSNorm(k_norm), RoPE -> kc[h][p] fp16; v likewise -> vc[h][p]
//   [.., + Hi)         indexer query head h: qi + t ld_qi + h di -> RMSNorm(iq_norm), RoPE -> qi_out (T, Hi, di)
//   last               the raw indexer key ki + t ld_ki (di) -> kraw[p]; with pool, when (p+1) % r == 0, kbar[p/r]
// kc, vc: (Hkv, max_ctx, HD) fp16 (engine/cuda/kv.py's f16 layout); kraw (max_ctx, di), kbar (max_ctx / r, di) fp32;
// rope (max_ctx, n_rot/2) float2.
extern "C" __global__ void __launch_bounds__(QSA_PREP_THREADS)
qsa_prep(const float* __restrict__ q, long long ld_q, int q_hs, const float* __restrict__ k, long long ld_k,
         const float* __restrict__ v, long long ld_v, const float* __restrict__ qi, long long ld_qi,
         const float* __restrict__ ki, long long ld_ki, const float* __restrict__ q_norm,
         const float* __restrict__ k_norm, const float* __restrict__ iq_norm, const float* __restrict__ ik_norm,
         const float2* __restrict__ rope, int n_rot, float eps, const int* __restrict__ state, int pos0,
         float* __restrict__ q_out, float* __restrict__ qi_out, unsigned short* __restrict__ kc,
         unsigned short* __restrict__ vc, int max_ctx, float* __restrict__ kraw, float* __restrict__ kbar, int Hq,
         int Hkv, int Hi, int di, int r, int pool) {
    __shared__ float buf[32];
    __shared__ float hv[QSA_PREP_THREADS];
    const int role = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    const int p = qsa_pos(state, pos0, t);
    const float2* cs = rope + (long long)p * (n_rot / 2);
    if (role < Hq) {
        const float* src = q + t * ld_q + (long long)role * q_hs;
        float val = d < QSA_HD ? src[d] : 0.f;
        val = qsa_norm_rope(val, d, QSA_HD, q_norm, cs, n_rot, eps, hv, buf);
        if (d < QSA_HD) q_out[((long long)t * Hq + role) * QSA_HD + d] = val;
    } else if (role < Hq + Hkv) {
        const int h = role - Hq;
        float val = d < QSA_HD ? k[t * ld_k + (long long)h * QSA_HD + d] : 0.f;
        val = qsa_norm_rope(val, d, QSA_HD, k_norm, cs, n_rot, eps, hv, buf);
        if (d < QSA_HD) {
            const long long at = ((long long)h * max_ctx + p) * QSA_HD + d;
            kc[at] = f2h(val);
            vc[at] = f2h(v[t * ld_v + (long long)h * QSA_HD + d]);
        }
    } else if (role < Hq + Hkv + Hi) {
        const int h = role - Hq - Hkv;
        float val = d < di ? qi[t * ld_qi + (long long)h * di + d] : 0.f;
        val = qsa_norm_rope(val, d, di, iq_norm, cs, n_rot, eps, hv, buf);
        if (d < di) qi_out[((long long)t * Hi + h) * di + d] = val;
    } else {
        const float val = d < di ? ki[t * ld_ki + d] : 0.f;
        if (d < di) kraw[(long long)p * di + d] = val;
        if (pool && (p + 1) % r == 0) {           // block-uniform
            const int b = p / r;
            float sum = 0.f;
            if (d < di) {
                for (int j = 0; j < r - 1; ++j) sum += kraw[((long long)b * r + j) * di + d];
                sum += val;                       // this token's own key, the block's last
            }
            qsa_pool_store(sum, d, di, r, b, ik_norm, rope, n_rot, eps, kbar, hv, buf);
        }
    }
}

// Prompt: grid nb, block di rounded up to 32 (<= QSA_PREP_THREADS). Pools blocks b0 .. b0 + nb - 1 from kraw.
extern "C" __global__ void __launch_bounds__(QSA_PREP_THREADS)
qsa_pool(const float* __restrict__ kraw, float* __restrict__ kbar, const float* __restrict__ ik_norm,
         const float2* __restrict__ rope, int n_rot, float eps, int b0, int di, int r) {
    __shared__ float buf[32];
    __shared__ float hv[QSA_PREP_THREADS];
    const int b = b0 + blockIdx.x, d = threadIdx.x;
    float sum = 0.f;
    if (d < di)
        for (int j = 0; j < r; ++j) sum += kraw[((long long)b * r + j) * di + d];
    qsa_pool_store(sum, d, di, r, b, ik_norm, rope, n_rot, eps, kbar, hv, buf);
}

// Decode: any grid (the wrapper: 2 a multiprocessor), block 32 QSA_WARPS. The query at p = qsa_pos(state, pos0, 0)
// with qi (Hi, di) rotated (qsa_prep's qi_out): scores[b] for b < n_b = (p+1)/r, nothing when n_b <= nb_budget.
extern "C" __global__ void __launch_bounds__(32 * QSA_WARPS)
qsa_scores_dec(const float* __restrict__ qi, const float* __restrict__ kbar, float* __restrict__ scores,
               const int* __restrict__ state, int pos0, int Hi, int di, int r, int nb_budget) {
    constexpr int E = QSA_MAXDI / 32;
    __shared__ float qs[QSA_MAXHI * QSA_MAXDI];
    const int p = qsa_pos(state, pos0, 0), n_b = (p + 1) / r;
    if (n_b <= nb_budget) return;                 // dense: every block is attended
    for (int i = threadIdx.x; i < Hi * di; i += blockDim.x) qs[i] = qi[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float sq = sqrtf((float)di);
    for (int b = blockIdx.x * nw + (threadIdx.x >> 5); b < n_b; b += gridDim.x * nw) {
        float kv[E];
#pragma unroll
        for (int e = 0; e < E; ++e) kv[e] = lane + 32 * e < di ? kbar[(long long)b * di + lane + 32 * e] : 0.f;
        float acc = 0.f;
#pragma unroll
        for (int h = 0; h < QSA_MAXHI; ++h) {
            if (h >= Hi) break;
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e)
                if (lane + 32 * e < di) dot += kv[e] * qs[h * di + lane + 32 * e];
            acc += fmaxf(warp_sum(dot), 0.f);
        }
        if (lane == 0) scores[b] = acc / sq;
    }
}

// Prompt: grid (ceil(nb / QSA_TB), ceil(Tq / QSA_TQ)), block 256. Queries t0 + tq (tq < Tq) of the chunk at positions
// pos0 + t0 + tq, qi (T, Hi, di) rotated: scores[tq * ld_s + b] for b < n_b of that query; tiles no query of which
// is sparse (n_b <= nb_budget) or whose blocks are all past the tile's last query's n_b are skipped. Thread (tx, ty)
// = (tid % 16, tid / 16): query ty of the tile, blocks tx + 16 j (j < 4).
extern "C" __global__ void __launch_bounds__(256)
qsa_scores_rows(const float* __restrict__ qi, int t0, int Tq, const float* __restrict__ kbar,
                float* __restrict__ scores, long long ld_s, int pos0, int Hi, int di, int r, int nb_budget) {
    __shared__ float ks[QSA_TB][33];
    __shared__ float qsm[QSA_TQ][QSA_MAXHI][33];
    const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    const int b0 = blockIdx.x * QSA_TB, tq0 = blockIdx.y * QSA_TQ;
    const int tl = min(tq0 + QSA_TQ - 1, Tq - 1);
    const int nb_last = (pos0 + t0 + tl + 1) / r;          // the tile's largest n_b (its last query's)
    if (b0 >= nb_last || nb_last <= nb_budget) return;     // block-uniform
    float acc[QSA_MAXHI][4];
#pragma unroll
    for (int h = 0; h < QSA_MAXHI; ++h)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[h][j] = 0.f;
    for (int d0 = 0; d0 < di; d0 += 32) {
        for (int i = threadIdx.x; i < QSA_TB * 32; i += blockDim.x) {
            const int bb = i >> 5, dd = i & 31, b = b0 + bb;
            ks[bb][dd] = b < nb_last && d0 + dd < di ? kbar[(long long)b * di + d0 + dd] : 0.f;
        }
        for (int i = threadIdx.x; i < QSA_TQ * QSA_MAXHI * 32; i += blockDim.x) {
            const int tt = i / (QSA_MAXHI * 32), h = (i >> 5) % QSA_MAXHI, dd = i & 31, tq = tq0 + tt;
            qsm[tt][h][dd] = tq < Tq && h < Hi && d0 + dd < di
                                 ? qi[((long long)(t0 + tq) * Hi + h) * di + d0 + dd] : 0.f;
        }
        __syncthreads();
#pragma unroll 4
        for (int dd = 0; dd < 32; ++dd) {
            float kk[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) kk[j] = ks[tx + 16 * j][dd];
#pragma unroll
            for (int h = 0; h < QSA_MAXHI; ++h) {
                const float qv = qsm[ty][h][dd];       // 0 for h >= Hi
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[h][j] += qv * kk[j];
            }
        }
        __syncthreads();
    }
    const int tq = tq0 + ty;
    if (tq >= Tq) return;
    const int nb = (pos0 + t0 + tq + 1) / r;
    const float sq = sqrtf((float)di);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float s = 0.f;
#pragma unroll
        for (int h = 0; h < QSA_MAXHI; ++h)
            if (h < Hi) s += fmaxf(acc[h][j], 0.f);
        const int b = b0 + tx + 16 * j;
        if (b < nb) scores[(long long)tq * ld_s + b] = s / sq;
    }
}

// Block-wide inclusive scan of v (every thread calls it; blockDim.x a multiple of 32); total: the block's sum.
__device__ __forceinline__ int qsa_scan(int v, int* wsum, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();                              // wsum of a previous call read by everyone
    if (lane == 31) wsum[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nw ? wsum[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += y;
        }
        if (lane < nw) wsum[lane] = w;
    }
    __syncthreads();
    total = wsum[nw - 1];
    return x + (warp ? wsum[warp - 1] : 0);
}

// Grid Tq, block QSA_SEL_THREADS. Query t = t0 + blockIdx.x at p = qsa_pos(state, pos0, t), its scores in row
// blockIdx.x of scores (ld_s apart; the blocks b < n_b = (p+1)/r). Writes units[t * ld_u ..] and n_units[t]:
//   dense (n_b <= nb_budget): 0, 1, .., ceil((p+1)/r) - 1 (the last one partial when (p+1) % r)
//   sparse: the nb_budget blocks of the highest scores in increasing block order (ties to the lower block), then
//           the tail block n_b when (p+1) % r (its cells r n_b .. p)
// ld_u >= nb_budget + 1.
extern "C" __global__ void __launch_bounds__(QSA_SEL_THREADS)
qsa_select(const float* __restrict__ scores, long long ld_s, int t0, const int* __restrict__ state, int pos0, int r,
           int nb_budget, int* __restrict__ units, int ld_u, int* __restrict__ n_units) {
    __shared__ int hist[256];
    __shared__ int wsum[32];
    __shared__ unsigned int s_prefix;
    __shared__ int s_remaining;
    const int t = t0 + blockIdx.x;
    const int p = qsa_pos(state, pos0, t), n_b = (p + 1) / r;
    int* ur = units + (long long)t * ld_u;
    if (n_b <= nb_budget) {
        const int n = (p + r) / r;
        for (int u = threadIdx.x; u < n; u += blockDim.x) ur[u] = u;
        if (threadIdx.x == 0) n_units[t] = n;
        return;
    }
    const float* s = scores + (long long)blockIdx.x * ld_s;
    // radix select, 8 bits a pass from the top: the nb_budget-th largest key, and how many of its equals to take
    unsigned int prefix = 0u, mask = 0u;
    int remaining = nb_budget;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int b = threadIdx.x; b < n_b; b += blockDim.x) {
            const unsigned int key = qsa_key(s[b]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        // thread i < 256 takes digit 255 - i: the inclusive scan counts the keys at or above that digit
        const int c = threadIdx.x < 256 ? hist[255 - threadIdx.x] : 0;
        int total;
        const int incl = qsa_scan(c, wsum, total);
        if (threadIdx.x < 256 && incl - c < remaining && remaining <= incl) {
            s_prefix = prefix | ((unsigned int)(255 - threadIdx.x) << shift);
            s_remaining = remaining - (incl - c);
        }
        __syncthreads();
        prefix = s_prefix;
        remaining = s_remaining;
        mask |= 255u << shift;
    }
    // every key above the threshold, and the first `remaining` equal to it, in block order
    int taken = 0, eq_seen = 0;
    for (int base = 0; base < n_b; base += blockDim.x) {
        const int b = base + threadIdx.x;
        const unsigned int key = b < n_b ? qsa_key(s[b]) : 0u;
        const int eq = b < n_b && key == prefix, gt = b < n_b && key > prefix;
        int eq_total, take_total;
        const int eq_rank = qsa_scan(eq, wsum, eq_total) - eq;            // equals before this one in this pass
        const int take = gt || (eq && eq_seen + eq_rank < remaining);
        const int at = qsa_scan(take, wsum, take_total) - take;
        if (take) ur[taken + at] = b;
        eq_seen += eq_total;
        taken += take_total;
    }
    if (threadIdx.x == 0) {
        int n = nb_budget;
        if ((p + 1) % r) ur[n++] = n_b;           // the tail: cells r n_b .. p
        n_units[t] = n;
    }
}

// Grid (n_split, Hkv, T), block 32 QSA_WARPS. Query t (p = qsa_pos(state, pos0, t)), KV head g and its QSA_G query
// heads g G .. g G + G - 1 of q (T, Hq, HD) (rotated: qsa_prep's q_out), over units [split ups, (split+1) ups) of
// units[t * ld_u ..] (n_units[t] of them): unit u covers cells units[u] r .. + r - 1, those <= p. Key kk of the split
// goes to warp kk % QSA_WARPS: online softmax of q.k * scale per head, the V rows accumulated; the warps merge in
// shared memory. part == nullptr: out[t * ld_out + h HD + d] = the attention (times sigmoid(gate[t * ld_gate +
// h gate_hs + d]) when gate is given); else part (n_split, Hq, HD + 2): [acc (HD) | max | sum] for qsa_combine.
extern "C" __global__ void __launch_bounds__(32 * QSA_WARPS)
qsa_attn(const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
         int max_ctx, const int* __restrict__ units, int ld_u, const int* __restrict__ n_units,
         const int* __restrict__ state, int pos0, int r, int ups, const float* __restrict__ gate, long long ld_gate,
         int gate_hs, float* __restrict__ out, long long ld_out, float* __restrict__ part, int Hkv, float scale) {
    constexpr int G = QSA_G, L = QSA_L;
    __shared__ __align__(16) float qs[G][QSA_HD];
    __shared__ float macc[G][QSA_HD];
    __shared__ float mm[G], ll[G];
    const int split = blockIdx.x, g = blockIdx.y, t = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int Hq = Hkv * G;
    const int p = qsa_pos(state, pos0, t);
    const float* qrow = q + ((long long)t * Hq + (long long)g * G) * QSA_HD;
    for (int i = threadIdx.x; i < G * QSA_HD; i += blockDim.x) qs[i / QSA_HD][i % QSA_HD] = qrow[i];
    __syncthreads();
    const int nu = n_units[t];
    const int u0 = split * ups, u1 = min(nu, u0 + ups);
    const int nkeys = u1 > u0 ? (u1 - u0) * r : 0;
    const int* ur = units + (long long)t * ld_u;
    // lane holds dims lane + 32 e (e < L): conflict-free shared reads, 64-byte K/V loads a warp instruction
    const unsigned short* kb = kc + (long long)g * max_ctx * QSA_HD + lane;
    const unsigned short* vb = vc + (long long)g * max_ctx * QSA_HD + lane;
    float m[G], l[G], acc[G][L];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < L; ++e) acc[h][e] = 0.f;
    }
    for (int kk = warp; kk < nkeys; kk += QSA_WARPS) {
        const int pos = ur[u0 + kk / r] * r + kk % r;
        if (pos > p) continue;                    // warp-uniform: cells of the query's own block past it
        float kv[L], vv[L];
#pragma unroll
        for (int e = 0; e < L; ++e) {
            kv[e] = h2f(kb[(long long)pos * QSA_HD + 32 * e]);
            vv[e] = h2f(vb[(long long)pos * QSA_HD + 32 * e]);
        }
        float sc[G];
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < L; ++e) dot += qs[h][lane + 32 * e] * kv[e];
            sc[h] = dot;
        }
#pragma unroll
        for (int h = 0; h < G; ++h) sc[h] = warp_sum(sc[h]) * scale;
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float mn = fmaxf(m[h], sc[h]);
            const float c = expf(m[h] - mn), pr = expf(sc[h] - mn);   // m = -inf the first time: c = 0
            l[h] = l[h] * c + pr;
#pragma unroll
            for (int e = 0; e < L; ++e) acc[h][e] = acc[h][e] * c + pr * vv[e];
            m[h] = mn;
        }
    }
    // merge the warps, one after another, into macc / mm / ll
    for (int w = 0; w < QSA_WARPS; ++w) {
        if (warp == w) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float m0 = w ? mm[h] : NEG_INF, l0 = w ? ll[h] : 0.f;
                const float mn = fmaxf(m0, m[h]);
                const float c0 = m0 == NEG_INF ? 0.f : expf(m0 - mn), c1 = m[h] == NEG_INF ? 0.f : expf(m[h] - mn);
#pragma unroll
                for (int e = 0; e < L; ++e) {
                    const int dd = lane + 32 * e;
                    macc[h][dd] = (w ? macc[h][dd] * c0 : 0.f) + acc[h][e] * c1;
                }
                __syncwarp();
                if (lane == 0) {
                    mm[h] = mn;
                    ll[h] = l0 * c0 + l[h] * c1;
                }
                __syncwarp();
            }
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < G * QSA_HD; i += blockDim.x) {
        const int h = i / QSA_HD, dd = i % QSA_HD, hg = g * G + h;
        if (part) {
            float* pr = part + ((long long)split * Hq + hg) * (QSA_HD + 2);
            pr[dd] = macc[h][dd];
            if (dd == 0) {
                pr[QSA_HD] = mm[h];
                pr[QSA_HD + 1] = ll[h];
            }
        } else {
            float o = ll[h] > 0.f ? macc[h][dd] / ll[h] : 0.f;
            if (gate) o *= qsa_sigmoid(gate[t * ld_gate + (long long)hg * gate_hs + dd]);
            out[t * ld_out + (long long)hg * QSA_HD + dd] = o;
        }
    }
}

// Decode: grid Hq, block QSA_HD. out[h HD + d] = the splits' partials (qsa_attn) merged, times sigmoid(gate[h gate_hs
// + d]) when gate is given.
extern "C" __global__ void __launch_bounds__(QSA_HD)
qsa_combine(const float* __restrict__ part, int n_split, const float* __restrict__ gate, int gate_hs,
            float* __restrict__ out, int Hq) {
    const int h = blockIdx.x, d = threadIdx.x;
    float mx = NEG_INF;
    for (int s = 0; s < n_split; ++s) mx = fmaxf(mx, part[((long long)s * Hq + h) * (QSA_HD + 2) + QSA_HD]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < n_split; ++s) {
        const float* pr = part + ((long long)s * Hq + h) * (QSA_HD + 2);
        const float ms = pr[QSA_HD];
        if (ms == NEG_INF) continue;              // a split with no keys
        const float c = expf(ms - mx);
        num += pr[d] * c;
        den += pr[QSA_HD + 1] * c;
    }
    float o = den > 0.f ? num / den : 0.f;
    if (gate) o *= qsa_sigmoid(gate[(long long)h * gate_hs + d]);
    out[(long long)h * QSA_HD + d] = o;
}
