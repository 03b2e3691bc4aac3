"""Classifier: fused softmax + cross-entropy loss + the logit gradient, over llm.c's padded vocabulary.

    python dev/cuda/classifier.py                 # validate + time every variant at N=4096, Vp=50304
    python dev/cuda/classifier.py 4               # one variant
    python -m pytest tests/test_classifier.py -q  # numpy references vs torch (add -m gpu on a GPU)

Semantics (docs/ops.md), for launch(losses, logits, targets, dloss, write_dlogits):
    losses(N) =      losses[i] = -log softmax(logits[i, :V])[targets[i]]
    logits(N, Vp)    read; if write_dlogits, overwritten in place with the gradient of
                     sum_i dloss * losses[i]: (softmax - onehot(targets[i])) * dloss on columns < V,
                     0 on the padded columns V..Vp-1
    targets(N) int32 in [0, V)
The padded columns never affect the loss or the gradient (they may hold anything, NaN included).
Shapes may carry extra leading dims ((B, T, Vp) logits, (B, T) losses/targets): N = B*T rows.

bf16 builds (variants 1, 2, 3; `build(rt, n, "bf16", ...)`): logits (and the gradient written over
them) are bf16, losses stay fp32. The softmax statistics, the loss and each gradient value are fp32
arithmetic on the exactly widened bf16 logits; the gradient is rounded to bf16 once, on its store.
The cpu launcher takes bf16 logits too (uint16 bits, llmc/bf16.py): it computes in float32 and
rounds the gradient the same way.
"""
from __future__ import annotations

import numpy as np

from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import LLMCError
from llmc.ops import OpSpec, Variant, refuse, check_block_size, esize

MODULE = "classifier"  # cuda/classifier.cu
OP = "classifier"
SMEM_LIMIT_SM90 = 227 * 1024  # opt-in shared memory per block on Hopper; build checks the real device

# ----------------------------------------------------------------------------------------------
# numpy references


def classifier_forward_ref(logits, targets, V):
    """(losses(N), probs(N, V)) for logits (N, Vp) (any leading dims flatten to N), in the logits'
    dtype. Only the first V columns are read."""
    Vp = logits.shape[-1]
    x = logits.reshape(-1, Vp)[:, :V]
    t = np.asarray(targets).reshape(-1)
    if t.size and (t.min() < 0 or t.max() >= V):
        raise LLMCError(f"classifier: targets must lie in [0, {V}), got [{t.min()}, {t.max()}]")
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    s = e.sum(axis=1, keepdims=True)
    probs = e / s
    rows = np.arange(x.shape[0])
    losses = np.log(s[:, 0]) - x[rows, t]  # -(x_t - max - log sum)
    return losses, probs


def classifier_backward_ref(probs, targets, dloss, Vp):
    """dlogits(N, Vp): (probs - onehot(targets)) * dloss on the first V columns, 0 on the padding."""
    N, V = probs.shape
    t = np.asarray(targets).reshape(-1)
    d = np.zeros((N, Vp), probs.dtype)
    d[:, :V] = probs
    d[np.arange(N), t] -= 1.0
    d[:, :V] *= dloss
    return d


def classifier_cpu(N, V, Vp, **_):
    """The numpy backend: launch(losses, logits, targets, dloss, write_dlogits) in place, with the
    GPU variants' semantics. Works in the arrays' dtype (float32 for training, float64 for tests);
    one exp over the (N, V) block and no Python loop, so N=256 x V=50257 takes well under a second.
    bf16 logits (uint16 bits): float32 arithmetic on the widened values, the gradient rounded to
    bf16 once (what the bf16 kernels do)."""
    def launch(losses, logits, targets, dloss, write_dlogits):
        if logits.dtype == BF16:
            x = from_bf16(logits).reshape(logits.shape)
            launch(losses, x, targets, dloss, write_dlogits)
            if write_dlogits:
                logits[...] = to_bf16(x).reshape(logits.shape)
            return
        L = logits.reshape(N, Vp)  # views: the arrays are contiguous
        t = np.asarray(targets).reshape(N)
        x = L[:, :V]
        m = x.max(axis=1, keepdims=True)
        rows = np.arange(N)
        xt = x[rows, t] - m[:, 0]          # read the target logits before anything is overwritten
        e = x - m                          # (N, V) the one temporary
        np.exp(e, out=e)
        s = e.sum(axis=1, keepdims=True)
        losses.reshape(N)[...] = np.log(s[:, 0]) - xt
        if write_dlogits:
            e *= (dloss / s).astype(e.dtype)
            x[...] = e
            x[rows, t] -= L.dtype.type(dloss)
            L[:, V:] = 0
    return launch


