"""The run directory (-o) as llm.c lays it out: checkpoints with DONE markers, resume from ours and
from llm.c's state files, retention, temp-file cleanup, main.log; and what happens when a save fails.

    python -m pytest tests/test_run_dir.py -q
"""
import errno
import os
import re
import shutil

import numpy as np
import pytest

from llmc import runfiles
from llmc.checkpoint import read_model
from llmc.train import cli, llmc_loader_state
from llmc_fixtures import read_llmc_state, write_llmc_state

SMALL = ["--device", "cpu", "-e", "L1C32H2", "-b", "2", "-t", "16", "-s", "0", "-v", "0", "-l", "1e-3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from llmc.data import write_shard
    d = tmp_path_factory.mktemp("data")
    base = np.random.default_rng(0).integers(0, 500, 64)
    write_shard(str(d / "train_000.bin"), np.tile(base, 40).astype(np.uint16))   # 79 batches of 2x16
    write_shard(str(d / "train_001.bin"), np.tile(base[::-1], 10).astype(np.uint16))  # 19 batches
    write_shard(str(d / "val_000.bin"), np.tile(base, 4).astype(np.uint16))
    return d


def train(capsys, *args):
    """Run the trainer in this process; returns (exit code, stdout, stderr)."""
    code = cli([*args])
    out, err = capsys.readouterr()
    return code, out, err


def data(d):
    return ["-i", str(d / "train_*.bin"), "-j", str(d / "val_*.bin")]


def losses(stdout):
    return [float(m) for m in re.findall(r"^step\s+\d+/\d+ \| loss ([0-9.]+)", stdout, re.M)]


def files(d):
    return sorted(p for p in os.listdir(d) if p != "main.log")


def test_checkpoint_files_and_done_marker(shards, tmp_path, capsys):
    code, out, err = train(capsys, *SMALL, *data(shards), "-x", "4", "-n", "2", "-o", str(tmp_path))
    assert code == 0, err
    assert files(tmp_path) == ["DONE_00000002", "DONE_00000004", "model_00000002.bin", "model_00000004.bin",
                               "state_00000002_00000.bin", "state_00000004_00000.bin"]
    assert runfiles.latest_done(tmp_path) == 4
    # what llm.c's load_state reads from our state file
    cfg, _ = read_model(tmp_path / "model_00000004.bin")
    st = read_llmc_state(tmp_path / "state_00000004_00000.bin", cfg.num_parameters)
    assert (st["step"], st["num_processes"], st["rank"], st["master_weights"], st["shuffle"]) == (4, 1, 0, 0, 0)
    assert (st["shard"], st["sample"]) == (0, 4) and st["rng_state"] != 0
    assert np.abs(st["v"]).sum() > 0
    log = (tmp_path / "main.log").read_text().splitlines()
    assert [l.split()[0] for l in log] == ["s:0", "s:1", "s:2", "s:3"]
    assert all(re.fullmatch(r"s:\d+ trl:\d+\.\d{4} lr:\d\.\d{6} norm:\d+\.\d{2}", l) for l in log), log


def test_resume_from_an_llmc_state_file(shards, tmp_path, capsys):
    """A run directory as llm.c leaves it (its state file written here from llm.c's documented
    layout, not by our writer; no trailer) resumes from the same batch, and with shuffle off and
    no sampling it continues exactly as the uninterrupted run."""
    common = [*SMALL, *data(shards), "-x", "8", "-u", "2", "-n", "4"]
    code, full, err = train(capsys, *common, "-o", str(tmp_path / "full"))
    assert code == 0, err
    ours = tmp_path / "full"
    cfg, _ = read_model(ours / "model_00000004.bin")
    st = read_llmc_state(ours / "state_00000004_00000.bin", cfg.num_parameters)
    run = tmp_path / "llmc"
    run.mkdir()
    shutil.copy(ours / "model_00000004.bin", run / "model_00000004.bin")
    write_llmc_state(run / "state_00000004_00000.bin", 4, st["m"], st["v"], shard=0, sample=4, rng_state=777)
    (run / "DONE_00000004").write_bytes(b"")
    code, resumed, err = train(capsys, *common, "-o", str(run), "-y", "1")
    assert code == 0, err
    assert "llm.c's" in err and "resumed from" in resumed
    assert losses(resumed) == losses(full)[4:]
    assert (run / "model_00000008.bin").read_bytes() == (ours / "model_00000008.bin").read_bytes()
    # the llm.c run's stochastic-rounding RNG is carried into the state we write
    assert read_llmc_state(run / "state_00000008_00000.bin", cfg.num_parameters)["rng_state"] == 777


def test_resume_from_llmc_bf16_run_uses_master_weights(shards, tmp_path, capsys):
    """llm.c's bf16 runs keep fp32 master weights in the state: those are the weights we continue."""
    from llmc.checkpoint import write_model
    from llmc.config import config_from_name
    cfg = config_from_name("L1C32H2")
    rng = np.random.default_rng(3)
    master = (rng.standard_normal(cfg.num_parameters) * 0.02).astype(np.float32)
    write_model(tmp_path / "model_00000003.bin", cfg, master, dtype="bf16")
    z = np.zeros(cfg.num_parameters, np.float32)
    write_llmc_state(tmp_path / "state_00000003_00000.bin", 3, z, z, master=master, sample=3)
    (tmp_path / "DONE_00000003").write_bytes(b"")
    code, out, err = train(capsys, *SMALL, *data(shards), "-x", "4", "-o", str(tmp_path), "-y", "1")
    assert code == 0, err
    # the one step trained (step 4) starts from the fp32 master weights, on batch 3 of the train data
    from llmc.backend import CpuBackend
    from llmc.data import DataLoader
    from llmc.model import GPT2
    m = GPT2(cfg, CpuBackend(), 2, 16, training=False)
    m.load_params(master)
    dl = DataLoader(str(shards / "train_*.bin"), 2, 16)
    for _ in range(4):
        x, y = dl.next_batch()
    assert losses(out) == [round(m.forward(x, y), 6)]


def test_llmc_loader_position_at_shard_end(shards):
    from llmc.data import DataLoader
    dl = DataLoader(str(shards / "train_*.bin"), 2, 16)
    assert dl.shard_windows == [79, 19]
    assert llmc_loader_state(dl, 0, 5)["shard_index"] == 0
    # llm.c stops at sample == the shard's batch count and moves on at its next call
    st = llmc_loader_state(dl, 0, 79)
    assert (st["epoch"], st["shard_index"], st["window_index"]) == (0, 1, 0)
    st = llmc_loader_state(dl, 1, 19)
    assert (st["epoch"], st["shard_index"], st["window_index"]) == (1, 0, 0)
    dl.load_state(llmc_loader_state(dl, 1, 3))
    x, _ = dl.next_batch()
    assert dl.position == 4 * 32 and dl.current_shard == 1
    from llmc.errors import LLMCError
    with pytest.raises(LLMCError, match="outside"):
        llmc_loader_state(dl, 0, 80)
    with pytest.raises(LLMCError, match="outside"):
        llmc_loader_state(dl, 2, 0)


def test_resume_without_checkpoint_starts_fresh(shards, tmp_path, capsys):
    (tmp_path / "main.log").write_text("s:0 trl:1.0000 lr:0.000100 norm:1.00\n")
    code, out, err = train(capsys, *SMALL, *data(shards), "-x", "2", "-o", str(tmp_path), "-y", "1")
    assert code == 0, err
    assert "starting fresh" in err and "random init" in out
    assert runfiles.latest_done(tmp_path) == 2
    assert (tmp_path / "main.log").read_text().count("s:0 trl") == 1  # a fresh run's log starts empty


def test_changed_hyperparameters_are_reported(shards, tmp_path, capsys):
    code, _, err = train(capsys, *SMALL, *data(shards), "-x", "2", "-o", str(tmp_path))
    assert code == 0, err
    code, out, err = train(capsys, *SMALL[:-1], "2e-3", *data(shards), "-x", "4", "-o", str(tmp_path), "-y", "1",
                           "-k", "linear", "--seed", "7")
    assert code == 0, err
    notes = [l for l in err.splitlines() if l.startswith("note: ")]
    assert any("-l/--learning-rate is 0.002 now, 0.001" in l for l in notes), err
    assert any("-k/--lr-schedule is linear now, cosine" in l for l in notes), err
    assert any("--seed is 7 now, 1337" in l for l in notes), err
    assert any("-x/--max-steps is 4 now, 2" in l for l in notes), err
    assert len(notes) == 4, notes
    assert losses(out) and "step    3/4" in out


def test_retention_keeps_newest_and_major(shards, tmp_path, capsys):
    code, out, err = train(capsys, *SMALL, *data(shards), "-x", "10", "-n", "2", "-nk", "2", "-nm", "4",
                           "-o", str(tmp_path))
    assert code == 0, err
    assert runfiles.done_steps(tmp_path) == [4, 8, 10]
    assert files(tmp_path) == ["DONE_00000004", "DONE_00000008", "DONE_00000010", "model_00000004.bin",
                               "model_00000008.bin", "model_00000010.bin", "state_00000004_00000.bin",
                               "state_00000008_00000.bin", "state_00000010_00000.bin"]
    # a later, longer run's checkpoints in the same directory are not touched by an earlier step
    assert runfiles.prune_checkpoints(tmp_path, 8, keep=1) == [4]
    assert runfiles.done_steps(tmp_path) == [8, 10]


def test_temp_files_of_a_killed_save_are_removed(shards, tmp_path, capsys):
    dead = tmp_path / ".model_00000002.bin.tmp.999999999"     # no such process
    mine = tmp_path / f".model_00000099.bin.tmp.{os.getpid()}"  # a live process's: kept
    dead.write_bytes(b"x" * 100)
    mine.write_bytes(b"x")
    code, out, err = train(capsys, *SMALL, *data(shards), "-x", "2", "-o", str(tmp_path))
    assert code == 0, err
    assert "removed 1 temp file" in err
    assert not dead.exists() and mine.exists()


def test_failed_save_keeps_the_previous_checkpoint(shards, tmp_path, capsys, monkeypatch):
    import llmc.checkpoint as ck
    real = ck.write_state

    def disk_full(path, step, *a, **k):
        if step < 4:
            return real(path, step, *a, **k)
        with ck.atomic_open(path) as f:  # half a file, then the disk is full
            f.write(b"\0" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ck, "write_state", disk_full)
    code, out, err = train(capsys, *SMALL, *data(shards), "-x", "4", "-n", "2", "-o", str(tmp_path))
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0], err
    assert "the previous checkpoint, step 2" in lines[0] and "is intact" in lines[0]
    assert runfiles.done_steps(tmp_path) == [2]
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]
    # and -y 1 resumes from step 2
    monkeypatch.setattr(ck, "write_state", real)
    code, out, err = train(capsys, *SMALL, *data(shards), "-x", "4", "-n", "2", "-o", str(tmp_path), "-y", "1")
    assert code == 0 and "(step 2)" in out and runfiles.done_steps(tmp_path) == [2, 4]


