"""Sample text from a GPT-2 checkpoint (ours or llm.c's), with a KV cache, on the GPU or the CPU.

    python sample_gpt2.py -e out/model_00000500.bin --prompt "ROMEO:" --max-new-tokens 200 \\
        --temperature 0.8 --top-k 40 --seed 1337 --device auto
    python sample_gpt2.py -e gpt2_124M.bin --prompt-file prompt.txt --num-samples 4 --stop-at-eot
    echo "The meaning of life is" | python sample_gpt2.py -e gpt2_124M.bin --prompt-file -
    python sample_gpt2.py -e gpt2_124M.bin --temperature 0      # greedy

Text streams to stdout as it is generated (one sample), or each sample is printed when the batch
is done (--num-samples N > 1). --no-kv-cache recomputes the whole context for every token (slow;
the baseline the cache is measured against).
"""
import argparse
import sys
import time

import numpy as np

from llmc.errors import LLMCError

EOT_TEXT = "<|endoftext|>"


def parse(argv=None):
    from llmc.train import OneLineParser
    p = OneLineParser(prog="sample_gpt2.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="gpt2_124M.bin", help="model checkpoint (llm.c format, v3 or v5) or a Hugging Face GPT-2 directory")
    p.add_argument("--prompt", default=None, help=f"prompt text (default {EOT_TEXT}: start from nothing)")
    p.add_argument("--prompt-file", default=None, help="read the prompt from a file ('-' = stdin)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=1.0, help="<= 0 means greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1, help="samples generated together as one batch")
    p.add_argument("--stop-at-eot", action="store_true", help="stop a sample at <|endoftext|>")
    p.add_argument("--device", default="auto", help="cpu | cuda | auto")
    p.add_argument("--no-kv-cache", action="store_true", help="full recomputation per token (baseline)")
    p.add_argument("--quiet", action="store_true", help="no timing line on stderr")
    return p.parse_args(argv)


class Streamer:
    """Prints tokens as they come, holding back bytes until they form complete UTF-8 characters."""

    def __init__(self, enc, out=sys.stdout):
        self.enc, self.out, self.buf = enc, out, b""

    def __call__(self, toks):
        self.buf += self.enc.decode_bytes([t for t in toks if t < self.enc.n_vocab])
        text, self.buf = _utf8_prefix(self.buf)
        self.out.write(text)
        self.out.flush()

    def flush(self):
        self.out.write(self.buf.decode("utf-8", errors="replace"))
        self.out.flush()
        self.buf = b""


def _utf8_prefix(b: bytes):
    for cut in range(len(b), max(len(b) - 4, -1), -1):
        try:
            return b[:cut].decode("utf-8"), b[cut:]
        except UnicodeDecodeError:
            continue
    return b.decode("utf-8", errors="replace"), b""


def main(argv=None) -> int:
    args = parse(argv)
    from llmc.hf import read_any_model
    from llmc.tokenizer import get_encoding
    if args.num_samples < 1:
        raise LLMCError(f"--num-samples {args.num_samples}: must be at least 1")
    if args.max_new_tokens < 0:
        raise LLMCError(f"--max-new-tokens {args.max_new_tokens}: must be >= 0")
    cfg, params = read_any_model(args.model)   # an llm.c .bin or an HF directory (config.json + model.safetensors)
    if not 0 <= args.top_k <= cfg.vocab_size:
        raise LLMCError(f"--top-k {args.top_k}: expected 0 (off) to the vocab size {cfg.vocab_size}")
    enc = get_encoding()
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8").read()
        except OSError as e:
            raise LLMCError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
    else:
        text = args.prompt if args.prompt is not None else EOT_TEXT
    prompt = enc.encode(text, allowed_special={EOT_TEXT})
    if not prompt:
        prompt = [enc.eot_token]
    if len(prompt) > cfg.max_seq_len:
        raise LLMCError(f"prompt is {len(prompt)} tokens, longer than the model's max sequence length "
                        f"{cfg.max_seq_len}")
    if args.temperature <= 0 and not args.quiet:
        print("[temperature <= 0: greedy decoding]", file=sys.stderr)

    from llmc.backend import make_backend
    be = make_backend(args.device)
    rng = np.random.default_rng(args.seed)
    top_k = args.top_k or None
    B = args.num_samples
    stream = Streamer(enc) if B == 1 else None
    if stream:
        sys.stdout.write(text)
    t0 = time.perf_counter()
    if args.no_kv_cache:
        from llmc.model import GPT2
        from llmc.sample import sample_token
        T = min(len(prompt) + args.max_new_tokens, cfg.max_seq_len)
        model = GPT2(cfg, be, B, T, training=False)
        model.load_params(params)
        outs = [[] for _ in range(B)]
        ctx = [list(prompt) for _ in range(B)]
        for _ in range(min(args.max_new_tokens, T - len(prompt))):
            x = np.zeros((B, T), np.int32)
            for b in range(B):
                x[b, :len(ctx[b])] = ctx[b]
            model.forward(x)
            new = [sample_token(model.logits_row(b, len(ctx[b]) - 1), args.temperature, top_k, rng) for b in range(B)]
            for b in range(B):
                ctx[b].append(new[b]); outs[b].append(new[b])
            if stream:
                stream(new[:1])
    else:
        from llmc.decode import Decoder, generate
        dec = Decoder(cfg, be, B, params=params)
        outs = generate(dec, prompt, args.max_new_tokens, args.temperature, top_k, rng,
                        stop_at_eot=args.stop_at_eot,
                        on_tokens=(lambda new, done: stream(new[:1]) if not done[0] or new[0] != enc.eot_token else None)
                        if stream else None)
    dt = time.perf_counter() - t0
    if stream:
        stream.flush()
        print()
    else:
        for b, toks in enumerate(outs):
            body = enc.decode([t for t in toks if t < enc.n_vocab and not (args.stop_at_eot and t == enc.eot_token)])
            print(f"--- sample {b + 1}/{B} ---\n{text}{body}")
    n = sum(len(o) for o in outs)
    if not args.quiet:
        print(f"[{n} tokens in {dt:.2f} s: {n / max(dt, 1e-9):.1f} tokens/s, {be.describe()}, "
              f"{'no cache' if args.no_kv_cache else 'KV cache'}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LLMCError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
