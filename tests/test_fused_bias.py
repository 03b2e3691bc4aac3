"""The model's fused bias gradients (layernorm_backward / gelu_backward with colsum=True; docs/ops.md):
where the chosen variant has the fused form the model launches it and no matmul_backward_bias for
fcproj, attproj and fc; otherwise (an older variant named, a shape the default refuses) it launches
the plain op and the bias pass. Either way the gradients are the same: bit for bit on the numpy
backend and on the fake GPU backend (tests/fake_runtime.py: the cuda backend's choices and buffer
plumbing running the numpy launchers), where the fused cpu launchers sum exactly what the bias pass
would. The kernels themselves: tests/test_layernorm.py and tests/test_gelu.py (-m gpu). These models
are built with fuse_dgelu=False: with the fcproj GEMM's dgelu form (tests/test_fused_dgelu.py) no
gelu_backward runs at all, and fc's bias gradient comes from that GEMM's epilogue; and with
fuse_gelu_recompute=False (tests/test_fused_gelu_recompute.py: GELU's recompute form of the same kernel).

    python -m pytest tests/test_fused_bias.py -q
"""
import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config, param_layout
from llmc.model import GPT2
from tests.fake_runtime import FakeCudaBackend

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=3, num_heads=2, channels=32)

UNFUSED = {"layernorm_backward": 3, "gelu_backward": 1}  # variants without the fused form


def _train(be, B=2, T=16, steps=2, accum=2):
    """Gradients after each step (accumulated over `accum` micro-steps: the fused forms "+=" too)."""
    rng = np.random.default_rng(7)
    m = GPT2(CFG, be, B, T, fuse_dgelu=False, fuse_gelu_recompute=False)
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
    (None, {"layernorm_backward": True, "gelu_backward": True, "attention_backward": False}),
    (UNFUSED, {"layernorm_backward": False, "gelu_backward": False, "attention_backward": False}),
    ({"layernorm_backward": 3}, {"layernorm_backward": False, "gelu_backward": True, "attention_backward": False}),
    ({"gelu_backward": 1}, {"layernorm_backward": True, "gelu_backward": False, "attention_backward": False}),
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
    m = GPT2(cfg, be, B, T, fuse_dgelu=False, fuse_gelu_recompute=False)
    assert m.fused_bias == {"layernorm_backward": False, "gelu_backward": True, "attention_backward": False}
    assert "bias_C" in m.built and "layernorm_backward_colsum" not in m.built
    assert "gelu_backward_colsum" in m.built and "bias_4C" not in m.built
    rng = np.random.default_rng(3)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    res = []
    for backend in (be, CpuBackend(np.float32)):
        mm = m if backend is be else GPT2(cfg, backend, B, T, fuse_dgelu=False, fuse_gelu_recompute=False)
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
    m = GPT2(CFG, be, 2, 16, fuse_dgelu=False, fuse_gelu_recompute=False)
    C = CFG.channels
    ln, ge = m.built["layernorm_backward_colsum"], m.built["gelu_backward_colsum"]
    assert ln.number == m.built["layernorm_backward"].number == 5
    assert ge.number == m.built["gelu_backward"].number == 2
    assert ln.shape == dict(N=32, C=C, colsum=True) and ge.shape == dict(N=32 * 4 * C, OC=4 * C, colsum=True)
    assert be.fuses("gelu_backward", dict(colsum=True, OC=4 * C), N=32 * 4 * C) == 2
    assert be.fuses("layernorm_backward", dict(colsum=True), N=32, C=30) is None  # 5 refuses C % 4
    assert CpuBackend().fuses("layernorm_backward", dict(colsum=True), N=32, C=30) == 0  # numpy: every form


def test_fuse_bias_false_keeps_the_variants_and_launches_the_bias_passes(monkeypatch):
    """fuse_bias=False (LLMC_FUSED_BIAS=0): the same variants, the bias passes launched (the A/B of
    the fusion alone); the gradients are the same bits on both backends."""
    be = FakeCudaBackend(quiet=True)
    m = GPT2(CFG, be, 2, 16, fuse_bias=False, fuse_dgelu=False, fuse_gelu_recompute=False)
    assert m.fused_bias == {"layernorm_backward": False, "gelu_backward": False, "attention_backward": False}
    assert m.built["layernorm_backward"].number == 5 and m.built["gelu_backward"].number == 2
    monkeypatch.setenv("LLMC_FUSED_BIAS", "0")
    _, grads = _train(FakeCudaBackend(quiet=True))
    _, cpu = _train(CpuBackend(np.float32))
    monkeypatch.delenv("LLMC_FUSED_BIAS")
    _, fused = _train(CpuBackend(np.float32))
    for g, c, f in zip(grads, cpu, fused):
        np.testing.assert_array_equal(g, c)
        np.testing.assert_array_equal(c, f)


