// qwen4exp's own pieces on the GPU (engine/cuda/families/q4ops.py launches them; its NumPy references are the ground
// truth, engine/arch/qwen4exp.py the model's): the hyper-connection read / write around every half-layer (spec 4.2,
// 4.3), a Gated DeltaNet with a sigmoid output gate and any head width (4.5; cuda_src/gdn.cu is built for widths 64
// and 128 with a SiLU gate), the PLE gate and dilated conv (4.8), and QSA (4.6): indexer keys, pooled block keys,
// block scores, the top-budget selection and attention over the selected positions.
//
// These are the plain first versions: one thread per channel where a recurrence runs along the tokens, a warp per
// (head, query) for the attention, an O(n_blocks^2) rank for the selection (ties to the lower block). Every kernel
// takes T rows; where it takes `state`, a decode step reads its position from state[1] (the embed kernel wrote it),
// so one captured graph serves every step, and pos0 is then ignored. fp32 throughout, K/V fp16 (kv.py's layout).
#include "common.cuh"     // h2f, NEG_INF (NVRTC builds see no CUDA or system headers)

#define Q4_MAX_LANE 8          // head width / 32 held per lane (head width <= 256)

__device__ __forceinline__ float q4_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float q4_silu(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float q4_softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float q4_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the block (any blockDim.x up to 1024); every thread gets it. red: 32 floats of shared memory.
__device__ __forceinline__ float q4_block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = q4_warp_sum(v);
    __syncthreads();                       // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; ++i) s += red[i];
    return s;
}

__device__ __forceinline__ int q4_pos(const int* state, int pos0, int t) { return state ? state[1] : pos0 + t; }

// --- hyper-connections -------------------------------------------------------------------------------------------

// Grid rows * H, block 256: out[r, c N + i] = x[r, c N + i] / sqrt(mean_i x[r, c N + i]^2 + eps) * gamma[c N + i]
// (GroupNorm_H: each stream normed alone with its slice of gamma). out may be x.
extern "C" __global__ void q4_group_rmsnorm(const float* __restrict__ x, const float* __restrict__ gamma,
                                            float* __restrict__ out, int N, int H, float eps) {
    __shared__ float red[32];
    const long long base = (long long)blockIdx.x * N;          // row r's stream c starts at (r H + c) N
    const int c = blockIdx.x % H;
    float s = 0.f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const float v = x[base + i];
        s += v * v;
    }
    const float inv = rsqrtf(q4_block_sum(s, red) / N + eps);
    for (int i = threadIdx.x; i < N; i += blockDim.x) out[base + i] = x[base + i] * inv * gamma[c * N + i];
}

// a[i] = silu(a[i] * scale): the HC read's SiLU(W_down u / H).
extern "C" __global__ void q4_silu_scale(float* __restrict__ a, long long n, float scale) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        a[i] = q4_silu(a[i] * scale);
}

// y[r, i] = (1/H) sum_c sigmoid(s[r, c N + i]) u[r, c N + i]: the block input from the normalised streams u and the
// up projection's logits s (both rows of H N).
extern "C" __global__ void q4_hc_mix(const float* __restrict__ u, const float* __restrict__ s, float* __restrict__ y,
                                     int N, int H, long long rows) {
    const long long n = rows * N;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x) {
        const long long r = k / N, i = k % N, base = r * H * N + i;
        float acc = 0.f;
        for (int c = 0; c < H; ++c) acc += q4_sigmoid(s[base + c * N]) * u[base + c * N];
        y[k] = acc / H;
    }
}

// x[r, c N + i] += 2 sigmoid(inj[r, c] * inv_h) * o[r, i]: the HC write (inj: the inject projection's logits, H a row).
extern "C" __global__ void q4_hc_write(float* __restrict__ x, const float* __restrict__ o,
                                       const float* __restrict__ inj, int N, int H, long long rows, float inv_h) {
    const long long D = (long long)H * N, n = rows * D;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x) {
        const long long r = k / D, j = k % D;
        const int c = (int)(j / N), i = (int)(j % N);
        x[k] += 2.f * q4_sigmoid(inj[r * H + c] * inv_h) * o[r * N + i];
    }
}

