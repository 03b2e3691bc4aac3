"""train_gpt2.py end to end on the numpy backend: loss falls, checkpoints appear, resume continues
bit for bit, and every user mistake is one line on stderr with a non-zero exit."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--device", "cpu", "-e", "L1C32H2", "-b", "2", "-t", "16", "-s", "0"]


def run(args, cwd=ROOT, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def step_losses(stdout):
    return [float(m) for m in re.findall(r"^step\s+\d+/\d+ \| loss ([0-9.]+)", stdout, re.M)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from llmc.data import write_shard
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    # a repetitive token stream, so a tiny model can learn something in a few steps
    base = rng.integers(0, 500, 64)
    write_shard(str(d / "train_000.bin"), np.tile(base, 40).astype(np.uint16))
    write_shard(str(d / "val_000.bin"), np.tile(base, 4).astype(np.uint16))
    write_shard(str(d / "short.bin"), np.arange(20, dtype=np.uint16))
    return d


def data_args(d):
    return ["-i", str(d / "train_*.bin"), "-j", str(d / "val_*.bin")]


def test_overfit_single_batch_loss_falls(shards):
    p = run(SMALL + data_args(shards) + ["-a", "1", "-x", "30", "-l", "1e-3", "-v", "10"])
    losses = step_losses(p.stdout)
    assert len(losses) == 30
    assert losses[-1] < losses[0] - 1.0, losses
    assert "val loss" in p.stdout


def test_checkpoints_and_exact_resume(shards, tmp_path):
    common = SMALL + data_args(shards) + ["-v", "0", "-l", "1e-3", "-u", "2", "-x", "8", "-n", "4"]
    full = run(common + ["-o", str(tmp_path / "full")])
    assert (tmp_path / "full" / "model_00000004.bin").exists()
    assert (tmp_path / "full" / "model_00000008.bin").exists()
    log = (tmp_path / "full" / "main.log").read_text()
    # llm.c's main.log: the train line of optimizer step k (console "step k+1/N") says s:k
    assert re.search(r"^s:0 trl:\d+\.\d{4} lr:0\.000500 norm:\d+\.\d{2}$", log, re.M), log
    assert "s:7 trl:" in log and "s:8 trl:" not in log
    assert (tmp_path / "full" / "state_00000004_00000.bin").exists() and (tmp_path / "full" / "DONE_00000008").exists()
    # a second run into another dir, whose last checkpoint we delete: as if it had stopped after
    # step 4 (same -x, so the same lr schedule); resuming must reproduce steps 5..8 exactly
    part = tmp_path / "part"
    run(common + ["-o", str(part)])
    for f in part.glob("*_00000008*"):
        f.unlink()
    resumed = run(common + ["-o", str(part), "-y", "1"])
    assert "resumed from" in resumed.stdout
    want = step_losses(full.stdout)[4:]
    got = step_losses(resumed.stdout)
    assert got == want, (got, want)  # printed to 6 decimals, bit-exact underneath (checked below)
    a = np.fromfile(tmp_path / "full" / "model_00000008.bin", dtype=np.uint8)
    b = np.fromfile(part / "model_00000008.bin", dtype=np.uint8)
    assert np.array_equal(a, b), "resumed run's final weights differ from the uninterrupted run's"


def test_samples_are_text(shards):
    p = run(["--device", "cpu", "-e", "L1C32H2", "-b", "1", "-t", "16", "-x", "1", "-s", "1", "-g", "8",
             "-v", "0"] + data_args(shards))
    assert "generating:" in p.stdout


def test_list_kernels():
    p = run(["--list-kernels"])
    assert "softmax_forward" in p.stdout and "matmul_forward" in p.stdout


def one_line_error(p, *needles):
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs(shards, tmp_path):
    bad_magic = tmp_path / "bad_magic.bin"
    np.zeros(256, np.int32).tofile(bad_magic)
    one_line_error(run(SMALL[:2] + ["-e", str(bad_magic)] + data_args(shards), check=False), "bad_magic.bin")
    bad_version = tmp_path / "bad_version.bin"
    h = np.zeros(256, np.int32); h[0] = 20240326; h[1] = 4
    h.tofile(bad_version)
    one_line_error(run(SMALL[:2] + ["-e", str(bad_version)] + data_args(shards), check=False), "version")
    trunc = tmp_path / "trunc.bin"
    h = np.zeros(256, np.int32); h[:8] = [20240326, 3, 1024, 50257, 1, 2, 32, 50304]
    h.tofile(trunc)
    one_line_error(run(SMALL[:2] + ["-e", str(trunc)] + data_args(shards), check=False), "trunc.bin")
    one_line_error(run(SMALL + ["-i", str(shards / "short.bin"), "-j", ""], check=False), "short.bin")
    one_line_error(run(SMALL + ["-i", str(tmp_path / "nothing_*.bin")], check=False), "nothing_")
    one_line_error(run(SMALL + data_args(shards) + ["--softmax-kernel", "99"], check=False), "--softmax-kernel")
    one_line_error(run(["--device", "cpu", "-e", "L1C32H2", "-b", "1", "-t", "2048"] + data_args(shards),
                       check=False), "2048")
    one_line_error(run(SMALL + data_args(shards) + ["-k", "bogus"], check=False), "bogus")
    one_line_error(run(SMALL + data_args(shards) + ["-b", "x"], check=False), "--batch-size")
    one_line_error(run(SMALL + data_args(shards) + ["-d", "100"], check=False), "--total-batch-size")
    one_line_error(run(SMALL + data_args(shards) + ["-y", "1"], check=False), "--resume")
    one_line_error(run(SMALL + data_args(shards) + ["-m", "0"], check=False), "--val-batches")
