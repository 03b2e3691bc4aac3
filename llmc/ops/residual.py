"""Residual: out = inp1 + inp2, elementwise.

    python dev/cuda/residual_forward.py         # validate + time every variant at N = 4*1024*768
    python -m pytest tests/test_residual.py -q

Semantics (docs/ops.md):
    residual_forward: out(N)=, inp1(N), inp2(N); out may alias inp1 or inp2 (the model's running
                      loss sum is loss_acc = loss_acc + losses)

bf16 builds (variants 1 and 2): all three tensors bf16, the sum in fp32, rounded once; variant 2's
bf16 kernel moves 8 elements per 16-byte access and takes any N (a scalar tail). (The running loss
sum adds fp32 losses: it needs the fp32 build whatever the model's precision.)
"""
from __future__ import annotations

import numpy as np

from llmc.ops import OpSpec, Variant, as_view, check_elementwise, check_elementwise_float4, esize
from llmc.runtime import ceil_div

MODULE = "residual"  # cuda/residual.cu


# ----------------------------------------------------------------------------------------------
# numpy reference and cpu launcher

def residual_forward_ref(inp1, inp2):
    return inp1 + inp2


def _flat(a, N):
    return as_view(a, (N,))  # raises rather than copy: the writes must land in a


def residual_forward_cpu(N, block_size=None):
    def launch(out, inp1, inp2):
        _flat(out, N)[...] = residual_forward_ref(_flat(inp1, N), _flat(inp2, N))
    return launch


# ----------------------------------------------------------------------------------------------
# shape checks and GPU variants

check_any, check_float4 = check_elementwise, check_elementwise_float4  # (llmc/ops: any N; N % 4 == 0)


def _variant(number, per_thread, default_bs, dtype="fp32"):
    """per_thread elements per thread: 1, 4 (fp32 float4) or 8 (bf16, 16 bytes; the bf16 kernel
    takes the N % 8 left over in its last thread, so the grid rounds up)."""
    suffix = "" if dtype == "fp32" else f"_{dtype}"

    def build(rt, N, block_size=None):
        bs = block_size or default_bs
        k = rt.kernel(MODULE, f"residual_forward_kernel{number}{suffix}", "PPPi",
                      label=f"residual_forward {number} {dtype}")
        per = N // per_thread if dtype == "fp32" else ceil_div(N, per_thread)
        grid, n_ = (max(1, ceil_div(per, bs)), 1, 1), np.int32(N)

        def launch(out, inp1, inp2):
            k(grid, (bs, 1, 1), out.ptr, inp1.ptr, inp2.ptr, n_)
        return launch
    return build


residual_forward1 = _variant(1, 1, 256)
residual_forward2 = _variant(2, 4, 256)
residual_forward1_bf16 = _variant(1, 1, 256, "bf16")
residual_forward2_bf16 = _variant(2, 8, 256, "bf16")

OPS = [
    OpSpec(
        name="residual_forward", flag="--residual-kernel", default=2,
        cost=lambda N, dtype="fp32", **_: (0, esize(dtype) * 3 * N),  # read inp1, inp2; write out
        cpu=residual_forward_cpu,
        doc="out(N)=, inp1(N), inp2(N); out = inp1 + inp2 (out may alias an input)",
        variants={
            1: Variant(1, "one thread per element", {"fp32": residual_forward1, "bf16": residual_forward1_bf16},
                       check_any),
            2: Variant(2, "one thread per 16 bytes: float4, or 8 bf16 (N%4==0)",
                       {"fp32": residual_forward2, "bf16": residual_forward2_bf16}, check_float4),
        }),
]
