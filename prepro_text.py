"""Your own text -> GPT-2 tokens in llm.c's .bin shards (val, then train), plus the tokenizer .bin.

    python prepro_text.py --input my.txt                       # -> dev/data/my/my_val_000000.bin, my_train_000001.bin
    python prepro_text.py --input books.txt --shard-size 100000000 --val-tokens 1000000
    python prepro_text.py --input notes.txt --doc-sep ''       # the whole file is one document
    python prepro_text.py --input my.txt --force               # rewrite what is already there
    python train_gpt2.py -i "dev/data/my/my_train_*.bin" -j "dev/data/my/my_val_*.bin"

Any UTF-8 text, any size: the file is read in chunks (a progress bar shows the bytes done), so memory
stays at about one shard. Documents: the text is cut after every --doc-sep (default a blank line,
"\\n\\n", as llm.c does for tiny shakespeare; the separator stays with the document before it) and
every document starts with <|endoftext|> (50256), which is how llm.c's prepro scripts mark where a
document begins. The text itself is encoded as plain text: a literal "<|endoftext|>" in it is not
the special token.

Shards are llm.c's (a 256-int32 header, magic 20240520, then uint16 tokens) and named as llm.c's
fineweb.py names them: shard 0 (and more if --val-tokens > --shard-size) is val, the rest train,
NAME_{val,train}_{index:06d}.bin, at most --shard-size tokens each. The val shard is the first
--val-tokens tokens of the text. prepro_tinyshakespeare.py is this script with its own file names.

A document longer than about 4 MiB of text is tokenized in pieces, cut only where the GPT-2
pre-tokenizer itself would put a boundary (a whitespace character right after a non-whitespace
one), so the tokens are the same as encoding it whole (tests/test_prepro_text.py checks that).
"""
from __future__ import annotations

import argparse
import codecs
import os
import re
import sys
from pathlib import Path

import numpy as np

from llmc.errors import LLMCError

ROOT = Path(__file__).resolve().parent
TOKENIZER_OUT = ROOT / "dev" / "data" / "gpt2_tokenizer.bin"
EOT = 50256
DEFAULT_SHARD = 100_000_000   # llm.c's fineweb.py shard size
DEFAULT_VAL = 32_768          # what llm.c holds out of tiny shakespeare
CHUNK_BYTES = 1 << 20
MAX_PIECE_CHARS = 1 << 22
BATCH_CHARS = 1 << 21         # text handed to tiktoken's threaded batch encoder at once

# -----------------------------------------------------------------------------
# text -> documents -> tokens


_CUT = re.compile(r"\S(?=\s)")


def _safe_cut(text: str) -> int | None:
    """The last position p where text[p-1] is not whitespace and text[p] is. No piece of GPT-2's
    pre-tokenizer (its regex) spans p, and the only rule that looks ahead (a whitespace run not
    followed by a non-space) cannot end at text[p-1], so encoding text[:p] and text[p:] apart gives
    the tokens of encoding text whole. None if there is no such place. Looks at the tail first."""
    for start in (max(len(text) - (1 << 16), 0), 0):
        last = None
        for last in _CUT.finditer(text, start):
            pass
        if last is not None:
            return last.end()
    return None


def read_documents(path, sep: str = "\n\n", on_bytes=None, chunk_bytes: int = CHUNK_BYTES,
                   max_piece: int = MAX_PIECE_CHARS):
    """Yield (text, starts_document) pieces of the UTF-8 file at path, streamed. A document is
    everything up to and including a sep ('' : the whole file is one); one longer than max_piece
    characters comes in several pieces, cut at safe places (_safe_cut). on_bytes(n) after each read."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, start, done = "", True, 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(chunk_bytes)
            try:
                buf += decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise LLMCError(f"{path}: not UTF-8 text (bad byte at offset {done + max(e.start, 0):,})") from None
            done += len(raw)
            if sep:
                parts = buf.split(sep)
                for part in parts[:-1]:
                    yield part + sep, start
                    start = True
                buf = parts[-1]
            while len(buf) > max_piece:
                cut = _safe_cut(buf)
                if cut is None:
                    break  # no safe place (one giant word): keep it whole
                yield buf[:cut], start
                buf, start = buf[cut:], False
            if on_bytes:
                on_bytes(len(raw))
            if not raw:
                break
    if buf or start:
        yield buf, start


def encode_documents(pieces, enc, threads: int = 0):
    """(text, starts_document) pieces -> uint16 token arrays: <|endoftext|> before each document,
    the text encoded as plain text, batched through tiktoken's threaded encoder."""
    threads = threads or min(8, os.cpu_count() or 1)
    batch, starts, size = [], [], 0

    def flush():
        out = []
        for s, toks in zip(starts, enc.encode_ordinary_batch(batch, num_threads=threads)):
            out.append(np.array(([EOT] if s else []) + toks, dtype=np.uint16))
        return np.concatenate(out) if out else np.zeros(0, np.uint16)

    for text, s in pieces:
        batch.append(text); starts.append(s); size += len(text) + 1
        if size >= BATCH_CHARS:
            yield flush()
            batch, starts, size = [], [], 0
    if batch:
        yield flush()


# -----------------------------------------------------------------------------
# tokens -> shards


