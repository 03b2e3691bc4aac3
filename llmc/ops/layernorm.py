"""Layernorm: GPT-2's normalisation over the channels of (N, C) rows, forward and backward.

    python dev/cuda/layernorm_forward.py        # validate + time every forward variant (B=4, T=1024, C=768)
    python dev/cuda/layernorm_forward.py 4 5    # just variants 4 and 5
    python dev/cuda/layernorm_backward.py
    python -m pytest tests/test_layernorm.py -q           # references vs torch autograd (float64)
    python -m pytest -m gpu tests/test_layernorm.py -q    # every variant vs the reference, on a GPU

Semantics (docs/ops.md):
    layernorm_forward:  out(N,C)=, mean(N)=, rstd(N)=, inp(N,C), weight(C), bias(C)
                        eps = 1e-5, biased variance; mean and rstd are kept for backward
    layernorm_backward: dinp(N,C)+=, dweight(C)+=, dbias(C)+=, dout(N,C), inp(N,C), weight(C),
                        mean(N), rstd(N)
      with colsum=True (variants 5 and 7, the fused form the model asks for when the chosen variant has it):
                        dinp(N,C)+=, dweight(C)+=, dbias(C)+=, colsum(C)+=, dout, inp, weight, mean, rstd
                        colsum += column sums of dinp after its += (the bias gradient of the linear
                        layer that wrote the residual stream here: one matmul_backward_bias less)

bf16 builds (entry points <kernel>_bf16[_nvN]): forward 3, 4, 5, 6 and backward 3, 5, 6, 7. Variant 6
(both directions, both dtypes) is written for the copy ceiling at GPT-2's shapes: persistent warps
over consecutive rows with the next row in flight, 16-byte vectors only (it refuses C % 8 != 0 in
bf16, C % 4 != 0 in fp32, and C past its register budget, in one line; the defaults stay 5 until it
is timed). Backward 7 (both dtypes; fp32 only to C=384) runs in one launch with the colsum form too,
and is the bf16 default (B=16, C=768 on the H100: 69% of the copy bandwidth against 5's 63%, colsum 67%
against 57%); forward's bf16 default is 4 (76% against 5's 67%: 5's streaming hints cost it). Every tensor is
bf16 except mean(N) and rstd(N), which stay fp32 in both directions; the math is fp32 and each output
element is rounded once (the "+=" outputs: read, add in fp32, round). The vector kernels move 16
bytes (8 bf16) per access and take C % 8 != 0 through guarded scalar accesses. Backward's per-block
dweight/dbias partial sums are fp32 scratch, (min(N, MAX_BLOCKS), 2, C), declared by scratch_bytes.

This module is the pattern the other op modules follow: numpy references, the cpu launchers that
wrap them, one small build function per GPU variant (kernels resolved, grid/block/shared memory and
scratch fixed at build; the returned closure only launches), then the OPS table.
"""
from __future__ import annotations

import numpy as np

from llmc.ops import Built, OpSpec, Variant, refuse, check_block_size, as_view, esize
from llmc.runtime import ceil_div

MODULE = "layernorm"  # cuda/layernorm.cu
EPS = 1e-5
MAX_NV = 16           # register-resident variants hold C/4 float4 over 32 lanes: C <= 16*128
                      # (bf16: C/8 vectors of 8, so NV <= 8 for the same C <= 2048)
MAX_BLOCKS = 1024     # deterministic backward: at most this many blocks, so scratch is known from the shape
SMEM_OPTIN = 227 * 1024  # H100's per-block shared-memory limit (opt-in); build re-reads the device's


# ----------------------------------------------------------------------------------------------
# numpy references (float32 or float64: they compute in the inputs' dtype)

def layernorm_forward_ref(inp, weight, bias, eps=EPS):
    """inp (N, C) (or any (..., C)) -> out, mean (...), rstd (...)."""
    mean = inp.mean(axis=-1, keepdims=True)
    xc = inp - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)  # biased, two-pass: E[(x - mean)^2]
    rstd = 1.0 / np.sqrt(var + eps)
    out = xc * rstd * weight + bias
    return out, mean[..., 0], rstd[..., 0]


def layernorm_backward_ref(dout, inp, weight, mean, rstd):
    """Gradients of layernorm_forward: (dinp, dweight, dbias), not accumulated."""
    norm = (inp - mean[..., None]) * rstd[..., None]
    dnorm = dout * weight
    dinp = rstd[..., None] * (dnorm - dnorm.mean(axis=-1, keepdims=True)
                              - norm * (dnorm * norm).mean(axis=-1, keepdims=True))
    red = tuple(range(dout.ndim - 1))
    dweight = (norm * dout).sum(axis=red)
    dbias = dout.sum(axis=red)
    return dinp, dweight, dbias


_shaped = as_view  # a view of `a` with `shape`; raises instead of silently copying


# ----------------------------------------------------------------------------------------------
# cpu launchers: same arguments and semantics as the GPU variants

