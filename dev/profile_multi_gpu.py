"""One data-parallel training step on every GPU, timed with CUDA events: every kernel on the compute
stream and every per-layer gradient reduction on the second stream, to show the reductions running
under backward. Also the step time without events and each rank's GPU memory.

    mpirun -np 2 python dev/profile_multi_gpu.py -z 1 --out gpu_out/profile_z1   # -> .json + .txt
    mpirun -np 2 python dev/profile_multi_gpu.py -z 0 -e d12 -b 16 -t 1024
    python dev/profile_multi_gpu.py                                              # 1 GPU: no reductions

The .json is a Chrome trace (open it in chrome://tracing or ui.perfetto.dev): one process per rank,
lanes "compute" (kernels, AdamW, the ZeRO-1 all-gather) and "comm" (the reduce-scatters or
all-reduces, one NCCL group per layer). The .txt has, per rank: the step, forward and backward
spans, each reduction's start/end relative to the end of backward, how much of the reduction time
lies inside backward (hidden) and how much after it (exposed), and the memory.
Inputs are random tokens (a different batch per rank); weights are a seeded random init.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np  # noqa: E402

from llmc.backend import make_backend  # noqa: E402
from llmc.config import config_from_name  # noqa: E402
from llmc.dist import DataParallel, Group, NcclComm, check_gpus  # noqa: E402
from llmc.errors import LLMCError  # noqa: E402
from llmc.model import GPT2  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-e", "--model", default="d12")
    p.add_argument("-b", "--batch-size", type=int, default=16)
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("-z", "--zero-stage", type=int, default=1)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    p.add_argument("--out", default=None, help="path prefix for the .json trace and .txt summary")
    args = p.parse_args()
    group = Group.start()
    why = check_gpus(group)
    group.agree(why)
    rank, world = group.rank, group.world
    B, T, zero = args.batch_size, args.seq_len, args.zero_stage if group.world > 1 else 0
    be = make_backend("cuda", gpu=group.local_rank, precision=args.precision)
    rt = be.rt
    cfg = config_from_name(args.model)
    model = GPT2(cfg, be, B, T, optimizer=zero == 0)
    model.init_params(1337)
    comm = NcclComm(group, rt) if world > 1 else None
    dp = DataParallel(group, model, zero, comm)
    rng = np.random.default_rng(rank)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)

    def step(i):
        model.zero_grad()
        dp.train_micro_step(x, y, last=True)
        dp.update(3e-4, i + 1, weight_decay=0.1, max_norm=1.0)
        return dp.step_loss()

    for i in range(3):  # warm-up: kernels built, graphs captured, NCCL connected
        step(i)
    t0 = time.perf_counter()
    for i in range(3, 3 + args.steps):
        loss = step(i)
    ms = (time.perf_counter() - t0) * 1000 / args.steps
    free, total = rt.mem_info()
    mem = {"rank": rank, "allocated_GiB": rt.allocated_bytes / 2**30, "device_used_GiB": (total - free) / 2**30,
           "optimizer_state_GiB": 2 * 4 * dp.optimizer_numel() / 2**30}

    # the profiled step: an event pair around every launch of the model's plan (kernel by kernel,
    # no graphs), and DataParallel's own events around each reduction and update phase
    records = []

    def wrap(key, fn):
        def timed(*a, **kw):
            s, e = rt.event(), rt.event()
            s.record(rt.stream)
            fn(*a, **kw)
            e.record(rt.stream)
            records.append((key, "compute", s, e))
        return timed
    for key in list(model.k):
        model.k[key] = wrap(key, model.k[key])
    if zero == 0:
        model.adamw_plan = [(wrap("adamw", pl[0]), *pl[1:]) for pl in model.adamw_plan]
    else:
        dp.plan = [(wrap("adamw", pl[0]), *pl[1:]) for pl in dp.plan]
        if dp.adamw_all is not None:
            dp.adamw_all = wrap("adamw", dp.adamw_all)
    model.use_graphs = False
    dp.trace = records
    start = rt.event()
    start.record(rt.stream)
    step(3 + args.steps)
    dp.params_ready()  # (-z 1: the all-gathers on the second stream end inside the profiled span)
    end = rt.event()
    end.record(rt.stream)
    end.synchronize()
    spans = [(label, lane, s.time_since(start), e.time_since(start)) for label, lane, s, e in records]
    mine = {"rank": rank, "step_ms_profiled": end.time_since(start), "step_ms": ms, "loss": loss,
            "spans": spans, "mem": mem}
    every = group.allgather(mine)
    if rank != 0:
        return
    lines = [f"{args.model} B={B} T={T}, {world} rank{'s' if world > 1 else ''}, -z {zero}: "
             f"{ms:.2f} ms/step (rank 0, mean of {args.steps}), {world * B * T / ms * 1000:,.0f} tokens/s"]
    trace = []
    for r in every:
        sp = r["spans"]
        for label, lane, s, e in sp:
            trace.append({"name": label, "ph": "X", "ts": s * 1000, "dur": (e - s) * 1000, "pid": r["rank"],
                          "tid": lane})
        fwd_end = max(e for label, lane, s, e in sp if label == "classifier")
        bwd_end = max(e for label, lane, s, e in sp if label == "encoder_backward")
        comm = [(label, s, e) for label, lane, s, e in sp if lane == "comm" and not label.startswith("all-gather")]
        tot = sum(e - s for _, s, e in comm)
        hidden = sum(max(0.0, min(e, bwd_end) - max(s, fwd_end)) for _, s, e in comm)
        m = r["mem"]
        lines += [f"rank {r['rank']}: step {r['step_ms']:.2f} ms ({r['step_ms_profiled']:.2f} ms profiled, an event "
                  f"pair per launch), forward 0-{fwd_end:.2f} ms, backward {fwd_end:.2f}-{bwd_end:.2f} ms",
                  f"  reductions: {len(comm)} groups, {tot:.2f} ms in all, {hidden:.2f} ms of it inside backward "
                  f"(hidden), {tot - hidden:.2f} ms after it (exposed)",
                  f"  memory: {m['allocated_GiB']:.2f} GiB allocated by us, {m['device_used_GiB']:.2f} GiB used on "
                  f"the device (with the CUDA context and NCCL), AdamW m+v {m['optimizer_state_GiB']:.3f} GiB"]
        for label, lane, s, e in sp:
            if lane != "compute" or label in ("classifier", "encoder_backward") or label.startswith("norm") \
                    or label.startswith("all-gather") or label.startswith("clip"):
                lines.append(f"    {lane:7s} {label:32s} {s:9.3f} .. {e:9.3f} ms")
        for label, s, e in comm:
            lines.append(f"    comm    {label:32s} {s:9.3f} .. {e:9.3f} ms  (backward ends at {bwd_end:.3f})")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + ".txt").write_text(text + "\n")
        Path(args.out + ".json").write_text(json.dumps({"traceEvents": trace}))
        print(f"wrote {args.out}.txt and {args.out}.json")


if __name__ == "__main__":
    try:
        main()
    except LLMCError as e:
        if not getattr(e, "quiet", False):
            print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
