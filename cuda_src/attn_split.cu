// Flash-decoding: the decode step's attention (and a speculative window's: n_q = 1..8 query tokens at consecutive
// positions) with the K/V sequence split into chunks across thread blocks, on tensor cores.
//
// Why (issue 34): attention.cu's attn_gqa_* give every q head of a GQA group its own warp, each warp re-reading the
// whole K and V tile from shared memory and converting every fp16 value itself: 8x the shared-memory traffic and
// conversions of the bytes it streams, so at 32K context it ran far below the HBM rate (65% of a Qwen3-30B step).
// Here the G q heads of a KV head (times n_q tokens) are the rows of one mma tile, so each K/V value is read from
// shared memory once per 8 query rows and multiplied on the tensor cores, as prefill_attn.cu does for prompts.
//
// Precision: K and V are fp16 in the cache (int8 dequantizes to fp16, as prefill_attn.cu), but q and the softmax
// weights are fp32. An m16n8k16 tile has 16 rows and a GQA group of 8 fills only 8, so each query row r sits twice in
// its tile: row r as fp16(x) ("hi") and row r + 8 as fp16(x - hi) ("lo"); hi + lo carry 22 bits of x, and the two
// accumulator rows a lane holds (g and g + 8, the fragment layout) are summed. Scores use the split q, P V the split
// weights, so the result matches fp32 math on the cached values (attention.cu's) at the cost of mma work the idle
// rows would have wasted anyway.
//
// Work split: grid (n_head_kv, max_chunks). The key range the window needs, kb .. kend - 1 (kend = P0 + n_q; kb = 0, or
// the first query's window start), is cut into n chunks of at least AS_CMIN keys (whole tiles), n <= max_chunks, on
// the device from the position P0 = pos0 + state[1] (a replayed CUDA graph serves every step): blocks past n exit at
// once. A block streams its chunk in tiles of AS_BN keys (a cp.async ring; int8: raw bytes, then each
// thread dequantizes the chunks it copied itself). Its warps are (m-tile, key slice) pairs: m-tile mt holds query rows
// 8 mt .. 8 mt + 7 (row r: token r / G, head kvh * G + r % G), and the ks warps of an m-tile take 16-key slices of
// each tile in turn, each with its own online softmax. At the chunk's end the block merges its warps in shared memory
// in a fixed order and writes either the output (one chunk) or the chunk's (m, l, unnormalised o) to the scratch;
// attn_split_reduce then merges the chunks in chunk order. Nothing depends on which block finishes first: two runs
// give the same bits.
// Causal among the window: query row r sees keys <= P0 + r / G (and, OSS with a window, > P0 + r / G - n_swa).
// OSS (gpt-oss): the layer's `rows` rows a head are a ring (position p at row p % rows) and the head's sink logit
// joins each softmax denominator. FUSE (n_q = 1, the decode step): q and this step's k arrive raw; every block norms
// and rotates its q rows, and the block holding position P0 norms and rotates k, writes K and V into the cache and
// into its own tile (whose row it loaded as zeros): a launch fewer than qk_rope_store + attend.
// Head dims are compile-time (AS_HD, the mma loops); engine/cuda/kv.py loads the build of the model's head_dim.
// tests/test_cuda_attn_split.py checks every variant against NumPy.
// @build AS_HD=64
// @build AS_HD=128
// @build AS_HD=256
#include "common.cuh"
#include "mma.cuh"

#ifndef AS_HD
#define AS_HD 128
#endif
#if AS_HD % 32 != 0 || AS_HD > 256
#error "AS_HD must be a multiple of 32 and at most 256"
#endif
#define AS_BN (AS_HD > 128 ? 32 : 64)    // keys per tile
#define AS_NST 3                          // fp16 stages: tiles t + 1 and t + 2 load while t is multiplied
// int8 raw stages: three tiles in flight (its tiles are half the bytes, and its shared memory allows one block an SM
// at head_dim 128, so one block must keep ~50 KB in flight by itself)
#define AS_NST_I8 4
#define AS_CMIN 128                       // fewest keys a chunk (two tiles load at once: no slower than one)
#define AS_MAX_CHUNKS 128
#define AS_MAX_ROWS 64                    // query rows per KV head (n_q * G): 8 m-tiles, a warp each
#define AS_MAX_WARPS 8
#define AS_LD (AS_HD + 8)                 // halves per shared row: 16-byte aligned, conflict-free ldmatrix
#define AS_TILE_B (AS_BN * AS_LD * 2)     // one fp16 K or V tile in shared memory
#define AS_STAGE_B (2 * AS_TILE_B)        // K then V
#define AS_RCH (AS_BN * AS_HD / 16)       // 16-byte int8 chunks per K or V tile
#define AS_RAW_B (2 * AS_RCH * 16 + 2 * AS_RCH * 4)    // int8 K, V, then one scale per chunk of each
#define AS_LOG2E 1.4426950408889634f

