"""The GPT-2 tokenizer, offline, and llm.c's tokenizer .bin (token id -> bytes, for decoding).

    from llmc.tokenizer import get_encoding, write_tokenizer, TokenizerBin, find_tokenizer_bin
    enc = get_encoding()                       # tiktoken's "gpt2" Encoding, no network needed
    enc.encode("Hello world")                  # [15496, 995]
    write_tokenizer("dev/data/gpt2_tokenizer.bin", enc)
    tok = TokenizerBin.from_file(find_tokenizer_bin())
    tok.decode([15496, 995])                   # "Hello world"

get_encoding() tries, in this order, and never waits on the network when a local copy exists:
  1. tiktoken's own cache already holds the two GPT-2 files (vocab.bpe, encoder.json), with the
     sha256 tiktoken expects: tiktoken.get_encoding("gpt2") reads them from there, no network.
  2. the copies shipped in this package (llmc/vocab/, from OpenAI's GPT-2 release, as tiktoken
     fetches them): we check their sha256 against the hashes tiktoken expects and build the
     identical Encoding from them (gpt2's regex pattern from tiktoken_ext.openai_public, 50257
     tokens, <|endoftext|> = 50256).
  3. unless LLMC_OFFLINE=1: download the two files ourselves, with a timeout (tiktoken's own
     download has none and can hang), into tiktoken's cache, and go to 1.
  Otherwise: LLMCError (the package's copies are missing or corrupt: reinstall it).

Tokenizer .bin (llm.c's format): a 256 x int32 little-endian header, header[0]=20240328 magic,
[1]=2 version, [2]=vocab size (50257), [3]=eot token id (50256); then for each token id in order
a uint8 length followed by that many bytes. (Version 1 files, from older llm.c, lack header[3]; we
read them with eot = 50256 as llm.c does.) Token byte strings are not always valid UTF-8 on their
own (a multi-byte character can be split across tokens), so decode() joins the bytes of all ids
first and only then decodes, replacing invalid sequences.

Where the .bin lives: download_starter_pack.sh puts llm.c's copy in the repo root (gpt2_tokenizer.bin,
where llm.c looks); prepro_tinyshakespeare.py writes ours to dev/data/gpt2_tokenizer.bin (beside
the data, git-ignored). find_tokenizer_bin() returns whichever exists, root first.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np

from llmc.checkpoint import HEADER_BYTES, atomic_open, make_header, read_header
from llmc import switches
from llmc.errors import LLMCError

TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2
GPT2_EOT = 50256
GPT2_N_VOCAB = 50257

# the two files of the original GPT-2 release, where tiktoken fetches them, and the sha256 it expects
GPT2_FILES = {
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}
DOWNLOAD_TIMEOUT = (5, 30)  # seconds: connect, read

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_BIN_PATHS = (ROOT / "gpt2_tokenizer.bin", ROOT / "dev" / "data" / "gpt2_tokenizer.bin")

encoding_source = None  # where get_encoding() found the files: "tiktoken cache", "shipped copy", ...

# -----------------------------------------------------------------------------
# tiktoken "gpt2" Encoding, offline


def _sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _tiktoken_cache_dir() -> str | None:
    """tiktoken's cache directory, by its own rules (None when caching is disabled)."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return os.environ[var] or None
    import tempfile
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _tiktoken_cache_path(url: str) -> str | None:
    d = _tiktoken_cache_dir()  # tiktoken keys its cache files by the sha1 of the URL
    return None if d is None else os.path.join(d, hashlib.sha1(url.encode()).hexdigest())


def _in_tiktoken_cache() -> bool:
    for url, sha in GPT2_FILES.values():
        p = _tiktoken_cache_path(url)
        if p is None or not os.path.isfile(p) or _sha256(p) != sha:
            return False
    return True


VOCAB_DIR = Path(__file__).resolve().parent / "vocab"  # the two files, shipped with the package


def _shipped_vocab_dir() -> Path | None:
    """llmc/vocab/ if both files are there."""
    return VOCAB_DIR if all((VOCAB_DIR / name).is_file() for name in GPT2_FILES) else None


