// Hyper-connections (qwen4exp: ../shared/qwen4exp.md 4.2 read, 4.3 write, 4.9 head) for one token (decode) or T
// tokens (prompt). The residual is H streams of N floats a token (D = H N, fp32, stream-major: stream c of row t at
// x[t * ld_x + c N]). NumPy reference: engine/arch/qwen4exp.py (group_rms_norm, hc_read, hc_write); launch
// wrappers and every buffer's layout: engine/cuda/hc.py.
//
// A read is   u = GroupNorm_H(x); d = W_down u; e = W_inj u; a = silu(d / H); s = W_up a;
//             y = (1/H) sum_c sigmoid(s_c) u_c; iota = 2 sigmoid(e / H)
// and a write x_c += iota_c o. The mat-vecs / GEMMs of W_down and W_inj (one input: dense.cu mv4 through
// Launcher.mv_many, or the prompt's cuBLAS GEMM) are the engine's; the kernels here are the rest:
//   hc_write_norm   the previous half-layer's write (and an optional add, the PLE layer's) fused with this read's
//                   GroupNorm: one launch per half-layer boundary, decode and prompt alike;
//   hc_up_mix<QT>   decode: a = silu(d / H) staged, the H rows n, N + n, .. of W_up a warp, the sigmoid mix into
//                   y[n] and iota, so a read is 3 launches (write_norm, mv4 of down and inject, up_mix);
//   hc_act_rows     prompt: a = silu(d / H) for T rows (fp32 and/or fp16 for the W_up GEMM);
//   hc_mix_rows     prompt: y and iota from the W_up GEMM's (T, D) output and the inject GEMM's (T, H).
#include "quant.cuh"
#include "common.cuh"


__device__ __forceinline__ float hc_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// Grid (H, T), block a multiple of 32 (256). Stream c = blockIdx.x of row t = blockIdx.y:
//   x_c += iota[t H + c] * o[t]      when o is given (o rows of ld_o floats, N used; iota (T, H) contiguous)
//   x_c += add[t][c N ..]            when add is given (rows of ld_add floats, D used)
//   (x written back when either is given)
//   u_c = x_c / sqrt(mean(x_c^2) + eps) * gamma_c   into u (rows of D floats) and/or u16 (fp16, rows of D), when given.
// Every thread re-reads only the elements it wrote itself, so x may be updated in place without a barrier.
extern "C" __global__ void hc_write_norm(float* __restrict__ x, long long ld_x, const float* __restrict__ o,
                                         long long ld_o, const float* __restrict__ iota,
                                         const float* __restrict__ add, long long ld_add,
                                         const float* __restrict__ gamma, float* __restrict__ u,
                                         unsigned short* __restrict__ u16, int N, int H, float eps) {
    __shared__ float buf[32];
    const int c = blockIdx.x, t = blockIdx.y;
    float* xr = x + t * ld_x + (long long)c * N;
    const float* orow = o ? o + t * ld_o : nullptr;
    const float* arow = add ? add + t * ld_add + (long long)c * N : nullptr;
    const float w = o ? iota[(long long)t * H + c] : 0.f;
    float ss = 0.f;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        float v = xr[i];
        if (orow) v += w * orow[i];
        if (arow) v += arow[i];
        if (orow || arow) xr[i] = v;
        ss += v * v;
    }
    if (!u && !u16) return;                      // block-uniform: a plain write
    const float inv = rsqrtf(block_sum(ss, buf) / N + eps);
    const float* g = gamma + (long long)c * N;
    float* ur = u ? u + (long long)t * H * N + (long long)c * N : nullptr;
    unsigned short* hr = u16 ? u16 + (long long)t * H * N + (long long)c * N : nullptr;
    for (int i = threadIdx.x; i < N; i += blockDim.x) {
        const float v = xr[i] * inv * g[i];
        if (ur) ur[i] = v;
        if (hr) hr[i] = f2h(v);
    }
}

