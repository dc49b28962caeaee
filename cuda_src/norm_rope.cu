// RMSNorm, and the per-head step between the Q/K/V projections and attention: optional q/k RMSNorm, RoPE from a
// host-made cos/sin table (so every scaling variant matches the NumPy reference), K and V into the fp16 cache.
#include "common.cuh"

// out[t] = x[t] / rms(x[t]) * w, one block per row.
extern "C" __global__ void rmsnorm(const float* __restrict__ x, const float* __restrict__ w,
                                   float* __restrict__ out, int n, float eps) {
    __shared__ float buf[32];
    const float* xr = x + (long long)blockIdx.x * n;
    float* o = out + (long long)blockIdx.x * n;
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
    s = block_sum(s, buf);
    const float inv = rsqrtf(s / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = xr[i] * inv * w[i];
}

// Grid (n_head + 2 * n_head_kv, T): block y is token t at position pos0 + t (+ state[1] when pos_dev is given);
// block x picks a Q head, a K head or a V head. blockDim.x == head_dim.
// q: (T, n_head*head_dim) rotated in place; k, v: (T, n_head_kv*head_dim) read; caches: (n_head_kv, max_ctx,
// head_dim) of this layer. rope_cs: (max_ctx, n_rot/2) float2 (cos, sin), already scaled as the model needs.
extern "C" __global__ void qk_rope_store(float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, const float* __restrict__ q_norm,
                                         const float* __restrict__ k_norm, const float2* __restrict__ rope_cs,
                                         const int* __restrict__ pos_dev, int pos0, unsigned short* __restrict__ kc,
                                         unsigned short* __restrict__ vc, int n_head, int n_head_kv, int head_dim,
                                         int n_rot, int neox, float eps, int max_ctx) {
    __shared__ float buf[32];
    __shared__ float hv[512];
    const int t = blockIdx.y, hb = blockIdx.x, d = threadIdx.x;
    const int pos = pos0 + t + (pos_dev ? pos_dev[1] : 0);
    const int qw = n_head * head_dim, kw = n_head_kv * head_dim;
    if (hb >= n_head + n_head_kv) {   // V: straight into the cache
        const int h = hb - n_head - n_head_kv;
        vc[((long long)h * max_ctx + pos) * head_dim + d] = f2h(v[(long long)t * kw + h * head_dim + d]);
        return;
    }
    const bool is_q = hb < n_head;
    const int h = is_q ? hb : hb - n_head;
    const float* src = is_q ? q + (long long)t * qw + h * head_dim : k + (long long)t * kw + h * head_dim;
    const float val = norm_rope_value(src[d], is_q ? q_norm : k_norm, rope_cs, pos, d, head_dim, n_rot, neox, eps, hv,
                                      buf);
    if (is_q) {
        q[(long long)t * qw + h * head_dim + d] = val;
    } else {
        kc[((long long)h * max_ctx + pos) * head_dim + d] = f2h(val);
    }
}
