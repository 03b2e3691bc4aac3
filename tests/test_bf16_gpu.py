"""--precision bf16 on the GPU (pytest -m gpu): the model against the fp32 numpy backend within llm.c's
bf16 thresholds, 50 steps of tiny shakespeare tracking the fp32 run, and sampling (bit-exact resume
with --deterministic in bf16 is tests/test_train_gpu.py's resume test, run in both precisions).

    python prepro_tinyshakespeare.py                        # the shards test (b) trains on
    python -m pytest -m gpu tests/test_bf16_gpu.py -q -s    # -s prints the tables and the two curves

These need every op of the training step (and of the decoder, for (d)) to have a bf16 build; an op
without one makes the model build refuse in one line, which fails the test with that line.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.backend import CpuBackend, CudaBackend
from llmc.config import config_from_name, param_layout
from llmc.model import GPT2

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "dev" / "data" / "tinyshakespeare"

# llm.c's test_gpt2.cu, bf16 build: |logit - ref| < 25 and |loss - ref| < 0.05 on its debug batch;
# per gradient tensor i, in the parameter layout's order (wte, wpe, ln1w, ln1b, qkvw, qkvb, attprojw,
# attprojb, ln2w, ln2b, fcw, fcb, fcprojw, fcprojb, lnfw, lnfb: llm.c indexes its thresholds by
# tensor number the same way), every element within threshold[i] + 0.079 |ref| (0.079: the
# relative part it calls the bf16 epsilon).
LOGIT_TOL, LOSS_TOL, GRAD_REL = 25.0, 0.05, 0.079
GRAD_TOL = [5e-1, 4e-3, 1e-1, 3.5e-2, 2e-2, 3e-2, 5e-2, 5e-2, 5e-2, 1.5e-2, 5e-4, 8e-3, 1.5e-3, 2.5e-3, 1e-1, 2e-2]


def train(*args, check=True):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), *[str(a) for a in args]], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def step_losses(stdout):
    return [float(v) for v in re.findall(r"^step\s+\d+/\d+ \| loss ([0-9.]+)", stdout, re.M)]


def val_losses(stdout):
    return [float(v) for v in re.findall(r"^val loss ([0-9.]+)", stdout, re.M)]


# ----------------------------------------------------------------------------------------------
# (a) d12 from the same init: logits, loss and every gradient tensor


def test_d12_bf16_within_llmc_thresholds():
    """d12 (GPT-2 124M's shape) from one random init at llm.c's debug batch shape (B=4, T=64): the bf16
    model's logits, loss and gradients against the fp32 numpy backend's, with llm.c's bf16
    thresholds (above). The relative norm error per tensor is printed beside them."""
    cfg = config_from_name("d12")
    B, T = 4, 64
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    cpu = GPT2(cfg, CpuBackend(np.float32), B, T)
    params = cpu.init_params(42)
    gpu = GPT2(cfg, CudaBackend(precision="bf16"), B, T)
    gpu.load_params(params)
    for m in (cpu, gpu):
        m.forward(x)
    dl = np.abs(gpu.logits() - cpu.logits()).max()
    losses = []
    for m in (cpu, gpu):
        m.zero_grad()
        losses.append(m.forward(x, y))
        m.backward()
    gc, gg = cpu.get_grads(), gpu.get_grads()
    print(f"\nd12 bf16: logits max |diff| {dl:.4f} (< {LOGIT_TOL}); loss fp32 {losses[0]:.6f} bf16 {losses[1]:.6f}")
    assert dl < LOGIT_TOL and abs(losses[1] - losses[0]) < LOSS_TOL
    bad = []
    for (name, off, size), tol in zip(param_layout(cfg), GRAD_TOL):
        ref, got = gc[off:off + size].astype(np.float64), gg[off:off + size].astype(np.float64)
        excess = np.abs(got - ref) - (tol + GRAD_REL * np.abs(ref))
        relnorm = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
        print(f"  {name:9s} max |diff| {np.abs(got - ref).max():.3e}  threshold {tol:.1e} + {GRAD_REL}|ref|  "
              f"rel norm err {relnorm:.2e}  {'ok' if excess.max() <= 0 else 'NOT OK'}")
        if excess.max() > 0:
            bad.append(name)
    assert not bad, f"gradients outside llm.c's bf16 thresholds: {bad}"


# ----------------------------------------------------------------------------------------------
# (b) 50 steps of tiny shakespeare, bf16 against fp32


@pytest.mark.skipif(not (SHAKESPEARE / "tiny_shakespeare_train.bin").exists(),
                    reason="no tiny shakespeare shards: run python prepro_tinyshakespeare.py")
def test_fifty_steps_of_tiny_shakespeare_track_fp32():
    """d12 from the same random init, B=4, T=1024, 50 steps: the bf16 run's loss stays within 0.05 of
    the (deterministic) fp32 run's at every step, and the final val losses are within 0.03. Prints
    both curves."""
    # lr 3e-4 (the trainer's default): at 6e-4 both precisions spike at step 9 (fp32 12.80, bf16 12.58 on
    # the H100, every other step within 0.032), and a spike amplifies any difference, rounding included
    common = ["--device", "cuda", "-e", "d12", "-b", "4", "-t", "1024", "-x", "50", "-l", "3e-4", "-u", "10",
              "-v", "50", "-m", "20", "-s", "0", "--seed", "1337",
              "-i", SHAKESPEARE / "tiny_shakespeare_train.bin", "-j", SHAKESPEARE / "tiny_shakespeare_val.bin"]
    # the fp32 reference with --deterministic (encoder_backward 3 instead of the atomic 5): with the
    # atomics two fp32 runs of this very command agree to 1e-4 for ~25 steps and then drift apart by
    # chaos alone (H100, 2026-11-26: final val 6.1661 in one run, 6.2139 in another; the deterministic
    # run 6.1661 every time); bf16 runs its defaults, attention_backward 5's dq sums included (their order
    # varies from run to run: rounding-level differences, which this test's bounds are about)
    f32 = train(*common, "--precision", "fp32", "--deterministic").stdout
    b16 = train(*common, "--precision", "bf16").stdout
    l32, l16 = step_losses(f32), step_losses(b16)
    v32, v16 = val_losses(f32), val_losses(b16)
    print("\nstep   fp32      bf16      diff")
    for i, (a, b) in enumerate(zip(l32, l16), start=1):
        print(f"{i:4d}  {a:.4f}  {b:.4f}  {b - a:+.4f}")
    print(f"val losses fp32 {v32}  bf16 {v16}")
    assert len(l32) == len(l16) == 50 and len(v32) == len(v16) == 2
    worst = max(abs(a - b) for a, b in zip(l32, l16))
    assert worst < 0.05, f"bf16 and fp32 losses differ by {worst:.4f} at some step"
    assert abs(v32[-1] - v16[-1]) < 0.03, (v32, v16)


# ----------------------------------------------------------------------------------------------
# (c) resume in bf16 is bit-exact with --deterministic: tests/test_train_gpu.py's resume test, which
# runs in both precisions


# ----------------------------------------------------------------------------------------------
# (d) sampling in bf16


def test_bf16_sampling_runs(tmp_path):
    """sample_gpt2.py --precision bf16 on a v5 model: text comes out, and greedy decoding with the
    KV cache gives the same tokens as the bf16 forward model run on the whole context."""
    from llmc.checkpoint import write_model
    cfg = config_from_name("L2C128H2")
    host = GPT2(cfg, CpuBackend(np.float32), 1, 4).init_params(3)
    write_model(tmp_path / "m.bin", cfg, host, dtype="bf16")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])))
    p = subprocess.run([sys.executable, str(ROOT / "sample_gpt2.py"), "-e", str(tmp_path / "m.bin"),
                        "--precision", "bf16", "--device", "cuda", "--max-new-tokens", "40", "--prompt", "ROMEO:"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip(), p.stdout + p.stderr
    from llmc.decode import Decoder, generate
    be = CudaBackend(precision="bf16")
    dec = Decoder(cfg, be, 1, params=host)
    prompt = [5, 17, 3, 44, 90]
    toks = generate(dec, prompt, 12, temperature=0.0)[0]
    full = GPT2(cfg, be, 1, len(prompt) + 12, training=False)
    full.load_params(host)
    ctx = prompt + toks
    full.forward(np.array([ctx], np.int32))
    lg = full.logits()[0]
    agree = sum(int(np.argmax(lg[len(prompt) - 1 + i]) == t) for i, t in enumerate(toks))
    # bf16 rounding differs between the decode kernels and the training forward, so a near tie may
    # flip; most tokens must agree
    assert agree >= 10, (toks, agree)


# ----------------------------------------------------------------------------------------------
# CUDA graphs of the bf16 step


def test_bf16_graphs_equal_eager():
    """Four bf16 steps of two micro-steps (stochastic rounding on, the lr changing every step): the
    CUDA-graph replays of the micro-step and the update (seeds and hyperparameters read from device
    memory) give bit-identical losses, norms and weights to launching kernel by kernel. The
    deterministic variants, so that any difference is the graphs'."""
    from llmc.runtime import Graph
    from llmc.train import deterministic_kernels
    cfg = config_from_name("L2C128H2")
    B, T, accum = 2, 64, 2
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)) for _ in range(4 * accum)]
    runs = []
    for graphs in (True, False):
        m = GPT2(cfg, CudaBackend(deterministic_kernels({}, "bf16"), precision="bf16"), B, T)
        m.init_params(1)
        m.grad_accum_steps, m.use_graphs = accum, graphs
        out = []
        for step in range(1, 5):
            m.zero_grad()
            for x, y in batches[(step - 1) * accum:step * accum]:
                m.train_micro_step(x, y)
            m.update(lr=1e-3 * step, step=step, weight_decay=0.1)
            out.append((m.step_loss(), m.grad_norm()))
        out += [m.get_params(), m.be.download(m.params)]
        assert isinstance(m._graph_update, Graph) == graphs
        runs.append(out)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
