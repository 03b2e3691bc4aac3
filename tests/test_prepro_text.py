"""prepro_text.py: streamed tokenization gives the tokens of encoding each document whole, shards
split val/train at --val-tokens and --shard-size, and prepro_tinyshakespeare.py (now a user of it)
writes the same bytes as before.

    python -m pytest tests/test_prepro_text.py -q
"""
import hashlib
import shutil

import numpy as np
import pytest

import prepro_text
import prepro_tinyshakespeare
from conftest import ROOT
from llmc.data import read_shard
from llmc.tokenizer import get_encoding

INPUT = ROOT / "dev" / "data" / "tinyshakespeare" / "input.txt"
EOT = 50256

# sha256 of what prepro_tinyshakespeare.py wrote for the committed input.txt before it became a user
# of prepro_text.py (commit 1d6af53, measured then): the outputs must stay byte for byte the same
BEFORE = {
    "tiny_shakespeare_train.bin": "8a70606be574040c26d225694f5f9759973b419852d22f7fe5c118e1b359dcc8",
    "tiny_shakespeare_val.bin": "fe99db720dc7c83e694806d4e047a952909411da1daccde4ccc2e55f40882a62",
    "tok.bin": "6f3abc21e444e4e8300e225f4e03da48ea121cf17e30f67009b8dad7a66c2f13",
}


def test_tinyshakespeare_bytes_unchanged(tmp_path):
    (tmp_path / "ts").mkdir()
    shutil.copy(INPUT, tmp_path / "ts" / "input.txt")
    assert prepro_tinyshakespeare.main(["--data-dir", str(tmp_path / "ts"), "--tokenizer-out",
                                        str(tmp_path / "ts" / "tok.bin")]) == 0
    for name, sha in BEFORE.items():
        assert hashlib.sha256((tmp_path / "ts" / name).read_bytes()).hexdigest() == sha, name


def messy_text(rng, n_words):
    """Words, numbers, punctuation, unicode (2-, 3- and 4-byte UTF-8), runs of spaces, tabs, blank
    lines: everything where GPT-2's pre-tokenizer has a rule."""
    words = ["the", "Hello", "world", "'s", "don't", "123", "4.5", "!!", "...", "é", "naïve", "日本語",
             "🙂", "<|endoftext|>", "a\tb", "x", "  ", "   ", "\n", "\n\n", "\n\n\n", " \n", "\t"]
    seps = [" ", " ", " ", "", "  ", "\n", "\n\n", "\t", " \n "]
    return "".join(words[i] + seps[j] for i, j in zip(rng.integers(0, len(words), n_words),
                                                      rng.integers(0, len(seps), n_words)))


def reference(text, sep):
    """Each document (text cut after every sep) encoded whole, <|endoftext|> before each."""
    enc = get_encoding()
    docs = [text] if not sep else [d + sep for d in text.split(sep)[:-1]] + [text.split(sep)[-1]]
    out = []
    for d in docs:
        out += [EOT] + enc.encode_ordinary(d)
    return out


@pytest.mark.parametrize("sep", ["\n\n", ""])
@pytest.mark.parametrize("seed", [0, 1])
def test_streamed_equals_whole(tmp_path, sep, seed):
    text = messy_text(np.random.default_rng(seed), 3000)
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    enc = get_encoding()
    # tiny reads (multi-byte characters split across them) and tiny pieces (documents cut often)
    pieces = list(prepro_text.read_documents(tmp_path / "t.txt", sep, chunk_bytes=7, max_piece=40))
    assert sum(not s for _, s in pieces) > 10     # long documents really were cut into pieces
    assert "".join(t for t, _ in pieces) == text
    got = np.concatenate(list(prepro_text.encode_documents(pieces, enc))).tolist()
    assert got == reference(text, sep)
    assert got.count(EOT) == (text.count(sep) + 1 if sep else 1)   # the literal "<|endoftext|>" is text


def run(tmp_path, text, *extra):
    (tmp_path / "my.txt").write_text(text, encoding="utf-8")
    return prepro_text.main(["--input", str(tmp_path / "my.txt"), "--output-dir", str(tmp_path / "out"),
                             "--tokenizer-out", str(tmp_path / "tok.bin"), *extra])


def test_shards_split_and_size(tmp_path, capsys):
    text = messy_text(np.random.default_rng(2), 4000)
    assert run(tmp_path, text, "--shard-size", "1000", "--val-tokens", "1500") == 0
    out = capsys.readouterr().out
    files = sorted((tmp_path / "out").glob("my_*.bin"), key=lambda p: p.name.split("_")[2])
    names = [f.name for f in files]
    assert names[:3] == ["my_val_000000.bin", "my_val_000001.bin", "my_train_000002.bin"]
    sizes = [read_shard(f).size for f in files]
    assert sizes[:2] == [1000, 500] and all(s == 1000 for s in sizes[2:-1]) and 0 < sizes[-1] <= 1000
    tokens = np.concatenate([read_shard(f) for f in files]).tolist()
    assert tokens == reference(text, "\n\n")
    assert 'train_gpt2.py -i "' in out and "my_train_*.bin" in out
    assert (tmp_path / "tok.bin").exists()
    # re-run: skipped; --force with a bigger shard size rewrites and removes the stale shards
    assert run(tmp_path, text, "--shard-size", "1000") == 0
    assert "skipping" in capsys.readouterr().out
    assert run(tmp_path, text, "--force", "--shard-size", "100000", "--val-tokens", "100") == 0
    assert sorted(f.name for f in (tmp_path / "out").glob("my_*.bin")) == ["my_train_000001.bin", "my_val_000000.bin"]


@pytest.mark.parametrize("case", ["not utf-8", "missing", "all val", "bad name"])
def test_bad_input_is_one_line(tmp_path, capsys, case):
    if case == "not utf-8":
        (tmp_path / "my.txt").write_bytes(b"fine text\n" * 10 + b"\xff\xfe bad")
        rc = prepro_text.main(["--input", str(tmp_path / "my.txt"), "--output-dir", str(tmp_path / "out"),
                               "--tokenizer-out", str(tmp_path / "tok.bin")])
        needle = "not UTF-8 text (bad byte at offset 100)"
    elif case == "missing":
        rc = prepro_text.main(["--input", str(tmp_path / "nope.txt")])
        needle = "nope.txt: not found"
    elif case == "all val":
        rc = run(tmp_path, "a short text", "--val-tokens", "100")
        needle = "nothing left to train on"
    else:
        rc = run(tmp_path, "a text", "--name", "a/b")
        needle = "--name"
    err = capsys.readouterr().err.strip()
    assert rc == 1 and needle in err and "\n" not in err, err
    assert not list((tmp_path / "out").glob("*.bin")) if (tmp_path / "out").exists() else True
