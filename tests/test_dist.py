"""Data parallel on the numpy backend: 2 ranks under mpiexec (MPI through mpi4py) train exactly as 1 rank
at twice the batch, with -z 0 and -z 1; per-rank checkpoints resume exactly; bad input is one line on
rank 0 and a non-zero exit, never a hang.

    pip install -r requirements-test.txt          # mpi4py + the mpich wheel (mpiexec)
    python -m pytest -q tests/test_dist.py
"""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from llmc.config import config_from_name
from llmc.data import DataLoader, write_shard
from llmc.dist import grad_chunks
from llmc.errors import LLMCError

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--device", "cpu", "-e", "L1C32H2", "-t", "16", "-s", "0", "-l", "1e-3", "-u", "2"]


def mpiexec() -> str | None:
    """The mpiexec that pip installed with the mpich wheel (in this Python's scripts directory),
    else one on PATH."""
    import sysconfig
    for d in (sysconfig.get_path("scripts"), Path(sys.executable).parent):
        if (Path(d) / "mpiexec").exists():
            return str(Path(d) / "mpiexec")
    return shutil.which("mpiexec")


def need_mpi():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py not installed (pip install -r requirements-test.txt)")
    if mpiexec() is None:
        pytest.skip("no mpiexec (pip install -r requirements-test.txt installs the mpich wheel)")


