"""Kernel lab: what encoder_backward's memory traffic can reach (bf16, C=768, the trainer's B), against a copy
of the same bytes: bare kernels with its row shapes, built from cuda/encoder.cu with -DENC_FLOOR_BENCH=1.

    python dev/cuda/encoder_backward_floor.py --batch 16
    python dev/cuda/encoder_backward_floor.py --batch 4 --quick

Rows (N = B*T rows of 768 bf16, 1.5 KB each; a warp per R rows, lanes over 16-byte columns):
  copy             out[i] = in[i]                      (2 N rows of traffic)
  scatter-add      out[idx[i]] += in[i], idx distinct  (3 N: encoder_backward's tokens seen once)
  gather           out[i] = in[idx[i]]                 (2 N: encoder_forward's)
  scatter          out[idx[i]] = in[i]                 (2 N)
  add              out[i] += in[i]                     (3 N)
  position units   dwpe[t] += the B rows at t, each also onto dwte[idx] (every id distinct; 3 N + 2 T rows):
                   a warp per (t, 512-byte slice), 8 rows at a time ("slices"), or per t over whole rows,
                   2 at a time ("whole"); variant 10's dwpe units without its work list
idx: distinct rows of a 50304-row table, random order. Session 51 (H200): every form at 93-101% of its copy
at B=16, where variant 10 runs at 76-82% on uniform ids (docs/ops.md, "encoder_backward's floor").
"""
import numpy as np

import lab
from llmc.bf16 import BF16, from_bf16, to_bf16

L = lab.Lab("encoder_backward_floor")
B = L.args.batch or 16
T, C, V = 1024, 768, 50304
N, C16 = B * T, C // 8
if B > 32:
    L.parser.error(f"--batch {B}: the position units read a position's B ids from one warp (B <= 32)")
rt, rng = L.rt, np.random.default_rng(0)
D = {"ENC_FLOOR_BENCH": 1}

x = rng.standard_normal((V, C)).astype(np.float32)
base = rng.standard_normal((V, C)).astype(np.float32)
pbase = rng.standard_normal((T, C)).astype(np.float32)
xb, bb, pb = (from_bf16(to_bf16(a)).astype(np.float64) for a in (x, base, pbase))
d_in = rt.to_device(to_bf16(x))
d_tab, d_rows, d_pos = rt.empty((V, C), BF16), rt.empty((N, C), BF16), rt.empty((T, C), BF16)
distinct = rng.choice(V, N, replace=False).astype(np.int32)
anyrow = rng.integers(0, V, N).astype(np.int32)
d_distinct, d_any = rt.to_device(distinct), rt.to_device(anyrow)
row_bytes = N * C * 2

ROWS = {  # mode: (label, traffic in rows of N, output, ids, reference of the output's rows)
    0: ("copy", 2, d_rows, d_any, lambda: xb[:N]),
    1: ("scatter-add", 3, d_tab, d_distinct, None),
    2: ("gather", 2, d_rows, d_any, lambda: xb[anyrow]),
    3: ("scatter", 2, d_tab, d_distinct, None),
    4: ("add", 3, d_rows, d_any, lambda: bb[:N] + xb[:N]),
}
BS = 128
L.section(f"B={B} rows")
for mode, (name, traffic, out, ids, ref) in ROWS.items():
    for R in ((1,) if L.args.quick else (1, 4)):
        k = rt.kernel("encoder", f"encoder_floor_m{mode}_r{R}", "PPPii", defines=D)
        grid = (-(-N // (R * BS // 32)), 1, 1)
        fn = (lambda k=k, grid=grid, out=out, ids=ids:
              k(grid, (BS, 1, 1), d_in.ptr, out.ptr, ids.ptr, np.int32(N), np.int32(C16)))
        label = f"{name} R={R}"
        if out is d_tab:  # the whole table: rows not named by idx keep their values
            want = bb.copy()
            want[distinct] = (bb[distinct] if mode == 1 else 0.0) + xb[:N]
            L.validate(label, fn, outputs={"out": out}, refs={"out": want}, atol=0.0, rtol=2.0 ** -8,
                       init={"out": to_bf16(base)})
        else:
            L.validate(label, fn, outputs={"out": out}, refs={"out": ref()}, atol=0.0, rtol=2.0 ** -8,
                       init={"out": to_bf16(base[:N])} if mode == 4 else None)
        L.time(label, fn, block_size=BS, bytes=traffic * row_bytes, ceiling="dram")

L.section(f"B={B} position units")
want_tab = bb.copy()
want_tab[distinct] = bb[distinct] + xb[:N]
want_pos = pb + xb[:N].reshape(B, T, C).sum(0)
for name, units in (("slices", T * C16 // 32), ("whole", T)):
    k = rt.kernel("encoder", f"encoder_floor_pos_{name}", "PPPPiii", defines=D)
    grid = (-(-units * 32 // BS), 1, 1)
    fn = (lambda k=k, grid=grid: k(grid, (BS, 1, 1), d_in.ptr, d_tab.ptr, d_pos.ptr, d_distinct.ptr,
                                   np.int32(B), np.int32(T), np.int32(C16)))
    label = f"position units, {name}"
    L.validate(label, fn, outputs={"dwte": d_tab, "dwpe": d_pos}, refs={"dwte": want_tab, "dwpe": want_pos},
               atol=1e-2, rtol=2.0 ** -7, init={"dwte": to_bf16(base), "dwpe": to_bf16(pbase)})
    L.time(label, fn, block_size=BS, bytes=3 * row_bytes + 2 * T * C * 2, ceiling="dram")
L.finish()
