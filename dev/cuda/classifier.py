"""Kernel lab: the fused classifier (softmax + cross-entropy + logit gradient) at the trainer's shape.

    python dev/cuda/classifier.py            # validate + time every variant over block sizes
    python dev/cuda/classifier.py 2 4        # only variants 2 and 4
    python dev/cuda/classifier.py --quick    # default block size, 10 repeats
    python dev/cuda/classifier.py 3 --dtype bf16   # the bf16 build of variant 3 only

Shape: GPT-2 124M at B=4, T=1024: N=4096 rows, V=50257 real columns padded to Vp=50304.
Bytes counted (the floor): read the logits once and write the gradient once, N*Vp*4 each, plus
targets read and losses written: 1.65 GB, 0.55 ms at 2.98 TB/s. The "loss only" lines
(write_dlogits=0, the eval path) count N*Vp*4 read + N*8.
Reference line: torch's F.cross_entropy forward + backward on a (N, V) fp32 tensor (no padding).

bf16 (the rows "<n> bf16", variants with a bf16 build: 1, 2, 3, 5, 6, 7): bf16 logits and gradient, fp32
losses; the floor halves: N*Vp*2 read + written = 0.82 GB, 0.277 ms at 2.98 TB/s (target: >= 85% of
the copy ceiling). Validated against the float64 reference on the bf16 values: the gradient within
rtol 2^-8 (one bf16 rounding). Reference line: torch F.cross_entropy on a bf16 tensor (fwd+bwd).
Both dtypes run by default; --dtype fp32 or --dtype bf16 runs one.
"""


import numpy as np

import lab
from llmc.bf16 import from_bf16, to_bf16
from llmc.ops import classifier as op_module
from llmc.ops.classifier import classifier_backward_ref, classifier_forward_ref

N, V, Vp = 4 * 1024, 50257, 50304
DLOSS = 1.0 / N  # the trainer's mean-loss gradient scale
BLOCK_SIZES = {1: (1024, 512, 256), 2: (1024, 512, 256), 3: (1024, 512), 4: (1024, 512), 5: (1024, 512), 6: (1024, 512),
               7: (1024, 512), 8: (None,)}
BLOCK_SIZES_BF16 = {1: (1024, 512, 256), 2: (1024, 512, 256), 3: (1024, 512, 256), 5: (1024, 512, 256),
                    6: (1024, 512, 256), 7: (1024, 512, 256), 8: (None,)}  # the default first; a variant missing here: its default block only


L = lab.Lab("classifier")
DTYPES = ("fp32", "bf16") if L.args.dtype == "both" else (L.args.dtype,)  # lab.py's --dtype
rt = L.rt
spec = op_module.OPS[0]  # the module itself: a half-written sibling op can't break this lab

rng = np.random.default_rng(0)
logits = lab.rand(rng, (N, Vp), scale=2.0)
logits[:, V:] = np.nan  # padding is never read for the loss; the gradient writes zeros there
targets = rng.integers(0, V, size=N).astype(np.int32)
d_targets, d_losses = rt.to_device(targets), rt.empty((N,))

for dtype in DTYPES:
    L.section(dtype)
    print(f"\n## {dtype}")
    # the reference sees what the kernel sees: in bf16, the bf16 values of the same logits
    host = logits if dtype == "fp32" else to_bf16(logits)
    values = logits if dtype == "fp32" else from_bf16(host)
    print("computing the float64 reference ...")
    losses_ref, probs = classifier_forward_ref(values.astype(np.float64), targets, V)
    dlogits_ref = classifier_backward_ref(probs, targets, DLOSS, Vp)
    del probs
    esize = 4 if dtype == "fp32" else 2
    d_logits = rt.to_device(host)
    bytes_fused = 2 * N * Vp * esize + 2 * N * 4
    bytes_loss = N * Vp * esize + 2 * N * 4
    # fp32 vs float64: loss to ~1e-6 absolute, gradient p*dloss (~1e-10 here) to 1e-5 relative;
    # bf16: the same loss, the gradient rounded once to bf16 (half an ulp: <= 2^-8 relative)
    rtol = 1e-5 if dtype == "fp32" else 2.0 ** -8
    sizes = BLOCK_SIZES if dtype == "fp32" else BLOCK_SIZES_BF16
    sfx = "" if dtype == "fp32" else " bf16"
    for n in L.selected(spec):
        if dtype not in spec.variants[n].dtypes:
            print(f"  variant {n}: no {dtype} build")
            continue
        for bs in L.block_sizes(sizes.get(n, (1024,))):
            launch = spec.build(rt, n, dtype, N=N, V=V, Vp=Vp, block_size=bs).launch  # the bare closure
            fused = lambda: launch(d_losses, d_logits, d_targets, DLOSS, 1)  # noqa: E731
            if bs == sizes.get(n, (1024,))[0]:
                L.validate(f"{n}{sfx}", fused, outputs={"losses": d_losses, "logits": d_logits},
                           refs={"losses": losses_ref, "logits": dlogits_ref}, atol=1e-14, rtol=rtol,
                           init={"logits": host})
            # timed on whatever the logits hold by now (the gradient of the last run): same work
            L.time(f"{n}{sfx}", fused, block_size=bs, bytes=bytes_fused)
        launch = spec.build(rt, n, dtype, N=N, V=V, Vp=Vp).launch  # the bare closure: no Python call in between
        L.time(f"{n}{sfx} loss only", lambda: launch(d_losses, d_logits, d_targets, DLOSS, 0), bytes=bytes_loss)
    del dlogits_ref  # host memory: 1.6 GB of float64

