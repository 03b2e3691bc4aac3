"""Attention: causal self-attention forward/backward (the composite of GEMMs and a softmax, and the
fused "flash" kernels), and the two ops of decoding with a KV cache.

    python dev/cuda/attention_forward.py        # every variant at B=4 T=1024 C=768 NH=12, vs torch SDPA
    python dev/cuda/attention_backward.py
    python dev/cuda/attention_decode.py         # one query over a KV cache, batch 1 and 8
    python -m pytest tests/test_attention.py -q # numpy references vs torch autograd (add -m gpu on a GPU)

Semantics (docs/ops.md), scale = 1/sqrt(hs), everything causal (position t sees s <= t):
    attention_forward(out=, qkvr=, saved=, inp)   inp (B,T,3C) -> out (B,T,C); qkvr holds q|k|v,
                                                  each (B,NH,T,hs), one after the other; saved is what
                                                  backward reads: att (B,NH,T,T) (variant 1, the
                                                  numpy backend) or its log-sum-exp (B,NH,T) (2, 3)
    attention_backward(dinp=, dout, qkvr, saved, out)   dinp (B,T,3C) is overwritten
    attention_decode(out=, qkv, kcache+=, vcache+=, pos)   one new token per row at position pos
                                                  (read from the device): its k, v appended to the
                                                  caches (B,NH,maxT,hs), its q attends over 0..pos
    attention_kv_fill(kcache=, vcache=, qkvr)     positions 0..T-1 of the caches from a forward's qkvr

What each variant keeps for backward, which ops it is built from and which flags select it are
declared on its Variant (saves, uses, selected_by; llmc/ops/__init__.py): the backends and the model
read them from there, so a new attention variant is added in this file alone.

Variant 1, the composite: a permute kernel, q k^T and att v in the batched GEMM engine that goes
with the --matmul-kernel number (the engine the matmul variant declares; for backward the
--matmul-backward-kernel's), the chosen softmax variant (llmc/ops/softmax.py) and an unpermute
kernel. Scratch (preatt, y; dy, datt, dpreatt, dqkvr) is allocated once in the builder; one built op
can serve every layer, nothing is carried between calls.

Causal structure: only s <= t matters. Every softmax variant reads only the lower triangle (and
writes the zeros above it). The GEMMs skip most of the upper triangle by splitting the T rows into
`causal_chunks` row blocks: block i computes its rows against columns 0..end of block i only
(QK^T, dy V^T), or sums over K = 0..end of block i only (att@V, dpreatt K), or, for the transposed
products (att^T dy, dpreatt^T q), over K = start of block i..T. With c chunks the GEMM work is
(c+1)/(2c) of the full square. causal_chunks is an int or a pair (wide, narrow): the GEMMs with
(T, T) outputs and those with (T, hs) outputs split differently (see _chunk_plan). Entries of
preatt/datt above the diagonal outside the computed blocks stay unwritten: nothing reads them (the
softmax kernels mask s > t with selects).

Variants 2 and 3, fused (head size 64): one kernel computes q k^T, the online softmax and p v tile
by tile on TF32 tensor cores and keeps only each row's log-sum-exp; backward recomputes the
probabilities in a dq kernel and a dk/dv kernel (cuda/attention.cu says more).

bf16 builds (--precision bf16): variants 2 and 3 of both directions (bf16 tensor cores, mma.sync
m16n8k16 with ldmatrix; fp32 softmax; the saved lse (B,NH,T) and the backward's D stay fp32),
attention_decode 1, 2 and attention_kv_fill 1 (bf16 caches, fp32 math). The composite is fp32 only.

Variant 4 of both directions, Hopper only (sm_90a, cuda/attention_wgmma.cu), bf16 and fp32 (TF32),
the default on Hopper in both: the same fused math on wgmma, tiles brought by the TMA; it keeps /
reads the same lse as 2 and 3, so forward 4 pairs with backward 2, 3 or 4 and backward 4 runs after
forward 2, 3 or 4. Another GPU refuses 4 and gets 3 and 3 with one note.
"""
from __future__ import annotations

import math

import numpy as np

from llmc import switches
from llmc.errors import LLMCError
from llmc.ops import Built, OpSpec, Variant, check_block_size, get, note_once, ptr as _ptr, refuse, softmax
from llmc.ops.softmax import _causal_mask
from llmc.runtime import ceil_div

MODULE = "attention"  # cuda/attention.cu

# ----------------------------------------------------------------------------------------------
# numpy references (float32 or float64: they compute in the inputs' dtype)

softmax_forward_ref = softmax.softmax_forward_ref
softmax_backward_ref = softmax.softmax_backward_ref


def _split_heads(inp, NH):
    """inp (B,T,3C) -> (3, B, NH, T, hs), a view."""
    B, T, C3 = inp.shape
    C = C3 // 3
    return inp.reshape(B, T, 3, NH, C // NH).transpose(2, 0, 3, 1, 4)


def attention_forward_ref(inp, NH):
    """inp (B,T,3C) -> (out (B,T,C), qkvr (B,T,3C) = q|k|v each (B,NH,T,hs), att (B,NH,T,T))."""
    B, T, C3 = inp.shape
    C = C3 // 3
    hs = C // NH
    qkv = np.ascontiguousarray(_split_heads(inp, NH))      # (3, B, NH, T, hs)
    q, k, v = qkv
    preatt = q @ k.swapaxes(-1, -2)                         # (B, NH, T, T)
    att = softmax_forward_ref(preatt, 1.0 / math.sqrt(hs))  # (B, NH, T, T)
    y = att @ v                                             # (B, NH, T, hs)
    out = y.transpose(0, 2, 1, 3).reshape(B, T, C)
    return out, qkv.reshape(B, T, 3 * C), att


def attention_backward_ref(dout, qkvr, att, NH):
    """dout (B,T,C), qkvr (B,T,3C) as written by forward, att (B,NH,T,T) -> dinp (B,T,3C)."""
    B, T, C = dout.shape
    hs = C // NH
    q, k, v = qkvr.reshape(3, B, NH, T, hs)
    dy = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)   # (B, NH, T, hs)
    dv = att.swapaxes(-1, -2) @ dy
    datt = dy @ v.swapaxes(-1, -2)                          # (B, NH, T, T)
    dpreatt = softmax_backward_ref(datt, att, 1.0 / math.sqrt(hs))
    dq = dpreatt @ k
    dk = dpreatt.swapaxes(-1, -2) @ q
    dqkv = np.stack([dq, dk, dv])                           # (3, B, NH, T, hs)
    return dqkv.transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * C)


def attention_decode_ref(q, kcache, vcache, pos):
    """One query per sequence: q (B,C) over kcache/vcache (B,NH,maxT,hs) positions 0..pos -> out (B,C)."""
    B, NH, maxT, hs = kcache.shape
    qh = q.reshape(B, NH, 1, hs)
    k, v = kcache[:, :, :pos + 1], vcache[:, :, :pos + 1]   # (B, NH, pos+1, hs)
    s = (qh @ k.swapaxes(-1, -2)) * q.dtype.type(1.0 / math.sqrt(hs))  # (B, NH, 1, pos+1)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    p = s / s.sum(axis=-1, keepdims=True)
    return (p @ v).reshape(B, NH * hs)


# ----------------------------------------------------------------------------------------------
# cpu launchers (the numpy backend): same argument order as the GPU, outputs written in place



def attention_forward_cpu(B, T, C, NH, qkv_in_place=False, **_):
    """qkv_in_place (the form the model takes when both directions have it): qkvr is inp itself, kept
    unpermuted for backward; nothing is written to it."""
    def launch(out, qkvr, att, inp):
        o, qk, a = attention_forward_ref(inp.reshape(B, T, 3 * C), NH)
        out[...] = o.reshape(out.shape)
        if not qkv_in_place:
            qkvr[...] = qk.reshape(qkvr.shape)
        att[...] = a.reshape(att.shape)
    return launch


def attention_backward_cpu(B, T, C, NH, qkv_in_place=False, colsum=False, **_):
    """qkv_in_place: qkvr is the forward's inp (B,T,3C), unpermuted. colsum: launch(dinp, dbias, ...),
    dbias += dinp's column sums (matmul_backward_bias's cpu sum: the same bits as the two launches)."""
    def launch(dinp, dout, qkvr, att, out=None):
        qk = qkvr.reshape(B, T, 3 * C)
        if qkv_in_place:
            qk = np.ascontiguousarray(_split_heads(qk, NH)).reshape(B, T, 3 * C)
        dinp[...] = attention_backward_ref(dout.reshape(B, T, C), qk, att.reshape(B, NH, T, T), NH).reshape(dinp.shape)

    def launch_colsum(dinp, dbias, dout, qkvr, att, out=None):
        launch(dinp, dout, qkvr, att, out)
        dbias += dinp.reshape(B * T, 3 * C).sum(axis=0)
    return launch_colsum if colsum else launch


def attention_lse_ref(inp, NH):
    """inp (B,T,3C) -> lse (B,NH,T): log sum_{s<=t} exp(scale q_t.k_s), what the fused forward keeps."""
    B, T, C3 = inp.shape
    hs = C3 // 3 // NH
    q, k, _ = _split_heads(inp, NH)
    x = (q @ k.swapaxes(-1, -2)) * inp.dtype.type(1.0 / math.sqrt(hs))
    x = np.where(_causal_mask(T), x, -np.inf)
    mx = x.max(axis=-1, keepdims=True)
    return (mx + np.log(np.exp(x - mx).sum(axis=-1, keepdims=True)))[..., 0]


def att_from_lse(qkvr, lse, NH):
    """The probabilities (B,NH,T,T) the fused backward recomputes: exp(scale q k^T - lse), causal."""
    B, T, C3 = qkvr.shape
    hs = C3 // 3 // NH
    q, k, _ = qkvr.reshape(3, B, NH, T, hs)
    x = (q @ k.swapaxes(-1, -2)) * qkvr.dtype.type(1.0 / math.sqrt(hs)) - lse[..., None]
    mask = _causal_mask(T)
    return np.where(mask, np.exp(np.where(mask, x, 0.0)), 0.0)



# ----------------------------------------------------------------------------------------------
# GPU: permutes between (B, T, S, NH, hs) and (S, B, NH, T, hs)



def _build_permute(rt, kind, B, T, S, NH, hs, dtype="fp32"):
    """kind 'permute': dst (S,B,NH,T,hs) <- src (B,T,S,NH,hs); 'unpermute': the inverse.
    launch(dst, src) with DevArrays or raw pointers. dtype "bf16": the permute only (what the fused
    bf16 builds need), 16-byte moves of 8 bf16 (hs % 8 == 0)."""
    if dtype == "bf16":
        assert kind == "permute" and hs % 8 == 0, (kind, hs)
        vec = 8
        k = rt.kernel(MODULE, "permute_kernel2_bf16", "PPiiiii", label=f"attention {kind} bf16")
    else:
        vec = 4 if hs % 4 == 0 else 1
        k = rt.kernel(MODULE, f"{kind}_kernel{2 if vec == 4 else 1}", "PPiiiii", label=f"attention {kind}")
    n = S * B * NH * T * hs // vec
    bs = 256
    grid = (ceil_div(n, bs), 1, 1)
    args = tuple(np.int32(x) for x in (B, T, S, NH, hs))

    def launch(dst, src):
        k(grid, (bs, 1, 1), _ptr(dst), _ptr(src), *args)
    return launch



# ----------------------------------------------------------------------------------------------
# GPU: the composite (variant 1)



def _check_attention(B, T, C, NH):
    if min(B, T, C, NH) < 1:
        raise LLMCError(f"attention: empty shape B={B} T={T} C={C} NH={NH}")
    if C % NH:
        raise LLMCError(f"attention: C={C} is not divisible by NH={NH}")
    if 3 * B * T * C >= 2**31 or B * NH * T * T >= 2**31:
        raise LLMCError(f"attention: B={B} T={T} C={C} NH={NH} is too large for int32 indexing")