def run(args, np_=1, check=True, env=None, timeout=300):
    """train_gpt2.py on np_ ranks (np_=1: a plain process, no MPI)."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    cmd = [sys.executable, str(ROOT / "train_gpt2.py"), *args]
    if np_ > 1:
        cmd = [mpiexec(), "-n", str(np_), *cmd]
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def step_losses(stdout):
    return [float(m) for m in re.findall(r"^step\s+\d+/\d+ \| loss ([0-9.]+)", stdout, re.M)]


def val_losses(stdout):
    return [float(m) for m in re.findall(r"^val loss ([0-9.]+)", stdout, re.M)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    base = rng.integers(0, 500, 64)
    # two train shards (the loader crosses a shard boundary and wraps an epoch within the tests)
    write_shard(str(d / "train_000.bin"), np.tile(base, 12).astype(np.uint16))
    write_shard(str(d / "train_001.bin"), rng.integers(0, 500, 700).astype(np.uint16))
    write_shard(str(d / "val_000.bin"), np.tile(base, 5).astype(np.uint16))
    return d


def data_args(d):
    return ["-i", str(d / "train_*.bin"), "-j", str(d / "val_*.bin")]


# ----------------------------------------------------------------------------------------------
# without MPI: the pieces


@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_ranks_slice_the_single_rank_batch(shards, shuffle):
    """Rank r of N at micro-batch B gets rows r*B..r*B+B-1 of what one rank gets at B*N (llm.c's
    loader: rank r starts at r*B*T, stride N*B*T), batch after batch, across shards and epochs."""
    B, T, N = 2, 16, 3
    pattern = str(shards / "train_*.bin")
    one = DataLoader(pattern, B * N, T, shuffle=shuffle, seed=5)
    ranks = [DataLoader(pattern, B, T, shuffle=shuffle, seed=5, rank=r, world=N) for r in range(N)]
    assert all(r.batches_per_epoch == one.batches_per_epoch for r in ranks)
    for _ in range(2 * one.batches_per_epoch + 1):
        x1, y1 = one.next_batch()
        for r, ld in enumerate(ranks):
            x, y = ld.next_batch()
            assert np.array_equal(x, x1[r * B:(r + 1) * B]) and np.array_equal(y, y1[r * B:(r + 1) * B])


def test_loader_state_names_its_rank(shards):
    pattern = str(shards / "train_*.bin")
    a = DataLoader(pattern, 2, 16, rank=1, world=2)
    a.next_batch()
    b = DataLoader(pattern, 2, 16, rank=1, world=2)
    b.load_state(a.state())
    assert np.array_equal(a.next_batch()[0], b.next_batch()[0])
    with pytest.raises(LLMCError, match="rank 1 of 2.*rank 0 of 3"):
        DataLoader(pattern, 2, 16, rank=0, world=3).load_state(a.state())


def test_loader_too_short_for_all_ranks(shards):
    with pytest.raises(LLMCError, match=r"fewer than B\*T x 5 ranks\+1"):
        DataLoader(str(shards / "val_000.bin"), 4, 16, world=5)  # 320 tokens < 5*4*16+1


def test_grad_chunks_tile_the_parameters():
    cfg = config_from_name("L3C32H2")
    per_layer, rest = grad_chunks(cfg)
    chunks = sorted([c for l in range(3) for c in per_layer[l]] + rest)
    off = 0
    for o, n, _ in chunks:
        assert o == off
        off += n
    assert off == cfg.num_parameters
    assert len(per_layer[0]) == 12 and len(rest) == 4


def test_state_files_name_processes_and_rank_and_resume_needs_the_same_count(tmp_path):
    """runfiles.save_checkpoint per rank: llm.c's header holds the number of processes and the rank,
    DONE comes only after the barrier; -y 1 under another count is one line naming the count."""
    from llmc import runfiles
    from llmc.checkpoint import read_state
    cfg = config_from_name("L1C32H2")
    P = cfg.num_parameters
    params = np.zeros(P, np.float32)
    loader = {"shard_index": 0, "window_index": 3}
    calls = []
    for r in range(2):  # two ranks writing in turn; the barrier records what each reported
        runfiles.save_checkpoint(tmp_path, 4, cfg, params if r == 0 else None, np.full(P // 2, r, np.float32),
                                 np.zeros(P // 2, np.float32), loader, {"zero": 1}, rank=r, world=2,
                                 barrier=calls.append)
    assert calls == [None, None] and runfiles.latest_done(tmp_path) == 4
    st = read_state(tmp_path / "state_00000004_00001.bin", P // 2, rank=1, world=2)
    assert (st["num_processes"], st["rank"], st["sample_index"]) == (2, 1, 3) and (st["m"] == 1).all()
    assert runfiles.checkpoint_processes(tmp_path, 4) == 2
    runfiles.check_processes(tmp_path, 4, 2)
    with pytest.raises(LLMCError, match=r"written by 2 ranks .*this run has 4: resume with mpirun -np 2"):
        runfiles.check_processes(tmp_path, 4, 4)
    runfiles.save_checkpoint(tmp_path, 8, cfg, params, np.zeros(P), np.zeros(P), loader)
    with pytest.raises(LLMCError, match=r"written by 1 rank .*resume with one process"):
        runfiles.check_processes(tmp_path, 8, 2)


def test_a_rank_that_fails_to_save_stops_every_rank_and_no_done(tmp_path):
    """The barrier hears a failing rank's error (it does not wait for a rank that raised): no DONE."""
    from llmc import runfiles
    cfg = config_from_name("L1C32H2")
    P = cfg.num_parameters
    heard = []

    def barrier(err):
        heard.append(err)
        if err is not None:
            raise LLMCError(f"rank 1: {err}")
    bad = np.full(P, np.nan, np.float32)
    with pytest.raises(LLMCError, match="rank 1: step 2: the AdamW m hold NaN/inf"):
        runfiles.save_checkpoint(tmp_path, 2, cfg, None, bad, np.zeros(P), {"shard_index": 0, "window_index": 0},
                                 rank=1, world=2, barrier=barrier)
    assert heard and heard[0] is not None and runfiles.latest_done(tmp_path) is None


# ----------------------------------------------------------------------------------------------
# under mpiexec


@pytest.mark.parametrize("zero,extra", [(0, []), (1, ["-d", "128"])], ids=["z0", "z1-accum2"])
def test_two_ranks_match_one_rank_at_twice_the_batch(shards, tmp_path, zero, extra):
    """2 ranks x B=2 == 1 rank x B=4 on the same tokens: step losses, val losses and the final
    weights agree to float32 summation-order noise. -d 128 is 2 micro-steps per step: the
    reduction runs on the last one only."""
    need_mpi()
    common = SMALL + data_args(shards) + ["-x", "8", "-v", "4", "-c", "0.1"] + extra
    one = run(common + ["-b", "4", "-o", str(tmp_path / "one")])
    two = run(common + ["-b", "2", "-z", str(zero), "-o", str(tmp_path / "two")], np_=2)
    assert "data parallel: 2 ranks, -z %d" % zero in two.stdout
    l1, l2 = step_losses(one.stdout), step_losses(two.stdout)
    assert len(l1) == len(l2) == 8
    np.testing.assert_allclose(l2, l1, rtol=0, atol=2e-5)
    np.testing.assert_allclose(val_losses(two.stdout), val_losses(one.stdout), rtol=0, atol=2e-5)
    assert l2[-1] < l2[0]  # it trains
    w1 = np.fromfile(tmp_path / "one" / "model_00000008.bin", dtype=np.float32)[256:]
    w2 = np.fromfile(tmp_path / "two" / "model_00000008.bin", dtype=np.float32)[256:]
    # (atol: the k part of qkvb has a zero true gradient, so AdamW turns its float noise into
    # updates of ~1e-6 that differ in sign between the two runs)
    np.testing.assert_allclose(w2, w1, rtol=1e-4, atol=1e-5)
    # rank 0 alone prints: one header, one line per step
    assert two.stdout.count("model: ") == 1 and two.stdout.count("step    1/8") == 1