# The classifier folded into the lm head (the trainer's training steps; docs/matmul_notes.md, "The classifier folded
# into the lm head"): the pair it replaces, the lm head GEMM (engine 5) then variant 7 over its logits, against the
# fold's forward: the GEMM writing p' and its row sums, the combine, the fix (no rows to redo here after the first
# run). Both rows count the GEMM's FLOPs (2 N Vp C, C = 768). The fold's losses are checked against float64 on its
# first 256 rows; its gradients: tests/test_classifier.py's GPU tests.
def fold_kernels(dtype, sfx):
    """The fold's memory-bound kernels alone, at B=4's rows and B=16's (16384), against a copy of their bytes:
    the combine over every row (bytes: the tile sums, lnf read and X written, targets, losses, cs and the two
    touches of p'_t), the row scale (dinp read and written in place, cs); then the fix with every row of B=4
    flagged (a GEMV of each row against wte: FLOPs 2 N V C, CUDA cores). The combine runs on filled values that
    keep every row in range and leave p'_t as it was (p'_t ~ 2^37, S ~ 1), so each repeat does the same work.
    Then prime (the first step of a run without k from a state file: min(N, SMs) rows through the fix)."""
    es = 4 if dtype == "fp32" else 2
    tdt = np.float32 if dtype == "fp32" else BF16
    for n in (N, 4 * N):
        f = op_module.fold_build(rt, n, V, Vp, C, dtype)
        tg = rt.to_device(np.random.default_rng(2).integers(0, V, n).astype(np.int32))
        P, x, ls = rt.empty((n, Vp), tdt), rt.empty((n, C), tdt), rt.empty((n,))
        P.fill_bytes(0x52)  # p' ~ 2.3e11 (fp32 0x52525252, bf16 0x5252)
        f.FS.fill_bytes(0x3B)  # 0.0029 a tile: S ~ 1.1
        x.fill_bytes(0x3F)
        cbytes = n * f.tiles * 4 + 2 * n * C * es + 3 * n * 4 + 2 * n * es
        L.time(f"fold combine{sfx}, N={n}", lambda: f.combine(ls, P, tg, x, DLOSS), bytes=cbytes)
        if L.args.define:  # (a sweep: the combine also on 4 blocks an SM, what stays resident at 64 registers)
            g = f.grid_rows
            f.grid_rows = (max(1, min(-(-n // 8), rt.sm_count * 4)), 1, 1)
            L.time(f"fold combine{sfx}, N={n}, {f.grid_rows[0]} blocks", lambda: f.combine(ls, P, tg, x, DLOSS), bytes=cbytes)
            f.grid_rows = g
        flagged = int(f.ctl.get()[1])
        if flagged:
            print(f"  fold combine{sfx}, N={n}: {flagged} rows flagged (expected none): FAIL")
            L.failed.append(f"fold combine{sfx}")
        L.time(f"fold scale{sfx}, N={n}", lambda: f.scale(x), bytes=2 * n * C * es + n * 4)
        if n == N:  # every row through the fix: the ctl a combine leaves when it flags them all
            f.flagged.set(np.arange(n, dtype=np.int32))
            ctl = np.array(op_module.FOLD_INIT, np.int32)
            ctl[1] = n
            d_wte = rt.to_device(to_bf16(wte) if dtype == "bf16" else wte)
            ms = L.time(f"fold fix{sfx}, all {n} rows flagged", lambda: (f.ctl.set(ctl), f.fix(ls, P, tg, x, d_wte, DLOSS)),
                        flops=2 * n * V * C, ceiling="fp32")
            print(f"  fold fix{sfx}: {1e3 * ms / n:.2f} us a flagged row ({rt.sm_count} blocks, a row each at a time)")
            L.time(f"fold prime{sfx} (a run's first step: {min(n, rt.sm_count)} rows through the fix)",
                   lambda: f.prime(ls, P, tg, x, d_wte), flops=2 * min(n, rt.sm_count) * V * C, ceiling="fp32")
            del d_wte
        del f, P, x, tg, ls


if rt.arch == "sm_90":
    from llmc.bf16 import BF16
    from llmc.ops.gemm_wgmma import wgmma_build
    C = 768
    frng = np.random.default_rng(1)
    lnf = frng.standard_normal((N, C)).astype(np.float32)
    wte = (0.3 * frng.standard_normal((Vp, C))).astype(np.float32)
    wte[V:] = 0.0
    flops = 2 * N * Vp * C
    for dtype in DTYPES:
        L.section(dtype)
        print(f"\n## {dtype}: the lm head + classifier 7, and the fold")
        sfx = "" if dtype == "fp32" else " bf16"
        if dtype == "bf16":
            h_lnf, h_wte = to_bf16(lnf), to_bf16(wte)
            x64, w64 = from_bf16(h_lnf).astype(np.float64), from_bf16(h_wte).astype(np.float64)
        else:
            h_lnf, h_wte = lnf, wte
            x64, w64 = lnf.astype(np.float64), wte.astype(np.float64)
        d_lnf, d_wte = rt.to_device(h_lnf), rt.to_device(h_wte)
        P = rt.empty((N, Vp), BF16 if dtype == "bf16" else np.float32)
        gemm = wgmma_build(rt, "bf16" if dtype == "bf16" else "tf32", N, Vp, C, out=dtype)
        c7 = spec.build(rt, 7, dtype, N=N, V=V, Vp=Vp).launch
        fold = op_module.fold_build(rt, N, V, Vp, C, dtype)

        def pair():
            gemm(P, d_lnf, d_wte, None)
            c7(d_losses, P, d_targets, DLOSS, 1)

        def folded():
            fold.forward(P, d_lnf, d_wte)
            fold.combine(d_losses, P, d_targets, d_lnf, DLOSS)
            fold.fix(d_losses, P, d_targets, d_lnf, d_wte, DLOSS)
        folded()
        rows = 256
        ref, _ = classifier_forward_ref(x64[:rows] @ w64.T, targets[:rows], V)
        err = float(np.abs(d_losses.get()[:rows] - ref).max())
        ok = err < 2e-2  # (TF32 logits carry ~1e-3 of |logit| ~ 10; bf16's p' 2^-9 of the target's)
        print(f"  fold{sfx}: losses of the first {rows} rows within {err:.2e} of float64: {'OK' if ok else 'FAIL'}")
        if not ok:
            L.failed.append(f"fold{sfx}")
        ceiling = "tf32" if dtype == "fp32" else None
        L.time(f"lm head GEMM + classifier 7{sfx}", pair, flops=flops, ceiling=ceiling)
        L.time(f"fold: lm head GEMM + combine + fix{sfx}", folded, flops=flops, ceiling=ceiling)
        del P, d_lnf, d_wte, fold
        fold_kernels(dtype, sfx)

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("no CUDA in this torch")
    import torch.nn.functional as F
    t = torch.tensor(targets, device="cuda", dtype=torch.long)
    for dtype in DTYPES:
        L.section(dtype)
        tdt = torch.float32 if dtype == "fp32" else torch.bfloat16
        x = torch.tensor(logits[:, :V], device="cuda").to(tdt).requires_grad_(True)

        def torch_fused(x=x):
            loss = F.cross_entropy(x, t)
            torch.autograd.grad(loss, x)
        esize = 4 if dtype == "fp32" else 2
        L.reference(f"torch F.cross_entropy fwd+bwd {dtype}", torch_fused, bytes=2 * N * V * esize + 2 * N * 4)
        del x
except ImportError as e:
    print(f"WARNING: no torch reference line ({e})")

L.finish()
