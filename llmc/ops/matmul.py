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
from llmc.ops import Built, OpSpec, Variant, check_block_size

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
# the GEMM engine: strided-batched, any M, N, K, layouts nn / nt / tn / tt

GEMM_VARIANTS = {
    1: "SIMT fp32, 64x64x16 tiles, 4x4 per thread, predicated scalar loads: any shape and alignment",
    2: "TF32 mma.sync m16n8k8, 16-byte cp.async 3-stage pipeline, 128x256/128x128/64x64 tiles by shape, "
       "split-K when the grid is short, epilogue staged through smem (needs leading dims, strides % 4 == 0, "
       "16-byte aligned pointers)",
    3: "TF32 like 2 but 4-byte cp.async and 64x64 tiles: any shape and alignment (engine 2's fallback)",
    4: "TF32 like 2 with K-major fragments through ldmatrix.x4 and a leaner cp.async loader: ~2.9-3.0 "
       "instructions per mma in the main loop instead of 4.1-4.7 (same tiles, planner, split-K, epilogue; "
       "same alignment needs, engine 3 as its fallback)",
}

# TF32 tile configurations: name -> (BM, BN, threads, pipeline stages, CTAs per SM, efficiency).
# The efficiency (steady-state rate relative to "mid") feeds the planner's cost model; measured on
# the H100 (docs/matmul_notes.md). mid8 is not built for the tn layout (it spilled).
TF32_CONFIGS = {
    "big": (128, 256, 256, 3, 1, 0.92),
    "big4": (128, 256, 256, 4, 1, 0.92),
    "mid": (128, 128, 128, 3, 2, 1.0),
    "mid8": (128, 128, 256, 3, 2, 0.95),
    "small": (64, 64, 128, 3, 4, 0.82),
}
# warp tile (WM, WN) of each config (cuda/matmul.cu); engine 4 builds all but mid8 (it spilled at 128
# registers). tests/test_matmul_layout.py checks engine 4's index formulas for every one of these.
TF32_WARP_TILES = {"big": (64, 64), "big4": (64, 64), "mid": (64, 64), "mid8": (64, 32), "small": (32, 32)}
E4_CONFIGS = ("big", "big4", "mid", "small")
SM_FLOPS = 1.3e12    # per-SM rate of "mid" with two CTAs resident (170 TFLOP/s over 132 SMs)
LONE_CTA = 0.65      # a 4-warp CTA alone on an SM gets this fraction of it (8-warp CTAs: all)
TILE_OVERHEAD = 3    # pipeline fill + epilogue, in k-tiles
DRAM_BPS = 2.5e12    # bytes/s for the split-K second pass


def _ptr(x) -> int:
    return 0 if x is None else int(x if isinstance(x, (int, np.integer)) else x.ptr)


def _layout(transA: bool, transB: bool) -> str:
    return ("t" if transA else "n") + ("t" if transB else "n")


def _gemm_check(variant, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC):
    """Reason string when engine `variant` cannot take this GEMM (pointer alignment is checked at
    launch), else None."""
    if variant in (2, 4):
        odd = [f"{n}={v}" for n, v in (("lda", lda), ("ldb", ldb), ("ldc", ldc), ("strideA", strideA),
                                       ("strideB", strideB), ("strideC", strideC)) if v % 4]
        if odd:
            return "16-byte copies need leading dims and batch strides % 4 == 0, have " + ", ".join(odd)
    if variant == 4 and max(lda, ldb) >= 1 << 24:  # its loader keeps row steps in 32-bit byte counts
        return f"leading dims must be < 2^24 (lda={lda}, ldb={ldb})"
    return None


