"""Tiny shakespeare -> GPT-2 tokens in llm.c's .bin shards, plus the GPT-2 tokenizer .bin.

    python prepro_tinyshakespeare.py              # tokenize the committed dev/data/tinyshakespeare/input.txt
    python prepro_tinyshakespeare.py --download   # fetch input.txt first (karpathy's char-rnn copy)
    python prepro_tinyshakespeare.py --force      # rewrite outputs that already exist

Writes (safe to re-run: existing outputs are skipped unless --force):
    dev/data/tinyshakespeare/tiny_shakespeare_val.bin    32,768 tokens (the first 32,768)
    dev/data/tinyshakespeare/tiny_shakespeare_train.bin  305,260 tokens (the rest)
    dev/data/gpt2_tokenizer.bin                          llm.c's tokenizer table (for decoding)
The counts are for the committed input.txt (1,115,394 bytes, sha256 86c4e6aa...); the names and
the split are llm.c's, so its shards and ours are interchangeable.

Tokenization, as llm.c does it: every blank-line-separated section (one speaker's lines) is its
own document, so the text is split on "\\n\\n", each section is prefixed with <|endoftext|> and the
sections are joined again with "\\n\\n". That is: "<|endoftext|>" + text with every "\\n\\n" replaced
by "\\n\\n<|endoftext|>", encoded with <|endoftext|> allowed as the special token 50256.
This is prepro_text.py's rule with its defaults (--doc-sep "\\n\\n", --val-tokens 32768): this script
is prepro_text.py with llm.c's tiny shakespeare file names, one shard per split.
The GPT-2 tokenizer works offline (see llmc/tokenizer.py); only --download needs the network.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

from llmc.errors import LLMCError
from prepro_text import tokenize_to_shards, write_tokenizer_once

ROOT = Path(__file__).resolve().parent
DATA_DIR = ROOT / "dev" / "data" / "tinyshakespeare"
TOKENIZER_OUT = ROOT / "dev" / "data" / "gpt2_tokenizer.bin"
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
VAL_TOKENS = 32768
# what the committed input.txt gives; printed so a user can see their run is the expected one
KNOWN_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
EXPECTED_TRAIN, EXPECTED_VAL = 305_260, 32_768

# -----------------------------------------------------------------------------
# download


def download(url: str, dest: Path, timeout: float = 30.0, retries: int = 3) -> None:
    """GET url into dest via dest.part (so a failed download never sits under the real name),
    retrying connection errors and 5xx answers, with a progress bar on a terminal."""
    import requests
    from requests.adapters import HTTPAdapter
    from tqdm import tqdm
    from urllib3.util.retry import Retry

    session = requests.Session()
    retry = Retry(total=retries, backoff_factor=0.5, status_forcelist=(429, 500, 502, 503, 504),
                  allowed_methods=("GET",))
    session.mount("http://", HTTPAdapter(max_retries=retry))
    session.mount("https://", HTTPAdapter(max_retries=retry))
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with session.get(url, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                raise LLMCError(f"download {url}: HTTP {r.status_code} {r.reason} (check --url)")
            total = int(r.headers.get("Content-Length", 0)) or None
            got = 0
            with open(part, "wb") as f, tqdm(total=total, unit="B", unit_scale=True,
                                             desc=dest.name, disable=None) as bar:
                for chunk in r.iter_content(chunk_size=1 << 16):
                    f.write(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
    except requests.RequestException as e:
        if isinstance(e, requests.Timeout):
            why = f"timed out after {timeout:g} s"
        elif isinstance(e, requests.exceptions.RetryError):
            why = f"the server kept failing ({retries} retries)"
        elif isinstance(e, requests.ConnectionError):
            why = "could not resolve the host" if "resolve" in str(e).lower() else "could not connect"
        else:
            why = type(e).__name__
        raise LLMCError(f"download {url}: {why}; the committed copy works offline: run without "
                        f"--download") from None
    if total is not None and got != total:
        os.remove(part)
        raise LLMCError(f"download {url}: got {got:,} bytes, server said {total:,}; try again")
    os.replace(part, dest)
    print(f"downloaded {url} -> {dest} ({got:,} bytes)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--download", action="store_true", help="fetch input.txt from --url first "
                        "(skipped if it exists, unless --force)")
    parser.add_argument("--url", default=URL, help="where --download fetches input.txt (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="rewrite outputs (and re-download) even if they exist")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR,
                        help="holds input.txt and receives the shards (default: %(default)s)")
    parser.add_argument("--tokenizer-out", type=Path, default=TOKENIZER_OUT,
                        help="where the tokenizer .bin goes (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=30.0, help="network timeout in seconds")
    parser.add_argument("--retries", type=int, default=3, help="retries on connection errors and 5xx")
    args = parser.parse_args(argv)
    try:
        run(args)
    except LLMCError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # an output we could not write: full disk, read-only or missing directory
        print(f"error: {e.filename or args.data_dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def run(args) -> None:
    data_dir: Path = args.data_dir
    src = data_dir / "input.txt"
    if args.download:
        if src.exists() and not args.force:
            print(f"{src} already exists, skipping download (--force to fetch again)")
        else:
            download(args.url, src, timeout=args.timeout, retries=args.retries)
    if not src.exists():
        raise LLMCError(f"{src}: not found (run with --download to fetch it)")

    write_tokenizer_once(args.tokenizer_out, args.force)

    val_path = data_dir / "tiny_shakespeare_val.bin"
    train_path = data_dir / "tiny_shakespeare_train.bin"
    if val_path.exists() and train_path.exists() and not args.force:
        print(f"{val_path} and {train_path.name} already exist, skipping (--force to rewrite)")
        return
    try:
        raw = src.read_bytes()
    except OSError as e:
        raise LLMCError(f"{src}: cannot read it ({e.strerror})") from None
    known = hashlib.sha256(raw).hexdigest() == KNOWN_SHA256
    # checked here too (prepro_text's streaming reader would also refuse it) to name the bad byte
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LLMCError(f"{src}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                        f"convert it, e.g. iconv -t UTF-8") from None
    names = {"val": val_path, "train": train_path}
    # one shard per split: the shard size is the most a shard's int32 count field holds
    written = tokenize_to_shards(src, lambda split, index: names[split], VAL_TOKENS, 2**31 - 1, "\n\n")
    counts = {split: n for _, split, n in written}
    for path, split, n in written:
        print(f"wrote {path} ({n:,} tokens)")
    if known:
        ok = (counts["train"], counts["val"]) == (EXPECTED_TRAIN, EXPECTED_VAL)
        print(f"expected for this input.txt: {EXPECTED_TRAIN:,} train / {EXPECTED_VAL:,} val tokens: "
              f"{'match' if ok else 'MISMATCH (different tokenizer?)'}")
    else:
        print(f"note: {src} is not the known tiny shakespeare (sha256 {KNOWN_SHA256[:8]}...), so the "
              f"counts differ from the expected {EXPECTED_TRAIN:,} train / {EXPECTED_VAL:,} val")


if __name__ == "__main__":
    sys.exit(main())
