// TF32 tensor-core helpers shared by cuda/matmul.cu (the GEMM engines) and cuda/attention.cu (the
// fused attention): fp32 -> tf32 rounding and one mma.sync m16n8k8. Header-only, sm_80+.
#pragma once
#include <stdint.h>

// fp32 -> tf32, round to nearest (ties away from zero) by adding 0x1000 to the bit pattern: the tensor
// core ignores the low 13 bits (cvt.rna.tf32.f32 in one integer add; see the note in cuda/matmul.cu)
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
