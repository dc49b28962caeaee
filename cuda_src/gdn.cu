// Gated DeltaNet (the qwen3next / qwen35moe linear-attention layers) for one layer: the decode step's conv and
// delta-rule update of one token, and the prompt's conv and chunked delta rule over T tokens on tensor cores.
// NumPy reference: engine/arch/qwen3next.py (causal_conv, l2_norm, delta_rule, delta_rule_chunk, Qwen3Next.gdn);
// launch wrappers and every buffer's layout: engine/cuda/families/gdn.py. Head width (key = value) is
// compile-time, GDN_D.
//
// Decode (capture-safe: no allocation, every input from device memory): gdn_conv_decode then gdn_delta_decode; the
// engine's decode step does the conv in its projection's launch instead (dense.cu mv4) and the l2 norms here.
// Prompt: gdn_conv_prefill (f16 activations), gdn_chunk_prep (per chunk of 64 tokens and value head, all in
// parallel: the decay-masked A = beta K K^T, its inverse (I + A)^-1 by forward substitution, the masked Q K^T), then
// gdn_chunk_scan (per value head and slice of GDN_BV value columns, chunk after chunk: the WY/UT form
//   u = T beta V - T beta G K S^T,   o = G Q S^T + (decay . Q K^T) u,   S^T <- G_C S^T + (G_C/G_s K)^T u
// with the state in fp32 accumulators), then gdn_gated_norm. mma inputs are fp16 (|q|, |k| <= 1 after the l2 norm,
// every decay factor <= 1), accumulators fp32; tests/test_cuda_gdn.py bounds the error against float64.
// The output gate is silu(z) (qwen3next, qwen35moe), or sigmoid(z) with GDN_GATE_SIGMOID=1 (qwen4exp, spec 4.5
// step 6).
// @build GDN_D=128
// @build GDN_D=64
// @build GDN_D=128 GDN_GATE_SIGMOID=1
#include "common.cuh"
#include "mma.cuh"

#ifndef GDN_D
#define GDN_D 128
#endif
#if GDN_D != 64 && GDN_D != 128
#error "GDN_D (the GDN head width) is 64 or 128"
#endif
#ifndef GDN_BV
#define GDN_BV 32                   // value columns per scan block: 4 blocks a head at D 128 fill the SMs (bench.gdn:
                                    // 64 took 0.23 ms a 4K-token layer at the 80B shape, 32 0.17 ms)
#endif
#if GDN_BV > GDN_D || GDN_D % GDN_BV != 0 || GDN_BV % 32 != 0
#error "GDN_BV divides GDN_D and is a multiple of 32"
#endif
#define GDN_KMAX 8                  // widest conv kernel (the published models: 4)
#define GDN_C 64                    // tokens per chunk
#ifndef GDN_DEC_WARPS
#define GDN_DEC_WARPS 16            // gdn_delta_decode: warps per value head (all of S_h's rows in flight at once)
#endif

__device__ __forceinline__ float gdn_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float gdn_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
#ifndef GDN_GATE_SIGMOID
#define GDN_GATE_SIGMOID 0
#endif
__device__ __forceinline__ float gdn_gate(float z) { return GDN_GATE_SIGMOID ? gdn_sigmoid(z) : silu(z); }

// beta and g of value head h for one token: b, a point at the token's row; value head h's entry sits at
// (h / r) * grp + h % r (qwen3next's ssm_ba groups [b x r, a x r] per key head: grp 2r; apart: grp r)
__device__ __forceinline__ void gdn_beta_g(const float* b, const float* a, int h, int r, int grp,
                                           const float* dt_bias, const float* ssm_a, float& beta, float& g) {
    const int idx = (h / r) * grp + h % r;
    beta = gdn_sigmoid(b[idx]);
    g = gdn_softplus(a[idx] + dt_bias[h]) * ssm_a[h];
}

// ---- decode ------------------------------------------------------------------------------------------------------

// Grid (2 n_k + n_v), block GDN_D: one head's channels a block (q heads, k heads, v heads). conv over the d_conv-1
// saved inputs and this one, silu; q and k l2-normed per head, q times q_scale. The state shifts by one in place
// (each thread owns its channel). act may be qkv itself.
extern "C" __global__ void gdn_conv_decode(const float* qkv, float* __restrict__ conv_state,
                                           const float* __restrict__ conv_w, float* act, int C, int n_k, int d_conv,
                                           float eps, float q_scale) {
    __shared__ float buf[32];
    const int grp = blockIdx.x, c = grp * GDN_D + threadIdx.x;
    const float x = qkv[c];
    // every load before the first store (the stores could alias them for the compiler: one latency each otherwise)
    float st[GDN_KMAX - 1], w[GDN_KMAX - 1];
#pragma unroll
    for (int i = 0; i < GDN_KMAX - 1; ++i) {
        st[i] = i < d_conv - 1 ? conv_state[(long long)i * C + c] : 0.f;
        w[i] = i < d_conv - 1 ? conv_w[(long long)c * d_conv + i] : 0.f;
    }
    float acc = x * conv_w[(long long)c * d_conv + d_conv - 1];
#pragma unroll
    for (int i = 0; i < GDN_KMAX - 1; ++i) {
        acc += st[i] * w[i];
        if (i < d_conv - 1) conv_state[(long long)i * C + c] = i + 1 < d_conv - 1 ? st[i + 1 < GDN_KMAX - 1 ? i + 1 : 0] : x;
    }
    float y = silu(acc);
    if (grp < 2 * n_k) {                          // block-uniform
        const float ss = block_sum(y * y, buf);
        y *= rsqrtf(ss + eps) * (grp < n_k ? q_scale : 1.f);
    }
    act[c] = y;
}

