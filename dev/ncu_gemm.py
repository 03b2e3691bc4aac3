"""Profile a few engine-5 GEMMs under Nsight Compute (one launch each, after a warm-up).

    ncu --target-processes all -k regex:gemm_wgmma --launch-skip 0 --launch-count 4 \
        --metrics <list> python dev/ncu_gemm.py
"""
import numpy as np

from llmc.ops import gemm_wgmma as gw
from llmc.runtime import Runtime

rt = Runtime()
rng = np.random.default_rng(0)
for M, N, K, name in [(4096, 2304, 768, "qkv fwd"), (2304, 768, 4096, "qkv dweight (K-major copies)"),
                      (4096, 50304, 768, "lm head fwd"), (4096, 768, 50304, "lm head dinp")]:
    A = rt.to_device(rng.standard_normal((M, K)).astype(np.float32))
    B = rt.to_device(rng.standard_normal((N, K)).astype(np.float32))
    C = rt.empty((M, N), np.float32)
    g = gw.wgmma_build(rt, "tf32", M, N, K)
    g(C, A, B)
    rt.synchronize()
    print(name, g.plan, flush=True)
