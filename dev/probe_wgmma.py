"""Engine 5 bring-up probes (cuda/gemm_wgmma.cu), kept because each answered a question the tests
could not: small integer GEMMs (exact, so any wrong element shows), one TMA box copied back out of
128B-swizzled shared memory, and the register layout of wgmma's tf32 A operand.

    PYTHONPATH=. python dev/probe_wgmma.py gemm [small]   # integer GEMMs on engine 5, out vs ref
    PYTHONPATH=. python dev/probe_wgmma.py tma            # one TMA box, unswizzled, equals the source
    PYTHONPATH=. python dev/probe_wgmma.py layout         # which (row, k) each A register holds; load_a_mn
"""
import sys

import numpy as np

from llmc.ops import gemm_wgmma as gw
from llmc.runtime import Runtime

D = {"GEMM_WGMMA_DEBUG": 1}   # the probe kernels are built only with this define


def gemm(rt, small=False):
    rng = np.random.default_rng(0)
    shapes = [(128, 128, 32)] if small else [(128, 128, 32), (128, 128, 8), (1, 1, 8), (256, 256, 64), (1024, 768, 768)]
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


def tma(rt):
    A = np.arange(128 * 32, dtype=np.float32).reshape(128, 32)
    dA = rt.to_device(A)
    dtm = rt.to_device(np.frombuffer(gw.tensor_map(dA.ptr, "tf32t", 128, 32, 32, 128), np.uint8))  # bits copied
    k = rt.kernel("gemm_wgmma", "wgmma_debug_tma", "PPi", defines=D)
    k.set_max_dynamic_smem(16384 + 1024)
    out = rt.empty((128 * 32,), np.float32)
    out.fill_bytes(0xFF)
    k((1, 1, 1), (128, 1, 1), dtm.ptr, out.ptr, np.int32(128), smem=16384 + 1024)
    o = out.get().reshape(128, 32)
    print("TMA box: NaN", int(np.isnan(o).sum()), "row0", o[0, :8], "row1", o[1, :8])
    un = np.empty_like(o)  # unswizzle: 16-byte chunk c of row r sits at chunk c ^ (r % 8)
    for r in range(128):
        for c in range(8):
            un[r, 4 * c:4 * c + 4] = o[r, 4 * (c ^ (r % 8)):4 * (c ^ (r % 8)) + 4]
    print("unswizzled equals A:", np.array_equal(un, A))


def layout(rt):
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


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "gemm"
    rt = Runtime()
    if what == "gemm":
        gemm(rt, small=sys.argv[2:] == ["small"])
    elif what in ("tma", "layout"):
        {"tma": tma, "layout": layout}[what](rt)
    else:
        sys.exit(f"error: probe_wgmma.py: no probe {what!r}; have gemm, tma, layout")
