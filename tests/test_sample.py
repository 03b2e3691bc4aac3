"""Sampling: the KV-cache decoder against full recomputation, seeded reproducibility, top-k, the CLI."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.decode import Decoder, generate
from llmc.model import GPT2
from llmc.sample import generate_full, sample_token

ROOT = Path(__file__).resolve().parent.parent
CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=2, num_heads=2, channels=32)


def model_and_params(cfg=CFG, B=1, T=None, dtype=np.float64, seed=0):
    m = GPT2(cfg, CpuBackend(dtype), B, T or cfg.max_seq_len, training=False)
    params = m.init_params(seed)
    # larger weights than GPT-2's init so that greedy decoding is not one repeated token
    params = params * 5
    m.load_params(params)
    return m, params


def test_greedy_cache_equals_full_recompute():
    full, params = model_and_params()
    prompt = [3, 14, 15, 92, 65]
    want = generate_full(full, prompt, 20, temperature=0)[len(prompt):]
    dec = Decoder(CFG, CpuBackend(np.float64), 1, params=params)
    got = generate(dec, prompt, 20, temperature=0)[0]
    assert got == want
    assert len(set(got)) > 1


def test_decoder_logits_match_full_forward():
    full, params = model_and_params()
    toks = [5, 6, 7, 8, 9, 10]
    x = np.zeros((1, CFG.max_seq_len), np.int32); x[0, :len(toks)] = toks
    full.forward(x)
    dec = Decoder(CFG, CpuBackend(np.float64), 1, params=params)
    for t, tok in enumerate(toks):
        logits = dec.step(np.array([tok]), t)
        np.testing.assert_allclose(logits[0], full.logits_row(0, t), rtol=1e-10, atol=1e-10)


def test_batch_of_samples_and_seeded_reproducibility():
    _, params = model_and_params()
    runs = []
    for _ in range(2):
        dec = Decoder(CFG, CpuBackend(np.float32), 3, params=params)
        runs.append(generate(dec, [1, 2, 3], 15, temperature=1.0, top_k=10, rng=np.random.default_rng(7)))
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3 and all(len(r) == 15 for r in runs[0])


def test_sliding_window_past_max_t(capsys):
    _, params = model_and_params()
    dec = Decoder(CFG, CpuBackend(np.float32), 1, params=params)
    out = generate(dec, [1, 2, 3], CFG.max_seq_len + 10, temperature=0)
    assert len(out[0]) == CFG.max_seq_len + 10
    assert capsys.readouterr().err.count("sliding the window") == 1


def test_top_k_never_outside_k():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = rng.standard_normal(200)
        k = int(rng.integers(1, 20))
        allowed = set(np.argsort(logits)[-k:].tolist())
        for _ in range(20):
            assert sample_token(logits, 1.5, k, rng) in allowed


@pytest.mark.parametrize("V", [7, 300, 3001, 50257])
def test_inverse_cdf_matches_float64(V):
    """The two-level inverse CDF picks the index a float64 cumsum over the whole row picks (draws
    within 1e-6 of a boundary excepted), zero weights never chosen."""
    from llmc.sample import _inverse_cdf
    rng = np.random.default_rng(V)
    w = np.exp(rng.standard_normal(V) * 3).astype(np.float32)
    w[rng.random(V) < 0.3] = 0.0
    w[-1] = 0.0
    cdf = np.cumsum(w.astype(np.float64))
    checked = 0
    for u in np.concatenate([rng.random(3000), [0.0, 1 - 1e-12]]):
        j = _inverse_cdf(w, u)
        assert w[j] > 0
        t = u * cdf[-1]
        ref = min(int(np.searchsorted(cdf, t, side="right")), V - 1)
        while w[ref] == 0:
            ref -= 1
        if np.abs(cdf - t).min() > 1e-6 * cdf[-1]:
            assert j == ref, (u, j, ref)
            checked += 1
    assert checked > 2900


@pytest.mark.parametrize("V,k", [(300, None), (300, 17), (5000, None), (5000, 50)])
def test_sampling_distribution(V, k):
    """Frequencies of 20000 draws match softmax(logits / T) over the top k within 5 sigma."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal(V) * 2
    T = 0.7
    p = np.exp((logits - logits.max()) / T)
    if k:
        p[logits < np.sort(logits)[-k]] = 0
    p /= p.sum()
    n = 20000
    counts = np.bincount([sample_token(logits, T, k, rng) for _ in range(n)], minlength=V)
    f = counts / n
    assert np.all(np.abs(f - p) <= 5 * np.sqrt(p * (1 - p) / n) + 2e-4)
    assert np.all(counts[p == 0] == 0)


