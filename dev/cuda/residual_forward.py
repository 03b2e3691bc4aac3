"""Kernel lab: residual_forward at the trainer's shape: N = B*T*C = 4*1024*768.

    python dev/cuda/residual_forward.py           # every variant, block-size sweep, table

Bytes counted: inp1, inp2 read once, out written once (3N floats).
"""

import numpy as np

import lab
from llmc import ops
from llmc.errors import VariantRefused

B, T, C = 4, 1024, 768
N = B * T * C
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

L = lab.Lab("residual_forward")
rt, rng = L.rt, np.random.default_rng(0)
a, b = lab.rand(rng, N), lab.rand(rng, N)
ref = a.astype(np.float64) + b
d_a, d_b, d_out = rt.to_device(a), rt.to_device(b), rt.empty(N)
nbytes = 4 * 3 * N

spec = ops.get("residual_forward")
for n in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES):
        try:
            launch = spec.build(rt, n, N=N, block_size=bs).launch  # the bare closure: no Python call in between
        except VariantRefused as e:
            print(f"  {e}")
            continue
        fn = lambda: launch(d_out, d_a, d_b)  # noqa: E731
        L.validate(n, fn, outputs={"out": d_out}, refs={"out": ref}, atol=0.0, rtol=1e-7)
        L.time(n, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
