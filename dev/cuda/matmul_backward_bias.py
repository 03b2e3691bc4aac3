"""Kernel lab: matmul_backward_bias, dbias (OC) += column sums of dout (N, OC), at the trainer's shapes
(N = B*T = 4096 rows; OC = 768, 2304, 3072: the attproj/fcproj, qkv and fc biases).

    python dev/cuda/matmul_backward_bias.py       # every variant, table
    python dev/cuda/matmul_backward_bias.py 4     # one variant

Reads N*OC floats once (the bytes of the op's cost model): judged in GB/s against 2.98 TB/s.
"""
import numpy as np

import lab
import llmc.ops

L = lab.Lab("matmul_backward_bias")
rt, rng = L.rt, np.random.default_rng(0)
spec = llmc.ops.get("matmul_backward_bias")
B, T, C = 4, 1024, 768
N = B * T
for OC in (C, 3 * C, 4 * C):
    L.section(f"OC={OC}")
    print(f"\n## matmul_backward_bias: N={N} OC={OC}")
    dout, db0 = lab.rand(rng, (N, OC)), lab.rand(rng, (OC,))
    ref = db0.astype(np.float64) + dout.astype(np.float64).sum(0)
    d_dout, d_db = rt.to_device(dout), rt.to_device(db0)
    _, nbytes = spec.cost(N=N, OC=OC)
    for n in L.selected(spec):
        launch = spec.build(rt, n, N=N, OC=OC).launch  # the bare closure: no Python call in between
        fn = (lambda launch=launch: launch(d_db, d_dout))
        label = f"{n} OC={OC}"
        L.validate(label, fn, outputs={"dbias": d_db}, refs={"dbias": ref}, atol=1e-4 * np.sqrt(N), rtol=1e-5,
                   init={"dbias": db0})
        L.time(label, fn, bytes=nbytes, ceiling="dram")
L.finish()
