"""Kernel lab: softmax_forward, the causal softmax of attention, at the trainer's shape
(GPT-2 124M, B=4, NH=12: BNH = 48 rows-blocks of T x T, T = 1024).

    python dev/cuda/softmax_forward.py            # validate + time every variant over block sizes
    python dev/cuda/softmax_forward.py 6 --quick  # one variant, default block size

Bytes counted for GB/s, the same for every variant: the fewest any kernel must move, i.e. read the
lower triangle s <= t once (48*T(T+1)/2 floats = 101 MB) and write the full matrix (201 MB):
302 MB, 0.10 ms at 2.98 TB/s. A variant that re-reads rows shows as a lower GB/s.
"""
import math

import numpy as np

import lab
import llmc.ops
from llmc.ops.softmax import softmax_forward_ref

B, NH, T, hs = 4, 12, 1024, 64
BNH, scale = B * NH, 1.0 / math.sqrt(hs)

L = lab.Lab("softmax_forward")
rt = L.rt
spec = llmc.ops.get("softmax_forward")

# -----------------------------------------------------------------------------
# inputs and the float64 reference
rng = np.random.default_rng(1337)
preatt = lab.rand(rng, (BNH, T, T), scale=8.0)  # scale * preatt ~ N(0, 1), like GPT-2's logits
ref = softmax_forward_ref(preatt.astype(np.float64), scale)
d_pre, d_att = rt.to_device(preatt), rt.empty((BNH, T, T))
nbytes = 4 * (BNH * T * (T + 1) // 2 + BNH * T * T)

# block sizes per variant, the launcher's default first (--quick runs only that one)
BLOCKS = {1: (256, 128), 2: (256, 64, 128, 512, 1024), 4: (256, 64, 128, 512)}

# -----------------------------------------------------------------------------
for n in L.selected(spec):
    for i, bs in enumerate(L.block_sizes(BLOCKS.get(n, (256, 64, 128, 512)))):
        launch = spec.build(rt, n, BNH=BNH, T=T, scale=scale, block_size=bs).launch  # the bare closure: no Python call in between
        fn = lambda: launch(d_att, d_pre)  # noqa: E731
        if i == 0:
            L.validate(n, fn, outputs={"att": d_att}, refs={"att": ref}, atol=1e-7, rtol=3e-5)
        L.time(n, fn, block_size=bs, bytes=nbytes)

# vendor line: torch's softmax over the full rows (no causal mask: it reads and writes 2 x 201 MB)
try:
    import torch
    x = torch.from_numpy(preatt).cuda()
    L.reference("torch.softmax full rows (not causal)", lambda: torch.softmax(x, dim=-1),
                bytes=2 * 4 * BNH * T * T)
except Exception as e:  # torch without CUDA: the table just has no reference line
    print(f"WARNING: no torch reference ({e})")
L.finish()
