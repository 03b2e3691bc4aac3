"""Attention: causal softmax forward/backward (numbered variants), the attention composite built
from them and the team's batched GEMM, and a KV-cache decode kernel for sampling.

    python dev/cuda/softmax_forward.py          # validate + time every softmax_forward variant (BNH=48, T=1024)
    python dev/cuda/softmax_backward.py         # same for softmax_backward
    python dev/cuda/attention_forward.py        # the whole composite at B=4 T=1024 C=768 NH=12, vs torch SDPA
    python dev/cuda/attention_backward.py
    python -m pytest tests/test_attention.py -q # numpy references vs torch autograd (add -m gpu on a GPU)

Semantics (docs/ops.md), scale = 1/sqrt(hs), everything causal (position t sees s <= t):
    softmax_forward(att=, preatt)           att[r, t, s] = softmax_s(scale * preatt[r, t, :t+1]), 0 for s > t
    softmax_backward(dpreatt=, datt, att)   dpreatt = scale * att * (datt - sum_s att * datt), 0 for s > t
    attention_forward(out=, qkvr=, att=, inp)    inp (B,T,3C) -> out (B,T,C); qkvr holds q|k|v,
                                                 each (B,NH,T,hs), one after the other; att (B,NH,T,T)
    attention_backward(dinp=, dout, qkvr, att)   dinp (B,T,3C) is overwritten

How the composite ops are exposed (my choice): `attention_forward` and `attention_backward` are
OpSpecs with a cpu launcher and NO variants of their own (so they have no flag and take no part in
kernel_choices). On the GPU they are built by the plain functions

    build_attention_forward(rt, softmax_variant, matmul_variant, B=, T=, C=, NH=, causal_chunks=None)
        -> launch(out, qkvr, att, inp)
    build_attention_backward(rt, softmax_backward_variant, matmul_backward_variant, B=, T=, C=, NH=,
                             causal_chunks=None) -> launch(dinp, dout, qkvr, att)

(the argument order llmc/backend.py calls them with), from: a permute kernel, QK^T and att@V in
the batched GEMM engine that goes with the --matmul-kernel number (llmc.ops.matmul.gemm_variant_for;
for backward the --matmul-backward-kernel number, see gemm_engine_for_backward),
the chosen softmax variant and an unpermute kernel. Scratch (preatt; dy, datt, dpreatt, dqkvr) is
allocated once in the builder; one built op can serve every layer, nothing is carried between calls.

Causal structure: only s <= t matters. Every softmax variant reads only the lower triangle (and
writes the zeros above it). The GEMMs skip most of the upper triangle by splitting the T rows into
`causal_chunks` row blocks: block i computes its rows against columns 0..end of block i only
(QK^T, dy V^T), or sums over K = 0..end of block i only (att@V, dpreatt K), or, for the transposed
products (att^T dy, dpreatt^T q), over K = start of block i..T. With c chunks the GEMM work is
(c+1)/(2c) of the full square. causal_chunks is an int or a pair (wide, narrow): the GEMMs with
(T, T) outputs and those with (T, hs) outputs split differently (see _chunk_plan). Entries of
preatt/datt above the diagonal outside the computed blocks stay unwritten: nothing reads them (the
softmax kernels mask s > t with selects).

Decode (sampling with a KV cache): build_attention_decode(rt, B, C, NH, maxT)
    -> launch(out (B,C), qkv (B,3C), kcache (B,NH,maxT,hs), vcache (B,NH,maxT,hs), pos)
appends the new token's k, v (from qkv) to the caches at position pos and attends its q over
positions 0..pos. Reference: kv_append_ref then attention_decode_ref.
"""
from __future__ import annotations

import math

import numpy as np

from llmc.errors import LLMCError
from llmc.ops import OpSpec, Variant, refuse, check_block_size
from llmc.runtime import ceil_div

MODULE = "attention"  # cuda/attention.cu

# ----------------------------------------------------------------------------------------------
# numpy references (float32 or float64: they compute in the inputs' dtype)


