"""Kernel lab: matmul_forward (out = inp @ weight^T + bias) and the attention-shaped batched GEMMs.

    python dev/cuda/matmul_forward.py             # every variant at the trainer's shapes, + cuBLAS TF32
    python dev/cuda/matmul_forward.py 6           # one variant (its tile configs swept too)
    python dev/cuda/matmul_forward.py 6 7         # GEMM engines 2 and 4 side by side
    python dev/cuda/matmul_forward.py --quick     # fewer repeats, planner's tile config only
    python dev/cuda/matmul_forward.py --sass      # no GPU: SASS instructions per HMMA in the main loop,
                                                  # engines 2 and 4, every tile config and layout

Shapes: GPT-2 124M at B=4, T=1024 (N = 4096 rows): qkv 768->2304, attproj 768->768, fc 768->3072,
fcproj 3072->768, lm head 768->50304 (no bias); then the attention GEMMs (batch B*NH = 48, T=1024,
hs=64) on GEMM engines 1, 2 and 4: q@k^T (nt, K=64), att@v (nn, K=1024) and the backward's
datt=dy@v^T (nt), dv=att^T@dy (tn), dq=datt@k (nn), dk=datt^T@q (tn).
Each row: median ms (L2 flushed), TFLOP/s vs the fp32 (51) or tf32 (377) ceiling; the summary at the
end gives each variant as a fraction of cuBLAS TF32 (torch, allow_tf32) at the same shape.
The variants 1-3 are skipped at the lm-head shape unless named (they take seconds there).
First of all, a probe times mma.sync m16n8k8 TF32 with no memory traffic: the ceiling of any
mma.sync kernel on this GPU (cuBLAS uses Hopper's wgmma instead).
The rounding experiment ("truncate") builds engines 2 and 4 feeding raw fp32 bits to the tensor
cores: what the one-IADD-per-register tf32 rounding costs (a third of engine 4's loop instructions).
bf16 (--precision bf16): the variants with a bf16 build (9 on engine 5, 8 the GEMV) run bf16 in and
out at the same shapes (and the decode shapes) beside cuBLAS BF16 through torch; the summary's "bf16"
rows give their fraction of cuBLAS BF16 (issue 12's target: >= 0.9 on every shape).

    python dev/cuda/matmul_forward.py 9 --quick   # engine 5, TF32 and bf16 rows, against cuBLAS

The fc layer's fused form (matmul_forward with gelu_pre=True, variant 9): "fc+gelu" rows time it
against what the model launches without it, the plain variant then gelu_forward's default, at the fc
shape (B from --batch, default 4; --dtype fp32, bf16 or both), both outputs validated (pre and gelu):

    python dev/cuda/matmul_forward.py 9 --fc-gelu --quick --batch 16   # only those rows
"""
import collections  # noqa: E402
import sys  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402

import numpy as np  # noqa: E402

import llmc.ops  # noqa: E402
from llmc.ops import gemm as mm  # noqa: E402 (the GEMM engines)

# ----------------------------------------------------------------------------------------------
# --sass: instruction counts of the TF32 engines' main loops, from the cubin (nvcc + cuobjdump, no GPU)


