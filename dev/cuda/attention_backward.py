"""Kernel lab: attention backward at B=4, T=1024, C=768, NH=12: variant 1, the composite
(unpermute-backward, dv = att^T dy, datt = dy v^T, softmax backward, dq = dpreatt k, dk = dpreatt^T q,
permute-backward), and variants 2, 3, the fused (flash) kernels that recompute att from the log-sum-exp,
in TF32 and in their bf16 builds (bf16 mma.sync m16n8k16; lse and D fp32), variant 4 (bf16 only, the
fused kernels on Hopper wgmma + TMA; sm_90 GPUs), with torch SDPA's backward (fp32; bf16 with torch's
choice of backend, and FlashAttention-2's and cuDNN's forced) as reference lines.

    python dev/cuda/attention_backward.py         # default softmax_backward variant at several causal_chunks
                                                  # (wide, narrow), plus softmax_backward 5; torch lines
    python dev/cuda/attention_backward.py 3 6     # these softmax_backward variants, default chunking
    python dev/cuda/attention_backward.py --dtype bf16 --batch 16   # bf16 rows only (2, 3, 4 and torch), B=16

Time per call (one layer). Inputs qkvr and att come from the float64 reference forward (rounded
to fp32), so the check isolates backward. The torch line is SDPA's backward (autograd.grad of a
causal SDPA forward done once), fp32 with TF32 allowed.
"""

import numpy as np

import lab
import llmc.ops
from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
from llmc.ops import attention as A
from llmc.testing import rel_err


L = lab.Lab("attention_backward")
rt = L.rt
B, T, C, NH = L.args.batch or 4, 1024, 768, 12  # --batch
DTYPES = ("fp32", "bf16") if L.args.dtype == "both" else (L.args.dtype,)  # lab.py's --dtype
hs = C // NH
sm_spec = llmc.ops.get("softmax_backward")
try:
    mm = llmc.ops.get("matmul_backward").default
except KeyError:
    mm = 1

# -----------------------------------------------------------------------------
rng = np.random.default_rng(1337)
inp = lab.rand(rng, (B, T, 3 * C))
out64, qkvr64, att64 = A.attention_forward_ref(inp.astype(np.float64), NH)
qkvr, att = qkvr64.astype(np.float32), att64.astype(np.float32)
dout = lab.rand(rng, (B, T, C))
ref = (A.attention_backward_ref(dout.astype(np.float64), qkvr.astype(np.float64), att.astype(np.float64), NH)
       if "fp32" in DTYPES else None)
d_dout, d_qkvr, d_att = rt.to_device(dout), rt.to_device(qkvr), rt.to_device(att)
d_dinp = rt.empty((B, T, 3 * C))

# (softmax_backward variant, causal_chunks, lower_only)
if "fp32" not in DTYPES:
    configs = []
elif L.args.variants:
    configs = [(n, A.DEFAULT_CAUSAL_CHUNKS, True) for n in L.selected(sm_spec)]
else:
    configs = ([(sm_spec.default, c, True) for c in ((1, 1), (2, 2), (4, 2), (4, 4), (8, 2))]
               + [(sm_spec.default, A.DEFAULT_CAUSAL_CHUNKS, False), (5, A.DEFAULT_CAUSAL_CHUNKS, True)])

# -----------------------------------------------------------------------------
for sm, chunks, lower in configs:
    label = f"softmax_bwd {sm}{' lower-only' if lower and sm == 6 else ''}, chunks {chunks}"
    launch = A.build_attention_backward(rt, sm, mm, B=B, T=T, C=C, NH=NH, causal_chunks=chunks, lower_only=lower).launch
    fn = lambda: launch(d_dinp, d_dout, d_qkvr, d_att)  # noqa: E731
    scale = float(np.abs(ref).max())  # dinp entries vary a lot in size: atol relative to the largest
    L.validate(label, fn, outputs={"dinp": d_dinp}, refs={"dinp": ref}, atol=2e-3 * scale, rtol=2e-2)
    print(f"    rel_err dinp {rel_err(d_dinp.get(), ref):.2e}")
    L.time(label, fn)

