"""Kernel lab: layernorm_backward at the trainer's shape (N=4096 rows, C=768).

    python dev/cuda/layernorm_backward.py           # every variant, block-size sweep, table
    python dev/cuda/layernorm_backward.py 3 4

Bytes counted: dout, inp read once; dinp (+=) read and written once; weight, mean, rstd read once;
dweight, dbias (+=) read and written once. The deterministic variants' scratch is not counted.
Timed repeats keep accumulating into the outputs (the values don't matter to the time).
"""

import numpy as np

import lab
from llmc import ops
from llmc.errors import VariantRefused
from llmc.ops.layernorm import layernorm_backward_ref, layernorm_forward_ref

B, T, C = 4, 1024, 768
N = B * T
BLOCK_SIZES = [None, 32, 64, 128, 256, 512, 1024]

L = lab.Lab("layernorm_backward")
rt, rng = L.rt, np.random.default_rng(0)
x = lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1))
w = 1.0 + lab.rand(rng, C, scale=0.2)
b = lab.rand(rng, C, scale=0.2)
dout = lab.rand(rng, (N, C))
_, mean, rstd = (a.astype(np.float32) for a in layernorm_forward_ref(x, w, b))
init = {"dinp": lab.rand(rng, (N, C)), "dweight": lab.rand(rng, C), "dbias": lab.rand(rng, C)}
gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
refs = {"dinp": init["dinp"] + gi, "dweight": init["dweight"] + gw, "dbias": init["dbias"] + gb}
ins = [rt.to_device(a) for a in (dout, x, w, mean, rstd)]
outs = {k: rt.empty(v.shape) for k, v in init.items()}
nbytes = 4 * (4 * N * C + 2 * N + 5 * C)

spec = ops.get("layernorm_backward")
for n in L.selected(spec):
    sizes = L.block_sizes(BLOCK_SIZES)
    for bs in sizes:
        try:
            launch = spec.build(rt, n, N=N, C=C, block_size=bs).launch  # the bare closure: no Python call in between
        except VariantRefused as e:
            print(f"  {e}")
            continue
        fn = lambda: launch(outs["dinp"], outs["dweight"], outs["dbias"], *ins)  # noqa: E731
        # dweight/dbias sum 4096 rows in fp32 onto partial sums of up to ~60: sequential (variant 1's
        # atomics) that rounds to ~1e-4 typically, a few e-4 at worst (one element of variant 1 was
        # 1.7e-4 off in one run), so 1e-3 absolute here; dinp stays at 1e-4
        # (two validations, each from the initial values: the second re-runs the kernel)
        L.validate(n, fn, outputs={"dinp": outs["dinp"]}, refs=refs, atol=1e-4, rtol=1e-4, init=init)
        L.validate(n, fn, outputs={"dweight": outs["dweight"], "dbias": outs["dbias"]}, refs=refs,
                   atol=1e-3, rtol=1e-4, init=init)
        L.time(n, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
        if n == 1:
            break  # the contended-atomics baseline is slow at every block size; one is enough
L.finish()
