// The routed expert FFN of one token (or a small window), reading every expert through the per-(layer, expert)
// pointer table: an entry is the expert's VRAM cache slot or its address in the mapped pinned arena, so a missed
// expert is read over PCIe in place by these same kernels. An expert blob is gate | up | down, each the GGUF's
// rows for that expert.
//
// Both kernels read their input vector from shared memory (common.cuh stage_x: fewer L1 wavefronts than the weight
// bytes otherwise) and start the ids -> table -> weights chain before anything else, since every dependent load is
// ~0.5-1 us (several over PCIe) and the step is a chain of such latencies.
#include "quant.cuh"
#include "common.cuh"

// Grid (ceil(n_ff / (warps per block * MOE_GU_RPW)), k, T); dynamic shared memory staged_bytes(ncols).
// h[t, j, r] = silu(gate_e[r] . xn_t) * (up_e[r] . xn_t), e = ids[t, j], xn_t = rmsnorm(x_t) * norm_w (the FFN
// norm, done here per block; x_t as is when norm_w is NULL). A warp computes MOE_GU_RPW consecutive rows: every
// block stages (and norms) x, ~3 x n_embd floats from L2 against 4 rows' 9 KB of Q4_K weights at n_embd 2048, so
// more rows a block amortize that (a define: bench.decode_kernels --define MOE_GU_RPW=2 times it; the engine's
// launch keeps 1 until a measurement says otherwise).
#ifndef MOE_GU_RPW
#define MOE_GU_RPW 1
#endif
template <int QT>
__global__ void moe_gate_up(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                            long long up_off, long long row_bytes, const float* __restrict__ x,
                            const float* __restrict__ norm_w, float eps, float* __restrict__ h, int n_ff, int ncols,
                            int k) {
    const int lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * MOE_GU_RPW;
    const int j = blockIdx.y, t = blockIdx.z;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(table[ids[t * k + j]]);
    const uint8_t* rg[MOE_GU_RPW];
    const uint8_t* ru[MOE_GU_RPW];
#pragma unroll
    for (int i = 0; i < MOE_GU_RPW; ++i) {
        rg[i] = base + (long long)min(r0 + i, n_ff - 1) * row_bytes;   // a tail warp re-reads the last row
        ru[i] = rg[i] + up_off;
    }
    float g[MOE_GU_RPW], u[MOE_GU_RPW];
    if constexpr (QT == STRATA_Q_Q4_K) {       // the first units' loads go out before the staging
        Q4KRaw p[MOE_GU_RPW][Q4K_BATCH], q[MOE_GU_RPW][Q4K_BATCH];
#pragma unroll
        for (int i = 0; i < MOE_GU_RPW; ++i) {
            q4k_preload(rg[i], ncols, lane, p[i]);
            q4k_preload(ru[i], ncols, lane, q[i]);
        }
        const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
#pragma unroll
        for (int i = 0; i < MOE_GU_RPW; ++i) q4k_finish2(p[i], q[i], rg[i], ru[i], xs, ncols, lane, g[i], u[i]);
    } else {
        const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
#pragma unroll
        for (int i = 0; i < MOE_GU_RPW; ++i) dot2_s<QT>(rg[i], ru[i], xs, ncols, lane, g[i], u[i]);
    }
#pragma unroll
    for (int i = 0; i < MOE_GU_RPW; ++i) {
        const float gi = warp_sum(g[i]), ui = warp_sum(u[i]);
        if (lane == 0 && r0 + i < n_ff) h[((long long)t * k + j) * n_ff + r0 + i] = silu(gi) * ui;
    }
}

// Grid, block and shared memory as moe_gate_up's, for a layer whose gate and up differ in quant type (community
// quants mix them): two launches, gate (mul 0: h = gate_e[r] . xn) then up (mul 1: h = silu(h) * (up_e[r] . xn)),
// each with its own type's staging; off is the projection's offset in the blob. Uniform layers keep moe_gate_up.
template <int QT>
__global__ void moe_proj(const unsigned long long* __restrict__ table, const int* __restrict__ ids, long long off,
                         long long row_bytes, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                         float* __restrict__ h, int n_ff, int ncols, int k, int mul) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int j = blockIdx.y, t = blockIdx.z;
    const uint8_t* row = reinterpret_cast<const uint8_t*>(table[ids[t * k + j]]) + off +
                         (long long)min(r, n_ff - 1) * row_bytes;
    const float* xs = stage_x<QT>(x + (long long)t * ncols, norm_w, eps, ncols);
    const float d = warp_sum(dot_s<QT>(row, xs, ncols, lane));
    if (lane == 0 && r < n_ff) {
        float* o = h + ((long long)t * k + j) * n_ff + r;
        *o = mul ? silu(*o) * d : d;
    }
}