def sass_steady_loop(sass: str) -> collections.Counter:
    """Opcodes issued by one warp in one trip of the k-tile loop (the loop holding the HMMAs), along
    its steady-state path: of the paths from the loop head to the back edge, those that issue the
    most LDGSTS (the next k-tile is loaded), the shortest (interior tiles: no zero-fill arithmetic)."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    opc = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]  # noqa: E731
    best = None
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if not (m and int(m.group(1), 16) < addr):
            continue
        lo, hi = int(m.group(1), 16), addr
        body = [(a, t) for a, t in ins if lo <= a <= hi]
        if not any(opc(t).startswith("HMMA") for _, t in body):
            continue
        starts = {lo} | {int(x, 16) for _, t in body for x in re.findall(r"BRA (0x[0-9a-f]+)", t)}
        starts |= {body[k + 1][0] for k, (_, t) in enumerate(body[:-1]) if "BRA" in t}
        blocks, cur = [], []
        for a, t in body:
            if a in starts and cur:
                blocks.append(cur)
                cur = []
            cur.append((a, t))
        blocks.append(cur)
        index = {b[0][0]: k for k, b in enumerate(blocks)}

        def succ(k):
            last = blocks[k][-1][1]
            m2 = re.search(r"BRA (0x[0-9a-f]+)", last)
            out = []
            if m2:
                tgt = int(m2.group(1), 16)
                out.append("end" if tgt == lo else index.get(tgt))
                if last.startswith("@") and k + 1 < len(blocks):
                    out.append(k + 1)
            else:
                out.append(k + 1 if k + 1 < len(blocks) else "end")
            return [o for o in out if o is not None]

        paths = []

        def walk(k, path):
            if k == "end":
                paths.append([opc(t) for j in path for _, t in blocks[j]])
            elif k not in path:
                for s_ in succ(k):
                    walk(s_, path + [k])
        walk(0, [])
        for p_ in paths:
            key = (sum(o.startswith("LDGSTS") for o in p_), -len(p_))
            if best is None or key > best[0]:
                best = (key, collections.Counter(p_))
    return best[1]


def sass_report():
    from llmc.runtime import compile_cubin, cuobjdump_env
    found = cuobjdump_env()
    if found is None:
        raise SystemExit("matmul_forward.py --sass: cuobjdump (and nvdisasm) not found: install the CUDA toolkit or "
                         "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    tool, env = found
    print("## TF32 engines: SASS instructions per warp per k-tile (main loop, steady state) / HMMA")
    for arch in ("sm_90", "sm_80"):
        cubin, _ = compile_cubin("gemm", arch)
        print(f"\n### {arch} ({cubin.name})\n")
        print("| config | layout | engine 2 | per HMMA | engine 4 | per HMMA | change | engine 4: LDSM / LDS.128 / LDGSTS |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for cfg in mm.E4_CONFIGS:
            for lay in ("nn", "nt", "tn", "tt"):
                counts = []
                for fn in (f"gemm_tf32_{cfg}_v4_{lay}", f"gemm_tf32_e4_{cfg}_{lay}"):
                    sass = subprocess.run([tool, "-sass", "-fun", fn, str(cubin)], capture_output=True,
                                          text=True, check=True, env=env).stdout
                    c = sass_steady_loop(sass)
                    counts.append((sum(c.values()), c["HMMA.1688.F32.TF32"], c))
                (n2, h2, _), (n4, h4, c4) = counts
                ldg = sum(v for k, v in c4.items() if k.startswith("LDGSTS"))
                print(f"| {cfg} | {lay} | {n2} | {n2 / h2:.2f} | {n4} | {n4 / h4:.2f} | {100 * (n4 - n2) / n2:+.0f}% "
                      f"| {c4['LDSM.16.M88.4']} / {c4['LDS.128']} / {ldg} |")


if "--sass" in sys.argv:
    sass_report()
    sys.exit(0)
FC_GELU_ONLY = "--fc-gelu" in sys.argv  # (ours, not the lab's: taken out before it parses the rest)
if FC_GELU_ONLY:
    sys.argv.remove("--fc-gelu")

import lab  # noqa: E402

L = lab.Lab("matmul_forward")
rt = L.rt
spec = llmc.ops.get("matmul_forward")
B, T, C, NH, Vp = 4, 1024, 768, 12, 50304
N, hs = B * T, C // NH
TF32 = {5, 6, 7}
SWEEP = {6: list(mm.TF32_CONFIGS), 7: list(mm.E4_CONFIGS)}  # tile configs each engine variant builds
rng = np.random.default_rng(0)

try:
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    HAVE_TORCH = torch.cuda.is_available()
except ImportError:
    HAVE_TORCH = False


def reference64(fn, *arrays):
    """float64 reference, on the GPU through torch when we can (the lm head is 316 GFLOP)."""
    if HAVE_TORCH:
        return fn(*(torch.from_numpy(a).cuda().double() for a in arrays)).cpu().numpy()
    return fn(*(a.astype(np.float64) for a in arrays))


def tolerances(tf32, ref):
    rms = float(np.sqrt(np.mean(np.square(ref))))
    return (1e-2 * rms, 1e-2) if tf32 else (1e-4, 1e-4)


summary = []  # (shape, label, ms, tflops)


def fc_gelu_rows():
    """The fused fc + GELU (gelu_pre=True) beside the plain variant + gelu_forward (the default
    variant of that precision), at (B*T, C) @ (4C, C)^T + bias: the outputs pre and out = gelu(pre)
    poisoned and checked against float64 for both; timed the same way; the difference per layer."""
    from llmc.bf16 import BF16, from_bf16, to_bf16
    from llmc.ops.gelu import gelu_forward_ref
    rows, Cin, OC = (L.args.batch or B) * T, C, 4 * C
    gspec = llmc.ops.get("gelu_forward")
    for dt in ("fp32", "bf16") if L.args.dtype == "both" else (L.args.dtype,):
        variants = [n for n in L.selected(spec) if "gelu_pre" in spec.variant(n).options and dt in spec.variant(n).dtypes]
        if not variants:
            continue
        L.section(f"fc+gelu {dt}")
        print(f"\n## fc + GELU {dt}: ({rows}, {Cin}) @ ({OC}, {Cin})^T + bias, GELU fused into the epilogue "
              f"vs the plain GEMM + gelu_forward")
        up, val = (to_bf16, from_bf16) if dt == "bf16" else ((lambda a: a), (lambda a: a))
        inp, weight, bias = (up(lab.rand(rng, (rows, Cin))), up(lab.rand(rng, (OC, Cin), scale=Cin ** -0.5)),
                             up(lab.rand(rng, (OC,))))
        ref = reference64(lambda x, w, b: x @ w.T + b, val(inp), val(weight), val(bias))
        gref = gelu_forward_ref(ref)
        dty = BF16 if dt == "bf16" else np.float32
        d_inp, d_w, d_b = rt.to_device(inp), rt.to_device(weight), rt.to_device(bias)
        d_pre, d_out = rt.empty((rows, OC), dty), rt.empty((rows, OC), dty)
        flops = 2 * rows * Cin * OC
        atol, rtol = bf16_tolerances(ref) if dt == "bf16" else tolerances(True, ref)
        for n in variants:
            why = spec.refuse_reason(n, dt, rt.arch, N=rows, C=Cin, OC=OC, has_bias=True, gelu_pre=True)
            if why:
                print(f"  variant {n} {dt}: refuses the fused form ({why})")
                continue
            fused = spec.build(rt, n, dt, N=rows, C=Cin, OC=OC, has_bias=True, gelu_pre=True)
            plain = spec.build(rt, n, dt, N=rows, C=Cin, OC=OC, has_bias=True)
            gelu = gspec.build(rt, gspec.default_for(dt), dt, N=rows * OC)
            times = []
            for label, fn in ((f"{n} {dt} fc+gelu fused", lambda: fused(d_out, d_pre, d_inp, d_w, d_b)),
                              (f"{n} {dt} fc + gelu_forward {gelu.number}",
                               lambda: (plain(d_pre, d_inp, d_w, d_b), gelu(d_out, d_pre)))):
                L.validate(label, fn, outputs={"pre": d_pre}, refs={"pre": ref}, atol=atol, rtol=rtol)
                # gelu(pre): in bf16 pre is rounded once, then its GELU once more (rtol 2^-7)
                L.validate(label, fn, outputs={"out": d_out}, refs={"out": gref}, atol=atol,
                           rtol=2.0 ** -7 if dt == "bf16" else rtol)
                ms = L.time(label, fn, block_size=f"{fused.plan[1]}/s{fused.plan[2]}", flops=flops,
                            ceiling="tf32" if dt == "fp32" else None)
                times.append(ms)
                summary.append((f"fc+gelu {dt}", label.split(f"{dt} ", 1)[1], ms, flops / ms / 1e9))
            print(f"  fused / unfused: {times[0] / times[1]:.3f} ({1000 * (times[1] - times[0]):.1f} us a layer)")
        del d_inp, d_w, d_b, d_pre, d_out


def bf16_tolerances(ref):
    """One rounding of the output (<= 2^-9 relative; 2^-8 allows a sum beside a rounding boundary) plus
    the fp32 accumulation and near-zero outputs (1e-3 of the rms): llmc.testing.bf16_close's rule."""
    return 1e-3 * float(np.sqrt(np.mean(np.square(ref)))), 2.0 ** -8