// Grid n_v, block 32 GDN_DEC_WARPS: value head h. Row i of S_h (S[h, i, :], keys along j) is independent of the
// others: decay, err = v_i - S_i.k, S_i += beta err k, o_i = S_i.q; a warp takes GDN_D / GDN_DEC_WARPS rows, each lane
// GDN_D / 32 consecutive keys. Then out = rms_norm(o) * norm_w * gate(z) over the head (gdn_gate).
// act: (2 n_k + n_v) D floats [q | k | v], q and k l2-normed (q scaled) by gdn_conv_decode, or with qk_norm not yet
// (dense.cu mv4's conv epilogue): then here, as gdn_conv_decode would; b, a: this token's beta/alpha projections
// (see gdn_beta_g).
extern "C" __global__ void __launch_bounds__(32 * GDN_DEC_WARPS)
gdn_delta_decode(const float* __restrict__ act, const float* __restrict__ b, const float* __restrict__ a,
                 int grp, const float* __restrict__ dt_bias, const float* __restrict__ ssm_a, float* __restrict__ S,
                 const float* __restrict__ z, const float* __restrict__ norm_w, float* __restrict__ out, int n_k,
                 int n_v, int grouped, float eps, int qk_norm, float q_scale) {
    constexpr int L = GDN_D / 32, ROWS = GDN_D / GDN_DEC_WARPS;
    __shared__ float o_sm[GDN_D];
    __shared__ float buf[32];
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r = n_v / n_k, kh = grouped ? h / r : h % n_k;
    float beta, g;
    gdn_beta_g(b, a, h, r, grp, dt_bias, ssm_a, beta, g);
    const float decay = expf(g);
    float q[L], k[L];
#pragma unroll
    for (int e = 0; e < L; ++e) {
        q[e] = act[kh * GDN_D + lane * L + e];
        k[e] = act[(n_k + kh) * GDN_D + lane * L + e];
    }
    if (qk_norm) {          // act straight from the conv (dense.cu mv4): each warp holds whole q and k heads
        float qq = 0.f, kk = 0.f;
#pragma unroll
        for (int e = 0; e < L; ++e) qq += q[e] * q[e], kk += k[e] * k[e];
        const float sq = rsqrtf(warp_sum(qq) + eps) * q_scale, sk = rsqrtf(warp_sum(kk) + eps);
#pragma unroll
        for (int e = 0; e < L; ++e) q[e] *= sq, k[e] *= sk;
    }
    const float* v = act + 2 * n_k * GDN_D + h * GDN_D;
    float* Sh = S + (long long)h * GDN_D * GDN_D;
    float s[ROWS][L];
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
        const float* row = Sh + (warp * ROWS + rr) * GDN_D + lane * L;
        if (L == 4) {
            const float4 t = *reinterpret_cast<const float4*>(row);
            s[rr][0] = t.x, s[rr][1] = t.y, s[rr][L > 2 ? 2 : 0] = t.z, s[rr][L > 3 ? 3 : 0] = t.w;
        } else {
            const float2 t = *reinterpret_cast<const float2*>(row);
            s[rr][0] = t.x, s[rr][1] = t.y;
        }
    }
    // every row's load issued before the first use: without this the compiler interleaved them with the row's
    // reductions, one memory latency a row (bench.gdn: 7.7 us a layer's step at 8 warps)
    asm volatile("" ::: "memory");
#pragma unroll
    for (int rr = 0; rr < ROWS; ++rr) {
        const int i = warp * ROWS + rr;
        float kv = 0.f;
#pragma unroll
        for (int e = 0; e < L; ++e) {
            s[rr][e] *= decay;
            kv += s[rr][e] * k[e];
        }
        kv = warp_sum(kv);
        const float u = beta * (v[i] - kv);
        float o = 0.f;
#pragma unroll
        for (int e = 0; e < L; ++e) {
            s[rr][e] += u * k[e];
            o += s[rr][e] * q[e];
        }
        o = warp_sum(o);
        if (lane == 0) o_sm[i] = o;
        float* row = Sh + i * GDN_D + lane * L;
        if (L == 4)
            *reinterpret_cast<float4*>(row) = make_float4(s[rr][0], s[rr][1], s[rr][L > 2 ? 2 : 0], s[rr][L > 3 ? 3 : 0]);
        else
            *reinterpret_cast<float2*>(row) = make_float2(s[rr][0], s[rr][1]);
    }
    __syncthreads();
    const float ov = threadIdx.x < GDN_D ? o_sm[threadIdx.x] : 0.f;
    const float ss = block_sum(ov * ov, buf);
    if (threadIdx.x < GDN_D) {
        const int i = h * GDN_D + threadIdx.x;
        out[i] = ov * rsqrtf(ss / GDN_D + eps) * norm_w[threadIdx.x] * gdn_gate(z[i]);
    }
}

