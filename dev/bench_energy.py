"""Energy per call of the bf16 step's GEMMs, ours (engine 5, the planner's default plan) against cuBLAS
BF16 (through torch), each run for a sustained spell so that the board settles where the trainer
runs it: at B=16 a bf16 step draws the 700 W cap and the driver lowers the SM clock, so a step's
time is its energy over 700 W, and what a GEMM costs the step is its joules more than its time at
full clock (dev/power.py).

    python dev/bench_energy.py                    # B=16, T=1024: forward, dinp, dweight of every layer
    python dev/bench_energy.py --B 4 --seconds 2 --rounds 3
    python dev/bench_energy.py --only fc lmhead   # some layers
    python dev/bench_energy.py --plans --only fc  # + every other plan engine 5 has built for each GEMM
    python dev/bench_energy.py --plans mc         # + only the 2-CTA multicast plan, where one is built

For each GEMM, each side in turn (--rounds rounds): --ramp seconds of calls (the board's power and
clock settle), then the GPU's queue drained, the board's energy counter read (NVML), calls for about
--seconds, drained and read again. Printed per side, the medians over the rounds: ms a call (wall
time / calls: the host keeps the queue ahead), J a call, mean board power, the SM clock (NVML,
sampled as the calls run), TFLOP per kJ; and ours over cuBLAS in time and in energy. The same
operands as dev/bench_gemm.py (random, bf16 in and out; dweight accumulates into a bf16 gradient).
A device-to-device copy of 1 GB is measured the same way first: the joules a byte of DRAM traffic
costs, for the memory-bound kernels. --plans: each GEMM also on every other tile plan built for its
layout (cooperative 128 x 128 / 192 / 256, ping-pong 128 x 128 and 64 x 256, clusters of two CTAs
sharing B by multicast), or only the plans named after it, in the same turns, each printed against cuBLAS.
"""
import argparse
import statistics
import time

import numpy as np

from power import Energy

# --plans: the alternatives to the default plan (those that build for a layout; the same plan twice is left out)
PLANS = (("co128", dict(schedule="coop", bn=128)), ("co192", dict(schedule="coop", bn=192)),
         ("co256", dict(schedule="coop", bn=256)), ("pp128", dict(schedule="pingpong", rm=128, bn=128)),
         ("pp64x256", dict(schedule="pingpong", rm=64, bn=256)), ("mc", dict(multicast=True)))
LAYERS = {"qkv": (768, 2304), "attproj": (768, 768), "fc": (768, 3072), "fcproj": (3072, 768), "lmhead": (768, 50304)}


def gemm_cases(torch, N: int, C: int, OC: int) -> dict:
    """One layer's three bf16 GEMMs at N rows (random operands; dweight accumulates into a bf16 gradient):
    {kind: (wgmma_build's shape arguments, cuBLAS's call through torch, (C, A, B) for ours)}. Also
    dev/ncu_gemm.py's."""
    x = torch.randn(N, C, device="cuda").bfloat16()
    w = (torch.randn(OC, C, device="cuda") * 0.02).bfloat16()
    dout = torch.randn(N, OC, device="cuda").bfloat16()
    y = torch.empty(N, OC, device="cuda", dtype=torch.bfloat16)
    dx = torch.empty(N, C, device="cuda", dtype=torch.bfloat16)
    dw = (torch.randn(OC, C, device="cuda") * 0.01).bfloat16()
    return {
        "fwd": (dict(M=N, N=OC, K=C), lambda: torch.matmul(x, w.t(), out=y), (y, x, w)),
        "dinp": (dict(M=N, N=C, K=OC, ldb=C, b_major="n"), lambda: torch.matmul(dout, w, out=dx), (dx, dout, w)),
        "dweight": (dict(M=OC, N=C, K=N, lda=OC, ldb=C, ldc=C, beta=1.0, a_major="m", b_major="n"),
                    lambda: dw.addmm_(dout.t(), x), (dw, dout, x)),
    }