def test_zero1_equals_zero0(shards, tmp_path):
    """ZeRO-1 (reduce-scatter, AdamW on the shard, all-gather) updates as the all-reduce does. The
    averaged gradients are the same bits (two floats add the same either way); the squared norm is
    summed in another order (per shard, then across ranks), which moves the clip scale (clipping is
    on here) in its last bits: float32 noise, amplified by AdamW only where the gradient is ~0."""
    need_mpi()
    common = SMALL + data_args(shards) + ["-b", "2", "-x", "6", "-v", "0", "-c", "0.1", "--grad-clip", "0.5"]
    z0 = run(common + ["-z", "0", "-o", str(tmp_path / "z0")], np_=2)
    z1 = run(common + ["-z", "1", "-o", str(tmp_path / "z1")], np_=2)
    np.testing.assert_allclose(step_losses(z1.stdout), step_losses(z0.stdout), rtol=0, atol=2e-6)
    a = np.fromfile(tmp_path / "z0" / "model_00000006.bin", dtype=np.float32)[256:]
    b = np.fromfile(tmp_path / "z1" / "model_00000006.bin", dtype=np.float32)[256:]
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)
    # each rank wrote its own optimizer state: the whole model's with -z 0, half of it with -z 1
    n = config_from_name("L1C32H2").num_parameters
    s0 = (tmp_path / "z0" / "state_00000006_00001.bin").stat().st_size
    s1 = (tmp_path / "z1" / "state_00000006_00001.bin").stat().st_size
    assert s0 - s1 == 2 * 4 * (n - n // 2)


def test_resume_same_ranks_is_exact_and_other_ranks_refused(shards, tmp_path):
    need_mpi()
    common = SMALL + data_args(shards) + ["-b", "2", "-z", "1", "-x", "8", "-n", "4", "-v", "0"]
    full = run(common + ["-o", str(tmp_path / "full")], np_=2)
    part = tmp_path / "part"
    run(common + ["-o", str(part)], np_=2)
    for f in part.glob("*_00000008*"):   # the model, both ranks' states and DONE_00000008
        f.unlink()
    resumed = run(common + ["-o", str(part), "-y", "1"], np_=2)
    assert "resumed from" in resumed.stdout
    assert step_losses(resumed.stdout) == step_losses(full.stdout)[4:]
    a = (tmp_path / "full" / "model_00000008.bin").read_bytes()
    assert a == (part / "model_00000008.bin").read_bytes(), "resumed weights differ"
    # resuming with another number of ranks: one line, non-zero exit, from rank 0 only
    for np_ in (1, 4):
        p = run(common + ["-o", str(part), "-y", "1"], np_=np_, check=False)
        assert p.returncode != 0
        errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert len(errs) == 1 and "written by 2 ranks" in errs[0] and "mpirun -np 2" in errs[0], p.stderr
        assert "Traceback" not in p.stderr


def one_error_line(p):
    assert p.returncode != 0, p.stdout
    errs = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(errs) == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return errs[0]


def test_bad_input_is_one_line_from_rank_0(shards, tmp_path):
    need_mpi()
    base = SMALL + data_args(shards) + ["-x", "2", "-v", "0"]
    # -d must be a multiple of B*T*ranks
    line = one_error_line(run(base + ["-b", "2", "-d", "96"], np_=2, check=False))
    assert "-d/--total-batch-size 96" in line and "B*T*ranks = 2*16*2 = 64" in line
    # ZeRO-1 needs every tensor to split evenly (C=32 over 3 ranks does not)
    line = one_error_line(run(base + ["-b", "1", "-z", "1"], np_=3, check=False))
    assert "-z 1" in line and "not divisible by 3 ranks" in line
    # one rank alone fails (its state file is damaged): rank 0 says which and why, nobody hangs
    common = SMALL + data_args(shards) + ["-b", "2", "-x", "2", "-v", "0", "-o", str(tmp_path)]
    run(common, np_=2)
    st = tmp_path / "state_00000002_00001.bin"
    st.write_bytes(st.read_bytes()[:1024 + 400])   # the header and a little of m
    line = one_error_line(run(common + ["-y", "1"], np_=2, check=False))
    assert line.startswith("error: rank 1: state file") and "truncated" in line


def test_rank_that_never_starts_times_out(shards):
    """A rank that never reaches the start-up handshake (here: a process that only sleeps) must not
    leave the others waiting forever: rank 0 gives up after LLMC_DIST_TIMEOUT and the job ends."""
    need_mpi()
    env = dict(os.environ, PYTHONPATH=str(ROOT), LLMC_DIST_TIMEOUT="3")
    cmd = [mpiexec(), "-n", "1", sys.executable, str(ROOT / "train_gpt2.py"), *SMALL, *data_args(shards),
           "-b", "2", "-x", "2", ":", "-n", "1", sys.executable, "-c", "import time; time.sleep(120)"]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert time.monotonic() - t0 < 100
    assert p.returncode != 0
    assert "did not finish within 3 s" in p.stderr and "did a rank fail to start?" in p.stderr, p.stderr


@pytest.mark.parametrize("precision,zero,gather", [("fp32", 0, "update"), ("fp32", 1, "update"), ("bf16", 0, "update"),
                                                   ("bf16", 1, "update"), ("fp32", 1, "forward")])
def test_gpu_code_path_on_a_fake_gpu_and_fake_nccl(zero, precision, gather):
    """NcclComm and DataParallel's GPU side (CUDA-array views of our DevArrays, the second stream
    waiting on backward's events, ZeRO-1's piece pointers) on tests/fake_runtime.py's heap, with a
    stand-in nccl.core that checks nccl4py's signatures: 2 ranks match 1 fake GPU at twice the batch.
    bf16: the gradients reduced as bf16 (nccl4py's raw bindings), ZeRO-1's fp32 master shards; the
    ranks hold identical weights with stochastic rounding on; against one GPU (rounding to nearest)
    the losses agree to 5e-3 and the weights to 2e-2 (a few bf16 ulps of a weight near 1: the two
    ranks' bf16 gradient sum rounds differently from one rank's)."""
    need_mpi()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), LLMC_DP_GATHER=gather)
    p = subprocess.run([mpiexec(), "-n", "2", sys.executable, str(ROOT / "tests" / "dist_fake_nccl.py"), str(zero),
                        precision], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"^losses (.*) \| one (.*) \| max weight diff (\S+)", p.stdout, re.M)
    assert m, p.stdout
    two, one = ([float(v) for v in g.split()] for g in m.groups()[:2])
    assert len(two) == len(one) == 4
    loss_tol, weight_tol = (2e-6, 1e-5) if precision == "fp32" else (5e-3, 2e-2)
    np.testing.assert_allclose(two, one, rtol=0, atol=loss_tol)
    assert float(m.group(3)) < weight_tol


