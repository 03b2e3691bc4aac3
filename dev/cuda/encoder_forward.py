"""Kernel lab: encoder_forward at the trainer's shape (B=4, T=1024, C=768, Vp=50304), fp32 and bf16.

    python dev/cuda/encoder_forward.py            # every variant and dtype, block-size sweep, table
    python dev/cuda/encoder_forward.py 3 --dtype bf16 --batch 16

Bytes counted: the ids, each distinct wte row used and the T wpe rows read once, out written once
(4 bytes an element in fp32, 2 in bf16). bf16 rows ("3 bf16") run on bf16 copies of the same
inputs, against the float64 reference on those values: one rounding, rtol 2^-8.
"""

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.errors import VariantRefused
from llmc.ops.encoder import encoder_forward_ref

L = lab.Lab("encoder_forward")
B, T, C, V, Vp, maxT = L.args.batch or 4, 1024, 768, 50257, 50304, 1024
N = B * T
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

rt, rng = L.rt, np.random.default_rng(0)
inp = rng.integers(0, V, (B, T)).astype(np.int32)
wte = lab.rand(rng, (Vp, C))
wpe = lab.rand(rng, (maxT, C))
d_inp = rt.to_device(inp)
U = len(np.unique(inp))
print(f"  B={B}: {U} distinct tokens among {N} positions")
data = {  # dtype: (wte, wpe, out on the device, float64 reference, bytes, atol, rtol)
    "fp32": (rt.to_device(wte), rt.to_device(wpe), rt.empty((B, T, C)),
             encoder_forward_ref(inp, wte, wpe.astype(np.float64)), 4, 1e-6, 1e-6),
    "bf16": (rt.to_device(to_bf16(wte)), rt.to_device(to_bf16(wpe)), rt.empty((B, T, C), BF16),
             encoder_forward_ref(inp, round_bf16(wte), round_bf16(wpe).astype(np.float64)), 2, 0.0, 2.0 ** -8),
}

spec = ops.get("encoder_forward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        d_wte, d_wpe, out, ref, size, atol, rtol = data[dt]
        nbytes = 4 * N + size * (U * C + T * C + N * C)
        label = n if dt == "fp32" else f"{n} {dt}"
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, dt, B=B, T=T, C=C, block_size=bs).launch  # the bare closure
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(out, d_inp, d_wte, d_wpe)  # noqa: E731
            L.validate(label, fn, outputs={"out": out}, refs={"out": ref}, atol=atol, rtol=rtol)
            L.time(label, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