if FC_GELU_ONLY:
    try:
        fc_gelu_rows()
        L.finish()
    finally:
        for s_, lbl, ms_, tf in summary:
            print(f"{s_:12s} {lbl}: {ms_:.4f} ms, {tf:.1f} TFLOP/s")
    sys.exit(0)

# ----------------------------------------------------------------------------------------------
# the mma.sync ceiling: HMMA.1688.F32.TF32 back to back from registers, no memory traffic

probe = rt.kernel("gemm", "gemm_tf32_mma_probe", "Pi", label="mma.sync probe")
blocks, iters = rt.sm_count * 4, 4096
d_probe = rt.empty((blocks * 256,))
flops = blocks * 8 * iters * 8 * 2048  # warps x iterations x 8 mma x 16*8*8*2 flops
print("\n## mma.sync m16n8k8 TF32 issue-rate probe (8 independent accumulators per warp, 32 warps/SM)")
ms = L.time("mma.sync probe", lambda: probe((blocks, 1, 1), (256, 1, 1), d_probe.ptr, np.int32(iters)),
            flops=flops, ceiling="tf32")
summary.append(("probe", "mma.sync", ms, flops / ms / 1e9))

# ----------------------------------------------------------------------------------------------
# matmul_forward at the trainer's shapes

SHAPES = [("qkv", C, 3 * C, True), ("attproj", C, C, True), ("fc", C, 4 * C, True),
          ("fcproj", 4 * C, C, True), ("lmhead", C, Vp, False)]
