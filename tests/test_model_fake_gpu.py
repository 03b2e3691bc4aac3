"""The model driven through DevArrays (tests/fake_runtime.py) must give bit-identical results to the
numpy backend: this runs the cuda backend's buffer plumbing (views, per-layer indexing, offsets,
argument order) in CI, where there is no GPU; and, with --precision bf16, the bf16 model (its
dtypes, master weights, rounding seeds, v5 checkpoints and exact resume) against the fp32 one."""
import re

import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.bf16 import BF16, bf16_neighbours, from_bf16, round_bf16, to_bf16
from llmc.config import GPT2Config
from llmc.model import GPT2
from llmc.runtime import DevArray
from tests.fake_runtime import BASE, FakeCudaBackend

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=2, num_heads=2, channels=32)


def test_devarray_views_and_indexing():
    a = DevArray(None, BASE, (3, 4, 5), np.float32, None)
    assert a[1].ptr == BASE + 20 * 4 and a[1].shape == (4, 5)
    assert a[-1].ptr == BASE + 40 * 4
    assert a[2][3].ptr == BASE + (40 + 15) * 4 and a[2][3].shape == (5,)
    assert a.view(7, (2, 3)).ptr == BASE + 28 and len(a) == 3
    with pytest.raises(IndexError):
        a[3]
    with pytest.raises(AssertionError):
        a.view(50, (20,))


@pytest.mark.parametrize("B,T", [(2, 16), (1, 1), (3, 7)])
def test_model_through_devarrays_is_bit_identical(B, T):
    rng = np.random.default_rng(0)
    x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    results = []
    for be in (CpuBackend(np.float32), FakeCudaBackend()):
        m = GPT2(CFG, be, B, T)
        m.init_params(3)
        out = {}
        m.forward(x)
        out["logits"] = m.logits()
        for step in range(1, 3):
            m.zero_grad()
            out[f"loss{step}"] = m.forward(x, y)
            m.backward()
            out[f"grads{step}"] = m.get_grads()
            m.update(lr=1e-3, step=step, weight_decay=0.1)
            out[f"norm{step}"] = m.grad_norm()
        out["params"] = m.get_params()
        out["row"] = m.logits_row(B - 1, T - 1)
        results.append(out)
    for key in results[0]:
        np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)


def test_graph_path_of_the_training_step_is_bit_identical():
    """train_micro_step + update, whose later calls replay what the backend's graph() returned
    (here the launch functions themselves, counted), give exactly what forward/backward/update
    give: the replay path's bookkeeping (micro-step count, loss, flags) and the device-side AdamW
    hyperparameters (lr changing every step) included, with gradient accumulation."""
    B, T, accum = 2, 8, 2
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)) for _ in range(4 * accum)]
    runs = []
    for graph_path in (False, True):
        be = FakeCudaBackend()
        m = GPT2(CFG, be, B, T)
        m.init_params(5)
        m.grad_accum_steps = accum
        m.use_graphs = graph_path  # False: every call launches kernel by kernel
        out = []
        for step in range(1, 5):
            m.zero_grad()
            for x, y in batches[(step - 1) * accum:step * accum]:
                if graph_path:
                    m.train_micro_step(x, y)
                else:
                    m.forward(x, y, read_loss=False)
                    m.backward()
            assert m.micro_steps == accum
            m.update(lr=1e-3 * step, step=step, weight_decay=0.1, max_norm=0.5)
            out.append((m.step_loss(), m.grad_norm()))
        out.append(m.get_params())
        runs.append(out)
        # captured once each: the first micro-step after zero_grad (first_write), the later ones, the update
        assert getattr(be, "graphs", 0) == (3 if graph_path else 0)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_deferred_layernorm_sums_reach_the_gradients(monkeypatch, precision):
    """The layernorm backwards' deferred column sums (layernorm_backward 5 / 7, deferred=2L): with
    gradient accumulation (each micro-step's backward flushes its own sums), the gradients match the
    ticketed launches' (LLMC_LN_DEFERRED=0) to an fp32 rounding (the fake adds each call's fp32 sums
    at the flush). Without the flush (sabotage) the layernorm weights' and the fused biases' gradients
    of one micro-step differ (the fake holds them until a flush that never comes), and the next
    backward finds its slots still taken."""
    B, T = 2, 16
    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)) for _ in range(2)]

    def grads(env, micro=2, sabotage=False):
        monkeypatch.setenv("LLMC_LN_DEFERRED", env)
        m = GPT2(CFG, FakeCudaBackend(precision=precision), B, T)
        assert m.ln_deferred == (env == "1")
        assert "bias_C" not in m.built  # (fused either way: no bias pass is built)
        if sabotage:
            m._ln_flush = lambda: None
        m.init_params(2)
        m.grad_accum_steps = micro
        m.zero_grad()
        for x, y in batches[:micro]:
            m.train_micro_step(x, y)
        g = m.be.download(m.grads)
        return from_bf16(g) if precision == "bf16" else g

    tol = 2.0 ** -7 if precision == "bf16" else 1e-5
    for micro in (1, 2):
        ref, got = grads("0", micro), grads("1", micro)
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * float(np.abs(ref).max()))
    bad = grads("1", 1, sabotage=True)
    assert not np.allclose(bad, grads("0", 1), rtol=tol, atol=tol * float(np.abs(ref).max()))
    with pytest.raises(AssertionError, match="slot 0 taken twice"):
        grads("1", 2, sabotage=True)