def _softmax_op(rt, op, number, BNH, T, scale):
    """(variant number, launch) for softmax variant `number`; if it refuses this shape, say so in
    one line and use the variant that takes every shape."""
    spec = get(op)
    reason = spec.refuse_reason(number, BNH=BNH, T=T, scale=scale)
    if reason:
        note_once(f"attention: {spec.flag} {number} refuses T={T} ({reason}); using {op} {softmax.FALLBACK}")
        number = softmax.FALLBACK
    return number, spec.build(rt, number, BNH=BNH, T=T, scale=scale).launch


def _chunks(T, n):
    """Row blocks [(t0, t1), ...] for the causal GEMM split into about n blocks. Blocks are
    multiples of 64 rows (the GEMM tile height) so that no tile straddles two blocks needlessly."""
    if n < 1:
        raise LLMCError(f"attention: causal_chunks must be >= 1, got {n}")
    size = max(64, ceil_div(ceil_div(T, n), 64) * 64)
    return [(t0, min(T, t0 + size)) for t0 in range(0, T, size)]


def _chunk_plan(T, causal_chunks):
    """(row blocks for the wide GEMMs, row blocks for the narrow ones). causal_chunks is None (the
    default), an int (both) or a pair (wide, narrow). Wide GEMMs write (T, T) outputs (q k^T,
    dy v^T): every skipped tile saves work and bytes, and each block still has many tiles. Narrow
    ones write (T, hs) (att v, att^T dy, dpreatt k, dpreatt^T q): a block of rows is only
    rows/64 x batch tiles, so many blocks underfill the GPU."""
    cc = DEFAULT_CAUSAL_CHUNKS if causal_chunks is None else causal_chunks
    wide, narrow = (cc, cc) if isinstance(cc, int) else cc
    return _chunks(T, wide), _chunks(T, narrow)


# (wide, narrow), measured on the H100 with GEMM engine 2 at B=4 T=1024 C=768 NH=12 (forward /
# backward ms): (1,1) 0.359/0.539, (2,2) 0.317/0.461, (4,2) 0.319/0.465, (8,2) 0.329/0.478,
# (4,4) -/0.556. (2,2) and (4,2) tie within noise; (2,2) launches fewer GEMMs.
DEFAULT_CAUSAL_CHUNKS = (2, 2)


def gemm_engine(op: str, number: int) -> int:
    """The GEMM engine matmul op `op`'s variant `number` declares (Variant.engine): the composite
    runs its batched products on the engine of the --matmul-kernel (forward) or
    --matmul-backward-kernel (backward) chosen."""
    return get(op).variant(number).engine


def build_attention_forward(rt, softmax_variant, matmul_variant, B, T, C, NH, causal_chunks=None):
    """launch(out (B,T,C), qkvr (B,T,3C), att (B,NH,T,T), inp (B,T,3C)); all outputs overwritten."""
    from llmc.ops.gemm import gemm_build
    _check_attention(B, T, C, NH)
    hs, BNH = C // NH, B * NH
    scale = 1.0 / math.sqrt(hs)
    gv = gemm_engine("matmul_forward", matmul_variant)
    _, softmax = _softmax_op(rt, "softmax_forward", softmax_variant, BNH, T, scale)
    permute = _build_permute(rt, "permute", B, T, 3, NH, hs)
    unpermute = _build_permute(rt, "unpermute", B, T, 1, NH, hs)
    preatt = rt.empty((B, NH, T, T))  # scratch: q k^T, unscaled (the softmax applies the scale)
    y = rt.empty((B, NH, T, hs))      # scratch: att @ v before the unpermute
    F4 = 4  # bytes per float: offsets below are in bytes, added to the pointers at launch
    qkv_bytes = BNH * T * hs * F4     # one of q, k, v inside qkvr

    wide, narrow = _chunk_plan(T, causal_chunks)
    qk = []  # (gemm launch, C byte offset into preatt, A offset into qkvr, B offset into qkvr)
    for t0, t1 in wide:
        # preatt[rows t0:t1, cols 0:t1] = q[t0:t1] @ k[0:t1]^T
        g = gemm_build(rt, gv, False, True, M=t1 - t0, N=t1, K=hs, batch=BNH, lda=hs, ldb=hs, ldc=T,
                       strideA=T * hs, strideB=T * hs, strideC=T * T).launch
        qk.append((g, t0 * T * F4, t0 * hs * F4, qkv_bytes))
    av = []  # (gemm launch, C offset into y, A offset into att, B offset into qkvr)
    for t0, t1 in narrow:
        # y[t0:t1] = att[rows t0:t1, cols 0:t1] @ v[0:t1]  (att is 0 for s > t within the block)
        g = gemm_build(rt, gv, False, False, M=t1 - t0, N=hs, K=t1, batch=BNH, lda=T, ldb=hs, ldc=hs,
                       strideA=T * T, strideB=T * hs, strideC=T * hs).launch
        av.append((g, t0 * hs * F4, t0 * T * F4, 2 * qkv_bytes))
    pre, yp = preatt.ptr, y.ptr

    def launch(out, qkvr, att, inp):
        qp, ap = _ptr(qkvr), _ptr(att)
        permute(qp, inp)                                   # qkvr (3,B,NH,T,hs) <- inp (B,T,3,NH,hs)
        for g, c_off, a_off, b_off in qk:
            g(pre + c_off, qp + a_off, qp + b_off)         # preatt (B,NH,T,T)
        softmax(ap, pre)                                   # att (B,NH,T,T)
        for g, c_off, a_off, b_off in av:
            g(yp + c_off, ap + a_off, qp + b_off)          # y (B,NH,T,hs)
        unpermute(out, yp)                                 # out (B,T,C)
    return Built(launch, scratch={"preatt": preatt, "y": y})


def build_attention_backward(rt, softmax_backward_variant, matmul_backward_variant, B, T, C, NH,
                             causal_chunks=None, lower_only=True):
    """launch(dinp (B,T,3C), dout (B,T,C), qkvr (B,T,3C), att (B,NH,T,T)); dinp overwritten.
    lower_only: with softmax_backward 6, use its entry point that stores only s <= t into a dpreatt
    scratch zeroed here once (nothing else writes dpreatt, so its upper triangle stays 0)."""
    from llmc.ops.gemm import gemm_build
    _check_attention(B, T, C, NH)
    hs, BNH = C // NH, B * NH
    scale = 1.0 / math.sqrt(hs)
    gv = gemm_engine("matmul_backward", matmul_backward_variant)
    sm_number, softmax_bwd = _softmax_op(rt, "softmax_backward", softmax_backward_variant, BNH, T, scale)
    lower_only = lower_only and sm_number == 6
    if lower_only:
        softmax_bwd = softmax.build_backward6_lower(rt, BNH, T, scale)
    to_heads = _build_permute(rt, "permute", B, T, 1, NH, hs)      # dy (B,NH,T,hs) <- dout (B,T,C)
    from_heads = _build_permute(rt, "unpermute", B, T, 3, NH, hs)  # dinp (B,T,3C) <- dqkvr (3,B,NH,T,hs)
    dy = rt.empty((B, NH, T, hs))
    datt = rt.empty((B, NH, T, T))
    dpreatt = rt.zeros((B, NH, T, T)) if lower_only else rt.empty((B, NH, T, T))
    dqkvr = rt.empty((3, B, NH, T, hs))
    F4 = 4
    qkv_bytes = BNH * T * hs * F4
    sTT, sTh = T * T, T * hs

    # each entry: (gemm, C base, C off, A base, A off, B base, B off); bases name a buffer
    wide, narrow = _chunk_plan(T, causal_chunks)
    steps_pre, steps_post = [], []
    for t0, t1 in narrow:
        # dv[s in t0:t1] = att[t >= t0, s]^T @ dy[t >= t0]   (att[t, s] = 0 for t < s)
        g = gemm_build(rt, gv, True, False, M=t1 - t0, N=hs, K=T - t0, batch=BNH, lda=T, ldb=hs, ldc=hs,
                       strideA=sTT, strideB=sTh, strideC=sTh).launch
        steps_pre.append((g, "dqkvr", 2 * qkv_bytes + t0 * hs * F4, "att", (t0 * T + t0) * F4, "dy", t0 * hs * F4))
    for t0, t1 in wide:
        # datt[rows t0:t1, cols 0:t1] = dy[t0:t1] @ v[0:t1]^T
        g = gemm_build(rt, gv, False, True, M=t1 - t0, N=t1, K=hs, batch=BNH, lda=hs, ldb=hs, ldc=T,
                       strideA=sTh, strideB=sTh, strideC=sTT).launch
        steps_pre.append((g, "datt", t0 * T * F4, "dy", t0 * hs * F4, "qkvr", 2 * qkv_bytes))
    for t0, t1 in narrow:
        # dq[t0:t1] = dpreatt[rows t0:t1, cols 0:t1] @ k[0:t1]
        g = gemm_build(rt, gv, False, False, M=t1 - t0, N=hs, K=t1, batch=BNH, lda=T, ldb=hs, ldc=hs,
                       strideA=sTT, strideB=sTh, strideC=sTh).launch
        steps_post.append((g, "dqkvr", t0 * hs * F4, "dpreatt", t0 * T * F4, "qkvr", qkv_bytes))
        # dk[s in t0:t1] = dpreatt[t >= t0, s]^T @ q[t >= t0]
        g = gemm_build(rt, gv, True, False, M=t1 - t0, N=hs, K=T - t0, batch=BNH, lda=T, ldb=hs, ldc=hs,
                       strideA=sTT, strideB=sTh, strideC=sTh).launch
        steps_post.append((g, "dqkvr", qkv_bytes + t0 * hs * F4, "dpreatt", (t0 * T + t0) * F4, "qkvr", t0 * hs * F4))
    own = {"dy": dy.ptr, "datt": datt.ptr, "dpreatt": dpreatt.ptr, "dqkvr": dqkvr.ptr}

    def launch(dinp, dout, qkvr, att, out=None):  # out: the fused backward's argument, unused here
        base = dict(own, qkvr=_ptr(qkvr), att=_ptr(att))
        to_heads(own["dy"], dout)                                      # dy (B,NH,T,hs)
        for g, cb, co, ab, ao, bb, bo in steps_pre:                    # dv, datt
            g(base[cb] + co, base[ab] + ao, base[bb] + bo)
        softmax_bwd(own["dpreatt"], own["datt"], base["att"])          # dpreatt (B,NH,T,T)
        for g, cb, co, ab, ao, bb, bo in steps_post:                   # dq, dk
            g(base[cb] + co, base[ab] + ao, base[bb] + bo)
        from_heads(dinp, own["dqkvr"])                                 # dinp (B,T,3C)
    return Built(launch, scratch={"dy": dy, "datt": datt, "dpreatt": dpreatt, "dqkvr": dqkvr},
                 keep=frozenset({"dpreatt"}) if lower_only else frozenset())  # keep: contents must persist



# ----------------------------------------------------------------------------------------------
# GPU: fused ("flash") attention, head size 64 (cuda/attention.cu, flash_attention_*_kernel2/3)



FLASH_HS = 64   # the kernels' head size (every GPT-2 size has 64)
FLASH_TILE = 64  # rows per block, positions per tile


def _check_flash_tf32(B, T, C, NH, **_):
    """Variant 4's fp32 (TF32) builds: the fused kernels' shapes (q, k, v in place or permuted)."""
    return _check_flash(B, T, C, NH)


def _check_flash(B, T, C, NH, **_):
    bad = _check_composite(B, T, C, NH)
    if bad:
        return bad
    if C // NH != FLASH_HS:
        return f"head size C/NH = {C // NH}: the fused kernels are written for head size {FLASH_HS}"
    if 3 * B * T * C >= 2**31:
        return f"3*B*T*C = {3 * B * T * C:,} does not fit int32 indexing"
    return None


def _flash_smem(kind, version, dtype="fp32"):
    """Dynamic shared memory in bytes of a flash kernel (the layout is described in cuda/attention.cu):
    tiles of 64 rows, 68 floats (fp32) or 72 bf16 (bf16) each, plus fp32 rows of lse / D."""
    tile_bytes, pipe = (FLASH_TILE * 68 * 4) if dtype == "fp32" else (FLASH_TILE * 72 * 2), version == 3
    tiles, rows = {"fwd": (4 if pipe else 2, 0),
                   "dq": (4 if pipe else 2, 1),
                   "dkdv": (6 if pipe else 4, 4 if pipe else 2)}[kind]
    return tiles * tile_bytes + 4 * rows * FLASH_TILE


