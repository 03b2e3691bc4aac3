"""Kernel lab: the global gradient norm (sum of squares) over GPT-2 124M's gradient buffer.

    python dev/cuda/global_norm.py           # validate + time every variant over block sizes
    python dev/cuda/global_norm.py 3 --quick

Shape: n = 124,475,904 floats. Bytes counted: read 4n = 498 MB (0.167 ms at 2.98 TB/s); the
partials and norm2 are a few KB.
Reference line: torch.linalg.vector_norm(g) on the GPU (it returns the norm; same bytes).
"""

import numpy as np

import lab
from llmc.ops import global_norm as op_module
from llmc.ops.global_norm import global_norm_ref

n = 124_475_904
BLOCK_SIZES = {1: (512, 256, 1024), 2: (1024, 256, 512), 3: (1024, 256, 512)}  # the default first

L = lab.Lab("global_norm")
rt = L.rt
spec = op_module.OPS[0]  # the module itself: a half-written sibling op can't break this lab

rng = np.random.default_rng(0)
g = lab.rand(rng, n, scale=1e-3)
ref = np.array([global_norm_ref(g)])
d_g, d_norm2 = rt.to_device(g), rt.empty((1,))

for k in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES[k]):
        launch = spec.build(rt, k, n=n, block_size=bs).launch  # the bare closure: no Python call in between
        # validated at every block size (the grid and the summation order change with it);
        # fp32 partial sums vs a float64 sum: relative 1e-5 is the bar the tests set
        L.validate(k, lambda: launch(d_norm2, d_g), outputs={"norm2": d_norm2}, refs={"norm2": ref},
                   atol=0.0, rtol=1e-5)
        L.time(k, lambda: launch(d_norm2, d_g), block_size=bs, bytes=4 * n)

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("no CUDA in this torch")
    tg = torch.tensor(g, device="cuda")
    L.reference("torch linalg.vector_norm", lambda: torch.linalg.vector_norm(tg), bytes=4 * n)
except ImportError as e:
    print(f"WARNING: no torch reference line ({e})")

L.finish()
