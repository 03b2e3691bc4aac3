"""Kernel lab: attention forward at the trainer's shape, B=4, T=1024, C=768, NH=12: variant 1, the
composite (permute, q k^T, causal softmax, att v, unpermute), and variants 2, 3, the fused (flash)
kernels, in TF32 and in their bf16 builds (bf16 mma.sync m16n8k16; inp/qkvr/out bf16, lse fp32),
and variant 4, the Hopper wgmma + TMA kernel (sm_90a; bf16, and its TF32 build), with torch SDPA (fp32; bf16 with torch's
choice of backend, and FlashAttention-2's and cuDNN's forced) as reference lines.

    python dev/cuda/attention_forward.py          # default softmax variant at several causal_chunks
                                                  # (wide, narrow),
                                                  # plus softmax 4; torch lines for comparison
    python dev/cuda/attention_forward.py 5 6      # these softmax variants at the default chunking
    python dev/cuda/attention_forward.py --dtype bf16 --batch 16 --quick   # bf16 rows only (2, 3, 4), B=16

Time per call (one layer). The GEMMs run in the engine that goes with the default --matmul-kernel.
causal_chunks (wide, narrow) splits the T rows into blocks so that the GEMMs skip most of the upper
triangle ((c+1)/(2c) of the square's work with c blocks; llmc/ops/attention.py says more). The torch lines take q, k, v already split into heads (no
permutes), fp32 with TF32 allowed.
"""

import numpy as np

import lab
import llmc.ops
from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
from llmc.ops import attention as A
from llmc.testing import compare, rel_err

L = lab.Lab("attention_forward")
rt = L.rt
B, T, C, NH = L.args.batch or 4, 1024, 768, 12  # --batch
hs = C // NH
DTYPES = ("fp32", "bf16") if L.args.dtype == "both" else (L.args.dtype,)  # lab.py's --dtype
nt = -(-T // 64)
# FLOPs of the fused rows: q k^T and p v over the 64 x 64 tiles at and below the diagonal (the
# useful causal work; variant 4's 128 x 128 tiles compute ~6% more, masked, not counted)
FUSED_FLOPS = 2 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs
sm_spec = llmc.ops.get("softmax_forward")
try:
    mm = llmc.ops.get("matmul_forward").default
except KeyError:  # matmul ops not registered yet: the GEMM engine maps any number
    mm = 1

# -----------------------------------------------------------------------------
rng = np.random.default_rng(1337)
inp = lab.rand(rng, (B, T, 3 * C))
out64, qkvr64, att64 = A.attention_forward_ref(inp.astype(np.float64), NH)
d_inp = rt.to_device(inp)
d_out, d_qkvr, d_att = rt.empty((B, T, C)), rt.empty((B, T, 3 * C)), rt.empty((B, NH, T, T))

if "fp32" not in DTYPES:
    configs = []
elif L.args.variants:
    configs = [(n, A.DEFAULT_CAUSAL_CHUNKS) for n in L.selected(sm_spec)]
else:
    configs = [(sm_spec.default, c) for c in ((1, 1), (2, 2), (4, 2), (8, 2))] + [(4, A.DEFAULT_CAUSAL_CHUNKS)]

# -----------------------------------------------------------------------------
for sm, chunks in configs:
    label = f"softmax {sm}, chunks {chunks}"
    launch = A.build_attention_forward(rt, sm, mm, B=B, T=T, C=C, NH=NH, causal_chunks=chunks).launch
    fn = lambda: launch(d_out, d_qkvr, d_att, d_inp)  # noqa: E731
    # TF32 GEMMs: ~1e-3 relative on the logits; elementwise bounds set for that, rel_err printed
    L.validate(label, fn, outputs={"out": d_out, "qkvr": d_qkvr, "att": d_att},
               refs={"out": out64, "qkvr": qkvr64, "att": att64}, atol=5e-3, rtol=2e-2)
    print(f"    rel_err out {rel_err(d_out.get(), out64):.2e}  att {rel_err(d_att.get(), att64):.2e}")
    L.time(label, fn)

# attention_forward 2 and 3: the fused kernel (plus the permute into qkvr), keeping only the log-sum-exp
lse64 = A.attention_lse_ref(inp.astype(np.float64), NH)
d_lse = rt.empty((B, NH, T))
for version in (2, 3) if "fp32" in DTYPES else ():
    flash = A.build_flash_attention_forward(rt, B=B, T=T, C=C, NH=NH, version=version)
    fn = lambda: flash(d_out, d_qkvr, d_lse, d_inp)  # noqa: E731
    label = f"attention_forward {version} (flash{', cp.async' if version == 3 else ''})"
    L.validate(label, fn, outputs={"out": d_out, "qkvr": d_qkvr, "lse": d_lse},
               refs={"out": out64, "qkvr": qkvr64, "lse": lse64}, atol=5e-3, rtol=2e-2)
    print(f"    rel_err out {rel_err(d_out.get(), out64):.2e}  lse {rel_err(d_lse.get(), lse64):.2e}")
    L.time(label, fn, flops=FUSED_FLOPS, ceiling="tf32")
# attention_forward 4's fp32 build: TF32 wgmma + TMA (Hopper), v transposed first (its own row below)
if "fp32" in DTYPES and rt.arch == "sm_90":
    flash = A.build_flash_attention_forward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH)
    fn = lambda: flash(d_out, d_qkvr, d_lse, d_inp)  # noqa: E731
    label = "attention_forward 4 (flash wgmma + TMA, TF32)"
    L.validate(label, fn, outputs={"out": d_out, "qkvr": d_qkvr, "lse": d_lse},
               refs={"out": out64, "qkvr": qkvr64, "lse": lse64}, atol=5e-3, rtol=2e-2)
    print(f"    rel_err out {rel_err(d_out.get(), out64):.2e}  lse {rel_err(d_lse.get(), lse64):.2e}")
    L.time(label, fn, flops=FUSED_FLOPS, ceiling="tf32")
    # in place (the model's form with backward 4): q, k, v read from inp itself, no permute; v transposed
    # in global memory (attention_vt_kernel) or in shared memory (the _smt kernel); pingpong: the two
    # consumers taking turns issuing (the _pp kernels); persistent: one CTA per SM walking the blocks
    for smt, pp, per in ((False, False, False), (True, False, False), (False, True, False), (True, True, False),
                         (False, True, True), (True, True, True)):
        flash_ip = A.build_flash_attention_forward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True,
                                                              smem_transpose=smt, pingpong=pp, persistent=per)
        fn = lambda: flash_ip(d_out, d_inp, d_lse, d_inp)  # noqa: E731
        label = ("attention_forward 4 (flash wgmma + TMA, TF32), in place, " + ("smem" if smt else "global") + " v^T"
                 + (", pingpong" if pp else "") + (", persistent" if per else ""))
        L.validate(label, fn, outputs={"out": d_out, "lse": d_lse}, refs={"out": out64, "lse": lse64}, atol=5e-3,
                   rtol=2e-2)
        L.time(label, fn, flops=FUSED_FLOPS, ceiling="tf32")
