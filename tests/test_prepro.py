"""prepro_tinyshakespeare.py: exact token counts from the committed text, re-run safety, download.

    python -m pytest tests/test_prepro.py -q
"""
import shutil

import numpy as np
import pytest

import prepro_tinyshakespeare as prepro
from conftest import ROOT
from llmc.data import read_shard
from llmc.tokenizer import TokenizerBin, get_encoding
from llmc_fixtures import serve_files

INPUT = ROOT / "dev" / "data" / "tinyshakespeare" / "input.txt"


def run(tmp_path, *extra):
    return prepro.main(["--data-dir", str(tmp_path / "ts"), "--tokenizer-out", str(tmp_path / "tok.bin"),
                        *extra])


def check_outputs(tmp_path):
    val = read_shard(tmp_path / "ts" / "tiny_shakespeare_val.bin")
    train = read_shard(tmp_path / "ts" / "tiny_shakespeare_train.bin")
    assert (train.size, val.size) == (305_260, 32_768)
    assert val[0] == 50256                                  # the first section starts with <|endoftext|>
    tokens = np.concatenate([val, train])
    assert (tokens == 50256).sum() == INPUT.read_text().count("\n\n") + 1  # one per section
    text = INPUT.read_text()
    tok = TokenizerBin.from_file(tmp_path / "tok.bin")
    assert tok.decode(tokens) == "<|endoftext|>" + text.replace("\n\n", "\n\n<|endoftext|>")
    return tokens


def test_committed_text_counts_and_rerun(tmp_path, capsys):
    (tmp_path / "ts").mkdir()
    shutil.copy(INPUT, tmp_path / "ts" / "input.txt")
    assert run(tmp_path) == 0
    out = capsys.readouterr().out
    assert "305,260 train / 32,768 val tokens: match" in out
    tokens = check_outputs(tmp_path)
    # sections encoded separately and joined give the same tokens (llm.c's description of it)
    enc = get_encoding()
    sections = INPUT.read_text().split("\n\n")
    joined = []
    for i, s in enumerate(sections):
        joined += [50256] + enc.encode(s + ("\n\n" if i < len(sections) - 1 else ""))
    assert joined == tokens.tolist()
    # safe to re-run: nothing rewritten
    before = (tmp_path / "ts" / "tiny_shakespeare_train.bin").stat().st_mtime_ns
    assert run(tmp_path) == 0
    assert "already exist" in capsys.readouterr().out
    assert (tmp_path / "ts" / "tiny_shakespeare_train.bin").stat().st_mtime_ns == before
    assert run(tmp_path, "--force") == 0
    assert "wrote" in capsys.readouterr().out


def test_missing_input(tmp_path, capsys):
    assert run(tmp_path) == 1
    err = capsys.readouterr().err.strip()
    assert "input.txt: not found" in err and "--download" in err and "\n" not in err


def test_download_from_local_server(tmp_path, capsys):
    with serve_files({"input.txt": INPUT.read_bytes()}, fail_first=1) as (url, log):
        assert run(tmp_path, "--download", "--url", f"{url}/input.txt") == 0   # first answer is a 503: retried
        assert [m for m, _, _ in log] == ["GET", "GET"]
    assert (tmp_path / "ts" / "input.txt").read_bytes() == INPUT.read_bytes()
    assert not (tmp_path / "ts" / "input.txt.part").exists()
    check_outputs(tmp_path)
    assert "match" in capsys.readouterr().out
    # re-run with --download: the local copy is kept, no request made
    with serve_files({}) as (url, log):
        assert run(tmp_path, "--download", "--url", f"{url}/input.txt") == 0
        assert log == []


@pytest.mark.parametrize("case", ["404", "503", "offline"])
def test_download_failures(tmp_path, capsys, case):
    if case == "404":
        with serve_files({}) as (url, _):
            rc = run(tmp_path, "--download", "--url", f"{url}/input.txt")
        needle = "HTTP 404"
    elif case == "503":
        with serve_files({"input.txt": b"x"}, fail_first=5) as (url, log):
            rc = run(tmp_path, "--download", "--url", f"{url}/input.txt", "--retries", "1")
        assert len(log) == 2
        needle = "kept failing"
    else:
        from llmc_fixtures import closed_port
        rc = run(tmp_path, "--download", "--url", f"http://127.0.0.1:{closed_port()}/input.txt", "--timeout", "2",
                 "--retries", "0")
        needle = "could not connect"
    assert rc == 1
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err
    assert not (tmp_path / "ts" / "input.txt").exists()


def test_non_utf8_input_is_one_line(tmp_path, capsys):
    (tmp_path / "ts").mkdir()
    (tmp_path / "ts" / "input.txt").write_bytes("Ünïcode in latin-1".encode("latin-1"))
    assert run(tmp_path) == 1
    err = capsys.readouterr().err.strip()
    assert "input.txt: not UTF-8" in err and "0xdc" in err and "\n" not in err


def test_unwritable_output_is_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / "ts").mkdir()
    shutil.copy(INPUT, tmp_path / "ts" / "input.txt")

    def full(path, tokens):
        raise OSError(28, "No space left on device", str(path))
    import llmc.data
    monkeypatch.setattr(llmc.data, "write_shard", full)   # what prepro_text's ShardWriter calls
    assert run(tmp_path) == 1
    err = capsys.readouterr().err.strip()
    assert "tiny_shakespeare_val.bin: No space left on device" in err and "\n" not in err
