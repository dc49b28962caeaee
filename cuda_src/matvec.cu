// matvec.cu: y = W x for one to eight activation vectors, W in any GGUF quant type (one module per type:
// -DSTRATA_QT=<id>). A warp per R consecutive output rows, fp32 accumulation; lanes walk the rows in 8-element chunks
// and load each x chunk once for the R rows (quant.cuh dot_rows).
//   W: nrows rows of row_stride bytes (row_stride >= the row's ncols/QK blocks), 16-byte aligned
//   x: NV vectors of ncols floats, vector v at x + v*ldx (16-byte aligned);  y: vector v's outputs at y + v*ldy
// Kernels matvec_r<R>_nv<NV>; launch blockDim 128 (4 warps), grid ceil(nrows / (4*R)). bench/matvec.py's
// matvec_plan() picks R from the measurements (docs/experiments.md); MATVEC_ROWS there lists these instantiations.
// @build per-qtype
#include "quant.cuh"

#ifndef STRATA_QT
#error "compile matvec.cu with -DSTRATA_QT=<ggml type id> (engine/cuda/kernels.py does)"
#endif

#define MV_WARPS 4

template <int R, int NV>
__device__ __forceinline__ void matvec_body(const uint8_t* __restrict__ W, long long row_stride,
                                            const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
                                            int nrows, int ncols) {
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * MV_WARPS + (threadIdx.x >> 5)) * R;
    if (row0 >= nrows) return;
    const uint8_t* rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) rows[r] = W + (long long)min(row0 + r, nrows - 1) * row_stride;  // tail: re-read
    float acc[R][NV];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int n = 0; n < NV; n++) acc[r][n] = 0.f;
    dot_rows<STRATA_QT, R, NV>(rows, x, ldx, ncols, lane, acc);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int n = 0; n < NV; n++) {
            const float s = strata_warp_sum(acc[r][n]);
            if (lane == 0 && row0 + r < nrows) y[(long long)n * ldy + row0 + r] = s;
        }
}

#define STRATA_MATVEC(R, NV)                                                                                     \
    extern "C" __global__ void __launch_bounds__(MV_WARPS * 32)                                                 \
    matvec_r##R##_nv##NV(const uint8_t* __restrict__ W, long long row_stride, const float* __restrict__ x,     \
                         int ldx, float* __restrict__ y, int ldy, int nrows, int ncols) {                       \
        matvec_body<R, NV>(W, row_stride, x, ldx, y, ldy, nrows, ncols);                                        \
    }
STRATA_MATVEC(1, 1)
STRATA_MATVEC(2, 1)
STRATA_MATVEC(4, 1)
STRATA_MATVEC(1, 2)
STRATA_MATVEC(2, 2)
STRATA_MATVEC(1, 3)
STRATA_MATVEC(2, 3)
STRATA_MATVEC(1, 4)
STRATA_MATVEC(2, 4)
STRATA_MATVEC(1, 5)
STRATA_MATVEC(2, 5)
STRATA_MATVEC(1, 6)
STRATA_MATVEC(2, 6)
STRATA_MATVEC(1, 7)
STRATA_MATVEC(2, 7)
STRATA_MATVEC(1, 8)
STRATA_MATVEC(2, 8)
