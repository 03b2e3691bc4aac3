"""Softmax: the causal softmax of attention's score matrices, forward and backward, in numbered
variants. It runs only inside the composite attention (attention_forward / attention_backward
variant 1, llmc/ops/attention.py): naming a --softmax-kernel selects that composite.

    python dev/cuda/softmax_forward.py          # validate + time every softmax_forward variant (BNH=48, T=1024)
    python dev/cuda/softmax_backward.py         # same for softmax_backward
    python -m pytest tests/test_softmax.py -q   # numpy references vs torch autograd (add -m gpu on a GPU)

Semantics (docs/ops.md), everything causal (position t sees s <= t):
    softmax_forward(att=, preatt)           att[r, t, s] = softmax_s(scale * preatt[r, t, :t+1]), 0 for s > t
    softmax_backward(dpreatt=, datt, att)   dpreatt = scale * att * (datt - sum_s att * datt), 0 for s > t
Every variant reads only the lower triangle (and writes the zeros above it): entries above the
diagonal may hold anything (the causal GEMMs leave them unwritten).
"""
from __future__ import annotations

import numpy as np

from llmc.ops import OpSpec, Variant, check_block_size, ptr as _ptr, refuse
from llmc.runtime import ceil_div

MODULE = "softmax"  # cuda/softmax.cu

# ----------------------------------------------------------------------------------------------
# numpy references (float32 or float64: they compute in the inputs' dtype)


def _causal_mask(T):
    return np.tril(np.ones((T, T), dtype=bool))  # (T, T), True where s <= t



def softmax_forward_ref(preatt, scale):
    """preatt (..., T, T) -> att (..., T, T): causal softmax of scale * preatt, zeros above the diagonal."""
    T = preatt.shape[-1]
    mask = _causal_mask(T)
    x = np.where(mask, preatt * preatt.dtype.type(scale), -np.inf)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.where(mask, np.exp(x), 0.0).astype(preatt.dtype)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward_ref(datt, att, scale):
    """Gradient of softmax_forward w.r.t. preatt: scale * att * (datt - sum_s att*datt), 0 above the diagonal."""
    T = att.shape[-1]
    mask = _causal_mask(T)
    a = np.where(mask, att, 0.0).astype(att.dtype)
    g = np.where(mask, datt, 0.0).astype(att.dtype)
    dot = (a * g).sum(axis=-1, keepdims=True)
    return att.dtype.type(scale) * a * (g - dot)

# ----------------------------------------------------------------------------------------------
# cpu launchers (the numpy backend): same argument order as the GPU, outputs written in place


def softmax_forward_cpu(BNH, T, scale, **_):
    def launch(att, preatt):
        att[...] = softmax_forward_ref(preatt.reshape(BNH, T, T), scale).reshape(att.shape)
    return launch


def softmax_backward_cpu(BNH, T, scale, **_):
    def launch(dpreatt, datt, att):
        dpreatt[...] = softmax_backward_ref(datt.reshape(BNH, T, T), att.reshape(BNH, T, T),
                                            scale).reshape(dpreatt.shape)
    return launch

# ----------------------------------------------------------------------------------------------
# GPU variants. build(rt, BNH, T, scale, block_size=None) -> launch(att, preatt) (forward) or
# launch(dpreatt, datt, att) (backward)


def _row_args(BNH, T, scale):
    return np.int32(BNH), np.int32(T), np.float32(scale)


def _check_rows(BNH, T, **_):
    if BNH < 1 or T < 1:
        return f"empty problem BNH={BNH} T={T}"
    if BNH * T * T >= 2**31:
        return f"BNH*T*T = {BNH * T * T:,} elements does not fit the kernels' int32 row index math"
    return None


def _check_warp_block(block_size=None, **_):
    return check_block_size(block_size)


def _check_pow2_block(block_size=None, **_):
    if block_size is not None and (block_size & (block_size - 1) or not 1 <= block_size <= 1024):
        return f"block_size {block_size} must be a power of two <= 1024 (tree reduction)"
    return None


def _check_vec4(T, **_):
    if T % 4:
        return f"T={T} is not a multiple of 4 (float4 rows must start 16-byte aligned)"
    return None


def _nv4(T):
    """float4s per lane for the register-resident variants (the smallest power of two covering T)."""
    for nv in (1, 2, 4, 8, 16):
        if 128 * nv >= T:
            return nv
    return None


def _check_regs(T, **_):
    if _nv4(T) is None:
        return f"T={T} > 2048: the row no longer fits in one warp's registers (use variant 5)"
    return None


def _all(*checks):
    def check(**shape):
        for c in checks:
            r = c(**shape)
            if r:
                return r
        return None
    return check


def _thread_per_row(op, func):
    def build(rt, BNH, T, scale, block_size=None):
        bs = block_size or 256
        k = rt.kernel(MODULE, func, "P" * (2 if op == "softmax_forward" else 3) + "iif", label=f"{op} 1")
        grid, args = (ceil_div(BNH * T, bs), 1, 1), _row_args(BNH, T, scale)

        def launch(*bufs):
            k(grid, (bs, 1, 1), *(_ptr(b) for b in bufs), *args)
        return launch
    return build


def _block_per_row(op, func, number, smem_floats):
    """smem_floats(T, bs): dynamic shared memory in floats."""
    def build(rt, BNH, T, scale, block_size=None):
        bs = block_size or (256 if number == 2 else 128)
        k = rt.kernel(MODULE, func, "P" * (2 if op == "softmax_forward" else 3) + "iif", label=f"{op} {number}")
        smem = 4 * smem_floats(T, bs)
        if smem > rt.max_smem_optin:
            refuse(op, number, f"needs {smem} bytes of shared memory, the device allows {rt.max_smem_optin}")
        k.set_max_dynamic_smem(smem)
        grid, args = (BNH * T, 1, 1), _row_args(BNH, T, scale)

        def launch(*bufs):
            k(grid, (bs, 1, 1), *(_ptr(b) for b in bufs), *args, smem=smem)
        return launch
    return build