def _causal_mask(T):
    return np.tril(np.ones((T, T), dtype=bool))  # (T, T), True where s <= t


def softmax_forward_ref(preatt, scale):
    """preatt (..., T, T) -> att (..., T, T): causal softmax of scale * preatt, zeros above the diagonal."""
    T = preatt.shape[-1]
    mask = _causal_mask(T)
    x = np.where(mask, preatt * preatt.dtype.type(scale), -np.inf)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.where(mask, np.exp(x), 0.0).astype(preatt.dtype)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_backward_ref(datt, att, scale):
    """Gradient of softmax_forward w.r.t. preatt: scale * att * (datt - sum_s att*datt), 0 above the diagonal."""
    T = att.shape[-1]
    mask = _causal_mask(T)
    a = np.where(mask, att, 0.0).astype(att.dtype)
    g = np.where(mask, datt, 0.0).astype(att.dtype)
    dot = (a * g).sum(axis=-1, keepdims=True)
    return att.dtype.type(scale) * a * (g - dot)


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


def softmax_forward_cpu(BNH, T, scale, **_):
    def launch(att, preatt):
        att[...] = softmax_forward_ref(preatt.reshape(BNH, T, T), scale).reshape(att.shape)
    return launch


def softmax_backward_cpu(BNH, T, scale, **_):
    def launch(dpreatt, datt, att):
        dpreatt[...] = softmax_backward_ref(datt.reshape(BNH, T, T), att.reshape(BNH, T, T),
                                            scale).reshape(dpreatt.shape)
    return launch


def attention_forward_cpu(B, T, C, NH, **_):
    def launch(out, qkvr, att, inp):
        o, qk, a = attention_forward_ref(inp.reshape(B, T, 3 * C), NH)
        out[...] = o.reshape(out.shape)
        qkvr[...] = qk.reshape(qkvr.shape)
        att[...] = a.reshape(att.shape)
    launch.saved_shape = (B, NH, T, T)  # what forward keeps for backward: the probabilities
    return launch


def attention_backward_cpu(B, T, C, NH, **_):
    def launch(dinp, dout, qkvr, att, out=None):
        dinp[...] = attention_backward_ref(dout.reshape(B, T, C), qkvr.reshape(B, T, 3 * C),
                                           att.reshape(B, NH, T, T), NH).reshape(dinp.shape)
    launch.saved_shape = (B, NH, T, T)
    return launch


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
# GPU: softmax_forward variants. build(rt, BNH, T, scale, block_size=None) -> launch(att, preatt)


def _ptr(x) -> int:
    return x if isinstance(x, (int, np.integer)) else x.ptr


def _row_args(BNH, T, scale):
    return np.int32(BNH), np.int32(T), np.float32(scale)


def _check_rows(BNH, T, **_):
    if BNH < 1 or T < 1:
        return f"empty problem BNH={BNH} T={T}"
    if BNH * T * T >= 2**31:
        return f"BNH*T*T = {BNH * T * T:,} elements does not fit the kernels' int32 row index math"
    return None


def _check_warp_block(block_size=None, **_):
    return check_block_size(block_size)


def _check_pow2_block(block_size=None, **_):
    if block_size is not None and (block_size & (block_size - 1) or not 1 <= block_size <= 1024):
        return f"block_size {block_size} must be a power of two <= 1024 (tree reduction)"
    return None


def _check_vec4(T, **_):
    if T % 4:
        return f"T={T} is not a multiple of 4 (float4 rows must start 16-byte aligned)"
    return None


def _nv4(T):
    """float4s per lane for the register-resident variants (the smallest power of two covering T)."""
    for nv in (1, 2, 4, 8, 16):
        if 128 * nv >= T:
            return nv
    return None


def _check_regs(T, **_):
    if _nv4(T) is None:
        return f"T={T} > 2048: the row no longer fits in one warp's registers (use variant 5)"
    return None


