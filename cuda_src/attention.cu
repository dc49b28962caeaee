// The decode step's attention over the KV cache: one launch per layer per GQA group (below). The number of positions
// is read from device state, so a captured graph serves every step.
#include "common.cuh"
#include "kv_int8.cuh"

// ---- the decode step's attention: one launch per layer over a GQA group --------------------------------------------
// Grid (n_head_kv, n_split), blockDim 32 * clamp(G, 4, 8) with G = n_head / n_head_kv <= 16. Each block serves all
// G q heads of its KV head (one warp per head, two heads a warp when G > 8), so every K/V row is read once for the
// group. The live position count n_pos = state[1] + 1 is read here (a replayed graph serves every position): the
// split span is ceil(n_pos / n_split) rounded up to whole 32-position tiles, so short contexts use few blocks with
// one tile each and long ones every block; blocks past the needed count exit at once and are not counted. Tiles go
// global -> shared with 16-byte cp.async, double-buffered, so the next tile's loads fly while this one is computed.
// With one split needed the block writes the output itself; otherwise the last block of each KV head to finish
// merges the splits' (m, l, acc), every split's loads issued together.
// KV layouts (per layer): fp16 (n_head_kv, max_ctx, head_dim); int8 the same with one fp32 scale per 32 values in
// (n_head_kv, max_ctx, head_dim / 32), value = scale * q (prefill_attn.cu's qk_rope_store_kv8 writes it).
// part: n_head_kv * n_split * G * head_dim floats (acc), then n_head_kv * n_split * G * 2 (m, l). counters: one int
// per KV head, zero between launches. Dynamic shared memory: the group's q (G * head_dim floats) and two tile
// buffers (engine/cuda/kv.py attn_smem mirrors it). attn_gqa_rope_* also do qk_rope_store's work (see FUSE below).
#define AT_T 32               // positions per tile: one per lane for the scores
#define AT_MAX_SPLITS 64
#define AT_MAX_G 16
#define AT_DPL 8              // head_dim / 32 values per lane, up to head_dim 256

