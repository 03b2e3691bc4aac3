"""Engine 5's tile widths and split-K counts against the planner's choice, for the bf16 backward GEMMs
of GPT-2 d12 (the ones furthest from cuBLAS BF16): each configuration validated against the first
one's output, then timed (CUDA events, median), with cuBLAS BF16 (torch) in the same run.

    python dev/sweep_wgmma.py                 # dweight and dinp, B=4 and 16, T=1024
    python dev/sweep_wgmma.py --B 4 --gemm dweight
    python dev/sweep_wgmma.py --gemm fwd dinp --pingpong    # + every ping-pong tile shape and split

dweight += dout^T @ inp runs as (M=OC, N=C) with dout M-major and inp N-major ("mn"), or swapped
(M=C, N=OC, stored transposed: trans_c); dinp = dout @ weight as (M=B*T, N=C) with weight N-major;
fwd = inp @ weight^T as (M=B*T, N=OC), both K-major. --pingpong adds the ping-pong instances
(schedule="pingpong": each consumer warpgroup its own rows x BN tile) of fwd and dinp, every tile shape
and split, plus the planner's ping-pong pick ("pp-plan"), beside the cooperative configurations.
"""
from __future__ import annotations

import argparse

import numpy as np

from bench_gemm import torch_median_ms  # (dev/, the folder of the script, is importable)

LAYERS = {"qkv": (768, 2304), "attproj": (768, 768), "fc": (768, 3072), "fcproj": (3072, 768),
          "lmhead": (768, 50304)}  # name: (C, OC) of the matmul's weight (OC, C)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--gemm", nargs="*", default=["dweight", "dinp"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--pingpong", action="store_true", help="add the ping-pong instances (fwd, dinp)")
    args = ap.parse_args()

    import torch
    from llmc.errors import LLMCError
    from llmc.ops import gemm_wgmma as gw
    from llmc.runtime import Runtime
    rt = Runtime()
    P = lambda t: t.data_ptr()  # noqa: E731

    def med(fn):
        return float(np.median(rt.time_ms(fn, warmup=3, repeat=args.reps)))

    def tmed(fn):
        return torch_median_ms(fn, args.reps, warmup=3)

    for B in args.B:
        N = B * args.T
        for name, (C, OC) in LAYERS.items():
            x = torch.randn(N, C, device="cuda").bfloat16()
            dout = torch.randn(N, OC, device="cuda").bfloat16()
            w = (torch.randn(OC, C, device="cuda") * 0.02).bfloat16()
            for kind in args.gemm:
                if kind == "dweight":
                    dw0 = (torch.randn(OC, C, device="cuda") * 0.01).bfloat16()
                    out = dw0.clone()
                    cublas = tmed(lambda: out.copy_(dw0).addmm_(dout.t(), x))
                    ref = (dw0.double() + dout.double().t() @ x.double())
                    configs = [("mn", bn, s) for bn in (128, 192, 256) for s in (1, 2, 4)] + \
                              [("swap", bn, s) for bn in (128, 192, 256) for s in (1, 2)]
                elif kind == "dinp":
                    out = torch.empty(N, C, device="cuda").bfloat16()
                    cublas = tmed(lambda: torch.matmul(dout, w, out=out))
                    ref = dout.double() @ w.double()
                    configs = [("kn", bn, s) for bn in (128, 192, 256) for s in (1, 2)]
                else:
                    out = torch.empty(N, OC, device="cuda").bfloat16()
                    cublas = tmed(lambda: torch.matmul(x, w.t(), out=out))
                    ref = x.double() @ w.double().t()
                    configs = [("kk", bn, s) for bn in (128, 192, 256) for s in (1, 2)]
                if args.pingpong and kind != "dweight":
                    configs += [("pp-plan", None, None)] + [("pp", sh, s) for sh in gw.PP_SHAPES for s in (1, 2)]
                planned = None
                results = []
                for lay, bn, splits in [("plan", None, None)] + configs:
                    try:
                        if kind == "dweight" and lay in ("mn", "plan"):
                            g = gw.wgmma_build(rt, "bf16", OC, C, N, lda=OC, ldb=C, ldc=C, beta=1.0, a_major="m",
                                               b_major="n", out="bf16", bn=bn, splits=splits)
                            run = lambda g=g: (out.copy_(dw0), g(P(out), P(dout), P(x)))  # noqa: E731
                        elif kind == "dweight":
                            g = gw.wgmma_build(rt, "bf16", C, OC, N, lda=C, ldb=OC, ldc=C, beta=1.0, a_major="m",
                                               b_major="n", out="bf16", bn=bn, splits=splits, trans_c=True)
                            run = lambda g=g: (out.copy_(dw0), g(P(out), P(x), P(dout)))  # noqa: E731
                        else:
                            # the planner's ping-pong pick, or one tile shape (rows, BN) of the ping-pong instances
                            pp = dict(schedule="pingpong", rm=bn[0] if lay == "pp" else None) if lay.startswith("pp") else {}
                            width = bn[1] if lay == "pp" else bn
                            if kind == "dinp":
                                g = gw.wgmma_build(rt, "bf16", N, C, OC, ldb=C, b_major="n", out="bf16", bn=width,
                                                   splits=splits, **pp)
                                run = lambda g=g: g(P(out), P(dout), P(w))  # noqa: E731
                            else:
                                g = gw.wgmma_build(rt, "bf16", N, OC, C, out="bf16", bn=width, splits=splits, **pp)
                                run = lambda g=g: g(P(out), P(x), P(w))  # noqa: E731
                    except LLMCError as e:
                        results.append((lay, bn, splits, None, str(e)[:60]))
                        continue
                    run(); torch.cuda.synchronize()
                    err = float((out.double() - ref).norm() / ref.norm())
                    ms = med(run)
                    if lay == "plan":
                        planned = (g.plan, ms)
                    results.append((lay, bn, splits, ms, f"err {err:.1e} {g.plan}"))
                print(f"B={B:2d} {name:8s} {kind:8s} cuBLAS BF16 {cublas:.4f} ms (dweight: incl. a {OC}x{C} copy) | "
                      f"plan {planned[0]} {planned[1]:.4f} ms ({cublas / planned[1]:.2f}x)")
                best = min((r for r in results if r[3] is not None and r[0] != "plan"), key=lambda r: r[3])
                for lay, bn, splits, ms, note in results[1:]:
                    mark = " <- best" if (lay, bn, splits) == best[:3] else ""
                    print(f"    {lay:7s} bn={bn} splits={splits}: " + (f"{ms:.4f} ms ({cublas / ms:.2f}x) {note}{mark}"
                                                                        if ms is not None else f"refused: {note}"))


if __name__ == "__main__":
    main()
