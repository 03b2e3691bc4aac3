"""Engine 5 bring-up: a few shapes, printing the error, NaN count and a corner of out vs ref.

    PYTHONPATH=. python dev/debug_wgmma.py [small]
"""
import sys

import numpy as np

from llmc.ops import gemm_wgmma as gw
from llmc.runtime import Runtime

rt = Runtime()
rng = np.random.default_rng(0)
shapes = [(128, 128, 32)] if sys.argv[1:] == ["small"] else [(128, 128, 32), (128, 128, 8), (1, 1, 8), (256, 256, 64), (1024, 768, 768)]
for M, N, K in shapes:
    for bn in (128,):
        A = rng.integers(-2, 3, (M, K)).astype(np.float32)
        B = rng.integers(-2, 3, (N, K)).astype(np.float32)
        dA, dB = rt.to_device(A), rt.to_device(B)
        dC = rt.empty((M, N), np.float32)
        dC.fill_bytes(0xFF)
        g = gw.wgmma_build(rt, "tf32", M, N, K, bn=bn, splits=1)
        g(dC, dA, dB)
        out = dC.get()
        ref = A.astype(np.float64) @ B.astype(np.float64).T
        nan = int(np.isnan(out).sum())
        ok = np.nan_to_num(out, nan=1e30) == ref
        print(f"M={M} N={N} K={K} bn={bn}: NaN {nan}/{out.size}, exact {int(ok.sum())}/{out.size}")
        if not ok.all():
            print(" out[:4,:8]\n", out[:4, :8], "\n ref[:4,:8]\n", ref[:4, :8])
            bad = np.argwhere(~ok)
            print(" first bad (row, col):", bad[:8].tolist())
