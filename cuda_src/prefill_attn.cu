// Prompt attention for the streamed prompt pass: causal, GQA, tiled with an online softmax (flash-attention style),
// so a 32K prompt never materialises its score matrix. Keys and values are read from the KV cache, which the chunk's
// own K/V were written into first (qk_rope_store for fp16, qk_rope_store_i8 below for int8), so a chunk attends to
// every earlier chunk and to itself alike.
// KV formats: fp16 (n_head_kv, max_ctx, head_dim) per layer, as the decode step reads it; int8 the same shape with
// one fp32 scale per 32 values (n_head_kv, max_ctx, head_dim / 32), half the bytes. attn_decode_i8 is the decode
// side's read of the int8 cache (one query per head).
// CUDA cores only for now (a warp per query row, a lane per key of a 32-key tile); tensor cores are the next step.
// Not yet run on a GPU: tests/test_cuda_prefill_kernels.py checks these against NumPy.
#include "common.cuh"

#define FA_ROWS 8          // query rows (token, head) per block: one warp each
#define FA_TILE 32         // keys per tile: one per lane for the scores
#define FA_MAX_HD 256

// A tile of FA_TILE keys and values, positions p0.., as fp16 in shared memory; zeros past `last` (never NaN from
// unwritten cache, which a zero softmax weight would not cancel).
template <bool I8>
__device__ __forceinline__ void fa_load_tile(unsigned short* ks, unsigned short* vs, const void* kc, const void* vc,
                                             const float* ksc, const float* vsc, long long head_base, int p0,
                                             int last, int hd) {
    const int half = hd / 2, kst = hd + 2;
    for (int w = threadIdx.x; w < FA_TILE * half; w += blockDim.x) {
        const int r = w / half, col = w % half, p = p0 + r;
        uint32_t kw = 0u, vw = 0u;
        if (p <= last) {
            const long long at = (head_base + p) * hd + 2 * col;
            if (I8) {
                const signed char* kq = reinterpret_cast<const signed char*>(kc);
                const signed char* vq = reinterpret_cast<const signed char*>(vc);
                const long long si = (head_base + p) * (hd / 32) + (2 * col) / 32;
                const float a = ksc[si], b = vsc[si];
                kw = (uint32_t)f2h(a * kq[at]) | ((uint32_t)f2h(a * kq[at + 1]) << 16);
                vw = (uint32_t)f2h(b * vq[at]) | ((uint32_t)f2h(b * vq[at + 1]) << 16);
            } else {
                kw = reinterpret_cast<const uint32_t*>(kc)[at / 2];
                vw = reinterpret_cast<const uint32_t*>(vc)[at / 2];
            }
        }
        reinterpret_cast<uint32_t*>(ks + r * kst)[col] = kw;
        reinterpret_cast<uint32_t*>(vs + r * hd)[col] = vw;
    }
}