def test_micro_step_graph_recaptured_when_accumulation_changes():
    """The captured micro-step bakes in the loss scale 1/(B*T*accum): changing grad_accum_steps
    must capture again, not replay a stale scale."""
    be = FakeCudaBackend()
    m = GPT2(CFG, be, 1, 8)
    m.init_params(0)
    x = np.arange(8, dtype=np.int32).reshape(1, 8)
    for _ in range(2):
        m.train_micro_step(x, x)
    assert be.graphs == 1
    m.grad_accum_steps = 4
    m.train_micro_step(x, x)
    assert be.graphs == 2


@pytest.mark.parametrize("tokens,pdl", [(8, True), (7, False)])
def test_training_graphs_are_programmatic_only_for_small_steps(monkeypatch, tokens, pdl):
    """The training step's graphs ask for programmatic dependent launches when a micro-step has at
    most PDL_TRAIN_TOKENS tokens (measured faster there, slower at d12 B >= 8); data parallel's
    custom graph, which holds NCCL's launches, never does. (LLMC_PDL overrides it in Runtime.capture.)"""
    import llmc.model
    monkeypatch.setattr(llmc.model, "PDL_TRAIN_TOKENS", tokens)
    be = FakeCudaBackend()
    m = GPT2(CFG, be, 1, 8)
    m.init_params(0)
    x = np.arange(8, dtype=np.int32).reshape(1, 8)
    m.zero_grad()
    m.train_micro_step(x, x)  # the first micro-step's graph
    m.update(1e-3, 1)
    m.train_micro_step(x, x)  # and the later micro-steps'
    m.train_micro_step(x, x, custom=lambda: m._launch_micro())
    assert be.graph_pdl == [pdl, pdl, pdl, False]


# ----------------------------------------------------------------------------------------------
# --precision bf16 on the fake GPU: each op is its fp32 reference over from_bf16 copies of the bf16
# arguments, rounded back with to_bf16 (tests/fake_runtime.py), AdamW on fp32 master weights


