"""Encoder: numpy references vs torch autograd (float64) with repeated tokens, cpu launcher semantics,
shape refusals; with -m gpu, every variant against the reference and the deterministic backward
variants bit-identical across runs.

    python -m pytest tests/test_encoder.py -q
    python -m pytest -m gpu tests/test_encoder.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.errors import LLMCError, VariantRefused
from llmc.ops.encoder import encoder_backward_ref, encoder_forward_ref
from llmc.testing import assert_close, poison

FWD = ops.get("encoder_forward")
BWD = ops.get("encoder_backward")
DETERMINISTIC = (2, 3)


def inputs(rng, B, T, C, Vp, maxT, vocab=None, dtype=np.float64):
    """Tokens from a small vocabulary (so they repeat, within and across rows) plus the last id."""
    vocab = vocab or max(2, min(Vp, B * T // 3))
    inp = rng.integers(0, vocab, (B, T)).astype(np.int32)
    inp[-1, -1] = Vp - 1
    wte = rng.standard_normal((Vp, C)).astype(dtype)
    wpe = rng.standard_normal((maxT, C)).astype(dtype)
    dout = rng.standard_normal((B, T, C)).astype(dtype)
    return inp, wte, wpe, dout


# ----------------------------------------------------------------------------------------------
# references (no GPU)

@pytest.mark.parametrize("B,T,C", [(2, 5, 8), (3, 17, 24), (1, 1, 4)])
def test_references_match_torch_autograd(rng, B, T, C):
    torch = pytest.importorskip("torch")
    Vp, maxT = 11, T + 3
    inp, wte, wpe, dout = inputs(rng, B, T, C, Vp, maxT, vocab=4)
    out = encoder_forward_ref(inp, wte, wpe)
    twte, twpe = torch.tensor(wte, requires_grad=True), torch.tensor(wpe, requires_grad=True)
    tout = twte[torch.tensor(inp, dtype=torch.long)] + twpe[:T]
    tout.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-15, atol=0)
    dwte, dwpe = encoder_backward_ref(np.zeros_like(wte), np.zeros_like(wpe), dout, inp)
    np.testing.assert_allclose(dwte, twte.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dwpe, twpe.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert B * T == 1 or (np.bincount(inp.ravel()) > 1).any()  # the test really has repeated tokens


def test_backward_ref_accumulates_and_touches_only_used_rows(rng):
    B, T, C, Vp, maxT = 2, 6, 8, 20, 9
    inp, _, _, dout = inputs(rng, B, T, C, Vp, maxT, vocab=5)
    dwte0, dwpe0 = rng.standard_normal((Vp, C)), rng.standard_normal((maxT, C))
    dwte, dwpe = encoder_backward_ref(dwte0.copy(), dwpe0.copy(), dout, inp)
    unused = np.setdiff1d(np.arange(Vp), inp)
    np.testing.assert_array_equal(dwte[unused], dwte0[unused])
    np.testing.assert_array_equal(dwpe[T:], dwpe0[T:])
    want = dwte0.copy()
    for (b, t), tok in np.ndenumerate(inp):  # the obvious loop, as a cross-check only
        want[tok] += dout[b, t]
    np.testing.assert_allclose(dwte, want, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(dwpe[:T], dwpe0[:T] + dout.sum(0), rtol=1e-14, atol=1e-14)


def test_cpu_launchers(rng):
    B, T, C, Vp, maxT = 2, 7, 12, 10, 8
    inp, wte, wpe, dout = inputs(rng, B, T, C, Vp, maxT, dtype=np.float32)
    out = np.full((B, T, C), np.nan, np.float32)
    FWD.cpu(B=B, T=T, C=C)(out, inp, wte, wpe)
    np.testing.assert_array_equal(out, encoder_forward_ref(inp, wte, wpe))
    flat = rng.standard_normal(Vp * C + maxT * C).astype(np.float32)  # grads as views of one buffer
    want = encoder_backward_ref(flat[:Vp * C].reshape(Vp, C).copy(), flat[Vp * C:].reshape(maxT, C).copy(),
                                dout, inp)
    BWD.cpu(B=B, T=T, C=C)(flat[:Vp * C].reshape(Vp, C), flat[Vp * C:].reshape(maxT, C), dout, inp)
    np.testing.assert_array_equal(flat, np.concatenate([w.ravel() for w in want]))


@pytest.mark.parametrize("spec,number", [(FWD, 2), (FWD, 3), (BWD, 3), (BWD, 4), (BWD, 5)])
def test_float4_variants_refuse_odd_C(spec, number):
    reason = spec.variants[number].refuse_reason(B=2, T=3, C=66)
    assert reason and "multiple of 4" in reason
    with pytest.raises(VariantRefused, match=spec.flag):
        spec.build(None, number, B=2, T=3, C=66)
    assert spec.variants[number].refuse_reason(B=2, T=3, C=768) is None


def test_variants_table():
    assert len(FWD.variants) >= 2 and len(BWD.variants) >= 2
    for spec in (FWD, BWD):
        assert spec.default in spec.variants
        for n, v in spec.variants.items():
            assert v.number == n and v.description
        with pytest.raises(LLMCError, match="have 1, 2"):
            spec.variant(9)
    for n in DETERMINISTIC:
        assert "deterministic" in BWD.variants[n].description
        assert "non-deterministic" not in BWD.variants[n].description


# ----------------------------------------------------------------------------------------------
# GPU

# (B, T, C): T=65 and T=1, C not a power of two (80, 96, 1600), C=768, and C=66 (float4 refuses)
SHAPES = [(2, 65, 96), (1, 1, 80), (3, 64, 768), (4, 33, 1600), (2, 5, 66), (8, 129, 80)]
VP = 97


def _refused(spec, number, B, T, C):
    reason = spec.variants[number].refuse_reason(B=B, T=T, C=C)
    if reason:
        assert C % 4 and "float4" in spec.variants[number].description, reason
        with pytest.raises(VariantRefused):
            spec.build(None, number, B=B, T=T, C=C)
    return reason


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C", SHAPES)
@pytest.mark.parametrize("number", sorted(FWD.variants))
def test_forward_gpu(rt, rng, number, B, T, C):
    if _refused(FWD, number, B, T, C):
        return
    inp, wte, wpe, _ = inputs(rng, B, T, C, VP, T + 3, dtype=np.float32)
    launch = FWD.build(rt, number, B=B, T=T, C=C)
    out = rt.empty((B, T, C))
    poison(out)
    launch(out, rt.to_device(inp), rt.to_device(wte), rt.to_device(wpe))
    ref = encoder_forward_ref(inp, wte.astype(np.float64), wpe.astype(np.float64))
    assert_close(out.get(), ref, 1e-6, 1e-6, "out")  # one fp32 add: within half an ulp


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C", SHAPES)
@pytest.mark.parametrize("number", sorted(BWD.variants))
def test_backward_gpu_accumulates(rt, rng, number, B, T, C):
    if _refused(BWD, number, B, T, C):
        return
    maxT = T + 3
    inp, _, _, dout = inputs(rng, B, T, C, VP, maxT, dtype=np.float32)
    dwte0 = rng.standard_normal((VP, C)).astype(np.float32)   # "+=" outputs pre-filled
    dwpe0 = rng.standard_normal((maxT, C)).astype(np.float32)
    launch = BWD.build(rt, number, B=B, T=T, C=C)
    dwte, dwpe = rt.to_device(dwte0), rt.to_device(dwpe0)
    launch(dwte, dwpe, rt.to_device(dout), rt.to_device(inp))
    want_wte, want_wpe = encoder_backward_ref(dwte0.astype(np.float64), dwpe0.astype(np.float64),
                                              dout.astype(np.float64), inp)
    got_wte, got_wpe = dwte.get(), dwpe.get()
    # up to ~B*T/3 repeats of a token summed in fp32: 1e-5 abs + 1e-5 rel is well above the rounding
    assert_close(got_wte, want_wte, 1e-5, 1e-5, "dwte")
    assert_close(got_wpe, want_wpe, 1e-5, 1e-5, "dwpe")
    unused = np.setdiff1d(np.arange(VP), inp)
    np.testing.assert_array_equal(got_wte[unused], dwte0[unused])  # rows not used: untouched
    np.testing.assert_array_equal(got_wpe[T:], dwpe0[T:])


@pytest.mark.gpu
@pytest.mark.parametrize("number", DETERMINISTIC)
def test_backward_deterministic_bit_identical(rt, rng, number):
    # many repeats (8 tokens over 4096 positions): atomics would add them in a varying order
    B, T, C = 4, 1024, 768
    inp, _, _, dout = inputs(rng, B, T, C, VP, T, vocab=8, dtype=np.float32)
    dwte0 = rng.standard_normal((VP, C)).astype(np.float32)
    dwpe0 = rng.standard_normal((T, C)).astype(np.float32)
    d_dout, d_inp = rt.to_device(dout), rt.to_device(inp)
    launch = BWD.build(rt, number, B=B, T=T, C=C)
    runs = []
    for _ in range(2):
        dwte, dwpe = rt.to_device(dwte0), rt.to_device(dwpe0)
        launch(dwte, dwpe, d_dout, d_inp)
        runs.append((dwte.get().view(np.uint32), dwpe.get().view(np.uint32)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
