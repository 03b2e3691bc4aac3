"""Softmax (the causal softmax inside the composite attention): numpy references vs PyTorch float64
autograd, the variant table and its refusals (CPU), and every GPU variant vs the references (-m gpu).

    python -m pytest tests/test_softmax.py -q            # CPU part (CI)
    python -m pytest tests/test_softmax.py -q -m gpu     # GPU part, on a machine with a GPU
"""
import functools
import math

import numpy as np
import pytest

from llmc import ops
from llmc.errors import LLMCError, VariantRefused
from llmc.ops import softmax as S
from llmc.testing import assert_close, poison


# ----------------------------------------------------------------------------------------------
# torch float64 version of the math, written out (the oracle for the numpy references)


def torch_causal_softmax(preatt, scale):
    import torch
    T = preatt.shape[-1]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    return torch.softmax((preatt * scale).masked_fill(~mask, float("-inf")), dim=-1)


# ----------------------------------------------------------------------------------------------
# CPU: references vs torch, the cpu launchers, the variant table


@pytest.mark.parametrize("BNH,T", [(3, 17), (2, 1), (1, 64)])
def test_softmax_refs_match_torch(BNH, T, rng):
    import torch
    scale = 0.3
    preatt = rng.standard_normal((BNH, T, T)) * 3
    datt = rng.standard_normal((BNH, T, T))
    x = torch.tensor(preatt, requires_grad=True)
    att_t = torch_causal_softmax(x, scale)
    att_t.backward(torch.tensor(datt))
    att = S.softmax_forward_ref(preatt, scale)
    assert_close(att, att_t.detach().numpy(), 1e-12, 1e-10, "att")
    assert np.all(att[:, ~np.tril(np.ones((T, T), bool))] == 0)
    dpre = S.softmax_backward_ref(datt, att, scale)
    # torch's gradient above the diagonal is 0 too (those inputs are masked out)
    assert_close(dpre, x.grad.numpy(), 1e-12, 1e-10, "dpreatt")


def test_cpu_launchers_write_in_place(rng):
    B, T, NH = 2, 7, 3
    # softmax ops on flat (BNH, T, T) buffers
    pre = rng.standard_normal((B * NH, T, T))
    a = np.full_like(pre, np.nan)
    ops.get("softmax_forward").cpu(BNH=B * NH, T=T, scale=0.5)(a, pre)
    assert np.array_equal(a, S.softmax_forward_ref(pre, 0.5))
    d = np.full_like(pre, np.nan)
    ops.get("softmax_backward").cpu(BNH=B * NH, T=T, scale=0.5)(d, pre, a)
    assert np.array_equal(d, S.softmax_backward_ref(pre, a, 0.5))


@pytest.mark.parametrize("name", ["softmax_forward", "softmax_backward"])
def test_variant_tables(name):
    spec = ops.get(name)
    assert len(spec.variants) >= 5 and spec.default in spec.variants
    for n, v in spec.variants.items():
        assert v.number == n and v.description
        assert v.refuse_reason(BNH=48, T=1024, scale=0.125) is None
        assert v.refuse_reason(BNH=4, T=64, scale=0.125) is None
    for n in (5, 6):  # float4 variants refuse T % 4 != 0, saying why
        assert "multiple of 4" in spec.variants[n].refuse_reason(BNH=4, T=65, scale=0.125)
        with pytest.raises(VariantRefused, match="multiple of 4"):
            spec.build(None, n, BNH=4, T=65, scale=0.125)
    assert "2048" in spec.variants[6].refuse_reason(BNH=1, T=4096, scale=0.1)
    assert "power of two" in spec.variants[2].refuse_reason(BNH=1, T=8, scale=0.1, block_size=96)
    with pytest.raises(LLMCError, match="no variant 99"):
        spec.variant(99)



# ----------------------------------------------------------------------------------------------
# GPU: every softmax variant (poisoned outputs, every element checked, zeros above the diagonal)