// ---- prompt: conv -------------------------------------------------------------------------------------------------

#define GDN_CONV_TT 32              // tokens per conv block

// Grid (2 n_k + n_v, ceil(T / GDN_CONV_TT)), block GDN_D. qkv rows of ld_in floats (the first C used), act16: (T, C)
// fp16 [q | k | v], q and k l2-normed (q times q_scale), v = silu(conv). A thread takes one channel over the tile's
// tokens, every input in registers first (weights right-aligned in GDN_KMAX taps, so every index is compile-time),
// and q/k heads reduce all the tile's sums of squares at one barrier. Only the first tile reads the old conv state,
// so its block alone writes the new one (the last d_conv - 1 inputs of state + qkv), after reading.
extern "C" __global__ void __launch_bounds__(GDN_D)
gdn_conv_prefill(const float* __restrict__ qkv, long long ld_in, int T, float* __restrict__ conv_state,
                 const float* __restrict__ conv_w, unsigned short* __restrict__ act16, int C, int n_k, int d_conv,
                 float eps, float q_scale) {
    constexpr int K = GDN_KMAX, TT = GDN_CONV_TT, NW = GDN_D / 32;
    __shared__ float part[TT][NW];
    const int grp = blockIdx.x, c = grp * GDN_D + threadIdx.x, t0 = blockIdx.y * TT;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int shift = K - d_conv;                 // tap m holds weight m - shift (none below shift)
    float w[K], seq[K - 1 + TT];                  // seq[j]: the input at token t0 - (K - 1) + j
#pragma unroll
    for (int m = 0; m < K; ++m) w[m] = m >= shift ? conv_w[(long long)c * d_conv + m - shift] : 0.f;
#pragma unroll
    for (int j = 0; j < K - 1 + TT; ++j) {
        const int p = t0 - (K - 1) + j;
        seq[j] = p >= T ? 0.f : p >= 0 ? qkv[p * ld_in + c]
                                       : (p + d_conv - 1 >= 0 ? conv_state[(long long)(p + d_conv - 1) * C + c] : 0.f);
    }
    float y[TT];
#pragma unroll
    for (int tt = 0; tt < TT; ++tt) {
        float acc = 0.f;
#pragma unroll
        for (int m = 0; m < K; ++m) acc += w[m] * seq[tt + m];
        y[tt] = silu(acc);
    }
    if (grp < 2 * n_k) {                          // block-uniform
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            const float ss = warp_sum(y[tt] * y[tt]);
            if (lane == 0) part[tt][warp] = ss;
        }
        __syncthreads();
        const float scale = grp < n_k ? q_scale : 1.f;
#pragma unroll
        for (int tt = 0; tt < TT; ++tt) {
            float ss = 0.f;
#pragma unroll
            for (int i = 0; i < NW; ++i) ss += part[tt][i];
            y[tt] *= rsqrtf(ss + eps) * scale;
        }
    }
#pragma unroll
    for (int tt = 0; tt < TT; ++tt)
        if (t0 + tt < T) act16[(long long)(t0 + tt) * C + c] = f2h(y[tt]);
    if (blockIdx.y == 0) {
        // new row i = the input at token T - (d_conv - 1) + i; before token 0 that is old row T + i, which comes after
        // row i, so writing rows in ascending order reads every old row before it is replaced
        for (int i = 0; i < d_conv - 1; ++i) {
            const int p = T - (d_conv - 1) + i;
            conv_state[(long long)i * C + c] = p >= 0 ? qkv[p * ld_in + c] : conv_state[(long long)(T + i) * C + c];
        }
    }
}

// ---- prompt: per-chunk preparation ------------------------------------------------------------------------------

// ldmatrix lane offsets (in halves, for a row pitch LD): A or k-major B "plain" (rows (lane & 7) + 8 ((lane >> 3) & 1),
// column 8 (lane >> 4)); n-major B / k-major A (rows (lane & 7) + 8 (lane >> 4), column 8 ((lane >> 3) & 1)).
__device__ __forceinline__ int gdn_lane_a(int lane, int ld) { return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8; }
__device__ __forceinline__ int gdn_lane_b(int lane, int ld) { return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8; }

