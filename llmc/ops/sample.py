"""Sampling the next token on the GPU (the KV-cache decoder's last kernel of a step).

    python dev/cuda/sample.py                   # greedy / top-k / full, batch 1 and 8, vs torch
    launch = llmc.ops.get("sample").build(rt, 1, B=8, V=50257, Vp=50304)
    launch(tokens (B,) int32, logits (B, Vp), uniforms (B,) float64, temperature, top_k)

The rule is llmc.sample.sample_with_uniform's (greedy at temperature <= 0; top-k with ties kept;
the first index whose running sum of exp((z - max) / T) exceeds u * the total), applied per row
with the row's uniform draw, so a seed gives the same tokens as host sampling except where a draw
lands within rounding of a boundary between two tokens. cuda/sample.cu has the kernel; sample_cpu
is the numpy backend's launcher (it is the host sampler itself). One variant so far; only the
decoder runs it (--sample-kernel).

bf16 build (`build(rt, 1, "bf16", ...)`, for a bf16 model): logits bf16 (B, Vp), everything else
unchanged (uniforms float64, tokens int32). The kernel widens each bf16 logit exactly, so it
samples from from_bf16(logits), the values the host sampler (and sample_cpu, which takes bf16 bits
too) sees.
"""
from __future__ import annotations

import numpy as np

from llmc.bf16 import BF16, from_bf16
from llmc.ops import Built, OpSpec, Variant, esize
from llmc.sample import sample_with_uniform  # the host sampler's rule, which the kernel follows

MODULE = "sample"  # cuda/sample.cu
THREADS = 1024      # SAMPLE_THREADS


def sample_ref(logits, uniforms, V, temperature, top_k):
    """tokens (B,) from logits (B, >=V) with one uniform per row (bf16 logits: uint16 bits)."""
    if np.asarray(logits).dtype == BF16:
        logits = from_bf16(logits).reshape(np.shape(logits))
    return np.array([sample_with_uniform(row[:V], temperature, top_k, float(u))
                     for row, u in zip(logits, uniforms)], np.int32)


def sample_cpu(B, V, Vp, **_):
    def launch(tokens, logits, uniforms, temperature, top_k):
        tokens.reshape(-1)[:B] = sample_ref(logits.reshape(B, Vp), uniforms.reshape(-1)[:B], V, temperature, top_k)
    return launch


def _check(B, V, Vp, **_):
    if B < 1 or not 1 <= V <= Vp:
        return f"B={B}, vocabulary V={V} outside 1..Vp={Vp}"
    return None


def sample1(rt, B, V, Vp, func="sample_kernel1"):
    k = rt.kernel(MODULE, func, "PPPiiifi", label="sample 1" + (" (bf16)" if "bf16" in func else ""))
    grid, block = (B, 1, 1), (THREADS, 1, 1)
    # the row in shared memory when it fits next to the kernel's static ~9.4 KB (GPT-2: 201 KB); a
    # bf16 row is widened to fp32 there, so the same rule (and the same vector loads' Vp % 4 == 0)
    static = k.attributes()["static_smem"]
    staged = Vp % 4 == 0 and 4 * V + static <= rt.max_smem_optin
    smem = 4 * V if staged else 0
    if staged:
        k.set_max_dynamic_smem(smem)

    def launch(tokens, logits, uniforms, temperature, top_k):
        inv_temp = np.float32(0.0 if temperature <= 0 else 1.0 / temperature)
        k_ = np.int32(top_k if top_k is not None and 0 < top_k < V else 0)
        k(grid, block, tokens.ptr, logits.ptr, uniforms.ptr, np.int32(V), np.int32(Vp), k_, inv_temp,
          np.int32(staged), smem=smem)
    return Built(launch, info={"staged": staged})


def sample1_bf16(rt, B, V, Vp):
    return sample1(rt, B, V, Vp, func="sample_kernel1_bf16")


OPS = [
    OpSpec("sample", sample_cpu, {
        1: Variant(1, "a block per row: max, top-k threshold by a radix select over the row, the inverse "
                      "CDF by a block scan; the row staged in shared memory when it fits",
                   {"fp32": sample1, "bf16": sample1_bf16}, _check),
    }, default=1, flag="--sample-kernel", cost=lambda B, V, Vp, dtype="fp32", **_: (0, esize(dtype) * B * V),
        doc="tokens(B,) int32=, logits(B,Vp), uniforms(B,) float64, temperature, top_k; build(B, V, Vp)"),
]
