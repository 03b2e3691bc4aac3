"""Every GEMM of a GPT-2 d12 training step, on each of our engines and on cuBLAS (through torch),
timed in one run: TFLOP/s and the ratio to cuBLAS at the same precision.

    python dev/bench_gemm.py                 # B=4 and B=16, T=1024; writes $OUT/bench_gemm.json if OUT is set
    python dev/bench_gemm.py --B 4 --reps 50
    python dev/bench_gemm.py --pingpong      # + the ping-pong instances (forward and dinp, TF32 and BF16)
    python dev/bench_gemm.py --batch 20      # each timing: 20 calls back to back (no host gap in the figure)
    python dev/bench_gemm.py --plot docs/results/bench_gemm_h200_session29.json docs/lab/gemm_wgmma.png "H200, 20 calls back to back"   # chart, no GPU

Shapes (row-major, N = B*T tokens): forward out(N,OC) = inp(N,C) @ W(OC,C)^T; dinp(N,C) = dout(N,OC) @ W;
dweight(OC,C) = dout^T @ inp, for qkv, attproj, fc, fcproj and the lm head. Engine 5 (wgmma) takes only
K-major operands in TF32, so its dinp row includes transposing W and its dweight row transposing dout
and inp (the times of those transposes are also shown on their own).
CUDA events around each call, median of --reps after warm-up; inputs random. --batch N puts N calls back
to back between the events instead (the figure divided by N): one call alone includes the host's launch
gap (a few us: our PyCUDA launches and torch's dispatch alike), which is a large part of a 0.02-0.05 ms
GEMM and flatters whichever side is slower on the GPU; in the trainer the graph launches them back to back.

BF16 (the bf16 trainer's GEMMs, issue 13): every GEMM also runs bf16 in and bf16 out on engine 5, as
matmul_forward 9 / matmul_backward 5 build it (dinp and dweight read dout, W and inp as they lie: the
bf16 wgmma transposes in shared memory), against cuBLAS BF16 through torch with preallocated bf16
outputs (dweight: addmm_ into a bf16 gradient, the same += semantics), the two timed in turn (5
rounds, the median of the round medians: see paired). Issue 12's target: engine 5 >= 0.9 of cuBLAS
BF16 on every shape; the "bf16" line of each GEMM prints the ratio.

--pingpong: the forward and dinp GEMMs also run on the ping-pong instances (wgmma_build(...,
schedule="pingpong"): each consumer warpgroup its own tile, one's epilogue under the other's
mainloop), TF32 (dinp incl. the weight transpose, as the engine 5 row) and BF16 in/out, printed on a
"ping-pong" line beside cuBLAS and the default plan of the same run (the engine 5 row: itself ping-pong
where the defaults take it), with the relative difference from the cooperative output (0 or ~1e-7: the
same products in the same order). A "tf32 in turn" line then times cuBLAS TF32, the cooperative plan
(schedule="coop") and ping-pong in turn (GEMMs only): the comparison the tf32 default rests on.
"""
import argparse
import json
import os

import numpy as np

LAYERS = {"qkv": (768, 2304), "attproj": (768, 768), "fc": (768, 3072), "fcproj": (3072, 768), "lmhead": (768, 50304)}