// Grid (ceil(n_embd / warps per block), T). out[t, r] += sum_j w[t, j] * (down_e[r] . h[t, j]).
// One warp sums a row over all k experts, so the result does not depend on scheduling. With stage, h[t] (k * n_ff
// floats) is read from shared memory (dynamic shared memory staged_bytes(k * n_ff)), else from global memory.
// k <= 32. Lane j < k fetches expert j's address and weight, so the k chains run side by side, once per warp.
#define MOE_DOWN_BATCH 6    // (expert, unit) pairs per lane in flight: k = 8, n_ff = 768 is 6 a lane (registers: 4 blocks an SM)
template <int QT>
__global__ void moe_down(const unsigned long long* __restrict__ table, const int* __restrict__ ids,
                         const float* __restrict__ weights, long long down_off, long long row_bytes,
                         const float* __restrict__ h, float* __restrict__ out, int n_embd, int n_ff, int k,
                         int stage) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int t = blockIdx.y;
    unsigned long long addr = 0;
    float wl = 0.f;
    if (lane < k) {
        addr = table[ids[t * k + lane]] + down_off + (unsigned long long)min(r, n_embd - 1) * row_bytes;
        wl = weights[t * k + lane];
    }
    const float* ht = h + (long long)t * k * n_ff;
    float s = 0.f;
    if (stage) {
        if constexpr (QT == STRATA_Q_Q4_K) {
            // the k rows' units as one list of (expert, unit) pairs over the 32 lanes: every lane busy (n_ff = 768
            // is 24 units a row) and all of a lane's loads in flight before the staging
            const int nu = n_ff / 32, total = k * nu;
            Q4KRaw raw[MOE_DOWN_BATCH];
            int pj[MOE_DOWN_BATCH];
#pragma unroll
            for (int i = 0; i < MOE_DOWN_BATCH; ++i) {
                const int p = lane + 32 * i, jj = min(p / nu, k - 1);
                pj[i] = jj;
                const unsigned long long a = __shfl_sync(0xffffffffu, addr, jj);
                if (p < total) raw[i] = q4k_load(reinterpret_cast<const uint8_t*>(a), p - jj * nu);
            }
            const float* hs = stage_x<QT>(ht, nullptr, 0.f, k * n_ff);
#pragma unroll
            for (int i = 0; i < MOE_DOWN_BATCH; ++i) {
                const int p = lane + 32 * i, jj = pj[i];
                const float wj = __shfl_sync(0xffffffffu, wl, jj);
                if (p < total) s += wj * q4k_dot(raw[i], hs + xs_at<QT>(jj * n_ff), p - jj * nu);
            }
            for (int p0 = lane + 32 * MOE_DOWN_BATCH; __any_sync(0xffffffffu, p0 < total); p0 += 32) {
                const int jj = min(p0 / nu, k - 1);     // pairs beyond the first batch (large k * n_ff)
                const unsigned long long a = __shfl_sync(0xffffffffu, addr, jj);
                const float wj = __shfl_sync(0xffffffffu, wl, jj);
                if (p0 < total)
                    s += wj * q4k_dot(q4k_load(reinterpret_cast<const uint8_t*>(a), p0 - jj * nu),
                                      hs + xs_at<QT>(jj * n_ff), p0 - jj * nu);
            }
        } else {
            const float* hs = stage_x<QT>(ht, nullptr, 0.f, k * n_ff);
            for (int j = 0; j < k; ++j) {
                const uint8_t* row = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, addr, j));
                s += __shfl_sync(0xffffffffu, wl, j) * dot_s<QT>(row, hs + j * n_ff, n_ff, lane);
            }
        }
    } else {
        // Lane partials of all k rows first, one warp reduction at the end: the k rows' loads overlap, which is
        // what hides PCIe latency when some of the experts are read in place from host memory.
#pragma unroll 8
        for (int j = 0; j < k; ++j) {
            const uint8_t* row = reinterpret_cast<const uint8_t*>(__shfl_sync(0xffffffffu, addr, j));
            s += __shfl_sync(0xffffffffu, wl, j) * dotw<QT>(row, ht + (long long)j * n_ff, n_ff, lane);
        }
    }
    s = warp_sum(s);
    if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
}

