// Element types for the kernels templated on them (fp32 or bf16), and 16-byte vector access of
// either: a Vec16<T> moves 16 bytes (4 floats or 8 bf16) between memory and a float[N] in registers.
// Arithmetic is always fp32: bf16 values widen exactly on the load, and a store rounds once, to
// nearest even (__float2bfloat16_rn), which is the only rounding a bf16 kernel's output sees.
// Header-only, no entry points. Included by the elementwise, encoder and layernorm families.
#pragma once
#include <cuda_bf16.h>
#include "common.cuh"

typedef __nv_bfloat16 bf16;

// scalar conversions: to_f32(x) widens (exact), from_f32<T>(f) rounds to nearest even
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float f);
template <> __device__ __forceinline__ float from_f32<float>(float f) { return f; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float f) { return __float2bfloat16_rn(f); }

// Two bf16 in one 32-bit word (little-endian: the lower address is the low half) <-> two floats.
// The widening is a shift/mask (bf16 is the top half of an fp32), no conversion instruction.
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // one cvt.rn.bf16x2.f32 on sm_80+
    return *reinterpret_cast<unsigned*>(&h);
}

// Raw 16 bytes <-> N floats. The pointer must be 16-byte aligned: the launchers check that rows
// (or the tensor) hold a multiple of N elements, and every buffer starts 16-byte aligned.
template <typename T> struct Vec16;

template <> struct Vec16<float> {
    static constexpr int N = 4;
    typedef float4 raw;
    static __device__ __forceinline__ raw ld(const float* p) { return *reinterpret_cast<const float4*>(p); }
    static __device__ __forceinline__ raw ld_cs(const float* p) { return __ldcs(reinterpret_cast<const float4*>(p)); }
    static __device__ __forceinline__ void st(float* p, raw r) { *reinterpret_cast<float4*>(p) = r; }
    static __device__ __forceinline__ void st_cs(float* p, raw r) { __stcs(reinterpret_cast<float4*>(p), r); }
    static __device__ __forceinline__ void unpack(float (&f)[4], raw r) { f[0] = r.x; f[1] = r.y; f[2] = r.z; f[3] = r.w; }
    static __device__ __forceinline__ raw pack(const float (&f)[4]) { return make_float4(f[0], f[1], f[2], f[3]); }
};

template <> struct Vec16<bf16> {
    static constexpr int N = 8;
    typedef uint4 raw;  // 8 bf16, two per 32-bit word
    static __device__ __forceinline__ raw ld(const bf16* p) { return *reinterpret_cast<const uint4*>(p); }
    static __device__ __forceinline__ raw ld_cs(const bf16* p) { return __ldcs(reinterpret_cast<const uint4*>(p)); }
    static __device__ __forceinline__ void st(bf16* p, raw r) { *reinterpret_cast<uint4*>(p) = r; }
    static __device__ __forceinline__ void st_cs(bf16* p, raw r) { __stcs(reinterpret_cast<uint4*>(p), r); }
    static __device__ __forceinline__ void unpack(float (&f)[8], raw r) {
        f[0] = bf16_lo(r.x); f[1] = bf16_hi(r.x); f[2] = bf16_lo(r.y); f[3] = bf16_hi(r.y);
        f[4] = bf16_lo(r.z); f[5] = bf16_hi(r.z); f[6] = bf16_lo(r.w); f[7] = bf16_hi(r.w);
    }
    static __device__ __forceinline__ raw pack(const float (&f)[8]) {
        return make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]),
                          pack_bf16x2(f[4], f[5]), pack_bf16x2(f[6], f[7]));
    }
};

// load / store N elements as floats: the 16-byte path, or (vec == false: a row that is not 16-byte
// aligned) N guarded scalar accesses of p[0..n) (n <= N; the rest of f is 0 on a load)
template <typename T>
__device__ __forceinline__ void load_vec(float (&f)[Vec16<T>::N], const T* p, bool vec, int n) {
    if (vec) {
        Vec16<T>::unpack(f, Vec16<T>::ld(p));
    } else {
#pragma unroll
        for (int k = 0; k < Vec16<T>::N; k++) f[k] = k < n ? to_f32(p[k]) : 0.0f;
    }
}
template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[Vec16<T>::N], bool vec, int n) {
    if (vec) {
        Vec16<T>::st(p, Vec16<T>::pack(f));
    } else {
#pragma unroll
        for (int k = 0; k < Vec16<T>::N; k++) if (k < n) p[k] = from_f32<T>(f[k]);
    }
}

// f rounded to T's precision in place (what storing it as T and loading it back gives)
template <typename T, int N>
__device__ __forceinline__ void round_to(float (&f)[N]) {
#pragma unroll
    for (int k = 0; k < N; k++) f[k] = to_f32(from_f32<T>(f[k]));
}

// 16 bytes of T as raw bits: one load, or (vec == false) up to N guarded scalar loads packed into
// the same bits (exact: the values are already of type T), zeros past n
template <typename T>
__device__ __forceinline__ typename Vec16<T>::raw load_raw(const T* p, bool vec, int n) {
    if (vec) return Vec16<T>::ld(p);
    float f[Vec16<T>::N];
    load_vec<T>(f, p, false, n);
    return Vec16<T>::pack(f);
}
