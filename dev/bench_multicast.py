"""The bf16 dweight GEMMs of GPT-2 d12 with and without 2-CTA clusters (TMA multicast of the shared B
tile: gemm_wgmma's _mc instances), against cuBLAS BF16 (torch's addmm_ into a bf16 gradient, the same
+= semantics), timed in turn within each round.

    python dev/bench_multicast.py                  # B=4 and 16, T=1024, every layer
    python dev/bench_multicast.py --B 4 --layers fc fcproj --rounds 7

Each configuration: dweight (OC, C) += dout^T @ inp, dout and inp as they lie (the "mn" layout), beta = 1,
the TMA store, one K split, at each tile width built (64-192), with multicast off and on where built, the
planner's own pick, and three K splits of 128 x 128 with direct stores. Each timing is --batch calls back to back between CUDA events (no host gap), the
median of --reps; the figure is the median of the --rounds round medians. Every configuration's output
is first checked against float64 (relative Frobenius error).
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

LAYERS = {"qkv": (768, 2304), "attproj": (768, 768), "fc": (768, 3072), "fcproj": (3072, 768),
          "lmhead": (768, 50304)}  # name: (C, OC) of the weight (OC, C)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--layers", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=20)
    args = ap.parse_args()

    import torch
    from llmc.errors import LLMCError
    from llmc.ops import gemm_wgmma as gw
    from llmc.runtime import Runtime
    rt = Runtime()
    print(f"{rt.name}, {rt.sm_count} SMs; batch {args.batch}, {args.reps} reps, {args.rounds} rounds")
    P = lambda t: t.data_ptr()  # noqa: E731
    rows = []
    for B in args.B:
        N = B * args.T
        for layer in args.layers:
            C, OC = LAYERS[layer]
            x = torch.randn(N, C, device="cuda").bfloat16()
            dout = torch.randn(N, OC, device="cuda").bfloat16()
            dw0 = (torch.randn(OC, C, device="cuda") * 0.01).bfloat16()
            ref = dw0.double() + dout.double().t() @ x.double()
            out = dw0.clone()
            fns = {"cublas": lambda: out.addmm_(dout.t(), x)}
            notes = {}
            ts_widths = sorted(gw.INSTANCES[("bf16", "bf16", "mn", True)])
            mc_widths = sorted(gw.MC_INSTANCES[("bf16", "bf16", "mn")])
            configs = [("plan", None, None)] + [(f"{bn}{'+mc' if mc else ''}", bn, mc) for bn in ts_widths
                                                for mc in (False, True) if not mc or bn in mc_widths]
            configs += [("128/3", 128, "split")]  # three K splits, direct stores (attproj's plan at B=16)
            for key, bn, mc in configs:
                try:
                    kw = (dict(bn=bn, store="direct", splits=3) if mc == "split" else
                          dict(bn=bn, store="tma", splits=1, multicast=mc) if bn else {})
                    g = gw.wgmma_build(rt, "bf16", OC, C, N, lda=OC, ldb=C, ldc=C, beta=1.0, a_major="m",
                                       b_major="n", out="bf16", beside=False, **kw)
                except LLMCError as e:
                    notes[key] = f"refused: {e}"
                    continue
                out.copy_(dw0)
                g(P(out), P(dout), P(x))
                torch.cuda.synchronize()
                err = float((out.double() - ref).norm() / (ref - dw0.double()).norm())
                notes[key] = f"{g.plan[1]} x{g.plan[2]} err {err:.1e}"
                fns[key] = (lambda g=g: g(P(out), P(dout), P(x)))
            per = {k: [] for k in fns}
            for _ in range(args.rounds):
                for k, fn in fns.items():
                    for _ in range(3):
                        fn()
                    ts = []
                    for _ in range(args.reps):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        for _ in range(args.batch):
                            fn()
                        e.record(); e.synchronize()
                        ts.append(s.elapsed_time(e) / args.batch)
                    per[k].append(float(np.median(ts)))
            med = {k: float(np.median(v)) for k, v in per.items()}
            cub = med["cublas"]
            print(f"B={B:2d} {layer:8s} dweight {OC}x{C}x{N}: cuBLAS BF16 {cub:.4f} ms")
            for k in fns:
                if k == "cublas":
                    continue
                print(f"    {k:8s} {med[k]:.4f} ms ({cub / med[k]:.2f}x)  rounds {' '.join(f'{t:.4f}' for t in per[k])}"
                      f"  {notes[k]}")
                rows.append(dict(B=B, layer=layer, config=k, ms=med[k], cublas_ms=cub, note=notes[k]))
            for k, n in notes.items():
                if n.startswith("refused"):
                    print(f"    {k:8s} {n}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_multicast.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
