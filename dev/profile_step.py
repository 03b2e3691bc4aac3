"""Where a training step spends its time: every op call of one d12 step timed with CUDA events.

    python dev/profile_step.py                                  # default variants
    python dev/profile_step.py --softmax-kernel 3               # what softmax 3 costs inside a real step
    python dev/profile_step.py --md docs/profile.md
    python dev/profile_step.py --precision bf16                 # the bf16 step (GB/s column: see below)

One step of GPT-2 124M at B=4, T=1024 (no sampling, no validation), after warm-up. Every launch
of the model's plan is bracketed by a pair of events (the folded classifier's too: its lm head GEMM in the
mm_lmhead row, its small kernels in "fold ..." rows, time only); the table (sorted by time) shows the op, the
variant, calls, total ms, % of the step and the achieved TFLOP/s (matmuls, attention) or GB/s
(everything else, counting each input read once and each output written once): the cost model each
op declares (OpSpec.cost, llmc/ops/<family>.py), at the shape and in the element type the model
built it for: 2 bytes an element of a bf16 build's tensors, 4 for those that stay fp32 (layernorm
statistics, losses, AdamW state). (The matmul and attention rows report TFLOP/s.)
"""
import argparse
from collections import defaultdict
from pathlib import Path


import numpy as np

from llmc import ops
from llmc.backend import CudaBackend
from llmc.config import config_from_name
from llmc.model import GPT2
from llmc.train import kernel_flags


def instrument(model, rt) -> list:
    """Brackets every launch of `model`'s step with a pair of events (rt.event(), recorded on rt.stream):
    the planned ops (model.k, the first micro-step's dweight twins model.k_first), AdamW's per-range launches,
    the deferred layernorm flush, and the folded classifier's launches (model.fold: the lm head's GEMM and
    the combine, fix and scale kernels, which are not in model.k). Returns the list that each call appends
    (key, op name, start event, end event) to."""
    records = []

    def wrap(key, fn, opname):
        def timed(*a, **kw):
            s, e = rt.event(), rt.event()
            s.record(rt.stream); fn(*a, **kw); e.record(rt.stream)
            records.append((key, opname, s, e))
        return timed
    for key in list(model.k):
        model.k[key] = wrap(key, model.k[key], model.built[key].op)
    for key in list(model.k_first):  # the first micro-step's dweight GEMMs (first_write): their call sites' rows
        model.k_first[key] = wrap(key + "/first", model.k_first[key], model.built_first[key].op)
    model.adamw_plan = [(wrap("adamw", pl[0], "adamw"), *pl[1:]) for pl in model.adamw_plan]
    if model._ln_flush is not None:  # the deferred layernorm backwards' flush: its time joins their row
        model._ln_flush = wrap("layernorm_backward_colsum_deferred/flush", model._ln_flush, "layernorm_backward")
    if model.fold is not None:  # (instance attributes over the methods: prime's own call of fix is timed too)
        f = model.fold
        f.forward = wrap("fold/forward", f.forward, "matmul_forward")
        for part in ("combine", "fix", "scale"):
            setattr(f, part, wrap(f"fold/{part}", getattr(f, part), "classifier"))
    return records


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="d12")
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("--md", help="write the table (markdown) to this file")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    for flag, name, h in kernel_flags():
        p.add_argument(flag, type=int, default=None, dest=f"kernel_{name}", help=h)
    args = p.parse_args()
    kernels = {k[7:]: v for k, v in vars(args).items() if k.startswith("kernel_") and v is not None}
    be = CudaBackend(kernels, precision=args.precision)
    rt = be.rt
    cfg = config_from_name(args.model)
    B, T = args.batch_size, args.seq_len
    # one stream: each op's events bracket it alone (the side stream's weight-gradient GEMMs would
    # overlap the main stream's launches and their times)
    model = GPT2(cfg, be, B, T, side_stream=False)
    model.use_graphs = False  # every launch from Python, so that each can be bracketed by events
    model.init_params(0)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)

    def step(i):
        model.zero_grad(); model.forward(x, y, read_loss=False); model.backward(); model.update(3e-4, i + 1)
        return model.step_loss()

    for i in range(3):
        step(i)

    records = instrument(model, rt)
    s_all, e_all = rt.event(), rt.event()
    s_all.record(rt.stream)
    step(3)
    e_all.record(rt.stream)
    e_all.synchronize()
    step_ms = e_all.time_since(s_all)

    agg = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # calls, ms, flops, bytes
    for key, opname, s, e in records:
        ms = e.time_since(s)
        flush = key.endswith("/flush")  # (time only: not a call of its own, no bytes of its own)
        first = key.endswith("/first")
        key = key.removesuffix("/flush").removesuffix("/first")
        spec = ops.get(opname)
        if key == "adamw":  # one launch per contiguous range of the flat buffer
            variant, shape = be.kernels["adamw"], None
        elif key.startswith("fold/"):  # the folded classifier: the lm head's GEMM, then its small kernels
            part = key.removeprefix("fold/")
            if part == "forward":
                built = model.built["mm_lmhead"]  # (its shape and cost: the same GEMM, the fold's epilogue)
                variant, shape, key = f"{built.number} (folded classifier)", built.shape, "mm_lmhead"
            else:  # (time only: no cost model of their own)
                variant, shape, key, built = "fold", None, f"fold {part}", None
        else:
            built = (model.built_first if first else model.built)[key]
            variant, shape = built.number, built.shape
            uses = spec.variant(variant).uses
            if uses:  # a variant built from other ops (the composite attention): what it is made of
                variant = f"{variant}: " + ", ".join(f"{kw} {be.kernels[op]}" for kw, op in uses.items())
            elif opname.startswith("attention"):
                variant = f"{variant} (fused)"
        row = agg[(opname, key if key.startswith(("mm", "bias", "fold")) else opname, variant)]
        flops, nbytes = spec.cost(**shape, dtype=built.dtype) if shape is not None and not flush else (0, 0)
        row[0] += 0 if flush else 1; row[1] += ms; row[2] += flops; row[3] += nbytes
    for k, v in agg.items():  # AdamW over all ranges
        if k[0] == "adamw":
            v[3] = ops.get("adamw").cost(n=cfg.num_parameters, dtype=be.precision)[1]
    total_ops = sum(v[1] for v in agg.values())
    lines = [f"One training step of {args.model} ({cfg.describe()}), B={B}, T={T} on {rt.name}: "
             f"{step_ms:.2f} ms (events around the whole step; ops sum to {total_ops:.2f} ms)", "",
             "| op | call site | variant | calls | total ms | % of step | achieved |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (opname, site, variant), (calls, ms, flops, nbytes) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        if flops:
            ach = f"{flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s"
        elif nbytes:
            ach = f"{nbytes / (ms * 1e-3) / 1e9:.0f} GB/s"
        else:
            ach = ""
        lines.append(f"| {opname} | {site} | {variant} | {calls} | {ms:.3f} | {100 * ms / step_ms:.1f}% | {ach} |")
    out = "\n".join(lines)
    print(out)
    if args.md:
        Path(args.md).write_text(out + "\n")


if __name__ == "__main__":
    main()
