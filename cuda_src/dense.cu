// Dense layers of one token (decode): quantized mat-vec with its epilogues, the SwiGLU pair, token embedding.
// Weights stay in their GGUF quant format; quant.cuh's dot_row<QT> reads one row against a float vector.
#include "quant.cuh"
#include "common.cuh"

// Every mat-vec here can read x from shared memory, staged once per block (common.cuh stage_x): then the launch
// passes dynamic shared memory staged_bytes(ncols), and with norm_w given the block stages rmsnorm(x) * norm_w, so
// the norm before a projection needs no launch of its own (each block recomputes sum(x^2) of a vector in L2).

// y[r] = (accumulate ? y[r] : 0) + gate * (W[r] . xn + bias[r]); gate = sigmoid(*gate_logit) when given.
// xn = x, or staged (stage != 0) and then normed when norm_w is given. One warp per row, rows_per_warp rows in turn
// (one staging serves them all: the output head has ~150k rows); blockDim.x = 32 * warps, grid
// ceil(nrows / (warps * rows_per_warp)).
__device__ __forceinline__ void mv_store(int r, float s, float* __restrict__ y, const float* __restrict__ bias,
                                         const float* __restrict__ gate_logit, int accumulate) {
    if (bias) s += bias[r];
    if (gate_logit) s *= 1.f / (1.f + __expf(-gate_logit[0]));
    y[r] = accumulate ? y[r] + s : s;
}

// This warp's dot product of row (clamped to the last row) with x staged in shared memory: for Q4_K the row's
// first B units a lane go out before the staging, so their latency overlaps it. Returns the staged x through xs.
template <int QT, int B = Q4K_BATCH>
__device__ __forceinline__ float staged_row_dot(const uint8_t* __restrict__ row, const float* x,
                                                const float* __restrict__ norm_w, float eps, int ncols, int lane,
                                                const float*& xs) {
    if constexpr (QT == STRATA_Q_Q4_K) {
        Q4KRaw p[B];
        q4k_preload<B>(row, ncols, lane, p);
        xs = stage_x<QT>(x, norm_w, eps, ncols);
        return q4k_finish<B>(p, row, xs, ncols, lane);
    } else {
        xs = stage_x<QT>(x, norm_w, eps, ncols);
        return dot_s<QT>(row, xs, ncols, lane);
    }
}

// y[r] = (accumulate ? y[r] : 0) + gate * (W[r] . xn + bias[r]); gate = sigmoid(*gate_logit) when given.
// xn = x, or staged (stage != 0) and then normed when norm_w is given. One warp per row, rows_per_warp rows in turn
// (one staging serves them all: the output head has ~150k rows); blockDim.x = 32 * warps, grid
// ceil(nrows / (warps * rows_per_warp)).
// mv_block is the body for the rows of grid block blk (mv: blockIdx.x; window.cu's mv_tok: blockIdx.y, with x, y and
// gate_logit at its token); every thread of the block calls it (the staging).
template <int QT>
__device__ __forceinline__ void mv_block(int blk, const uint8_t* __restrict__ W, long long row_bytes,
                                         const float* __restrict__ x, float* __restrict__ y,
                                         const float* __restrict__ bias, const float* __restrict__ gate_logit,
                                         int nrows, int ncols, int accumulate, const float* __restrict__ norm_w,
                                         float eps, int stage, int rows_per_warp) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int r0 = blk * rows_per_warp * nw + (threadIdx.x >> 5);
    if (stage) {
        const float* xs;
        // 4 units a lane up front: wo's 4096-wide rows in one round (mv3, with 2048, keeps 2 and its registers)
        const float s = warp_sum(staged_row_dot<QT, 4>(W + (long long)min(r0, nrows - 1) * row_bytes, x, norm_w,
                                                       eps, ncols, lane, xs));
        if (lane == 0 && r0 < nrows) mv_store(r0, s, y, bias, gate_logit, accumulate);
        for (int i = 1; i < rows_per_warp; ++i) {
            const int r = r0 + i * nw;
            if (r >= nrows) break;
            const float t = warp_sum(dot_s<QT>(W + (long long)r * row_bytes, xs, ncols, lane));
            if (lane == 0) mv_store(r, t, y, bias, gate_logit, accumulate);
        }
    } else {
        for (int i = 0; i < rows_per_warp; ++i) {
            const int r = r0 + i * nw;
            if (r >= nrows) break;
            const float t = warp_sum(dotw<QT>(W + (long long)r * row_bytes, x, ncols, lane));
            if (lane == 0) mv_store(r, t, y, bias, gate_logit, accumulate);
        }
    }
}