# attention_backward 2 and 3: the fused kernels (dq + D, then dk dv), from the log-sum-exp and out
lse = A.attention_lse_ref(inp.astype(np.float64), NH).astype(np.float32)
d_lse, d_outf = rt.to_device(lse), rt.to_device(out64.astype(np.float32))
nt = -(-T // 64)  # 7 tile products per (query tile, key tile) pair at and below the diagonal
for version in ((2, 3) if "fp32" in DTYPES else ()):
    scale = float(np.abs(ref).max())
    flash = A.build_flash_attention_backward(rt, B=B, T=T, C=C, NH=NH, version=version).launch
    fn = lambda: flash(d_dinp, d_dout, d_qkvr, d_lse, d_outf)  # noqa: E731
    label = f"attention_backward {version} (flash{', cp.async' if version == 3 else ''})"
    L.validate(label, fn, outputs={"dinp": d_dinp}, refs={"dinp": ref}, atol=2e-3 * scale, rtol=2e-2)
    print(f"    rel_err dinp {rel_err(d_dinp.get(), ref):.2e}")
    L.time(label, fn, flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling="tf32")
# attention_backward 4's fp32 build: TF32 wgmma + TMA (Hopper), k, q, dout transposed first
if "fp32" in DTYPES and rt.arch == "sm_90":
    scale = float(np.abs(ref).max())
    flash = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH).launch
    fn = lambda: flash(d_dinp, d_dout, d_qkvr, d_lse, d_outf)  # noqa: E731
    label = "attention_backward 4 (flash wgmma + TMA, TF32)"
    L.validate(label, fn, outputs={"dinp": d_dinp}, refs={"dinp": ref}, atol=2e-3 * scale, rtol=2e-2)
    print(f"    rel_err dinp {rel_err(d_dinp.get(), ref):.2e}")
    L.time(label, fn, flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling="tf32")
    # in place (the model's form): q, k, v read from the forward's inp (B,T,3C) itself; and both forms
    # with k, q, dout transposed in global memory by attention_vt_kernel instead of in shared memory
    d_inpf = rt.to_device(inp.astype(np.float32))
    for in_place, smt in ((True, True), (False, False), (True, False)):
        flash_ip = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=in_place,
                                                               smem_transpose=smt).launch
        q_in = d_inpf if in_place else d_qkvr
        fn = lambda: flash_ip(d_dinp, d_dout, q_in, d_lse, d_outf)  # noqa: E731
        label = ("attention_backward 4 (flash wgmma + TMA, TF32)" + (", in place" if in_place else "")
                 + ("" if smt else ", global transposes"))
        L.validate(label, fn, outputs={"dinp": d_dinp}, refs={"dinp": ref}, atol=2e-3 * scale, rtol=2e-2)
        L.time(label, fn, flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling="tf32")
    # the colsum form (the fp32 trainer's: qkv's bias gradient summed as dqkv is stored) against the pair
    # it replaces, 4 then matmul_backward_bias 4 re-reading dqkv; the check: dbias against float64 column
    # sums of the dinp the same launch wrote (fp32 sums: 2^-20 of the sum of magnitudes allowed)
    ip4 = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True).launch
    cs4 = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, colsum=True)
    bias4f = llmc.ops.get("matmul_backward_bias").build(rt, 4, "fp32", N=B * T, OC=3 * C).launch
    bias0f = np.random.default_rng(1).standard_normal(3 * C).astype(np.float32)
    d_biasf = rt.to_device(bias0f)
    d_dinp.fill_bytes(0xFF)
    for x in cs4.scratch.values():
        x.fill_bytes(0xFF)
    cs4.launch(d_dinp, d_biasf, d_dout, d_inpf, d_lse, d_outf)
    rt.synchronize()
    rows = d_dinp.get().reshape(B * T, 3 * C).astype(np.float64)
    err = np.abs(d_biasf.get() - (bias0f + rows.sum(axis=0)))
    ok = np.isfinite(rows).all() and np.all(err <= 2.0 ** -20 * (np.abs(bias0f) + np.abs(rows).sum(axis=0)))
    print(f"  attention_backward 4 tf32 colsum: {'OK' if ok else 'MISMATCH'}  dbias max err {err.max():.2e} "
          f"(exact column sums of the dinp written)")
    if not ok:
        L.failed.append("attention_backward 4 tf32 colsum")
    L.time("attention_backward 4 TF32 in place + matmul_backward_bias 4 (the pair)",
           lambda: (ip4(d_dinp, d_dout, d_inpf, d_lse, d_outf), bias4f(d_biasf, d_dinp)),
           flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling="tf32")
    L.time("attention_backward 4 TF32 in place, colsum (qkv's bias summed as dinp is stored)",
           lambda: cs4.launch(d_dinp, d_biasf, d_dout, d_inpf, d_lse, d_outf),
           flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling="tf32")
    L.time("  matmul_backward_bias 4 fp32 alone (the pass it replaces)", lambda: bias4f(d_biasf, d_dinp),
           bytes=4 * B * T * 3 * C + 4 * 3 * C, ceiling="dram")