def _all(*checks):
    def check(**shape):
        for c in checks:
            r = c(**shape)
            if r:
                return r
        return None
    return check


def _thread_per_row(op, func):
    def build(rt, BNH, T, scale, block_size=None):
        bs = block_size or 256
        k = rt.kernel(MODULE, func, "P" * (2 if op == "softmax_forward" else 3) + "iif", label=f"{op} 1")
        grid, args = (ceil_div(BNH * T, bs), 1, 1), _row_args(BNH, T, scale)

        def launch(*bufs):
            k(grid, (bs, 1, 1), *(_ptr(b) for b in bufs), *args)
        return launch
    return build


def _block_per_row(op, func, number, smem_floats):
    """smem_floats(T, bs): dynamic shared memory in floats."""
    def build(rt, BNH, T, scale, block_size=None):
        bs = block_size or (256 if number == 2 else 128)
        k = rt.kernel(MODULE, func, "P" * (2 if op == "softmax_forward" else 3) + "iif", label=f"{op} {number}")
        smem = 4 * smem_floats(T, bs)
        if smem > rt.max_smem_optin:
            refuse(op, number, f"needs {smem} bytes of shared memory, the device allows {rt.max_smem_optin}")
        k.set_max_dynamic_smem(smem)
        grid, args = (BNH * T, 1, 1), _row_args(BNH, T, scale)

        def launch(*bufs):
            k(grid, (bs, 1, 1), *(_ptr(b) for b in bufs), *args, smem=smem)
        return launch
    return build


def _warp_per_row(op, func, number):
    """func may be a callable T -> kernel name (register-resident variants pick NV4 by T)."""
    def build(rt, BNH, T, scale, block_size=None):
        bs = block_size or 256
        name = func(T) if callable(func) else func
        k = rt.kernel(MODULE, name, "P" * (2 if op == "softmax_forward" else 3) + "iif", label=f"{op} {number}")
        grid, args = (ceil_div(BNH * T * 32, bs), 1, 1), _row_args(BNH, T, scale)

        def launch(*bufs):
            k(grid, (bs, 1, 1), *(_ptr(b) for b in bufs), *args)
        return launch
    return build


F, BW = "softmax_forward", "softmax_backward"

SOFTMAX_FORWARD_VARIANTS = {
    1: Variant(1, "one thread per row, three serial passes (max, sum, write): the plainest",
               _thread_per_row(F, "softmax_forward_kernel1"), _all(_check_rows)),
    2: Variant(2, "one block per row, shared-memory tree reductions",
               _block_per_row(F, "softmax_forward_kernel2", 2, lambda T, bs: bs), _all(_check_rows, _check_pow2_block)),
    3: Variant(3, "one warp per row, shuffle reductions, three passes over the row",
               _warp_per_row(F, "softmax_forward_kernel3", 3), _all(_check_rows, _check_warp_block)),
    4: Variant(4, "one warp per row, online softmax (max and sum in one pass), then the write pass",
               _warp_per_row(F, "softmax_forward_kernel4", 4), _all(_check_rows, _check_warp_block)),
    5: Variant(5, "4 with float4 loads/stores (T % 4 == 0)",
               _warp_per_row(F, "softmax_forward_kernel5", 5), _all(_check_rows, _check_warp_block, _check_vec4)),
    6: Variant(6, "one warp per row, lower triangle held in registers: one DRAM read of s <= t, streaming "
                  "float4 stores (T % 4 == 0, T <= 2048)",
               _warp_per_row(F, lambda T: f"softmax_forward_kernel6_nv{_nv4(T)}", 6),
               _all(_check_rows, _check_warp_block, _check_vec4, _check_regs)),
}

