"""Model checkpoints, debug states and resume states: round trips, llm.c-format fixtures, bad files.

    python -m pytest tests/test_checkpoint.py -q
"""
import json
import os

import numpy as np
import pytest

from llmc.bf16 import from_bf16, to_bf16
from llmc.checkpoint import (HEADER_BYTES, atomic_open, read_debug_state, read_model, read_state, write_debug_state,
                             write_model, write_state)
from llmc.config import GPT2Config
from llmc.errors import LLMCError
from llmc_fixtures import (bf16_bytes_torch, header_bytes, read_llmc_state, write_llmc_debug_state,
                           write_llmc_model, write_llmc_state)

# small, with a padded vocab (V=11 -> Vp=16) and C not a power of two
CFG = GPT2Config(max_seq_len=8, vocab_size=11, padded_vocab_size=16, num_layers=2, num_heads=2, channels=6)
HDR = (CFG.max_seq_len, CFG.vocab_size, CFG.num_layers, CFG.num_heads, CFG.channels, CFG.padded_vocab_size)


def random_params(rng, cfg=CFG):
    return rng.standard_normal(cfg.num_parameters).astype(np.float32)


def no_temp_files(d):
    return [p for p in os.listdir(d) if ".tmp" in p] == []


# -----------------------------------------------------------------------------
# bf16 conversion


def test_bf16_matches_torch_round_to_nearest_even(rng):
    x = np.concatenate([
        rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-40, 38, 10000),
        np.array([0.0, -0.0, np.inf, -np.inf, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8),
                  np.finfo(np.float32).max, np.finfo(np.float32).tiny / 3, 3e38], dtype=np.float32),
    ]).astype(np.float32)
    ours = to_bf16(x).astype("<u2").tobytes()
    assert ours == bf16_bytes_torch(x)
    # the ties explicitly: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 -> even (1.0);
    # 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6 -> even (1 + 2^-6)
    back = from_bf16(to_bf16(np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)))
    assert back.tolist() == [1.0, 1 + 2**-6]


def test_bf16_nan_stays_nan():
    x = np.array([np.nan, -np.nan], dtype=np.float32)
    x.view(np.uint32)[1] = 0xFFFFFFFF  # the NaN whose +0x7FFF would wrap around
    assert np.isnan(from_bf16(to_bf16(x))).all()


def test_bf16_to_fp32_exact(rng):
    bits = rng.integers(0, 2**16, 5000).astype(np.uint16)
    got = from_bf16(bits).view(np.uint32)
    assert (got == bits.astype(np.uint32) << 16).all()


# -----------------------------------------------------------------------------
# model checkpoint


def test_model_fp32_round_trip(tmp_path, rng):
    params = random_params(rng)
    write_model(tmp_path / "m.bin", CFG, params)
    cfg, got = read_model(tmp_path / "m.bin")
    assert cfg == CFG
    assert got.dtype == np.float32 and np.array_equal(got, params)
    assert (tmp_path / "m.bin").stat().st_size == HEADER_BYTES + 4 * CFG.num_parameters
    assert no_temp_files(tmp_path)


def test_model_bf16_round_trip(tmp_path, rng):
    params = random_params(rng)
    write_model(tmp_path / "m.bin", CFG, params, dtype="bf16")
    cfg, got = read_model(tmp_path / "m.bin")
    assert cfg == CFG and got.dtype == np.float32
    import torch
    want = torch.from_numpy(params).to(torch.bfloat16).float().numpy()
    assert np.array_equal(got, want)
    assert (tmp_path / "m.bin").stat().st_size == HEADER_BYTES + 2 * CFG.num_parameters


@pytest.mark.parametrize("version,dtype", [(3, "fp32"), (5, "bf16")])
def test_model_llmc_fixture_both_ways(tmp_path, rng, version, dtype):
    """A file written straight from the format description reads back, and ours is byte-identical."""
    params = random_params(rng)
    write_llmc_model(tmp_path / "ref.bin", *HDR, params, version=version)
    cfg, got = read_model(tmp_path / "ref.bin")
    assert cfg == CFG
    if version == 3:
        assert np.array_equal(got, params)
    write_model(tmp_path / "ours.bin", CFG, params, dtype=dtype)
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_model_header_fields_in_llmc_order(tmp_path, rng):
    write_model(tmp_path / "m.bin", CFG, random_params(rng))
    h = np.fromfile(tmp_path / "m.bin", dtype="<i4", count=256)
    assert h[:8].tolist() == [20240326, 3, 8, 11, 2, 2, 6, 16] and not h[8:].any()


