"""Kernel lab: layernorm_forward at the trainer's shape (GPT-2 124M, B=4, T=1024: N=4096 rows, C=768).

    python dev/cuda/layernorm_forward.py            # every variant, block-size sweep, table
    python dev/cuda/layernorm_forward.py 4 5        # just variants 4 and 5
    python dev/cuda/layernorm_forward.py --quick    # default block size only

Bytes counted: x read once, out written once, weight/bias read once, mean/rstd written once.
"""

import numpy as np

import lab
from llmc import ops
from llmc.errors import VariantRefused
from llmc.ops.layernorm import layernorm_forward_ref

B, T, C = 4, 1024, 768
N = B * T
BLOCK_SIZES = [None, 32, 64, 128, 256, 512, 1024]  # None: the variant's default

L = lab.Lab("layernorm_forward")
rt, rng = L.rt, np.random.default_rng(0)
x = lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1))
w = 1.0 + lab.rand(rng, C, scale=0.2)
b = lab.rand(rng, C, scale=0.2)
ref_out, ref_mean, ref_rstd = layernorm_forward_ref(*(a.astype(np.float64) for a in (x, w, b)))
d_x, d_w, d_b = (rt.to_device(a) for a in (x, w, b))
out, mean, rstd = rt.empty((N, C)), rt.empty(N), rt.empty(N)
nbytes = 4 * (2 * N * C + 2 * N + 2 * C)

spec = ops.get("layernorm_forward")
for n in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES):
        try:
            launch = spec.build(rt, n, N=N, C=C, block_size=bs).launch  # the bare closure: no Python call in between
        except VariantRefused as e:
            print(f"  {e}")
            continue
        fn = lambda: launch(out, mean, rstd, d_x, d_w, d_b)  # noqa: E731
        L.validate(n, fn, outputs={"out": out, "mean": mean, "rstd": rstd},
                   refs={"out": ref_out, "mean": ref_mean, "rstd": ref_rstd}, atol=1e-5, rtol=1e-5)
        L.time(n, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
