// The streamed prompt pass's expert FFN: a chunk's (token, expert) pairs sorted by expert on the GPU, then each
// expert's rows through gate/up (SwiGLU in the epilogue) and down (routing weight in the epilogue) as tiled GEMMs on
// tensor cores. Weights stay in their GGUF format wherever they are (VRAM cache slot, ring slot, or mapped host
// memory); each block dequantizes its weight tile into shared memory as fp16 (quant.cuh's dequant8; Q4_K through
// mg_q4k8) and multiplies it with fp16 activations (converted once per token) by mma.sync
// m16n8k16 with ldmatrix fragment loads, accumulating in fp32. A block multiplies each dequantized weight tile by MG_MT
// 64-row tiles; the tiles are double-buffered in shared memory, and the next slice's global reads are issued before
// this slice's mma instructions (one barrier a slice). The dequantization is most of the issued instructions
// (python -m bench.moe_gemm; docs/experiments.md has the figures). tests/test_cuda_prefill_kernels.py checks it
// against NumPy.
#include "quant.cuh"
#include "common.cuh"
#include "mma.cuh"

#define MG_BM 64              // pair rows per block tile
#define MG_BN 64              // output columns per block tile
#define MG_BK 32              // reduction slice per step (four 8-element chunks per row)
#define MG_LDS (MG_BK + 8)    // halves per shared row: keeps rows 16-byte aligned, fragment reads bank-conflict free
#define MG_THREADS 256        // 8 warps: 4 along M (16 rows each) x 2 along N (32 columns each)
#ifndef MG_MT
#define MG_MT 2               // 64-row tiles per pass over a weight tile: each dequantized tile feeds MG_MT * 64 rows
#endif                        // (at 4K tokens an expert averages 256 rows: the dequantization is paid 2x, not 4x)
#define MG_ROWS (MG_BM * MG_MT)
#define MG_MAX_EXPERT 1024

// ---- sorting pairs by expert ------------------------------------------------------------------------------------
// One block of 1024 threads (a chunk has at most a few 10^4 pairs, so one block is a few microseconds and needs no
// grid-wide sync or host round trip). ids/w: (n_pairs) expert and routing weight of pair p = token * k + j.
// offsets: (n_expert + 1) start of each expert's range; rows[o] / row_w[o]: token and weight of sorted pair o.
// Within an expert the order is whatever the shared atomics give (the down GEMM adds with atomics anyway).
extern "C" __global__ void moe_sort(const int* __restrict__ ids, const float* __restrict__ w, int n_pairs, int k,
                                    int n_expert, int* __restrict__ offsets, int* __restrict__ rows,
                                    float* __restrict__ row_w) {
    __shared__ int cnt[MG_MAX_EXPERT];
    __shared__ int cur[MG_MAX_EXPERT];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e >= 0 && e < n_expert) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int e = 0; e < n_expert; ++e) {
            cur[e] = s;
            offsets[e] = s;
            s += cnt[e];
        }
        offsets[n_expert] = s;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        const int e = ids[p];
        if (e < 0 || e >= n_expert) continue;
        const int o = atomicAdd(&cur[e], 1);
        rows[o] = p / k;
        row_w[o] = w[p];
    }
}

// ---- tile helpers -----------------------------------------------------------------------------------------------
// fp16 that saturates: a value past fp16's range (65504) becomes +-65504 instead of inf, NaN stays NaN. The SwiGLU
// output h is kept in fp16 (the down GEMM's mma operand, half the bytes of fp32); real models do produce SwiGLU
// outputs in the thousands and now and then past 65504 (llama.cpp's quantized path keeps them in f32 and quantizes
// per 32 values; its cuBLAS path converts to f16 and would give inf). Saturating costs accuracy on that one value
// only, where inf would turn the token's whole down-projection into inf/NaN.
__device__ __forceinline__ unsigned short f2h_sat(float f) {
    return f2h(fabsf(f) > 65504.f ? copysignf(65504.f, f) : f);
}

