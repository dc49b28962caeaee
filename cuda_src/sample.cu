// Greedy sampling on the GPU: the argmax of the logits as one 64-bit word per step (sortable value bits high,
// inverted index low, so ties pick the lowest id as numpy's argmax does), then the id goes to mapped host memory.
#include "common.cuh"

__device__ __forceinline__ unsigned int sortable(float v) {
    const unsigned int b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Grid-stride over n logits; state[2..3] holds the running word (cleared by the step's embed kernel),
// state[4] counts NaNs.
extern "C" __global__ void argmax_word(const float* __restrict__ logits, int n, int* __restrict__ state) {
    unsigned long long best = 0ull;
    int nan = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const float v = logits[i];
        if (v != v) { nan = 1; continue; }
        const unsigned long long w = ((unsigned long long)sortable(v) << 32) | (0xffffffffu - (unsigned int)i);
        best = w > best ? w : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long ob = __shfl_xor_sync(0xffffffffu, best, o);
        best = ob > best ? ob : best;
        nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicMax(reinterpret_cast<unsigned long long*>(state + 2), best);
        if (nan) atomicAdd(state + 4, 1);
    }
}

// One thread: out_host[0] = chosen id, out_host[1] = NaN count (mapped pinned memory, read after the step).
extern "C" __global__ void argmax_finish(const int* __restrict__ state, int* __restrict__ out_host) {
    const unsigned long long w = reinterpret_cast<const unsigned long long*>(state + 2)[0];
    out_host[0] = (int)(0xffffffffu - (unsigned int)(w & 0xffffffffull));
    out_host[1] = state[4];
}