def test_bf16_model_tracks_fp32_and_keeps_fp32_where_the_conventions_say():
    """d-tiny, 3 steps: bf16 (stochastic rounding off) against the fp32 numpy backend from the same
    init. The losses agree to 0.01: activations rounded to 8 bits (2^-9 relative each) through 2
    layers move a loss of ~4.6 by about 1e-3 here; a wrong dtype or a missed conversion moves it by
    whole units or gives NaN (the fake heap is poisoned). The norm agrees to 2%."""
    B, T = 2, 16
    rng = np.random.default_rng(0)
    x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    runs = []
    for be in (CpuBackend(np.float32), FakeCudaBackend(precision="bf16")):
        m = GPT2(CFG, be, B, T)
        init = m.init_params(3)
        m.stochastic_rounding = False
        out = []
        for step in range(1, 4):
            m.zero_grad()
            m.train_micro_step(x, y)
            m.update(lr=1e-3, step=step, weight_decay=0.1)
            out.append((m.step_loss(), m.grad_norm()))
        runs.append((m, out, init))
    (m32, ref, _), (m16, got, init) = runs
    for (l32, n32), (l16, n16) in zip(ref, got):
        assert abs(l16 - l32) < 0.01 and abs(n16 - n32) < 0.02 * n32, (ref, got)
    # the dtypes: params, grads, most activations bf16; statistics, losses, AdamW state fp32
    for buf in (m16.params, m16.grads, m16.a["ln1"], m16.a["logits"], m16.a["fch"]):
        assert buf.dtype == BF16
    for buf in (m16.master, m16.m, m16.v, m16.norm2, m16.hp, m16.a["ln1_mean"], m16.a["lnf_rstd"],
                m16.a["att"], m16.a["losses"], m16.a["loss_acc"]):
        assert buf.dtype == np.float32
    assert m16.seeds.dtype == np.uint32 and set(m16.be.download(m16.seeds).tolist()) == {0}
    # the update ran on the fp32 master (it moved by less than a bf16 ulp somewhere) and, rounding
    # to nearest even, wrote params = bf16(master)
    master = m16.get_params()
    assert np.array_equal(m16.be.download(m16.params), to_bf16(master))
    assert not np.array_equal(master, round_bf16(master))
    assert np.abs(master - m32.get_params()).max() < 0.01 and np.abs(master - init).max() > 1e-4
    # every bf16 build the fake ran was asked for bf16; the loss accumulator for fp32
    built = {k: b.dtype for k, b in m16.built.items()}
    assert built.pop("loss_acc") == "fp32" and set(built.values()) == {"bf16"}
    # bytes by dtype: about half of fp32's activations
    assert m16.activation_bytes() < 0.6 * m32.activation_bytes()


def test_bf16_stochastic_rounding_seeds_come_from_the_run_rng():
    """With stochastic rounding each AdamW launch gets its own nonzero seed per step, drawn from the
    rounding RNG (llm.c's xorshift), so a model given the same sr_state draws the same seeds."""
    m = GPT2(CFG, FakeCudaBackend(precision="bf16"), 1, 8)
    m.init_params(0)
    x = np.arange(8, dtype=np.int32).reshape(1, 8)
    state0 = m.sr_state
    m.train_micro_step(x, x)
    m.update(lr=1e-3, step=1)
    seeds = m.be.download(m.seeds).tolist()
    assert len(set(seeds)) == len(seeds) == len(m.adamw_plan) and 0 not in seeds
    assert m.sr_state != state0
    from llmc.model import next_seed
    s, again = state0, []
    for _ in seeds:
        s, seed = next_seed(s)
        again.append(seed)
    assert again == seeds and s == m.sr_state
    # params are one of the two bf16 neighbours of the master, and not all the nearest
    master = m.get_params()
    p = from_bf16(m.be.download(m.params))
    lo, hi = bf16_neighbours(master)
    assert np.all((p == lo) | (p == hi))
    assert not np.array_equal(p, round_bf16(master))


def test_bf16_loads_fp32_weights_and_fp32_loads_bf16_weights(tmp_path):
    """A v3 (fp32) file into a bf16 model: master = the file's values exactly, params rounded; a v5
    (bf16) file into an fp32 model: the bf16 values upcast exactly."""
    from llmc.checkpoint import read_model, write_model
    host = GPT2(CFG, CpuBackend(np.float32), 1, 4).init_params(11)
    write_model(tmp_path / "m3.bin", CFG, host, dtype="fp32")
    write_model(tmp_path / "m5.bin", CFG, host, dtype="bf16")
    _, p3 = read_model(tmp_path / "m3.bin")
    m16 = GPT2(CFG, FakeCudaBackend(precision="bf16"), 1, 4)
    m16.load_params(p3)
    assert np.array_equal(m16.get_params(), host)
    assert np.array_equal(m16.be.download(m16.params), to_bf16(host))
    _, p5 = read_model(tmp_path / "m5.bin")
    m32 = GPT2(CFG, CpuBackend(np.float32), 1, 4)
    m32.load_params(p5)
    assert np.array_equal(m32.get_params(), round_bf16(host))


def _train(argv, monkeypatch, capsys):
    """train_gpt2.py's main in this process on the fake GPU (the precision the flags ask for)."""
    import llmc.backend
    from llmc import train
    made = []

    def fake_backend(device, kernels=None, dtype=np.float32, gpu=0, precision="fp32"):
        made.append(FakeCudaBackend(kernels, nbytes=1 << 27, quiet=True, precision=precision))
        return made[-1]
    monkeypatch.setattr(llmc.backend, "make_backend", fake_backend)
    assert train.main(argv) == 0
    captured = capsys.readouterr()
    _train.stderr = captured.err
    return [float(v) for v in re.findall(r"^step\s+\d+/\d+ \| loss ([0-9.]+)", captured.out, re.M)], made[-1]