__device__ __forceinline__ unsigned at_smem_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned)a;
}
// 16 (or 4) bytes global -> shared without a register round trip; zeros when !ok (rows past the live positions).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at_smem_addr(dst)), "l"(src),
                 "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(at_smem_addr(dst)), "l"(src),
                 "r"(ok ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ float h_lo(unsigned w) { return h2f((unsigned short)(w & 0xffffu)); }
__device__ __forceinline__ float h_hi(unsigned w) { return h2f((unsigned short)(w >> 16)); }
__device__ __forceinline__ float i8_at(int w, int b) { return (float)((w << (24 - 8 * b)) >> 24); }

// Bytes of one K (or V) row in the cache and in shared memory (+16: rows of consecutive lanes start in different
// banks, so the per-lane row reads of the scores are conflict-free), and of one tile buffer (K, V, int8 scales).
__device__ __forceinline__ int at_row_bytes(bool i8, int hd) { return i8 ? hd : 2 * hd; }
__device__ __forceinline__ int at_buf_bytes(bool i8, int hd) {
    return 2 * AT_T * (at_row_bytes(i8, hd) + 16) + (i8 ? 2 * AT_T * (hd / 32) * 4 : 0);
}

// Queue tile rows row0 .. row0 + AT_T - 1 (global row = kv head * max_ctx + position; rows >= n_valid zero-filled).
// RING (gpt-oss): row0 is a position and the layer holds `ring` rows a head from head0 on, position p at row p % ring.
template <bool I8, bool RING = false>
__device__ __forceinline__ void at_issue(unsigned char* buf, const unsigned char* kg, const unsigned char* vg,
                                         const float* ksg, const float* vsg, long long row0, int n_valid, int hd,
                                         long long head0 = 0, int ring = 1) {
    const int rb = at_row_bytes(I8, hd), rs = rb + 16, cpr = rb / 16;
    unsigned char* ks = buf;
    unsigned char* vs = buf + AT_T * rs;
    auto row_of = [&](int r) { return RING ? head0 + (row0 + r) % ring : row0 + r; };
    for (int i = threadIdx.x; i < AT_T * cpr; i += blockDim.x) {
        const int r = i / cpr, c = i - r * cpr;
        const bool ok = r < n_valid;
        const long long g = row_of(ok ? r : 0) * rb + c * 16;
        cp_async16(ks + r * rs + c * 16, kg + g, ok);
        cp_async16(vs + r * rs + c * 16, vg + g, ok);
    }
    if (I8) {
        const int ns = hd / 32;
        float* kss = reinterpret_cast<float*>(buf + 2 * AT_T * rs);
        float* vss = kss + AT_T * ns;
        for (int i = threadIdx.x; i < AT_T * ns; i += blockDim.x) {
            const bool ok = i / ns < n_valid;
            const long long g = RING ? (ok ? row_of(i / ns) * ns + i % ns : head0 * ns) : row0 * ns + (ok ? i : 0);
            cp_async4(kss + i, ksg + g, ok);
            cp_async4(vss + i, vsg + g, ok);
        }
    }
    cp_async_commit();
}

// q . K[row] for this lane's row of the tile (q already scaled, in shared memory; same address for every lane).
template <bool I8>
__device__ __forceinline__ float at_score(const unsigned char* buf, const float* qg, int row, int hd) {
    const int rs = at_row_bytes(I8, hd) + 16;
    const unsigned char* kr = buf + row * rs;
    float s0 = 0.f, s1 = 0.f;
    if (!I8) {
        for (int c = 0; c < hd / 8; ++c) {
            const uint4 k = *reinterpret_cast<const uint4*>(kr + 16 * c);
            const float4 a = *reinterpret_cast<const float4*>(qg + 8 * c);
            const float4 b = *reinterpret_cast<const float4*>(qg + 8 * c + 4);
            s0 += a.x * h_lo(k.x) + a.y * h_hi(k.x) + a.z * h_lo(k.y) + a.w * h_hi(k.y);
            s1 += b.x * h_lo(k.z) + b.y * h_hi(k.z) + b.z * h_lo(k.w) + b.w * h_hi(k.w);
        }
        return s0 + s1;
    }
    const float* sc = reinterpret_cast<const float*>(buf + 2 * AT_T * rs) + row * (hd / 32);
    for (int c = 0; c < hd / 16; ++c) {          // 16 values; a 32-value scale block is two of these
        const int4 k = *reinterpret_cast<const int4*>(kr + 16 * c);
        const int w[4] = {k.x, k.y, k.z, k.w};
        float t = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 a = *reinterpret_cast<const float4*>(qg + 16 * c + 4 * j);
            t += a.x * i8_at(w[j], 0) + a.y * i8_at(w[j], 1) + a.z * i8_at(w[j], 2) + a.w * i8_at(w[j], 3);
        }
        if (c & 1) s1 += t * sc[c >> 1]; else s0 += t * sc[c >> 1];
    }
    return s0 + s1;
}

// This lane's head_dim / 32 values of V[row] (columns lane * dpl ..), as floats.
template <bool I8>
__device__ __forceinline__ void at_vrow(const unsigned char* buf, int row, int hd, int lane, float* x) {
    const int dpl = hd / 32, rs = at_row_bytes(I8, hd) + 16;
    const unsigned char* vr = buf + AT_T * rs + row * rs;
    if (!I8) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(vr) + lane * dpl;
        if (dpl == 8) {
            const uint4 u = *reinterpret_cast<const uint4*>(p);
            x[0] = h_lo(u.x); x[1] = h_hi(u.x); x[2] = h_lo(u.y); x[3] = h_hi(u.y);
            x[4] = h_lo(u.z); x[5] = h_hi(u.z); x[6] = h_lo(u.w); x[7] = h_hi(u.w);
        } else if (dpl == 4) {
            const uint2 u = *reinterpret_cast<const uint2*>(p);
            x[0] = h_lo(u.x); x[1] = h_hi(u.x); x[2] = h_lo(u.y); x[3] = h_hi(u.y);
        } else if (dpl == 2) {
            const unsigned u = *reinterpret_cast<const unsigned*>(p);
            x[0] = h_lo(u); x[1] = h_hi(u);
        } else {
#pragma unroll
            for (int i = 0; i < AT_DPL; ++i)
                if (i < dpl) x[i] = h2f(p[i]);
        }
        return;
    }
    // a lane's values cross a 32-value scale block when dpl does not divide 32 (head_dim 96): a scale per value
    const signed char* p = reinterpret_cast<const signed char*>(vr) + lane * dpl;
    const float* sc = reinterpret_cast<const float*>(buf + 2 * AT_T * rs) + AT_T * (hd / 32) + row * (hd / 32);
