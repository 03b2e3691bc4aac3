"""Benchmark: sampling speed of GPT-2 124M with and without the KV cache (GPU or CPU).

    python dev/bench_sample.py                      # batch 1 and 8, 64-token prompt, 256 new tokens
    python dev/bench_sample.py -e gpt2_124M.bin --device cuda --matmul-kernel 2
    python dev/bench_sample.py --device cuda --precision bf16   # the bf16 decoder

Tokens/s counts generated tokens (batch x new tokens) over the wall time of the whole generation,
prompt processing and top-k 40 sampling on the host included, after one warm-up generation. On the
cuda backend the KV-cache rows come twice: with the decode step captured into a CUDA graph (the
default) and launched kernel by kernel (LLMC_GRAPHS=0). "GPU ms/step" is the decode step alone
(CUDA events around 50 replays, median), the floor the host work sits on top of.
"""
import argparse
import os
import time
from pathlib import Path


import numpy as np

from llmc.backend import make_backend
from llmc.config import config_from_name
from llmc.decode import Decoder, generate
from llmc.model import GPT2
from llmc.sample import sample_token
from llmc.train import kernel_flags


def no_cache(cfg, be, params, B, prompt, n, rng):
    """Full recomputation: a (B, len(prompt)+n) forward for every new token."""
    T = len(prompt) + n
    m = GPT2(cfg, be, B, T, training=False)
    m.load_params(params)
    ctx = [list(prompt) for _ in range(B)]
    t0 = time.perf_counter()
    for _ in range(n):
        x = np.zeros((B, T), np.int32)
        for b in range(B):
            x[b, :len(ctx[b])] = ctx[b]
        m.forward(x)
        for b in range(B):
            ctx[b].append(sample_token(m.logits_row(b, len(ctx[b]) - 1), 1.0, 40, rng))
    return time.perf_counter() - t0, None


def with_cache(cfg, be, params, B, prompt, n, rng):
    dec = Decoder(cfg, be, B, params=params)
    t0 = time.perf_counter()
    generate(dec, prompt, n, 1.0, 40, rng)
    s = time.perf_counter() - t0
    gpu_ms = None
    if hasattr(be, "rt"):  # the decode step alone, at the last position, on the GPU
        dec.step(np.zeros(B, np.int32), len(prompt) + n - 1)
        gpu_ms = float(np.median(be.rt.time_ms(dec._run, warmup=3, repeat=50)))
    return s, gpu_ms


def decode_matmuls(be, cfg, rows=(1, 2, 4, 8), variants=(7, 8), reps=20):
    """The decode step's matmuls alone: (variant, N rows, us per launch), each timed as a CUDA
    graph of `reps` back-to-back launches (kernel by kernel from Python, the host would be the
    bottleneck for kernels this short)."""
    from llmc import ops
    rt, C, Vp = be.rt, cfg.channels, cfg.padded_vocab_size
    spec = ops.get("matmul_forward")
    shapes = {"qkv": (C, 3 * C), "attproj": (C, C), "fc": (C, 4 * C), "fcproj": (4 * C, C), "lmhead": (C, Vp)}
    w = {k: rt.empty((oc, c)) for k, (c, oc) in shapes.items()}
    rng = np.random.default_rng(0)
    for k, (c, oc) in shapes.items():
        w[k].set((rng.standard_normal((oc, c)) * 0.02).astype(np.float32))
    out = []
    for N in rows:
        x = rt.to_device(rng.standard_normal((N, 4 * C)).astype(np.float32))
        y = rt.empty((N, Vp))
        for v in variants:
            if any(spec.variant(v).refuse_reason(N=N, C=c, OC=oc) for c, oc in shapes.values()):
                continue
            launches = [(spec.build(rt, v, N=N, C=c, OC=oc, has_bias=False), w[k]) for k, (c, oc) in shapes.items()]

            def body():
                for _ in range(reps):
                    for fn, weight in launches:
                        fn(y, x, weight, None)
            g = rt.capture(body)
            ms = float(np.median(rt.time_ms(g, warmup=2, repeat=10)))
            out.append((v, N, 1e3 * ms / reps))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="d12", help="checkpoint or descriptor (random init)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--no-baseline", action="store_true", help="skip the rows without the cache")
    p.add_argument("--matmuls", action="store_true",
                   help="also time the decode matmuls (qkv, attproj, fc, fcproj, lm head) per variant and batch")
    for flag, name, h in kernel_flags():
        p.add_argument(flag, type=int, default=None, dest=f"kernel_{name}", help=h)
    args = p.parse_args()
    kernels = {k[7:]: v for k, v in vars(args).items() if k.startswith("kernel_") and v is not None}
    be = make_backend(args.device, kernels, precision=args.precision)
    if Path(args.model).exists():
        from llmc.checkpoint import read_model
        cfg, params = read_model(args.model)
    else:
        cfg = config_from_name(args.model)
        params = GPT2(cfg, be, 1, 1, training=False).init_params(0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    print(f"{be.describe()} | {cfg.describe()} | prompt {args.prompt_len} tokens, {args.new} new, top-k 40"
          + (f" | kernels {kernels}" if kernels else ""))
    print("| batch | KV cache | CUDA graph | tokens/s | ms per step | GPU ms/step |\n"
          "| --- | --- | --- | --- | --- | --- |")
    modes = [("yes", "yes", with_cache)] if be.name == "cuda" else []
    modes += [("yes", "no" if be.name == "cuda" else "-", with_cache)]
    if not args.no_baseline:
        modes += [("no", "-", no_cache)]
    for B in (int(b) for b in args.batches.split(",")):
        for cache, graph, fn in modes:
            os.environ["LLMC_GRAPHS"] = "0" if graph == "no" else "1"
            fn(cfg, be, params, B, prompt, 4, rng)  # warm-up (compiles, allocations)
            s, gpu_ms = fn(cfg, be, params, B, prompt, args.new, rng)
            print(f"| {B} | {cache} | {graph} | {B * args.new / s:.1f} | {1e3 * s / args.new:.2f} | "
                  f"{'-' if gpu_ms is None else f'{gpu_ms:.3f}'} |", flush=True)
    os.environ.pop("LLMC_GRAPHS", None)
    if args.matmuls and be.name == "cuda":
        print("\nthe five matmuls of a decode layer + lm head, one set of launches, CUDA graph of 20 sets")
        print("| matmul_forward variant | rows (batch) | us |\n| --- | --- | --- |")
        for v, N, us in decode_matmuls(be, cfg):
            print(f"| {v} | {N} | {us:.1f} |")


if __name__ == "__main__":
    main()