def test_sample_ref_and_cpu_launcher_take_bf16_bits():
    """bf16 logits (uint16 bits) sample exactly like their widened values, and the bf16 build exists."""
    from llmc import ops
    from llmc.bf16 import from_bf16, to_bf16
    from llmc.ops.sample import sample_ref
    rng = np.random.default_rng(3)
    bits = to_bf16(rng.standard_normal((4, 104)) * 3)
    u = rng.random(4)
    for temperature, k in ((0.0, None), (1.0, 10), (0.8, None)):
        want = sample_ref(from_bf16(bits).reshape(4, 104), u, 100, temperature, k)
        assert np.array_equal(sample_ref(bits, u, 100, temperature, k), want)
        tokens = np.full(4, -1, np.int32)
        ops.get("sample").cpu(B=4, V=100, Vp=104)(tokens, bits, u, temperature, k)
        assert np.array_equal(tokens, want)
    assert ops.get("sample").variants[1].dtypes == ("fp32", "bf16")


def test_greedy_is_argmax():
    logits = np.array([0.1, 3.0, -2.0, 2.9])
    assert sample_token(logits, 0.0, None, np.random.default_rng(0)) == 1


def run_cli(args, stdin=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "sample_gpt2.py"), *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from llmc.checkpoint import write_model
    from llmc.config import config_from_name
    cfg = config_from_name("L1C32H2")
    m = GPT2(cfg, CpuBackend(), 1, 8, training=False)
    path = tmp_path_factory.mktemp("ckpt") / "model.bin"
    write_model(str(path), cfg, m.init_params(0))
    return path