#pragma unroll
    for (int i = 0; i < AT_DPL; ++i)
        if (i < dpl) x[i] = sc[(lane * dpl + i) >> 5] * (float)p[i];
}

// The fused variant's inputs: this step's raw (un-normed, un-rotated) K and V rows and what qk_rope_store takes.
struct AtNew {
    const float* k;
    const float* v;
    const float* q_norm;
    const float* k_norm;
    const float2* cs;
    int n_rot, neox;
    float eps;
    // gpt-oss (the OSS template flag): one sink logit per q head of this layer (may be null), the window (0: none)
    const float* sinks;
    int n_swa;
};

// By one warp: dst[0 .. hd) = rope(rmsnorm(src) * w) at position pos, times mul (norm_rope.cu's qk_rope_store for one
// head; lane holds d = lane + 32 i). dst is shared memory.
__device__ __forceinline__ void at_rope_row(float* dst, const float* src, const float* w, const AtNew& nn, int pos,
                                            int hd, float mul, int lane) {
    const int dpl = hd / 32;
    float x[AT_DPL];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < AT_DPL; ++i)
        if (i < dpl) {
            x[i] = src[lane + 32 * i];
            ss += x[i] * x[i];
        }
    if (w) {
        const float r = rsqrtf(warp_sum(ss) / hd + nn.eps);
#pragma unroll
        for (int i = 0; i < AT_DPL; ++i)
            if (i < dpl) x[i] = x[i] * r * w[lane + 32 * i];
    }
#pragma unroll
    for (int i = 0; i < AT_DPL; ++i)
        if (i < dpl) dst[lane + 32 * i] = x[i];
    __syncwarp();
    const int half = nn.n_rot / 2;
#pragma unroll
    for (int i = 0; i < AT_DPL; ++i) {
        const int d = lane + 32 * i;
        if (i < dpl && d < nn.n_rot) {
            int j, partner;
            float sign;
            rope_pair(d, half, nn.neox, j, partner, sign);
            const float2 c = nn.cs[(long long)pos * half + j];
            x[i] = x[i] * c.x + sign * dst[partner] * c.y;
        }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < AT_DPL; ++i)
        if (i < dpl) dst[lane + 32 * i] = x[i] * mul;
    __syncwarp();
}

// By one warp: row x (hd floats, shared memory) into a K or V row of the cache layout at dst (fp16, or int8 with its
// hd / 32 scales at sc: kv_int8.cuh's rounding, so the cache and the patched tile hold the same values).
template <bool I8>
__device__ __forceinline__ void at_put_row(const float* x, unsigned char* dst, float* sc, int hd, int lane) {
#pragma unroll
    for (int i = 0; i < AT_DPL; ++i) {
        if (i >= hd / 32) break;
        const int d = lane + 32 * i;
        const float val = x[d];
        if (I8) {
            const float s = warp_max(fabsf(val)) / 127.f;
            reinterpret_cast<signed char*>(dst)[d] = (signed char)__float2int_rn(s > 0.f ? val / s : 0.f);
            if (lane == 0) sc[i] = s;
        } else {
            reinterpret_cast<unsigned short*>(dst)[d] = f2h(val);
        }
    }
}