SOFTMAX_BACKWARD_VARIANTS = {
    1: Variant(1, "one thread per row, two serial passes (dot, write): the plainest",
               _thread_per_row(BW, "softmax_backward_kernel1"), _all(_check_rows)),
    2: Variant(2, "one block per row, shared-memory tree reduction of the dot product",
               _block_per_row(BW, "softmax_backward_kernel2", 2, lambda T, bs: bs), _all(_check_rows, _check_pow2_block)),
    3: Variant(3, "one warp per row, shuffle reduction, two passes over the row",
               _warp_per_row(BW, "softmax_backward_kernel3", 3), _all(_check_rows, _check_warp_block)),
    4: Variant(4, "one block per row, the row cached in shared memory: one DRAM read for any T",
               _block_per_row(BW, "softmax_backward_kernel4", 4, lambda T, bs: 2 * T),
               _all(_check_rows, _check_warp_block,
                    lambda T, **_: f"T={T}: 2*T floats exceed 227 KB of shared memory" if 8 * T > 227 * 1024 else None)),
    5: Variant(5, "3 with float4 loads/stores (T % 4 == 0)",
               _warp_per_row(BW, "softmax_backward_kernel5", 5), _all(_check_rows, _check_warp_block, _check_vec4)),
    6: Variant(6, "one warp per row, lower triangles of att and datt held in registers: one DRAM read, "
                  "streaming float4 stores (T % 4 == 0, T <= 2048)",
               _warp_per_row(BW, lambda T: f"softmax_backward_kernel6_nv{_nv4(T)}", 6),
               _all(_check_rows, _check_warp_block, _check_vec4, _check_regs)),
}

# the variant the composite falls back to when the chosen one refuses the shape (any T)
_FALLBACK = 4


# ----------------------------------------------------------------------------------------------
# GPU: permutes between (B, T, S, NH, hs) and (S, B, NH, T, hs)


def _build_permute(rt, kind, B, T, S, NH, hs):
    """kind 'permute': dst (S,B,NH,T,hs) <- src (B,T,S,NH,hs); 'unpermute': the inverse.
    launch(dst, src) with DevArrays or raw pointers."""
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
# GPU: the composites


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
    from llmc.ops import get
    spec = get(op)
    v = spec.variant(number)
    reason = v.refuse_reason(BNH=BNH, T=T, scale=scale)
    if reason:
        from llmc.ops import note_once
        note_once(f"attention: {spec.flag} {number} refuses T={T} ({reason}); using {op} {_FALLBACK}")
        number = _FALLBACK
    return number, spec.build(rt, number, BNH=BNH, T=T, scale=scale)


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


def gemm_engine_for_backward(matmul_backward_variant: int) -> int:
    """The GEMM engine that goes with a --matmul-backward-kernel number. gemm_variant_for maps
    --matmul-kernel (forward) numbers; matmul_backward's variant n runs on GEMM engine n
    (llmc/ops/matmul.py), so backward numbers map to themselves unless matmul.py says otherwise."""
    from llmc.ops import matmul as mm
    f = getattr(mm, "gemm_variant_for_backward", None)
    if f is not None:
        return f(matmul_backward_variant)
    if matmul_backward_variant in mm.GEMM_VARIANTS:
        return matmul_backward_variant
    return mm.gemm_variant_for(matmul_backward_variant)


def build_attention_forward(rt, softmax_variant, matmul_variant, B, T, C, NH, causal_chunks=None):
    """launch(out (B,T,C), qkvr (B,T,3C), att (B,NH,T,T), inp (B,T,3C)); all outputs overwritten."""
    from llmc.ops.matmul import gemm_build, gemm_variant_for
    _check_attention(B, T, C, NH)
    hs, BNH = C // NH, B * NH
    scale = 1.0 / math.sqrt(hs)
    gv = gemm_variant_for(matmul_variant)
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
                       strideA=T * hs, strideB=T * hs, strideC=T * T)
        qk.append((g, t0 * T * F4, t0 * hs * F4, qkv_bytes))
    av = []  # (gemm launch, C offset into y, A offset into att, B offset into qkvr)
    for t0, t1 in narrow:
        # y[t0:t1] = att[rows t0:t1, cols 0:t1] @ v[0:t1]  (att is 0 for s > t within the block)
        g = gemm_build(rt, gv, False, False, M=t1 - t0, N=hs, K=t1, batch=BNH, lda=T, ldb=hs, ldc=hs,
                       strideA=T * T, strideB=T * hs, strideC=T * hs)
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
    launch.scratch = {"preatt": preatt, "y": y}
    launch.saved_shape = (B, NH, T, T)
    return launch


