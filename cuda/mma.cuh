// Tensor-core and async-copy helpers shared by cuda/gemm.cu (the GEMM engines), cuda/matmul.cu
// (matmul_forward 5) and cuda/attention.cu (the fused attention): fp32 -> tf32 rounding, one
// mma.sync m16n8k8, ldmatrix, cp.async copies and 128-bit shared loads. Header-only, sm_80+.
#pragma once
#include <stdint.h>
#include "elem.cuh"  // bf16, pack_bf16x2

// fp32 -> tf32, round to nearest (ties away from zero) by adding 0x1000 to the bit pattern: the tensor
// core ignores the low 13 bits (cvt.rna.tf32.f32 in one integer add; see the note in cuda/gemm.cu)
// Built with -DMATMUL_TF32_TRUNCATE=1 the kernels feed raw fp32 bits (the tensor core truncates):
// the lab uses it to measure what the rounding costs.
#if defined(MATMUL_TF32_TRUNCATE) && MATMUL_TF32_TRUNCATE
__device__ __forceinline__ uint32_t tf32_round(float x) { return __float_as_uint(x); }
#else
__device__ __forceinline__ uint32_t tf32_round(float x) { return __float_as_uint(x) + 0x1000u; }
#endif

// D = A(16x8, row) * B(8x8, col) + D. Fragments (g = lane/4, t = lane%4):
//   a0 (g, t) a1 (g+8, t) a2 (g, t+4) a3 (g+8, t+4);  b0 (k=t, n=g) b1 (k=t+4, n=g);
//   c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)
__device__ __forceinline__ void mma_tf32(float* d, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// shared-memory address of a generic pointer (what cp.async and ldmatrix take)
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16-byte / 4-byte asynchronous global->shared copies; bytes < size zero-fills the rest (edges)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&d)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(addr));
}
// a whole 16-byte chunk, no zero-fill operand
__device__ __forceinline__ void cp_async16_full(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// ---- bf16 (sm_80+) ----
// D = A(16x16, row) * B(16x8, col) + D with bf16 operands, fp32 accumulate. Each 32-bit register
// holds two bf16, the lower k (or column) index in the low half. Fragments (g = lane/4, t = lane%4;
// PTX ISA, "Matrix Fragments for mma.m16n8k16" with .bf16):
//   a0 (g, 2t..2t+1)  a1 (g+8, 2t..2t+1)  a2 (g, 2t+8..2t+9)  a3 (g+8, 2t+8..2t+9)
//   b0 (k=2t..2t+1, n=g)  b1 (k=2t+8..2t+9, n=g)
//   c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)   (as mma_tf32's)
// So the accumulators of two adjacent n-tiles 2j, 2j+1 (16 x 16) are, packed in pairs, exactly the
// A fragment of k-step j: a0 = (c0, c1) of 2j, a1 = (c2, c3) of 2j, a2/a3 the same of 2j+1.
__device__ __forceinline__ void mma_bf16_16816(float* d, const uint32_t* a, const uint32_t* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// ldmatrix of four 8x8 b16 matrices, transposed: lanes 8i..8i+7 give the addresses of rows 0..7 of
// matrix i; d[i] of lane (g, t) holds elements (row 2t, col g) and (row 2t+1, col g) of matrix i
// (without .trans, ldsm_x4: (row g, col 2t) and (row g, col 2t+1)).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&d)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(addr));
}
// (two floats -> two bf16 in one register: pack_bf16x2, in elem.cuh)
