"""Kernel lab: encoder_forward at the trainer's shape (B=4, T=1024, C=768, Vp=50304).

    python dev/cuda/encoder_forward.py            # every variant, block-size sweep, table

Bytes counted: the ids, each distinct wte row used and the T wpe rows read once, out written once.
"""

import numpy as np

import lab
from llmc import ops
from llmc.errors import VariantRefused
from llmc.ops.encoder import encoder_forward_ref

B, T, C, V, Vp, maxT = 4, 1024, 768, 50257, 50304, 1024
N = B * T
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

L = lab.Lab("encoder_forward")
rt, rng = L.rt, np.random.default_rng(0)
inp = rng.integers(0, V, (B, T)).astype(np.int32)
wte = lab.rand(rng, (Vp, C))
wpe = lab.rand(rng, (maxT, C))
ref = encoder_forward_ref(inp, wte, wpe.astype(np.float64))
d_inp, d_wte, d_wpe, out = rt.to_device(inp), rt.to_device(wte), rt.to_device(wpe), rt.empty((B, T, C))
U = len(np.unique(inp))
nbytes = 4 * (N + U * C + T * C + N * C)
print(f"  {U} distinct tokens among {N} positions")

spec = ops.get("encoder_forward")
for n in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES):
        try:
            launch = spec.build(rt, n, B=B, T=T, C=C, block_size=bs).launch  # the bare closure: no Python call in between
        except VariantRefused as e:
            print(f"  {e}")
            continue
        fn = lambda: launch(out, d_inp, d_wte, d_wpe)  # noqa: E731
        L.validate(n, fn, outputs={"out": out}, refs={"out": ref}, atol=1e-6, rtol=1e-6)
        L.time(n, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
