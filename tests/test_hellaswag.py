"""HellaSwag from llm.c's eval file: the reader against files written here from the format, the
scoring rule on hand-made losses (ties included), a tiny model against an independent PyTorch
computation, and the trainer's -h 1 / -x 0 end to end on the numpy backend.

    python -m pytest tests/test_hellaswag.py -q
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.errors import LLMCError
from llmc.hellaswag import HellaSwag, pack_batch, read_eval_file, score_batch, token_losses
from llmc_fixtures import header_bytes, write_llmc_evalfile, write_llmc_shard

ROOT = Path(__file__).resolve().parent.parent


def random_examples(rng, n, vocab=1000, max_ctx=6, max_end=5):
    out = []
    for _ in range(n):
        ctx = rng.integers(0, vocab, rng.integers(1, max_ctx + 1)).tolist()
        ends = [rng.integers(0, vocab, rng.integers(1, max_end + 1)).tolist() for _ in range(4)]
        out.append((int(rng.integers(0, 4)), ctx, ends))
    return out


# ----------------------------------------------------------------------------------------------
# the file

def test_reads_what_the_format_says(tmp_path, rng):
    ex = random_examples(rng, 7)
    write_llmc_evalfile(tmp_path / "h.bin", ex)
    got = read_eval_file(tmp_path / "h.bin")
    assert len(got) == 7
    for i, (g, (label, ctx, ends)) in enumerate(zip(got, ex)):
        assert g.index == i and g.label == label and g.context.tolist() == ctx
        assert [e.tolist() for e in g.endings] == ends


def bad_file(tmp_path, mutate):
    """The stream of a valid 2-example file, changed by mutate(list of uint16) -> written raw."""
    ex = [(1, [5, 6], [[1], [2, 3], [4], [7]]), (0, [9], [[1], [2], [3], [4, 4]])]
    write_llmc_evalfile(tmp_path / "ok.bin", ex)
    raw = np.fromfile(tmp_path / "ok.bin", dtype="<u2", offset=1024).tolist()
    hdr = np.fromfile(tmp_path / "ok.bin", dtype="<i4", count=256)
    raw, hdr = mutate(raw, hdr)
    path = tmp_path / "bad.bin"
    with open(path, "wb") as f:
        f.write(np.asarray(hdr, dtype="<i4").tobytes())
        f.write(np.asarray(raw, dtype="<u2").tobytes())
    return path


def set_at(i, v):
    def mutate(raw, hdr):
        raw = list(raw); raw[i] = v
        return raw, hdr
    return mutate


@pytest.mark.parametrize("mutate, needle", [
    (set_at(0, 7), "delimiter"),
    (set_at(2, 3), "index 3"),
    (set_at(3, 4), "label 4"),
    (set_at(4, 3), "3 endings"),
    (set_at(5, 0), "context has 0 tokens"),
    (lambda r, h: (r[:-3], h), "past the end of the file (truncated?)"),
    (lambda r, h: (r + [65535], h), "after the last"),
    (lambda r, h: (r, [20240520, *h[1:]]), "bad magic"),
    (lambda r, h: (r, [h[0], 2, *h[2:]]), "version 2"),
    (lambda r, h: (r, [h[0], h[1], 3, *h[3:]]), "file ends early"),
])
def test_bad_files_are_one_line(tmp_path, mutate, needle):
    path = bad_file(tmp_path, mutate)
    with pytest.raises(LLMCError) as e:
        read_eval_file(path)
    msg = str(e.value)
    assert needle in msg and str(path) in msg and "\n" not in msg, msg


def test_header_only_and_missing(tmp_path):
    (tmp_path / "empty.bin").write_bytes(header_bytes(20240522, 1, 0, 0))
    with pytest.raises(LLMCError, match="0 examples"):
        read_eval_file(tmp_path / "empty.bin")
    with pytest.raises(LLMCError, match="not found"):
        read_eval_file(tmp_path / "nope.bin")


# ----------------------------------------------------------------------------------------------
# packing and the rule

def test_pack_batch_rows_and_mask():
    from llmc.hellaswag import Example
    ex = Example(0, 2, np.array([10, 11, 12], np.int32),
                 [np.array(e, np.int32) for e in ([20], [21, 22], [23, 24, 25], [26])])
    x, y, mask, labels = pack_batch([ex], B=8, T=8)
    assert labels == [2]
    assert x[2].tolist() == [10, 11, 12, 23, 24, 25, 0, 0]
    # the last context token predicts the first ending token, and so on
    assert y[2].tolist() == [0, 0, 23, 24, 25, 0, 0, 0]
    assert mask[2].tolist() == [False, False, True, True, True, False, False, False]
    assert mask[1].sum() == 2 and mask[0].sum() == 1
    assert not x[4:].any() and not mask[4:].any()   # the empty example slot


def test_rule_by_hand():
    B, T = 8, 4
    mask = np.zeros((B, T), bool)
    losses = np.full((B, T), 99.0, np.float32)      # unmasked positions must not count
    # example 0: ending means 2.0, 1.5, 1.5, 3.0 -> ending 1 (the first of the tie); label 1: right
    for row, vals in enumerate([[1.0, 3.0], [1.5], [1.0, 2.0], [3.0, 3.0, 3.0]]):
        losses[row, :len(vals)] = vals
        mask[row, :len(vals)] = True
    # example 1: all four equal -> ending 0 wins; label 2: wrong
    for row in range(4, 8):
        losses[row, 1:3] = 0.25
        mask[row, 1:3] = True
    assert score_batch(losses, mask, [1, 2]) == 1
    assert score_batch(losses, mask, [1, 0]) == 2
    assert score_batch(losses, mask, [2, 0]) == 1   # tie broken towards the first, not the label
    assert score_batch(losses, mask, [0, 1]) == 0


def test_rule_sums_in_order_in_fp32():
    # 1e8 + 1 + 1 ... in fp32 one by one stays 1e8 (each 1 is lost), pairwise it would not:
    # llm.c's sequential fp32 sum makes ending 0's mean exactly that of ending 1
    mask = np.zeros((4, 5), bool); mask[:2, :] = True; mask[2:, 0] = True
    losses = np.zeros((4, 5), np.float32)
    losses[0] = [1e8, 1, 1, 1, 1]
    losses[1] = [1e8, 0, 0, 0, 0]
    losses[2:, 0] = 3e7
    assert score_batch(losses, mask, [0]) == 1       # a tie with ending 1: the first (0) wins
    assert score_batch(losses, mask, [1]) == 0


# ----------------------------------------------------------------------------------------------
# a tiny model against an independent computation (PyTorch, float64, one row per ending, unpadded)

@pytest.fixture(scope="module")
def tiny():
    from llmc.backend import make_backend
    from llmc.config import config_from_name
    from llmc.model import GPT2
    cfg = config_from_name("L2C32H2")
    model = GPT2(cfg, make_backend("cpu"), 8, 16)
    params = model.init_params(7) * np.float32(8)   # large weights: endings far apart in loss
    model.load_params(params)
    return cfg, model, params


def torch_scores(cfg, params, ex):
    import torch
    import torch.nn.functional as F
    from torch_gpt2 import TorchGPT2
    ref = TorchGPT2(params.astype(np.float64), cfg.max_seq_len, cfg.vocab_size, cfg.padded_vocab_size,
                    cfg.num_layers, cfg.num_heads, cfg.channels)
    label, ctx, ends = ex
    scores = []
    with torch.no_grad():
        for end in ends:
            row = np.array([ctx + end])
            logits, _ = ref.forward(row)
            ce = F.cross_entropy(logits[0, :-1], torch.tensor(row[0, 1:]), reduction="none")
            scores.append(float(ce[len(ctx) - 1:].mean()))
    return scores


def test_tiny_model_against_torch(tiny, tmp_path):
    cfg, model, params = tiny
    rng = np.random.default_rng(3)
    ex = random_examples(rng, 5, max_ctx=8, max_end=7)
    ex.append((0, [17, 4], [[33, 8]] * 4))      # four identical endings: a tie, ending 0 wins
    winners = []
    for e in ex:
        s = torch_scores(cfg, params, e)
        w = int(np.argmin(s))
        gaps = sorted(abs(a - s[w]) for a in s)[1]
        assert gaps > 1e-3 or e[2][0] == e[2][1], f"near tie in the test data ({s}): pick other seeds"
        winners.append(w)
    # labels by hand: right for the even examples, wrong for the odd ones -> 3 of 6 right
    labelled = [(w if i % 2 == 0 else (w + 1) % 4, c, ends) for i, (w, (_, c, ends)) in enumerate(zip(winners, ex))]
    write_llmc_evalfile(tmp_path / "h.bin", labelled)
    hs = HellaSwag(tmp_path / "h.bin", B=8, T=16, vocab_size=cfg.vocab_size)
    assert hs.num_batches == 3                    # 2 examples per batch, the last batch half empty
    assert hs.evaluate(model, progress=False) == (3, 6)
    # our per-ending means match torch's
    x, y, mask, _ = pack_batch(hs.examples[:2], 8, 16)
    losses = token_losses(model, x, y)
    for e in range(2):
        ours = [losses[4 * e + c][mask[4 * e + c]].mean() for c in range(4)]
        np.testing.assert_allclose(ours, torch_scores(cfg, params, ex[e]), rtol=1e-4)


def test_b_must_be_a_multiple_of_4(tmp_path):
    write_llmc_evalfile(tmp_path / "h.bin", [(0, [1], [[2], [3], [4], [5]])])
    with pytest.raises(LLMCError, match="B=6 is not a multiple of 4"):
        HellaSwag(tmp_path / "h.bin", B=6, T=16, vocab_size=50257)
    with pytest.raises(LLMCError, match="run with -t 2 or more"):
        HellaSwag(tmp_path / "h.bin", B=4, T=1, vocab_size=50257)
    with pytest.raises(LLMCError, match="token id 5 is outside"):
        HellaSwag(tmp_path / "h.bin", B=4, T=16, vocab_size=5)


# ----------------------------------------------------------------------------------------------
# the trainer: -h 1, -x 0

def run(args, check=True):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny):
    from llmc.checkpoint import write_model
    cfg, _, params = tiny
    d = tmp_path_factory.mktemp("hs")
    rng = np.random.default_rng(5)
    write_llmc_shard(d / "train.bin", rng.integers(0, 1000, 400).tolist())
    write_llmc_shard(d / "val.bin", rng.integers(0, 1000, 200).tolist())
    write_llmc_evalfile(d / "h.bin", random_examples(rng, 5))
    write_model(d / "model.bin", cfg, params)
    return d


def common(d):
    return ["--device", "cpu", "-e", str(d / "model.bin"), "-b", "8", "-t", "16", "-s", "0",
            "-i", str(d / "train.bin"), "-j", str(d / "val.bin"), "--hellaswag-data", str(d / "h.bin")]


def test_eval_only(files, tiny, tmp_path):
    cfg, model, _ = tiny
    hs = HellaSwag(files / "h.bin", B=8, T=16, vocab_size=cfg.vocab_size)
    c, n = hs.evaluate(model, progress=False)
    p = run(common(files) + ["-x", "0", "-h", "1", "-o", str(tmp_path)])
    assert f"\nHellaSwag: {c}/{n} = {c / n:f}\n" in p.stdout           # llm.c's line exactly
    assert "val loss" in p.stdout and "step 1" not in p.stdout     # -x 0: no training step
    log = (tmp_path / "main.log").read_text().splitlines()
    assert log[0].startswith("s:0 tel:") and log[1] == f"s:0 eval:{c / n:.4f}" and len(log) == 2
    assert not list(tmp_path.glob("model_*.bin"))                  # nothing trained, nothing saved


def test_cadence_while_training(files, tmp_path):
    p = run(common(files) + ["-x", "3", "-v", "2", "-h", "1", "-o", str(tmp_path)])
    assert len(re.findall(r"^HellaSwag: \d+/5 = ", p.stdout, re.M)) == 2   # step 2 and the last step (3)
    evals = [l for l in (tmp_path / "main.log").read_text().splitlines() if " eval:" in l]
    assert [l.split()[0] for l in evals] == ["s:2", "s:3"]


def test_flags(files):
    p = run(["--help"])
    assert "--hellaswag" in p.stdout and "--hellaswag-data" in p.stdout
    p = run(common(files) + ["-x", "0", "-h", "1", "-b", "6"], check=False)
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0 and "multiple of 4" in p.stderr
    p = run(common(files) + ["-x", "0", "-h", "2"], check=False)
    # refused at parse time, as every 0/1 flag is: one line naming the flag and what it takes
    assert p.returncode != 0 and "-h/--hellaswag" in p.stderr and "expected 0 or 1" in p.stderr
    assert p.stderr.strip().count("\n") == 0
    p = run(common(files)[:-1] + [str(files / "nope.bin"), "-x", "0", "-h", "1"], check=False)
    assert p.returncode != 0 and "nope.bin: not found" in p.stderr and p.stderr.strip().count("\n") == 0


def test_through_the_cuda_backends_plumbing(tmp_path):
    """HellaSwag with the cuda backend's buffers (tests/fake_runtime.py: DevArrays, kernels replaced by
    their references) scores exactly as the numpy backend: the GPU path's downloads and views."""
    from llmc.backend import CpuBackend
    from llmc.config import GPT2Config
    from llmc.model import GPT2
    from fake_runtime import FakeCudaBackend
    cfg = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=2, num_heads=2, channels=32)
    write_llmc_evalfile(tmp_path / "h.bin", random_examples(np.random.default_rng(4), 9, vocab=97))
    hs = HellaSwag(tmp_path / "h.bin", B=8, T=16, vocab_size=cfg.vocab_size)
    results = []
    for be in (CpuBackend(np.float32), FakeCudaBackend()):
        m = GPT2(cfg, be, 8, 16)
        m.load_params(m.init_params(3) * np.float32(8))
        x, y, _, _ = pack_batch(hs.examples[:2], 8, 16)
        results.append((hs.evaluate(m, progress=False), token_losses(m, x, y)))
    assert results[0][0] == results[1][0]
    assert np.array_equal(results[0][1], results[1][1])