// x[r, c N + i] = e[r, i] for every stream c: the residual's four copies of the embedding.
extern "C" __global__ void q4_broadcast(const float* __restrict__ e, float* __restrict__ x, int N, int H,
                                        long long rows) {
    const long long D = (long long)H * N, n = rows * D;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (long long)gridDim.x * blockDim.x)
        x[k] = e[(k / D) * N + (k % D) % N];
}

// --- Gated DeltaNet (sigmoid gate, any head width up to 1024) ----------------------------------------------------

// One thread per channel c < C: out[t, c] = silu(sum_k w[c, k] seq[t + k]), seq = the K-1 inputs in state (oldest
// first, (K-1, C)) then in's T rows (row stride ld_in); state becomes the last K-1 inputs. out must not alias in.
extern "C" __global__ void q4_gdn_conv(const float* __restrict__ in, long long ld_in, int T, float* __restrict__ state,
                                       const float* __restrict__ w, float* __restrict__ out, long long ld_out, int C,
                                       int K) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int L = K - 1;
    for (int t = 0; t < T; ++t) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) {
            const int j = t + k;
            const float v = j < L ? state[(long long)j * C + c] : in[(long long)(j - L) * ld_in + c];
            acc += w[(long long)c * K + k] * v;
        }
        out[(long long)t * ld_out + c] = q4_silu(acc);
    }
    for (int j = 0; j < L; ++j) {      // ascending: seq[T + j] never reads a state row already rewritten
        const int s = T + j;
        state[(long long)j * C + c] = s < L ? state[(long long)s * C + c] : in[(long long)(s - L) * ld_in + c];
    }
}

// Grid (2 n_k, T), block 32: q heads (the first n_k of D each) and k heads (the next n_k) of act's row t l2-normed,
// v / sqrt(sum v^2 + eps), q heads also times q_scale.
extern "C" __global__ void q4_gdn_qk_norm(float* __restrict__ act, long long ld, int n_k, int D, float eps,
                                          float q_scale) {
    float* v = act + (long long)blockIdx.y * ld + (long long)blockIdx.x * D;
    float s = 0.f;
    for (int i = threadIdx.x; i < D; i += 32) s += v[i] * v[i];
    const float mul = rsqrtf(q4_warp_sum(s) + eps) * ((int)blockIdx.x < n_k ? q_scale : 1.f);
    for (int i = threadIdx.x; i < D; i += 32) v[i] *= mul;
}

// Grid n_v, block >= D (a multiple of 32), dynamic shared memory 2 D floats. Value head h (key head h % n_k, the
// GGUF's tiled order) over T tokens in order: S_h (D x D, S[h, i, j]: value i, key j) decays by exp(g), moves its
// answer for k toward v by beta, o = S_h q; out = rms_norm(o) * norm_w * gate(z), gate sigmoid (sigmoid_gate) or
// SiLU. act rows: [q of n_k heads | k of n_k heads | v of n_v heads] after q4_gdn_conv and q4_gdn_qk_norm; b, a the
// beta and alpha projections (n_v a row, row stride ld_ba), g = softplus(a + dt_bias) * ssm_a.
extern "C" __global__ void q4_gdn_delta(const float* __restrict__ act, long long ld_act, int T,
                                        const float* __restrict__ b, const float* __restrict__ a, long long ld_ba,
                                        const float* __restrict__ dt_bias, const float* __restrict__ ssm_a,
                                        float* __restrict__ S, const float* __restrict__ z, long long ld_z,
                                        const float* __restrict__ norm_w, float* __restrict__ out, long long ld_out,
                                        int n_k, int D, float eps, int sigmoid_gate) {
    extern __shared__ float q4_sm[];
    __shared__ float red[32];
    float* sq = q4_sm;
    float* sk = q4_sm + D;
    const int h = blockIdx.x, kh = h % n_k, i = threadIdx.x;
    float* row = S + ((long long)h * D + (i < D ? i : 0)) * D;
    for (int t = 0; t < T; ++t) {
        const float* at = act + (long long)t * ld_act;
        __syncthreads();                   // the previous token's readers of sq / sk are done
        for (int j = threadIdx.x; j < D; j += blockDim.x) {
            sq[j] = at[kh * D + j];
            sk[j] = at[(n_k + kh) * D + j];
        }
        __syncthreads();
        const float beta = q4_sigmoid(b[(long long)t * ld_ba + h]);
        const float decay = expf(q4_softplus(a[(long long)t * ld_ba + h] + dt_bias[h]) * ssm_a[h]);
        float o = 0.f;
        if (i < D) {
            const float v = at[(2 * n_k + h) * D + i];
            float m = 0.f;
            for (int j = 0; j < D; ++j) {
                const float s = row[j] * decay;
                row[j] = s;
                m += s * sk[j];
            }
            const float delta = beta * (v - m);
            for (int j = 0; j < D; ++j) {
                const float s = row[j] + delta * sk[j];
                row[j] = s;
                o += s * sq[j];
            }
        }
        const float inv = rsqrtf(q4_block_sum(o * o, red) / D + eps);
        if (i < D) {
            const float zv = z[(long long)t * ld_z + (long long)h * D + i];
            const float g = sigmoid_gate ? q4_sigmoid(zv) : q4_silu(zv);
            out[(long long)t * ld_out + (long long)h * D + i] = o * inv * norm_w[i] * g;
        }
    }
}

