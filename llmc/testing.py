"""Validation helpers shared by the GPU tests and the kernel lab (dev/cuda).

    poison(dev_array)                      # every byte 0xFF: fp32 NaN, int32 -1
    report = compare(got, ref, atol, rtol) # None if close, else a message with the first mismatches
    with module_defines(rt, "gelu", {"GELU_CS_UNROLL": 4}): ...   # builds with a lab knob, then as before
"""
from __future__ import annotations

import contextlib

import numpy as np

POISON_BYTE = 0xFF  # 0xFFFFFFFF is a NaN in fp32: any element a kernel forgets to write stays NaN


@contextlib.contextmanager
def module_defines(rt, module: str, defines: dict):
    """Inside the block, rt's builds of cuda/<module>.cu take `defines` (the lab's --define knobs) over
    the extra defines it already has; after it, those are as they were (none: the module's entry gone)."""
    saved = rt.extra_defines.get(module)
    rt.extra_defines[module] = {**(saved or {}), **{k: str(v) for k, v in defines.items()}}
    try:
        yield
    finally:
        if saved is None:
            rt.extra_defines.pop(module, None)
        else:
            rt.extra_defines[module] = saved


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


def tf32_close(got, ref, name: str = "out") -> None:
    """TF32 tensor-core results: elementwise within 1% (of the value or of the output's rms), and
    ||got - ref|| / ||ref|| < 2e-3 (TF32 rounds each input to 10 mantissa bits)."""
    rms = float(np.sqrt(np.mean(np.square(ref)))) + 1e-30
    assert_close(got, ref, atol=1e-2 * rms, rtol=1e-2, name=name)
    assert rel_err(got, ref) < 2e-3, f"{name}: rel_err {rel_err(got, ref):.2e}"


def check_matmul(got, ref, tf32: bool, name: str = "out", exact: bool = False) -> None:
    """The GEMM and matmul tests' tolerance: exact (small-integer inputs), TF32, or fp32 (atol scaled
    with the outputs' size: unscaled inputs give |out| ~ sqrt(K))."""
    if exact:
        assert_close(got, ref, atol=0, rtol=0, name=name)
    elif tf32:
        tf32_close(got, ref, name)
    else:
        rms = float(np.sqrt(np.mean(np.square(ref))))
        assert_close(got, ref, atol=1e-4 * max(1.0, rms), rtol=1e-4, name=name)


def bf16_close(got, ref, name: str = "out") -> None:
    """bf16 outputs of fp32-accumulated products or sums, rounded once (the matmul family's bf16
    builds): elementwise |got - ref| <= 2^-8 |ref| + 1e-3 rms(ref), and ||got - ref|| / ||ref|| < 4e-3.
    One rounding to bf16 is at most 2^-9 relative; 2^-8 leaves room for an fp32 sum that lands beside
    a rounding boundary. The absolute part covers the fp32 accumulation (~sqrt(K) 2^-24 rms(ref), under
    1e-4 rms even at K = 50304) and outputs near 0; an indexing bug is O(rms) and always fails.
    `got` is already float (llmc.bf16.from_bf16 of the kernel's bits); NaN (0xFFFF poison) fails."""
    rms = float(np.sqrt(np.mean(np.square(np.asarray(ref, np.float64))))) + 1e-30
    assert_close(got, ref, atol=1e-3 * rms, rtol=2.0 ** -8, name=name)
    assert rel_err(got, ref) < 4e-3, f"{name}: rel_err {rel_err(got, ref):.2e}"
