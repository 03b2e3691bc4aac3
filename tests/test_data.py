"""Token shards and the DataLoader: round trips, llm.c fixtures, bad files, wrap, shuffle, exact resume.

    python -m pytest tests/test_data.py -q
"""
import json

import numpy as np
import pytest

from llmc.checkpoint import HEADER_BYTES
from llmc.data import DataLoader, read_shard, write_shard
from llmc.errors import LLMCError
from llmc_fixtures import header_bytes, write_llmc_shard

# -----------------------------------------------------------------------------
# shard files


def test_shard_round_trip(tmp_path, rng):
    tokens = rng.integers(0, 50257, 1000).astype(np.uint16)
    write_shard(tmp_path / "s.bin", tokens)
    got = read_shard(tmp_path / "s.bin")
    assert got.dtype == np.uint16 and np.array_equal(got, tokens)
    assert np.array_equal(read_shard(tmp_path / "s.bin", mmap=False), tokens)
    write_shard(tmp_path / "e.bin", [])
    assert read_shard(tmp_path / "e.bin").size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.bin", "s.bin"]  # no temp files left


def test_shard_llmc_fixture_both_ways(tmp_path, rng):
    tokens = rng.integers(0, 65536, 777).tolist()
    write_llmc_shard(tmp_path / "ref.bin", tokens)
    assert read_shard(tmp_path / "ref.bin").tolist() == tokens
    write_shard(tmp_path / "ours.bin", np.array(tokens, dtype=np.int64))  # any int dtype in range
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "ref.bin").read_bytes()


def test_shard_bad_files(tmp_path):
    good = tmp_path / "good.bin"
    write_llmc_shard(good, range(100))
    data = good.read_bytes()
    cases = {
        "magic": (header_bytes(20240326, 1, 100) + data[HEADER_BYTES:], "bad magic 20240326.*expected 20240520"),
        "version": (header_bytes(20240520, 2, 100) + data[HEADER_BYTES:], "version 2"),
        "trunc": (data[:-2], "truncated: header says 100 uint16 tokens = 200 bytes.*file has 198"),
        "long": (data + b"\0\0", "too long"),
        "neg": (header_bytes(20240520, 1, -5) + data[HEADER_BYTES:], "-5 tokens"),
        "short": (data[:10], "smaller than the 1024-byte header"),
    }
    for name, (content, needle) in cases.items():
        p = tmp_path / f"{name}.bin"
        p.write_bytes(content)
        with pytest.raises(LLMCError, match=needle):
            read_shard(p)
    with pytest.raises(LLMCError, match="not found"):
        read_shard(tmp_path / "missing.bin")
    with pytest.raises(ValueError):
        write_shard(tmp_path / "x.bin", [1, 70000])
    with pytest.raises(ValueError):
        write_shard(tmp_path / "x.bin", [-1])


# -----------------------------------------------------------------------------
# DataLoader


def make_shards(d, sizes, start=0):
    """Shards whose tokens are consecutive integers (mod 65536), so every batch says where it came from."""
    paths = []
    for i, n in enumerate(sizes):
        p = d / f"shard_{i:03d}.bin"
        write_llmc_shard(p, [(start + j) % 65536 for j in range(n)])
        start += n
        paths.append(p)
    return paths


def test_loader_sequential_and_wrap(tmp_path):
    B, T = 2, 4                                  # windows of 9 tokens, advancing by 8
    make_shards(tmp_path, [20, 17, 30])         # 2, 2, 3 windows: (20-1)//8, (17-1)//8, (30-1)//8
    loader = DataLoader(tmp_path / "shard_*.bin", B, T)
    assert loader.num_tokens == 67 and loader.batches_per_epoch == 7
    starts = [0, 8, 20, 28, 37, 45, 53]         # token value at each window start
    for epoch in range(3):
        for s in starts:
            assert loader.epoch == epoch
            x, y = loader.next_batch()
            assert x.dtype == np.int32 and x.shape == (B, T) and y.shape == (B, T)
            assert x.reshape(-1).tolist() == list(range(s, s + 8))
            assert y.reshape(-1).tolist() == list(range(s + 1, s + 9))
    assert loader.epoch == 3
    loader.reset()
    assert loader.epoch == 0 and loader.next_batch()[0][0, 0] == 0


def test_loader_exact_fit(tmp_path):
    make_shards(tmp_path, [9])                  # exactly B*T+1: one window, then wrap
    loader = DataLoader(tmp_path / "*.bin", 2, 4)
    a = loader.next_batch()
    assert loader.epoch == 1
    b = loader.next_batch()
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_loader_errors(tmp_path):
    with pytest.raises(LLMCError, match="no files match"):
        DataLoader(tmp_path / "nothing_*.bin", 2, 4)
    make_shards(tmp_path, [20, 8])
    with pytest.raises(LLMCError) as e:
        DataLoader(tmp_path / "shard_*.bin", 2, 4)
    msg = str(e.value)
    assert "shard_001.bin" in msg and "8 tokens" in msg and "B*T+1 = 9" in msg and "\n" not in msg
    (tmp_path / "shard_001.bin").write_bytes(b"junk")
    with pytest.raises(LLMCError, match="shard_001.bin.*truncated"):
        DataLoader(tmp_path / "shard_*.bin", 2, 4)


