"""Kernel lab: encoder_decode, the decoder's embedding of B new tokens at one position (token ids and
the position read from the device), GPT-2 124M (C=768, Vp=50304, maxT=1024), batch 1 and 8.

    python dev/cuda/encoder_decode.py             # every variant, block sizes, table

Bytes (the op's cost model): B wte rows and one wpe row read, out written.
"""
import numpy as np

import lab
import llmc.ops
from llmc.ops.encoder import encoder_decode_ref

C, V, Vp, maxT = 768, 50257, 50304, 1024
L = lab.Lab("encoder_decode")
rt, rng = L.rt, np.random.default_rng(0)
spec = llmc.ops.get("encoder_decode")
wte, wpe = lab.rand(rng, (Vp, C)), lab.rand(rng, (maxT, C))
d_wte, d_wpe = rt.to_device(wte), rt.to_device(wpe)
for B in (1, 8):
    L.section(f"B={B}")
    inp = np.concatenate([rng.integers(0, V, B), [517]]).astype(np.int32)  # B tokens, then the position
    ref = encoder_decode_ref(inp, wte.astype(np.float64), wpe.astype(np.float64))
    d_inp, d_out = rt.to_device(inp), rt.empty((B, C))
    _, nbytes = spec.cost(B=B, C=C)
    for n in L.selected(spec):
        for bs in L.block_sizes((256, 128, 512)):
            launch = spec.build(rt, n, B=B, C=C, block_size=bs).launch  # the bare closure: no Python call in between
            fn = (lambda launch=launch: launch(d_out, d_inp, d_wte, d_wpe))
            label = f"{n} B={B}"
            L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=1e-6, rtol=1e-6)
            L.time(label, fn, block_size=bs, bytes=nbytes, ceiling="dram")
L.finish()