// --- PLE ---------------------------------------------------------------------------------------------------------

// Grid rows * H, block 256: stream c of row r: lambda = (kn_c . qn_c) / sqrt(N), the signed square root
// sign(lambda) sqrt(max(|lambda|, 1e-6)), and g[r, c N + i] = sigmoid(that) v[r, i] (kn, qn: the normed key and
// query, rows of H N; v rows of N).
extern "C" __global__ void q4_ple_gate(const float* __restrict__ kn, const float* __restrict__ qn,
                                       const float* __restrict__ v, float* __restrict__ g, int N, int H) {
    __shared__ float red[32];
    const long long base = (long long)blockIdx.x * N;
    const long long r = blockIdx.x / H;
    float s = 0.f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) s += kn[base + i] * qn[base + i];
    const float lam = q4_block_sum(s, red) / sqrtf((float)N);
    const float root = sqrtf(fmaxf(fabsf(lam), 1e-6f));
    const float gate = q4_sigmoid(lam > 0.f ? root : (lam < 0.f ? -root : 0.f));
    for (int i = threadIdx.x; i < N; i += blockDim.x) g[base + i] = gate * v[r * N + i];
}

// One thread per channel c < D: the dilated causal conv of the normed gated values gn over the history hist
// ((K-1) dil rows, oldest first): conv_t = sum_k w[c, k] seq[t + dil k]; x[t, c] += g[t, c] + silu(conv_t); hist
// becomes the last (K-1) dil rows of seq (hist then gn).
extern "C" __global__ void q4_ple_conv(const float* __restrict__ gn, float* __restrict__ hist,
                                       const float* __restrict__ w, const float* __restrict__ g,
                                       float* __restrict__ x, int T, int D, int K, int dil) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const int L = (K - 1) * dil;
    for (int t = 0; t < T; ++t) {
        float acc = 0.f;
        for (int k = 0; k < K; ++k) {
            const int j = t + dil * k;
            acc += w[(long long)c * K + k] * (j < L ? hist[(long long)j * D + c] : gn[(long long)(j - L) * D + c]);
        }
        x[(long long)t * D + c] += g[(long long)t * D + c] + q4_silu(acc);
    }
    for (int j = 0; j < L; ++j) {
        const int s = T + j;
        hist[(long long)j * D + c] = s < L ? hist[(long long)s * D + c] : gn[(long long)(s - L) * D + c];
    }
}

// --- QSA ---------------------------------------------------------------------------------------------------------