// the merge of a block's warps reuses the fp16 stages: every (key slice, row) o plus its (m, l)
static_assert(2 * AS_STAGE_B >= AS_MAX_WARPS * 8 * (AS_HD + 2) * 4, "the warp merge does not fit the stages");

// The chunks of a window at position P0: keys kb .. kend - 1 in n chunks of clen keys (the last may be shorter).
struct AsRange {
    int kb, kend, clen, n;
};
__device__ __forceinline__ AsRange as_range(int P0, int n_q, int n_swa, int max_chunks) {
    AsRange r;
    r.kb = n_swa > 0 ? max(0, P0 - n_swa + 1) : 0;
    r.kend = P0 + n_q;
    const int span = r.kend - r.kb;
    int n = min(max_chunks, max(1, (span + AS_CMIN - 1) / AS_CMIN));
    int clen = (span + n - 1) / n;
    clen = (clen + AS_BN - 1) / AS_BN * AS_BN;
    r.clen = clen;
    r.n = (span + clen - 1) / clen;
    return r;
}

// Dynamic shared memory of a block: fp16 stages, (int8) raw stages, q (hi/lo rows per m-tile), (FUSE) the new K and
// V rows and a row of scratch a warp. attn_split_shape reports it, so the host never disagrees.
__device__ __forceinline__ int as_off_raw(bool i8) { return (i8 ? 2 : AS_NST) * AS_STAGE_B; }
__device__ __forceinline__ int as_off_q(bool i8) { return as_off_raw(i8) + (i8 ? AS_NST_I8 * AS_RAW_B : 0); }
__device__ __forceinline__ int as_off_new(bool i8, int mt) { return as_off_q(i8) + mt * 16 * AS_LD * 2; }
__device__ __forceinline__ int as_smem(bool i8, bool fuse, int mt, int nw) {
    return as_off_new(i8, mt) + (fuse ? (2 + nw) * AS_HD * 4 : 0);
}

// out[0] = the dynamic shared memory of a block with mt m-tiles and nw warps, out[1] = AS_BN, out[2] = AS_CMIN,
// out[3] = AS_MAX_CHUNKS, out[4] = AS_MAX_ROWS.
extern "C" __global__ void attn_split_shape(int* out, int i8, int fuse, int mt, int nw) {
    out[0] = as_smem(i8 != 0, fuse != 0, mt, nw);
    out[1] = AS_BN;
    out[2] = AS_CMIN;
    out[3] = AS_MAX_CHUNKS;
    out[4] = AS_MAX_ROWS;
}

