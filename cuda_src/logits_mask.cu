// The grammar mask and log-probabilities on the logits in VRAM (engine/cuda/logits_mask.py drives them; the NumPy
// references are engine/grammar.py apply_mask and engine/sampling.py logprobs_of).
//
// apply_token_mask: a token whose bit is 0 (bit t % 32 of word t / 32, LSB first: llguidance's layout) becomes -inf,
//   in place, before the sampler's chain; ids past the mask's words too.
// top_logprobs: one block. The log-softmax's normaliser (max, then the sum of exp(x - max), each thread's share in
//   double), the picked token's log-probability, and the k most likely ids in order (ties: the lower id first),
//   found by k block-wide arg-max passes that skip the ids already taken: k <= 20 passes over the vocabulary cost
//   less than one sort of it, and the request that asks for logprobs pays them alone.
#define LP_THREADS 1024
// NVRTC has no math.h, so no INFINITY: the bit pattern of -inf, as common.cuh spells NEG_INF.
#define LP_NEG_INF __int_as_float(0xff800000)
#define LP_MAX_K 20

extern "C" __global__ void apply_token_mask(float* __restrict__ logits, const unsigned int* __restrict__ words,
                                            int n_vocab, int n_words) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_vocab; i += gridDim.x * blockDim.x) {
        const int w = i >> 5;
        const bool ok = w < n_words && ((words[w] >> (i & 31)) & 1u);
        if (!ok) logits[i] = LP_NEG_INF;
    }
}

// Block-wide arg-max of (value, id): the larger value, at equal values the lower id. Returns the winner to every
// thread. s_val / s_id hold one entry per warp.
__device__ __forceinline__ void argmax_block(float& v, int& id, float* s_val, int* s_id) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, v, off);
        const int oi = __shfl_down_sync(0xffffffffu, id, off);
        if (ov > v || (ov == v && oi >= 0 && (id < 0 || oi < id))) { v = ov; id = oi; }
    }
    if (lane == 0) { s_val[warp] = v; s_id[warp] = id; }
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? s_val[lane] : LP_NEG_INF;
        id = lane < (int)(blockDim.x >> 5) ? s_id[lane] : -1;
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_down_sync(0xffffffffu, v, off);
            const int oi = __shfl_down_sync(0xffffffffu, id, off);
            if (ov > v || (ov == v && oi >= 0 && (id < 0 || oi < id))) { v = ov; id = oi; }
        }
        if (lane == 0) { s_val[0] = v; s_id[0] = id; }
    }
    __syncthreads();
    v = s_val[0];
    id = s_id[0];
    __syncthreads();
}

__device__ __forceinline__ double sum_block(double x, double* s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
    if (lane == 0) s[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < (int)(blockDim.x >> 5) ? s[lane] : 0.0;
        for (int off = 16; off > 0; off >>= 1) x += __shfl_down_sync(0xffffffffu, x, off);
        if (lane == 0) s[0] = x;
    }
    __syncthreads();
    x = s[0];
    __syncthreads();
    return x;
}

// out_ids[j], out_lp[j] for j < k: the j-th most likely id and its log-probability (-1 and -inf once every finite
// logit is taken); out_tok[0]: the log-probability of `token`, out_tok[1]: the normaliser (max + log sum exp).
extern "C" __global__ void __launch_bounds__(LP_THREADS)
top_logprobs(const float* __restrict__ logits, int n_vocab, int token, int k, int* __restrict__ out_ids,
             float* __restrict__ out_lp, float* __restrict__ out_tok) {
    __shared__ float s_val[32];
    __shared__ int s_id[32];
    __shared__ double s_sum[32];
    __shared__ int taken[LP_MAX_K];

    float m = LP_NEG_INF;
    int mi = -1;
    for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
        const float x = logits[i];
        if (x > m || (x == m && mi < 0)) { m = x; mi = i; }
    }
    argmax_block(m, mi, s_val, s_id);
    double part = 0.0;
    if (m > LP_NEG_INF)
        for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) part += exp((double)logits[i] - (double)m);
    const double lse = (double)m + log(sum_block(part, s_sum));

    if (threadIdx.x == 0) {
        out_tok[0] = token >= 0 && token < n_vocab ? (float)((double)logits[token] - lse) : LP_NEG_INF;
        out_tok[1] = (float)lse;
    }
    k = k < LP_MAX_K ? k : LP_MAX_K;
    for (int j = 0; j < k; ++j) {
        float v = LP_NEG_INF;
        int id = -1;
        for (int i = threadIdx.x; i < n_vocab; i += blockDim.x) {
            const float x = logits[i];
            if (!(x > LP_NEG_INF)) continue;
            bool skip = false;
            for (int t = 0; t < j; ++t) skip |= taken[t] == i;
            if (skip) continue;
            if (x > v || (x == v && (id < 0 || i < id))) { v = x; id = i; }
        }
        argmax_block(v, id, s_val, s_id);
        if (threadIdx.x == 0) {
            taken[j] = id;
            out_ids[j] = id;
            out_lp[j] = id >= 0 ? (float)((double)v - lse) : LP_NEG_INF;
        }
        __syncthreads();
    }
}