for name, Cin, OC, has_bias in SHAPES:
    L.section(name)
    print(f"\n## {name}: ({N}, {Cin}) @ ({OC}, {Cin})^T" + (" + bias" if has_bias else ""))
    inp, weight, bias = lab.rand(rng, (N, Cin)), lab.rand(rng, (OC, Cin), scale=Cin ** -0.5), lab.rand(rng, (OC,))
    ref = reference64(lambda x, w, b: x @ w.T + (b if has_bias else 0), inp, weight, bias)
    d_inp, d_w, d_b, d_out = rt.to_device(inp), rt.to_device(weight), rt.to_device(bias), rt.empty((N, OC))
    bias_arg = d_b if has_bias else None
    flops = 2 * N * Cin * OC
    for n in L.selected(spec):
        if n <= 3 and name == "lmhead" and not L.args.variants:
            print(f"  variant {n}: skipped at the lm-head shape (name it to run it)")
            continue
        why = spec.variant(n).refuse_reason(N=N, C=Cin, OC=OC)
        if why:
            print(f"  variant {n}: refuses this shape ({why})")
            continue
        sweep = [None] + (SWEEP.get(n, []) if not L.args.quick else [])
        for cfg in sweep:
            built = spec.build(rt, n, N=N, C=Cin, OC=OC, has_bias=has_bias, block_size=cfg)
            launch, plan = built.launch, built.plan  # time the bare closure
            fn = (lambda launch=launch: launch(d_out, d_inp, d_w, bias_arg))
            label = f"{n} {name}"
            atol, rtol = tolerances(n in TF32, ref)
            if cfg is None or name != "lmhead":  # (the lm-head check is 206M elements on the host)
                L.validate(label if cfg is None else f"{label} {cfg}", fn, outputs={"out": d_out},
                           refs={"out": ref}, atol=atol, rtol=rtol)
            bs = cfg or (f"{plan[1]}/s{plan[2]}" if plan else None)
            ms = L.time(label if cfg is None else f"{label} {cfg}", fn, block_size=bs, flops=flops,
                        ceiling="tf32" if n in TF32 else "fp32")
            summary.append((name, f"{n}" + (f" {cfg}" if cfg else ""), ms, flops / ms / 1e9))
    for n, engine in ((6, 2), (7, 4)):
        if n not in L.selected(spec) or L.args.quick or name not in ("qkv", "fc", "lmhead"):
            continue
        # experiment: what does rounding to tf32 (one integer add per fragment element) cost?
        g = mm.gemm_build(rt, engine, False, True, M=N, N=OC, K=Cin, has_bias=has_bias, truncate=True)
        fn = (lambda g=g.launch: g(d_out, d_inp, d_w, bias_arg))
        atol, rtol = tolerances(True, ref)
        L.validate(f"{n} {name} truncate", fn, outputs={"out": d_out}, refs={"out": ref}, atol=2 * atol, rtol=2 * rtol)
        ms = L.time(f"{n} {name} truncate", fn, block_size=f"{g.plan[1]}/s{g.plan[2]}", flops=flops, ceiling="tf32")
        summary.append((name, f"{n} trunc", ms, flops / ms / 1e9))
    if HAVE_TORCH:
        ti, tw, tb = (torch.from_numpy(a).cuda() for a in (inp, weight, bias))
        to = torch.empty((N, OC), device="cuda")
        fn = (lambda: torch.addmm(tb, ti, tw.t(), out=to)) if has_bias else (lambda: torch.mm(ti, tw.t(), out=to))
        ms = L.reference(f"cuBLAS TF32 {name}", fn, flops=flops, ceiling="tf32")
        summary.append((name, "cuBLAS", ms, flops / ms / 1e9))
        del ti, tw, tb, to
    del d_inp, d_w, d_b, d_out

