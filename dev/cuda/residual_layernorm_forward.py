"""Kernel lab: residual_layernorm_forward (fused residual add + layernorm) at N=4096 rows, C=768,
fp32 and bf16.

    python dev/cuda/residual_layernorm_forward.py        # every variant and dtype, block-size sweep, table
    python dev/cuda/residual_layernorm_forward.py 3
    python dev/cuda/residual_layernorm_forward.py 3 --dtype bf16 --batch 16

Bytes counted (the fused minimum): inp1, inp2 read once; residual, out written once; weight/bias
read, mean/rstd written (4 bytes an element in fp32; in bf16 2, except mean/rstd, fp32 in both).
Variant 1 (two launches) really moves a third more: it reads residual back. bf16 rows ("3 bf16")
run on bf16 copies of the inputs; the reference is float64 on the rounded residual bf16(inp1 + inp2),
whose layernorm the kernels compute: residual and out rounded once (rtol 2^-8; out also the fp32
math's 1e-5), mean and rstd fp32 (1e-5, 1e-5).
"""

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.errors import VariantRefused
from llmc.ops.layernorm import layernorm_forward_ref
from llmc.ops.residual_layernorm import residual_layernorm_forward_ref

L = lab.Lab("residual_layernorm_forward")
B, T, C = L.args.batch or 4, 1024, 768
N = B * T
BLOCK_SIZES = [None, 32, 64, 128, 256, 512, 1024]

rt, rng = L.rt, np.random.default_rng(0)
a = lab.rand(rng, (N, C)) + lab.rand(rng, (N, 1))
b = lab.rand(rng, (N, C))
w = 1.0 + lab.rand(rng, C, scale=0.2)
bias = lab.rand(rng, C, scale=0.2)
data = {}  # dtype: (inputs on the device, outputs, references, bytes)
r_res, r_out, r_mean, r_rstd = residual_layernorm_forward_ref(*(v.astype(np.float64) for v in (a, b, w, bias)))
data["fp32"] = ([rt.to_device(v) for v in (a, b, w, bias)],
                {"residual": rt.empty((N, C)), "out": rt.empty((N, C)), "mean": rt.empty(N), "rstd": rt.empty(N)},
                {"residual": r_res, "out": r_out, "mean": r_mean, "rstd": r_rstd}, 4 * (4 * N * C + 2 * N + 2 * C))
resid = round_bf16(round_bf16(a) + round_bf16(b))  # float32 add of the bf16 values, rounded: the kernel's residual
r_out, r_mean, r_rstd = layernorm_forward_ref(*(v.astype(np.float64) for v in (resid, round_bf16(w), round_bf16(bias))))
data["bf16"] = ([rt.to_device(to_bf16(v)) for v in (a, b, w, bias)],
                {"residual": rt.empty((N, C), BF16), "out": rt.empty((N, C), BF16), "mean": rt.empty(N), "rstd": rt.empty(N)},
                {"residual": resid, "out": r_out, "mean": r_mean, "rstd": r_rstd}, 2 * (4 * N * C + 2 * C) + 4 * 2 * N)

spec = ops.get("residual_layernorm_forward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        ins, outs, refs, nbytes = data[dt]
        label = n if dt == "fp32" else f"{n} {dt}"
        for bs in L.block_sizes(BLOCK_SIZES):
            try:
                launch = spec.build(rt, n, dt, N=N, C=C, block_size=bs).launch  # the bare closure
            except VariantRefused as e:
                print(f"  {e}")
                continue
            fn = lambda: launch(*outs.values(), *ins)  # noqa: E731
            if dt == "fp32":
                L.validate(label, fn, outputs=outs, refs=refs, atol=1e-5, rtol=1e-5)
            else:  # (two validations, the second re-runs the kernel)
                L.validate(label, fn, outputs={k: outs[k] for k in ("residual", "out")}, refs=refs,
                           atol=1e-5, rtol=2.0 ** -8)
                L.validate(label, fn, outputs={k: outs[k] for k in ("mean", "rstd")}, refs=refs,
                           atol=1e-5, rtol=1e-5)
            L.time(label, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
L.finish()
