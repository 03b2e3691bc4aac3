"""Fused residual + layernorm forward: reference vs torch (float64), cpu launcher, refusals; with
-m gpu, every variant against the reference.

    python -m pytest tests/test_residual_layernorm.py -q
    python -m pytest -m gpu tests/test_residual_layernorm.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.errors import VariantRefused
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
