"""Attention: numpy references vs PyTorch float64 autograd (CPU), the composite's launch plan on a
numpy "device" (CPU), and every GPU softmax variant plus the GPU composite and decode kernel vs the
references (-m gpu).

    python -m pytest tests/test_attention.py -q            # CPU part (CI)
    python -m pytest tests/test_attention.py -q -m gpu     # GPU part, on a machine with a GPU
"""
import math
import os

import numpy as np
import pytest

from llmc import ops
from llmc.errors import LLMCError, VariantRefused
from llmc.ops import attention as A
from llmc.testing import assert_close, poison, rel_err

# ----------------------------------------------------------------------------------------------
# torch float64 versions of the math, written out (the oracle for the numpy references)


def torch_causal_softmax(preatt, scale):
    import torch
    T = preatt.shape[-1]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    return torch.softmax((preatt * scale).masked_fill(~mask, float("-inf")), dim=-1)


def torch_attention(inp, NH):
    """inp (B,T,3C) float64 tensor -> (out (B,T,C), att (B,NH,T,T)), GPT-2's causal attention."""
    B, T, C3 = inp.shape
    C = C3 // 3
    hs = C // NH
    q, k, v = inp.split(C, dim=2)
    q, k, v = (x.view(B, T, NH, hs).transpose(1, 2) for x in (q, k, v))  # (B, NH, T, hs)
    att = torch_causal_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(hs))
    out = (att @ v).transpose(1, 2).reshape(B, T, C)
    return out, att


# ----------------------------------------------------------------------------------------------
# CPU: references vs torch


@pytest.mark.parametrize("B,T,C,NH", [(2, 9, 24, 3), (1, 1, 8, 2), (2, 16, 32, 4)])
def test_attention_refs_match_torch(B, T, C, NH, rng):
    import torch
    inp = rng.standard_normal((B, T, 3 * C))
    dout = rng.standard_normal((B, T, C))
    x = torch.tensor(inp, requires_grad=True)
    out_t, att_t = torch_attention(x, NH)
    out_t.backward(torch.tensor(dout))
    out, qkvr, att = A.attention_forward_ref(inp, NH)
    assert out.shape == (B, T, C) and qkvr.shape == (B, T, 3 * C) and att.shape == (B, NH, T, T)
    assert_close(out, out_t.detach().numpy(), 1e-12, 1e-10, "out")
    assert_close(att, att_t.detach().numpy(), 1e-12, 1e-10, "att")
    # qkvr layout: q | k | v, each (B, NH, T, hs), one after the other
    hs = C // NH
    q, k, v = qkvr.reshape(3, B, NH, T, hs)
    assert np.array_equal(k[1 % B, NH - 1, T - 1], inp[1 % B, T - 1, C + (NH - 1) * hs:C + NH * hs])
    assert np.array_equal(v[0, 0, 0], inp[0, 0, 2 * C:2 * C + hs])
    dinp = A.attention_backward_ref(dout, qkvr, att, NH)
    assert_close(dinp, x.grad.numpy(), 1e-12, 1e-10, "dinp")


def test_refs_keep_float32():
    rng = np.random.default_rng(0)
    inp = rng.standard_normal((1, 5, 24)).astype(np.float32)
    out, qkvr, att = A.attention_forward_ref(inp, 2)
    assert out.dtype == qkvr.dtype == att.dtype == np.float32
    assert A.attention_backward_ref(out, qkvr, att, 2).dtype == np.float32


def test_cpu_launchers_write_in_place(rng):
    B, T, C, NH = 2, 7, 12, 3
    inp = rng.standard_normal((B, T, 3 * C))
    out, qkvr, att = np.full((B, T, C), np.nan), np.full((B, T, 3 * C), np.nan), np.full((B, NH, T, T), np.nan)
    ops.get("attention_forward").cpu(B=B, T=T, C=C, NH=NH)(out, qkvr, att, inp)
    r_out, r_qkvr, r_att = A.attention_forward_ref(inp, NH)
    assert np.array_equal(out, r_out) and np.array_equal(qkvr, r_qkvr) and np.array_equal(att, r_att)
    dout = rng.standard_normal((B, T, C))
    dinp = np.full((B, T, 3 * C), np.nan)
    ops.get("attention_backward").cpu(B=B, T=T, C=C, NH=NH)(dinp, dout, qkvr, att)
    assert np.array_equal(dinp, A.attention_backward_ref(dout, qkvr, att, NH))


@pytest.mark.parametrize("B,T,C,NH,maxT", [(2, 9, 24, 3, 16), (1, 1, 8, 2, 4), (3, 16, 32, 4, 16)])
def test_decode_ref_matches_forward_last_row(B, T, C, NH, maxT, rng):
    inp = rng.standard_normal((B, T, 3 * C))
    out, qkvr, _ = A.attention_forward_ref(inp, NH)
    q, kc, vc = _decode_inputs(inp, qkvr, B, T, C, NH, maxT, rng)
    assert_close(A.attention_decode_ref(q, kc, vc, T - 1), out[:, T - 1], 1e-12, 1e-10)


def _decode_inputs(inp, qkvr, B, T, C, NH, maxT, rng):
    """q of the last token and caches holding k, v of positions 0..T-1 (garbage after)."""
    hs = C // NH
    _, k, v = qkvr.reshape(3, B, NH, T, hs)
    kc = rng.standard_normal((B, NH, maxT, hs)).astype(inp.dtype) * 100  # beyond pos: must be ignored
    vc = rng.standard_normal((B, NH, maxT, hs)).astype(inp.dtype) * 100
    kc[:, :, :T], vc[:, :, :T] = k, v
    return np.ascontiguousarray(inp[:, T - 1, :C]), kc, vc


# ----------------------------------------------------------------------------------------------
# CPU: the variant tables and refusals (no GPU needed)


def test_attention_variants_and_pairing():
    from llmc.backend import kernel_choices
    fwd, bwd = ops.get("attention_forward"), ops.get("attention_backward")
    assert set(fwd.variants) == {1, 2, 3, 4}  # 4: wgmma + TMA (TF32 and BF16), sm_90a only
    assert set(bwd.variants) == {1, 2, 3, 4, 5}  # 5: 4 with dq by fp32 reductions (bf16 only)
    assert bwd.variants[5].dtypes == ("bf16",)
    assert fwd.flag == "--attention-kernel" and bwd.flag == "--attention-backward-kernel"
    assert fwd.default == bwd.default == 4  # 2, 3 and 4 keep the log-sum-exp; 4 on Hopper, else 3
    for spec in (fwd, bwd):
        assert spec.variants[1].refuse_reason(B=2, T=65, C=96, NH=3) is None        # composite: any head size
        for n in (2, 3):
            assert spec.variants[n].refuse_reason(B=4, T=1024, C=768, NH=12) is None
            assert spec.variants[n].refuse_reason(B=1, T=1, C=64, NH=1) is None
            assert "head size" in spec.variants[n].refuse_reason(B=2, T=65, C=96, NH=3)
            with pytest.raises(VariantRefused, match="head size C/NH = 32"):
                spec.build(None, n, B=1, T=8, C=64, NH=2)
    # a number named for one direction is used for both (they must agree on what forward keeps)
    assert kernel_choices({"attention_forward": 1})["attention_backward"] == 1
    assert kernel_choices({"attention_backward": 1})["attention_forward"] == 1
    # --attention-kernel 4 pairs the two wgmma kernels (both keep / read the lse)
    four = kernel_choices({"attention_forward": 4})
    assert (four["attention_forward"], four["attention_backward"]) == (4, 4)
    # backward 5 reads forward 4's lse: forward stays on its default when only 5 is named
    five = kernel_choices({"attention_backward": 5})
    assert (five["attention_forward"], five["attention_backward"]) == (4, 5)
    both = kernel_choices({"attention_forward": 1, "attention_backward": 2})
    assert (both["attention_forward"], both["attention_backward"]) == (1, 2)  # the model refuses this pair
    # a softmax variant only runs in the composite: naming one selects it, unless attention is named
    for sm in ("softmax_forward", "softmax_backward"):
        c = kernel_choices({sm: 5})
        assert (c["attention_forward"], c["attention_backward"], c[sm]) == (1, 1, 5)
        c = kernel_choices({sm: 5, "attention_forward": 2})
        assert (c["attention_forward"], c["attention_backward"]) == (2, 2)
    assert kernel_choices({})["attention_forward"] == fwd.default


@pytest.mark.parametrize("B,T,C,NH", [(2, 9, 24, 3), (1, 1, 8, 2), (2, 70, 16, 2)])
def test_lse_ref_gives_att(B, T, C, NH, rng):
    """What the fused kernels keep (the log-sum-exp) reproduces the probabilities, and those the
    composite's backward reference: the fused backward's reference is attention_backward_ref."""
    inp = rng.standard_normal((B, T, 3 * C))
    out, qkvr, att = A.attention_forward_ref(inp, NH)
    lse = A.attention_lse_ref(inp, NH)
    assert lse.shape == (B, NH, T)
    assert_close(A.att_from_lse(qkvr, lse, NH), att, 1e-15, 1e-12, "att from lse")
    # lse of row t is at least the largest scaled score and at most that + log(t + 1)
    hs = C // NH
    q, k, _ = qkvr.reshape(3, B, NH, T, hs)
    s = np.where(np.tril(np.ones((T, T), bool)), q @ k.swapaxes(-1, -2) / math.sqrt(hs), -np.inf)
    assert np.all(lse >= s.max(-1) - 1e-12) and np.all(lse <= s.max(-1) + np.log(np.arange(1, T + 1)) + 1e-12)


def test_chunks_cover_rows():
    for T in (1, 63, 64, 65, 200, 1024):
        for c in (1, 2, 3, 4, 8):
            ch = A._chunks(T, c)
            assert ch[0][0] == 0 and ch[-1][1] == T
            assert all(a[1] == b[0] for a, b in zip(ch, ch[1:]))
            assert all(t1 > t0 for t0, t1 in ch)
    with pytest.raises(LLMCError):
        A._chunks(64, 0)


def test_decode_ops_are_registered_variants():
    """attention_decode and attention_kv_fill follow every op's rules: numbered variants, a flag,
    refusals with a reason, the fallback (decode 2 needs head size % 4 == 0: the default falls back to 1)."""
    from tests.test_backend import cuda_backend
    dec, fill = ops.get("attention_decode"), ops.get("attention_kv_fill")
    assert set(dec.variants) == {1, 2} and dec.default == 2 and dec.flag == "--attention-decode-kernel"
    assert fill.flag == "--attention-kv-fill-kernel" and fill.family == dec.family == "attention"
    assert "multiple of 4" in dec.refuse_reason(2, B=2, C=90, NH=3, maxT=200)
    assert dec.refuse_reason(1, B=2, C=90, NH=3, maxT=200) is None
    assert "shared memory" in dec.refuse_reason(1, B=1, C=768, NH=12, maxT=1 << 16)
    assert "outside 1..maxT" in fill.refuse_reason(1, B=1, C=64, NH=1, maxT=16, T=17)
    be = cuda_backend()
    assert be.choose("attention_decode", B=2, C=90, NH=3, maxT=200) == 1
    assert be.choose("attention_decode", B=2, C=96, NH=3, maxT=200) == 2


@pytest.mark.parametrize("B,T,C,NH", [(2, 64, 128, 2), (1, 65, 96, 3), (4, 1024, 768, 12)])
def test_declared_scratch_is_what_the_builds_allocate(B, T, C, NH, monkeypatch):
    """Variant.scratch_bytes (the model's memory estimate) against the bytes each build allocates
    on the fake runtime (the composite's GEMMs emulated without a split-K workspace)."""
    import llmc.ops.gemm as mm
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setattr(mm, "gemm_build", _fake_gemm_build)
    shapes = {"attention_forward": dict(B=B, T=T, C=C, NH=NH), "attention_backward": dict(B=B, T=T, C=C, NH=NH),
              "attention_decode": dict(B=B, C=C, NH=NH, maxT=T)}
    # (and attention_backward's colsum forms, whose partials are scratch too)
    shapes = [(name, shape) for name, shape in shapes.items()] + [("attention_backward", dict(B=B, T=T, C=C, NH=NH,
                                                                                             colsum=True))]
    for name, shape in shapes:
        spec = ops.get(name)
        for num, v in spec.variants.items():
            for dtype in v.dtypes:  # the bf16 builds' scratch (D, decode's chunk states) is fp32 too
                if spec.refuse_reason(num, dtype, **shape):
                    continue
                rt = FakeRuntime()
                spec.build(rt, num, dtype, **shape)
                assert rt.allocated_bytes == v.scratch_bytes(**shape, dtype=dtype), (name, num, dtype, shape)


def test_decode_cpu_launchers(rng):
    """The registered numpy launchers: decode appends the new k, v at pos and attends over 0..pos;
    kv fill copies a forward's k, v into positions 0..T-1."""
    B, T, C, NH, maxT = 2, 9, 24, 3, 16
    hs = C // NH
    inp = rng.standard_normal((B, T, 3 * C))
    out, qkvr, _ = A.attention_forward_ref(inp, NH)
    kc, vc = np.full((B, NH, maxT, hs), np.nan), np.full((B, NH, maxT, hs), np.nan)
    _, qkvr_p, _ = A.attention_forward_ref(inp[:, :T - 1], NH)    # the prompt's forward: positions 0..T-2
    ops.get("attention_kv_fill").cpu(B=B, C=C, NH=NH, maxT=maxT, T=T - 1)(kc, vc, qkvr_p)
    _, k, v = qkvr.reshape(3, B, NH, T, hs)
    assert np.array_equal(kc[:, :, :T - 1], k[:, :, :T - 1]) and np.isnan(kc[:, :, T - 1:]).all()
    kc2, vc2 = kc, vc
    got = np.full((B, C), np.nan)
    ops.get("attention_decode").cpu(B=B, C=C, NH=NH, maxT=maxT)(got, inp[:, T - 1].copy(), kc2, vc2,
                                                                 np.array([T - 1], np.int32))
    assert_close(got, out[:, T - 1], 1e-12, 1e-10, "decode out")
    assert np.array_equal(kc2[:, :, :T], k) and np.array_equal(vc2[:, :, :T], v)


# ----------------------------------------------------------------------------------------------
# CPU: the composite's launch plan (pointer offsets, strides, causal chunks) run on the tests' fake
# runtime (tests/fake_runtime.py): a numpy heap poisoned with NaN; the GEMM engine and our kernels
# are emulated with numpy. Anything the plan reads that nothing wrote shows up as NaN.


def _emulate_permute(rt, dst, src, B, T, S, NH, hs, unpermute=False):
    n = S * B * NH * T * hs
    x = rt.floats(src, n).copy()
    if not unpermute:  # dst (S,B,NH,T,hs) <- src (B,T,S,NH,hs)
        out = x.reshape(B, T, S, NH, hs).transpose(2, 0, 3, 1, 4)
    else:              # dst (B,T,S,NH,hs) <- src (S,B,NH,T,hs)
        out = x.reshape(S, B, NH, T, hs).transpose(1, 3, 0, 2, 4)
    rt.floats(dst, n)[:] = out.reshape(-1)


def _emulate_softmax_forward(rt, att, pre, BNH, T, scale):
    x = rt.floats(pre, BNH * T * T).reshape(BNH, T, T).astype(np.float64)
    rt.floats(att, BNH * T * T)[:] = A.softmax_forward_ref(x, float(scale)).reshape(-1)


def _emulate_softmax_backward(lower):
    def run(rt, dx, g, a, BNH, T, scale):
        gv = rt.floats(g, BNH * T * T).reshape(BNH, T, T).astype(np.float64)
        av = rt.floats(a, BNH * T * T).reshape(BNH, T, T).astype(np.float64)
        d = A.softmax_backward_ref(gv, av, float(scale))
        out = rt.floats(dx, BNH * T * T).reshape(BNH, T, T)
        if lower:  # stores only s <= t (rounded up to float4s: those extra are 0 anyway)
            m = np.tril(np.ones((T, T), bool))
            out[:, m] = d[:, m]
        else:
            out[...] = d
    return run


def fake_runtime(nbytes):
    from tests.fake_runtime import FakeRuntime
    rt = FakeRuntime(nbytes)
    rt.emulate.update({
        "permute": lambda rt, d, s, *dims: _emulate_permute(rt, d, s, *(int(x) for x in dims)),
        "unpermute": lambda rt, d, s, *dims: _emulate_permute(rt, d, s, *(int(x) for x in dims), unpermute=True),
        "softmax_forward": _emulate_softmax_forward,
        "softmax_backward_kernel6_lower": _emulate_softmax_backward(True),
        "softmax_backward": _emulate_softmax_backward(False),
    })
    return rt


def _fake_gemm_build(rt, variant, transA, transB, M, N, K, batch=1, lda=None, ldb=None, ldc=None,
                     strideA=0, strideB=0, strideC=0, alpha=1.0, beta=0.0, has_bias=False):
    """The engine's contract (llmc/ops/gemm.py) in numpy on the fake heap (no workspace allocated)."""
    from llmc.ops import Built, ptr
    lda = lda or (M if transA else K)
    ldb = ldb or (K if transB else N)
    ldc = ldc or N

    def launch(C, Am, Bm, bias=None):
        c, a, b = ptr(C), ptr(Am), ptr(Bm)
        av = rt.strided(a, (batch, K, M) if transA else (batch, M, K), (strideA, lda, 1))
        bv = rt.strided(b, (batch, N, K) if transB else (batch, K, N), (strideB, ldb, 1))
        opa = av.swapaxes(-1, -2) if transA else av
        opb = bv.swapaxes(-1, -2) if transB else bv
        res = alpha * (opa.astype(np.float64) @ opb)
        cv = rt.strided(c, (batch, M, N), (strideC, ldc, 1))
        if beta != 0.0:
            res = res + beta * cv
        cv[...] = res
    return Built(launch, op="gemm", number=variant)


@pytest.mark.parametrize("B,T,C,NH,chunks", [
    (2, 9, 24, 3, 1), (1, 1, 8, 2, 4), (2, 200, 32, 2, 3), (1, 256, 16, 2, 4), (1, 130, 16, 1, 8),
    (1, 256, 16, 2, (4, 2)), (2, 200, 12, 3, (1, 3)), (1, 70, 8, 2, None),
])
@pytest.mark.parametrize("lower_only", [True, False])
def test_composite_plan_on_numpy_device(B, T, C, NH, chunks, lower_only, rng, monkeypatch):
    import llmc.ops.gemm as mm
    monkeypatch.setattr(mm, "gemm_build", _fake_gemm_build)
    hs = C // NH
    rt = fake_runtime(4 * (12 * B * T * C + 6 * B * NH * T * T) + (1 << 16))
    fwd = A.build_attention_forward(rt, 6, 1, B=B, T=T, C=C, NH=NH, causal_chunks=chunks)
    bwd = A.build_attention_backward(rt, 6, 1, B=B, T=T, C=C, NH=NH, causal_chunks=chunks, lower_only=lower_only)
    inp = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    d_inp, d_dout = rt.to_device(inp), rt.to_device(dout)
    d_out, d_qkvr, d_att = rt.empty((B, T, C)), rt.empty((B, T, 3 * C)), rt.empty((B, NH, T, T))
    d_dinp = rt.empty((B, T, 3 * C))
    fwd(d_out, d_qkvr, d_att, d_inp)
    bwd(d_dinp, d_dout, d_qkvr, d_att)
    out, qkvr, att = A.attention_forward_ref(inp.astype(np.float64), NH)
    # the heap is float32: results are rounded there (a misplaced offset shows as NaN or O(1) errors)
    assert_close(rt.np(d_out), out, 1e-5, 1e-4, "out")
    assert_close(rt.np(d_qkvr), qkvr, 0, 0, "qkvr")
    assert_close(rt.np(d_att), att, 1e-6, 1e-4, "att")
    ref = A.attention_backward_ref(dout.astype(np.float64), rt.np(d_qkvr).astype(np.float64),
                                   rt.np(d_att).astype(np.float64), NH)
    assert_close(rt.np(d_dinp), ref, 1e-5, 1e-4, "dinp")
    # the plan launches: permute, gemms, softmax, gemms, unpermute (forward); float4 permutes when hs % 4 == 0
    perm = "permute_kernel2" if hs % 4 == 0 else "permute_kernel1"
    calls = [launch.func for launch in rt.launches]
    assert calls[0] == perm
    # softmax_backward 6 takes T % 4 == 0 (else the composite falls back to 4); lower-only if asked
    lower = [c for c in calls if c.startswith("softmax_backward_kernel6_lower")]
    assert bool(lower) == (lower_only and T % 4 == 0)


