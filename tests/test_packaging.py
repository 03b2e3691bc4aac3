"""`pip install .` gives a package that works from any directory: the kernel sources and the GPT-2
vocabulary ship inside it, and the llmc-train / llmc-sample commands exist.

    python -m pytest tests/test_packaging.py -q
"""
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def copy_source(dest: Path) -> Path:
    """What a fresh clone holds of the package (building in the checkout would leave build/ there)."""
    for name in ("llmc", "cuda"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    return dest


def pip(*args, python=sys.executable):
    p = subprocess.run([python, "-m", "pip", *args, "-q", "--disable-pip-version-check"], capture_output=True,
                       text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_wheel_ships_kernels_vocab_and_commands(tmp_path):
    src = copy_source(tmp_path / "src")
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(src))
    whl = next((tmp_path / "whl").glob("llmc_py-*.whl"))
    names = set(zipfile.ZipFile(whl).namelist())
    kernels = {f"llmc/cuda/{p.name}" for p in (ROOT / "cuda").iterdir() if p.suffix in (".cu", ".cuh")}
    assert kernels and kernels <= names, kernels - names
    assert {"llmc/vocab/vocab.bpe", "llmc/vocab/encoder.json", "llmc/ops/__init__.py"} <= names
    meta = next(n for n in names if n.endswith("entry_points.txt"))
    ep = zipfile.ZipFile(whl).read(meta).decode()
    assert "llmc-train = llmc.train:cli_main" in ep and "llmc-sample = llmc.sample_cli:cli_main" in ep
    requires = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: numpy>=2.1" in requires and "Requires-Dist: tiktoken>=0.12" in requires


@pytest.mark.slow
def test_pip_install_into_a_fresh_venv(tmp_path):
    """Installed (no editable link to the checkout), run from an unrelated directory."""
    src = copy_source(tmp_path / "src")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    # built by this interpreter's setuptools (a venv's bundled one may predate PEP 517 wheels),
    # installed by the venv's pip
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "whl"), str(src))
    pip("install", "--no-deps", str(next((tmp_path / "whl").glob("llmc_py-*.whl"))), python=str(py))
    shutil.rmtree(src)  # nothing may point back at the source tree
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda *cmd: subprocess.run([str(c) for c in cmd], cwd=work, env=env, capture_output=True,  # noqa: E731
                                      text=True, timeout=300)
    for cmd in ("llmc-train", "llmc-sample"):
        p = run(env_dir / "bin" / cmd, "--help")
        assert p.returncode == 0 and "--device" in p.stdout, p.stderr
    p = run(py, "-c", "import llmc.runtime as r, llmc.tokenizer as t; print(r.CUDA_DIR); "
            "print(t._shipped_vocab_dir()); print(len(r.cuda_sources()))")
    assert p.returncode == 0, p.stderr
    cuda_dir, vocab_dir, n = p.stdout.split()
    assert str(env_dir) in cuda_dir and str(env_dir) in vocab_dir
    assert int(n) == len(list((ROOT / "cuda").glob("*.cu")))
    # the installed package compiles its kernels (no GPU needed for nvcc)
    from llmc.runtime import nvcc_path
    if nvcc_path():
        p = run(py, "-c", "from llmc.runtime import compile_cubin; print(compile_cubin('gelu', 'sm_80', "
                "use_cache=False)[0])")
        assert p.returncode == 0 and p.stdout.strip().endswith(".cubin"), p.stderr
    # and trains on the numpy backend from here
    from llmc.data import write_shard
    import numpy as np
    write_shard(work / "t.bin", np.tile(np.arange(64, dtype=np.uint16), 10))
    p = run(env_dir / "bin" / "llmc-train", "--device", "cpu", "-e", "L1C32H2", "-b", "2", "-t", "16", "-x", "2",
            "-i", "t.bin", "-j", "", "-s", "0", "-o", "out")
    assert p.returncode == 0, p.stderr
    assert (work / "out" / "DONE_00000002").exists()
