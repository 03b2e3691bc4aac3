"""Validation helpers shared by the GPU tests and the kernel lab (dev/cuda).

    poison(dev_array)                      # every byte 0xFF: fp32 NaN, int32 -1
    report = compare(got, ref, atol, rtol) # None if close, else a message with the first mismatches
"""
from __future__ import annotations

import numpy as np

POISON_BYTE = 0xFF  # 0xFFFFFFFF is a NaN in fp32: any element a kernel forgets to write stays NaN


def poison(*arrays) -> None:
    for a in arrays:
        if a is not None:
            a.fill_bytes(POISON_BYTE)


def compare(got: np.ndarray, ref: np.ndarray, atol: float, rtol: float, name: str = "out",
            show: int = 5) -> str | None:
    """Elementwise |got - ref| <= atol + rtol*|ref|, and every element finite (unwritten elements
    of a poisoned output are NaN). Returns None when all pass, else a description."""
    got = np.asarray(got, dtype=np.float64).reshape(-1)
    ref = np.asarray(ref, dtype=np.float64).reshape(-1)
    if got.shape != ref.shape:
        return f"{name}: shape {got.shape} != reference {ref.shape}"
    notfinite = ~np.isfinite(got)
    bad = notfinite | (np.abs(got - ref) > atol + rtol * np.abs(ref))
    if not bad.any():
        return None
    idx = np.flatnonzero(bad)
    lines = [f"{name}: {idx.size} of {got.size} elements off (atol={atol:g}, rtol={rtol:g}); "
             f"{int(notfinite.sum())} not finite (unwritten?)"]
    for i in idx[:show]:
        lines.append(f"  [{i}] got {got[i]!r} want {ref[i]!r}")
    return "\n".join(lines)


def assert_close(got, ref, atol: float, rtol: float, name: str = "out") -> None:
    msg = compare(got, ref, atol, rtol, name)
    assert msg is None, msg


def rel_err(got, ref) -> float:
    """||got - ref|| / ||ref|| in float64."""
    got = np.asarray(got, np.float64); ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
