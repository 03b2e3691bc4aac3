"""Kernel lab, variant 7's choices at GPT-2 d12's B=16 shape in bf16 (N=16384, C=768): the options the
layernorm_forward/backward labs do not sweep (the rows of a warp strided over the grid or consecutive,
the blocks' partials summed in the same launch or by the reduce kernel), each block size, beside the
variants they grew from (5, 6). Every configuration is validated against the float64 reference first.

    python dev/cuda/layernorm_sweep7.py --batch 16          # (--quick: 10 repeats)
"""
import numpy as np

import lab
from llmc import ops
from llmc.bf16 import round_bf16, to_bf16, BF16
from llmc.errors import VariantRefused
from llmc.ops import layernorm as ln
from llmc.ops.layernorm import layernorm_backward_ref, layernorm_forward_ref

L = lab.Lab("layernorm (variant 7 options)")
B, T, C = L.args.batch or 16, 1024, 768
N = B * T
rt, rng = L.rt, np.random.default_rng(0)
x = round_bf16(lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1)))
w = round_bf16(1.0 + lab.rand(rng, C, scale=0.2))
b = round_bf16(lab.rand(rng, C, scale=0.2))
dout = round_bf16(lab.rand(rng, (N, C)))
ref_out, ref_mean, ref_rstd = layernorm_forward_ref(*(a.astype(np.float64) for a in (x, w, b)))
mean, rstd = ref_mean.astype(np.float32), ref_rstd.astype(np.float32)
gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
init = {"dinp": round_bf16(lab.rand(rng, (N, C))), "dweight": round_bf16(lab.rand(rng, C)),
        "dbias": round_bf16(lab.rand(rng, C)), "colsum": round_bf16(lab.rand(rng, C))}
refs = {"dinp": init["dinp"] + gi, "dweight": init["dweight"] + gw, "dbias": init["dbias"] + gb}
refs["colsum"] = init["colsum"] + refs["dinp"].sum(axis=0)
d_x, d_w, d_b, d_dout = (rt.to_device(to_bf16(a)) for a in (x, w, b, dout))
d_mean, d_rstd = rt.to_device(mean), rt.to_device(rstd)
outs = {k: rt.empty(v.shape, BF16) for k, v in init.items()}
f_outs = {"out": rt.empty((N, C), BF16), "mean": rt.empty(N), "rstd": rt.empty(N)}
FWD, BWD = ops.get("layernorm_forward"), ops.get("layernorm_backward")
fwd_bytes = FWD.cost(N=N, C=C, dtype="bf16")[1]
bwd_bytes = BWD.cost(N=N, C=C, dtype="bf16")[1]
cs_bytes = BWD.cost(N=N, C=C, dtype="bf16", colsum=True)[1]
up = {k: to_bf16(v) for k, v in init.items()}
cs_atol = 2e-2 * float(np.sqrt(np.mean(refs["colsum"] ** 2)))


def bwd_case(label, launch, colsum):
    names = ["dinp", "dweight", "dbias"] + (["colsum"] if colsum else [])
    fn = lambda: launch(*(outs[k] for k in names), d_dout, d_x, d_w, d_mean, d_rstd)  # noqa: E731
    L.validate(label, fn, outputs={"dinp": outs["dinp"]}, refs=refs, atol=1e-4, rtol=2.0 ** -8, init=up)
    L.validate(label, fn, outputs={"dweight": outs["dweight"], "dbias": outs["dbias"]}, refs=refs, atol=1e-3,
               rtol=2.0 ** -8, init=up)
    if colsum:
        outs["dinp"].set(up["dinp"])
        L.validate(label, fn, outputs={"colsum": outs["colsum"]}, refs=refs, atol=cs_atol, rtol=2.0 ** -8, init=up)
    L.time(label, fn, bytes=cs_bytes if colsum else bwd_bytes, ceiling="dram")


def fwd_case(label, launch):
    fn = lambda: launch(f_outs["out"], f_outs["mean"], f_outs["rstd"], d_x, d_w, d_b)  # noqa: E731
    L.validate(label, fn, outputs={"out": f_outs["out"]}, refs={"out": ref_out}, atol=1e-5, rtol=2.0 ** -8)
    L.validate(label, fn, outputs={"mean": f_outs["mean"], "rstd": f_outs["rstd"]},
               refs={"mean": ref_mean, "rstd": ref_rstd}, atol=1e-5, rtol=1e-5)
    L.time(label, fn, bytes=fwd_bytes, ceiling="dram")


def flag_name(f):
    return ("chunked" if f & ln.LN7_CHUNKED else "strided") + (" +reduce" if f & ln.LN7_SPLIT else "")


L.section("backward")
for n in (5, 6):
    bwd_case(f"bwd {n}", BWD.build(rt, n, "bf16", N=N, C=C).launch, False)
for bs, P, flags in ((128, 4, (0,)), (256, 3, (0,)), (256, 4, (0, ln.LN7_CHUNKED, ln.LN7_SPLIT)), (256, 6, (0,)),
                     (384, 3, (0, ln.LN7_SPLIT)), (384, 4, (0,)), (512, 3, (0, ln.LN7_SPLIT)), (512, 2, (0,))):
    for f in flags:
        try:
            bwd_case(f"bwd 7 bs{bs} P{P} {flag_name(f)}",
                     ln._backward7("bf16")(rt, N, C, block_size=bs, flags=f, stages=P).launch, False)
        except VariantRefused as e:
            print(f"  {e}")
L.section("backward colsum")
bwd_case("bwd 5 colsum", BWD.build(rt, 5, "bf16", N=N, C=C, colsum=True).launch, True)
for bs, P, flags in ((128, 4, (0,)), (256, 3, (0,)), (256, 4, (0, ln.LN7_SPLIT)), (384, 3, (0,)), (384, 4, (0,))):
    for f in flags:
        try:
            bwd_case(f"bwd 7 colsum bs{bs} P{P} {flag_name(f)}",
                     ln._backward7("bf16")(rt, N, C, block_size=bs, colsum=True, flags=f, stages=P).launch, True)
        except VariantRefused as e:
            print(f"  {e}")
L.section("forward")
for n in (4, 5, 6):
    fwd_case(f"fwd {n}", FWD.build(rt, n, "bf16", N=N, C=C).launch)
for bs in (128, 256, 512, 1024):
    for f in (0, ln.LN7_CHUNKED):
        try:
            fwd_case(f"fwd 7 bs{bs} {flag_name(f)}", ln._forward7("bf16")(rt, N, C, block_size=bs, flags=f))
        except VariantRefused as e:
            print(f"  {e}")
L.finish()
