"""Kernel lab: matmul_backward_bias, dbias (OC) += column sums of dout (N, OC), at the trainer's shapes
(N = B*T = 4096 rows by default; OC = 768, 2304, 3072: the attproj/fcproj, qkv and fc biases).

    python dev/cuda/matmul_backward_bias.py       # every variant, table
    python dev/cuda/matmul_backward_bias.py 4     # one variant
    python dev/cuda/matmul_backward_bias.py 4 5 --batch 16   # N = 16 * 1024

Variant 5 (clusters, sm_90) is timed at its default width ("5", 8 16-byte column lanes a block) and
at 4 lanes ("5/l4"); variant 4 with its default chunks (>= 128 rows) and with chunks of >= 32 and >= 64 rows
("4/r32", "4/r64": more partials for the finishing block to add).

Reads N*OC floats once (the bytes of the op's cost model): judged in GB/s against 2.98 TB/s.
bf16 rows ("4 bf16 OC=..."): the bf16 build (dout and dbias bf16, fp32 sums, one rounding) reads N*OC
bf16 = half the bytes; the target for bf16 memory-bound kernels is >= 85% of the copy ceiling.
"""
import numpy as np

import lab
import llmc.ops

L = lab.Lab("matmul_backward_bias")
rt, rng = L.rt, np.random.default_rng(0)
spec = llmc.ops.get("matmul_backward_bias")
B, T, C = L.args.batch or 4, 1024, 768
N = B * T


def widths(numbers, dtype):
    """(variant, build kwargs, label suffix): each variant as the launcher builds it; variant 5 also at
    its other width (lanes=4)"""
    for n in numbers:
        if n == 5 and spec.refuse_reason(5, dtype, rt.arch, N=N, OC=OC) is None:
            yield n, {}, ""
            yield n, {"lanes": 4}, "/l4"
        elif n == 4:  # also with chunks of >= 32 and >= 64 rows (the default: >= 128; more partials to finish)
            yield n, {}, ""
            yield n, {"min_rows": 32}, "/r32"
            yield n, {"min_rows": 64}, "/r64"
        else:
            yield n, {}, ""


for OC in (C, 3 * C, 4 * C):
    L.section(f"OC={OC}")
    print(f"\n## matmul_backward_bias: N={N} OC={OC}")
    dout, db0 = lab.rand(rng, (N, OC)), lab.rand(rng, (OC,))
    ref = db0.astype(np.float64) + dout.astype(np.float64).sum(0)
    d_dout, d_db = rt.to_device(dout), rt.to_device(db0)
    _, nbytes = spec.cost(N=N, OC=OC)
    for n, kw, tag in widths(L.selected(spec), "fp32"):
        launch = spec.build(rt, n, N=N, OC=OC, **kw).launch  # the bare closure: no Python call in between
        fn = (lambda launch=launch: launch(d_db, d_dout))
        label = f"{n}{tag} OC={OC}"
        L.validate(label, fn, outputs={"dbias": d_db}, refs={"dbias": ref}, atol=1e-4 * np.sqrt(N), rtol=1e-5,
                   init={"dbias": db0})
        L.time(label, fn, bytes=nbytes, ceiling="dram")

# bf16 builds: dbias bf16 += column sums of dout bf16
from llmc.bf16 import from_bf16, to_bf16  # noqa: E402

for OC in (C, 3 * C, 4 * C):
    L.section(f"OC={OC} bf16")
    dout, db0 = to_bf16(lab.rand(rng, (N, OC))), to_bf16(lab.rand(rng, (OC,)))
    ref = from_bf16(db0).astype(np.float64) + from_bf16(dout).astype(np.float64).sum(0)
    d_dout, d_db = rt.to_device(dout), rt.to_device(db0)
    nbytes = 2 * N * OC
    for n, kw, tag in widths(L.selected(spec), "bf16"):
        if "bf16" not in spec.variant(n).dtypes or spec.refuse_reason(n, "bf16", rt.arch, N=N, OC=OC):
            continue
        launch = spec.build(rt, n, "bf16", N=N, OC=OC, **kw).launch
        fn = (lambda launch=launch: launch(d_db, d_dout))
        label = f"{n}{tag} bf16 OC={OC}"
        rms = float(np.sqrt(np.mean(np.square(ref))))
        # one rounding of dbias (2^-8 relative) + fp32 sums over N rows (1e-3 of the rms)
        L.validate(label, fn, outputs={"dbias": d_db}, refs={"dbias": ref}, atol=1e-3 * rms, rtol=2.0 ** -8,
                   init={"dbias": db0})
        L.time(label, fn, bytes=nbytes, ceiling="dram")
L.finish()
