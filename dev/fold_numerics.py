"""Numerics of the classifier folded into the lm head (docs/matmul_notes.md; designed in session 38, built in 39),
simulated in numpy against float64 and against the bf16 path without the fold (LLMC_CLASSIFIER_FOLD=0).

    python dev/fold_numerics.py                 # 256 rows, C = 96, GPT-2's vocabulary
    python dev/fold_numerics.py --rows 64 --offsets 0 40

"today" (the unfolded bf16 path): the lm head stores bf16 logits, the classifier takes the softmax in fp32 from
them and rounds dlogits to bf16, and the backward GEMMs read those. Folded, as built: the forward's epilogue stores
p' = exp(logit - B) in bf16 (B = k ln 2, one scalar), sums it per 128-wide tile in fp32; the combine takes the sum
S, the loss log S - log p'_target (p'_target as stored), one scale per row c = dloss / S, writes p' - S at the
target (so that c times it is (p - 1) * dloss) and X = c * lnf in bf16; then dinp = c * (stored @ wte), the GEMM's
output rounded to bf16 before the scale and again after it, and dwte = stored^T @ X. Every GEMM here is bf16
operands with fp32 accumulation, as the tensor cores do.
"""
import argparse

import numpy as np

from llmc.bf16 import round_bf16


def errors(rows: int = 256, C: int = 96, V: int = 50257, Vp: int = 50304, tile: int = 128, seed: int = 0,
           offsets=(None, 0.0, 40.0, -40.0)) -> dict:
    """{'today': (loss, dinp, dwte), 'B=...': (...), ...}: each the largest error relative to the largest
    float64 value. offsets: where B sits, None the median row maximum, +x the largest row maximum + x, -x the
    smallest row maximum - x, 0.0 B = 0."""
    rng = np.random.default_rng(seed)
    N = rows
    x = (rng.standard_normal((N, C)) * rng.uniform(0.3, 1.6, (N, 1))).astype(np.float32)  # row maxima spread
    W = (rng.standard_normal((Vp, C)) * 0.35).astype(np.float32)
    W[V:] = 0
    tgt = rng.integers(0, V, N)
    dloss = 1.0 / N
    rows_ = np.arange(N)
    logit64 = x.astype(np.float64) @ W.astype(np.float64).T
    logit64[:, V:] = -np.inf
    rowmax = logit64.max(1)
    lse64 = rowmax + np.log(np.exp(logit64 - rowmax[:, None]).sum(1))
    d64 = np.exp(logit64 - lse64[:, None])
    d64[rows_, tgt] -= 1
    d64 *= dloss
    ref = (lse64 - logit64[rows_, tgt], d64 @ W.astype(np.float64), d64.T @ x.astype(np.float64))

    def rel(got):
        return tuple(float(np.abs(g - r).max() / np.abs(r).max()) for g, r in zip(got, ref))

    Wb, xb = round_bf16(W), round_bf16(x)
    acc = (xb @ Wb.T).astype(np.float32)  # the lm head's fp32 accumulator on bf16 operands
    out = {}
    lg = round_bf16(acc)
    lg[:, V:] = -np.inf
    m = lg.max(1, keepdims=True)
    e = np.exp(lg - m)
    s = e.sum(1, keepdims=True)
    d = e / s
    d[rows_, tgt] -= 1
    d = round_bf16((d * dloss).astype(np.float32))
    out["today"] = rel((np.log(s[:, 0]) + m[:, 0] - lg[rows_, tgt], d @ Wb, d.T @ xb))
    for off in offsets:
        B = np.float32(np.median(rowmax) if off is None else 0.0 if off == 0 else
                       rowmax.max() + off if off > 0 else rowmax.min() + off)
        pp = np.exp(acc - B)
        pp[:, V:] = 0
        ssum = pp.reshape(N, -1, tile).sum(2, dtype=np.float32).sum(1, dtype=np.float32)
        c = (np.float32(dloss) / ssum).astype(np.float32)
        st = round_bf16(pp)
        loss = np.log(ssum.astype(np.float64)) - np.log(st[rows_, tgt].astype(np.float64))
        st[rows_, tgt] = round_bf16((st[rows_, tgt] - ssum).astype(np.float32))
        xs = round_bf16((c[:, None] * xb).astype(np.float32))
        dinp = round_bf16((c[:, None] * round_bf16((st @ Wb).astype(np.float32))).astype(np.float32))
        out[f"B={float(B):.1f}"] = rel((loss, dinp, st.T @ xs))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offsets", type=float, nargs="*", default=None,
                    help="where B sits: 0 (B = 0), +x (largest row maximum + x), -x (smallest - x); unset: the "
                         "median row maximum, 0, +40, -40")
    args = ap.parse_args()
    offsets = (None, 0.0, 40.0, -40.0) if args.offsets is None else tuple(args.offsets)
    print(f"{'':12s} {'loss':>9s} {'dinp':>9s} {'dwte':>9s}   (largest error / largest float64 value)")
    for name, (a, b, c) in errors(args.rows, seed=args.seed, offsets=offsets).items():
        print(f"{name:12s} {a:9.2e} {b:9.2e} {c:9.2e}")


if __name__ == "__main__":
    main()
