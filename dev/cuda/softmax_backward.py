"""Kernel lab: softmax_backward (causal) at the trainer's shape: BNH = 48 (B=4, NH=12), T = 1024.

    python dev/cuda/softmax_backward.py            # validate + time every variant over block sizes
    python dev/cuda/softmax_backward.py 6 --quick

dpreatt = scale * att * (datt - sum_s att*datt) on s <= t, 0 above. Bytes counted for GB/s (the
same for every variant): read the lower triangles of att and datt once (2 x 101 MB) and write the
full dpreatt (201 MB): 403 MB, 0.135 ms at 2.98 TB/s.
"""
import math

import numpy as np

import lab
import llmc.ops
from llmc.ops.softmax import build_backward6_lower, softmax_backward_ref, softmax_forward_ref

B, NH, T, hs = 4, 12, 1024, 64
BNH, scale = B * NH, 1.0 / math.sqrt(hs)

L = lab.Lab("softmax_backward")
rt = L.rt
spec = llmc.ops.get("softmax_backward")

# -----------------------------------------------------------------------------
rng = np.random.default_rng(1337)
att = softmax_forward_ref(lab.rand(rng, (BNH, T, T), scale=8.0), scale).astype(np.float32)  # a real softmax
datt = lab.rand(rng, (BNH, T, T))
ref = softmax_backward_ref(datt.astype(np.float64), att.astype(np.float64), scale)
d_att, d_datt, d_dpre = rt.to_device(att), rt.to_device(datt), rt.empty((BNH, T, T))
nbytes = 4 * (2 * BNH * T * (T + 1) // 2 + BNH * T * T)

BLOCKS = {1: (256, 128), 2: (256, 64, 128, 512, 1024), 4: (128, 64, 256, 512)}

# -----------------------------------------------------------------------------
for n in L.selected(spec):
    for i, bs in enumerate(L.block_sizes(BLOCKS.get(n, (256, 64, 128, 512)))):
        launch = spec.build(rt, n, BNH=BNH, T=T, scale=scale, block_size=bs).launch  # the bare closure: no Python call in between
        fn = lambda: launch(d_dpre, d_datt, d_att)  # noqa: E731
        if i == 0:
            L.validate(n, fn, outputs={"dpreatt": d_dpre}, refs={"dpreatt": ref}, atol=1e-7, rtol=1e-4)
        L.time(n, fn, block_size=bs, bytes=nbytes)

# the composite's lower-only entry point of variant 6: stores only the float4s holding s <= t into a
# buffer whose upper triangle is already 0 (302 MB instead of 403 MB)
if not L.args.variants or 6 in L.args.variants:
    lower = build_backward6_lower(rt, BNH, T, scale)
    fn = lambda: lower(d_dpre, d_datt, d_att)  # noqa: E731
    L.validate("6 lower-only", fn, outputs={"dpreatt": d_dpre}, refs={"dpreatt": ref}, atol=1e-7, rtol=1e-4,
               init={"dpreatt": np.zeros((BNH, T, T), np.float32)})
    L.time("6 lower-only", fn, block_size=256, bytes=4 * 3 * BNH * T * (T + 1) // 2)

# vendor line: torch's softmax backward over full rows (reads 2 x 201 MB, writes 201 MB)
try:
    import torch
    a, g = torch.from_numpy(att).cuda(), torch.from_numpy(datt).cuda()
    L.reference("torch _softmax_backward_data full rows",
                lambda: torch._softmax_backward_data(g, a, -1, torch.float32), bytes=3 * 4 * BNH * T * T)
except Exception as e:
    print(f"WARNING: no torch reference ({e})")
L.finish()