__device__ __forceinline__ uint32_t mg_pack2(float a, float b) {
    return (uint32_t)f2h_sat(a) | ((uint32_t)f2h_sat(b) << 16);
}

__device__ __forceinline__ uint4 mg_pack8(const float (&v)[8]) {
    return make_uint4(mg_pack2(v[0], v[1]), mg_pack2(v[2], v[3]), mg_pack2(v[4], v[5]), mg_pack2(v[6], v[7]));
}

// Fragments by ldmatrix (mma.cuh ldsm_x4): one instruction replaces the four (A) or four (two B fragments) 32-bit
// shared loads per fragment the first version issued: at 4K tokens the kernels were bound by issued instructions
// (ncu: IPC 1.9, tensor pipe mostly idle, ALU the busiest pipe), not by the tensor cores.

// A fragment (16 rows from row0, 16 k from kk): tiles (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
// (rows 8-15, k 8-15) are a[0..3] of the m16n8k16 layout; rows are MG_LDS halves (80 bytes) apart, so the eight
// 16-byte rows of a tile fall in distinct bank groups.
__device__ __forceinline__ void mg_load_a(const unsigned short* xs, int row0, int kk, int lane, uint32_t (&a)[4]) {
    ldsm_x4(smem_u32(xs + (row0 + (lane & 15)) * MG_LDS + kk + ((lane >> 4) << 3)), a[0], a[1], a[2], a[3]);
}

// B fragments of two adjacent 8-column groups (col0, col0 + 8), 16 k from kk: the weight tile is stored [n][k], so
// a non-transposed tile row is one output column's 8 k values, the col-major B operand mma wants.
// b[0], b[1]: columns col0..col0+7 (k 0-7, k 8-15); b[2], b[3]: columns col0+8..col0+15.
__device__ __forceinline__ void mg_load_b2(const unsigned short* ws, int col0, int kk, int lane, uint32_t (&b)[4]) {
    ldsm_x4(smem_u32(ws + (col0 + ((lane >> 4) << 3) + (lane & 7)) * MG_LDS + kk + (((lane >> 3) & 1) << 3)),
            b[0], b[1], b[2], b[3]);
}