def test_model_bad_files(tmp_path, rng):
    params = random_params(rng)
    good = tmp_path / "good.bin"
    write_llmc_model(good, *HDR, params)
    data = good.read_bytes()

    def bad(name, content, *needles):
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(LLMCError) as e:
            read_model(p)
        msg = str(e.value)
        assert "\n" not in msg and str(p) in msg
        for n in needles:
            assert n in msg, msg

    with pytest.raises(LLMCError, match="not found"):
        read_model(tmp_path / "missing.bin")
    bad("magic.bin", header_bytes(1234, 3, *HDR) + data[HEADER_BYTES:], "bad magic 1234", "expected 20240326")
    bad("version.bin", header_bytes(20240326, 4, *HDR) + data[HEADER_BYTES:], "version 4", "3 or 5")
    bad("trunc.bin", data[:-1], "truncated", f"{4 * CFG.num_parameters:,}", f"{4 * CFG.num_parameters - 1:,}")
    bad("long.bin", data + b"\0\0\0\0", "too long")
    bad("tiny.bin", data[:100], "truncated", "header")
    bad("empty.bin", b"", "truncated")
    # bf16 header over an fp32 body: twice as long as the header says
    bad("mixed.bin", header_bytes(20240326, 5, *HDR) + data[HEADER_BYTES:], "too long", "bf16")
    bad("heads.bin", header_bytes(20240326, 3, 8, 11, 2, 4, 6, 16) + data[HEADER_BYTES:], "not divisible")
    bad("vp.bin", header_bytes(20240326, 3, 8, 11, 2, 2, 6, 8) + data[HEADER_BYTES:], "Vp=8 < vocab V=11")
    bad("zero.bin", header_bytes(20240326, 3, 8, 11, 0, 2, 6, 16), "L=0")
    # a data shard given as a model
    bad("shard.bin", header_bytes(20240520, 1, 4) + b"\0" * 8, "bad magic 20240520", "model checkpoint")


def test_write_model_is_atomic(tmp_path, rng, monkeypatch):
    """A crash mid-save leaves the previous checkpoint intact and no temp file behind."""
    path = tmp_path / "m.bin"
    old = random_params(rng)
    write_model(path, CFG, old)
    before = path.read_bytes()
    import llmc.checkpoint as ckpt

    def crash(x):
        raise KeyboardInterrupt  # e.g. Ctrl-C halfway through the write
    monkeypatch.setattr(ckpt, "to_bf16", crash)
    with pytest.raises(KeyboardInterrupt):
        write_model(path, CFG, random_params(rng), dtype="bf16")
    assert path.read_bytes() == before
    assert no_temp_files(tmp_path)


def test_atomic_open_keeps_old_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_open(path) as f:
            f.write(b"new but partial")
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old" and no_temp_files(tmp_path)
    with atomic_open(tmp_path / "sub" / "g.bin") as f:  # creates the directory
        f.write(b"new")
    assert (tmp_path / "sub" / "g.bin").read_bytes() == b"new"


def test_write_model_rejects_wrong_size(tmp_path):
    with pytest.raises(ValueError):
        write_model(tmp_path / "m.bin", CFG, np.zeros(5, np.float32))
    with pytest.raises(LLMCError, match="dtype"):
        write_model(tmp_path / "m.bin", CFG, np.zeros(CFG.num_parameters, np.float32), dtype="fp16")
    assert not (tmp_path / "m.bin").exists()


# -----------------------------------------------------------------------------
# debug state


def debug_arrays(rng, B=2, T=5):
    x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    logits = rng.standard_normal((B, T, CFG.vocab_size)).astype(np.float32)
    grads = random_params(rng)
    return B, T, x, y, logits, np.float32(2.5), grads


