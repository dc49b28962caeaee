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
template <int QT>
__global__ void mv(const uint8_t* __restrict__ W, long long row_bytes, const float* __restrict__ x,
                   float* __restrict__ y, const float* __restrict__ bias, const float* __restrict__ gate_logit,
                   int nrows, int ncols, int accumulate, const float* __restrict__ norm_w, float eps, int stage,
                   int rows_per_warp) {
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const float* xs = stage ? stage_x<QT>(x, norm_w, eps, ncols) : x;
    for (int i = 0; i < rows_per_warp; ++i) {
        const int r = (blockIdx.x * rows_per_warp + i) * nw + (threadIdx.x >> 5);
        if (r >= nrows) break;
        const uint8_t* row = W + (long long)r * row_bytes;
        float s = warp_sum(stage ? dot_s<QT>(row, xs, ncols, lane) : dotw<QT>(row, x, ncols, lane));
        if (lane == 0) {
            if (bias) s += bias[r];
            if (gate_logit) s *= 1.f / (1.f + __expf(-gate_logit[0]));
            y[r] = accumulate ? y[r] + s : s;
        }
    }
}

// The Q, K and V projections in one launch (one quant type): rows [0, n0) of W0, then W1, then W2; bias optional.
// x staged (normed by norm_w when given); dynamic shared memory staged_bytes(ncols).
template <int QT>
__global__ void mv3(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1, const uint8_t* __restrict__ W2,
                    long long row_bytes, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                    float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                    const float* __restrict__ b0, const float* __restrict__ b1, const float* __restrict__ b2, int n0,
                    int n1, int n2, int ncols) {
    const int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const float* xs = stage_x<QT>(x, norm_w, eps, ncols);
    const uint8_t* W = W0;
    float* y = y0;
    const float* b = b0;
    if (r >= n0) {
        r -= n0;
        W = W1; y = y1; b = b1;
        if (r >= n1) {
            r -= n1;
            W = W2; y = y2; b = b2;
            if (r >= n2) return;
        }
    }
    float s = warp_sum(dot_s<QT>(W + (long long)r * row_bytes, xs, ncols, lane));
    if (lane == 0) y[r] = b ? s + b[r] : s;
}

// h[r] = silu(Wg[r] . xn) * (Wu[r] . xn): the gate and up halves of a SwiGLU FFN in one pass. x staged (normed by
// norm_w when given); dynamic shared memory staged_bytes(ncols).
template <int QT>
__global__ void swiglu_mv(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu, long long row_bytes,
                          const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                          float* __restrict__ h, int nrows, int ncols) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const float* xs = stage_x<QT>(x, norm_w, eps, ncols);
    if (r >= nrows) return;
    float g, u;
    dot2_s<QT>(Wg + (long long)r * row_bytes, Wu + (long long)r * row_bytes, xs, ncols, lane, g, u);
    g = warp_sum(g);
    u = warp_sum(u);
    if (lane == 0) h[r] = silu(g) * u;
}

// out[t, :] = dequant(W[tok_t]). Tokens come from `tokens` (device) or, for a decode step, from the mapped host
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
