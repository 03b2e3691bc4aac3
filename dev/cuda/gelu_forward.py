"""Kernel lab: gelu_forward at the trainer's shape: N = B*T*4C = 4*1024*3072 (the MLP's hidden layer).

    python dev/cuda/gelu_forward.py            # every variant, block-size sweep, table
    python dev/cuda/gelu_forward.py 2 --quick

Bytes counted: each input read once, the output written once (forward 2N floats, backward 3N).
"""

import numpy as np

import lab
from llmc import ops
from llmc.errors import VariantRefused
from llmc.ops.gelu import gelu_backward_ref, gelu_forward_ref

B, T, C = 4, 1024, 768
N = B * T * 4 * C
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

L = lab.Lab("gelu_forward")
rt, rng = L.rt, np.random.default_rng(0)
x = lab.rand(rng, N, scale=2.0)
dout = lab.rand(rng, N)
d_x, d_dout, d_out = rt.to_device(x), rt.to_device(dout), rt.empty(N)
ref = gelu_forward_ref(x.astype(np.float64))
nbytes = 4 * 2 * N

spec = ops.get("gelu_forward")
for n in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES):
        try:
            launch = spec.build(rt, n, N=N, block_size=bs).launch  # the bare closure: no Python call in between
        except VariantRefused as e:
            print(f"  {e}")
            continue
        fn = lambda: launch(d_out, d_x)  # noqa: E731
        L.validate(n, fn, outputs={"out": d_out}, refs={"out": ref}, atol=1e-6, rtol=1e-5)
        L.time(n, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
