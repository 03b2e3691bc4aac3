"""Matmul: GPT-2's linear layers (forward, backward, bias backward).

    python dev/cuda/matmul_forward.py          # validate + time every forward variant at the trainer's shapes
    python dev/cuda/matmul_backward.py         # same for matmul_backward and matmul_backward_bias
    python -m pytest tests/test_matmul.py -q   # numpy references vs torch autograd (add -m gpu on a GPU)


Semantics (docs/ops.md):
    matmul_forward:        out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC)
    matmul_backward:       dinp(N,C) = dout(N,OC) @ weight(OC,C) ; dweight(OC,C) += dout^T @ inp
                           (overwrite=True, variant 5: dweight = dout^T @ inp, its old value never read)
    matmul_backward_bias:  dbias(OC) += sum over rows of dout(N,OC)

Versions 6 and 7 of matmul_forward and every matmul_backward version run on the GEMM engines
(llmc/ops/gemm.py, cuda/gemm.cu); each declares its engine (Variant.engine), which the composite
attention follows. The op's own kernels (versions 1-5 and 8, the bias backward) are cuda/matmul.cu.

The fc layer's fused form, gelu_pre=True (variant 9, both precisions; the model asks for it where the
chosen variant has it, docs/ops.md): launch(out, pre, inp, weight, bias) writes pre = inp @ weight^T
+ bias (fch, which gelu_backward reads) and out = gelu(pre) (fch_gelu) from one GEMM epilogue, GELU
computed from pre as stored (bf16: rounded) by gelu_forward's own function: the bits of the plain
variant followed by gelu_forward, without gelu_forward re-reading pre.

bf16 builds (--precision bf16; every tensor bf16, fp32 accumulation, one rounding per output element,
dweight and dbias read, added to in fp32 and rounded once): matmul_forward 9 and matmul_backward 5 on
engine 5 (wgmma, Hopper), where the backward GEMMs read dout, weight and inp as they lie (the bf16
wgmma's transpose bits: no transposes, no scratch); matmul_forward 8 (the decoder's GEMV, with gelu);
matmul_backward_bias 4. bf16 rows need 16-byte strides in the TMA: C % 8 (and OC % 8 for backward).
"""
from __future__ import annotations

import numpy as np

from llmc.ops import Built, OpSpec, Variant, check_block_size, ptr as _ptr
from llmc.ops.gemm import gemm_build, gemm_check

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


