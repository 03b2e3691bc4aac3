"""Kernel lab: encoder_forward at the trainer's shape (B=4, T=1024, C=768, Vp=50304), fp32 and bf16.

    python dev/cuda/encoder_forward.py            # every variant and dtype, block-size sweep, table
    python dev/cuda/encoder_forward.py 3 --dtype bf16 --batch 16

Bytes counted: the ids, each distinct wte row used and the T wpe rows read once, out written once
(4 bytes an element in fp32, 2 in bf16). bf16 rows ("3 bf16") run on bf16 copies of the same
inputs, against the float64 reference on those values: one rounding, rtol 2^-8.

Three id sets: uniform over the vocab (the worst case: almost every row a distinct, random wte row),
the same ids sorted ("sorted": wte read in address order, what a gather's DRAM locality is worth), and
Zipf over the vocab ("z": text-like repeats, most rows found in L2). Rows carry the set's tag.
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
uniform = rng.integers(0, V, (B, T)).astype(np.int32)
zipf = 1.0 / np.arange(1, V + 1)
id_sets = {"": uniform, " sorted": np.sort(uniform, axis=None).reshape(B, T).astype(np.int32),
           " z": rng.choice(V, (B, T), p=zipf / zipf.sum()).astype(np.int32)}
wte = lab.rand(rng, (Vp, C))
wpe = lab.rand(rng, (maxT, C))
weights = {"fp32": (rt.to_device(wte), rt.to_device(wpe), rt.empty((B, T, C)), wte, wpe, 4, 1e-6, 1e-6),
           "bf16": (rt.to_device(to_bf16(wte)), rt.to_device(to_bf16(wpe)), rt.empty((B, T, C), BF16),
                    round_bf16(wte), round_bf16(wpe), 2, 0.0, 2.0 ** -8)}

spec = ops.get("encoder_forward")
for tag, inp in id_sets.items():
    d_inp = rt.to_device(inp)
    U = len(np.unique(inp))
    print(f"  B={B}, ids{tag or ' uniform'}: {U} distinct tokens among {N} positions")
    for n in L.selected(spec):
        for dt in L.dtypes(spec.variants[n]):
            d_wte, d_wpe, out, w_ref, p_ref, size, atol, rtol = weights[dt]
            ref = encoder_forward_ref(inp, w_ref, p_ref.astype(np.float64))
            nbytes = 4 * N + size * (U * C + T * C + N * C)
            label = (str(n) if dt == "fp32" else f"{n} {dt}") + tag
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