template <int QT>
__global__ void mv(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                   float* __restrict__ y, const float* __restrict__ bias, const float* __restrict__ gate_logit,
                   int nrows, int ncols, int accumulate, const float* __restrict__ norm_w, float eps, int stage,
                   int rows_per_warp) {
    mv_block<QT>(blockIdx.x, W, row_bytes, x, y, bias, gate_logit, nrows, ncols, accumulate, norm_w, eps, stage,
                 rows_per_warp);
}

// The Q, K and V projections in one launch (one quant type): rows [0, n0) of W0, then W1, then W2; bias optional.
// x staged (normed by norm_w when given); dynamic shared memory staged_bytes(ncols).
// mv3_block: the body for grid block blk (mv3: blockIdx.x, t = 0; window.cu's mv3_tok: blockIdx.y, x at its token t,
// outputs at y0 + t * n0, y1 + t * n1, y2 + t * n2); every thread of the block calls it (the staging).
template <int QT>
__device__ __forceinline__ void mv3_block(int blk, const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                                          const uint8_t* __restrict__ W2, long long row_bytes,
                                          const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                                          float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                                          const float* __restrict__ b0, const float* __restrict__ b1,
                                          const float* __restrict__ b2, int n0, int n1, int n2, int ncols, int t) {
    const int lane = threadIdx.x & 31;
    int r = blk * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const bool valid = r < n0 + n1 + n2;
    if (!valid) r = n0 + n1 + n2 - 1;            // a tail warp re-reads the last row (it must join the staging)
    const uint8_t* W = W0;
    float* y = y0 + (long long)t * n0;
    const float* b = b0;
    if (r >= n0) {
        r -= n0;
        W = W1; y = y1 + (long long)t * n1; b = b1;
        if (r >= n1) {
            r -= n1;
            W = W2; y = y2 + (long long)t * n2; b = b2;
        }
    }
    const float* xs;
    const float s = warp_sum(staged_row_dot<QT>(W + (long long)r * row_bytes, x, norm_w, eps, ncols, lane, xs));
    if (lane == 0 && valid) y[r] = b ? s + b[r] : s;
}

template <int QT>
__global__ void mv3(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, const uint8_t* __restrict__ W2,
                    long long row_bytes, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                    float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                    const float* __restrict__ b0, const float* __restrict__ b1, const float* __restrict__ b2, int n0,
                    int n1, int n2, int ncols) {
    mv3_block<QT>(blockIdx.x, W0, W1, W2, row_bytes, x, norm_w, eps, y0, y1, y2, b0, b1, b2, n0, n1, n2, ncols, 0);
}