def test_bf16_trainer_writes_v5_and_resumes_exactly(tmp_path, monkeypatch, capsys):
    """train_gpt2.py --precision bf16 (stochastic rounding on) on the fake GPU: the model file is
    llm.c's version 5, the state holds the fp32 master weights (header[4] = 1) and the rounding RNG;
    a run stopped at step 2 and resumed writes step 4's files byte for byte as the uninterrupted
    run does; and its losses track an fp32 run's."""
    from llmc.checkpoint import HEADER_INTS, read_model, read_state
    from llmc.data import write_shard
    rng = np.random.default_rng(0)
    base = rng.integers(0, 97, 64)
    write_shard(str(tmp_path / "train_000.bin"), np.tile(base, 40).astype(np.uint16))
    write_shard(str(tmp_path / "val_000.bin"), np.tile(base, 4).astype(np.uint16))
    # the model: d-tiny's shape, written as an fp32 (v3) file that the bf16 run starts from
    host = GPT2(CFG, CpuBackend(np.float32), 1, 4).init_params(5)
    from llmc.checkpoint import write_model
    write_model(tmp_path / "init.bin", CFG, host)
    common = ["-e", str(tmp_path / "init.bin"), "-i", str(tmp_path / "train_*.bin"),
              "-j", str(tmp_path / "val_*.bin"), "-b", "2", "-t", "16", "-s", "0", "-v", "0",
              "-l", "1e-3", "-x", "4", "-n", "2", "--precision", "bf16"]
    full, be = _train(common + ["-o", str(tmp_path / "full")], monkeypatch, capsys)
    assert be.precision == "bf16" and len(full) == 4
    mfile, sfile = tmp_path / "full" / "model_00000004.bin", tmp_path / "full" / "state_00000004_00000.bin"
    h = np.fromfile(mfile, np.int32, HEADER_INTS)
    assert h[1] == 5 and mfile.stat().st_size == 4 * HEADER_INTS + 2 * CFG.num_parameters
    cfg, weights = read_model(mfile)
    st = read_state(sfile, CFG.num_parameters)
    assert np.fromfile(sfile, np.int32, HEADER_INTS)[4] == 1 and st["master"] is not None
    # the file's weights are the bf16 roundings (stochastic) of the masters
    lo, hi = bf16_neighbours(st["master"])
    assert np.all((weights == lo) | (weights == hi)) and not np.array_equal(weights, st["master"])
    assert st["sr_rng"] != 13371337  # the rounding RNG moved and was saved
    # stopped after step 2, resumed: step 4's files are the uninterrupted run's, byte for byte
    part = tmp_path / "part"
    _train(common + ["-o", str(part)], monkeypatch, capsys)
    for f in part.glob("*_00000004*"):
        f.unlink()
    resumed, _ = _train(common + ["-o", str(part), "-y", "1"], monkeypatch, capsys)
    assert resumed == full[2:]
    for name in ("model_00000004.bin", "state_00000004_00000.bin"):
        a = np.fromfile(tmp_path / "full" / name, np.uint8)
        b = np.fromfile(part / name, np.uint8)
        assert np.array_equal(a, b), name
    # the same run in fp32 (the fake GPU at fp32): losses within bf16's noise
    fp32, _ = _train([a for a in common if a not in ("--precision", "bf16")] + ["-o", str(tmp_path / "f32")],
                     monkeypatch, capsys)
    assert np.abs(np.array(full) - np.array(fp32)).max() < 0.02, (full, fp32)
    # and the fp32 run resumes from the bf16 run's checkpoint: its master weights, exactly
    import shutil
    shutil.copytree(tmp_path / "full", tmp_path / "cross")
    for f in (tmp_path / "cross").glob("*_00000004*"):
        f.unlink()
    _train([a for a in common if a not in ("--precision", "bf16")] + ["-o", str(tmp_path / "cross"), "-y", "1"],
           monkeypatch, capsys)
    assert (tmp_path / "cross" / "DONE_00000004").exists()
    assert "--precision is fp32 now, bf16 in the run that wrote" in _train.stderr, _train.stderr
    assert np.fromfile(tmp_path / "cross" / "model_00000004.bin", np.int32, HEADER_INTS)[1] == 3