// PTX helpers for the Q4_K tile path (NVRTC builds without cuda_fp16.h here)
__device__ __forceinline__ uint32_t mg_h2_sub(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// Q4_K chunk j (8 values) of the block at b as fp16: each nibble byte q becomes the fp16 1024 + q by a byte permute
// with 0x64 (fp16's exponent for [1024, 2048), where the mantissa counts units) and 1024 is taken off exactly, two
// values an instruction; then d * scale * q - dmin * min in fp32 (one fma each) and one rounding to fp16 per pair, the
// same numbers as dequant8's fp32 path, faster than dequant8 then 8 conversions. The products stay in fp32: an fp16x2
// fma was faster but took the int8-KV prompt-pass test over its bound (docs/experiments.md). |w| <= 945 d stays far
// inside fp16's range.
__device__ __forceinline__ uint4 mg_q4k8(const uint8_t* __restrict__ b, int j) {
    const int s = j >> 2;
    float dl, ml;
    strata_k4_header(b, s, dl, ml);
    uint32_t q0, q1;
    ld8(b + 16 + (s >> 1) * 32 + (j & 3) * 8, q0, q1);
    const int sh = (s & 1) * 4;
    q0 = (q0 >> sh) & 0x0f0f0f0fu;
    q1 = (q1 >> sh) & 0x0f0f0f0fu;
    const auto pair = [&](uint32_t q, uint32_t sel) {
        const uint32_t h = mg_h2_sub(__byte_perm(q, 0x64646464u, sel), 0x64006400u);    // (q_lo, q_hi), exact
        return pack_h2(fmaf(h2f((unsigned short)(h & 0xffffu)), dl, -ml),
                           fmaf(h2f((unsigned short)(h >> 16)), dl, -ml));
    };
    return make_uint4(pair(q0, 0x4140u), pair(q0, 0x4342u), pair(q1, 0x4140u), pair(q1, 0x4342u));
}

// 8 elements (chunk c) of weight row `row` of a quantized matrix at `base`, as fp16; zeros outside the matrix.
template <int QT>
__device__ __forceinline__ uint4 mg_weight8(const uint8_t* base, long long row_bytes, int row, int nrows, int c,
                                            int nchunks) {
    constexpr int CPB = QTraits<QT>::QK / 8, BB = QTraits<QT>::BYTES;
    if (row >= nrows || c >= nchunks) return make_uint4(0u, 0u, 0u, 0u);
    if constexpr (QT == STRATA_Q_Q4_K)
        return mg_q4k8(base + (long long)row * row_bytes + (long long)(c / CPB) * BB, c % CPB);
    float v[8];
    dequant8<QT>(base + (long long)row * row_bytes + (long long)(c / CPB) * BB, c % CPB, v);
    return mg_pack8(v);
}

// 8 fp16 activations (chunk c) of row `row` of a (rows, K) fp16 matrix; zeros for row -1 or past the row's end.
__device__ __forceinline__ uint4 mg_x8(const unsigned short* __restrict__ m, int row, int K, int c, int nchunks) {
    if (row < 0 || c >= nchunks) return make_uint4(0u, 0u, 0u, 0u);
    return *reinterpret_cast<const uint4*>(m + (long long)row * K + c * 8);
}

// ---- gate/up with SwiGLU ----------------------------------------------------------------------------------------
// Grid (ceil(n_ff / 64), any number of row-tile blocks per expert, n_sel), block 256. sel[z]: the expert of grid slice z,
// ptrs[z]: its blob (gate | up | down; up at up_off). x: (T, K) fp16 activations. h: (n_pairs, n_ff) fp16, row o
// for sorted pair o: h[o, n] = silu(gate_n . x) * (up_n . x).
// The body takes gate's and up's quant types (and up's row bytes) apart: moe_gemm_gate_up is it with one type, and
// moe_gemm_gate_up_mixed<QG, QU> serves a layer whose gate and up differ (instantiated only for the pairs a model
// holds: engine/cuda/kernels.py's `pairs`).
// OAI (gpt-oss): gate and up get expert e's biases (bg, bu: (n_expert, n_ff) fp32) and h = swiglu_oai(gate, up)
// (common.cuh), as engine/arch/gptoss.py.
template <int QG, int QU, bool OAI = false>
__device__ __forceinline__ void moe_gemm_gate_up_body(const int* __restrict__ sel, const unsigned long long* __restrict__ ptrs,
                 const int* __restrict__ offsets, const int* __restrict__ rows, const unsigned short* __restrict__ x,
                 unsigned short* __restrict__ h, long long up_off, long long row_bytes, long long up_row_bytes, int n_ff,
                 int K, const float* __restrict__ bg = nullptr, const float* __restrict__ bu = nullptr) {
    // two buffers of each tile: a slice is written into one while the last slice's readers may still be in the
    // other, so one barrier a slice suffices (the first version wrote in place and needed two)
    __shared__ __align__(16) unsigned short xs2[2][MG_ROWS * MG_LDS];
    __shared__ __align__(16) unsigned short gs2[2][MG_BN * MG_LDS];
    __shared__ __align__(16) unsigned short us2[2][MG_BN * MG_LDS];
    int cur = 0;
    const int e = sel[blockIdx.z];
    const int o0 = offsets[e], n_rows = offsets[e + 1] - o0;
    const int n0 = blockIdx.x * MG_BN;
    const uint8_t* gbase = reinterpret_cast<const uint8_t*>(ptrs[blockIdx.z]);
    const uint8_t* ubase = gbase + up_off;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp & 3) * 16, wn = (warp >> 2) * 32;
    const int lr = tid >> 2, lc = tid & 3;    // this thread's tile loads: row lr (of each 64-row tile), chunk lc
    const int nchunks = K >> 3;
    const int g = lane >> 2, t = lane & 3;
    // gridDim.y blocks share an expert's rows: sized for the average expert, so a busy expert loops here instead of
    // every expert launching (and retiring at once) as many blocks as the busiest could need
    for (int m0 = blockIdx.y * MG_ROWS; m0 < n_rows; m0 += gridDim.y * MG_ROWS) {
        const int mt = min(MG_MT, (n_rows - m0 + MG_BM - 1) / MG_BM);   // 64-row tiles holding rows (block-uniform)
        int tok[MG_MT];
#pragma unroll
        for (int i = 0; i < MG_MT; ++i) {
            const int r = m0 + i * MG_BM + lr;
            tok[i] = r < n_rows ? rows[o0 + r] : -1;
        }
        float ag[MG_MT][4][4], au[MG_MT][4][4];
#pragma unroll
        for (int i = 0; i < MG_MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) ag[i][j][q] = au[i][j][q] = 0.f;
        // a slice's tiles go global -> registers (the weights dequantized) -> shared memory; the next slice's reads are
        // issued right after this slice's mma instructions, so their latency runs under the tensor cores' work
        uint4 xr[MG_MT], gr, ur;
#pragma unroll
        for (int i = 0; i < MG_MT; ++i) xr[i] = mg_x8(x, tok[i], K, lc, nchunks);
        gr = mg_weight8<QG>(gbase, row_bytes, n0 + lr, n_ff, lc, nchunks);
        ur = mg_weight8<QU>(ubase, up_row_bytes, n0 + lr, n_ff, lc, nchunks);
#pragma unroll
        for (int i = 0; i < MG_MT; ++i)
            *reinterpret_cast<uint4*>(xs2[cur] + (i * MG_BM + lr) * MG_LDS + lc * 8) = xr[i];
        *reinterpret_cast<uint4*>(gs2[cur] + lr * MG_LDS + lc * 8) = gr;
        *reinterpret_cast<uint4*>(us2[cur] + lr * MG_LDS + lc * 8) = ur;
        __syncthreads();
        for (int k0 = 0; k0 < K; k0 += MG_BK, cur ^= 1) {
            const unsigned short *xs = xs2[cur], *gs = gs2[cur], *us = us2[cur];
            const bool more = k0 + MG_BK < K;
            if (more) {     // the next slice's reads go out before this slice's mma: their latency runs under them
                const int c = ((k0 + MG_BK) >> 3) + lc;
#pragma unroll
                for (int i = 0; i < MG_MT; ++i) xr[i] = mg_x8(x, tok[i], K, c, nchunks);
                gr = mg_weight8<QG>(gbase, row_bytes, n0 + lr, n_ff, c, nchunks);
                ur = mg_weight8<QU>(ubase, up_row_bytes, n0 + lr, n_ff, c, nchunks);
            }
#pragma unroll
            for (int kk = 0; kk < MG_BK; kk += 16) {
                uint32_t a[MG_MT][4];
#pragma unroll
                for (int i = 0; i < MG_MT; ++i)
                    if (i < mt) mg_load_a(xs, i * MG_BM + wm, kk, lane, a[i]);
#pragma unroll
                for (int jp = 0; jp < 4; jp += 2) {
                    uint32_t bg[4], bu[4];
                    mg_load_b2(gs, wn + 8 * jp, kk, lane, bg);
                    mg_load_b2(us, wn + 8 * jp, kk, lane, bu);
#pragma unroll
                    for (int i = 0; i < MG_MT; ++i)
                        if (i < mt) {
                            mma_16816(ag[i][jp], a[i], bg[0], bg[1]);
                            mma_16816(ag[i][jp + 1], a[i], bg[2], bg[3]);
                            mma_16816(au[i][jp], a[i], bu[0], bu[1]);
                            mma_16816(au[i][jp + 1], a[i], bu[2], bu[3]);
                        }
                }
            }
            if (more) {     // into the other buffer, whose last readers passed the barrier below a slice ago
#pragma unroll
                for (int i = 0; i < MG_MT; ++i)
                    *reinterpret_cast<uint4*>(xs2[cur ^ 1] + (i * MG_BM + lr) * MG_LDS + lc * 8) = xr[i];
                *reinterpret_cast<uint4*>(gs2[cur ^ 1] + lr * MG_LDS + lc * 8) = gr;
                *reinterpret_cast<uint4*>(us2[cur ^ 1] + lr * MG_LDS + lc * 8) = ur;
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < MG_MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int r = m0 + i * MG_BM + wm + g + 8 * hh;
                    if (r >= n_rows) continue;
#pragma unroll
                    for (int q = 0; q < 2; ++q) {
                        const int col = n0 + wn + 8 * j + 2 * t + q;
                        if (col < n_ff) {
                            const float gv = ag[i][j][2 * hh + q], uv = au[i][j][2 * hh + q];
                            h[(long long)(o0 + r) * n_ff + col] = f2h_sat(
                                OAI ? swiglu_oai(gv + bg[(long long)e * n_ff + col], uv + bu[(long long)e * n_ff + col])
                                    : silu(gv) * uv);
                        }
                    }
                }
    }
}

template <int QT>
__global__ __launch_bounds__(MG_THREADS, 2) void moe_gemm_gate_up(const int* __restrict__ sel, const unsigned long long* __restrict__ ptrs,
                 const int* __restrict__ offsets, const int* __restrict__ rows, const unsigned short* __restrict__ x,
                 unsigned short* __restrict__ h, long long up_off, long long row_bytes, int n_ff, int K) {
    moe_gemm_gate_up_body<QT, QT>(sel, ptrs, offsets, rows, x, h, up_off, row_bytes, row_bytes, n_ff, K);
}

// gpt-oss's experts: moe_gemm_gate_up with the biases and SWIGLU_OAI (OAI above).
template <int QT>
__global__ __launch_bounds__(MG_THREADS, 2) void moe_gemm_gate_up_oai(const int* __restrict__ sel,
                 const unsigned long long* __restrict__ ptrs, const int* __restrict__ offsets,
                 const int* __restrict__ rows, const unsigned short* __restrict__ x, unsigned short* __restrict__ h,
                 long long up_off, long long row_bytes, int n_ff, int K, const float* __restrict__ bg,
                 const float* __restrict__ bu) {
    moe_gemm_gate_up_body<QT, QT, true>(sel, ptrs, offsets, rows, x, h, up_off, row_bytes, row_bytes, n_ff, K, bg, bu);
}

template <int QG, int QU>
__global__ __launch_bounds__(MG_THREADS, 2) void moe_gemm_gate_up_mixed(const int* __restrict__ sel,
                 const unsigned long long* __restrict__ ptrs, const int* __restrict__ offsets,
                 const int* __restrict__ rows, const unsigned short* __restrict__ x, unsigned short* __restrict__ h,
                 long long up_off, long long row_bytes, long long up_row_bytes, int n_ff, int K) {
    moe_gemm_gate_up_body<QG, QU>(sel, ptrs, offsets, rows, x, h, up_off, row_bytes, up_row_bytes, n_ff, K);
}

// ---- down with the routing weight -------------------------------------------------------------------------------
// Grid (ceil(n_embd / 64), any number of row-tile blocks per expert, n_sel), block 256. out[rows[o], n] += row_w[o] *
// (h[o] . down_n) for the selected experts' sorted pairs o; out is the fp32 residual stream (T, n_embd), added to
// with atomics (a token's k experts land from different blocks). BIAS (gpt-oss): expert e's bias bd[e] (n_expert,
// n_embd) joins each product before the weight, out += row_w * (h . down_n + bd[e, n]).
template <int QT, bool BIAS = false>
__device__ __forceinline__ void moe_gemm_down_body(const int* __restrict__ sel, const unsigned long long* __restrict__ ptrs,
              const int* __restrict__ offsets, const int* __restrict__ rows, const float* __restrict__ row_w,
              const unsigned short* __restrict__ h, float* __restrict__ out, long long down_off, long long row_bytes,
              int n_embd, int K, const float* __restrict__ bd = nullptr) {
    __shared__ __align__(16) unsigned short hs2[2][MG_ROWS * MG_LDS];     // double-buffered as in gate/up
    __shared__ __align__(16) unsigned short ds2[2][MG_BN * MG_LDS];
    int cur = 0;
    const int e = sel[blockIdx.z];
    const int o0 = offsets[e], n_rows = offsets[e + 1] - o0;
    const int n0 = blockIdx.x * MG_BN;
    const uint8_t* dbase = reinterpret_cast<const uint8_t*>(ptrs[blockIdx.z]) + down_off;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp & 3) * 16, wn = (warp >> 2) * 32;
    const int lr = tid >> 2, lc = tid & 3;
    const int nchunks = K >> 3;
    const int g = lane >> 2, t = lane & 3;
    for (int m0 = blockIdx.y * MG_ROWS; m0 < n_rows; m0 += gridDim.y * MG_ROWS) {   // as in gate/up
        const int mt = min(MG_MT, (n_rows - m0 + MG_BM - 1) / MG_BM);
        float acc[MG_MT][4][4];
#pragma unroll
        for (int i = 0; i < MG_MT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;
        int hrow[MG_MT];                // this thread's h row per 64-row tile (-1: past the expert's rows)
#pragma unroll
        for (int i = 0; i < MG_MT; ++i) hrow[i] = m0 + i * MG_BM + lr < n_rows ? o0 + m0 + i * MG_BM + lr : -1;
        uint4 hr[MG_MT], dr;            // staged as in gate/up
#pragma unroll
        for (int i = 0; i < MG_MT; ++i) hr[i] = mg_x8(h, hrow[i], K, lc, nchunks);
        dr = mg_weight8<QT>(dbase, row_bytes, n0 + lr, n_embd, lc, nchunks);
#pragma unroll
        for (int i = 0; i < MG_MT; ++i)
            *reinterpret_cast<uint4*>(hs2[cur] + (i * MG_BM + lr) * MG_LDS + lc * 8) = hr[i];
        *reinterpret_cast<uint4*>(ds2[cur] + lr * MG_LDS + lc * 8) = dr;
        __syncthreads();
        for (int k0 = 0; k0 < K; k0 += MG_BK, cur ^= 1) {
            const unsigned short *hs = hs2[cur], *ds = ds2[cur];
            const bool more = k0 + MG_BK < K;
            if (more) {     // as in gate/up: the next slice's reads before this slice's mma
                const int c = ((k0 + MG_BK) >> 3) + lc;
#pragma unroll
                for (int i = 0; i < MG_MT; ++i) hr[i] = mg_x8(h, hrow[i], K, c, nchunks);
                dr = mg_weight8<QT>(dbase, row_bytes, n0 + lr, n_embd, c, nchunks);
            }
#pragma unroll
            for (int kk = 0; kk < MG_BK; kk += 16) {
                uint32_t a[MG_MT][4];
#pragma unroll
                for (int i = 0; i < MG_MT; ++i)
                    if (i < mt) mg_load_a(hs, i * MG_BM + wm, kk, lane, a[i]);
#pragma unroll
                for (int jp = 0; jp < 4; jp += 2) {
                    uint32_t b[4];
                    mg_load_b2(ds, wn + 8 * jp, kk, lane, b);
#pragma unroll
                    for (int i = 0; i < MG_MT; ++i)
                        if (i < mt) {
                            mma_16816(acc[i][jp], a[i], b[0], b[1]);
                            mma_16816(acc[i][jp + 1], a[i], b[2], b[3]);
                        }
                }
            }
            if (more) {
#pragma unroll
                for (int i = 0; i < MG_MT; ++i)
                    *reinterpret_cast<uint4*>(hs2[cur ^ 1] + (i * MG_BM + lr) * MG_LDS + lc * 8) = hr[i];
                *reinterpret_cast<uint4*>(ds2[cur ^ 1] + lr * MG_LDS + lc * 8) = dr;
            }
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < MG_MT; ++i)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int r = m0 + i * MG_BM + wm + g + 8 * hh;
                if (r >= n_rows) continue;
                const int tok = rows[o0 + r];
                const float wt = row_w[o0 + r];
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int q = 0; q < 2; ++q) {
                        const int col = n0 + wn + 8 * j + 2 * t + q;
                        if (col < n_embd)
                            atomicAdd(out + (long long)tok * n_embd + col,
                                      wt * (BIAS ? acc[i][j][2 * hh + q] + bd[(long long)e * n_embd + col]
                                                 : acc[i][j][2 * hh + q]));
                    }
            }
    }
}