// Up to four projections of one input in one launch (one quant type and width; the decode step's hybrid mixers,
// engine/cuda/launch.py mv_many): rows [0, n0) of W0, then n1 of W1, n2 of W2, n3 of W3 (a matrix with no rows is
// absent). x staged, normed by norm_w when given; dynamic shared memory staged_bytes(ncols).
// With conv_w given, matrix conv_m (0..3) is a GDN layer's attn_qkv and its outputs go through the decode step's
// causal conv: channel c = its row r, over conv_state's d_conv - 1 saved inputs (rows of that matrix's row count,
// oldest first) and this one, then silu; the state shifts by one in place (one warp owns a channel). The l2 norms of
// q and k need whole heads, so gdn.cu's gdn_delta_decode applies them (qk_norm): no gdn_conv_decode launch.
// mv4_rows is the body for warp row r (every warp of the block calls it: the staging); mv_mixed.cu's two-type kernel
// calls it for each of its two parts.
template <int QT>
__device__ __forceinline__ void mv4_rows(int r, const uint8_t* W0, const uint8_t* W1, const uint8_t* W2,
                                         const uint8_t* W3, long long row_bytes, const float* __restrict__ x,
                                         const float* __restrict__ norm_w, float eps, float* y0, float* y1, float* y2,
                                         float* y3, int n0, int n1, int n2, int n3, int ncols, float* conv_state,
                                         const float* __restrict__ conv_w, int d_conv, int conv_m) {
    const int lane = threadIdx.x & 31, n = n0 + n1 + n2 + n3;
    const bool valid = r < n;
    if (!valid) r = n - 1;                       // a tail warp re-reads the last row (it must join the staging)
    const uint8_t* W = W0;
    float* y = y0;
    int m = 0, nm = n0;                          // which matrix (warp-uniform) and its rows
    if (r >= n0) {
        r -= n0, W = W1, y = y1, m = 1, nm = n1;
        if (r >= n1) {
            r -= n1, W = W2, y = y2, m = 2, nm = n2;
            if (r >= n2) r -= n2, W = W3, y = y3, m = 3, nm = n3;
        }
    }
    const bool conv = conv_w != nullptr && m == conv_m;
    float st = 0.f, w = 0.f;                     // lane i: saved input i and tap i of channel r, loaded early
    if (conv) {
        if (lane < d_conv - 1) st = conv_state[(long long)lane * nm + r];
        if (lane < d_conv) w = conv_w[(long long)r * d_conv + lane];
    }
    const float* xs;
    const float s = warp_sum(staged_row_dot<QT>(W + (long long)r * row_bytes, x, norm_w, eps, ncols, lane, xs));
    if (!conv) {
        if (lane == 0 && valid) y[r] = s;
        return;
    }
    const float acc = warp_sum((lane < d_conv - 1 ? st : lane == d_conv - 1 ? s : 0.f) * w);
    const float next = __shfl_down_sync(0xffffffffu, st, 1);
    if (valid) {
        if (lane < d_conv - 1) conv_state[(long long)lane * nm + r] = lane + 1 < d_conv - 1 ? next : s;
        if (lane == 0) y[r] = silu(acc);
    }
}

template <int QT>
__global__ void mv4(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, const uint8_t* __restrict__ W2,
                    const uint8_t* __restrict__ W3, long long row_bytes, const float* __restrict__ x,
                    const float* __restrict__ norm_w, float eps, float* __restrict__ y0, float* __restrict__ y1,
                    float* __restrict__ y2, float* __restrict__ y3, int n0, int n1, int n2, int n3, int ncols,
                    float* __restrict__ conv_state, const float* __restrict__ conv_w, int d_conv, int conv_m) {
    mv4_rows<QT>(blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), W0, W1, W2, W3, row_bytes, x, norm_w, eps,
                 y0, y1, y2, y3, n0, n1, n2, n3, ncols, conv_state, conv_w, d_conv, conv_m);
}

// y[r] += W[r] . (x * sigmoid(gate)): a gated attention's output projection (qwen3next / qwen35moe attn_output) with
// its query gate applied as the block stages x (attn_gate.cu's sigmoid_gate_mul, without a launch of its own). One
// warp per row; dynamic shared memory staged_bytes(ncols); x and gate 16-byte aligned, ncols a multiple of 4.
template <int QT>
__global__ void mv_gated(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                         const float* __restrict__ gate, float* __restrict__ y, int nrows, int ncols) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const uint8_t* row = W + (long long)min(r, nrows - 1) * row_bytes;
    float* xs = reinterpret_cast<float*>(strata_smem4);
    auto stage = [&]() {
        for (int i = 4 * threadIdx.x; i < ncols; i += 4 * blockDim.x) {
            float4 v = *reinterpret_cast<const float4*>(x + i);
            const float4 g = *reinterpret_cast<const float4*>(gate + i);
            v.x *= 1.f / (1.f + __expf(-g.x));
            v.y *= 1.f / (1.f + __expf(-g.y));
            v.z *= 1.f / (1.f + __expf(-g.z));
            v.w *= 1.f / (1.f + __expf(-g.w));
            *reinterpret_cast<float4*>(xs + xs_at<QT>(i)) = v;
        }
        __syncthreads();
    };
    float s;
    if constexpr (QT == STRATA_Q_Q4_K) {        // the row's first units go out before the staging, as mv's
        Q4KRaw p[4];
        q4k_preload<4>(row, ncols, lane, p);
        stage();
        s = q4k_finish<4>(p, row, xs, ncols, lane);
    } else {
        stage();
        s = dot_s<QT>(row, xs, ncols, lane);
    }
    s = warp_sum(s);
    if (lane == 0 && r < nrows) y[r] += s;
}

