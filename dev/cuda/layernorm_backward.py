"""Kernel lab: layernorm_backward at the trainer's shape (N=4096 rows, C=768), fp32 and bf16.

    python dev/cuda/layernorm_backward.py           # every variant and dtype, block-size sweep, table
    python dev/cuda/layernorm_backward.py 3 4
    python dev/cuda/layernorm_backward.py 5 --dtype bf16 --batch 16
    python dev/cuda/layernorm_backward.py 5 6 --dtype bf16 --batch 16 --quick  # 6: persistent warps
    python dev/cuda/layernorm_backward.py 5 --batch 16 --quick   # + the fused colsum rows (see below)

Bytes counted: dout, inp read once; dinp (+=) read and written once; weight, mean, rstd read once;
dweight, dbias (+=) read and written once (4 bytes an element in fp32; in bf16 2, except mean/rstd,
fp32 in both). The deterministic variants' fp32 scratch is not counted. bf16 rows ("5 bf16") run on
bf16 copies of the inputs (and of the "+=" outputs' initial values) against the float64 reference on
those values: each output element rounded once, rtol 2^-8 over the fp32 tolerances below.
Timed repeats keep accumulating into the outputs (the values don't matter to the time).

The fused form (colsum=True; variants that have it): "<n> colsum" also sums the dinp it writes into
colsum (C) (the next linear layer's bias gradient), timed beside "<n> + bias", the plain variant then
matmul_backward_bias (its default) over the same dinp: what the model launches without the fusion.
The difference is what the fusion saves per layernorm backward (3 of them a layer in the model, 2 of
which replace a bias pass). Bytes counted for both rows: the plain op's plus colsum (C) read and
written; "+ bias" moves N*C more (the bias pass's read of dinp) in the same time budget.
Variant 7's deferred form (deferred=S, the model's): "7 colsum deferred x24 + flush" is 24 calls
into their own slots then one flush of their column sums, beside "7 colsum x24", 24 ticketed calls:
a step's worth of d12's fused layernorm backwards each way (bytes: 24 calls' count), each call on
tensors of its own as a layer's are, against 24 copies of one call's bytes (each between buffers of
its own) back to back; and "deferred, one call", a call alone with its sums left for the flush (the
flush reads G x 3 x C fp32 partials a slot, not counted).
"""

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.errors import VariantRefused
from llmc.ops.layernorm import layernorm_backward_ref, layernorm_forward_ref

L = lab.Lab("layernorm_backward")
B, T, C = L.args.batch or 4, 1024, 768
N = B * T
BLOCK_SIZES = [None, 32, 64, 128, 256, 512, 1024]

rt, rng = L.rt, np.random.default_rng(0)
x = lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1))
w = 1.0 + lab.rand(rng, C, scale=0.2)
b = lab.rand(rng, C, scale=0.2)
dout = lab.rand(rng, (N, C))
init32 = {"dinp": lab.rand(rng, (N, C)), "dweight": lab.rand(rng, C), "dbias": lab.rand(rng, C)}
data = {}  # dtype: (inputs on the device, outputs, initial values, references, bytes)
for dt in ("fp32", "bf16"):
    val, up, dty, size = (lambda a: a, lambda a: a, np.float32, 4) if dt == "fp32" else (round_bf16, to_bf16, BF16, 2)
    xv, wv, bv, dv = (val(a) for a in (x, w, b, dout))
    _, mean, rstd = (a.astype(np.float32) for a in layernorm_forward_ref(xv, wv, bv))
    gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dv, xv, wv, mean, rstd)))
    init = {k: val(v) for k, v in init32.items()}
    refs = {"dinp": init["dinp"] + gi, "dweight": init["dweight"] + gw, "dbias": init["dbias"] + gb}
    ins = [rt.to_device(up(a)) for a in (dout, x, w)] + [rt.to_device(mean), rt.to_device(rstd)]
    outs = {k: rt.empty(v.shape, dty) for k, v in init32.items()}
    data[dt] = (ins, outs, {k: up(v) for k, v in init32.items()}, refs, size * (4 * N * C + 5 * C) + 4 * 2 * N)

