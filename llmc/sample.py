"""Sampling text from the model.

    from llmc.sample import sample_token, generate_full
    tok = sample_token(logits_row, temperature=0.8, top_k=40, rng=rng)   # one draw from one row

generate_full runs the whole (B, T) forward of a model for every new token (O(T) work per token):
the reference the KV-cache decoder (llmc/decode.py) is tested against, and the --no-kv-cache baseline.
"""
from __future__ import annotations

import numpy as np

EOT = 50256


def sample_token(logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator) -> int:
    """Draw one token from one row of logits (V,). temperature <= 0 means greedy (argmax).
    top_k keeps only the k largest logits (ties at the k-th value are kept)."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if top_k is not None and 0 < top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max()
    p = np.exp(z)
    p /= p.sum()
    # inverse-CDF with one uniform draw: the same rng stream on every backend
    cdf = np.cumsum(p)
    idx = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), z.size - 1)
    while p[idx] == 0.0:  # rounding at the top of the cdf can land on a masked entry
        idx -= 1
    return idx


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


def sample_during_training(decoder, gen_tokens: int, rng: np.random.Generator, tokenizer=None) -> str:
    """What the trainer prints every -s steps: gen_tokens tokens after <|endoftext|>, temperature 1,
    through the same KV-cache decoder as sample_gpt2.py (reading the model's live weights)."""
    from llmc.decode import generate
    toks = generate(decoder, [EOT], gen_tokens, temperature=1.0, top_k=None, rng=rng)[0]
    if tokenizer is None:
        return " ".join(str(t) for t in toks)
    return tokenizer.decode([t for t in toks if t < tokenizer.n_vocab])
