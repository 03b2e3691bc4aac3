"""GELU: GPT-2's tanh approximation, elementwise, forward and backward.

    python dev/cuda/gelu_forward.py             # validate + time every variant at N = 4*1024*3072
    python dev/cuda/gelu_backward.py
    python -m pytest tests/test_gelu.py -q      # references vs torch (approximate='tanh'), float64

Semantics (docs/ops.md):
    gelu_forward:  out(N)=, inp(N)          out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    gelu_backward: dinp(N)=, inp(N), dout(N) dinp = gelu'(inp) * dout; dinp may alias dout (in place)
      with colsum=True and OC (the row length; variant 2, the fused form the model asks for when the
      chosen variant has it): dinp(N)=, colsum(OC)+=, inp(N), dout(N)
                   colsum += column sums of dinp viewed as (N/OC, OC): fc's bias gradient, so the
                   model runs no matmul_backward_bias over d fch
      with colsum=True and recompute=True (variant 2): dinp(N)=, colsum(OC)+=, gout(N)=, inp(N), dout(N)
                   also gout = gelu(inp) (gelu_forward's bits): backward's GELU recompute (-r >= 1)
                   from the inp this kernel reads anyway, instead of a gelu_forward launch

bf16 builds (variants 1 and 2, entry points <kernel>_bf16): every tensor bf16, fp32 math, one
rounding on the store; variant 2's bf16 kernel moves 8 elements per 16-byte access and takes any N
(a scalar tail), though its check still asks N % 4 == 0 like the fp32 kernel's.
"""
from __future__ import annotations

import math

import numpy as np

from llmc.ops import Built, OpSpec, Variant, as_view, check_elementwise, check_elementwise_float4, esize
from llmc.runtime import ceil_div

MODULE = "gelu"  # cuda/gelu.cu
GELU_K = math.sqrt(2.0 / math.pi)  # a Python float: keeps float32 inputs in float32 (NEP 50)
GELU_C = 0.044715


# ----------------------------------------------------------------------------------------------
# numpy references (float32 or float64)

def gelu_forward_ref(inp):
    return 0.5 * inp * (1.0 + np.tanh(GELU_K * (inp + GELU_C * inp ** 3)))


def gelu_backward_ref(inp, dout):
    """dinp = gelu'(inp) * dout (not accumulated)."""
    t = np.tanh(GELU_K * (inp + GELU_C * inp ** 3))
    grad = 0.5 * (1.0 + t) + 0.5 * inp * (1.0 - t * t) * GELU_K * (1.0 + 3.0 * GELU_C * inp * inp)
    return grad * dout


def _flat(a, N):
    return as_view(a, (N,))  # raises rather than copy: the writes must land in a


# ----------------------------------------------------------------------------------------------
# cpu launchers

def gelu_forward_cpu(N, block_size=None):
    def launch(out, inp):
        _flat(out, N)[...] = gelu_forward_ref(_flat(inp, N))
    return launch


