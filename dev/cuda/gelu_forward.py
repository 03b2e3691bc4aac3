"""Kernel lab: gelu_forward at the trainer's shape: N = B*T*4C = 4*1024*3072 (the MLP's hidden layer),
fp32 and bf16.

    python dev/cuda/gelu_forward.py            # every variant and dtype, block-size sweep, table
    python dev/cuda/gelu_forward.py 2 --quick --dtype bf16 --batch 16

Bytes counted: each input read once, the output written once (forward 2N elements, backward 3N; 4
bytes each in fp32, 2 in bf16). bf16 rows ("2 bf16") run on bf16 copies of the inputs against the
float64 reference on those values: one rounding of the output, rtol 2^-8; atol 1e-5 of the output's
rms for the values near a zero of the function, where the fp32 math's absolute error is what's left.
"""

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.errors import VariantRefused
from llmc.ops.gelu import gelu_backward_ref, gelu_forward_ref

L = lab.Lab("gelu_forward")
B, T, C = L.args.batch or 4, 1024, 768
N = B * T * 4 * C
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

rt, rng = L.rt, np.random.default_rng(0)
x = lab.rand(rng, N, scale=2.0)
dout = lab.rand(rng, N)
data = {}  # dtype: (inputs on the device, output, float64 reference, bytes per element, atol, rtol)
for dt in ("fp32", "bf16"):
    val, up, dty = (lambda a: a, lambda a: a, np.float32) if dt == "fp32" else (round_bf16, to_bf16, BF16)
    ref = gelu_forward_ref(val(x).astype(np.float64))
    ins = (rt.to_device(up(x)),)
    tol = (1e-6, 1e-5) if dt == "fp32" else (1e-5 * float(np.sqrt(np.mean(ref * ref))), 2.0 ** -8)
    data[dt] = (ins, rt.empty(N, dty), ref, 4 if dt == "fp32" else 2, *tol)

spec = ops.get("gelu_forward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        ins, d_out, ref, size, atol, rtol = data[dt]
        label = n if dt == "fp32" else f"{n} {dt}"
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, dt, N=N, block_size=bs).launch  # the bare closure
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(d_out, *ins)  # noqa: E731
            L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=atol, rtol=rtol)
            L.time(label, fn, block_size=bs or "default", bytes=size * 2 * N, ceiling="dram")
L.finish()