spec = ops.get("layernorm_backward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        ins, outs, init, refs, nbytes = data[dt]
        label = n if dt == "fp32" else f"{n} {dt}"
        rtol = 1e-4 if dt == "fp32" else 2.0 ** -8
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, dt, N=N, C=C, block_size=bs).launch  # the bare closure
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(outs["dinp"], outs["dweight"], outs["dbias"], *ins)  # noqa: E731
            # dweight/dbias sum 4096 rows in fp32 onto partial sums of up to ~60: sequential (variant 1's
            # atomics) that rounds to ~1e-4 typically, a few e-4 at worst (one element of variant 1 was
            # 1.7e-4 off in one run), so 1e-3 absolute here; dinp stays at 1e-4
            # (two validations, each from the initial values: the second re-runs the kernel)
            L.validate(label, fn, outputs={"dinp": outs["dinp"]}, refs=refs, atol=1e-4, rtol=rtol, init=init)
            L.validate(label, fn, outputs={"dweight": outs["dweight"], "dbias": outs["dbias"]}, refs=refs,
                       atol=1e-3, rtol=rtol, init=init)
            L.time(label, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
            if n == 1:
                break  # the contended-atomics baseline is slow at every block size; one is enough

# -- the fused form beside the unfused pair it replaces
bias_spec = ops.get("matmul_backward_bias")
for n in L.selected(spec):
    if "colsum" not in spec.variants[n].options:
        continue
    for dt in L.dtypes(spec.variants[n]):
        L.section(f"colsum {dt}")
        ins, outs, init, refs, _ = data[dt]
        val, up, dty = (lambda a: a, lambda a: a, np.float32) if dt == "fp32" else (round_bf16, to_bf16, BF16)
        cs_init = lab.rand(rng, C)
        colsum = rt.empty(C, dty)
        # colsum's reference: the float64 dinp's column sums (bf16: the kernel sums its rounded dinp, so
        # ~sqrt(N) 2^-9 of a row's |dinp| over the rows; 2e-2 of the sums' rms covers it)
        cs_ref = val(cs_init).astype(np.float64) + refs["dinp"].sum(axis=0)
        rms = float(np.sqrt(np.mean(cs_ref ** 2)))
        cs_atol = 1e-3 * max(1.0, np.sqrt(N / 4096)) if dt == "fp32" else 2e-2 * rms
        rtol = 1e-4 if dt == "fp32" else 2.0 ** -8
        fused = spec.build(rt, n, dt, N=N, C=C, colsum=True)
        plain = spec.build(rt, n, dt, N=N, C=C)
        bias = bias_spec.build(rt, bias_spec.default_for(dt), dt, N=N, OC=C)
        nbytes = spec.cost(N=N, C=C, dtype=dt, colsum=True)[1]
        fn = lambda: fused(outs["dinp"], outs["dweight"], outs["dbias"], colsum, *ins)  # noqa: E731
        fn_pair = lambda: (plain(outs["dinp"], outs["dweight"], outs["dbias"], *ins), bias(colsum, outs["dinp"]))  # noqa: E731
        for label, f in ((f"{n} colsum {dt}", fn), (f"{n} + bias {bias.number} {dt}", fn_pair)):
            L.validate(label, f, outputs={"dinp": outs["dinp"]}, refs=refs, atol=1e-4, rtol=rtol, init=init)
            outs["dinp"].set(init["dinp"])  # (colsum sums dinp after this launch's +=: start it over)
            L.validate(label, f, outputs={"colsum": colsum}, refs={"colsum": cs_ref}, atol=cs_atol, rtol=rtol,
                       init={"colsum": up(cs_init)})
            L.time(label, f, bytes=nbytes, ceiling="dram")
        if "deferred" not in spec.variants[n].options:
            continue
        # the deferred form (what the model launches): S calls, then one flush of their column sums;
        # timed as 24 calls (d12's fused layernorm backwards a step) + the flush, beside 24 ticketed calls
        S = 24
        dfr = spec.build(rt, n, dt, N=N, C=C, colsum=True, deferred=S)
        one = lambda: (dfr(0, outs["dinp"], outs["dweight"], outs["dbias"], colsum, *ins), dfr.flush())  # noqa: E731
        label = f"{n} colsum deferred {dt}"
        L.validate(label, one, outputs={"dinp": outs["dinp"]}, refs=refs, atol=1e-4, rtol=rtol, init=init)
        L.validate(label, one, outputs={"dweight": outs["dweight"], "dbias": outs["dbias"]}, refs=refs,
                   atol=1e-3, rtol=rtol, init=init)
        outs["dinp"].set(init["dinp"])
        L.validate(label, one, outputs={"colsum": colsum}, refs={"colsum": cs_ref}, atol=cs_atol, rtol=rtol,
                   init={"colsum": up(cs_init)})

        # one call alone, as each of the model's: its dinp written, its sums left in a slot for the flush
        # (a slot a timed call; the flush, untimed, when they run out)
        SL = 128
        dfr1 = spec.build(rt, n, dt, N=N, C=C, colsum=True, deferred=SL)
        used = [0]

        def one_call():
            if used[0] == SL:
                dfr1.flush()  # noqa: B023
                used[0] = 0
            dfr1(used[0], outs["dinp"], outs["dweight"], outs["dbias"], colsum, *ins)  # noqa: B023
            used[0] += 1
        L.time(f"{n} colsum deferred {dt}, one call (its sums left for the flush)", one_call, bytes=nbytes,
               ceiling="dram")
        dfr1.flush()
        del dfr1
        # as the model runs them: each call on tensors of its own (a layer's: dinp, dout, inp, mean, rstd,
        # weight and its sums), so the L2 holds little of one call's bytes for the next; against S copies
        # of one call's bytes, each between buffers of its own
        calls = [[rt.to_device(a.get()) for a in (outs["dinp"], outs["dweight"], outs["dbias"], colsum, *ins)]
                 for _ in range(S)]

        def many():
            for slot, args in enumerate(calls):
                dfr(slot, *args)
            dfr.flush()
        L.time(f"{label} x{S} + flush", many, bytes=S * nbytes, ceiling="dram", copies=S)
        L.time(f"{n} colsum {dt} x{S}", lambda: [fused(*args) for args in calls], bytes=S * nbytes,
               ceiling="dram", copies=S)
        del calls
L.finish()