// FUSE: q arrives raw; every block norms and rotates its group's q itself, and the block holding the new position
// (the last needed split) norms and rotates this step's K, writes K and V into the cache and into its own last tile
// (which cp.async loaded before they were written). Nothing else in the launch reads that row, so no other block
// waits for it; this replaces a qk_rope_store launch.
// OSS (gpt-oss, with FUSE): the layer holds max_ctx rows a head as a ring (position p at row p % max_ctx; a full
// layer's ring is its whole context), only the last nn.n_swa positions are attended when n_swa > 0, and the head's
// sink logit nn.sinks[h] joins each softmax denominator (engine/arch/gptoss.py sink_softmax).
template <bool I8, bool FUSE, bool OSS = false>
__device__ __forceinline__ void attn_gqa_body(const float* __restrict__ q, const unsigned char* kg,
                                              const unsigned char* vg, const float* ksg, const float* vsg,
                                              const int* __restrict__ state, int n_fixed, float* __restrict__ part,
                                              int* __restrict__ counters, float* __restrict__ out, int n_head_kv,
                                              int G, int hd, int max_ctx, float scale, const AtNew nn) {
    extern __shared__ __align__(16) unsigned char at_smem[];
    __shared__ float s_c[AT_MAX_G][AT_MAX_SPLITS];
    __shared__ float s_inv[AT_MAX_G];
    __shared__ int s_last;
    const int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int n_pos = state ? state[1] + 1 : n_fixed;
    const int lo = OSS && nn.n_swa > 0 ? max(0, n_pos - nn.n_swa) : 0;     // the first position attended
    int span = (n_pos - lo + S - 1) / S;
    span = max(AT_T, (span + AT_T - 1) / AT_T * AT_T);
    const int n_need = (n_pos - lo + span - 1) / span;
    if (split >= n_need) return;                     // uniform over the block; not counted in the merge
    const int p0 = lo + split * span, p1 = min(n_pos, p0 + span);
    const int n_tiles = (p1 - p0 + AT_T - 1) / AT_T;
    const int bb = at_buf_bytes(I8, hd), dpl = hd / 32;
    float* qs = reinterpret_cast<float*>(at_smem);
    unsigned char* bufs = at_smem + G * hd * 4;
    const long long head0 = (long long)kvh * max_ctx;
    const long long row0 = OSS ? p0 : head0 + p0;     // OSS: a position, its row p % max_ctx (at_issue RING)
    at_issue<I8, OSS>(bufs, kg, vg, ksg, vsg, row0, min(AT_T, p1 - p0), hd, head0, max_ctx);
    const int pos = n_pos - 1;
    const bool holds_new = FUSE && split == n_need - 1;
    float* knew = &s_c[0][0];          // the merge's scratch, free until then: the new K and V rows
    float* vnew = &s_c[8][0];
    if (FUSE) {
        for (int g = warp; g < G; g += nw)
            at_rope_row(qs + g * hd, q + (long long)(kvh * G + g) * hd, nn.q_norm, nn, pos, hd, scale, lane);
        if (holds_new && warp == 0) {
            at_rope_row(knew, nn.k + (long long)kvh * hd, nn.k_norm, nn, pos, hd, 1.f, lane);
            for (int d = lane; d < hd; d += 32) vnew[d] = nn.v[(long long)kvh * hd + d];
            __syncwarp();
            const long long row = head0 + (OSS ? pos % max_ctx : pos);
            const int rb = at_row_bytes(I8, hd);
            at_put_row<I8>(knew, const_cast<unsigned char*>(kg) + row * rb,
                           I8 ? const_cast<float*>(ksg) + row * (hd / 32) : nullptr, hd, lane);
            at_put_row<I8>(vnew, const_cast<unsigned char*>(vg) + row * rb,
                           I8 ? const_cast<float*>(vsg) + row * (hd / 32) : nullptr, hd, lane);
        }
    } else {
        for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = q[(long long)kvh * G * hd + i] * scale;
    }

    float acc[2][AT_DPL], m[2], l[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        m[hh] = NEG_INF;
        l[hh] = 0.f;
#pragma unroll
        for (int i = 0; i < AT_DPL; ++i) acc[hh][i] = 0.f;
    }
    for (int t = 0; t < n_tiles; ++t) {
        const int tp = p0 + t * AT_T, nv = min(AT_T, p1 - tp);
        if (t + 1 < n_tiles) {
            at_issue<I8, OSS>(bufs + ((t + 1) & 1) * bb, kg, vg, ksg, vsg, row0 + (t + 1) * AT_T,
                              min(AT_T, p1 - tp - AT_T), hd, head0, max_ctx);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (holds_new && t == n_tiles - 1) {         // block-uniform
            if (warp == 0) {
                unsigned char* b = bufs + (t & 1) * bb;
                const int rs = at_row_bytes(I8, hd) + 16, r = pos - tp;
                float* ksc = reinterpret_cast<float*>(b + 2 * AT_T * rs);
                at_put_row<I8>(knew, b + r * rs, ksc + r * (hd / 32), hd, lane);
                at_put_row<I8>(vnew, b + AT_T * rs + r * rs, ksc + AT_T * (hd / 32) + r * (hd / 32), hd, lane);
            }
            __syncthreads();
        }
        const unsigned char* buf = bufs + (t & 1) * bb;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int g = warp + hh * nw;
            if (g >= G) continue;                    // warp-uniform
            const float s = lane < nv ? at_score<I8>(buf, qs + g * hd, lane, hd) : NEG_INF;
            const float mn = fmaxf(m[hh], warp_max(s));
            const float corr = __expf(m[hh] - mn);    // 0 on the first tile (m = -inf, mn finite)
            const float w = __expf(s - mn);           // 0 past the live rows
            l[hh] = l[hh] * corr + warp_sum(w);
#pragma unroll
            for (int i = 0; i < AT_DPL; ++i) acc[hh][i] *= corr;
            for (int j = 0; j < nv; ++j) {
                const float wj = __shfl_sync(0xffffffffu, w, j);
                float x[AT_DPL];
                at_vrow<I8>(buf, j, hd, lane, x);
#pragma unroll
                for (int i = 0; i < AT_DPL; ++i)
                    if (i < dpl) acc[hh][i] += wj * x[i];
            }
            m[hh] = mn;
        }
        __syncthreads();                             // the next issue overwrites this buffer
    }

    const int cols = G * hd;
    if (n_need == 1) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int g = warp + hh * nw;
            if (g >= G) continue;
            const float sink = OSS && nn.sinks ? __expf(nn.sinks[kvh * G + g] - m[hh]) : 0.f;
            const float inv = 1.f / (l[hh] + sink);
            float* o = out + (long long)kvh * cols + g * hd + lane * dpl;
#pragma unroll
            for (int i = 0; i < AT_DPL; ++i)
                if (i < dpl) o[i] = acc[hh][i] * inv;
        }
        return;
    }
    float* pacc = part + (long long)kvh * S * cols;                     // (split, g, d)
    float* pml = part + (long long)n_head_kv * S * cols + (long long)kvh * S * G * 2;   // (split, g, {m, l})
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int g = warp + hh * nw;
        if (g >= G) continue;
        float* o = pacc + (long long)split * cols + g * hd + lane * dpl;
