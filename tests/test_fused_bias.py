"""The model's fused bias gradients (layernorm_backward / gelu_backward with colsum=True; docs/ops.md):
where the chosen variant has the fused form the model launches it and no matmul_backward_bias for
fcproj, attproj and fc; otherwise (an older variant named, a shape the default refuses) it launches
the plain op and the bias pass. Either way the gradients are the same: bit for bit on the numpy
backend and on the fake GPU backend (tests/fake_runtime.py: the cuda backend's choices and buffer
plumbing running the numpy launchers), where the fused cpu launchers sum exactly what the bias pass
would. The kernels themselves: tests/test_layernorm.py and tests/test_gelu.py (-m gpu).

    python -m pytest tests/test_fused_bias.py -q
"""
import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.model import GPT2
from tests.fake_runtime import FakeCudaBackend

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=3, num_heads=2, channels=32)

UNFUSED = {"layernorm_backward": 3, "gelu_backward": 1}  # variants without the fused form


def _train(be, B=2, T=16, steps=2, accum=2):
    """Gradients after each step (accumulated over `accum` micro-steps: the fused forms "+=" too)."""
    rng = np.random.default_rng(7)
    m = GPT2(CFG, be, B, T)
    m.init_params(11)
    m.grad_accum_steps = accum
    out = []
    for step in range(1, steps + 1):
        m.zero_grad()
        for _ in range(accum):
            x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
            y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
            m.forward(x, y)
            m.backward()
        out.append(m.get_grads().copy())
        m.update(lr=1e-3, step=step)
    return m, out


@pytest.mark.parametrize("kernels,fused", [
    (None, {"layernorm_backward": True, "gelu_backward": True}),
    (UNFUSED, {"layernorm_backward": False, "gelu_backward": False}),
    ({"layernorm_backward": 3}, {"layernorm_backward": False, "gelu_backward": True}),
    ({"gelu_backward": 1}, {"layernorm_backward": True, "gelu_backward": False}),
])
def test_fused_and_unfused_give_the_same_gradients(kernels, fused):
    """Default variants: fused; a named variant without the form: that op unfused. The bias passes
    launched per micro-step: qkv's always (L), fcproj's and attproj's (2L) only without the fused
    layernorm_backward, fc's (L) only without the fused gelu_backward. Gradients bit-identical to the
    numpy backend's (which always runs the fused cpu forms) at every step."""
    L = CFG.num_layers
    be = FakeCudaBackend(kernels, quiet=True)
    m, grads = _train(be)
    assert m.fused_bias == fused
    _, ref = _train(CpuBackend(np.float32))
    for g, r in zip(grads, ref):
        np.testing.assert_array_equal(g, r)
    bias = be.launches.count("matmul_backward_bias")  # over 2 steps of 2 micro-steps
    want = L + 2 * L * (not fused["layernorm_backward"]) + L * (not fused["gelu_backward"])
    assert bias == want * 2 * 2, (bias, want)
    lnb = be.launches.count("layernorm_backward")
    assert lnb == (2 * L + 1) * 2 * 2  # fused or not: one launch a layernorm


def test_a_refused_shape_falls_back_to_the_unfused_launches():
    """C = 30 (not a multiple of 4): layernorm_backward's default 5 refuses, the fallback 3 has no
    fused form, so the model launches fcproj's and attproj's bias passes; gelu_backward (N = B*T*4C,
    always whole float4s) stays fused. Same gradients as numpy."""
    cfg = GPT2Config(max_seq_len=16, vocab_size=50, padded_vocab_size=52, num_layers=2, num_heads=2, channels=30)
    B, T = 1, 3
    be = FakeCudaBackend(quiet=True)
    m = GPT2(cfg, be, B, T)
    assert m.fused_bias == {"layernorm_backward": False, "gelu_backward": True}
    assert "bias_C" in m.built and "layernorm_backward_colsum" not in m.built
    assert "gelu_backward_colsum" in m.built and "bias_4C" not in m.built
    rng = np.random.default_rng(3)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    res = []
    for backend in (be, CpuBackend(np.float32)):
        mm = m if backend is be else GPT2(cfg, backend, B, T)
        mm.init_params(5)
        mm.zero_grad()
        mm.forward(x, x)
        mm.backward()
        res.append(mm.get_grads())
    np.testing.assert_array_equal(res[0], res[1])


def test_fused_builds_are_the_chosen_variant():
    """The fused form is built from the variant the backend chose for the plain op (prefer=), with
    the colsum option and, for gelu, the row length OC = 4C."""
    be = FakeCudaBackend(quiet=True)
    m = GPT2(CFG, be, 2, 16)
    C = CFG.channels
    ln, ge = m.built["layernorm_backward_colsum"], m.built["gelu_backward_colsum"]
    assert ln.number == m.built["layernorm_backward"].number == 5
    assert ge.number == m.built["gelu_backward"].number == 2
    assert ln.shape == dict(N=32, C=C, colsum=True) and ge.shape == dict(N=32 * 4 * C, OC=4 * C, colsum=True)
    assert be.fuses("gelu_backward", dict(colsum=True, OC=4 * C), N=32 * 4 * C) == 2
    assert be.fuses("layernorm_backward", dict(colsum=True), N=32, C=30) is None  # 5 refuses C % 4
    assert CpuBackend().fuses("layernorm_backward", dict(colsum=True), N=32, C=30) == 0  # numpy: every form
