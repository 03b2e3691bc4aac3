"""Benchmark: one training step of GPT-2 124M (d12) at B=4, T=1024 on the GPU.

    python dev/bench_step.py                       # default kernel variants
    python dev/bench_step.py --precision bf16 -b 16 # bf16 weights/activations/grads, fp32 master + AdamW
    python dev/bench_step.py --softmax-kernel 5 --matmul-kernel 5
    python dev/bench_step.py -b 1 -t 128            # a small step, where launching from Python costs
    python dev/bench_step.py --precision bf16 -r 0  # activation recompute as the trainer's -r (default 1)
    LLMC_GRAPHS=0 python dev/bench_step.py          # kernel by kernel instead of CUDA graph replays
    LLMC_FUSED_BIAS=0 python dev/bench_step.py      # bias grads by matmul_backward_bias, not fused (same variants)
    LLMC_FUSED_GELU=1 python dev/bench_step.py      # the fc layer's GELU in its GEMM's epilogue (default: gelu_forward)
    python dev/bench_step.py --precision bf16 -b 16 --power   # + board power, SM clock, clock-limit reasons, J a step
    python dev/bench_step.py --tokens dev/data/tinyshakespeare/tiny_shakespeare_val.bin  # a batch of text

Times forward + backward + clip + AdamW + the loss and norm read, exactly the trainer's step (after
the first step, the micro-step and the update are CUDA graph replays where cuda-python is
installed) in the trainer's loop: each step is launched before the previous one's loss and norm are
read (llmc/train.py; the copies queue behind the step). A CUDA event recorded on the stream as each
step's launches begin marks its start, so a step's time is the GPU's from its first kernel to the
next step's, idle time included. Prints the median ms/step after warm-up, tokens/s and peak GPU
memory (our allocations, and the device's used memory as nvidia-smi would count it, context
included). --sync: each step read before the next is launched (events around the step and the
read, as sessions before 22 timed it; LLMC_PIPELINE_STEPS=0 in the trainer).
"""
import argparse
import os
import statistics
import time


import numpy as np

from llmc import switches
from llmc.backend import CudaBackend
from llmc.config import config_from_name, llmc_train_bytes
from llmc.data import read_shard
from llmc.errors import LLMCError
from llmc.model import GPT2
from llmc.train import kernel_flags
from power import Energy, PowerSampler, describe_energy


def training_step(be, cfg, B, T, recompute: int = 1, tokens=None):
    """(model, step): the GPT-2 of `cfg` built and initialised (seed 0) on `be` with the trainer's
    -r `recompute`, and step(i), the trainer's step i on one fixed batch (zero_grad, forward +
    backward, clip + AdamW at lr 3e-4, the loss read): random ids (uniform over the vocabulary), or
    the first B*T + 1 of `tokens` (text: a few frequent tokens, which encoder_backward feels)."""
    if tokens is not None and tokens.size < B * T + 1:
        raise LLMCError(f"--tokens: {tokens.size:,} tokens, a batch needs B*T + 1 = {B * T + 1:,}")
    model = GPT2(cfg, be, B, T, recompute=recompute)
    model.init_params(0)
    if tokens is None:
        rng = np.random.default_rng(0)
        x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
        y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    else:
        x = np.asarray(tokens[:B * T], np.int32).reshape(B, T)
        y = np.asarray(tokens[1:B * T + 1], np.int32).reshape(B, T)

    def step(i):
        """Launch step i; returns its StepRead (the loss and norm on their way to the host)."""
        model.zero_grad()
        model.train_micro_step(x, y)
        model.update(3e-4, i + 1)
        return model.read_step()
    return model, step


def time_pipelined(rt, step, first: int, n: int):
    """(GPU ms, wall ms) of steps first .. first + n - 1 in the trainer's loop: step i + 1 launched
    before step i's read; an event at the start of each step's launches and one after the last."""
    marks, walls, prev, loss = [], [], None, None
    w0 = time.perf_counter()
    for i in range(n + 1):
        ev = rt.event()
        ev.record(rt.stream)
        marks.append(ev)
        read = step(first + i) if i < n else None
        if prev is not None:
            loss = prev.loss()
            w1 = time.perf_counter()
            walls.append((w1 - w0) * 1000)
            w0 = w1
        prev = read
    marks[-1].synchronize()
    return [marks[i + 1].time_since(marks[i]) for i in range(n)], walls, loss


