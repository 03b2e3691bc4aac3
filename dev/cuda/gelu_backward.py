"""Kernel lab: gelu_backward at the trainer's shape: N = B*T*4C = 4*1024*3072 (the MLP's hidden layer),
fp32 and bf16.

    python dev/cuda/gelu_backward.py            # every variant and dtype, block-size sweep, table
    python dev/cuda/gelu_backward.py 2 --quick --dtype bf16 --batch 16
    python dev/cuda/gelu_backward.py 2 --quick --batch 16       # + the fused colsum rows (see below)

Bytes counted: each input read once, the output written once (forward 2N elements, backward 3N; 4
bytes each in fp32, 2 in bf16). bf16 rows ("2 bf16") run on bf16 copies of the inputs against the
float64 reference on those values: one rounding of the output, rtol 2^-8; atol 1e-5 of the output's
rms for the values near a zero of the function, where the fp32 math's absolute error is what's left.

The fused form (colsum=True with OC = 4C; variants that have it): "<n> colsum" also sums dinp, as
(B*T, 4C) rows, into colsum (4C) (fc's bias gradient), timed beside "<n> + bias", the plain variant
then matmul_backward_bias (its default) over the same dinp: what the model launches without the
fusion (once a layer). Both run in place, as the model does (dout is dinp); bytes counted for both
rows: the plain op's 3N plus colsum read and written, so "+ bias" shows the bias pass's N more as time.
"<n> colsum + gelu": the recompute form (the trainer's at -r 1, its default), gout = gelu(inp) written
too (4N bytes and colsum's).
"""

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.errors import VariantRefused
from llmc.ops.gelu import gelu_backward_ref, gelu_forward_ref

L = lab.Lab("gelu_backward")
B, T, C = L.args.batch or 4, 1024, 768
N = B * T * 4 * C
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

rt, rng = L.rt, np.random.default_rng(0)
x = lab.rand(rng, N, scale=2.0)
dout = lab.rand(rng, N)
data = {}  # dtype: (inputs on the device, output, float64 reference, bytes per element, atol, rtol)
for dt in ("fp32", "bf16"):
    val, up, dty = (lambda a: a, lambda a: a, np.float32) if dt == "fp32" else (round_bf16, to_bf16, BF16)
    ref = gelu_backward_ref(val(x).astype(np.float64), val(dout).astype(np.float64))
    ins = (rt.to_device(up(x)), rt.to_device(up(dout)))
    tol = (1e-5, 1e-5) if dt == "fp32" else (1e-5 * float(np.sqrt(np.mean(ref * ref))), 2.0 ** -8)
    data[dt] = (ins, rt.empty(N, dty), ref, 4 if dt == "fp32" else 2, *tol)

spec = ops.get("gelu_backward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        ins, d_out, ref, size, atol, rtol = data[dt]
        label = n if dt == "fp32" else f"{n} {dt}"
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, dt, N=N, block_size=bs).launch  # the bare closure
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(d_out, *ins)  # noqa: E731  (the model runs it in place; same bytes)
            L.validate(label, fn, outputs={"dinp": d_out}, refs={"dinp": ref}, atol=atol, rtol=rtol)
            L.time(label, fn, block_size=bs or "default", bytes=size * 3 * N, ceiling="dram")

# -- the fused form beside the unfused pair it replaces (in place, as the model runs it)
bias_spec = ops.get("matmul_backward_bias")
OC, rows = 4 * C, B * T
for n in L.selected(spec):
    if "colsum" not in spec.variants[n].options:
        continue
    for dt in L.dtypes(spec.variants[n]):
        L.section(f"colsum {dt}")
        ins, d_out, ref, size, atol, rtol = data[dt]
        val, up = (lambda a: a, lambda a: a) if dt == "fp32" else (round_bf16, to_bf16)
        cs_init = lab.rand(rng, OC)
        colsum = rt.empty(OC, np.float32 if dt == "fp32" else BF16)
        # colsum's reference: the float64 dinp's column sums; in bf16 the kernel sums its rounded dinp
        # (~sqrt(rows) 2^-9 of |dinp| over the rows): 2e-2 of the sums' rms; fp32 1e-3 (sums of ~4k rows)
        cs_ref = val(cs_init).astype(np.float64) + ref.reshape(rows, OC).sum(axis=0)
        rms = float(np.sqrt(np.mean(cs_ref ** 2)))
        cs_atol = 1e-3 * max(1.0, np.sqrt(rows / 4096)) if dt == "fp32" else 2e-2 * rms
        fused = spec.build(rt, n, dt, N=N, OC=OC, colsum=True)
        plain = spec.build(rt, n, dt, N=N)
        bias = bias_spec.build(rt, bias_spec.default_for(dt), dt, N=rows, OC=OC)
        nbytes = spec.cost(N=N, OC=OC, dtype=dt, colsum=True)[1]
        d_x, d_dout = ins
        fn = lambda: fused(d_out, colsum, d_x, d_out)  # noqa: E731  (in place: d_out holds dout first)
        fn_pair = lambda: (plain(d_out, d_x, d_out), bias(colsum, d_out))  # noqa: E731
        for label, f in ((f"{n} colsum {dt}", fn), (f"{n} + bias {bias.number} {dt}", fn_pair)):
            init = {"dinp": up(val(dout)), "colsum": up(cs_init)}  # d_out starts as dout (in place)
            L.validate(label, f, outputs={"dinp": d_out}, refs={"dinp": ref}, atol=atol, rtol=rtol, init=init)
            d_out.set(init["dinp"])  # (the launch above overwrote dout: start it over)
            L.validate(label, f, outputs={"colsum": colsum}, refs={"colsum": cs_ref}, atol=cs_atol, rtol=rtol,
                       init=init)
            # (timed in place over whatever d_out holds: the time does not depend on the values)
            L.time(label, f, bytes=nbytes, ceiling="dram")
        # the recompute form (the trainer's at -r >= 1, its default): gout = gelu(inp) written too
        fused_rc = spec.build(rt, n, dt, N=N, OC=OC, colsum=True, recompute=True)
        gout = rt.empty(N, np.float32 if dt == "fp32" else BF16)
        g_ref = gelu_forward_ref(val(x).astype(np.float64))
        g_atol = (1e-5 if dt == "fp32" else 1e-5 * float(np.sqrt(np.mean(g_ref * g_ref))))
        label = f"{n} colsum + gelu {dt}"
        f = lambda: fused_rc(d_out, colsum, gout, d_x, d_out)  # noqa: E731
        init = {"dinp": up(val(dout)), "colsum": up(cs_init)}
        for o, r, a in (("dinp", ref, atol), ("gout", g_ref, g_atol), ("colsum", cs_ref, cs_atol)):
            d_out.set(init["dinp"])  # (in place: every check starts from dout)
            L.validate(label, f, outputs={o: {"dinp": d_out, "gout": gout, "colsum": colsum}[o]}, refs={o: r},
                       atol=a, rtol=rtol, init=init)
        L.time(label, f, bytes=spec.cost(N=N, OC=OC, dtype=dt, colsum=True, recompute=True)[1], ceiling="dram")
L.finish()