# ----------------------------------------------------------------------------------------------
# bf16 builds at the trainer's shapes: bf16 in and out, fp32 accumulation, one rounding per output

from llmc.bf16 import BF16, from_bf16, to_bf16  # noqa: E402


def torch_bf16(bits):
    """A CUDA bf16 tensor holding these uint16 bf16 bit patterns."""
    return torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)


BF16_VARIANTS = [n for n in L.selected(spec) if "bf16" in spec.variant(n).dtypes]
for name, Cin, OC, has_bias in SHAPES if BF16_VARIANTS else ():
    L.section(f"{name} bf16")
    print(f"\n## {name} bf16: ({N}, {Cin}) @ ({OC}, {Cin})^T" + (" + bias" if has_bias else ""))
    inp, weight, bias = (to_bf16(lab.rand(rng, (N, Cin))), to_bf16(lab.rand(rng, (OC, Cin), scale=Cin ** -0.5)),
                         to_bf16(lab.rand(rng, (OC,))))
    ref = reference64(lambda x, w, b: x @ w.T + (b if has_bias else 0), from_bf16(inp), from_bf16(weight), from_bf16(bias))
    d_inp, d_w, d_b, d_out = rt.to_device(inp), rt.to_device(weight), rt.to_device(bias), rt.empty((N, OC), BF16)
    bias_arg = d_b if has_bias else None
    flops = 2 * N * Cin * OC
    for n in BF16_VARIANTS:
        why = spec.refuse_reason(n, "bf16", rt.arch, N=N, C=Cin, OC=OC, has_bias=has_bias)
        if why:
            print(f"  variant {n} bf16: refuses this shape ({why})")
            continue
        built = spec.build(rt, n, "bf16", N=N, C=Cin, OC=OC, has_bias=has_bias)
        launch, plan = built.launch, built.plan
        fn = (lambda launch=launch: launch(d_out, d_inp, d_w, bias_arg))
        label = f"{n} bf16 {name}"
        atol, rtol = bf16_tolerances(ref)
        L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=atol, rtol=rtol)
        ms = L.time(label, fn, block_size=f"{plan[1]}/s{plan[2]}" if plan else None, flops=flops, ceiling=None)
        summary.append((f"{name} bf16", f"{n}", ms, flops / ms / 1e9))
    if HAVE_TORCH:
        ti, tw, tb = torch_bf16(inp), torch_bf16(weight), torch_bf16(bias)
        to = torch.empty((N, OC), device="cuda", dtype=torch.bfloat16)
        fn = (lambda: torch.addmm(tb, ti, tw.t(), out=to)) if has_bias else (lambda: torch.mm(ti, tw.t(), out=to))
        ms = L.reference(f"cuBLAS BF16 {name}", fn, flops=flops, ceiling=None)
        summary.append((f"{name} bf16", "cuBLAS", ms, flops / ms / 1e9))
        del ti, tw, tb, to
    del d_inp, d_w, d_b, d_out

# ----------------------------------------------------------------------------------------------
# the KV-cache decoder's matmuls: N = batch rows (1, 4, 8), weight-bandwidth-bound, so GB/s of
# weights read; the GEMV (variant 8) against the TF32 engines