template <int QT>
__global__ __launch_bounds__(MG_THREADS) void moe_gemm_down(const int* __restrict__ sel, const unsigned long long* __restrict__ ptrs,
              const int* __restrict__ offsets, const int* __restrict__ rows, const float* __restrict__ row_w,
              const unsigned short* __restrict__ h, float* __restrict__ out, long long down_off, long long row_bytes,
              int n_embd, int K) {
    moe_gemm_down_body<QT>(sel, ptrs, offsets, rows, row_w, h, out, down_off, row_bytes, n_embd, K);
}

template <int QT>
__global__ __launch_bounds__(MG_THREADS) void moe_gemm_down_bias(const int* __restrict__ sel,
              const unsigned long long* __restrict__ ptrs, const int* __restrict__ offsets, const int* __restrict__ rows,
              const float* __restrict__ row_w, const unsigned short* __restrict__ h, float* __restrict__ out,
              long long down_off, long long row_bytes, int n_embd, int K, const float* __restrict__ bd) {
    moe_gemm_down_body<QT, true>(sel, ptrs, offsets, rows, row_w, h, out, down_off, row_bytes, n_embd, K, bd);
}

// Rows of a quantized matrix as fp16 (rows x cols, row-major): the prompt pass's dense projections run as cuBLAS
// GEMMs with fp16 operands on tensor cores (fp32 accumulation) on weights dequantized once per chunk (a 4K chunk
// re-reads each matrix 4096 times, so the one dequantization is noise; fp32 GEMMs ran on CUDA cores at ~50 TFLOP/s).
// Grid-stride over 8-value chunks; cols a multiple of 8.
template <int QT>
__global__ void dequant_rows_f16(const uint8_t* __restrict__ base, long long row_bytes, unsigned short* __restrict__ out,
                                 int rows, int cols) {
    constexpr int CPB = QTraits<QT>::QK / 8, BB = QTraits<QT>::BYTES;
    const int cpr = cols >> 3;
    const long long n = (long long)rows * cpr;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / cpr;
        const int c = (int)(i - r * cpr);
        float v[8];
        dequant8<QT>(base + r * row_bytes + (long long)(c / CPB) * BB, c % CPB, v);
        *reinterpret_cast<uint4*>(out + i * 8) = mg_pack8(v);
    }
}

// fp32 -> fp16, saturating (the expert GEMMs' activations, converted once per token and layer). n a multiple of 4.
extern "C" __global__ void to_half(const float* __restrict__ x, unsigned short* __restrict__ y, long long n) {
    for (long long i = 4 * (blockIdx.x * (long long)blockDim.x + threadIdx.x); i < n;
         i += 4 * (long long)gridDim.x * blockDim.x) {
        const float4 v = *reinterpret_cast<const float4*>(x + i);
        *reinterpret_cast<uint2*>(y + i) = make_uint2(mg_pack2(v.x, v.y), mg_pack2(v.z, v.w));
    }
}