elif "fp32" in DTYPES:
    print(f"note: attention_forward 4 (wgmma) needs an sm_90 GPU (this one is {rt.arch}); its TF32 row skipped")

# the bf16 builds of 2 and 3: inp, qkvr, out bf16, lse fp32. Inputs rounded to bf16 first, so the
# float64 reference sees what the kernel sees; p is rounded to bf16 before p v: error <= 2^-8 max|v|
# per element, plus the rounding of out (2^-8 |out|); allowed twice that (tests/test_attention.py)
inp_b = round_bf16(inp)
outb64, qkvrb64, _ = A.attention_forward_ref(inp_b.astype(np.float64), NH)
lseb64 = A.attention_lse_ref(inp_b.astype(np.float64), NH)
d_inp_b = rt.to_device(to_bf16(inp_b))
d_out_b, d_qkvr_b = rt.empty((B, T, C), BF16), rt.empty((B, T, 3 * C), BF16)
vmax = float(np.abs(inp_b[..., 2 * C:]).max())
# rows: query rows per block, 64 (the default build) or 128 (a warp owns two m-tiles, so each k, v
# fragment read from shared memory serves both: half the ldmatrix traffic per FLOP)
# version 4: the wgmma + TMA kernel (Hopper only: skipped with a note elsewhere), one row per schedule
# (llmc/ops/attention.py, build_flash_attention_forward_wgmma): "in place" reads q, k, v from inp (the
# model's training form beside backward 4: no permute); "persistent" one CTA per SM walking the blocks;
# "overlap" the next tile's q k^T issued before this tile's p v; "pingpong" the two consumers taking
# turns issuing; "N stages" the k/v ring's depth (2 unless named). The last row is the default build.
_W4_ROWS = ["", "in place", "in place, overlap", "in place, pingpong", "in place, overlap, pingpong",
            "in place, persistent", "in place, persistent, pingpong", "in place, persistent, pingpong, 4 stages",
            "in place, persistent, overlap, 4 stages", "in place, persistent, overlap, pingpong, 3 stages",
            "in place, persistent, overlap, pingpong, 5 stages", "in place, persistent, overlap, pingpong, 6 stages",
            "in place, persistent, overlap, pingpong, 4 stages"]