def time_synced(rt, step, first: int, n: int):
    """(GPU ms, wall ms) of each step with its read before the next is launched."""
    times, walls, loss = [], [], None
    for i in range(n):
        s, e = rt.event(), rt.event()
        w0 = time.perf_counter()
        s.record(rt.stream)
        loss = step(first + i).loss()
        e.record(rt.stream)
        e.synchronize()
        walls.append((time.perf_counter() - w0) * 1000)
        times.append(e.time_since(s))
    return times, walls, loss


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="d12")
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("-r", "--recompute", type=int, choices=(0, 1, 2), default=1,
                   help="activation recompute in backward, as the trainer's -r: 0 none, 1 GELU, 2 GELU and layernorm")
    p.add_argument("--sync", action="store_true",
                   help="read each step's loss before launching the next (the trainer with LLMC_PIPELINE_STEPS=0)")
    p.add_argument("--power", action="store_true",
                   help="sample board power, SM clock and clock-limit reasons (nvidia-smi) during the timed steps, "
                        "and read the board's energy counter around them (joules a step)")
    p.add_argument("--tokens", metavar="SHARD",
                   help="the batch from this llm.c token shard (its first B*T + 1 tokens) instead of random ids")
    for flag, name, h in kernel_flags():
        p.add_argument(flag, type=int, default=None, dest=f"kernel_{name}", help=h)
    args = p.parse_args()
    try:  # an LLMC_* switch's bad value or a bad shard: one line (bench_ab's runs show it), before the model is built
        switches.check_environment()
        tokens = read_shard(args.tokens) if args.tokens else None
    except LLMCError as e:
        p.error(str(e))
    kernels = {k[7:]: v for k, v in vars(args).items() if k.startswith("kernel_") and v is not None}

    be = CudaBackend(kernels, precision=args.precision)
    rt = be.rt
    free0, total = rt.mem_info()
    cfg = config_from_name(args.model)
    B, T = args.batch_size, args.seq_len
    t0 = time.perf_counter()
    try:
        model, step = training_step(be, cfg, B, T, args.recompute, tokens)
    except LLMCError as e:
        p.error(str(e))
    build_s = time.perf_counter() - t0

    for i in range(args.warmup):
        step(i).loss()
    sampler = PowerSampler(rt.device.pci_bus_id()) if args.power else None
    meter = Energy(rt.device.pci_bus_id()) if args.power else None
    e0, w0 = (meter.read(), time.perf_counter()) if meter else (None, 0.0)
    times, walls, loss = (time_synced if args.sync else time_pipelined)(rt, step, args.warmup, args.steps)
    e1, w1 = (meter.read(), time.perf_counter()) if meter else (None, 0.0)
    power = sampler.stop() if sampler is not None else None
    free1, _ = rt.mem_info()
    ms = statistics.median(times)
    print(f"device: {rt.name} | model {cfg.describe()} | B={B} T={T} | {args.precision} | -r {args.recompute} | "
          f"{'ids of ' + os.path.basename(args.tokens) if args.tokens else 'random ids'} | build {build_s:.1f} s")
    print("kernels: " + ", ".join(f"{k}={v}" for k, v in sorted(be.kernels_for().items())))
    print("bias grads fused into: " + (", ".join(k for k, v in model.fused_bias.items() if v) or "none (matmul_backward_bias)"))
    print("fc GELU: " + ("fused into the fc GEMM's epilogue" if model.fused_gelu else "mm_fc + gelu_forward"))
    print("fcproj backward: " + ("dinp GEMM, gelu_backward's recompute form (fch_gelu and d fch in one pass), "
                                 "dweight GEMM" if model.fused_gelu_recompute else
                                 "gelu_backward fused into dinp's GEMM epilogue" if model.fused_dgelu else
                                 "mmb_fcproj + gelu_backward"))
    from llmc.runtime import Graph
    # (one micro-step a step: with first_write every step replays the first micro-step's graph)
    replayed = [g for g in (model._graph_micro, model._graph_micro_first) if isinstance(g, Graph)]
    print("CUDA graphs: " + ("yes" if replayed and isinstance(model._graph_update, Graph) else
                             f"no ({rt.graphs_available() or 'not captured'})"))
    print(f"step: median {ms:.2f} ms (GPU events, {'each step read before the next' if args.sync else 'the trainer loop: the next step launched before the read'}), "
          f"{statistics.median(walls):.2f} ms wall | "
          f"{B * T / (ms / 1000):,.0f} tokens/s | last loss {loss:.4f}")
    if power:
        print(power)
        joules = None if e0 is None or e1 is None else e1 - e0
        print(describe_energy(joules, w1 - w0, args.steps, "step", meter.why))
    print(f"memory: {rt.allocated_bytes / 2**30:.2f} GiB allocated by the model "
          f"({model.activation_bytes() / 2**30:.2f} GiB activations) | "
          f"{(total - free1) / 2**30:.2f} GiB used on the device (context included; "
          f"{(total - free0) / 2**30:.2f} GiB before the model)")
    if args.precision == "bf16":  # (issue 13: memory below llm.c's at the same settings)
        ref = sum(llmc_train_bytes(cfg, B, T, args.recompute).values())
        print(f"llm.c's bf16 trainer at these settings allocates {ref / 2**30:.2f} GiB (its tensor sizes with cuDNN "
              f"attention, llmc.config.llmc_train_bytes; its context and cuDNN's workspace not counted)")


if __name__ == "__main__":
    main()
