"""Kernel lab: residual_forward at the trainer's shape: N = B*T*C = 4*1024*768, fp32 and bf16.

    python dev/cuda/residual_forward.py           # every variant and dtype, block-size sweep, table
    python dev/cuda/residual_forward.py 2 --dtype bf16 --batch 16

Bytes counted: inp1, inp2 read once, out written once (3N elements: 4 bytes each in fp32, 2 in
bf16). bf16 rows ("2 bf16") add bf16 copies of the inputs, against the float64 sum of those values:
one rounding, rtol 2^-8.
"""

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.errors import VariantRefused

L = lab.Lab("residual_forward")
B, T, C = L.args.batch or 4, 1024, 768
N = B * T * C
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

rt, rng = L.rt, np.random.default_rng(0)
a, b = lab.rand(rng, N), lab.rand(rng, N)
data = {  # dtype: (inp1, inp2, out, float64 reference, bytes per element, atol, rtol)
    "fp32": (rt.to_device(a), rt.to_device(b), rt.empty(N), a.astype(np.float64) + b, 4, 0.0, 1e-7),
    "bf16": (rt.to_device(to_bf16(a)), rt.to_device(to_bf16(b)), rt.empty(N, BF16),
             round_bf16(a).astype(np.float64) + round_bf16(b), 2, 0.0, 2.0 ** -8),
}

spec = ops.get("residual_forward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        d_a, d_b, d_out, ref, size, atol, rtol = data[dt]
        label = n if dt == "fp32" else f"{n} {dt}"
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, dt, N=N, block_size=bs).launch  # the bare closure
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(d_out, d_a, d_b)  # noqa: E731
            L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=atol, rtol=rtol)
            L.time(label, fn, block_size=bs or "default", bytes=size * 3 * N, ceiling="dram")
L.finish()