__device__ __forceinline__ void gdn_cp16(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void gdn_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void gdn_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// rows x cols fp16 from global (row stride ld_g halves) into shared (pitch LD) by 16-byte copies, rows >= nrows zero
template <int ROWS, int COLS, int LD, int NT>
__device__ __forceinline__ void gdn_load_tile(uint32_t sm, const unsigned short* g, long long ld_g, int nrows) {
    constexpr int CH = COLS / 8, N = ROWS * CH;
#pragma unroll
    for (int w = threadIdx.x; w < N; w += NT) {
        const int r = w / CH, c = w % CH;
        const bool ok = r < nrows;
        gdn_cp16(sm + (uint32_t)((r * LD + 8 * c) * 2), g + (ok ? r : 0) * ld_g + 8 * c, ok);
    }
}

#define GDN_LDK (GDN_D + 8)         // shared pitch (halves) of Q and K tiles
#define GDN_LDC (GDN_C + 8)         // of 64-column tiles
#define GDN_PREP_THREADS 128
#define GDN_PREP_SMEM (2 * GDN_C * GDN_LDK * 2 + GDN_C * (GDN_C + 1) * 4 * 2 + 3 * GDN_C * 4 + 768 * 4)

// Grid (n_chunks, n_v), block 128, GDN_PREP_SMEM bytes of dynamic shared memory. Chunk c of value head h:
//   gcum[h, c*64 + t] = g_1 + ... + g_t within the chunk (log G_t); tokens past T have beta = g = 0
//   tcat[h, c] (64 x 128 fp16) = [X diag(beta) | -X diag(beta G)], X = (I + A)^-1, A[t,s] = beta_t G_t/G_s k_t.k_s, s < t
//   qkm[h, c] (64 x 64 fp16) = G_t/G_s q_t.k_s for s <= t, else 0
extern "C" __global__ void __launch_bounds__(GDN_PREP_THREADS)
gdn_chunk_prep(const unsigned short* __restrict__ act16, int T, int C, const float* __restrict__ b,
               const float* __restrict__ a, long long ld_ba, int grp, const float* __restrict__ dt_bias,
               const float* __restrict__ ssm_a, int n_k, int n_v, int grouped, float* __restrict__ gcum,
               unsigned short* __restrict__ tcat, unsigned short* __restrict__ qkm) {
    extern __shared__ __align__(16) unsigned char gdn_sm[];
    unsigned short* sQ = reinterpret_cast<unsigned short*>(gdn_sm);
    unsigned short* sK = sQ + GDN_C * GDN_LDK;
    float* sA = reinterpret_cast<float*>(sK + GDN_C * GDN_LDK);     // 64 x 65
    float* sX = sA + GDN_C * (GDN_C + 1);                             // 64 x 65: X[t][c] at t * 65 + c
    float* sG = sX + GDN_C * (GDN_C + 1);
    float* sB = sG + GDN_C;
    float* sGraw = sB + GDN_C;
    float* sM = sGraw + GDN_C;                                        // 3 x 16 x 16: sum_k A_ik X_kj
    const int ch = blockIdx.x, h = blockIdx.y, nch = gridDim.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g4 = lane >> 2, t4 = lane & 3;
    const int r = n_v / n_k, kh = grouped ? h / r : h % n_k;
    const int t0 = ch * GDN_C, nrows = min(GDN_C, T - t0);
    const uint32_t smQ = smem_u32(sQ), smK = smem_u32(sK);
    gdn_load_tile<GDN_C, GDN_D, GDN_LDK, GDN_PREP_THREADS>(smQ, act16 + (long long)t0 * C + kh * GDN_D, C, nrows);
    gdn_load_tile<GDN_C, GDN_D, GDN_LDK, GDN_PREP_THREADS>(smK, act16 + (long long)t0 * C + (n_k + kh) * GDN_D, C,
                                                           nrows);
    gdn_commit();
    if (threadIdx.x < GDN_C) {
        const int t = threadIdx.x;
        float beta = 0.f, g = 0.f;
        if (t < nrows)
            gdn_beta_g(b + (long long)(t0 + t) * ld_ba, a + (long long)(t0 + t) * ld_ba, h, r, grp, dt_bias, ssm_a,
                       beta, g);
        sB[t] = beta;
        sGraw[t] = g;
    }
    __syncthreads();
    if (threadIdx.x < 32) {                       // inclusive prefix sum of g over 64 tokens (two per lane)
        float x0 = sGraw[2 * lane], x1 = x0 + sGraw[2 * lane + 1];
        float s = x1;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, s, o);
            if (lane >= o) s += y;
        }
        const float before = s - x1;
        sG[2 * lane] = before + x0;
        sG[2 * lane + 1] = s;
        gcum[(long long)h * nch * GDN_C + t0 + 2 * lane] = before + x0;
        gcum[(long long)h * nch * GDN_C + t0 + 2 * lane + 1] = s;
    }
    gdn_wait<0>();
    __syncthreads();
    // K K^T and Q K^T: warp w's rows 16 w .. 16 w + 15, all 64 columns
    float kk[8][4], qk[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) kk[n][e] = qk[n][e] = 0.f;
    const int la = gdn_lane_a(lane, GDN_LDK), lb = gdn_lane_b(lane, GDN_LDK);
