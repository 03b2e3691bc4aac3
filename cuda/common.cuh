// Shared device helpers: warp/block reductions, ceil_div, 16-byte vector access.
// Included by every cuda/<op>.cu (nvcc gets -I cuda/). Header-only, no entry points.
#pragma once
#include <cuda_runtime.h>
#include <float.h>
#include <stdint.h>

#define WARP_SIZE 32

// Programmatic dependent launch (llmc/runtime.py, PDL_ENV: the decode step's graph, or every graph with
// LLMC_PDL=1): a kernel launched with the programmatic stream-serialization attribute may start while the
// kernel before it on the stream is still ending; it must wait here for that kernel's completion and
// memory before touching anything it wrote. Every entry point starts with it (a CPU test checks);
// launched without the attribute it returns at once.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LLMC_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")
#else
#define LLMC_PDL_WAIT() ((void)0)
#endif

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// sum / max over the 32 lanes of a warp; every lane gets the result
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// block-wide sum / max for blockDim.x a multiple of 32 (<= 1024). `shared` needs 32 floats.
// Every thread gets the result. Safe to call twice in a row (the trailing barrier protects shared).
__device__ __forceinline__ float block_reduce_sum(float v, float* shared) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    v = warp_reduce_sum(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? shared[lane] : 0.0f;
    v = warp_reduce_sum(v);
    __syncthreads();
    return v;
}
__device__ __forceinline__ float block_reduce_max(float v, float* shared) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    v = warp_reduce_max(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (lane < nwarps) ? shared[lane] : -FLT_MAX;
    v = warp_reduce_max(v);
    __syncthreads();
    return v;
}

// 16-byte loads/stores; the pointer must be 16-byte aligned (launchers check C % 4 == 0).
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
// streaming load: read once, don't keep in L1 (ld.global.cs)
__device__ __forceinline__ float4 load4_cs(const float* p) { return __ldcs(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ void store4_cs(float* p, float4 v) { __stcs(reinterpret_cast<float4*>(p), v); }

// The ticket of a column reduction finished in the same launch (matmul_backward_bias 4, gelu_backward
// 2's colsum): grid (column blocks, chunks of rows); each block has written its chunk's partial. The
// ticket makes it visible device-wide (fence, then one atomicAdd per block on counters[blockIdx.x])
// and answers, to every thread of the block, whether this block took the last ticket of its column
// block: that block alone goes on to read the gridDim.y partials (the second fence orders those
// reads after the ticket). is_last: a __shared__ bool of the caller's. Every thread of the block
// calls it (it holds two barriers); the last block resets counters[blockIdx.x] when done.
__device__ __forceinline__ bool last_block_ticket(unsigned int* counters, bool& is_last) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) is_last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!is_last) return false;
    __threadfence();
    return true;
}

// GPT-2's GELU, gelu(x) = 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi), in the two forms the
// kernels use; each is the one definition of its form:
//   gelu_fwd          the tanh form (tanhf, not tanh.approx, whose ~1e-3 error would show against
//                     fp64): gelu_forward's fp32 kernels, the decode GEMV's epilogue (cuda/matmul.cu),
//                     GEMM engine 5's fused fc epilogue in fp32 (cuda/gemm_wgmma.cu)
//   gelu_fwd_sigmoid  the same function as x * sigmoid(2u) (0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u))),
//                     with __expf and a fast divide (~2^-21 relative error, far under bf16's 2^-9):
//                     gelu_forward's bf16 kernels and engine 5's fused epilogue in bf16
// The arithmetic around tanhf / __expf is written with explicit rounding (__fmul_rn, __fadd_rn,
// __fmaf_rn), which the compiler never contracts into an fma: with plain * and + (nvcc's default
// -fmad=true) an fma may also swallow the multiply that produced x when the caller's x is a product
// (alpha * acc in a GEMM epilogue without bias), and the fused epilogue would then differ from
// gelu_forward run on the stored value. Written this way, the bits depend on the value of x only.
#define GELU_K 0.7978845608028654f  // sqrt(2/pi)
#define GELU_C 0.044715f

// u = k (x + 0.044715 x^3), as k * fma(0.044715 x x, x, x)
__device__ __forceinline__ float gelu_u(float x) {
    return __fmul_rn(GELU_K, __fmaf_rn(__fmul_rn(__fmul_rn(GELU_C, x), x), x, x));
}

__device__ __forceinline__ float gelu_fwd(float x) {
    return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(gelu_u(x))));
}

// x / (1 + e^(-2u)). For x << 0, e^(-2u) overflows to inf and __fdividef(x, inf) is -0, the right
// limit; for x >> 0 it is x / 1.
__device__ __forceinline__ float gelu_fwd_sigmoid(float x) {
    return __fdividef(x, __fadd_rn(1.0f, __expf(__fmul_rn(-2.0f, gelu_u(x)))));
}

// gelu'(x) in the same two forms, written the same way (explicit rounding: the bits depend on x only,
// so gelu_backward and engine 5's fused dgelu epilogue, cuda/gemm_wgmma.cu, agree bit for bit):
//   gelu_grad          0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3c x^2), t = tanh(u): gelu_backward's fp32 kernels
//   gelu_grad_sigmoid  s + 2 x (s - s^2) k (1 + 3c x^2), s = sigmoid(2u) (1 - t^2 = 4 s (1 - s); s - s^2,
//                      not s (1 - s): s = 0 at e = inf gives 0, not inf * 0): gelu_backward's bf16 kernels
__device__ __forceinline__ float gelu_dudx(float x) {  // k (1 + 3c x^2)
    return __fmul_rn(GELU_K, __fmaf_rn(__fmul_rn(3.0f * GELU_C, x), x, 1.0f));
}

__device__ __forceinline__ float gelu_grad(float x) {
    const float t = tanhf(gelu_u(x));
    const float a = __fmul_rn(0.5f, __fadd_rn(1.0f, t));
    return __fadd_rn(a, __fmul_rn(__fmul_rn(__fmul_rn(0.5f, x), __fsub_rn(1.0f, __fmul_rn(t, t))), gelu_dudx(x)));
}

__device__ __forceinline__ float gelu_grad_sigmoid(float x) {
    const float s = __fdividef(1.0f, __fadd_rn(1.0f, __expf(__fmul_rn(-2.0f, gelu_u(x)))));
    return __fadd_rn(s, __fmul_rn(__fmul_rn(__fmul_rn(2.0f, x), __fsub_rn(s, __fmul_rn(s, s))), gelu_dudx(x)));
}
