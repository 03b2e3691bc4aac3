"""Matmul family: numpy references vs torch autograd (CPU), shape checks (CPU), every GPU variant
against the float64 reference (-m gpu). The GEMM engines the TF32 variants run on have their own
tests: tests/test_gemm.py (planner, fallbacks, every engine/layout) and tests/test_gemm_layout.py
(engine 4's index formulas).

    python -m pytest tests/test_matmul.py -q          # CPU part
    python -m pytest tests/test_matmul.py -q -m gpu   # GPU part (needs a GPU and PyCUDA)

Tolerances. fp32 SIMT variants: rtol = 1e-4, atol = 1e-4 * max(1, rms(ref)) (fp32 sums over K <= 4096
terms stay ~1e-6 relative to the terms' size, and outputs near 0 need the absolute part). TF32 variants: inputs are rounded to 10 mantissa bits, so each output carries
~2^-11 * sqrt(K) relative noise: we require ||got - ref|| / ||ref|| < 2e-3 norm-wise and elementwise
|err| <= 1e-2 * rms(ref) + 1e-2 * |ref| (about 25 standard deviations of the TF32 error: no flakes,
but an indexing bug, which is O(1), always fails). Small-integer inputs (|x| <= 8, exact in fp32
and in tf32, all partial sums < 2^24) must match exactly in every variant, whatever the order.
"""
import numpy as np
import pytest

from llmc import ops
from llmc.errors import LLMCError, VariantRefused
from llmc.ops import matmul as mm

TF32_FWD = {5, 6, 7, 9}
TF32_BWD = {2, 3, 4, 5}


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def ints(rng, *shape, lim=8, scale=None):
    return rng.integers(-lim, lim + 1, size=shape).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# CPU: references against torch autograd in float64