// h[r] = silu(Wg[r] . xn) * (Wu[r] . xn): the gate and up halves of a SwiGLU FFN in one pass. x staged (normed by
// norm_w when given); dynamic shared memory staged_bytes(ncols).
// swiglu_block: the body for grid block blk (swiglu_mv: blockIdx.x; window.cu's swiglu_tok: blockIdx.y, with x and
// h at its token); every thread of the block calls it (the staging).
template <int QT>
__device__ __forceinline__ void swiglu_block(int blk, const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu,
                                             long long row_bytes, const float* __restrict__ x,
                                             const float* __restrict__ norm_w, float eps, float* __restrict__ h,
                                             int nrows, int ncols) {
    const int lane = threadIdx.x & 31;
    const int r = blk * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const uint8_t* rg = Wg + (long long)min(r, nrows - 1) * row_bytes;
    const uint8_t* ru = Wu + (long long)min(r, nrows - 1) * row_bytes;
    float g, u;
    if constexpr (QT == STRATA_Q_Q4_K) {       // the first units' loads go out before the staging
        Q4KRaw p[Q4K_BATCH], q[Q4K_BATCH];
        q4k_preload(rg, ncols, lane, p);
        q4k_preload(ru, ncols, lane, q);
        const float* xs = stage_x<QT>(x, norm_w, eps, ncols);
        q4k_finish2(p, q, rg, ru, xs, ncols, lane, g, u);
    } else {
        const float* xs = stage_x<QT>(x, norm_w, eps, ncols);
        dot2_s<QT>(rg, ru, xs, ncols, lane, g, u);
    }
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0 && r < nrows) h[r] = silu(g) * u;
}

template <int QT>
__global__ void swiglu_mv(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long row_bytes,
                          const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                          float* __restrict__ h, int nrows, int ncols) {
    swiglu_block<QT>(blockIdx.x, Wg, Wu, row_bytes, x, norm_w, eps, h, nrows, ncols);
}

// out[t, :] = dequant(W[tok_t]). Tokens come from `tokens` (device) or, for a decode step, from the step's
// params (then block 0 also copies the step's token and position into device state and clears the argmax word).
template <int QT>
__global__ void embed(const uint8_t* __restrict__ W, long long row_bytes, const int* __restrict__ tokens,
                      const int* __restrict__ params, int* __restrict__ state, float* __restrict__ out, int ncols) {
    const int t = blockIdx.x;
    const int tok = tokens ? tokens[t] : params[P_TOKEN];
    if (!tokens && t == 0 && threadIdx.x == 0) {
        state[0] = params[P_TOKEN];
        state[1] = params[P_POS];
        reinterpret_cast<unsigned long long*>(state + 2)[0] = 0ull;
        state[4] = 0;
    }
    const uint8_t* row = W + (long long)tok * row_bytes;
    constexpr int BV = QTraits<QT>::QK, BB = QTraits<QT>::BYTES;
    for (int g = threadIdx.x; g < ncols / 8; g += blockDim.x) {
        const int i = g * 8;
        float v[8];
        dequant8<QT>(row + (long long)(i / BV) * BB, (i % BV) / 8, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) out[(long long)t * ncols + i + j] = v[j];
    }
}

// out[r, :] = dequant(src row r), rows of a quantized matrix to float (prompt-pass scratch). src may be any
// device-readable address: a VRAM tensor, a VRAM cache slot or the mapped pinned arena.
template <int QT>
__global__ void dequant_rows(const uint8_t* __restrict__ src, long long row_bytes, float* __restrict__ out,
                             int nrows, int ncols) {
    constexpr int BV = QTraits<QT>::QK, BB = QTraits<QT>::BYTES;
    const int groups = ncols / 8;
    const long long total = (long long)nrows * groups;
    for (long long q = blockIdx.x * (long long)blockDim.x + threadIdx.x; q < total;
         q += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(q / groups), i = (int)(q % groups) * 8;
        float v[8];
        dequant8<QT>(src + r * row_bytes + (long long)(i / BV) * BB, (i % BV) / 8, v);
        float* o = out + (long long)r * ncols + i;
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = v[j];
    }
}
