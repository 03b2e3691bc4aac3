"""Residual add: reference, cpu launcher (aliasing), refusals; with -m gpu, every variant.

    python -m pytest tests/test_residual.py -q
    python -m pytest -m gpu tests/test_residual.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import LLMCError, VariantRefused
from llmc.ops.residual import residual_forward_ref
from llmc.testing import assert_close, poison

SPEC = ops.get("residual_forward")


def test_reference_matches_torch(rng):
    torch = pytest.importorskip("torch")
    a, b = rng.standard_normal(50), rng.standard_normal(50)
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    (ta + tb).sum().backward()
    np.testing.assert_array_equal(residual_forward_ref(a, b), (ta + tb).detach().numpy())


def test_cpu_launcher_overwrites_and_allows_aliasing(rng):
    N = 13
    a, b = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    out = np.full(N, np.nan, np.float32)
    SPEC.cpu(N=N)(out, a, b)
    np.testing.assert_array_equal(out, a + b)
    acc = a.copy()
    SPEC.cpu(N=N)(acc, acc, b)  # loss_acc = loss_acc + losses, as the model does
    np.testing.assert_array_equal(acc, a + b)


def test_float4_variant_refuses_odd_N():
    reason = SPEC.variants[2].refuse_reason(N=65)
    assert reason and "multiple of 4" in reason
    with pytest.raises(VariantRefused, match="--residual-kernel"):
        SPEC.build(None, 2, N=65 * 66)
    assert SPEC.variants[1].refuse_reason(N=65) is None
    with pytest.raises(LLMCError, match="have 1, 2"):
        SPEC.variant(3)


SIZES = [1, 65, 2 * 65 * 96, 4 * 64 * 768, 2 * 33 * 1600, 1 * 1 * 80]


@pytest.mark.gpu
@pytest.mark.parametrize("alias", [False, True])
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", sorted(SPEC.variants))
def test_forward_gpu(rt, rng, number, N, alias):
    if SPEC.variants[number].refuse_reason(N=N):
        assert N % 4 and number == 2
        return
    a, b = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    launch = SPEC.build(rt, number, N=N)
    d_a, d_b = rt.to_device(a), rt.to_device(b)
    out = d_a if alias else rt.empty(N)
    if not alias:
        poison(out)
    launch(out, d_a, d_b)
    assert_close(out.get(), a.astype(np.float64) + b, 0.0, 1e-7, "out")  # one fp32 add: half an ulp


# bf16 builds: the kernel adds the two bf16 values in fp32 and rounds once to nearest even. numpy
# does the very same operations (float32 add of the widened values, to_bf16's round-to-nearest-even),
# so the result must be the same bits: no tolerance needed.
@pytest.mark.gpu
@pytest.mark.parametrize("alias", [None, "inp1", "inp2"])
@pytest.mark.parametrize("N", SIZES + [8 * 41 + 4])
@pytest.mark.parametrize("number", [n for n, v in sorted(SPEC.variants.items()) if "bf16" in v.dtypes])
def test_forward_gpu_bf16_bit_exact(rt, rng, number, N, alias):
    if SPEC.variants[number].refuse_reason(N=N):
        assert N % 4 and number == 2
        return
    a, b = (to_bf16(rng.standard_normal(N) * s) for s in (1.0, 0.3))
    launch = SPEC.build(rt, number, "bf16", N=N)
    d_a, d_b = rt.to_device(a), rt.to_device(b)
    out = {"inp1": d_a, "inp2": d_b}.get(alias)
    if out is None:
        out = rt.empty(N + 8, BF16)  # 8 guard elements after the tensor must keep their poison
        poison(out)
        launch(out.view(0, (N,)), d_a, d_b)
        assert (out.get()[N:] == 0xFFFF).all(), "wrote past N"
        got = out.get()[:N]
    else:
        launch(out, d_a, d_b)
        got = out.get()
    want = to_bf16(from_bf16(a) + from_bf16(b))  # float32 add, then round to nearest even
    np.testing.assert_array_equal(got, want)
