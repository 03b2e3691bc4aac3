// Fused residual + layernorm forward, the pair GPT-2 runs twice per layer:
//   residual = inp1 + inp2;  out = layernorm(residual) with weight, bias; eps = 1e-5, biased var.
//
// residual_layernorm_forward (--residual-layernorm-kernel N):
//   1  the baseline: residual_forward then layernorm_forward as two launches (cuda/residual.cu and
//      cuda/layernorm.cu: their float4 variants when C % 4 == 0, else the scalar ones); residual is
//      written by the first and read back from DRAM/L2 by the second
//   2  fused, one warp per row, scalar loads (any C): pass 1 adds and writes residual while summing,
//      passes 2 and 3 re-read this lane's own residual values (L1 hits) for the variance and output
//   3  fused, one warp per row, float4, the residual row held in registers: inp1 and inp2 read once,
//      residual and out written once (C % 4 == 0, C <= 2048)
//
// Memory traffic at N = 4096, C = 768: reads inp1, inp2 and writes residual, out: 4 * 12.6 MB =
// 50.3 MB (16.9 us at 2.98 TB/s). The unfused baseline moves 75.5 MB (it reads residual again).
// Measured on the lent H100 (dev/cuda lab: median of 30, L2 flushed before each, best block size):
//   1: 26.1 us (1.93 TB/s counting the fused bytes)   2: 31.4 us (1.60 TB/s)   3: 21.3 us (2.36 TB/s)
//
// bf16 builds (entry points <name>_bf16[_nvN]): inp1, inp2, residual, out, weight, bias bf16; mean
// and rstd fp32. residual = bf16(inp1 + inp2) is rounded first, and the statistics and out are
// those of the rounded residual: the layernorm of exactly the tensor that is stored, the one
// layernorm_backward later reads back with these mean and rstd. Variant 2 scalar (any C); variant 3
// 16-byte vectors of 8 bf16, NV = ceil(C/256) <= 8 per lane, guarded scalar accesses when
// C % 8 != 0. 25.2 MB at N = 4096, C = 768 (8.4 us at 2.98 TB/s).
#include "layernorm.cuh"  // LN_EPS, hsum4, ln_row_stats, the templated row helpers (common.cuh, elem.cuh)

// variant 2: scalar, any C; passes 2 and 3 re-read this lane's own residual values (L1 hits). T: float
// or bf16 (to_f32 and from_f32 of a float are the value itself)
template <typename T>
__device__ __forceinline__ void residual_layernorm_forward2_t(T* residual, T* out, float* mean,
        float* rstd, const T* inp1, const T* inp2, const T* weight, const T* bias, int N, int C) {
    int lane = threadIdx.x % WARP_SIZE;
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) return;
    const size_t off = (size_t)row * C;
    const T* a = inp1 + off;
    const T* b = inp2 + off;
    T* r = residual + off;
    float sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        T v = from_f32<T>(to_f32(a[c]) + to_f32(b[c]));
        r[c] = v;
        sum += to_f32(v);
    }
    const float m = warp_reduce_sum(sum) / C;
    float var = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) { float d = to_f32(r[c]) - m; var += d * d; }
    const float s = rsqrtf(warp_reduce_sum(var) / C + LN_EPS);
    T* o = out + off;
    for (int c = lane; c < C; c += WARP_SIZE)
        o[c] = from_f32<T>((to_f32(r[c]) - m) * s * to_f32(weight[c]) + to_f32(bias[c]));
    if (lane == 0) { mean[row] = m; rstd[row] = s; }
}

// residual (N,C) =, out (N,C) =, mean (N) =, rstd (N) =, inp1 (N,C), inp2 (N,C), weight (C), bias (C)
extern "C" __global__ void residual_layernorm_forward_kernel2(float* residual, float* out, float* mean,
        float* rstd, const float* inp1, const float* inp2, const float* weight, const float* bias,
        int N, int C) {
    LLMC_PDL_WAIT();
    residual_layernorm_forward2_t<float>(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C);
}

template <int NV>
__device__ __forceinline__ void residual_layernorm_forward3(float* residual, float* out, float* mean,
        float* rstd, const float* inp1, const float* inp2, const float* weight, const float* bias,
        int N, int C) {
    int lane = threadIdx.x % WARP_SIZE;
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) return;
    const int C4 = C / 4;
    const size_t off = (size_t)row * C;
    float4 v[NV];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) {  // 2*NV 16-byte loads in flight per lane
        int c4 = lane + i * WARP_SIZE;
        if (c4 < C4) {
            float4 x = load4(inp1 + off + 4 * c4), y = load4(inp2 + off + 4 * c4);
            v[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
            store4(residual + off + 4 * c4, v[i]);
            sum += (v[i].x + v[i].y) + (v[i].z + v[i].w);
        }
    }
    float m, s;
    ln_row_stats<NV>(v, sum, lane, C4, C, m, s);
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int c4 = lane + i * WARP_SIZE;
        if (c4 < C4) {
            float4 w = load4(weight + 4 * c4), b = load4(bias + 4 * c4), o;
            o.x = (v[i].x - m) * s * w.x + b.x;
            o.y = (v[i].y - m) * s * w.y + b.y;
            o.z = (v[i].z - m) * s * w.z + b.z;
            o.w = (v[i].w - m) * s * w.w + b.w;
            store4(out + off + 4 * c4, o);
        }
    }
    if (lane == 0) { mean[row] = m; rstd[row] = s; }
}

