// The gated attention's output gate (qwen3next / qwen35moe, engine/arch/qwen3next.py gated_attention): each value of
// the attention output times sigmoid of its gate value, which the q projection's second half of each head gave.
// y, g: n floats (T rows of n_head * head_dim); y[i] *= sigmoid(g[i]) in place. Grid-stride, any n.
extern "C" __global__ void sigmoid_gate_mul(float* __restrict__ y, const float* __restrict__ g, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] *= 1.f / (1.f + __expf(-g[i]));
}
