"""Kernel lab, layernorm_backward 7's choices at GPT-2 d12's B=16 shape in bf16 (N=16384, C=768): the
options the layernorm_backward lab does not sweep (the rows of a warp strided over the grid or
consecutive; the blocks' partials summed in the same launch or by the reduce kernel; the stages of
each warp's ring; a persistent grid or more blocks than are resident), beside 5 and 6 and the plain
and colsum forms. Every configuration is validated against the float64 reference first.

    python dev/cuda/layernorm_sweep7.py --batch 16          # (--quick: 10 repeats)
    python dev/cuda/layernorm_sweep7.py --batch 4 --sets tails --quick   # one section: backward, colsum, tails, deferred

Last, the deferred form (the bf16 trainer's: 24 calls, then one flush of their column sums) in a few of
the same configurations.
"""
import numpy as np

import lab
from llmc import ops
from llmc.bf16 import round_bf16, to_bf16, BF16
from llmc.errors import VariantRefused
from llmc.ops import layernorm as ln
from llmc.ops.layernorm import layernorm_backward_ref, layernorm_forward_ref

L = lab.Lab("layernorm (variant 7 options)")
SECTIONS = L.chosen_sets(("backward", "colsum", "tails", "deferred"), ("backward", "colsum", "tails", "deferred"))
B, T, C = L.args.batch or 16, 1024, 768
N = B * T
rt, rng = L.rt, np.random.default_rng(0)
x = round_bf16(lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1)))
w = round_bf16(1.0 + lab.rand(rng, C, scale=0.2))
b = round_bf16(lab.rand(rng, C, scale=0.2))
dout = round_bf16(lab.rand(rng, (N, C)))
_, ref_mean, ref_rstd = layernorm_forward_ref(*(a.astype(np.float64) for a in (x, w, b)))
mean, rstd = ref_mean.astype(np.float32), ref_rstd.astype(np.float32)
gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
init = {"dinp": round_bf16(lab.rand(rng, (N, C))), "dweight": round_bf16(lab.rand(rng, C)),
        "dbias": round_bf16(lab.rand(rng, C)), "colsum": round_bf16(lab.rand(rng, C))}
refs = {"dinp": init["dinp"] + gi, "dweight": init["dweight"] + gw, "dbias": init["dbias"] + gb}
refs["colsum"] = init["colsum"] + refs["dinp"].sum(axis=0)
d_x, d_w, d_b, d_dout = (rt.to_device(to_bf16(a)) for a in (x, w, b, dout))
d_mean, d_rstd = rt.to_device(mean), rt.to_device(rstd)
outs = {k: rt.empty(v.shape, BF16) for k, v in init.items()}
BWD = ops.get("layernorm_backward")
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


def flag_name(f):
    return (("chunked" if f & ln.LN7_CHUNKED else "strided") + (" +reduce" if f & ln.LN7_SPLIT else "")
            + (" reset-tail" if f & ln.LN7_RESET else ""))


if "backward" in SECTIONS:
    L.section("backward")
    for n in (5, 6, 7):
        bwd_case(f"bwd {n}", BWD.build(rt, n, "bf16", N=N, C=C).launch, False)
    # (block size, stages, flags, rows per warp): persistent (rows_per_warp None) or as many blocks of R
    # consecutive rows a warp as that takes (the hardware hands them out)
    CASES = [(256, 4, 0, None), (256, 4, ln.LN7_CHUNKED, None), (384, 3, ln.LN7_SPLIT, None), (512, 2, 0, None),
             (256, 3, 0, 2), (256, 2, 0, 4), (128, 3, 0, 4), (256, 3, 0, 8), (384, 2, 0, 4), (384, 3, 0, 4),
             (384, 2, 0, 6), (384, 3, 0, 6), (512, 2, 0, 4), (384, 4, 0, 4), (384, 2, 0, 3), (384, 2, 0, 8)]
    for bs, P, f, rpw in CASES:
        try:
            bwd_case(f"bwd 7 bs{bs} P{P} {flag_name(f)}" + (f" R{rpw}" if rpw else ""),
                     ln._backward7("bf16")(rt, N, C, block_size=bs, flags=f, stages=P, rows_per_warp=rpw).launch, False)
        except VariantRefused as e:
            print(f"  {e}")