def test_bf16_without_the_cuda_backend_is_one_line():
    """--precision bf16 on the numpy backend (or with no GPU) says in one line that it needs the
    CUDA backend, and exits 1."""
    import subprocess
    import sys
    from pathlib import Path
    from llmc.gpu_check import why_no_gpu
    root = Path(__file__).resolve().parent.parent
    cases = [["--device", "cpu"]] + ([["--device", "auto"]] if why_no_gpu() is not None else [])
    for dev in cases:
        p = subprocess.run([sys.executable, str(root / "train_gpt2.py"), "--precision", "bf16", *dev],
                           cwd=root, capture_output=True, text=True, timeout=300,
                           env={**__import__("os").environ, "PYTHONPATH": str(root)})
        lines = [l for l in p.stderr.splitlines() if l.strip()]
        assert p.returncode == 1 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert "--precision bf16 needs the CUDA backend" in lines[0], lines[0]


def test_bf16_decoder_matches_fp32():
    """The KV-cache decoder in bf16 on the fake GPU (bf16 weights, cache and logits; prefill through
    the bf16 forward model, then decode steps) gives the fp32 numpy decoder's logits within bf16's
    error: |d logits| < 0.05 + 2% of the logits' spread, where a wrong cache layout or a missed
    conversion is off by the whole spread."""
    from llmc.decode import Decoder
    host = GPT2(CFG, CpuBackend(np.float32), 1, 4).init_params(2)
    prompt = np.array([[5, 17, 3, 44, 90, 1]], np.int32)
    outs = []
    for be in (CpuBackend(np.float32), FakeCudaBackend(precision="bf16")):
        dec = Decoder(CFG, be, 1, params=host)
        rows = [dec.prefill(prompt)[0].copy()]
        for pos, tok in enumerate([7, 8, 9], start=prompt.shape[1]):
            rows.append(np.array(dec.step(np.array([tok]), pos)[0], copy=True))
        outs.append(np.stack(rows))
        if be.name != "cpu":
            assert dec.kcache.dtype == BF16 and dec.a["logits"].dtype == BF16 and dec.a["mean"].dtype == np.float32
    ref, got = outs
    spread = float(ref.max() - ref.min())
    assert np.isfinite(got).all() and np.abs(got - ref).max() < 0.05 + 0.02 * spread, np.abs(got - ref).max()


@pytest.mark.parametrize("make", [lambda: CpuBackend(np.float32), lambda: FakeCudaBackend()], ids=["cpu", "fake-gpu"])
def test_recompute_levels_train_identically_in_less_memory(make):
    """-r 0 (keep GELU outputs), 1 (recompute GELU) and 2 (also ln1/ln2): the same losses, norms and
    weights bit for bit in fp32 (the recomputation is the forward's own arithmetic), in less
    activation memory at each level: exactly L-1 layers' GELU outputs, then 2(L-1) layers' ln."""
    B, T = 2, 16
    C, L = CFG.channels, CFG.num_layers
    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)) for _ in range(3)]
    runs, sizes = [], []
    for r in (0, 1, 2):
        m = GPT2(CFG, make(), B, T, recompute=r)
        m.init_params(9)
        out = []
        for step, (x, y) in enumerate(batches, start=1):
            m.zero_grad()
            m.train_micro_step(x, y)
            m.update(lr=1e-3, step=step, weight_decay=0.1)
            out.append((m.step_loss(), m.grad_norm()))
        out.append(m.get_params())
        runs.append(out)
        sizes.append(m.activation_bytes())
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    assert sizes[0] - sizes[1] == (L - 1) * B * T * 4 * C * 4
    assert sizes[1] - sizes[2] == 2 * (L - 1) * B * T * C * 4 - 2 * 64 * 4  # (+ the recomputed stats, 64-aligned)


