// matvec.cu: y = W x for one to eight activation vectors, W in any GGUF quant type (one module per type: -DSTRATA_QT=<id>).
// A warp per output row, fp32 accumulation; lanes walk the row in 8-element chunks (quant.cuh dot_row*).
//   W: nrows rows of row_stride bytes (row_stride >= the row's ncols/QK blocks), 16-byte aligned
//   x: NV vectors of ncols floats, vector v at x + v*ldx;  y: vector v's nrows outputs at y + v*ldy
// @build per-qtype
#include "quant.cuh"

#ifndef STRATA_QT
#error "compile matvec.cu with -DSTRATA_QT=<ggml type id> (engine/cuda/kernels.py does)"
#endif

#define MV_WARPS 4  // rows per block of 128 threads

template <int NV>
__device__ __forceinline__ void matvec_body(const uint8_t* __restrict__ W, long long row_stride,
                                            const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
                                            int nrows, int ncols) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    if (row >= nrows) return;
    const uint8_t* r = W + (long long)row * row_stride;
    float acc[NV];
    if (NV == 1) {
        acc[0] = dot_row<STRATA_QT>(r, x, ncols, lane);
    } else {
#pragma unroll
        for (int n = 0; n < NV; n++) acc[n] = 0.f;
        dot_row_nv<STRATA_QT, NV>(r, x, ldx, ncols, lane, acc);
    }
#pragma unroll
    for (int n = 0; n < NV; n++) {
        const float s = strata_warp_sum(acc[n]);
        if (lane == n) y[(long long)n * ldy + row] = s;
    }
}

#define STRATA_MATVEC(NV)                                                                                        \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)                                                 \
    matvec_nv##NV(const uint8_t* __restrict__ W, long long row_stride, const float* __restrict__ x, int ldx,   \
                  float* __restrict__ y, int ldy, int nrows, int ncols) {                                       \
        matvec_body<NV>(W, row_stride, x, ldx, y, ldy, nrows, ncols);                                           \
    }
STRATA_MATVEC(1)
STRATA_MATVEC(2)
STRATA_MATVEC(3)
STRATA_MATVEC(4)
STRATA_MATVEC(5)
STRATA_MATVEC(6)
STRATA_MATVEC(7)
STRATA_MATVEC(8)