#pragma unroll
    for (int kc = 0; kc < GDN_D / 16; ++kc) {
        uint32_t ak[4], aq[4];
        ldsm_x4(smK + (uint32_t)((16 * warp * GDN_LDK + 16 * kc + la) * 2), ak[0], ak[1], ak[2], ak[3]);
        ldsm_x4(smQ + (uint32_t)((16 * warp * GDN_LDK + 16 * kc + la) * 2), aq[0], aq[1], aq[2], aq[3]);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4(smK + (uint32_t)((16 * np * GDN_LDK + 16 * kc + lb) * 2), b0, b1, b2, b3);
            mma_16816(kk[2 * np], ak, b0, b1);
            mma_16816(kk[2 * np + 1], ak, b2, b3);
            mma_16816(qk[2 * np], aq, b0, b1);
            mma_16816(qk[2 * np + 1], aq, b2, b3);
        }
    }
    unsigned short* qkm_out = qkm + ((long long)h * nch + ch) * GDN_C * GDN_C;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = 16 * warp + g4 + (e >> 1) * 8, s = 8 * n + 2 * t4 + (e & 1);
            const float dec = s <= t ? expf(sG[t] - sG[s]) : 0.f;
            sA[t * (GDN_C + 1) + s] = s < t ? sB[t] * dec * kk[n][e] : 0.f;
            qkm_out[t * GDN_C + s] = f2h(dec * qk[n][e]);
        }
    __syncthreads();
    // X = (I + A)^-1 by 16 x 16 blocks (one long forward substitution took 64 dependent rows on 64 threads):
    // warp w inverts diagonal block w by forward substitution (lanes l and l + 16 split column l's sums by the
    // parity of s), then the blocks below it, block diagonal by block diagonal: X_ij = -X_ii sum_{j<=k<i} A_ik X_kj.
    // The blocks above the diagonal are never written; the writer below takes them as 0.
    {
        const int cl = lane & 15, par = lane >> 4, b0 = 16 * warp, c = b0 + cl;
        for (int t = 0; t < 16; ++t) {
            float acc = 0.f;
            for (int s = cl + par; s < t; s += 2) acc += sA[(b0 + t) * (GDN_C + 1) + b0 + s] * sX[(b0 + s) * (GDN_C + 1) + c];
            acc += __shfl_xor_sync(0xffffffffu, acc, 16);
            if (par == 0) sX[(b0 + t) * (GDN_C + 1) + c] = t == cl ? 1.f : (t < cl ? 0.f : -acc);
            __syncwarp();
        }
    }
    __syncthreads();
    for (int d = 1; d < 4; ++d) {
        const int n = (4 - d) * 256;
        for (int e = threadIdx.x; e < n; e += GDN_PREP_THREADS) {
            const int jb = e >> 8, row = (e >> 4) & 15, col = e & 15, ib = jb + d;
            float acc = 0.f;
            for (int m = 16 * jb; m < 16 * ib; ++m)
                acc += sA[(16 * ib + row) * (GDN_C + 1) + m] * sX[m * (GDN_C + 1) + 16 * jb + col];
            sM[e] = acc;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < n; e += GDN_PREP_THREADS) {
            const int jb = e >> 8, row = (e >> 4) & 15, col = e & 15, ib = jb + d;
            float acc = 0.f;
            for (int m = 0; m <= row; ++m)
                acc += sX[(16 * ib + row) * (GDN_C + 1) + 16 * ib + m] * sM[(jb << 8) + (m << 4) + col];
            sX[(16 * ib + row) * (GDN_C + 1) + 16 * jb + col] = -acc;
        }
        __syncthreads();
    }
    unsigned short* tc = tcat + ((long long)h * nch + ch) * GDN_C * 2 * GDN_C;
    for (int w = threadIdx.x; w < GDN_C * GDN_C; w += GDN_PREP_THREADS) {
        const int t = w / GDN_C, c = w % GDN_C;
        const float x = (t >> 4) < (c >> 4) ? 0.f : sX[t * (GDN_C + 1) + c] * sB[c];
        tc[t * 2 * GDN_C + c] = f2h(x);
        tc[t * 2 * GDN_C + GDN_C + c] = f2h(-x * expf(sG[c]));
    }
}

// ---- prompt: the scan over chunks ---------------------------------------------------------------------------------

#define GDN_SCAN_WARPS 8
#define GDN_SCAN_THREADS (32 * GDN_SCAN_WARPS)
#define GDN_LDV (GDN_BV + 8)
// one stage: Q, K (64 x D), V (64 x BV), tcat (64 x 128), qkm (64 x 64), gcum (64 floats)
#define GDN_ST_Q 0
#define GDN_ST_K (GDN_ST_Q + GDN_C * GDN_LDK * 2)
#define GDN_ST_V (GDN_ST_K + GDN_C * GDN_LDK * 2)
#define GDN_ST_T (GDN_ST_V + GDN_C * GDN_LDV * 2)
#define GDN_ST_QK (GDN_ST_T + GDN_C * (2 * GDN_C + 8) * 2)
#define GDN_ST_G (GDN_ST_QK + GDN_C * GDN_LDC * 2)
#define GDN_STAGE_B (GDN_ST_G + GDN_C * 4)
// after the two stages: KH, U, Ud (64 x BV each), H (D x BV)
#define GDN_SM_KH (2 * GDN_STAGE_B)
#define GDN_SM_U (GDN_SM_KH + GDN_C * GDN_LDV * 2)
#define GDN_SM_UD (GDN_SM_U + GDN_C * GDN_LDV * 2)
#define GDN_SM_H (GDN_SM_UD + GDN_C * GDN_LDV * 2)
#define GDN_SCAN_SMEM (GDN_SM_H + GDN_D * GDN_LDV * 2)

