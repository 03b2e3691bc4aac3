"""The trainer on the GPU (pytest -m gpu): --deterministic makes a run split by a resume equal an
uninterrupted one bit for bit; the memory, MFU and mean-step-time lines; the no-GPU reasons where
the GPU is fine; divergence stops in one line; the installed package trains from any directory.

    python -m pytest -m gpu tests/test_train_gpu.py -q
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
# head size 64, so the fused attention (the default) runs
RUN = ["--device", "cuda", "-e", "L2C128H2", "-b", "2", "-t", "64", "-s", "0", "-v", "0", "-l", "1e-3", "-u", "2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory, rt):
    from llmc.data import write_shard
    d = tmp_path_factory.mktemp("data")
    base = np.random.default_rng(0).integers(0, 5000, 257)
    write_shard(str(d / "train_000.bin"), np.tile(base, 20).astype(np.uint16))
    return d


def train(*args, cwd=ROOT, exe=None, check=True):
    cmd = [str(exe)] if exe else [sys.executable, str(ROOT / "train_gpt2.py")]
    # the checkout first, then whatever PYTHONPATH held (PyCUDA may be installed there)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    if exe is not None:  # the installed command: keep PYTHONPATH (PyCUDA may live there), minus the checkout
        import site
        keep = [d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d and Path(d).resolve() != ROOT]
        # and this interpreter's site-packages: where python3 is itself a venv (the GPU machine's is),
        # a --system-site-packages venv made from it sees the base interpreter's, not numpy's
        keep += [d for d in site.getsitepackages() if d not in keep]
        env["PYTHONPATH"] = os.pathsep.join(keep)
    p = subprocess.run(cmd + [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deterministic_resume_is_bit_exact(shards, tmp_path, precision):
    """Two uninterrupted runs are byte-identical, and a run stopped at step 3 and resumed writes step
    6's model and state byte for byte as the uninterrupted one. In bf16 with stochastic rounding on:
    a v5 model, and the state's fp32 masters and rounding RNG carry the run across the resume."""
    from llmc.checkpoint import HEADER_INTS
    common = [*RUN, "-i", shards / "train_*.bin", "-j", "", "-x", "6", "-n", "3", "--deterministic",
              "--precision", precision]
    train(*common, "-o", tmp_path / "full")
    train(*common, "-o", tmp_path / "again")
    full = (tmp_path / "full" / "model_00000006.bin").read_bytes()
    assert np.frombuffer(full[:4 * HEADER_INTS], np.int32)[1] == (5 if precision == "bf16" else 3)
    assert (tmp_path / "again" / "model_00000006.bin").read_bytes() == full, "two uninterrupted runs differ"
    part = tmp_path / "part"
    train(*common, "-o", part)
    for f in part.glob("*_00000006*"):
        f.unlink()
    p = train(*common, "-o", part, "-y", "1")
    assert "(step 3)" in p.stdout
    assert (part / "model_00000006.bin").read_bytes() == full, "the resumed run's weights differ"
    assert (part / "state_00000006_00000.bin").read_bytes() == (tmp_path / "full" / "state_00000006_00000.bin").read_bytes()
    assert "encoder_backward=9" in p.stdout and "global_norm=3" in p.stdout


def test_memory_mfu_and_mean_step_time_lines(shards, rt):
    from llmc.train import peak_flops
    p = train(*RUN, "-i", shards / "train_*.bin", "-j", "", "-x", "4")
    mem = [l for l in p.stdout.splitlines() if l.startswith("GPU memory: ")]
    assert len(mem) == 1 and float(mem[0].split()[2]) > 0, p.stdout
    steps = [l for l in p.stdout.splitlines() if l.startswith("step ")]
    assert len(steps) == 4
    if peak_flops(rt.name, "fp32") is not None:
        assert all("% MFU" in l for l in steps), steps
    assert "total average iteration time" in p.stdout


def test_gpu_checks_pass_here_and_name_a_missing_nvcc(rt, monkeypatch):
    import llmc.runtime
    from llmc.errors import LLMCError
    from llmc.gpu_check import probe_driver, why_no_gpu
    d = probe_driver()
    assert d["state"] == "ok" and tuple(d["arch"]) >= (8, 0) and d["name"] == rt.name
    assert why_no_gpu() is None
    from llmc.backend import make_backend
    assert make_backend("auto").name == "cuda"
    monkeypatch.setattr(llmc.runtime, "nvcc_path", lambda: None)
    assert "nvcc not found" in why_no_gpu()
    with pytest.raises(LLMCError, match="--device cuda: nvcc not found"):
        make_backend("cuda")


def test_divergence_stops_in_one_line(shards, tmp_path):
    p = train(*RUN, "-i", shards / "train_*.bin", "-j", "", "-x", "20", "-l", "1e30", "-n", "1",
              "-o", tmp_path, check=False)
    lines = [l for l in p.stderr.splitlines() if l.strip() and not l.startswith("compiling")]
    assert p.returncode == 1 and len(lines) == 1 and "diverged" in lines[0], p.stderr
    from llmc import runfiles
    from llmc.checkpoint import read_model
    for s in runfiles.done_steps(tmp_path):
        assert np.isfinite(read_model(runfiles.model_path(tmp_path, s))[1]).all()


def test_skip_grad_z_reads_the_norm_before_the_update(rt):
    """-sg computes the norm before AdamW; the update computes it again: the same value."""
    from llmc.backend import CudaBackend
    from llmc.config import config_from_name
    from llmc.model import GPT2
    from llmc.dist import DataParallel, Group
    cfg = config_from_name("L2C128H2")
    m = GPT2(cfg, CudaBackend(), 2, 64)
    m.init_params(0)
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.vocab_size, (2, 64)).astype(np.int32) for _ in range(2))
    m.zero_grad()
    m.train_micro_step(x, y)
    dp = DataParallel(Group(), m, 0)   # what the trainer calls, one process
    before = dp.grad_norm_before_update()
    dp.update(1e-3, 1)
    assert before == m.grad_norm() and before > 0


def test_installed_package_trains_on_the_gpu_from_any_directory(shards, tmp_path):
    import venv
    from test_packaging import copy_source, pip
    src = copy_source(tmp_path / "src")
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(src))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    pip("install", "--no-deps", str(next((tmp_path / "whl").glob("llmc_py-*.whl"))), python=str(env_dir / "bin" / "python"))
    shutil.rmtree(src)
    work = tmp_path / "elsewhere"
    work.mkdir()
    p = train(*RUN, "-i", shards / "train_*.bin", "-j", "", "-x", "2", "-o", "out", cwd=work,
              exe=env_dir / "bin" / "llmc-train")
    assert "backend: cuda" in p.stdout and (work / "out" / "DONE_00000002").exists()
