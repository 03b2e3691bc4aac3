"""llmc/bf16.py: the host's bf16 conversions, checked against torch's bfloat16 (round to nearest even)."""
import numpy as np
import pytest
import torch

from llmc.bf16 import BF16, bf16_neighbours, from_bf16, round_bf16, to_bf16


def torch_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_to_bf16_matches_torch_round_to_nearest_even():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 100_000),
                        np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, -1e-42],
                                 np.float32)]).astype(np.float32)
    # exact ties: the 16 dropped bits are 0x8000 (ties to even, both parities of the kept bit)
    ties = (np.arange(2000, dtype=np.uint32) << 16 | np.uint32(0x8000)).view(np.float32)
    x = np.concatenate([x, ties, -ties])
    got = to_bf16(x)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got, torch_bits(x))


def test_nan_stays_nan_and_round_trip_is_exact():
    x = np.array([np.nan, -np.nan, np.float32(np.nan)], np.float32)
    x = np.concatenate([x, np.array([0x7F80_0001, 0xFFFF_FFFF], np.uint32).view(np.float32)])
    assert np.isnan(from_bf16(to_bf16(x))).all()
    bits = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    f = from_bf16(bits)
    finite = np.isfinite(f)
    np.testing.assert_array_equal(to_bf16(f[finite]), bits[finite])
    with pytest.raises(TypeError, match="uint16"):
        from_bf16(np.zeros(3, np.float32))


def test_round_error_is_within_half_an_ulp():
    rng = np.random.default_rng(1)
    x = rng.standard_normal(10_000).astype(np.float32)
    r = round_bf16(x)
    assert np.all(np.abs(r - x) <= np.abs(x) * 2.0 ** -8)
    lo, hi = bf16_neighbours(x)
    assert np.all(lo <= x) and np.all(x <= hi) and np.all((r == lo) | (r == hi))
    assert np.all(to_bf16(lo) == to_bf16(lo)) and np.all(round_bf16(lo) == lo) and np.all(round_bf16(hi) == hi)
    one = np.float32(1.0)
    assert bf16_neighbours(np.array([one]))[0][0] == one == bf16_neighbours(np.array([one]))[1][0]