W4 = [(4, r or 128) for r in _W4_ROWS]
bf16_rows = [(2, 64), (3, 64), (2, 128), (3, 128)] + W4 if "bf16" in DTYPES else []
if bf16_rows and rt.arch != "sm_90":
    print(f"note: attention_forward 4 (wgmma) needs an sm_90 GPU (this one is {rt.arch}); skipped")
    bf16_rows = bf16_rows[:-len(W4)]
for version, rows in bf16_rows:
    in_place = "in place" in str(rows)
    if version == 4:
        st = [int(w.split()[0]) for w in str(rows).split(", ") if w.endswith("stages")]
        flash = A.build_flash_attention_forward_wgmma(rt, B=B, T=T, C=C, NH=NH, overlap="overlap" in str(rows),
                                                      qkv_in_place=in_place, pingpong="pingpong" in str(rows),
                                                      persistent="persistent" in str(rows),  # plain: all off
                                                      stages=st[0] if st else A.WGMMA_STAGES)
        label = f"attention_forward 4 bf16 (flash wgmma + TMA, 128 rows{'' if rows == 128 else ', ' + rows})"
    else:
        flash = A.build_flash_attention_forward(rt, B=B, T=T, C=C, NH=NH, version=version, dtype="bf16", rows=rows)
        label = f"attention_forward {version} bf16 (flash m16n8k16{', cp.async' if version == 3 else ''}, {rows} rows)"
    qkvr_b = d_inp_b if in_place else d_qkvr_b
    fn = lambda: flash(d_out_b, qkvr_b, d_lse, d_inp_b)  # noqa: E731
    for d in (d_out_b, d_lse) + (() if in_place else (d_qkvr_b,)):
        d.fill_bytes(0xFF)  # poisoned: 0xFFFF is a bf16 NaN
    fn()
    rt.synchronize()
    bad = [m for m in (compare(from_bf16(d_out_b.get()), outb64, 2 ** -7 * vmax, 2 ** -7, "out"),
                       compare(from_bf16(qkvr_b.get()), inp_b if in_place else qkvrb64, 0, 0, "qkvr"),
                       compare(d_lse.get(), lseb64, 1e-4, 1e-5, "lse")) if m]
    print(f"  {label}: " + ("MISMATCH\n" + "\n".join(bad) if bad else "all outputs match the reference (out, qkvr, lse)"))
    if bad:
        L.failed.append(label)
    print(f"    rel_err out {rel_err(from_bf16(d_out_b.get()), outb64):.2e}  lse {rel_err(d_lse.get(), lseb64):.2e}")
    L.time(label, fn, flops=FUSED_FLOPS, ceiling=None)

# the composite's data-movement pieces on their own (GB/s: bytes read + written)
if "fp32" in DTYPES:
    perm = A._build_permute(rt, "permute", B, T, 3, NH, hs)
    L.time("  permute inp -> qkvr", lambda: perm(d_qkvr, d_inp), bytes=2 * 4 * 3 * B * T * C)
if "bf16" in DTYPES:  # what the bf16 builds but 4's in-place one spend before the kernel
    perm_b = A._build_permute(rt, "permute", B, T, 3, NH, hs, "bf16")
    L.time("  permute inp -> qkvr bf16", lambda: perm_b(d_qkvr_b, d_inp_b), bytes=2 * 2 * 3 * B * T * C)
unperm = A._build_permute(rt, "unpermute", B, T, 1, NH, hs)
d_y = rt.to_device(lab.rand(rng, (B, NH, T, hs)))
L.time("  unpermute y -> out", lambda: unperm(d_out, d_y), bytes=2 * 4 * B * T * C)

try:
    import torch
    import torch.nn.functional as Fn
    torch.backends.cuda.matmul.allow_tf32 = True
    q, k, v = (torch.from_numpy(x.astype(np.float32)).cuda() for x in qkvr64.reshape(3, B, NH, T, hs))
    L.reference("torch SDPA causal (fp32, TF32 allowed)", lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=True))
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device="cuda"))

    def torch_math():
        a = (q @ k.transpose(-2, -1)) * (1.0 / hs ** 0.5)
        return torch.softmax(a.masked_fill(~mask, float("-inf")), dim=-1) @ v
    L.reference("torch math: q k^T, masked softmax, att v", torch_math)
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    # the same FLOP count as ours (only the causal half), so the TFLOP/s columns compare; torch's own choice
    # of kernel, and FlashAttention-2's and cuDNN's forced (lab.sdpa_backends)
    for label, fn in lab.sdpa_backends(torch, lambda: Fn.scaled_dot_product_attention(qb, kb, vb, is_causal=True)):
        L.reference(f"torch SDPA causal bf16 ({label})", fn, flops=FUSED_FLOPS, ceiling=None)
except Exception as e:
    print(f"WARNING: no torch reference ({e})")
L.finish()