def sustained(fn, sync, meter, seconds: float, ramp: float) -> dict:
    """Run fn() (one call, queued) for `ramp` s, then for about `seconds` s between two reads of the
    energy counter, each after sync(). Returns ms a call, J a call, mean W and mean SM MHz."""
    t_end = time.perf_counter() + ramp
    n_ramp = 0
    while time.perf_counter() < t_end:
        fn()
        n_ramp += 1
    sync()
    t0 = time.perf_counter()
    for _ in range(8):  # the rate at this clock, for the call count
        fn()
    sync()
    per = max((time.perf_counter() - t0) / 8, 1e-6)
    n = max(int(seconds / per), 8)
    clocks = []
    e0, t0 = meter.read(), time.perf_counter()
    for i in range(n):
        fn()
        if i % max(n // 16, 1) == 0:
            clocks.append(meter.sm_clock() or 0)
    sync()
    e1, t1 = meter.read(), time.perf_counter()
    joules, wall = e1 - e0, t1 - t0
    return {"ms": wall * 1000 / n, "J": joules / n, "W": joules / wall, "MHz": statistics.mean(clocks), "n": n}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, nargs="*", default=[16])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=1.5, help="the measured spell of each side, each round")
    ap.add_argument("--ramp", type=float, default=0.5, help="calls before each measured spell")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", nargs="*", choices=list(LAYERS), help="these layers only")
    ap.add_argument("--kinds", nargs="*", choices=("fwd", "dinp", "dweight"), default=["fwd", "dinp", "dweight"])
    ap.add_argument("--plans", nargs="*", choices=[label for label, _ in PLANS], default=None,
                    help="also every other tile plan built for each GEMM (or those named: e.g. --plans mc)")
    args = ap.parse_args()

    import torch
    from llmc.runtime import Runtime
    from llmc.errors import LLMCError
    from llmc.ops import gemm_wgmma as gw
    rt = Runtime()
    meter = Energy(rt.device.pci_bus_id())
    if meter.read() is None:
        raise SystemExit(f"bench_energy: no energy counter ({meter.why})")

    def sync():
        rt.synchronize()
        torch.cuda.synchronize()

    def row(label, sides, flops=None, nbytes=None):
        """sides: {name: [round dicts]} -> one printed line per side, then the ratio of the two."""
        med = {k: {f: statistics.median(r[f] for r in v) for f in ("ms", "J", "W", "MHz")} for k, v in sides.items()}
        for k, m in med.items():
            extra = (f" | {flops / m['J'] / 1e9:6.1f} TFLOP/kJ | {flops / m['ms'] / 1e9:6.1f} TFLOP/s" if flops else
                     f" | {m['J'] / nbytes * 1e12:6.1f} pJ/B | {nbytes / m['ms'] / 1e6:6.0f} GB/s" if nbytes else "")
            print(f"  {label:<22} {k:<7} {m['ms']:8.4f} ms {m['J'] * 1000:8.2f} mJ {m['W']:5.0f} W "
                  f"{m['MHz']:5.0f} MHz{extra}", flush=True)
        if len(med) == 2:
            (ka, a), (kb, b) = med.items()
            print(f"  {label:<22} {kb} / {ka}: time {b['ms'] / a['ms']:.3f}x, energy {b['J'] / a['J']:.3f}x", flush=True)
        elif len(med) > 2:
            (ka, a), *rest = med.items()
            print(f"  {label:<22} over {ka}: " + ", ".join(f"{kb} {b['ms'] / a['ms']:.3f}x / {b['J'] / a['J']:.3f}x"
                                                           for kb, b in rest) + " (time / energy)", flush=True)
        return med

    def turns(fns: dict):
        got = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                got[k].append(sustained(fn, sync, meter, args.seconds, args.ramp))
        return got

    print(f"device: {rt.name} | {args.seconds} s spells after {args.ramp} s of calls, {args.rounds} rounds, "
          f"the sides in turn", flush=True)
    nbytes = 1 << 30
    src, dst = rt.empty((nbytes,), np.uint8), rt.empty((nbytes,), np.uint8)
    src.fill_bytes(0x3C)
    row("copy 1 GB (r+w 2 GB)", turns({"copy": lambda: rt.drv.memcpy_dtod_async(dst.ptr, src.ptr, nbytes, rt.stream)}),
        nbytes=2 * nbytes)
    del src, dst

    P = lambda t: t.data_ptr()  # noqa: E731
    for B in args.B:
        N = B * args.T
        print(f"B={B}, T={args.T}: bf16 GEMMs (ours: engine 5's default plan)", flush=True)
        for name, (C, OC) in LAYERS.items():
            if args.only and name not in args.only:
                continue
            kinds = gemm_cases(torch, N, C, OC)
            for kind in args.kinds:
                shape, cublas, ops_ = kinds[kind]
                ptrs = tuple(P(t) for t in ops_)
                sides = {"cuBLAS": cublas}
                g = gw.wgmma_build(rt, "bf16", out="bf16", **shape)
                sides["ours"] = (lambda g=g: g(*ptrs))
                plans = [f"ours={g.plan}"]
                for label, kw in (PLANS if args.plans is not None else ()):
                    if args.plans and label not in args.plans:
                        continue
                    try:
                        alt = gw.wgmma_build(rt, "bf16", out="bf16", **shape, **kw)
                    except LLMCError:
                        continue
                    if alt.plan != g.plan or kw.get("multicast"):
                        sides[label] = (lambda a=alt: a(*ptrs))
                        plans.append(f"{label}={alt.plan}")
                row(f"{name} {kind}", turns(sides), flops=2.0 * N * C * OC)
                print("    plans: " + " ".join(plans), flush=True)
            kinds = sides = g = None  # (the closures hold the operands: let them go)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