def _gemv(dtype):
    """matmul_forward 8's build for one element type: a warp per output column, all N <= 8 rows, one
    entry point per row count (cuda/matmul.cu). bf16: 8 bf16 per 16-byte load (C % 8 == 0), fp32
    sums, one rounding on the store."""
    sfx, what = ("", "") if dtype == "fp32" else (f"_{dtype}", f" {dtype}")

    def build(rt, N, C, OC, has_bias=True, block_size=None, gelu=False):
        name = f"matmul_forward_kernel8{'_gelu' if gelu else ''}_rows{N}{sfx}"
        k = rt.kernel(MODULE, name, "PPPPiii", label=f"matmul_forward 8{what}{' + gelu' if gelu else ''} (rows={N})")
        bs = block_size or 256
        grid, args = (-(-OC // (bs // 32)), 1, 1), (np.int32(N), np.int32(C), np.int32(OC))

        def launch(out, inp, weight, bias=None):
            k(grid, (bs, 1, 1), out.ptr, inp.ptr, weight.ptr, _ptr(bias), *args)
        return launch
    return build


matmul_forward8 = _gemv("fp32")
matmul_forward8_bf16 = _gemv("bf16")


def _gemv_checker(vec, what):
    """Variant 8's shape check: at most 8 rows, C a multiple of its 16-byte loads' vec elements."""
    def check(N, C, OC, block_size=None, **_):
        if N > 8:
            return f"N={N} rows > 8 (a GEMV for decoding: each warp keeps all N row sums in registers)"
        if C % vec:
            return f"{what} need C % {vec} == 0 (C={C})"
        return check_block_size(block_size)
    return check


_gemv_check = _gemv_checker(4, "float4 loads")
_gemv_check_bf16 = _gemv_checker(8, "16-byte loads of 8 bf16")


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


def forward_on_engine(engine: int):
    """The build of a matmul_forward variant that is one GEMM on `engine` (bias fused; block_size
    names a tile config, for the lab): out (N,OC) = inp (N,C) @ weight (OC,C)^T, layout nt."""
    def build(rt, N, C, OC, has_bias=True, block_size=None):
        gemm = gemm_build(rt, engine, False, True, M=N, N=OC, K=C, has_bias=has_bias, config=block_size)
        return Built(gemm.launch, plan=gemm.plan)
    return build


def _wgmma_forward(gemm, gelu_pre):
    """matmul_forward's launch over an engine-5 GEMM: launch(out, inp, weight, bias), or with
    gelu_pre launch(out, pre, inp, weight, bias): the GEMM writes pre and, in its epilogue, out = gelu(pre)."""
    if not gelu_pre:
        return Built(gemm, plan=gemm.plan)

    def launch(out, pre, inp, weight, bias=None):
        gemm(pre, inp, weight, bias, out)
    return Built(launch, plan=gemm.plan)


def matmul_forward9(rt, N, C, OC, has_bias=True, block_size=None, gelu_pre=False):
    from llmc.ops.gemm_wgmma import wgmma_build
    # inp (N,C) and weight (OC,C): both K-major
    return _wgmma_forward(wgmma_build(rt, "tf32", N, OC, C, has_bias=has_bias, gelu=gelu_pre), gelu_pre)


def matmul_forward9_bf16(rt, N, C, OC, has_bias=True, block_size=None, gelu_pre=False):
    """out bf16 (N,OC) = inp bf16 (N,C) @ weight bf16 (OC,C)^T + bias bf16: engine 5's bf16 GEMM with
    fp32 accumulation and the bf16 epilogue (bias added in fp32, one rounding on the store)."""
    from llmc.ops.gemm_wgmma import wgmma_build
    return _wgmma_forward(wgmma_build(rt, "bf16", N, OC, C, has_bias=has_bias, out="bf16", gelu=gelu_pre), gelu_pre)


def _need_c8_in(N, C, OC, **_):
    return f"the TMA needs 16-byte rows: C % 8 == 0 for bf16 (C={C})" if C % 8 else None


def forward_engine_check(engine: int):
    def check(N, C, OC, **_):
        return gemm_check(engine, False, True, N, OC, C, 1, C, C, OC, 0, 0, 0)
    return check


matmul_forward6 = forward_on_engine(2)
matmul_forward7 = forward_on_engine(4)


def _need_c4(N, C, OC, **_):
    if C % 4 or OC % 4:
        return f"float4 loads/stores need C % 4 == 0 and OC % 4 == 0 (C={C}, OC={OC})"
    return None


def _need_c4_in(N, C, OC, **_):
    return f"float4 loads need C % 4 == 0 (C={C})" if C % 4 else None


def matmul_forward_cpu(N, C, OC, has_bias=True, gelu=False, gelu_pre=False, **_):
    from llmc.ops.gelu import gelu_forward_ref

    def launch(out, inp, weight, bias=None):
        y = matmul_forward_ref(inp, weight, bias if has_bias else None)
        out[...] = gelu_forward_ref(y).reshape(out.shape) if gelu else y

    def launch_gelu_pre(out, pre, inp, weight, bias=None):
        # the plain form into pre, then gelu_forward's reference on pre as stored: the unfused pair's bits
        launch(pre, inp, weight, bias)
        out[...] = gelu_forward_ref(pre).reshape(out.shape)
    return launch_gelu_pre if gelu_pre else launch


# ----------------------------------------------------------------------------------------------
# matmul_backward: dinp(N,C) = dout(N,OC) @ weight(OC,C) ; dweight(OC,C) += dout^T @ inp


def backward_on_engine(engine: int):
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


def matmul_backward4(rt, N, C, OC, block_size=None):
    """dinp on engine 5 (wgmma): TF32 wgmma needs both operands K-major, and weight (OC,C) is K-major
    for the forward but not for dinp = dout @ weight, so weight^T (C,OC) is written first (a 2 x OC x C
    float pass, ~3-10% of the GEMM's time at GPT-2's shapes). dweight on engine 4."""
    from llmc.ops.gemm_wgmma import transpose_build, wgmma_build
    wt = rt.scratch((C, OC), np.float32)                     # weight^T (written by each launch)
    tr = transpose_build(rt, OC, C)
    g_dinp = wgmma_build(rt, "tf32", N, C, OC)               # dinp(N,C) = dout(N,OC) @ wt(C,OC)^T
    g_dw = gemm_build(rt, 4, True, False, M=OC, N=C, K=N, beta=1.0)
    dw_ = g_dw.launch

    def launch(dinp, dweight, dout, inp, weight):
        tr(wt, weight)
        g_dinp(dinp, dout, wt)
        dw_(dweight, dout, inp)
    return Built(launch, plan=(g_dinp.plan, g_dw.plan))


def _dgelu_form(g_dinp_dg, dweight_part, weight_b=None):
    """matmul_backward's dgelu form over an engine-5 build: launch(dinp, dweight, dout, inp, weight, pre,
    dbias=None): dinp = gelu'(pre) * (dout @ weight) from one GEMM epilogue (the bits of the plain
    dinp then gelu_backward), dbias += dinp's column sums when given, then dweight as the plain form.
    weight_b(weight): the B operand of dinp's GEMM (TF32: weight^T, written into a scratch), else weight."""
    def launch(dinp, dweight, dout, inp, weight, pre, dbias=None):
        g_dinp_dg(dinp, dout, weight_b(weight) if weight_b is not None else weight, pre, dbias)
        dweight_part(dweight, dout, inp)
    return launch


def _parts(built, dinp_part, dweight_part, dinp_only, dweight_only):
    """matmul_backward's one-GEMM forms: dinp_only=True launch(dinp, dout, weight); dweight_only=True
    launch(dweight, dout, inp) (the model runs something between the two: backward's GELU recompute);
    else `built`, both."""
    if dinp_only:
        return Built(dinp_part, plan=built.plan[0])
    if dweight_only:
        return Built(dweight_part, plan=built.plan[1])
    return built


def _dweight_gemm(wgmma_build, overwrite, *args, **kw):
    """Engine 5's dweight GEMM: beta = 1 (dweight +=), or with overwrite beta = 0 on the accumulating
    build's own plan (its tile and K splits: a GEMM the planner splits over K stays on direct stores,
    where a beta = 0 GEMM would otherwise take the TMA store unsplit), so both forms sum in the same
    order: the same bits, the old gradient (zeros) aside."""
    plan_only = kw.pop("plan_only", False)
    if not overwrite:
        return wgmma_build(*args, beta=1.0, plan_only=plan_only, **kw)
    g = wgmma_build(*args, beta=1.0, plan_only=True, **kw)  # (its plan: no workspace of its own)
    return wgmma_build(*args, beta=0.0, store="direct" if g.plan[2] > 1 else "auto", plan_only=plan_only, **kw)


def matmul_backward5(rt, N, C, OC, block_size=None, dgelu=False, dinp_only=False, dweight_only=False,
                     overwrite=False):
    """dinp and dweight on engine 5. dinp as in variant 4 (weight^T written first). dweight =
    dout^T @ inp reduces over the N rows, which is the slow dimension of both operands; TF32 wgmma
    wants K-major tiles in shared memory, so: the wider of dout (N,OC) and inp (N,C) is the A operand,
    M-major straight from its rows into registers (engine 5's `_am` kernels), and the narrower one is
    transposed (N x min(C, OC) floats: one pass, 0.013 ms at N = 4096, C = 768 on the H100) into a
    K-major B. When inp is the wider (fcproj: C = 3072 > OC = 768) the GEMM computes dweight^T and
    stores it transposed. dgelu=True: the fcproj layer's fused form (see _dgelu_form): dinp's GEMM
    runs engine 5's dgelu instance (gelu_backward in its epilogue, the column sums for fc's bias).
    overwrite=True (any form with a dweight): dweight = dout^T @ inp, the GEMM built with beta = 0, so
    the old dweight is never read (the model's first micro-step after zero_grad: no memset first)."""
    from llmc.ops.gemm_wgmma import transpose_build, wgmma_build
    # scratch (each launch writes it before reading it): weight^T for dinp, the narrow operand
    # transposed for dweight, each only where its GEMM is built (a one-GEMM form has no use for the
    # other), and shared by the model's first micro-step twin (overwrite) with its call site's build
    wt = None if dweight_only else rt.scratch((C, OC), np.float32)
    tr_w = transpose_build(rt, OC, C)
    # (a one-GEMM form plans the other GEMM without building it: the plan is part of the Built's record)
    g_dinp = wgmma_build(rt, "tf32", N, C, OC, dgelu=dgelu, colsum=dgelu, plan_only=dweight_only)
    Np = -(-N // 4) * 4                                       # 16-byte rows for the TMA
    narrow = min(C, OC)
    t_buf = None if dinp_only else rt.scratch((narrow, Np), np.float32)
    tr_x = transpose_build(rt, N, narrow, ld_out=Np)
    if OC >= C:   # dweight(OC,C) += dout^T(OC,N) @ inp(N,C): A = dout (M-major), B = inp^T
        g_dw = _dweight_gemm(wgmma_build, overwrite, rt, "tf32", OC, C, N, lda=OC, ldb=Np, ldc=C, a_major="m",
                             plan_only=dinp_only)
    else:         # dweight^T(C,OC) += inp^T(C,N) @ dout(N,OC): A = inp (M-major), B = dout^T
        g_dw = _dweight_gemm(wgmma_build, overwrite, rt, "tf32", C, OC, N, lda=C, ldb=Np, ldc=C, a_major="m",
                             trans_c=True, plan_only=dinp_only)

    def dweight_part(dweight, dout, inp):
        if OC >= C:
            tr_x(t_buf, inp)
            g_dw(dweight, dout, t_buf)
        else:
            tr_x(t_buf, dout)
            g_dw(dweight, inp, t_buf)

    def launch(dinp, dweight, dout, inp, weight):
        tr_w(wt, weight)
        g_dinp(dinp, dout, wt)
        dweight_part(dweight, dout, inp)

    def dinp_part(dinp, dout, weight):
        tr_w(wt, weight)
        g_dinp(dinp, dout, wt)

    if dinp_only or dweight_only:
        return _parts(Built(launch, plan=(g_dinp.plan, g_dw.plan)), dinp_part, dweight_part, dinp_only, dweight_only)
    if dgelu:
        def weight_t(weight):
            tr_w(wt, weight)
            return wt
        return Built(_dgelu_form(g_dinp, dweight_part, weight_t), plan=(g_dinp.plan, g_dw.plan))
    return Built(launch, plan=(g_dinp.plan, g_dw.plan))


def matmul_backward5_bf16(rt, N, C, OC, block_size=None, dgelu=False, dinp_only=False, dweight_only=False,
                          overwrite=False):
    """bf16 dinp and dweight on engine 5, every operand read as it lies: bf16 wgmma takes M- and
    N-major tiles from shared memory (its transpose bits), so unlike TF32 nothing is transposed first.
    dinp (N,C) = dout (N,OC) @ weight (OC,C): A = dout (K-major, K = OC), B = weight as B^T (N-major).
    dweight (OC,C) += dout^T @ inp: A = dout as A^T (M-major), B = inp as B^T (N-major), K = N rows;
    split-K (fp32 partials, reduced in order) where the 128-wide tiles don't fill the GPU. Both round
    once: dinp on the store, dweight after adding the old bf16 gradient in fp32. dgelu=True: the fcproj
    layer's fused form (see _dgelu_form), on engine 5's dgelu instance. overwrite=True: dweight written
    (beta = 0: the old gradient is not read), as in the fp32 build."""
    from llmc.ops.gemm_wgmma import wgmma_build
    g_dinp = wgmma_build(rt, "bf16", N, C, OC, ldb=C, b_major="n", out="bf16", dgelu=dgelu, colsum=dgelu,
                         plan_only=dweight_only)
    # (dweight_only: the trainer's side stream, beside the main stream's kernels: planned for SM time)
    g_dw = _dweight_gemm(wgmma_build, overwrite, rt, "bf16", OC, C, N, lda=OC, ldb=C, ldc=C, a_major="m", b_major="n",
                         out="bf16", plan_only=dinp_only, beside=dweight_only)

    def launch(dinp, dweight, dout, inp, weight):
        g_dinp(dinp, dout, weight)
        g_dw(dweight, dout, inp)
    if dinp_only or dweight_only:
        return _parts(Built(launch, plan=(g_dinp.plan, g_dw.plan)), g_dinp, g_dw, dinp_only, dweight_only)
    if dgelu:
        return Built(_dgelu_form(g_dinp, g_dw), plan=(g_dinp.plan, g_dw.plan))
    return Built(launch, plan=(g_dinp.plan, g_dw.plan))


def _bwd_wgmma5_check_bf16(N, C, OC, overwrite=False, dinp_only=False, **_):
    if overwrite and dinp_only:
        return "overwrite is about dweight, which the dinp_only form does not write"
    if OC % 8 or C % 8:
        return f"the TMA needs 16-byte row strides: C % 8 == 0 and OC % 8 == 0 for bf16 (C={C}, OC={OC})"
    return None


def _bwd_wgmma_check(N, C, OC, **_):
    if OC % 4:
        return f"the TMA needs 16-byte row strides: OC % 4 == 0 (OC={OC})"
    return backward_engine_check(4)(N, C, OC)


def _bwd_wgmma5_check(N, C, OC, overwrite=False, dinp_only=False, **_):
    if overwrite and dinp_only:
        return "overwrite is about dweight, which the dinp_only form does not write"
    if OC % 4 or C % 4:
        return f"the TMA needs 16-byte row strides: C % 4 == 0 and OC % 4 == 0 (C={C}, OC={OC})"
    return None


def backward_engine_check(engine: int):
    def check(N, C, OC, **_):
        return (gemm_check(engine, False, False, N, C, OC, 1, OC, C, C, 0, 0, 0)
                or gemm_check(engine, True, False, OC, C, N, 1, OC, C, C, 0, 0, 0))
    return check


def matmul_backward_cpu(N, C, OC, dgelu=False, dinp_only=False, dweight_only=False, overwrite=False, **_):
    from llmc.ops.gelu import gelu_backward_ref

    def launch_dweight(dweight, dout, inp):
        g = dout.reshape(N, OC).T @ inp.reshape(N, C)
        if overwrite:
            dweight[...] = g
        else:
            dweight += g

    def launch(dinp, dweight, dout, inp, weight):
        # the model passes (B,T,.) views: work on them as (N, .) rows
        dinp[...] = (dout.reshape(N, OC) @ weight).reshape(dinp.shape)
        launch_dweight(dweight, dout, inp)

    def launch_dinp(dinp, dout, weight):
        dinp[...] = (dout.reshape(N, OC) @ weight).reshape(dinp.shape)

    def launch_dgelu(dinp, dweight, dout, inp, weight, pre, dbias=None):
        # the plain form, then gelu_backward's and matmul_backward_bias's references on dinp as stored
        launch(dinp, dweight, dout, inp, weight)
        dinp[...] = gelu_backward_ref(pre, dinp).reshape(dinp.shape)
        if dbias is not None:
            dbias += dinp.reshape(N, C).sum(axis=0)
    if dinp_only or dweight_only:
        return launch_dinp if dinp_only else launch_dweight
    return launch_dgelu if dgelu else launch


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


def _bias4(dtype):
    """Version 4, one launch: per-chunk partials, the last block of each column block (an integer ticket)
    adds them in order. fp32: 4 columns a lane (128 a block); bf16: 8 (256 a block), partials fp32, dbias
    rounded once. min_rows: the least rows a chunk (the lab also times 32, version 3's chunks and version
    4's until session 31, and 64): fewer chunks, fewer partials for the finishing block to add (H200, N =
    4096, OC = 768: 0.0107 ms against 0.0112 with 32 in fp32, 0.0097 against 0.0104 in bf16; no slower
    elsewhere)"""
    sfx, cols = ("", 128) if dtype == "fp32" else (f"_{dtype}", 256)

    def build(rt, N, OC, block_size=None, min_rows=128):
        k = rt.kernel(MODULE, f"matmul_backward_bias_kernel4{sfx}", "PPPPiii",
                      label="matmul_backward_bias 4" + (f" {dtype}" if sfx else ""))
        col_blocks, nchunks, rows = _bias_chunks(rt, N, OC, cols, min_rows)
        partial = rt.empty((nchunks, OC), np.float32)
        counters = rt.zeros((col_blocks,), np.uint32)  # each finishing block resets its own
        args = (np.int32(N), np.int32(OC), np.int32(rows))

        def launch(dbias, dout):
            k((col_blocks, nchunks, 1), (32, 8, 1), dbias.ptr, partial.ptr, counters.ptr, dout.ptr, *args)
        return launch
    return build


matmul_backward_bias4 = _bias4("fp32")
matmul_backward_bias4_bf16 = _bias4("bf16")


def _bias_cluster(dtype):
    """Version 5 (sm_90): clusters of 8 blocks, each cluster a slice of columns, each block an eighth of
    the rows; the cluster adds its 8 sums through distributed shared memory (cuda/matmul.cu). `lanes`:
    16-byte column lanes per 256-thread block, 8 (the default) or 4 (half the columns a block, twice the
    blocks: no faster at any lab shape on an H200, N = 4096 and 16384, OC = 768 included)."""
    vec = 8 if dtype == "bf16" else 4
    sfx = "_bf16" if dtype == "bf16" else ""

    def build(rt, N, OC, block_size=None, lanes=8):
        if lanes not in (4, 8):
            raise ValueError(f"matmul_backward_bias 5: lanes must be 4 or 8, got {lanes}")
        k = rt.kernel(MODULE, f"matmul_backward_bias_kernel5_l{lanes}{sfx}", "PPii",
                      label=f"matmul_backward_bias 5 {dtype}")
        grid, args = (-(-OC // (lanes * vec)), 8, 1), (np.int32(N), np.int32(OC))

        def launch(dbias, dout):
            k(grid, (256, 1, 1), dbias.ptr, dout.ptr, *args)
        return launch
    return build


def _bias_c8(N, OC, **_):
    return f"16-byte loads of 8 bf16 need OC % 8 == 0 (OC={OC})" if OC % 8 else None


def _bias_c4(N, OC, **_):
    return f"float4 loads need OC % 4 == 0 (OC={OC})" if OC % 4 else None


def matmul_backward_bias_cpu(N, OC, **_):
    def launch(dbias, dout):
        dbias += dout.reshape(N, OC).sum(axis=0)
    return launch


# ----------------------------------------------------------------------------------------------
# cost models (FLOPs, bytes) of one call, for the lab and the profile: each input read once, each
# output written once (the dweight accumulation reads and writes it)

def cost_forward(N, C, OC, has_bias=True, gelu_pre=False, **_):
    # gelu_pre: a second (N, OC) output, gelu(out)
    return 2 * N * C * OC, 4 * (N * C + OC * C + N * OC * (2 if gelu_pre else 1) + (OC if has_bias else 0))


def cost_backward(N, C, OC, dinp_only=False, dweight_only=False, overwrite=False, **_):
    dw = (1 if overwrite else 2) * OC * C  # dweight written (overwrite), or read and written
    if dinp_only:   # read dout, weight; write dinp
        return 2 * N * C * OC, 4 * (N * OC + OC * C + N * C)
    if dweight_only:  # read dout, inp; dweight
        return 2 * N * C * OC, 4 * (N * OC + N * C + dw)
    return 4 * N * C * OC, 4 * (N * OC + N * C + dw + N * C)


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
                      "swizzled smem, fused bias, float4 stores", matmul_forward6, forward_engine_check(2), engine=2),
        7: Variant(7, "TF32 GEMM engine 4: engine 2 with ldmatrix fragments and a leaner loader "
                      "(fewer instructions per mma)", matmul_forward7, forward_engine_check(4), engine=4),
        8: Variant(8, "GEMV for decoding (N <= 8 rows): a warp per output column, float4 weight stream "
                      "read once, row sums in registers", {"fp32": matmul_forward8, "bf16": matmul_forward8_bf16},
                   {"fp32": _gemv_check, "bf16": _gemv_check_bf16}, engine=1, options=("gelu",)),
        9: Variant(9, "TF32 GEMM engine 5 (Hopper): wgmma from TMA-loaded 128B-swizzled smem, 3-6 stage "
                      "mbarrier pipeline, producer + 2 consumer warpgroups, persistent, fused bias, TMA "
                      "stores for short K; gelu_pre: the fc layer's GELU fused into the epilogue",
                   {"fp32": matmul_forward9, "bf16": matmul_forward9_bf16},
                   {"fp32": _need_c4_in, "bf16": _need_c8_in}, arch="sm_90", engine=4, options=("gelu_pre",)),
    }, default=9, flag="--matmul-kernel", options=("gelu", "gelu_pre"), cost=cost_forward,
        doc="out(N,OC)= ; inp(N,C), weight(OC,C), bias(OC) or None; gelu=True: out = gelu(...) (variant 8); "
            "gelu_pre=True: out(N,OC)=, pre(N,OC)=, inp, weight, bias: pre = inp @ weight^T + bias, "
            "out = gelu(pre as stored) (variant 9)"),
    OpSpec("matmul_backward", matmul_backward_cpu, {
        1: Variant(1, "SIMT: dinp and dweight on GEMM engine 1 (64x64 tiles)", backward_on_engine(1), engine=1),
        2: Variant(2, "TF32: dinp and dweight on GEMM engine 2 (split-K for the K=N reduction)",
                   backward_on_engine(2), backward_engine_check(2), engine=2),
        3: Variant(3, "TF32: dinp and dweight on GEMM engine 4 (ldmatrix fragments; split-K for dweight)",
                   backward_on_engine(4), backward_engine_check(4), engine=4),
        4: Variant(4, "TF32: dinp on GEMM engine 5 (wgmma, Hopper; weight transposed first), dweight on "
                      "engine 4", matmul_backward4, _bwd_wgmma_check, arch="sm_90", engine=4),
        5: Variant(5, "TF32: dinp and dweight on GEMM engine 5; dweight's wider operand M-major through "
                      "registers, the narrower one transposed (bf16: every operand as it lies, transposed "
                      "in the wgmma)", {"fp32": matmul_backward5, "bf16": matmul_backward5_bf16},
                   {"fp32": _bwd_wgmma5_check, "bf16": _bwd_wgmma5_check_bf16}, arch="sm_90", engine=4,
                   options=("dgelu", "dinp_only", "dweight_only", "overwrite")),
    }, default=5, flag="--matmul-backward-kernel", options=("dgelu", "dinp_only", "dweight_only", "overwrite"),
        cost=cost_backward,
        doc="dinp(N,C)= ; dweight(OC,C)+= ; dout(N,OC), inp(N,C), weight(OC,C); dgelu=True (variant 5, the "
            "fcproj layer's fused form): dinp, dweight, dout, inp, weight, pre(N,C), dbias(C) or None: "
            "dinp = gelu'(pre) * (dout @ weight as stored), dbias += dinp's column sums; dinp_only=True "
            "(variant 5): dinp(N,C)=, dout, weight; dweight_only=True: dweight(OC,C)+=, dout, inp; "
            "overwrite=True (variant 5, with any form that writes dweight): dweight(OC,C)= instead of +="),
    OpSpec("matmul_backward_bias", matmul_backward_bias_cpu, {
        1: Variant(1, "one thread per column over all rows", matmul_backward_bias1),
        2: Variant(2, "(32x8)-thread blocks over row chunks -> partials, fixed-order second pass "
                      "(deterministic, no atomics)", matmul_backward_bias2),
        3: Variant(3, "version 2 with float4 columns (128 per block), 4 rows in flight per thread",
                   matmul_backward_bias3, _bias_c4),
        4: Variant(4, "version 3 in one launch: the last block of each column block sums the partials in "
                      "order (deterministic)", {"fp32": matmul_backward_bias4, "bf16": matmul_backward_bias4_bf16},
                   {"fp32": _bias_c4, "bf16": _bias_c8}),
        5: Variant(5, "clusters of 8 blocks over the rows of a column slice, summed in rank order through "
                      "distributed shared memory: no partials, no counters (deterministic)",
                   {"fp32": _bias_cluster("fp32"), "bf16": _bias_cluster("bf16")},
                   {"fp32": _bias_c4, "bf16": _bias_c8}, arch="sm_90"),
    }, default=4, flag="--matmul-backward-bias-kernel", cost=cost_backward_bias, doc="dbias(OC)+= ; dout(N,OC)"),
]