def gemm_build(rt, variant: int, transA: bool, transB: bool, M: int, N: int, K: int, batch: int = 1,
               lda=None, ldb=None, ldc=None, strideA: int = 0, strideB: int = 0, strideC: int = 0,
               alpha: float = 1.0, beta: float = 0.0, has_bias: bool = False, config: str | None = None,
               splits: int | None = None, truncate: bool = False):
    """Build C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias[n]) for b < batch.
    Returns launch(C, A, B, bias=None) taking DevArrays (or raw device pointers).
    A refused engine falls back (2 or 4 -> 3; 3 and 1 take anything) with one printed line.
    `config` ("big"/"mid"/"small"...) and `splits` override the TF32 planner (the lab sweeps them);
    `truncate` feeds unrounded fp32 to the tensor cores (a lab experiment, not used by the trainer)."""
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
        fb = 3 if variant in (2, 4) else 1
        from llmc.ops import note_once
        note_once(f"gemm engine {variant} refuses M={M} N={N} K={K} {_layout(transA, transB)} ({reason}); "
                  f"falling back to engine {fb} ({GEMM_VARIANTS[fb].split(',')[0]})")
        variant = fb
    if variant == 1:
        return _gemm_simt(rt, alpha=alpha, beta=beta, has_bias=has_bias, **shape)
    return _gemm_tf32(rt, vec=1 if variant == 3 else 4, alpha=alpha, beta=beta, has_bias=has_bias,
                      config=config, splits=splits, truncate=truncate, engine=variant, **shape)


