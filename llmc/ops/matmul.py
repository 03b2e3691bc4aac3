"""Matmul: GPT-2's linear layers (forward, backward, bias backward) and a general strided-batched GEMM.

    python dev/cuda/matmul_forward.py          # validate + time every forward variant at the trainer's shapes
    python dev/cuda/matmul_backward.py         # same for matmul_backward and matmul_backward_bias
    python -m pytest tests/test_matmul.py -q   # numpy references vs torch autograd (add -m gpu on a GPU)

    from llmc.ops.matmul import gemm_build
    gemm = gemm_build(rt, 2, transA=False, transB=True, M=1024, N=1024, K=64, batch=48,
                      strideA=1024*64, strideB=1024*64, strideC=1024*1024, alpha=0.125)
    gemm(C, A, B)                              # C[b] = 0.125 * A[b] @ B[b]^T for b < 48

Semantics (docs/ops.md):
    matmul_forward:        out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC)
    matmul_backward:       dinp(N,C) = dout(N,OC) @ weight(OC,C) ; dweight(OC,C) += dout^T @ inp
    matmul_backward_bias:  dbias(OC) += sum over rows of dout(N,OC)

The GEMM engine (gemm_build) is row-major: C[b](M,N) = alpha * op(A[b]) @ op(B[b]) + beta * C[b]
(+ bias[n]), op(X) = X or X^T as stored. beta == 0 never reads C.
"""
from __future__ import annotations

import numpy as np

from llmc.errors import LLMCError
from llmc.ops import OpSpec, Variant

MODULE = "matmul"  # cuda/matmul.cu

# ----------------------------------------------------------------------------------------------
# numpy references


def matmul_forward_ref(inp, weight, bias=None):
    """out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC). Works in the inputs' dtype."""
    out = inp @ weight.T
    if bias is not None:
        out = out + bias
    return out


def matmul_backward_ref(dout, inp, weight):
    """Gradients of matmul_forward: (dinp(N,C), dweight(OC,C), dbias(OC)) (not accumulated)."""
    dinp = dout @ weight
    dweight = dout.T @ inp
    dbias = dout.sum(axis=0)
    return dinp, dweight, dbias


def gemm_ref(A, B, C=None, transA=False, transB=False, alpha=1.0, beta=0.0, bias=None):
    """Batched reference of the GEMM engine on (batch, rows, cols) arrays (packed)."""
    a = np.swapaxes(A, -1, -2) if transA else A
    b = np.swapaxes(B, -1, -2) if transB else B
    out = alpha * (a @ b)
    if beta != 0.0:
        out = out + beta * C
    if bias is not None:
        out = out + bias
    return out


# ----------------------------------------------------------------------------------------------
# the GEMM engine: strided-batched, any M, N, K, layouts NN / NT / TN / TT

GEMM_VARIANTS = {
    1: "SIMT fp32, 64x64x16 tiles, 4x4 per thread, predicated scalar loads: any shape and alignment",
}


def gemm_variant_for(matmul_variant: int) -> int:
    """The GEMM engine that goes with a --matmul-kernel number (attention uses it)."""
    return 1


def _ptr(x) -> int:
    return 0 if x is None else (x if isinstance(x, (int, np.integer)) else x.ptr)


def _layout(transA: bool, transB: bool) -> str:
    return ("t" if transA else "n") + ("t" if transB else "n")


def _gemm_check(variant, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC):
    """Reason string when engine `variant` cannot take this GEMM, else None."""
    if variant == 1:
        return None
    return f"no GEMM engine {variant}"


def gemm_build(rt, variant: int, transA: bool, transB: bool, M: int, N: int, K: int, batch: int = 1,
               lda=None, ldb=None, ldc=None, strideA: int = 0, strideB: int = 0, strideC: int = 0,
               alpha: float = 1.0, beta: float = 0.0, has_bias: bool = False):
    """Build C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias[n]) for b < batch.
    Returns launch(C, A, B, bias=None) taking DevArrays (or raw device pointers).
    A refused engine falls back to engine 1 (SIMT) with one printed line."""
    if variant not in GEMM_VARIANTS:
        raise LLMCError(f"gemm: no engine {variant}; have {', '.join(map(str, GEMM_VARIANTS))}")
    if min(M, N, K, batch) < 1:
        raise LLMCError(f"gemm: empty problem M={M} N={N} K={K} batch={batch}")
    lda = lda if lda is not None else (M if transA else K)
    ldb = ldb if ldb is not None else (K if transB else N)
    ldc = ldc if ldc is not None else N
    if lda < (M if transA else K) or ldb < (K if transB else N) or ldc < N:
        raise LLMCError(f"gemm: leading dims too small (lda={lda}, ldb={ldb}, ldc={ldc}) "
                        f"for transA={transA} transB={transB} M={M} N={N} K={K}")
    shape = dict(transA=transA, transB=transB, M=M, N=N, K=K, batch=batch, lda=lda, ldb=ldb, ldc=ldc,
                 strideA=strideA, strideB=strideB, strideC=strideC)
    reason = _gemm_check(variant, **shape)
    if reason:
        print(f"gemm engine {variant} refuses M={M} N={N} K={K} {_layout(transA, transB)} ({reason}); "
              f"falling back to engine 1 (SIMT)")
        variant = 1
    return _GEMM_BUILDERS[variant](rt, alpha=alpha, beta=beta, has_bias=has_bias, **shape)


def _gemm_simt(rt, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC,
               alpha, beta, has_bias):
    k = rt.kernel(MODULE, f"gemm_simt_{_layout(transA, transB)}", "PPPPiiiiiiqqqff", label="gemm 1")
    grid, block = (-(-N // 64), -(-M // 64), batch), (256, 1, 1)
    args = (np.int32(M), np.int32(N), np.int32(K), np.int32(lda), np.int32(ldb), np.int32(ldc),
            np.int64(strideA), np.int64(strideB), np.int64(strideC), np.float32(alpha), np.float32(beta))

    def launch(C, A, B, bias=None):
        k(grid, block, _ptr(C), _ptr(A), _ptr(B), _ptr(bias), *args)
    return launch


_GEMM_BUILDERS = {1: _gemm_simt}