def build_attention_backward(rt, softmax_backward_variant, matmul_backward_variant, B, T, C, NH,
                             causal_chunks=None, lower_only=True):
    """launch(dinp (B,T,3C), dout (B,T,C), qkvr (B,T,3C), att (B,NH,T,T)); dinp overwritten.
    lower_only: with softmax_backward 6, use its entry point that stores only s <= t into a dpreatt
    scratch zeroed here once (nothing else writes dpreatt, so its upper triangle stays 0)."""
    from llmc.ops.matmul import gemm_build
    _check_attention(B, T, C, NH)
    hs, BNH = C // NH, B * NH
    scale = 1.0 / math.sqrt(hs)
    gv = gemm_engine_for_backward(matmul_backward_variant)
    sm_number, softmax_bwd = _softmax_op(rt, "softmax_backward", softmax_backward_variant, BNH, T, scale)
    lower_only = lower_only and sm_number == 6
    if lower_only:
        softmax_bwd = _warp_per_row(BW, lambda T: f"softmax_backward_kernel6_lower_nv{_nv4(T)}", 6)(rt, BNH, T, scale)
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
                       strideA=sTT, strideB=sTh, strideC=sTh)
        steps_pre.append((g, "dqkvr", 2 * qkv_bytes + t0 * hs * F4, "att", (t0 * T + t0) * F4, "dy", t0 * hs * F4))
    for t0, t1 in wide:
        # datt[rows t0:t1, cols 0:t1] = dy[t0:t1] @ v[0:t1]^T
        g = gemm_build(rt, gv, False, True, M=t1 - t0, N=t1, K=hs, batch=BNH, lda=hs, ldb=hs, ldc=T,
                       strideA=sTh, strideB=sTh, strideC=sTT)
        steps_pre.append((g, "datt", t0 * T * F4, "dy", t0 * hs * F4, "qkvr", 2 * qkv_bytes))
    for t0, t1 in narrow:
        # dq[t0:t1] = dpreatt[rows t0:t1, cols 0:t1] @ k[0:t1]
        g = gemm_build(rt, gv, False, False, M=t1 - t0, N=hs, K=t1, batch=BNH, lda=T, ldb=hs, ldc=hs,
                       strideA=sTT, strideB=sTh, strideC=sTh)
        steps_post.append((g, "dqkvr", t0 * hs * F4, "dpreatt", t0 * T * F4, "qkvr", qkv_bytes))
        # dk[s in t0:t1] = dpreatt[t >= t0, s]^T @ q[t >= t0]
        g = gemm_build(rt, gv, True, False, M=t1 - t0, N=hs, K=T - t0, batch=BNH, lda=T, ldb=hs, ldc=hs,
                       strideA=sTT, strideB=sTh, strideC=sTh)
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
    launch.scratch = {"dy": dy, "datt": datt, "dpreatt": dpreatt, "dqkvr": dqkvr}
    launch.keep = {"dpreatt"} if lower_only else set()  # scratch whose contents must persist
    launch.saved_shape = (B, NH, T, T)
    return launch


# ----------------------------------------------------------------------------------------------
# GPU: fused ("flash") attention, head size 64 (cuda/attention.cu, flash_attention_*_kernel2/3)

FLASH_HS = 64   # the kernels' head size (every GPT-2 size has 64)
FLASH_TILE = 64  # rows per block, positions per tile


def _check_flash(B, T, C, NH, **_):
    bad = _check_composite(B, T, C, NH)
    if bad:
        return bad
    if C // NH != FLASH_HS:
        return f"head size C/NH = {C // NH}: the fused kernels are written for head size {FLASH_HS}"
    if 3 * B * T * C >= 2**31:
        return f"3*B*T*C = {3 * B * T * C:,} does not fit int32 indexing"
    return None