__device__ __forceinline__ void as_cp16(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void as_cp4(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void as_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void as_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ float as_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as fp16 hi parts (one register) and the fp16 of what hi leaves (another): a + b's 22 bits.
__device__ __forceinline__ void as_split2(float a, float b, uint32_t& hi, uint32_t& lo) {
    hi = pack_h2(a, b);
    lo = pack_h2(a - h2f((unsigned short)(hi & 0xffffu)), b - h2f((unsigned short)(hi >> 16)));
}

// Row of the cache holding position p of this head (OSS: a ring of `rows`).
template <bool OSS>
__device__ __forceinline__ long long as_row(long long head0, int p, int rows) {
    return head0 + (OSS ? p % rows : p);
}

// The fp16 tile of keys p0 .. p0 + AS_BN - 1 into the stage at st (K, then V); keys from `end` on as zeros.
template <bool OSS>
__device__ __forceinline__ void as_issue_f16(uint32_t st, const unsigned short* kc, const unsigned short* vc,
                                             long long head0, int p0, int end, int rows) {
    constexpr int CH = AS_HD / 8, N = AS_BN * CH;
    for (int w = threadIdx.x; w < N; w += blockDim.x) {
        const int r = w / CH, c = w - r * CH, p = p0 + r;
        const bool ok = p < end;
        const long long off = (ok ? as_row<OSS>(head0, p, rows) : head0) * AS_HD + 8 * c;
        const uint32_t so = (uint32_t)((r * AS_LD + 8 * c) * 2);
        as_cp16(st + so, kc + off, ok);
        as_cp16(st + AS_TILE_B + so, vc + off, ok);
    }
}

// The int8 tile into the raw stage at rs: chunk w (16 values of key w / (AS_HD / 16)) of K at rs + 16 w, V's after
// K's, then one float a chunk (its 32-value block's scale) for K and for V. The thread that copies a chunk dequantizes
// it (as_dequant: same loop), so its own wait suffices.
template <bool OSS>
__device__ __forceinline__ void as_issue_i8(uint32_t rs, const signed char* kc, const signed char* vc,
                                            const float* ksc, const float* vsc, long long head0, int p0, int end,
                                            int rows) {
    constexpr int CH = AS_HD / 16;
    for (int w = threadIdx.x; w < AS_RCH; w += blockDim.x) {
        const int r = w / CH, c = w - r * CH, p = p0 + r;
        const bool ok = p < end;
        const long long row = ok ? as_row<OSS>(head0, p, rows) : head0;
        as_cp16(rs + 16 * w, kc + row * AS_HD + 16 * c, ok);
        as_cp16(rs + 16 * (AS_RCH + w), vc + row * AS_HD + 16 * c, ok);
        const long long si = row * (AS_HD / 32) + c / 2;
        as_cp4(rs + 32 * AS_RCH + 4 * w, ksc + si, ok);
        as_cp4(rs + 36 * AS_RCH + 4 * w, vsc + si, ok);
    }
}

// 4 int8 values times s as 4 fp16 (prefill_attn.cu's fa_i8x4: exact int -> float by the bit pattern 2^23 + q + 128,
// then fp32 q * s rounded once to fp16).
__device__ __forceinline__ void as_i8x4(uint32_t w, float s, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;
    const float f0 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7540)) - 8388736.f;
    const float f1 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7541)) - 8388736.f;
    const float f2 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7542)) - 8388736.f;
    const float f3 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7543)) - 8388736.f;
    lo = pack_h2(f0 * s, f1 * s);
    hi = pack_h2(f2 * s, f3 * s);
}

__device__ __forceinline__ void as_dequant(const unsigned char* raw, unsigned char* st) {
    constexpr int CH = AS_HD / 16;
    for (int w = threadIdx.x; w < AS_RCH; w += blockDim.x) {
        const int r = w / CH, c = w - r * CH;
        const int so = (r * AS_LD + 16 * c) * 2;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
            const uint4 q = *reinterpret_cast<const uint4*>(raw + 16 * (m * AS_RCH + w));
            const float s = *reinterpret_cast<const float*>(raw + 32 * AS_RCH + 4 * (m * AS_RCH + w));
            uint4 a, b;
            as_i8x4(q.x, s, a.x, a.y);
            as_i8x4(q.y, s, a.z, a.w);
            as_i8x4(q.z, s, b.x, b.y);
            as_i8x4(q.w, s, b.z, b.w);
            unsigned char* d = st + m * AS_TILE_B + so;
            *reinterpret_cast<uint4*>(d) = a;
            *reinterpret_cast<uint4*>(d + 16) = b;
        }
    }
}

// This step's raw k / v rows and what qk_rope_store takes (FUSE).
struct AsNew {
    const float* k;
    const float* v;
    const float* q_norm;
    const float* k_norm;
    const float2* cs;
    int n_rot, neox;
    float eps;
};