// This build's launch shape for the wrappers: prep threads and shared bytes, scan threads, shared bytes, GDN_BV,
// gdn_delta_decode's threads.
extern "C" __global__ void gdn_shape(int* out) {
    out[0] = GDN_PREP_THREADS;
    out[1] = GDN_PREP_SMEM;
    out[2] = GDN_SCAN_THREADS;
    out[3] = GDN_SCAN_SMEM;
    out[4] = GDN_BV;
    out[5] = 32 * GDN_DEC_WARPS;
}

// Grid (D / GDN_BV, n_v), block GDN_SCAN_THREADS, GDN_SCAN_SMEM bytes. Value head h, value columns i0 .. i0+BV-1 of
// S[h] (S: (n_v, D, D) fp32, S[h, i, j]: value i, key j), read at the start and written back at the end; the state
// lives in fp32 mma accumulators (H = S^T: warp rows of keys x value columns), with an fp16 copy in shared memory
// as the next chunk's operand. Chunk data comes by cp.async one chunk ahead. o: (T, n_v * D) fp32, ungated.
extern "C" __global__ void __launch_bounds__(GDN_SCAN_THREADS)
gdn_chunk_scan(const unsigned short* __restrict__ act16, int T, int C, const float* __restrict__ gcum,
               const unsigned short* __restrict__ tcat, const unsigned short* __restrict__ qkm, float* __restrict__ S,
               float* __restrict__ o, int n_k, int n_v, int grouped) {
    extern __shared__ __align__(16) unsigned char gdn_sm[];
    const int h = blockIdx.y, i0 = blockIdx.x * GDN_BV, nch = (T + GDN_C - 1) / GDN_C;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g4 = lane >> 2, t4 = lane & 3;
    const int r = n_v / n_k, kh = grouped ? h / r : h % n_k;
    const uint32_t sm0 = smem_u32(gdn_sm);
    float* Sh = S + (long long)h * GDN_D * GDN_D;
    // warp tilings: token rows x value columns (64 x BV): 4 x 2 warps; key rows x value columns (D x BV): HJ x HI
    constexpr int NCOL = GDN_BV / 2 / 8;                          // n-tiles per warp in the token tiling
    const int wm = warp & 3, wn = warp >> 2;
    constexpr int HJ = GDN_D / 16, HI = GDN_SCAN_WARPS / HJ, HN = GDN_BV / HI / 8;
    const int wj = warp % HJ, wi = warp / HJ;
    auto issue = [&](int stage, int ch) {
        const uint32_t st = sm0 + stage * GDN_STAGE_B;
        const int t0 = ch * GDN_C, nrows = min(GDN_C, T - t0);
        const unsigned short* row = act16 + (long long)t0 * C;
        gdn_load_tile<GDN_C, GDN_D, GDN_LDK, GDN_SCAN_THREADS>(st + GDN_ST_Q, row + kh * GDN_D, C, nrows);
        gdn_load_tile<GDN_C, GDN_D, GDN_LDK, GDN_SCAN_THREADS>(st + GDN_ST_K, row + (n_k + kh) * GDN_D, C, nrows);
        gdn_load_tile<GDN_C, GDN_BV, GDN_LDV, GDN_SCAN_THREADS>(st + GDN_ST_V, row + 2 * n_k * GDN_D + h * GDN_D + i0,
                                                                C, nrows);
        const long long hc = (long long)h * nch + ch;
        gdn_load_tile<GDN_C, 2 * GDN_C, 2 * GDN_C + 8, GDN_SCAN_THREADS>(st + GDN_ST_T, tcat + hc * GDN_C * 2 * GDN_C,
                                                                         2 * GDN_C, GDN_C);
        gdn_load_tile<GDN_C, GDN_C, GDN_LDC, GDN_SCAN_THREADS>(st + GDN_ST_QK, qkm + hc * GDN_C * GDN_C, GDN_C, GDN_C);
        if (threadIdx.x < GDN_C / 4)
            gdn_cp16(st + GDN_ST_G + 16 * threadIdx.x, gcum + (long long)h * nch * GDN_C + t0 + 4 * threadIdx.x, true);
    };
    issue(0, 0);
    gdn_commit();
    // the state: H[j][i] = S[i0 + i][j] in accumulators (rows 16 wj + g4 (+8), columns wi HN*8 + 8 n + 2 t4 (+1))
    float hacc[HN][4];
    unsigned short* sH = reinterpret_cast<unsigned short*>(gdn_sm + GDN_SM_H);
#pragma unroll
    for (int n = 0; n < HN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = 16 * wj + g4 + (e >> 1) * 8, i = wi * HN * 8 + 8 * n + 2 * t4 + (e & 1);
            hacc[n][e] = Sh[(long long)(i0 + i) * GDN_D + j];
            sH[j * GDN_LDV + i] = f2h(hacc[n][e]);
        }
    unsigned short* sKH = reinterpret_cast<unsigned short*>(gdn_sm + GDN_SM_KH);
    unsigned short* sU = reinterpret_cast<unsigned short*>(gdn_sm + GDN_SM_U);
    unsigned short* sUd = reinterpret_cast<unsigned short*>(gdn_sm + GDN_SM_UD);
    const int laK = gdn_lane_a(lane, GDN_LDK), laT = gdn_lane_a(lane, 2 * GDN_C + 8), laC = gdn_lane_a(lane, GDN_LDC);
    const int lbV = gdn_lane_a(lane, GDN_LDV);           // k-major B (trans): the plain pattern
    const int laKt = gdn_lane_b(lane, GDN_LDK);          // k-major A (trans): the n-major pattern
    for (int ch = 0; ch < nch; ++ch) {
        const int cur = ch & 1;
        gdn_wait<0>();
        __syncthreads();      // chunk ch's stage and sH for everyone; everyone is done with chunk ch - 1's stage
        if (ch + 1 < nch) issue(cur ^ 1, ch + 1);     // loads while this chunk is multiplied
        gdn_commit();
        const uint32_t st = sm0 + cur * GDN_STAGE_B;
        const float* sg = reinterpret_cast<const float*>(gdn_sm + cur * GDN_STAGE_B + GDN_ST_G);
        const int t0 = ch * GDN_C;
        // (a) KH = K H, QH = Q H: rows 16 wm, columns wn BV/2 ..
        float kh_acc[NCOL][4], qh_acc[NCOL][4];
#pragma unroll
        for (int n = 0; n < NCOL; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) kh_acc[n][e] = qh_acc[n][e] = 0.f;
#pragma unroll
        for (int kc = 0; kc < GDN_D / 16; ++kc) {
            uint32_t ak[4], aq[4];
            ldsm_x4(st + GDN_ST_K + (uint32_t)((16 * wm * GDN_LDK + 16 * kc + laK) * 2), ak[0], ak[1], ak[2], ak[3]);
            ldsm_x4(st + GDN_ST_Q + (uint32_t)((16 * wm * GDN_LDK + 16 * kc + laK) * 2), aq[0], aq[1], aq[2], aq[3]);
#pragma unroll
            for (int np = 0; np < NCOL / 2; ++np) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4_t(smem_u32(sH) + (uint32_t)((16 * kc * GDN_LDV + wn * GDN_BV / 2 + 16 * np + lbV) * 2), b0,
                          b1, b2, b3);
                mma_16816(kh_acc[2 * np], ak, b0, b1);
                mma_16816(kh_acc[2 * np + 1], ak, b2, b3);
                mma_16816(qh_acc[2 * np], aq, b0, b1);
                mma_16816(qh_acc[2 * np + 1], aq, b2, b3);
            }
        }
        const int ra = 16 * wm + g4, rb = ra + 8;
        const float ga = expf(sg[ra]), gb = expf(sg[rb]);
#pragma unroll
        for (int n = 0; n < NCOL; ++n) {
            const int col = wn * GDN_BV / 2 + 8 * n + 2 * t4;
            *reinterpret_cast<uint32_t*>(sKH + ra * GDN_LDV + col) = pack_h2(kh_acc[n][0], kh_acc[n][1]);
            *reinterpret_cast<uint32_t*>(sKH + rb * GDN_LDV + col) = pack_h2(kh_acc[n][2], kh_acc[n][3]);
            qh_acc[n][0] *= ga, qh_acc[n][1] *= ga, qh_acc[n][2] *= gb, qh_acc[n][3] *= gb;
        }
        __syncthreads();
        // (b) u = tcat [V; KH]: the same tiling
        float u[NCOL][4];
#pragma unroll
        for (int n = 0; n < NCOL; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) u[n][e] = 0.f;
#pragma unroll
        for (int kc = 0; kc < 2 * GDN_C / 16; ++kc) {
            uint32_t at[4];
            ldsm_x4(st + GDN_ST_T + (uint32_t)((16 * wm * (2 * GDN_C + 8) + 16 * kc + laT) * 2), at[0], at[1], at[2],
                    at[3]);
            const int kr = (kc % (GDN_C / 16)) * 16;
            const uint32_t bsrc = kc < GDN_C / 16 ? st + GDN_ST_V : smem_u32(sKH);
#pragma unroll
            for (int np = 0; np < NCOL / 2; ++np) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4_t(bsrc + (uint32_t)((kr * GDN_LDV + wn * GDN_BV / 2 + 16 * np + lbV) * 2), b0, b1, b2, b3);
                mma_16816(u[2 * np], at, b0, b1);
                mma_16816(u[2 * np + 1], at, b2, b3);
            }
        }
        const float glast = sg[GDN_C - 1];
        const float da = expf(glast - sg[ra]), db = expf(glast - sg[rb]);
