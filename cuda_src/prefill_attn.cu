// Prompt attention for the streamed prompt pass: causal, GQA, tiled with an online softmax (flash-attention style),
// so a 32K prompt never materialises its score matrix. Keys and values are read from the KV cache, which the chunk's
// own K/V were written into first (engine/cuda/kv.py KVCache.store: qk_rope_store for fp16, attention.cu's
// qk_rope_store_kv8 for int8), so a chunk attends to every earlier chunk and to itself alike.
// KV formats: fp16 (n_head_kv, max_ctx, head_dim) per layer, as the decode step reads it; int8 the same shape with
// one fp32 scale per 32 values (n_head_kv, max_ctx, head_dim / 32), half the bytes (cuda_src/kv_int8.cuh).
//
// On tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulators), as FlashAttention-2: a block holds FA_BM = 128
// query rows (8 warps x 16) of one KV head and walks the keys in tiles of FA_BN; per tile each warp computes S = Q K^T
// into registers, masks (only on the tiles that cross its rows' diagonal), updates its running max and sum, rescales
// its output, and multiplies P (the same registers, repacked as fp16) by V. Row r of the T * G rows of a KV head is
// token r / G, head kvh * G + r % G, so the G query heads that share a KV head read each K/V tile once, and 8 warps
// share each tile that the block brings in (the first version had 4: twice the L2 reads per query row).
// Loads overlap the tensor cores: fp16 tiles come global -> shared by 16-byte cp.async into a ring of FA_STAGES (3),
// the next two loading while this one is multiplied; int8 tiles come raw by cp.async two tiles ahead, and each
// thread dequantizes the chunks it copied itself (its own cp.async data needs no barrier) into the other of two fp16
// stages after its warp's multiplies, so one __syncthreads per tile orders everything. Fragments come from shared
// memory by ldmatrix (K plain, V transposed).
// A/B builds (bench.prefill_attn --define): FA_WARPS, FA_MT (2: 32 rows a warp), FA_STAGES, FA_BN, FA_MINB.
// Head dims are compile-time (FA_HD, default 128; the pass loads the module with the model's head_dim).
// The launch shape (rows per block, threads, dynamic shared memory per KV format) comes from the module itself
// (flash_attn_shape, read by engine/cuda/prefill.py attn_kernel), so a launch cannot disagree with the build.
// tests/test_cuda_prefill_kernels.py checks it against NumPy.
#include "common.cuh"
#include "mma.cuh"

#ifndef FA_HD
#define FA_HD 128
#endif
#if FA_HD % 16 != 0 || FA_HD > 256
#error "FA_HD must be a multiple of 16 and at most 256"
#endif
#ifndef FA_WARPS
#define FA_WARPS 8
#endif
#ifndef FA_MINB
#define FA_MINB 1                        // blocks per SM the registers must allow (__launch_bounds__), for A/B builds
#endif
#ifndef FA_MT
#define FA_MT 1                          // 16-row m-tiles per warp: 2 reads each K/V fragment once for 32 rows
#endif
#if FA_MT < 1 || FA_MT > 2 || FA_MT * FA_HD > 256
#error "FA_MT is 1, or 2 up to head_dim 128 (two m-tiles' outputs at hd 256 alone would take 256 registers)"
#endif
#ifndef FA_STAGES
#define FA_STAGES 3                      // fp16 K/V stages: tiles j+1 and j+2 load while j is multiplied
#endif
#if FA_STAGES < 2
#error "FA_STAGES is at least 2"
#endif
#define FA_THREADS (32 * FA_WARPS)
#define FA_BM (16 * FA_MT * FA_WARPS)    // query rows per block
#ifndef FA_BN                            // keys per tile (hd 256, 64 keys: 285 KB of shared memory for int8)
#define FA_BN (FA_HD * FA_MT > 128 ? 32 : 64)
#endif
#if FA_BN % 16 != 0
#error "FA_BN must be a multiple of 16 (P V takes keys 16 at a time)"
#endif
// Q's A fragments stay in registers up to 128 values a row (hd x m-tiles); at hd 256 they would take 64 of the 255
// registers next to the output's 128 (ptxas spills), so each warp parks its rows in shared memory and reads them
// back by ldmatrix
#define FA_QSM (FA_HD * FA_MT > 128)
#define FA_LD (FA_HD + 8)                // halves per shared row: 16-byte aligned rows, conflict-free ldmatrix
#define FA_TILE_B (FA_BN * FA_LD * 2)    // bytes of one fp16 K or V tile in shared memory
#define FA_STAGE_B (2 * FA_TILE_B)       // K then V
#define FA_RCH (FA_BN * FA_HD / 16)      // 16-byte int8 chunks per K or V tile
#define FA_RAW_B (2 * FA_RCH * 16 + 2 * FA_RCH * 4)    // int8 K, V, then one scale per chunk of each
#define FA_Q_B (FA_QSM ? FA_BM * FA_LD * 2 : 0)      // Q in shared memory (FA_QSM)
#define FA_SMEM_F16 (FA_STAGES * FA_STAGE_B + FA_Q_B)
#define FA_SMEM_I8 (2 * FA_STAGE_B + FA_Q_B + 2 * FA_RAW_B)

