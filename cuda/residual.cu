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
//
// bf16 builds (<name>_bf16): out = bf16(float(inp1) + float(inp2)), one rounding. Variant 1 one
// thread per element; variant 2 one thread per 16 bytes (8 bf16), a scalar tail, any N. 18.9 MB at
// the size above (6.3 us at 2.98 TB/s): here the ~5 us of launch and tail weigh as much as the bytes.
#include "common.cuh"
#include "elem.cuh"

// out (N), inp1 (N), inp2 (N)
extern "C" __global__ void residual_forward_kernel1(float* out, const float* inp1, const float* inp2, int N) {
    LLMC_PDL_WAIT();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = inp1[i] + inp2[i];
}

// out, inp1, inp2 16-byte aligned; N % 4 == 0 (the launcher refuses otherwise)
extern "C" __global__ void residual_forward_kernel2(float* out, const float* inp1, const float* inp2, int N) {
    LLMC_PDL_WAIT();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N / 4) {
        float4 a = load4(inp1 + 4 * i), b = load4(inp2 + 4 * i);
        store4(out + 4 * i, make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w));
    }
}

// ----------------------------------------------------------------------------------------------
// bf16 builds, templated on the element type (only the bf16 instantiations have entry points)

template <typename T>
__device__ __forceinline__ void residual_forward1(T* out, const T* inp1, const T* inp2, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) out[i] = from_f32<T>(to_f32(inp1[i]) + to_f32(inp2[i]));
}

// one thread per 16 bytes, elements [V*i, V*i + V); the last thread takes the n < V left over.
// out may be inp1 or inp2: both loads come before the store, and no other thread touches these.
template <typename T>
__device__ __forceinline__ void residual_forward2(T* out, const T* inp1, const T* inp2, int N) {
    constexpr int V = Vec16<T>::N;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const long e = (long)i * V;
    if (e >= N) return;
    const int n = min(V, (int)(N - e));
    float a[V], b[V];
    load_vec<T>(a, inp1 + e, n == V, n);
    load_vec<T>(b, inp2 + e, n == V, n);
#pragma unroll
    for (int k = 0; k < V; k++) a[k] += b[k];
    store_vec<T>(out + e, a, n == V, n);
}

extern "C" __global__ void residual_forward_kernel1_bf16(bf16* out, const bf16* inp1, const bf16* inp2, int N) {
    LLMC_PDL_WAIT();
    residual_forward1<bf16>(out, inp1, inp2, N);
}
extern "C" __global__ void residual_forward_kernel2_bf16(bf16* out, const bf16* inp1, const bf16* inp2, int N) {
    LLMC_PDL_WAIT();
    residual_forward2<bf16>(out, inp1, inp2, N);
}
