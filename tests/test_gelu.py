"""GELU (tanh form): numpy references vs torch's gelu(approximate='tanh') and its autograd in float64,
cpu launchers (in-place backward), refusals; with -m gpu, every variant against the reference.

    python -m pytest tests/test_gelu.py -q
    python -m pytest -m gpu tests/test_gelu.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import LLMCError, VariantRefused
from llmc.ops.gelu import gelu_backward_ref, gelu_forward_ref
from llmc.testing import assert_close, poison

FWD = ops.get("gelu_forward")
BWD = ops.get("gelu_backward")


def inputs(rng, N, dtype=np.float64):
    x = rng.standard_normal(N) * 3.0  # reaches the tails where tanh saturates
    return x.astype(dtype), rng.standard_normal(N).astype(dtype)


def test_references_match_torch_tanh_gelu(rng):
    torch = pytest.importorskip("torch")
    x, dout = inputs(rng, 1000)
    tx = torch.tensor(x, requires_grad=True)
    tout = torch.nn.functional.gelu(tx, approximate="tanh")
    tout.backward(torch.tensor(dout))
    np.testing.assert_allclose(gelu_forward_ref(x), tout.detach().numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(gelu_backward_ref(x, dout), tx.grad.numpy(), rtol=1e-12, atol=1e-13)


def test_references_in_float32(rng):
    x, dout = inputs(rng, 1000)
    x32, d32 = x.astype(np.float32), dout.astype(np.float32)
    assert gelu_forward_ref(x32).dtype == gelu_backward_ref(x32, d32).dtype == np.float32
    assert_close(gelu_forward_ref(x32), gelu_forward_ref(x32.astype(np.float64)), 1e-6, 1e-5)
    assert_close(gelu_backward_ref(x32, d32), gelu_backward_ref(x32.astype(np.float64), d32.astype(np.float64)),
                 1e-5, 1e-5)


def test_cpu_launchers_and_in_place_backward(rng):
    N = 37
    x, dout = inputs(rng, N)
    out = np.full(N, np.nan)
    FWD.cpu(N=N)(out, x)
    np.testing.assert_array_equal(out, gelu_forward_ref(x))
    want = gelu_backward_ref(x, dout)
    d = dout.copy()
    BWD.cpu(N=N)(d, x, d)  # dinp aliases dout
    np.testing.assert_array_equal(d, want)


@pytest.mark.parametrize("spec", [FWD, BWD])
def test_float4_variant_refuses_odd_N(spec):
    reason = spec.variants[2].refuse_reason(N=66 * 3 + 1)
    assert reason and "multiple of 4" in reason
    with pytest.raises(VariantRefused, match=spec.flag):
        spec.build(None, 2, N=199)
    assert spec.variants[2].refuse_reason(N=4 * 1024 * 3072) is None
    assert spec.variants[1].refuse_reason(N=199) is None
    with pytest.raises(LLMCError, match="have 1, 2"):
        spec.variant(7)


def test_bf16_kernels_sigmoid_form_is_the_tanh_form(rng):
    """The bf16 kernels compute gelu as x * sigmoid(2u) and gelu' as s + 2 x s (1 - s) k (1 + 3c x^2)
    (cuda/gelu.cu); the same formulas in float64 equal the tanh-form references."""
    x, dout = inputs(rng, 2000)
    x = np.concatenate([x, [-30.0, -12.0, 0.0, 12.0, 30.0]])
    k, c = np.sqrt(2 / np.pi), 0.044715
    u = k * (x + c * x ** 3)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-2.0 * u))
    np.testing.assert_allclose(x * s, gelu_forward_ref(x), rtol=1e-12, atol=1e-14)
    grad = s + 2.0 * x * (s - s * s) * k * (1.0 + 3.0 * c * x * x)
    np.testing.assert_allclose(grad, gelu_backward_ref(x, np.ones_like(x)), rtol=1e-10, atol=1e-12)


def test_default_variants_have_bf16_builds():
    for spec in (FWD, BWD):
        assert "bf16" in spec.variants[spec.default].dtypes
        assert "bf16" in spec.variants[1].dtypes  # the any-N fallback


# ----------------------------------------------------------------------------------------------
# GPU

# N = B*T*4C for (B,T,C) = (1,1,80), (2,65,96), (4,64,768), (2,33,1600), plus N = 1 and an odd N
SIZES = [1 * 1 * 4 * 80, 2 * 65 * 4 * 96, 4 * 64 * 4 * 768, 2 * 33 * 4 * 1600, 1, 1003]


def _refused(spec, number, N):
    reason = spec.variants[number].refuse_reason(N=N)
    if reason:
        assert N % 4 and number == 2, reason
    return reason


@pytest.mark.gpu
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", sorted(FWD.variants))
def test_forward_gpu(rt, rng, number, N):
    if _refused(FWD, number, N):
        return
    x, _ = inputs(rng, N, np.float32)
    launch = FWD.build(rt, number, N=N)
    out = rt.empty(N)
    poison(out)
    launch(out, rt.to_device(x))
    assert_close(out.get(), gelu_forward_ref(x.astype(np.float64)), 1e-6, 1e-5, "out")  # tanhf: ~2 ulp


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", sorted(BWD.variants))
def test_backward_gpu(rt, rng, number, N, in_place):
    if _refused(BWD, number, N):
        return
    x, dout = inputs(rng, N, np.float32)
    launch = BWD.build(rt, number, N=N)
    d_dout = rt.to_device(dout)
    dinp = d_dout if in_place else rt.empty(N)
    if not in_place:
        poison(dinp)
    launch(dinp, rt.to_device(x), d_dout)
    # 1 - tanh^2 cancels in fp32 for |x| > 3: absolute error ~1e-6 at most
    assert_close(dinp.get(), gelu_backward_ref(x.astype(np.float64), dout.astype(np.float64)), 1e-5, 1e-5, "dinp")


# bf16 builds: inputs are bf16 values (rounded first, so the reference sees what the kernel sees),
# the reference is float64 on them. The kernel computes in fp32 (~1e-6 relative, the sigmoid form
# with __expf) and rounds once on the store: <= 2^-9 relative. Tolerance: rtol 2^-8 (two roundings'
# worth), and an atol of 1e-5 of the output's rms for the zero of gelu' near x = -0.75, where the fp32
# math's absolute error is all there is.
BF16_RTOL = 2.0 ** -8


def _bf16_variants(spec):
    return [n for n, v in sorted(spec.variants.items()) if "bf16" in v.dtypes]


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a))))


@pytest.mark.gpu
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", _bf16_variants(FWD))
def test_forward_gpu_bf16(rt, rng, number, N):
    if _refused(FWD, number, N):
        return
    x, _ = inputs(rng, N, np.float32)
    xb = to_bf16(x)
    launch = FWD.build(rt, number, "bf16", N=N)
    out = rt.empty(N, BF16)
    poison(out)
    launch(out, rt.to_device(xb))
    ref = gelu_forward_ref(from_bf16(xb).astype(np.float64))
    assert_close(from_bf16(out.get()), ref, 1e-5 * _rms(ref), BF16_RTOL, "out")


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", _bf16_variants(BWD))
def test_backward_gpu_bf16(rt, rng, number, N, in_place):
    if _refused(BWD, number, N):
        return
    x, dout = (to_bf16(a) for a in inputs(rng, N, np.float32))
    launch = BWD.build(rt, number, "bf16", N=N)
    d_dout = rt.to_device(dout)
    dinp = d_dout if in_place else rt.empty(N, BF16)
    if not in_place:
        poison(dinp)
    launch(dinp, rt.to_device(x), d_dout)
    ref = gelu_backward_ref(from_bf16(x).astype(np.float64), from_bf16(dout).astype(np.float64))
    assert_close(from_bf16(dinp.get()), ref, 1e-5 * _rms(ref), BF16_RTOL, "dinp")


@pytest.mark.gpu
def test_bf16_vector_kernel_takes_a_tail(rt, rng):
    """N % 8 != 0 (but % 4 == 0, so variant 2 takes it): the last thread's 4 elements go scalar, and
    nothing past N is written (a guard element after the tensor keeps its bits)."""
    N = 8 * 37 + 4
    x, _ = inputs(rng, N, np.float32)
    xb = to_bf16(x)
    buf = rt.empty(N + 8, BF16)
    poison(buf)
    FWD.build(rt, 2, "bf16", N=N)(buf.view(0, (N,)), rt.to_device(xb))
    got = buf.get()
    assert (got[N:] == 0xFFFF).all()
    ref = gelu_forward_ref(from_bf16(xb).astype(np.float64))
    assert_close(from_bf16(got[:N]), ref, 1e-5 * _rms(ref), BF16_RTOL, "out")
