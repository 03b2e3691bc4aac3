"""Benchmark: sampling speed of GPT-2 124M with and without the KV cache (GPU or CPU).

    python dev/bench_sample.py                      # batch 1 and 8, 64-token prompt, 256 new tokens
    python dev/bench_sample.py -e gpt2_124M.bin --device cuda --matmul-kernel 2

Tokens/s counts generated tokens (batch x new tokens) over the wall time of the whole generation,
prompt processing and top-k 40 sampling on the host included, after one warm-up generation. On the
cuda backend the KV-cache rows come twice: with the decode step captured into a CUDA graph (the
default) and launched kernel by kernel (LLMC_GRAPHS=0). "GPU ms/step" is the decode step alone
(CUDA events around 50 replays, median), the floor the host work sits on top of.
"""
import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from llmc.backend import make_backend  # noqa: E402
from llmc.config import config_from_name  # noqa: E402
from llmc.decode import Decoder, generate  # noqa: E402
from llmc.model import GPT2  # noqa: E402
from llmc.sample import sample_token  # noqa: E402
from llmc.train import kernel_flags  # noqa: E402


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


def profile_decode(cfg, be, params, B, pos, reps=20):
    """Each launch of one eager decode step at `pos` bracketed by CUDA events: (name, calls, us)
    per decoder op, median over reps, sorted by time."""
    rt = be.rt
    dec = Decoder(cfg, be, B, params=params)
    dec.step(np.zeros(B, np.int32), pos)  # builds; leaves token ids and pos on the device
    events = []
    for name, fn in list(dec.k.items()):
        def timed(*a, _fn=fn, _name=name):
            start, end = rt.event(), rt.event()
            start.record(rt.stream)
            _fn(*a)
            end.record(rt.stream)
            events.append((_name, start, end))
        dec.k[name] = timed
    per = {}
    for _ in range(reps):
        events.clear()
        dec._launch_step()
        rt.synchronize()
        tot = {}
        for name, start, end in events:
            calls, us = tot.get(name, (0, 0.0))
            tot[name] = (calls + 1, us + 1e3 * end.time_since(start))
        for name, v in tot.items():
            per.setdefault(name, []).append(v)
    rows = [(name, v[0][0], float(np.median([u for _, u in v]))) for name, v in per.items()]
    return sorted(rows, key=lambda r: -r[2])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="d12", help="checkpoint or descriptor (random init)")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--no-baseline", action="store_true", help="skip the rows without the cache")
    p.add_argument("--profile", action="store_true", help="also time each op of one decode step (cuda)")
    for flag, name, h in kernel_flags():
        p.add_argument(flag, type=int, default=None, dest=f"kernel_{name}", help=h)
    args = p.parse_args()
    kernels = {k[7:]: v for k, v in vars(args).items() if k.startswith("kernel_") and v is not None}
    be = make_backend(args.device, kernels)
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
    if args.profile and be.name == "cuda":
        pos = args.prompt_len + args.new - 1
        for B in (int(b) for b in args.batches.split(",")):
            rows = profile_decode(cfg, be, params, B, pos)
            total = sum(us for _, _, us in rows)
            print(f"\none decode step, batch {B}, position {pos}, launched op by op: {total:.1f} us in kernels")
            print("| op | calls | us | % |\n| --- | --- | --- | --- |")
            for name, calls, us in rows:
                print(f"| {name} | {calls} | {us:.1f} | {100 * us / total:.1f}% |")


if __name__ == "__main__":
    main()
