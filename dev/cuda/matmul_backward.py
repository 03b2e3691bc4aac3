"""Kernel lab: matmul_backward (dinp = dout @ weight, dweight += dout^T @ inp). The bias gradient has
its own script, dev/cuda/matmul_backward_bias.py.

    python dev/cuda/matmul_backward.py            # every variant at the trainer's shapes, + cuBLAS TF32
    python dev/cuda/matmul_backward.py 2          # one variant
    python dev/cuda/matmul_backward.py 2 3        # GEMM engines 2 and 4 side by side
    python dev/cuda/matmul_backward.py --quick    # fewer repeats, no per-GEMM config sweep

Shapes: GPT-2 124M at B=4, T=1024 (N = 4096 rows), per linear layer (C -> OC): qkv 768->2304,
attproj 768->768, fc 768->3072, fcproj 3072->768, lm head 768->50304. matmul_backward does
4*N*C*OC flops (two GEMMs): dinp (N,C) = dout (N,OC) @ weight (OC,C) [nn, K=OC] and
dweight (OC,C) += dout^T @ inp [tn, K=N=4096, accumulate]. The TF32 variants (2: engine 2, 3: engine
4) are also broken down into their two GEMMs, each swept over the engine's tile configs (and split-K
for dweight).
bf16: the variants with a bf16 build (5: engine 5, every operand read as it lies) run bf16 in and out
at the same shapes beside cuBLAS BF16 through torch (dinp = mm, dweight = addmm_ into a bf16
gradient), whole and per GEMM; the summary's "bf16" rows give the fraction of cuBLAS BF16.
"""
import lab  # noqa: E402

import numpy as np  # noqa: E402

import llmc.ops  # noqa: E402
from llmc.ops import gemm as mm  # noqa: E402 (the GEMM engines)

L = lab.Lab("matmul_backward")
rt = L.rt
spec = llmc.ops.get("matmul_backward")
B, T, C, Vp = 4, 1024, 768, 50304
N = B * T
rng = np.random.default_rng(0)
TF32 = {n: v.engine for n, v in spec.variants.items() if v.engine != 1}  # TF32 variant -> the engine it declares

try:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    HAVE_TORCH = torch.cuda.is_available()
except ImportError:
    HAVE_TORCH = False


def reference64(fn, *arrays):
    if HAVE_TORCH:
        out = fn(*(torch.from_numpy(a).cuda().double() for a in arrays))
        return tuple(o.cpu().numpy() for o in out)
    return fn(*(a.astype(np.float64) for a in arrays))


def tolerances(tf32, ref):
    rms = float(np.sqrt(np.mean(np.square(ref))))
    return (1e-2 * rms, 1e-2) if tf32 else (1e-4 * max(1.0, rms), 1e-4)