def _warp_per_row(op, func, number):
    """func may be a callable T -> kernel name (register-resident variants pick NV4 by T)."""
    def build(rt, BNH, T, scale, block_size=None):
        bs = block_size or 256
        name = func(T) if callable(func) else func
        k = rt.kernel(MODULE, name, "P" * (2 if op == "softmax_forward" else 3) + "iif", label=f"{op} {number}")
        grid, args = (ceil_div(BNH * T * 32, bs), 1, 1), _row_args(BNH, T, scale)

        def launch(*bufs):
            k(grid, (bs, 1, 1), *(_ptr(b) for b in bufs), *args)
        return launch
    return build


F, BW = "softmax_forward", "softmax_backward"

SOFTMAX_FORWARD_VARIANTS = {
    1: Variant(1, "one thread per row, three serial passes (max, sum, write): the plainest",
               _thread_per_row(F, "softmax_forward_kernel1"), _all(_check_rows)),
    2: Variant(2, "one block per row, shared-memory tree reductions",
               _block_per_row(F, "softmax_forward_kernel2", 2, lambda T, bs: bs), _all(_check_rows, _check_pow2_block)),
    3: Variant(3, "one warp per row, shuffle reductions, three passes over the row",
               _warp_per_row(F, "softmax_forward_kernel3", 3), _all(_check_rows, _check_warp_block)),
    4: Variant(4, "one warp per row, online softmax (max and sum in one pass), then the write pass",
               _warp_per_row(F, "softmax_forward_kernel4", 4), _all(_check_rows, _check_warp_block)),
    5: Variant(5, "4 with float4 loads/stores (T % 4 == 0)",
               _warp_per_row(F, "softmax_forward_kernel5", 5), _all(_check_rows, _check_warp_block, _check_vec4)),
    6: Variant(6, "one warp per row, lower triangle held in registers: one DRAM read of s <= t, streaming "
                  "float4 stores (T % 4 == 0, T <= 2048)",
               _warp_per_row(F, lambda T: f"softmax_forward_kernel6_nv{_nv4(T)}", 6),
               _all(_check_rows, _check_warp_block, _check_vec4, _check_regs)),
}

SOFTMAX_BACKWARD_VARIANTS = {
    1: Variant(1, "one thread per row, two serial passes (dot, write): the plainest",
               _thread_per_row(BW, "softmax_backward_kernel1"), _all(_check_rows)),
    2: Variant(2, "one block per row, shared-memory tree reduction of the dot product",
               _block_per_row(BW, "softmax_backward_kernel2", 2, lambda T, bs: bs), _all(_check_rows, _check_pow2_block)),
    3: Variant(3, "one warp per row, shuffle reduction, two passes over the row",
               _warp_per_row(BW, "softmax_backward_kernel3", 3), _all(_check_rows, _check_warp_block)),
    4: Variant(4, "one block per row, the row cached in shared memory: one DRAM read for any T",
               _block_per_row(BW, "softmax_backward_kernel4", 4, lambda T, bs: 2 * T),
               _all(_check_rows, _check_warp_block,
                    lambda T, **_: f"T={T}: 2*T floats exceed 227 KB of shared memory" if 8 * T > 227 * 1024 else None)),
    5: Variant(5, "3 with float4 loads/stores (T % 4 == 0)",
               _warp_per_row(BW, "softmax_backward_kernel5", 5), _all(_check_rows, _check_warp_block, _check_vec4)),
    6: Variant(6, "one warp per row, lower triangles of att and datt held in registers: one DRAM read, "
                  "streaming float4 stores (T % 4 == 0, T <= 2048)",
               _warp_per_row(BW, lambda T: f"softmax_backward_kernel6_nv{_nv4(T)}", 6),
               _all(_check_rows, _check_warp_block, _check_vec4, _check_regs)),
}

# the variant the composite falls back to when the chosen one refuses the shape (any T)
FALLBACK = 4


def build_backward6_lower(rt, BNH, T, scale):
    """softmax_backward 6's entry point that stores only s <= t (the composite's dpreatt scratch is
    zeroed once and nothing else writes it, so its upper triangle stays 0): 302 MB instead of 403
    at BNH=48, T=1024. Not a variant of its own: the composite picks it when it runs variant 6."""
    return _warp_per_row(BW, lambda T: f"softmax_backward_kernel6_lower_nv{_nv4(T)}", 6)(rt, BNH, T, scale)


def cost_forward(BNH, T, **_):
    """(flops, bytes): read the lower triangle once, write the full matrix (the fewest any kernel moves)."""
    return 0, 4 * (BNH * T * (T + 1) // 2 + BNH * T * T)


def cost_backward(BNH, T, **_):
    """(flops, bytes): read two lower triangles, write the full matrix."""
    return 0, 4 * (BNH * T * (T + 1) + BNH * T * T)


# ----------------------------------------------------------------------------------------------
# the op table

OPS = [
    OpSpec("softmax_forward", softmax_forward_cpu, SOFTMAX_FORWARD_VARIANTS, default=6, flag="--softmax-kernel",
           doc="att(BNH,T,T)=, preatt(BNH,T,T); build(BNH, T, scale)", cost=cost_forward),
    OpSpec("softmax_backward", softmax_backward_cpu, SOFTMAX_BACKWARD_VARIANTS, default=6,
           flag="--softmax-backward-kernel",
           doc="dpreatt(BNH,T,T)=, datt(BNH,T,T), att(BNH,T,T); build(BNH, T, scale)", cost=cost_backward),
]