#pragma unroll
        for (int n = 0; n < NCOL; ++n) {
            const int col = wn * GDN_BV / 2 + 8 * n + 2 * t4;
            *reinterpret_cast<uint32_t*>(sU + ra * GDN_LDV + col) = pack_h2(u[n][0], u[n][1]);
            *reinterpret_cast<uint32_t*>(sU + rb * GDN_LDV + col) = pack_h2(u[n][2], u[n][3]);
            *reinterpret_cast<uint32_t*>(sUd + ra * GDN_LDV + col) = pack_h2(u[n][0] * da, u[n][1] * da);
            *reinterpret_cast<uint32_t*>(sUd + rb * GDN_LDV + col) = pack_h2(u[n][2] * db, u[n][3] * db);
        }
        __syncthreads();
        // (c) o = G QH + qkm U
#pragma unroll
        for (int kc = 0; kc < GDN_C / 16; ++kc) {
            uint32_t aq[4];
            ldsm_x4(st + GDN_ST_QK + (uint32_t)((16 * wm * GDN_LDC + 16 * kc + laC) * 2), aq[0], aq[1], aq[2], aq[3]);
#pragma unroll
            for (int np = 0; np < NCOL / 2; ++np) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4_t(smem_u32(sU) + (uint32_t)((16 * kc * GDN_LDV + wn * GDN_BV / 2 + 16 * np + lbV) * 2), b0,
                          b1, b2, b3);
                mma_16816(qh_acc[2 * np], aq, b0, b1);
                mma_16816(qh_acc[2 * np + 1], aq, b2, b3);
            }
        }