# the bf16 builds of 2 and 3: dinp, dout, qkvr, out bf16; lse and the scratch D fp32. Inputs are
# bf16 values, out and lse the exact forward's (out rounded to bf16): the check isolates backward.
# p and ds are rounded to bf16 before the position products: each part of dinp is checked
# norm-wise against the larger of its norm and a tenth of dinp's: a plain float64 backward with the
# same bf16 roundings measures ~2.5e-3 there; allowed 2^-7 (tests/test_attention.py says more)
inp_b = round_bf16(inp)
outb64, qkvrb64, attb64 = A.attention_forward_ref(inp_b.astype(np.float64), NH)
dout_b = round_bf16(dout)
refb = A.attention_backward_ref(dout_b.astype(np.float64), qkvrb64, attb64, NH)
d_lse_b = rt.to_device(A.attention_lse_ref(inp_b.astype(np.float64), NH).astype(np.float32))
d_dout_b, d_qkvr_b, d_out_b = (rt.to_device(to_bf16(x)) for x in (dout_b, qkvrb64, outb64))
d_dinp_b = rt.empty((B, T, 3 * C), BF16)
for version in ((2, 3) if "bf16" in DTYPES else ()):
    built = A.build_flash_attention_backward(rt, B=B, T=T, C=C, NH=NH, version=version, dtype="bf16")
    flash_b = built.launch
    fn = lambda: flash_b(d_dinp_b, d_dout_b, d_qkvr_b, d_lse_b, d_out_b)  # noqa: E731
    label = f"attention_backward {version} bf16 (flash m16n8k16{', cp.async' if version == 3 else ''})"
    d_dinp_b.fill_bytes(0xFF)
    for x in built.scratch.values():
        x.fill_bytes(0xFF)
    fn()
    rt.synchronize()
    got = from_bf16(d_dinp_b.get())
    errs = []
    for i, part in enumerate(("dq", "dk", "dv")):
        g_, w_ = got[..., i * C:(i + 1) * C], refb[..., i * C:(i + 1) * C]
        errs.append(np.linalg.norm(g_ - w_) / max(np.linalg.norm(w_), 0.1 * np.linalg.norm(refb)))
    ok = np.isfinite(got).all() and max(errs) < 2 ** -7
    print(f"  {label}: {'OK' if ok else 'MISMATCH'}  rel err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}"
          f"{'' if np.isfinite(got).all() else ' (unwritten NaN elements)'}")
    if not ok:
        L.failed.append(label)
    L.time(label, fn, flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling=None)