def _flash_kernel(rt, name, argtypes, kind, version, label, defines=None, dtype="fp32", suffix=""):
    """The kernel <name><version>[_bf16]<suffix> (suffix: an instantiation, e.g. _rows128) and its
    dynamic shared memory, opted in."""
    dt = "_bf16" if dtype == "bf16" else ""
    k = rt.kernel(MODULE, f"{name}{version}{dt}{suffix}", argtypes, label=label + (" bf16" if dt else "") + suffix,
                  defines=defines)
    smem = _flash_smem(kind, version, dtype)
    if smem > rt.max_smem_optin:
        refuse(label.split()[0], version, f"needs {smem} bytes of shared memory, the device allows {rt.max_smem_optin}")
    k.set_max_dynamic_smem(smem)
    return k, smem


def build_flash_attention_forward(rt, B, T, C, NH, version=2, defines=None, dtype="fp32", rows=64, **_):
    """launch(out (B,T,C), qkvr (B,T,3C), lse (B,NH,T), inp (B,T,3C)): the permute into qkvr, then
    one fused kernel writing out and the per-row log-sum-exp (saved for backward) for backward.
    version 2: tiles staged by the threads; 3: cp.async double-buffered. dtype "bf16": out, qkvr,
    inp bf16, lse fp32; bf16 tensor cores (m16n8k16), fp32 softmax. rows: query rows per block, 64,
    or 128 for bf16 (a warp owns two m-tiles: each k, v fragment read once for both; the lab
    measures it against 64, the default)."""
    _check_attention(B, T, C, NH)
    if rows not in (64, 128) or (rows == 128 and dtype != "bf16"):
        raise LLMCError(f"attention_forward {version} (flash): rows={rows}: have 64, and 128 for bf16")
    permute = _build_permute(rt, "permute", B, T, 3, NH, FLASH_HS, dtype)
    k, smem = _flash_kernel(rt, "flash_attention_forward_kernel", "PPPiiif", "fwd", version,
                            f"attention_forward {version} (flash)", defines, dtype,
                            suffix="_rows128" if rows == 128 else "")
    grid, block = (ceil_div(T, rows), B * NH, 1), (128, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))

    def launch(out, qkvr, lse, inp):
        permute(qkvr, inp)
        k(grid, block, _ptr(out), _ptr(lse), _ptr(qkvr), *args, smem=smem)
    return launch


def build_flash_attention_backward(rt, B, T, C, NH, version=2, defines=None, dtype="fp32", **_):
    """launch(dinp (B,T,3C), dout (B,T,C), qkvr (B,T,3C), lse (B,NH,T), out (B,T,C)): two kernels,
    dq (also writing D = rowsum(dout * out)) then dk, dv; dinp overwritten, no atomics. dtype
    "bf16": dinp, dout, qkvr, out bf16; lse and the scratch D fp32; dq, dk, dv accumulate in fp32
    registers and are rounded once on the store."""
    _check_attention(B, T, C, NH)
    D = rt.scratch((B, NH, T))  # fp32 in both builds
    label = f"attention_backward {version} (flash)"
    kq, smq = _flash_kernel(rt, "flash_attention_backward_dq_kernel", "PPPPPPiiif", "dq", version, label + " dq",
                            defines, dtype)
    kkv, smkv = _flash_kernel(rt, "flash_attention_backward_dkdv_kernel", "PPPPPiiif", "dkdv", version,
                              label + " dk dv", defines, dtype)
    grid, block = (ceil_div(T, FLASH_TILE), B * NH, 1), (128, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))

    def launch(dinp, dout, qkvr, lse, out):
        kq(grid, block, _ptr(dinp), _ptr(D), _ptr(dout), _ptr(out), _ptr(qkvr), _ptr(lse), *args, smem=smq)
        kkv(grid, block, _ptr(dinp), _ptr(dout), _ptr(qkvr), _ptr(lse), _ptr(D), *args, smem=smkv)
    return Built(launch, scratch={"D": D})



# ----------------------------------------------------------------------------------------------
# GPU: fused attention on Hopper wgmma + TMA, bf16 (cuda/attention_wgmma.cu, sm_90a)


WGMMA_MODULE = "attention_wgmma"
WGMMA_BQ = 128                  # query rows per CTA (2 consumer warpgroups x 64) = keys per k/v tile
WGMMA_STAGES = 2                # k/v ring depth
# dynamic shared memory of flash_attention_forward_kernel4_bf16 (FWD_SMEM in the .cu): 1 KB of
# alignment slack, q (128 x 128 bytes), STAGES x (k + v tiles), 1 + 2 STAGES mbarriers
WGMMA_FWD_SMEM = 1024 + WGMMA_BQ * 128 + WGMMA_STAGES * 2 * WGMMA_BQ * 128 + 8 * (1 + 2 * WGMMA_STAGES)


FLOAT32 = 7  # CU_TENSOR_MAP_DATA_TYPE_FLOAT32 (attention_backward 5's dq reductions)


def _bf16_tensor_map(ptr: int, dims, strides, box, what: str, dtype_code: int = 9) -> bytes:
    """A 128-byte CUtensorMap of a bf16 tensor (dims innermost first, strides in bytes of dims 1..),
    read in boxes of `box`, 128-byte swizzled; out-of-bounds elements are zero-filled (and skipped by
    stores and reductions). dtype_code: the CUtensorMapDataType (9 bfloat16; 11 tfloat32: fp32 rounded
    to tf32 as it is copied; 7 float32)."""
    import ctypes
    from llmc.ops.gemm_wgmma import L2_PROMOTION_256B, SWIZZLE_128B, _driver
    n = len(dims)
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63          # CUtensorMap is 64-byte aligned
    err = _driver().cuTensorMapEncodeTiled(addr, dtype_code, n, ctypes.c_void_p(ptr), (ctypes.c_uint64 * n)(*dims),
                                           (ctypes.c_uint64 * (n - 1))(*strides), (ctypes.c_uint32 * n)(*box),
                                           (ctypes.c_uint32 * n)(*([1] * n)),
                                           0, SWIZZLE_128B, L2_PROMOTION_256B, 0)      # 0: OOB filled with 0
    if err != 0:
        raise LLMCError(f"{what}: cuTensorMapEncodeTiled failed (CUresult {err}) at 0x{ptr:x}")
    return ctypes.string_at(addr, 128)


def qkvr_tensor_map(ptr: int, B: int, NH: int, T: int) -> bytes:
    """The TMA's 128-byte CUtensorMap of qkvr (3, B, NH, T, 64) bf16 seen as a 3D tensor (64 dims,
    T rows, 3*B*NH slabs), read in boxes of (64, 128, 1), 128-byte swizzled; rows past T of a slab
    are zero-filled (never the next head's rows)."""
    return _bf16_tensor_map(ptr, (FLASH_HS, T, 3 * B * NH), (FLASH_HS * 2, T * FLASH_HS * 2),  # bytes: next row, slab
                            (FLASH_HS, WGMMA_BQ, 1), f"attention 4: qkvr (B={B} NH={NH} T={T})")


def btc_tensor_map(ptr: int, B: int, T: int, NH: int, what: str = "attention_backward 4: dout",
                   rows: int = WGMMA_BQ) -> bytes:
    """The CUtensorMap of a (B,T,C) bf16 tensor (dout for attention_backward 4) seen as 4D (64 dims, NH
    heads, T rows, B), read in boxes of (64, 1, rows, 1): one head's 128 rows (by default) of 128 bytes,
    128-byte swizzled like a qkvr box; rows past T are zero-filled (never the next batch row's) and not
    written by a store."""
    C = NH * FLASH_HS
    return _bf16_tensor_map(ptr, (FLASH_HS, NH, T, B), (FLASH_HS * 2, C * 2, T * C * 2),  # bytes: head, row, batch
                            (FLASH_HS, 1, rows, 1), f"{what} (B={B} T={T} C={C})")


def qkv_tensor_map(ptr: int, B: int, T: int, NH: int) -> bytes:
    """The CUtensorMap of the qkv matmul's output (B,T,3C) bf16, unpermuted: btc_tensor_map's 4D view with
    3*NH heads (q of head h is head h, k head NH + h, v head 2*NH + h), boxes of one head's 128 rows."""
    return btc_tensor_map(ptr, B, T, 3 * NH, "attention 4: qkv")


def out_tensor_map(ptr: int, B: int, T: int, NH: int) -> bytes:
    """The CUtensorMap of the forward's out (B,T,C) bf16 for the persistent kernels' TMA store: btc_tensor_map
    in boxes of one consumer's 64 rows of a head (rows past T are not written)."""
    return btc_tensor_map(ptr, B, T, NH, "attention_forward 4: out", rows=64)


def _fwd_o_staged(stages):
    """Whether the persistent forward with this ring stores out through shared memory and the TMA
    (fwd_o_staged in the .cu: up to 5 stages; 6 and the staging would not fit)."""
    return stages <= 5


def _fwd_p_smem(stages):
    """The persistent forward's dynamic shared memory (fwd_p_smem(ST) in the .cu): 1 KB of slack, two q
    buffers, `stages` x (k + v tiles), the consumers' staged out rows (2 x 64 x 128 bytes, up to 5 stages),
    4 + 2 stages mbarriers."""
    staged = 2 * 64 * 128 if _fwd_o_staged(stages) else 0
    return 1024 + 2 * WGMMA_BQ * 128 + stages * 2 * WGMMA_BQ * 128 + staged + 8 * (4 + 2 * stages)


WGMMA_FWD_P_SMEM = _fwd_p_smem(WGMMA_STAGES)


# the persistent builds in the .cu (FWD_PERSISTENT): (pingpong, overlap, stages)
WGMMA_FWD_PERSISTENT = {(False, False, 2), (True, False, 2), (True, False, 4), (False, True, 4), (True, True, 3),
                        (True, True, 4), (True, True, 5), (True, True, 6)}
WGMMA_FWD_OVERLAP_STAGES = 4  # the default forward's k/v ring (persistent, overlap, ping-pong)


