"""Kernel lab: residual_layernorm_forward (fused residual add + layernorm) at N=4096 rows, C=768.

    python dev/cuda/residual_layernorm_forward.py        # every variant, block-size sweep, table
    python dev/cuda/residual_layernorm_forward.py 3

Bytes counted (the fused minimum): inp1, inp2 read once; residual, out written once; weight/bias
read, mean/rstd written. Variant 1 (two launches) really moves a third more: it reads residual back.
"""

import numpy as np

import lab
from llmc import ops
from llmc.errors import VariantRefused
from llmc.ops.residual_layernorm import residual_layernorm_forward_ref

B, T, C = 4, 1024, 768
N = B * T
BLOCK_SIZES = [None, 32, 64, 128, 256, 512, 1024]

L = lab.Lab("residual_layernorm_forward")
rt, rng = L.rt, np.random.default_rng(0)
a = lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1))
b = lab.rand(rng, (N, C))
w = 1.0 + lab.rand(rng, C, scale=0.2)
bias = lab.rand(rng, C, scale=0.2)
r_res, r_out, r_mean, r_rstd = residual_layernorm_forward_ref(*(v.astype(np.float64) for v in (a, b, w, bias)))
ins = [rt.to_device(v) for v in (a, b, w, bias)]
outs = {"residual": rt.empty((N, C)), "out": rt.empty((N, C)), "mean": rt.empty(N), "rstd": rt.empty(N)}
refs = {"residual": r_res, "out": r_out, "mean": r_mean, "rstd": r_rstd}
nbytes = 4 * (4 * N * C + 2 * N + 2 * C)

spec = ops.get("residual_layernorm_forward")
for n in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES):
        try:
            launch = spec.build(rt, n, N=N, C=C, block_size=bs).launch  # the bare closure: no Python call in between
        except VariantRefused as e:
            print(f"  {e}")
            continue
        fn = lambda: launch(*outs.values(), *ins)  # noqa: E731
        L.validate(n, fn, outputs=outs, refs=refs, atol=1e-5, rtol=1e-5)
        L.time(n, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