def every_window(loader, n):
    return [loader.next_batch()[0][0, 0].item() for _ in range(n)]


def test_loader_shuffle_deterministic(tmp_path):
    make_shards(tmp_path, [200, 170, 300, 90])  # 24 + 21 + 37 + 11 = 93 windows of B*T = 8
    pattern = tmp_path / "shard_*.bin"
    a = DataLoader(pattern, 2, 4, shuffle=True, seed=7)
    b = DataLoader(pattern, 2, 4, shuffle=True, seed=7)
    c = DataLoader(pattern, 2, 4, shuffle=True, seed=8)
    plain = DataLoader(pattern, 2, 4)
    n = a.batches_per_epoch
    assert n == 93
    ea0, ea1 = every_window(a, n), every_window(a, n)
    assert a.epoch == 2
    assert ea0 == every_window(b, n) and ea1 == every_window(b, n)        # same seed, same batches
    assert ea0 != every_window(c, n)                                        # another seed, another order
    ordered = every_window(plain, n)
    assert sorted(ea0) == sorted(ordered) == sorted(ea1)                     # each window once per epoch
    assert ea0 != ordered and ea0 != ea1                                     # reshuffled every epoch
    a.reset()
    assert every_window(a, n) == ea0


@pytest.mark.parametrize("shuffle", [False, True])
def test_loader_resume_exact(tmp_path, shuffle):
    """From every point of two epochs, a loader restored from state() continues identically."""
    make_shards(tmp_path, [40, 25, 33])          # 4 + 3 + 4 = 11 windows
    pattern = tmp_path / "shard_*.bin"
    ref = DataLoader(pattern, 2, 4, shuffle=shuffle, seed=99)
    stream = [ref.next_batch() for _ in range(30)]
    for k in range(25):
        run = DataLoader(pattern, 2, 4, shuffle=shuffle, seed=99)
        for _ in range(k):
            run.next_batch()
        saved = json.loads(json.dumps(run.state()))  # it goes through a state file as JSON
        fresh = DataLoader(pattern, 2, 4, shuffle=shuffle, seed=12345)  # seed comes from the state
        fresh.load_state(saved)
        assert fresh.epoch == run.epoch
        for j in range(k, k + 5):
            x, y = fresh.next_batch()
            assert np.array_equal(x, stream[j][0]) and np.array_equal(y, stream[j][1]), (k, j)


def test_loader_resume_through_state_file(tmp_path, rng):
    """The path a resumed training run takes: state() -> write_state -> read_state -> load_state."""
    from llmc.checkpoint import read_state, write_state
    make_shards(tmp_path, [40, 25, 33])
    pattern = tmp_path / "shard_*.bin"
    a = DataLoader(pattern, 2, 4, shuffle=True, seed=5)
    for _ in range(13):
        a.next_batch()
    m = rng.standard_normal(10).astype(np.float32)
    write_state(tmp_path / "state.bin", 13, m, m, a.state(), {})
    b = DataLoader(pattern, 2, 4, shuffle=True, seed=5)
    b.load_state(read_state(tmp_path / "state.bin", 10)["loader"])
    for _ in range(12):
        assert all(np.array_equal(p, q) for p, q in zip(a.next_batch(), b.next_batch()))


def test_loader_state_mismatch(tmp_path):
    make_shards(tmp_path, [40, 25])
    pattern = tmp_path / "shard_*.bin"
    st = DataLoader(pattern, 2, 4).state()
    with pytest.raises(LLMCError, match="B=2 T=4"):
        DataLoader(pattern, 1, 4).load_state(st)
    with pytest.raises(LLMCError, match="shuffle"):
        DataLoader(pattern, 2, 4, shuffle=True).load_state(st)
    with pytest.raises(LLMCError, match="2 shards"):
        DataLoader(tmp_path / "shard_000.bin", 2, 4).load_state(st)
    with pytest.raises(LLMCError, match="window_index"):
        DataLoader(pattern, 2, 4).load_state({**st, "window_index": 99})
    with pytest.raises(LLMCError, match="missing or bad field"):
        DataLoader(pattern, 2, 4).load_state({"epoch": 0})


def test_loader_real_tinyshakespeare_shape(tmp_path, rng):
    """B=4, T=1024 over a shard the size of tiny shakespeare's train split."""
    write_shard(tmp_path / "train.bin", rng.integers(0, 50257, 305_260))
    loader = DataLoader(tmp_path / "train.bin", 4, 1024)
    assert loader.batches_per_epoch == (305_260 - 1) // 4096 == 74
    x, y = loader.next_batch()
    assert x.shape == (4, 1024) and np.array_equal(x.reshape(-1)[1:], y.reshape(-1)[:-1])