def build_flash_attention_forward_wgmma(rt, B, T, C, NH, overlap=True, qkv_in_place=False, pingpong=True,
                                        persistent=True, stages=None, **_):
    """Variant 4's bf16 build: launch(out (B,T,C), qkvr (B,T,3C), lse (B,NH,T), inp (B,T,3C)) like the
    bf16 builds of 2, 3 (out, qkvr, inp bf16; lse fp32, read by attention_backward 2/3/4): one wgmma
    kernel per (b, h, 128 query rows) that reads q, k, v straight from inp, the qkv matmul's output,
    through a tensor map of it (4D: dims, 3*NH heads, T, B), and the bf16 permute of inp into qkvr
    for backward 2, 3 (and 4's permuted build) to read. qkv_in_place: no permute; what backward
    reads is inp itself (the caller passes the same tensor as qkvr and inp, and builds backward 4 with
    qkv_in_place too): the model's form in training when both directions are 4. The map holds inp's
    address: one map per inp pointer (each layer has its own in place), encoded and copied to the
    device at its first launch, so a captured graph replays the same maps. The persistent kernels store
    out through shared memory and the TMA (up to 5 stages; cuda/attention_wgmma.cu, forward_store_tma):
    their maps are per (inp, out) pair, inp's then out's.
    The schedule (every build gives the same bits): persistent, one CTA per SM walking the (b, h, query
    block) items, q double-buffered (else one CTA per block); overlap, the next tile's q k^T issued before
    this tile's p v, so the softmax overlaps the tensor cores within a warpgroup (FlashAttention-3's
    intra-warpgroup overlap); pingpong, the two consumer warpgroups take turns issuing their products
    (its inter-warpgroup schedule); stages, the k/v ring's depth (persistent only: WGMMA_FWD_PERSISTENT
    lists the builds; default 4 with overlap, else 2). The default, all three with 4 stages, measured
    fastest on the H100 (bf16, in place, interleaved, 5 rounds; docs/ops.md "Session 17": B=16 0.1015 ms
    against 0.1115 for persistent ping-pong without overlap and 0.1106 without either; B=4 0.0296 against
    0.0334 and 0.0331); overlap needs the deeper ring (a consumer holds two stages at once)."""
    _check_attention(B, T, C, NH)
    if stages is None:
        stages = WGMMA_FWD_OVERLAP_STAGES if persistent and overlap else WGMMA_STAGES
    if persistent:
        assert (pingpong, overlap, stages) in WGMMA_FWD_PERSISTENT, \
            f"no persistent build with pingpong={pingpong} overlap={overlap} stages={stages}"
    else:
        assert stages == WGMMA_STAGES, f"one CTA per block: {WGMMA_STAGES} stages only"
    permute = None if qkv_in_place else _build_permute(rt, "permute", B, T, 3, NH, FLASH_HS, "bf16")
    sfx = ("_persistent" if persistent else "") + ("_overlap" if overlap else "") + ("_pingpong" if pingpong else "") \
        + (f"_s{stages}" if stages != WGMMA_STAGES else "")
    k = rt.kernel(WGMMA_MODULE, "flash_attention_forward_kernel4_bf16" + sfx, "PPPiiif",
                  label="attention_forward 4 (flash, wgmma) bf16" + sfx.replace("_", " "))
    smem = _fwd_p_smem(stages) if persistent else WGMMA_FWD_SMEM
    if smem > rt.max_smem_optin:
        refuse("attention_forward", 4, f"needs {smem} bytes of shared memory, the device allows {rt.max_smem_optin}")
    k.set_max_dynamic_smem(smem)
    items = B * NH * ceil_div(T, WGMMA_BQ)
    grid, block = ((min(items, rt.sm_count), 1, 1) if persistent else (B * NH, ceil_div(T, WGMMA_BQ), 1)), (384, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))
    maps: dict = {}

    def launch(out, qkvr, lse, inp):
        ip = _ptr(inp)
        if permute is not None:
            permute(qkvr, inp)
        elif _ptr(qkvr) != ip:
            raise LLMCError("attention_forward 4 (qkv in place): qkvr must be inp, the tensor backward 4 reads "
                            f"(got 0x{_ptr(qkvr):x} and 0x{ip:x})")
        # the persistent kernels' maps: inp's, then out's (their TMA store; 128 bytes each, back to back)
        op = _ptr(out) if persistent else 0
        dm = maps.get((ip, op))
        if dm is None:  # first launch on this (inp, out): encode the maps, copy them to the device
            if ip & 15:
                raise LLMCError(f"attention_forward 4: inp must be 16-byte aligned for the TMA (0x{ip:x})")
            if op & 15:
                raise LLMCError(f"attention_forward 4: out must be 16-byte aligned for the TMA (0x{op:x})")
            two = qkv_tensor_map(ip, B, T, NH) + (out_tensor_map(op, B, T, NH) if persistent else b"")
            dm = maps[(ip, op)] = rt.to_device(np.frombuffer(two, np.uint8))
        k(grid, block, _ptr(out), _ptr(lse), dm.ptr, *args, smem=smem)
    return launch


# flash_attention_forward_kernel4_tf32 (TF_FWD_SMEM in the .cu): 1 KB of slack, q (128 rows x 256 bytes),
# STAGES x (k 128 x 256 bytes + vt 64 x 512 bytes [+ SMT: v 128 x 256 bytes]), 1 + 3 STAGES mbarriers
WGMMA_TF32_FWD_SMEM = 1024 + WGMMA_BQ * 256 + WGMMA_STAGES * (WGMMA_BQ * 256 + 64 * WGMMA_BQ * 4) + 8 * (2 + 3 * WGMMA_STAGES)
WGMMA_TF32_FWD_SMEM_SMT = WGMMA_TF32_FWD_SMEM + WGMMA_STAGES * WGMMA_BQ * 256

TF32_GLOBAL_TRANSPOSE_MAX = 40 << 20  # bytes of transposed copies that the H100's 50 MB L2 keeps
TF32_GLOBAL_TRANSPOSE_BPS = 4.0e12    # a DRAM peak from which the global passes win at any size (the H200's)


def _tf32_transposed_bytes(B, T, NH) -> int:
    """One transposed copy (B*NH, 64, Tp) fp32, Tp = T rounded up to 8 (vt, kt, qt, dot)."""
    return 4 * B * NH * FLASH_HS * ceil_div(T, 8) * 8


def _tf32_smem_transpose(B, T, NH, copies: int, rt=None) -> bool:
    """The TF32 kernels' default form: transposes in shared memory (the _smt kernels) where the global
    transposes' `copies` buffers would not fit in the L2 and the DRAM is slower than
    TF32_GLOBAL_TRANSPOSE_BPS; else separate passes over global memory. H100 (3.35 TB/s), d12 fp32 step
    (session 11), backward (3 copies): B=4 (37.7 MB) 19.82 ms global against 19.98 in shared memory;
    B=16 (151 MB) 69.64 global against 68.62. H200 (4.8 TB/s; session 37, both forms of forward and
    backward, in turn): B=16 58.65 global against 59.22, B=4 16.26 against 16.49. rt: the device
    (rt.dram_peak, bytes/s), None or without it: the H100's rule. LLMC_TF32_SMEM_TRANSPOSE=1|0 forces
    one form (whole-step A/Bs)."""
    asked = switches.flag("LLMC_TF32_SMEM_TRANSPOSE")
    if asked is not None:
        return asked
    if (getattr(rt, "dram_peak", None) or 0) >= TF32_GLOBAL_TRANSPOSE_BPS:
        return False
    return copies * _tf32_transposed_bytes(B, T, NH) > TF32_GLOBAL_TRANSPOSE_MAX


def build_flash_attention_forward_wgmma_tf32(rt, B, T, C, NH, qkv_in_place=False, smem_transpose=None, pingpong=None,
                                            persistent=None, **_):
    """Variant 4's fp32 build (TF32 wgmma): launch(out (B,T,C), qkvr (B,T,3C), lse (B,NH,T), inp
    (B,T,3C)) like 2, 3: the fp32 permute of inp into qkvr, then attention_vt_kernel writes v
    transposed (each group of 8 keys in the order the kernel's register P wants, see
    cuda/attention_wgmma.cu) into a scratch vt (B*NH, 64, Tp), Tp = T rounded up to 8, and the wgmma
    kernel reads q and k from qkvr and v^T from vt through three tensor maps (TFLOAT32: the TMA rounds
    to tf32 as it copies). Keeps lse for backward 2/3/4. qkv_in_place: no permute (qkvr must be inp):
    q and k are read from inp, the qkv matmul's output, through 4D maps (64 dims, 3 NH heads, T, B), v
    transposed from it, and backward 4 built with qkv_in_place reads inp too. smem_transpose (None:
    _tf32_smem_transpose's rule): no vt pass; the TMA brings v's tiles too and the producer
    warpgroup's idle warps transpose them in shared memory (the _smt kernels, the same bits).
    pingpong (in place only; None: LLMC_TF32_PINGPONG, default 1): the two consumer warpgroups take
    turns issuing their products, one's softmax beside the other's (the _pp kernels, the same bits;
    H100 lab, B=4: 0.0605 against 0.0625 ms, 113 against 110 TFLOP/s; whole steps unchanged within
    0.2%). persistent (in place with pingpong only; None: LLMC_TF32_PERSISTENT, default 1): one CTA
    per SM walking the (head, query block) items, the k/v ring running on across them (the
    _persistent kernels, the same bits; H100 lab: B=16 with shared-memory transposes 0.221 against
    0.244 ms, 124 TFLOP/s; B=4 with global ones 0.0556 against 0.0608 ms, 123 TFLOP/s)."""
    _check_attention(B, T, C, NH)
    permute = None if qkv_in_place else _build_permute(rt, "permute", B, T, 3, NH, FLASH_HS, "fp32")
    BNH, Tp = B * NH, ceil_div(T, 8) * 8
    smt = _tf32_smem_transpose(B, T, NH, 1, rt) if smem_transpose is None else bool(smem_transpose)
    vt = None if smt else rt.empty((BNH, FLASH_HS, Tp))
    kvt = None if smt else rt.kernel(WGMMA_MODULE, "attention_vt_kernel", "PPiiiiiq", label="attention_forward 4 tf32: v^T")
    if pingpong is None:
        pingpong = switches.on("LLMC_TF32_PINGPONG")
    if persistent is None:
        persistent = switches.on("LLMC_TF32_PERSISTENT")
    persistent = bool(persistent and pingpong and qkv_in_place)
    sfx = (("_btc" if qkv_in_place else "") + ("_smt" if smt else "") + ("_pp" if pingpong and qkv_in_place else "")
           + ("_persistent" if persistent else ""))
    k = rt.kernel(WGMMA_MODULE, "flash_attention_forward_kernel4_tf32" + sfx, "PPPiiif",
                  label="attention_forward 4 (flash, wgmma) tf32" + sfx.replace("_", " "))
    smem = WGMMA_TF32_FWD_SMEM_SMT if smt else WGMMA_TF32_FWD_SMEM
    if smem > rt.max_smem_optin:
        refuse("attention_forward", 4, f"needs {smem} bytes of shared memory, the device allows {rt.max_smem_optin}")
    k.set_max_dynamic_smem(smem)
    items = BNH * ceil_div(T, WGMMA_BQ)
    grid = (min(items, rt.sm_count), 1, 1) if persistent else (BNH, ceil_div(T, WGMMA_BQ), 1)
    block = (384, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))
    maps: dict = {}
    what = f"attention_forward 4 tf32 (B={B} NH={NH} T={T})"

    def launch(out, qkvr, lse, inp):
        qp = _ptr(qkvr)
        if permute is not None:
            permute(qkvr, inp)
            v, layout = qp + 2 * BNH * T * FLASH_HS * 4, (T * FLASH_HS, FLASH_HS, NH * T * FLASH_HS)
        elif qp != _ptr(inp):
            raise LLMCError(f"{what} (qkv in place): qkvr must be inp, the tensor backward 4 reads "
                            f"(got 0x{qp:x} and 0x{_ptr(inp):x})")
        else:  # v: columns 2C.. of each (B,T,3C) row
            v, layout = qp + 2 * C * 4, (FLASH_HS, 3 * C, T * 3 * C)
        if not smt:
            kvt((ceil_div(Tp, 32), BNH, 1), (32, 8, 1), vt.ptr, v, np.int32(NH), np.int32(T), np.int32(Tp),
                np.int32(layout[0]), np.int32(layout[1]), np.int64(layout[2]))
        dm = maps.get(qp)
        if dm is None:  # q rows (box 32 dims x 64 rows), k (and SMT: v) rows (32 x 128), vt (32 keys x 64 dims)
            if qp & 15:
                raise LLMCError(f"{what}: qkvr must be 16-byte aligned for the TMA (0x{qp:x})")
            if qkv_in_place:  # (64 dims, 3 NH heads, T, B): q of head h is head h, k head NH + h
                dims, strides = (FLASH_HS, 3 * NH, T, B), (FLASH_HS * 4, 3 * C * 4, T * 3 * C * 4)
                qbox, kbox = (32, 1, 64, 1), (32, 1, WGMMA_BQ, 1)
            else:
                dims, strides = (FLASH_HS, T, 3 * BNH), (FLASH_HS * 4, T * FLASH_HS * 4)
                qbox, kbox = (32, 64, 1), (32, WGMMA_BQ, 1)
            blob = (_bf16_tensor_map(qp, dims, strides, qbox, what + ": q", 11)
                    + _bf16_tensor_map(qp, dims, strides, kbox, what + ": k", 11)
                    + (bytes(128) if smt else  # (SMT: never acquired)
                       _bf16_tensor_map(vt.ptr, (Tp, FLASH_HS, BNH), (Tp * 4, FLASH_HS * Tp * 4), (32, FLASH_HS, 1),
                                        what + ": vt", 11)))
            dm = maps[qp] = rt.to_device(np.frombuffer(blob, np.uint8))
        k(grid, block, _ptr(out), _ptr(lse), dm.ptr, *args, smem=smem)
    return Built(launch, scratch={} if smt else {"vt": vt})