def test_recompute_in_bf16_tracks_r1():
    """-r 2 in bf16 recomputes ln from the bf16-stored residual (the forward normalised the fp32 sum
    before storing it), so it is not bit-identical to -r 1: within bf16 noise."""
    B, T = 2, 16
    x = np.arange(B * T, dtype=np.int32).reshape(B, T) % CFG.vocab_size
    losses = []
    for r in (1, 2):
        m = GPT2(CFG, FakeCudaBackend(precision="bf16"), B, T, recompute=r)
        m.init_params(9)
        m.stochastic_rounding = False
        out = []
        for step in range(1, 4):
            m.zero_grad()
            m.train_micro_step(x, x)
            m.update(lr=1e-3, step=step)
            out.append(m.step_loss())
        losses.append(out)
    assert np.abs(np.array(losses[0]) - np.array(losses[1])).max() < 0.01, losses


def test_deterministic_choice_follows_the_precision(monkeypatch):
    """--deterministic --precision bf16 takes the bf16 default when it is deterministic and has bf16
    kernels, else the op's DETERMINISTIC_CHOICE, else the highest-numbered deterministic variant that
    has bf16 kernels; with none, one line naming the op."""
    from llmc import ops
    from llmc.errors import LLMCError
    from llmc.train import DETERMINISTIC_CHOICE, NONDETERMINISTIC, deterministic_kernels
    for name in NONDETERMINISTIC:  # a bf16 build on every deterministic variant but the highest
        spec = ops.get(name)
        ok = sorted(set(spec.variants) - NONDETERMINISTIC[name])
        for n in ok:
            v = spec.variants[n]
            lacks = n == ok[-1] and len(ok) > 1
            monkeypatch.setattr(v, "builds", {"fp32": v.builds["fp32"]} if lacks else
                                {**v.builds, "bf16": v.builds["fp32"]})
    got = deterministic_kernels({}, "bf16")
    for name, bad in NONDETERMINISTIC.items():
        spec = ops.get(name)
        ok = sorted(set(spec.variants) - bad)
        have = [n for n in ok if "bf16" in spec.variants[n].dtypes]
        want = next(n for n in (spec.default_for("bf16"), DETERMINISTIC_CHOICE.get(name), max(have)) if n in have)
        assert got[name] == want, (name, got)
    v = ops.get("global_norm").variants
    for n in v:
        monkeypatch.setattr(v[n], "builds", {"fp32": v[n].builds["fp32"]})
    with pytest.raises(LLMCError, match="global_norm has no deterministic variant with bf16 kernels"):
        deterministic_kernels({}, "bf16")


def test_an_op_without_bf16_kernels_refuses_the_bf16_build_in_one_line(monkeypatch):
    """The real CudaBackend (over the fake runtime): building an op none of whose variants has bf16
    kernels says so in one line, naming the op and --precision fp32; the fp32 build of the same op
    (what the bf16 model asks for its loss sum) is unaffected."""
    from llmc import ops
    from llmc.backend import CudaBackend
    from llmc.errors import LLMCError
    from tests.fake_runtime import FakeRuntime
    v = ops.get("residual_forward").variants
    for n in v:
        monkeypatch.setattr(v[n], "builds", {"fp32": v[n].builds["fp32"]})
    be = CudaBackend(rt=FakeRuntime(check_ptx=False), precision="bf16", quiet=True)
    assert be.dtype == BF16 and be.acc_dtype == np.float32
    with pytest.raises(LLMCError, match=r"^--precision bf16: residual_forward has no bf16 kernels yet .*"
                                        r"use --precision fp32$"):
        be.build("residual_forward", N=64)
    assert be.build("residual_forward", N=64, precision="fp32").dtype == "fp32"
    with pytest.raises(LLMCError, match="--precision fp16: expected one of fp32, bf16"):
        CudaBackend(rt=FakeRuntime(check_ptx=False), precision="fp16")


