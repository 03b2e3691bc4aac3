"""Kernel lab: layernorm_forward at the trainer's shape (GPT-2 124M, B=4, T=1024: N=4096 rows, C=768),
fp32 and bf16.

    python dev/cuda/layernorm_forward.py            # every variant and dtype, block-size sweep, table
    python dev/cuda/layernorm_forward.py 4 5        # just variants 4 and 5
    python dev/cuda/layernorm_forward.py 5 --dtype bf16 --batch 16
    python dev/cuda/layernorm_forward.py --quick    # default block size only
    python dev/cuda/layernorm_forward.py 5 6 --dtype bf16 --batch 16 --quick   # 6: persistent warps

Bytes counted: x read once, out written once, weight/bias read once, mean/rstd written once (4 bytes
an element in fp32; in bf16 2, except mean/rstd, which stay fp32). bf16 rows ("5 bf16") run on bf16
copies of the inputs against the float64 reference on those values: out is rounded once (rtol 2^-8
over the fp32 math's 1e-5), mean and rstd are fp32 (1e-5, 1e-5).
"""

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.errors import VariantRefused
from llmc.ops.layernorm import layernorm_forward_ref

L = lab.Lab("layernorm_forward")
B, T, C = L.args.batch or 4, 1024, 768
N = B * T
BLOCK_SIZES = [None, 32, 64, 128, 256, 512, 1024]  # None: the variant's default

rt, rng = L.rt, np.random.default_rng(0)
x = lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1))
w = 1.0 + lab.rand(rng, C, scale=0.2)
b = lab.rand(rng, C, scale=0.2)
data = {}  # dtype: (inputs on the device, outputs, references, bytes)
for dt in ("fp32", "bf16"):
    val, up, dty, size = (lambda a: a, lambda a: a, np.float32, 4) if dt == "fp32" else (round_bf16, to_bf16, BF16, 2)
    ref_out, ref_mean, ref_rstd = layernorm_forward_ref(*(val(a).astype(np.float64) for a in (x, w, b)))
    data[dt] = ([rt.to_device(up(a)) for a in (x, w, b)],
                {"out": rt.empty((N, C), dty), "mean": rt.empty(N), "rstd": rt.empty(N)},
                {"out": ref_out, "mean": ref_mean, "rstd": ref_rstd},
                size * (2 * N * C + 2 * C) + 4 * 2 * N)

spec = ops.get("layernorm_forward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        ins, outs, refs, nbytes = data[dt]
        label = n if dt == "fp32" else f"{n} {dt}"
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, dt, N=N, C=C, block_size=bs).launch  # the bare closure
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(outs["out"], outs["mean"], outs["rstd"], *ins)  # noqa: E731
            if dt == "fp32":
                L.validate(label, fn, outputs=outs, refs=refs, atol=1e-5, rtol=1e-5)
            else:  # (two validations, the second re-runs the kernel)
                L.validate(label, fn, outputs={"out": outs["out"]}, refs=refs, atol=1e-5, rtol=2.0 ** -8)
                L.validate(label, fn, outputs={"mean": outs["mean"], "rstd": outs["rstd"]}, refs=refs,
                           atol=1e-5, rtol=1e-5)
            L.time(label, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