#pragma unroll
        for (int i = 0; i < AT_DPL; ++i)
            if (i < dpl) o[i] = acc[hh][i];
        if (lane == 0) {
            pml[(split * G + g) * 2] = m[hh];
            pml[(split * G + g) * 2 + 1] = l[hh];
        }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        s_last = atomicAdd(counters + kvh, 1) == n_need - 1;
        if (s_last) counters[kvh] = 0;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // merge weights per (head, split): c = exp(m_s - M), and 1 / sum(l_s * c)
    for (int g = warp; g < G; g += nw) {
        float M = NEG_INF;
        for (int s = lane; s < n_need; s += 32) M = fmaxf(M, __ldcg(pml + (s * G + g) * 2));
        M = warp_max(M);
        float L = 0.f;
        for (int s = lane; s < n_need; s += 32) {
            const float ms = __ldcg(pml + (s * G + g) * 2), ls = __ldcg(pml + (s * G + g) * 2 + 1);
            const float c = ms == NEG_INF ? 0.f : __expf(ms - M);
            s_c[g][s] = c;
            L += ls * c;
        }
        L = warp_sum(L);
        if (OSS && nn.sinks) L += __expf(nn.sinks[kvh * G + g] - M);
        if (lane == 0) s_inv[g] = 1.f / L;
    }
    __syncthreads();
    // one float4 column a thread; eight splits' loads in flight at once
    const float4* pa = reinterpret_cast<const float4*>(pacc);
    const int c4 = cols / 4;
    for (int c = threadIdx.x; c < c4; c += blockDim.x) {
        const int g = (4 * c) / hd;
        float ax = 0.f, ay = 0.f, az = 0.f, aw = 0.f;
        for (int s0 = 0; s0 < n_need; s0 += 8) {
            float4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (s0 + u < n_need) v[u] = __ldcg(pa + (long long)(s0 + u) * c4 + c);
#pragma unroll
            for (int u = 0; u < 8; ++u)
                if (s0 + u < n_need) {
                    const float w = s_c[g][s0 + u];
                    ax += w * v[u].x;
                    ay += w * v[u].y;
                    az += w * v[u].z;
                    aw += w * v[u].w;
                }
        }
        const float inv = s_inv[g];
        float4 r;
        r.x = ax * inv;
        r.y = ay * inv;
        r.z = az * inv;
        r.w = aw * inv;
        reinterpret_cast<float4*>(out + (long long)kvh * cols)[c] = r;
    }
}

