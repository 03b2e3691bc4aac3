"""The offline GPT-2 tokenizer and llm.c's tokenizer .bin.

    python -m pytest tests/test_tokenizer.py -q
"""
import hashlib
import shutil

import numpy as np
import pytest

import llmc.tokenizer as tk
from llmc.checkpoint import HEADER_BYTES
from llmc.errors import LLMCError
from llmc.tokenizer import TokenizerBin, get_encoding, write_tokenizer
from llmc_fixtures import header_bytes, write_llmc_tokenizer

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "Ünïcödé, emoji 🤖, 中文, tabs\tand   spaces  \n")


@pytest.fixture
def fresh_encoding(monkeypatch, tmp_path):
    """get_encoding() with its memo cleared and tiktoken's cache pointed at an empty directory."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    monkeypatch.setenv("LLMC_OFFLINE", "1")  # a test never touches the network
    get_encoding.cache_clear()
    yield tmp_path / "tiktoken-cache"
    get_encoding.cache_clear()


def test_known_ids():
    enc = get_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]
    assert enc.decode(enc.encode(TEXT)) == TEXT


def test_shipped_files_offline(fresh_encoding):
    enc = get_encoding()
    assert tk.encoding_source.startswith("shipped copy")
    assert enc.name == "gpt2" and enc.encode("Hello world") == [15496, 995]
    assert enc.decode(enc.encode(TEXT)) == TEXT


def test_from_tiktoken_cache(fresh_encoding):
    """With the two files in tiktoken's cache, tiktoken itself loads them (no network)."""
    src = tk._shipped_vocab_dir()
    fresh_encoding.mkdir()
    for name, (url, _) in tk.GPT2_FILES.items():
        shutil.copy(src / name, fresh_encoding / hashlib.sha1(url.encode()).hexdigest())
    import tiktoken.registry
    tiktoken.registry.ENCODINGS.pop("gpt2", None)  # make tiktoken really read its cache
    enc = get_encoding()
    assert tk.encoding_source == "tiktoken cache"
    assert enc.encode(TEXT) == tk._encoding_from_files(src / "vocab.bpe", src / "encoder.json").encode(TEXT)


def test_no_source_is_one_clear_error(fresh_encoding, monkeypatch):
    monkeypatch.setattr(tk, "_shipped_vocab_dir", lambda: None)
    with pytest.raises(LLMCError, match="reinstall llmc-py") as e:
        get_encoding()
    assert "\n" not in str(e.value)


def test_shipped_files_have_tiktokens_hashes():
    """The two files in llmc/vocab/ are byte for byte the ones tiktoken fetches for "gpt2"."""
    for name, (_, sha) in tk.GPT2_FILES.items():
        assert hashlib.sha256((tk.VOCAB_DIR / name).read_bytes()).hexdigest() == sha, name


def test_corrupt_local_files(tmp_path):
    src = tk._shipped_vocab_dir()
    shutil.copy(src / "encoder.json", tmp_path / "encoder.json")
    (tmp_path / "vocab.bpe").write_bytes((src / "vocab.bpe").read_bytes()[:-10])
    with pytest.raises(LLMCError, match="sha256 mismatch"):
        tk._encoding_from_files(tmp_path / "vocab.bpe", tmp_path / "encoder.json")


# -----------------------------------------------------------------------------
# tokenizer .bin


def test_tokenizer_bin_round_trip(tmp_path):
    enc = get_encoding()
    write_tokenizer(tmp_path / "tok.bin", enc)
    tok = TokenizerBin.from_file(tmp_path / "tok.bin")
    assert tok.vocab_size == tok.n_vocab == len(tok) == 50257 and tok.eot_token == 50256
    ids = enc.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.decode(np.array(ids, dtype=np.int32)) == TEXT
    assert tok.decode([50256]) == "<|endoftext|>"
    # a character split over two tokens decodes only when both are joined
    two = [i for i in enc.encode("🤖")]
    assert len(two) > 1 and "\ufffd" in tok.decode(two[:1]) and tok.decode(two) == "🤖"
    with pytest.raises(LLMCError, match="token id 50300 out of range"):
        tok.decode([1, 50300])
    # byte-identical to a file written straight from the format description
    write_llmc_tokenizer(tmp_path / "ref.bin", [enc.decode_single_token_bytes(i) for i in range(50257)])
    assert (tmp_path / "tok.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_tokenizer_bin_version1(tmp_path):
    """Older llm.c files (version 1) have no eot field; llm.c assumes GPT-2's 50256."""
    toks = [b"a", b"bc", b"\xe4\xb8"] + [bytes([i % 256]) for i in range(3, 50257)]
    write_llmc_tokenizer(tmp_path / "v1.bin", toks, version=1)
    tok = TokenizerBin.from_file(tmp_path / "v1.bin")
    assert tok.eot_token == 50256 and tok.vocab_size == 50257
    assert tok.decode_bytes([1, 0, 2]) == b"bca\xe4\xb8"


def test_tokenizer_bin_bad_files(tmp_path):
    toks = [b"a", b"bc", b"def"]
    good = tmp_path / "good.bin"
    write_llmc_tokenizer(good, toks, eot=2)
    assert TokenizerBin.from_file(good).decode([2, 0]) == "defa"
    data = good.read_bytes()
    cases = {
        "magic": (header_bytes(20240326, 2, 3, 2) + data[HEADER_BYTES:], "bad magic 20240326"),
        "version": (header_bytes(20240328, 3, 3, 2) + data[HEADER_BYTES:], "version 3"),
        "trunc": (data[:-1], "truncated"),
        "trunc2": (data[:-4], "truncated: header says 3 tokens, the data ends after 2"),
        "long": (data + b"\x01z", "too long"),
        "more": (header_bytes(20240328, 2, 4, 2) + data[HEADER_BYTES:], "truncated"),
        "eot": (header_bytes(20240328, 2, 3, 7) + data[HEADER_BYTES:], "eot id 7"),
    }
    for name, (content, needle) in cases.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(content)
        with pytest.raises(LLMCError, match=needle):
            TokenizerBin.from_file(p)
    with pytest.raises(LLMCError, match="not found"):
        TokenizerBin.from_file(tmp_path / "missing.bin")