# head size 64 (attention_backward 5, the bf16 default on Hopper, takes only that), bf16-friendly widths
HS64_CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


def _train_bf16(kernels=None, fuse_bias=None):
    """train_steps (2 steps of 2 micro-steps) on the fake GPU backend in bf16 at HS64_CFG: (backend, with
    every launch counted in be.launches, model, [each step's gradients, then the last weights])."""
    from tests.llmc_fixtures import train_steps
    be = FakeCudaBackend(kernels, quiet=True, precision="bf16", nbytes=1 << 27)
    m, steps, _ = train_steps(HS64_CFG, be, 2, 16, fuse_bias=fuse_bias)
    return be, m, [grads for _, grads, _ in steps] + [steps[-1][2]]


def test_qkv_bias_gradient_summed_by_attention_backward():
    """bf16 with attention_backward 5 (the default) or 4 (--deterministic's): qkv's bias gradient comes
    from their colsum form and no matmul_backward_bias runs at all (fcproj's, attproj's and fc's are
    fused too); named 3, which has no such form, or fuse_bias=False: the bias pass sums dqkv. With 4
    and 3 the gradients and the updated weights are the same bits (the fake backend's colsum forms are
    the plain backward then the bias pass's sum of dinp as stored; the GPU's order differs:
    tests/test_attention.py), and with fuse_bias=False (every bias gradient by the bias pass) too."""
    L = HS64_CFG.num_layers
    be5, m5, fused = _train_bf16()
    assert m5.fused_bias == {"layernorm_backward": True, "gelu_backward": True, "attention_backward": True}
    att = m5.built["attention_backward"]
    assert att.number == 5 and att.shape.get("colsum") is True and "bias_3C" not in m5.built
    assert be5.launches.count("matmul_backward_bias") == 0
    be4, m4, named4 = _train_bf16({"attention_backward": 4})
    assert m4.fused_bias["attention_backward"] and m4.built["attention_backward"].number == 4
    assert be4.launches.count("matmul_backward_bias") == 0
    be3, m3, named3 = _train_bf16({"attention_backward": 3})
    assert not m3.fused_bias["attention_backward"] and "colsum" not in m3.built["attention_backward"].shape
    assert be3.launches.count("matmul_backward_bias") == L * 2 * 2  # qkv's, 2 steps x 2 micro-steps
    be0, m0, unfused = _train_bf16(fuse_bias=False)
    assert m0.built["attention_backward"].number == 5 and not m0.fused_bias["attention_backward"]
    assert "bias_3C" in m0.built and be0.launches.count("matmul_backward_bias") == 4 * L * 2 * 2
    for a, b, c in zip(fused, named4, named3):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    for a, b in zip(fused, unfused):
        np.testing.assert_array_equal(a, b)
    off, n = next((o, n) for name, o, n in param_layout(HS64_CFG) if name == "qkvb")
    assert np.abs(fused[0][off:off + n]).max() > 0  # (a gradient, not zeros)


def test_bf16_colsum_forms_sum_dinp_as_stored():
    """The fake GPU backend's bf16 layernorm_backward and gelu_backward colsum forms (deferred or not,
    GELU's recompute form too) sum dinp as stored, rounded to bf16, as the GPU kernels do (docs/ops.md):
    fused and unfused (fuse_bias=False: the bias pass) give the same bits at every step. A fake that
    summed the fp32 values before the store's rounding (what the generic bf16 wrapper of the numpy
    launchers does) fails this."""
    from tests.llmc_fixtures import train_steps
    for recompute in (0, 1):
        runs = {}
        for fuse in (True, False):
            be = FakeCudaBackend(None, quiet=True, precision="bf16", nbytes=1 << 27)
            m, steps, _ = train_steps(HS64_CFG, be, 2, 16, fuse_bias=fuse, recompute=recompute)
            assert m.fused_bias["layernorm_backward"] == m.fused_bias["gelu_backward"] == fuse
            runs[fuse] = [g for _, g, _ in steps] + [steps[-1][2]]
        for a, b in zip(runs[True], runs[False]):
            np.testing.assert_array_equal(a, b)


