"""bfloat16 on the host. numpy has no bf16 type, so a bf16 tensor is held on the host as its raw
16-bit patterns in a uint16 array (the upper half of the fp32 bit pattern: sign, 8 exponent bits,
7 mantissa bits). Every conversion goes through the two functions here, never through astype:

    h = to_bf16(np.float32 array)    # uint16 bits, rounded to nearest, ties to even (like __float2bfloat16_rn)
    f = from_bf16(h)                 # float32, exact (every bf16 value is an fp32 value)
    r = round_bf16(x)                # x rounded to bf16 precision, as float32 (a reference's rounding)

On the GPU the same bits are __nv_bfloat16. A DevArray of a bf16 tensor has dtype BF16 (uint16), so
uploads and downloads move the bits untouched: dev.set(to_bf16(x)), from_bf16(dev.get()).

Precision of bf16: 8 significant bits, so one rounding is off by at most half a unit in the last
place, 2^-8 = 0.4% relative (BF16_EPS / 2); a sum or dot product accumulated in fp32 and rounded once at the end is off by
about that much, which is what the bf16 tests' tolerances are built from.
"""
from __future__ import annotations

import numpy as np

BF16 = np.dtype(np.uint16)   # host storage of bf16 bit patterns
BF16_EPS = 2.0 ** -7         # the gap between 1 and the next bf16 value (8 significant bits)


def to_bf16(x) -> np.ndarray:
    """float -> bf16 bits (uint16), round to nearest, ties to even; NaN stays NaN (quiet), inf stays inf."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)            # uint64: the rounding add can't wrap
    # add 0x7FFF plus the lowest kept bit, then cut: round half to even on the 16 dropped bits
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():  # keep the sign, force a quiet-NaN mantissa bit (the add could carry into inf)
        rounded[nan] = ((u[nan] >> 16).astype(np.uint16) | np.uint16(0x0040))
    return rounded


def from_bf16(h) -> np.ndarray:
    """bf16 bits (uint16) -> float32, exactly."""
    h = np.ascontiguousarray(h)
    if h.dtype != BF16:
        raise TypeError(f"from_bf16: expected uint16 bf16 bits, got {h.dtype}")
    return (h.astype(np.uint32) << 16).view(np.float32)


def round_bf16(x) -> np.ndarray:
    """x rounded to the nearest bf16 value, as float32 (what storing x in a bf16 tensor does)."""
    return from_bf16(to_bf16(x))


def bf16_neighbours(x) -> tuple[np.ndarray, np.ndarray]:
    """The bf16 values just below and just above each x (equal when x is a bf16 value): the only
    two results a stochastic rounding of x may give. Returned as float32."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    trunc = (u & np.uint32(0xFFFF0000)).view(np.float32)      # toward zero
    exact = (u & np.uint32(0xFFFF)) == 0
    away = ((u & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)  # away from zero
    away = np.where(exact, trunc, away)
    lo = np.where(f >= 0, trunc, away)
    hi = np.where(f >= 0, away, trunc)
    return lo.astype(np.float32), hi.astype(np.float32)