if "colsum" in SECTIONS:
    L.section("backward colsum")
    for n in (5, 7):
        bwd_case(f"bwd {n} colsum", BWD.build(rt, n, "bf16", N=N, C=C, colsum=True).launch, True)
    for bs, P, f, rpw in [(256, 3, 0, None), (256, 3, 0, 2), (256, 2, 0, 4), (128, 3, 0, 4), (384, 2, 0, 4),
                          (384, 3, 0, 4), (384, 2, 0, 6)]:
        try:
            bwd_case(f"bwd 7 colsum bs{bs} P{P} {flag_name(f)}" + (f" R{rpw}" if rpw else ""),
                     ln._backward7("bf16")(rt, N, C, block_size=bs, colsum=True, flags=f, stages=P,
                                           rows_per_warp=rpw).launch, True)
        except VariantRefused as e:
            print(f"  {e}")
# the ticketed tail: the default (the generation barrier, outputs prefetched into L2), session 34's (the
# summers wait for the count, the last resets both counters), and none: the deferred form's call alone (its
# partials left in a slot, no flush), the floor a one-launch tail can reach (session 54's polled tail, no
# ticket, was slower: branch wip/ln7-poll)
if "tails" in SECTIONS:
    L.section("backward tails")
    for colsum in (False, True):
        cs = " colsum" if colsum else ""
        for bs, P, rpw in ((384, 3, None), (384, 2, None), (384, 2, 4), (384, 3, 4), (384, 2, 3), (256, 2, 3)):
            cfg = f"bs{bs} P{P}" + (f" R{rpw}" if rpw else "")
            for f in (0, ln.LN7_RESET) if rpw is None and P == 3 else (0,):
                bwd_case(f"bwd 7{cs} {cfg} {flag_name(f)}", ln._backward7("bf16")(
                    rt, N, C, block_size=bs, colsum=colsum, flags=f, stages=P, rows_per_warp=rpw).launch, colsum)
            SLOTS = 128  # (a slot a timed call; a flush, untimed, when they run out)
            alone = ln._backward7("bf16")(rt, N, C, block_size=bs, colsum=colsum, stages=P, rows_per_warp=rpw,
                                          deferred=SLOTS)
            names = ["dinp", "dweight", "dbias"] + (["colsum"] if colsum else [])
            used = [0]

            def main_alone():
                if used[0] == SLOTS:
                    alone.flush()  # noqa: B023
                    used[0] = 0
                alone(used[0], *(outs[k] for k in names), d_dout, d_x, d_w, d_mean, d_rstd)  # noqa: B023
                used[0] += 1
            L.time(f"bwd 7{cs} {cfg} main alone (no column sums)", main_alone,
                   bytes=cs_bytes if colsum else bwd_bytes, ceiling="dram")
            alone.flush()
# the deferred form (the bf16 trainer's): 24 calls (d12's fused layernorm backwards a step), then the flush
if "deferred" in SECTIONS:
    L.section("backward colsum deferred x24 + flush")
    S = 24
    for bs, P, rpw in [(384, 3, None), (384, 2, None), (256, 3, None), (384, 2, 4), (256, 2, 4), (384, 3, 4),
                       (384, 2, 8), (512, 2, 4)]:
        label = f"bwd 7 colsum deferred bs{bs} P{P}" + (f" R{rpw}" if rpw else "")
        try:
            dfr = ln._backward7("bf16")(rt, N, C, block_size=bs, colsum=True, stages=P, rows_per_warp=rpw, deferred=S)
        except VariantRefused as e:
            print(f"  {e}")
            continue
        args = lambda: (outs["dinp"], outs["dweight"], outs["dbias"], outs["colsum"], d_dout, d_x, d_w, d_mean, d_rstd)  # noqa: E731
        one = lambda: (dfr(0, *args()), dfr.flush())  # noqa: E731
        L.validate(label, one, outputs={"dinp": outs["dinp"]}, refs=refs, atol=1e-4, rtol=2.0 ** -8, init=up)
        L.validate(label, one, outputs={"dweight": outs["dweight"], "dbias": outs["dbias"]}, refs=refs, atol=1e-3,
                   rtol=2.0 ** -8, init=up)
        outs["dinp"].set(up["dinp"])
        L.validate(label, one, outputs={"colsum": outs["colsum"]}, refs=refs, atol=cs_atol, rtol=2.0 ** -8, init=up)

        def many():
            for slot in range(S):
                dfr(slot, *args())
            dfr.flush()
        L.time(f"{label} x{S}", many, bytes=S * cs_bytes, ceiling="dram")
L.finish()
