"""Benchmark: sampling speed of GPT-2 124M with and without the KV cache (GPU or CPU).

    python dev/bench_sample.py                      # batch 1 and 8, 64-token prompt, 256 new tokens
    python dev/bench_sample.py -e gpt2_124M.bin --device cuda

Tokens/s counts generated tokens (batch x new tokens) over the wall time of the whole generation,
prompt processing included, after one warm-up generation.
"""
import argparse
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


def no_cache(cfg, be, params, B, prompt, n, rng):
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
    return time.perf_counter() - t0


def with_cache(cfg, be, params, B, prompt, n, rng):
    dec = Decoder(cfg, be, B, params=params)
    t0 = time.perf_counter()
    generate(dec, prompt, n, 1.0, 40, rng)
    return time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="d12", help="checkpoint or descriptor (random init)")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--batches", default="1,8")
    args = p.parse_args()
    be = make_backend(args.device)
    if Path(args.model).exists():
        from llmc.checkpoint import read_model
        cfg, params = read_model(args.model)
    else:
        cfg = config_from_name(args.model)
        params = GPT2(cfg, be, 1, 1, training=False).init_params(0)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    print(f"{be.describe()} | {cfg.describe()} | prompt {args.prompt_len} tokens, {args.new} new")
    print("| batch | KV cache | tokens/s | s |\n| --- | --- | --- | --- |")
    for B in (int(b) for b in args.batches.split(",")):
        for name, fn in (("yes", with_cache), ("no", no_cache)):
            fn(cfg, be, params, B, prompt, 4, rng)  # warm-up (compiles, allocations)
            s = fn(cfg, be, params, B, prompt, args.new, rng)
            print(f"| {B} | {name} | {B * args.new / s:.1f} | {s:.2f} |", flush=True)


if __name__ == "__main__":
    main()
