"""Engine 5 bring-up, step 3: wgmma's tf32 register layout for A, and load_a_mn against the TMA.

    PYTHONPATH=. python dev/debug_wgmma3.py
"""
import numpy as np

from llmc.ops import gemm_wgmma as gw
from llmc.runtime import Runtime

rt = Runtime()
D = {"GEMM_WGMMA_DEBUG": 1}
k = rt.kernel("gemm_wgmma", "wgmma_debug_rs_layout", "P", defines=D)
k.set_max_dynamic_smem(16384 + 1024)
out = rt.empty((64, 8), np.float32)
out.fill_bytes(0xFF)
k((1, 1, 1), (128, 1, 1), out.ptr, smem=16384 + 1024)
o = out.get()
print("A(m, k) -> (tid, reg) for the first warp's 16 rows:")
for m in range(16):
    print(m, [((int(v) - 1) // 4, (int(v) - 1) % 4) if np.isfinite(v) and v > 0 else None for v in o[m]])
mine = np.zeros((64, 8), np.int64)
for tid in range(128):
    w, l = tid // 32, tid % 32
    g, t = l // 4, l % 4
    for i in range(4):
        mine[w * 16 + g + 8 * (i & 1), t + 4 * (i >> 1)] = 4 * tid + i + 1
print("layout as load_a_mn assumes it:", np.array_equal(o.astype(np.int64), mine))

M, K = 128, 32
At = (np.arange(M)[None, :] * 1000 + np.arange(K)[:, None]).astype(np.float32)  # A^T[k, m] = m*1000 + k
dA = rt.to_device(At)
dtm = rt.to_device(np.frombuffer(gw.tensor_map(dA.ptr, "tf32t", K, M, M, 32), np.uint8))
k2 = rt.kernel("gemm_wgmma", "wgmma_debug_load_a_mn", "PP", defines=D)
k2.set_max_dynamic_smem(16384 + 1024)
o2 = rt.empty((256 * 16,), np.float32)
k2((1, 1, 1), (256, 1, 1), dtm.ptr, o2.ptr, smem=16384 + 1024)
got = o2.get().reshape(256, 4, 4)
bad = 0
for tid in range(256):
    wg, w, l = tid // 128, (tid // 32) % 4, tid % 32
    g, t = l // 4, l % 4
    for ks in range(4):
        for i in range(4):
            m = wg * 64 + w * 16 + g + 8 * (i & 1)
            kk = ks * 8 + t + 4 * (i >> 1)
            if got[tid, ks, i] != m * 1000 + kk:
                if bad < 5:
                    print("load_a_mn: tid", tid, "ks", ks, "i", i, "got", got[tid, ks, i], "want", m * 1000 + kk)
                bad += 1
print("load_a_mn mismatches:", bad)