def plot(json_path, png_path, label="H100"):
    """Bar charts of TFLOP/s per GEMM, one row of panels per batch size: TF32 (cuBLAS TF32, engine 4, engine 5)
    and, where the run has them, BF16 (cuBLAS BF16 and engine 5, timed in turn); engine 5's ratio to cuBLAS
    written over its bar. label: the machine (and run) the JSON came from, for the titles."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = json.load(open(json_path))
    Bs = sorted({r["B"] for r in rows})
    has_bf16 = all("tflops_bf16_engine5" in r and "tflops_bf16_cublas" in r for r in rows)
    cols = 2 if has_bf16 else 1
    fig, axes = plt.subplots(len(Bs), cols, figsize=(13 * cols, 4.2 * len(Bs)), squeeze=False)
    panels = [("TF32", [("cublas_tf32", "cuBLAS TF32 (torch)"), ("engine4", "engine 4 (mma.sync)"),
                        ("engine5_tf32", "engine 5 (wgmma + TMA)")], "cublas_tf32", "engine5_tf32")]
    if has_bf16:
        panels.append(("BF16 in and out, timed in turn", [("bf16_cublas", "cuBLAS BF16 (torch)"),
                                                           ("bf16_engine5", "engine 5 (wgmma + TMA)")],
                       "bf16_cublas", "bf16_engine5"))
    for row, B in enumerate(Bs):
        rs = [r for r in rows if r["B"] == B]
        x = np.arange(len(rs))
        for col, (what, bars, ref, ours) in enumerate(panels):
            ax = axes[row, col]
            w = 0.8 / len(bars)
            for i, (key, name) in enumerate(bars):
                ax.bar(x + (i - (len(bars) - 1) / 2) * w, [r["tflops_" + key] for r in rs], w, label=name)
            for xi, r in zip(x, rs):
                ax.text(xi + (len(bars) - 1) / 2 * w, r["tflops_" + ours] + 4, f"{r[ref] / r[ours]:.2f}x",
                        ha="center", fontsize=7)
            ax.set_xticks(x, [f"{r['layer']}\n{r['gemm']}" for r in rs], fontsize=8)
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"GPT-2 d12 GEMMs, B={B}, T=1024, {what} ({label}; over engine 5's bar: its speed relative "
                         f"to cuBLAS)", fontsize=9)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def torch_median_ms(fn, reps: int, warmup: int = 5, batch: int = 1) -> float:
    """Median ms of fn() (torch work on torch's stream) over reps, by CUDA events, after warm-up; with
    batch > 1 each rep is `batch` calls back to back between the events, divided by batch."""
    import torch
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(batch):
            fn()
        e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / batch)
    return float(np.median(ts))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", nargs="+", metavar="JSON PNG [LABEL]",
                    help="chart a saved run instead of measuring (LABEL: the machine, for the titles)")
    ap.add_argument("--B", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pingpong", action="store_true", help="also time the ping-pong instances (forward, dinp)")
    ap.add_argument("--batch", type=int, default=1,
                    help="calls back to back between each timing's two events (time / batch): 1 times each call "
                         "alone, its host launch gap included; 20 keeps the GPU's queue ahead, as a CUDA graph does")
    args = ap.parse_args()
    if args.plot:
        if len(args.plot) not in (2, 3):
            ap.error("--plot takes JSON PNG [LABEL]")
        return plot(*args.plot)

    import torch
    from llmc.runtime import Runtime
    from llmc.ops import gemm_wgmma as gw
    from llmc.ops.matmul import gemm_build
    rt = Runtime()
    torch.backends.cuda.matmul.allow_tf32 = True
    rng = np.random.default_rng(0)

    if args.batch < 1:
        raise SystemExit(f"bench_gemm: --batch {args.batch}: expected at least 1")
    nb = args.batch
    print(f"bench_gemm: each timing is {'one call' if nb == 1 else f'{nb} calls back to back (per call shown)'}", flush=True)

    def rep(fn):  # (ours: `batch` calls between rt.time_ms's events)
        if nb == 1:
            return fn
        return lambda: [fn() for _ in range(nb)]

    def ours_ms(fn, warmup, n):
        return float(np.median(rt.time_ms(rep(fn), warmup=warmup, repeat=n))) / nb

    def med(fn):
        return ours_ms(fn, 5, args.reps)

    def tmed(fn):
        return torch_median_ms(fn, args.reps, batch=nb)

    def paired(torch_fn, ours_fn, rounds=5):
        """(cuBLAS ms, engine 5 ms): the two timed in turn, `rounds` rounds of reps / rounds calls each,
        the median of each side's round medians. A long GEMM moves the chip's clocks and power state
        (the lm head at B=16: cuBLAS measured 1.80 to 2.13 ms in separate runs), so the two sides of a
        ratio are measured interleaved rather than one after the other."""
        n = max(3, args.reps // rounds)
        a, b = [], []
        for _ in range(rounds):
            a.append(torch_median_ms(torch_fn, n, warmup=2, batch=nb))
            b.append(ours_ms(ours_fn, 2, n))
        return float(np.median(a)), float(np.median(b))

    def turns(torch_fn, ours, rounds=5):
        """[cuBLAS ms, then each of ours]: torch_fn and the functions in ours timed in turn (CUDA events
        on each one's own stream), `rounds` rounds of max(3, reps / rounds) calls: the medians of the
        round medians (as paired, for more than one of ours)."""
        n = max(3, args.reps // rounds)
        got = [[] for _ in range(1 + len(ours))]
        for _ in range(rounds):
            got[0].append(torch_median_ms(torch_fn, n, warmup=2, batch=nb))
            for i, fn in enumerate(ours):
                got[1 + i].append(ours_ms(fn, 2, n))
        return [float(np.median(g)) for g in got]

    rows = []
    for B in args.B:
        Ntok = B * args.T
        for name, (C, OC) in LAYERS.items():
            x = torch.randn(Ntok, C, device="cuda")
            w = torch.randn(OC, C, device="cuda") * 0.02
            dout = torch.randn(Ntok, OC, device="cuda")
            y = torch.empty(Ntok, OC, device="cuda")
            dx = torch.empty(Ntok, C, device="cuda")
            dw = torch.zeros(OC, C, device="cuda")
            xb, wb, doutb = x.bfloat16(), w.bfloat16(), dout.bfloat16()
            wt = w.t().contiguous()
            doutT, xT = dout.t().contiguous(), x.t().contiguous()
            P = lambda t: t.data_ptr()  # noqa: E731
            flops = 2.0 * Ntok * C * OC
            yb16, dxb16 = torch.empty(Ntok, OC, device="cuda", dtype=torch.bfloat16), torch.empty(Ntok, C, device="cuda", dtype=torch.bfloat16)
            dwb16 = (torch.randn(OC, C, device="cuda") * 0.01).bfloat16()

            def pingpong_rows(r, kind):
                """r["pp_tf32"], r["pp_bf16"]: the ping-pong instances on this GEMM (the cooperative rows
                are already in r), and their relative difference from the cooperative output."""
                def diff(run_pp, run_co, out):
                    run_pp(); torch.cuda.synchronize()
                    a = out.float().clone()
                    run_co(); torch.cuda.synchronize()
                    b = out.float()
                    return float((a - b).norm() / b.norm())
                if kind == "fwd":
                    gp = gw.wgmma_build(rt, "tf32", Ntok, OC, C, schedule="pingpong")
                    gc = gw.wgmma_build(rt, "tf32", Ntok, OC, C, schedule="coop")
                    run_p, run_c, o = (lambda: gp(P(y), P(x), P(w))), (lambda: gc(P(y), P(x), P(w))), y
                    gpb = gw.wgmma_build(rt, "bf16", Ntok, OC, C, out="bf16", schedule="pingpong")
                    gcb = gw.wgmma_build(rt, "bf16", Ntok, OC, C, out="bf16")
                    run_pb, run_cb, ob = (lambda: gpb(P(yb16), P(xb), P(wb))), (lambda: gcb(P(yb16), P(xb), P(wb))), yb16
                    extra = 0.0
                else:  # wt (the transposed weight) was written by the cooperative row's transpose
                    gp = gw.wgmma_build(rt, "tf32", Ntok, C, OC, schedule="pingpong")
                    gc = gw.wgmma_build(rt, "tf32", Ntok, C, OC, schedule="coop")
                    run_p, run_c, o = (lambda: gp(P(dx), P(dout), P(wt))), (lambda: gc(P(dx), P(dout), P(wt))), dx
                    gpb = gw.wgmma_build(rt, "bf16", Ntok, C, OC, ldb=C, b_major="n", out="bf16", schedule="pingpong")
                    gcb = gw.wgmma_build(rt, "bf16", Ntok, C, OC, ldb=C, b_major="n", out="bf16")
                    run_pb, run_cb, ob = (lambda: gpb(P(dxb16), P(doutb), P(wb))), (lambda: gcb(P(dxb16), P(doutb), P(wb))), dxb16
                    extra = r["transpose"]
                r["pp_tf32"] = med(run_p) + extra
                # tf32: cuBLAS, the cooperative plan and ping-pong timed in turn (GEMMs only, no transpose)
                ctf = (lambda: torch.matmul(x, w.t(), out=y)) if kind == "fwd" else (lambda: torch.matmul(dout, w, out=dx))
                r["turns_pp_tf32"] = turns(ctf, [run_c, run_p])
                r["pp_bf16"] = med(run_pb)
                r["plan_pp_tf32"], r["plan_pp_bf16"] = gp.plan, gpb.plan
                # every tile shape, for the planner's constants (PP_EFF are assumptions until this runs)
                for dt, key in (("tf32", "pp_shapes_tf32"), ("bf16", "pp_shapes_bf16")):
                    r[key] = {}
                    for rows_, bn_ in gw.PP_SHAPES:
                        if kind == "fwd":
                            gs = gw.wgmma_build(rt, dt, Ntok, OC, C, out="bf16" if dt == "bf16" else "fp32",
                                                schedule="pingpong", rm=rows_, bn=bn_, splits=1)
                            args_ = (P(yb16), P(xb), P(wb)) if dt == "bf16" else (P(y), P(x), P(w))
                        else:
                            gs = gw.wgmma_build(rt, dt, Ntok, C, OC, ldb=C if dt == "bf16" else None,
                                                b_major="n" if dt == "bf16" else "k", out="bf16" if dt == "bf16" else "fp32",
                                                schedule="pingpong", rm=rows_, bn=bn_, splits=1)
                            args_ = (P(dxb16), P(doutb), P(wb)) if dt == "bf16" else (P(dx), P(dout), P(wt))
                        r[key][f"{rows_}x{bn_}"] = med(lambda: gs(*args_))
                r["pp_diff_tf32"] = diff(run_p, run_c, o)
                r["pp_diff_bf16"] = diff(run_pb, run_cb, ob)

            for kind in ("fwd", "dinp", "dweight"):
                r = {"B": B, "layer": name, "gemm": kind}
                # bf16 in and out, as the bf16 trainer runs it (engine 5's bf16 epilogue)
                if kind == "fwd":
                    gb16 = gw.wgmma_build(rt, "bf16", Ntok, OC, C, out="bf16")
                    r["bf16_cublas"], r["bf16_engine5"] = paired(lambda: torch.matmul(xb, wb.t(), out=yb16),
                                                                 lambda: gb16(P(yb16), P(xb), P(wb)))
                    gb16(P(yb16), P(xb), P(wb)); torch.cuda.synchronize()
                    ref16 = xb.double() @ wb.double().t()
                    r["bf16_err"] = float((yb16.double() - ref16).norm() / ref16.norm())
                elif kind == "dinp":
                    gb16 = gw.wgmma_build(rt, "bf16", Ntok, C, OC, ldb=C, b_major="n", out="bf16")
                    r["bf16_cublas"], r["bf16_engine5"] = paired(lambda: torch.matmul(doutb, wb, out=dxb16),
                                                                 lambda: gb16(P(dxb16), P(doutb), P(wb)))
                    gb16(P(dxb16), P(doutb), P(wb)); torch.cuda.synchronize()
                    ref16 = doutb.double() @ wb.double()
                    r["bf16_err"] = float((dxb16.double() - ref16).norm() / ref16.norm())
                else:
                    gb16 = gw.wgmma_build(rt, "bf16", OC, C, Ntok, lda=OC, ldb=C, ldc=C, beta=1.0, a_major="m",
                                          b_major="n", out="bf16")
                    r["bf16_cublas"], r["bf16_engine5"] = paired(lambda: dwb16.addmm_(doutb.t(), xb),
                                                                 lambda: gb16(P(dwb16), P(doutb), P(xb)))
                    dw0 = dwb16.double()
                    gb16(P(dwb16), P(doutb), P(xb)); torch.cuda.synchronize()
                    ref16 = dw0 + doutb.double().t() @ xb.double()
                    r["bf16_err"] = float((dwb16.double() - ref16).norm() / ref16.norm())
                r["bf16_plan"] = gb16.plan
                del ref16  # (the lm head's float64 reference is 1.6-6.6 GB)
                if kind == "fwd":
                    r["cublas_tf32"] = tmed(lambda: torch.matmul(x, w.t(), out=y))
                    r["cublas_bf16"] = tmed(lambda: torch.matmul(xb, wb.t()))
                    e4 = gemm_build(rt, 4, False, True, M=Ntok, N=OC, K=C)
                    r["engine4"] = med(lambda: e4(P(y), P(x), P(w)))
                    g = gw.wgmma_build(rt, "tf32", Ntok, OC, C)
                    r["engine5_tf32"] = med(lambda: g(P(y), P(x), P(w)))
                    r["plan_tf32"] = g.plan
                    gd = gw.wgmma_build(rt, "tf32", Ntok, OC, C, store="direct")
                    r["engine5_direct"] = med(lambda: gd(P(y), P(x), P(w)))
                    r["plan_direct"] = gd.plan
                    gb = gw.wgmma_build(rt, "bf16", Ntok, OC, C)
                    yb = torch.empty(Ntok, OC, device="cuda")
                    r["engine5_bf16"] = med(lambda: gb(P(yb), P(xb), P(wb)))
                    r["plan_bf16"] = gb.plan
                    # correctness spot check against cuBLAS at the same precision
                    g(P(y), P(x), P(w)); torch.cuda.synchronize()
                    ref = x.double() @ w.double().t()
                    r["err_tf32"] = float((y.double() - ref).norm() / ref.norm())
                    gr = gw.wgmma_build(rt, "tf32t", Ntok, OC, C)   # FLOAT32 tensor maps: truncation
                    r["engine5_tf32t"] = med(lambda: gr(P(y), P(x), P(w)))
                    gr(P(y), P(x), P(w)); torch.cuda.synchronize()
                    r["err_tf32t"] = float((y.double() - ref).norm() / ref.norm())
                    e4(P(y), P(x), P(w)); torch.cuda.synchronize()
                    r["err_engine4"] = float((y.double() - ref).norm() / ref.norm())
                    gb(P(yb), P(xb), P(wb)); torch.cuda.synchronize()
                    refb = xb.double() @ wb.double().t()
                    r["err_bf16"] = float((yb.double() - refb).norm() / refb.norm())
                elif kind == "dinp":
                    r["cublas_tf32"] = tmed(lambda: torch.matmul(dout, w, out=dx))
                    r["cublas_bf16"] = tmed(lambda: torch.matmul(doutb, wb))
                    e4 = gemm_build(rt, 4, False, False, M=Ntok, N=C, K=OC)
                    r["engine4"] = med(lambda: e4(P(dx), P(dout), P(w)))
                    g = gw.wgmma_build(rt, "tf32", Ntok, C, OC)
                    tr = gw.transpose_build(rt, OC, C)
                    r["transpose"] = med(lambda: tr(P(wt), P(w)))
                    r["engine5_tf32_gemm"] = med(lambda: g(P(dx), P(dout), P(wt)))
                    r["engine5_tf32"] = r["engine5_tf32_gemm"] + r["transpose"]
                    r["plan_tf32"] = g.plan
                    gd = gw.wgmma_build(rt, "tf32", Ntok, C, OC, store="direct")
                    r["engine5_direct"] = med(lambda: gd(P(dx), P(dout), P(wt))) + r["transpose"]
                    r["plan_direct"] = gd.plan
                else:
                    r["cublas_tf32"] = tmed(lambda: torch.matmul(dout.t(), x, out=dw))
                    r["cublas_bf16"] = tmed(lambda: torch.matmul(doutb.t(), xb))
                    e4 = gemm_build(rt, 4, True, False, M=OC, N=C, K=Ntok, beta=1.0)
                    r["engine4"] = med(lambda: e4(P(dw), P(dout), P(x)))
                    g = gw.wgmma_build(rt, "tf32", OC, C, Ntok, beta=1.0)
                    t1, t2 = gw.transpose_build(rt, Ntok, OC), gw.transpose_build(rt, Ntok, C)
                    r["transpose"] = med(lambda: (t1(P(doutT), P(dout)), t2(P(xT), P(x))))
                    r["engine5_tf32_gemm"] = med(lambda: g(P(dw), P(doutT), P(xT)))
                    r["plan_tf32_kk"] = g.plan
                    # what the trainer runs (matmul_backward 5): the wider operand M-major through
                    # registers, the narrower one transposed (N x min(C, OC))
                    if OC >= C:
                        gm = gw.wgmma_build(rt, "tf32", OC, C, Ntok, lda=OC, beta=1.0, a_major="m")
                        r["transpose_narrow"] = med(lambda: t2(P(xT), P(x)))
                        r["engine5_tf32"] = med(lambda: gm(P(dw), P(dout), P(xT))) + r["transpose_narrow"]
                    else:
                        gm = gw.wgmma_build(rt, "tf32", C, OC, Ntok, lda=C, ldc=C, beta=1.0, a_major="m", trans_c=True)
                        r["transpose_narrow"] = med(lambda: t1(P(doutT), P(dout)))
                        r["engine5_tf32"] = med(lambda: gm(P(dw), P(x), P(doutT))) + r["transpose_narrow"]
                    r["plan_tf32"] = gm.plan
                if args.pingpong and kind != "dweight":
                    pingpong_rows(r, kind)
                for key in list(r):
                    if key.startswith(("cublas", "engine", "bf16_cublas", "bf16_engine", "pp_tf32", "pp_bf16")) and not key.endswith("_gemm"):
                        r["tflops_" + key] = flops / r[key] / 1e9
                rows.append(r)
                line = (f"B={B:2d} {name:8s} {kind:7s} cuBLAS tf32 {r['cublas_tf32']:.3f} ms "
                        f"| e4 {r['engine4']:.3f} | e5 tf32 {r['engine5_tf32']:.3f} "
                        f"({r['cublas_tf32'] / r['engine5_tf32']:.2f}x of cuBLAS) {r['plan_tf32']}")
                if "engine5_bf16" in r:
                    line += (f" | bf16 cuBLAS {r['cublas_bf16']:.3f} e5 {r['engine5_bf16']:.3f} "
                             f"({r['cublas_bf16'] / r['engine5_bf16']:.2f}x) err tf32 {r['err_tf32']:.1e} tf32t {r['err_tf32t']:.1e} ({r['engine5_tf32t']:.3f} ms) "
                             f"e4 {r['err_engine4']:.1e} bf16 {r['err_bf16']:.1e}")
                if "engine5_direct" in r:
                    line += f" | direct stores {r['engine5_direct']:.3f} {r['plan_direct']}"
                if "transpose" in r:
                    line += f" | transposes {r['transpose']:.3f}"
                if "transpose_narrow" in r:
                    line += (f" | both K-major (after both transposes) {r['engine5_tf32_gemm']:.3f} {r['plan_tf32_kk']}, "
                             f"narrow transpose {r['transpose_narrow']:.3f}")
                print(line, flush=True)
                if "pp_tf32" in r:
                    print(f"B={B:2d} {name:8s} {kind:7s} ping-pong: tf32 {r['pp_tf32']:.3f} ms "
                          f"({r['cublas_tf32'] / r['pp_tf32']:.2f}x of cuBLAS, {r['engine5_tf32'] / r['pp_tf32']:.2f}x of "
                          f"the default plan) {r['plan_pp_tf32']} | bf16 {r['pp_bf16']:.3f} ms ({r['bf16_cublas'] / r['pp_bf16']:.2f}x "
                          f"of cuBLAS BF16, {r['bf16_engine5'] / r['pp_bf16']:.2f}x of the default plan) {r['plan_pp_bf16']} | "
                          f"differs from cooperative by tf32 {r['pp_diff_tf32']:.1e} bf16 {r['pp_diff_bf16']:.1e}", flush=True)
                    cb, co, pp = r["turns_pp_tf32"]
                    print(f"B={B:2d} {name:8s} {kind:7s} tf32 in turn (GEMM only): cuBLAS {cb:.4f} ms | cooperative "
                          f"{co:.4f} ({cb / co:.2f}x) | ping-pong {pp:.4f} ({cb / pp:.2f}x) {r['plan_pp_tf32']}", flush=True)
                    print(f"B={B:2d} {name:8s} {kind:7s} ping-pong tile shapes (GEMM only, ms): tf32 " +
                          " ".join(f"{k} {v:.3f}" for k, v in r["pp_shapes_tf32"].items()) + " | bf16 " +
                          " ".join(f"{k} {v:.3f}" for k, v in r["pp_shapes_bf16"].items()), flush=True)
                print(f"B={B:2d} {name:8s} {kind:7s} bf16: cuBLAS BF16 {r['bf16_cublas']:.3f} ms | e5 bf16 "
                      f"{r['bf16_engine5']:.3f} ms {r['tflops_bf16_engine5']:.0f} TFLOP/s = "
                      f"{r['bf16_cublas'] / r['bf16_engine5']:.2f}x of cuBLAS (target >= 0.9) {r['bf16_plan']} "
                      f"err {r['bf16_err']:.1e}", flush=True)
            del x, w, dout, y, dx, dw, xb, wb, doutb, wt, doutT, xT, yb16, dxb16, dwb16
            torch.cuda.empty_cache()
    # totals per step (12 layers + lm head) for each engine
    for B in args.B:
        worst = min((r["bf16_cublas"] / r["bf16_engine5"], r["layer"], r["gemm"]) for r in rows if r["B"] == B)
        print(f"B={B} bf16: worst engine 5 / cuBLAS BF16 ratio {worst[0]:.2f} ({worst[1]} {worst[2]}; target >= 0.9)")
        if args.pingpong:  # the step's matmuls with forward and dinp on ping-pong (dweight cooperative)
            for pp, co in (("pp_tf32", "engine5_tf32"), ("pp_bf16", "bf16_engine5")):
                tot = sum(r.get(pp, r[co]) * (1 if r["layer"] == "lmhead" else 12) for r in rows if r["B"] == B)
                print(f"B={B} step total of matmuls, {pp} (forward and dinp ping-pong, dweight cooperative): {tot:.2f} ms")
        for key in ("cublas_tf32", "engine4", "engine5_tf32", "cublas_bf16", "bf16_cublas", "bf16_engine5"):
            tot = sum(r.get(key, 0.0) * (1 if r["layer"] == "lmhead" else 12) for r in rows if r["B"] == B)
            print(f"B={B} step total of matmuls, {key}: {tot:.2f} ms (cuBLAS bf16 has no dinp/dweight split rows: "
                  f"all three GEMM kinds timed)" if key == "cublas_bf16" else f"B={B} step total of matmuls, {key}: {tot:.2f} ms")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_gemm.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