def _flash_smem(kind, version):
    """Dynamic shared memory in bytes of a flash kernel (the layout is described in cuda/attention.cu)."""
    tile, pipe = FLASH_TILE * 68, version == 3
    floats = {"fwd": (4 if pipe else 2) * tile,
              "dq": (4 if pipe else 2) * tile + FLASH_TILE,
              "dkdv": (6 if pipe else 4) * tile + (4 if pipe else 2) * FLASH_TILE}[kind]
    return 4 * floats


def _flash_kernel(rt, name, argtypes, kind, version, label, defines=None):
    k = rt.kernel(MODULE, f"{name}{version}", argtypes, label=label, defines=defines)
    smem = _flash_smem(kind, version)
    if smem > rt.max_smem_optin:
        refuse(label.split()[0], version, f"needs {smem} bytes of shared memory, the device allows {rt.max_smem_optin}")
    k.set_max_dynamic_smem(smem)
    return k, smem


def build_flash_attention_forward(rt, B, T, C, NH, version=2, defines=None, **_):
    """launch(out (B,T,C), qkvr (B,T,3C), lse (B,NH,T), inp (B,T,3C)): the permute into qkvr, then
    one fused kernel writing out and the per-row log-sum-exp (launch.saved_shape) for backward.
    version 2: tiles staged by the threads; 3: cp.async double-buffered."""
    _check_attention(B, T, C, NH)
    permute = _build_permute(rt, "permute", B, T, 3, NH, FLASH_HS)
    k, smem = _flash_kernel(rt, "flash_attention_forward_kernel", "PPPiiif", "fwd", version,
                            f"attention_forward {version} (flash)", defines)
    grid, block = (ceil_div(T, FLASH_TILE), B * NH, 1), (128, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))

    def launch(out, qkvr, lse, inp):
        permute(qkvr, inp)
        k(grid, block, _ptr(out), _ptr(lse), _ptr(qkvr), *args, smem=smem)
    launch.scratch = {}
    launch.saved_shape = (B, NH, T)
    return launch


def build_flash_attention_backward(rt, B, T, C, NH, version=2, defines=None, **_):
    """launch(dinp (B,T,3C), dout (B,T,C), qkvr (B,T,3C), lse (B,NH,T), out (B,T,C)): two kernels,
    dq (also writing D = rowsum(dout * out)) then dk, dv; dinp overwritten, no atomics."""
    _check_attention(B, T, C, NH)
    D = rt.empty((B, NH, T))
    label = f"attention_backward {version} (flash)"
    kq, smq = _flash_kernel(rt, "flash_attention_backward_dq_kernel", "PPPPPPiiif", "dq", version, label + " dq",
                            defines)
    kkv, smkv = _flash_kernel(rt, "flash_attention_backward_dkdv_kernel", "PPPPPiiif", "dkdv", version,
                              label + " dk dv", defines)
    grid, block = (ceil_div(T, FLASH_TILE), B * NH, 1), (128, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.float32(1.0 / math.sqrt(FLASH_HS)))

    def launch(dinp, dout, qkvr, lse, out):
        kq(grid, block, _ptr(dinp), _ptr(D), _ptr(dout), _ptr(out), _ptr(qkvr), _ptr(lse), *args, smem=smq)
        kkv(grid, block, _ptr(dinp), _ptr(dout), _ptr(qkvr), _ptr(lse), _ptr(D), *args, smem=smkv)
    launch.scratch = {"D": D}
    launch.keep = set()
    launch.saved_shape = (B, NH, T)
    return launch


def _flash(direction, version):
    f = build_flash_attention_forward if direction == "forward" else build_flash_attention_backward
    return lambda rt, **shape: f(rt, version=version, **shape)