for rows in (1, 4, 8):
    for name, Cin, OC, has_bias in SHAPES:
        L.section(f"decode {name} N={rows}")
        print(f"\n## decode {name}: ({rows}, {Cin}) @ ({OC}, {Cin})^T" + (" + bias" if has_bias else ""))
        inp, weight, bias = lab.rand(rng, (rows, Cin)), lab.rand(rng, (OC, Cin), scale=Cin ** -0.5), lab.rand(rng, (OC,))
        ref = reference64(lambda x, w, b: x @ w.T + (b if has_bias else 0), inp, weight, bias)
        d_inp, d_w, d_b, d_out = rt.to_device(inp), rt.to_device(weight), rt.to_device(bias), rt.empty((rows, OC))
        bias_arg = d_b if has_bias else None
        nbytes = 4 * (OC * Cin + rows * Cin + rows * OC)
        for n in L.selected(spec):
            if n < 5 or spec.variant(n).refuse_reason(N=rows, C=Cin, OC=OC):
                continue
            built = spec.build(rt, n, N=rows, C=Cin, OC=OC, has_bias=has_bias)
            launch, plan = built.launch, built.plan  # time the bare closure
            fn = (lambda launch=launch: launch(d_out, d_inp, d_w, bias_arg))
            label = f"{n} decode {name} N={rows}"
            atol, rtol = tolerances(n in TF32, ref)
            L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=atol, rtol=rtol)
            ms = L.time(label, fn, bytes=nbytes)
            summary.append((f"decode {name} N={rows}", f"{n}", ms, 2 * rows * Cin * OC / ms / 1e9))
        if HAVE_TORCH:
            ti, tw, tb = (torch.from_numpy(a).cuda() for a in (inp, weight, bias))
            to = torch.empty((rows, OC), device="cuda")
            fn = (lambda: torch.addmm(tb, ti, tw.t(), out=to)) if has_bias else (lambda: torch.mm(ti, tw.t(), out=to))
            ms = L.reference(f"cuBLAS TF32 decode {name} N={rows}", fn, bytes=nbytes)
            summary.append((f"decode {name} N={rows}", "cuBLAS", ms, 2 * rows * Cin * OC / ms / 1e9))
            del ti, tw, tb, to
        del d_inp, d_w, d_b, d_out

# the decoder's matmuls in bf16 (a bf16 model samples with them): half the weight bytes of fp32
for rows in (1, 4, 8) if BF16_VARIANTS else ():
    for name, Cin, OC, has_bias in SHAPES:
        L.section(f"decode {name} N={rows} bf16")
        inp, weight, bias = (to_bf16(lab.rand(rng, (rows, Cin))), to_bf16(lab.rand(rng, (OC, Cin), scale=Cin ** -0.5)),
                             to_bf16(lab.rand(rng, (OC,))))
        ref = reference64(lambda x, w, b: x @ w.T + (b if has_bias else 0), from_bf16(inp), from_bf16(weight),
                          from_bf16(bias))
        d_inp, d_w, d_b, d_out = rt.to_device(inp), rt.to_device(weight), rt.to_device(bias), rt.empty((rows, OC), BF16)
        bias_arg = d_b if has_bias else None
        nbytes = 2 * (OC * Cin + rows * Cin + rows * OC)
        for n in BF16_VARIANTS:
            if spec.refuse_reason(n, "bf16", rt.arch, N=rows, C=Cin, OC=OC, has_bias=has_bias):
                continue
            launch = spec.build(rt, n, "bf16", N=rows, C=Cin, OC=OC, has_bias=has_bias).launch
            fn = (lambda launch=launch: launch(d_out, d_inp, d_w, bias_arg))
            label = f"{n} bf16 decode {name} N={rows}"
            atol, rtol = bf16_tolerances(ref)
            L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=atol, rtol=rtol)
            ms = L.time(label, fn, bytes=nbytes)
            summary.append((f"decode {name} N={rows} bf16", f"{n}", ms, 2 * rows * Cin * OC / ms / 1e9))
        if HAVE_TORCH:
            ti, tw, tb = torch_bf16(inp), torch_bf16(weight), torch_bf16(bias)
            to = torch.empty((rows, OC), device="cuda", dtype=torch.bfloat16)
            fn = (lambda: torch.addmm(tb, ti, tw.t(), out=to)) if has_bias else (lambda: torch.mm(ti, tw.t(), out=to))
            ms = L.reference(f"cuBLAS BF16 decode {name} N={rows}", fn, bytes=nbytes)
            summary.append((f"decode {name} N={rows} bf16", "cuBLAS", ms, 2 * rows * Cin * OC / ms / 1e9))
            del ti, tw, tb, to
        del d_inp, d_w, d_b, d_out

