"""AdamW with global-norm gradient clipping, in place over one contiguous range of parameters.

    python dev/cuda/adamw.py                 # validate + time every variant at n=124,475,904
    python -m pytest tests/test_adamw.py -q  # reference vs torch.optim.AdamW (add -m gpu on a GPU)

Semantics (docs/ops.md), for launch(params, grads, m, v, norm2, hp), where hp (8 float32, on the
device for the GPU variants) = hyperparams(lr, beta1, beta2, eps, weight_decay, t, max_norm):
    s = max_norm / sqrt(norm2) if max_norm > 0 and sqrt(norm2) > max_norm else 1   (on the device)
    g = s * grads
    m = beta1 m + (1 - beta1) g ;  v = beta2 v + (1 - beta2) g^2                  (in place)
    params -= lr * (mhat / (sqrt(vhat) + eps) + weight_decay * params)             (in place)
    mhat = m / (1 - beta1^t), vhat = v / (1 - beta2^t), t the 1-based step (int).
This is torch.optim.AdamW's update (decoupled weight decay on the old params) applied to the
clipped gradient. grads and norm2 are only read. The hyperparameters come from memory, not from
launch arguments, so that a captured CUDA graph of the update replays with each step's lr and t. The model calls it once per run of tensors that
share a weight-decay flag; any offset works: variant 2 handles a pointer that is not 16-byte
aligned (scalar head and tail; scalar throughout if the four arrays are misaligned differently).
"""
from __future__ import annotations

import math

import numpy as np

from llmc.errors import LLMCError
from llmc.ops import OpSpec, Variant, check_block_size

MODULE = "adamw"  # cuda/adamw.cu
OP = "adamw"

# ----------------------------------------------------------------------------------------------
# numpy reference


def clip_scale(norm2, max_norm) -> float:
    """The factor the gradients are multiplied by: max_norm / ||g|| when clipping bites, else 1."""
    norm = math.sqrt(max(float(np.asarray(norm2).reshape(-1)[0]), 0.0))
    return max_norm / norm if max_norm > 0 and norm > max_norm else 1.0


def _check_t(t):
    if int(t) < 1:
        raise LLMCError(f"adamw: step t must be >= 1 (1-based), got {t}")


HP_FIELDS = ("lr", "beta1", "beta2", "bc1", "bc2", "eps", "weight_decay", "max_norm")


def hyperparams(lr, beta1, beta2, eps, weight_decay, t, max_norm, dtype=np.float32) -> np.ndarray:
    """The hp array the launchers read: (lr, beta1, beta2, 1 - beta1^t, 1 - beta2^t, eps,
    weight_decay, max_norm), the bias corrections computed in double from t (1-based); float32 for
    the GPU kernels, float64 for the numpy backend at float64."""
    _check_t(t)
    return np.array([lr, beta1, beta2, 1.0 - beta1 ** t, 1.0 - beta2 ** t, eps, weight_decay, max_norm], dtype)


def adamw_ref(params, grads, m, v, norm2, lr, b1, b2, eps, wd, t, max_norm):
    """One AdamW step in float64; returns the new (params, m, v) (the inputs are not modified)."""
    _check_t(t)
    p, g, m, v = (np.asarray(a, np.float64) for a in (params, grads, m, v))
    g = g * clip_scale(norm2, max_norm)
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    mhat = m / (1.0 - b1 ** t)
    vhat = v / (1.0 - b2 ** t)
    p = p - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p)
    return p, m, v


def adamw_cpu(n, **_):
    """The numpy backend: launch(...) updates params, m, v in place in their own dtype (float32 for
    training, float64 for tests), a chunk at a time so temporaries stay small at 124M params."""
    def launch(params, grads, m, v, norm2, hp):
        lr, beta1, beta2, bc1, bc2, eps, weight_decay, max_norm = (float(x) for x in np.asarray(hp).reshape(-1)[:8])
        s = clip_scale(norm2, max_norm)
        P, G, M, Vv = (a.reshape(-1) for a in (params, grads, m, v))
        for i in range(0, n, 1 << 20):
            j = min(n, i + (1 << 20))
            p, mm, vv = P[i:j], M[i:j], Vv[i:j]
            g = G[i:j] * s
            mm *= beta1; mm += (1.0 - beta1) * g
            vv *= beta2; vv += (1.0 - beta2) * (g * g)
            denom = np.sqrt(vv / bc2); denom += eps
            upd = (mm / bc1) / denom
            upd += weight_decay * p
            p -= lr * upd
    return launch


# ----------------------------------------------------------------------------------------------
# GPU variants

ARGTYPES = "PPPPPPi"  # params, grads, m, v, norm2, hp, n


def _check(n, block_size=None, **_):
    if n < 1:
        return f"need n >= 1, got {n}"
    if n >= 2**31:
        return f"n={n} does not fit the kernels' int32 count"
    return check_block_size(block_size)


def _make_launch(k, grid, block, n):
    n32 = np.int32(n)

    def launch(params, grads, m, v, norm2, hp):
        k(grid, block, params.ptr, grads.ptr, m.ptr, v.ptr, norm2.ptr, hp.ptr, n32)
    return launch


def adamw1(rt, n, block_size=None):
    bs = block_size or 256  # H100: 1.264 ms at 256, 1.296 at 512, 1.334 at 1024
    k = rt.kernel(MODULE, "adamw_kernel1", ARGTYPES, label=f"{OP} 1")
    return _make_launch(k, (-(-n // bs), 1, 1), (bs, 1, 1), n)


def adamw2(rt, n, block_size=None):
    bs = block_size or 1024  # H100: 1.243 ms at 1024, 1.27-1.28 at 128..512
    k = rt.kernel(MODULE, "adamw_kernel2", ARGTYPES, label=f"{OP} 2")
    # grid-stride over n/4 float4s: enough blocks to fill the chip, fewer for small ranges
    grid = max(1, min(rt.sm_count * k.resident_blocks(bs), -(-max(n // 4, 1) // bs)))
    return _make_launch(k, (grid, 1, 1), (bs, 1, 1), n)


VARIANTS = {
    1: Variant(1, "one thread per element, scalar loads", adamw1, _check),
    2: Variant(2, "float4 grid-stride, streaming hints; any alignment (scalar head/tail)", adamw2, _check),
}

OPS = [
    OpSpec("adamw", cpu=adamw_cpu, variants=VARIANTS, default=2, flag="--adamw-kernel",
           cost=lambda n, **_: (0, 28 * n),  # read params, grads, m, v; write params, m, v
           doc="params(n), grads(n), m(n), v(n) in/out, norm2(1), hp(8) = hyperparams(lr, beta1, beta2, eps, "
               "weight_decay, t, max_norm): AdamW on the clipped gradient, clip scale computed on the device"),
]