SOFTMAX_SHAPES = [(48, 1024), (4, 1), (6, 65), (5, 64)]


@functools.lru_cache(maxsize=4)
def _softmax_case(BNH, T):
    """float32 inputs and float64 references for one shape (shared by all variants)."""
    rng = np.random.default_rng(BNH * 10007 + T)
    scale = 1.0 / math.sqrt(64)
    preatt = (rng.standard_normal((BNH, T, T)) * 8).astype(np.float32)  # scaled logits ~ N(0, 1)
    # what the GEMM leaves above the diagonal must not matter: put NaN and huge values there
    upper = ~np.tril(np.ones((T, T), bool))
    preatt[:, upper] = np.where(rng.random(int(upper.sum())) < 0.5, np.nan, 1e30).astype(np.float32)
    att64 = S.softmax_forward_ref(preatt.astype(np.float64), scale)
    datt = rng.standard_normal((BNH, T, T)).astype(np.float32)
    datt[:, upper] = np.nan
    att32 = att64.astype(np.float32)
    dpre64 = S.softmax_backward_ref(datt.astype(np.float64), att32.astype(np.float64), scale)
    return scale, preatt, att64, datt, att32, dpre64


def _variant_ids(name):
    return [(name, n) for n in sorted(ops.get(name).variants)]


@pytest.mark.gpu
@pytest.mark.parametrize("BNH,T", SOFTMAX_SHAPES)
@pytest.mark.parametrize("n", sorted(S.SOFTMAX_FORWARD_VARIANTS))
def test_softmax_forward_gpu(rt, n, BNH, T):
    spec = ops.get("softmax_forward")
    scale, preatt, att64, *_ = _softmax_case(BNH, T)
    if spec.variants[n].refuse_reason(BNH=BNH, T=T, scale=scale):
        pytest.skip(spec.variants[n].refuse_reason(BNH=BNH, T=T, scale=scale))
    d_pre = rt.to_device(preatt)
    d_att = rt.empty((BNH, T, T))
    poison(d_att)
    spec.build(rt, n, BNH=BNH, T=T, scale=scale)(d_att, d_pre)
    got = d_att.get()
    # fp32 with expf: a few ulp per element; a serial fp32 sum over <= 1024 terms (variant 1) can be
    # off by ~1e-5 relative (n*eps bound 6e-5), and every element of the row shares that error
    assert_close(got, att64, atol=1e-7, rtol=3e-5, name=f"softmax_forward {n} att")
    assert np.all(got[:, ~np.tril(np.ones((T, T), bool))] == 0.0), "upper triangle not written as 0"


@pytest.mark.gpu
@pytest.mark.parametrize("BNH,T", SOFTMAX_SHAPES)
@pytest.mark.parametrize("n", sorted(S.SOFTMAX_BACKWARD_VARIANTS))
def test_softmax_backward_gpu(rt, n, BNH, T):
    spec = ops.get("softmax_backward")
    scale, _, _, datt, att32, dpre64 = _softmax_case(BNH, T)
    if spec.variants[n].refuse_reason(BNH=BNH, T=T, scale=scale):
        pytest.skip(spec.variants[n].refuse_reason(BNH=BNH, T=T, scale=scale))
    d_att, d_datt = rt.to_device(att32), rt.to_device(datt)
    d_dpre = rt.empty((BNH, T, T))
    poison(d_dpre)
    spec.build(rt, n, BNH=BNH, T=T, scale=scale)(d_dpre, d_datt, d_att)
    got = d_dpre.get()
    # |dpreatt| <= scale * att * O(1); the fp32 dot over <= 1024 terms is good to ~1e-6 of its size
    assert_close(got, dpre64, atol=1e-7, rtol=1e-4, name=f"softmax_backward {n} dpreatt")
    assert np.all(got[:, ~np.tril(np.ones((T, T), bool))] == 0.0), "upper triangle not written as 0"
