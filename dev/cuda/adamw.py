"""Kernel lab: AdamW (with on-device clipping) over GPT-2 124M's whole parameter buffer.

    python dev/cuda/adamw.py             # validate + time every variant over block sizes
    python dev/cuda/adamw.py 2 --quick   # one variant, default block size
    python dev/cuda/adamw.py 2 --dtype bf16

Shape: n = 124,475,904 (GPT-2 124M with Vp=50304), one range (the model splits it in a few
ranges by weight-decay flag; same bytes). Bytes counted: read params, grads, m, v and write params,
m, v: 28 bytes per parameter, 3.49 GB, 1.17 ms at 2.98 TB/s.
Reference line: torch.optim.AdamW(fused=True).step() on one fp32 parameter of the same size (its
clipping would be a separate pass; ours is folded in).

bf16 (rows "<n> bf16"): bf16 params (written only) and grads, fp32 m, v and master weights, the
stochastic rounding on (seed 1234): read grads, m, v, master, write params, m, v, master: also 28
bytes per parameter, 1.17 ms (target: >= 85% of the copy ceiling). Validated: master, m, v as fp32;
params within one bf16 ulp (2^-7 relative) of the float64 master (stochastic rounding moves a value
by less than an ulp). Reference line: torch AdamW fused on a bf16 parameter (no master weights,
round to nearest). Both dtypes by default; --dtype fp32 or --dtype bf16 runs one.
"""


import numpy as np

import lab
from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.ops import adamw as op_module
from llmc.ops.adamw import adamw_ref, hyperparams


n = 124_475_904
LR, B1, B2, EPS, WD, T, MAX_NORM = 6e-4, 0.9, 0.95, 1e-8, 0.1, 7, 1.0
BLOCK_SIZES = {1: (256, 512, 1024), 2: (1024, 128, 256, 512), 3: (256, 128, 512, 1024)}  # the default first

L = lab.Lab("adamw")
DTYPES = ("fp32", "bf16") if L.args.dtype == "both" else (L.args.dtype,)  # lab.py's --dtype
rt = L.rt
spec = op_module.OPS[0]  # the module itself: a half-written sibling op can't break this lab

rng = np.random.default_rng(0)
p = lab.rand(rng, n)
g = lab.rand(rng, n, scale=1e-3)
m = lab.rand(rng, n, scale=1e-3)
v = (rng.random(n, dtype=np.float32) * 1e-5 + 1e-7).astype(np.float32)
nbytes = 28 * n
d_hp_clip = rt.to_device(hyperparams(LR, B1, B2, EPS, WD, T, 0.1))       # max_norm 0.1 < norm: clipping on
d_hp = rt.to_device(hyperparams(LR, B1, B2, EPS, WD, T, MAX_NORM))

for dtype in DTYPES:
    L.section(dtype)
    print(f"\n## {dtype}")
    gh = g if dtype == "fp32" else to_bf16(g)
    gv = g if dtype == "fp32" else from_bf16(gh)  # the values the kernel sees
    norm2 = np.array([float(np.dot(gv.astype(np.float64), gv.astype(np.float64)))], np.float32)  # ~0.35^2: clips
    print("computing the float64 reference ...")
    p_ref, m_ref, v_ref = adamw_ref(p, gv, m, v, norm2, LR, B1, B2, EPS, WD, T, 0.1)  # max_norm 0.1 < norm: clipping on
    d_g, d_m, d_v, d_norm2 = (rt.to_device(a) for a in (gh, m, v, norm2))
    if dtype == "fp32":
        d_p = rt.to_device(p)
        args = (d_p, d_g, d_m, d_v, d_norm2)
        outputs, refs, init = {"params": d_p, "m": d_m, "v": d_v}, {"params": p_ref, "m": m_ref, "v": v_ref}, \
            {"params": p, "m": m, "v": v}
        tail = ()
    else:
        d_p, d_master = rt.empty((n,), BF16), rt.to_device(p)
        d_seed = rt.to_device(np.array([1234], np.uint32))
        args = (d_p, d_g, d_m, d_v, d_norm2)
        outputs = {"params": d_p, "master": d_master, "m": d_m, "v": d_v}
        refs = {"params": p_ref, "master": p_ref, "m": m_ref, "v": v_ref}
        init = {"master": p, "m": m, "v": v}
        tail = (d_master, d_seed)
    sfx = "" if dtype == "fp32" else " bf16"
    for k in L.selected(spec):
        if dtype not in spec.variants[k].dtypes:
            print(f"  variant {k}: no {dtype} build")
            continue
        for bs in L.block_sizes(BLOCK_SIZES[k]):
            launch = spec.build(rt, k, dtype, n=n, block_size=bs).launch  # the bare closure: no Python call in between
            # validated at every block size (the grid, so which thread takes which element, changes);
            # fp32 elementwise vs float64: a few ulp of each value. bf16 params: the fp32 master
            # stochastically rounded, less than one bf16 ulp (2^-7 relative) from it
            if dtype == "fp32":
                L.validate(k, lambda: launch(*args, d_hp_clip), outputs=outputs, refs=refs,
                           atol=1e-7, rtol=1e-5, init=init)
            else:
                fn = lambda: launch(*args, d_hp_clip, *tail)  # noqa: E731
                L.validate(f"{k}{sfx}", fn, outputs={n_: outputs[n_] for n_ in ("master", "m", "v")},
                           refs=refs, atol=1e-7, rtol=1e-5, init=init)
                reset = lambda: [d.set(h) for d, h in ((d_master, p), (d_m, m), (d_v, v))]  # noqa: E731
                L.validate(f"{k}{sfx}", lambda: (reset(), fn()), outputs={"params": d_p}, refs=refs,
                           atol=1e-6, rtol=2.0 ** -7)
            L.time(f"{k}{sfx}", lambda: launch(*args, d_hp, *tail), block_size=bs, bytes=nbytes)

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("no CUDA in this torch")
    for dtype in DTYPES:
        L.section(dtype)
        tdt = torch.float32 if dtype == "fp32" else torch.bfloat16
        tp = torch.nn.Parameter(torch.tensor(p, device="cuda").to(tdt))
        tp.grad = torch.tensor(g, device="cuda").to(tdt)
        opt = torch.optim.AdamW([tp], lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD, fused=True)
        L.reference(f"torch AdamW fused=True {dtype}", opt.step,
                    bytes=nbytes if dtype == "fp32" else 16 * n)  # bf16: p, g, m, v all bf16
        del tp, opt
except (ImportError, RuntimeError) as e:
    print(f"WARNING: no torch reference line ({e})")

L.finish()
