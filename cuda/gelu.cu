// GELU, GPT-2's tanh approximation, elementwise over N floats:
//   gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))),  k = sqrt(2/pi)
//   gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) k (1 + 3*0.044715 x^2),  u = k (x + 0.044715 x^3)
//
// gelu_forward (--gelu-kernel N):
//   1  one thread per element (any N)
//   2  one thread per 4 elements, float4 loads/stores (N % 4 == 0)
// gelu_backward (--gelu-backward-kernel N): dinp = gelu'(inp) * dout (overwrites dinp)
//   1  one thread per element (any N)
//   2  one thread per 4 elements, float4 loads/stores (N % 4 == 0)
//
// gelu_backward may run in place (dinp == dout): each thread reads its own elements of dout before
// writing the same elements of dinp, and nothing else touches them; no __restrict__ on that pair.
// tanhf, not the fast tanh.approx: its ~1e-3 relative error would show against the fp64 reference.
// Memory traffic at N = B*T*4C = 4*1024*3072 (12.6M floats): forward reads + writes 100.7 MB
// (33.8 us at 2.98 TB/s); backward reads 2 and writes 1: 151 MB (50.7 us).
// Measured on the lent H100 (dev/cuda lab: median of 30, L2 flushed before each, best block size):
//   forward   1: 48.8 us (2.06 TB/s)   2: 37.7 us (2.67 TB/s)
//   backward  1: 63.6 us (2.37 TB/s)   2: 54.9 us (2.75 TB/s)
#include "common.cuh"

// gelu_fwd, GELU_K and GELU_C live in common.cuh (the decode GEMV applies gelu_fwd in its epilogue)

__device__ __forceinline__ float gelu_grad(float x) {
    float u = GELU_K * (x + GELU_C * x * x * x);
    float t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
}

// ----------------------------------------------------------------------------------------------
// gelu_forward: out (N), inp (N)

extern "C" __global__ void gelu_forward_kernel1(float* out, const float* inp, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = gelu_fwd(inp[i]);
}

extern "C" __global__ void gelu_forward_kernel2(float* out, const float* inp, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N / 4) {
        float4 x = load4(inp + 4 * i);
        store4(out + 4 * i, make_float4(gelu_fwd(x.x), gelu_fwd(x.y), gelu_fwd(x.z), gelu_fwd(x.w)));
    }
}

// ----------------------------------------------------------------------------------------------
// gelu_backward: dinp (N) =, inp (N), dout (N); dinp may be dout

extern "C" __global__ void gelu_backward_kernel1(float* dinp, const float* inp, const float* dout, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) dinp[i] = gelu_grad(inp[i]) * dout[i];
}

extern "C" __global__ void gelu_backward_kernel2(float* dinp, const float* inp, const float* dout, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N / 4) {
        float4 x = load4(inp + 4 * i), d = load4(dout + 4 * i);
        store4(dinp + 4 * i, make_float4(gelu_grad(x.x) * d.x, gelu_grad(x.y) * d.y,
                                         gelu_grad(x.z) * d.z, gelu_grad(x.w) * d.w));
    }
}