# ----------------------------------------------------------------------------------------------
# llm.c's run files under mpiexec: per-rank state in llm.c's layout, DONE, -z, HellaSwag, rank 0's log


def strip_trailer(path, floats_per_array):
    """Cut our JSON trailer off a state file: what is left is exactly what llm.c writes."""
    data = path.read_bytes()
    path.write_bytes(data[:1024 + 2 * 4 * floats_per_array])


def set_loader_position(path, shard, sample):
    h = np.fromfile(path, dtype="<i4", count=256)
    h[30:32] = np.array([shard], "<u8").view("<i4")
    h[32:34] = np.array([sample], "<u8").view("<i4")
    data = bytearray(path.read_bytes())
    data[:1024] = h.tobytes()
    path.write_bytes(bytes(data))


def test_llmc_layout_states_of_two_ranks_resume_exactly(shards, tmp_path):
    """Each rank's state_%08d_%05d.bin is llm.c's: the header names 2 processes and the rank, holds
    the rank's ZeRO-1 shard of m and v, and counts the loader position in windows of 2*B*T tokens.
    With our trailer cut off (what llm.c itself writes) both ranks resume from the header alone, at
    a shard's end in our form (next shard, sample 0) and in llm.c's (same shard, sample = count)."""
    need_mpi()
    P = config_from_name("L1C32H2").num_parameters
    common = SMALL + data_args(shards) + ["-b", "2", "-z", "1", "-v", "0", "-x", "13", "-n", "11"]
    full = run(common + ["-o", str(tmp_path / "full")], np_=2)
    for r in range(2):
        h = np.fromfile(tmp_path / "full" / f"state_00000011_{r:05d}.bin", dtype="<i4", count=256)
        # 11 steps x one 2*2*16-token window each: all 11 windows of train_000 (768 tokens) are done
        assert (h[0], h[2], h[3], h[10]) == (20240527, 2, r, 11)
        assert (int(h[30]), int(h[32])) == (1, 0)
    want = step_losses(full.stdout)[11:]
    assert len(want) == 2
    for position in [(1, 0), (0, 11)]:
        part = tmp_path / f"part_{position[0]}"
        shutil.copytree(tmp_path / "full", part)
        for f in part.glob("*_00000013*"):
            f.unlink()
        for r in range(2):
            st = part / f"state_00000011_{r:05d}.bin"
            strip_trailer(st, P // 2)
            set_loader_position(st, *position)
        p = run(common + ["-o", str(part), "-y", "1"], np_=2)
        assert "is llm.c's: continuing at its loader position" in p.stderr
        assert p.stderr.count("is llm.c's") == 1   # rank 0's note only
        assert step_losses(p.stdout) == want, position
    # the same files under -z 0 (each rank would need the whole model's m and v): one line
    line = one_error_line(run(common + ["-z", "0", "-o", str(tmp_path / "part_1"), "-y", "1"], np_=2, check=False))
    assert "holds ZeRO-1 shards of m and v (-z 1)" in line and "resume with -z 1" in line
    assert not line.startswith("error: rank")


def test_rank0_alone_logs_prunes_and_marks_done(shards, tmp_path):
    need_mpi()
    common = SMALL + data_args(shards) + ["-b", "2", "-x", "6", "-n", "2", "-nk", "1", "-v", "3", "-o", str(tmp_path)]
    p = run(common, np_=2)
    names = sorted(f.name for f in tmp_path.iterdir())
    # -nk 1: only step 6 is left, every rank's state of the older steps deleted with them
    assert names == ["DONE_00000006", "main.log", "model_00000006.bin", "state_00000006_00000.bin",
                     "state_00000006_00001.bin"], names
    log = (tmp_path / "main.log").read_text().splitlines()
    assert [l.split()[0] for l in log if " trl:" in l] == [f"s:{i}" for i in range(6)]   # one line per step
    assert [l.split()[0] for l in log if " tel:" in l] == ["s:0", "s:3", "s:6"]
    assert p.stdout.count("deleted the checkpoint of step") == 2


def test_hellaswag_split_over_ranks_counts_every_example(tmp_path):
    """-h 1 under 2 ranks: each scores every other batch, the counts are summed: llm.c's line is the
    same as one process's, and only rank 0 prints it and logs s:0 eval:."""
    need_mpi()
    from llmc_fixtures import write_llmc_evalfile
    rng = np.random.default_rng(3)
    ex = [(int(rng.integers(0, 4)), rng.integers(0, 500, int(rng.integers(1, 6))).tolist(),
           [rng.integers(0, 500, int(rng.integers(1, 5))).tolist() for _ in range(4)]) for _ in range(7)]
    write_llmc_evalfile(tmp_path / "hs.bin", ex)
    write_shard(str(tmp_path / "train.bin"), rng.integers(0, 500, 2000).astype(np.uint16))
    args = ["--device", "cpu", "-e", "L1C32H2", "-t", "16", "-b", "4", "-x", "0", "-h", "1", "-s", "0",
            "--hellaswag-data", str(tmp_path / "hs.bin"), "-i", str(tmp_path / "train.bin"), "-j", ""]
    one = run(args)
    two = run(args + ["-o", str(tmp_path / "out")], np_=2)
    line = re.findall(r"^HellaSwag: \d+/7 = .*$", one.stdout, re.M)
    assert len(line) == 1 and re.findall(r"^HellaSwag: \d+/7 = .*$", two.stdout, re.M) == line
    acc = float(line[0].split("= ")[1])
    assert (tmp_path / "out" / "main.log").read_text().splitlines() == [f"s:0 eval:{acc:.4f}"]


def test_nccl_buffers_carry_their_device_through_dlpack():
    """The collectives' buffer wrapper hands its memory over by DLPack, naming the device (nccl4py
    guessed it wrong from __cuda_array_interface__ on the H200s). Checked with host memory, which
    numpy consumes: the same structs with device (1, 0) instead of (2, rank's GPU)."""
    from types import SimpleNamespace

    from llmc.dist import _CudaArray
    host = np.arange(10, dtype=np.float32) * 1.5
    a = SimpleNamespace(ptr=host.ctypes.data, size=host.size, dtype=host.dtype)
    view = _CudaArray(a, device=(1, 0))
    got = np.from_dlpack(view)                          # numpy asks for DLPack 1.0: the versioned capsule
    assert np.array_equal(got, host) and got.ctypes.data == host.ctypes.data   # the same memory

    class Legacy:                                       # a consumer of the unversioned protocol
        def __init__(self, v):
            self.v = v

        def __dlpack_device__(self):
            return self.v.__dlpack_device__()

        def __dlpack__(self, stream=None):
            return self.v.__dlpack__(stream=stream)
    old = np.from_dlpack(Legacy(view))
    assert np.array_equal(old, host) and old.ctypes.data == host.ctypes.data
    from llmc import dist
    assert len(dist._LIVE) == 2
    del got, old                                        # the consumers call the deleters
    assert len(dist._LIVE) == 0
    rt = SimpleNamespace(ordinal=1)
    cuda = _CudaArray(SimpleNamespace(ptr=host.ctypes.data, size=4, dtype=np.dtype(np.int32), rt=rt))
    assert cuda.__dlpack_device__() == (2, 1)
    assert cuda.__cuda_array_interface__["typestr"] == "<i4"


# ----------------------------------------------------------------------------------------------
# stream order of ZeRO-1's all-gather (no MPI: a recording stand-in for the communicator)


class _RecordingComm:
    """Two ranks' collectives as this rank (0) sees them, logged in launch order with the stream
    they go on ("compute" or "comm"); an event is the log position of the last collective on its
    stream when it was recorded. Kernels are logged by the test's wrappers."""

    def __init__(self, world=2):
        self.world, self.log, self.sends = world, [], {}

    def _op(self, what, stream, bufs):
        self.log.append((what, stream or "compute", bufs))

    def all_reduce_avg(self, bufs, stream=None):
        self._op("all_reduce", stream, list(bufs))

    def reduce_scatter_avg(self, pairs, stream=None):
        for send, recv in pairs:  # rank 0's piece of the "sum of both ranks / 2" = its own piece
            recv[...] = send[:recv.size]
        self._op("reduce_scatter", stream, [r for _, r in pairs])

    def all_reduce_sum(self, buf, stream=None):
        self._op("all_reduce_sum", stream, [buf])

    def all_gather(self, pairs, stream=None):
        self._op("all_gather", stream, [recv for _, recv in pairs])
        self.sends[len(self.log) - 1] = [send for send, _ in pairs]

    def new_stream(self):
        return "comm"

    def record(self, stream):
        s = stream or "compute"
        return max((i for i, e in enumerate(self.log) if e[1] == s), default=-1)

    def wait(self, stream, event):
        self.log.append(("wait", stream or "compute", event))


def _span(a):
    p = a.__array_interface__["data"][0]
    return p, p + a.nbytes


@pytest.mark.parametrize("gather", ["forward", "update"])
def test_zero1_forward_reads_no_weight_before_its_all_gather(monkeypatch, gather):
    """-z 1 all-gathers the updated weights at the end of the update on the compute stream
    (LLMC_DP_GATHER=update, the default), or on the second stream, layer by layer, while the next
    forward runs (=forward). Either way
    no kernel on the compute stream may read a weight before the all-gather that writes it has
    finished: every such read must come after a compute-stream wait on an event recorded after that
    all-gather; and no all-gather on the second stream may send a piece before the AdamW launches
    before it (which write the pieces) are waited for. Checked over a whole update + the next
    micro-step + a validation forward, from a log of every launch and collective (numpy backend)."""
    from llmc.backend import make_backend
    from llmc.dist import DataParallel
    from llmc.model import GPT2

    class Group:
        world, rank, local_rank, local_world, is_main, num_hosts = 2, 0, 0, 1, True, 1

    monkeypatch.setenv("LLMC_DP_GATHER", gather)
    cfg = config_from_name("L3C32H2")
    be = make_backend("cpu")
    model = GPT2(cfg, be, 2, 16, optimizer=False)
    model.init_params(1)
    comm = _RecordingComm()
    dp = DataParallel(Group(), model, 1, comm)
    for name, fn in list(model.k.items()):
        def logged(*args, _fn=fn, _name=name):
            comm.log.append(("kernel " + _name, "compute", [a for a in args if isinstance(a, np.ndarray)]))
            return _fn(*args)
        model.k[name] = logged

    def log_adamw(fn, lo, hi):  # logged with the weights it writes: this rank's pieces of chunks lo..hi-1
        pieces = [send for send, _ in dp._gather_pairs(dp._all_chunks()[lo:hi])]

        def logged(*args):
            comm.log.append(("kernel adamw", "compute", pieces))
            return fn(*args)
        return logged
    dp.adamw_all = log_adamw(dp.adamw_all, 0, len(dp.plan))
    dp.plan = [(log_adamw(pl[0], i, i + 1), *pl[1:]) for i, pl in enumerate(dp.plan)]
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32) for _ in range(2))
    for step in range(2):
        model.zero_grad()
        dp.train_micro_step(x, y, last=True)
        dp.update(1e-3, step + 1)
    dp.params_ready()
    model.forward(x, y, grad=False)

    params = _span(model.params)
    waited = {"compute": -1, "comm": -1}  # the latest event each stream has waited for
    gathers = []                          # (log position, stream, written byte ranges)
    reads = 0
    for i, (what, stream, bufs) in enumerate(comm.log):
        if what == "wait":
            waited[stream] = max(waited[stream], bufs)
            continue
        spans = [_span(b) for b in bufs]
        if what == "all_gather":
            gathers.append((i, stream, spans))
            assert stream == ("compute" if gather == "update" else "comm")
            sends = [_span(b) for b in comm.sends[i]]
            for k, (kwhat, kstream, kbufs) in enumerate(comm.log[:i]):
                if kwhat == "kernel adamw" and any(lo < hi2 and lo2 < hi for lo, hi in sends
                                                   for lo2, hi2 in map(_span, kbufs)):
                    assert kstream == stream or waited[stream] >= k, \
                        f"the all-gather at {i} sends pieces that AdamW (launch {k}) may still be writing"
            continue
        if not what.startswith("kernel"):
            continue
        for lo, hi in spans:
            if hi <= params[0] or lo >= params[1]:
                continue  # not the weights
            reads += 1
            for g, gstream, gspans in gathers:
                if any(lo < ghi and glo < hi for glo, ghi in gspans):
                    assert gstream == stream or waited[stream] >= g, \
                        f"{what} (launch {i}) reads weights that the all-gather at {g} is still writing"
    assert reads > 50 and len(gathers) >= (2 if gather == "update" else 2 * (cfg.num_layers + 1))


