"""Kernel lab: AdamW (with on-device clipping) over GPT-2 124M's whole parameter buffer.

    python dev/cuda/adamw.py             # validate + time every variant over block sizes
    python dev/cuda/adamw.py 2 --quick   # one variant, default block size

Shape: n = 124,475,904 (GPT-2 124M with Vp=50304), one range (the model splits it in a few
ranges by weight-decay flag; same bytes). Bytes counted: read params, grads, m, v and write params,
m, v: 28 bytes per parameter, 3.49 GB, 1.17 ms at 2.98 TB/s.
Reference line: torch.optim.AdamW(fused=True).step() on one fp32 parameter of the same size (its
clipping would be a separate pass; ours is folded in).
"""

import numpy as np

import lab
from llmc.ops import adamw as op_module
from llmc.ops.adamw import adamw_ref, hyperparams

n = 124_475_904
LR, B1, B2, EPS, WD, T, MAX_NORM = 6e-4, 0.9, 0.95, 1e-8, 0.1, 7, 1.0
BLOCK_SIZES = {1: (256, 512, 1024), 2: (1024, 128, 256, 512)}  # the default first

L = lab.Lab("adamw")
rt = L.rt
spec = op_module.OPS[0]  # the module itself: a half-written sibling op can't break this lab

rng = np.random.default_rng(0)
p = lab.rand(rng, n)
g = lab.rand(rng, n, scale=1e-3)
m = lab.rand(rng, n, scale=1e-3)
v = (rng.random(n, dtype=np.float32) * 1e-5 + 1e-7).astype(np.float32)
norm2 = np.array([float(np.dot(g.astype(np.float64), g.astype(np.float64)))], np.float32)  # ~0.35^2: clips
print("computing the float64 reference ...")
p_ref, m_ref, v_ref = adamw_ref(p, g, m, v, norm2, LR, B1, B2, EPS, WD, T, 0.1)  # max_norm 0.1 < norm: clipping on

d_p, d_g, d_m, d_v, d_norm2 = (rt.to_device(a) for a in (p, g, m, v, norm2))
d_hp_clip = rt.to_device(hyperparams(LR, B1, B2, EPS, WD, T, 0.1))       # max_norm 0.1 < norm: clipping on
d_hp = rt.to_device(hyperparams(LR, B1, B2, EPS, WD, T, MAX_NORM))
nbytes = 28 * n

for k in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES[k]):
        launch = spec.build(rt, k, n=n, block_size=bs).launch  # the bare closure: no Python call in between
        # validated at every block size (the grid, so which thread takes which element, changes);
        # fp32 elementwise vs float64: a few ulp of each value
        L.validate(k, lambda: launch(d_p, d_g, d_m, d_v, d_norm2, d_hp_clip),
                   outputs={"params": d_p, "m": d_m, "v": d_v}, refs={"params": p_ref, "m": m_ref, "v": v_ref},
                   atol=1e-7, rtol=1e-5, init={"params": p, "m": m, "v": v})
        L.time(k, lambda: launch(d_p, d_g, d_m, d_v, d_norm2, d_hp),
               block_size=bs, bytes=nbytes)

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("no CUDA in this torch")
    tp = torch.nn.Parameter(torch.tensor(p, device="cuda"))
    tp.grad = torch.tensor(g, device="cuda")
    opt = torch.optim.AdamW([tp], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)
    L.reference("torch AdamW fused=True", opt.step, bytes=nbytes)
except (ImportError, RuntimeError) as e:
    print(f"WARNING: no torch reference line ({e})")

L.finish()