def layernorm_forward_cpu(N, C, block_size=None):
    def launch(out, mean, rstd, inp, weight, bias):
        o, m, s = layernorm_forward_ref(_shaped(inp, (N, C)), weight, bias)
        _shaped(out, (N, C))[...] = o
        _shaped(mean, (N,))[...] = m
        _shaped(rstd, (N,))[...] = s
    return launch


def layernorm_backward_cpu(N, C, block_size=None, colsum=False, deferred=0):
    def launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        gi, gw, gb = layernorm_backward_ref(_shaped(dout, (N, C)), _shaped(inp, (N, C)), weight,
                                            _shaped(mean, (N,)), _shaped(rstd, (N,)))
        _shaped(dinp, (N, C))[...] += gi
        dweight += gw
        dbias += gb

    def launch_colsum(dinp, dweight, dbias, colsum, dout, inp, weight, mean, rstd):
        launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd)
        colsum += _shaped(dinp, (N, C)).sum(axis=0)  # matmul_backward_bias's cpu sum, the same bits
    fn = launch_colsum if colsum else launch
    if deferred:  # the deferred form's signature (a slot first); numpy adds the sums at once
        return lambda slot, *args: fn(*args)
    return fn


# ----------------------------------------------------------------------------------------------
# shape checks (no GPU needed) and small build helpers

_check_block = check_block_size  # whole warps, <= 1024 threads


def check_any(N, C, block_size=None):
    return _check_block(block_size)


def check_float4(N, C, block_size=None):
    if C % 4:
        return f"C={C} is not a multiple of 4 (float4 loads of each row)"
    if C > MAX_NV * 128:
        return f"C={C} > {MAX_NV * 128} (the row is held in registers: at most {MAX_NV} float4 per lane)"
    return _check_block(block_size)


def check_smem(N, C, block_size=None):
    if 2 * C * 4 > SMEM_OPTIN:
        return f"C={C}: the per-warp dweight/dbias accumulators (8*C bytes) exceed shared memory"
    return _check_block(block_size)


def check_float4_smem(N, C, block_size=None):
    return check_float4(N, C, block_size) or check_smem(N, C, block_size)


def check_backward5(N, C, block_size=None, colsum=False, deferred=0):
    """Variant 5, with or without its fused colsum (a third per-warp row: 12*C bytes a warp); deferred=S
    (the column sums of S calls at one flush)."""
    if deferred and (not isinstance(deferred, int) or deferred < 1):
        return f"deferred={deferred!r}: expected a number of slots >= 1"
    if colsum and 3 * C * 4 > SMEM_OPTIN:
        return f"C={C}: the per-warp dweight/dbias/colsum accumulators (12*C bytes) exceed shared memory"
    return check_float4_smem(N, C, block_size)


