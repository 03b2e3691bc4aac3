"""Sample text from a GPT-2 checkpoint (ours or llm.c's), with a KV cache, on the GPU or the CPU.
The body of sample_gpt2.py and of the llmc-sample command (same flags).

    python sample_gpt2.py -o out --prompt "ROMEO:"          # the newest model of a run directory
    python sample_gpt2.py -e out/model_00000500.bin --prompt "ROMEO:" --max-new-tokens 200 \\
        --temperature 0.8 --top-k 40 --seed 1337 --device auto
    python sample_gpt2.py -e gpt2_124M.bin --prompt-file prompt.txt --num-samples 4 --stop-at-eot
    echo "The meaning of life is" | python sample_gpt2.py -e gpt2_124M.bin --prompt-file -
    python sample_gpt2.py -e gpt2_124M.bin --temperature 0      # greedy
    python sample_gpt2.py -e gpt2_124M.bin --precision bf16     # decode with the bf16 kernels (GPU)
    python sample_gpt2.py -e hf_dir --prompt "Hello"          # a Hugging Face GPT-2 directory

Text streams to stdout as it is generated (one sample), or each sample is printed when the batch
is done (--num-samples N > 1). Everything else (notes, the timing line) goes to stderr, so stdout
is only the text. --no-kv-cache recomputes the whole context for every token (slow; the baseline
the cache is measured against).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import sys
import time

import numpy as np

from llmc import switches
from llmc.errors import LLMCError

EOT_TEXT = "<|endoftext|>"
DEFAULT_MODEL = "gpt2_124M.bin"


def build_parser():
    from llmc.train import HelpFormatter, OneLineParser, number
    p = OneLineParser(prog="sample_gpt2.py", description=__doc__, formatter_class=HelpFormatter)
    a = p.add_argument
    a("-e", "--model", default=None, help=f"model checkpoint, llm.c format v3 or v5, or a Hugging Face GPT-2 "
      f"directory (config.json + model.safetensors) (default: {DEFAULT_MODEL}, or with -o the newest model there)")
    a("-o", "--output-dir", default=None, help="a run directory (train_gpt2.py -o): sample from its newest "
      "complete checkpoint")
    a("--prompt", default=None, help=f"prompt text (default: {EOT_TEXT}, i.e. start from nothing)")
    a("--prompt-file", default=None, help="read the prompt from a UTF-8 file ('-' = stdin)")
    a("--max-new-tokens", type=number(int, 0), default=200, help="tokens to generate per sample")
    a("--temperature", type=number(float, 0.0), default=1.0, help="softmax temperature; 0 = greedy")
    a("--top-k", type=number(int, 0), default=0, help="keep the k most likely tokens (0 = all)")
    a("--seed", type=number(int, 0), default=1337, help="sampling seed")
    a("--num-samples", type=number(int, 1), default=1, help="samples generated together as one batch")
    a("--stop-at-eot", action="store_true", help="stop a sample at <|endoftext|>")
    a("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto = the GPU when usable")
    a("--precision", default="fp32", choices=("fp32", "bf16"),
      help="bf16: weights, activations and KV cache in bf16, decoded by the bf16 kernels (GPU only)")
    a("--no-kv-cache", action="store_true", help="full recomputation per token (baseline)")
    a("--quiet", action="store_true", help="no timing line on stderr")
    return p


def model_in_run_dir(out_dir: str) -> str:
    """The model file of the newest complete checkpoint in a run directory (a DONE marker), or the
    newest model_*.bin when there are no markers (a directory of bare model files)."""
    from llmc import runfiles
    if not os.path.isdir(out_dir):
        raise LLMCError(f"-o/--output-dir {out_dir}: not a directory (a train_gpt2.py -o run directory)")
    last = runfiles.latest_done(out_dir)
    if last is not None and os.path.exists(runfiles.model_path(out_dir, last)):
        return runfiles.model_path(out_dir, last)
    models = [(int(m.group(1)), f) for f in glob.glob(os.path.join(out_dir, "model_*.bin"))
              if (m := re.fullmatch(r"model_(\d+)\.bin", os.path.basename(f)))]
    if not models:
        raise LLMCError(f"-o/--output-dir {out_dir}: no model_*.bin checkpoint there (train with "
                        f"python train_gpt2.py -o {out_dir} first)")
    return max(models)[1]


def read_prompt(args) -> str:
    if args.prompt_file is None:
        return args.prompt if args.prompt is not None else EOT_TEXT
    name = "stdin" if args.prompt_file == "-" else args.prompt_file
    try:
        if args.prompt_file == "-":
            raw = sys.stdin.buffer.read()
        else:
            with open(args.prompt_file, "rb") as f:
                raw = f.read()
    except OSError as e:
        raise LLMCError(f"--prompt-file {args.prompt_file}: {e.strerror}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LLMCError(f"--prompt-file {name}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                        f"{e.start}); convert it, e.g. iconv -t UTF-8") from None


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
    args = build_parser().parse_args(argv)
    switches.check_environment()
    from llmc.hf import read_any_model
    from llmc.tokenizer import get_encoding
    if args.model is not None:
        path = args.model
    elif args.output_dir is not None:
        path = model_in_run_dir(args.output_dir)
    else:
        path = DEFAULT_MODEL
        if not os.path.exists(path):
            raise LLMCError(f"model file {path}: not found (./download_starter_pack.sh fetches it; or "
                            f"-o out to sample the model that make train wrote, or -e FILE)")
    cfg, params = read_any_model(path)   # an llm.c .bin or an HF directory (config.json + model.safetensors)
    if not args.top_k <= cfg.vocab_size:
        raise LLMCError(f"--top-k {args.top_k}: expected 0 (off) to the vocab size {cfg.vocab_size}")
    enc = get_encoding()
    text = read_prompt(args)
    prompt = enc.encode(text, allowed_special={EOT_TEXT})
    if not prompt:
        prompt = [enc.eot_token]
    if len(prompt) > cfg.max_seq_len:
        raise LLMCError(f"prompt is {len(prompt)} tokens, longer than the model's max sequence length "
                        f"{cfg.max_seq_len}")
    if not args.quiet:
        print(f"[{path}: {cfg.describe()}]", file=sys.stderr)
        if args.temperature <= 0:
            print("[temperature 0: greedy decoding]", file=sys.stderr)

    # everything the build prints (fallback notes, the compile message) is a diagnostic: stderr
    with contextlib.redirect_stdout(sys.stderr):
        from llmc.backend import make_backend
        be = make_backend(args.device, precision=args.precision)
    rng = np.random.default_rng(args.seed)
    top_k = args.top_k or None
    B = args.num_samples
    stream = Streamer(enc) if B == 1 else None
    t0 = time.perf_counter()
    if args.no_kv_cache:
        from llmc.model import GPT2
        from llmc.sample import sample_token
        T = min(len(prompt) + args.max_new_tokens, cfg.max_seq_len)
        with contextlib.redirect_stdout(sys.stderr):
            model = GPT2(cfg, be, B, T, training=False)
        model.load_params(params)
        if stream:
            sys.stdout.write(text)
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
        with contextlib.redirect_stdout(sys.stderr):
            dec = Decoder(cfg, be, B, params=params)
        if stream:
            sys.stdout.write(text)
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


def cli(argv=None) -> int:
    """Entry point: user and machine faults become one line on stderr and a non-zero exit."""
    try:
        return main(argv)
    except LLMCError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head`: the reader has gone; nothing more to say
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")
        return 0
    except MemoryError:
        print("error: out of host memory (try --num-samples 1 or a smaller model)", file=sys.stderr)
        return 1
    except OSError as e:
        where = f" {e.filename}" if e.filename else ""
        print(f"error:{where}: {e.strerror or e}", file=sys.stderr)
        return 1


def cli_main() -> None:
    """The llmc-sample console command."""
    sys.exit(cli())