def test_cli_streams_text(ckpt):
    p = run_cli(["-e", str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "8", "--device", "cpu",
                 "--top-k", "40", "--temperature", "0.8"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ROMEO:")
    assert "tokens/s" in p.stderr
    p2 = run_cli(["-e", str(ckpt), "--prompt-file", "-", "--max-new-tokens", "4", "--device", "cpu",
                  "--num-samples", "2"], stdin="To be")
    assert p2.returncode == 0, p2.stderr
    assert p2.stdout.count("--- sample") == 2


@pytest.mark.parametrize("args,needle", [
    (["-e", "missing.bin"], "missing.bin"),
    (["--top-k", "999999"], "--top-k"),
    (["--prompt", "hi " * 2000], "longer than"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
])
def test_cli_bad_input(ckpt, args, needle):
    base = ["-e", str(ckpt), "--device", "cpu"]
    p = run_cli(base + args)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_prefill_fills_the_cache_like_steps():
    """The prompt's forward pass leaves the same cache and logits as feeding it token by token."""
    _, params = model_and_params()
    toks = np.array([[5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 7]], np.int32)
    a = Decoder(CFG, CpuBackend(np.float64), 2, params=params)
    la = a.prefill(toks)
    b = Decoder(CFG, CpuBackend(np.float64), 2, params=params)
    for t in range(toks.shape[1]):
        lb = b.step(toks[:, t], t)
    np.testing.assert_allclose(la, lb, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(a.kcache, b.kcache, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(a.vcache, b.vcache, rtol=1e-12, atol=1e-12)


def test_decoder_through_devarrays_is_bit_identical():
    """The decoder's GPU-side plumbing (cache views, kv append/fill, prefill model sharing the
    weights) run through DevArrays (tests/fake_runtime.py) gives exactly the numpy backend's tokens."""
    from tests.fake_runtime import FakeCudaBackend
    _, params = model_and_params(dtype=np.float32)
    outs = []
    for be in (CpuBackend(np.float32), FakeCudaBackend()):
        dec = Decoder(CFG, be, 2, params=params)
        outs.append(generate(dec, [4, 8, 15, 16], CFG.max_seq_len + 5, temperature=0.9, top_k=20,
                             rng=np.random.default_rng(3)))
    assert outs[0] == outs[1]
    assert be.graphs == 1  # the step was handed to the backend's graph capture once, then replayed


# ----------------------------------------------------------------------------------------------
# GPU: the sampling kernel (cuda/sample.cu) against the host sampler, draw by draw


@pytest.fixture(scope="module")
def rt():
    from llmc.runtime import Runtime
    return Runtime()


def _rows(rng, R, V, Vp, k):
    """R rows of logits with ties planted at the max and at the k-th largest value."""
    z = (rng.standard_normal((R, Vp)) * 3).astype(np.float32)
    z[:, V:] = np.nan  # padding past V must never be read
    for r in range(R):
        row = z[r, :V]
        row[rng.integers(0, V, 2)] = row.max()  # two more copies of the max: greedy takes the first
        if k and k < V:
            kth = np.partition(row, -k)[-k]
            row[rng.integers(0, V, 3)] = kth    # ties at the k-th value are kept
    return z


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("V,Vp", [(50257, 50304), (97, 128), (1, 4), (97, 99)])  # 99: rows not 16-byte aligned: not staged
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 40), (1.5, 1), (0.7, 2000),
                                               (1.0, 10 ** 6)])
def test_sample_kernel_matches_host(rt, V, Vp, temperature, top_k, dtype):
    """Every draw is the host sampler's on the same values; bf16 logits are widened exactly, so the
    host samples from_bf16 of the very bits the kernel reads (same rule, same tolerance)."""
    from llmc import ops
    from llmc.bf16 import round_bf16, to_bf16
    from llmc.ops.sample import sample_ref
    from llmc.testing import poison
    rng = np.random.default_rng(V + int(10 * temperature) + (top_k or 0))
    R, draws = 8, 16
    z = np.repeat(_rows(rng, R, V, Vp, top_k), draws, axis=0)   # each row with `draws` uniforms
    dev_z = z
    if dtype == "bf16":  # ties planted at the max and the k-th value stay ties after rounding
        dev_z, z = to_bf16(z), round_bf16(z)
    u = rng.random(R * draws)
    u[:2] = [0.0, np.nextafter(1.0, 0.0)]                         # the two ends of [0, 1)
    tokens = rt.empty((R * draws,), np.int32)
    poison(tokens)
    ops.get("sample").build(rt, 1, dtype, B=R * draws, V=V, Vp=Vp)(tokens, rt.to_device(dev_z), rt.to_device(u),
                                                                   temperature, top_k)
    got = tokens.get()
    want = sample_ref(z, u, V, temperature, top_k)
    assert np.all((got >= 0) & (got < V)), "unwritten or out-of-range tokens"
    if temperature <= 0:
        assert np.array_equal(got, want)  # greedy: the first index of the max, exactly
        return
    ambiguous = 0
    for i in np.flatnonzero(got != want):  # only a draw within rounding of a boundary may differ
        row = z[i, :V].astype(np.float32)
        keep = row >= (np.partition(row, -top_k)[-top_k] if top_k and top_k < V else -np.inf)
        assert keep[got[i]], f"draw {i}: token {got[i]} is outside the top {top_k}"
        w = np.where(keep, np.exp((row - row.max()) * np.float32(1 / temperature)), 0).astype(np.float64)
        cdf = np.cumsum(w)
        assert np.abs(cdf - u[i] * cdf[-1]).min() < 1e-6 * cdf[-1], f"draw {i}: {got[i]} != {want[i]}"
        ambiguous += 1
    assert ambiguous <= 2


def test_cli_samples_the_newest_checkpoint_of_a_run_dir(ckpt, tmp_path):
    """-o DIR: the model of the newest DONE marker (a newer model without its marker is an
    unfinished save); a directory of bare model files: the newest of them."""
    import shutil
    for step in (2, 4, 6):
        shutil.copy(ckpt, tmp_path / f"model_{step:08d}.bin")
    for step in (2, 4):
        (tmp_path / f"DONE_{step:08d}").write_bytes(b"")
    from llmc.sample_cli import model_in_run_dir
    assert model_in_run_dir(str(tmp_path)).endswith("model_00000004.bin")
    for f in tmp_path.glob("DONE_*"):
        f.unlink()
    assert model_in_run_dir(str(tmp_path)).endswith("model_00000006.bin")
    p = run_cli(["-o", str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "4", "--device", "cpu"])
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("ROMEO:") and "model_00000006.bin" in p.stderr


def test_cli_stdout_is_only_the_text(ckpt):
    """--device auto on a machine without a usable GPU: the fallback warning goes to stderr."""
    p = run_cli(["-e", str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "4", "--seed", "1"])
    assert p.returncode == 0, p.stderr
    q = run_cli(["-e", str(ckpt), "--prompt", "ROMEO:", "--max-new-tokens", "4", "--seed", "1", "--device", "cpu"])
    assert p.stdout == q.stdout and p.stdout.startswith("ROMEO:")


@pytest.mark.parametrize("args,needle", [
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "-1"], "--temperature"),
    (["--max-new-tokens", "-1"], "--max-new-tokens"),
    (["--num-samples", "0"], "--num-samples"),
    (["-o", "/nonexistent/run"], "not a directory"),
])
def test_cli_bad_flags(ckpt, args, needle):
    p = run_cli((["--device", "cpu"] if "-o" in args else ["-e", str(ckpt), "--device", "cpu"]) + args)
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_cli_non_utf8_prompt(ckpt, tmp_path):
    f = tmp_path / "latin1.txt"
    f.write_bytes("café".encode("latin-1"))
    for args, stdin in ((["--prompt-file", str(f)], None), (["--prompt-file", "-"], "café".encode("latin-1"))):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        p = subprocess.run([sys.executable, str(ROOT / "sample_gpt2.py"), "-e", str(ckpt), "--device", "cpu", *args],
                           input=stdin, env=env, capture_output=True, timeout=300)
        err = p.stderr.decode()
        lines = [l for l in err.splitlines() if l.strip()]
        assert p.returncode == 1 and len(lines) == 1 and "not UTF-8" in lines[0] and "0xe9" in lines[0], err


def test_cli_ctrl_c_is_one_line(ckpt, monkeypatch, capsys):
    import llmc.decode
    from llmc.sample_cli import cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(llmc.decode, "generate", interrupted)
    assert cli(["-e", str(ckpt), "--device", "cpu", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted"
