// qwen4exp's own pieces on the GPU (engine/cuda/families/q4ops.py launches them; its NumPy references are the ground
// truth, engine/arch/qwen4exp.py the model's): the streams' grouped RMSNorm (GroupNorm_H, spec section 3: the PLE's
// three norms) and the embedding's broadcast to the H streams (4.1), a Gated DeltaNet with a sigmoid output gate and
// any head width (4.5; cuda_src/gdn.cu is built for widths 64 and 128), the PLE gate and dilated conv (4.8). The HC
// reads / writes and QSA are cuda_src/hc.cu and qsa.cu.
//
// Plain first versions: one thread per channel where a recurrence runs along the tokens. Every kernel takes T rows;
// fp32 throughout.

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

// --- the residual streams -------------------------------------------------------------------------------------------

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
