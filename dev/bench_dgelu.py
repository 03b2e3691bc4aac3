"""The fcproj layer's backward with GELU's, fused and not: what the dgelu epilogue costs and saves.

    python dev/bench_dgelu.py              # B=4 and 16, T=1024, TF32 and BF16

At d12's fcproj dinp shape (M = B*T, N = 4C = 3072, K = C = 768), timed in one run (CUDA events,
median of --reps after warm-up, inputs random):
  gemm            dinp's GEMM alone (engine 5, TMA store, the tile width the dgelu build takes)
  pair            that GEMM, then gelu_backward's fused colsum form (what the model runs unfused: in
                  place, fc's bias gradient as column sums)
  dgelu           the dgelu instance without column sums
  dgelu+colsum    the dgelu instance with them, and the finishing kernel (what the model runs fused)
bf16 also:
  pair rc         the GEMM, then gelu_backward's recompute form (colsum + gout = gelu(fch)): what the default
                  -r 1 step runs in fcproj's backward before its dweight GEMM (the dgelu form applies to -r 0
                  only: with -r >= 1 the recompute form takes its place)
The memory floor of the pair's gelu_backward: it reads d fch and fch and writes d fch (3 x M x N
elements); the fused form reads fch once more inside the GEMM and writes nothing extra.
"""
import argparse
import statistics

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    from llmc import ops
    from llmc.bf16 import BF16
    from llmc.ops.gemm_wgmma import wgmma_build
    from llmc.runtime import Runtime
    rt = Runtime()
    print(f"device: {rt.name}")
    N, K = 3072, 768
    for B in args.B:
        M = B * 1024
        for dtype in ("tf32", "bf16"):
            bf = dtype == "bf16"
            et = BF16 if bf else np.float32
            rng = np.random.default_rng(0)
            A = rt.to_device(rng.standard_normal((M, K)).astype(np.float32).astype(et) if not bf else
                             _bf(rng.standard_normal((M, K))))
            W = rt.to_device(_bf(rng.standard_normal((K, N)) * 0.03) if bf else
                             (rng.standard_normal((N, K)) * 0.03).astype(np.float32))
            P = rt.to_device(_bf(rng.standard_normal((M, N))) if bf else rng.standard_normal((M, N)).astype(np.float32))
            C = rt.empty((M, N), et)
            dbias = rt.to_device(_bf(np.zeros(N)) if bf else np.zeros(N, np.float32))
            kw = dict(b_major="n", out="bf16", ldb=N) if bf else {}
            fused = wgmma_build(rt, dtype, M, N, K, dgelu=True, colsum=True, **kw)
            bn = int(fused.plan[1].split("x")[1].split("+")[0])
            plain = wgmma_build(rt, dtype, M, N, K, store="tma", bn=bn, **kw)
            gb = ops.get("gelu_backward").build(rt, 2, "bf16" if bf else "fp32", N=M * N, OC=N, colsum=True)
            rows = {
                "gemm": (lambda: plain(C, A, W), plain),
                "pair": (lambda: (plain(C, A, W), gb(C, dbias, P, C)), plain),
                "dgelu": (lambda: fused(C, A, W, P), fused),
                "dgelu+colsum": (lambda: fused(C, A, W, P, dbias), fused),
            }
            if bf:
                G = rt.empty((M, N), et)
                rc = ops.get("gelu_backward").build(rt, 2, "bf16", N=M * N, OC=N, colsum=True, recompute=True)
                rows["pair rc"] = (lambda: (plain(C, A, W), rc(C, dbias, G, P, C)), plain)
            flops = 2 * M * N * K
            base = None
            for name, (fn, built) in rows.items():
                ms = statistics.median(rt.time_ms(fn, warmup=5, repeat=args.reps))
                base = base or ms
                print(f"B={B:2d} {dtype}  {name:18s} {ms:8.4f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
                      f"(+{ms - base:.4f} ms over the GEMM)  plan {built.plan[1]}")
            esz = 2 if bf else 4
            print(f"B={B:2d} {dtype}  gelu_backward's floor: {3 * M * N * esz / 2.98e12 * 1e3:.4f} ms at 2.98 TB/s")


def _bf(x):
    from llmc.bf16 import to_bf16
    return to_bf16(np.asarray(x, np.float32))


if __name__ == "__main__":
    main()