// This build's launch shape: rows per block, threads per block, dynamic shared memory of flash_attn_f16 and of
// flash_attn_i8 (a kernel, not a __constant__: nvcc makes an unused constant module-local, not found by name)
extern "C" __global__ void flash_attn_shape(int* out) {
    out[0] = FA_BM;
    out[1] = FA_THREADS;
    out[2] = FA_SMEM_F16;
    out[3] = FA_SMEM_I8;
}

// 16 (or 4) bytes global -> shared without a register round trip; zeros when !ok (keys from `end` on: never NaN from
// unwritten cache, which a zero softmax weight would not cancel). src must be a valid address either way.
__device__ __forceinline__ void fa_cp16(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void fa_cp4(uint32_t dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void fa_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fa_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The fp16 tile of FA_BN keys and values from position p0 into the stage at shared address st (K, then V).
// ring > 0 (gpt-oss): the head holds `ring` rows, position p at row p % ring.
__device__ __forceinline__ void fa_issue_f16(uint32_t st, const unsigned short* kc, const unsigned short* vc,
                                             long long head_base, int p0, int end, int ring = 0) {
    constexpr int CH = FA_HD / 8, N = FA_BN * CH;
#pragma unroll
    for (int i = 0; i < (N + FA_THREADS - 1) / FA_THREADS; ++i) {
        const int w = threadIdx.x + i * FA_THREADS;
        if (N % FA_THREADS == 0 || w < N) {
            const int r = w / CH, c = w % CH, p = p0 + r;
            const bool ok = p < end;
            const long long off = (head_base + (ok ? (ring ? p % ring : p) : 0)) * FA_HD + 8 * c;
            const uint32_t so = (uint32_t)((r * FA_LD + 8 * c) * 2);
            fa_cp16(st + so, kc + off, ok);
            fa_cp16(st + FA_TILE_B + so, vc + off, ok);
        }
    }
}

// The int8 tile from p0 into the raw stage at shared address rs: chunk w (16 values of row w / (FA_HD / 16)) of K at
// rs + 16 w, of V after K's, and the chunk's scale (of its 32-value block) at one float per chunk after those.
__device__ __forceinline__ void fa_issue_i8(uint32_t rs, const signed char* kc, const signed char* vc,
                                            const float* ksc, const float* vsc, long long head_base, int p0, int end,
                                            int ring = 0) {
    constexpr int CH = FA_HD / 16;
#pragma unroll
    for (int i = 0; i < (FA_RCH + FA_THREADS - 1) / FA_THREADS; ++i) {
        const int w = threadIdx.x + i * FA_THREADS;
        if (FA_RCH % FA_THREADS == 0 || w < FA_RCH) {
            const int r = w / CH, c = w % CH, p = p0 + r;
            const bool ok = p < end;
            const long long row = head_base + (ok ? (ring ? p % ring : p) : 0);
            fa_cp16(rs + 16 * w, kc + row * FA_HD + 16 * c, ok);
            fa_cp16(rs + 16 * (FA_RCH + w), vc + row * FA_HD + 16 * c, ok);
            const long long si = row * (FA_HD / 32) + c / 2;
            fa_cp4(rs + 32 * FA_RCH + 4 * w, ksc + si, ok);
            fa_cp4(rs + 36 * FA_RCH + 4 * w, vsc + si, ok);
        }
    }
}

// 4 int8 values times s as 4 fp16 (2 registers). Exact int -> float through the float bit pattern 2^23 + (q + 128)
// (a byte permute and a subtract instead of the slow conversion unit), then rounded once, as fp32 q * s to fp16.
__device__ __forceinline__ void fa_i8x4(uint32_t w, float s, uint32_t& lo, uint32_t& hi) {
    const uint32_t u = w ^ 0x80808080u;
    const float f0 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7540)) - 8388736.f;
    const float f1 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7541)) - 8388736.f;
    const float f2 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7542)) - 8388736.f;
    const float f3 = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7543)) - 8388736.f;
    lo = pack_h2(f0 * s, f1 * s);
    hi = pack_h2(f2 * s, f3 * s);
}