# ----------------------------------------------------------------------------------------------
# GPU variants: one block per row (versions 1-3) or a persistent grid (version 4)

ARGTYPES = "PPPfiiii"  # losses, logits, targets, dloss, write_dlogits, N, V, Vp


def _check_common(N, V, Vp, block_size=None, **_):
    if V < 1 or Vp < V:
        return f"need 1 <= V <= Vp, got V={V}, Vp={Vp}"
    if N < 1:
        return f"need N >= 1, got {N}"
    return check_block_size(block_size)


def _check_float4(N, V, Vp, block_size=None, **_):
    return _check_common(N, V, Vp, block_size) or (
        f"Vp={Vp} is not a multiple of 4 (float4 loads of each row)" if Vp % 4 else None)


def _smem_bytes(V):
    return -(-V // 4) * 16  # ceil(V/4) float4s: the row's real columns


def _check_smem(N, V, Vp, block_size=None, **_):
    return _check_float4(N, V, Vp, block_size) or (
        f"a row of V={V} floats needs {_smem_bytes(V):,} bytes of shared memory, more than "
        f"{SMEM_LIMIT_SM90:,}" if _smem_bytes(V) > SMEM_LIMIT_SM90 else None)


def _aligned(logits, number, nbytes=16):
    if logits.ptr % nbytes:
        raise LLMCError(f"{OP} variant {number}: the logits pointer must be {nbytes}-byte aligned "
                        f"({nbytes}-byte vector loads)")


def _row_kernel(rt, number, func, V, smem):
    """The entry point `func` of version `number`, opted in to `smem` bytes of dynamic shared memory
    (a row of V logits; refused in one line where the GPU allows less)."""
    dt = " (bf16)" if "bf16" in func else ""
    k = rt.kernel(MODULE, func, ARGTYPES, label=f"{OP} {number}{dt}")
    if smem > 48 * 1024:
        if smem > rt.max_smem_optin:
            refuse(OP, number, f"a row of V={V}{dt} needs {smem:,} bytes of shared memory; "
                               f"this GPU allows {rt.max_smem_optin:,} per block")
        k.set_max_dynamic_smem(smem)
    return k


def _build_row_kernel(rt, number, N, V, Vp, block_size, default_bs, smem=0, vec_bytes=0, func=None):
    """The launch of a one-block-per-row kernel (versions 1-3; vec_bytes: the width of its vector
    loads, whose alignment the logits pointer must have)."""
    bs = block_size or default_bs
    k = _row_kernel(rt, number, func or f"classifier_kernel{number}", V, smem)
    grid, block = (N, 1, 1), (bs, 1, 1)
    n32, V32, Vp32 = np.int32(N), np.int32(V), np.int32(Vp)

    def launch(losses, logits, targets, dloss, write_dlogits):
        if vec_bytes:
            _aligned(logits, number, vec_bytes)
        k(grid, block, losses.ptr, logits.ptr, targets.ptr, np.float32(dloss), np.int32(write_dlogits),
          n32, V32, Vp32, smem=smem)
    return launch


def classifier1(rt, N, V, Vp, block_size=None):
    return _build_row_kernel(rt, 1, N, V, Vp, block_size, 1024)


def classifier2(rt, N, V, Vp, block_size=None):
    return _build_row_kernel(rt, 2, N, V, Vp, block_size, 1024, vec_bytes=16)


# bf16 builds: the same kernels instantiated for bf16 logits. A chunk is 8 bf16 (16-byte loads) when
# Vp % 8 == 0 (GPT-2's 50304), else 4 (8-byte loads, the _vec4 entry points): so the bf16 builds
# take exactly the shapes the fp32 ones take (the checks above know no dtype).

def _bf16_vec(Vp):
    """(elements per chunk, entry point suffix) of the bf16 vector kernels for this Vp."""
    return (8, "_bf16") if Vp % 8 == 0 else (4, "_bf16_vec4")


def _smem_bytes_bf16(V, Vp):
    vec, _ = _bf16_vec(Vp)
    return -(-V // vec) * vec * 2  # the row's real columns, in whole chunks of bf16


def classifier1_bf16(rt, N, V, Vp, block_size=None):
    return _build_row_kernel(rt, 1, N, V, Vp, block_size, 1024, func="classifier_kernel1_bf16")


def classifier2_bf16(rt, N, V, Vp, block_size=None):
    vec, suffix = _bf16_vec(Vp)
    return _build_row_kernel(rt, 2, N, V, Vp, block_size, 1024, vec_bytes=2 * vec,
                             func=f"classifier_kernel2{suffix}")


def _row_in_smem(number):
    """Versions 3, 5 and 7 (the row in shared memory, 1024 threads), fp32 and bf16 builds. 3 in bf16: with
    a 100.5 KB row and 32 registers, two blocks share an SM (the kernel's __launch_bounds__(1024, 2)), so
    one row's loads overlap the other's reductions and stores."""
    def fp32(rt, N, V, Vp, block_size=None):
        return _build_row_kernel(rt, number, N, V, Vp, block_size, 1024, smem=_smem_bytes(V), vec_bytes=16)

    def bf16(rt, N, V, Vp, block_size=None):
        vec, suffix = _bf16_vec(Vp)
        return _build_row_kernel(rt, number, N, V, Vp, block_size, 1024, smem=_smem_bytes_bf16(V, Vp),
                                 vec_bytes=2 * vec, func=f"classifier_kernel{number}{suffix}")
    return fp32, bf16


classifier3, classifier3_bf16 = _row_in_smem(3)
classifier5, classifier5_bf16 = _row_in_smem(5)
classifier7, classifier7_bf16 = _row_in_smem(7)


def _build_persistent(rt, number, N, V, Vp, block_size, smem, vec_bytes, func):
    """The launch of a persistent kernel (versions 4 and 6): as many blocks as fit at once (shared
    memory or threads decide), never more than N; each prefetches its next row."""
    bs = block_size or 1024
    k = _row_kernel(rt, number, func, V, smem)
    smem_sm = rt.device.get_attribute(rt.drv.device_attribute.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
    per_sm = max(1, min(2048 // bs, smem_sm // (smem + 1024 + 256)))  # 1 KB per block reserved by the driver
    grid, block = (min(N, rt.sm_count * per_sm), 1, 1), (bs, 1, 1)
    n32, V32, Vp32 = np.int32(N), np.int32(V), np.int32(Vp)

    def launch(losses, logits, targets, dloss, write_dlogits):
        _aligned(logits, number, vec_bytes)
        k(grid, block, losses.ptr, logits.ptr, targets.ptr, np.float32(dloss), np.int32(write_dlogits),
          n32, V32, Vp32, smem=smem)
    return launch


def classifier4(rt, N, V, Vp, block_size=None):
    return _build_persistent(rt, 4, N, V, Vp, block_size, _smem_bytes(V), 16, "classifier_kernel4")


def classifier6(rt, N, V, Vp, block_size=None):
    return _build_persistent(rt, 6, N, V, Vp, block_size, _smem_bytes(V), 16, "classifier_kernel6")


def classifier6_bf16(rt, N, V, Vp, block_size=None):
    # two blocks of 1024 threads an SM (100.5 KB rows, __launch_bounds__(1024, 2)): a persistent grid of
    # 2 x SMs, each block's next row coming in during its write pass
    vec, suffix = _bf16_vec(Vp)
    return _build_persistent(rt, 6, N, V, Vp, block_size, _smem_bytes_bf16(V, Vp), 2 * vec,
                             f"classifier_kernel6{suffix}")


def _with_loss_kernel(number, grad_build, loss_func):
    """Version 8: version `number`'s build for the gradient form, and for the loss-only form (write_dlogits
    = 0) the streaming kernel `loss_func`, one 256-thread block a row (block_size, if given, for both)."""
    def build(rt, N, V, Vp, block_size=None):
        grad = grad_build(rt, N, V, Vp, block_size)
        k = rt.kernel(MODULE, loss_func, ARGTYPES, label=f"{OP} 8 loss{' (bf16)' if 'bf16' in loss_func else ''}")
        vec_bytes = 8 if loss_func.endswith("_vec4") else 16
        grid, block = (N, 1, 1), (block_size or 256, 1, 1)
        n32, V32, Vp32 = np.int32(N), np.int32(V), np.int32(Vp)

        def launch(losses, logits, targets, dloss, write_dlogits):
            if write_dlogits:
                return grad(losses, logits, targets, dloss, write_dlogits)
            _aligned(logits, 8, vec_bytes)
            k(grid, block, losses.ptr, logits.ptr, targets.ptr, np.float32(dloss), np.int32(0), n32, V32, Vp32)
        return launch
    return build


classifier8 = _with_loss_kernel(7, classifier7, "classifier_kernel8_loss")


def classifier8_bf16(rt, N, V, Vp, block_size=None):
    _, suffix = _bf16_vec(Vp)
    return _with_loss_kernel(7, classifier7_bf16, f"classifier_kernel8_loss{suffix}")(rt, N, V, Vp, block_size)


VARIANTS = {
    1: Variant(1, "one block per row, three passes over global memory (max, sum, write), scalar loads",
               {"fp32": classifier1, "bf16": classifier1_bf16}, _check_common),
    2: Variant(2, "one block per row, online softmax: one read pass for max+sum, one write pass; float4, streaming hints",
               {"fp32": classifier2, "bf16": classifier2_bf16}, _check_float4),
    3: Variant(3, "one block per row held in shared memory (cp.async): logits read from DRAM once, written once",
               {"fp32": classifier3, "bf16": classifier3_bf16}, _check_smem),
    4: Variant(4, "version 3 persistent: each block prefetches its next row while writing this row's gradient",
               classifier4, _check_smem),
    5: Variant(5, "version 3 with the exponentials on the SFU (__expf: FMUL + MUFU.EX2, not expf's ~10 "
                  "instructions): the row's ~2 exponentials per logit no longer bound the issue rate",
               {"fp32": classifier5, "bf16": classifier5_bf16}, _check_smem),
    6: Variant(6, "version 4 (persistent, the next row prefetched during this row's write pass) with version 5's "
                  "__expf; fp32 and bf16",
               {"fp32": classifier6, "bf16": classifier6_bf16}, _check_smem),
    7: Variant(7, "version 5 with each exponential one FFMA + MUFU.EX2 (log2e folded in), and 1/s and dloss folded "
                  "into the exponent's offset on the chunks without the target or padding (~10 instructions a logit, 5: ~19)",
               {"fp32": classifier7, "bf16": classifier7_bf16}, _check_smem),
    8: Variant(8, "version 7 (its kernel for the gradient), with the loss-only form (evaluation) streamed from global "
                  "memory through registers by 256-thread blocks: no row staged in shared memory",
               {"fp32": classifier8, "bf16": classifier8_bf16}, _check_smem),
}

# default 3: fastest on the H100 (0.565 ms at N=4096, Vp=50304: 98% of the copy ceiling). It needs
# ceil(V/4)*16 bytes of shared memory per block (201 KB at GPT-2's vocab): an A100 (163 KB) refuses
# it at build, and version 2 (0.575 ms on the H100, no shared-memory limit) is the one to fall back to.
# In bf16 the row needs half that (100.5 KB), so version 3 fits on an A100 too. bf16's default was 5
# (3 with __expf): H100 lab, N=4096: 0.290 ms against 3's 0.331 (95% against 83% of a copy of the
# same bytes); in fp32, 5 and 3 are within 1% (0.565 / 0.569 ms) and 3 keeps expf's last bits.
# Since session 28 both defaults are 7 (each exponential one FFMA + MUFU.EX2; p within ~5e-6 relative
# of expf's): H200 lab, N=4096, bf16 0.212 ms against 5's 0.279 (92% against 70% of a copy), fp32
# 0.411 against 3's 0.442 (94% against 88%); whole steps, bf16 8.33 against 8.46 ms at B=4 and 29.03
# against 29.29 at B=16, fp32 16.67 against 16.80 at B=4 (docs/results/session28_h200_2026-11-28.txt).
# Since session 40 the default is 8: 7's kernel for the gradient (training without the fold), and the
# loss-only form (evaluation; training steps run the fold) streamed through registers.
OPS = [
    OpSpec("classifier", cpu=classifier_cpu, variants=VARIANTS, default=8, flag="--classifier-kernel",
           # logits read once, dlogits written once (the build's dtype); targets int32 read, losses
           # fp32 written (fp32 in both)
           cost=lambda N, V, Vp, dtype="fp32", **_: (0, esize(dtype) * 2 * N * Vp + 4 * 2 * N),
           doc="losses(N)=, logits(N,Vp) in/out, targets(N) int32, dloss, write_dlogits: fused softmax "
               "+ cross-entropy; the logit gradient overwrites the logits, padded columns zeroed"),
]


# ----------------------------------------------------------------------------------------------
# The classifier folded into the lm head's GEMMs (a form of the model, not a variant of this op: its
# launches take the lm head's operands; docs/matmul_notes.md, "The classifier folded into the lm head")

FOLD_INIT = (0, 0, -(1 << 30), 1 << 30, 0)  # ctl: k, flagged rows, largest / smallest lse (log2), done blocks


class Fold:
    """The folded classifier's state and launches, for N rows of V classes (Vp padded), model width C,
    dtype "fp32" (with the TF32 GEMMs) or "bf16":

        f = fold_build(rt, N, V, Vp, C, "bf16")
        f.prime(losses, P, targets, lnf, wte)  # once, unless load_state gave k: k from a sample of rows
        f.forward(P, lnf, wte)               # P (N, Vp) = p' (the lm head's _fold GEMM), f.FS the tile sums
        f.combine(losses, P, targets, lnf, dloss)   # losses, P's folded target elements, f.X, f.cs
        f.fix(losses, P, targets, lnf, wte, dloss)  # the rows out of range, recomputed; the next k
        # backward: dinp = P @ wte, dwte += P^T @ f.X (the usual GEMMs), then
        f.scale(dinp)                        # dinp rows *= f.cs

    k (f.ctl[0]) keeps p' = 2^(logit log2 e - k) in range; the results move with it only by the rounding
    of logit log2 e - k (~5e-6 relative). It moves to the middle of each step's rows (the fix kernel's last
    block); state() / load_state() carry it (the trainer's state file keeps it, so resume is exact). A run
    that starts without it primes it from the first batch (prime)."""

    def __init__(self, rt, N, V, Vp, C, dtype):
        from llmc.ops.gemm_wgmma import wgmma_fold_build
        if dtype not in ("fp32", "bf16"):
            raise LLMCError(f"classifier fold: dtype {dtype!r}; expected fp32 or bf16")
        esize = 4 if dtype == "fp32" else 2
        if (C * esize) % 16 or (Vp * esize) % 16:  # (the GEMM's TMA rows; the combine and scale: 16-byte vectors)
            raise LLMCError(f"classifier fold: rows of C={C} and Vp={Vp} {dtype} values must be multiples of 16 bytes")
        self.rt, self.N, self.V, self.Vp, self.C, self.dtype = rt, N, V, Vp, C, dtype
        tdt = np.float32 if dtype == "fp32" else BF16
        self.gemm = wgmma_fold_build(rt, "bf16" if dtype == "bf16" else "tf32", N, Vp, C, V,
                                     out="bf16" if dtype == "bf16" else "fp32")
        self.tiles = self.gemm.tiles
        self.FS = rt.empty((N, self.tiles), np.float32)
        self.X = rt.empty((N, C), tdt)
        self.cs = rt.empty((N,), np.float32)
        self.flagged = rt.empty((N,), np.int32)
        self.ctl = rt.to_device(np.array(FOLD_INIT, np.int32))
        sfx = "_bf16" if dtype == "bf16" else ""
        self._combine = rt.kernel(MODULE, "classifier_fold_combine" + sfx, "PPPPPPPPPfiiii", label=f"classifier fold combine{sfx}")
        self._fix = rt.kernel(MODULE, "classifier_fold_fix" + sfx, "PPPPPPPPPfiiii", label=f"classifier fold fix{sfx}")
        self._scale = rt.kernel(MODULE, "classifier_fold_scale" + sfx, "PPii", label=f"classifier fold scale{sfx}")
        self._prime = rt.kernel(MODULE, "classifier_fold_prime", "PPii", label="classifier fold prime")
        self.primed = False  # k came from a fix (prime's or a step's) or from load_state
        self.grid_rows = (max(1, min(-(-N // 8), rt.sm_count * 8)), 1, 1)  # 8 warps a block, a warp a row
        self.grid_fix = (rt.sm_count, 1, 1)

    def forward(self, P, lnf, wte):
        self.gemm(P, lnf, wte, self.FS, self.ctl)

    def combine(self, losses, P, targets, lnf, dloss):
        self._combine(self.grid_rows, (256, 1, 1), losses.ptr, P.ptr, self.FS.ptr, targets.ptr, lnf.ptr, self.X.ptr,
                      self.cs.ptr, self.ctl.ptr, self.flagged.ptr, np.float32(dloss), np.int32(self.N),
                      np.int32(self.Vp), np.int32(self.C), np.int32(self.tiles))

    def fix(self, losses, P, targets, lnf, wte, dloss):
        self._fix(self.grid_fix, (1024, 1, 1), losses.ptr, P.ptr, targets.ptr, lnf.ptr, wte.ptr, self.X.ptr,
                  self.cs.ptr, self.ctl.ptr, self.flagged.ptr, np.float32(dloss), np.int32(self.N), np.int32(self.V),
                  np.int32(self.Vp), np.int32(self.C), smem=4 * self.C)

    def prime(self, losses, P, targets, lnf, wte):
        """Before a run's first forward when k came from no state: k from min(N, SMs) of the batch's rows,
        recomputed by the fix kernel (2.5 ms fp32, 3.8 ms bf16, once; H200), so that the step's rows start
        in range whatever the weights' logits are (a pretrained GPT-2's lse can be far from 0; at k = 0 its
        rows would all go through the fix, 20-30 us each). What it writes in P, losses, X and cs, the
        forward's GEMM and combine overwrite."""
        n = min(self.N, self.rt.sm_count)
        self._prime((1, 1, 1), (256, 1, 1), self.ctl.ptr, self.flagged.ptr, np.int32(self.N), np.int32(n))
        self.fix(losses, P, targets, lnf, wte, 1.0)
        self.primed = True

    def scale(self, dinp):
        self._scale(self.grid_rows, (256, 1, 1), dinp.ptr, self.cs.ptr, np.int32(self.N), np.int32(self.C))

    def state(self) -> dict:
        return {"k": int(self.ctl.get()[0])}

    def load_state(self, st: dict) -> None:
        init = np.array(FOLD_INIT, np.int32)
        init[0] = int(st.get("k", 0))
        self.ctl.set(init)
        self.primed = True


def fold_build(rt, N, V, Vp, C, dtype="fp32") -> Fold:
    return Fold(rt, N, V, Vp, C, dtype)


def fold_bytes(N, V, Vp, C, dtype="fp32") -> int:
    """The device memory a Fold allocates (FS, X, cs, flagged, ctl): for the model's early memory check,
    before anything is allocated (bf16 d12 at B=16: 51 MB; fp32: 76 MB)."""
    from llmc.ops.gemm_wgmma import fold_bn
    tiles = -(-Vp // fold_bn(dtype))
    esize = 4 if dtype == "fp32" else 2
    return N * tiles * 4 + N * C * esize + N * 4 + N * 4 + len(FOLD_INIT) * 4