#pragma unroll
        for (int n = 0; n < NCOL; ++n) {
            const int col = h * GDN_D + i0 + wn * GDN_BV / 2 + 8 * n + 2 * t4;
            if (t0 + ra < T)
                *reinterpret_cast<float2*>(o + (long long)(t0 + ra) * n_v * GDN_D + col) =
                    make_float2(qh_acc[n][0], qh_acc[n][1]);
            if (t0 + rb < T)
                *reinterpret_cast<float2*>(o + (long long)(t0 + rb) * n_v * GDN_D + col) =
                    make_float2(qh_acc[n][2], qh_acc[n][3]);
        }
        // (d) H = G_C H + K^T Ud: rows 16 wj of keys, columns wi HN*8 .. of values
        const float gl = expf(glast);
#pragma unroll
        for (int n = 0; n < HN; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) hacc[n][e] *= gl;
#pragma unroll
        for (int kc = 0; kc < GDN_C / 16; ++kc) {
            uint32_t ak[4];
            ldsm_x4_t(st + GDN_ST_K + (uint32_t)((16 * kc * GDN_LDK + 16 * wj + laKt) * 2), ak[0], ak[1], ak[2],
                      ak[3]);
#pragma unroll
            for (int np = 0; np < HN / 2; ++np) {
                uint32_t b0, b1, b2, b3;
                ldsm_x4_t(smem_u32(sUd) + (uint32_t)((16 * kc * GDN_LDV + wi * HN * 8 + 16 * np + lbV) * 2), b0, b1,
                          b2, b3);
                mma_16816(hacc[2 * np], ak, b0, b1);
                mma_16816(hacc[2 * np + 1], ak, b2, b3);
            }
        }
        // sH's readers (step a) passed two barriers since; the next chunk reads it after the loop's barrier
#pragma unroll
        for (int n = 0; n < HN; ++n) {
            const int j = 16 * wj + g4, col = wi * HN * 8 + 8 * n + 2 * t4;
            *reinterpret_cast<uint32_t*>(sH + j * GDN_LDV + col) = pack_h2(hacc[n][0], hacc[n][1]);
            *reinterpret_cast<uint32_t*>(sH + (j + 8) * GDN_LDV + col) = pack_h2(hacc[n][2], hacc[n][3]);
        }
    }
#pragma unroll
    for (int n = 0; n < HN; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = 16 * wj + g4 + (e >> 1) * 8, i = wi * HN * 8 + 8 * n + 2 * t4 + (e & 1);
            Sh[(long long)(i0 + i) * GDN_D + j] = hacc[n][e];
        }
}

// ---- prompt: gated norm -------------------------------------------------------------------------------------------

// Grid ceil(T n_v / 8), block 256: one warp per (token, value head) row of D. out = rms_norm(o) * norm_w * gate(z);
// z rows of ld_z floats (head h at h D), out may be o.
extern "C" __global__ void gdn_gated_norm(const float* o, const float* __restrict__ z, long long ld_z,
                                          const float* __restrict__ norm_w, float* out, int T, int n_v, float eps) {
    constexpr int L = GDN_D / 32;
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= T * n_v) return;
    const int t = row / n_v, h = row % n_v;
    const float* src = o + (long long)row * GDN_D;
    float x[L], ss = 0.f;
#pragma unroll
    for (int e = 0; e < L; ++e) {
        x[e] = src[lane + 32 * e];
        ss += x[e] * x[e];
    }
    const float sc = rsqrtf(warp_sum(ss) / GDN_D + eps);
    const float* zr = z + t * ld_z + h * GDN_D;
#pragma unroll
    for (int e = 0; e < L; ++e) {
        const int i = lane + 32 * e;
        out[(long long)row * GDN_D + i] = x[e] * sc * norm_w[i] * gdn_gate(zr[i]);
    }
}
