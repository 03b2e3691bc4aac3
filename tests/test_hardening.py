"""Every fault a user or the machine can cause ends in one line and a non-zero exit; runs that go
wrong stop loudly; --help, --deterministic, MFU, and the no-GPU reasons.

    python -m pytest tests/test_hardening.py -q
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.train import build_parser, cli

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--device", "cpu", "-e", "L1C32H2", "-b", "2", "-t", "16", "-s", "0", "-v", "0"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from llmc.data import write_shard
    d = tmp_path_factory.mktemp("data")
    base = np.random.default_rng(0).integers(0, 500, 64)
    write_shard(str(d / "train_000.bin"), np.tile(base, 10).astype(np.uint16))
    bad = np.tile(base, 10).astype(np.uint16)
    bad[100] = 60000
    write_shard(str(d / "badtok.bin"), bad)
    return d


def one_line(capsys, argv, *needles):
    code = cli(argv)
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert code != 0, out
    assert len(lines) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# -----------------------------------------------------------------------------
# flags


@pytest.mark.parametrize("flag,value,name", [
    ("-b", "0", "--batch-size"), ("-t", "0", "--seq-len"), ("-q", "-2", "--final-lr-frac"),
    ("-q", "1.5", "--final-lr-frac"), ("--grad-clip", "-1", "--grad-clip"), ("-m", "0", "--val-batches"),
    ("-l", "nan", "--learning-rate"), ("-l", "-1", "--learning-rate"), ("-l", "inf", "--learning-rate"),
    ("-c", "nan", "--weight-decay"), ("-sl", "-1", "--skip-loss-z"), ("-sg", "nan", "--skip-grad-z"),
    ("-y", "2", "--resume"), ("-a", "3", "--overfit-single-batch"), ("-x", "-5", "--max-steps"),
    ("-d", "0", "--total-batch-size"), ("--seed", "-1", "--seed"), ("-nk", "-1", "--checkpoints-keep"),
    ("-nm", "x", "--major-checkpoint-every"), ("-n", "-3", "--checkpoint-every"), ("-v", "-1", "--val-every"),
    ("-g", "0", "--gen-tokens"), ("-u", "-1", "--warmup-steps"), ("--device", "gpu", "--device"),
    ("--precision", "fp16", "--precision"), ("--stochastic-rounding", "2", "--stochastic-rounding"),
    ("--softmax-kernel", "0", "--softmax-kernel"),
])
def test_flag_ranges(flag, value, name, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and name in err and repr(value) in err, err


def test_lr_is_the_learning_rate_not_a_prefix_of_lr_schedule():
    """`--lr 6e-4` (nanoGPT's and many trainers' spelling) sets the learning rate; before it was an alias,
    argparse took it as an abbreviation of --lr-schedule and refused '6e-4' as a schedule."""
    args = build_parser().parse_args(["--lr", "6e-4", "--lr-schedule", "linear"])
    assert args.learning_rate == 6e-4 and args.lr_schedule == "linear"
    assert build_parser().parse_args(["-l", "1e-3"]).learning_rate == 1e-3


def test_help_shows_each_default_once_and_every_flag_has_help():
    text = build_parser().format_help()
    assert "(default: None)" not in text
    for action in build_parser()._actions:
        assert action.help, action.option_strings
        h = action.help
        assert h.count("default") <= 1, h
    # the -b line states its default once
    line = [l for l in text.splitlines() if "--batch-size" in l][0]
    idx = text.index(line)
    assert text[idx:idx + 200].count("default") == 1
    assert "-e L2C64H2 -b 4 -t 64 -x 50" in " ".join(text.split())  # what the CPU defaults become
    flat = " ".join(text.split())
    assert "only then) (default: 0)" in flat and "(1.0 = no decay) (default: 1.0)" in flat  # zeros shown too
    # --help is the help flag; -h is llm.c's HellaSwag letter
    hs = [a for a in build_parser()._actions if "-h" in a.option_strings]
    assert [a.option_strings for a in hs] == [["-h", "--hellaswag"]]


def test_help_from_the_command_line():
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), "--help"], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0 and "--learning-rate" in p.stdout and "-nk" in p.stdout


# -----------------------------------------------------------------------------
# runs that go wrong


def test_diverging_run_stops_without_a_nan_checkpoint(shards, tmp_path):
    from llmc import runfiles
    from llmc.checkpoint import read_model
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), *SMALL, "-i", str(shards / "train_*.bin"),
                        "-x", "20", "-n", "1", "-l", "1e30", "-o", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode == 1 and len(lines) == 1, p.stderr  # (no numpy overflow warnings either)
    line = lines[0]
    assert "diverged" in line
    step = int(line.split("step ")[1].split(":")[0])
    assert step >= 1 and ("nan" in line or "inf" in line), line
    assert all(s < step for s in runfiles.done_steps(tmp_path))
    for s in runfiles.done_steps(tmp_path):
        assert np.isfinite(read_model(runfiles.model_path(tmp_path, s))[1]).all()


def test_nan_weights_are_refused(shards, tmp_path, capsys):
    from llmc.checkpoint import write_model
    from llmc.config import config_from_name
    cfg = config_from_name("L1C32H2")
    p = np.zeros(cfg.num_parameters, np.float32)
    p[5] = np.nan
    write_model(tmp_path / "nan.bin", cfg, p)
    one_line(capsys, ["--device", "cpu", "-e", str(tmp_path / "nan.bin"), "-b", "2", "-t", "16",
                      "-i", str(shards / "train_*.bin"), "-j", ""], "nan.bin", "NaN")


@pytest.mark.parametrize("pipeline", ["0", "1"])
def test_nan_gradients_stop_the_run(shards, monkeypatch, capsys, pipeline):
    """A NaN in the gradient norm alone (the loss still finite) also stops the step it happens, also
    when the step is read after the next one is launched (LLMC_PIPELINE_STEPS=1)."""
    from llmc.model import GPT2
    monkeypatch.setenv("LLMC_PIPELINE_STEPS", pipeline)
    update = GPT2.update

    def nan_norm(self, *a, **k):  # the squared norm the update computed, as the step reads it
        update(self, *a, **k)
        self.norm2[...] = np.nan
    monkeypatch.setattr(GPT2, "update", nan_norm)
    one_line(capsys, SMALL + ["-i", str(shards / "train_*.bin"), "-x", "3"], "step 1:", "gradient norm is nan")


def test_token_out_of_range_names_shard_and_offset(shards, capsys):
    one_line(capsys, SMALL + ["-i", str(shards / "badtok.bin"), "-x", "5"], "badtok.bin", "60000",
             "token 100", "V=50257")


def test_unreadable_data_is_one_line(shards, tmp_path, capsys, monkeypatch):
    import builtins
    real_open = builtins.open

    def deny(path, *a, **k):
        if str(path).endswith("train_000.bin"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)
    monkeypatch.setattr(builtins, "open", deny)
    monkeypatch.setattr(np, "fromfile", lambda path, *a, **k: deny(path))
    one_line(capsys, SMALL + ["-i", str(shards / "train_*.bin"), "-x", "1"], "train_000.bin", "Permission denied")


def test_host_out_of_memory_is_one_line(shards, monkeypatch, capsys):
    from llmc import model

    def boom(*a, **k):
        raise MemoryError()
    monkeypatch.setattr(model.GPT2, "__init__", boom)
    one_line(capsys, SMALL + ["-i", str(shards / "train_*.bin")], "out of host memory")


# -----------------------------------------------------------------------------
# --deterministic, MFU


def test_deterministic_kernel_choice():
    from llmc.errors import LLMCError
    from llmc.train import NONDETERMINISTIC, deterministic_kernels
    got = deterministic_kernels({})
    assert got == {"encoder_backward": 9, "layernorm_backward": 5, "global_norm": 3, "attention_backward": 4}
    assert all(got[k] not in bad for k, bad in NONDETERMINISTIC.items())
    assert deterministic_kernels({"encoder_backward": 2})["encoder_backward"] == 2
    with pytest.raises(LLMCError, match="--encoder-backward-kernel 5: uses atomics"):
        deterministic_kernels({"encoder_backward": 5})
    # attention_backward 5 adds dq by fp32 reductions: bf16 --deterministic runs 4
    assert deterministic_kernels({}, "bf16")["attention_backward"] == 4
    with pytest.raises(LLMCError, match="--attention-backward-kernel 5: uses atomics"):
        deterministic_kernels({"attention_backward": 5}, "bf16")


def test_nondeterministic_table_matches_the_descriptions():
    """Every variant whose description says it is not deterministic is in the table, and no
    variant in the table calls itself deterministic."""
    from llmc import ops
    from llmc.train import NONDETERMINISTIC
    for name, spec in ops.registry().items():
        for num, v in spec.variants.items():
            d = v.description.lower()
            if "non-deterministic" in d or "not deterministic" in d:
                assert num in NONDETERMINISTIC.get(name, ()), (name, num, v.description)
            elif num in NONDETERMINISTIC.get(name, ()):
                assert "deterministic" not in d or "non" in d, (name, num, v.description)


def test_mfu_numbers():
    from llmc.config import config_from_name
    from llmc.train import flops_per_token, peak_flops
    cfg = config_from_name("d12")
    assert flops_per_token(cfg, 1024) == 6 * cfg.num_parameters + 6 * 12 * 768 * 1024
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") == pytest.approx(494.7e12)
    assert peak_flops("NVIDIA H100 PCIe", "fp32") == pytest.approx(378e12)
    assert peak_flops("Some GPU", "fp32") is None


# -----------------------------------------------------------------------------
# no GPU: the real reason, and the fallback


@pytest.mark.parametrize("driver,pycuda,nvcc,needle", [
    ({"state": "no_gpu", "detail": "libcuda.so.1 not found"}, True, (12, 4), "no NVIDIA GPU"),
    ({"state": "no_driver", "detail": "libcuda.so.1 not found"}, True, (12, 4), "install the NVIDIA driver"),
    ({"state": "driver_error", "detail": "cuInit failed with CUDA error 999"}, True, (12, 4), "nvidia-smi"),
    ({"state": "ok", "name": "Tesla V100", "arch": (7, 0)}, True, (12, 4), "sm_70; our kernels need sm_80"),
    ({"state": "ok", "name": "NVIDIA H100", "arch": (9, 0)}, False, (12, 4), "pip install pycuda"),
    ({"state": "ok", "name": "NVIDIA H100", "arch": (9, 0)}, True, None, "nvcc not found"),
    ({"state": "ok", "name": "NVIDIA H100", "arch": (9, 0)}, True, (11, 8), "CUDA 11.8; the kernels need CUDA >= 12.0"),
    ({"state": "ok", "name": "NVIDIA H100", "arch": (9, 0)}, True, (13, 0), None),
])
def test_why_no_gpu(driver, pycuda, nvcc, needle):
    from llmc.gpu_check import why_no_gpu
    why = why_no_gpu(driver=lambda: driver, pycuda=lambda: pycuda, nvcc=lambda: nvcc)
    if needle is None:
        assert why is None
    else:
        assert needle in why and "\n" not in why


def test_auto_falls_back_and_cuda_stops(monkeypatch, capsys):
    import llmc.gpu_check as gc
    from llmc.backend import make_backend
    from llmc.errors import LLMCError
    monkeypatch.setattr(gc, "why_no_gpu", lambda: "PyCUDA is not installed: pip install pycuda")
    be = make_backend("auto")
    cap = capsys.readouterr()
    assert be.name == "cpu" and cap.out == ""
    assert "PyCUDA is not installed" in cap.err and "numpy backend" in cap.err
    with pytest.raises(LLMCError, match="--device cuda: PyCUDA is not installed.*--device cpu"):
        make_backend("cuda")


def test_first_kernel_build_says_it_is_compiling(tmp_path):
    from llmc.runtime import nvcc_path
    if nvcc_path() is None:
        pytest.skip("no nvcc")
    code = "from llmc.runtime import compile_cubin; compile_cubin('gelu', 'sm_80'); compile_cubin('residual', 'sm_80')"
    env = dict(os.environ, PYTHONPATH=str(ROOT), LLMC_CACHE=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stderr.count("compiling CUDA kernels") == 1 and p.stdout == ""
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert "compiling" not in p.stderr  # cached: nothing to say


# -----------------------------------------------------------------------------
# the newcomer's path: make train (prepro, train -o out), then the README's sampling command


@pytest.mark.slow
def test_make_train_then_sample(tmp_path):
    """What `make train` runs (in a scratch directory, with fewer steps), then `python sample_gpt2.py
    -o out`: text on stdout, the no-GPU note on stderr only."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    data = tmp_path / "dev" / "data" / "tinyshakespeare"
    data.mkdir(parents=True)
    shutil.copy(ROOT / "dev" / "data" / "tinyshakespeare" / "input.txt", data / "input.txt")
    sh = lambda *cmd: subprocess.run([sys.executable, *map(str, cmd)], cwd=tmp_path, env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=600)
    p = sh(ROOT / "prepro_tinyshakespeare.py", "--data-dir", data, "--tokenizer-out", tmp_path / "dev" / "data" / "gpt2_tokenizer.bin")
    assert p.returncode == 0, p.stderr
    p = sh(ROOT / "train_gpt2.py", "-o", "out", "-x", "3", "--device", "cpu", "-s", "0")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "out" / "DONE_00000003").exists()
    p = sh(ROOT / "sample_gpt2.py", "-o", "out", "--prompt", "ROMEO:", "--max-new-tokens", "16")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ROMEO:") and "WARNING" not in p.stdout and "note" not in p.stdout
    assert "model_00000003.bin" in p.stderr
