"""The fp32 transposes of a TF32 training step (engine 5's dinp and dweight operands) against a
device-to-device copy of the same bytes, timed in turn: how far the transposes are from the floor of
the bytes they move.

    python dev/bench_transpose.py              # d12 at B=4 and 16, T=1024
    python dev/bench_transpose.py --reps 50

TF32 wgmma reads only K-major operands from shared memory, so matmul_backward 5 writes weight^T (OC, C)
before each dinp GEMM and the narrower of dout and inp transposed (N x 768) before each dweight GEMM:
49 + 49 transposes a d12 step. Bytes: the matrix read once and written once. CUDA events, the L2
flushed before every call (a 2x-L2 memset), 5 rounds of the two in turn, the median of the round
medians. (Session 25, H200: 86-100% of the copy on every shape; a 64 x 64-tile kernel with four
times the loads in flight per thread was 0.92-1.07x of this one and no faster in whole steps.)
"""
import argparse

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, nargs="*", default=[4, 16])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()

    from llmc.ops import gemm_wgmma as gw
    from llmc.runtime import Runtime
    rt = Runtime()
    rng = np.random.default_rng(0)
    C, V = 768, 50304
    shapes = [("weight qkv", 3 * C, C, None), ("weight attproj", C, C, None), ("weight fc", 4 * C, C, None),
              ("weight fcproj", C, 4 * C, None), ("weight lm head", V, C, None)]
    for B in args.B:
        N = B * args.T
        shapes.append((f"B={B} activation", N, C, -(-N // 4) * 4))
    n = max(3, args.reps // 5)

    def med(fn):
        return float(np.median(rt.time_ms(fn, warmup=2, repeat=n, flush_l2=True)))

    print(f"device: {rt.name} | each row: ms and GB/s (bytes read + written), 5 rounds in turn, L2 flushed")
    totals = {"transpose": 0.0, "copy": 0.0}
    for name, rows, cols, ld_out in shapes:
        ld = rows if ld_out is None else ld_out
        x = rt.to_device(rng.standard_normal((rows, cols)).astype(np.float32))
        out = rt.empty((cols, ld), np.float32)
        nbytes = rows * cols * 4
        src, dst = rt.empty((nbytes,), np.uint8), rt.empty((nbytes,), np.uint8)
        tr = gw.transpose_build(rt, rows, cols, ld_out=ld)
        out.fill_bytes(0xFF)
        tr(out, x)
        assert np.array_equal(out.get()[:, :rows], x.get().T), name
        got = {"transpose": [], "copy": []}
        for _ in range(5):
            got["transpose"].append(med(lambda: tr(out, x)))
            got["copy"].append(med(lambda: rt.drv.memcpy_dtod_async(dst.ptr, src.ptr, nbytes, rt.stream)))
        ms = {k: float(np.median(v)) for k, v in got.items()}
        gbs = {k: 2 * nbytes / 1e6 / v for k, v in ms.items()}
        if "weight" in name:
            for k in totals:
                totals[k] += (1 if "lm head" in name else 12) * ms[k]
        print(f"{name:16s} {rows:6d} x {cols:5d}: transpose {ms['transpose']:.4f} ms {gbs['transpose']:6.0f} GB/s | "
              f"copy {ms['copy']:.4f} ms {gbs['copy']:6.0f} GB/s | {100 * ms['copy'] / ms['transpose']:.0f}% of the copy",
              flush=True)
        del x, out, src, dst
    print(f"the 49 weight transposes of a step (12 layers x 4 + the lm head): {totals['transpose']:.3f} ms, "
          f"copies of the same bytes {totals['copy']:.3f} ms")


if __name__ == "__main__":
    main()