// The chunks this thread copied into the raw stage at raw (after its own wait: no barrier needed) as fp16 into the
// stage at st.
__device__ __forceinline__ void fa_dequant(const unsigned char* raw, unsigned char* st) {
    constexpr int CH = FA_HD / 16;
#pragma unroll
    for (int i = 0; i < (FA_RCH + FA_THREADS - 1) / FA_THREADS; ++i) {
        const int w = threadIdx.x + i * FA_THREADS;
        if (FA_RCH % FA_THREADS == 0 || w < FA_RCH) {
            const int r = w / CH, c = w % CH;
            const uint32_t so = (uint32_t)((r * FA_LD + 16 * c) * 2);
#pragma unroll
            for (int m = 0; m < 2; ++m) {       // K, then V
                const uint4 q = *reinterpret_cast<const uint4*>(raw + 16 * (m * FA_RCH + w));
                const float s = *reinterpret_cast<const float*>(raw + 32 * FA_RCH + 4 * (m * FA_RCH + w));
                uint4 a, b;
                fa_i8x4(q.x, s, a.x, a.y);
                fa_i8x4(q.y, s, a.z, a.w);
                fa_i8x4(q.z, s, b.x, b.y);
                fa_i8x4(q.w, s, b.z, b.w);
                unsigned char* d = st + m * FA_TILE_B + so;
                *reinterpret_cast<uint4*>(d) = a;
                *reinterpret_cast<uint4*>(d + 16) = b;
            }
        }
    }
}

constexpr int FA_KS = FA_HD / 16, FA_NS = FA_BN / 8, FA_NO = FA_HD / 8, FA_QR = FA_QSM ? 1 : FA_KS;