def _nv(C):
    return max(1, ceil_div(C // 4, 128 // 4))


def _nv_bf16(C):
    return max(1, ceil_div(C, 256))  # 16-byte vectors of 8 bf16 over 32 lanes


def _sfx(dtype):
    return "" if dtype == "fp32" else f"_{dtype}"  # entry point suffix: layernorm_forward_kernel3_bf16


def _entry(op, number, dtype, C, per_nv):
    """Entry point name: <op>_kernel<n>[_bf16][_nvN] (per_nv: the register-resident kernels)."""
    name = f"{op}_kernel{number}{_sfx(dtype)}"
    if per_nv:
        name += f"_nv{_nv(C) if dtype == 'fp32' else _nv_bf16(C)}"
    return name


def _fits(op, number, kernel, block_size):
    """Refuse a block size the kernel can't launch with (its registers cap threads per block)."""
    limit = kernel.attributes()["max_threads"]
    if block_size > limit:
        refuse(op, number, f"block_size={block_size} > {limit} threads (register use of {kernel.label})")


def _i32(*xs):
    return [np.int32(x) for x in xs]


# ----------------------------------------------------------------------------------------------
# layernorm_forward variants

FWD_ARGS = "PPPPPPii"  # out, mean, rstd, inp, weight, bias, N, C


def _forward_rows_per_thread(number, default_bs):  # (fp32 only)
    """Variant 1: one thread per row."""
    def build(rt, N, C, block_size=None):
        bs = block_size or default_bs
        k = rt.kernel(MODULE, f"layernorm_forward_kernel{number}", FWD_ARGS, label=f"layernorm_forward {number}")
        _fits("layernorm_forward", number, k, bs)
        grid, n_, c_ = (ceil_div(N, bs), 1, 1), *_i32(N, C)

        def launch(out, mean, rstd, inp, weight, bias):
            k(grid, (bs, 1, 1), out.ptr, mean.ptr, rstd.ptr, inp.ptr, weight.ptr, bias.ptr, n_, c_)
        return launch
    return build


def layernorm_forward2(rt, N, C, block_size=None):
    """One block per row."""
    bs = block_size or 128
    k = rt.kernel(MODULE, "layernorm_forward_kernel2", FWD_ARGS, label="layernorm_forward 2")
    _fits("layernorm_forward", 2, k, bs)
    n_, c_ = _i32(N, C)

    def launch(out, mean, rstd, inp, weight, bias):
        k((N, 1, 1), (bs, 1, 1), out.ptr, mean.ptr, rstd.ptr, inp.ptr, weight.ptr, bias.ptr, n_, c_)
    return launch


def _forward_warp_per_row(number, default_bs, per_nv, dtype="fp32"):
    """Variants 3, 4, 5: one warp per row, block_size/32 rows per block."""
    def build(rt, N, C, block_size=None):
        bs = block_size or default_bs
        name = _entry("layernorm_forward", number, dtype, C, per_nv)
        k = rt.kernel(MODULE, name, FWD_ARGS, label=f"layernorm_forward {number} {dtype}")
        _fits("layernorm_forward", number, k, bs)
        grid, n_, c_ = (ceil_div(N, bs // 32), 1, 1), *_i32(N, C)

        def launch(out, mean, rstd, inp, weight, bias):
            k(grid, (bs, 1, 1), out.ptr, mean.ptr, rstd.ptr, inp.ptr, weight.ptr, bias.ptr, n_, c_)
        return launch
    return build


layernorm_forward1 = _forward_rows_per_thread(1, 128)
layernorm_forward3 = _forward_warp_per_row(3, 256, False)
layernorm_forward4 = _forward_warp_per_row(4, 256, True)
layernorm_forward5 = _forward_warp_per_row(5, 256, True)
layernorm_forward3_bf16 = _forward_warp_per_row(3, 256, False, "bf16")
layernorm_forward4_bf16 = _forward_warp_per_row(4, 256, True, "bf16")
layernorm_forward5_bf16 = _forward_warp_per_row(5, 256, True, "bf16")


# ----------------------------------------------------------------------------------------------
# layernorm_backward variants

BWD_ARGS = "PPPPPPPPii"  # dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C


def _blocks_per_sm(rt, k, bs, smem):
    """How many blocks of this kernel fit on one SM (threads, registers, shared memory)."""
    regs = max(1, k.attributes()["regs"])
    by_threads = 2048 // bs
    by_regs = 65536 // (regs * bs)
    by_smem = (rt.max_smem_optin + 1024) // (smem + 1024) if smem else 32
    return max(1, min(by_threads, by_regs, by_smem, 32))


def layernorm_backward1(rt, N, C, block_size=None):
    """One thread per row, global atomics for dweight/dbias."""
    bs = block_size or 128
    k = rt.kernel(MODULE, "layernorm_backward_kernel1", BWD_ARGS, label="layernorm_backward 1")
    _fits("layernorm_backward", 1, k, bs)
    grid, n_, c_ = (ceil_div(N, bs), 1, 1), *_i32(N, C)

    def launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        k(grid, (bs, 1, 1), dinp.ptr, dweight.ptr, dbias.ptr, dout.ptr, inp.ptr, weight.ptr,
          mean.ptr, rstd.ptr, n_, c_)
    return launch


def layernorm_backward2(rt, N, C, block_size=None):
    """Warp per row, block-shared accumulators (shared atomics), one global atomic per channel per block."""
    bs = block_size or 512
    k = rt.kernel(MODULE, "layernorm_backward_kernel2", BWD_ARGS, label="layernorm_backward 2")
    _fits("layernorm_backward", 2, k, bs)
    smem = 2 * C * 4
    if smem > rt.max_smem_optin:
        refuse("layernorm_backward", 2, f"C={C}: 8*C bytes of accumulators exceed shared memory")
    k.set_max_dynamic_smem(smem)
    G = min(ceil_div(N, bs // 32), rt.sm_count * _blocks_per_sm(rt, k, bs, smem))
    n_, c_ = _i32(N, C)

    def launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
        k((G, 1, 1), (bs, 1, 1), dinp.ptr, dweight.ptr, dbias.ptr, dout.ptr, inp.ptr, weight.ptr,
          mean.ptr, rstd.ptr, n_, c_, smem=smem)
    return launch


def _backward_smem_per_warp(number, C, dtype, rows=2):
    """Bytes of per-warp dweight|dbias (|colsum: rows=3) accumulators: rows*C floats; the bf16
    kernel 5's rows are padded to a whole 16-byte vector (C rounded up to 8)."""
    return rows * 4 * (ceil_div(C, 8) * 8 if dtype == "bf16" and number == 5 else C)


def scratch_bytes_backward(N, C, colsum=False, deferred=0, **_):
    """The deterministic variants' fp32 partials, (min(N, MAX_BLOCKS), 2, C) (3 with colsum), in
    either dtype; deferred=S (5): S slots of (G, 3, C) partials (G <= min(N, MAX_BLOCKS): an upper
    bound) and the S x 3 pointer table."""
    if deferred:
        return 4 * 3 * C * min(N, MAX_BLOCKS) * deferred + 8 * 3 * deferred
    return 4 * (3 if colsum else 2) * C * min(N, MAX_BLOCKS)


def _backward_deterministic(number, default_bs, per_nv, dtype="fp32"):
    """Variants 3, 4, 5: per-warp accumulators, per-block partials in scratch (G, 2, C) allocated
    here (fp32 in both dtypes, G <= MAX_BLOCKS), then the fixed-order reduce kernel. Same inputs ->
    same bits, every run. colsum=True (variant 5 only: the table refuses it for 3 and 4): the fused
    form, kernels <op>_kernel5_colsum[_bf16]_nvN with a third row of partials, scratch (G, 3, C),
    finished by the colsum reduce (cuda/layernorm.cu, "colsum")."""
    def build(rt, N, C, block_size=None, colsum=False, deferred=0):
        bs = block_size or default_bs
        label = f"layernorm_backward {number} {dtype}" + (" colsum" if colsum else "")
        name = _entry("layernorm_backward", number, dtype, C, per_nv)
        if colsum:
            name = name.replace(f"_kernel{number}", f"_kernel{number}_colsum")
        k = rt.kernel(MODULE, name, "PPPPPPPiii", label=label)
        reduce_name = "layernorm_backward_reduce_colsum_kernel" if colsum else "layernorm_backward_reduce_kernel"
        kr = rt.kernel(MODULE, reduce_name + _sfx(dtype), "PPPPii" if colsum else "PPPii", label=label + " (reduce)")
        _fits("layernorm_backward", number, k, bs)
        # each warp needs its accumulators in shared memory: use fewer warps per block if C is large
        K = 3 if colsum else 2  # rows of per-warp accumulators and of per-block partials
        per_warp = _backward_smem_per_warp(number, C, dtype, K)
        nwarps = min(bs // 32, rt.max_smem_optin // per_warp)
        if nwarps == 0:
            refuse("layernorm_backward", number, f"C={C}: {per_warp} bytes of accumulators per warp exceed shared memory")
        bs = nwarps * 32
        smem = nwarps * per_warp
        k.set_max_dynamic_smem(smem)
        # enough blocks for one full wave (at most MAX_BLOCKS); rows per block R a multiple of the
        # warps so they share evenly
        G0 = min(rt.sm_count * _blocks_per_sm(rt, k, bs, smem), MAX_BLOCKS)
        R = nwarps * ceil_div(N, G0 * nwarps)
        G = ceil_div(N, R)
        assert G <= min(N, MAX_BLOCKS)
        n_, c_, r_, g_ = _i32(N, C, R, G)
        if deferred:  # (variant 5) each call's partials into its own slot, summed at the flush: no reduce a call
            def main(part, dinp, dweight, dbias, *rest):
                ins = rest[1:] if colsum else rest
                k((G, 1, 1), (bs, 1, 1), dinp.ptr, part, *(a.ptr for a in ins), n_, c_, r_, smem=smem)
            return _deferred(rt, dtype, G, C, colsum, deferred, main, label)
        scratch = rt.scratch((min(N, MAX_BLOCKS), K, C), np.float32)  # per-block dweight | dbias (| colsum) partials
        grid_r = (ceil_div(C, 32), 1, 1)

        def launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
            k((G, 1, 1), (bs, 1, 1), dinp.ptr, scratch.ptr, dout.ptr, inp.ptr, weight.ptr,
              mean.ptr, rstd.ptr, n_, c_, r_, smem=smem)
            kr(grid_r, (32, 32, 1), dweight.ptr, dbias.ptr, scratch.ptr, g_, c_)

        def launch_colsum(dinp, dweight, dbias, colsum, dout, inp, weight, mean, rstd):
            k((G, 1, 1), (bs, 1, 1), dinp.ptr, scratch.ptr, dout.ptr, inp.ptr, weight.ptr,
              mean.ptr, rstd.ptr, n_, c_, r_, smem=smem)
            kr(grid_r, (32, 32, 1), dweight.ptr, dbias.ptr, colsum.ptr, scratch.ptr, g_, c_)
        return Built(launch_colsum if colsum else launch, scratch={"partials": scratch})
    return build


layernorm_backward3 = _backward_deterministic(3, 256, False)
layernorm_backward4 = _backward_deterministic(4, 256, True)
layernorm_backward5 = _backward_deterministic(5, 256, True)
layernorm_backward3_bf16 = _backward_deterministic(3, 256, False, "bf16")
layernorm_backward5_bf16 = _backward_deterministic(5, 256, True, "bf16")


# ----------------------------------------------------------------------------------------------
# variant 6 (forward and backward): persistent warps, R consecutive rows each, the next row's loads
# in flight while this one is computed (cuda/layernorm.cu). 16-byte vectors only.

V16 = {"fp32": 4, "bf16": 8}          # elements per 16-byte vector
NV6 = {"forward": 8, "backward": 4}   # the register-resident rows' vectors per lane, at most


def _check6(direction, dtype):
    def check(N, C, block_size=None):
        v = V16[dtype]
        if C % v:
            return f"C={C} is not a multiple of {v} (16-byte vectors of {v} {dtype}; variant 6 has no scalar path)"
        if C > NV6[direction] * 32 * v:
            return f"C={C} > {NV6[direction] * 32 * v} ({dtype}: the rows are held in registers, {NV6[direction]} vectors per lane)"
        return _check_block(block_size)
    return check


def _persistent_rows(rt, k, bs, smem, N, max_warps=None):
    """Rows per warp R and warps W for a grid of persistent warps: as many warps as are resident on the
    GPU at once (capped by max_warps), each taking R = ceil(N / W) consecutive rows."""
    resident = rt.sm_count * _blocks_per_sm(rt, k, bs, smem) * (bs // 32)
    W = max(1, min(N, resident, max_warps or N))
    R = ceil_div(N, W)
    return R, ceil_div(N, R)


def _forward6(dtype):
    def build(rt, N, C, block_size=None):
        bs = block_size or 256
        nv = ceil_div(C, 32 * V16[dtype])
        k = rt.kernel(MODULE, f"layernorm_forward_kernel6{_sfx(dtype)}_nv{nv}", FWD_ARGS + "i",
                      label=f"layernorm_forward 6 {dtype}")
        _fits("layernorm_forward", 6, k, bs)
        R, W = _persistent_rows(rt, k, bs, 0, N)
        grid, n_, c_, r_ = (ceil_div(W, bs // 32), 1, 1), *_i32(N, C, R)

        def launch(out, mean, rstd, inp, weight, bias):
            k(grid, (bs, 1, 1), out.ptr, mean.ptr, rstd.ptr, inp.ptr, weight.ptr, bias.ptr, n_, c_, r_)
        return launch
    return build


def _backward6(dtype):
    def build(rt, N, C, block_size=None):
        bs = block_size or 128
        nv = ceil_div(C, 32 * V16[dtype])
        label = f"layernorm_backward 6 {dtype}"
        k = rt.kernel(MODULE, f"layernorm_backward_kernel6{_sfx(dtype)}_nv{nv}", "PPPPPPPiii", label=label)
        kr = rt.kernel(MODULE, f"layernorm_backward_reduce_kernel{_sfx(dtype)}", "PPPii", label=label + " (reduce)")
        _fits("layernorm_backward", 6, k, bs)
        smem = (bs // 32) * 2 * C * 4  # the warps' dweight | dbias sums, added in order at the end
        if smem > rt.max_smem_optin:
            refuse("layernorm_backward", 6, f"C={C}, block_size={bs}: {smem} bytes of per-warp sums exceed shared memory")
        k.set_max_dynamic_smem(smem)
        # at most MAX_BLOCKS blocks (the scratch rows), so at most MAX_BLOCKS * warps per block warps
        R, W = _persistent_rows(rt, k, bs, smem, N, max_warps=MAX_BLOCKS * (bs // 32))
        G = ceil_div(W, bs // 32)
        assert G <= min(N, MAX_BLOCKS)
        scratch = rt.scratch((min(N, MAX_BLOCKS), 2, C), np.float32)  # per-block dweight | dbias partials
        n_, c_, r_, g_ = _i32(N, C, R, G)
        grid_r = (ceil_div(C, 32), 1, 1)

        def launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
            k((G, 1, 1), (bs, 1, 1), dinp.ptr, scratch.ptr, dout.ptr, inp.ptr, weight.ptr,
              mean.ptr, rstd.ptr, n_, c_, r_, smem=smem)
            kr(grid_r, (32, 32, 1), dweight.ptr, dbias.ptr, scratch.ptr, g_, c_)
        return Built(launch, scratch={"partials": scratch})
    return build


# ----------------------------------------------------------------------------------------------
# backward variant 7: persistent warps, rows strided over the grid, each warp's next rows in a
# shared-memory ring filled by cp.async, the blocks' partials summed in the same launch by the last
# blocks to finish, in a fixed order (cuda/layernorm.cu, "Backward variant 7")

# kernel flags (the lab's comparisons): 6's consecutive rows; the reduce kernel; session 34's ticketed tail
LN7_CHUNKED, LN7_SPLIT, LN7_RESET = 1, 2, 4
LN7_OUTS = 8  # (set per launch: the outputs' old values staged in shared memory, where they are 16-byte aligned)
NV7 = {"fp32": 3, "bf16": 4}   # vectors per lane, at most (the entry points; registers)


def _check7(dtype):
    def check(N, C, block_size=None, colsum=False, deferred=0):
        if deferred and (not isinstance(deferred, int) or deferred < 1):
            return f"deferred={deferred!r}: expected a number of slots >= 1"
        v = V16[dtype]
        nv = NV7[dtype]
        if C % v:
            return f"C={C} is not a multiple of {v} (16-byte vectors of {v} {dtype}; variant 7 has no scalar path)"
        if C > nv * 32 * v:
            return f"C={C} > {nv * 32 * v} ({dtype}: the rows are held in registers, {nv} vectors per lane)"
        return _check_block(block_size)
    return check


def scratch_bytes_backward7(N, C, colsum=False, deferred=0, **_):
    """Variant 7: the (min(N, MAX_BLOCKS), K, C) fp32 partials of 3-6, and two uint32 tickets; deferred=S:
    S slots of (G, 3, C) partials (G <= min(N, MAX_BLOCKS): an upper bound) and the S x 3 pointer table."""
    return scratch_bytes_backward(N, C, colsum=colsum, deferred=deferred) + 8


def _backward7(dtype):
    """384 threads (one block an SM at C = 768 bf16: 12 warps, 167 registers) and 2 stages a warp: the
    fastest of the sweep (dev/cuda/layernorm_sweep7.py). The deferred form (the trainer's): its 24 calls
    and flush took 0.2487 ms against 0.2607 with 3 stages at B=4 and 0.7350 against 0.7624 at B=16 (H200,
    bf16, session 34). The ticketed form, since session 49's shorter tail: B=4 0.0153 ms against 0.0159
    (colsum 0.0161 against 0.0173), B=16 0.0345 against 0.0349 (0.0355 against 0.0367) (H200, bf16, L2
    flushed, the sweep's "backward tails"; session 34 had chosen 3 stages with the old tail). The lab's comparisons only: flags
    LN7_CHUNKED, LN7_SPLIT (the reduce kernel sums the partials, as for 3-6), LN7_RESET (session 34's tail:
    the summers wait for the count to reach G and the last resets both counters); stages: rows per warp in
    the shared-memory ring (stages - 1 in flight); rows_per_warp: R consecutive rows per warp and as
    many blocks as that takes (more than are resident: the hardware hands out the blocks)."""
    def build(rt, N, C, block_size=None, colsum=False, flags=0, stages=None, rows_per_warp=None, deferred=0):
        bs = block_size or 384
        P = stages or 2
        assert 2 <= P <= 6
        nv = ceil_div(C, 32 * V16[dtype])
        label = f"layernorm_backward 7 {dtype}" + (" colsum" if colsum else "")
        K = 3 if colsum else 2
        cs = "_colsum" if colsum else ""
        k = rt.kernel(MODULE, f"layernorm_backward_kernel7{cs}{_sfx(dtype)}_nv{nv}",
                      ("PPPPPP" if colsum else "PPPPP") + "PPPPPiiii", label=label)
        _fits("layernorm_backward", 7, k, bs)
        smem = (bs // 32) * P * 3 * C * esize(dtype) + 16  # each warp's ring of P (dout|inp|dinp) rows; ticket
        if smem > rt.max_smem_optin:
            refuse("layernorm_backward", 7, f"C={C}, block_size={bs}: {smem} bytes of row stages exceed shared memory")
        # the ticketed form: the outputs' old values after the ticket, where they fit (LN7_OUTS)
        ticketed = not (deferred or flags & (LN7_SPLIT | LN7_RESET))
        outs_smem = ticketed and smem + K * C * esize(dtype) <= rt.max_smem_optin
        if outs_smem:
            smem += K * C * esize(dtype)
        k.set_max_dynamic_smem(smem)
        # persistent: no more blocks than are resident at once (the last blocks wait for the others),
        # at most MAX_BLOCKS (the scratch rows)
        R, W = _persistent_rows(rt, k, bs, smem, N, max_warps=MAX_BLOCKS * (bs // 32))
        if rows_per_warp:
            flags |= LN7_CHUNKED
            R, W = rows_per_warp, ceil_div(N, rows_per_warp)
        G = ceil_div(W, bs // 32)
        assert G <= min(N, MAX_BLOCKS)
        tickets = rt.zeros(2, np.uint32)  # arrivals, finished final sums; back to 0 after each launch
        n_, c_, r_, f_, g_ = _i32(N, C, R, flags | (P << 8), G)
        if deferred:  # each call's partials into its own slot (LN7_SPLIT: no tickets), summed at the flush
            fd_ = _i32(flags | LN7_SPLIT | (P << 8))[0]

            def main(part, dinp, dweight, dbias, *rest):
                cs = (rest[0].ptr,) if colsum else ()
                ins = rest[1:] if colsum else rest
                k((G, 1, 1), (bs, 1, 1), dinp.ptr, dweight.ptr, dbias.ptr, *cs, part, tickets.ptr,
                  *(a.ptr for a in ins), n_, c_, r_, fd_, smem=smem)
            b = _deferred(rt, dtype, G, C, colsum, deferred, main, label)
            b.scratch["tickets"] = tickets
            return b
        scratch = rt.scratch((min(N, MAX_BLOCKS), K, C), np.float32)  # per-block dweight | dbias (| colsum)
        split = bool(flags & LN7_SPLIT)
        if split:
            reduce_name = "layernorm_backward_reduce_colsum_kernel" if colsum else "layernorm_backward_reduce_kernel"
            kr = rt.kernel(MODULE, reduce_name + _sfx(dtype), "PPPPii" if colsum else "PPPii", label=label + " (reduce)")
        grid_r = (ceil_div(C, 32), 1, 1)

        f_outs = _i32(flags | LN7_OUTS | (P << 8))[0]

        def fl(*outs):  # LN7_OUTS where every output is 16-byte aligned (cp.async's pieces)
            return f_outs if outs_smem and not any(o.ptr % 16 for o in outs) else f_

        def launch(dinp, dweight, dbias, dout, inp, weight, mean, rstd):
            k((G, 1, 1), (bs, 1, 1), dinp.ptr, dweight.ptr, dbias.ptr, scratch.ptr, tickets.ptr, dout.ptr,
              inp.ptr, weight.ptr, mean.ptr, rstd.ptr, n_, c_, r_, fl(dweight, dbias), smem=smem)
            if split:
                kr(grid_r, (32, 32, 1), dweight.ptr, dbias.ptr, scratch.ptr, g_, c_)

        def launch_colsum(dinp, dweight, dbias, colsum, dout, inp, weight, mean, rstd):
            k((G, 1, 1), (bs, 1, 1), dinp.ptr, dweight.ptr, dbias.ptr, colsum.ptr, scratch.ptr, tickets.ptr,
              dout.ptr, inp.ptr, weight.ptr, mean.ptr, rstd.ptr, n_, c_, r_, fl(dweight, dbias, colsum), smem=smem)
            if split:
                kr(grid_r, (32, 32, 1), dweight.ptr, dbias.ptr, colsum.ptr, scratch.ptr, g_, c_)
        return Built(launch_colsum if colsum else launch, scratch={"partials": scratch, "tickets": tickets},
                     info={"grid": G, "outs_smem": outs_smem})
    return build


def _deferred(rt, dtype, G, C, colsum, slots, main, label):
    """The deferred form (deferred=S) of a layernorm backward whose main kernel leaves (G, K, C) fp32
    partials (K = 3 with colsum, else 2; variants 5 and 7): launch(slot, *the usual arguments) runs
    main(partials, *the usual arguments), which writes dinp at once and leaves the call's column sums
    (dweight, dbias, colsum) as G partial rows in its own slot of scratch (0 <= slot < S: every call
    between two flushes takes its own); Built.flush() then adds every slot used since the last flush
    into its outputs in one launch (cuda/layernorm.cu, layernorm_backward_reduce_deferred). The
    outputs' addresses go to the device in a table of S x 3 pointers, uploaded by a flush that finds
    them changed: the first of a captured sequence must run uncaptured (as the model's first step
    does), and a changed table under capture is an error."""
    scratch = rt.scratch((slots, G, 3, C), np.float32)  # slot s at s * G * 3 * C floats
    slot_bytes = G * 3 * C * 4
    kd = rt.kernel(MODULE, f"layernorm_backward_reduce_deferred_kernel{_sfx(dtype)}", "PPii",
                   label=label + " (deferred reduce)")
    table = rt.zeros((slots * 3,), np.uint64)
    host = np.zeros(slots * 3, np.uint64)  # this epoch's outputs (0: the slot not used)
    uploaded = np.zeros(slots * 3, np.uint64)
    g_, c_ = _i32(G, C)
    grid_d = (ceil_div(3 * C // 4, 32), slots, 1)

    def launch(slot, dinp, dweight, dbias, *rest):
        if not 0 <= slot < slots:
            raise IndexError(f"{label}: slot {slot} outside the {slots} deferred slots")
        if host[3 * slot]:
            raise RuntimeError(f"{label}: slot {slot} taken twice before a flush")
        host[3 * slot:3 * slot + 3] = (dweight.ptr, dbias.ptr, rest[0].ptr if colsum else 0)
        main(scratch.ptr + slot * slot_bytes, dinp, dweight, dbias, *rest)

    def flush():
        if not host.any():
            return
        if not np.array_equal(host, uploaded):
            if getattr(rt, "capturing", False):
                host[:] = 0  # (the pending slots dropped: a later flush adds nothing from this capture)
                raise RuntimeError(f"{label}: the deferred outputs changed under graph capture "
                                   "(run the same launches once uncaptured first)")
            table.set(host)  # (a synchronous copy: after every launch before it, on either stream)
            uploaded[:] = host
        kd(grid_d, (256, 1, 1), scratch.ptr, table.ptr, g_, c_)
        host[:] = 0

    return Built(launch, flush=flush, scratch={"partials": scratch, "table": table})


# ----------------------------------------------------------------------------------------------
# cost models: the fewest bytes one call must move, each input read once, each output written once
# (the same counts as the labs'): elements of the build's dtype, mean/rstd fp32 in both

def cost_forward(N, C, dtype="fp32", **_):
    # read inp (N,C), weight, bias (C); write out (N,C), mean, rstd (N)
    return 0, esize(dtype) * (2 * N * C + 2 * C) + 4 * 2 * N


def cost_backward(N, C, dtype="fp32", colsum=False, **_):
    # read dout, inp (N,C); dinp (N,C) +=: read and written; read weight (C), dweight, dbias (C) +=:
    # read and written; read mean, rstd (N); colsum (C) +=: read and written. (The deterministic
    # variants' fp32 scratch is extra.)
    return 0, esize(dtype) * (4 * N * C + (7 if colsum else 5) * C) + 4 * 2 * N


# ----------------------------------------------------------------------------------------------
# the table

OPS = [
    OpSpec(
        name="layernorm_forward", flag="--layernorm-kernel", default=5, defaults={"bf16": 4},
        cost=cost_forward,
        cpu=layernorm_forward_cpu,
        doc="out(N,C)=, mean(N)=, rstd(N)=, inp(N,C), weight(C), bias(C); eps 1e-5, biased variance",
        variants={
            1: Variant(1, "one thread per row, three serial passes (uncoalesced)", layernorm_forward1, check_any),
            2: Variant(2, "one block per row, shared-memory block reductions", layernorm_forward2, check_any),
            3: Variant(3, "one warp per row, shuffle reductions, three coalesced passes",
                       {"fp32": layernorm_forward3, "bf16": layernorm_forward3_bf16}, check_any),
            4: Variant(4, "one warp per row, 16-byte loads (float4 / 8 bf16), row in registers, one DRAM read "
                          "(C%4==0, C<=2048)", {"fp32": layernorm_forward4, "bf16": layernorm_forward4_bf16},
                       check_float4),
            5: Variant(5, "4 + streaming cache hints on the row in/out (C%4==0, C<=2048)",
                       {"fp32": layernorm_forward5, "bf16": layernorm_forward5_bf16}, check_float4),
            6: Variant(6, "persistent warps over consecutive rows, the next row loaded during this one, 16-byte "
                          "vectors only (fp32 C%4==0, C<=1024; bf16 C%8==0, C<=2048)",
                       {"fp32": _forward6("fp32"), "bf16": _forward6("bf16")},
                       {"fp32": _check6("forward", "fp32"), "bf16": _check6("forward", "bf16")}),
        }),
    OpSpec(
        name="layernorm_backward", flag="--layernorm-backward-kernel", default=5, defaults={"bf16": 7},
        cost=cost_backward,
        cpu=layernorm_backward_cpu,
        options=("colsum", "deferred"),
        doc="dinp(N,C)+=, dweight(C)+=, dbias(C)+=, dout(N,C), inp(N,C), weight(C), mean(N), rstd(N); "
            "colsum=True: colsum(C)+= (column sums of dinp after the +=) after dbias; deferred=S (5, 7): "
            "launch(slot, ...) with 0 <= slot < S, dweight/dbias(/colsum) += only at Built.flush()",
        variants={
            1: Variant(1, "one thread per row, global atomics for dweight/dbias (baseline)", layernorm_backward1, check_any),
            2: Variant(2, "one warp per row, shared-memory atomics per block, then global atomics (non-deterministic)",
                       layernorm_backward2, check_smem),
            3: Variant(3, "deterministic: warp per row, per-warp smem sums, per-block scratch + fixed-order reduce",
                       {"fp32": layernorm_backward3, "bf16": layernorm_backward3_bf16}, check_smem,
                       scratch_bytes=scratch_bytes_backward),
            4: Variant(4, "3 with float4 and the rows in registers (C%4==0, C<=2048), deterministic",
                       layernorm_backward4, check_float4_smem, scratch_bytes=scratch_bytes_backward),
            5: Variant(5, "4 with dinp loaded together with dout and inp (fp32: C<=1024, above as 4; bf16: 16-byte "
                          "loads, kept packed), deterministic; fused colsum of dinp (the next bias grad); deferred: "
                          "the column sums of many calls finished by one flush",
                       {"fp32": layernorm_backward5, "bf16": layernorm_backward5_bf16}, check_backward5,
                       options=("colsum", "deferred"), scratch_bytes=scratch_bytes_backward),
            6: Variant(6, "deterministic: persistent warps over consecutive rows, next row prefetched, dweight/dbias "
                          "in registers, per-block partials + fixed-order reduce (fp32 C%4==0, C<=512; bf16 C%8==0, "
                          "C<=1024)",
                       {"fp32": _backward6("fp32"), "bf16": _backward6("bf16")},
                       {"fp32": _check6("backward", "fp32"), "bf16": _check6("backward", "bf16")},
                       scratch_bytes=scratch_bytes_backward),
            7: Variant(7, "deterministic, one launch: persistent warps, rows strided over the grid, each warp's next "
                          "rows in a shared-memory ring (cp.async), blocks' partials summed in fixed order by the last "
                          "blocks to finish (integer tickets); fused colsum (fp32 C%4==0, C<=384; bf16 C%8==0, "
                          "C<=1024); deferred: the column sums of many calls finished by one flush",
                       {"fp32": _backward7("fp32"), "bf16": _backward7("bf16")},
                       {"fp32": _check7("fp32"), "bf16": _check7("bf16")},
                       options=("colsum", "deferred"), scratch_bytes=scratch_bytes_backward7),
        }),
]
