"""Kernel lab: the global gradient norm (sum of squares) over GPT-2 124M's gradient buffer.

    python dev/cuda/global_norm.py           # validate + time every variant over block sizes
    python dev/cuda/global_norm.py 3 --quick
    python dev/cuda/global_norm.py 3 --dtype bf16

Shape: n = 124,475,904 floats. Bytes counted: read 4n = 498 MB (0.167 ms at 2.98 TB/s); the
partials and norm2 are a few KB.
Reference line: torch.linalg.vector_norm(g) on the GPU (it returns the norm; same bytes).

bf16 (rows "<n> bf16", variants 2 and 3): bf16 grads, fp32 norm2 and sums; read 2n = 249 MB,
0.084 ms at 2.98 TB/s (target: >= 85% of the copy ceiling). Reference line: torch's vector_norm on
a bf16 tensor. Both dtypes by default; --dtype fp32 or --dtype bf16 runs one.
"""


import numpy as np

import lab
from llmc.bf16 import to_bf16
from llmc.ops import global_norm as op_module
from llmc.ops.global_norm import global_norm_ref

n = 124_475_904
BLOCK_SIZES = {1: (512, 256, 1024), 2: (1024, 256, 512), 3: (1024, 256, 512)}  # the default first


L = lab.Lab("global_norm")
DTYPES = ("fp32", "bf16") if L.args.dtype == "both" else (L.args.dtype,)  # lab.py's --dtype
rt = L.rt
spec = op_module.OPS[0]  # the module itself: a half-written sibling op can't break this lab

rng = np.random.default_rng(0)
g = lab.rand(rng, n, scale=1e-3)
d_norm2 = rt.empty((1,))

for dtype in DTYPES:
    L.section(dtype)
    print(f"\n## {dtype}")
    host = g if dtype == "fp32" else to_bf16(g)
    ref = np.array([global_norm_ref(host)])  # of the bf16 values themselves in bf16
    d_g = rt.to_device(host)
    nbytes = n * (4 if dtype == "fp32" else 2)
    sfx = "" if dtype == "fp32" else " bf16"
    for k in L.selected(spec):
        if dtype not in spec.variants[k].dtypes:
            print(f"  variant {k}: no {dtype} build")
            continue
        for bs in L.block_sizes(BLOCK_SIZES[k]):
            launch = spec.build(rt, k, dtype, n=n, block_size=bs).launch  # the bare closure: no Python call in between
            # validated at every block size (the grid and the summation order change with it);
            # fp32 partial sums vs a float64 sum: relative 1e-5 is the bar the tests set (bf16 too:
            # the squares of bf16 values are exact in fp32)
            L.validate(f"{k}{sfx}", lambda: launch(d_norm2, d_g), outputs={"norm2": d_norm2}, refs={"norm2": ref},
                       atol=0.0, rtol=1e-5)
            L.time(f"{k}{sfx}", lambda: launch(d_norm2, d_g), block_size=bs, bytes=nbytes)

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("no CUDA in this torch")
    for dtype in DTYPES:
        L.section(dtype)
        tg = torch.tensor(g, device="cuda").to(torch.float32 if dtype == "fp32" else torch.bfloat16)
        L.reference(f"torch linalg.vector_norm {dtype}", lambda tg=tg: torch.linalg.vector_norm(tg),
                    bytes=n * tg.element_size())
except ImportError as e:
    print(f"WARNING: no torch reference line ({e})")

L.finish()