// Decode: grid ceil(N / warps), block 32 * warps, dynamic shared memory 4 R bytes (16-byte aligned: R a multiple
// of 8, as every quant type's rows are). W_up (D rows of R in quant type QT, row_bytes apart); d (R,) = W_down u;
// u (D,) the normed streams (hc_write_norm). Warp n: y[n] = (1/H) sum_c sigmoid(W_up[c N + n] . a) u[c N + n], the
// H rows read together (quant.cuh dot_rows, each staged chunk of a loaded once). With inj given ((H,) = W_inj u),
// block 0 also writes iota[c] = 2 sigmoid(inj[c] / H); the head (4.9) passes none.
template <int QT>
__global__ void hc_up_mix(const uint8_t* __restrict__ W_up, long long row_bytes, const float* __restrict__ d,
                          const float* __restrict__ inj, const float* __restrict__ u, float* __restrict__ y,
                          float* __restrict__ iota, int N, int H, int R) {
    float* as = reinterpret_cast<float*>(strata_smem4);
    const float inv_h = 1.f / (float)H;
    for (int i = threadIdx.x; i < R; i += blockDim.x) as[i] = silu(d[i] * inv_h);
    if (inj && blockIdx.x == 0 && threadIdx.x < H) iota[threadIdx.x] = 2.f * hc_sigmoid(inj[threadIdx.x] * inv_h);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;                           // after the only barrier
    float acc = 0.f;
    if (H == 4) {
        const uint8_t* rows[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) rows[c] = W_up + ((long long)c * N + n) * row_bytes;
        float part[4][1] = {{0.f}, {0.f}, {0.f}, {0.f}};
        dot_rows<QT, 4, 1>(rows, as, 0, R, lane, part);
#pragma unroll
        for (int c = 0; c < 4; ++c) acc += hc_sigmoid(warp_sum(part[c][0])) * u[(long long)c * N + n];
    } else {
        for (int c = 0; c < H; ++c) {
            const float s = warp_sum(dot_row<QT>(W_up + ((long long)c * N + n) * row_bytes, as, R, lane));
            acc += hc_sigmoid(s) * u[(long long)c * N + n];
        }
    }
    if (lane == 0) y[n] = acc * inv_h;
}

// Prompt: grid ceil(T R / 256), block 256. a = silu(d / H) for T rows: d rows of ld_d floats (R used); out (T, R)
// fp32 and/or out16 (T, R) fp16, when given.
extern "C" __global__ void hc_act_rows(const float* __restrict__ d, long long ld_d, float* __restrict__ out,
                                       unsigned short* __restrict__ out16, int T, int R, int H) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * R) return;
    const long long t = i / R, j = i % R;
    const float a = silu(d[t * ld_d + j] * (1.f / (float)H));
    if (out) out[i] = a;
    if (out16) out16[i] = f2h(a);
}

// Prompt: grid (ceil(N / 256), T), block 256. Row t: y[t][n] = (1/H) sum_c sigmoid(s[t][c N + n]) u[t][c N + n]
// (s rows of ld_s floats, D used: the W_up GEMM; u rows of D, fp32); y rows of ld_y floats. With inj given (rows of
// ld_inj floats, H used: the W_inj GEMM), iota (T, H) = 2 sigmoid(inj / H), written by the blocks of x index 0.
extern "C" __global__ void hc_mix_rows(const float* __restrict__ s, long long ld_s, const float* __restrict__ u,
                                       const float* __restrict__ inj, long long ld_inj, float* __restrict__ y,
                                       long long ld_y, float* __restrict__ iota, int N, int H) {
    const int t = blockIdx.y, n = blockIdx.x * blockDim.x + threadIdx.x;
    const float inv_h = 1.f / (float)H;
    if (inj && blockIdx.x == 0 && threadIdx.x < H)
        iota[(long long)t * H + threadIdx.x] = 2.f * hc_sigmoid(inj[t * ld_inj + threadIdx.x] * inv_h);
    if (n >= N) return;
    const float* sr = s + t * ld_s;
    const float* ur = u + (long long)t * H * N;
    float acc = 0.f;
    for (int c = 0; c < H; ++c) acc += hc_sigmoid(sr[(long long)c * N + n]) * ur[(long long)c * N + n];
    y[t * ld_y + n] = acc * inv_h;
}