@pytest.mark.parametrize("zero", [0, 1])
def test_pipelined_steps_print_the_same_on_two_ranks(shards, tmp_path, zero):
    """With each step read after the next one is launched (LLMC_PIPELINE_STEPS=1, the cuda
    backend's default), every rank reads its steps in the same order, so the losses averaged over
    the ranks, the norms (-z 1: the shard norms summed across ranks) and every printed line are
    those of the run that reads each step at once."""
    need_mpi()
    # (-s 2: rank 0 alone samples, every rank reports the pending step before it: a mean over ranks)
    common = SMALL + data_args(shards) + ["-b", "2", "-z", str(zero), "-x", "6", "-v", "3", "-c", "0.1",
                                          "-s", "2", "-g", "4"]
    outs = [run(common + ["-o", str(tmp_path / f"p{flag}")], np_=2, env={"LLMC_PIPELINE_STEPS": flag},
                timeout=120).stdout for flag in ("1", "0")]
    strip = [[re.sub(r"\| [0-9.]+ ms.*$", "", ln) for ln in o.splitlines()
              if not ln.startswith(("total average", "wrote "))] for o in outs]
    assert strip[0] == strip[1]
    assert len(step_losses(outs[0])) == 6 and "norm" in outs[0] and outs[0].count("generating") >= 3
    a = (tmp_path / "p1" / "model_00000006.bin").read_bytes()
    assert a == (tmp_path / "p0" / "model_00000006.bin").read_bytes()
