"""The pipelined step (GPT2.read_step, the trainer's loop): a step's loss and norm are copied to the
host behind its launches and read after the next step is launched.

- read_step's values equal step_loss() / grad_norm() read at once, on the numpy backend, the fake
  GPU and (pytest -m gpu) the H100, bit for bit, with the next step launched before the read;
- two reads pending at once, and a third reusing the oldest's pinned buffers after reading it out;
- the trainer's output (every line but the times: steps, val losses, samples, checkpoints) and its
  checkpoints are the same pipelined and with LLMC_PIPELINE_STEPS=0.

    python -m pytest tests/test_step_read.py -q
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.model import GPT2

ROOT = Path(__file__).resolve().parent.parent
CFG = GPT2Config(max_seq_len=16, vocab_size=64, padded_vocab_size=64, num_layers=2, num_heads=2, channels=32)


def batches(n, B=2, T=8, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 64, (B, T)).astype(np.int32), rng.integers(0, 64, (B, T)).astype(np.int32))
            for _ in range(n)]


def run_steps(model, data, pipelined, accum=1):
    """(loss, norm) of each step: read at once (step_loss, grad_norm) or through read_step with the
    next step launched before the read, as the trainer does."""
    out, pending = [], None
    for i in range(0, len(data), accum):
        model.zero_grad()
        for x, y in data[i:i + accum]:
            model.train_micro_step(x, y)
        model.update(1e-3, i // accum + 1, weight_decay=0.1)
        if pipelined:
            read = model.read_step()
            if pending is not None:
                out.append((pending.loss(), pending.norm()))
            pending = read
        else:
            out.append((model.step_loss(), model.grad_norm()))
    if pending is not None:
        out.append((pending.loss(), pending.norm()))
    return out


def cpu_model(seed=0):
    m = GPT2(CFG, CpuBackend(), 2, 8)
    m.init_params(seed)
    return m


@pytest.mark.parametrize("accum", [1, 2])
def test_read_step_equals_the_synchronous_reads(accum):
    data = batches(8)
    want = run_steps(cpu_model(), data, pipelined=False, accum=accum)
    got = run_steps(cpu_model(), data, pipelined=True, accum=accum)
    assert got == want
    assert len(set(want)) == len(want)  # the steps differ: a read of the wrong step would show


def test_three_reads_in_flight_keep_their_values():
    """Two pinned buffer sets in turn: the third read reuses the first's, after reading it out."""
    m = cpu_model()
    reads, want = [], []
    for i, (x, y) in enumerate(batches(3)):
        m.zero_grad()
        m.train_micro_step(x, y)
        m.update(1e-3, i + 1)
        reads.append(m.read_step())
        want.append(m.step_loss())
    assert [r.loss() for r in reads] == want
    assert len(set(want)) == 3


def test_read_without_norm():
    m = cpu_model()
    x, y = batches(1)[0]
    m.zero_grad()
    m.train_micro_step(x, y)
    r = m.read_step(norm=False)
    assert r.loss() == m.step_loss()
    with pytest.raises(RuntimeError, match="no norm"):
        r.norm()


def test_read_step_on_the_fake_gpu():
    """The cuda backend's model code over the fake runtime (first_write, the batch upload, graphs
    captured and replayed, the side stream) reads the same through read_step as at once."""
    from tests.fake_runtime import FakeCudaBackend
    data = batches(6)
    res = []
    for pipelined in (False, True):
        m = GPT2(CFG, FakeCudaBackend(quiet=True), 2, 8)
        m.init_params(0)
        res.append(run_steps(m, data, pipelined))
    assert res[0] == res[1]


def _train(args, env=None):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), *args], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _without_times(stdout):
    out = []
    for line in stdout.splitlines():
        line = re.sub(r"\| [0-9.]+ ms.*$", "", line)  # a step line's time, MFU and tokens/s
        if line.startswith(("total average iteration time", "wrote ", "GPU memory")):
            line = line.split(":")[0] if not line.startswith("wrote ") else "wrote"
        out.append(line)
    return out


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from llmc.data import write_shard
    d = tmp_path_factory.mktemp("data")
    base = np.random.default_rng(0).integers(0, 500, 64)
    write_shard(str(d / "train_000.bin"), np.tile(base, 40).astype(np.uint16))
    write_shard(str(d / "val_000.bin"), np.tile(base, 4).astype(np.uint16))
    return d


def test_trainer_output_is_the_same_pipelined(shards, tmp_path):
    """Every line in the same order (a step's line before the val loss, sample and checkpoint of the
    next), the same losses and norms, the same checkpoints, with and without the pipeline."""
    args = ["--device", "cpu", "-e", "L1C32H2", "-b", "2", "-t", "16", "-i", str(shards / "train_*.bin"),
            "-j", str(shards / "val_*.bin"), "-v", "3", "-s", "4", "-g", "4", "-n", "5", "-x", "11",
            "-a", "0", "-l", "1e-3"]
    outs = {}
    for flag in ("1", "0"):
        d = tmp_path / f"run{flag}"
        outs[flag] = _train(args + ["-o", str(d)], {"LLMC_PIPELINE_STEPS": flag})
    a, b = _without_times(outs["1"]), _without_times(outs["0"])
    assert a == b, "\n".join(f"{x!r} | {y!r}" for x, y in zip(a, b) if x != y)
    text = "\n".join(a)
    assert text.count("val loss") >= 4 and text.count("generating") >= 2 and text.count("wrote") >= 3
    assert len(re.findall(r"^step\s+\d+/11 \| loss", text, re.M)) == 11
    # a step's line comes before the validation at the top of the next step
    assert re.search(r"^step\s+3/11 .*\n(.*\n)*?val loss", text, re.M)
    for f in sorted((tmp_path / "run1").glob("*.bin")):
        assert f.read_bytes() == (tmp_path / "run0" / f.name).read_bytes(), f.name


GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_read_step_gpu_bit_for_bit(precision):
    """On the GPU (graphs, first_write, the copies queued behind the step and read after the next
    step's launches, --deterministic's kernels): the same bits as step_loss() and grad_norm() read
    at once."""
    from llmc.backend import CudaBackend
    from llmc.train import deterministic_kernels
    data = [(x % 97, y % 97) for x, y in batches(8, B=3, T=37, seed=1)]
    res = []
    for pipelined in (False, True):
        be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
        m = GPT2(GPU_CFG, be, 3, 37)
        m.init_params(0)
        m.stochastic_rounding = False
        res.append(run_steps(m, data, pipelined, accum=2))
        del m, be
    assert res[0] == res[1], res
    assert len(set(res[0])) == len(res[0]) and all(np.isfinite(v) for pair in res[0] for v in pair)


def test_bench_step_times_the_trainers_loop(monkeypatch):
    """dev/bench_step.py's pipelined timing: step i + 1 is launched before step i is read, and each
    step's time runs from the event at its launches' start to the next step's."""
    monkeypatch.syspath_prepend(str(ROOT / "dev"))
    import importlib
    bench_step = importlib.import_module("bench_step")
    clock, log = [0.0], []

    class Ev:
        def record(self, stream):
            self.t = clock[0]

        def synchronize(self):
            pass

        def time_since(self, other):
            return self.t - other.t

    class Rt:
        stream = None

        def event(self):
            return Ev()

    class Read:
        def __init__(self, i):
            self.i = i

        def loss(self):
            log.append(("read", self.i))
            return float(self.i)

    def step(i):
        log.append(("launch", i))
        clock[0] += 1.0 + i  # the GPU time step i takes
        return Read(i)

    times, walls, loss = bench_step.time_pipelined(Rt(), step, 3, 4)
    assert log == [("launch", 3), ("launch", 4), ("read", 3), ("launch", 5), ("read", 4), ("launch", 6),
                   ("read", 5), ("read", 6)]
    assert times == [4.0, 5.0, 6.0, 7.0] and len(walls) == 4 and loss == 6.0
    log.clear()
    times, _, loss = bench_step.time_synced(Rt(), step, 0, 2)
    assert log == [("launch", 0), ("read", 0), ("launch", 1), ("read", 1)] and loss == 1.0


@pytest.mark.parametrize("r", [0, 2])
def test_bench_step_builds_the_model_with_its_recompute(monkeypatch, r):
    """bench_step -r builds the model with that activation recompute (and steps it), as the trainer's -r."""
    monkeypatch.syspath_prepend(str(ROOT / "dev"))
    import importlib
    bench_step = importlib.import_module("bench_step")
    model, step = bench_step.training_step(CpuBackend(), CFG, 2, 8, recompute=r)
    assert model.recompute == r and model.activation_bytes() != GPT2(CFG, CpuBackend(), 2, 8).activation_bytes()
    assert np.isfinite(step(0).loss())


def test_bench_step_takes_its_batch_from_a_token_shard(monkeypatch, tmp_path):
    """bench_step --tokens: the batch is the shard's first B*T + 1 tokens (x, then y shifted by one),
    so that a step can be timed on text ids; a shard too short for a batch is one clear error."""
    from llmc.data import write_shard
    from llmc.errors import LLMCError
    monkeypatch.syspath_prepend(str(ROOT / "dev"))
    import importlib
    bench_step = importlib.import_module("bench_step")
    toks = (np.arange(40) * 7 % CFG.vocab_size).astype(np.uint16)
    write_shard(tmp_path / "t.bin", toks)
    shard = bench_step.read_shard(tmp_path / "t.bin")
    seen = []
    model, step = bench_step.training_step(CpuBackend(), CFG, 2, 8, tokens=shard)
    real = model.train_micro_step
    monkeypatch.setattr(model, "train_micro_step", lambda x, y: (seen.append((x.copy(), y.copy())), real(x, y))[1])
    assert np.isfinite(step(0).loss())
    np.testing.assert_array_equal(seen[0][0], toks[:16].reshape(2, 8))
    np.testing.assert_array_equal(seen[0][1], toks[1:17].reshape(2, 8))
    with pytest.raises(LLMCError, match="--tokens: 40 tokens, a batch needs B\\*T \\+ 1 = 41"):
        bench_step.training_step(CpuBackend(), CFG, 5, 8, tokens=shard)