def test_composite_falls_back_when_softmax_refuses(rng, monkeypatch, capsys):
    import llmc.ops.gemm as mm
    import llmc.ops
    monkeypatch.setattr(mm, "gemm_build", _fake_gemm_build)
    monkeypatch.setattr(llmc.ops, "_NOTED", set())
    rt = fake_runtime(1 << 18)
    A.build_attention_forward(rt, 6, 1, B=1, T=65, C=8, NH=2)
    assert "using softmax_forward 4" in capsys.readouterr().out
    A.build_attention_forward(rt, 6, 1, B=1, T=65, C=8, NH=2)
    assert "using softmax_forward 4" not in capsys.readouterr().out  # said once per process
    with pytest.raises(LLMCError, match="not divisible"):
        A.build_attention_forward(rt, 6, 1, B=1, T=8, C=10, NH=3)


# ----------------------------------------------------------------------------------------------
# GPU: the composite forward/backward and the decode kernel

ATTN_SHAPES = [(2, 65, 96, 2), (1, 1, 64, 1), (4, 64, 768, 12)]


def _matmul_variants():
    """The matmul variant numbers to drive the GEMM engine with (default first)."""
    try:
        fwd, bwd = ops.get("matmul_forward"), ops.get("matmul_backward")
        return fwd.default, bwd.default
    except KeyError:
        return 1, 1


# The GEMM engine may run on TF32 tensor cores: ~1e-3 relative per product with K = hs or T, so
# elementwise checks would need ~1e-2; we compare norm-wise (rel_err < 5e-3) and require every
# element written (finite). The permute into qkvr is a copy: exact.
TF32_REL = 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("lower_only", [True, False])
@pytest.mark.parametrize("chunks", [1, (4, 2)])
@pytest.mark.parametrize("sm", [1, 6])
@pytest.mark.parametrize("B,T,C,NH", ATTN_SHAPES)
def test_attention_composite_gpu(rt, B, T, C, NH, sm, chunks, lower_only):
    rng = np.random.default_rng(B * 1000 + T)
    mf, mb = _matmul_variants()
    fwd = A.build_attention_forward(rt, sm, mf, B=B, T=T, C=C, NH=NH, causal_chunks=chunks)
    bwd = A.build_attention_backward(rt, sm, mb, B=B, T=T, C=C, NH=NH, causal_chunks=chunks,
                                     lower_only=lower_only)
    inp = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    out64, qkvr64, att64 = A.attention_forward_ref(inp.astype(np.float64), NH)
    d_inp, d_dout = rt.to_device(inp), rt.to_device(dout)
    d_out, d_qkvr, d_att = rt.empty((B, T, C)), rt.empty((B, T, 3 * C)), rt.empty((B, NH, T, T))
    d_dinp = rt.empty((B, T, 3 * C))
    # poison the scratch too: nothing may read scratch it did not write (but dpreatt of the
    # lower-only softmax backward is zeroed at build and must stay so)
    poison(d_out, d_qkvr, d_att, d_dinp, *fwd.scratch.values(),
           *(v for k, v in bwd.scratch.items() if k not in bwd.keep))
    fwd(d_out, d_qkvr, d_att, d_inp)
    out, qkvr, att = d_out.get(), d_qkvr.get(), d_att.get()
    assert_close(qkvr, qkvr64, 0, 0, "qkvr")
    for name, got, ref in (("out", out, out64), ("att", att, att64)):
        assert np.isfinite(got).all(), f"{name}: unwritten (NaN) elements"
        assert rel_err(got, ref) < TF32_REL, f"{name}: rel_err {rel_err(got, ref):.2e}"
    assert np.all(att[:, :, ~np.tril(np.ones((T, T), bool))] == 0.0)
    # backward from the GPU's own forward state (what the model does)
    bwd(d_dinp, d_dout, d_qkvr, d_att)
    dinp = d_dinp.get()
    ref = A.attention_backward_ref(dout.astype(np.float64), qkvr.astype(np.float64), att.astype(np.float64), NH)
    assert np.isfinite(dinp).all(), "dinp: unwritten (NaN) elements"
    assert rel_err(dinp, ref) < TF32_REL, f"dinp: rel_err {rel_err(dinp, ref):.2e}"


FLASH_SHAPES = [(2, 65, 128, 2), (1, 1, 64, 1), (4, 64, 768, 12), (1, 200, 192, 3), (2, 1024, 768, 12),
                (3, 127, 64, 1)]


def _flash_fp32_checked(rt, fwd, bwd, B, T, C, NH, seed):
    """One fp32 fused forward (fwd) then backward (bwd) on random inputs, every output poisoned first
    and checked against float64: qkvr the exact permute, out and lse to TF32's tolerance, each part of
    dinp (_part_errors) likewise. Returns the host results, the references and the device arrays."""
    from types import SimpleNamespace
    rng = np.random.default_rng(seed)
    inp = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    inp64 = inp.astype(np.float64)
    out64, qkvr64, att64 = A.attention_forward_ref(inp64, NH)
    lse64 = A.attention_lse_ref(inp64, NH)
    d_inp, d_dout = rt.to_device(inp), rt.to_device(dout)
    d_out, d_qkvr, d_lse = rt.empty((B, T, C)), rt.empty((B, T, 3 * C)), rt.empty(fwd.saved_shape)
    d_dinp = rt.empty((B, T, 3 * C))
    assert fwd.saved_shape == bwd.saved_shape == (B, NH, T)
    poison(d_out, d_qkvr, d_lse, d_dinp, *fwd.scratch.values(), *bwd.scratch.values())
    fwd(d_out, d_qkvr, d_lse, d_inp)
    out, qkvr, lse = d_out.get(), d_qkvr.get(), d_lse.get()
    assert_close(qkvr, qkvr64, 0, 0, "qkvr")
    for name, got, ref in (("out", out, out64), ("lse", lse, lse64)):
        assert np.isfinite(got).all(), f"{name}: unwritten (NaN) elements"
        assert rel_err(got, ref) < TF32_REL, f"{name}: rel_err {rel_err(got, ref):.2e}"
    # scores are TF32 products (~1e-3 relative): lse elementwise to a few 1e-3 absolute
    assert_close(lse, lse64, atol=1e-2, rtol=1e-3, name="lse")
    bwd(d_dinp, d_dout, d_qkvr, d_lse, d_out)
    dinp = d_dinp.get()
    ref = A.attention_backward_ref(dout.astype(np.float64), qkvr.astype(np.float64), att64, NH)
    assert np.isfinite(dinp).all(), "dinp: unwritten (NaN) elements"
    # dq, dk come from p * (dp - D): dp is a TF32 product but D = rowsum(dout * out) is fp32, so
    # where they cancel (a row attending to one key; T=1 makes dq = dk = 0 exactly) what is left is
    # TF32 rounding of dp, ~1e-3 of |dout| |v| |k| scale. Each part's error is measured against the
    # larger of its own norm and a tenth of the whole gradient's.
    for part, err in zip(("dq", "dk", "dv"), _part_errors(dinp, ref, C)):
        assert err < TF32_REL, f"{part}: relative error {err:.2e}"
    return SimpleNamespace(inp=inp, out=out, qkvr=qkvr, lse=lse, dinp=dinp, ref=ref, d_inp=d_inp, d_dout=d_dout,
                           d_out=d_out, d_qkvr=d_qkvr, d_lse=d_lse, d_dinp=d_dinp)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("B,T,C,NH", FLASH_SHAPES)