def test_output_dir_problems(shards, tmp_path, capsys, monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    code, _, err = train(capsys, *SMALL, *data(shards), "-x", "1", "-o", str(f))
    assert code == 1 and err.count("\n") == 1 and "afile: exists and is not a directory" in err
    monkeypatch.setattr(os, "access", lambda p, mode: False)  # (as root, chmod cannot make one)
    code, _, err = train(capsys, *SMALL, *data(shards), "-x", "1", "-o", str(tmp_path / "ro"))
    assert code == 1 and err.count("\n") == 1 and "not writable" in err


def test_outlier_detector_matches_windowed_zscore():
    rng = np.random.default_rng(0)
    xs = rng.standard_normal(200) * 3 + 10
    d = runfiles.OutlierDetector()
    for i, x in enumerate(xs):
        z = d.update(float(x))
        if i < 64:  # the first 64 values fill the window
            assert np.isnan(z)
        else:
            w = xs[i - 63:i + 1]
            assert z == pytest.approx((x - w.mean()) / w.std(), rel=1e-9, abs=1e-9)
    # its state survives a checkpoint (JSON) and continues the same
    d2 = runfiles.OutlierDetector(d.state())
    assert d2.update(3.0) == d.update(3.0)
    c = runfiles.OutlierDetector()
    assert [c.update(1.0) for _ in range(65)][-1] == 0.0  # a constant window: z = 0, not a division by 0


def test_skip_update_on_outliers(tmp_path, capsys):
    """-sl: 70 batches of a repeated pattern, then random tokens: the loss jumps at step 71 and that
    update is skipped, with llm.c's line; nothing is skipped while the 64-step window fills."""
    from llmc.data import write_shard
    base = np.random.default_rng(0).integers(0, 500, 32)
    noise = np.random.default_rng(1).integers(0, 50000, 32 * 6)
    write_shard(str(tmp_path / "spike.bin"), np.concatenate([np.tile(base, 70), noise, base[:1]]).astype(np.uint16))
    code, out, err = train(capsys, *SMALL, "-i", str(tmp_path / "spike.bin"), "-j", "", "-x", "72", "-sl", "3", "-l", "1e-2")
    assert code == 0, err
    lines = out.splitlines()
    skips = [i for i, l in enumerate(lines) if l.startswith("skipping update due to loss z-score of ")]
    assert skips, out
    assert lines[skips[0] + 1].startswith("step   71/72"), lines[skips[0] - 1:skips[0] + 2]
