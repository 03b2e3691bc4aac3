"""Kernel lab: encoder_decode, the decoder's embedding of B new tokens at one position (token ids and
the position read from the device), GPT-2 124M (C=768, Vp=50304, maxT=1024), batch 1 and 8, fp32
and bf16.

    python dev/cuda/encoder_decode.py             # every variant and dtype, block sizes, table
    python dev/cuda/encoder_decode.py --dtype bf16

Bytes (the op's cost model in the build's dtype: 4 bytes an element, 2 in bf16, plus the B+1 int32
ids): B wte rows and one wpe row read, out written. bf16 rows run on bf16 copies of the tables against the float64 reference on those
values: one rounding, rtol 2^-8.
"""
import numpy as np

import lab
import llmc.ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.ops.encoder import encoder_decode_ref

C, V, Vp, maxT = 768, 50257, 50304, 1024
L = lab.Lab("encoder_decode")
rt, rng = L.rt, np.random.default_rng(0)
spec = llmc.ops.get("encoder_decode")
wte, wpe = lab.rand(rng, (Vp, C)), lab.rand(rng, (maxT, C))
tables = {"fp32": (rt.to_device(wte), rt.to_device(wpe), wte, wpe),
          "bf16": (rt.to_device(to_bf16(wte)), rt.to_device(to_bf16(wpe)), round_bf16(wte), round_bf16(wpe))}
for B in (1, 8):
    L.section(f"B={B}")
    inp = np.concatenate([rng.integers(0, V, B), [517]]).astype(np.int32)  # B tokens, then the position
    d_inp = rt.to_device(inp)
    for n in L.selected(spec):
        for dt in L.dtypes(spec.variants[n]):
            d_wte, d_wpe, h_wte, h_wpe = tables[dt]
            ref = encoder_decode_ref(inp, h_wte.astype(np.float64), h_wpe.astype(np.float64))
            d_out = rt.empty((B, C), np.float32 if dt == "fp32" else BF16)
            tol = (1e-6, 1e-6) if dt == "fp32" else (0.0, 2.0 ** -8)
            for bs in L.block_sizes((256, 128, 512)):
                launch = spec.build(rt, n, dt, B=B, C=C, block_size=bs).launch  # the bare closure
                fn = (lambda launch=launch, d_out=d_out, d_wte=d_wte, d_wpe=d_wpe: launch(d_out, d_inp, d_wte, d_wpe))
                label = f"{n} B={B}" if dt == "fp32" else f"{n} {dt} B={B}"
                L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=tol[0], rtol=tol[1])
                L.time(label, fn, block_size=bs, bytes=spec.cost(B=B, C=C, dtype=dt)[1], ceiling="dram")
L.finish()
