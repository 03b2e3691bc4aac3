"""Sampling text from the model.

    from llmc.sample import sample_token, generate_full
    tok = sample_token(logits_row, temperature=0.8, top_k=40, rng=rng)   # one draw from one row

generate_full runs the whole (B, T) forward of a model for every new token (O(T) work per token):
the reference the KV-cache decoder (llmc/decode.py) is tested against, and the --no-kv-cache baseline.
This module imports nothing else of llmc: the decoder and the sampling kernel's reference
(llmc/ops/sample.py) both build on it, never the other way round.
"""
from __future__ import annotations

import numpy as np

EOT = 50256


def sample_token(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    """Draw one token from one row of logits (V,). temperature <= 0 means greedy (argmax).
    top_k keeps only the k largest logits (ties at the k-th value are kept).

    One uniform draw per token (none when greedy), inverted through the cumulative distribution in
    index order, so that the same seed gives the same stream on every backend (the GPU's sampling
    kernel, cuda/sample.cu, follows the same rule from the same draws)."""
    if temperature <= 0:
        return int(np.argmax(np.asarray(logits)))
    return sample_with_uniform(logits, temperature, top_k, rng.random())


def sample_with_uniform(logits: np.ndarray, temperature: float, top_k: int | None, u: float) -> int:
    """sample_token given its uniform draw u in [0, 1). Fast enough to keep up with the GPU
    (~0.05 ms for GPT-2's 50257 logits): float32 where numpy vectorises, the cumulative sum in two
    levels (float32 sums of blocks of 512, float64 prefix over the blocks, then over the one block
    the draw lands in) instead of a 50k-long float64 cumsum."""
    logits = np.asarray(logits)
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float32, copy=False)
    idx = None
    if top_k is not None and 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        idx = np.flatnonzero(z >= kth)
        z = z[idx]
    w = np.exp((z - z.max()) * np.float32(1.0 / temperature))
    j = _inverse_cdf(w, u)
    return int(idx[j]) if idx is not None else j


_BLOCK = 512


def _inverse_cdf(w: np.ndarray, u: float) -> int:
    """The first index j with cumsum(w)[j] > u * sum(w), skipping zero weights (w >= 0, some > 0)."""
    n = w.size
    if n <= 4 * _BLOCK:
        cdf = np.cumsum(w, dtype=np.float64)
        j = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    else:
        nb = -(-n // _BLOCK)
        padded = np.zeros(nb * _BLOCK, np.float32)
        padded[:n] = w
        sums = np.cumsum(padded.reshape(nb, _BLOCK).sum(axis=1), dtype=np.float64)
        target = u * sums[-1]
        b = min(int(np.searchsorted(sums, target, side="right")), nb - 1)
        before = sums[b - 1] if b else 0.0
        cdf = before + np.cumsum(padded[b * _BLOCK:(b + 1) * _BLOCK], dtype=np.float64)
        j = b * _BLOCK + min(int(np.searchsorted(cdf, target, side="right")), _BLOCK - 1)
    j = min(j, n - 1)
    while w[j] == 0.0:  # rounding at the top of the cdf can land on a zero weight
        j -= 1
    return j


def generate_full(model, prompt: list[int], n: int, temperature: float = 1.0, top_k: int | None = None,
                  rng: np.random.Generator | None = None) -> list[int]:
    """Append n tokens to prompt with full forwards of `model` (row 0 of its (B, T) batch)."""
    rng = rng or np.random.default_rng(0)
    B, T = model.B, model.T
    toks = list(prompt)
    n = min(n, T - len(toks))
    for _ in range(max(n, 0)):
        x = np.zeros((B, T), np.int32)  # positions after the context never affect it (causal)
        x[0, :len(toks)] = toks
        model.forward(x)
        row = model.logits_row(0, len(toks) - 1)
        toks.append(sample_token(row, temperature, top_k, rng))
    return toks