def _composite(direction):
    """Variant 1 of attention_forward/backward: the composite, built from the softmax and matmul
    variants the backend passes in (softmax=, matmul=)."""
    def build(rt, B, T, C, NH, softmax=None, matmul=None, **kw):
        from llmc.ops import get
        sm = softmax if softmax is not None else get(f"softmax_{direction}").default
        mm = matmul if matmul is not None else get("matmul_" + direction).default
        f = build_attention_forward if direction == "forward" else build_attention_backward
        return f(rt, sm, mm, B=B, T=T, C=C, NH=NH, **kw)
    return build


def _check_composite(B, T, C, NH, **_):
    if min(B, T, C, NH) < 1 or C % NH:
        return f"B={B} T={T} C={C} NH={NH} is not a valid attention shape"
    return None


ATTENTION_FORWARD_VARIANTS = {
    1: Variant(1, "composite: permute, q k^T and att v in the batched GEMM (--matmul-kernel), causal softmax "
                  "(--softmax-kernel), unpermute; keeps att (B,NH,T,T) for backward",
               _composite("forward"), _check_composite),
    2: Variant(2, "fused flash attention, TF32 mma.sync, online softmax in registers; keeps only the "
                  "log-sum-exp (B,NH,T); k, v tiles staged by the threads (head size 64)",
               _flash("forward", 2), _check_flash),
    3: Variant(3, "2 with the k, v tiles double-buffered through cp.async: the next tile loads while "
                  "the tensor cores work (head size 64; measured slower than 2: not load-bound)",
               _flash("forward", 3), _check_flash),
}
ATTENTION_BACKWARD_VARIANTS = {
    1: Variant(1, "composite: dv, datt in the batched GEMM (--matmul-backward-kernel), softmax backward "
                  "(--softmax-backward-kernel), dq, dk; needs att from attention_forward 1",
               _composite("backward"), _check_composite),
    2: Variant(2, "fused flash attention backward, TF32 mma.sync: a dq kernel and a dk/dv kernel "
                  "recompute att from the log-sum-exp, no atomics; needs attention_forward 2 or 3 (head size 64)",
               _flash("backward", 2), _check_flash),
    3: Variant(3, "2 with the swept tiles double-buffered through cp.async (head size 64)",
               _flash("backward", 3), _check_flash),
}


# ----------------------------------------------------------------------------------------------
# GPU: decode with a KV cache (sampling)


DECODE_CHUNK = 64  # keys per block of attention_decode_kernel2 (cuda/attention.cu)