// By one warp: dst[0 .. AS_HD) (shared memory) = rope(rmsnorm(src) * w) at position pos, times mul (attention.cu's
// at_rope_row; lane holds d = lane + 32 i).
__device__ __forceinline__ void as_rope_row(float* dst, const float* src, const float* w, const AsNew& nn, int pos,
                                            float mul, int lane) {
    constexpr int DPL = AS_HD / 32;
    float x[DPL];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        x[i] = src[lane + 32 * i];
        ss += x[i] * x[i];
    }
    if (w) {
        const float r = rsqrtf(warp_sum(ss) / AS_HD + nn.eps);
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] = x[i] * r * w[lane + 32 * i];
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) dst[lane + 32 * i] = x[i];
    __syncwarp();
    const int half = nn.n_rot / 2;
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
        const int d = lane + 32 * i;
        if (d < nn.n_rot) {
            int j, partner;
            float sign;
            rope_pair(d, half, nn.neox, j, partner, sign);
            const float2 c = nn.cs[(long long)pos * half + j];
            x[i] = x[i] * c.x + sign * dst[partner] * c.y;
        }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < DPL; ++i) dst[lane + 32 * i] = x[i] * mul;
    __syncwarp();
}

// By one warp: row x (AS_HD floats, shared memory) as the cache holds it. cache: write it at row `row` of the cache
// (fp16, or int8 with its scales: kv_int8.cuh's rounding); tile: write the fp16 value the tile loader would have
// produced from that cache row into the shared tile row at tile (either may be null).
template <bool I8>
__device__ __forceinline__ void as_put_row(const float* x, unsigned char* cache, float* sc, long long row,
                                           unsigned short* tile, int lane) {
#pragma unroll
    for (int i = 0; i < AS_HD / 32; ++i) {
        const int d = lane + 32 * i;
        const float val = x[d];
        if (I8) {
            const float s = warp_max(fabsf(val)) / 127.f;
            const int qv = __float2int_rn(s > 0.f ? val / s : 0.f);
            if (cache) {
                reinterpret_cast<signed char*>(cache)[row * AS_HD + d] = (signed char)qv;
                if (lane == 0) sc[row * (AS_HD / 32) + i] = s;
            }
            if (tile) tile[d] = f2h((float)qv * s);
        } else {
            const unsigned short h = f2h(val);
            if (cache) reinterpret_cast<unsigned short*>(cache)[row * AS_HD + d] = h;
            if (tile) tile[d] = h;
        }
    }
}

constexpr int AS_NO = AS_HD / 8;       // 8-column output tiles a row
constexpr int AS_KS = AS_HD / 16;      // 16-dim k-steps of q . k

// One warp, 16 keys (k0 .. k0 + 15, at shared address kt for K and kt + AS_TILE_B for V): S = q K^T with q's hi/lo
// rows, the mask, the online softmax (m, l of this lane's row), o = o * c + P V with P's hi/lo rows.
// Visible: key < kend_c (the chunk's end), key <= lim, key >= lo.
__device__ __forceinline__ void as_keys16(float (&o)[AS_NO][4], float& m, float& l, uint32_t qa, uint32_t kt,
                                          uint32_t k_lane, uint32_t v_lane, int k0, int kend_c, int lim, int lo) {
    const int t4 = threadIdx.x & 3;
    float s[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < AS_KS; ++kk) {
        uint32_t a[4], b0, b1, b2, b3;
        ldsm_x4(qa + (uint32_t)(16 * kk * 2), a[0], a[1], a[2], a[3]);
        ldsm_x4(kt + k_lane + (uint32_t)(16 * kk * 2), b0, b1, b2, b3);
        mma_16816(s[0], a, b0, b1);
        mma_16816(s[1], a, b2, b3);
    }
    float x[2][2];
    float mx = NEG_INF;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int key = k0 + 8 * n + 2 * t4 + e;
            const float v = s[n][e] + s[n][e + 2];         // hi row g + lo row g + 8
            x[n][e] = key < kend_c && key <= lim && key >= lo ? v : NEG_INF;
            mx = fmaxf(mx, x[n][e]);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mn = fmaxf(m, mx);
    const float rf = mn == NEG_INF ? 0.f : mn;               // nothing visible yet: weights 0, no -inf - -inf
    const float c = as_exp2(m - rf);                          // 0 while m is -inf
    m = mn;
    float p[2][2];
    float ps = 0.f;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            p[n][e] = as_exp2(x[n][e] - rf);
            ps += p[n][e];
        }
    l = l * c + ps;
