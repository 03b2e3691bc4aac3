"""GELU (tanh form): numpy references vs torch's gelu(approximate='tanh') and its autograd in float64,
cpu launchers (in-place backward), refusals; with -m gpu, every variant against the reference.

    python -m pytest tests/test_gelu.py -q
    python -m pytest -m gpu tests/test_gelu.py -q
"""
import numpy as np
import pytest

from llmc import ops
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