class ShardWriter:
    """Cuts a stream of token arrays into shards: the first val_tokens tokens are val, then train;
    every shard has at most shard_size tokens. path_for(split, index) names shard number index.
    Nothing is written for val until the first train token arrives (or the stream ends), so a text
    too small to leave anything for training fails before writing (with val <= shard_size)."""

    def __init__(self, path_for, val_tokens: int, shard_size: int):
        self.path_for, self.val_left, self.shard_size = path_for, val_tokens, shard_size
        self.pending, self.pending_n, self.split, self.index = [], 0, "val" if val_tokens > 0 else "train", 0
        self.written = []   # (path, split, tokens)
        self.total = 0

    def add(self, toks: np.ndarray) -> None:
        while toks.size:
            if self.split == "val" and self.val_left == 0:
                self._flush()
                self.split = "train"
            room = self.shard_size - self.pending_n
            if self.split == "val":
                room = min(room, self.val_left)
            take = toks[:room]
            self.pending.append(take); self.pending_n += take.size; self.total += take.size
            if self.split == "val":
                self.val_left -= take.size
            toks = toks[room:]
            if self.pending_n == self.shard_size and not (self.split == "val" and self.val_left == 0):
                self._flush()

    def _flush(self) -> None:
        from llmc.data import write_shard
        if not self.pending_n:
            return
        path = self.path_for(self.split, self.index)
        write_shard(path, np.concatenate(self.pending))
        self.written.append((path, self.split, self.pending_n))
        self.pending, self.pending_n, self.index = [], 0, self.index + 1

    def close(self) -> list:
        if not any(s == "train" for _, s, _ in self.written) and not (self.split == "train" and self.pending_n):
            raise LLMCError(f"the text gave {self.total:,} tokens, all held out for val (--val-tokens): "
                            f"nothing left to train on; use a smaller --val-tokens")
        self._flush()
        return self.written


def tokenize_to_shards(path, path_for, val_tokens: int, shard_size: int, sep: str = "\n\n",
                       enc=None, progress: bool = True) -> list:
    """The whole pipeline: read (streamed), split into documents, encode, write shards.
    Returns [(path, split, tokens)] of the shards written."""
    from tqdm import tqdm

    from llmc.tokenizer import get_encoding
    if shard_size < 1 or val_tokens < 0:
        raise LLMCError(f"--shard-size {shard_size} / --val-tokens {val_tokens}: expected >= 1 / >= 0")
    if not Path(path).is_file():
        raise LLMCError(f"--input {path}: not found")
    enc = enc or get_encoding()
    writer = ShardWriter(path_for, val_tokens, shard_size)
    with tqdm(total=Path(path).stat().st_size, unit="B", unit_scale=True, desc=Path(path).name,
              disable=None if progress else True) as bar:
        for toks in encode_documents(read_documents(path, sep, on_bytes=bar.update), enc):
            writer.add(toks)
    return writer.close()


def write_tokenizer_once(path, force: bool) -> None:
    from llmc.tokenizer import get_encoding, write_tokenizer
    if Path(path).exists() and not force:
        print(f"{path} already exists, skipping")
        return
    enc = get_encoding()
    write_tokenizer(path, enc)
    print(f"wrote {path} ({enc.n_vocab:,} tokens, eot {enc.eot_token})")


# -----------------------------------------------------------------------------
# command line


def fineweb_names(out_dir: Path, name: str):
    return lambda split, index: out_dir / f"{name}_{split}_{index:06d}.bin"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--input", required=True, type=Path, help="a UTF-8 text file")
    p.add_argument("--output-dir", type=Path, default=None, help="where the shards go (default dev/data/<input name>)")
    p.add_argument("--name", default=None, help="shard name prefix (default: the input's name without suffix)")
    p.add_argument("--shard-size", type=int, default=DEFAULT_SHARD, help="most tokens per shard (default %(default)s)")
    p.add_argument("--val-tokens", type=int, default=DEFAULT_VAL, help="the first N tokens are val (default %(default)s)")
    p.add_argument("--doc-sep", default="\\n\\n", help="document separator, backslash escapes allowed; '' = "
                   "one document (default: a blank line, \\n\\n)")
    p.add_argument("--tokenizer-out", type=Path, default=TOKENIZER_OUT, help="llm.c's tokenizer .bin (default %(default)s)")
    p.add_argument("--force", action="store_true", help="rewrite shards (and the tokenizer) that exist")
    args = p.parse_args(argv)
    try:
        run(args)
    except LLMCError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def run(args) -> None:
    name = args.name or args.input.stem
    if not re.fullmatch(r"[\w.-]+", name):
        raise LLMCError(f"--name {name!r}: use letters, digits, '.', '-' and '_' only")
    out_dir = args.output_dir or ROOT / "dev" / "data" / name
    try:
        sep = codecs.decode(args.doc_sep, "unicode_escape")
    except UnicodeDecodeError as e:
        raise LLMCError(f"--doc-sep {args.doc_sep!r}: bad escape ({e.reason})") from None
    if not args.input.is_file():
        raise LLMCError(f"--input {args.input}: not found")
    write_tokenizer_once(args.tokenizer_out, args.force)
    pattern = re.compile(rf"{re.escape(name)}_(val|train)_\d{{6}}\.bin")
    old = [f for f in out_dir.glob(f"{name}_*.bin") if pattern.fullmatch(f.name)] if out_dir.is_dir() else []
    if old and not args.force:
        print(f"{out_dir}/{name}_*.bin already exist ({len(old)} shards), skipping (--force to rewrite)")
        return
    written = tokenize_to_shards(args.input, fineweb_names(out_dir, name), args.val_tokens, args.shard_size, sep)
    for path, split, n in written:
        print(f"wrote {path} ({n:,} {split} tokens)")
    for f in old:   # shards of an earlier, longer run that this one did not overwrite
        if Path(f) not in {Path(w) for w, _, _ in written}:
            f.unlink()
    print(f"train with: python train_gpt2.py -i \"{out_dir}/{name}_train_*.bin\" -j \"{out_dir}/{name}_val_*.bin\"")


if __name__ == "__main__":
    sys.exit(main())