// entry points per NV = ceil(C / 128), as in cuda/layernorm.cu
#define RLN_ENTRY(NV)                                                                                 \
    extern "C" __global__ void residual_layernorm_forward_kernel3_nv##NV(float* residual, float* out, \
            float* mean, float* rstd, const float* inp1, const float* inp2, const float* weight,       \
            const float* bias, int N, int C) { LLMC_PDL_WAIT();                                        \
        residual_layernorm_forward3<NV>(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C);    \
    }
RLN_ENTRY(1) RLN_ENTRY(2) RLN_ENTRY(3) RLN_ENTRY(4) RLN_ENTRY(5) RLN_ENTRY(6) RLN_ENTRY(7) RLN_ENTRY(8)
RLN_ENTRY(9) RLN_ENTRY(10) RLN_ENTRY(11) RLN_ENTRY(12) RLN_ENTRY(13) RLN_ENTRY(14) RLN_ENTRY(15)
RLN_ENTRY(16)

// ----------------------------------------------------------------------------------------------
// bf16 builds, templated on the element type T (variant 3's template has bf16 entry points only)

// variant 3: the residual row in registers (as fp32 of its rounded values), residual and out written
// once. All 2*NV 16-byte loads of the row are issued (held packed) before the first residual store:
// with the stores in the same loop the compiler may not move later loads above them (residual might
// alias an input, as far as it knows), leaving two loads in flight per lane.
template <typename T, int NV>
__device__ __forceinline__ void residual_layernorm_forward3_t(T* residual, T* out, float* mean,
        float* rstd, const T* inp1, const T* inp2, const T* weight, const T* bias, int N, int C) {
    constexpr int V = Vec16<T>::N;
    typedef typename Vec16<T>::raw raw;
    int lane = threadIdx.x % WARP_SIZE;
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) return;
    const bool vec = C % V == 0;
    const size_t off = (size_t)row * C;
    raw ra[NV], rb[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) { ra[i] = load_raw<T>(inp1 + off + c0, vec, C - c0); rb[i] = load_raw<T>(inp2 + off + c0, vec, C - c0); }
    }
    float v[NV][V];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) {
            float b[V];
            Vec16<T>::unpack(v[i], ra[i]);
            Vec16<T>::unpack(b, rb[i]);
#pragma unroll
            for (int k = 0; k < V; k++) v[i][k] += b[k];  // zeros past C (!vec): they add nothing
            round_to<T>(v[i]);  // the stored residual's values: the store below is then exact
            store_vec<T>(residual + off + c0, v[i], vec, C - c0);
#pragma unroll
            for (int k = 0; k < V; k++) sum += v[i][k];
        }
    }
    float m, s;
    ln_row_stats_v<NV, V>(v, sum, lane, C, m, s);
    ln_row_normalize_store<T, NV, false>(out + off, v, m, s, weight, bias, lane, C, vec);
    if (lane == 0) { mean[row] = m; rstd[row] = s; }
}

extern "C" __global__ void residual_layernorm_forward_kernel2_bf16(bf16* residual, bf16* out, float* mean,
        float* rstd, const bf16* inp1, const bf16* inp2, const bf16* weight, const bf16* bias, int N, int C) {
    LLMC_PDL_WAIT();
    residual_layernorm_forward2_t<bf16>(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C);
}

// entry points per NV = ceil(C / 256), NV <= 8 (C <= 2048)
#define RLN_ENTRY_BF16(NV)                                                                            \
    extern "C" __global__ void residual_layernorm_forward_kernel3_bf16_nv##NV(bf16* residual, bf16* out, \
            float* mean, float* rstd, const bf16* inp1, const bf16* inp2, const bf16* weight,          \
            const bf16* bias, int N, int C) { LLMC_PDL_WAIT();                                         \
        residual_layernorm_forward3_t<bf16, NV>(residual, out, mean, rstd, inp1, inp2, weight, bias, N, C); \
    }
RLN_ENTRY_BF16(1) RLN_ENTRY_BF16(2) RLN_ENTRY_BF16(3) RLN_ENTRY_BF16(4) RLN_ENTRY_BF16(5)
RLN_ENTRY_BF16(6) RLN_ENTRY_BF16(7) RLN_ENTRY_BF16(8)