def test_qkv_in_place_when_both_attention_directions_take_it(monkeypatch):
    """Training with attention 4 and 4 (the defaults on Hopper, fp32 and bf16; the numpy backend
    implements every form): the qkv matmul writes each layer's output straight into qkvr[l], and both
    attention directions read q, k, v there (no permuted copy). LLMC_QKV_IN_PLACE=0, a pairing without
    the form (4 + backward 3, 2 + 3) and inference models keep the copy. Either way the same bits. In place, the one-layer qkv
    scratch (B,T,3C) is not allocated, nor counted by the memory check."""
    cfg = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=2, num_heads=2, channels=128)
    B, T, C = 2, 16, cfg.channels
    rng = np.random.default_rng(7)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)

    def run(be, env):
        monkeypatch.setenv("LLMC_QKV_IN_PLACE", env)
        monkeypatch.setenv("LLMC_SHARE_SCRATCH", "0")  # (shared, the qkv scratch takes room in the logits' buffer)
        checked = []  # the bytes the memory check asked for
        monkeypatch.setattr(be, "require_free", lambda nbytes, what="model": checked.append(nbytes))
        m = GPT2(cfg, be, B, T)
        m.init_params(3)
        out = []
        for step in (1, 2):
            m.zero_grad()
            out.append(m.forward(x, y))
            m.backward()
            out.append(m.get_grads())
            m.update(lr=1e-3, step=step)
        return m.qkv_in_place, "qkv" in m.a, m.activation_bytes(), checked, out + [m.get_params()]

    for make in (lambda: CpuBackend(np.float32), lambda: FakeCudaBackend(precision="bf16"), lambda: FakeCudaBackend()):
        on, off = run(make(), "1"), run(make(), "0")
        assert on[0] and not off[0]
        assert not on[1] and off[1]
        qkv_bytes = B * T * 3 * C * np.dtype(make().dtype).itemsize  # (a multiple of 64 elements: no padding)
        assert off[2] - on[2] == qkv_bytes
        assert len(on[3]) == len(off[3]) == 1 and off[3][0] - on[3][0] == qkv_bytes
        for a, b in zip(on[4], off[4]):
            np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("LLMC_QKV_IN_PLACE", "1")
    for m in (GPT2(cfg, FakeCudaBackend(kernels={"attention_backward": 3}, precision="bf16"), B, T),
              GPT2(cfg, FakeCudaBackend(kernels={"attention_forward": 2}), B, T),  # fp32: 2 and 2
              GPT2(cfg, CpuBackend(np.float32), B, T, training=False)):
        assert not m.qkv_in_place and "qkv" in m.a


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_encoder_backward_8_gets_each_batch_records(precision):
    """--encoder-backward-kernel 8 (9, 10) reads records the host computes from each batch's ids: the model's
    set_batch uploads them beside the batch (the fake launch checks the buffer holds the current
    batch's records), through the graph path with accumulation too; the same results as variant 7.
    Without the upload the launch fails."""
    B, T, accum = 2, 8, 2
    rng = np.random.default_rng(4)
    batches = [(rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)) for _ in range(2 * accum)]
    runs = {}
    for number in (7, 8, 9, 10):
        be = FakeCudaBackend({"encoder_backward": number}, precision=precision)
        m = GPT2(CFG, be, B, T)
        assert m.built["encoder_backward"].number == number
        assert bool(m._host_inputs) == (number in (8, 9, 10))
        m.init_params(5)
        m.grad_accum_steps = accum
        for step in (1, 2):
            m.zero_grad()
            for x, y in batches[(step - 1) * accum:step * accum]:
                m.train_micro_step(x, y)
            m.update(lr=1e-3, step=step, weight_decay=0.1)
        runs[number] = m.get_params()
    np.testing.assert_array_equal(runs[7], runs[8])
    np.testing.assert_array_equal(runs[7], runs[9])
    np.testing.assert_array_equal(runs[7], runs[10])
    m = GPT2(CFG, FakeCudaBackend({"encoder_backward": 9}, precision=precision), B, T)
    m.init_params(5)
    m.forward(*batches[0])
    m.backward()
    m._host_inputs = []  # the next batch's records never uploaded: the buffer holds the first batch's
    m.forward(*batches[1])
    with pytest.raises(AssertionError, match="records are not this batch's"):
        m.backward()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("side,recompute", [(True, 0), (True, 1), (True, 2), (False, 1)])
