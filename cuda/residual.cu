// Residual connection: out = inp1 + inp2, elementwise over N floats.
//
// residual_forward (--residual-kernel N):
//   1  one thread per element (any N)
//   2  one thread per 4 elements, float4 loads/stores (N % 4 == 0)
//
// out may alias inp1 or inp2 (the model keeps a running loss sum with loss_acc = loss_acc + losses):
// every thread reads its elements before it writes them and no thread touches another's, so no
// __restrict__ on these pointers.
// Memory traffic: read 2N, write N floats. At N = B*T*C = 4*1024*768: 37.7 MB, 12.7 us at 2.98 TB/s.
// Measured on the lent H100 (dev/cuda lab: median of 30, L2 flushed before each, best block size):
//   1: 19.7 us (1.92 TB/s)   2: 17.6 us (2.14 TB/s). Every kernel in the lab shows ~5 us on top of
//   bytes / 3.1 TB/s (launch, ramp-up and tail); at this size that is what keeps 2 under 2.5 TB/s.
#include "common.cuh"

// out (N), inp1 (N), inp2 (N)
extern "C" __global__ void residual_forward_kernel1(float* out, const float* inp1, const float* inp2, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = inp1[i] + inp2[i];
}

// out, inp1, inp2 16-byte aligned; N % 4 == 0 (the launcher refuses otherwise)
extern "C" __global__ void residual_forward_kernel2(float* out, const float* inp1, const float* inp2, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N / 4) {
        float4 a = load4(inp1 + 4 * i), b = load4(inp2 + 4 * i);
        store4(out + 4 * i, make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w));
    }
}