// A warp's RMSNorm (gamma) and NeoX RoPE (the first n_rot dims, pairs (i, i + n_rot/2), at position p of rope's
// (cos, sin) table of n_rot/2 pairs a position) of the d values in buf (shared memory), written to out.
__device__ __forceinline__ void q4_warp_norm_rope(float* buf, float* __restrict__ out, int d,
                                                  const float* __restrict__ gamma, const float* __restrict__ rope,
                                                  int n_rot, float eps, int p) {
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += 32) s += buf[i] * buf[i];
    const float inv = rsqrtf(q4_warp_sum(s) / d + eps);
    for (int i = threadIdx.x; i < d; i += 32) buf[i] *= inv * gamma[i];
    __syncwarp();
    const int half = n_rot / 2;
    for (int i = threadIdx.x; i < d; i += 32) {
        float v = buf[i];
        if (i < n_rot) {
            const int pi = i < half ? i : i - half;
            const float cs = rope[((long long)p * half + pi) * 2], sn = rope[((long long)p * half + pi) * 2 + 1];
            v = i < half ? buf[i] * cs - buf[i + half] * sn : buf[i - half] * sn + buf[i] * cs;
        }
        out[i] = v;
    }
    __syncwarp();
}

// Grid (heads, T), block 32, head width d <= 512: each head of row t (row stride ld) RMS-normed with gamma and
// turned at its position in place (the indexer queries).
extern "C" __global__ void q4_norm_rope(float* __restrict__ x, long long ld, int d, const float* __restrict__ gamma,
                                        const float* __restrict__ rope, int n_rot, float eps, const int* state,
                                        int pos0) {
    __shared__ float buf[512];
    float* h = x + (long long)blockIdx.y * ld + (long long)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += 32) buf[i] = h[i];
    __syncwarp();
    q4_warp_norm_rope(buf, h, d, gamma, rope, n_rot, eps, q4_pos(state, pos0, blockIdx.y));
}

// Grid T, block 128: the raw indexer keys kraw (T, d) into keys at their positions.
extern "C" __global__ void q4_qsa_store_keys(const float* __restrict__ kraw, float* __restrict__ keys, int d,
                                             const int* state, int pos0) {
    const int p = q4_pos(state, pos0, blockIdx.x);
    for (int i = threadIdx.x; i < d; i += blockDim.x) keys[(long long)p * d + i] = kraw[(long long)blockIdx.x * d + i];
}

// Grid n, block 32, d <= 512: pooled block keys, K-bar_b = RoPE(RMSNorm(mean of keys' r rows of block b; gamma), at
// position r b). The prompt: blocks lo + blockIdx.x (n = hi - lo). A decode step (state): the block its token
// completes, if it completes one (grid 1).
extern "C" __global__ void q4_qsa_pool(const float* __restrict__ keys, float* __restrict__ pooled, int d, int r,
                                       const float* __restrict__ gamma, const float* __restrict__ rope, int n_rot,
                                       float eps, const int* state, int lo) {
    __shared__ float buf[512];
    int blk;
    if (state) {
        const int p = state[1];
        if ((p + 1) % r) return;
        blk = p / r;
    } else {
        blk = lo + blockIdx.x;
    }
    for (int i = threadIdx.x; i < d; i += 32) {
        float s = 0.f;
        for (int j = 0; j < r; ++j) s += keys[((long long)blk * r + j) * d + i];
        buf[i] = s / r;
    }
    __syncwarp();
    q4_warp_norm_rope(buf, pooled + (long long)blk * d, d, gamma, rope, n_rot, eps, blk * r);
}

// Grid (ceil(n_cols / 4), T), block 128 (a warp a block b): scores[t, b] = sum_h relu(q_h . K-bar_b) / sqrt(d) for
// the blocks complete at query t's position p (b < (p + 1) / r), -inf for the others up to n_cols. q: (T, heads d),
// row stride ld_q, already normed and turned.
extern "C" __global__ void q4_qsa_scores(const float* __restrict__ q, long long ld_q, int heads, int d,
                                         const float* __restrict__ pooled, float* __restrict__ scores, long long ld_s,
                                         int n_cols, int r, const int* state, int pos0) {
    const int t = blockIdx.y, b = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (b >= n_cols) return;
    const int nb = (q4_pos(state, pos0, t) + 1) / r;
    float out = NEG_INF;
    if (b < nb) {
        const float* qt = q + (long long)t * ld_q;
        const float* kb = pooled + (long long)b * d;
        float tot = 0.f;
        for (int h = 0; h < heads; ++h) {
            float s = 0.f;
            for (int i = lane; i < d; i += 32) s += qt[h * d + i] * kb[i];
            tot += fmaxf(q4_warp_sum(s), 0.f);
        }
        out = tot / sqrtf((float)d);
    }
    if (lane == 0) scores[(long long)t * ld_s + b] = out;
}

