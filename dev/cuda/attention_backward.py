"""Kernel lab: attention backward at B=4, T=1024, C=768, NH=12: variant 1, the composite
(unpermute-backward, dv = att^T dy, datt = dy v^T, softmax backward, dq = dpreatt k, dk = dpreatt^T q,
permute-backward), and variant 2, the fused (flash) kernels that recompute att from the log-sum-exp.

    python dev/cuda/attention_backward.py         # default softmax_backward variant at several causal_chunks
                                                  # (wide, narrow), plus softmax_backward 5; torch lines
    python dev/cuda/attention_backward.py 3 6     # these softmax_backward variants, default chunking

Time per call (one layer). Inputs qkvr and att come from the float64 reference forward (rounded
to fp32), so the check isolates backward. The torch line is SDPA's backward (autograd.grad of a
causal SDPA forward done once), fp32 with TF32 allowed.
"""

import numpy as np

import lab
import llmc.ops
from llmc.ops import attention as A
from llmc.testing import rel_err

B, T, C, NH = 4, 1024, 768, 12
hs = C // NH

L = lab.Lab("attention_backward")
rt = L.rt
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
ref = A.attention_backward_ref(dout.astype(np.float64), qkvr.astype(np.float64), att.astype(np.float64), NH)
d_dout, d_qkvr, d_att = rt.to_device(dout), rt.to_device(qkvr), rt.to_device(att)
d_dinp = rt.empty((B, T, 3 * C))

# (softmax_backward variant, causal_chunks, lower_only)
if L.args.variants:
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
scale = float(np.abs(ref).max())
nt = -(-T // 64)  # 7 tile products per (query tile, key tile) pair at and below the diagonal
for version in (2, 3):
    flash = A.build_flash_attention_backward(rt, B=B, T=T, C=C, NH=NH, version=version).launch
    fn = lambda: flash(d_dinp, d_dout, d_qkvr, d_lse, d_outf)  # noqa: E731
    label = f"attention_backward {version} (flash{', cp.async' if version == 3 else ''})"
    L.validate(label, fn, outputs={"dinp": d_dinp}, refs={"dinp": ref}, atol=2e-3 * scale, rtol=2e-2)
    print(f"    rel_err dinp {rel_err(d_dinp.get(), ref):.2e}")
    L.time(label, fn, flops=7 * 2 * B * NH * (nt * (nt + 1) // 2) * 64 * 64 * hs, ceiling="tf32")

try:
    import torch
    import torch.nn.functional as Fn
    torch.backends.cuda.matmul.allow_tf32 = True
    q, k, v = (torch.from_numpy(np.ascontiguousarray(x)).cuda().requires_grad_()
               for x in qkvr.reshape(3, B, NH, T, hs))
    o = Fn.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.from_numpy(np.ascontiguousarray(dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3))).cuda()
    L.reference("torch SDPA causal backward (fp32, TF32 allowed)",
                lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
except Exception as e:
    print(f"WARNING: no torch reference ({e})")
L.finish()