def test_flash_attention_gpu(rt, B, T, C, NH, version):
    fwd = ops.get("attention_forward").build(rt, version, B=B, T=T, C=C, NH=NH)
    bwd = ops.get("attention_backward").build(rt, version, B=B, T=T, C=C, NH=NH)
    r = _flash_fp32_checked(rt, fwd, bwd, B, T, C, NH, B * 1000 + T + 7)
    # no atomics: a second run is bit-identical
    poison(r.d_dinp)
    bwd(r.d_dinp, r.d_dout, r.d_qkvr, r.d_lse, r.d_out)
    assert np.array_equal(r.d_dinp.get(), r.dinp), "flash backward is not deterministic"


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH", FLASH_SHAPES)
def test_flash_attention_wgmma_tf32_gpu(rt, B, T, C, NH):
    """attention 4's fp32 builds (TF32 wgmma; v, and in the backward k, q, dout, transposed by
    attention_vt_kernel with each group of 8 rows reordered for the register A): forward out and lse
    against float64 with TF32's tolerance, every element written (poisoned first), qkvr the exact
    permute; backward 3 on its lse and out gives the reference gradients, and so does backward 4's
    fp32 build; second runs are bit-identical."""
    if rt.arch != "sm_90":
        pytest.skip(f"attention 4 needs sm_90a (this GPU is {rt.arch})")
    fwd = ops.get("attention_forward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH)
    bwd = ops.get("attention_backward").build(rt, 3, B=B, T=T, C=C, NH=NH)
    r = _flash_fp32_checked(rt, fwd, bwd, B, T, C, NH, B * 1000 + T + 11)
    inp, out, lse, ref = r.inp, r.out, r.lse, r.ref
    d_inp, d_dout, d_out, d_qkvr, d_lse, d_dinp = r.d_inp, r.d_dout, r.d_out, r.d_qkvr, r.d_lse, r.d_dinp
    poison(d_out, d_lse)
    fwd(d_out, d_qkvr, d_lse, d_inp)
    assert np.array_equal(d_out.get(), out) and np.array_equal(d_lse.get(), lse), "not deterministic"
    # backward 4's fp32 build (TF32 wgmma) on the same lse and out: the reference gradients, every
    # element written, the same bits on a second run
    bwd4 = ops.get("attention_backward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH)
    for _ in range(2):
        poison(d_dinp, *bwd4.scratch.values())
        bwd4(d_dinp, d_dout, d_qkvr, d_lse, d_out)
        dinp4 = d_dinp.get()
        assert np.isfinite(dinp4).all(), "backward 4 tf32: unwritten (NaN) elements"
        for part, err in zip(("dq", "dk", "dv"), _part_errors(dinp4, ref, C)):
            assert err < TF32_REL, f"backward 4 tf32 {part}: relative error {err:.2e}"
        if _ == 0:
            first = dinp4
    assert np.array_equal(first, dinp4), "backward 4 tf32 is not deterministic"
    # v transposed in shared memory (the _smt kernels), permuted and in place, and in place with the
    # consumers taking turns (the _pp kernels, either transpose): the same bits
    # and persistent (one CTA per SM walking the blocks, ring and q buffer running on across them)
    for in_place, smt_, pp, per in ((False, True, False, False), (True, True, False, False), (True, False, True, False),
                                    (True, True, True, False), (True, False, True, True), (True, True, True, True)):
        other = A.build_flash_attention_forward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=in_place,
                                                           smem_transpose=smt_, pingpong=pp, persistent=per)
        poison(d_out, d_lse)
        other(d_out, d_inp if in_place else d_qkvr, d_lse, d_inp)
        assert np.array_equal(d_out.get(), out) and np.array_equal(d_lse.get(), lse), \
            f"forward smt {smt_} pingpong {pp} persistent {per} (in place {in_place})"
    # the in-place builds (the model's form): q, k, v read from inp itself, the same bits as through qkvr
    fwd_ip = ops.get("attention_forward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    bwd_ip = ops.get("attention_backward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    poison(d_out, d_lse, d_dinp, *fwd_ip.scratch.values(), *bwd_ip.scratch.values())
    fwd_ip(d_out, d_inp, d_lse, d_inp)
    assert np.array_equal(d_out.get(), out) and np.array_equal(d_lse.get(), lse), "in place: other forward bits"
    assert np.array_equal(d_inp.get(), inp), "in place: the forward changed inp"
    bwd_ip(d_dinp, d_dout, d_inp, d_lse, d_out)
    assert np.array_equal(d_dinp.get(), dinp4), "in place: other backward bits"
    # both forms of the transposes (shared memory, the _smt kernels; global memory, attention_vt_kernel),
    # permuted and in place: the same bits
    for in_place, q in ((False, d_qkvr), (True, d_inp)):
        for smt in (True, False):
            other = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=in_place,
                                                                smem_transpose=smt)
            poison(d_dinp, *other.scratch.values())
            other(d_dinp, d_dout, q, d_lse, d_out)
            assert np.array_equal(d_dinp.get(), dinp4), f"smem transposes {smt}, in place {in_place}: other bits"
    # the colsum form (qkv's bias gradient in fp32: dbias += the column sums of dinp as stored, one row of
    # partials per 16 rows, added in order): dinp the plain form's bits; dbias against the float64 sums of
    # those rows within fp32's rounding of the sum of magnitudes (a row left out or summed twice is ~1 of a
    # row's magnitude, far outside it); the same bits on every run and under graph replay
    bias0 = np.random.default_rng(T).standard_normal(3 * C).astype(np.float32)
    rows = dinp4.reshape(B * T, 3 * C).astype(np.float64)
    exact = bias0 + rows.sum(axis=0)
    bound = 2.0 ** -20 * (np.abs(bias0) + np.abs(rows).sum(axis=0)) + 1e-30
    d_bias = rt.to_device(bias0)
    for in_place, q in ((False, d_qkvr), (True, d_inp)):
        for smt in (True, False):
            cs = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=in_place,
                                                             smem_transpose=smt, colsum=True)
            assert cs.scratch["part"].shape == (B * -(-T // 128) * 8, 3 * C)
            first = None
            for run in range(2):
                poison(d_dinp, *cs.scratch.values())
                d_bias.set(bias0)
                cs(d_dinp, d_bias, d_dout, q, d_lse, d_out)
                got = d_bias.get()
                form = f"colsum (smem transposes {smt}, in place {in_place}), run {run}"
                assert np.array_equal(d_dinp.get(), dinp4), f"{form}: dinp differs from the plain form"
                err = np.abs(got.astype(np.float64) - exact)
                assert np.all(err <= bound), f"{form}: dbias off the column sums by {err.max():.3g} (column {err.argmax()})"
                assert first is None or np.array_equal(got, first), f"{form}: dbias not deterministic"
                first = got
            if rt.graphs_available() is None:
                graph = rt.capture(lambda: cs(d_dinp, d_bias, d_dout, q, d_lse, d_out))
                poison(d_dinp, *cs.scratch.values())
                d_bias.set(bias0)
                graph()
                rt.synchronize()
                assert np.array_equal(d_bias.get(), first), f"colsum (smt {smt}, in place {in_place}): graph replay"


# bf16 builds of the fused variants. Inputs are bf16 values (round_bf16), so the float64 reference
# sees exactly what the kernels see, and the error budget is the kernels' own roundings (one bf16
# rounding to nearest is off by at most u = 2^-8 relative, half an ulp of 8 significant bits):
#  - out: the scores are exact bf16 products summed in fp32 (~1e-7 relative); p is rounded to bf16
#    (<= u relative each) before p v, so |error| <= u sum_s p_s |v_s| / l <= u max|v|, then the store
#    rounds out once (<= u |out|). Allowed, elementwise: 2^-7 max|v| + 2^-7 |ref|, twice that worst
#    case (averages of v cancel, so the error is set by |v|, not |out|; a plain float64 version with
#    the same roundings measures ~2.3e-3 max|v| at most).
#  - lse: fp32 all the way (exact products, fp32 sums, ex2/lg2.approx): atol 1e-4 + rtol 1e-5.
#  - dinp: p and ds = p (dp - D) are rounded to bf16 before the position products, D comes from the
#    bf16 out, and each gradient is rounded once on the store: roundings of ~1.6e-3 rms each that
#    add incoherently, ~2-3e-3 in all. dq, dk cancel in (dp - D) (T=1 makes them 0), so each part
#    is measured norm-wise against the larger of its own norm and a tenth of the whole gradient's,
#    as the TF32 test does. The bound is flash-attention's rule: within 2x (+1e-4) of what a plain
#    float64 implementation with the same bf16 roundings gets (_bf16_backward_plain), and under
#    2^-6 whatever that gets.
BF16_OUT = 2.0 ** -7


def _bf16_backward_plain(dout, qkvr, att, out, NH):
    """The backward in float64 with the kernels' bf16 roundings: p rounded before p^T dout, ds =
    scale p (dp - D) rounded before ds k and ds^T q, D from the bf16 out, dinp rounded on the store."""
    from llmc.bf16 import round_bf16
    B, T, C = dout.shape
    hs = C // NH
    r = lambda x: round_bf16(x).astype(np.float64)  # noqa: E731
    q, k, v = qkvr.reshape(3, B, NH, T, hs)
    dy = dout.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    o = out.reshape(B, T, NH, hs).transpose(0, 2, 1, 3)
    D = (dy * r(o)).sum(-1, keepdims=True)
    ds = r(att * (dy @ v.swapaxes(-1, -2) - D) / math.sqrt(hs))
    dq, dk, dv = r(ds @ k), r(ds.swapaxes(-1, -2) @ q), r(r(att).swapaxes(-1, -2) @ dy)
    return np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * C)


def _part_errors(got, ref, C):
    """Per part (dq, dk, dv): ||got - ref|| over the larger of ||ref part|| and 0.1 ||ref||."""
    errs = []
    for i in range(3):
        g, w = got[..., i * C:(i + 1) * C], ref[..., i * C:(i + 1) * C]
        errs.append(np.linalg.norm(g - w) / max(np.linalg.norm(w), 0.1 * np.linalg.norm(ref)))
    return errs


@pytest.mark.gpu
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("B,T,C,NH", FLASH_SHAPES)
def test_flash_attention_bf16_gpu(rt, B, T, C, NH, version):
    from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
    rng = np.random.default_rng(B * 1000 + T + 11)
    fwd = ops.get("attention_forward").build(rt, version, "bf16", B=B, T=T, C=C, NH=NH)
    bwd = ops.get("attention_backward").build(rt, version, "bf16", B=B, T=T, C=C, NH=NH)
    assert fwd.dtype == bwd.dtype == "bf16"
    inp = round_bf16(rng.standard_normal((B, T, 3 * C)))
    dout = round_bf16(rng.standard_normal((B, T, C)))
    inp64 = inp.astype(np.float64)
    out64, qkvr64, att64 = A.attention_forward_ref(inp64, NH)
    lse64 = A.attention_lse_ref(inp64, NH)
    d_inp, d_dout = rt.to_device(to_bf16(inp)), rt.to_device(to_bf16(dout))
    d_out, d_qkvr = rt.empty((B, T, C), BF16), rt.empty((B, T, 3 * C), BF16)
    d_lse, d_dinp = rt.empty(fwd.saved_shape), rt.empty((B, T, 3 * C), BF16)  # lse stays fp32
    assert fwd.saved_shape == bwd.saved_shape == (B, NH, T)
    poison(d_out, d_qkvr, d_lse, d_dinp, *bwd.scratch.values())
    fwd(d_out, d_qkvr, d_lse, d_inp)
    out, qkvr, lse = from_bf16(d_out.get()), from_bf16(d_qkvr.get()), d_lse.get()
    assert_close(qkvr, qkvr64, 0, 0, "qkvr")  # a permute of bf16 values: exact
    assert np.isfinite(out).all() and np.isfinite(lse).all(), "out / lse: unwritten (NaN) elements"
    vmax = np.abs(inp[..., 2 * C:]).max()
    assert_close(out, out64, atol=BF16_OUT * vmax, rtol=BF16_OUT, name="out")
    assert_close(lse, lse64, atol=1e-4, rtol=1e-5, name="lse")
    # forward is deterministic too (no atomics, fixed order)
    poison(d_out, d_lse)
    fwd(d_out, d_qkvr, d_lse, d_inp)
    assert np.array_equal(from_bf16(d_out.get()), out) and np.array_equal(d_lse.get(), lse)
    # the 128-row-block forward does, per row, the same operations in the same order plus fully
    # masked tiles (p = 0, corr = 1: exact no-ops): the same bits
    fwd128 = A.build_flash_attention_forward(rt, B=B, T=T, C=C, NH=NH, version=version, dtype="bf16", rows=128)
    poison(d_out, d_lse)
    fwd128(d_out, d_qkvr, d_lse, d_inp)
    assert np.array_equal(from_bf16(d_out.get()), out), "rows=128: out differs from the 64-row forward"
    assert np.array_equal(d_lse.get(), lse), "rows=128: lse differs from the 64-row forward"
    fwd(d_out, d_qkvr, d_lse, d_inp)  # backward below reads the default build's out and lse

    bwd(d_dinp, d_dout, d_qkvr, d_lse, d_out)
    dinp = from_bf16(d_dinp.get())
    ref = A.attention_backward_ref(dout.astype(np.float64), qkvr64, att64, NH)
    assert np.isfinite(dinp).all(), "dinp: unwritten (NaN) elements"
    plain = _bf16_backward_plain(dout.astype(np.float64), qkvr64, att64, out64, NH)
    for part, err, base in zip(("dq", "dk", "dv"), _part_errors(dinp, ref, C), _part_errors(plain, ref, C)):
        assert err <= 2 * base + 1e-4 and err < 2.0 ** -6, f"{part}: relative error {err:.2e} (plain bf16: {base:.2e})"
    poison(d_dinp)
    bwd(d_dinp, d_dout, d_qkvr, d_lse, d_out)
    assert np.array_equal(from_bf16(d_dinp.get()), dinp), "bf16 flash backward is not deterministic"


# attention_forward 4 (wgmma + TMA, bf16, Hopper only): the same bounds as the bf16 builds of 2, 3
# above (the same roundings: exact bf16 products summed in fp32, p rounded to bf16 before p v, out
# rounded once; lse fp32 all the way). Extra shapes: T = 128 and 129 (one full block; a second with
# one row), T = 384 (three full blocks, two full tiles below each diagonal).
WGMMA_SHAPES = FLASH_SHAPES + [(2, 128, 128, 2), (1, 129, 64, 1), (2, 384, 192, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH", WGMMA_SHAPES)
def test_flash_attention_wgmma_gpu(rt, B, T, C, NH):
    from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
    if rt.arch != "sm_90":
        pytest.skip(f"attention_forward 4 needs an sm_90 GPU (this one is {rt.arch})")
    rng = np.random.default_rng(B * 1000 + T + 13)
    fwd = ops.get("attention_forward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH)
    inp = round_bf16(rng.standard_normal((B, T, 3 * C)))
    inp64 = inp.astype(np.float64)
    out64, qkvr64, att64 = A.attention_forward_ref(inp64, NH)
    lse64 = A.attention_lse_ref(inp64, NH)
    d_inp = rt.to_device(to_bf16(inp))
    d_out, d_qkvr, d_lse = rt.empty((B, T, C), BF16), rt.empty((B, T, 3 * C), BF16), rt.empty(fwd.saved_shape)
    assert fwd.saved_shape == (B, NH, T)
    poison(d_out, d_qkvr, d_lse)
    fwd(d_out, d_qkvr, d_lse, d_inp)
    out, qkvr, lse = from_bf16(d_out.get()), from_bf16(d_qkvr.get()), d_lse.get()
    assert_close(qkvr, qkvr64, 0, 0, "qkvr")
    assert np.isfinite(out).all() and np.isfinite(lse).all(), "out / lse: unwritten (NaN) elements"
    vmax = np.abs(inp[..., 2 * C:]).max()
    assert_close(out, out64, atol=BF16_OUT * vmax, rtol=BF16_OUT, name="out (wgmma)")
    assert_close(lse, lse64, atol=1e-4, rtol=1e-5, name="lse (wgmma)")
    # the other schedules (the next tile's q k^T issued before this tile's p v or not; consumers taking
    # turns or not; persistent CTAs walking the blocks or one per block; the ring's depth) do the same
    # operations per row in the same order: the same bits
    for kw in (dict(persistent=False, overlap=False, pingpong=False), dict(persistent=False, overlap=True, pingpong=False),
               dict(persistent=False, overlap=False), dict(persistent=False), dict(overlap=False, pingpong=False),
               dict(overlap=False), dict(overlap=False, stages=4), dict(pingpong=False), dict(stages=3),
               dict(stages=5), dict(stages=6)):
        pp = A.build_flash_attention_forward_wgmma(rt, B=B, T=T, C=C, NH=NH, **kw)
        poison(d_out, d_lse)
        pp(d_out, d_qkvr, d_lse, d_inp)
        assert np.array_equal(from_bf16(d_out.get()), out), f"{kw}: out differs from the default build"
        assert np.array_equal(d_lse.get(), lse), f"{kw}: lse differs from the default build"
    # deterministic (fixed order, no atomics), and a captured graph replays the same launches (the
    # tensor map was encoded at the first launch above) with the same bits
    poison(d_out, d_lse)
    fwd(d_out, d_qkvr, d_lse, d_inp)
    assert np.array_equal(from_bf16(d_out.get()), out) and np.array_equal(d_lse.get(), lse), "not deterministic"
    # in place (the model's training form with backward 4): qkvr is inp itself, nothing is written to
    # it; the same kernel on the same input: the same bits
    inplace = ops.get("attention_forward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    poison(d_out, d_lse)
    inplace(d_out, d_inp, d_lse, d_inp)
    assert np.array_equal(from_bf16(d_inp.get()), inp), "in place: inp was written"
    assert np.array_equal(from_bf16(d_out.get()), out) and np.array_equal(d_lse.get(), lse), "in place: differs"
    if rt.graphs_available() is None:
        graph = rt.capture(lambda: fwd(d_out, d_qkvr, d_lse, d_inp))
        poison(d_out, d_lse)
        graph()
        rt.synchronize()
        assert np.array_equal(from_bf16(d_out.get()), out) and np.array_equal(d_lse.get(), lse), "graph replay differs"
    # the fused backward (3) consumes variant 4's lse: dinp as in test_flash_attention_bf16_gpu
    bwd = ops.get("attention_backward").build(rt, 3, "bf16", B=B, T=T, C=C, NH=NH)
    dout = round_bf16(rng.standard_normal((B, T, C)))
    d_dinp = rt.empty((B, T, 3 * C), BF16)
    poison(d_dinp, *bwd.scratch.values())
    bwd(d_dinp, rt.to_device(to_bf16(dout)), d_qkvr, d_lse, d_out)
    dinp = from_bf16(d_dinp.get())
    assert np.isfinite(dinp).all(), "dinp: unwritten (NaN) elements"
    ref = A.attention_backward_ref(dout.astype(np.float64), qkvr64, att64, NH)
    plain = _bf16_backward_plain(dout.astype(np.float64), qkvr64, att64, out64, NH)
    for part, err, base in zip(("dq", "dk", "dv"), _part_errors(dinp, ref, C), _part_errors(plain, ref, C)):
        assert err <= 2 * base + 1e-4 and err < 2.0 ** -6, f"{part}: relative error {err:.2e} (plain bf16: {base:.2e})"


# attention_backward 4 (wgmma + TMA, bf16, Hopper only): the bounds of the bf16 builds of 2, 3 (the
# same roundings: p and ds rounded to bf16 before the position products, D from the bf16 out, each
# gradient rounded once on the store), against the float64 reference. Shapes: every T class the
# tiling has (T = 1; 65, 127 inside one 128 block; 128 exactly; 129 a second block of one row; 384
# full blocks; 1000 and 1024 many blocks, 1000 with a ragged last one) and B*NH > 1.
WGMMA_BWD_SHAPES = FLASH_SHAPES + [(2, 128, 128, 2), (1, 129, 64, 1), (2, 384, 192, 3), (1, 1000, 128, 2)]


def _wgmma_bwd_case(rt, B, T, C, NH, seed):
    """The bf16 backward tests' case: random bf16 inp (B,T,3C) and dout, the float64 forward and backward
    references, inp and dout on the device and the other tensors allocated (out, qkvr, lse fp32, dinp).
    Returns dout, qkvr64, att64, ref, d_inp, d_dout, d_out, d_qkvr, d_lse, d_dinp."""
    from llmc.bf16 import BF16, round_bf16, to_bf16
    rng = np.random.default_rng(B * 1000 + T + seed)
    inp = round_bf16(rng.standard_normal((B, T, 3 * C)))
    dout = round_bf16(rng.standard_normal((B, T, C)))
    _, qkvr64, att64 = A.attention_forward_ref(inp.astype(np.float64), NH)
    ref = A.attention_backward_ref(dout.astype(np.float64), qkvr64, att64, NH)
    d_inp, d_dout = rt.to_device(to_bf16(inp)), rt.to_device(to_bf16(dout))
    d_out, d_qkvr, d_lse = rt.empty((B, T, C), BF16), rt.empty((B, T, 3 * C), BF16), rt.empty((B, NH, T))
    return dout, qkvr64, att64, ref, d_inp, d_dout, d_out, d_qkvr, d_lse, rt.empty((B, T, 3 * C), BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH", WGMMA_BWD_SHAPES)
def test_flash_attention_wgmma_backward_gpu(rt, B, T, C, NH):
    from llmc.bf16 import from_bf16
    if rt.arch != "sm_90":
        pytest.skip(f"attention_backward 4 needs an sm_90 GPU (this one is {rt.arch})")
    bwd = ops.get("attention_backward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH)
    assert bwd.dtype == "bf16" and bwd.saved_shape == (B, NH, T) and set(bwd.scratch) == {"D"}
    dout, qkvr64, att64, ref, d_inp, d_dout, d_out, d_qkvr, d_lse, d_dinp = _wgmma_bwd_case(rt, B, T, C, NH, 17)
    # after each forward that keeps the lse (2, 3 bf16 and 4): its own out and lse, so the plain
    # bf16 bound uses that forward's out (it differs from the exact one by a bf16 rounding)
    first = None
    for fv in (4, 2, 3):
        fwd = ops.get("attention_forward").build(rt, fv, "bf16", B=B, T=T, C=C, NH=NH)
        fwd(d_out, d_qkvr, d_lse, d_inp)
        out = from_bf16(d_out.get())
        poison(d_dinp, *bwd.scratch.values())  # every element of dinp (and D) must be written
        bwd(d_dinp, d_dout, d_qkvr, d_lse, d_out)
        dinp = from_bf16(d_dinp.get())
        assert np.isfinite(dinp).all(), f"after forward {fv}: dinp has unwritten (NaN) elements"
        plain = _bf16_backward_plain(dout.astype(np.float64), qkvr64, att64, out.astype(np.float64), NH)
        for part, err, base in zip(("dq", "dk", "dv"), _part_errors(dinp, ref, C), _part_errors(plain, ref, C)):
            assert err <= 2 * base + 1e-4 and err < 2.0 ** -6, \
                f"after forward {fv}: {part} relative error {err:.2e} (plain bf16: {base:.2e})"
        if first is None:
            first = dinp
            # D (scratch, fp32) is rowsum(dout * out) of the bf16 out: fp32 sums of exact products
            # (64 terms: within 64 fp32 roundings of the sum of their magnitudes, 2^-18 of it allowed)
            prod = (dout.astype(np.float64) * out).reshape(B, T, NH, C // NH).transpose(0, 2, 1, 3)
            Dgot, Dref, Dabs = bwd.scratch["D"].get(), prod.sum(-1), np.abs(prod).sum(-1)
            assert np.all(np.abs(Dgot - Dref) <= 2.0 ** -18 * Dabs + 1e-30), "D = rowsum(dout * out) is off"
    # deterministic: forward 4 again, then the backward twice more and under graph replay, bit-identical
    fwd = ops.get("attention_forward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH)
    fwd(d_out, d_qkvr, d_lse, d_inp)
    poison(d_dinp)
    bwd(d_dinp, d_dout, d_qkvr, d_lse, d_out)
    assert np.array_equal(from_bf16(d_dinp.get()), first), "attention_backward 4 is not deterministic"
    # in place: q, k, v read from the (B,T,3C) inp itself (the _btc kernels): the same tiles, the same bits
    inplace = ops.get("attention_backward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    poison(d_dinp, *inplace.scratch.values())
    inplace(d_dinp, d_dout, d_inp, d_lse, d_out)
    assert np.array_equal(from_bf16(d_dinp.get()), first), "in place: dinp differs from the permuted-qkvr build"
    pp = A.build_flash_attention_backward_wgmma(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, pingpong=False)
    poison(d_dinp, *pp.scratch.values())
    pp(d_dinp, d_dout, d_inp, d_lse, d_out)
    assert np.array_equal(from_bf16(d_dinp.get()), first), "in place without ping-pong: dinp differs"
    # a deeper ring (LLMC_ATT_BWD_STAGES, a build parameter of the .cu): the same products, the same bits
    os.environ["LLMC_ATT_BWD_STAGES"] = "3"
    try:
        deep = A.build_flash_attention_backward_wgmma(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    finally:
        del os.environ["LLMC_ATT_BWD_STAGES"]
    poison(d_dinp, *deep.scratch.values())
    deep(d_dinp, d_dout, d_inp, d_lse, d_out)
    assert np.array_equal(from_bf16(d_dinp.get()), first), "3-stage ring: dinp differs"
    # the overlapped dq kernel does the same operations on each accumulator in the same order: the same bits
    over = A.build_flash_attention_backward_wgmma(rt, B=B, T=T, C=C, NH=NH, overlap=True)
    poison(d_dinp, *over.scratch.values())
    over(d_dinp, d_dout, d_qkvr, d_lse, d_out)
    assert np.array_equal(from_bf16(d_dinp.get()), first), "overlap: dinp differs from the plain wgmma backward"
    if rt.graphs_available() is None:
        graph = rt.capture(lambda: bwd(d_dinp, d_dout, d_qkvr, d_lse, d_out))
        poison(d_dinp, *bwd.scratch.values())
        graph()
        rt.synchronize()
        assert np.array_equal(from_bf16(d_dinp.get()), first), "attention_backward 4: graph replay differs"


# attention_backward 5 (bf16, Hopper only): 4's dk/dv kernel forming dq per tile pair too, added by fp32
# reductions. dv is 4's (the same register-A products in the same order): the same bits; dk's product
# reads dS^T from shared memory instead of registers (the same values, the same order); D is 4's. dq's
# fp32 sums land in no fixed order: each run may round differently, so it is held to the bf16 bound
# and to within a bf16 rounding (2^-7 relative, plus fp32 noise) of 4's dq, elementwise.
@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH", WGMMA_BWD_SHAPES)
def test_flash_attention_wgmma5_backward_gpu(rt, B, T, C, NH):
    from llmc.bf16 import from_bf16
    if rt.arch != "sm_90":
        pytest.skip(f"attention_backward 5 needs an sm_90 GPU (this one is {rt.arch})")
    dout, qkvr64, att64, ref, d_inp, d_dout, d_out, d_qkvr, d_lse, d_dinp = _wgmma_bwd_case(rt, B, T, C, NH, 23)
    ops.get("attention_forward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH)(d_out, d_qkvr, d_lse, d_inp)
    out = from_bf16(d_out.get())
    bwd4 = ops.get("attention_backward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH)
    bwd4(d_dinp, d_dout, d_qkvr, d_lse, d_out)
    want, D4 = from_bf16(d_dinp.get()), bwd4.scratch["D"].get()
    plain = _bf16_backward_plain(dout.astype(np.float64), qkvr64, att64, out.astype(np.float64), NH)
    bwd5 = ops.get("attention_backward").build(rt, 5, "bf16", B=B, T=T, C=C, NH=NH)
    assert bwd5.dtype == "bf16" and bwd5.saved_shape == (B, NH, T) and set(bwd5.scratch) == {"D", "dq"}
    in_place = ops.get("attention_backward").build(rt, 5, "bf16", B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    no_pp = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, pingpong=False)

    def check(form, dinp, D):
        assert np.isfinite(dinp).all(), f"{form}: dinp has unwritten (NaN) elements"
        for part, err, base in zip(("dq", "dk", "dv"), _part_errors(dinp, ref, C), _part_errors(plain, ref, C)):
            assert err <= 2 * base + 1e-4 and err < 2.0 ** -6, \
                f"{form}: {part} relative error {err:.2e} (plain bf16: {base:.2e})"
        assert np.array_equal(dinp[..., 2 * C:], want[..., 2 * C:]), f"{form}: dv differs from attention_backward 4"
        assert np.array_equal(dinp[..., C:2 * C], want[..., C:2 * C]), f"{form}: dk differs from attention_backward 4"
        assert D is None or np.array_equal(D, D4), f"{form}: D differs from attention_backward 4"
        dq5, dq4 = dinp[..., :C], want[..., :C]
        tol = 2.0 ** -7 * np.abs(dq4) + 1e-6 * np.abs(dq4).max()
        assert np.all(np.abs(dq5 - dq4) <= tol), f"{form}: dq more than a bf16 rounding from attention_backward 4's"

    # main_zeroes: the main kernel zeroes the (poisoned) accumulator itself, each head's tiles just before
    # the reductions into them; its sync words must be back to zero after every launch
    mz = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, main_zeroes=True)
    mz_no_pp = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, pingpong=False,
                                                       main_zeroes=True)
    assert mz.info["main_zeroes"] and not in_place.info["main_zeroes"]
    for form, bwd, qkv in (("permuted qkvr", bwd5, d_qkvr), ("in place", in_place, d_inp),
                           ("in place, no ping-pong", no_pp, d_inp), ("in place, main zeroes", mz, d_inp),
                           ("in place, no ping-pong, main zeroes", mz_no_pp, d_inp)):
        for run in range(3 if bwd.info["main_zeroes"] else 2):
            poison(d_dinp, *bwd.scratch.values())  # every element of dinp, D and the accumulator is written
            bwd(d_dinp, d_dout, qkv, d_lse, d_out)
            check(f"{form}, run {run}", from_bf16(d_dinp.get()), bwd.scratch["D"].get())
            if bwd.info["main_zeroes"]:
                zs = bwd.info["zsync"].get()
                assert not zs.any(), f"{form}, run {run}: the sync words were not reset ({np.count_nonzero(zs)} set)"
    if rt.graphs_available() is None:  # its three launches under graph replay
        graph = rt.capture(lambda: bwd5(d_dinp, d_dout, d_qkvr, d_lse, d_out))
        poison(d_dinp, *bwd5.scratch.values())
        graph()
        rt.synchronize()
        check("graph replay", from_bf16(d_dinp.get()), None)
        graph = rt.capture(lambda: mz(d_dinp, d_dout, d_inp, d_lse, d_out))
        for run in range(2):
            poison(d_dinp, *mz.scratch.values())
            graph()
            rt.synchronize()
            check(f"main zeroes, graph replay {run}", from_bf16(d_dinp.get()), None)
    # caller_zeroes: prep leaves the accumulator alone; the build zeroed it, the caller zeroes it again
    # (info["rezero"]) after each launch. Three launches with the rezero between them pass; without it,
    # the next launch adds onto the last one's dq (and only dq differs)
    cz = ops.get("attention_backward").build(rt, 5, "bf16", B=B, T=T, C=C, NH=NH, qkv_in_place=True, caller_zeroes=True)
    assert "rezero" in cz.info and "rezero" not in in_place.info and "dq" in cz.keep
    for run in range(3):
        poison(d_dinp, cz.scratch["D"])
        cz(d_dinp, d_dout, d_inp, d_lse, d_out)
        check(f"caller_zeroes, run {run}", from_bf16(d_dinp.get()), cz.scratch["D"].get())
        if run < 2:
            cz.info["rezero"]()
    cz(d_dinp, d_dout, d_inp, d_lse, d_out)  # no rezero before it: dq = this launch's + the last one's
    stale = from_bf16(d_dinp.get())
    assert np.array_equal(stale[..., C:], want[..., C:])
    assert np.allclose(stale[..., :C], 2 * want[..., :C], rtol=2.0 ** -6, atol=1e-5 * np.abs(want[..., :C]).max())


# ATT_O_TMA (cuda/attention_wgmma.cu, 1 by default): the persistent forward stores out through shared memory
# and one TMA store per consumer and item (forward_store_tma), where ATT_O_TMA=0 stores each pair of values
# from registers. The same bits (the same values, rounded once), every row < T written and nothing else:
# out sits inside a poisoned buffer, with a poisoned pad of 16 bytes before it and 4 KB after it (a box's
# rows past T would land there if the map did not end at T). Every persistent schedule, the 6-stage one
# (direct stores: its ring and the staging would not fit) included; T = 1, 65, 129 (boxes mostly past T),
# 200, 1000; two launches in a row (the second waits for the first's store to have read the staging).
@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH", [(1, 1, 64, 1), (2, 65, 128, 2), (1, 129, 64, 1), (2, 200, 192, 3),
                                      (1, 1000, 128, 2)])
def test_attention_forward4_out_by_tma_gpu(rt, B, T, C, NH):
    from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
    from llmc.testing import module_defines
    if rt.arch != "sm_90":
        pytest.skip(f"attention_forward 4 needs an sm_90 GPU (this one is {rt.arch})")
    rng = np.random.default_rng(T + 41)
    inp = round_bf16(rng.standard_normal((B, T, 3 * C)))
    d_inp, d_lse = rt.to_device(to_bf16(inp)), rt.empty((B, NH, T))
    pre, post, n = 8, 2048, B * T * C
    buf = rt.empty((pre + n + post,), BF16)
    d_out = buf.view(pre, (B, T, C))
    poison_bits = np.full(pre + n + post, 0x7FC1, np.uint16)
    forms = [dict(pingpong=pp, overlap=ov, stages=st) for pp, ov, st in sorted(A.WGMMA_FWD_PERSISTENT)]
    got = {}
    for tma in (1, 0):
        with module_defines(rt, "attention_wgmma", {"ATT_O_TMA": tma}):
            builds = [A.build_flash_attention_forward_wgmma(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, **kw)
                      for kw in forms]
        for kw, f in zip(forms, builds):
            for run in range(2):
                buf.set(poison_bits)
                poison(d_lse)
                f(d_out, d_inp, d_lse, d_inp)
                whole = buf.get()
                assert np.all(whole[:pre] == 0x7FC1) and np.all(whole[pre + n:] == 0x7FC1), \
                    f"ATT_O_TMA={tma} {kw}: out written outside its (B,T,C)"
                out = from_bf16(whole[pre:pre + n]).reshape(B, T, C)
                assert np.isfinite(out).all() and np.isfinite(d_lse.get()).all(), f"ATT_O_TMA={tma} {kw}: unwritten"
                got[tma, str(kw), run] = (out, d_lse.get())
    out64, _, _ = A.attention_forward_ref(inp.astype(np.float64), NH)
    vmax = np.abs(inp[..., 2 * C:]).max()
    for kw in forms:
        o1, l1 = got[1, str(kw), 0]
        assert_close(o1, out64, atol=BF16_OUT * vmax, rtol=BF16_OUT, name=f"out {kw}")
        for key in ((1, str(kw), 1), (0, str(kw), 0), (0, str(kw), 1)):
            assert np.array_equal(got[key][0], o1) and np.array_equal(got[key][1], l1), f"{key}: out or lse differs"


# ATT_DIAG_SKIP (cuda/attention_wgmma.cu, 1 by default): the diagonal tile's all-masked quarter (queries
# 0..63 of the tile, keys 64..127) is left out of forward 4's and backward 5's products. What is left out
# adds exact zeros, so every output keeps the bits of the build that forms it (ATT_DIAG_SKIP=0): out and
# lse of each forward schedule, and backward 5's dk, dv and D (its plain and colsum forms, with and without
# ping-pong); dq's fp32 sums land in no fixed order, so dq is held to within a bf16 rounding of the other
# build's, and the colsum form's dbias to the float64 sums of the dinp it wrote. T = 1 and 65 (one
# diagonal tile, keys past T), 128, 129, 384 and 1000 (ragged last block), B NH > 1.
@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH", [(1, 1, 64, 1), (2, 65, 128, 2), (2, 128, 128, 2), (1, 129, 64, 1),
                                      (2, 384, 192, 3), (1, 1000, 128, 2)])
def test_attention_diag_skip_keeps_the_bits_gpu(rt, B, T, C, NH):
    from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
    from llmc.testing import module_defines
    if rt.arch != "sm_90":
        pytest.skip(f"attention 4 / 5 need an sm_90 GPU (this one is {rt.arch})")
    dout, qkvr64, att64, ref, d_inp, d_dout, d_out, d_qkvr, d_lse, d_dinp = _wgmma_bwd_case(rt, B, T, C, NH, 29)
    fwd_forms = (dict(), dict(persistent=False, overlap=False, pingpong=False), dict(overlap=False),
                 dict(persistent=False))
    d_dbias = rt.empty((3 * C,), BF16)
    bias0 = round_bf16(np.random.default_rng(T).standard_normal(3 * C) * 0.1)
    res = {}
    for skip in (1, 0):
        with module_defines(rt, "attention_wgmma", {"ATT_DIAG_SKIP": skip}):
            fwds = [A.build_flash_attention_forward_wgmma(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, **kw)
                    for kw in fwd_forms]
            bwds = [A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, pingpong=pp,
                                                            colsum=cs) for pp in (True, False) for cs in (False, True)]
        outs = []
        for f in fwds:
            poison(d_out, d_lse)
            f(d_out, d_inp, d_lse, d_inp)
            outs.append((from_bf16(d_out.get()), d_lse.get()))
        # every backward reads the skip build's default forward: the same out and lse on both sides
        fwd0 = res[1]["fwd"][0] if skip == 0 else outs[0]
        d_out.set(to_bf16(fwd0[0]))
        d_lse.set(fwd0[1])
        grads = []
        for bwd, cs in zip(bwds, (False, True, False, True)):
            poison(d_dinp, *bwd.scratch.values())
            if cs:
                d_dbias.set(to_bf16(bias0))
                bwd(d_dinp, d_dbias, d_dout, d_inp, d_lse, d_out)
            else:
                bwd(d_dinp, d_dout, d_inp, d_lse, d_out)
            grads.append((from_bf16(d_dinp.get()), bwd.scratch["D"].get(), from_bf16(d_dbias.get()) if cs else None))
        res[skip] = {"fwd": outs, "bwd": grads}
    for k, kw in enumerate(fwd_forms):
        (o1, l1), (o0, l0) = res[1]["fwd"][k], res[0]["fwd"][k]
        assert np.isfinite(o1).all() and np.isfinite(l1).all(), f"forward {kw}: unwritten (NaN) elements"
        assert np.array_equal(o1, o0), f"forward {kw}: out differs from the build without the skip"
        assert np.array_equal(l1, l0), f"forward {kw}: lse differs from the build without the skip"
    for k, form in enumerate(("ping-pong", "ping-pong colsum", "no ping-pong", "no ping-pong colsum")):
        (g1, D1, b1), (g0, D0, b0) = res[1]["bwd"][k], res[0]["bwd"][k]
        assert np.isfinite(g1).all(), f"backward 5 {form}: dinp has unwritten (NaN) elements"
        assert np.array_equal(g1[..., C:], g0[..., C:]), f"backward 5 {form}: dk or dv differs without the skip"
        assert np.array_equal(D1, D0), f"backward 5 {form}: D differs without the skip"
        tol = 2.0 ** -7 * np.abs(g0[..., :C]) + 1e-6 * np.abs(g0[..., :C]).max()
        assert np.all(np.abs(g1[..., :C] - g0[..., :C]) <= tol), f"backward 5 {form}: dq more than a bf16 rounding off"
        for part, err in zip(("dq", "dk", "dv"), _part_errors(g1, ref, C)):
            assert err < 2.0 ** -6, f"backward 5 {form}: {part} relative error {err:.2e}"
        if b1 is not None:  # dbias: bias0 + the column sums of the dinp this launch wrote
            rows = g1.reshape(-1, 3 * C).astype(np.float64)
            exact = bias0 + rows.sum(axis=0)
            bound = 2.0 ** -8 * np.abs(exact) + 2.0 ** -16 * (np.abs(bias0) + np.abs(rows).sum(axis=0)) + 1e-30
            assert np.all(np.abs(b1.astype(np.float64) - exact) <= bound), \
                f"backward 5 {form}: dbias off the column sums of its dinp"


# attention_backward 5's colsum form (qkv's bias gradient: dbias += the column sums of dinp as stored,
# summed by the main kernel (dk, dv) and convert (dq) into a row of partials per 64 rows, then added in
# order and rounded once). dinp: the plain form's (dk, dv bit for bit, dq within a bf16 rounding, as 5's
# dq is not deterministic); dbias against the float64 sums of the dinp the same launch wrote, which the
# kernel adds in fp32: within one bf16 rounding of the exact total plus 2^-16 of the sum of magnitudes
# (a row summed twice or left out is ~1 of a row's magnitude, far outside it). Every element of dinp and
# of the partials poisoned first. T = 1, 64 (the second 64 keys of a block past T), 65, 127, 1000 ...
@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH", WGMMA_BWD_SHAPES)
def test_flash_attention_wgmma5_backward_colsum_gpu(rt, B, T, C, NH):
    from llmc.bf16 import from_bf16, round_bf16, to_bf16
    if rt.arch != "sm_90":
        pytest.skip(f"attention_backward 5 needs an sm_90 GPU (this one is {rt.arch})")
    dout, qkvr64, att64, ref, d_inp, d_dout, d_out, d_qkvr, d_lse, d_dinp = _wgmma_bwd_case(rt, B, T, C, NH, 29)
    ops.get("attention_forward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH)(d_out, d_qkvr, d_lse, d_inp)
    plain = ops.get("attention_backward").build(rt, 5, "bf16", B=B, T=T, C=C, NH=NH)
    plain(d_dinp, d_dout, d_qkvr, d_lse, d_out)
    want = from_bf16(d_dinp.get())
    bias0 = round_bf16(np.random.default_rng(T).standard_normal(3 * C) * 0.1)  # dbias before the "+="
    d_bias = rt.to_device(to_bf16(bias0))

    def check(form, dinp, got):
        assert np.isfinite(dinp).all(), f"{form}: dinp has unwritten (NaN) elements"
        assert np.array_equal(dinp[..., C:], want[..., C:]), f"{form}: dk or dv differs from the plain form"
        tol = 2.0 ** -7 * np.abs(want[..., :C]) + 1e-6 * np.abs(want[..., :C]).max()
        assert np.all(np.abs(dinp[..., :C] - want[..., :C]) <= tol), f"{form}: dq off the plain form's"
        rows = dinp.reshape(B * T, 3 * C).astype(np.float64)
        exact = bias0 + rows.sum(axis=0)
        bound = 2.0 ** -8 * np.abs(exact) + 2.0 ** -16 * (np.abs(bias0) + np.abs(rows).sum(axis=0)) + 1e-30
        err = np.abs(got.astype(np.float64) - exact)
        assert np.all(err <= bound), f"{form}: dbias off the column sums by {err.max():.3g} (column {err.argmax()})"

    for form, kw, qkv in (("permuted qkvr", dict(main_zeroes=False), d_qkvr),
                          ("in place, main zeroes", dict(qkv_in_place=True, main_zeroes=True), d_inp),
                          ("in place", dict(qkv_in_place=True, main_zeroes=False), d_inp)):
        cs = ops.get("attention_backward").build(rt, 5, "bf16", B=B, T=T, C=C, NH=NH, colsum=True, **kw)
        assert set(cs.scratch) == {"D", "dq", "part"} and list(cs.info["passes"]) == ["prep", "main", "convert", "finish"]
        assert cs.scratch["part"].shape == (B * -(-T // 64), 3 * C)
        for run in range(2):
            poison(d_dinp, *cs.scratch.values())
            d_bias.set(to_bf16(bias0))
            cs(d_dinp, d_bias, d_dout, qkv, d_lse, d_out)
            check(f"{form}, run {run}", from_bf16(d_dinp.get()), from_bf16(d_bias.get()))
    # variant 4's colsum form (--deterministic's): dinp its plain form's bits, dbias as above and the same
    # bits on every run (4 is deterministic)
    plain4 = ops.get("attention_backward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    plain4(d_dinp, d_dout, d_inp, d_lse, d_out)
    want4 = from_bf16(d_dinp.get())
    cs4 = ops.get("attention_backward").build(rt, 4, "bf16", B=B, T=T, C=C, NH=NH, colsum=True, qkv_in_place=True)
    assert set(cs4.scratch) == {"D", "part"}
    first = None
    for run in range(2):
        poison(d_dinp, *cs4.scratch.values())
        d_bias.set(to_bf16(bias0))
        cs4(d_dinp, d_bias, d_dout, d_inp, d_lse, d_out)
        dinp, got = from_bf16(d_dinp.get()), from_bf16(d_bias.get())
        assert np.array_equal(dinp, want4), f"attention_backward 4 colsum, run {run}: dinp differs from the plain form"
        check(f"attention_backward 4 colsum, run {run}", dinp, got)
        assert first is None or np.array_equal(got, first), "attention_backward 4 colsum: dbias not deterministic"
        first = got
    if rt.graphs_available() is None:  # its four launches under graph replay
        graph = rt.capture(lambda: cs(d_dinp, d_bias, d_dout, d_inp, d_lse, d_out))
        poison(d_dinp, *cs.scratch.values())
        d_bias.set(to_bf16(bias0))
        graph()
        rt.synchronize()
        check("graph replay", from_bf16(d_dinp.get()), from_bf16(d_bias.get()))


def test_attention_backward_colsum_is_an_option_of_the_hopper_builds_and_the_cpu_sums_as_the_bias_pass():
    """colsum: variants 4 (both builds) and 5 take it; 1-3 refuse it (the model then launches the bias
    pass); the numpy launcher's colsum form is the plain launch then matmul_backward_bias's sum, bit for
    bit."""
    spec = ops.get("attention_backward")
    shape = dict(B=2, T=65, C=128, NH=2)
    for n in (4, 5):
        assert spec.refuse_reason(n, "bf16", "sm_90", **shape, colsum=True) is None
    assert spec.refuse_reason(4, "fp32", "sm_90", **shape, colsum=True) is None
    assert spec.refuse_reason(5, "bf16", "sm_90", B=1, T=8, C=64 * 40, NH=40, colsum=True) is not None
    for n in (1, 2, 3):
        for dt in spec.variants[n].dtypes:
            assert "has no colsum option" in spec.refuse_reason(n, dt, "sm_90", **shape, colsum=True)
    rng = np.random.default_rng(4)
    B, T, C, NH = 2, 9, 32, 2
    inp = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    _, qkvr, att = A.attention_forward_ref(inp, NH)
    dinp, dinp2 = np.empty((B, T, 3 * C), np.float32), np.empty((B, T, 3 * C), np.float32)
    db = rng.standard_normal(3 * C).astype(np.float32)
    db2 = db.copy()
    spec.build_cpu(B=B, T=T, C=C, NH=NH, colsum=True).launch(dinp, db, dout, qkvr, att)
    spec.build_cpu(B=B, T=T, C=C, NH=NH).launch(dinp2, dout, qkvr, att)
    ops.get("matmul_backward_bias").build_cpu(N=B * T, OC=3 * C).launch(db2, dinp2)
    np.testing.assert_array_equal(dinp, dinp2)
    np.testing.assert_array_equal(db, db2)


@pytest.mark.parametrize("switch", ["0", "1", None])
def test_attention_backward5_main_zeroes_launches_without_gpu(switch, monkeypatch):
    """attention_backward 5's main_zeroes form on the fake runtime (argument lists checked against the
    .cu's entry points where nvcc is found): prep is told to leave the accumulator alone (zero_acc = 0)
    and the _mz main kernel gets the sync words (2 a head, zeroed at build, kept out of the scratch that
    tests poison); the plain form zeroes in prep and runs the kernel without them; caller_zeroes wins
    over it; it needs the in-place form. LLMC_ATT5_MAIN_ZERO picks the form when the build does not say."""
    from llmc.bf16 import BF16
    from tests.fake_runtime import FakeRuntime
    for enc in ("qkv_tensor_map", "btc_tensor_map", "_bf16_tensor_map"):  # (the driver encodes these)
        monkeypatch.setattr(A, enc, lambda *a, **k: bytes(128))
    if switch is None:
        monkeypatch.delenv("LLMC_ATT5_MAIN_ZERO", raising=False)
    else:
        monkeypatch.setenv("LLMC_ATT5_MAIN_ZERO", switch)
    import re
    from llmc.runtime import CUDA_DIR
    cu = (CUDA_DIR / "attention_wgmma.cu").read_text()  # the .cu's mbarriers and the smem the build asks for
    assert int(re.search(r"constexpr int ZERO_TILES = (\d+);", cu).group(1)) == A.WGMMA5_ZERO_TILES
    B, T, C, NH = 2, 130, 768, 12
    default = switch == "1"
    with pytest.raises(LLMCError, match="in-place form"):
        A.build_flash_attention_backward_wgmma5(FakeRuntime(), B=B, T=T, C=C, NH=NH, main_zeroes=True)
    with pytest.raises(LLMCError, match="T <= 2048"):
        A.build_flash_attention_backward_wgmma5(FakeRuntime(), B=1, T=2049, C=C, NH=NH, qkv_in_place=True,
                                                main_zeroes=True)
    # (the switch leaves the permuted form as it is)
    assert not A.build_flash_attention_backward_wgmma5(FakeRuntime(), B=B, T=T, C=C, NH=NH).info["main_zeroes"]
    for opts, want in (({}, default), ({"main_zeroes": True}, True), ({"main_zeroes": False}, False),
                       ({"main_zeroes": True, "caller_zeroes": True}, False)):
        rt = FakeRuntime(1 << 24)
        built = ops.get("attention_backward").build(rt, 5, "bf16", B=B, T=T, C=C, NH=NH, qkv_in_place=True, **opts)
        assert built.info["main_zeroes"] is want and set(built.scratch) == {"D", "dq"}, opts
        args = (rt.empty((B, T, 3 * C), BF16), rt.empty((B, T, C), BF16), rt.empty((B, T, 3 * C), BF16),
                rt.empty((B, NH, T)), rt.empty((B, T, C), BF16))
        built.launch(*args)
        prep, main = rt.launches[0], rt.launches[1]
        assert prep.func == "flash_attention_backward_prep_kernel5_bf16"
        assert main.func == "flash_attention_backward_dkdvq_kernel5_bf16_btc_pingpong" + ("_mz" if want else "")
        zero_acc = 0 if (want or opts.get("caller_zeroes")) else 1
        assert prep.args[-1] == zero_acc, opts
        if want:
            zs = built.info["zsync"]
            assert zs.shape == (B * NH * (-(-T // 128) + 1),) and main.args[-1] == zs.ptr and len(main.args) == 12
            G = main.args[9]  # (the head group: capped so its CTAs, G ceil(T/128), fit the SMs at once)
            assert G * -(-T // 128) <= rt.sm_count
            assert not rt.np(zs).any(), "the sync words start zeroed"
        else:
            assert len(main.args) == 11 and "zsync" not in built.info
    # many heads at a short T: the L2's head group (98 heads of 2 query tiles) is capped at 132 // 2 = 66
    rt = FakeRuntime(1 << 26)
    B, T = 16, 130
    for z, G in ((False, 98), (True, 66)):
        built = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, main_zeroes=z)
        built.launch(rt.empty((B, T, 3 * C), BF16), rt.empty((B, T, C), BF16), rt.empty((B, T, 3 * C), BF16),
                     rt.empty((B, NH, T)), rt.empty((B, T, C), BF16))
        assert rt.launches[-2].args[9] == G, (z, rt.launches[-2].args[9])


def colsum_finish_model(part, bias):
    """The colsum finish kernels' order of sums in numpy float32 (cuda/attention_wgmma.cu, colsum_finish_rows):
    s[y] = rows y, y + 64, ... added in turn from 0 (y < 64), then s[y] += s[y + h] for h = 32, 16, ..., 1;
    dbias + s[0], one float32 add (rounded to bf16 by the caller for the bf16 build)."""
    s = np.zeros((64, part.shape[1]), np.float32)
    for r in range(part.shape[0]):
        s[r % 64] += part[r]
    for h in (32, 16, 8, 4, 2, 1):
        s[:h] = s[:h] + s[h:2 * h]
    return bias.astype(np.float32) + s[0]


# the finish kernel alone, on random partials: bit for bit the order above (a row left out, added twice or
# in another order changes the bits), every column of dbias written (the rest of its buffer poisoned and
# left alone); R = 1 (T <= 64), 2, 48, 64 (d12 B=4), 65, 256 (d12 B=16) in bf16, and the TF32 build's rows
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,B,T,C", [("bf16", 1, 64, 64), ("bf16", 1, 65, 192), ("bf16", 3, 1000, 128),
                                          ("bf16", 4, 1024, 768), ("bf16", 65, 64, 1600), ("bf16", 16, 1024, 768),
                                          ("fp32", 1, 1, 64), ("fp32", 3, 130, 192), ("fp32", 4, 1024, 768)])
def test_attention_backward_colsum_finish_order_gpu(rt, dtype, B, T, C):
    from llmc.bf16 import from_bf16, to_bf16
    if rt.arch != "sm_90":
        pytest.skip(f"the colsum finish is built with the wgmma kernels, sm_90 only (this GPU is {rt.arch})")
    part, finish, check = A._colsum_finish(rt, B, T, C, "test", {}, dtype=dtype)
    R, C3 = part.shape
    rng = np.random.default_rng(R * 7 + C)
    vals = (rng.standard_normal((R, C3)) * np.exp(rng.uniform(-4, 4, (R, 1)))).astype(np.float32)
    part.set(vals)
    bias = rng.standard_normal(C3).astype(np.float32)
    want = colsum_finish_model(vals, from_bf16(to_bf16(bias)) if dtype == "bf16" else bias)
    pad = 8  # dbias inside a poisoned buffer: nothing before or after it is written
    if dtype == "bf16":
        buf = rt.to_device(np.concatenate([np.full(pad, 0x7FC1, np.uint16), to_bf16(bias), np.full(pad, 0x7FC1, np.uint16)]))
        dbias = buf.ptr + 2 * pad
    else:
        buf = rt.to_device(np.concatenate([np.full(pad, np.nan, np.float32), bias, np.full(pad, np.nan, np.float32)]))
        dbias = buf.ptr + 4 * pad
    check(dbias)
    finish(dbias)
    rt.synchronize()
    got = buf.get()
    if dtype == "bf16":
        assert np.all(got[:pad] == 0x7FC1) and np.all(got[-pad:] == 0x7FC1), "finish wrote outside dbias"
        assert np.array_equal(got[pad:-pad], to_bf16(want)), f"R={R}: dbias differs from the model's order"
    else:
        assert np.isnan(got[:pad]).all() and np.isnan(got[-pad:]).all(), "finish wrote outside dbias"
        assert np.array_equal(got[pad:-pad], want), f"R={R}: dbias differs from the model's order"


def test_colsum_finish_model_is_the_pairwise_tree():
    """The numpy model above against a plain float64 sum (CPU): the same total within float32 rounding, and
    its order is not the row order's (so the GPU test above pins the tree, not just a sum)."""
    rng = np.random.default_rng(3)
    vals = (rng.standard_normal((200, 40)) * np.exp(rng.uniform(-6, 6, (200, 1)))).astype(np.float32)
    bias = rng.standard_normal(40).astype(np.float32)
    got = colsum_finish_model(vals, bias)
    exact = bias.astype(np.float64) + vals.astype(np.float64).sum(axis=0)
    assert np.allclose(got, exact, rtol=1e-5, atol=1e-5 * np.abs(vals).sum(axis=0).max())
    serial = bias.copy()
    for r in range(200):
        serial = serial + vals[r]
    assert not np.array_equal(got, serial)


@pytest.mark.parametrize("C,NH", [(768, 12), (1600, 25)])
def test_attention_backward_colsum_launches_without_gpu(C, NH, monkeypatch):
    """The colsum builds' launches on the fake runtime (argument lists checked against the .cu's entry
    points where nvcc is found): 4 runs its dq and dk/dv kernels with the partials pointer, then finish;
    5 prep, main with the partials, convert_colsum (RG = 8 row groups at C = 768, 4 at C = 1600: a block of
    C/8 x RG threads, (RG - 1) C floats of shared memory), finish over B ceil(T/64) rows; a dbias not
    8-byte aligned is refused before any launch."""
    from llmc.bf16 import BF16
    from tests.fake_runtime import FakeRuntime
    for enc in ("qkv_tensor_map", "btc_tensor_map", "_bf16_tensor_map"):  # (the driver encodes these)
        monkeypatch.setattr(A, enc, lambda *a, **k: bytes(128))
    B, T = 2, 130
    R = B * -(-T // 64)
    for n in (4, 5):
        rt = FakeRuntime()
        built = ops.get("attention_backward").build(rt, n, "bf16", B=B, T=T, C=C, NH=NH, colsum=True, qkv_in_place=True)
        part = built.scratch["part"]
        assert part.shape == (R, 3 * C)
        dinp, dbias = rt.empty((B, T, 3 * C), BF16), rt.empty((3 * C,), BF16)
        args = (rt.empty((B, T, C), BF16), rt.empty((B, T, 3 * C), BF16), rt.empty((B, NH, T)), rt.empty((B, T, C), BF16))
        with pytest.raises(LLMCError, match="8-byte aligned"):
            built.launch(dinp, dbias.ptr + 2, *args)
        assert not rt.launches
        built.launch(dinp, dbias, *args)
        names = [x.func for x in rt.launches]
        fin = rt.launches[-1]
        assert fin.func == "flash_attention_backward_colsum_finish_kernel_bf16"
        X = A.FINISH_X  # (block (X, 64): X float4 columns a block)
        assert fin.block == (X, 64, 1) and fin.args[:4] == (dbias.ptr, part.ptr, R, 3 * C)
        assert fin.grid == (-(-3 * C // (4 * X)), 1, 1)
        if n == 4:
            assert [f.split("_kernel4")[0] for f in names[:2]] == ["flash_attention_backward_dq",
                                                                   "flash_attention_backward_dkdv"]
            assert all(x.args[-1] == part.ptr for x in rt.launches[:2]) and len(names) == 3
        else:
            rg = 8 if C <= 1024 else 4
            assert names[1].startswith("flash_attention_backward_dkdvq_kernel5") and rt.launches[1].args[-1] == part.ptr
            cs = rt.launches[2]
            assert cs.func == f"flash_attention_backward_convert_colsum_kernel5_bf16_rg{rg}"
            assert cs.grid == (R, 1, 1) and cs.block == (C // 8, rg, 1) and cs.smem == 4 * (rg - 1) * C
            assert len(names) == 4
    # 4's fp32 build (TF32): its dq and dk/dv kernels with the partials (a row per 16 rows of each
    # 128-row block), then the fp32 finish; dbias needs 16-byte alignment (float4s)
    for smt in (True, False):
        rt = FakeRuntime()
        built = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True,
                                                            smem_transpose=smt, colsum=True)
        R = B * -(-T // 128) * 8
        part = built.scratch["part"]
        assert part.shape == (R, 3 * C)
        dinp, dbias = rt.empty((B, T, 3 * C)), rt.empty((3 * C,))
        args = (rt.empty((B, T, C)), rt.empty((B, T, 3 * C)), rt.empty((B, NH, T)), rt.empty((B, T, C)))
        with pytest.raises(LLMCError, match="16-byte aligned"):
            built.launch(dinp, dbias.ptr + 8, *args)
        assert not rt.launches
        built.launch(dinp, dbias, *args)
        names = [x.func for x in rt.launches]
        sfx = "_btc_smt" if smt else "_btc"
        assert names[-3:] == ["flash_attention_backward_dq_kernel4_tf32" + sfx,
                              "flash_attention_backward_dkdv_kernel4_tf32" + sfx,
                              "flash_attention_backward_colsum_finish_kernel_fp32"]
        assert all(x.args[-1] == part.ptr for x in rt.launches[-3:-1])
        fin = rt.launches[-1]
        X = A.FINISH_X
        assert fin.block == (X, 64, 1) and fin.args[:4] == (dbias.ptr, part.ptr, R, 3 * C)
        assert fin.grid == (-(-3 * C // (4 * X)), 1, 1)
    # the finish's block width: the .cu's FINISH_X default, which the launcher mirrors, and a define of that
    # name (the lab's A/B) moving both
    import re

    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "attention_wgmma.cu").read_text()
    assert int(re.search(r"#define FINISH_X (\d+)", src).group(1)) == A.FINISH_X
    for defines, X in (({}, A.FINISH_X), ({"FINISH_X": 16}, 16)):
        rt = FakeRuntime(1 << 26)
        part, finish, check = A._colsum_finish(rt, 4, 1024, C, "t", defines)
        finish(rt.empty((3 * C,), BF16))
        fin = rt.launches[-1]
        assert fin.block == (X, 64, 1) and fin.grid == (-(-3 * C // (4 * X)), 1, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("B,T,C,NH,maxT", [(2, 65, 96, 2, 128), (1, 1, 64, 1, 16), (4, 1024, 768, 12, 1024),
                                           (3, 300, 768, 12, 1024), (2, 129, 90, 3, 200), (1, 64, 768, 12, 1024),
                                           (8, 65, 768, 12, 1024)])
def test_attention_decode_gpu(rt, B, T, C, NH, maxT, version):
    rng = np.random.default_rng(T)
    inp = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    out64, qkvr64, _ = A.attention_forward_ref(inp.astype(np.float64), NH)
    q, kc, vc = _decode_inputs(inp, qkvr64.astype(np.float32), B, T, C, NH, maxT, rng)
    d_out = rt.empty((B, C))
    poison(d_out)
    if version == 2 and (C // NH) % 4:
        with pytest.raises(VariantRefused, match="not a multiple of 4"):
            ops.get("attention_decode").build(rt, 2, B=B, C=C, NH=NH, maxT=maxT)
        return
    # the kernel gets the new token's whole qkv row and caches holding positions 0..T-2: garbage at
    # T-1 (it must append the new k, v there and use them) and after (must be ignored)
    pos = T - 1
    qkv = np.ascontiguousarray(inp[:, pos])                       # (B, 3C): q | k | v of the new token
    want_k, want_v = kc[:, :, pos].copy(), vc[:, :, pos].copy()
    kc[:, :, pos], vc[:, :, pos] = 1e4, -1e4
    d_kc, d_vc = rt.to_device(kc), rt.to_device(vc)
    launch = ops.get("attention_decode").build(rt, version, B=B, C=C, NH=NH, maxT=maxT)
    launch(d_out, rt.to_device(qkv), d_kc, d_vc, rt.to_device(np.array([pos], np.int32)))
    # plain fp32 dot products and sums over <= 1024 terms
    assert_close(d_out.get(), out64[:, pos], atol=1e-5, rtol=1e-4, name="decode out")
    got_k, got_v = d_kc.get(), d_vc.get()
    assert np.array_equal(got_k[:, :, pos], want_k) and np.array_equal(got_v[:, :, pos], want_v), "append"
    kc[:, :, pos], vc[:, :, pos] = want_k, want_v
    assert np.array_equal(got_k, kc) and np.array_equal(got_v, vc), "cache written outside position pos"


# ----------------------------------------------------------------------------------------------
# CPU: the bf16 fused kernels' fragment mapping (cuda/attention.cu, fb_*), checked on a model of
# what the hardware does, before the kernels ever ran. Facts from the PTX ISA (lane l, g = l // 4,
# t = l % 4; two bf16 per 32-bit register, the lower index in the low half):
#   mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
#     A (16x16): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)      (row, k)
#     B (16x8):  b0 (2t..2t+1, g)  b1 (2t+8.., g)                                        (k, col)
#     C (16x8):  c0 (g, 2t) c1 (g, 2t+1) c2 (g+8, 2t) c3 (g+8, 2t+1)                     (row, col)
#   ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8q..8q+7 give the addresses of rows
#     0..7 of matrix q (8 bf16 each); register q of lane l holds (row g, cols 2t, 2t+1) of matrix q,
#     with .trans (rows 2t, 2t+1, col g). A phase (one matrix) is conflict-free when its 8 rows
#     fall in 8 distinct 16-byte bank groups.
# The lane offsets are read from the .cu (fb_lane_a, fb_lane_b are plain C expressions); the loops
# below are the kernels' fb_frags_a, fb_mma_dim and fb_mma_pos, line for line.


def _fb_source():
    import re
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "attention.cu").read_text()
    ld = int(re.search(r"#define FB_LD (\d+)", src).group(1))
    lanes = {}
    for name in ("fb_lane_a", "fb_lane_b"):
        expr = re.search(name + r"\(int lane\) \{ return (.*?); \}", src).group(1)
        lanes[name] = [eval(expr, {"FB_LD": ld, "lane": lane}) for lane in range(32)]  # C ints = Python ints here
    return ld, lanes["fb_lane_a"], lanes["fb_lane_b"]


def _ldsm(smem, offsets, trans=False):
    """ldmatrix x4 on a flat bf16 array: offsets[lane] is the element address lane gives. Returns
    regs[lane][q] = (lo, hi), and checks each phase is conflict-free."""
    rows = [[smem[o:o + 8] for o in offsets[8 * q:8 * q + 8]] for q in range(4)]  # matrix q, row r
    for q in range(4):
        groups = {(2 * o // 16) % 8 for o in offsets[8 * q:8 * q + 8]}
        assert len(groups) == 8, f"bank conflict in matrix {q}: {offsets[8 * q:8 * q + 8]}"
        assert all(2 * o % 16 == 0 for o in offsets[8 * q:8 * q + 8]), "ldmatrix rows must be 16-byte aligned"
    regs = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        if trans:
            regs.append([(rows[q][2 * t][g], rows[q][2 * t + 1][g]) for q in range(4)])
        else:
            regs.append([(rows[q][g][2 * t], rows[q][g][2 * t + 1]) for q in range(4)])
    return regs


def _mma16816(acc, a, b):
    """acc[lane] (4 floats) += A @ B, with A, B gathered from the lanes' fragments by the ISA table."""
    A, Bm = np.full((16, 16), np.nan), np.full((16, 8), np.nan)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (r, k) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[r, k], A[r, k + 1] = a[lane][i]
        for i, k in enumerate((2 * t, 2 * t + 8)):
            Bm[k, g], Bm[k + 1, g] = b[lane][i]
    assert not np.isnan(A).any() and not np.isnan(Bm).any()
    D = A @ Bm
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def test_bf16_flash_fragment_mapping(rng):
    """One warp's q k^T (fb_mma_dim from fb_frags_a fragments) and p v (fb_mma_pos: the accumulators
    packed as A, v through the transposing ldmatrix) on the hardware model equal the matrix products,
    exactly (small integers), with every ldmatrix conflict-free."""
    LD, la, lb = _fb_source()
    assert LD % 8 == 0 and LD >= 64
    # the offsets and the packing modelled below are the kernels' (every helper and the dkdv loop)
    from llmc.runtime import CUDA_DIR
    src = " ".join((CUDA_DIR / "attention.cu").read_text().split())
    for line in ("ldsm_x4(a[kk], base + 2 * 16 * kk);",
                 "ldsm_x4(b, base + 2 * (16 * jp * FB_LD + 16 * kk));",
                 "ldsm_x4_trans(b, base + 2 * (16 * j * FB_LD + 16 * np));",
                 "ldsm_x4(bq, qb + 2 * (16 * jp * FB_LD + 16 * kk));",
                 "fb_frags_a(ka, ks, w0, x);",
                 "mma_bf16_16816(s[2 * jp + 1], ka[kk], bq + 2);",
                 "pack_bf16x2(S[2 * j][0], S[2 * j][1]), pack_bf16x2(S[2 * j][2], S[2 * j][3]), "
                 "pack_bf16x2(S[2 * j + 1][0], S[2 * j + 1][1]), pack_bf16x2(S[2 * j + 1][2], S[2 * j + 1][3])",
                 "a[mt][2] = pack_bf16x2(S[mt][2 * j + 1][0], S[mt][2 * j + 1][1]);"):
        assert line in src, f"cuda/attention.cu no longer has: {line}"
    tile = lambda: rng.integers(-8, 9, (64, 64)).astype(np.float64)  # noqa: E731
    Q, K, V = tile(), tile(), tile()
    flat = lambda X: np.pad(X, ((0, 0), (0, LD - 64))).reshape(-1)  # noqa: E731  a staged tile, row stride LD
    qs, ks, vs = flat(Q), flat(K), flat(V)
    for w0 in (0, 16, 32, 48):  # each warp's 16 rows
        # fb_frags_a: qa[kk] = ldsm_x4(base + 16 kk), base = la + row0 * FB_LD
        qa = [_ldsm(qs, [la[l] + w0 * LD + 16 * kk for l in range(32)]) for kk in range(4)]
        # fb_mma_dim: S[2jp], S[2jp+1] += qa[kk] * ldsm_x4(lb + 16 jp FB_LD + 16 kk) halves
        S = [np.zeros((32, 4)) for _ in range(8)]
        for kk in range(4):
            for jp in range(4):
                b = _ldsm(ks, [lb[l] + 16 * jp * LD + 16 * kk for l in range(32)])
                _mma16816(S[2 * jp], qa[kk], [r[0:2] for r in b])
                _mma16816(S[2 * jp + 1], qa[kk], [r[2:4] for r in b])
        want = Q[w0:w0 + 16] @ K.T  # (16, 64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(8):  # the kernels' reading of accumulators: row g + 8 (e >> 1), col 8j + 2t + (e & 1)
                for e in range(4):
                    assert S[j][lane][e] == want[g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1)]
        # fb_mma_pos: a = packed S[2j], S[2j+1]; acc[2np], acc[2np+1] += a * ldsm_x4_trans(la + 16 j FB_LD + 16 np)
        P = [s / 64 for s in S]  # any values: exact in float64
        acc = [np.zeros((32, 4)) for _ in range(8)]
        for j in range(4):
            a = [[(P[2 * j][l][0], P[2 * j][l][1]), (P[2 * j][l][2], P[2 * j][l][3]),
                  (P[2 * j + 1][l][0], P[2 * j + 1][l][1]), (P[2 * j + 1][l][2], P[2 * j + 1][l][3])]
                 for l in range(32)]
            for np_ in range(4):
                b = _ldsm(vs, [la[l] + 16 * j * LD + 16 * np_ for l in range(32)], trans=True)
                _mma16816(acc[2 * np_], a, [r[0:2] for r in b])
                _mma16816(acc[2 * np_ + 1], a, [r[2:4] for r in b])
        want_o = (want / 64) @ V
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for n in range(8):
                for e in range(4):
                    assert acc[n][lane][e] == want_o[g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1)]


# ----------------------------------------------------------------------------------------------
# attention_forward 4: Hopper wgmma + TMA, bf16 and TF32 (cuda/attention_wgmma.cu)


def test_wgmma_forward_variant_declares_bf16_and_tf32_sm90_only():
    v = ops.get("attention_forward").variants[4]
    assert v.dtypes == ("fp32", "bf16") and v.arch == "sm_90"
    spec = ops.get("attention_forward")
    assert spec.refuse_reason(4, "bf16", "sm_90", B=4, T=1024, C=768, NH=12) is None
    assert spec.refuse_reason(4, "bf16", "sm_90", B=1, T=1, C=64, NH=1) is None
    assert spec.refuse_reason(4, "fp32", "sm_90", B=1, T=8, C=64, NH=1) is None  # the TF32 build
    back = ops.get("attention_backward")
    assert back.variants[4].dtypes == ("fp32", "bf16")
    assert back.refuse_reason(4, "fp32", "sm_90", B=1, T=8, C=64, NH=1) is None
    for op in (spec, back):  # both element types read q, k, v in place too
        for dt in ("fp32", "bf16"):
            assert op.refuse_reason(4, dt, "sm_90", B=1, T=8, C=64, NH=1, qkv_in_place=True) is None
    assert "sm_90" in spec.refuse_reason(4, "bf16", "sm_80", B=1, T=8, C=64, NH=1)
    assert "head size" in spec.refuse_reason(4, "bf16", "sm_90", B=2, T=65, C=96, NH=3)
    # it keeps what backward 2/3 read (the log-sum-exp), so they can run on its output
    shape = dict(B=2, T=65, C=128, NH=2)
    assert spec.saved_shape(4, **shape) == ops.get("attention_backward").saved_shape(3, **shape) == (2, 2, 65)


def test_wgmma_forward_builds(monkeypatch):
    """Variant 4 builds on the fake runtime (entry points and argtypes against the PTX), with the shared
    memory the .cu computes, the persistent ping-pong kernel by default (a grid of min(blocks, SMs)),
    the one-CTA-per-block builds of the lab (a grid of (B*NH, ceil(T/128))), the persistent builds of
    the lab (the schedules the .cu builds, each with its ring's shared memory), and one tensor map per inp
    pointer, encoded at its first launch only (a captured graph replays the same maps); the persistent
    kernels' maps per (inp, out) pair, inp's then out's (their TMA store of out), out 16-byte aligned."""
    import re
    from llmc.runtime import CUDA_DIR
    from tests.fake_runtime import BASE as FAKE_BASE
    from tests.fake_runtime import FakeRuntime
    src = (CUDA_DIR / "attention_wgmma.cu").read_text()
    const = {k: int(re.search(rf"constexpr int {k} = (\d+);", src).group(1)) for k in ("BQ", "BKV", "STAGES")}
    assert const == {"BQ": A.WGMMA_BQ, "BKV": A.WGMMA_BQ, "STAGES": A.WGMMA_STAGES}
    assert "constexpr int FWD_SMEM = 1024 + Q_BYTES + STAGES * STAGE_BYTES + 8 * (1 + 2 * STAGES);" in src
    assert A.WGMMA_FWD_SMEM == 1024 + 128 * 128 + const["STAGES"] * 2 * 128 * 128 + 8 * (1 + 2 * const["STAGES"])
    encoded = []
    # the kernel reads q, k, v from inp (the qkv matmul's (B,T,3C) output): one map per inp pointer
    monkeypatch.setattr(A, "qkv_tensor_map", lambda ptr, B, T, NH: encoded.append((ptr, B, T, NH)) or bytes(128))
    outs = []
    monkeypatch.setattr(A, "out_tensor_map", lambda ptr, B, T, NH: outs.append((ptr, B, T, NH)) or bytes(range(128)))
    monkeypatch.setattr(A, "qkvr_tensor_map", lambda *a: pytest.fail("forward 4 reads inp, never qkvr"))
    rt = FakeRuntime(heap_bytes=1 << 16)  # the maps are copied to the fake device
    launch = ops.get("attention_forward").build(rt, 4, "bf16", B=2, T=200, C=128, NH=2)
    assert rt.built == ["permute_kernel2_bf16", "flash_attention_forward_kernel4_bf16_persistent_overlap_pingpong_s4"]
    for inp in (0x10000, 0x10000, 0x20000):
        launch(0x1000, 0x4000, 0x3000, inp)  # out, qkvr, lse, inp
    assert encoded == [(0x10000, 2, 200, 2), (0x20000, 2, 200, 2)]
    assert outs == [(0x1000, 2, 200, 2), (0x1000, 2, 200, 2)]  # (with each new inp: the pair is new)
    launch(0x2000, 0x4000, 0x3000, 0x20000)  # another out: a new pair, two maps
    assert encoded[-1] == (0x20000, 2, 200, 2) and outs[-1] == (0x2000, 2, 200, 2) and len(outs) == 3
    k = [x for x in rt.launches if x.func == "flash_attention_forward_kernel4_bf16_persistent_overlap_pingpong_s4"]
    # the two maps back to back on the device, inp's then out's
    at = int(k[-1].args[2]) - FAKE_BASE
    assert bytes(rt.heap[at:at + 256]) == bytes(128) + bytes(range(128))
    # 2 * 2 heads x 2 blocks = 8 items: 8 CTAs (at most one per SM), the persistent kernel's shared memory
    # with a 4-deep ring (2 more stages of k and v, 4 more mbarriers)
    s4_smem = A.WGMMA_FWD_P_SMEM + 2 * 2 * 128 * 128 + 8 * 4
    assert len(k) == 4 and k[0].grid == (8, 1, 1) and k[0].block == (384, 1, 1) and k[0].smem == s4_smem
    plain = A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, persistent=False, pingpong=False,
                                                  overlap=False)
    assert rt.built[-1] == "flash_attention_forward_kernel4_bf16"
    plain(0x1000, 0x4000, 0x3000, 0x10000)
    assert rt.launches[-1].grid == (4, 2, 1) and rt.launches[-1].smem == A.WGMMA_FWD_SMEM
    perm = [x for x in rt.launches if x.func == "permute_kernel2_bf16"]  # the permuted copy backward 2/3 read
    assert len(perm) == 5 and perm[0].args[:2] == (0x4000, 0x10000)
    with pytest.raises(LLMCError, match="inp must be 16-byte aligned"):
        launch(0x1000, 0x4000, 0x3000, 0x30008)
    with pytest.raises(LLMCError, match="out must be 16-byte aligned"):
        launch(0x1008, 0x4000, 0x3000, 0x30000)
    # the lab's other builds
    A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, persistent=False, pingpong=False)
    assert rt.built[-1] == "flash_attention_forward_kernel4_bf16_overlap"
    A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, persistent=False, overlap=False)
    assert rt.built[-1] == "flash_attention_forward_kernel4_bf16_pingpong"
    A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, persistent=False)
    assert rt.built[-1] == "flash_attention_forward_kernel4_bf16_overlap_pingpong"
    with pytest.raises(AssertionError, match="2 stages only"):
        A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, persistent=False, stages=4)
    # persistent: one CTA per SM at most (here 2 * 2 heads x 2 blocks = 8 items), its own shared memory
    assert "constexpr int FWD_P_SMEM = fwd_p_smem(STAGES);" in src
    assert "constexpr int O_STAGE_BYTES = 64 * ROW_BYTES;" in src  # a consumer's staged out rows
    assert A.WGMMA_FWD_P_SMEM == A.WGMMA_FWD_SMEM + 128 * 128 + 2 * 64 * 128 + 8 * 3
    per = A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, overlap=False)
    assert rt.built[-1] == "flash_attention_forward_kernel4_bf16_persistent_pingpong"
    per(0x1000, 0x4000, 0x3000, 0x10000)
    assert rt.launches[-1].grid == (8, 1, 1) and rt.launches[-1].smem == A.WGMMA_FWD_P_SMEM
    per = A.build_flash_attention_forward_wgmma(rt, B=64, T=1024, C=128, NH=2, persistent=True)
    per(0x1000, 0x4000, 0x3000, 0x10000)
    assert rt.launches[-1].grid == (rt.sm_count, 1, 1)
    assert "return 1024 + 2 * Q_BYTES + st * STAGE_BYTES + (fwd_o_staged(st) ? 2 * O_STAGE_BYTES : 0) + 8 * (4 + 2 * st);" in src
    assert "__host__ __device__ constexpr bool fwd_o_staged(int st) { return st <= 5; }" in src
    # every persistent build the .cu has: its name and its ring's shared memory (fits the H100's 227 KB)
    for pp, ov, st in sorted(A.WGMMA_FWD_PERSISTENT):
        sfx = ("_overlap" if ov else "") + ("_pingpong" if pp else "") + ("" if st == 2 else f"_s{st}")
        assert f"FWD_PERSISTENT({sfx}, {str(pp).lower()}, {str(ov).lower()}, {st})" in src
        per = A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, pingpong=pp, overlap=ov, stages=st)
        per(0x1000, 0x4000, 0x3000, 0x10000)
        assert rt.built[-1] == "flash_attention_forward_kernel4_bf16_persistent" + sfx
        staged = 0 if st <= 5 else -2 * 64 * 128  # (6 stages: out stored directly, no staging)
        assert rt.launches[-1].smem == A.WGMMA_FWD_P_SMEM + (st - 2) * (2 * 128 * 128 + 8 * 2) + staged <= 227 * 1024
    with pytest.raises(AssertionError, match="no persistent build"):
        A.build_flash_attention_forward_wgmma(rt, B=2, T=200, C=128, NH=2, overlap=False, pingpong=False, stages=6)
    # qkv in place: no permute at all, and qkvr must be inp (the tensor backward 4 then reads)
    rt = FakeRuntime(heap_bytes=1 << 16)
    encoded.clear()
    launch = ops.get("attention_forward").build(rt, 4, "bf16", B=2, T=200, C=128, NH=2, qkv_in_place=True)
    assert rt.built == ["flash_attention_forward_kernel4_bf16_persistent_overlap_pingpong_s4"]
    launch(0x1000, 0x10000, 0x3000, 0x10000)
    assert encoded == [(0x10000, 2, 200, 2)]
    assert [x.func for x in rt.launches] == ["flash_attention_forward_kernel4_bf16_persistent_overlap_pingpong_s4"]
    with pytest.raises(LLMCError, match="qkvr must be inp"):
        launch(0x1000, 0x20000, 0x3000, 0x10000)
    # only variant 4 has the in-place form
    spec = ops.get("attention_forward")
    for n in (1, 2, 3):
        assert "qkv_in_place" in spec.refuse_reason(n, "bf16" if n > 1 else "fp32", "sm_90", B=2, T=200, C=128, NH=2,
                                                    qkv_in_place=True)


def test_wgmma_p_fragment_is_the_score_accumulator():
    """The register-A fragment of P V's k-step kk (wgmma m64nNk16 bf16: per warp, mma.sync m16n8k16's
    A layout) holds exactly the score accumulators 8kk + 2r, 8kk + 2r + 1 (m64n128 layout: register
    4j + 2h + c at row 16w + g + 8h, column 8j + 2t + c), and the kernel packs it that way."""
    from llmc.runtime import CUDA_DIR
    src = " ".join((CUDA_DIR / "attention_wgmma.cu").read_text().split())
    for line in ("const float p = ex2(fmaf(sc[4 * j + e], c2, mneg[e >> 1]));",
                 "lp[e >> 1][(j & 1) * 2 + (e & 1)] += p;",
                 "mp[e >> 1][(j & 1) * 2 + (e & 1)] = fmaxf(mp[e >> 1][(j & 1) * 2 + (e & 1)], sc[4 * j + e]);",
                 "for (int r = 0; r < 4; r++) pa[kk][r] = pack_bf16(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);",
                 "wgmma_bf16_rs_n64<1>(o, pa[kk], desc_mn(sv + kk * 2048), 1);",
                 "if (diag) mask_scores<16>(sc, row0 - key0 - 2 * t);",
                 "if (8 * j + (e & 1) - 8 * (e >> 1) > lim) sc[4 * j + e] = -INFINITY;",
                 "const int row0 = q0 + 64 * cw + 16 * warp + g;"):
        assert line in src, f"cuda/attention_wgmma.cu no longer has: {line}"
    for w in range(4):
        for lane in range(32):
            g, t = lane // 4, lane % 4
            acc = {4 * j + 2 * h + c: (16 * w + g + 8 * h, 8 * j + 2 * t + c)
                   for j in range(16) for h in range(2) for c in range(2)}
            for kk in range(8):
                # A of m16n8k16 (rows of this warp): register r holds (row, col), (row, col + 1)
                a = {0: (g, 2 * t), 1: (g + 8, 2 * t), 2: (g, 2 * t + 8), 3: (g + 8, 2 * t + 8)}
                for r in range(4):
                    row, col = 16 * w + a[r][0], 16 * kk + a[r][1]
                    assert acc[8 * kk + 2 * r] == (row, col) and acc[8 * kk + 2 * r + 1] == (row, col + 1)
            # the softmax's row half of register 4j + e (its m, l, max and sum partials): e >> 1
            for n, (row, col) in acc.items():
                assert (n % 4) >> 1 == (row - 16 * w - g) // 8
                # the diagonal mask: key0 + col > row0 + 8 hh, with row0 = the thread's first row
                j, e = n // 4, n % 4
                for key0, row0 in ((0, 16 * w + g), (128, 128 + 16 * w + g), (0, 5), (256, 131)):
                    assert (8 * j + (e & 1) - 8 * (e >> 1) > row0 - key0 - 2 * t) == \
                        (key0 + col > row0 + 8 * (e >> 1))
    # the backward's key-major tiles (register 4j + e: key key0 + 8 (e >> 1), query q0 + 8j + 2t + (e & 1)):
    # mask_scores_t(sc, d = q0 + 2t - key0, hi = T - q0 - 2t) masks query < key and query >= T
    for line in ("if (8 * j + (e & 1) + d < 8 * (e >> 1) || 8 * j + (e & 1) >= hi) sc[4 * j + e] = -INFINITY;",
                 "if (i == 0 || i == nt - 1) mask_scores_t<16>(sc, q0 + 2 * t - key0, T - q0 - 2 * t);"):
        assert line in src, f"cuda/attention_wgmma.cu no longer has: {line}"
    rng = np.random.default_rng(0)
    for _ in range(2000):
        q0, key0, T = (int(x) for x in rng.integers(0, 400, 3))
        t, j, e = int(rng.integers(4)), int(rng.integers(16)), int(rng.integers(4))
        qpos, key = q0 + 8 * j + 2 * t + (e & 1), key0 + 8 * (e >> 1)
        d, hi = q0 + 2 * t - key0, T - q0 - 2 * t
        assert (8 * j + (e & 1) + d < 8 * (e >> 1) or 8 * j + (e & 1) >= hi) == (qpos < key or qpos >= T)


def test_wgmma_tiles_cover_the_causal_triangle():
    """The kernel's tile walk (block qb takes key tiles 0..qb, masks only tile qb) in numpy, float64:
    online softmax over 128-key tiles, the diagonal masked by key > row, gives the reference out and
    lse at T not a multiple of 128 (rows past T computed on zero-filled k, v and dropped)."""
    rng = np.random.default_rng(4)
    for T in (1, 65, 130, 300):
        inp = rng.standard_normal((1, T, 3 * 64))
        out64, _, _ = A.attention_forward_ref(inp, 1)
        lse64 = A.attention_lse_ref(inp, 1)
        q, k, v = (x[0, 0] for x in A._split_heads(inp, 1))  # (T, 64)
        nqb = -(-T // 128)
        pad = lambda x: np.pad(x, ((0, nqb * 128 - T), (0, 0)))  # noqa: E731  the TMA's zero fill
        q, k, v = pad(q), pad(k), pad(v)
        for qb in range(nqb):
            rows = np.arange(qb * 128, qb * 128 + 128)
            m, l, o = np.full(128, -np.inf), np.zeros(128), np.zeros((128, 64))
            for i in range(qb + 1):
                keys = np.arange(i * 128, i * 128 + 128)
                x = q[rows] @ k[keys].T / 8.0
                if i == qb:
                    x = np.where(keys[None, :] > rows[:, None], -np.inf, x)
                mx = np.maximum(m, x.max(1))
                corr = np.exp(m - mx)
                p = np.exp(x - mx[:, None])
                l, o, m = l * corr + p.sum(1), o * corr[:, None] + p @ v[keys], mx
            ok = rows < T
            np.testing.assert_allclose(o[ok] / l[ok, None], out64[0, rows[ok]], rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(m[ok] + np.log(l[ok]), lse64[0, 0, rows[ok]], rtol=1e-12, atol=1e-12)


def test_wgmma_persistent_walk_takes_every_block_once():
    """The persistent forward's item walk (persistent_item, snake order over G = min(items, SMs) CTAs;
    item w is query block nqb - 1 - w // (B NH) of head w % (B NH)): every (head, block) exactly once,
    and the key tiles per CTA even out (the d12 shapes: within 1.3x of the mean on 132 SMs)."""
    from llmc.runtime import CUDA_DIR
    src = " ".join((CUDA_DIR / "attention_wgmma.cu").read_text().split())
    for line in ("const int G = gridDim.x, c = (r & 1) ? G - 1 - blockIdx.x : blockIdx.x; return r * G + c;",
                 "const int qb = nqb - 1 - w / BNH, bh = w % BNH, b = bh / NH, h = bh % NH, j = r & 1;"):
        assert line in src, f"cuda/attention_wgmma.cu no longer has: {line}"
    for BNH, T in ((48, 1024), (192, 1024), (2, 200), (1, 1), (7, 129)):
        nqb = -(-T // 128)
        items = BNH * nqb
        G = min(items, 132)
        seen, tiles = [], np.zeros(G)
        for cta in range(G):
            r = 0
            while (w := r * G + (G - 1 - cta if r & 1 else cta)) < items:
                qb, bh = nqb - 1 - w // BNH, w % BNH
                seen.append((bh, qb))
                tiles[cta] += qb + 1
                r += 1
        assert sorted(seen) == sorted((bh, qb) for bh in range(BNH) for qb in range(nqb)), (BNH, T)
        if items >= 4 * G:
            assert tiles.max() <= 1.3 * tiles.mean(), (BNH, T, tiles.max(), tiles.mean())


# ----------------------------------------------------------------------------------------------
# attention_backward 4: Hopper wgmma + TMA, bf16 and TF32 (cuda/attention_wgmma.cu)


def test_wgmma_backward_variant_declares_tf32_and_bf16_sm90_only():
    spec = ops.get("attention_backward")
    v = spec.variants[4]
    assert v.dtypes == ("fp32", "bf16") and v.arch == "sm_90"
    assert spec.refuse_reason(4, "bf16", "sm_90", B=4, T=1024, C=768, NH=12) is None
    assert spec.refuse_reason(4, "bf16", "sm_90", B=1, T=1, C=64, NH=1) is None
    assert spec.refuse_reason(4, "fp32", "sm_90", B=1, T=8, C=64, NH=1) is None
    assert "sm_90" in spec.refuse_reason(4, "bf16", "sm_80", B=1, T=8, C=64, NH=1)
    assert "head size" in spec.refuse_reason(4, "bf16", "sm_90", B=2, T=65, C=96, NH=3)
    # it reads what forward 2, 3, 4 keep (the log-sum-exp) and has backward 3's scratch (D); the fp32
    # build also k, q and dout transposed, (B*NH, 64, T rounded up to 8) each
    shape = dict(B=2, T=65, C=128, NH=2)
    fwd = ops.get("attention_forward")
    assert all(spec.saved_shape(4, **shape) == fwd.saved_shape(n, **shape) == (2, 2, 65) for n in (2, 3, 4))
    assert v.scratch_bytes(**shape, dtype="bf16") == spec.variants[3].scratch_bytes(**shape) == 4 * 2 * 2 * 65
    # fp32 at this size: D and the global transposes' kt, qt, dot (they fit in the L2)
    assert v.scratch_bytes(**shape, dtype="fp32") == 4 * 2 * 2 * 65 + 3 * 4 * 2 * 2 * 64 * 72


def test_wgmma_backward_builds(monkeypatch):
    """Variant 4 builds on the fake runtime (entry points and argtypes against the PTX) with the shared
    memory the .cu computes, grids of (B*NH, ceil(T/128)) x 384 threads, backward 3's launch
    signature, and one pair of tensor maps (qkvr, dout) per pointer pair, encoded at its first launch."""
    import re
    from llmc.runtime import CUDA_DIR
    from tests.fake_runtime import FakeRuntime
    src = (CUDA_DIR / "attention_wgmma.cu").read_text()
    assert int(re.search(r"#define LLMC_ATT_BWD_STAGES (\d+)", src).group(1)) == A.WGMMA_BWD_STAGES
    one = " ".join(src.split())
    assert ("constexpr int DQ_SMEM = 1024 + 2 * Q_BYTES + BF_BWD_STAGES * STAGE_BYTES + 8 * (1 + 2 * BF_BWD_STAGES);"
            in one)
    assert ("constexpr int DKDV_SMEM = 1024 + 2 * KV_BYTES + BF_BWD_STAGES * STAGE_BYTES + 2 * 2 * ROWS_FLOATS * 4 + "
            "8 * (1 + 2 * BF_BWD_STAGES);") in one and "constexpr int ROWS_FLOATS = 2 * BQ;" in one
    tiles = 2 * 128 * 128 + A.WGMMA_BWD_STAGES * 2 * 128 * 128
    assert A.WGMMA_DQ_SMEM == 1024 + tiles + 8 * (1 + 2 * A.WGMMA_BWD_STAGES)
    assert A.WGMMA_DKDV_SMEM == A.WGMMA_DQ_SMEM + 2 * 2 * 2 * 128 * 4
    encoded = []
    monkeypatch.setattr(A, "qkvr_tensor_map", lambda ptr, B, NH, T: encoded.append(("qkvr", ptr, B, NH, T)) or bytes(128))
    monkeypatch.setattr(A, "btc_tensor_map", lambda ptr, B, T, NH, what="": encoded.append(("dout", ptr, B, T, NH)) or bytes(128))
    rt = FakeRuntime(heap_bytes=1 << 16)
    built = ops.get("attention_backward").build(rt, 4, "bf16", B=2, T=200, C=128, NH=2)
    assert rt.built == ["flash_attention_backward_dq_kernel4_bf16", "flash_attention_backward_dkdv_kernel4_bf16"]
    assert set(built.scratch) == {"D"} and built.scratch["D"].shape == (2, 2, 200)
    for qkvr, dout in ((0x10000, 0x20000), (0x10000, 0x20000), (0x10000, 0x30000)):
        built(0x1000, dout, qkvr, 0x5000, 0x6000)  # dinp, dout, qkvr, lse, out
    assert encoded == [("qkvr", 0x10000, 2, 2, 200), ("dout", 0x20000, 2, 200, 2),
                       ("qkvr", 0x10000, 2, 2, 200), ("dout", 0x30000, 2, 200, 2)]
    dq = [x for x in rt.launches if x.func == "flash_attention_backward_dq_kernel4_bf16"]
    kv = [x for x in rt.launches if x.func == "flash_attention_backward_dkdv_kernel4_bf16"]
    assert len(dq) == len(kv) == 3
    assert dq[0].grid == kv[0].grid == (4, 2, 1) and dq[0].block == kv[0].block == (384, 1, 1)
    assert dq[0].smem == A.WGMMA_DQ_SMEM and kv[0].smem == A.WGMMA_DKDV_SMEM
    D = built.scratch["D"].ptr
    # dq kernel: (dinp, D, dout, out, maps, lse, ...); dkdv: (dinp, maps, lse, D, ...); maps shared per pair
    assert dq[0].args[:4] == (0x1000, D, 0x20000, 0x6000) and dq[0].args[5] == 0x5000
    assert kv[0].args[0] == 0x1000 and kv[0].args[1] == dq[0].args[4] and kv[0].args[2:4] == (0x5000, D)
    assert dq[1].args[4] == dq[0].args[4] != dq[2].args[4]
    for qkvr, dout, out in ((0x10008, 0x20000, 0x6000), (0x10000, 0x40008, 0x6000), (0x50000, 0x60000, 0x6004)):
        with pytest.raises(LLMCError, match="16-byte aligned"):
            built(0x1000, dout, qkvr, 0x5000, out)
    A.build_flash_attention_backward_wgmma(rt, B=2, T=200, C=128, NH=2, overlap=True)  # the lab's other build
    assert rt.built[-2:] == ["flash_attention_backward_dq_kernel4_bf16_overlap", "flash_attention_backward_dkdv_kernel4_bf16"]
    # qkv in place: the _btc kernels, and qkvr (the forward's inp, (B,T,3C)) through the 4D qkv map
    monkeypatch.setattr(A, "qkv_tensor_map", lambda ptr, B, T, NH: encoded.append(("qkv", ptr, B, T, NH)) or bytes(128))
    encoded.clear()
    rt = FakeRuntime(heap_bytes=1 << 16)
    built = ops.get("attention_backward").build(rt, 4, "bf16", B=2, T=200, C=128, NH=2, qkv_in_place=True)
    # in place, the consumers take turns by default (measured faster); pingpong=False: the plain _btc kernels
    assert rt.built == ["flash_attention_backward_dq_kernel4_bf16_btc_pingpong",
                        "flash_attention_backward_dkdv_kernel4_bf16_btc_pingpong"]
    A.build_flash_attention_backward_wgmma(rt, B=2, T=200, C=128, NH=2, qkv_in_place=True, pingpong=False)
    assert rt.built[-2:] == ["flash_attention_backward_dq_kernel4_bf16_btc", "flash_attention_backward_dkdv_kernel4_bf16_btc"]
    built(0x1000, 0x20000, 0x10000, 0x5000, 0x6000)
    assert encoded == [("qkv", 0x10000, 2, 200, 2), ("dout", 0x20000, 2, 200, 2)]
    with pytest.raises(AssertionError):
        A.build_flash_attention_backward_wgmma(rt, B=2, T=200, C=128, NH=2, overlap=True, qkv_in_place=True)


def _wg_acc_coords(n):
    """wgmma m64nN fp32 accumulators of a warpgroup: (row, col) of register 4j + 2h + c of thread
    tid (warp w = tid / 32, g = lane / 4, t = lane % 4): (16w + g + 8h, 8j + 2t + c). Arrays (128, N/2)."""
    tid = np.arange(128)[:, None]
    w, g, t = tid // 32, tid % 32 // 4, tid % 4
    reg = np.arange(n // 2)[None, :]
    j, h, c = reg // 4, reg % 4 // 2, reg % 2
    return 16 * w + g + 8 * h, 8 * j + 2 * t + c


def _wg_regs_to_a(x):
    """The kernel's pack_a (a[kk][r] = x[8kk + 2r], x[8kk + 2r + 1], low half first) read through wgmma's
    register-A layout for m64nNk16 (per warp mma.sync m16n8k16's A: register r of k-step kk holds rows
    16w + g (+8 for r = 1, 3), columns 16kk + 2t (+8 for r = 2, 3), and the next column): the (64, 128)
    matrix the product sees. Every element comes from exactly one register."""
    A_ = np.full((64, 128), np.nan)
    tid = np.arange(128)
    w, g, t = tid // 32, tid % 32 // 4, tid % 4
    for kk in range(8):
        for r in range(4):
            row = 16 * w + g + 8 * (r & 1)
            col = 16 * kk + 2 * t + 8 * (r >> 1)
            for half in range(2):
                assert np.isnan(A_[row, col + half]).all()
                A_[row, col + half] = x[tid, 8 * kk + 2 * r + half]
    assert not np.isnan(A_).any()
    return A_


def _emulate_wgmma_backward(q, k, v, dout, out, lse, T):
    """Both kernels of attention_backward 4 on one head in float64, thread by thread through the
    wgmma fragment layouts, with the kernels' tile walks, masks, zero-filled rows past T and per-
    register formulas (the lines test_wgmma_backward_tile_walk checks are in the .cu). Returns dq, dk,
    dv (T, 64) and the (query tile, key tile) pairs each kernel visited."""
    nb = -(-T // 128)
    pad = lambda x: np.pad(x, ((0, nb * 128 - T), (0, 0)))  # noqa: E731  the TMA's zero fill
    q, k, v, dout, out = map(pad, (q, k, v, dout, out))
    scale, LOG2E = 1.0 / 8.0, 1.0 / math.log(2)
    c2 = scale * LOG2E
    rows, cols = _wg_acc_coords(128)  # S-shape accumulators (64 x 128)
    orow, ocol = _wg_acc_coords(64)   # O-shape accumulators (64 x 64)
    cc = (np.arange(64) % 2)[None, :]  # e & 1
    lse_p = np.concatenate([lse, np.zeros(nb * 128 - T)])
    D = (dout * out).sum(1)  # the dq kernel's D (rows >= T: zero-filled dout, D = 0)
    dq, dk, dv = (np.full((T, 64), np.nan) for _ in range(3))
    seen_dq, seen_kv = [], []
    for by in range(nb):  # dq kernel: blockIdx.y counts down from the last query block
        qb = nb - 1 - by
        for cw in range(2):
            r0 = qb * 128 + 64 * cw  # the warpgroup's first row; row0 = r0 + 16 w + g = r0 + rows (h = 0)
            rowg = r0 + rows          # the global row of each accumulator register
            lr = np.where(rowg < T, lse_p[np.minimum(rowg, nb * 128 - 1)] * LOG2E, 0.0)
            Dr = D[rowg]
            acc = np.zeros((128, 32))
            for i in range(qb + 1):
                if cw == 0:
                    seen_dq.append((qb, i))
                kt = slice(i * 128, i * 128 + 128)
                sc = (q[r0:r0 + 64] @ k[kt].T)[rows, cols]
                dp = (dout[r0:r0 + 64] @ v[kt].T)[rows, cols]
                p = np.exp2(sc * c2 - lr)
                if i == qb:  # diag: key0 + 8j + 2t + (e & 1) > row0 + 8 hh
                    p = np.where(i * 128 + cols > rowg, 0.0, p)
                ds = p * (dp - Dr)
                acc += (_wg_regs_to_a(ds) @ k[kt])[orow, ocol]  # issue_o(dq, da, stage(i)): k as the MN-major B
            ok = r0 + orow < T  # the stored registers (row0 + 8h < T)
            dq[(r0 + orow)[ok], ocol[ok]] = acc[ok] * scale
    for kb in range(nb):  # dkdv kernel: blockIdx.y = kb, query tiles kb..nb-1
        for cw in range(2):
            k0 = kb * 128 + 64 * cw
            keyg = k0 + rows
            accv, acck = np.zeros((128, 32)), np.zeros((128, 32))
            for i in range(nb - kb):
                if cw == 0:
                    seen_kv.append((kb + i, kb))
                q0 = (kb + i) * 128
                qt = slice(q0, q0 + 128)
                # the staged rows: r[tid] = lse (log2 units), r[128 + tid] = D, 0 past T
                qpos = q0 + np.arange(128)
                r = np.concatenate([np.where(qpos < T, lse_p[qpos] * LOG2E, 0.0), np.where(qpos < T, D[qpos], 0.0)])
                sc = (k[k0:k0 + 64] @ q[qt].T)[rows, cols]
                dp = (v[k0:k0 + 64] @ dout[qt].T)[rows, cols]
                tid = np.arange(128)[:, None]
                t = tid % 4
                j = np.arange(64)[None, :] // 4
                lq = r[8 * j + 2 * t + cc]           # float2 at r + 8j + 2t, .x / .y by c
                dd = r[128 + 8 * j + 2 * t + cc]
                p = np.exp2(sc * c2 - lq)
                if i == 0 or i == nb - kb - 1:
                    qp = q0 + 8 * j + 2 * t + cc
                    p = np.where((qp < keyg) | (qp >= T), 0.0, p)  # keyg: key0 + 8 (e >> 1)
                dsT = p * (dp - dd)
                accv += (_wg_regs_to_a(p) @ dout[qt])[orow, ocol]
                acck += (_wg_regs_to_a(dsT) @ q[qt])[orow, ocol]
            ok = k0 + orow < T
            dk[(k0 + orow)[ok], ocol[ok]] = acck[ok] * scale
            dv[(k0 + orow)[ok], ocol[ok]] = accv[ok]
    return dq, dk, dv, seen_dq, seen_kv


def test_wgmma_backward_tile_walk():
    """attention_backward 4's two kernels modelled thread by thread in float64 (_emulate_wgmma_backward:
    the S-shape accumulator layout, dS and P^T packed in place as the O-shape's register A, lse and D
    per row (dq) or per staged column (dk dv), the diagonal and past-T masks, zero-filled rows) give
    the reference gradients at T not a multiple of 128; each kernel visits every (query tile, key
    tile) pair of the causal lower triangle exactly once."""
    from llmc.runtime import CUDA_DIR
    src = " ".join((CUDA_DIR / "attention_wgmma.cu").read_text().split())
    for line in ("const float p = ex2(fmaf(sc[4 * j + e], c2, -lr[hh]));",
                 "if (i == nkt - 1) mask_scores<16>(sc, row0 - i * BKV - 2 * t);",
                 "sc[4 * j + e] = p * (dp[4 * j + e] - Dr[hh]);",
                 "issue_o(dq, da, stage(i));",
                 "const float2 lq = *reinterpret_cast<const float2*>(r + 8 * j + 2 * t);",
                 "const float2 dd = *reinterpret_cast<const float2*>(r + BQ + 8 * j + 2 * t);",
                 "const float p = ex2(fmaf(sc[4 * j + e], c2, -(c ? lq.y : lq.x)));",
                 "if (i == 0 || i == nt - 1) mask_scores_t<16>(sc, q0 + 2 * t - key0, T - q0 - 2 * t);",
                 "dp[4 * j + e] = p * (dp[4 * j + e] - (c ? dd.y : dd.x));",
                 "issue_o(dv, pa, sqt + KV_BYTES);", "issue_o(dk, da, sqt);",
                 "for (int r = 0; r < 4; r++) a[kk][r] = pack_bf16(x[8 * kk + 2 * r], x[8 * kk + 2 * r + 1]);",
                 "for (int kk = 0; kk < 8; kk++) wgmma_bf16_rs_n64<1>(acc, a[kk], desc_mn(sb + kk * 2048), 1);",
                 "const int row0 = q0 + 64 * cw + 16 * warp + g;", "const int key0 = k0 + 64 * cw + 16 * warp + g;",
                 "const int qb = gridDim.y - 1 - blockIdx.y;", "const int kb = blockIdx.y;",
                 "r[tid] = l_next * LOG2E;", "r[BQ + tid] = d_next;", "l = qpos < T ? lseh[qpos] : 0.0f;"):
        assert line in src, f"cuda/attention_wgmma.cu no longer has: {line}"
    rng = np.random.default_rng(5)
    for T in (1, 65, 130, 300):
        inp = rng.standard_normal((1, T, 3 * 64))
        dout = rng.standard_normal((1, T, 64))
        out64, qkvr64, att64 = A.attention_forward_ref(inp, 1)
        ref = A.attention_backward_ref(dout, qkvr64, att64, 1)[0]
        lse = A.attention_lse_ref(inp, 1)[0, 0]
        q, k, v = (x[0, 0] for x in A._split_heads(inp, 1))
        dq, dk, dv, seen_dq, seen_kv = _emulate_wgmma_backward(q, k, v, dout[0], out64[0], lse, T)
        for name, got, want in (("dq", dq, ref[:, :64]), ("dk", dk, ref[:, 64:128]), ("dv", dv, ref[:, 128:])):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=f"{name} at T={T}")
        nb = -(-T // 128)
        lower = sorted((qt, kt) for qt in range(nb) for kt in range(qt + 1))
        assert sorted(seen_dq) == lower and len(seen_dq) == len(lower), f"dq kernel's tiles at T={T}"
        assert sorted(seen_kv) == lower and len(seen_kv) == len(lower), f"dk dv kernel's tiles at T={T}"


def test_bf16_forward_rows128_builds():
    """The 128-row-block bf16 forward (a lab option of variants 2, 3) builds on the fake runtime
    (entry points and argtypes against the PTX), with half the blocks; fp32 and other row counts refuse."""
    from tests.fake_runtime import FakeRuntime
    for version in (2, 3):
        rt = FakeRuntime()
        launch = A.build_flash_attention_forward(rt, B=2, T=200, C=128, NH=2, version=version, dtype="bf16", rows=128)
        launch(*(0x1000,) * 4)
        assert rt.built[-1] == f"flash_attention_forward_kernel{version}_bf16_rows128"
        assert rt.launches[-1].grid == (2, 4, 1)  # ceil(200 / 128) query blocks x B*NH
    for dtype, rows in (("fp32", 128), ("bf16", 96)):
        with pytest.raises(LLMCError, match="rows="):
            A.build_flash_attention_forward(FakeRuntime(), B=1, T=8, C=64, NH=1, dtype=dtype, rows=rows)


def test_bf16_flash_staging_covers_tiles():
    """fa_stage / fa_stage_async of bf16 tiles: 128 threads x 4 chunks of 8 bf16 cover the 64 x 64
    tile exactly once, 16-byte aligned in shared memory; the kernels' shared-memory sizes are what the
    builds request."""
    LD, _, _ = _fb_source()
    seen = set()
    for tid in range(128):
        for i in range(64 * 64 // 8 // 128):
            idx = tid + i * 128
            r, c = idx >> 3, (idx & 7) * 8
            assert (2 * (r * LD + c)) % 16 == 0
            seen.add((r, c))
    assert seen == {(r, c) for r in range(64) for c in range(0, 64, 8)}
    tile = 64 * LD * 2
    assert A._flash_smem("fwd", 3, "bf16") == 4 * tile and A._flash_smem("fwd", 2, "bf16") == 2 * tile
    assert A._flash_smem("dq", 3, "bf16") == 4 * tile + 4 * 64
    assert A._flash_smem("dkdv", 3, "bf16") == 6 * tile + 4 * 4 * 64
    assert A._flash_smem("dkdv", 2, "fp32") == 4 * (4 * 64 * 68 + 2 * 64)  # the fp32 sizes unchanged


# The bf16 decode builds: qkv, caches and out bf16 (values made bf16 first), scores, softmax and
# sums fp32. Each output element is rounded once (<= 2^-8 relative, allowed 2^-7); the fp32 sums
# over <= 1024 keys add ~1e-6 of max|v| (allowed 2^-12 max|v|, absolute: out averages v and can
# cancel to near 0). The append and the kv fill are copies: exact.
@pytest.mark.gpu
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("B,T,C,NH,maxT", [(2, 65, 96, 2, 128), (1, 1, 64, 1, 16), (4, 1024, 768, 12, 1024),
                                           (3, 300, 768, 12, 1024), (1, 64, 768, 12, 1024), (8, 65, 768, 12, 1024)])
def test_attention_decode_bf16_gpu(rt, B, T, C, NH, maxT, version):
    from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
    rng = np.random.default_rng(T + 5)
    inp = round_bf16(rng.standard_normal((B, T, 3 * C)))
    out64, qkvr64, _ = A.attention_forward_ref(inp.astype(np.float64), NH)
    q, kc, vc = _decode_inputs(inp, qkvr64.astype(np.float32), B, T, C, NH, maxT, rng)
    kc, vc = round_bf16(kc), round_bf16(vc)  # the garbage past pos too
    pos = T - 1
    qkv = np.ascontiguousarray(inp[:, pos])
    want_k, want_v = kc[:, :, pos].copy(), vc[:, :, pos].copy()
    kc[:, :, pos], vc[:, :, pos] = 1e4, -1e4   # bf16 values: must be overwritten by the append
    d_kc, d_vc = rt.to_device(to_bf16(kc)), rt.to_device(to_bf16(vc))
    d_out = rt.empty((B, C), BF16)
    launch = ops.get("attention_decode").build(rt, version, "bf16", B=B, C=C, NH=NH, maxT=maxT)
    poison(d_out, *launch.scratch.values())
    launch(d_out, rt.to_device(to_bf16(qkv)), d_kc, d_vc, rt.to_device(np.array([pos], np.int32)))
    got = from_bf16(d_out.get())
    assert np.isfinite(got).all(), "decode out: unwritten (NaN) elements"
    vmax = np.abs(inp[..., 2 * C:]).max()
    assert_close(got, out64[:, pos], atol=2.0 ** -12 * vmax, rtol=2.0 ** -7, name="decode out bf16")
    got_k, got_v = from_bf16(d_kc.get()), from_bf16(d_vc.get())
    kc[:, :, pos], vc[:, :, pos] = want_k, want_v
    assert np.array_equal(got_k, kc) and np.array_equal(got_v, vc), "append / cache written outside pos"


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,NH,maxT", [(2, 65, 96, 2, 128), (1, 1, 64, 1, 16), (3, 300, 768, 12, 1024)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_attention_kv_fill_gpu(rt, B, T, C, NH, maxT, dtype):
    """kv fill copies k, v of a forward's qkvr into positions 0..T-1 of the caches, exactly, and
    writes nothing past T-1 (poisoned caches keep their poison there)."""
    from llmc.bf16 import BF16, from_bf16, to_bf16
    rng = np.random.default_rng(T)
    hs = C // NH
    qkvr = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    dev = (lambda x: rt.to_device(to_bf16(x))) if dtype == "bf16" else rt.to_device  # noqa: E731
    host = from_bf16 if dtype == "bf16" else (lambda x: x)  # noqa: E731
    d_kc = rt.empty((B, NH, maxT, hs), BF16 if dtype == "bf16" else np.float32)
    d_vc = rt.empty((B, NH, maxT, hs), BF16 if dtype == "bf16" else np.float32)
    poison(d_kc, d_vc)
    ops.get("attention_kv_fill").build(rt, 1, dtype, B=B, C=C, NH=NH, maxT=maxT, T=T)(d_kc, d_vc, dev(qkvr))
    want = host(to_bf16(qkvr)) if dtype == "bf16" else qkvr
    _, k, v = want.reshape(3, B, NH, T, hs)
    got_k, got_v = host(d_kc.get()), host(d_vc.get())
    assert np.array_equal(got_k[:, :, :T], k) and np.array_equal(got_v[:, :, :T], v)
    assert np.isnan(got_k[:, :, T:]).all() and np.isnan(got_v[:, :, T:]).all()


def test_wgmma_tf32_builds_launch_in_order(monkeypatch):
    """attention 4's fp32 builds on the fake runtime (entry points, argtypes against the PTX, argument
    counts, shared memory within the device's): the forward permutes, transposes v, runs the TF32
    kernel; the backward with global transposes transposes k, q and dout, then the dq and dk/dv
    kernels, every call; with shared-memory transposes (the default) the two kernels alone."""
    monkeypatch.setenv("LLMC_TF32_PINGPONG", "0")  # the plain kernels; the _pp ones (the default) at the end
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setattr(A, "_bf16_tensor_map", lambda *a, **k: bytes(128))
    rt = FakeRuntime()
    B, T, C, NH = 2, 200, 128, 2
    fwd = ops.get("attention_forward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH)
    bwd = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, smem_transpose=False)
    inp, qkvr, out, dout, dinp = (rt.empty(s) for s in ((B, T, 3 * C), (B, T, 3 * C), (B, T, C), (B, T, C), (B, T, 3 * C)))
    lse = rt.empty((B, NH, T))
    for _ in range(2):
        fwd(out, qkvr, lse, inp)
        bwd(dinp, dout, qkvr, lse, out)
    names = [L.func for L in rt.launches]
    one = ["permute_kernel2", "attention_vt_kernel", "flash_attention_forward_kernel4_tf32",
           "attention_vt_kernel", "attention_vt_kernel", "attention_vt_kernel",
           "flash_attention_backward_dq_kernel4_tf32", "flash_attention_backward_dkdv_kernel4_tf32"]
    assert names == one + one, names
    assert sum(1 for L in rt.launches if L.func == "flash_attention_forward_kernel4_tf32") == 2
    assert set(bwd.scratch) == {"D", "kt", "qt", "dot"} and bwd.scratch["kt"].shape == (B * NH, 64, 200)
    # the permuted layout: v, k, q transposed from qkvr's parts (head stride T*64, row 64, batch NH*T*64)
    vts = [L.args for L in rt.launches[:8] if L.func == "attention_vt_kernel"]
    part = B * NH * T * 64 * 4
    assert [(a[1] - qkvr.ptr, a[5], a[6], int(a[7])) for a in vts[:3]] == \
        [(2 * part, T * 64, 64, NH * T * 64), (part, T * 64, 64, NH * T * 64), (0, T * 64, 64, NH * T * 64)]
    assert (vts[3][1], vts[3][5], vts[3][6], int(vts[3][7])) == (dout.ptr, 64, C, T * C)
    # in place: no permute, q, k, v read from inp (B,T,3C) by the _btc kernels, transposed from its columns
    rt.launches.clear()
    fwd = ops.get("attention_forward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    bwd = A.build_flash_attention_backward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, smem_transpose=False)
    fwd(out, inp, lse, inp)
    bwd(dinp, dout, inp, lse, out)
    assert [L.func for L in rt.launches] == [
        "attention_vt_kernel", "flash_attention_forward_kernel4_tf32_btc", "attention_vt_kernel", "attention_vt_kernel",
        "attention_vt_kernel", "flash_attention_backward_dq_kernel4_tf32_btc", "flash_attention_backward_dkdv_kernel4_tf32_btc"]
    vts = [L.args for L in rt.launches if L.func == "attention_vt_kernel"]
    assert [(a[1] - inp.ptr, a[5], a[6], int(a[7])) for a in vts[:3]] == \
        [(2 * C * 4, 64, 3 * C, T * 3 * C), (C * 4, 64, 3 * C, T * 3 * C), (0, 64, 3 * C, T * 3 * C)]
    with pytest.raises(LLMCError, match="qkvr must be inp"):
        fwd(out, qkvr, lse, inp)
    # the variant's form: global transposes while kt, qt, dot fit in the L2 (d12 B=4: 37.7 MB), else in
    # shared memory (B=16), unless the DRAM is at least TF32_GLOBAL_TRANSPOSE_BPS fast (the H200: global
    # at any size; a device without the figure takes the H100's rule); LLMC_TF32_SMEM_TRANSPOSE=1|0
    # forces one; the declared scratch follows
    assert not A._tf32_smem_transpose(4, 1024, 12, 3) and A._tf32_smem_transpose(16, 1024, 12, 3)
    assert not A._tf32_smem_transpose(8, 1024, 12, 1) and A._tf32_smem_transpose(16, 1024, 12, 1)  # the forward's vt
    assert A._tf32_smem_transpose(16, 1024, 12, 3, rt) and rt.dram_peak < A.TF32_GLOBAL_TRANSPOSE_BPS  # (fake H100)
    h200 = type("h200", (), {"dram_peak": 4_800_000_000_000})()
    for copies in (1, 3):
        assert not A._tf32_smem_transpose(16, 1024, 12, copies, h200)
        assert not A._tf32_smem_transpose(64, 1024, 12, copies, h200)
    assert A._tf32_smem_transpose(16, 1024, 12, 3, type("old", (), {"dram_peak": None})())
    for num, copies in (("attention_forward", 1), ("attention_backward", 3)):
        v = ops.get(num).variants[4]
        assert (v.scratch_bytes(B=16, T=1024, C=768, NH=12, dtype="fp32", rt=h200)
                - v.scratch_bytes(B=16, T=1024, C=768, NH=12, dtype="fp32")) == copies * A._tf32_transposed_bytes(16, 1024, 12)
    monkeypatch.setenv("LLMC_TF32_SMEM_TRANSPOSE", "1")
    assert A._tf32_smem_transpose(4, 1024, 12, 3, h200)
    monkeypatch.delenv("LLMC_TF32_SMEM_TRANSPOSE")
    bwd = ops.get("attention_backward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH)
    assert set(bwd.scratch) == {"D", "kt", "qt", "dot"}
    assert sum(a.nbytes for a in bwd.scratch.values()) == \
        ops.get("attention_backward").variants[4].scratch_bytes(B=B, T=T, C=C, NH=NH, dtype="fp32")
    monkeypatch.setenv("LLMC_TF32_SMEM_TRANSPOSE", "0")
    assert not A._tf32_smem_transpose(16, 1024, 12, 3)
    monkeypatch.setenv("LLMC_TF32_SMEM_TRANSPOSE", "1")
    assert ops.get("attention_backward").variants[4].scratch_bytes(B=B, T=T, C=C, NH=NH, dtype="fp32") == 4 * B * NH * T
    # shared-memory transposes (_smt kernels): no transposed scratch, no vt launches
    for in_place, q in ((False, qkvr), (True, inp)):
        rt.launches.clear()
        bwd = ops.get("attention_backward").build(rt, 4, "fp32", B=B, T=T, C=C, NH=NH, qkv_in_place=in_place)
        assert set(bwd.scratch) == {"D"}
        bwd(dinp, dout, q, lse, out)
        sfx = "_btc_smt" if in_place else "_smt"
        assert [L.func for L in rt.launches] == ["flash_attention_backward_dq_kernel4_tf32" + sfx,
                                                 "flash_attention_backward_dkdv_kernel4_tf32" + sfx]
        assert all(L.smem <= rt.max_smem_optin for L in rt.launches)
    # the forward with v transposed in shared memory: no vt scratch nor pass, the _smt kernel
    for in_place, q in ((False, qkvr), (True, inp)):
        rt.launches.clear()
        fwd = A.build_flash_attention_forward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=in_place,
                                                         smem_transpose=True)
        assert fwd.scratch == {}
        fwd(out, q, lse, inp)
        assert [L.func for L in rt.launches] == ([] if in_place else ["permute_kernel2"]) + [
            "flash_attention_forward_kernel4_tf32" + ("_btc" if in_place else "") + "_smt"]
        assert rt.launches[-1].smem == A.WGMMA_TF32_FWD_SMEM_SMT <= rt.max_smem_optin
    # in place, taking turns: the _pp kernels (the default: LLMC_TF32_PINGPONG unset or 1; persistent
    # unless LLMC_TF32_PERSISTENT=0); not without in place (no _pp kernels there)
    monkeypatch.setenv("LLMC_TF32_PERSISTENT", "0")
    for env in (None, "1"):
        if env is None:
            monkeypatch.delenv("LLMC_TF32_PINGPONG")
        else:
            monkeypatch.setenv("LLMC_TF32_PINGPONG", env)
        for smt_, name in ((False, "_btc_pp"), (True, "_btc_smt_pp")):
            rt.launches.clear()
            fwd = A.build_flash_attention_forward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True,
                                                             smem_transpose=smt_)
            fwd(out, inp, lse, inp)
            assert rt.launches[-1].func == "flash_attention_forward_kernel4_tf32" + name
    rt.launches.clear()
    A.build_flash_attention_forward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, smem_transpose=True)(out, qkvr, lse, inp)
    assert rt.launches[-1].func == "flash_attention_forward_kernel4_tf32_smt"
    # persistent (in place with pingpong only; the default): one CTA per SM, at most one per (head,
    # query block) item
    monkeypatch.delenv("LLMC_TF32_PERSISTENT")
    for smt_ in (False, True):
        for BB, want in ((B, B * NH * -(-T // 128)), (40, rt.sm_count)):  # 8 items; 160 > 132 SMs
            rt.launches.clear()
            A.build_flash_attention_forward_wgmma_tf32(rt, B=BB, T=T, C=C, NH=NH, qkv_in_place=True,
                                                       smem_transpose=smt_)(out, inp, lse, inp)
            assert rt.launches[-1].func == "flash_attention_forward_kernel4_tf32_btc" + ("_smt" if smt_ else "") + \
                "_pp_persistent"
            assert rt.launches[-1].grid == (want, 1, 1)
    monkeypatch.setenv("LLMC_TF32_PINGPONG", "0")  # no persistent kernel without the turns: the plain one
    rt.launches.clear()
    A.build_flash_attention_forward_wgmma_tf32(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True, smem_transpose=False,
                                               persistent=True)(out, inp, lse, inp)
    assert rt.launches[-1].func == "flash_attention_forward_kernel4_tf32_btc"
    monkeypatch.delenv("LLMC_TF32_PINGPONG")


def test_backward4_bf16_ring_depth_is_a_build_parameter(monkeypatch):
    """LLMC_ATT_BWD_STAGES builds the bf16 backward's kernels with that ring depth (a -D of the module;
    the default passes none, so its cubin is the plain one) and sizes their shared memory to match the
    .cu's DQ_SMEM / DKDV_SMEM; anything but 2-4 is refused in one line."""
    import re
    from llmc.runtime import CUDA_DIR
    from tests.fake_runtime import FakeRuntime
    src = (CUDA_DIR / "attention_wgmma.cu").read_text()
    assert int(re.search(r"#define LLMC_ATT_BWD_STAGES (\d+)", src).group(1)) == A.WGMMA_BWD_STAGES
    assert "constexpr int DQ_SMEM = 1024 + 2 * Q_BYTES + BF_BWD_STAGES * STAGE_BYTES + 8 * (1 + 2 * BF_BWD_STAGES);" in src
    assert (A.WGMMA_DQ_SMEM, A.WGMMA_DKDV_SMEM) == A.wgmma_bwd_smem(2)
    for env, want in ((None, {}), ("2", {}), ("3", {"LLMC_ATT_BWD_STAGES": 3})):
        if env is None:
            monkeypatch.delenv("LLMC_ATT_BWD_STAGES", raising=False)
        else:
            monkeypatch.setenv("LLMC_ATT_BWD_STAGES", env)
        rt = FakeRuntime(heap_bytes=1 << 16)
        seen = []
        real = rt.kernel
        monkeypatch.setattr(rt, "kernel", lambda *a, defines=None, **k: seen.append(defines) or real(*a, defines=defines, **k))
        monkeypatch.setattr(A, "qkv_tensor_map", lambda *a: bytes(128))
        monkeypatch.setattr(A, "btc_tensor_map", lambda *a: bytes(128))
        bwd = A.build_flash_attention_backward_wgmma(rt, B=2, T=200, C=128, NH=2, qkv_in_place=True)
        assert seen == [want, want]
        bwd(0x1000, 0x2000, 0x3000, 0x4000, 0x5000)
        dq, dkdv = A.wgmma_bwd_smem(int(env or 2))
        assert [L.smem for L in rt.launches[-2:]] == [dq, dkdv]
    monkeypatch.setenv("LLMC_ATT_BWD_STAGES", "9")
    with pytest.raises(LLMCError, match="LLMC_ATT_BWD_STAGES"):
        A.build_flash_attention_backward_wgmma(FakeRuntime(), B=2, T=200, C=128, NH=2, qkv_in_place=True)