// 2^x, flushing results below 2^-126 to zero (softmax weights that small add nothing to an fp32 sum of ones)
__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// One warp's rows against the tile in the stage at st: S = Q K^T, causal mask when `diag` (keys past lim), online
// softmax, O += P V. Per m-tile mt the lane holds rows g and g + 8: state index 2 mt and 2 mt + 1 (m, l, lim).
// k_lane, v_lane: this lane's ldmatrix row offsets (bytes) within a tile; Q's fragments: qa, or (FA_QSM) by ldmatrix
// at q_lane (+ 16 rows per m-tile).
// WIN (gpt-oss): keys at or below lim - swa are masked too, and a row may see no key of a tile before its first
// visible one (its max stays -inf: the exponents are then taken against 0).
template <bool WIN = false>
__device__ __forceinline__ void fa_tile(float (&o)[FA_MT][FA_NO][4], float (&m)[2 * FA_MT], float (&l)[2 * FA_MT],
                                        const uint32_t (&qa)[FA_MT][FA_QR][4], uint32_t q_lane, uint32_t st,
                                        uint32_t k_lane, uint32_t v_lane, int p0, bool diag,
                                        const int (&lim)[2 * FA_MT], int swa = 0) {
    const int t4 = threadIdx.x & 3;
    float s[FA_MT][FA_NS][4];
#pragma unroll
    for (int mt = 0; mt < FA_MT; ++mt)
#pragma unroll
        for (int n = 0; n < FA_NS; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < FA_KS; ++kk) {
        uint32_t a[FA_MT][4];
#pragma unroll
        for (int mt = 0; mt < FA_MT; ++mt) {
            if (FA_QSM) {
                ldsm_x4(q_lane + (uint32_t)((16 * mt * FA_LD + 16 * kk) * 2), a[mt][0], a[mt][1], a[mt][2],
                           a[mt][3]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mt][i] = qa[mt][FA_QSM ? 0 : kk][i];
            }
        }
#pragma unroll
        for (int np = 0; np < FA_NS / 2; ++np) {
            // keys 16 np .. +7 and +8 .. +15 (rows of K), dims 16 kk .. +7 and +8 .. +15: the B fragments of
            // n-tiles 2 np and 2 np + 1, for every m-tile
            uint32_t b0, b1, b2, b3;
            ldsm_x4(st + k_lane + (uint32_t)((16 * np * FA_LD + 16 * kk) * 2), b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < FA_MT; ++mt) {
                mma_16816(s[mt][2 * np], a[mt], b0, b1);
                mma_16816(s[mt][2 * np + 1], a[mt], b2, b3);
            }
        }
    }
#pragma unroll
    for (int mt = 0; mt < FA_MT; ++mt) {
        const int ia = 2 * mt, ib = ia + 1;
        if (diag) {
#pragma unroll
            for (int n = 0; n < FA_NS; ++n) {
                const int key = p0 + 8 * n + 2 * t4;
                if (key > lim[ia]) s[mt][n][0] = NEG_INF;
                if (key + 1 > lim[ia]) s[mt][n][1] = NEG_INF;
                if (key > lim[ib]) s[mt][n][2] = NEG_INF;
                if (key + 1 > lim[ib]) s[mt][n][3] = NEG_INF;
                if (WIN && swa > 0) {
                    if (key <= lim[ia] - swa) s[mt][n][0] = NEG_INF;
                    if (key + 1 <= lim[ia] - swa) s[mt][n][1] = NEG_INF;
                    if (key <= lim[ib] - swa) s[mt][n][2] = NEG_INF;
                    if (key + 1 <= lim[ib] - swa) s[mt][n][3] = NEG_INF;
                }
            }
        }
        float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
        for (int n = 0; n < FA_NS; ++n) {
            mx_a = fmaxf(mx_a, fmaxf(s[mt][n][0], s[mt][n][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[mt][n][2], s[mt][n][3]));
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        // key 0 is in every row's first tile, so the running max is finite from the first tile on (a row with no
        // visible key in a later diagonal tile keeps its max: c = 1, weights 0)
        const float mn_a = fmaxf(m[ia], mx_a), mn_b = fmaxf(m[ib], mx_b);
        // WIN: nothing visible yet keeps the max at -inf; exponents against 0 then (weights 0, no -inf - -inf NaN)
        const float rf_a = WIN && mn_a == NEG_INF ? 0.f : mn_a, rf_b = WIN && mn_b == NEG_INF ? 0.f : mn_b;
        const float c_a = fa_exp2(m[ia] - rf_a), c_b = fa_exp2(m[ib] - rf_b);   // exp2(-inf) = 0 on the first tile
        m[ia] = mn_a;
        m[ib] = mn_b;
        l[ia] *= c_a;
        l[ib] *= c_b;
#pragma unroll
        for (int j = 0; j < FA_NO; ++j) {
            o[mt][j][0] *= c_a;
            o[mt][j][1] *= c_a;
            o[mt][j][2] *= c_b;
            o[mt][j][3] *= c_b;
        }
#pragma unroll
        for (int n = 0; n < FA_NS; ++n) {
            s[mt][n][0] = fa_exp2(s[mt][n][0] - rf_a);
            s[mt][n][1] = fa_exp2(s[mt][n][1] - rf_a);
            s[mt][n][2] = fa_exp2(s[mt][n][2] - rf_b);
            s[mt][n][3] = fa_exp2(s[mt][n][3] - rf_b);
            l[ia] += s[mt][n][0] + s[mt][n][1];
            l[ib] += s[mt][n][2] + s[mt][n][3];
        }
    }
    // O += P V: P's accumulator layout is the A fragment layout of keys 16c .. 16c+15
#pragma unroll
    for (int c = 0; c < FA_BN / 16; ++c) {
        uint32_t pa[FA_MT][4];
#pragma unroll
        for (int mt = 0; mt < FA_MT; ++mt) {
            pa[mt][0] = pack_h2(s[mt][2 * c][0], s[mt][2 * c][1]);
            pa[mt][1] = pack_h2(s[mt][2 * c][2], s[mt][2 * c][3]);
            pa[mt][2] = pack_h2(s[mt][2 * c + 1][0], s[mt][2 * c + 1][1]);
            pa[mt][3] = pack_h2(s[mt][2 * c + 1][2], s[mt][2 * c + 1][3]);
        }
#pragma unroll
        for (int jj = 0; jj < FA_HD / 16; ++jj) {
            uint32_t b0, b1, b2, b3;
            ldsm_x4_t(st + FA_TILE_B + v_lane + (uint32_t)((16 * c * FA_LD + 16 * jj) * 2), b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < FA_MT; ++mt) {
                mma_16816(o[mt][2 * jj], pa[mt], b0, b1);
                mma_16816(o[mt][2 * jj + 1], pa[mt], b2, b3);
            }
        }
    }
}

// Grid (ceil(T * G / FA_BM), n_head_kv), block FA_THREADS, FA_SMEM_F16 / FA_SMEM_I8 bytes of dynamic shared memory;
// G = n_head / n_head_kv, head_dim == FA_HD. q, out: (T, n_head * head_dim) fp32, q already rotated; the query rows
// of token t see positions 0 .. pos0 + t.
// OSS (gpt-oss): the layer's max_ctx rows a head are a ring (position p at row p % max_ctx), the query of position
// P sees keys P - swa + 1 .. P when swa > 0, and the head's sinks[h] joins each row's softmax denominator.
template <bool I8, bool OSS = false>
__device__ __forceinline__ void fa_body(const float* __restrict__ q, const void* kc, const void* vc,
                                        const float* ksc, const float* vsc, float* __restrict__ out, int T, int pos0,
                                        int n_head, int n_head_kv, int max_ctx, float scale,
                                        const float* __restrict__ sinks = nullptr, int swa = 0) {
    extern __shared__ __align__(16) unsigned char fa_sm[];
    const int G = n_head / n_head_kv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int rows = T * G;
    // blocks in order of decreasing work (the last row tiles see the most keys), every KV head's at each size
    // before the next smaller: the grid's tail is the cheapest tiles
    const int lin = blockIdx.y * gridDim.x + blockIdx.x;
    const int kvh = lin % n_head_kv;
    const int r0 = (gridDim.x - 1 - lin / n_head_kv) * FA_BM;
    const int end = pos0 + (min(rows, r0 + FA_BM) - 1) / G + 1;          // keys this block reads: 0 .. end-1
    const int wr0 = r0 + 16 * FA_MT * warp;
    const bool w_live = wr0 < rows;                                       // warps past the last row only load
    const int w_first = pos0 + min(wr0, rows - 1) / G;                    // the warp's first and last rows' last keys
    const int w_last = pos0 + min(rows - 1, wr0 + 16 * FA_MT - 1) / G;
    // this lane's rows: g and g + 8 of each m-tile (rows past the last read the last row's Q and write nothing)
    auto row_of = [&](int i) { return wr0 + 16 * (i >> 1) + 8 * (i & 1) + g; };
    auto q_off = [&](int r) {
        r = min(r, rows - 1);
        return (long long)(r / G) * n_head * FA_HD + (long long)(kvh * G + r % G) * FA_HD;
    };
    int lim[2 * FA_MT];
#pragma unroll
    for (int i = 0; i < 2 * FA_MT; ++i) lim[i] = pos0 + min(row_of(i), rows - 1) / G;
    const long long head_base = (long long)kvh * max_ctx;
    const int ring = OSS ? max_ctx : 0;
    // OSS with a window: the block's first key is its first row's first visible one, rounded down to a tile
    const int kb = OSS && swa > 0 ? max(0, pos0 + min(r0, rows - 1) / G - swa + 1) / FA_BN * FA_BN : 0;
    // shared memory: NST fp16 K/V stages, Q (FA_QSM), int8's two raw stages (int8 tiles run two ahead in those, so
    // two fp16 stages suffice)
    constexpr int NST = I8 ? 2 : FA_STAGES, Q0 = NST * FA_STAGE_B, RAW0 = Q0 + FA_Q_B;
    const uint32_t sm0 = smem_u32(fa_sm);
    // tile p (keys p .. p + FA_BN - 1) into fp16 stage `stage` (fp16 cache) or raw stage `stage` (int8 cache)
    auto issue = [&](int stage, int p) {
        if (I8)
            fa_issue_i8(sm0 + RAW0 + stage * FA_RAW_B, (const signed char*)kc, (const signed char*)vc, ksc, vsc,
                        head_base, p, end, ring);
        else
            fa_issue_f16(sm0 + stage * FA_STAGE_B, (const unsigned short*)kc, (const unsigned short*)vc, head_base, p,
                         end, ring);
    };

    // the first tiles start loading before Q is read: int8 two, fp16 NST - 1 (one commit group a tile, empty past end)
    constexpr int AHEAD = I8 ? 2 : NST - 1;
#pragma unroll
    for (int t = 0; t < AHEAD; ++t) {
        if (kb + t * FA_BN < end) issue(t, kb + t * FA_BN);
        fa_commit();
    }

    // Q as A fragments (rows g, g+8 of each m-tile; columns 2*t4.. and 2*t4+8..), scaled by scale * log2(e) for exp2
    const float qs = scale * 1.4426950408889634f;
    uint32_t qa[FA_MT][FA_QR][4];
    // FA_QSM: the warp's rows of Q in shared memory, each lane's at its fragments' places
    unsigned char* qw = fa_sm + Q0 + warp * 16 * FA_MT * FA_LD * 2;
#pragma unroll
    for (int mt = 0; mt < FA_MT; ++mt) {
        const long long qo_a = q_off(row_of(2 * mt)), qo_b = q_off(row_of(2 * mt + 1));
#pragma unroll
        for (int kk = 0; kk < FA_KS; ++kk) {
            const int c = 16 * kk + 2 * t4;
            const float2 a0 = *reinterpret_cast<const float2*>(q + qo_a + c);
            const float2 a1 = *reinterpret_cast<const float2*>(q + qo_b + c);
            const float2 a2 = *reinterpret_cast<const float2*>(q + qo_a + c + 8);
            const float2 a3 = *reinterpret_cast<const float2*>(q + qo_b + c + 8);
            const uint32_t f0 = pack_h2(a0.x * qs, a0.y * qs), f1 = pack_h2(a1.x * qs, a1.y * qs);
            const uint32_t f2 = pack_h2(a2.x * qs, a2.y * qs), f3 = pack_h2(a3.x * qs, a3.y * qs);
            if (FA_QSM) {
                const int r = 16 * mt + g;
                *reinterpret_cast<uint32_t*>(qw + (r * FA_LD + c) * 2) = f0;
                *reinterpret_cast<uint32_t*>(qw + ((r + 8) * FA_LD + c) * 2) = f1;
                *reinterpret_cast<uint32_t*>(qw + (r * FA_LD + c + 8) * 2) = f2;
                *reinterpret_cast<uint32_t*>(qw + ((r + 8) * FA_LD + c + 8) * 2) = f3;
            } else {
                qa[mt][FA_QSM ? 0 : kk][0] = f0;
                qa[mt][FA_QSM ? 0 : kk][1] = f1;
                qa[mt][FA_QSM ? 0 : kk][2] = f2;
                qa[mt][FA_QSM ? 0 : kk][3] = f3;
            }
        }
    }
    __syncwarp();                                             // FA_QSM: the warp's Q rows before its ldmatrix reads
    float o[FA_MT][FA_NO][4];
#pragma unroll
    for (int mt = 0; mt < FA_MT; ++mt)
#pragma unroll
        for (int j = 0; j < FA_NO; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
    float m[2 * FA_MT], l[2 * FA_MT];                         // l: this lane's part of the row sums
#pragma unroll
    for (int i = 0; i < 2 * FA_MT; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.f;
    }
    // ldmatrix row addresses: K (plain) lanes 0-7 keys 0-7 dims d0.., 8-15 keys 0-7 at d0 + 8, 16-31 keys 8-15 the
    // same; V (transposed) lanes 0-7 keys 0-7, 8-15 keys 8-15 (dims d0..), 16-31 the same at d0 + 8
    const uint32_t k_lane = (uint32_t)((((lane & 7) + (lane >> 4) * 8) * FA_LD + ((lane >> 3) & 1) * 8) * 2);
    const uint32_t v_lane = (uint32_t)((((lane & 7) + ((lane >> 3) & 1) * 8) * FA_LD + (lane >> 4) * 8) * 2);
    // Q (FA_QSM) as A fragments, plain: matrices (rows 0-7, dims 0-7), (rows 8-15, 0-7), (0-7, 8-15), (8-15, 8-15),
    // the same row addresses as V's
    const uint32_t q_lane = smem_u32(qw) + v_lane;

    if (I8) {
        fa_wait<1>();                                         // this thread's chunks of tile 0
        fa_dequant(fa_sm + RAW0, fa_sm);
        if (kb + 2 * FA_BN < end) issue(0, kb + 2 * FA_BN);
        fa_commit();
        __syncthreads();
    }
    for (int p0 = kb, cur = 0; p0 < end; p0 += FA_BN, cur = cur + 1 == NST ? 0 : cur + 1) {
        // tile j (keys from p0) is in stage cur; nxt, tile j - 1's, is free once every warp has passed tile j's
        // barrier: fp16 loads tile j + NST - 1 into it, int8 dequantizes tile j + 1 into it
        const int nxt = cur == 0 ? NST - 1 : cur - 1;
        if (!I8) {
            fa_wait<NST - 2>();                               // this thread's part of tile j is in
            __syncthreads();                                  // everyone's is; everyone is done with tile j - 1's stage
            if (p0 + (NST - 1) * FA_BN < end) issue(nxt, p0 + (NST - 1) * FA_BN);
            fa_commit();
        }
        // warp-uniform: no key of this tile is visible to the warp's rows (or the warp has none)
        if (OSS && swa > 0) {   // also skipped: tiles wholly before the warp's windows; masked: tiles crossing one
            if (w_live && p0 <= w_last && p0 + FA_BN - 1 > w_first - swa)
                fa_tile<true>(o, m, l, qa, q_lane, sm0 + cur * FA_STAGE_B, k_lane, v_lane, p0,
                              p0 + FA_BN - 1 > w_first || p0 <= w_last - swa, lim, swa);
        } else if (w_live && p0 <= w_last) {
            fa_tile(o, m, l, qa, q_lane, sm0 + cur * FA_STAGE_B, k_lane, v_lane, p0, p0 + FA_BN - 1 > w_first, lim);
        }
        if (I8 && p0 + FA_BN < end) {
            // tile j + 1 (raw, issued two tiles ago: its own chunks only) into the other fp16 stage, which every warp
            // finished with before the last barrier; then tile j + 3 into the raw stage just emptied
            fa_wait<1>();
            fa_dequant(fa_sm + RAW0 + nxt * FA_RAW_B, fa_sm + nxt * FA_STAGE_B);
            if (p0 + 3 * FA_BN < end) issue(nxt, p0 + 3 * FA_BN);
            fa_commit();
            __syncthreads();
        }
    }
    fa_wait<0>();                                             // nothing in flight when the block exits
#pragma unroll
    for (int i = 0; i < 2 * FA_MT; ++i) {
        float li = l[i];
        li += __shfl_xor_sync(0xffffffffu, li, 1);
        li += __shfl_xor_sync(0xffffffffu, li, 2);
        const int r = row_of(i);
        if (OSS && sinks)       // m is in log2 units (q was scaled by log2(e))
            li += fa_exp2(sinks[kvh * G + min(r, rows - 1) % G] * 1.4426950408889634f - m[i]);
        if (r < rows) {
            const float inv = 1.f / li;
            float* dst = out + q_off(r) + 2 * t4;
#pragma unroll
            for (int jo = 0; jo < FA_NO; ++jo)
                *reinterpret_cast<float2*>(dst + 8 * jo) =
                    make_float2(o[i >> 1][jo][2 * (i & 1)] * inv, o[i >> 1][jo][2 * (i & 1) + 1] * inv);
        }
    }
}

extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MINB)
flash_attn_f16(const float* __restrict__ q, const unsigned short* __restrict__ kc, const unsigned short* __restrict__ vc,
               float* __restrict__ out, int T, int pos0, int n_head, int n_head_kv, int head_dim, int max_ctx,
               float scale) {
    fa_body<false>(q, kc, vc, nullptr, nullptr, out, T, pos0, n_head, n_head_kv, max_ctx, scale);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MINB)
flash_attn_i8(const float* __restrict__ q, const signed char* __restrict__ kc, const signed char* __restrict__ vc,
              const float* __restrict__ k_scale, const float* __restrict__ v_scale, float* __restrict__ out, int T,
              int pos0, int n_head, int n_head_kv, int head_dim, int max_ctx, float scale) {
    fa_body<true>(q, kc, vc, k_scale, v_scale, out, T, pos0, n_head, n_head_kv, max_ctx, scale);
}

// gpt-oss's layers: as flash_attn_f16 / flash_attn_i8 with the layer's sinks (n_head floats, may be null), its
// window swa (0: none) and max_ctx the rows a head of its KV ring (engine/cuda/kv.py KVCache.rows).
extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MINB)
flash_attn_oss_f16(const float* __restrict__ q, const unsigned short* __restrict__ kc,
                   const unsigned short* __restrict__ vc, float* __restrict__ out, int T, int pos0, int n_head,
                   int n_head_kv, int head_dim, int max_ctx, float scale, const float* __restrict__ sinks, int swa) {
    fa_body<false, true>(q, kc, vc, nullptr, nullptr, out, T, pos0, n_head, n_head_kv, max_ctx, scale, sinks, swa);
}

extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MINB)
flash_attn_oss_i8(const float* __restrict__ q, const signed char* __restrict__ kc, const signed char* __restrict__ vc,
                  const float* __restrict__ k_scale, const float* __restrict__ v_scale, float* __restrict__ out, int T,
                  int pos0, int n_head, int n_head_kv, int head_dim, int max_ctx, float scale,
                  const float* __restrict__ sinks, int swa) {
    fa_body<true, true>(q, kc, vc, k_scale, v_scale, out, T, pos0, n_head, n_head_kv, max_ctx, scale, sinks, swa);
}
