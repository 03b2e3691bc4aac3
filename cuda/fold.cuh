// The folded classifier's exponential, shared by GEMM engine 5's _fold epilogue (cuda/gemm_wgmma.cu)
// and the classifier's fold kernels (cuda/classifier.cu); docs/matmul_notes.md, "The classifier folded
// into the lm head". Header-only, no entry points.
//
// p' = 2^(v log2(e) - k) for the integer k (as a float, exact): one FFMA and one MUFU.EX2, whose range
// reduction is its own (0 below 2^-126, inf from 2^128; NaN and inf give NaN, or 0 for -inf). The FFMA
// rounds v log2(e) - k once: 2^-24 of |v log2(e) - k| in the exponent, about 5e-6 relative in p' where
// |v log2(e) - k| ~ 100 (the fold's window), far under bf16's rounding and TF32's logits.
// Tried first (session 39, H200): 2^(v log2 e - round(v log2 e)) * 2^(round - k) built exactly, whose
// bits do not depend on k; with a floor() and a float-to-int conversion (quarter-rate) and a branch per
// value, the lm head's forward took 2.5x as long as the plain GEMM; branch-free with full-rate rounding,
// bf16 B=16 still 2.67 against 1.98 ms (the epilogue no longer hidden behind the other consumer's
// mainloop). This form is 4 instructions a value with the sum and the padding's select.
#pragma once

__device__ __forceinline__ float fold_exp(float v, float k) {
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(fmaf(v, 1.4426950408889634f, -k)));
    return e;
}
