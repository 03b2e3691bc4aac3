"""download_starter_pack.sh against a local HTTP server (HEAD + byte ranges) on 127.0.0.1.

    python -m pytest tests/test_download.py -q

The script writes next to itself, so each test runs a copy of it in a temporary directory.
"""
import hashlib
import os
import shutil
import subprocess

import numpy as np
import pytest

from conftest import ROOT
from llmc_fixtures import closed_port, serve_files

LOCAL = {  # name on the server -> where the script puts it
    "gpt2_124M.bin": "gpt2_124M.bin",
    "gpt2_124M_bf16.bin": "gpt2_124M_bf16.bin",
    "gpt2_124M_debug_state.bin": "gpt2_124M_debug_state.bin",
    "gpt2_tokenizer.bin": "gpt2_tokenizer.bin",
    "tiny_shakespeare_train.bin": "dev/data/tinyshakespeare/tiny_shakespeare_train.bin",
    "tiny_shakespeare_val.bin": "dev/data/tinyshakespeare/tiny_shakespeare_val.bin",
    "hellaswag_val.bin": "dev/data/hellaswag/hellaswag_val.bin",
}

pytestmark = pytest.mark.skipif(shutil.which("curl") is None or shutil.which("bash") is None,
                                reason="needs bash and curl")


@pytest.fixture
def pack():
    rng = np.random.default_rng(0)
    return {name: rng.integers(0, 256, 3000 + 1000 * i, dtype=np.uint8).tobytes()
            for i, name in enumerate(LOCAL)}


@pytest.fixture
def workdir(tmp_path):
    shutil.copy(ROOT / "download_starter_pack.sh", tmp_path / "download_starter_pack.sh")
    return tmp_path


def run(workdir, base_url, *names):
    env = {**os.environ, "LLMC_STARTER_PACK_URL": base_url}
    return subprocess.run(["bash", str(workdir / "download_starter_pack.sh"), *names], env=env,
                          capture_output=True, text=True, timeout=60)


def leftovers(workdir):
    return [str(p.relative_to(workdir)) for p in workdir.rglob("*.part")]


def test_complete_download(workdir, pack):
    with serve_files(pack) as (url, log):
        r = run(workdir, url)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    for name, rel in LOCAL.items():
        assert (workdir / rel).read_bytes() == pack[name], rel
    assert leftovers(workdir) == []
    assert sorted(n for m, n, _ in log if m == "GET") == sorted(LOCAL)


def test_already_complete_is_skipped(workdir, pack):
    with serve_files(pack) as (url, _):
        assert run(workdir, url).returncode == 0
    with serve_files(pack) as (url, log):
        r = run(workdir, url)
    assert r.returncode == 0
    assert r.stdout.count("skipping") == len(LOCAL)
    assert {m for m, _, _ in log} == {"HEAD"}             # nothing downloaded again


def test_partial_is_resumed(workdir, pack):
    name = "gpt2_124M_bf16.bin"
    (workdir / f"{name}.part").write_bytes(pack[name][:1234])
    with serve_files(pack) as (url, log):
        r = run(workdir, url, name)
    assert r.returncode == 0, r.stderr
    assert "resuming at 1234" in r.stdout
    assert (workdir / name).read_bytes() == pack[name]
    assert ("GET", name, "bytes=1234-") in log
    assert leftovers(workdir) == [] and not (workdir / "gpt2_124M.bin").exists()  # only the named file


def test_complete_part_and_stale_file(workdir, pack):
    """A .part with every byte is just renamed; a final file of the wrong size is replaced."""
    name, stale = "gpt2_tokenizer.bin", "gpt2_124M.bin"
    (workdir / f"{name}.part").write_bytes(pack[name])
    (workdir / stale).write_bytes(b"old")
    with serve_files(pack) as (url, log):
        r = run(workdir, url, name, stale)
    assert r.returncode == 0, r.stderr
    assert (workdir / name).read_bytes() == pack[name] and (workdir / stale).read_bytes() == pack[stale]
    assert ("GET", name, None) not in log and ("GET", name, f"bytes={len(pack[name])}-") not in log


def test_missing_file_on_server(workdir, pack):
    del pack["hellaswag_val.bin"]
    with serve_files(pack) as (url, _):
        r = run(workdir, url)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "HTTP 404" in lines[0] and "hellaswag_val.bin" in lines[0], r.stderr
    assert not (workdir / LOCAL["hellaswag_val.bin"]).exists() and leftovers(workdir) == []
    assert (workdir / "gpt2_124M.bin").read_bytes() == pack["gpt2_124M.bin"]  # earlier files are fine


def test_offline(workdir, pack):
    url = f"http://127.0.0.1:{closed_port()}"
    r = run(workdir, url)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach" in lines[0] and url in lines[0], r.stderr
    assert r.stdout == ""
    # with the files already here, offline keeps them and succeeds
    for name, rel in LOCAL.items():
        (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (workdir / rel).write_bytes(pack[name])
    r = run(workdir, url)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("keeping the existing file") == len(LOCAL)


def test_checksum(workdir, pack):
    name = "gpt2_124M.bin"
    good = {name: hashlib.sha256(pack[name]).hexdigest()}
    with serve_files(pack, etags={name: "0" * 64}) as (url, _):
        r = run(workdir, url, name)
    assert r.returncode != 0 and "sha256" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (workdir / name).exists() and leftovers(workdir) == []
    with serve_files(pack, etags=good) as (url, _):
        r = run(workdir, url, name)
    assert r.returncode == 0 and (workdir / name).read_bytes() == pack[name]


def test_unknown_name(workdir):
    r = run(workdir, "http://127.0.0.1:1", "gpt2_999M.bin")
    assert r.returncode != 0 and "unknown file gpt2_999M.bin" in r.stderr
