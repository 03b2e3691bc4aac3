// Element types: the same kernel body instantiated for fp32 and for bf16 (issue 13). A bf16 kernel
// loads bf16, computes in fp32 and rounds once when it stores (__float2bfloat16_rn, to nearest
// even); so the bodies work on floats and only the loads and stores know the element type. One
// header for every family with bf16 builds (and mma.cuh). Header-only, no entry points.
//
//   to_f32(x), from_f32<T>(f)          one element (from_f32<bf16> rounds to nearest even)
//   bf16_lo(w), bf16_hi(w), pack_bf16x2(lo, hi)   two bf16 in one 32-bit word <-> two floats
//   load_vec<T, N, HINT>(p, f)         N elements of T at p (N * sizeof(T) = 4, 8 or 16 bytes, that
//   store_vec<T, N, HINT>(p, f)        many aligned) to/from N floats, one vector instruction
//   Vec16<T>, load_vec<T>(f, p, vec, n), store_vec<T>(p, f, vec, n), load_raw, round_to
//                                      16 bytes (4 floats or 8 bf16) with a guarded scalar path for
//                                      rows that are not 16-byte aligned (the elementwise, encoder
//                                      and layernorm families)
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

// The GELU that gelu_forward's build for element type T computes (common.cuh): the tanh form in fp32,
// the sigmoid form in bf16. GEMM engine 5's fused fc epilogue calls it on the value it stored, so the
// fused form and gemm + gelu_forward give the same bits.
template <typename T> __device__ __forceinline__ float gelu_fwd_as(float x);
template <> __device__ __forceinline__ float gelu_fwd_as<float>(float x) { return gelu_fwd(x); }
template <> __device__ __forceinline__ float gelu_fwd_as<bf16>(float x) { return gelu_fwd_sigmoid(x); }

// gelu_backward's product for element type T: gelu'(x) * dout, with gelu' in the form of T (common.cuh)
// and a multiply the compiler cannot contract. GEMM engine 5's fused dgelu epilogue calls it on the
// value it stored, so the fused form and gemm + gelu_backward give the same bits.
template <typename T> __device__ __forceinline__ float gelu_grad_as(float x);
template <> __device__ __forceinline__ float gelu_grad_as<float>(float x) { return gelu_grad(x); }
template <> __device__ __forceinline__ float gelu_grad_as<bf16>(float x) { return gelu_grad_sigmoid(x); }
template <typename T> __device__ __forceinline__ float gelu_bwd_as(float x, float dout) {
    return __fmul_rn(gelu_grad_as<T>(x), dout);
}

// Two bf16 in one 32-bit word (little-endian: the lower address is the low half) <-> two floats.
// The widening is a shift/mask (bf16 is the top half of an fp32), no conversion instruction.
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xFFFF0000u); }
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // one cvt.rn.bf16x2.f32 on sm_80+
    return *reinterpret_cast<unsigned*>(&h);
}

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

// ---------------------------------------------------------------------------------------------
// 16-byte vectors with a scalar path (the elementwise, encoder and layernorm families)

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