// Grid (ceil(n_cols / 256), T), block 256: sel[t, b] = 1 where query t keeps block b: every complete block while
// there are at most B of them (dense), else the B best by score, ties to the lower block (a block's rank: the
// blocks scoring higher, or equal and lower); 0 for the incomplete and the unseen ones.
extern "C" __global__ void q4_qsa_select(const float* __restrict__ scores, long long ld_s,
                                         unsigned char* __restrict__ sel, long long ld_sel, int n_cols, int B, int r,
                                         const int* state, int pos0) {
    const int t = blockIdx.y, b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n_cols) return;
    const int nb = (q4_pos(state, pos0, t) + 1) / r;
    unsigned char keep = 0;
    if (b < nb) {
        if (nb <= B) {
            keep = 1;
        } else {
            const float* st = scores + (long long)t * ld_s;
            const float sb = st[b];
            int rank = 0;
            for (int j = 0; j < nb && rank < B; ++j) {
                const float sj = st[j];
                rank += (sj > sb || (sj == sb && j < b)) ? 1 : 0;
            }
            keep = rank < B;
        }
    }
    sel[(long long)t * ld_sel + b] = keep;
}

// Grid (n_head, T), block 32, head width hd a multiple of 32 up to 256: out[t, head] = the softmax(q k / scale)
// weighted V over the positions query t (at position p) keeps: the tail r nb .. p always, and the positions of the
// blocks sel marks (every one before the tail while nb <= B). q (T, n_head hd) normed and turned (row stride ld_q);
// K, V: one layer's fp16 cache (n_head_kv, rows, hd); query head i reads KV head i / (n_head / n_head_kv).
extern "C" __global__ void q4_qsa_attend(const float* __restrict__ q, long long ld_q,
                                         const unsigned short* __restrict__ K, const unsigned short* __restrict__ V,
                                         int rows,
                                         const unsigned char* __restrict__ sel, long long ld_sel,
                                         float* __restrict__ out, long long ld_out, int n_head, int n_head_kv, int hd,
                                         float scale, int r, int B, const int* state, int pos0) {
    const int head = blockIdx.x, t = blockIdx.y, lane = threadIdx.x;
    const int p = q4_pos(state, pos0, t), nb = (p + 1) / r, tail = r * nb;
    const bool dense = nb <= B;
    const int kvh = head / (n_head / n_head_kv), L = hd / 32;
    const float* qt = q + (long long)t * ld_q + (long long)head * hd;
    const unsigned char* st = sel + (long long)t * ld_sel;
    float qv[Q4_MAX_LANE], acc[Q4_MAX_LANE];
    for (int e = 0; e < Q4_MAX_LANE; ++e) {
        qv[e] = e < L ? qt[lane + 32 * e] : 0.f;
        acc[e] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const unsigned short* kh = K + (long long)kvh * rows * hd;      // fp16 bits
    const unsigned short* vh = V + (long long)kvh * rows * hd;
    for (int pos = 0; pos <= p; ++pos) {
        if (!dense && pos < tail && !st[pos / r]) continue;
        const unsigned short* kr = kh + (long long)pos * hd;
        float s = 0.f;
        for (int e = 0; e < L; ++e) s += qv[e] * h2f(kr[lane + 32 * e]);
        s = q4_warp_sum(s) * scale;
        const float mn = fmaxf(m, s), corr = expf(m - mn), w = expf(s - mn);
        l = l * corr + w;
        const unsigned short* vr = vh + (long long)pos * hd;
        for (int e = 0; e < L; ++e) acc[e] = acc[e] * corr + w * h2f(vr[lane + 32 * e]);
        m = mn;
    }
    float* ot = out + (long long)t * ld_out + (long long)head * hd;
    for (int e = 0; e < L; ++e) ot[lane + 32 * e] = acc[e] / l;
}