def _encoding_from_files(vocab_bpe: str, encoder_json: str):
    """Build tiktoken's gpt2 Encoding from local copies of the two files (hashes checked)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str
    for name, path in (("vocab.bpe", vocab_bpe), ("encoder.json", encoder_json)):
        if _sha256(path) != GPT2_FILES[name][1]:
            raise LLMCError(f"tokenizer file {path}: sha256 mismatch (expected "
                            f"{GPT2_FILES[name][1]}; corrupt copy? reinstall llmc-py)")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(vocab_bpe), encoder_json_file=str(encoder_json),
                                            vocab_bpe_hash=GPT2_FILES["vocab.bpe"][1],
                                            encoder_json_hash=GPT2_FILES["encoder.json"][1])
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: GPT2_EOT}, explicit_n_vocab=GPT2_N_VOCAB)


def _download_to_tiktoken_cache() -> None:
    import requests
    for name, (url, sha) in GPT2_FILES.items():
        dest = _tiktoken_cache_path(url)
        if dest is None:
            raise LLMCError("tokenizer: tiktoken caching is disabled (TIKTOKEN_CACHE_DIR=''), "
                            "cannot download; reinstall llmc-py (it ships the files)")
        if os.path.isfile(dest) and _sha256(dest) == sha:
            continue
        try:
            r = requests.get(url, timeout=DOWNLOAD_TIMEOUT)
            r.raise_for_status()
        except requests.RequestException as e:
            raise LLMCError(f"tokenizer: no local GPT-2 files and downloading {url} failed "
                            f"({type(e).__name__}); reinstall llmc-py (it ships the files) to work offline") from None
        if hashlib.sha256(r.content).hexdigest() != sha:
            raise LLMCError(f"tokenizer: {url} downloaded with a wrong sha256 (expected {sha})")
        with atomic_open(dest) as f:
            f.write(r.content)


@functools.lru_cache(maxsize=None)
def get_encoding():
    """tiktoken's "gpt2" Encoding without touching the network when a local copy exists."""
    global encoding_source
    try:
        import tiktoken
    except ImportError:
        raise LLMCError("tokenizer: tiktoken is not installed (pip install tiktoken)") from None
    if _in_tiktoken_cache():
        encoding_source = "tiktoken cache"
        return tiktoken.get_encoding("gpt2")
    d = _shipped_vocab_dir()
    if d is not None:
        encoding_source = f"shipped copy ({d})"
        return _encoding_from_files(d / "vocab.bpe", d / "encoder.json")
    if switches.on("LLMC_OFFLINE"):
        raise LLMCError("tokenizer: no local copy of the GPT-2 BPE files and LLMC_OFFLINE is set; "
                        "llmc/vocab/ (shipped with the package) is missing them: reinstall llmc-py")
    _download_to_tiktoken_cache()
    encoding_source = "downloaded into the tiktoken cache"
    return tiktoken.get_encoding("gpt2")


# -----------------------------------------------------------------------------
# llm.c's tokenizer .bin


def write_tokenizer(path, encoding=None) -> None:
    """Write encoding's token table (default: get_encoding()) as an llm.c tokenizer .bin. Atomic."""
    enc = encoding if encoding is not None else get_encoding()
    n, eot = enc.n_vocab, enc.eot_token
    parts = [make_header(TOKENIZER_MAGIC, TOKENIZER_VERSION, n, eot).tobytes()]
    for i in range(n):
        b = enc.decode_single_token_bytes(i)
        if not 0 < len(b) < 256:
            raise ValueError(f"write_tokenizer: token {i} has {len(b)} bytes, the format allows 1..255")
        parts.append(bytes([len(b)]) + b)
    with atomic_open(path) as f:
        f.write(b"".join(parts))


class TokenizerBin:
    """llm.c's decode-only tokenizer: token id -> bytes, from a tokenizer .bin."""

    def __init__(self, tokens: list[bytes], eot_token: int, path=None):
        self.tokens = tokens
        self.eot_token = eot_token
        self.path = path

    @classmethod
    def from_file(cls, path) -> "TokenizerBin":
        kind = "tokenizer file"
        h = read_header(path, kind, TOKENIZER_MAGIC, (1, 2), "an llm.c tokenizer (gpt2_tokenizer.bin)")
        n = int(h[2])
        eot = int(h[3]) if int(h[1]) == 2 else GPT2_EOT
        if n <= 0 or not 0 <= eot < n:
            raise LLMCError(f"{kind} {path}: header says vocab size {n}, eot id {eot} (corrupt header?)")
        data = Path(path).read_bytes()[HEADER_BYTES:]
        tokens, off = [], 0
        for i in range(n):
            if off >= len(data):
                raise LLMCError(f"{kind} {path}: truncated: header says {n:,} tokens, the data ends "
                                f"after {i:,}")
            length = data[off]
            if off + 1 + length > len(data):
                raise LLMCError(f"{kind} {path}: truncated: header says {n:,} tokens, token {i:,} "
                                f"(length {length}) runs past the end of the file")
            tokens.append(data[off + 1:off + 1 + length])
            off += 1 + length
        if off != len(data):
            raise LLMCError(f"{kind} {path}: too long: header says {n:,} tokens, they end at byte "
                            f"{HEADER_BYTES + off:,}, file has {HEADER_BYTES + len(data):,} bytes")
        return cls(tokens, eot, path)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def n_vocab(self) -> int:  # the same name as tiktoken's Encoding, so either can decode samples
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def decode_bytes(self, ids) -> bytes:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(self.tokens)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = int(ids[(ids < 0) | (ids >= n)][0])
            raise LLMCError(f"tokenizer {self.path}: token id {bad} out of range for vocab size {n} "
                            f"(a padded-vocab logit was sampled?)")
        return b"".join(self.tokens[i] for i in ids.tolist())

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def find_tokenizer_bin() -> Path | None:
    """The tokenizer .bin to use: the repo root's (starter pack / llm.c), else dev/data's (prepro)."""
    for p in TOKENIZER_BIN_PATHS:
        if p.is_file():
            return p
    return None
