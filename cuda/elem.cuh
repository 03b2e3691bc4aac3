// Element types: the same kernel body instantiated for fp32 and for bf16 (issue 13). A bf16 kernel
// loads bf16, computes in fp32 and rounds once when it stores; so the bodies work on floats and only
// the loads and stores know the element type. Included by classifier.cu, global_norm.cu, adamw.cu
// and sample.cu. Header-only, no entry points.
//
//   to_f32(x), from_f32<T>(f)          one element (from_f32<bf16> rounds to nearest even)
//   load_vec<T, N, HINT>(p, f)         N elements of T at p (N * sizeof(T) = 4, 8 or 16 bytes, that
//   store_vec<T, N, HINT>(p, f)        many aligned) to/from N floats, one vector instruction
//
// bf16 <-> fp32 by integer ops where it is exact: a bf16 value is the upper half of the fp32 one,
// so widening is a shift (no conversion instruction). Narrowing rounds: __floats2bfloat162_rn.
#pragma once
#include <cuda_bf16.h>
#include "common.cuh"

typedef __nv_bfloat16 bf16;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float((unsigned)__bfloat16_as_ushort(x) << 16); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// cache hints of a vector load / store
enum { LD_PLAIN = 0, LD_CS = 1, LD_CG = 2 };   // plain, streaming (ld.global.cs), L2 only (ld.global.cg)
enum { ST_PLAIN = 0, ST_CS = 1 };              // plain, streaming (st.global.cs)

// the raw vector type of a given size: what one load instruction moves
template <int BYTES> struct RawVec;
template <> struct RawVec<16> { typedef uint4 type; static constexpr int words = 4; };
template <> struct RawVec<8> { typedef uint2 type; static constexpr int words = 2; };
template <> struct RawVec<4> { typedef unsigned int type; static constexpr int words = 1; };

// word k of a raw vector (k a compile-time constant after unrolling: no local memory)
__device__ __forceinline__ unsigned raw_word(const uint4& r, int k) { return k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w; }
__device__ __forceinline__ unsigned raw_word(const uint2& r, int k) { return k == 0 ? r.x : r.y; }
__device__ __forceinline__ unsigned raw_word(const unsigned& r, int) { return r; }
__device__ __forceinline__ void set_raw_word(uint4& r, int k, unsigned w) {
    if (k == 0) r.x = w; else if (k == 1) r.y = w; else if (k == 2) r.z = w; else r.w = w;
}
__device__ __forceinline__ void set_raw_word(uint2& r, int k, unsigned w) { if (k == 0) r.x = w; else r.y = w; }
__device__ __forceinline__ void set_raw_word(unsigned& r, int, unsigned w) { r = w; }

template <int HINT, typename R> __device__ __forceinline__ R ld_raw(const R* p) {
    if constexpr (HINT == LD_CS) return __ldcs(p);
    else if constexpr (HINT == LD_CG) return __ldcg(p);
    else return *p;
}
template <int HINT, typename R> __device__ __forceinline__ void st_raw(R* p, const R& v) {
    if constexpr (HINT == ST_CS) __stcs(p, v);
    else *p = v;
}

// raw words -> N floats. fp32: one float per word; bf16: two per word, element 2k in the low half.
template <typename T, int N, typename R> __device__ __forceinline__ void unpack_vec(const R& r, float (&f)[N]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int k = 0; k < N; k++) f[k] = __uint_as_float(raw_word(r, k));
    } else {
#pragma unroll
        for (int k = 0; k < N / 2; k++) {
            const unsigned w = raw_word(r, k);
            f[2 * k] = __uint_as_float(w << 16);
            f[2 * k + 1] = __uint_as_float(w & 0xFFFF0000u);
        }
    }
}

// two floats -> one word of two bf16, each rounded to nearest even; lo in the low half
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

template <typename T, int N, typename R> __device__ __forceinline__ void pack_vec(const float (&f)[N], R& r) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int k = 0; k < N; k++) set_raw_word(r, k, __float_as_uint(f[k]));
    } else {
#pragma unroll
        for (int k = 0; k < N / 2; k++) set_raw_word(r, k, pack_bf16x2(f[2 * k], f[2 * k + 1]));
    }
}

// N elements of T at p (aligned to N * sizeof(T) bytes) as floats, and back
template <typename T, int N, int HINT = LD_PLAIN>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[N]) {
    typedef typename RawVec<N * sizeof(T)>::type R;
    unpack_vec<T, N>(ld_raw<HINT>(reinterpret_cast<const R*>(p)), f);
}

template <typename T, int N, int HINT = ST_PLAIN>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[N]) {
    typedef typename RawVec<N * sizeof(T)>::type R;
    R r;
    pack_vec<T, N>(f, r);
    st_raw<HINT>(reinterpret_cast<R*>(p), r);
}
