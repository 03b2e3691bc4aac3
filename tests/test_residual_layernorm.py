"""Fused residual + layernorm forward: reference vs torch (float64), cpu launcher, refusals; with
-m gpu, every variant against the reference.

    python -m pytest tests/test_residual_layernorm.py -q
    python -m pytest -m gpu tests/test_residual_layernorm.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import VariantRefused
from llmc.ops.layernorm import layernorm_forward_ref
from llmc.ops.residual_layernorm import residual_layernorm_forward_ref
from llmc.testing import assert_close, poison

SPEC = ops.get("residual_layernorm_forward")


def inputs(rng, N, C, dtype=np.float64):
    a = rng.standard_normal((N, C)) + rng.standard_normal((N, 1))
    b = rng.standard_normal((N, C)) * rng.uniform(0.5, 2.0, (N, 1))
    w = 1.0 + 0.2 * rng.standard_normal(C)
    bias = 0.2 * rng.standard_normal(C)
    return [x.astype(dtype) for x in (a, b, w, bias)]


def test_reference_matches_torch(rng):
    torch = pytest.importorskip("torch")
    N, C = 9, 40
    a, b, w, bias = inputs(rng, N, C)
    r, out, mean, rstd = residual_layernorm_forward_ref(a, b, w, bias)
    tr = torch.tensor(a) + torch.tensor(b)
    tout = torch.nn.functional.layer_norm(tr, (C,), torch.tensor(w), torch.tensor(bias), eps=1e-5)
    np.testing.assert_array_equal(r, tr.numpy())
    np.testing.assert_allclose(out, tout.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mean, tr.mean(-1).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rstd, (1 / torch.sqrt(tr.var(-1, unbiased=False) + 1e-5)).numpy(), rtol=1e-12)


def test_cpu_launcher(rng):
    N, C = 6, 16
    a, b, w, bias = inputs(rng, N, C, np.float32)
    outs = [np.full(s, np.nan, np.float32) for s in ((N, C), (N, C), N, N)]
    SPEC.cpu(N=N, C=C)(*outs, a, b, w, bias)
    for got, want in zip(outs, residual_layernorm_forward_ref(a, b, w, bias)):
        np.testing.assert_array_equal(got, want)


def test_float4_variant_refuses_odd_C():
    reason = SPEC.variants[3].refuse_reason(N=4, C=66)
    assert reason and "multiple of 4" in reason
    with pytest.raises(VariantRefused, match="--residual-layernorm-kernel"):
        SPEC.build(None, 3, N=4, C=66)
    for n in (1, 2):
        assert SPEC.variants[n].refuse_reason(N=4, C=66) is None
    assert SPEC.default in SPEC.variants and len(SPEC.variants) >= 2


def test_bf16_builds():
    assert "bf16" in SPEC.variants[SPEC.default].dtypes and "bf16" in SPEC.variants[2].dtypes  # 2: any C


SHAPES = [(1, 768), (65, 80), (130, 96), (257, 768), (64, 1600), (33, 66)]


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES)
@pytest.mark.parametrize("number", sorted(SPEC.variants))
def test_forward_gpu(rt, rng, number, N, C):
    if SPEC.variants[number].refuse_reason(N=N, C=C):
        assert C % 4 and number == 3
        return
    a, b, w, bias = (x.astype(np.float32) for x in inputs(rng, N, C))
    launch = SPEC.build(rt, number, N=N, C=C)
    outs = [rt.empty(s) for s in ((N, C), (N, C), N, N)]
    poison(*outs)
    launch(*outs, *(rt.to_device(x) for x in (a, b, w, bias)))
    refs = residual_layernorm_forward_ref(*(x.astype(np.float64) for x in (a, b, w, bias)))
    # residual is one fp32 add (exact to half an ulp); the layernorm outputs as in test_layernorm
    for name, got, ref, tol in zip(("residual", "out", "mean", "rstd"), outs, refs, (1e-6, 1e-5, 1e-5, 1e-5)):
        assert_close(got.get(), ref, tol, tol, name)


# bf16 builds. Inputs are bf16 values. residual = bf16(fp32 add), rounded to nearest even: numpy's
# float32 add + to_bf16 is the same operations, so residual must match bit for bit. out, mean and
# rstd are the layernorm of that rounded residual (the float64 reference on it): out one bf16
# rounding (rtol 2^-8) over the fp32 math (the fp32 test's 1e-5); mean, rstd fp32 (1e-5, 1e-5).
@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES + [(9, 100), (33, 36)])  # C % 8 == 4: 3's scalar path
@pytest.mark.parametrize("number", [n for n, v in sorted(SPEC.variants.items()) if "bf16" in v.dtypes])
def test_forward_gpu_bf16(rt, rng, number, N, C):
    if SPEC.variants[number].refuse_reason(N=N, C=C):
        assert C % 4 and number == 3
        return
    a, b, w, bias = (to_bf16(x) for x in inputs(rng, N, C))
    launch = SPEC.build(rt, number, "bf16", N=N, C=C)
    outs = [rt.empty((N, C), BF16), rt.empty((N, C), BF16), rt.empty(N), rt.empty(N)]
    poison(*outs)
    launch(*outs, *(rt.to_device(x) for x in (a, b, w, bias)))
    resid = to_bf16(from_bf16(a) + from_bf16(b))
    np.testing.assert_array_equal(outs[0].get(), resid)
    ro, rm, rs = layernorm_forward_ref(*(from_bf16(x).astype(np.float64) for x in (resid, w, bias)))
    assert_close(from_bf16(outs[1].get()), ro, 1e-5, 2.0 ** -8, "out")
    assert_close(outs[2].get(), rm, 1e-5, 1e-5, "mean")
    assert_close(outs[3].get(), rs, 1e-5, 1e-5, "rstd")
