"""Where a training step's GPU time goes, as the GPU ran it: a kernel timeline of whole steps (CUDA
graph replays, both streams) from CUPTI, through torch.profiler (which records every kernel of the
process's primary context, PyCUDA's included). Prints, for the last traced step: the step's span,
how long at least one kernel ran (busy) and how long none did (idle gaps between kernels, the
launch latencies a graph still pays), how long both streams ran kernels at once, the gaps by size,
and the kernels by total time.

    python dev/trace_step.py --precision bf16 -b 4
    python dev/trace_step.py --precision bf16 -b 16 --json trace.json   # also the raw chrome trace

Needs torch with CUDA (the GPU machine has it); the numbers are CUPTI's timestamps, not events.
"""
import argparse
import collections
import json
import os
import tempfile

import numpy as np


def union_length(iv):
    """Total length of the union of intervals [(start, end)]."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(iv):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize(kernels) -> dict:
    """kernels: [(start_us, end_us, stream, name)] of one step. The step's span, the time some kernel
    ran (busy), the idle gaps between kernels, the time kernels of two streams ran at once, and the
    kernels' total time by name."""
    t0 = min(k[0] for k in kernels)
    t1 = max(k[1] for k in kernels)
    busy = union_length([(k[0], k[1]) for k in kernels])
    streams = collections.Counter(k[2] for k in kernels)
    per_stream = sum(union_length([(k[0], k[1]) for k in kernels if k[2] == s]) for s in streams)
    gaps, cur_e = [], None
    for s, e in sorted((k[0], k[1]) for k in kernels):
        if cur_e is not None and s > cur_e:
            gaps.append(s - cur_e)
        cur_e = e if cur_e is None else max(cur_e, e)
    by_name, calls = collections.defaultdict(float), collections.Counter()
    for s, e, _, name in kernels:
        short = name.split("(")[0][:70]
        by_name[short] += e - s
        calls[short] += 1
    return {"kernels": len(kernels), "streams": dict(streams), "span": t1 - t0, "busy": busy,
            "overlap": per_stream - busy, "gaps": gaps, "by_name": dict(by_name), "calls": dict(calls)}


def split_steps(kernels, steps: int) -> list:
    """Cut a sorted kernel list into `steps` steps where the GPU idled longest (the host's loss read
    between steps)."""
    ends, cur = [], float("-inf")
    for k in kernels:
        cur = max(cur, k[1])
        ends.append(cur)
    gaps = sorted(((kernels[i + 1][0] - ends[i], i) for i in range(len(kernels) - 1)), reverse=True)
    cuts = sorted(i + 1 for _, i in gaps[:steps - 1])
    bounds = [0] + cuts + [len(kernels)]
    return [kernels[a:b] for a, b in zip(bounds, bounds[1:])]


def report(sm: dict, label: str) -> None:
    print(f"== {label}: {sm['kernels']} kernels on {len(sm['streams'])} stream(s) ({sm['streams']})")
    print(f"  span {sm['span'] / 1000:.3f} ms | busy (some kernel running) {sm['busy'] / 1000:.3f} ms | idle "
          f"{(sm['span'] - sm['busy']) / 1000:.3f} ms in {len(sm['gaps'])} gaps | two streams at once "
          f"{sm['overlap'] / 1000:.3f} ms")
    if sm["gaps"]:
        g = np.array(sm["gaps"])
        for lo, hi in ((0, 1), (1, 2), (2, 4), (4, 10), (10, None)):
            sel = g[(g >= lo) & (g < (hi if hi is not None else np.inf))]
            print(f"  gaps {lo:>4}-{hi if hi is not None else 'inf':>4} us: {len(sel):4d}, {sel.sum() / 1000:.3f} ms")
        print(f"  median gap {np.median(g):.2f} us, mean {g.mean():.2f} us")
    print("  kernels by total time (ms, calls; a kernel's time includes any wait for SMs held by the other stream):")
    for name, t in sorted(sm["by_name"].items(), key=lambda x: -x[1])[:25]:
        print(f"    {t / 1000:7.3f}  {sm['calls'][name]:4d}  {name}")


def kernels_of(events) -> list:
    """[(start_us, end_us, stream, name)] of a chrome trace's kernel events, sorted by start."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                   e.get("args", {}).get("stream", e.get("tid")), e["name"])
                  for e in events if e.get("cat") == "kernel")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the chrome trace here")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench_step import training_step
    from llmc.backend import CudaBackend
    from llmc.config import config_from_name

    torch.cuda.init()
    be = CudaBackend({}, precision=args.precision)
    rt = be.rt
    B, T = args.batch_size, args.seq_len
    _, step = training_step(be, config_from_name("d12"), B, T)
    for i in range(3):
        step(i)
    rt.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            step(3 + i)
        rt.synchronize()
    path = args.json or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    ks = kernels_of(events)
    if not ks:
        raise SystemExit("trace_step: the trace holds no kernels (CUPTI did not see PyCUDA's context)")
    print(f"device: {rt.name} | d12 B={B} T={T} {args.precision} | {len(ks)} kernels in {args.steps} steps")
    steps = split_steps(ks, args.steps)
    for j, step_k in enumerate(steps[:-1]):
        print(f"== step {j + 1}: span {(max(k[1] for k in step_k) - step_k[0][0]) / 1000:.3f} ms, {len(step_k)} kernels")
    report(summarize(steps[-1]), f"step {len(steps)} of {args.steps}")

if __name__ == "__main__":
    main()