def test_fused_forms_cost_the_plain_bytes_plus_colsum():
    """The cost model (profile, labs) of a fused form: the plain op's bytes plus colsum read and
    written, in the build's element type; the bias pass's read of the (rows, OC) tensor is gone."""
    from llmc import ops
    N, C = 4096, 768
    for dtype, e in (("fp32", 4), ("bf16", 2)):
        ln, ge = ops.get("layernorm_backward"), ops.get("gelu_backward")
        assert ln.cost(N=N, C=C, dtype=dtype, colsum=True)[1] == ln.cost(N=N, C=C, dtype=dtype)[1] + 2 * C * e
        assert (ge.cost(N=N * 4 * C, OC=4 * C, dtype=dtype, colsum=True)[1]
                == ge.cost(N=N * 4 * C, dtype=dtype)[1] + 2 * 4 * C * e)


# ----------------------------------------------------------------------------------------------
# GPU: the fused model against the unfused one (same variants) and against itself on graph replays

# hs = 64 (the fused attention, which has bf16 builds), C % 8 == 0 and Vp % 8 == 0 (bf16 matmuls)
GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_fused_matches_unfused_and_replays_bit_exactly(rt, precision):
    """On the GPU: two steps of 2 micro-steps (the second and later micro-steps are CUDA graph
    replays) with the fused bias gradients, twice from the same init: bit-identical gradients (the
    fused sums have a fixed order); and within a summation-order tolerance of the unfused model
    (fuse_bias=False: the same variants plus matmul_backward_bias, whose sums run in another order).
    Tolerance per gradient tensor: fp32 1e-5 of its rms elementwise plus 1e-5 relative on the first
    step (sums of B*T rows in another fp32 order); 1e-2 on the second, after one AdamW update: its
    first step moves each weight by about lr whatever the gradient's size, so a near-zero bias
    gradient summed in another order can move a weight the other way (measured on the H100: wte's
    gradient 3.8e-6 apart at an rms of 9.3e-3, qkvw 2.1e-6 at 1.0e-3); bf16: both forms sum the same stored
    bf16 values and round the total once, so a bias element may differ by a rounding per micro-step
    (2^-7 relative) and the second step's gradients by what that does to the update (1e-2 of the rms)."""
    from llmc.backend import CudaBackend
    from llmc.config import param_layout
    from llmc.train import deterministic_kernels
    from tests.llmc_fixtures import train_steps
    B, T = 4, 64
    runs = []
    for fuse in (True, True, False):
        # (--deterministic's kernels: the default fp32 encoder backward adds with float atomics)
        be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
        m, steps, _ = train_steps(GPU_CFG, be, B, T, fuse_bias=fuse, fuse_gelu_recompute=False)
        # (--deterministic: attention_backward 4, whose builds sum qkv's bias gradient too)
        assert m.fused_bias == {"layernorm_backward": fuse, "gelu_backward": fuse, "attention_backward": fuse}
        runs.append([grads for _, grads, _ in steps])
    for a, b in zip(runs[0], runs[1]):
        np.testing.assert_array_equal(a, b)
    for step, (a, b) in enumerate(zip(runs[0], runs[2])):
        for name, off, size in param_layout(GPU_CFG):
            ga, gb = a[off:off + size].astype(np.float64), b[off:off + size].astype(np.float64)
            rms = float(np.sqrt(np.mean(gb ** 2))) + 1e-30
            if precision == "fp32":  # (step 1 is after an AdamW update: see the docstring)
                atol, rtol = (1e-5 * rms, 1e-5) if step == 0 else (1e-2 * rms, 1e-2)
            else:
                atol, rtol = 1e-2 * rms, 2.0 ** -7
            err = np.abs(ga - gb) - (atol + rtol * np.abs(gb))
            assert np.all(err <= 0), (precision, step, name, float(np.max(np.abs(ga - gb))), rms)