def test_every_backward_build_is_launched(precision, side, recompute):
    """The model builds (and allocates scratch for) only what its steps launch: each layer GEMM's
    two-GEMM matmul_backward form only where no one-GEMM, dgelu or recompute form takes its place (fp32
    B=16 at d12: 0.24 GiB of transposes and split-K partials, session 38). Two builds stay unlaunched by
    design: layernorm_backward's non-deferred colsum form (data parallel's per-layer hooks launch it) and
    gelu_backward's plain form (the op's record for the profile and tests; it allocates nothing)."""
    m = GPT2(CFG, FakeCudaBackend(quiet=True, precision=precision), 2, 16, recompute=recompute, side_stream=side)
    m.init_params(1)
    used = set()

    def record(d):
        for key, fn in list(d.items()):
            d[key] = (lambda key, fn: lambda *a: (used.add(key), fn(*a))[1])(key, fn)
    record(m.k)
    record(m.k_first)
    x = np.zeros((2, 16), np.int32)
    for step in (1, 2):
        m.zero_grad()
        for _ in range(2):
            m.train_micro_step(x, x)
        m.update(lr=1e-3, step=step)
    m.forward(x)
    assert set(m.built) - used == {"gelu_backward", "layernorm_backward_colsum"}
    assert set(m.built_first) <= used
    assert all(f"mmb_{n}" in m.built for n in ("fc", "attproj", "qkv")) == (not side)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_folded_classifier_plumbing(precision):
    """The classifier folded into the lm head (fold_build; emulated in numpy by tests/fake_runtime.py's
    FakeFold): training steps through the graph path with gradient accumulation give the losses, gradients
    and weights of the same model without the fold, within fp32 rounding (bf16: bf16's); the training
    forward launches the fold (no classifier pass), the backward its row scale, and a forward without
    targets or an evaluation forward the plain lm head and classifier. So the model feeds the fold the
    right buffers in the right order: X (not lnf) to dwte, the scale after dinp and before lnf's backward."""
    B, T, accum = 2, 8, 2
    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)) for _ in range(3 * accum)]
    runs = []
    for fold in (False, True):
        be = FakeCudaBackend(precision=precision)
        be.emulate_fold = fold
        m = GPT2(CFG, be, B, T, fold=fold)
        assert (m.fold is not None) == fold
        m.init_params(5)
        m.grad_accum_steps = accum
        out = []
        for step in range(1, 4):
            m.zero_grad()
            for x, y in batches[(step - 1) * accum:step * accum]:
                m.train_micro_step(x, y)
            out.append(np.array([m.step_loss()]))
            out.append(m.get_grads())
            m.update(lr=1e-3, step=step, weight_decay=0.1)
        out.append(m.get_params())
        names = list(be.launches)
        if fold:
            assert "classifier" not in names, "a training step ran the classifier"
            assert names.count("classifier fold gemm") == 3 * accum and names.count("classifier fold scale") == 3 * accum
            # k primed once, from the first batch, before the first folded forward (never again, graphs or not)
            assert names.count("classifier fold prime") == 1, names.count("classifier fold prime")
            assert names.index("classifier fold prime") < names.index("classifier fold gemm")
            assert names[names.index("classifier fold prime") + 1] == "classifier fold fix"
            i = names.index("classifier fold scale")
            assert names[i - 1] == "matmul_backward" and names[i + 1] == "layernorm_backward", names[i - 2:i + 2]
            be.launches.clear()
            m.forward(batches[0][0], batches[0][1], grad=False)  # evaluation: the logits and the classifier
            assert "classifier" in be.launches and "classifier fold gemm" not in be.launches
            assert isinstance(m.fold.state()["k"], int)
            # a model whose k came from a state file (the trainer's resume) does not prime
            m2 = GPT2(CFG, be, B, T, fold=True)
            m2.init_params(5)
            m2.fold.load_state(m.fold.state())
            be.launches.clear()
            m2.train_micro_step(*batches[0])
            assert "classifier fold gemm" in be.launches and "classifier fold prime" not in be.launches
        runs.append(out)
    # the early memory check counts the fold's buffers where the model will build it (and only there)
    checked = {}
    for fold in (False, True):
        be = FakeCudaBackend(precision=precision)
        be.emulate_fold = True
        asked = []
        be.require_free = lambda nbytes, what="model", asked=asked: asked.append(nbytes)
        GPT2(CFG, be, B, T, fold=fold)
        checked[fold] = asked[0]
    assert checked[True] - checked[False] == be.fold_bytes(B * T, CFG.vocab_size, CFG.padded_vocab_size,
                                                           CFG.channels) > 0
    for i, (a, b) in enumerate(zip(*runs)):
        if precision == "fp32":
            np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-6, err_msg=f"item {i} (fold against no fold)")
        else:  # bf16 gradients round at other points: within 5% of each tensor's largest value (seen: 0.5-2%)
            err = np.abs(b - a).max() / np.abs(a).max()
            assert err < 5e-2, f"item {i}: fold against no fold in bf16, {err:.2e} of the largest value"
