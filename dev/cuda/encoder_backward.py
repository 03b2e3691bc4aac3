"""Kernel lab: encoder_backward at the trainer's shape (B=4, T=1024, C=768, Vp=50304).

    python dev/cuda/encoder_backward.py           # every variant, block-size sweep, table
    python dev/cuda/encoder_backward.py 2 3       # the deterministic ones

Two id distributions: uniform over the vocab (almost every token distinct) and Zipf over the vocab
(p(k) ~ 1/k: the most frequent token at ~9% of positions, somewhat more skewed than GPT-2 text, where
the top tokens are at 3-5%), which is where the owner variants (2, 3) pay for summing one token's
rows in one block. Rows labelled "z" use the Zipf ids.
Bytes counted: dout and the ids read once; each used dwte row and the T dwpe rows read and written
once ("+="). Timed repeats keep accumulating into dwte/dwpe (the values don't matter to the time).
"""

import numpy as np

import lab
from llmc import ops
from llmc.errors import VariantRefused
from llmc.ops.encoder import encoder_backward_ref

B, T, C, V, Vp, maxT = 4, 1024, 768, 50257, 50304, 1024
N = B * T
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

L = lab.Lab("encoder_backward")
rt, rng = L.rt, np.random.default_rng(0)
zipf = 1.0 / np.arange(1, V + 1)
ids = {"": rng.integers(0, V, (B, T)).astype(np.int32),
       "z": rng.choice(V, (B, T), p=zipf / zipf.sum()).astype(np.int32)}
dout = lab.rand(rng, (B, T, C))
init = {"dwte": lab.rand(rng, (Vp, C)), "dwpe": lab.rand(rng, (maxT, C))}
outs = {"dwte": rt.empty((Vp, C)), "dwpe": rt.empty((maxT, C))}
d_dout = rt.to_device(dout)
cases = {}
for tag, inp in ids.items():
    U, top = len(np.unique(inp)), np.bincount(inp.ravel()).max()
    print(f"  ids{' ' + tag if tag else ''}: {U} distinct tokens among {N} positions, the most frequent {top} times")
    refs = dict(zip(("dwte", "dwpe"), encoder_backward_ref(init["dwte"].astype(np.float64),
                                                         init["dwpe"].astype(np.float64), dout.astype(np.float64), inp)))
    cases[tag] = (rt.to_device(inp), refs, 4 * (N + N * C + 2 * U * C + 2 * T * C))

spec = ops.get("encoder_backward")
for n in L.selected(spec):
    for tag, (d_inp, refs, nbytes) in cases.items():
        label = f"{n} {tag}".strip()
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, B=B, T=T, C=C, block_size=bs).launch  # the bare closure: no Python call in between
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(outs["dwte"], outs["dwpe"], d_dout, d_inp)  # noqa: E731
            L.validate(label if tag else n, fn, outputs=outs, refs=refs, atol=1e-4, rtol=1e-5, init=init)
            L.time(label if tag else n, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