def _gemm_simt(rt, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC,
               alpha, beta, has_bias):
    k = rt.kernel(MODULE, f"gemm_simt_{_layout(transA, transB)}", "PPPPiiiiiiqqqff", label="gemm 1")
    grid, block = (-(-N // 64), -(-M // 64), batch), (256, 1, 1)
    args = (np.int32(M), np.int32(N), np.int32(K), np.int32(lda), np.int32(ldb), np.int32(ldc),
            np.int64(strideA), np.int64(strideB), np.int64(strideC), np.float32(alpha), np.float32(beta))

    def launch(C, A, B, bias=None):
        k(grid, block, _ptr(C), _ptr(A), _ptr(B), _ptr(bias), *args)
    return Built(launch, op="gemm", number=1, plan=(1, "simt", 1))


def _tf32_plan(sm_count, M, N, K, batch, vec, layout="nn", engine=2):
    """Pick (config, splits) minimising a wave-quantised time estimate. c = CTAs resident per SM
    (<= the config's occupancy, fewer when the grid is short); the grid runs in ceil(ctas / (sm*c))
    rounds of c CTAs per SM; a 4-warp CTA alone on an SM runs at LONE_CTA of the SM's rate.
    Split-K adds a pass that reads the partials once and writes C. Engine 4 uses engine 2's
    (measured) efficiencies over the configs it builds, until it has been measured itself."""
    KT = -(-K // 32)
    best = None
    for name, (BM, BN, threads, _, occ, eff) in TF32_CONFIGS.items():
        if (vec == 1 and name != "small") or (name == "mid8" and layout == "tn") or \
                (engine == 4 and name not in E4_CONFIGS):
            continue
        tiles = -(-M // BM) * -(-N // BN) * batch
        for s in (1, 2, 3, 4, 6, 8):
            if s > 1 and (KT // s < 8 or tiles * s > 2 * sm_count * occ):
                continue  # each split keeps >= 8 k-tiles; stop splitting once the grid is full
            kts = -(-KT // s)
            s = -(-KT // kts)  # no empty splits
            ctas = tiles * s
            c = min(occ, -(-ctas // sm_count))
            rounds = -(-ctas // (sm_count * c))
            rate = SM_FLOPS * eff * (LONE_CTA if c == 1 and occ > 1 and threads < 256 else 1.0)
            t = rounds * c * BM * BN * 64 * (kts + TILE_OVERHEAD) / rate
            if s > 1:
                t += (s + 2) * M * N * batch * 4 / DRAM_BPS
            if best is None or t < best[0]:
                best = (t, name, s)
    return best[1], best[2]


def _gemm_tf32(rt, vec, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC,
               alpha, beta, has_bias, config=None, splits=None, truncate=False, engine=None):
    engine = engine or (2 if vec == 4 else 3)
    lay = _layout(transA, transB)
    plan_cfg, plan_splits = _tf32_plan(rt.sm_count, M, N, K, batch, vec, lay, engine)
    config = config or plan_cfg
    if vec == 1:
        config = "small"
    if engine == 4:
        if config not in E4_CONFIGS:
            raise LLMCError(f"gemm: engine 4 has no TF32 config {config!r}; have {', '.join(E4_CONFIGS)}")
    elif config not in TF32_CONFIGS or (config == "mid8" and lay == "tn"):
        raise LLMCError(f"gemm: no TF32 config {config!r} for layout {lay}; have {', '.join(TF32_CONFIGS)} "
                        f"(mid8: not tn)")
    BM, BN, threads, stages, _, _ = TF32_CONFIGS[config]
    KT = -(-K // 32)
    splits = max(1, min(splits or plan_splits, KT))
    kts = -(-KT // splits)
    splits = -(-KT // kts)
    argt = "PPPPPiiiiiiqqqffiii"
    name = f"gemm_tf32_e4_{config}_{lay}" if engine == 4 else f"gemm_tf32_{config}_v{vec}_{lay}"
    k = rt.kernel(MODULE, name, argt, label=f"gemm {engine} ({config})",
                  defines={"MATMUL_TF32_TRUNCATE": 1} if truncate else None)
    smem = stages * (BM + BN) * 32 * 4
    k.set_max_dynamic_smem(smem)
    grid, block = (-(-M // BM), -(-N // BN), batch * splits), (threads, 1, 1)
    ldw = -(-N // 4) * 4
    W = rt.empty((batch * splits * M * ldw,), np.float32) if splits > 1 else None
    args = (np.int32(M), np.int32(N), np.int32(K), np.int32(lda), np.int32(ldb), np.int32(ldc),
            np.int64(strideA), np.int64(strideB), np.int64(strideC), np.float32(alpha), np.float32(beta),
            np.int32(splits), np.int32(kts), np.int32(ldw))
    if splits > 1:
        red = rt.kernel(MODULE, "gemm_splitk_reduce", "PPPiiiqiiiff", label=f"gemm {engine} split-K reduce")
        total = batch * M * N
        rgrid = (max(1, min(-(-total // 256), rt.sm_count * 8)), 1, 1)
        rargs = (np.int32(M), np.int32(N), np.int32(ldc), np.int64(strideC), np.int32(ldw), np.int32(splits),
                 np.int32(batch), np.float32(alpha), np.float32(beta))
    fallback = None
    if vec == 4:  # a pointer that is not 16-byte aligned at launch goes to engine 3, said once
        fallback = [None, False]

    def launch(C, A, B, bias=None):
        c, a, b, bi = _ptr(C), _ptr(A), _ptr(B), _ptr(bias)
        if fallback is not None and (c | a | b) & 15:
            if fallback[0] is None:
                print(f"gemm engine {engine}: pointers not 16-byte aligned (C=0x{c:x} A=0x{a:x} B=0x{b:x}); "
                      f"using engine 3 for this GEMM")
                fallback[0] = _gemm_tf32(rt, 1, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA,
                                         strideB, strideC, alpha, beta, has_bias)
            return fallback[0].launch(C, A, B, bias)
        if splits > 1:
            k(grid, block, c, a, b, 0, W.ptr, *args, smem=smem)
            red(rgrid, (256, 1, 1), c, W.ptr, bi, *rargs)
        else:
            k(grid, block, c, a, b, bi, 0, *args, smem=smem)
    return Built(launch, op="gemm", number=engine, plan=(engine, config, splits))  # plan: for the lab's table


# ----------------------------------------------------------------------------------------------
# matmul_forward: out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC)


def _fwd_kernel(rt, n):
    return rt.kernel(MODULE, f"matmul_forward_kernel{n}", "PPPPiii", label=f"matmul_forward {n}")


def matmul_forward1(rt, N, C, OC, has_bias=True, block_size=None):
    k, bs = _fwd_kernel(rt, 1), block_size or 256
    grid, args = (-(-OC // bs), N, 1), (np.int32(N), np.int32(C), np.int32(OC))

    def launch(out, inp, weight, bias=None):
        k(grid, (bs, 1, 1), out.ptr, inp.ptr, weight.ptr, _ptr(bias), *args)
    return launch


def matmul_forward2(rt, N, C, OC, has_bias=True, block_size=None):
    k, bs = _fwd_kernel(rt, 2), block_size or 256   # a warp per output column, 8 rows each
    grid, args = (-(-OC // (bs // 32)), -(-N // 8), 1), (np.int32(N), np.int32(C), np.int32(OC))

    def launch(out, inp, weight, bias=None):
        k(grid, (bs, 1, 1), out.ptr, inp.ptr, weight.ptr, _ptr(bias), *args)
    return launch


def matmul_forward8(rt, N, C, OC, has_bias=True, block_size=None, gelu=False):
    # a warp per output column, all N <= 8 rows; one entry point per row count (cuda/matmul.cu)
    name = f"matmul_forward_kernel8{'_gelu' if gelu else ''}_rows{N}"
    k = rt.kernel(MODULE, name, "PPPPiii", label=f"matmul_forward 8{' + gelu' if gelu else ''} (rows={N})")
    bs = block_size or 256
    grid, args = (-(-OC // (bs // 32)), 1, 1), (np.int32(N), np.int32(C), np.int32(OC))

    def launch(out, inp, weight, bias=None):
        k(grid, (bs, 1, 1), out.ptr, inp.ptr, weight.ptr, _ptr(bias), *args)
    return launch


def _gemv_check(N, C, OC, block_size=None, **_):
    if N > 8:
        return f"N={N} rows > 8 (a GEMV for decoding: each warp keeps all N row sums in registers)"
    if C % 4:
        return f"float4 loads need C % 4 == 0 (C={C})"
    return check_block_size(block_size)


def _fwd_tiled(n, tile, block):
    def build(rt, N, C, OC, has_bias=True, block_size=None):
        k = _fwd_kernel(rt, n)
        grid, args = (-(-OC // tile), -(-N // tile), 1), (np.int32(N), np.int32(C), np.int32(OC))

        def launch(out, inp, weight, bias=None):
            k(grid, block, out.ptr, inp.ptr, weight.ptr, _ptr(bias), *args)
        return launch
    return build


matmul_forward3 = _fwd_tiled(3, 32, (32, 32, 1))
matmul_forward4 = _fwd_tiled(4, 128, (256, 1, 1))
matmul_forward5 = _fwd_tiled(5, 64, (128, 1, 1))


def matmul_forward6(rt, N, C, OC, has_bias=True, block_size=None):
    gemm = gemm_build(rt, 2, False, True, M=N, N=OC, K=C, has_bias=has_bias, config=block_size)
    return Built(gemm.launch, plan=gemm.plan)


def matmul_forward7(rt, N, C, OC, has_bias=True, block_size=None):
    gemm = gemm_build(rt, 4, False, True, M=N, N=OC, K=C, has_bias=has_bias, config=block_size)
    return Built(gemm.launch, plan=gemm.plan)


def _need_c4(N, C, OC, **_):
    if C % 4 or OC % 4:
        return f"float4 loads/stores need C % 4 == 0 and OC % 4 == 0 (C={C}, OC={OC})"
    return None


def _need_c4_in(N, C, OC, **_):
    return f"float4 loads need C % 4 == 0 (C={C})" if C % 4 else None


def _fwd_engine_check(N, C, OC, engine=2, **_):
    return _gemm_check(engine, False, True, N, OC, C, 1, C, C, OC, 0, 0, 0)


def _fwd_engine4_check(N, C, OC, **_):
    return _fwd_engine_check(N, C, OC, engine=4)


def matmul_forward_cpu(N, C, OC, has_bias=True, gelu=False, **_):
    from llmc.ops.gelu import gelu_forward_ref

    def launch(out, inp, weight, bias=None):
        y = matmul_forward_ref(inp, weight, bias if has_bias else None)
        out[...] = gelu_forward_ref(y).reshape(out.shape) if gelu else y
    return launch


# ----------------------------------------------------------------------------------------------
# matmul_backward: dinp(N,C) = dout(N,OC) @ weight(OC,C) ; dweight(OC,C) += dout^T @ inp


def _matmul_backward_engine(engine):
    def build(rt, N, C, OC, block_size=None):
        # dinp (N,C) = dout (N,OC) @ weight (OC,C): nn, K = OC, overwrite
        g_dinp = gemm_build(rt, engine, False, False, M=N, N=C, K=OC)
        # dweight (OC,C) += dout^T @ inp: A = dout stored (N,OC) = (K,M) -> t; B = inp (N,C) = (K,N) -> n
        g_dw = gemm_build(rt, engine, True, False, M=OC, N=C, K=N, beta=1.0)

        dinp_, dw_ = g_dinp.launch, g_dw.launch

        def launch(dinp, dweight, dout, inp, weight):
            dinp_(dinp, dout, weight)
            dw_(dweight, dout, inp)
        return Built(launch, plan=(g_dinp.plan, g_dw.plan))
    return build


def _bwd_engine_check(N, C, OC, engine=2, **_):
    return (_gemm_check(engine, False, False, N, C, OC, 1, OC, C, C, 0, 0, 0)
            or _gemm_check(engine, True, False, OC, C, N, 1, OC, C, C, 0, 0, 0))


def _bwd_engine4_check(N, C, OC, **_):
    return _bwd_engine_check(N, C, OC, engine=4)


def matmul_backward_cpu(N, C, OC, **_):
    def launch(dinp, dweight, dout, inp, weight):
        # the model passes (B,T,.) views: work on them as (N, .) rows
        dout2, inp2 = dout.reshape(N, OC), inp.reshape(N, C)
        dinp[...] = (dout2 @ weight).reshape(dinp.shape)
        dweight += dout2.T @ inp2
    return launch


# ----------------------------------------------------------------------------------------------
# matmul_backward_bias: dbias(OC) += column sums of dout(N,OC)


def matmul_backward_bias1(rt, N, OC, block_size=None):
    k, bs = rt.kernel(MODULE, "matmul_backward_bias_kernel1", "PPii", label="matmul_backward_bias 1"), block_size or 128
    grid, args = (-(-OC // bs), 1, 1), (np.int32(N), np.int32(OC))

    def launch(dbias, dout):
        k(grid, (bs, 1, 1), dbias.ptr, dout.ptr, *args)
    return launch


def _bias_chunks(rt, N, OC, cols_per_block, min_rows):
    """Versions 2-4 split the rows into chunks: (column blocks, chunks, rows per chunk), with enough
    (32 x 8)-thread blocks to fill the GPU ~4 times over, each chunk >= min_rows rows."""
    col_blocks = -(-OC // cols_per_block)
    nchunks = max(1, min(-(-4 * rt.sm_count // col_blocks), -(-N // min_rows)))
    rows = -(-N // nchunks)
    return col_blocks, -(-N // rows), rows


def _bias_two_pass(number, cols_per_block, min_rows):
    """Versions 2 and 3: per-chunk partials, then the finishing pass adds them to dbias in order."""
    def build(rt, N, OC, block_size=None):
        k1 = rt.kernel(MODULE, f"matmul_backward_bias_kernel{number}", "PPiii", label=f"matmul_backward_bias {number}")
        k2 = rt.kernel(MODULE, "matmul_backward_bias_kernel2_finish", "PPii",
                       label=f"matmul_backward_bias {number} finish")
        col_blocks, nchunks, rows = _bias_chunks(rt, N, OC, cols_per_block, min_rows)
        partial = rt.empty((nchunks, OC), np.float32)
        args1 = (np.int32(N), np.int32(OC), np.int32(rows))
        args2 = (np.int32(nchunks), np.int32(OC))

        def launch(dbias, dout):
            k1((col_blocks, nchunks, 1), (32, 8, 1), partial.ptr, dout.ptr, *args1)
            k2((-(-OC // 256), 1, 1), (256, 1, 1), dbias.ptr, partial.ptr, *args2)
        return launch
    return build


matmul_backward_bias2 = _bias_two_pass(2, 32, 64)    # a column per lane, chunks of >= 64 rows
matmul_backward_bias3 = _bias_two_pass(3, 128, 32)   # 4 columns per lane (float4), >= 4 rows per thread


def matmul_backward_bias4(rt, N, OC, block_size=None):
    k = rt.kernel(MODULE, "matmul_backward_bias_kernel4", "PPPPiii", label="matmul_backward_bias 4")
    col_blocks, nchunks, rows = _bias_chunks(rt, N, OC, 128, 32)  # version 3's chunks
    partial = rt.empty((nchunks, OC), np.float32)
    counters = rt.zeros((col_blocks,), np.uint32)  # each finishing block resets its own
    args = (np.int32(N), np.int32(OC), np.int32(rows))

    def launch(dbias, dout):
        k((col_blocks, nchunks, 1), (32, 8, 1), dbias.ptr, partial.ptr, counters.ptr, dout.ptr, *args)
    return launch


def _bias_c4(N, OC, **_):
    return f"float4 loads need OC % 4 == 0 (OC={OC})" if OC % 4 else None


def matmul_backward_bias_cpu(N, OC, **_):
    def launch(dbias, dout):
        dbias += dout.reshape(N, OC).sum(axis=0)
    return launch


# ----------------------------------------------------------------------------------------------
# cost models (FLOPs, bytes) of one call, for the lab and the profile: each input read once, each
# output written once (the dweight accumulation reads and writes it)

def cost_forward(N, C, OC, has_bias=True, **_):
    return 2 * N * C * OC, 4 * (N * C + OC * C + N * OC + (OC if has_bias else 0))


def cost_backward(N, C, OC, **_):
    return 4 * N * C * OC, 4 * (N * OC + N * C + 2 * OC * C + N * C)


def cost_backward_bias(N, OC, **_):
    return 0, 4 * N * OC


# ----------------------------------------------------------------------------------------------
# the op table

OPS = [
    OpSpec("matmul_forward", matmul_forward_cpu, {
        1: Variant(1, "naive: one thread per output, threads along OC (uncoalesced weight reads)", matmul_forward1, engine=1),
        2: Variant(2, "coalesced: a warp per column x 8 rows, lanes stride along C, shuffle reduction", matmul_forward2, engine=1),
        3: Variant(3, "32x32 shared-memory tiles, one output per thread", matmul_forward3, engine=1),
        4: Variant(4, "128x128 register-blocked tiles, 8x8 per thread, float4 loads/stores", matmul_forward4, _need_c4, engine=1),
        5: Variant(5, "TF32 tensor cores (mma.sync m16n8k8), 64x64 tiles, no pipelining", matmul_forward5, _need_c4_in, engine=2),
        6: Variant(6, "TF32 GEMM engine 2: cp.async 3-stage, 128x256/128x128 tiles, 64x64 warp tiles, "
                      "swizzled smem, fused bias, float4 stores", matmul_forward6, _fwd_engine_check, engine=2),
        7: Variant(7, "TF32 GEMM engine 4: engine 2 with ldmatrix fragments and a leaner loader "
                      "(fewer instructions per mma)", matmul_forward7, _fwd_engine4_check, engine=4),
        8: Variant(8, "GEMV for decoding (N <= 8 rows): a warp per output column, float4 weight stream "
                      "read once, row sums in registers", matmul_forward8, _gemv_check,
                   engine=1, options=("gelu",)),
    }, default=7, flag="--matmul-kernel", options=("gelu",), cost=cost_forward,
        doc="out(N,OC)= ; inp(N,C), weight(OC,C), bias(OC) or None; gelu=True: out = gelu(...) (variant 8)"),
    OpSpec("matmul_backward", matmul_backward_cpu, {
        1: Variant(1, "SIMT: dinp and dweight on GEMM engine 1 (64x64 tiles)", _matmul_backward_engine(1), engine=1),
        2: Variant(2, "TF32: dinp and dweight on GEMM engine 2 (split-K for the K=N reduction)",
                   _matmul_backward_engine(2), _bwd_engine_check, engine=2),
        3: Variant(3, "TF32: dinp and dweight on GEMM engine 4 (ldmatrix fragments; split-K for dweight)",
                   _matmul_backward_engine(4), _bwd_engine4_check, engine=4),
    }, default=3, flag="--matmul-backward-kernel", cost=cost_backward,
        doc="dinp(N,C)= ; dweight(OC,C)+= ; dout(N,OC), inp(N,C), weight(OC,C)"),
    OpSpec("matmul_backward_bias", matmul_backward_bias_cpu, {
        1: Variant(1, "one thread per column over all rows", matmul_backward_bias1),
        2: Variant(2, "(32x8)-thread blocks over row chunks -> partials, fixed-order second pass "
                      "(deterministic, no atomics)", matmul_backward_bias2),
        3: Variant(3, "version 2 with float4 columns (128 per block), 4 rows in flight per thread",
                   matmul_backward_bias3, _bias_c4),
        4: Variant(4, "version 3 in one launch: the last block of each column block sums the partials in "
                      "order (deterministic)", matmul_backward_bias4, _bias_c4),
    }, default=4, flag="--matmul-backward-bias-kernel", cost=cost_backward_bias, doc="dbias(OC)+= ; dout(N,OC)"),
]