extern "C" __global__ void __launch_bounds__(256)
attn_gqa_f16(const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
             const int* __restrict__ state, int n_fixed, float* __restrict__ part, int* __restrict__ counters,
             float* __restrict__ out, int n_head_kv, int group, int head_dim, int max_ctx, float scale) {
    attn_gqa_body<false, false>(q, reinterpret_cast<const unsigned char*>(kc),
                                reinterpret_cast<const unsigned char*>(vc), nullptr, nullptr, state, n_fixed, part,
                                counters, out, n_head_kv, group, head_dim, max_ctx, scale, AtNew{});
}

extern "C" __global__ void __launch_bounds__(256)
attn_gqa_i8(const float* __restrict__ q, const signed char* __restrict__ kq, const float* __restrict__ ks,
            const signed char* __restrict__ vq, const float* __restrict__ vs, const int* __restrict__ state,
            int n_fixed, float* __restrict__ part, int* __restrict__ counters, float* __restrict__ out, int n_head_kv,
            int group, int head_dim, int max_ctx, float scale) {
    attn_gqa_body<true, false>(q, reinterpret_cast<const unsigned char*>(kq),
                               reinterpret_cast<const unsigned char*>(vq), ks, vs, state, n_fixed, part, counters, out,
                               n_head_kv, group, head_dim, max_ctx, scale, AtNew{});
}

// The fused launches: q, k, v are this step's raw projections (q is not written back); K and V land in the cache at
// state[1]. Arguments as attn_gqa_* plus qk_rope_store's.
extern "C" __global__ void __launch_bounds__(256)
attn_gqa_rope_f16(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                  const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float2* __restrict__ rope_cs,
                  int n_rot, int neox, float eps, unsigned short* kc, unsigned short* vc, const int* __restrict__ state,
                  float* __restrict__ part, int* __restrict__ counters, float* __restrict__ out, int n_head_kv,
                  int group, int head_dim, int max_ctx, float scale) {
    const AtNew nn{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps};
    attn_gqa_body<false, true>(q, reinterpret_cast<const unsigned char*>(kc),
                               reinterpret_cast<const unsigned char*>(vc), nullptr, nullptr, state, 0, part, counters,
                               out, n_head_kv, group, head_dim, max_ctx, scale, nn);
}

extern "C" __global__ void __launch_bounds__(256)
attn_gqa_rope_i8(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                 const float* __restrict__ q_norm, const float* __restrict__ k_norm, const float2* __restrict__ rope_cs,
                 int n_rot, int neox, float eps, signed char* kq, float* ks, signed char* vq, float* vs,
                 const int* __restrict__ state, float* __restrict__ part, int* __restrict__ counters,
                 float* __restrict__ out, int n_head_kv, int group, int head_dim, int max_ctx, float scale) {
    const AtNew nn{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps};
    attn_gqa_body<true, true>(q, reinterpret_cast<const unsigned char*>(kq), reinterpret_cast<const unsigned char*>(vq),
                              ks, vs, state, 0, part, counters, out, n_head_kv, group, head_dim, max_ctx, scale, nn);
}