// Grid (ceil(T * G / FA_ROWS), n_head_kv), block 32 * FA_ROWS; G = n_head / n_head_kv. Row r of the T * G rows is
// token t = r / G (position pos0 + t, keys 0 .. pos0 + t), head kvh * G + r % G. q, out: (T, n_head * hd) fp32, q
// already rotated. The rows of a block share their KV head, so each tile is loaded once for all of them.
template <bool I8>
__device__ __forceinline__ void fa_body(const float* __restrict__ q, const void* kc, const void* vc,
                                        const float* ksc, const float* vsc, float* __restrict__ out, int T, int pos0,
                                        int n_head, int n_head_kv, int hd, int max_ctx, float scale) {
    __shared__ float qs[FA_ROWS][FA_MAX_HD];
    __shared__ __align__(16) unsigned short ks[FA_TILE * (FA_MAX_HD + 2)];
    __shared__ __align__(16) unsigned short vs[FA_TILE * FA_MAX_HD];
    const int G = n_head / n_head_kv, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rows = T * G, r0 = blockIdx.x * FA_ROWS;
    const int r = r0 + warp;
    const bool active = r < rows;
    const int t = active ? r / G : 0, head = kvh * G + (active ? r % G : 0);
    const int my_last = pos0 + t;
    const int block_last = pos0 + (min(rows, r0 + FA_ROWS) - 1) / G;
    const int dpl = hd / 32, half = hd / 2, kst = hd + 2;
    for (int d = lane; d < hd; d += 32) qs[warp][d] = active ? q[(long long)t * n_head * hd + head * hd + d] * scale : 0.f;
    float acc[FA_MAX_HD / 32];
#pragma unroll
    for (int i = 0; i < FA_MAX_HD / 32; ++i) acc[i] = 0.f;
    float m = NEG_INF, l = 0.f;
    const long long head_base = (long long)kvh * max_ctx;
    for (int p0 = 0; p0 <= block_last; p0 += FA_TILE) {
        __syncthreads();
        fa_load_tile<I8>(ks, vs, kc, vc, ksc, vsc, head_base, p0, block_last, hd);
        __syncthreads();
        if (!active || p0 > my_last) continue;          // warp-uniform
        const uint32_t* kr = reinterpret_cast<const uint32_t*>(ks + lane * kst);
        float s = 0.f;
        for (int w = 0; w < half; ++w) {
            const uint32_t kw = kr[w];
            s += qs[warp][2 * w] * h2f((unsigned short)(kw & 0xffff)) + qs[warp][2 * w + 1] * h2f((unsigned short)(kw >> 16));
        }
        if (p0 + lane > my_last) s = NEG_INF;
        const float mn = fmaxf(m, warp_max(s));
        const float p = s == NEG_INF ? 0.f : __expf(s - mn);
        const float corr = m == NEG_INF ? 0.f : __expf(m - mn);
        l = l * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < FA_MAX_HD / 32; ++i) acc[i] *= corr;
        const int n_keys = min(FA_TILE, my_last - p0 + 1);
        for (int j = 0; j < n_keys; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const unsigned short* vr = vs + j * hd + lane * dpl;
#pragma unroll
            for (int i = 0; i < FA_MAX_HD / 32; ++i)
                if (i < dpl) acc[i] += pj * h2f(vr[i]);
        }
        m = mn;
    }
    if (!active) return;
    const float inv = 1.f / l;
    float* o = out + (long long)t * n_head * hd + head * hd + lane * dpl;
#pragma unroll
    for (int i = 0; i < FA_MAX_HD / 32; ++i)
        if (i < dpl) o[i] = acc[i] * inv;
}

extern "C" __global__ void __launch_bounds__(32 * FA_ROWS)
flash_attn_f16(const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
               float* __restrict__ out, int T, int pos0, int n_head, int n_head_kv, int head_dim, int max_ctx,
               float scale) {
    fa_body<false>(q, kc, vc, nullptr, nullptr, out, T, pos0, n_head, n_head_kv, head_dim, max_ctx, scale);
}

extern "C" __global__ void __launch_bounds__(32 * FA_ROWS)
flash_attn_i8(const float* __restrict__ q, const signed char* __restrict__ kc, const signed char* __restrict__ vc,
              const float* __restrict__ k_scale, const float* __restrict__ v_scale, float* __restrict__ out, int T,
              int pos0, int n_head, int n_head_kv, int head_dim, int max_ctx, float scale) {
    fa_body<true>(q, kc, vc, k_scale, v_scale, out, T, pos0, n_head, n_head_kv, head_dim, max_ctx, scale);
}

// qk_rope_store (norm_rope.cu) with an int8 cache: the same q/k norm and RoPE, K and V quantized per 32 values
// (one warp: absmax / 127 as the scale, round to nearest). Grid (n_head + 2 * n_head_kv, T), blockDim.x = head_dim.
__device__ __forceinline__ void i8_store(float val, signed char* q, float* sc, long long row, int d, int hd) {
    const float amax = warp_max(fabsf(val));
    const float s = amax / 127.f;
    q[row * hd + d] = (signed char)__float2int_rn(s > 0.f ? val / s : 0.f);
    if ((d & 31) == 0) sc[row * (hd / 32) + d / 32] = s;
}