def build_attention_decode(rt, B, C, NH, maxT, block_size=128, version=None):
    """launch(out (B,C), qkv (B,3C), kcache (B,NH,maxT,hs), vcache (B,NH,maxT,hs), pos (1,) int32 on
    the device, 0 <= pos < maxT: the caller checks, the kernels read it each launch). qkv is the
    qkv matmul's output for the new token: its k, v go into the caches at pos, its q attends over
    positions 0..pos.
    version 2 (the default where hs % 4 == 0): split over chunks of 64 keys, then a combine kernel;
    version 1: one block per (b, h)."""
    if C % NH:
        raise LLMCError(f"attention decode: C={C} is not divisible by NH={NH}")
    hs = C // NH
    version = version or (2 if hs % 4 == 0 else 1)
    if version == 2 and hs % 4:
        raise LLMCError(f"attention decode 2: head size {hs} is not a multiple of 4 (float4 keys)")
    ptrs = lambda *a: [_ptr(x) for x in a]  # noqa: E731
    if version == 1:
        k = rt.kernel(MODULE, "attention_decode_kernel1", "PPPPPiiiif", label="attention decode 1")
        G = max(1, block_size // hs)
        smem = 4 * (hs + maxT + max(G * hs, block_size))
        if smem > rt.max_smem_optin:
            raise LLMCError(f"attention decode: maxT={maxT} needs {smem} bytes of shared memory")
        k.set_max_dynamic_smem(smem)
        grid, block = (B * NH, 1, 1), (block_size, 1, 1)
        args = (np.int32(B), np.int32(NH), np.int32(hs), np.int32(maxT), np.float32(1.0 / math.sqrt(hs)))

        def launch(out, qkv, kcache, vcache, pos):
            k(grid, block, *ptrs(out, qkv, kcache, vcache, pos), *args, smem=smem)
        return launch
    chunks = -(-maxT // DECODE_CHUNK)
    part = rt.empty((B * NH, chunks, hs + 2))
    k = rt.kernel(MODULE, "attention_decode_kernel2", "PPPPPiiiif", label="attention decode 2")
    comb = rt.kernel(MODULE, "attention_decode_combine_kernel2", "PPPiii", label="attention decode 2 combine")
    bs = 128
    smem = 4 * (hs + DECODE_CHUNK + max(1, bs // hs) * hs)
    if smem > rt.max_smem_optin:
        raise LLMCError(f"attention decode 2: head size {hs} needs {smem} bytes of shared memory")
    k.set_max_dynamic_smem(smem)
    args = (np.int32(B), np.int32(NH), np.int32(hs), np.int32(maxT), np.float32(1.0 / math.sqrt(hs)))
    cbs = min(1024, -(-hs // 32) * 32)

    def launch(out, qkv, kcache, vcache, pos):
        k((B * NH, chunks, 1), (bs, 1, 1), _ptr(part), *ptrs(qkv, kcache, vcache, pos), *args, smem=smem)
        comb((B * NH, 1, 1), (cbs, 1, 1), _ptr(out), _ptr(part), _ptr(pos), np.int32(NH), np.int32(hs),
             np.int32(chunks))
    return launch


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


def build_kv_fill(rt, B, C, NH, maxT, T, block_size=256):
    """launch(kcache (B,NH,maxT,hs), vcache, qkvr (B,T,3C) as saved by attention_forward)."""
    hs = C // NH
    if not 1 <= T <= maxT:
        raise LLMCError(f"kv fill: T={T} outside 1..maxT={maxT}")
    k = rt.kernel(MODULE, "attention_kv_fill_kernel1", "PPPiiiii", label="attention kv_fill 1")
    grid, block = (-(-B * NH * T * hs // block_size), 1, 1), (block_size, 1, 1)
    args = (np.int32(B), np.int32(NH), np.int32(T), np.int32(hs), np.int32(maxT))

    def launch(kcache, vcache, qkvr):
        k(grid, block, _ptr(kcache), _ptr(vcache), _ptr(qkvr), *args)
    return launch


# ----------------------------------------------------------------------------------------------
# the op table

OPS = [
    OpSpec("softmax_forward", softmax_forward_cpu, SOFTMAX_FORWARD_VARIANTS, default=6, flag="--softmax-kernel",
           doc="att(BNH,T,T)=, preatt(BNH,T,T); build(BNH, T, scale)"),
    OpSpec("softmax_backward", softmax_backward_cpu, SOFTMAX_BACKWARD_VARIANTS, default=6,
           flag="--softmax-backward-kernel",
           doc="dpreatt(BNH,T,T)=, datt(BNH,T,T), att(BNH,T,T); build(BNH, T, scale)"),
    # variant 1 is the composite of the softmax and matmul variants above; 2 is fused. What forward
    # keeps for backward differs (att or lse): the backend keeps the two directions' numbers equal
    OpSpec("attention_forward", attention_forward_cpu, ATTENTION_FORWARD_VARIANTS, default=2,
           flag="--attention-kernel",
           doc="out(B,T,C)=, qkvr(B,T,3C)=, saved=, inp(B,T,3C); saved is att(B,NH,T,T) (1) or "
               "lse(B,NH,T) (2), launch.saved_shape; build(B, T, C, NH)"),
    OpSpec("attention_backward", attention_backward_cpu, ATTENTION_BACKWARD_VARIANTS, default=3,
           flag="--attention-backward-kernel",
           doc="dinp(B,T,3C)=, dout(B,T,C), qkvr(B,T,3C), saved, out(B,T,C); build(B, T, C, NH)"),
]