// gpt-oss's fused launches: as attn_gqa_rope_* with the layer's sinks (n_head floats), its window (0: none) and the
// ring (max_ctx: the layer's rows a head, engine/cuda/kv.py KVCache.rows).
extern "C" __global__ void __launch_bounds__(256)
attn_gqa_rope_oss_f16(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                      const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                      const float2* __restrict__ rope_cs, int n_rot, int neox, float eps, unsigned short* kc,
                      unsigned short* vc, const int* __restrict__ state, float* __restrict__ part,
                      int* __restrict__ counters, float* __restrict__ out, int n_head_kv, int group, int head_dim,
                      int max_ctx, float scale, const float* __restrict__ sinks, int n_swa) {
    const AtNew nn{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps, sinks, n_swa};
    attn_gqa_body<false, true, true>(q, reinterpret_cast<const unsigned char*>(kc),
                                     reinterpret_cast<const unsigned char*>(vc), nullptr, nullptr, state, 0, part,
                                     counters, out, n_head_kv, group, head_dim, max_ctx, scale, nn);
}

extern "C" __global__ void __launch_bounds__(256)
attn_gqa_rope_oss_i8(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                     const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                     const float2* __restrict__ rope_cs, int n_rot, int neox, float eps, signed char* kq, float* ks,
                     signed char* vq, float* vs, const int* __restrict__ state, float* __restrict__ part,
                     int* __restrict__ counters, float* __restrict__ out, int n_head_kv, int group, int head_dim,
                     int max_ctx, float scale, const float* __restrict__ sinks, int n_swa) {
    const AtNew nn{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps, sinks, n_swa};
    attn_gqa_body<true, true, true>(q, reinterpret_cast<const unsigned char*>(kq),
                                    reinterpret_cast<const unsigned char*>(vq), ks, vs, state, 0, part, counters, out,
                                    n_head_kv, group, head_dim, max_ctx, scale, nn);
}

// norm_rope.cu's qk_rope_store for the int8 cache: the same optional q/k RMSNorm and RoPE (rotated q back into q),
// K and V quantized into kv_int8.cuh's layout at position pos0 + t (+ state[1] when pos_dev is given).
// Grid (n_head + 2 * n_head_kv, T), blockDim.x = head_dim (a multiple of 32, <= 256).
extern "C" __global__ void qk_rope_store_kv8(float* __restrict__ q, const float* __restrict__ k,
                                             const float* __restrict__ v, const float* __restrict__ q_norm,
                                             const float* __restrict__ k_norm, const float2* __restrict__ rope_cs,
                                             const int* __restrict__ pos_dev, int pos0, signed char* __restrict__ kq,
                                             float* __restrict__ ks, signed char* __restrict__ vq,
                                             float* __restrict__ vs, int n_head, int n_head_kv, int head_dim,
                                             int n_rot, int neox, float eps, int max_ctx) {
    __shared__ float buf[32];
    __shared__ float hv[256];
    const int t = blockIdx.y, hb = blockIdx.x, d = threadIdx.x;
    const int pos = pos0 + t + (pos_dev ? pos_dev[1] : 0);
    const int qw = n_head * head_dim, kw = n_head_kv * head_dim;
    if (hb >= n_head + n_head_kv) {
        const int h = hb - n_head - n_head_kv;
        kv8_store(v[(long long)t * kw + h * head_dim + d], vq, vs, (long long)h * max_ctx + pos, d, head_dim);
        return;
    }
    const bool is_q = hb < n_head;
    const int h = is_q ? hb : hb - n_head;
    const float* src = is_q ? q + (long long)t * qw + h * head_dim : k + (long long)t * kw + h * head_dim;
    const float val = norm_rope_value(src[d], is_q ? q_norm : k_norm, rope_cs, pos, d, head_dim, n_rot, neox, eps, hv,
                                      buf);
    if (is_q)
        q[(long long)t * qw + h * head_dim + d] = val;
    else
        kv8_store(val, kq, ks, (long long)h * max_ctx + pos, d, head_dim);
}
