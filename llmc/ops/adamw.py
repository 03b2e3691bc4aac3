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

bf16 builds (variants 1 and 2), llm.c's mixed precision, for launch(params, grads, m, v, norm2, hp,
master, seed): params (n) bf16, written only; grads (n) bf16; m, v, master (n) fp32 in/out; norm2
(1), hp (8) fp32; seed (1) uint32 on the device. The update above runs on the fp32 master (same
arithmetic), then params = bf16(master): round to nearest even when seed == 0, else stochastic
rounding from sr_bits(seed, offset + i), a hash of the element's index in the whole parameter
buffer (`offset`, a build argument: the range's start), so the bits depend neither on the launch
configuration nor on how the buffer is cut into ranges. adamw_ref_bf16 is the reference (bit-exact
rounding given the master); the cpu launcher takes the same eight arguments.
"""
from __future__ import annotations

import math

import numpy as np

from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import LLMCError
from llmc.ops import OpSpec, Variant, check_block_size, esize

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


# ----------------------------------------------------------------------------------------------
# bf16 parameters: stochastic rounding of the fp32 master (the kernels' hash, bit for bit)


def _mix32(x):
    """cuda/adamw.cu's mix32 on a uint32 array (products wrap modulo 2^32, as on the GPU)."""
    x = x ^ (x >> np.uint32(16))
    x = (x.astype(np.uint64) * 0x7FEB352D & 0xFFFFFFFF).astype(np.uint32)
    x = x ^ (x >> np.uint32(15))
    x = (x.astype(np.uint64) * 0x846CA68B & 0xFFFFFFFF).astype(np.uint32)
    return x ^ (x >> np.uint32(16))


def sr_bits(seed, idx) -> np.ndarray:
    """The 32 random bits the bf16 AdamW kernels use for element idx (its index in the whole
    parameter buffer) under `seed`: a counter-based hash, so no state and no launch configuration."""
    idx = np.asarray(idx, np.uint64)
    s = np.array([int(seed) & 0xFFFFFFFF], np.uint32)
    k0 = _mix32(s)[0]
    k1 = _mix32(np.array([(int(seed) + 0x9E3779B9) & 0xFFFFFFFF], np.uint32))[0]
    lo = (idx & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = (idx >> np.uint64(32)).astype(np.uint32)
    a = _mix32(lo ^ k0).astype(np.uint64) + (hi ^ k1).astype(np.uint64)
    return _mix32((a & np.uint64(0xFFFFFFFF)).astype(np.uint32))


def round_params(master, seed, offset=0) -> np.ndarray:
    """bf16 bits of the fp32 master: round to nearest even if seed == 0, else stochastic rounding:
    add the low 16 random bits of sr_bits(seed, offset + i) to the fp32 bits and cut, so element i
    rounds away from zero with probability (its dropped 16 bits) / 2^16 (unbiased); inf and NaN are
    converted as by round to nearest. What the bf16 AdamW kernels write, bit for bit."""
    f = np.ascontiguousarray(master, np.float32).reshape(-1)
    if int(seed) == 0:
        return to_bf16(f)
    u = f.view(np.uint32).astype(np.uint64)
    r = sr_bits(seed, np.arange(f.size, dtype=np.uint64) + np.uint64(offset)).astype(np.uint64)
    out = ((u + (r & np.uint64(0xFFFF))) >> np.uint64(16)).astype(np.uint16)
    special = ~np.isfinite(f)
    out[special] = to_bf16(f[special])
    return out


def adamw_ref_bf16(master, grads, m, v, norm2, lr, b1, b2, eps, wd, t, max_norm, seed=0, offset=0):
    """One bf16-build AdamW step: adamw_ref (float64) on the master with the bf16 grads (uint16
    bits) widened, then params = round_params(float32(master), seed, offset). Returns (params bf16
    bits, master, m, v) (master, m, v in float64; the inputs are not modified). Against a kernel,
    round its own fp32 master with round_params for a bit-exact check: the float64 master may sit
    on the other side of a bf16 rounding boundary than the kernel's fp32 one."""
    g = from_bf16(grads) if np.asarray(grads).dtype == BF16 else grads
    p, m, v = adamw_ref(master, g, m, v, norm2, lr, b1, b2, eps, wd, t, max_norm)
    return round_params(p.astype(np.float32), seed, offset), p, m, v


def adamw_cpu(n, offset=0, chunks=None, **_):
    """The numpy backend: launch(...) updates params, m, v in place in their own dtype (float32 for
    training, float64 for tests), a chunk at a time so temporaries stay small at 124M params.
    With bf16 params (the bf16 build's launch(params, grads, m, v, norm2, hp, master, seed)): the
    update runs on master (grads widened from bf16), then params = round_params(master, seed)."""
    if chunks:  # variant 3's list of ranges (see chunk_tables): each range as a plain call
        parts = [(adamw_cpu(nc), poff, soff, nc, row) for poff, soff, nc, row, _ in _chunk_list(n, 0, chunks)]

        def launch_chunks(params, grads, m, v, norm2, hp, master=None, seed=None):
            P, H = params.reshape(-1), np.asarray(hp).reshape(-1, 8)
            for c, (one, poff, soff, nc, row) in enumerate(parts):
                sl = slice(soff, soff + nc)
                one(P[poff:poff + nc], grads.reshape(-1)[sl], m.reshape(-1)[sl], v.reshape(-1)[sl], norm2, H[row],
                    *(() if master is None else (master.reshape(-1)[sl], np.asarray(seed).reshape(-1)[c:c + 1])))
        return launch_chunks

    def launch(params, grads, m, v, norm2, hp, master=None, seed=None):
        if master is not None:
            G = from_bf16(grads.reshape(-1)) if grads.dtype == BF16 else grads
            launch(master, G, m, v, norm2, hp)
            s0 = int(np.asarray(seed).reshape(-1)[0])
            params.reshape(-1)[:n] = round_params(master.reshape(-1)[:n], s0, offset)
            return
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


def _check(n, block_size=None, offset=0, **_):
    if n < 1:
        return f"need n >= 1, got {n}"
    if offset < 0:
        return f"offset={offset}: the range's start must be >= 0"
    if n >= 2**31:
        return f"n={n} does not fit the kernels' int32 count"
    return check_block_size(block_size)


def _make_launch(k, grid, block, n):
    n32 = np.int32(n)

    def launch(params, grads, m, v, norm2, hp):
        k(grid, block, params.ptr, grads.ptr, m.ptr, v.ptr, norm2.ptr, hp.ptr, n32)
    return launch


# `offset` (every build): the range's first element in the whole parameter buffer. The fp32 kernels
# don't need it; the bf16 ones hash (seed, offset + i) for the stochastic rounding.

def adamw1(rt, n, block_size=None, offset=0):
    bs = block_size or 256  # H100: 1.264 ms at 256, 1.296 at 512, 1.334 at 1024
    k = rt.kernel(MODULE, "adamw_kernel1", ARGTYPES, label=f"{OP} 1")
    return _make_launch(k, (-(-n // bs), 1, 1), (bs, 1, 1), n)


def _grid2(rt, k, n, bs):
    """grid-stride over n/4 groups of 4: enough blocks to fill the chip, fewer for small ranges"""
    return max(1, min(rt.sm_count * k.resident_blocks(bs), -(-max(n // 4, 1) // bs)))


def adamw2(rt, n, block_size=None, offset=0):
    bs = block_size or 1024  # H100: 1.243 ms at 1024, 1.27-1.28 at 128..512
    k = rt.kernel(MODULE, "adamw_kernel2", ARGTYPES, label=f"{OP} 2")
    return _make_launch(k, (_grid2(rt, k, n, bs), 1, 1), (bs, 1, 1), n)


ARGTYPES_BF16 = "PPPPPPPPiq"  # params, grads, m, v, norm2, hp, master, seed, n, offset (int64)


def _make_launch_bf16(k, grid, block, n, offset):
    n32, off64 = np.int32(n), np.int64(offset)

    def launch(params, grads, m, v, norm2, hp, master, seed):
        k(grid, block, params.ptr, grads.ptr, m.ptr, v.ptr, norm2.ptr, hp.ptr, master.ptr, seed.ptr, n32, off64)
    return launch


def adamw1_bf16(rt, n, block_size=None, offset=0):
    bs = block_size or 256
    k = rt.kernel(MODULE, "adamw_kernel1_bf16", ARGTYPES_BF16, label=f"{OP} 1 (bf16)")
    return _make_launch_bf16(k, (-(-n // bs), 1, 1), (bs, 1, 1), n, offset)


def adamw2_bf16(rt, n, block_size=None, offset=0):
    bs = block_size or 1024  # as fp32 (the same 28 bytes per parameter); not yet measured
    k = rt.kernel(MODULE, "adamw_kernel2_bf16", ARGTYPES_BF16, label=f"{OP} 2 (bf16)")
    return _make_launch_bf16(k, (_grid2(rt, k, n, bs), 1, 1), (bs, 1, 1), n, offset)


# version 3: one launch over a list of ranges. `chunks` = ((poff, soff, n, row), ...): range c is
# params[poff : poff + n] and grads, m, v (and master) [soff : soff + n] (a ZeRO-1 shard holds the
# pieces); it takes hp row `row` (hp (2, 8): row 0 without weight decay, row 1 with) and, in
# bf16, seed[c] with the hash index j of its value j (as a plain build with offset 0 would). Without
# `chunks`, one range of n values at offset `offset`: the plain op, like versions 1 and 2.
ADAMW_TILE = 4096  # values per block (cuda/adamw.cu: ADAMW_TILE)


def _chunk_list(n, offset, chunks):
    """[(poff, soff, n, row, hash offset)] for version 3's table."""
    if not chunks:
        return [(0, 0, n, 0, offset)]
    return [(int(poff), int(soff), int(nc), int(row), 0) for poff, soff, nc, row in chunks]


def chunk_tables(n, offset=0, chunks=None):
    """(ch (C, 5) int64: poff, soff, n, row, hash offset; tiles (blocks, 2) int32: chunk, first value)"""
    ch = np.array(_chunk_list(n, offset, chunks), np.int64).reshape(-1, 5)
    tiles = np.array([(c, j) for c, (_, _, nc, _, _) in enumerate(ch.tolist()) for j in range(0, nc, ADAMW_TILE)],
                     np.int32).reshape(-1, 2)
    return ch, tiles


def _check3(n, block_size=None, offset=0, chunks=None, **_):
    why = _check(n, block_size, offset)
    if why or not chunks:
        return why
    if any(nc < 1 or poff < 0 or soff < 0 or soff + nc > n or row not in (0, 1) for poff, soff, nc, row in chunks):
        return f"chunks: every range needs n >= 1, poff >= 0, 0 <= soff <= soff + n <= {n:,} and row 0 or 1"
    return None


def _tables3(rt, n, offset, chunks):
    ch, tiles = chunk_tables(n, offset, chunks)
    return rt.to_device(ch), rt.to_device(tiles), (len(tiles), 1, 1)


def adamw3(rt, n, block_size=None, offset=0, chunks=None):
    bs = block_size or 256
    k = rt.kernel(MODULE, "adamw_kernel3", "PPPPPPPP", label=f"{OP} 3")
    ch, tiles, grid = _tables3(rt, n, offset, chunks)

    def launch(params, grads, m, v, norm2, hp):
        k(grid, (bs, 1, 1), params.ptr, grads.ptr, m.ptr, v.ptr, norm2.ptr, hp.ptr, ch.ptr, tiles.ptr)
    return launch


def adamw3_bf16(rt, n, block_size=None, offset=0, chunks=None):
    bs = block_size or 256
    k = rt.kernel(MODULE, "adamw_kernel3_bf16", "PPPPPPPPPP", label=f"{OP} 3 (bf16)")
    ch, tiles, grid = _tables3(rt, n, offset, chunks)

    def launch(params, grads, m, v, norm2, hp, master, seed):
        k(grid, (bs, 1, 1), params.ptr, grads.ptr, m.ptr, v.ptr, norm2.ptr, hp.ptr, master.ptr, seed.ptr,
          ch.ptr, tiles.ptr)
    return launch


VARIANTS = {
    1: Variant(1, "one thread per element, scalar loads", {"fp32": adamw1, "bf16": adamw1_bf16}, _check),
    2: Variant(2, "float4 grid-stride, streaming hints; any alignment (scalar head/tail)",
               {"fp32": adamw2, "bf16": adamw2_bf16}, _check),
    3: Variant(3, "one launch over a list of ranges (ZeRO-1's shard pieces), 4096 values per block",
               {"fp32": adamw3, "bf16": adamw3_bf16}, _check3, options=("chunks",)),
}


def cost_adamw(n, dtype="fp32", **_):
    """fp32: read params, grads, m, v and write params, m, v (7 x 4 bytes an element). bf16: read
    grads (2), m, v and the fp32 master (12), write m, v, master (12) and the bf16 params (2): also
    28, by coincidence; the elementwise split differs."""
    if esize(dtype) == 4:
        return 0, 4 * 7 * n
    return 0, 2 * n + 4 * 3 * n + 4 * 3 * n + 2 * n


OPS = [
    OpSpec("adamw", cpu=adamw_cpu, variants=VARIANTS, default=2, flag="--adamw-kernel", options=("chunks",),
           cost=cost_adamw,
           doc="params(n), grads(n), m(n), v(n) in/out, norm2(1), hp(8) = hyperparams(lr, beta1, beta2, eps, "
               "weight_decay, t, max_norm): AdamW on the clipped gradient, clip scale computed on the device"),
]