#pragma unroll
    for (int j = 0; j < AS_NO; ++j) {
        o[j][0] *= c;
        o[j][1] *= c;
        o[j][2] *= c;
        o[j][3] *= c;
    }
    // P as the A fragment of keys k0 .. k0 + 15: row g the weights' hi parts, row g + 8 their lo parts
    uint32_t pa[4];
    as_split2(p[0][0], p[0][1], pa[0], pa[1]);
    as_split2(p[1][0], p[1][1], pa[2], pa[3]);
#pragma unroll
    for (int jj = 0; jj < AS_HD / 16; ++jj) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(kt + AS_TILE_B + v_lane + (uint32_t)(16 * jj * 2), b0, b1, b2, b3);
        mma_16816(o[2 * jj], pa, b0, b1);
        mma_16816(o[2 * jj + 1], pa, b2, b3);
    }
}

// The split kernel's body (see the top). q: (n_q, n_head * AS_HD) fp32 (FUSE: raw, n_q = 1); out likewise. part_o:
// (chunk, kvh, row, AS_HD) floats, part_ml: (chunk, kvh, row, {m, l}) with m in log2 units; rows = n_q * G.
// blockDim = 32 * mt * ks, mt = ceil(n_q * G / 8).
template <bool I8, bool OSS, bool FUSE>
__device__ __forceinline__ void as_body(const float* __restrict__ q, const void* kc, const void* vc,
                                        const float* ksc, const float* vsc, const int* __restrict__ state, int pos0,
                                        int n_q, float* __restrict__ part_o, float* __restrict__ part_ml,
                                        float* __restrict__ out, int n_head_kv, int G, int rows, float scale,
                                        int max_chunks, int ks, const float* __restrict__ sinks, int n_swa,
                                        const AsNew nn) {
    extern __shared__ __align__(16) unsigned char as_sm[];
    const int kvh = blockIdx.x, chunk = blockIdx.y;
    const int P0 = pos0 + (state ? state[1] : 0);
    const int swa = OSS ? n_swa : 0;
    const AsRange rg = as_range(P0, n_q, swa, max_chunks);
    if (chunk >= rg.n) return;                                // block-uniform; attn_split_reduce counts alike
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
    const int R = n_q * G, MT = (R + 7) / 8, n_head = n_head_kv * G;
    const int mt = warp / ks, kq = warp - mt * ks;
    const int c0 = rg.kb + chunk * rg.clen, c1 = min(rg.kend, c0 + rg.clen);
    const bool holds_new = FUSE && chunk == rg.n - 1;         // FUSE: n_q = 1, the last key P0 is the new one
    const int load_end = FUSE ? min(c1, P0) : c1;             // the new row is not in the cache yet: zeros
    const int n_tiles = (c1 - c0 + AS_BN - 1) / AS_BN;
    const long long head0 = (long long)kvh * rows;
    const uint32_t sm0 = smem_u32(as_sm);
    const int raw0 = as_off_raw(I8), q0 = as_off_q(I8), x0 = as_off_new(I8, MT);
    constexpr int NST = I8 ? AS_NST_I8 : AS_NST;              // ring stages (int8: raw ones)

    auto issue = [&](int stage, int p) {
        if (I8)
            as_issue_i8<OSS>(sm0 + raw0 + stage * AS_RAW_B, (const signed char*)kc, (const signed char*)vc, ksc, vsc,
                             head0, p, load_end, rows);
        else
            as_issue_f16<OSS>(sm0 + stage * AS_STAGE_B, (const unsigned short*)kc, (const unsigned short*)vc, head0,
                              p, load_end, rows);
    };
#pragma unroll
    for (int t = 0; t < NST - 1; ++t) {                       // one commit group a tile, empty past the chunk
        if (t < n_tiles) issue(t, c0 + t * AS_BN);
        as_commit();
    }

    // q rows as hi/lo fp16 into shared memory, scaled by scale * log2(e) (exp2 below); rows past R repeat row R - 1
    const float qs = scale * AS_LOG2E;
    unsigned short* qsm = reinterpret_cast<unsigned short*>(as_sm + q0);
    auto put_q = [&](int i, int d, float val) {             // padded row i (m-tile i / 8), dim d
        const unsigned short hi = f2h(val);
        const int base = (i >> 3) * 16 * AS_LD + (i & 7) * AS_LD + d;
        qsm[base] = hi;
        qsm[base + 8 * AS_LD] = f2h(val - h2f(hi));
    };
    float* knew = reinterpret_cast<float*>(as_sm + x0);
    float* vnew = knew + AS_HD;
    if (FUSE) {
        const int nw = blockDim.x >> 5;
        float* scratch = vnew + AS_HD + warp * AS_HD;
        for (int i = warp; i < 8 * MT; i += nw) {
            const int r = min(i, R - 1);
            as_rope_row(scratch, q + (long long)(kvh * G + r) * AS_HD, nn.q_norm, nn, P0, qs, lane);
            for (int d = lane; d < AS_HD; d += 32) put_q(i, d, scratch[d]);
            __syncwarp();
        }
        if (holds_new && warp == 0) {
            as_rope_row(knew, nn.k + (long long)kvh * AS_HD, nn.k_norm, nn, P0, 1.f, lane);
            for (int d = lane; d < AS_HD; d += 32) vnew[d] = nn.v[(long long)kvh * AS_HD + d];
            __syncwarp();
            const long long row = as_row<OSS>(head0, P0, rows);
            as_put_row<I8>(knew, (unsigned char*)kc, const_cast<float*>(ksc), row, nullptr, lane);
            as_put_row<I8>(vnew, (unsigned char*)vc, const_cast<float*>(vsc), row, nullptr, lane);
        }
    } else {
        for (int idx = threadIdx.x; idx < 8 * MT * AS_HD; idx += blockDim.x) {
            const int i = idx / AS_HD, d = idx - i * AS_HD, r = min(i, R - 1);
            put_q(i, d, q[(long long)(r / G) * n_head * AS_HD + (long long)(kvh * G + r % G) * AS_HD + d] * qs);
        }
    }

    // this lane's query row (g of m-tile mt) and its visible keys
    const int my_r = min(8 * mt + g, R - 1);
    const int lim = P0 + my_r / G;
    const int lo = swa > 0 ? lim - swa + 1 : 0;
    // ldmatrix row addresses (prefill_attn.cu's): K plain, V transposed, q as A (the same offsets as V's)
    const uint32_t k_lane = (uint32_t)((((lane & 7) + (lane >> 4) * 8) * AS_LD + ((lane >> 3) & 1) * 8) * 2);
    const uint32_t v_lane = (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * AS_LD + (lane >> 4) * 8) * 2);
    const uint32_t qa = sm0 + (uint32_t)q0 + (uint32_t)(mt * 16 * AS_LD * 2) + v_lane;

    float o[AS_NO][4];