extern "C" __global__ void qk_rope_store_i8(float* __restrict__ q, const float* __restrict__ k,
                                            const float* __restrict__ v, const float* __restrict__ q_norm,
                                            const float* __restrict__ k_norm, const float2* __restrict__ rope_cs,
                                            const int* __restrict__ pos_dev, int pos0, signed char* __restrict__ kq,
                                            float* __restrict__ ks, signed char* __restrict__ vq,
                                            float* __restrict__ vs, int n_head, int n_head_kv, int head_dim,
                                            int n_rot, int neox, float eps, int max_ctx) {
    __shared__ float buf[32];
    __shared__ float hv[FA_MAX_HD];
    const int t = blockIdx.y, hb = blockIdx.x, d = threadIdx.x;
    const int pos = pos0 + t + (pos_dev ? pos_dev[1] : 0);
    const int qw = n_head * head_dim, kw = n_head_kv * head_dim;
    if (hb >= n_head + n_head_kv) {
        const int h = hb - n_head - n_head_kv;
        i8_store(v[(long long)t * kw + h * head_dim + d], vq, vs, (long long)h * max_ctx + pos, d, head_dim);
        return;
    }
    const bool is_q = hb < n_head;
    const int h = is_q ? hb : hb - n_head;
    const float* src = is_q ? q + (long long)t * qw + h * head_dim : k + (long long)t * kw + h * head_dim;
    float val = src[d];
    const float* nw = is_q ? q_norm : k_norm;
    if (nw) {
        const float s = block_sum(val * val, buf);
        val = val * rsqrtf(s / head_dim + eps) * nw[d];
    }
    hv[d] = val;
    __syncthreads();
    if (d < n_rot) {
        const int half_rot = n_rot / 2;
        int i, partner;
        float sign;
        if (neox) {
            i = d < half_rot ? d : d - half_rot;
            partner = d < half_rot ? d + half_rot : d - half_rot;
            sign = d < half_rot ? -1.f : 1.f;
        } else {
            i = d / 2;
            partner = d ^ 1;
            sign = (d & 1) ? 1.f : -1.f;
        }
        const float2 cs = rope_cs[(long long)pos * half_rot + i];
        val = hv[d] * cs.x + sign * hv[partner] * cs.y;
    }
    if (is_q)
        q[(long long)t * qw + h * head_dim + d] = val;
    else
        i8_store(val, kq, ks, (long long)h * max_ctx + pos, d, head_dim);
}

// Decode over the int8 cache: one query per head, grid n_head, block 128 (4 warps, positions round-robin, merged in
// shared memory). n_pos = state[1] + 1 (a captured step) or n_fixed when state is null. q, out: n_head * head_dim.
extern "C" __global__ void attn_decode_i8(const float* __restrict__ q, const signed char* __restrict__ kq,
                                          const float* __restrict__ ksc, const signed char* __restrict__ vq,
                                          const float* __restrict__ vsc, const int* __restrict__ state, int n_fixed,
                                          float* __restrict__ out, int n_head, int n_head_kv, int head_dim,
                                          int max_ctx, float scale) {
    __shared__ float sm[4], sl[4];
    __shared__ float sacc[4][FA_MAX_HD];
    const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int n_pos = state ? state[1] + 1 : n_fixed;
    const int kvh = h / (n_head / n_head_kv), dpl = head_dim / 32, nsc = head_dim / 32;
    float qv[FA_MAX_HD / 32], acc[FA_MAX_HD / 32];
#pragma unroll
    for (int i = 0; i < FA_MAX_HD / 32; ++i) {
        qv[i] = i < dpl ? q[h * head_dim + lane * dpl + i] * scale : 0.f;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const long long base = (long long)kvh * max_ctx;
    for (int p = warp; p < n_pos; p += nw) {
        const long long row = base + p;
        // the scale per value: a lane's dpl values cross a 32-value scale block when dpl does not divide 32
        // (head_dim 96, 160, 192, 224); found by reading, not yet run on a GPU
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < FA_MAX_HD / 32; ++i)
            if (i < dpl)
                d += qv[i] * ksc[row * nsc + (lane * dpl + i) / 32] * kq[row * head_dim + lane * dpl + i];
        const float s = warp_sum(d);
        const float mn = fmaxf(m, s);
        const float corr = m == NEG_INF ? 0.f : __expf(m - mn);
        const float w = __expf(s - mn);
        l = l * corr + w;
#pragma unroll
        for (int i = 0; i < FA_MAX_HD / 32; ++i)
            if (i < dpl)
                acc[i] = acc[i] * corr + w * vsc[row * nsc + (lane * dpl + i) / 32] * vq[row * head_dim + lane * dpl + i];
        m = mn;
    }
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
#pragma unroll
    for (int i = 0; i < FA_MAX_HD / 32; ++i)
        if (i < dpl) sacc[warp][lane * dpl + i] = acc[i];
    __syncthreads();
    float M = NEG_INF;
    for (int w = 0; w < nw; ++w) M = fmaxf(M, sm[w]);
    float L = 0.f;
    for (int w = 0; w < nw; ++w)
        if (sm[w] > NEG_INF) L += sl[w] * __expf(sm[w] - M);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.f;
        for (int w = 0; w < nw; ++w)
            if (sm[w] > NEG_INF) a += sacc[w][d] * __expf(sm[w] - M);
        out[h * head_dim + d] = a / L;
    }
}