# attention_backward 4: the same kernels on Hopper wgmma + TMA, bf16 only (sm_90a), the same inputs and
# check. Its tiles are 128 x 128: FLOPs counted on the tiles it computes (7 products per tile pair at
# and below the diagonal, the diagonal tiles whole), so its TFLOP/s is not on the 64-tile rows' basis:
# compare the times (the 128-tile count is ~6% more work than the 64-tile one at T=1024).
# "in place": the build the model trains with (q, k, v read from the qkv matmul's (B,T,3C) output, the
# forward's inp, through a 4D tensor map: the _btc kernels)
d_inp_b = rt.to_device(to_bf16(inp_b))
nt4 = -(-T // 128)
flops4 = 7 * 2 * B * NH * (nt4 * (nt4 + 1) // 2) * 128 * 128 * hs


def check_and_time_wgmma(label, built, qkv, bit_stable_dq=True):
    """Poison dinp and the build's scratch, run once: each part against the float64 reference (2^-7
    allowed, as for 2, 3); a second run: the same bits (dk, dv only where dq's sums have no fixed
    order, variant 5, which prints whether dq came out the same anyway); then the timed rows."""
    fn = lambda: built.launch(d_dinp_b, d_dout_b, qkv, d_lse_b, d_out_b)  # noqa: E731
    d_dinp_b.fill_bytes(0xFF)
    for x in built.scratch.values():
        x.fill_bytes(0xFF)
    fn()
    rt.synchronize()
    got = from_bf16(d_dinp_b.get())
    errs = []
    for i, part in enumerate(("dq", "dk", "dv")):
        g_, w_ = got[..., i * C:(i + 1) * C], refb[..., i * C:(i + 1) * C]
        errs.append(np.linalg.norm(g_ - w_) / max(np.linalg.norm(w_), 0.1 * np.linalg.norm(refb)))
    fn()
    rt.synchronize()
    again = from_bf16(d_dinp_b.get())
    lo = 0 if bit_stable_dq else C  # the part that must come out the same
    same = np.array_equal(again[..., lo:], got[..., lo:])
    ok = np.isfinite(got).all() and max(errs) < 2 ** -7 and same
    print(f"  {label}: {'OK' if ok else 'MISMATCH'}  rel err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}"
          f"{'' if np.isfinite(got).all() else ' (unwritten NaN elements)'}{'' if same else ' (not deterministic)'}"
          + ("" if bit_stable_dq else f"; dq bit-stable over two runs: {np.array_equal(again[..., :C], got[..., :C])}"))
    if not ok:
        L.failed.append(label)
    L.time(label, fn, flops=flops4, ceiling=None)


# ("in place, pingpong": both kernels' consumers taking turns issuing their products)
for form in (("plain", "dq overlap", "in place", "in place, pingpong") if "bf16" in DTYPES and rt.arch == "sm_90"
             else ()):
    built = A.build_flash_attention_backward_wgmma(rt, B=B, T=T, C=C, NH=NH, overlap=form == "dq overlap",
                                                   qkv_in_place="in place" in form, pingpong="pingpong" in form)
    check_and_time_wgmma(f"attention_backward 4 bf16 (flash wgmma + TMA{'' if form == 'plain' else ', ' + form})",
                         built, d_inp_b if "in place" in form else d_qkvr_b)
# attention_backward 5: 4's dk/dv kernel also forming dq per tile pair, added by fp32 reductions into a
# buffer (5 products per tile pair; dq's sums in no fixed order: not bit-stable from run to run), with
# a D / zeroing pass before and a conversion pass after. FLOPs on 4's 7-product basis (the times compare).
# "main zeroes": the main kernel zeroes each head's accumulator rows just before its reductions (prep
# only writes D)
FORMS5 = ("plain", "in place, pingpong", "in place, pingpong, main zeroes")
for form in (FORMS5 if "bf16" in DTYPES and rt.arch == "sm_90" else ()):
    built = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place="in place" in form,
                                                    main_zeroes="main zeroes" in form)
    qkv5 = d_inp_b if "in place" in form else d_qkvr_b
    check_and_time_wgmma(f"attention_backward 5 bf16 (dq by reductions{'' if form == 'plain' else ', ' + form})",
                         built, qkv5, bit_stable_dq=False)
    if "in place" in form:  # its three launches alone: the main kernel, and the two passes against a copy
        for name, f in built.info["passes"].items():
            zeros = 0 if built.info["main_zeroes"] else 4 * B * T * C
            nbytes = {"prep": 2 * 2 * B * T * C + zeros + 4 * B * NH * T,  # dout, out; zeros; D
                      "convert": 4 * B * T * C + 2 * B * T * C}.get(name)          # dq fp32 in, bf16 out
            mz = ", main zeroes" if built.info["main_zeroes"] else ""
            L.time(f"  attention_backward 5 bf16{mz}, {name} alone",
                   lambda f=f: f(d_dinp_b, d_dout_b, qkv5, d_lse_b, d_out_b),
                   bytes=nbytes, flops=None if nbytes else 5 * 2 * B * NH * (nt4 * (nt4 + 1) // 2) * 128 * 128 * hs,
                   ceiling="dram" if nbytes else None)
# attention_backward 5's colsum form (the bf16 trainer's: qkv's bias gradient summed as dqkv is written)
# against the pair it replaces, 5 then matmul_backward_bias 4 re-reading dqkv; the check: dbias against
# float64 column sums of the dinp the same launch wrote (one bf16 rounding of the total allowed)
if "bf16" in DTYPES and rt.arch == "sm_90":
    plain5 = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    cs5 = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, colsum=True)
    cs5z = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, colsum=True,
                                                   main_zeroes=not cs5.info["main_zeroes"])
    bias4 = llmc.ops.get("matmul_backward_bias").build(rt, 4, "bf16", N=B * T, OC=3 * C).launch
    bias0 = round_bf16(np.random.default_rng(1).standard_normal(3 * C) * 0.1)
    d_bias = rt.to_device(to_bf16(bias0))
    d_dinp_b.fill_bytes(0xFF)
    for x in cs5.scratch.values():
        x.fill_bytes(0xFF)
    cs5.launch(d_dinp_b, d_bias, d_dout_b, d_inp_b, d_lse_b, d_out_b)
    rt.synchronize()
    rows = from_bf16(d_dinp_b.get()).reshape(B * T, 3 * C).astype(np.float64)
    exact = bias0 + rows.sum(axis=0)
    err = np.abs(from_bf16(d_bias.get()) - exact)
    ok = np.isfinite(rows).all() and np.all(err <= 2.0 ** -8 * np.abs(exact) + 2.0 ** -16 * np.abs(rows).sum(axis=0))
    print(f"  attention_backward 5 bf16 colsum: {'OK' if ok else 'MISMATCH'}  dbias max err {err.max():.2e} "
          f"(exact column sums of the dinp written)")
    if not ok:
        L.failed.append("attention_backward 5 bf16 colsum")
    L.time("attention_backward 5 bf16 in place + matmul_backward_bias 4 (the pair)",
           lambda: (plain5.launch(d_dinp_b, d_dout_b, d_inp_b, d_lse_b, d_out_b), bias4(d_bias, d_dinp_b)),
           flops=flops4, ceiling=None)
    L.time("attention_backward 5 bf16 in place, colsum (qkv's bias summed as dinp is written)",
           lambda: cs5.launch(d_dinp_b, d_bias, d_dout_b, d_inp_b, d_lse_b, d_out_b), flops=flops4, ceiling=None)
    L.time(f"attention_backward 5 bf16 in place, colsum, main_zeroes={cs5z.info['main_zeroes']}",
           lambda: cs5z.launch(d_dinp_b, d_bias, d_dout_b, d_inp_b, d_lse_b, d_out_b), flops=flops4, ceiling=None)
    L.time("  matmul_backward_bias 4 bf16 alone (the pass it replaces)", lambda: bias4(d_bias, d_dinp_b),
           bytes=2 * B * T * 3 * C + 4 * 3 * C, ceiling="dram")
    for name in ("main", "convert", "finish"):
        nbytes = {"convert": 4 * B * T * C + 2 * B * T * C, "finish": cs5.scratch["part"].nbytes + 4 * 3 * C}.get(name)
        f = cs5.info["passes"][name]
        L.time(f"  attention_backward 5 bf16 colsum, {name} alone",
               lambda f=f: f(d_dinp_b, d_bias, d_dout_b, d_inp_b, d_lse_b, d_out_b), bytes=nbytes,
               flops=None if nbytes else 5 * 2 * B * NH * (nt4 * (nt4 + 1) // 2) * 128 * 128 * hs,
               ceiling="dram" if nbytes else None)
if "bf16" in DTYPES and rt.arch != "sm_90":
    print(f"attention_backward 4, 5 skipped: they need an sm_90 GPU (this one is {rt.arch})")

try:
    import torch
    import torch.nn.functional as Fn
    torch.backends.cuda.matmul.allow_tf32 = True
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x)).cuda().requires_grad_()
               for x in qkvr.reshape(3, B, NH, T, hs))
    o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.from_numpy(np.ascontiguousarray(dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3))).cuda()
    if "fp32" in DTYPES:
        L.reference("torch SDPA causal backward (fp32, TF32 allowed)",
                    lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
    qb, kb, vb = (x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    gb = g.to(torch.bfloat16)
    # FLOPs counted as ours (the 5 products FlashAttention-2 does, plus our 2 recomputed ones: q k^T
    # and dout v^T run in both of our kernels), so the TFLOP/s columns compare times directly
    # each backend's backward runs on the forward that backend made (its saved tensors are its own)
    def sdpa_bwd():
        ob = Fn.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        return lambda: torch.autograd.grad(ob, (qb, kb, vb), gb, retain_graph=True)
    backends = lab.sdpa_backends(torch, sdpa_bwd)  # (named by the kernels of the forward: the same backend)
    for label, make in backends:
        L.reference(f"torch SDPA causal backward bf16 ({label})", make(),
                    flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling=None)
except Exception as e:
    print(f"WARNING: no torch reference ({e})")
L.finish()