def test_debug_state_llmc_fixture_both_ways(tmp_path, rng):
    B, T, x, y, logits, loss, grads = debug_arrays(rng)
    write_llmc_debug_state(tmp_path / "ref.bin", B, T, x, y, logits, loss, grads)
    d = read_debug_state(tmp_path / "ref.bin", CFG)
    assert (d["B"], d["T"]) == (B, T)
    assert np.array_equal(d["x"], x) and np.array_equal(d["y"], y)
    assert d["logits"].shape == (B, T, CFG.vocab_size) and np.array_equal(d["logits"], logits)
    assert d["loss"] == 2.5 and np.array_equal(d["grads"], grads)
    write_debug_state(tmp_path / "ours.bin", CFG, B, T, x, y, logits, loss, grads)
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_debug_state_accepts_padded_logits(tmp_path, rng):
    B, T, x, y, logits, loss, grads = debug_arrays(rng)
    padded = rng.standard_normal((B, T, CFG.padded_vocab_size)).astype(np.float32)
    padded[..., :CFG.vocab_size] = logits
    write_debug_state(tmp_path / "a.bin", CFG, B, T, x, y, padded, loss, grads)
    assert np.array_equal(read_debug_state(tmp_path / "a.bin", CFG)["logits"], logits)


def test_debug_state_bad_files(tmp_path, rng):
    B, T, x, y, logits, loss, grads = debug_arrays(rng)
    good = tmp_path / "good.bin"
    write_llmc_debug_state(good, B, T, x, y, logits, loss, grads)
    data = good.read_bytes()
    cases = {
        "magic": (header_bytes(20240326, 2, B, T) + data[HEADER_BYTES:], "bad magic 20240326"),
        "version": (header_bytes(20240327, 1, B, T) + data[HEADER_BYTES:], "version 1"),
        "trunc": (data[:-4], "truncated"),
        "long": (data + b"x", "too long"),
        "T": (header_bytes(20240327, 2, 1, 10) + data[HEADER_BYTES:], "T=10 > the model's maxT=8"),
        "B": (header_bytes(20240327, 2, 0, T) + data[HEADER_BYTES:], "B=0"),
    }
    for name, (content, needle) in cases.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(content)
        with pytest.raises(LLMCError, match=needle):
            read_debug_state(p, CFG)
    with pytest.raises(LLMCError, match="not found"):
        read_debug_state(tmp_path / "nope.bin", CFG)
    # the same file read with a model of a different size: the sizes no longer add up
    other = GPT2Config(max_seq_len=8, vocab_size=11, padded_vocab_size=16, num_layers=1, num_heads=2, channels=6)
    with pytest.raises(LLMCError, match="too long"):
        read_debug_state(good, other)


# -----------------------------------------------------------------------------
# optimizer + dataloader state


def test_state_round_trip(tmp_path, rng):
    n = CFG.num_parameters
    m, v = random_params(rng), np.abs(random_params(rng))
    loader = {"epoch": 3, "shard_index": 1, "window_index": 7, "seed": 1337, "shuffle": True}
    bitgen = np.random.default_rng(42).bit_generator.state  # 128-bit ints: JSON keeps them exact
    extra = {"rng": bitgen, "lr": 6e-4, "note": "ünïcode", "np_int": np.int64(5)}
    write_state(tmp_path / "s.bin", 123, m, v, loader, extra)
    st = read_state(tmp_path / "s.bin", n)
    assert st["step"] == 123 and st["ours"] and st["master"] is None
    assert np.array_equal(st["m"], m) and np.array_equal(st["v"], v)
    assert st["loader"] == loader and (st["shard_index"], st["sample_index"]) == (1, 7)
    assert st["extra"]["rng"] == bitgen and st["extra"]["np_int"] == 5 and st["extra"]["note"] == "ünïcode"
    g = np.random.default_rng()
    g.bit_generator.state = st["extra"]["rng"]
    assert g.random() == np.random.default_rng(42).random()
    assert no_temp_files(tmp_path)


