"""Fused residual + layernorm forward: residual = inp1 + inp2; out = layernorm(residual).

    python dev/cuda/residual_layernorm_forward.py     # validate + time every variant (N=4096, C=768)
    python -m pytest tests/test_residual_layernorm.py -q

Semantics (docs/ops.md):
    residual_layernorm_forward: residual(N,C)=, out(N,C)=, mean(N)=, rstd(N)=,
                                inp1(N,C), inp2(N,C), weight(C), bias(C)
    eps = 1e-5, biased variance, as layernorm_forward. Backward needs nothing new: the model runs
    layernorm_backward and adds the result into both branches' gradient.

bf16 builds (variants 2 and 3, entry points <kernel>_bf16[_nvN]): every tensor bf16 except mean(N)
and rstd(N) (fp32). residual = bf16(inp1 + inp2) is rounded first and out, mean, rstd are the
layernorm of that stored residual (what layernorm_backward reads back); fp32 math, one rounding per
output element. Variant 3's bf16 kernel moves 16 bytes (8 bf16) per access, with guarded scalar
accesses when C % 8 != 0.
"""
from __future__ import annotations

import numpy as np

from llmc.ops import OpSpec, Variant, esize
from llmc.ops import layernorm as ln
from llmc.ops import residual as res
from llmc.runtime import ceil_div

MODULE = "residual_layernorm"  # cuda/residual_layernorm.cu


# ----------------------------------------------------------------------------------------------
# numpy reference and cpu launcher

def residual_layernorm_forward_ref(inp1, inp2, weight, bias, eps=ln.EPS):
    """-> residual, out, mean, rstd."""
    residual = inp1 + inp2
    out, mean, rstd = ln.layernorm_forward_ref(residual, weight, bias, eps)
    return residual, out, mean, rstd


def residual_layernorm_forward_cpu(N, C, block_size=None):
    shaped = ln._shaped

    def launch(residual, out, mean, rstd, inp1, inp2, weight, bias):
        r, o, m, s = residual_layernorm_forward_ref(shaped(inp1, (N, C)), shaped(inp2, (N, C)), weight, bias)
        shaped(residual, (N, C))[...] = r
        shaped(out, (N, C))[...] = o
        shaped(mean, (N,))[...] = m
        shaped(rstd, (N,))[...] = s
    return launch


# ----------------------------------------------------------------------------------------------
# GPU variants (the shape checks are layernorm's: same rows, same constraints)

def residual_layernorm_forward1(rt, N, C, block_size=None):
    """Baseline: two launches, residual_forward then layernorm_forward."""
    vec = ln.check_float4(N, C) is None
    residual = res.OPS[0].build(rt, 2 if vec else 1, N=N * C, block_size=block_size)
    layernorm = ln.OPS[0].build(rt, 4 if vec else 3, N=N, C=C, block_size=block_size)

    def launch(resid, out, mean, rstd, inp1, inp2, weight, bias):
        residual(resid, inp1, inp2)
        layernorm(out, mean, rstd, resid, weight, bias)
    return launch


def _fused(number, default_bs, func, dtype="fp32"):
    def build(rt, N, C, block_size=None):
        bs = block_size or default_bs
        k = rt.kernel(MODULE, func(C), "PPPPPPPPii", label=f"residual_layernorm_forward {number} {dtype}")
        ln._fits("residual_layernorm_forward", number, k, bs)
        grid, n_, c_ = (ceil_div(N, bs // 32), 1, 1), np.int32(N), np.int32(C)

        def launch(residual, out, mean, rstd, inp1, inp2, weight, bias):
            k(grid, (bs, 1, 1), residual.ptr, out.ptr, mean.ptr, rstd.ptr, inp1.ptr, inp2.ptr,
              weight.ptr, bias.ptr, n_, c_)
        return launch
    return build


residual_layernorm_forward2 = _fused(2, 256, lambda C: "residual_layernorm_forward_kernel2")
residual_layernorm_forward3 = _fused(3, 256, lambda C: f"residual_layernorm_forward_kernel3_nv{ln._nv(C)}")
residual_layernorm_forward2_bf16 = _fused(2, 256, lambda C: "residual_layernorm_forward_kernel2_bf16", "bf16")
residual_layernorm_forward3_bf16 = _fused(3, 256, lambda C: f"residual_layernorm_forward_kernel3_bf16_nv{ln._nv_bf16(C)}",
                                          "bf16")

OPS = [
    OpSpec(
        name="residual_layernorm_forward", flag="--residual-layernorm-kernel", default=3,
        # read inp1, inp2, weight, bias; write residual, out (the fused op's fewest bytes; the unfused
        # variant reads residual back on top) and mean, rstd (fp32 in both)
        cost=lambda N, C, dtype="fp32", **_: (0, esize(dtype) * (4 * N * C + 2 * C) + 4 * 2 * N),
        cpu=residual_layernorm_forward_cpu,
        doc="residual(N,C)=, out(N,C)=, mean(N)=, rstd(N)=, inp1(N,C), inp2(N,C), weight(C), bias(C)",
        variants={
            1: Variant(1, "baseline: residual_forward + layernorm_forward, two launches", residual_layernorm_forward1,
                       ln.check_any),
            2: Variant(2, "fused, one warp per row, scalar loads",
                       {"fp32": residual_layernorm_forward2, "bf16": residual_layernorm_forward2_bf16}, ln.check_any),
            3: Variant(3, "fused, one warp per row, 16-byte loads (float4 / 8 bf16), row in registers (C%4==0, C<=2048)",
                       {"fp32": residual_layernorm_forward3, "bf16": residual_layernorm_forward3_bf16}, ln.check_float4),
        }),
]
