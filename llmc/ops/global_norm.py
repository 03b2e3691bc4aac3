"""Global norm: the sum of squares of the whole gradient buffer, for gradient clipping.

    python dev/cuda/global_norm.py                 # validate + time every variant at n=124,475,904
    python -m pytest tests/test_global_norm.py -q  # reference vs torch (add -m gpu on a GPU)

Semantics (docs/ops.md), for launch(norm2, grads):
    norm2(1) =   sum of grads**2 (overwritten; the squared norm, so no sqrt on the device here).
                 adamw reads it on the device; the host never reads it inside a step.
    grads(n)     any 4-byte aligned pointer (the float4 variants handle a misaligned head and tail).

bf16 builds (variants 2 and 3): grads bf16 (any 2-byte aligned pointer: the vector body is 8 bf16
per 16-byte load, with a scalar head and tail), norm2 fp32, squares summed in fp32 (a bf16 value's
square is exact in fp32, so only the sums round, as in the fp32 kernels). Deterministic: the same
bits every run for a given (n, block size, GPU). The cpu launcher takes bf16 grads (uint16 bits) too.
"""
from __future__ import annotations

import numpy as np

from llmc.bf16 import BF16, from_bf16
from llmc.ops import OpSpec, Variant, check_block_size, esize

MODULE = "global_norm"  # cuda/global_norm.cu
OP = "global_norm"

# ----------------------------------------------------------------------------------------------
# numpy reference


def global_norm_ref(grads) -> float:
    """sum(grads**2), accumulated in float64 (chunked, so a 124M-float buffer needs no 1 GB copy).
    bf16 grads (uint16 bits) are widened exactly first."""
    g = np.asarray(grads).reshape(-1)
    total = 0.0
    for i in range(0, g.size, 1 << 22):
        c = g[i:i + (1 << 22)]
        c = (from_bf16(c) if c.dtype == BF16 else c).astype(np.float64)
        total += float(np.dot(c, c))
    return total


def global_norm_cpu(n, **_):
    """The numpy backend: launch(norm2, grads) writes norm2[0] = sum of squares."""
    def launch(norm2, grads):
        norm2.reshape(-1)[0] = global_norm_ref(grads.reshape(-1)[:n])
    return launch


# ----------------------------------------------------------------------------------------------
# GPU variants


def _check(n, block_size=None, **_):
    if n < 1:
        return f"need n >= 1, got {n}"
    if n >= 2**31:
        return f"n={n} does not fit the kernels' int32 count"
    return check_block_size(block_size)


def _grid(rt, k, n, bs, per_thread):
    """As many blocks as are resident at once (a grid-stride loop), fewer when n is small. The grid
    depends only on (n, bs, the GPU): the deterministic variants give the same bits on every run."""
    return max(1, min(rt.sm_count * k.resident_blocks(bs), -(-n // (bs * per_thread))))


def global_norm1(rt, n, block_size=None):
    bs = block_size or 512
    k = rt.kernel(MODULE, "global_norm_kernel1", "PPi", label=f"{OP} 1")
    grid, block, n32 = (_grid(rt, k, n, bs, 1), 1, 1), (bs, 1, 1), np.int32(n)

    def launch(norm2, grads):
        norm2.zero()  # memset on the stream: the atomics accumulate into it; no host sync
        k(grid, block, norm2.ptr, grads.ptr, n32)
    return launch


def global_norm2(rt, n, block_size=None):
    bs = block_size or 1024
    ka = rt.kernel(MODULE, "global_norm_kernel2a", "PPi", label=f"{OP} 2 (partials)")
    kb = rt.kernel(MODULE, "global_norm_kernel2b", "PPi", label=f"{OP} 2 (final)")
    nblocks = _grid(rt, ka, n, bs, 4)
    partials = rt.empty((nblocks,))  # scratch owned by this launch closure
    grid, block, n32, nb32 = (nblocks, 1, 1), (bs, 1, 1), np.int32(n), np.int32(nblocks)

    def launch(norm2, grads):
        ka(grid, block, partials.ptr, grads.ptr, n32)
        kb((1, 1, 1), (1024, 1, 1), norm2.ptr, partials.ptr, nb32)
    return launch


def global_norm3(rt, n, block_size=None):
    bs = block_size or 1024  # H100: 0.180 ms at 1024, 0.181-0.182 at 256/512 (noise-level)
    k = rt.kernel(MODULE, "global_norm_kernel3", "PPPPi", label=f"{OP} 3")
    nblocks = _grid(rt, k, n, bs, 4)
    partials = rt.empty((nblocks,))
    counter = rt.zeros((1,), np.uint32)  # the last block resets it: zero before every launch
    grid, block, n32 = (nblocks, 1, 1), (bs, 1, 1), np.int32(n)

    def launch(norm2, grads):
        k(grid, block, norm2.ptr, partials.ptr, counter.ptr, grads.ptr, n32)
    return launch


def global_norm2_bf16(rt, n, block_size=None):
    bs = block_size or 1024
    ka = rt.kernel(MODULE, "global_norm_kernel2a_bf16", "PPi", label=f"{OP} 2 (partials, bf16)")
    kb = rt.kernel(MODULE, "global_norm_kernel2b", "PPi", label=f"{OP} 2 (final)")
    nblocks = _grid(rt, ka, n, bs, 8)  # 8 bf16 per 16-byte load
    partials = rt.empty((nblocks,))    # fp32
    grid, block, n32, nb32 = (nblocks, 1, 1), (bs, 1, 1), np.int32(n), np.int32(nblocks)

    def launch(norm2, grads):
        ka(grid, block, partials.ptr, grads.ptr, n32)
        kb((1, 1, 1), (1024, 1, 1), norm2.ptr, partials.ptr, nb32)
    return launch


def global_norm3_bf16(rt, n, block_size=None):
    bs = block_size or 1024
    k = rt.kernel(MODULE, "global_norm_kernel3_bf16", "PPPPi", label=f"{OP} 3 (bf16)")
    nblocks = _grid(rt, k, n, bs, 8)
    partials = rt.empty((nblocks,))
    counter = rt.zeros((1,), np.uint32)
    grid, block, n32 = (nblocks, 1, 1), (bs, 1, 1), np.int32(n)

    def launch(norm2, grads):
        k(grid, block, norm2.ptr, partials.ptr, counter.ptr, grads.ptr, n32)
    return launch


VARIANTS = {
    1: Variant(1, "grid-stride scalar sums, one atomicAdd per block (norm2 zeroed on the stream); not deterministic",
               global_norm1, _check),
    2: Variant(2, "deterministic two-pass: float4 per-block partials into scratch, then a one-block sum",
               {"fp32": global_norm2, "bf16": global_norm2_bf16}, _check),
    3: Variant(3, "deterministic, one launch: float4 per-block partials, the last block to finish sums them",
               {"fp32": global_norm3, "bf16": global_norm3_bf16}, _check),
}

OPS = [
    OpSpec("global_norm", cpu=global_norm_cpu, variants=VARIANTS, default=3, flag="--global-norm-kernel",
           cost=lambda n, dtype="fp32", **_: (0, esize(dtype) * n),  # grads read once (norm2: fp32, 4 bytes)
           doc="norm2(1)=, grads(n): norm2 = sum of squares of grads"),
]