# dynamic shared memory of the backward's kernels (DQ_SMEM, DKDV_SMEM in the .cu): 1 KB of slack, two
# resident 128-row tiles (q, dout / k, v), BWD_STAGES x two swept tiles, [dkdv: 2 consumers x 2
# buffers of a tile's lse and D, fp32], 1 + 2 BWD_STAGES mbarriers
# (bf16; the ring depth is a build parameter of the .cu, LLMC_ATT_BWD_STAGES, which the environment
# variable of that name sets for the lab's A/B: wgmma_bwd_smem gives the two sizes for a depth)
WGMMA_BWD_STAGES = 2


def wgmma_bwd_smem(stages: int = WGMMA_BWD_STAGES) -> tuple[int, int]:
    dq = 1024 + 2 * WGMMA_BQ * 128 + stages * 2 * WGMMA_BQ * 128 + 8 * (1 + 2 * stages)
    return dq, dq + 2 * 2 * 2 * WGMMA_BQ * 4


WGMMA_DQ_SMEM, WGMMA_DKDV_SMEM = wgmma_bwd_smem()


# the colsum finish kernels' float4 columns a block: block (FINISH_X, 64) (cuda/attention_wgmma.cu's FINISH_X,
# 16 until session 57; a define of that name overrides both, for the lab's A/B)
FINISH_X = 8