# ----------------------------------------------------------------------------------------------
# attention's batched GEMMs (B*NH = 48 heads), on the SIMT and TF32 engines

BH = B * NH
# name, transA, transB, M, N, K, (A rows, A cols), (B rows, B cols), alpha
ATT = [("att q@kT", False, True, T, T, hs, (T, hs), (T, hs), hs ** -0.5),
       ("att att@v", False, False, T, hs, T, (T, T), (T, hs), 1.0),
       ("att dy@vT", False, True, T, T, hs, (T, hs), (T, hs), 1.0),
       ("att attT@dy", True, False, T, hs, T, (T, T), (T, hs), 1.0),
       ("att datt@k", False, False, T, hs, T, (T, T), (T, hs), 1.0),
       ("att dattT@q", True, False, T, hs, T, (T, T), (T, hs), 1.0)]
for name, tA, tB, M_, N_, K_, ashape, bshape, alpha in ATT:
    L.section(name)
    print(f"\n## {name}: batch {BH}, M={M_} N={N_} K={K_} ({'t' if tA else 'n'}{'t' if tB else 'n'})")
    A, Bm = lab.rand(rng, (BH, *ashape)), lab.rand(rng, (BH, *bshape), scale=K_ ** -0.5)
    ref = reference64(lambda a, b: alpha * ((a.transpose(1, 2) if tA else a) @ (b.transpose(1, 2) if tB else b))
                      if HAVE_TORCH else alpha * ((np.swapaxes(a, 1, 2) if tA else a) @ (np.swapaxes(b, 1, 2) if tB else b)),
                      A, Bm)
    d_A, d_B, d_C = rt.to_device(A), rt.to_device(Bm), rt.empty((BH, M_, N_))
    flops = 2 * BH * M_ * N_ * K_
    for engine in (1, 2, 4):
        g = mm.gemm_build(rt, engine, tA, tB, M_, N_, K_, batch=BH, strideA=ashape[0] * ashape[1],
                          strideB=bshape[0] * bshape[1], strideC=M_ * N_, alpha=alpha)
        fn = (lambda g=g.launch: g(d_C, d_A, d_B))
        label = f"gemm{engine} {name}"
        atol, rtol = tolerances(engine != 1, ref)
        L.validate(label, fn, outputs={"C": d_C}, refs={"C": ref}, atol=atol, rtol=rtol)
        plan = g.plan
        ms = L.time(label, fn, block_size=f"{plan[1]}/s{plan[2]}" if engine != 1 else None, flops=flops,
                    ceiling="fp32" if engine == 1 else "tf32")
        summary.append((name, f"gemm{engine}", ms, flops / ms / 1e9))
    if HAVE_TORCH:
        ta, tb_ = torch.from_numpy(A).cuda(), torch.from_numpy(Bm).cuda()
        tc = torch.empty((BH, M_, N_), device="cuda")
        opa, opb = (ta.transpose(1, 2) if tA else ta), (tb_.transpose(1, 2) if tB else tb_)
        fn = (lambda: torch.baddbmm(tc, opa, opb, beta=0.0, alpha=alpha, out=tc))
        ms = L.reference(f"cuBLAS TF32 {name}", fn, flops=flops, ceiling="tf32")
        summary.append((name, "cuBLAS", ms, flops / ms / 1e9))


fc_gelu_rows()


def print_summary():
    print("\n## summary: TFLOP/s (fraction of cuBLAS at the same shape: TF32; BF16 on the \"bf16\" rows)")
    shapes = list(dict.fromkeys(s for s, *_ in summary))
    for s in shapes:
        rows = [r for r in summary if r[0] == s]
        cub = next((r[2] for r in rows if r[1] == "cuBLAS"), None)
        cells = [f"{lbl}: {tf:.1f}" + (f" ({cub / ms:.2f})" if cub and lbl != "cuBLAS" else "")
                 for _, lbl, ms, tf in rows]
        print(f"{s:12s} " + " | ".join(cells))


try:
    L.finish()
finally:
    print_summary()
