// The decode step's shared-input projections (dense.cu mv4) when one matrix's quant type differs from the others'
// (llama-quantize's Q4_K_M gives attn_qkv or attn_v Q6_K on some layers, the rest Q4_K): matrix 0 in type QG, up to
// three more in type QU, in one launch. Blocks [0, ceil(n0 / 4)) take matrix 0 and the rest the others, so each
// block stages x once for its one type. Matrix conv_m (0..3, or any other value for none) gets mv4's conv epilogue.
// Loaded apart from the engine's table, for the type pairs a model needs (engine/cuda/launch.py load_mixed); launch
// blockDim 128, grid ceil(n0 / 4) + ceil((n1 + n2 + n3) / 4), dynamic shared memory staged_bytes(ncols) (the larger
// of the two types' layouts: Q4_K's padded one).
#include "dense.cu"

template <int QG, int QU>
__global__ void mv4_mixed(const uint8_t* __restrict__ W0, const uint8_t* __restrict__ W1,
                          const uint8_t* __restrict__ W2, const uint8_t* __restrict__ W3, long long rb0, long long rb,
                          const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                          float* __restrict__ y0, float* __restrict__ y1, float* __restrict__ y2,
                          float* __restrict__ y3, int n0, int n1, int n2, int n3, int ncols,
                          float* __restrict__ conv_state, const float* __restrict__ conv_w, int d_conv, int conv_m) {
    const int nw = blockDim.x >> 5, warp = threadIdx.x >> 5, b0 = (n0 + nw - 1) / nw;
    if ((int)blockIdx.x < b0)           // block-uniform: one type's staging a block
        mv4_rows<QG>(blockIdx.x * nw + warp, W0, nullptr, nullptr, nullptr, rb0, x, norm_w, eps, y0, nullptr,
                     nullptr, nullptr, n0, 0, 0, 0, ncols, conv_state, conv_w, d_conv, conv_m);
    else
        mv4_rows<QU>((blockIdx.x - b0) * nw + warp, W1, W2, W3, nullptr, rb, x, norm_w, eps, y1, y2, y3, nullptr,
                     n1, n2, n3, 0, ncols, conv_state, conv_w, d_conv, conv_m - 1);
}