def test_forward_backward_refs_match_torch(rng):
    torch = pytest.importorskip("torch")
    N, C, OC = 37, 48, 80
    inp, weight, bias = rng.standard_normal((N, C)), rng.standard_normal((OC, C)), rng.standard_normal(OC)
    dout = rng.standard_normal((N, OC))
    ti, tw, tb = (torch.tensor(x, requires_grad=True) for x in (inp, weight, bias))
    tout = torch.nn.functional.linear(ti, tw, tb)
    tout.backward(torch.tensor(dout))
    out = mm.matmul_forward_ref(inp, weight, bias)
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mm.matmul_forward_ref(inp, weight), inp @ weight.T, rtol=1e-12)
    dinp, dweight, dbias = mm.matmul_backward_ref(dout, inp, weight)
    np.testing.assert_allclose(dinp, ti.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dweight, tw.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dbias, tb.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_cpu_launchers_overwrite_and_accumulate(rng):
    N, C, OC = 9, 12, 16
    inp, weight, bias, dout = rnd(rng, N, C), rnd(rng, OC, C), rnd(rng, OC), rnd(rng, N, OC)
    out = np.full((N, OC), np.nan, np.float32)
    ops.get("matmul_forward").cpu(N=N, C=C, OC=OC, has_bias=True)(out, inp, weight, bias)
    np.testing.assert_allclose(out, inp @ weight.T + bias, rtol=1e-6)
    assert out.dtype == np.float32
    dinp = np.full((N, C), np.nan, np.float32)
    dw0 = rnd(rng, OC, C)
    dweight = dw0.copy()
    ops.get("matmul_backward").cpu(N=N, C=C, OC=OC)(dinp, dweight, dout, inp, weight)
    np.testing.assert_allclose(dinp, dout @ weight, rtol=1e-5)
    np.testing.assert_allclose(dweight, dw0 + dout.T @ inp, rtol=1e-5, atol=1e-6)
    db0 = rnd(rng, OC)
    dbias = db0.copy()
    ops.get("matmul_backward_bias").cpu(N=N, OC=OC)(dbias, dout)
    np.testing.assert_allclose(dbias, db0 + dout.sum(0), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# CPU: shape checks, variant table, the GEMM planner and builder logic (a fake runtime)

ODD_FWD = [dict(N=1, C=80, OC=96, has_bias=True), dict(N=65, C=1600, OC=2304, has_bias=False),
           dict(N=4 * 1024, C=768, OC=50304, has_bias=False), dict(N=7, C=81, OC=30, has_bias=True),
           dict(N=5, C=96, OC=1, has_bias=True)]


@pytest.mark.parametrize("shape", ODD_FWD, ids=str)
def test_forward_checks(shape):
    spec = ops.get("matmul_forward")
    for n, v in spec.variants.items():
        reason = v.refuse_reason(**shape)
        if n in (1, 2, 3):
            assert reason is None
        elif n == 4:
            assert (reason is None) == (shape["C"] % 4 == 0 and shape["OC"] % 4 == 0)
        elif n == 5:
            assert (reason is None) == (shape["C"] % 4 == 0)
        elif n in (6, 7):  # engines 2 and 4 need ld % 4 == 0
            assert (reason is None) == (shape["C"] % 4 == 0 and shape["OC"] % 4 == 0)
        elif n == 8:  # the decode GEMV: at most 8 rows, float4 along C
            assert (reason is None) == (shape["N"] <= 8 and shape["C"] % 4 == 0)
        if reason:
            with pytest.raises(VariantRefused, match=f"matmul_forward variant {n}"):
                spec.build(None, n, **shape)


def test_backward_checks():
    spec = ops.get("matmul_backward")
    assert spec.variant(1).refuse_reason(N=65, C=81, OC=7) is None
    assert spec.variant(2).refuse_reason(N=65, C=81, OC=7) is not None
    assert spec.variant(2).refuse_reason(N=65, C=768, OC=2304) is None
    assert spec.variant(3).refuse_reason(N=65, C=81, OC=7) is not None
    assert spec.variant(3).refuse_reason(N=65, C=768, OC=2304) is None
    bias = ops.get("matmul_backward_bias")
    assert [bias.variant(n).refuse_reason(N=1, OC=7) is None for n in (1, 2, 3, 4)] == [True, True, False, False]
    assert all(v.refuse_reason(N=1, OC=768) is None for v in bias.variants.values())


def test_variant_table():
    for name in ("matmul_forward", "matmul_backward", "matmul_backward_bias"):
        spec = ops.get(name)
        assert spec.default in spec.variants
        assert all(v.description and "\n" not in v.description for v in spec.variants.values())
        with pytest.raises(LLMCError, match="has no variant 99"):
            spec.variant(99)
    from llmc.ops.gemm import ENGINES
    assert set(ENGINES) == {1, 2, 3, 4}
    # the engine each variant declares (the composite attention runs its GEMMs on it; engine 5 can't batch)
    from llmc.ops.attention import gemm_engine
    assert [gemm_engine("matmul_forward", v) for v in range(1, 10)] == [1, 1, 1, 1, 2, 2, 4, 1, 4]
    assert set(spec_fwd := ops.get("matmul_forward").variants) == set(range(1, 10)), spec_fwd
    assert [gemm_engine("matmul_backward", v) for v in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 4]
    assert ops.get("matmul_forward").default == 9 and ops.get("matmul_backward").default == 5


# ----------------------------------------------------------------------------------------------
# GPU


from llmc.testing import check_matmul as check  # noqa: E402


FWD_SHAPES = [dict(N=4 * 65, C=768, OC=2304, has_bias=True), dict(N=1, C=80, OC=96, has_bias=True),
              dict(N=130, C=96, OC=80, has_bias=False), dict(N=65, C=1600, OC=200, has_bias=True),
              dict(N=4 * 1024, C=768, OC=768, has_bias=True), dict(N=33, C=81, OC=30, has_bias=True),
              # decode shapes (N = batch <= 8: the GEMV variant 8 takes them)
              dict(N=8, C=768, OC=2304, has_bias=True), dict(N=3, C=3072, OC=768, has_bias=True),
              dict(N=1, C=768, OC=50304, has_bias=False), dict(N=5, C=84, OC=7, has_bias=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", FWD_SHAPES, ids=str)
@pytest.mark.parametrize("integers", [False, True], ids=["random", "ints"])
def test_matmul_forward_gpu(rt, rng, shape, integers):
    from llmc.testing import poison
    N, C, OC, has_bias = shape["N"], shape["C"], shape["OC"], shape["has_bias"]
    if integers:
        inp, weight, bias = ints(rng, N, C), ints(rng, OC, C), ints(rng, OC)
    else:
        inp, weight, bias = rnd(rng, N, C), rnd(rng, OC, C, scale=C ** -0.5), rnd(rng, OC)
    ref = mm.matmul_forward_ref(inp.astype(np.float64), weight.astype(np.float64),
                                bias.astype(np.float64) if has_bias else None)
    d_inp, d_w, d_b = rt.to_device(inp), rt.to_device(weight), rt.to_device(bias)
    d_out = rt.empty((N, OC))
    spec = ops.get("matmul_forward")
    for n, v in spec.variants.items():
        if v.refuse_reason(**shape):
            continue
        launch = spec.build(rt, n, **shape)
        poison(d_out)
        launch(d_out, d_inp, d_w, d_b if has_bias else None)
        check(d_out.get(), ref, n in TF32_FWD, f"matmul_forward {n} {shape}", exact=integers)


BWD_SHAPES = [dict(N=4 * 65, C=768, OC=2304), dict(N=1, C=80, OC=96), dict(N=130, C=96, OC=80),
              dict(N=65, C=1600, OC=200), dict(N=4 * 1024, C=768, OC=3072), dict(N=33, C=81, OC=30)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BWD_SHAPES, ids=str)
@pytest.mark.parametrize("integers", [False, True], ids=["random", "ints"])
def test_matmul_backward_gpu(rt, rng, shape, integers):
    from llmc.testing import poison
    N, C, OC = shape["N"], shape["C"], shape["OC"]
    mk = ints if integers else rnd
    dout, inp, weight, dw0 = mk(rng, N, OC), mk(rng, N, C), mk(rng, OC, C), mk(rng, OC, C)
    dinp_ref, dw_ref, _ = mm.matmul_backward_ref(*(x.astype(np.float64) for x in (dout, inp, weight)))
    dw_ref = dw_ref + dw0
    d_dout, d_inp, d_w = rt.to_device(dout), rt.to_device(inp), rt.to_device(weight)
    d_dinp, d_dw = rt.empty((N, C)), rt.empty((OC, C))
    spec = ops.get("matmul_backward")
    for n, v in spec.variants.items():
        if v.refuse_reason(**shape):
            continue
        launch = spec.build(rt, n, **shape)
        poison(d_dinp)
        d_dw.set(dw0)
        launch(d_dinp, d_dw, d_dout, d_inp, d_w)
        check(d_dinp.get(), dinp_ref, n in TF32_BWD, f"matmul_backward {n} dinp {shape}", exact=integers)
        check(d_dw.get(), dw_ref, n in TF32_BWD, f"matmul_backward {n} dweight {shape}", exact=integers)


@pytest.mark.gpu
@pytest.mark.parametrize("N,OC", [(4 * 1024, 768), (1, 96), (4 * 65, 2304), (65, 1600), (7, 1)])
def test_matmul_backward_bias_gpu(rt, rng, N, OC):
    from llmc.testing import assert_close
    dout, db0 = rnd(rng, N, OC), rnd(rng, OC)
    ref = db0.astype(np.float64) + dout.astype(np.float64).sum(0)
    d_dout, d_db = rt.to_device(dout), rt.empty((OC,))
    spec = ops.get("matmul_backward_bias")
    for n, v in spec.variants.items():
        if v.refuse_reason(N=N, OC=OC):
            continue
        launch = spec.build(rt, n, N=N, OC=OC)
        d_db.set(db0)
        launch(d_db, d_dout)
        assert_close(d_db.get(), ref, atol=1e-4 * np.sqrt(N), rtol=1e-5, name=f"matmul_backward_bias {n}")
        if n >= 2:  # deterministic: the same bits twice
            first = d_db.get()
            d_db.set(db0)
            launch(d_db, d_dout)
            assert np.array_equal(first, d_db.get())


# (M, N, K, batch, padded leading dims, extra builder kwargs)
@pytest.mark.gpu
@pytest.mark.parametrize("variant,engine", [(6, 2), (7, 4)])
def test_forward_variant_runs_on_its_engine(rt, variant, engine):
    built = ops.get("matmul_forward").build(rt, variant, N=256, C=64, OC=128, has_bias=True)
    assert built.plan[0] == engine == ops.get("matmul_forward").variant(variant).engine


@pytest.mark.gpu
@pytest.mark.parametrize("N,C,OC", [(1, 768, 3072), (3, 96, 40), (8, 768, 3072), (4, 84, 7)])
def test_gemv_gelu_gpu(rt, rng, N, C, OC):
    """The decoder's fc + GELU in one launch against float64 gelu(inp @ w^T + b), every element
    written (poisoned first)."""
    from llmc.ops.gelu import gelu_forward_ref
    from llmc.testing import assert_close, poison
    inp, weight, bias = rnd(rng, N, C), rnd(rng, OC, C, scale=C ** -0.5), rnd(rng, OC)
    ref = gelu_forward_ref(mm.matmul_forward_ref(inp.astype(np.float64), weight.astype(np.float64),
                                                 bias.astype(np.float64)))
    d_out = rt.empty((N, OC))
    poison(d_out)
    ops.get("matmul_forward").build(rt, 8, N=N, C=C, OC=OC, gelu=True)(d_out, rt.to_device(inp), rt.to_device(weight), rt.to_device(bias))
    assert_close(d_out.get(), ref, atol=1e-5, rtol=1e-4, name=f"gemv+gelu N={N}")


def test_gemv_gelu_refuses_what_the_gemv_refuses():
    spec = ops.get("matmul_forward")
    with pytest.raises(LLMCError, match="rows > 8"):
        spec.build(None, 8, N=9, C=768, OC=3072, gelu=True)
    with pytest.raises(LLMCError, match="C % 4"):
        spec.build(None, 8, N=2, C=81, OC=30, gelu=True)
    # only variant 8 has the GELU epilogue: every other refuses gelu=True, saying so
    for n in set(spec.variants) - {8}:
        assert "no gelu option" in spec.refuse_reason(n, N=2, C=768, OC=3072, gelu=True)
        assert spec.refuse_reason(n, N=2, C=768, OC=3072, gelu=False) is None


def test_gelu_option_on_the_numpy_backend(rng):
    from llmc.ops.gelu import gelu_forward_ref
    inp, weight, bias = rng.standard_normal((3, 8)), rng.standard_normal((5, 8)), rng.standard_normal(5)
    out = np.full((3, 5), np.nan)
    ops.get("matmul_forward").cpu(N=3, C=8, OC=5, gelu=True)(out, inp, weight, bias)
    assert np.array_equal(out, gelu_forward_ref(inp @ weight.T + bias))


def test_hopper_variants_refuse_other_gpus():
    # engine 5 (wgmma) exists only on sm_90: elsewhere the variants refuse, so a default falls back
    for name, num, shape in (("matmul_forward", 9, dict(N=64, C=64, OC=64, has_bias=True)),
                             ("matmul_backward", 4, dict(N=64, C=64, OC=64))):
        v = ops.get(name).variant(num)
        assert v.refuse_reason("sm_90", **shape) is None
        assert "sm_90" in v.refuse_reason("sm_80", **shape)
    assert "OC % 4" in ops.get("matmul_backward").variant(4).refuse_reason("sm_90", N=8, C=64, OC=66)


# ----------------------------------------------------------------------------------------------
# bf16 builds (--precision bf16): every variant that lists "bf16", against float64 on bf16-valued
# inputs, outputs poisoned (0xFFFF: a bf16 NaN), twice for bit-identical results. Tolerance:
# llmc.testing.bf16_close: elementwise 2^-8 |ref| (one rounding of the output, <= 2^-9, with room for a
# sum next to a rounding boundary) + 1e-3 rms(ref) (fp32 accumulation; outputs near 0), rel-norm < 4e-3.


def bf16_values(rng, *shape, scale=1.0):
    """(bf16 bits, their float64 values): the reference sees exactly what the kernel reads."""
    from llmc.bf16 import from_bf16, to_bf16
    bits = to_bf16(rng.standard_normal(shape) * scale)
    return bits, from_bf16(bits).astype(np.float64)


def bf16_variants(spec, rt, shape):
    return [n for n, v in spec.variants.items()
            if "bf16" in v.dtypes and not spec.refuse_reason(n, "bf16", rt.arch, **shape)]


def test_bf16_builds_of_the_defaults():
    """The defaults (and the decoder's GEMV) have bf16 builds, so a bf16 model needs no fallback; the
    bf16 checks ask for 16-byte rows of 8 bf16 where the fp32 ones ask for 4 floats."""
    for name in ("matmul_forward", "matmul_backward", "matmul_backward_bias"):
        spec = ops.get(name)
        assert "bf16" in spec.variant(spec.default).dtypes, name
    fwd = ops.get("matmul_forward")
    assert "bf16" in fwd.variant(8).dtypes
    assert fwd.refuse_reason(9, "fp32", "sm_90", N=4, C=84, OC=8, has_bias=True) is None
    assert "C % 8" in fwd.refuse_reason(9, "bf16", "sm_90", N=4, C=84, OC=8, has_bias=True)
    assert "C % 8" in fwd.refuse_reason(8, "bf16", "sm_90", N=4, C=84, OC=8, has_bias=True, gelu=True)
    assert "sm_90" in fwd.refuse_reason(9, "bf16", "sm_80", N=4, C=768, OC=768, has_bias=True)
    bwd = ops.get("matmul_backward")
    assert "OC % 8" in bwd.refuse_reason(5, "bf16", "sm_90", N=4, C=768, OC=20)
    assert "sm_90" in bwd.refuse_reason(5, "bf16", "sm_80", N=4, C=768, OC=768)
    assert "no bf16 kernels" in bwd.refuse_reason(4, "bf16", "sm_90", N=4, C=768, OC=768)
    bias = ops.get("matmul_backward_bias")
    assert "OC % 8" in bias.refuse_reason(4, "bf16", None, N=4, OC=20) and bias.refuse_reason(4, "fp32", None, N=4, OC=20) is None


BF16_FWD_SHAPES = FWD_SHAPES + [dict(N=33, C=88, OC=30, has_bias=True), dict(N=5, C=16, OC=1, has_bias=True),
                                dict(N=130, C=16, OC=7, has_bias=False), dict(N=3, C=88, OC=5, has_bias=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BF16_FWD_SHAPES, ids=str)
def test_matmul_forward_bf16_gpu(rt, rng, shape):
    from llmc.bf16 import BF16, from_bf16
    from llmc.testing import bf16_close, poison
    N, C, OC, has_bias = shape["N"], shape["C"], shape["OC"], shape["has_bias"]
    (inp, inp64), (w, w64), (b, b64) = bf16_values(rng, N, C), bf16_values(rng, OC, C, scale=C ** -0.5), bf16_values(rng, OC)
    ref = mm.matmul_forward_ref(inp64, w64, b64 if has_bias else None)
    d_inp, d_w, d_b = rt.to_device(inp), rt.to_device(w), rt.to_device(b)
    d_out = rt.empty((N, OC), BF16)
    spec = ops.get("matmul_forward")
    for n in bf16_variants(spec, rt, shape):
        launch = spec.build(rt, n, "bf16", **shape)
        outs = []
        for _ in range(2):
            poison(d_out)
            launch(d_out, d_inp, d_w, d_b if has_bias else None)
            outs.append(d_out.get())
        bf16_close(from_bf16(outs[0]), ref, f"matmul_forward {n} bf16 {shape}")
        assert np.array_equal(outs[0], outs[1]), f"matmul_forward {n} bf16: two runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("N,C,OC", [(1, 768, 3072), (3, 96, 40), (8, 768, 3072), (4, 88, 7)])
def test_gemv_gelu_bf16_gpu(rt, rng, N, C, OC):
    """The decoder's fc + GELU in bf16: GELU of the fp32 sum, rounded once."""
    from llmc.bf16 import BF16, from_bf16
    from llmc.ops.gelu import gelu_forward_ref
    from llmc.testing import bf16_close, poison
    (inp, inp64), (w, w64), (b, b64) = bf16_values(rng, N, C), bf16_values(rng, OC, C, scale=C ** -0.5), bf16_values(rng, OC)
    ref = gelu_forward_ref(mm.matmul_forward_ref(inp64, w64, b64))
    d_out = rt.empty((N, OC), BF16)
    poison(d_out)
    ops.get("matmul_forward").build(rt, 8, "bf16", N=N, C=C, OC=OC, gelu=True)(
        d_out, rt.to_device(inp), rt.to_device(w), rt.to_device(b))
    bf16_close(from_bf16(d_out.get()), ref, f"gemv+gelu bf16 N={N}")


BF16_BWD_SHAPES = BWD_SHAPES + [dict(N=7, C=8, OC=16), dict(N=4 * 1024, C=768, OC=768), dict(N=100, C=3072, OC=768),
                                dict(N=1, C=8, OC=8)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", BF16_BWD_SHAPES, ids=str)
def test_matmul_backward_bf16_gpu(rt, rng, shape):
    """dinp overwritten (poisoned first), dweight += from a nonzero bf16 gradient (read, added in fp32,
    rounded once), bit-identical over two runs."""
    from llmc.bf16 import BF16, from_bf16
    from llmc.testing import bf16_close, poison
    N, C, OC = shape["N"], shape["C"], shape["OC"]
    (dout, dout64), (inp, inp64), (w, w64), (dw0, dw064) = (bf16_values(rng, N, OC), bf16_values(rng, N, C),
                                                              bf16_values(rng, OC, C), bf16_values(rng, OC, C))
    dinp_ref, dw_ref, _ = mm.matmul_backward_ref(dout64, inp64, w64)
    dw_ref = dw_ref + dw064
    d_dout, d_inp, d_w = rt.to_device(dout), rt.to_device(inp), rt.to_device(w)
    d_dinp, d_dw = rt.empty((N, C), BF16), rt.empty((OC, C), BF16)
    spec = ops.get("matmul_backward")
    for n in bf16_variants(spec, rt, shape):
        launch = spec.build(rt, n, "bf16", **shape)
        got = []
        for _ in range(2):
            poison(d_dinp)
            d_dw.set(dw0)
            launch(d_dinp, d_dw, d_dout, d_inp, d_w)
            got.append((d_dinp.get(), d_dw.get()))
        bf16_close(from_bf16(got[0][0]), dinp_ref, f"matmul_backward {n} bf16 dinp {shape}")
        bf16_close(from_bf16(got[0][1]), dw_ref, f"matmul_backward {n} bf16 dweight {shape}")
        assert all(np.array_equal(a, b) for a, b in zip(got[0], got[1])), f"matmul_backward {n} bf16: runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("N,OC", [(4 * 1024, 768), (1, 96), (4 * 65, 2304), (65, 1600), (7, 8), (4 * 1024, 3072)])
def test_matmul_backward_bias_bf16_gpu(rt, rng, N, OC):
    """dbias bf16 += column sums of dout bf16 from a nonzero start: fp32 sums, one rounding, and the
    same bits twice (fixed-order reduction, no float atomics)."""
    from llmc.bf16 import from_bf16
    from llmc.testing import bf16_close
    (dout, dout64), (db0, db064) = bf16_values(rng, N, OC), bf16_values(rng, OC)
    ref = db064 + dout64.sum(0)
    d_dout = rt.to_device(dout)
    d_db = rt.to_device(db0)
    spec = ops.get("matmul_backward_bias")
    ran = 0
    for n in bf16_variants(spec, rt, dict(N=N, OC=OC)):
        launch = spec.build(rt, n, "bf16", N=N, OC=OC)
        got = []
        for _ in range(2):
            d_db.set(db0)
            launch(d_db, d_dout)
            got.append(d_db.get())
        bf16_close(from_bf16(got[0]), ref, f"matmul_backward_bias {n} bf16 N={N} OC={OC}")
        assert np.array_equal(got[0], got[1])
        ran += 1
    assert ran


def bias4_in_order(dout32, db0_32, rows_per_chunk):
    """Version 4's sums in its order, in float32: per chunk, row-lane ty adds rows ty, ty+8, ... one
    after the other, the 8 row-lanes are added in lane order into the chunk's partial; the finishing
    block's lane ty adds chunks ty, ty+8, ..., the lanes in order, then dbias + that total. The kernel's
    batched loads must not change this order: it matches bit for bit."""
    N, OC = dout32.shape
    nchunks = -(-N // rows_per_chunk)

    def lanes_in_order(rows_of_lane):
        lanes = []
        for ty in range(8):
            s = np.zeros(OC, np.float32)
            for r in rows_of_lane(ty):
                s = s + r
            lanes.append(s)
        total = lanes[0]
        for s in lanes[1:]:
            total = total + s
        return total

    partial = np.stack([lanes_in_order(lambda ty, c=c: (dout32[n] for n in range(c * rows_per_chunk + ty,
                                                                         min(N, (c + 1) * rows_per_chunk), 8)))
                        for c in range(nchunks)])
    total = lanes_in_order(lambda ty: (partial[k] for k in range(ty, nchunks, 8)))
    return db0_32 + total


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("min_rows", [32, 64, 128])
@pytest.mark.parametrize("N,OC", [(4 * 1024, 768), (4 * 65, 2304), (2 * 1024 + 3, 776), (7, 8), (1000, 264)])
def test_matmul_backward_bias4_order_gpu(rt, rng, dtype, min_rows, N, OC):
    """Version 4 at each chunk size the lab times: the rows' loads batched (BIAS4_ROWS_BATCH), the
    finishing block's partials batched (BIAS4_FINISH_BATCH), chunks whose rows and chunk counts leave
    a partial batch. The result is the in-order float32 sum bit for bit (bf16: then rounded once)."""
    from llmc.bf16 import from_bf16, to_bf16
    spec = ops.get("matmul_backward_bias")
    if dtype == "bf16":
        (dout, _), (db0, _) = bf16_values(rng, N, OC), bf16_values(rng, OC)
        dout32, db32 = from_bf16(dout).astype(np.float32), from_bf16(db0).astype(np.float32)
    else:
        dout, db0 = rnd(rng, N, OC), rnd(rng, OC)
        dout32, db32 = dout, db0
    if spec.refuse_reason(4, dtype, rt.arch, N=N, OC=OC):
        pytest.skip(spec.refuse_reason(4, dtype, rt.arch, N=N, OC=OC))
    _, _, rows = mm._bias_chunks(rt, N, OC, 256 if dtype == "bf16" else 128, min_rows)
    want = bias4_in_order(dout32, db32, rows)
    if dtype == "bf16":
        want = to_bf16(want)
    d_dout, d_db = rt.to_device(dout), rt.to_device(db0)
    launch = spec.build(rt, 4, dtype, N=N, OC=OC, min_rows=min_rows)
    for _ in range(2):  # twice: the finishing block resets its counter
        d_db.set(db0)
        launch(d_db, d_dout)
        got = d_db.get()
        assert np.array_equal(got.view(np.uint16 if dtype == "bf16" else np.uint32),
                              want.view(np.uint16 if dtype == "bf16" else np.uint32)), \
            f"matmul_backward_bias 4 {dtype} min_rows={min_rows} N={N} OC={OC}: not the in-order sum"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("N,OC", [(1, 96), (65, 1600), (4 * 65, 2304), (7, 8), (2 * 1024 + 3, 776)])
def test_matmul_backward_bias5_both_widths_gpu(rt, rng, dtype, N, OC):
    """Version 5 (clusters) at each of its widths (8 column lanes a block, the default, and 4): OC not a
    multiple of a block's columns (the last slice partly empty), N below the cluster's 8 blocks (ranks
    with no rows) and not a multiple of 8. From a nonzero dbias; the same
    bits twice (the cluster's sums are added in rank order)."""
    from llmc.bf16 import from_bf16
    from llmc.testing import assert_close, bf16_close
    spec = ops.get("matmul_backward_bias")
    if spec.refuse_reason(5, dtype, rt.arch, N=N, OC=OC):
        pytest.skip(spec.refuse_reason(5, dtype, rt.arch, N=N, OC=OC))
    if dtype == "bf16":
        (dout, dout64), (db0, db064) = bf16_values(rng, N, OC), bf16_values(rng, OC)
    else:
        dout, db0 = rnd(rng, N, OC), rnd(rng, OC)
        dout64, db064 = dout.astype(np.float64), db0.astype(np.float64)
    ref = db064 + dout64.sum(0)
    d_dout, d_db = rt.to_device(dout), rt.to_device(db0)
    for lanes in (4, 8):
        launch = spec.build(rt, 5, dtype, N=N, OC=OC, lanes=lanes)
        got = []
        for _ in range(2):
            d_db.set(db0)
            launch(d_db, d_dout)
            got.append(d_db.get())
        name = f"matmul_backward_bias 5 {dtype} lanes={lanes} N={N} OC={OC}"
        if dtype == "bf16":
            bf16_close(from_bf16(got[0]), ref, name)
        else:
            assert_close(got[0], ref, atol=1e-4 * np.sqrt(N), rtol=1e-5, name=name)
        assert np.array_equal(got[0], got[1]), name


def test_matmul_backward_bias5_needs_hopper_and_16_byte_rows():
    spec = ops.get("matmul_backward_bias")
    assert spec.refuse_reason(5, "fp32", "sm_80", N=64, OC=768) is not None
    assert spec.refuse_reason(5, "bf16", "sm_90", N=64, OC=768) is None
    assert spec.refuse_reason(5, "bf16", "sm_90", N=64, OC=772) is not None   # 8 bf16 a load
    assert spec.refuse_reason(5, "fp32", "sm_90", N=64, OC=772) is None       # 4 floats a load


# ----------------------------------------------------------------------------------------------
# the fc layer's fused form (gelu_pre=True): out = gelu(pre), pre = inp @ weight^T + bias, both written


def test_gelu_pre_only_variant_9_takes_it():
    """Variant 9 (engine 5) offers gelu_pre in both precisions; every other variant refuses it, saying
    so, so the model falls back to the plain op + gelu_forward (tests/test_fused_gelu.py)."""
    spec = ops.get("matmul_forward")
    shape = dict(N=64, C=64, OC=256, has_bias=True)
    for dt in ("fp32", "bf16"):
        assert spec.refuse_reason(9, dt, "sm_90", **shape, gelu_pre=True) is None
        assert "sm_90" in spec.refuse_reason(9, dt, "sm_80", **shape, gelu_pre=True)
    assert "C % 8" in spec.refuse_reason(9, "bf16", "sm_90", N=64, C=60, OC=256, has_bias=True, gelu_pre=True)
    for n in set(spec.variants) - {9}:
        assert "no gelu_pre option" in spec.refuse_reason(n, "fp32", "sm_90", **shape, gelu_pre=True)
    assert "no gelu option" in spec.refuse_reason(9, "fp32", "sm_90", **shape, gelu=True)  # the GEMV's form


def test_gelu_pre_on_the_numpy_backend(rng):
    """The cpu form is the plain reference into pre, then gelu_forward's reference on pre: the unfused
    pair's bits (float32), whatever views the model passes."""
    from llmc.ops.gelu import gelu_forward_cpu
    inp, weight, bias = rnd(rng, 2, 3, 8), rnd(rng, 12, 8), rnd(rng, 12)
    out, pre = np.full((2, 3, 12), np.nan, np.float32), np.full((2, 3, 12), np.nan, np.float32)
    ops.get("matmul_forward").cpu(N=6, C=8, OC=12, gelu_pre=True)(out, pre, inp, weight, bias)
    pre2, out2 = np.empty_like(pre), np.empty_like(out)
    ops.get("matmul_forward").cpu(N=6, C=8, OC=12)(pre2, inp, weight, bias)
    gelu_forward_cpu(N=72)(out2, pre2)
    assert np.array_equal(pre, pre2) and np.array_equal(out, out2)


def test_gelu_pre_cost_counts_the_second_output():
    spec = ops.get("matmul_forward")
    f0, b0 = spec.cost(N=4096, C=768, OC=3072)
    f1, b1 = spec.cost(N=4096, C=768, OC=3072, gelu_pre=True)
    assert f1 == f0 and b1 == b0 + 4 * 4096 * 3072


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("N,C,OC", [(200, 72, 100), (4096, 768, 3072), (7, 16, 3072)])
def test_gelu_pre_gpu_equals_the_plain_variant_and_gelu_forward(rt, rng, dtype, N, C, OC):
    """matmul_forward 9 with gelu_pre: both outputs poisoned first, then bit for bit the plain build of
    9 followed by gelu_forward's default build in the same precision."""
    if rt.arch != "sm_90":
        pytest.skip("variant 9 needs sm_90a")
    from llmc.bf16 import BF16, to_bf16
    from llmc.testing import poison
    bf = dtype == "bf16"
    up = to_bf16 if bf else (lambda a: a)
    inp, weight, bias = (rt.to_device(up(rnd(rng, N, C))), rt.to_device(up(rnd(rng, OC, C, scale=C ** -0.5))),
                         rt.to_device(up(rnd(rng, OC))))
    out, pre, out2, pre2 = (rt.empty((N, OC), BF16 if bf else np.float32) for _ in range(4))
    poison(out, pre, out2, pre2)
    spec = ops.get("matmul_forward")
    spec.build(rt, 9, dtype, N=N, C=C, OC=OC, has_bias=True, gelu_pre=True)(out, pre, inp, weight, bias)
    spec.build(rt, 9, dtype, N=N, C=C, OC=OC, has_bias=True)(pre2, inp, weight, bias)
    g = ops.get("gelu_forward")
    g.build(rt, g.default_for(dtype), dtype, N=N * OC)(out2, pre2)
    assert np.array_equal(pre.get(), pre2.get()) and np.array_equal(out.get(), out2.get())