summary = []
SHAPES = [("qkv", C, 3 * C), ("attproj", C, C), ("fc", C, 4 * C), ("fcproj", 4 * C, C), ("lmhead", C, Vp)]
for name, Cin, OC in SHAPES:
    L.section(name)
    print(f"\n## {name}: N={N} C={Cin} OC={OC}")
    dout, inp = lab.rand(rng, (N, OC)), lab.rand(rng, (N, Cin))
    weight, dw0 = lab.rand(rng, (OC, Cin), scale=OC ** -0.5), lab.rand(rng, (OC, Cin))
    dinp_ref, dw_ref = reference64(lambda d, x, w, w0: (d @ w, w0 + d.T @ x), dout, inp, weight, dw0)
    d_dout, d_inp, d_w = rt.to_device(dout), rt.to_device(inp), rt.to_device(weight)
    d_dinp, d_dw = rt.empty((N, Cin)), rt.to_device(dw0)
    flops = 4 * N * Cin * OC
    for n in L.selected(spec):
        built = spec.build(rt, n, N=N, C=Cin, OC=OC)
        launch, plan = built.launch, built.plan  # time the bare closure
        fn = (lambda launch=launch: launch(d_dinp, d_dw, d_dout, d_inp, d_w))
        label = f"{n} {name}"
        a1, r1 = tolerances(n in TF32, dinp_ref)
        a2, r2 = tolerances(n in TF32, dw_ref)
        L.validate(label, fn, outputs={"dinp": d_dinp, "dweight": d_dw}, refs={"dinp": dinp_ref, "dweight": dw_ref},
                   atol=max(a1, a2), rtol=max(r1, r2), init={"dweight": dw0})
        bs = "/".join(f"{p[1]}.s{p[2]}" for p in plan) if n in TF32 else None
        ms = L.time(label, fn, block_size=bs, flops=flops, ceiling="tf32" if n in TF32 else "fp32")
        summary.append((name, f"{n}", ms, flops / ms / 1e9))
    # the TF32 variants' two GEMMs on their own, over tile configs / split-K
    for n, engine in TF32.items():
        if n not in L.selected(spec) or L.args.quick:
            continue
        cfgs_all = mm.TF32_CONFIGS if engine == 2 else mm.E4_CONFIGS
        sweeps = [("dinp", False, False, N, Cin, OC, 0.0, d_dinp, d_dout, d_w,
                   [(c, 1) for c in cfgs_all]),
                  ("dweight", True, False, OC, Cin, N, 1.0, d_dw, d_dout, d_inp,
                   [(c, s) for c in ("big", "mid", "small") for s in (1, 2, 3, 4, 6)])]
        for gname, tA, tB, M_, N_, K_, beta, dC, dA, dB, cfgs in sweeps:
            for cfg, s in [(None, None)] + cfgs:
                g = mm.gemm_build(rt, engine, tA, tB, M_, N_, K_, beta=beta, config=cfg, splits=s)
                lbl = f"gemm{engine} {name} {gname}"
                ms = L.time(lbl, (lambda g=g.launch, dC=dC, dA=dA, dB=dB: g(dC, dA, dB)),
                            block_size=f"{g.plan[1]}/s{g.plan[2]}" + ("" if cfg else " (plan)"),
                            flops=2 * M_ * N_ * K_, ceiling="tf32")
                summary.append((f"{name} {gname}", f"e{engine} {g.plan[1]}/s{g.plan[2]}" + ("" if cfg else "*"), ms,
                                2 * M_ * N_ * K_ / ms / 1e9))
    if HAVE_TORCH:
        td, ti, tw = (torch.from_numpy(a).cuda() for a in (dout, inp, weight))
        tdi, tdw = torch.empty((N, Cin), device="cuda"), torch.from_numpy(dw0).cuda()

        def cublas():
            torch.mm(td, tw, out=tdi)
            tdw.addmm_(td.t(), ti)
        ms = L.reference(f"cuBLAS TF32 {name}", cublas, flops=flops, ceiling="tf32")
        summary.append((name, "cuBLAS", ms, flops / ms / 1e9))
        ms1 = L.reference(f"cuBLAS TF32 {name} dinp", lambda: torch.mm(td, tw, out=tdi), flops=flops // 2, ceiling="tf32")
        ms2 = L.reference(f"cuBLAS TF32 {name} dweight", lambda: tdw.addmm_(td.t(), ti), flops=flops // 2, ceiling="tf32")
        summary.append((f"{name} dinp", "cuBLAS", ms1, flops / 2 / ms1 / 1e9))
        summary.append((f"{name} dweight", "cuBLAS", ms2, flops / 2 / ms2 / 1e9))
        del td, ti, tw, tdi, tdw
    del d_dout, d_inp, d_w, d_dinp, d_dw

# ----------------------------------------------------------------------------------------------
# bf16 builds: dinp bf16 (overwritten), dweight bf16 += (read, added in fp32, rounded once)

from llmc.bf16 import BF16, from_bf16, to_bf16  # noqa: E402


def bf16_tolerances(ref):
    """llmc.testing.bf16_close's rule: one rounding (2^-8 relative) + 1e-3 of the rms (fp32 sums)."""
    return 1e-3 * float(np.sqrt(np.mean(np.square(ref)))), 2.0 ** -8


def torch_bf16(bits):
    return torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)


BF16_VARIANTS = [n for n in L.selected(spec) if "bf16" in spec.variant(n).dtypes]
for name, Cin, OC in SHAPES if BF16_VARIANTS else ():
    L.section(f"{name} bf16")
    print(f"\n## {name} bf16: N={N} C={Cin} OC={OC}")
    dout, inp = to_bf16(lab.rand(rng, (N, OC))), to_bf16(lab.rand(rng, (N, Cin)))
    weight, dw0 = to_bf16(lab.rand(rng, (OC, Cin), scale=OC ** -0.5)), to_bf16(lab.rand(rng, (OC, Cin)))
    dinp_ref, dw_ref = reference64(lambda d, x, w, w0: (d @ w, w0 + d.T @ x), *(from_bf16(a) for a in (dout, inp, weight, dw0)))
    d_dout, d_inp, d_w = rt.to_device(dout), rt.to_device(inp), rt.to_device(weight)
    d_dinp, d_dw = rt.empty((N, Cin), BF16), rt.to_device(dw0)
    flops = 4 * N * Cin * OC
    for n in BF16_VARIANTS:
        why = spec.refuse_reason(n, "bf16", rt.arch, N=N, C=Cin, OC=OC)
        if why:
            print(f"  variant {n} bf16: refuses this shape ({why})")
            continue
        built = spec.build(rt, n, "bf16", N=N, C=Cin, OC=OC)
        launch, plan = built.launch, built.plan
        fn = (lambda launch=launch: launch(d_dinp, d_dw, d_dout, d_inp, d_w))
        label = f"{n} bf16 {name}"
        a1, r1 = bf16_tolerances(dinp_ref)
        a2, r2 = bf16_tolerances(dw_ref)
        ok = L.validate(label + " dinp", fn, outputs={"dinp": d_dinp}, refs={"dinp": dinp_ref}, atol=a1, rtol=r1)
        ok &= L.validate(label, fn, outputs={"dweight": d_dw}, refs={"dweight": dw_ref}, atol=a2, rtol=r2,
                         init={"dweight": dw0})
        bs = "/".join(f"{p[1]}.s{p[2]}" for p in plan) if plan else None
        ms = L.time(label, fn, block_size=bs, flops=flops, ceiling=None)
        summary.append((f"{name} bf16", f"{n}", ms, flops / ms / 1e9))
    if HAVE_TORCH:
        td, ti, tw = torch_bf16(dout), torch_bf16(inp), torch_bf16(weight)
        tdi, tdw = torch.empty((N, Cin), device="cuda", dtype=torch.bfloat16), torch_bf16(dw0)

        def cublas_bf16():
            torch.mm(td, tw, out=tdi)
            tdw.addmm_(td.t(), ti)
        ms = L.reference(f"cuBLAS BF16 {name}", cublas_bf16, flops=flops, ceiling=None)
        summary.append((f"{name} bf16", "cuBLAS", ms, flops / ms / 1e9))
        ms1 = L.reference(f"cuBLAS BF16 {name} dinp", lambda: torch.mm(td, tw, out=tdi), flops=flops // 2, ceiling=None)
        ms2 = L.reference(f"cuBLAS BF16 {name} dweight", lambda: tdw.addmm_(td.t(), ti), flops=flops // 2, ceiling=None)
        summary.append((f"{name} bf16 dinp", "cuBLAS", ms1, flops / 2 / ms1 / 1e9))
        summary.append((f"{name} bf16 dweight", "cuBLAS", ms2, flops / 2 / ms2 / 1e9))
        del td, ti, tw, tdi, tdw
    # the two GEMMs on their own, as matmul_backward 5 builds them
    if 5 in BF16_VARIANTS and not spec.refuse_reason(5, "bf16", rt.arch, N=N, C=Cin, OC=OC):
        from llmc.ops.gemm_wgmma import wgmma_build
        g1 = wgmma_build(rt, "bf16", N, Cin, OC, ldb=Cin, b_major="n", out="bf16")
        g2 = wgmma_build(rt, "bf16", OC, Cin, N, lda=OC, ldb=Cin, ldc=Cin, beta=1.0, a_major="m", b_major="n", out="bf16")
        for gname, g, args in (("dinp", g1, (d_dinp, d_dout, d_w)), ("dweight", g2, (d_dw, d_dout, d_inp))):
            ms = L.time(f"gemm5 bf16 {name} {gname}", (lambda g=g, args=args: g(*args)),
                        block_size=f"{g.plan[1]}/s{g.plan[2]}", flops=flops // 2, ceiling=None)
            summary.append((f"{name} bf16 {gname}", f"e5 {g.plan[1]}/s{g.plan[2]}", ms, flops / 2 / ms / 1e9))
    del d_dout, d_inp, d_w, d_dinp, d_dw


def print_summary():
    print("\n## summary: TFLOP/s (fraction of cuBLAS at the same shape, TF32 or BF16 on the \"bf16\" rows; * = the planner's pick)")
    for s in dict.fromkeys(r[0] for r in summary):
        rows = [r for r in summary if r[0] == s]
        cub = next((r[2] for r in rows if r[1] == "cuBLAS"), None)
        if cub is None:
            cub = next((r[2] for r in summary if r[0] == s and r[1] == "cuBLAS"), None)
        cells = [f"{lbl}: {tf:.1f}" + (f" ({cub / ms:.2f})" if cub and lbl != "cuBLAS" else "") for _, lbl, ms, tf in rows]
        print(f"{s:18s} " + " | ".join(cells))


try:
    L.finish()
finally:
    print_summary()