def _colsum_finish(rt, B, T, C, label, defines, dtype="bf16"):
    """The colsum forms' partials (a row of 3C fp32 column sums per 64 rows of dinp: B ceil(T/64) rows;
    the TF32 build's, dtype="fp32": one per 16 rows of each 128-row block, B ceil(T/128) 8 rows) and
    finish(dbias), which adds them in order into dbias(3C), rounded once (cuda/attention_wgmma.cu,
    flash_attention_backward_colsum_finish_kernel_{bf16,fp32}), and check(dbias), which refuses a dbias the
    finish kernel can't take (the launchers call it before their first pass)."""
    R = B * ceil_div(T, 64) if dtype == "bf16" else B * ceil_div(T, WGMMA_BQ) * (WGMMA_BQ // 16)
    part = rt.scratch((R, 3 * C))
    kf = rt.kernel(WGMMA_MODULE, f"flash_attention_backward_colsum_finish_kernel_{dtype}", "PPii",
                   label=label + " colsum finish", defines=defines)
    fx = int((defines or {}).get("FINISH_X", FINISH_X))
    grid = (ceil_div(3 * C // 4, fx), 1, 1)
    align = 8 if dtype == "bf16" else 16  # (4 columns a thread: a uint2 of bf16, a float4 of fp32)

    def check(dbias):
        if _ptr(dbias) & (align - 1):
            raise LLMCError(f"{label}: dbias must be {align}-byte aligned (0x{_ptr(dbias):x})")

    def finish(dbias):
        kf(grid, (fx, 64, 1), _ptr(dbias), part.ptr, np.int32(R), np.int32(3 * C))
    return part, finish, check


def _colsum_launch(plain, check, finish):
    """Variant 4's colsum form over its plain launch (whose kernels write the partials): launch(dinp, dbias,
    dout, qkvr, lse, out) checks dbias, runs the plain passes, then finish adds the partials into dbias."""
    def launch(dinp, dbias, dout, qkvr, lse, out):
        check(dbias)
        plain(dinp, dout, qkvr, lse, out)
        finish(dbias)
    return launch


def build_flash_attention_backward_wgmma(rt, B, T, C, NH, overlap=False, qkv_in_place=False, pingpong=None,
                                         colsum=False, **_):
    """Variant 4's bf16 build: launch(dinp (B,T,3C), dout (B,T,C), qkvr (B,T,3C), lse (B,NH,T), out (B,T,C))
    like the bf16 builds of 2, 3 (dinp, dout, qkvr, out bf16; lse and the scratch D fp32; the lse of
    attention_forward 2, 3 or 4): a dq kernel (also writing D = rowsum(dout * out)) then a dk/dv
    kernel, each a CTA per (b, h, 128 rows) of a producer warpgroup (TMA) and 2 wgmma consumer
    warpgroups; dinp overwritten, no atomics. The TMA reads qkvr and dout through two tensor maps
    (cuda/attention_wgmma.cu, backward Layouts) kept back to back on the device: one pair per (qkvr,
    dout) pointer pair, encoded and copied at its first launch, so a captured graph replays them.
    qkv_in_place: qkvr is the forward's inp itself, the (B,T,3C) qkv tensor unpermuted (attention_forward
    4 built with qkv_in_place; the kernels' _btc entry points read it through qkv_tensor_map); else the
    permuted qkvr that forwards 2, 3 and 4 write.
    overlap: the dq kernel that leaves tile i's dq product running while it issues tile i + 1's S and
    dP (the same bits; the lab times both; permuted qkvr only). pingpong (in place only; None: whenever
    in place): both kernels' consumer warpgroups take turns issuing their products (the same bits;
    H100, B=16: 0.383 ms against 0.397 without).
    colsum=True: launch(dinp, dbias, dout, qkvr, lse, out), dbias(3C) += the column sums of dinp as stored
    (qkv's bias gradient): each kernel's consumers sum the 64 rows they store into a row of partials
    (the dq kernel the q columns, the dk/dv kernel the k and v columns), and a third launch adds the rows
    in order into dbias, rounded once (as variant 5's colsum form, which sums the same values: dk, dv
    and D are 4's bits there, dq within a rounding). Deterministic, like the rest of 4."""
    if pingpong is None:
        pingpong = qkv_in_place
    _check_attention(B, T, C, NH)
    assert not (overlap and qkv_in_place), "the overlap dq kernel reads the permuted qkvr only"
    assert not pingpong or qkv_in_place, "the ping-pong kernels are built for the in-place form only"
    stages = int(switches.value("LLMC_ATT_BWD_STAGES") or WGMMA_BWD_STAGES)
    defines = {} if stages == WGMMA_BWD_STAGES else {"LLMC_ATT_BWD_STAGES": stages}
    dq_smem, dkdv_smem = wgmma_bwd_smem(stages)
    for name, smem in (("dq", dq_smem), ("dk dv", dkdv_smem)):
        if smem > rt.max_smem_optin:
            refuse("attention_backward", 4, f"the {name} kernel needs {smem} bytes of shared memory, the device "
                                            f"allows {rt.max_smem_optin}")
    D = rt.scratch((B, NH, T))  # fp32
    label = "attention_backward 4 (flash, wgmma) bf16"
    pp = "_pingpong" if pingpong else ""
    sfx = "_overlap" if overlap else "_btc" + pp if qkv_in_place else ""
    kq = rt.kernel(WGMMA_MODULE, "flash_attention_backward_dq_kernel4_bf16" + sfx, "PPPPPPiiifP",
                   label=label + " dq" + sfx.replace("_", " "), defines=defines)
    sfx = "_btc" + pp if qkv_in_place else ""
    kkv = rt.kernel(WGMMA_MODULE, "flash_attention_backward_dkdv_kernel4_bf16" + sfx, "PPPPiiifP",
                    label=label + " dk dv" + sfx.replace("_", " "), defines=defines)
    part, finish, check = _colsum_finish(rt, B, T, C, label, defines) if colsum else (None, None, None)
    qkv_map = (lambda p: qkv_tensor_map(p, B, T, NH)) if qkv_in_place else (lambda p: qkvr_tensor_map(p, B, NH, T))
    kq.set_max_dynamic_smem(dq_smem)
    kkv.set_max_dynamic_smem(dkdv_smem)
    grid, block = (B * NH, ceil_div(T, WGMMA_BQ), 1), (384, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))
    maps: dict = {}

    def launch(dinp, dout, qkvr, lse, out):
        qp, dp = _ptr(qkvr), _ptr(dout)
        dm = maps.get((qp, dp))
        if dm is None:  # first launch on this (qkvr, dout): encode both maps, copy them to the device
            for name, p in (("qkvr", qp), ("dout", dp), ("out", _ptr(out))):  # out: the dq kernel's 16-byte loads
                if p & 15:
                    raise LLMCError(f"attention_backward 4: {name} must be 16-byte aligned (0x{p:x})")
            two = qkv_map(qp) + btc_tensor_map(dp, B, T, NH)  # tm[0], tm[1]
            dm = maps[(qp, dp)] = rt.to_device(np.frombuffer(two, np.uint8))
        kq(grid, block, _ptr(dinp), _ptr(D), dp, _ptr(out), dm.ptr, _ptr(lse), *args, _ptr(part), smem=dq_smem)
        kkv(grid, block, _ptr(dinp), dm.ptr, _ptr(lse), _ptr(D), *args, _ptr(part), smem=dkdv_smem)
    if colsum:
        return Built(_colsum_launch(launch, check, finish), scratch={"D": D, "part": part})
    return Built(launch, scratch={"D": D})


WGMMA5_ZERO_TILES = 16  # (main_zeroes form) ZERO_TILES in the .cu: its zero_ready mbarriers, T <= 16 x 128


def wgmma5_smem(stages: int = 2) -> int:
    """Variant 5's main kernel (DKDVQ_SMEM in the .cu): the dk/dv kernel's bytes, a ring of two 32 KB
    buffers of a tile's dS^T (128 keys x 128 queries bf16) and their 4 mbarriers, each consumer's 16 KB
    of dq rows (fp32) staged for the TMA, and the main_zeroes form's zero_ready mbarriers."""
    return (wgmma_bwd_smem(stages)[1] + 2 * 2 * WGMMA_BQ * 128 + 2 * 64 * FLASH_HS * 4 + 8 * 2 * 2
            + 8 * WGMMA5_ZERO_TILES)


def build_flash_attention_backward_wgmma5(rt, B, T, C, NH, qkv_in_place=False, pingpong=None, caller_zeroes=False,
                                          colsum=False, main_zeroes=None, **_):
    """Variant 5 (bf16, Hopper): launch(dinp, dout, qkvr, lse, out) as variant 4's bf16 build, in one
    pass over the tile pairs instead of two (cuda/attention_wgmma.cu, "attention_backward variant 5"):
      prep     D = rowsum(dout * out) (variant 4's bits) and the fp32 dq accumulator (B,NH,T,64) zeroed
      main     variant 4's dk/dv kernel, which also adds each tile pair's dS k into the accumulator
               by TMA reductions (5 products per tile pair instead of 7)
      convert  dinp[..., 0:C] = bf16(scale dq)
    dk and dv are summed in a fixed order as in 4; dq's fp32 sums land in whatever order the CTAs run,
    so dq is not deterministic (--deterministic runs 4). pingpong: as 4 (in place only; None: in place).
    caller_zeroes=True: prep leaves the accumulator alone (it only reads dout and out: half its bytes),
    which the build zeroes once and the caller zeroes again after each launch, before the next, with
    `Built.info["rezero"]()` (a memset on the current stream: the model puts it on its side stream,
    off the backward's critical path).
    main_zeroes=True (None: LLMC_ATT5_MAIN_ZERO where it applies; in place only, T <= 2048, never with
    caller_zeroes): prep leaves the accumulator alone and the main kernel zeroes it just before its
    reductions add into it: each CTA its diagonal query tile, with the producer warpgroup's idle warps,
    the others waiting (outside the consumers) for the tiles they add into, so the zeros meet the
    reductions in the L2 instead of going out to DRAM and back (cuda/attention_wgmma.cu, dq_zero_ready).
    Its head groups are capped at SMs / ceil(T/128) heads, so a group's CTAs are resident together. Sync
    words: a flag per query tile and a counter per head, zeroed here, reset by each head's last CTA.
    colsum=True: launch(dinp, dbias, dout, qkvr, lse, out), and dbias(3C) += the column sums of dinp
    viewed as (B T, 3C) as stored (qkv's bias gradient, instead of matmul_backward_bias re-reading
    dinp): the main kernel sums each 64 keys' dk and dv columns, convert becomes convert_colsum (a block
    per 64 rows sums the dq columns it writes), both into a row of fp32 partials per 64 rows of dinp,
    and a fourth pass, finish, adds the rows in order into dbias, rounded once. Deterministic given
    dinp (which is not: dq)."""
    if pingpong is None:
        pingpong = qkv_in_place
    _check_attention(B, T, C, NH)
    assert not pingpong or qkv_in_place, "the ping-pong kernel is built for the in-place form only"
    defines = {}  # (its q / dout ring is 2 deep whatever LLMC_ATT_BWD_STAGES says: 3 would not fit)
    smem = wgmma5_smem()
    if smem > rt.max_smem_optin:
        refuse("attention_backward", 5, f"the main kernel needs {smem} bytes of shared memory, the device "
                                        f"allows {rt.max_smem_optin}")
    nqb = ceil_div(T, WGMMA_BQ)
    if main_zeroes is None:
        main_zeroes = switches.on("LLMC_ATT5_MAIN_ZERO") and qkv_in_place and nqb <= WGMMA5_ZERO_TILES
    main_zeroes = bool(main_zeroes) and not caller_zeroes
    if main_zeroes and not qkv_in_place:
        raise LLMCError("attention_backward 5: main_zeroes needs the in-place form (qkv_in_place=True)")
    if main_zeroes and nqb > WGMMA5_ZERO_TILES:
        raise LLMCError(f"attention_backward 5: main_zeroes takes T <= {WGMMA5_ZERO_TILES * WGMMA_BQ} (got T={T})")
    D = rt.scratch((B, NH, T))           # fp32
    # fp32: the dq accumulator, zeroed by prep at every call (caller_zeroes: here, then by the caller;
    # main_zeroes: by the main kernel)
    dq = rt.zeros((B, NH, T, FLASH_HS)) if caller_zeroes else rt.scratch((B, NH, T, FLASH_HS))
    # (main_zeroes) a head's words: a flag per query tile (zeroed), then its CTAs past their waits
    zsync = rt.zeros((B * NH * (nqb + 1),), np.uint32) if main_zeroes else None
    label = "attention_backward 5 (flash, wgmma, dq by reductions) bf16"
    kp = rt.kernel(WGMMA_MODULE, "flash_attention_backward_prep_kernel5_bf16", "PPPPiiii", label=label + " prep",
                   defines=defines)
    sfx = ("_btc" + ("_pingpong" if pingpong else "")) if qkv_in_place else ""
    sfx += "_mz" if main_zeroes else ""
    km = rt.kernel(WGMMA_MODULE, "flash_attention_backward_dkdvq_kernel5_bf16" + sfx,
                   "PPPPPiiifiPP" if main_zeroes else "PPPPPiiifiP",
                   label=label + " dk dv dq" + sfx.replace("_", " "), defines=defines)
    kc = rt.kernel(WGMMA_MODULE, "flash_attention_backward_convert_kernel5_bf16", "PPiiif", label=label + " convert",
                   defines=defines)
    km.set_max_dynamic_smem(smem)
    part = None
    if colsum:  # a row of fp32 column sums per 64 rows of dinp; convert_colsum's row groups (see the .cu)
        rg = _att5_colsum_rg(C)
        part, finish_bias, check_bias = _colsum_finish(rt, B, T, C, label, defines)
        kcs = rt.kernel(WGMMA_MODULE, f"flash_attention_backward_convert_colsum_kernel5_bf16_rg{rg}", "PPPiiif",
                        label=label + " convert colsum", defines=defines)
        cs_block, cs_smem = (C // 8, rg, 1), 4 * (rg - 1) * C
    qkv_map = (lambda p: qkv_tensor_map(p, B, T, NH)) if qkv_in_place else (lambda p: qkvr_tensor_map(p, B, NH, T))
    scale = np.float32(1.0 / math.sqrt(FLASH_HS))
    # the CTAs' start order (the .cu): groups of G heads, each group's dq rows (T x 256 bytes a head)
    # within 1/16 of the L2 (G = 12 at T = 1024 on an H100). Main kernel, H100, G = 1 / 12 / 24 / 48 /
    # 100 / all: B=16 0.2518 / - / 0.2558 / 0.2544 / 0.3569 / 0.3368 ms; B=4 0.0824 / 0.0707 / 0.0715 /
    # 0.0719 (all) ms. LLMC_ATT5_HEAD_GROUP sets G for the lab's A/B
    G = min(B * NH, switches.value("LLMC_ATT5_HEAD_GROUP") or max(1, rt.l2_bytes // 16 // (T * FLASH_HS * 4)))
    if main_zeroes:  # a CTA waits for its head's others in the group: all of a group resident at once
        G = max(1, min(G, rt.sm_count // nqb))
    grid, block = (ceil_div(T, WGMMA_BQ) * B * NH, 1, 1), (384, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T))
    prep_grid = (ceil_div(B * T * NH * 4, 256), 1, 1)
    conv_grid = (ceil_div(B * T * C // 8, 256), 1, 1)
    maps: dict = {}

    def prep(dinp, dout, qkvr, lse, out):
        kp(prep_grid, (256, 1, 1), _ptr(D), _ptr(dq), _ptr(dout), _ptr(out), *args,
           np.int32(0 if caller_zeroes or main_zeroes else 1))

    def tensor_maps(dinp, dout, qkvr, out):
        """The main kernel's three maps on the device (encoded and copied at the first launch on each
        (qkvr, dout) pair, after the alignment checks: before any of the three passes is launched)."""
        qp, dp = _ptr(qkvr), _ptr(dout)
        dm = maps.get((qp, dp))
        if dm is None:
            for name, p in (("qkvr", qp), ("dout", dp), ("out", _ptr(out)), ("dinp", _ptr(dinp))):
                if p & 15:
                    raise LLMCError(f"attention_backward 5: {name} must be 16-byte aligned (0x{p:x})")
            # tm[2]: dq_acc as (64 dims, T rows, B NH heads) fp32, reduced into in boxes of (32, 64, 1)
            three = (qkv_map(qp) + btc_tensor_map(dp, B, T, NH, "attention_backward 5: dout")
                     + _bf16_tensor_map(dq.ptr, (FLASH_HS, T, B * NH), (FLASH_HS * 4, T * FLASH_HS * 4), (32, 64, 1),
                                        "attention_backward 5: dq", FLOAT32))
            dm = maps[(qp, dp)] = rt.to_device(np.frombuffer(three, np.uint8))
        return dm

    def main(dinp, dout, qkvr, lse, out):
        dm = tensor_maps(dinp, dout, qkvr, out)
        km(grid, block, _ptr(dinp), _ptr(dq), dm.ptr, _ptr(lse), _ptr(D), *args, scale, np.int32(G), _ptr(part),
           *((_ptr(zsync),) if main_zeroes else ()), smem=smem)

    def convert(dinp, dout, qkvr, lse, out):
        kc(conv_grid, (256, 1, 1), _ptr(dinp), _ptr(dq), *args, scale)

    passes = {"prep": prep, "main": main, "convert": convert}

    def launch(dinp, dout, qkvr, lse, out):
        tensor_maps(dinp, dout, qkvr, out)  # (a misaligned argument is refused before prep runs)
        for f in passes.values():
            f(dinp, dout, qkvr, lse, out)
    if colsum:
        R = B * ceil_div(T, 64)

        def convert_colsum(dinp, dbias, dout, qkvr, lse, out):
            kcs((R, 1, 1), cs_block, _ptr(dinp), part.ptr, _ptr(dq), *args, scale, smem=cs_smem)

        def finish(dinp, dbias, dout, qkvr, lse, out):
            finish_bias(dbias)

        def plain(f):
            return lambda dinp, dbias, dout, qkvr, lse, out: f(dinp, dout, qkvr, lse, out)
        passes = {"prep": plain(prep), "main": plain(main), "convert": convert_colsum, "finish": finish}

        def launch(dinp, dbias, dout, qkvr, lse, out):  # noqa: F811
            tensor_maps(dinp, dout, qkvr, out)
            check_bias(dbias)  # (before any pass runs)
            for f in passes.values():
                f(dinp, dbias, dout, qkvr, lse, out)
    # info["passes"]: the launches alone (the lab times each; each takes launch's arguments)
    info = {"passes": passes, "main_zeroes": main_zeroes}
    if caller_zeroes:
        info["rezero"] = dq.zero
    if main_zeroes:  # (not in scratch, which tests poison: its words must stay zero between launches)
        info["zsync"] = zsync
    return Built(launch, scratch={"D": D, "dq": dq, **({"part": part} if colsum else {})},
                 keep=frozenset({"dq"}) if caller_zeroes else frozenset(), info=info)


def _att5_colsum_rg(C):
    """convert_colsum's row groups (blockDim.y): 8 where a block of C/8 x 8 threads fits, else 4."""
    return 8 if C <= 1024 else 4


def _check_backward4_tf32(B, T, C, NH, colsum=False, **kw):
    return _check_flash_tf32(B, T, C, NH, **kw)


def _check_backward5(B, T, C, NH, colsum=False, **kw):
    bad = _check_flash(B, T, C, NH, **kw)
    if bad is None and colsum and C > 2048:
        return f"C={C}: the colsum form's convert takes C <= 2048 (a block of C/8 x 4 threads)"
    return bad


# the TF32 backward's kernels (TB_DQ_SMEM, TB_DKDV_SMEM in the .cu): 1 KB of slack, two resident 128-row
# fp32 tiles (32 KB each), BWD_STAGES x 3 (dq: k, v, kt) or 4 (dk/dv: q, dout, qt, dot) tiles of 64 rows
# (16 KB each), [dk/dv: 2 consumers x 2 buffers of 64 lse and D], 1 + 3 BWD_STAGES mbarriers
WGMMA_TF32_DQ_SMEM = 1024 + 2 * 32768 + WGMMA_BWD_STAGES * 3 * 16384 + 8 * (1 + 3 * WGMMA_BWD_STAGES)
WGMMA_TF32_DKDV_SMEM = 1024 + 2 * 32768 + WGMMA_BWD_STAGES * 4 * 16384 + 2 * 2 * 2 * 64 * 4 + 8 * (1 + 3 * WGMMA_BWD_STAGES)


def build_flash_attention_backward_wgmma_tf32(rt, B, T, C, NH, qkv_in_place=False, smem_transpose=None, colsum=False,
                                              **_):
    """Variant 4's fp32 build (TF32 wgmma): launch(dinp (B,T,3C), dout (B,T,C), qkvr (B,T,3C), lse
    (B,NH,T), out (B,T,C)) like 2, 3: the dq kernel (which also writes D = rowsum(dout * out)) and the
    dk/dv kernel, both on 64-row swept tiles (cuda/attention_wgmma.cu). Their products over positions
    need k, q and dout transposed, each group of 8 rows reordered for the register A: with
    smem_transpose (the _smt entry points) the producer warpgroup's idle warps transpose each stage's
    tiles in shared memory; without, attention_vt_kernel writes kt, qt, dot to global scratch
    (B*NH, 64, Tp) first and the TMA loads their tiles (the same bits). None (the variant's build):
    shared memory unless those buffers fit in the L2 (_tf32_smem_transpose). qkv_in_place: qkvr is the forward's inp
    itself, (B,T,3C) unpermuted, read through a 4D map (the _btc entry points).
    colsum=True: launch(dinp, dbias, dout, qkvr, lse, out), dbias(3C) += the column sums of dinp as stored
    (qkv's bias gradient, fp32): each consumer warp of the two kernels sums the 16 rows it stores (the dq
    kernel the q columns, the dk/dv kernel the k and v columns) into a row of partials, and a third launch
    adds the rows in order into dbias, rounded once. Deterministic, like the rest of 4."""
    _check_attention(B, T, C, NH)
    for name, smem in (("dq", WGMMA_TF32_DQ_SMEM), ("dk dv", WGMMA_TF32_DKDV_SMEM)):
        if smem > rt.max_smem_optin:
            refuse("attention_backward", 4, f"the tf32 {name} kernel needs {smem} bytes of shared memory, the "
                                            f"device allows {rt.max_smem_optin}")
    BNH, Tp = B * NH, ceil_div(T, 8) * 8
    D = rt.scratch((B, NH, T))
    smt = _tf32_smem_transpose(B, T, NH, 3, rt) if smem_transpose is None else bool(smem_transpose)
    kt, qt, dot = (None, None, None) if smt else (rt.scratch((BNH, FLASH_HS, Tp)) for _ in range(3))
    kvt = None if smt else rt.kernel(WGMMA_MODULE, "attention_vt_kernel", "PPiiiiiq",
                                     label="attention_backward 4 tf32: transpose")
    label = "attention_backward 4 (flash, wgmma) tf32"
    sfx = ("_btc" if qkv_in_place else "") + ("_smt" if smt else "")
    kq = rt.kernel(WGMMA_MODULE, "flash_attention_backward_dq_kernel4_tf32" + sfx, "PPPPPPiiifP",
                   label=label + " dq" + sfx.replace("_", " "))
    kkv = rt.kernel(WGMMA_MODULE, "flash_attention_backward_dkdv_kernel4_tf32" + sfx, "PPPPiiifP",
                    label=label + " dk dv" + sfx.replace("_", " "))
    part, finish, check = _colsum_finish(rt, B, T, C, label, {}, "fp32") if colsum else (None, None, None)
    # q, k of qkvr: (part offset in bytes, head stride, row stride, batch stride) for the transposes
    if qkv_in_place:
        q_at, k_at, qk_layout = 0, C * 4, (FLASH_HS, 3 * C, T * 3 * C)
    else:
        q_at, k_at, qk_layout = 0, BNH * T * FLASH_HS * 4, (T * FLASH_HS, FLASH_HS, NH * T * FLASH_HS)
    kq.set_max_dynamic_smem(WGMMA_TF32_DQ_SMEM)
    kkv.set_max_dynamic_smem(WGMMA_TF32_DKDV_SMEM)
    grid, block = (BNH, ceil_div(T, WGMMA_BQ), 1), (384, 1, 1)
    tgrid = (ceil_div(Tp, 32), BNH, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))
    what = f"attention_backward 4 tf32 (B={B} NH={NH} T={T})"
    maps: dict = {}

    def tmap(ptr, dims, strides, box, name):
        return _bf16_tensor_map(ptr, dims, strides, box, f"{what}: {name}", 11)

    def launch(dinp, dout, qkvr, lse, out):
        qp, dp = _ptr(qkvr), _ptr(dout)
        if not smt:
            hs_, rs_, bs_ = qk_layout
            for dst, at in ((kt, k_at), (qt, q_at)):
                kvt(tgrid, (32, 8, 1), dst.ptr, qp + at, np.int32(NH), np.int32(T), np.int32(Tp), np.int32(hs_),
                    np.int32(rs_), np.int64(bs_))
            kvt(tgrid, (32, 8, 1), dot.ptr, dp, np.int32(NH), np.int32(T), np.int32(Tp), np.int32(FLASH_HS),
                np.int32(C), np.int64(T * C))
        dm = maps.get((qp, dp))
        if dm is None:  # dq's maps (qkvr, dout, kt) then dk/dv's (qkvr, dout, qt, dot)
            for name, p in (("qkvr", qp), ("dout", dp), ("out", _ptr(out))):  # out: the dq kernel's float4 loads
                if p & 15:
                    raise LLMCError(f"{what}: {name} must be 16-byte aligned (0x{p:x})")
            if qkv_in_place:  # inp (B,T,3C) as (64 dims, 3 NH heads, T, B)
                mq = tmap(qp, (FLASH_HS, 3 * NH, T, B), (FLASH_HS * 4, 3 * C * 4, T * 3 * C * 4), (32, 1, 64, 1), "qkv")
            else:
                mq = tmap(qp, (FLASH_HS, T, 3 * BNH), (FLASH_HS * 4, T * FLASH_HS * 4), (32, 64, 1), "qkvr")
            md = tmap(dp, (FLASH_HS, NH, T, B), (FLASH_HS * 4, C * 4, T * C * 4), (32, 1, 64, 1), "dout")
            mt = [bytes(128) if smt else tmap(x.ptr, (Tp, FLASH_HS, BNH), (Tp * 4, FLASH_HS * Tp * 4), (32, 64, 1), n)
                  for x, n in ((kt, "kt"), (qt, "qt"), (dot, "dot"))]  # (SMT: unused, never acquired)
            blob = mq + md + mt[0] + mq + md + mt[1] + mt[2]
            dm = maps[(qp, dp)] = rt.to_device(np.frombuffer(blob, np.uint8))
        kq(grid, block, _ptr(dinp), _ptr(D), dp, _ptr(out), dm.ptr, _ptr(lse), *args, _ptr(part),
           smem=WGMMA_TF32_DQ_SMEM)
        kkv(grid, block, _ptr(dinp), dm.ptr + 3 * 128, _ptr(lse), _ptr(D), *args, _ptr(part), smem=WGMMA_TF32_DKDV_SMEM)
    scratch = {"D": D} if smt else {"D": D, "kt": kt, "qt": qt, "dot": dot}
    if colsum:
        scratch["part"] = part
        launch = _colsum_launch(launch, check, finish)
    return Built(launch, scratch=scratch)


# ----------------------------------------------------------------------------------------------
# GPU: decode with a KV cache (sampling)


DECODE_CHUNK = 64  # keys per block of attention_decode_kernel2 (cuda/attention.cu)


def kv_append_ref(kcache, vcache, qkv, pos):
    """Write the new token's k, v (from qkv (B,3C)) at position pos of the (B,NH,maxT,hs) caches
    (in place); return q (B,C)."""
    B, NH, maxT, hs = kcache.shape
    C = NH * hs
    kv = qkv.reshape(B, 3, NH, hs)
    kcache[:, :, pos, :] = kv[:, 1]
    vcache[:, :, pos, :] = kv[:, 2]
    return qkv.reshape(B, 3 * C)[:, :C].copy()


def kv_fill_ref(kcache, vcache, qkvr, T):
    """Positions 0..T-1 of the (B,NH,maxT,hs) caches <- k, v of a forward's qkvr (q|k|v, each
    (B,NH,T,hs)), in place."""
    B, NH, maxT, hs = kcache.shape
    q, k, v = qkvr.reshape(3, B, NH, T, hs)
    kcache[:, :, :T, :] = k
    vcache[:, :, :T, :] = v


def attention_decode_cpu(B, C, NH, maxT, **_):
    def launch(out, qkv, kcache, vcache, pos):
        q = kv_append_ref(kcache, vcache, qkv, int(pos[0]))  # the new k, v into the caches at pos
        out[...] = attention_decode_ref(q, kcache, vcache, int(pos[0])).reshape(out.shape)
    return launch


def attention_kv_fill_cpu(B, C, NH, maxT, T, **_):
    def launch(kcache, vcache, qkvr):
        kv_fill_ref(kcache, vcache, qkvr, T)
    return launch


# attention_decode: launch(out (B,C), qkv (B,3C), kcache (B,NH,maxT,hs), vcache (B,NH,maxT,hs),
# pos (1,) int32 on the device, 0 <= pos < maxT: the caller checks, the kernels read it each launch).
# qkv is the qkv matmul's output for the new token: its k, v go into the caches at pos, its q
# attends over positions 0..pos.

def _decode1_smem(C, NH, maxT, block_size=128):
    hs = C // NH
    G = max(1, block_size // hs)
    return 4 * (hs + maxT + max(G * hs, block_size))


def _decode2_smem(C, NH, bs=128):
    hs = C // NH
    return 4 * (hs + DECODE_CHUNK + max(1, bs // hs) * hs)


def _check_decode(B, C, NH, maxT, block_size=None, **_):
    if min(B, C, NH, maxT) < 1 or C % NH:
        return f"B={B} C={C} NH={NH} maxT={maxT} is not a valid attention shape"
    return check_block_size(block_size)


def _check_decode1(B, C, NH, maxT, block_size=None, **_):
    bad = _check_decode(B, C, NH, maxT, block_size)
    smem = _decode1_smem(C, NH, maxT, block_size or 128)
    return bad or (f"maxT={maxT} needs {smem} bytes of shared memory (> 227 KB)" if smem > 227 * 1024 else None)


def _check_decode2(B, C, NH, maxT, **shape):
    bad = _check_decode(B, C, NH, maxT, **shape)
    if bad:
        return bad
    if (C // NH) % 4:
        return f"head size {C // NH} is not a multiple of 4 (float4 keys)"
    smem = _decode2_smem(C, NH)
    return f"head size {C // NH} needs {smem} bytes of shared memory (> 227 KB)" if smem > 227 * 1024 else None


def _sfx(dtype):
    """The entry-point suffix of a dtype's instantiation (cuda/attention.cu: <name>_bf16)."""
    return "_bf16" if dtype == "bf16" else ""


def attention_decode1(rt, B, C, NH, maxT, block_size=None, dtype="fp32"):
    """One block per (b, h). dtype "bf16": out, qkv and the caches bf16 (fp32 math)."""
    hs, block_size = C // NH, block_size or 128
    k = rt.kernel(MODULE, "attention_decode_kernel1" + _sfx(dtype), "PPPPPiiiif",
                  label="attention_decode 1" + _sfx(dtype))
    smem = _decode1_smem(C, NH, maxT, block_size)
    k.set_max_dynamic_smem(smem)
    grid, block = (B * NH, 1, 1), (block_size, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(hs), np.int32(maxT), np.float32(1.0 / math.sqrt(hs)))

    def launch(out, qkv, kcache, vcache, pos):
        k(grid, block, _ptr(out), _ptr(qkv), _ptr(kcache), _ptr(vcache), _ptr(pos), *args, smem=smem)
    return launch


def attention_decode2(rt, B, C, NH, maxT, block_size=None, dtype="fp32"):
    """Split over chunks of 64 keys, then a combine kernel (block_size is fixed at 128: a thread per key
    and the chunk's partial state). dtype "bf16": out, qkv and the caches bf16; the chunks' partial
    states (scratch) stay fp32."""
    hs = C // NH
    chunks = -(-maxT // DECODE_CHUNK)
    part = rt.empty((B * NH, chunks, hs + 2))  # fp32 in both builds
    k = rt.kernel(MODULE, "attention_decode_kernel2" + _sfx(dtype), "PPPPPiiiif",
                  label="attention_decode 2" + _sfx(dtype))
    comb = rt.kernel(MODULE, "attention_decode_combine_kernel2" + _sfx(dtype), "PPPiii",
                     label="attention_decode 2 combine" + _sfx(dtype))
    bs = 128
    smem = _decode2_smem(C, NH, bs)
    k.set_max_dynamic_smem(smem)
    args = (np.int32(B), np.int32(NH), np.int32(hs), np.int32(maxT), np.float32(1.0 / math.sqrt(hs)))
    cbs = min(1024, -(-hs // 32) * 32)

    def launch(out, qkv, kcache, vcache, pos):
        k((B * NH, chunks, 1), (bs, 1, 1), _ptr(part), _ptr(qkv), _ptr(kcache), _ptr(vcache), _ptr(pos), *args,
          smem=smem)
        comb((B * NH, 1, 1), (cbs, 1, 1), _ptr(out), _ptr(part), _ptr(pos), np.int32(NH), np.int32(hs),
             np.int32(chunks))
    return Built(launch, scratch={"part": part})


def _check_kv_fill(B, C, NH, maxT, T, block_size=None, **_):
    if min(B, C, NH, maxT) < 1 or C % NH:
        return f"B={B} C={C} NH={NH} maxT={maxT} is not a valid attention shape"
    if not 1 <= T <= maxT:
        return f"T={T} outside 1..maxT={maxT}"
    return check_block_size(block_size)


def attention_kv_fill1(rt, B, C, NH, maxT, T, block_size=None, dtype="fp32"):
    """launch(kcache (B,NH,maxT,hs), vcache, qkvr (B,T,3C) as saved by attention_forward); all of
    one dtype (a copy)."""
    hs, block_size = C // NH, block_size or 256
    k = rt.kernel(MODULE, "attention_kv_fill_kernel1" + _sfx(dtype), "PPPiiiii",
                  label="attention_kv_fill 1" + _sfx(dtype))
    grid, block = (-(-B * NH * T * hs // block_size), 1, 1), (block_size, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.int32(hs), np.int32(maxT))

    def launch(kcache, vcache, qkvr):
        k(grid, block, _ptr(kcache), _ptr(vcache), _ptr(qkvr), *args)
    return launch


def _dtypes(build):
    """{"fp32": build, "bf16": build with dtype="bf16"}: a variant whose one build function takes dtype."""
    return {"fp32": build, "bf16": lambda rt, **shape: build(rt, dtype="bf16", **shape)}


def _flash(direction, version, dtype="fp32"):
    f = build_flash_attention_forward if direction == "forward" else build_flash_attention_backward
    return lambda rt, **shape: f(rt, version=version, dtype=dtype, **shape)


def _flash_builds(direction, version):
    """The fused variant's builds: TF32 on fp32 data, and bf16 (cuda/attention.cu, *_bf16)."""
    return {"fp32": _flash(direction, version), "bf16": _flash(direction, version, "bf16")}


def _composite(direction):
    """Variant 1 of attention_forward/backward: the composite, built from the softmax and matmul
    variants the backend passes in (softmax=, matmul=: Variant.uses), else those ops' defaults."""
    def build(rt, B, T, C, NH, softmax=None, matmul=None, **kw):
        sm = softmax if softmax is not None else get(f"softmax_{direction}").default
        mm = matmul if matmul is not None else get("matmul_" + direction).default
        f = build_attention_forward if direction == "forward" else build_attention_backward
        return f(rt, sm, mm, B=B, T=T, C=C, NH=NH, **kw)
    return build


def _check_composite(B, T, C, NH, **_):
    if min(B, T, C, NH) < 1 or C % NH:
        return f"B={B} T={T} C={C} NH={NH} is not a valid attention shape"
    return None


# what each direction keeps / reads, and the scratch its build allocates (fp32 bytes; the
# composite's GEMMs may add a split-K workspace of their own, llmc/ops/gemm.py)
def _saves_att(B, T, C, NH, **_):
    return (B, NH, T, T)


def _saves_lse(B, T, C, NH, **_):
    return (B, NH, T)


def _scratch_composite_forward(B, T, C, NH, **_):
    return 4 * B * NH * T * (T + C // NH)            # preatt (B,NH,T,T), y (B,NH,T,hs)


def _scratch_composite_backward(B, T, C, NH, **_):
    return 4 * B * NH * T * (2 * T + 4 * (C // NH))  # datt, dpreatt (B,NH,T,T); dy, dqkvr (1+3 x (B,NH,T,hs))


def _scratch_flash_backward(B, T, C, NH, **_):
    return 4 * B * NH * T                            # D = rowsum(dout * out) (B,NH,T)


_COMPOSITE = dict(saves=_saves_att, selected_by=("softmax_forward", "softmax_backward"))
_FUSED = dict(saves=_saves_lse, check=_check_flash)

ATTENTION_FORWARD_VARIANTS = {
    1: Variant(1, "composite: permute, q k^T and att v in the batched GEMM (--matmul-kernel), causal softmax "
                  "(--softmax-kernel), unpermute; keeps att (B,NH,T,T) for backward",
               _composite("forward"), _check_composite, uses={"softmax": "softmax_forward", "matmul": "matmul_forward"},
               scratch_bytes=_scratch_composite_forward, **_COMPOSITE),
    2: Variant(2, "fused flash attention, TF32 mma.sync (bf16: m16n8k16), online softmax in fp32 registers; "
                  "keeps only the log-sum-exp (B,NH,T); k, v tiles staged by the threads (head size 64)",
               _flash_builds("forward", 2), scratch_bytes=lambda **_: 0, **_FUSED),
    3: Variant(3, "2 with the k, v tiles double-buffered through cp.async: the next tile loads while "
                  "the tensor cores work (head size 64; measured slower than 2: not load-bound)",
               _flash_builds("forward", 3), scratch_bytes=lambda **_: 0, **_FUSED),
    4: Variant(4, "fused flash attention on Hopper wgmma (bf16 and TF32, sm_90a): k, v tiles by TMA on an mbarrier "
                  "ring fed by a producer warpgroup, 2 consumer warpgroups x 64 query rows, p v with p from "
                  "registers; keeps the log-sum-exp for backward 2/3 (head size 64)",
               {"fp32": build_flash_attention_forward_wgmma_tf32, "bf16": build_flash_attention_forward_wgmma},
               # (the fp32 build's vt, v transposed, where it transposes in global memory; bf16: none)
               scratch_bytes=lambda B, T, C, NH, dtype="fp32", rt=None, **_: (
                   _tf32_transposed_bytes(B, T, NH) if dtype == "fp32" and not _tf32_smem_transpose(B, T, NH, 1, rt)
                   else 0),
               arch="sm_90",
               options=("qkv_in_place",), **dict(_FUSED, check={"fp32": _check_flash_tf32, "bf16": _check_flash})),
}
ATTENTION_BACKWARD_VARIANTS = {
    1: Variant(1, "composite: dv, datt in the batched GEMM (--matmul-backward-kernel), softmax backward "
                  "(--softmax-backward-kernel), dq, dk; needs att from attention_forward 1",
               _composite("backward"), _check_composite,
               uses={"softmax": "softmax_backward", "matmul": "matmul_backward"},
               scratch_bytes=_scratch_composite_backward, **_COMPOSITE),
    2: Variant(2, "fused flash attention backward, TF32 mma.sync (bf16: m16n8k16): a dq kernel and a dk/dv kernel "
                  "recompute att from the log-sum-exp, no atomics; needs attention_forward 2 or 3 (head size 64)",
               _flash_builds("backward", 2), scratch_bytes=_scratch_flash_backward, **_FUSED),
    3: Variant(3, "2 with the swept tiles double-buffered through cp.async (head size 64)",
               _flash_builds("backward", 3), scratch_bytes=_scratch_flash_backward, **_FUSED),
    4: Variant(4, "fused flash attention backward on Hopper wgmma (bf16 and TF32, sm_90a): the dq and dk/dv "
                  "kernels of 3 with tiles by TMA fed by a producer warpgroup, 2 consumer warpgroups, p and ds "
                  "from registers; reads the lse of forward 2, 3 or 4 (head size 64)",
               {"fp32": build_flash_attention_backward_wgmma_tf32, "bf16": build_flash_attention_backward_wgmma},
               # (the fp32 build: D, and kt, qt, dot where it transposes in global memory)
               scratch_bytes=lambda B, T, C, NH, dtype="fp32", colsum=False, rt=None, **_: _scratch_flash_backward(
                   B, T, C, NH) + (0 if dtype != "fp32" or _tf32_smem_transpose(B, T, NH, 3, rt)
                                   else 3 * _tf32_transposed_bytes(B, T, NH))
               + (0 if not colsum else 4 * 3 * C * (B * ceil_div(T, 64) if dtype != "fp32" else
                                                   B * ceil_div(T, WGMMA_BQ) * (WGMMA_BQ // 16))),
               arch="sm_90",
               options=("qkv_in_place", "colsum"),
               **dict(_FUSED, check={"fp32": _check_backward4_tf32, "bf16": _check_flash})),
    5: Variant(5, "4's dk/dv kernel also forming dq = ds k per tile pair, added into an fp32 buffer by TMA "
                  "reductions (5 products per tile pair instead of 7; dq not deterministic), with a D / "
                  "zeroing pass before and a bf16 conversion after (bf16, sm_90a, head size 64)",
               {"bf16": build_flash_attention_backward_wgmma5},
               scratch_bytes=lambda B, T, C, NH, colsum=False, **_: _scratch_flash_backward(B, T, C, NH) + 4 * B * T * C
               + (4 * 3 * C * B * ceil_div(T, 64) if colsum else 0),
               arch="sm_90", options=("qkv_in_place", "caller_zeroes", "colsum"),
               **dict(_FUSED, check=_check_backward5)),
}
ATTENTION_DECODE_VARIANTS = {
    1: Variant(1, "one block per (b, h): scores in shared memory, block softmax, att @ v; appends k, v",
               _dtypes(attention_decode1), _check_decode1, scratch_bytes=lambda **_: 0),
    2: Variant(2, "split keys: chunks of 64 keys across blocks (a thread per key), then a combine kernel "
                  "merging the chunks' softmax states; appends k, v (head size % 4 == 0)",
               _dtypes(attention_decode2), _check_decode2,
               scratch_bytes=lambda B, C, NH, maxT, **_: 4 * B * NH * -(-maxT // DECODE_CHUNK) * (C // NH + 2)),
}
ATTENTION_KV_FILL_VARIANTS = {
    1: Variant(1, "one thread per cached element: k, v of positions 0..T-1 from a forward's qkvr",
               _dtypes(attention_kv_fill1), _check_kv_fill),
}


# ----------------------------------------------------------------------------------------------
# cost models (FLOPs, bytes) of one call, for the lab and the profile. Attention FLOPs are the
# useful work over the full T x T square, the same for every variant (the kernels skip the causal
# upper half, so the real rate is about twice that shown; the fused backward also recomputes).

def cost_forward(B, T, C, NH, **_):
    N, att = B * T, B * NH * T * T
    return 4 * att * (C // NH), 4 * (N * 3 * C * 2 + N * C + 3 * att)


def cost_backward(B, T, C, NH, **_):
    N, att = B * T, B * NH * T * T
    return 8 * att * (C // NH), 4 * (N * C + 2 * N * 3 * C + 6 * att)


def cost_decode(B, C, NH, maxT, pos=None, **_):
    """At position pos (default the last, maxT-1): read q, k, v of the new token and the cached keys
    and values of positions 0..pos, write out and the new k, v."""
    n = (maxT if pos is None else pos + 1)
    return 4 * B * C * n, 4 * (3 * B * C + 2 * B * C * n + 3 * B * C)


def cost_kv_fill(B, C, NH, maxT, T, **_):
    return 0, 4 * 4 * B * T * C  # read k, v of qkvr, write both caches


# ----------------------------------------------------------------------------------------------
# the op table

OPS = [
    # variant 1 is the composite of the softmax and matmul variants; 2 and 3 are fused. What forward
    # keeps for backward differs (att or lse): `pair` keeps the two directions' numbers equal
    # On Hopper both element types default to 4 and 4, the wgmma + TMA kernels (H100, d12 B=16 step:
    # bf16 37.37 ms against 38.76 with 2/3 and 38.25 with 4/3; fp32 (TF32) 70.9-71.1 against 73.8-74.2
    # with 2/3, B=4 20.0-20.1 against 22.0); another GPU refuses 4 and gets 3 with one note
    OpSpec("attention_forward", attention_forward_cpu, ATTENTION_FORWARD_VARIANTS, default=4,
           flag="--attention-kernel", pair="attention_backward", saves=_saves_att, cost=cost_forward,
           options=("qkv_in_place",),
           doc="out(B,T,C)=, qkvr(B,T,3C)=, saved=, inp(B,T,3C); saved is att(B,NH,T,T) (1) or "
               "lse(B,NH,T) (2, 3): Built.saved_shape; build(B, T, C, NH)"),
    OpSpec("attention_backward", attention_backward_cpu, ATTENTION_BACKWARD_VARIANTS, default=4, defaults={"bf16": 5},
           flag="--attention-backward-kernel", pair="attention_forward", saves=_saves_att, cost=cost_backward,
           options=("qkv_in_place", "caller_zeroes", "colsum"),
           doc="dinp(B,T,3C)=, dout(B,T,C), qkvr(B,T,3C), saved, out(B,T,C); build(B, T, C, NH); "
               "caller_zeroes=True (variant 5): Built.info['rezero']() after each launch, before the next; "
               "colsum=True (variant 5): dinp, dbias(3C)+=, dout, ...: dbias += dinp's column sums"),
    OpSpec("attention_decode", attention_decode_cpu, ATTENTION_DECODE_VARIANTS, default=2,
           flag="--attention-decode-kernel", cost=cost_decode,
           doc="out(B,C)=, qkv(B,3C), kcache(B,NH,maxT,hs)+=, vcache+=, pos(1,) int32; build(B, C, NH, maxT)"),
    OpSpec("attention_kv_fill", attention_kv_fill_cpu, ATTENTION_KV_FILL_VARIANTS, default=1,
           flag="--attention-kv-fill-kernel", cost=cost_kv_fill,
           doc="kcache(B,NH,maxT,hs)=, vcache=, qkvr(B,T,3C); build(B, C, NH, maxT, T)"),
]