def test_state_is_llmc_layout(tmp_path, rng):
    """What llm.c's load_state reads from our file: its header fields, m, v, master weights; the
    shuffle flag is 0 so it stops there and never reads our trailer."""
    n = CFG.num_parameters
    m, v, master = random_params(rng), np.abs(random_params(rng)), random_params(rng)
    loader = {"epoch": 0, "shard_index": 2, "window_index": 5}
    write_state(tmp_path / "s.bin", 77, m, v, loader, {"x": 1}, master=master, rank=1, world=2, sr_rng=2**40 + 3)
    got = read_llmc_state(tmp_path / "s.bin", n)
    assert (got["num_processes"], got["rank"], got["master_weights"], got["shuffle"], got["step"]) == (2, 1, 1, 0, 77)
    assert (got["shard"], got["sample"], got["rng_state"]) == (2, 5, 2**40 + 3)
    assert np.array_equal(got["m"], m) and np.array_equal(got["v"], v) and np.array_equal(got["master"], master)
    # the default stochastic-rounding RNG is llm.c's initial one for the rank, never 0 (a stuck xorshift)
    write_state(tmp_path / "t.bin", 1, m, v, loader)
    assert read_llmc_state(tmp_path / "t.bin", n)["rng_state"] == 13371337


def test_reads_llmc_state(tmp_path, rng):
    n = CFG.num_parameters
    m, v, master = random_params(rng), np.abs(random_params(rng)), random_params(rng)
    write_llmc_state(tmp_path / "a.bin", 40, m, v, shard=3, sample=9, rng_state=99)
    st = read_state(tmp_path / "a.bin", n)
    assert not st["ours"] and st["loader"] is None and st["extra"] == {} and st["master"] is None
    assert (st["step"], st["shard_index"], st["sample_index"], st["sr_rng"]) == (40, 3, 9, 99)
    assert np.array_equal(st["m"], m) and np.array_equal(st["v"], v)
    write_llmc_state(tmp_path / "b.bin", 40, m, v, master=master)
    assert np.array_equal(read_state(tmp_path / "b.bin", n)["master"], master)
    # llm.c's shuffled loader state cannot be continued: one clear line
    write_llmc_state(tmp_path / "c.bin", 40, m, v, shuffle=1, tail=b"\0" * 64)
    with pytest.raises(LLMCError, match="shuffling dataloader"):
        read_state(tmp_path / "c.bin", n)
    with pytest.raises(LLMCError, match="rank 0's state, expected rank 1's"):
        read_state(tmp_path / "a.bin", n, rank=1)
    with pytest.raises(LLMCError, match="1 processes, this run has 2"):
        read_state(tmp_path / "a.bin", n, world=2)


def test_state_bad_files(tmp_path, rng):
    n = CFG.num_parameters
    good = tmp_path / "good.bin"
    write_state(good, 5, random_params(rng), random_params(rng), {"shard_index": 0, "window_index": 0}, {})
    data = good.read_bytes()
    tail = HEADER_BYTES + 8 * n
    cases = {
        "magic": (header_bytes(20241122, 1) + data[HEADER_BYTES:], "bad magic 20241122"),
        "version": (data[:4] + header_bytes(0, 2)[4:8] + data[8:], "version 2"),
        "trunc": (data[:HEADER_BYTES + 8 * n - 4], "truncated"),
        "long": (data + b"\0" * 8, "not an llmc-py trailer"),
        "trailer": (data[:tail] + b"\0" * 16 + data[tail + 16:], "not an llmc-py trailer"),
        "json": (data[:tail + 16] + b"{" * (len(data) - tail - 16), "JSON"),
        "rank": (data[:12] + header_bytes(0, 0, 0, 5)[12:16] + data[16:], "corrupt header"),
    }
    for name, (content, needle) in cases.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(content)
        with pytest.raises(LLMCError, match=needle):
            read_state(p, n)
    with pytest.raises(LLMCError, match="truncated"):
        read_state(good, 2 * n)
    with pytest.raises(LLMCError, match="not found"):
        read_state(tmp_path / "missing.bin", n)
    # a model checkpoint is not a state file
    write_model(tmp_path / "m.bin", CFG, random_params(rng))
    with pytest.raises(LLMCError, match="bad magic 20240326"):
        read_state(tmp_path / "m.bin", n)
    json.loads(data[tail + 16:])  # the trailer's blob itself is plain JSON