def gelu_backward_cpu(N, block_size=None, colsum=False, OC=None, recompute=False):
    def launch(dinp, inp, dout):  # the result is computed whole before it is written: dinp may be dout
        _flat(dinp, N)[...] = gelu_backward_ref(_flat(inp, N), _flat(dout, N))

    def launch_colsum(dinp, colsum, inp, dout):
        launch(dinp, inp, dout)
        colsum += as_view(dinp, (N // OC, OC)).sum(axis=0)  # matmul_backward_bias's cpu sum, the same bits

    def launch_recompute(dinp, colsum, gout, inp, dout):  # gelu_forward's reference, then the colsum form
        _flat(gout, N)[...] = gelu_forward_ref(_flat(inp, N))
        launch_colsum(dinp, colsum, inp, dout)
    if recompute:
        return launch_recompute
    return launch_colsum if colsum else launch


# ----------------------------------------------------------------------------------------------
# shape checks and GPU variants

check_any, check_float4 = check_elementwise, check_elementwise_float4  # (llmc/ops: any N; N % 4 == 0)


def check_colsum(N, OC, block_size=None):
    """The fused form (any OC: rows that are not 16-byte aligned go through guarded scalar accesses)."""
    if not OC or OC < 1 or N % OC:
        return f"colsum: N={N} must be whole rows of OC={OC} columns"
    if block_size is not None:
        return f"block_size={block_size}: the colsum form's block is fixed, (32, 8) threads"
    return None


def check2(N, block_size=None, colsum=False, OC=None, recompute=False):
    if recompute and not colsum:
        return "recompute=True is a form of the colsum form (colsum=True)"
    return check_colsum(N, OC, block_size) if colsum else check_float4(N, block_size)


def _variant(op, number, per_thread, default_bs, nptr, dtype="fp32"):
    """per_thread elements per thread: 1, 4 (fp32 float4) or 8 (bf16, 16 bytes; the bf16 kernel
    takes the N % 8 left over in its last thread, so the grid rounds up)."""
    suffix = "" if dtype == "fp32" else f"_{dtype}"

    def build(rt, N, block_size=None):
        bs = block_size or default_bs
        k = rt.kernel(MODULE, f"{op}_kernel{number}{suffix}", "P" * nptr + "i", label=f"{op} {number} {dtype}")
        per = N // per_thread if dtype == "fp32" else ceil_div(N, per_thread)
        grid, n_ = (max(1, ceil_div(per, bs)), 1, 1), np.int32(N)
        if nptr == 2:
            def launch(out, inp):
                k(grid, (bs, 1, 1), out.ptr, inp.ptr, n_)
        else:
            def launch(dinp, inp, dout):
                k(grid, (bs, 1, 1), dinp.ptr, inp.ptr, dout.ptr, n_)
        return launch
    return build


def _colsum_variant(number, dtype="fp32", recompute=False):
    """The fused form of variant `number` (cuda/gelu.cu, "colsum"): grid (column blocks of 32*V
    columns, chunks of rows), block (32, 8); as many blocks as are resident at once (one wave), each
    chunk a multiple of 8 rows; fp32 partials (chunks, OC) and a ticket counter per column block (zeroed
    here; the finishing block resets its own, so graph replays work) allocated by the build.
    recompute: the form that also writes gout = gelu(inp): launch(dinp, colsum, gout, inp, dout)."""
    suffix = ("_rc" if recompute else "") + ("" if dtype == "fp32" else f"_{dtype}")

    def build(rt, N, OC, block_size=None):
        rows = N // OC
        k = rt.kernel(MODULE, f"gelu_backward_kernel{number}_colsum{suffix}", "PPPPPPPiii" if recompute else "PPPPPPiii",
                      label=f"gelu_backward {number} {dtype} colsum{' + gelu' if recompute else ''}")
        V = 4 if dtype == "fp32" else 8
        col_blocks = ceil_div(OC, 32 * V)
        target = max(1, rt.sm_count * k.resident_blocks(256) // col_blocks)  # chunks for one full wave
        rows_per_chunk = 8 * ceil_div(ceil_div(rows, target), 8)
        nchunks = ceil_div(rows, rows_per_chunk)
        partial = rt.scratch((nchunks, OC), np.float32)
        counters = rt.zeros((col_blocks,), np.uint32)
        grid, args = (col_blocks, nchunks, 1), (np.int32(rows), np.int32(OC), np.int32(rows_per_chunk))

        def launch(dinp, colsum, inp, dout):
            k(grid, (32, 8, 1), dinp.ptr, colsum.ptr, partial.ptr, counters.ptr, inp.ptr, dout.ptr, *args)

        def launch_recompute(dinp, colsum, gout, inp, dout):
            k(grid, (32, 8, 1), dinp.ptr, colsum.ptr, gout.ptr, partial.ptr, counters.ptr, inp.ptr, dout.ptr, *args)
        return Built(launch_recompute if recompute else launch, scratch={"partials": partial, "counters": counters},
                     keep=frozenset({"counters"}), info={"rows_per_chunk": rows_per_chunk})
    return build


def _with_colsum(plain, fused, fused_rc):
    """A variant's build that takes the op's colsum option: the fused build for colsum=True, its
    recompute form with recompute=True too."""
    def build(rt, N, block_size=None, colsum=False, OC=None, recompute=False):
        if recompute:
            return fused_rc(rt, N, OC, block_size)
        return fused(rt, N, OC, block_size) if colsum else plain(rt, N, block_size)
    return build


gelu_forward1 = _variant("gelu_forward", 1, 1, 256, 2)
gelu_forward2 = _variant("gelu_forward", 2, 4, 256, 2)
gelu_backward1 = _variant("gelu_backward", 1, 1, 256, 3)
gelu_backward2 = _variant("gelu_backward", 2, 4, 256, 3)
gelu_forward1_bf16 = _variant("gelu_forward", 1, 1, 256, 2, "bf16")
gelu_forward2_bf16 = _variant("gelu_forward", 2, 8, 256, 2, "bf16")
gelu_backward1_bf16 = _variant("gelu_backward", 1, 1, 256, 3, "bf16")
# (64 threads: H200, lab, L2 flushed: B=4 0.0262 ms against 256's 0.0272 (86% / 83% of a copy), B=16
# 0.0840 against 0.0857; 128 level with 256, 512 and 1024 slower; session 34)
gelu_backward2_bf16 = _variant("gelu_backward", 2, 8, 64, 3, "bf16")
gelu_backward2_colsum = _colsum_variant(2)
gelu_backward2_colsum_bf16 = _colsum_variant(2, "bf16")
gelu_backward2_colsum_rc = _colsum_variant(2, recompute=True)
gelu_backward2_colsum_rc_bf16 = _colsum_variant(2, "bf16", recompute=True)


# ----------------------------------------------------------------------------------------------
# the table

OPS = [
    OpSpec(
        name="gelu_forward", flag="--gelu-kernel", default=2,
        cost=lambda N, dtype="fp32", **_: (0, esize(dtype) * 2 * N),  # read inp, write out
        cpu=gelu_forward_cpu,
        doc="out(N)=, inp(N); GPT-2 tanh form",
        variants={
            1: Variant(1, "one thread per element", {"fp32": gelu_forward1, "bf16": gelu_forward1_bf16},
                       check_any),
            2: Variant(2, "one thread per 16 bytes: float4, or 8 bf16 (N%4==0)",
                       {"fp32": gelu_forward2, "bf16": gelu_forward2_bf16}, check_float4),
        }),
    OpSpec(
        name="gelu_backward", flag="--gelu-backward-kernel", default=2,
        # read inp, dout; write dinp (colsum: + colsum (OC) read and written; recompute: + gout written)
        cost=lambda N, dtype="fp32", colsum=False, OC=0, recompute=False, **_: (
            0, esize(dtype) * ((4 if recompute else 3) * N + (2 * OC if colsum else 0))),
        cpu=gelu_backward_cpu,
        options=("colsum", "recompute"),
        doc="dinp(N)=, inp(N), dout(N); dinp may alias dout; colsum=True (with OC): dinp(N)=, colsum(OC)+=, "
            "inp(N), dout(N), colsum += column sums of dinp as (N/OC, OC); recompute=True (with colsum): "
            "dinp(N)=, colsum(OC)+=, gout(N)=, inp(N), dout(N), gout = gelu(inp) too",
        variants={
            1: Variant(1, "one thread per element (in place allowed)",
                       {"fp32": gelu_backward1, "bf16": gelu_backward1_bf16}, check_any),
            2: Variant(2, "one thread per 16 bytes: float4, or 8 bf16 (N%4==0; in place allowed); fused colsum "
                          "over rows of OC (the next bias grad): (32, 8) blocks own row chunks, fixed-order finish",
                       {"fp32": _with_colsum(gelu_backward2, gelu_backward2_colsum, gelu_backward2_colsum_rc),
                        "bf16": _with_colsum(gelu_backward2_bf16, gelu_backward2_colsum_bf16,
                                             gelu_backward2_colsum_rc_bf16)},
                       check2, options=("colsum", "recompute")),
        }),
]