// moe_down for Q6_K ffn_down (llama-quantize's Q4_K_M recipe), through tiles in shared memory. A Q6_K row of n_ff
// = 768 is 630 bytes, so its rows sit only 2-byte aligned and moe_down's row reads go out as 2- and 4-byte loads
// (~0.7 TB/s measured for this launch). Eight consecutive rows of one expert are 8 * row_bytes bytes, a multiple of
// 16 (Q6_K rows are 210 * n_ff / 256 bytes) starting 16-byte aligned: one block copies the eight rows of each of the k
// experts into shared memory as 16-byte loads (MOE_DOWN_TILE_BATCH in flight per thread, issued before h is staged),
// then warp w computes row r0 + w from there.
// Grid (n_embd / 8, T), block 256 (8 warps: n_embd a multiple of 8), dynamic shared memory
// moe_down_tiled_bytes: the k tiles (k * 8 * row_bytes, rounded up to 16) then h[t] (k * n_ff floats).
// out[t, r] += sum_j w[t, j] * (down_e[r] . h[t, j]), e = ids[t, j]; a lane sums its elements in a fixed order and
// the warp reduces, so the result does not depend on scheduling. k <= 32, n_ff a multiple of 256.
#define MOE_DOWN_TILE_ROWS 8
#define MOE_DOWN_TILE_BATCH 12   // 16-byte loads per thread in flight: k = 8, n_ff = 768 is 2,520 of them, one round
extern "C" __global__ void __launch_bounds__(256) moe_down_q6k(
        const unsigned long long* __restrict__ table, const int* __restrict__ ids, const float* __restrict__ weights,
        long long down_off, long long row_bytes, const float* __restrict__ h, float* __restrict__ out, int n_embd,
        int n_ff, int k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = blockIdx.x * MOE_DOWN_TILE_ROWS, t = blockIdx.y;
    unsigned long long addr = 0;
    float wl = 0.f;
    if (lane < k) {
        addr = table[ids[t * k + lane]] + down_off + (unsigned long long)r0 * row_bytes;
        wl = weights[t * k + lane];
    }
    uint8_t* tiles = reinterpret_cast<uint8_t*>(strata_smem4);
    const int tile = MOE_DOWN_TILE_ROWS * (int)row_bytes;          // bytes of one expert's eight rows
    const int per = tile / 16, total = k * per;
    const int tiles_bytes = (k * tile + 15) & ~15;
    float* hs = reinterpret_cast<float*>(tiles + tiles_bytes);
    for (int c0 = threadIdx.x; __syncthreads_or(c0 < total); c0 += blockDim.x * MOE_DOWN_TILE_BATCH) {
        uint4 v[MOE_DOWN_TILE_BATCH];
#pragma unroll
        for (int i = 0; i < MOE_DOWN_TILE_BATCH; ++i) {
            const int c = c0 + i * blockDim.x, j = min(c / per, k - 1);
            const unsigned long long a = __shfl_sync(0xffffffffu, addr, j);
            if (c < total) v[i] = *reinterpret_cast<const uint4*>(a + (unsigned long long)(c - j * per) * 16);
        }
        if (c0 == threadIdx.x) {       // the first round's loads are out: stage h[t] meanwhile
            const float4* h4 = reinterpret_cast<const float4*>(h + (long long)t * k * n_ff);
            for (int i = threadIdx.x; i < k * n_ff / 4; i += blockDim.x) reinterpret_cast<float4*>(hs)[i] = h4[i];
        }
#pragma unroll
        for (int i = 0; i < MOE_DOWN_TILE_BATCH; ++i) {
            const int c = c0 + i * blockDim.x;
            if (c < total) reinterpret_cast<uint4*>(tiles)[c] = v[i];
        }
    }
    __syncthreads();
    // Q6_K block (256 values): ql[128], qh[64], scales[16] (int8), d (fp16). In each half (128 values), lane l
    // holds values l, l + 32, l + 64, l + 96 (as ggml's dequantize_row_q6_K orders them), scales l / 16 + 0, 2, 4, 6.
    const int nb = n_ff / 256, is = lane >> 4;
    float s = 0.f;
    for (int j = 0; j < k; ++j) {
        const uint8_t* row = tiles + j * tile + warp * (int)row_bytes;
        const float* hj = hs + j * n_ff;
        float sj = 0.f;
        for (int b = 0; b < nb; ++b) {
            const uint8_t* blk = row + b * 210;
            const float d = h2f(*reinterpret_cast<const unsigned short*>(blk + 208));
            const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
            float sb = 0.f;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const uint8_t* ql = blk + 64 * half;
                const int a = ql[lane], c = ql[lane + 32], hb = blk[128 + 32 * half + lane];
                const int8_t* sh = sc + 8 * half + is;
                const float* y = hj + 256 * b + 128 * half + lane;
                sb += (float)sh[0] * (float)(((a & 15) | ((hb & 3) << 4)) - 32) * y[0] +
                      (float)sh[2] * (float)(((c & 15) | (((hb >> 2) & 3) << 4)) - 32) * y[32] +
                      (float)sh[4] * (float)(((a >> 4) | (((hb >> 4) & 3) << 4)) - 32) * y[64] +
                      (float)sh[6] * (float)(((c >> 4) | (((hb >> 6) & 3) << 4)) - 32) * y[96];
            }
            sj += d * sb;
        }
        s += __shfl_sync(0xffffffffu, wl, j) * sj;
    }
    s = warp_sum(s);
    const int r = r0 + warp;
    if (lane == 0 && r < n_embd) out[(long long)t * n_embd + r] += s;
}
