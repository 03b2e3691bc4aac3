"""Kernel lab: attention_kv_fill, the prompt's keys and values (from the forward's qkvr) into the
decoder's KV caches, GPT-2 124M (C=768, NH=12, maxT=1024) for a 64- and a 1000-token prompt.

    python dev/cuda/attention_kv_fill.py          # every variant, block sizes, table

Bytes (the op's cost model): k and v of qkvr read, both caches' first T positions written.
"""
import numpy as np

import lab
import llmc.ops
from llmc.ops.attention import kv_fill_ref

C, NH, maxT = 768, 12, 1024
hs = C // NH
L = lab.Lab("attention_kv_fill")
rt, rng = L.rt, np.random.default_rng(0)
spec = llmc.ops.get("attention_kv_fill")
for B, T in ((1, 64), (8, 1000)):
    L.section(f"B={B} T={T}")
    qkvr = lab.rand(rng, (B, T, 3 * C))
    kref, vref = np.zeros((B, NH, maxT, hs), np.float32), np.zeros((B, NH, maxT, hs), np.float32)
    kv_fill_ref(kref, vref, qkvr, T)
    d_qkvr, d_k, d_v = rt.to_device(qkvr), rt.zeros((B, NH, maxT, hs)), rt.zeros((B, NH, maxT, hs))
    _, nbytes = spec.cost(B=B, C=C, NH=NH, maxT=maxT, T=T)
    for n in L.selected(spec):
        for bs in L.block_sizes((256, 128, 512)):
            launch = spec.build(rt, n, B=B, C=C, NH=NH, maxT=maxT, T=T, block_size=bs).launch  # the bare closure: no Python call in between
            fn = (lambda launch=launch: launch(d_k, d_v, d_qkvr))
            label = f"{n} B={B} T={T}"
            # positions past T are never written: start from zeros, as the reference does
            L.validate(label, fn, outputs={"kcache": d_k, "vcache": d_v}, refs={"kcache": kref, "vcache": vref},
                       atol=0, rtol=0, init={"kcache": np.zeros_like(kref), "vcache": np.zeros_like(vref)})
            L.time(label, fn, block_size=bs, bytes=nbytes, ceiling="dram")
L.finish()
