// Attention of one query token per head over the fp16 KV cache (decode), split over positions so that a long
// context still fills the GPU: attn_partial writes each split's running max, sum and weighted V; attn_combine
// merges them. The number of positions is read from device state, so a captured graph serves every step.
#include "common.cuh"

#define ATT_MAX_DPL 8   // head_dim up to 256 (8 values per lane)

// Grid (n_head, n_split), blockDim 128 (4 warps). n_pos = state[1] + 1 + n_extra (or n_fixed when state is null).
// part: (n_head, n_split, 2 + head_dim) = m, l, acc.
// With counters given (one int per head, zero), the last split of each head to finish merges them all into out
// (n_head * head_dim) in the same launch; attn_combine does that merge as a kernel of its own.
__device__ __forceinline__ void merge_splits(const float* ph, float* __restrict__ out, int n_split, int head_dim) {
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float M = NEG_INF;
        for (int s = 0; s < n_split; ++s) M = fmaxf(M, __ldcg(ph + s * (2 + head_dim)));
        float L = 0.f, a = 0.f;
        for (int s = 0; s < n_split; ++s) {
            const float* p = ph + s * (2 + head_dim);
            const float m = __ldcg(p);
            if (m == NEG_INF) continue;
            const float c = __expf(m - M);
            L += __ldcg(p + 1) * c;
            a += __ldcg(p + 2 + d) * c;
        }
        out[d] = a / L;
    }
}

extern "C" __global__ void attn_partial(const float* __restrict__ q, const unsigned short* __restrict__ kc,
                                        const unsigned short* __restrict__ vc, const int* __restrict__ state, int n_fixed,
                                        float* __restrict__ part, int n_head, int n_head_kv, int head_dim,
                                        int max_ctx, float scale, int* __restrict__ counters,
                                        float* __restrict__ out_merged) {
    __shared__ float sm[4], sl[4];
    __shared__ float sacc[4][256];
    const int h = blockIdx.x, split = blockIdx.y, n_split = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int n_pos = state ? state[1] + 1 : n_fixed;
    const int chunk = (n_pos + n_split - 1) / n_split;
    const int p0 = split * chunk, p1 = min(n_pos, p0 + chunk);
    const int kvh = h / (n_head / n_head_kv);
    const int dpl = head_dim / 32;
    float qv[ATT_MAX_DPL], acc[ATT_MAX_DPL];
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL; ++i) {
        qv[i] = i < dpl ? q[h * head_dim + lane * dpl + i] * scale : 0.f;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const unsigned short* kbase = kc + (long long)kvh * max_ctx * head_dim;
    const unsigned short* vbase = vc + (long long)kvh * max_ctx * head_dim;
    // Four positions per warp and round: their K loads and dot-product reductions are independent, so they overlap.
    for (int p = p0 + warp * 4; p < p1; p += nw * 4) {
        float s[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float d = 0.f;
            if (p + u < p1) {
                const unsigned short* kp = kbase + (long long)(p + u) * head_dim + lane * dpl;
#pragma unroll
                for (int i = 0; i < ATT_MAX_DPL; ++i)
                    if (i < dpl) d += qv[i] * h2f(kp[i]);
            }
            s[u] = d;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) s[u] = p + u < p1 ? warp_sum(s[u]) : NEG_INF;
        const float mn = fmaxf(fmaxf(m, fmaxf(s[0], s[1])), fmaxf(s[2], s[3]));
        const float corr = __expf(m - mn);
        l *= corr;
#pragma unroll
        for (int i = 0; i < ATT_MAX_DPL; ++i) acc[i] *= corr;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            if (p + u < p1) {
                const float w = __expf(s[u] - mn);
                l += w;
                const unsigned short* vp = vbase + (long long)(p + u) * head_dim + lane * dpl;
#pragma unroll
                for (int i = 0; i < ATT_MAX_DPL; ++i)
                    if (i < dpl) acc[i] += w * h2f(vp[i]);
            }
        }
        m = mn;
    }
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL; ++i)
        if (i < dpl) sacc[warp][lane * dpl + i] = acc[i];
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < nw; ++w) M = fmaxf(M, sm[w]);
    float* out = part + ((long long)h * n_split + split) * (2 + head_dim);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < nw; ++w)
            if (sm[w] > NEG_INF) a += sacc[w][d] * __expf(sm[w] - M);
        out[2 + d] = a;
    }
    if (threadIdx.x == 0) {
        float L = 0.f;
        for (int w = 0; w < nw; ++w)
            if (sm[w] > NEG_INF) L += sl[w] * __expf(sm[w] - M);
        out[0] = M;
        out[1] = L;
    }
    if (counters) {
        __shared__ int is_last;
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            is_last = atomicAdd(counters + h, 1) == n_split - 1;
            if (is_last) counters[h] = 0;
        }
        __syncthreads();
        if (is_last) {
            __threadfence();
            merge_splits(part + (long long)h * n_split * (2 + head_dim), out_merged + h * head_dim, n_split, head_dim);
        }
    }
}

// Grid n_head, blockDim head_dim: out[h*head_dim + d] = merged softmax(QK) V.
extern "C" __global__ void attn_combine(const float* __restrict__ part, float* __restrict__ out, int n_split,
                                        int head_dim) {
    const int h = blockIdx.x, d = threadIdx.x;
    const float* ph = part + (long long)h * n_split * (2 + head_dim);
    float M = NEG_INF;
    for (int s = 0; s < n_split; ++s) M = fmaxf(M, ph[s * (2 + head_dim)]);
    float L = 0.f, a = 0.f;
    for (int s = 0; s < n_split; ++s) {
        const float* p = ph + s * (2 + head_dim);
        if (p[0] == NEG_INF) continue;
        const float c = __expf(p[0] - M);
        L += p[1] * c;
        a += p[2 + d] * c;
    }
    out[h * head_dim + d] = a / L;
}
