// Layernorm row statistics shared by cuda/layernorm.cu (layernorm_forward 4, 5) and
// cuda/residual_layernorm.cu (residual_layernorm_forward 3): both hold a row in registers, one warp
// per row, lane l owning float4 number l + 32*i for i < NV; and the same for the kernels templated
// on the element type (fp32 or bf16, 16-byte vectors of V elements). Header-only.
#pragma once
#include "common.cuh"
#include "elem.cuh"

#define LN_EPS 1e-5f

__device__ __forceinline__ float hsum4(float4 a) { return (a.x + a.y) + (a.z + a.w); }

// mean and rstd of a row of C floats (C4 = C/4 float4s) held as v[NV] in the warp's registers, given
// each lane's partial sum of its elements: m = sum/C, then the biased variance around m in a second
// pass over the registers (two passes: no catastrophic cancellation), rstd = 1/sqrt(var + eps).
template <int NV>
__device__ __forceinline__ void ln_row_stats(const float4 (&v)[NV], float sum, int lane, int C4, int C,
                                             float& m, float& s) {
    m = warp_reduce_sum(sum) / C;
    float var = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        if (lane + i * WARP_SIZE < C4) {
            float dx = v[i].x - m, dy = v[i].y - m, dz = v[i].z - m, dw = v[i].w - m;
            var += (dx * dx + dy * dy) + (dz * dz + dw * dw);
        }
    }
    s = rsqrtf(warp_reduce_sum(var) / C + LN_EPS);
}

// The same for the kernels templated on the element type (cuda/elem.cuh): lane l holds the V
// elements of 16-byte vector number l + 32*i, channels c = V*(l + 32*i) + k, as fp32 in v[i][k].
// Elements at c >= C (past the row, or never loaded) are left out by the guard.
template <int NV, int V>
__device__ __forceinline__ void ln_row_stats_v(const float (&v)[NV][V], float sum, int lane, int C,
                                               float& m, float& s) {
    m = warp_reduce_sum(sum) / C;
    float var = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
#pragma unroll
        for (int k = 0; k < V; k++) {
            if (c0 + k < C) { float d = v[i][k] - m; var += d * d; }
        }
    }
    s = rsqrtf(warp_reduce_sum(var) / C + LN_EPS);
}

// out row = (v - m) * s * weight + bias for the row held as v (layout above), each element rounded
// once to T on the store; vec == false (C % V != 0): guarded scalar loads and stores
template <typename T, int NV, bool STREAM>
__device__ __forceinline__ void ln_row_normalize_store(T* o, const float (&v)[NV][Vec16<T>::N], float m,
        float s, const T* weight, const T* bias, int lane, int C, bool vec) {
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) {
            float w[V], b[V], r[V];
            load_vec<T>(w, weight + c0, vec, C - c0);
            load_vec<T>(b, bias + c0, vec, C - c0);
#pragma unroll
            for (int k = 0; k < V; k++) r[k] = (v[i][k] - m) * s * w[k] + b[k];
            if (vec && STREAM) Vec16<T>::st_cs(o + c0, Vec16<T>::pack(r));
            else store_vec<T>(o + c0, r, vec, C - c0);
        }
    }
}