#pragma unroll
    for (int j = 0; j < AS_NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m = NEG_INF, l = 0.f;
    for (int t = 0; t < n_tiles; ++t) {
        const int p = c0 + t * AS_BN;
        int cur;
        if (!I8) {
            as_wait<NST - 2>();                               // this thread's part of tile t is in
            __syncthreads();                                  // everyone's; everyone is done with tile t - 1
            if (t + NST - 1 < n_tiles) issue((t + NST - 1) % NST, p + (NST - 1) * AS_BN);
            as_commit();
            cur = t % NST;
        } else {
            // this thread's raw chunks of tile t into fp16 stage t % 2, which tile t - 2 used: every warp finished
            // that before the previous barrier
            as_wait<NST - 2>();
            as_dequant(as_sm + raw0 + (t % NST) * AS_RAW_B, as_sm + (t & 1) * AS_STAGE_B);
            __syncthreads();
            if (t + NST - 1 < n_tiles) issue((t + NST - 1) % NST, p + (NST - 1) * AS_BN);
            as_commit();
            cur = t & 1;
        }
        if (FUSE && holds_new && P0 >= p && P0 < p + AS_BN) {   // block-uniform: the new row into the tile
            if (warp == 0) {
                unsigned short* ts = reinterpret_cast<unsigned short*>(as_sm + cur * AS_STAGE_B);
                as_put_row<I8>(knew, nullptr, nullptr, 0, ts + (P0 - p) * AS_LD, lane);
                as_put_row<I8>(vnew, nullptr, nullptr, 0, ts + AS_TILE_B / 2 + (P0 - p) * AS_LD, lane);
            }
            __syncthreads();
        }
        const uint32_t st = sm0 + (uint32_t)(cur * AS_STAGE_B);
        for (int sub = kq; sub < AS_BN / 16; sub += ks) {
            const int k0 = p + 16 * sub;
            if (k0 >= c1) break;                              // warp-uniform: the chunk's tail tile
            as_keys16(o, m, l, qa, st + (uint32_t)(16 * sub * AS_LD * 2), k_lane, v_lane, k0, c1, lim, lo);
        }
    }
    as_wait<0>();
    __syncthreads();                                          // the stages are free: the warps' merge

    // every (key slice kq, padded row i): o at mo + (kq * 8 MT + i) * AS_HD, (m, l) at mml + 2 (kq * 8 MT + i)
    float* mo = reinterpret_cast<float*>(as_sm);
    float* mml = mo + ks * 8 * MT * AS_HD;
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    {
        const int t4 = lane & 3, slot = kq * 8 * MT + 8 * mt + g;
        float* dst = mo + (long long)slot * AS_HD + 2 * t4;
#pragma unroll
        for (int j = 0; j < AS_NO; ++j)
            *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(o[j][0] + o[j][2], o[j][1] + o[j][3]);
        if (t4 == 0) {
            mml[2 * slot] = m;
            mml[2 * slot + 1] = l;
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < R * AS_HD; idx += blockDim.x) {
        const int i = idx / AS_HD, d = idx - i * AS_HD;
        float M = NEG_INF;
        for (int k = 0; k < ks; ++k) M = fmaxf(M, mml[2 * (k * 8 * MT + i)]);
        float L = 0.f, O = 0.f;
        for (int k = 0; k < ks; ++k) {                        // fixed order
            const float mk = mml[2 * (k * 8 * MT + i)];
            const float w = mk == NEG_INF ? 0.f : as_exp2(mk - M);
            L += w * mml[2 * (k * 8 * MT + i) + 1];
            O += w * mo[(long long)(k * 8 * MT + i) * AS_HD + d];
        }
        const int h = kvh * G + i % G;
        if (rg.n == 1) {
            if (OSS && sinks) L += as_exp2(sinks[h] * AS_LOG2E - M);
            out[(long long)(i / G) * n_head * AS_HD + (long long)h * AS_HD + d] = O / L;
        } else {
            const long long slot = ((long long)chunk * n_head_kv + kvh) * R + i;
            part_o[slot * AS_HD + d] = O;
            if (d == 0) {
                part_ml[2 * slot] = M;
                part_ml[2 * slot + 1] = L;
            }
        }
    }
}

#define AS_ARGS                                                                                                      \
    const float *__restrict__ q, void *kc, void *vc, float *ksc, float *vsc, const int *__restrict__ state,           \
        int pos0, int n_q, float *__restrict__ part_o, float *__restrict__ part_ml, float *__restrict__ out,          \
        int n_head_kv, int group, int rows, float scale, int max_chunks, int ks, const float *__restrict__ sinks,    \
        int n_swa
#define AS_PASS q, kc, vc, ksc, vsc, state, pos0, n_q, part_o, part_ml, out, n_head_kv, group, rows, scale, max_chunks, \
                ks, sinks, n_swa
#define AS_NEW_ARGS                                                                                                  \
    const float *__restrict__ k, const float *__restrict__ v, const float *__restrict__ q_norm,                      \
        const float *__restrict__ k_norm, const float2 *__restrict__ rope_cs, int n_rot, int neox, float eps

// Every variant takes the same arguments (engine/cuda/kv.py DecodeAttention launches them alike): ksc / vsc null for
// fp16 caches, sinks null and n_swa 0 outside gpt-oss; the _rope (FUSE) ones then this step's raw k, v and the
// norm / RoPE arguments (n_q = 1). rows: the layer's rows a head (max_ctx, or a window layer's ring).
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_f16(AS_ARGS) {
    as_body<false, false, false>(AS_PASS, AsNew{});
}
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_i8(AS_ARGS) {
    as_body<true, false, false>(AS_PASS, AsNew{});
}
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_oss_f16(AS_ARGS) {
    as_body<false, true, false>(AS_PASS, AsNew{});
}
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_oss_i8(AS_ARGS) {
    as_body<true, true, false>(AS_PASS, AsNew{});
}
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_rope_f16(AS_ARGS, AS_NEW_ARGS) {
    as_body<false, false, true>(AS_PASS, AsNew{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps});
}
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_rope_i8(AS_ARGS, AS_NEW_ARGS) {
    as_body<true, false, true>(AS_PASS, AsNew{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps});
}
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_rope_oss_f16(AS_ARGS, AS_NEW_ARGS) {
    as_body<false, true, true>(AS_PASS, AsNew{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps});
}
extern "C" __global__ void __launch_bounds__(32 * AS_MAX_WARPS) attn_split_rope_oss_i8(AS_ARGS, AS_NEW_ARGS) {
    as_body<true, true, true>(AS_PASS, AsNew{k, v, q_norm, k_norm, rope_cs, n_rot, neox, eps});
}

// The chunks' merge, in chunk order: grid (n_q * G, n_head_kv), AS_RED_THREADS threads; exits at once when the
// window needed one chunk (the split kernel wrote out itself). Warp w takes chunks w, w + AS_RED_WARPS, .. (four
// loads in flight a lane), the warps' sums then add in warp order: the same bits whatever the scheduling.
#define AS_RED_WARPS 16
extern "C" __global__ void __launch_bounds__(32 * AS_RED_WARPS)
attn_split_reduce(const float* __restrict__ part_o, const float* __restrict__ part_ml, const int* __restrict__ state,
                  int pos0, int n_q, int max_chunks, float* __restrict__ out, int n_head_kv, int group,
                  const float* __restrict__ sinks, int n_swa) {
    constexpr int DPL = AS_HD / 32;
    __shared__ float s_o[AS_RED_WARPS][AS_HD];
    __shared__ float s_l[AS_RED_WARPS];
    const int r = blockIdx.x, kvh = blockIdx.y, R = n_q * group;
    const int P0 = pos0 + (state ? state[1] : 0);
    const AsRange rg = as_range(P0, n_q, n_swa, max_chunks);
    if (rg.n == 1) return;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n = rg.n;
    auto slot = [&](int c) { return ((long long)c * n_head_kv + kvh) * R + r; };
    float M = NEG_INF;
    for (int c = lane; c < n; c += 32) M = fmaxf(M, part_ml[2 * slot(c)]);
    M = warp_max(M);                       // finite: chunk 0 holds a visible key of every row (chunks >= 64 keys)
    float acc[DPL], L = 0.f;
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = 0.f;
    for (int c = warp; c < n; c += 4 * AS_RED_WARPS) {
        float v[4][DPL], w[4], lc[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int cu = c + u * AS_RED_WARPS;
            const bool ok = cu < n;
            const long long sl = slot(ok ? cu : c);
            const float mc = part_ml[2 * sl];
            w[u] = ok && mc != NEG_INF ? as_exp2(mc - M) : 0.f;
            lc[u] = part_ml[2 * sl + 1];
#pragma unroll
            for (int i = 0; i < DPL; ++i) v[u][i] = part_o[sl * AS_HD + lane + 32 * i];
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            L += w[u] * lc[u];
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[i] += w[u] * v[u][i];
        }
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) s_o[warp][lane + 32 * i] = acc[i];
    if (lane == 0) s_l[warp] = L;
    __syncthreads();
    const int h = kvh * group + r % group;
    for (int d = threadIdx.x; d < AS_HD; d += blockDim.x) {
        float O = 0.f, LL = 0.f;
        for (int w = 0; w < AS_RED_WARPS; ++w) {
            O += s_o[w][d];
            LL += s_l[w];
        }
        if (sinks) LL += as_exp2(sinks[h] * AS_LOG2E - M);
        out[(long long)(r / group) * n_head_kv * group * AS_HD + (long long)h * AS_HD + d] = O / LL;
    }
}
