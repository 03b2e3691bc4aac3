"""The fc layer's GELU fused into its GEMM (matmul_forward with gelu_pre=True; docs/ops.md): with
fuse_gelu=True or LLMC_FUSED_GELU=1 (off by default: not faster in the H100 step), where the variant
chosen for mm_fc has the fused form (9, engine 5), the model's forward launches it and no
gelu_forward; otherwise (another variant named, a GPU without wgmma) mm_fc and gelu_forward. The
fused form is defined as the plain op then gelu_forward on the stored pre-activation, so everything
is the same bits either way: on the numpy backend (whose launcher is exactly that), on the fake GPU
backend (tests/fake_runtime.py, fp32 and bf16) and, -m gpu, on the GPU (the kernels themselves:
tests/test_gemm_wgmma.py and tests/test_matmul.py).

    python -m pytest tests/test_fused_gelu.py -q
"""
import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.model import GPT2
from tests.fake_runtime import FakeCudaBackend

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=128, num_layers=3, num_heads=2, channels=32)


def _train(be, B=2, T=16, steps=2, **kw):
    """(model, [(loss, grads, logits of a forward without targets)] per step); fuse_gelu=True unless
    the caller says otherwise (None: the environment's LLMC_FUSED_GELU, or the default)."""
    rng = np.random.default_rng(7)
    kw.setdefault("fuse_gelu", True)
    kw.setdefault("fuse_gelu_recompute", False)  # (the counts below include backward's gelu_forward recompute)
    m = GPT2(CFG, be, B, T, **kw)
    m.init_params(11)
    m.stochastic_rounding = False
    out = []
    for step in range(1, steps + 1):
        x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
        y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
        m.zero_grad()
        loss = m.forward(x, y)
        m.backward()
        grads = np.asarray(m.get_grads(), np.float32).copy()
        m.update(lr=1e-3, step=step)
        m.forward(x)
        out.append((loss, grads, m.logits().copy()))
    return m, out


def _same(a, b):
    for (la, ga, xa), (lb, gb, xb) in zip(a, b):
        assert la == lb
        np.testing.assert_array_equal(ga, gb)
        np.testing.assert_array_equal(xa, xb)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_form_and_the_same_bits_as_the_pair(monkeypatch, precision):
    """fuse_gelu=True: the default variant (9) takes the fused form, mm_fc_gelu is built from it
    (prefer=) with gelu_pre, and a training micro-step launches L gelu_forwards (backward's recompute)
    instead of 2L. fuse_gelu=False, and the default (LLMC_FUSED_GELU unset or 0), keep the pair with
    the same variants; LLMC_FUSED_GELU=1 fuses. Losses, gradients and logits: the same bits every way
    (and the numpy backend's, in fp32)."""
    L = CFG.num_layers
    be = FakeCudaBackend(quiet=True, precision=precision)
    m, fused = _train(be)
    assert m.fused_gelu and m.built["mm_fc_gelu"].number == m.built["mm_fc"].number == 9
    assert m.built["mm_fc_gelu"].shape == dict(N=32, C=32, OC=128, has_bias=True, gelu_pre=True)
    # per step: a training forward + backward (L + L recomputed GELUs unfused) and a forward (L)
    assert be.launches.count("gelu_forward") == 2 * L  # 2 steps x (backward's L), no forward's
    be2 = FakeCudaBackend(quiet=True, precision=precision)
    m2, unfused = _train(be2, fuse_gelu=False)
    assert not m2.fused_gelu and "mm_fc_gelu" not in m2.built
    assert be2.launches.count("gelu_forward") == 2 * 3 * L
    _same(fused, unfused)
    monkeypatch.delenv("LLMC_FUSED_GELU", raising=False)
    m3, default = _train(FakeCudaBackend(quiet=True, precision=precision), fuse_gelu=None)
    assert not m3.fused_gelu  # off by default
    _same(fused, default)
    monkeypatch.setenv("LLMC_FUSED_GELU", "1")
    m5, env = _train(FakeCudaBackend(quiet=True, precision=precision), fuse_gelu=None)
    assert m5.fused_gelu
    monkeypatch.setenv("LLMC_FUSED_GELU", "0")
    assert not _train(FakeCudaBackend(quiet=True, precision=precision), fuse_gelu=None, steps=1)[0].fused_gelu
    _same(fused, env)
    if precision == "fp32":
        m4, cpu = _train(CpuBackend(np.float32))
        assert m4.fused_gelu  # the numpy launchers implement every form of their op
        _same(fused, cpu)


@pytest.mark.parametrize("kernels,arch", [({"matmul_forward": 7}, "sm_90"), (None, "sm_80")])
def test_a_variant_without_the_form_falls_back_to_the_pair(kernels, arch):
    """--matmul-kernel 7 (engine 4: no fused epilogue), or an A100 (9 refuses: no wgmma, so the
    default falls back to a variant without the form): mm_fc + gelu_forward, the same results."""
    be = FakeCudaBackend(kernels, quiet=True)
    be.rt.arch = arch
    m, out = _train(be)
    assert not m.fused_gelu and "mm_fc_gelu" not in m.built and m.built["mm_fc"].number != 9
    assert be.fuses("matmul_forward", dict(gelu_pre=True), N=32, C=32, OC=128, has_bias=True) is None
    _, ref = _train(FakeCudaBackend(kernels, quiet=True), fuse_gelu=False)
    _same(out, ref)


def test_recompute_0_keeps_the_fused_gelu_per_layer():
    """-r 0 keeps each layer's GELU output (written by the fused GEMM in the forward); backward
    recomputes nothing, and the gradients are the pair's."""
    be = FakeCudaBackend(quiet=True)
    m, fused = _train(be, recompute=0)
    assert m.fused_gelu and be.launches.count("gelu_forward") == 0
    _, unfused = _train(FakeCudaBackend(quiet=True), recompute=0, fuse_gelu=False)
    _same(fused, unfused)


# ----------------------------------------------------------------------------------------------
# GPU: a training step with the fusion against one without it, bit for bit

# hs = 64 (the fused attention, which has bf16 builds), C % 8 == 0 and Vp % 8 == 0 (bf16 matmuls)
GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(4, 64), (3, 37)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_fused_gelu_step_is_bit_identical(rt, precision, B, T):
    """Two steps of 2 micro-steps (graph replays after the first) with --deterministic's kernels, the
    fc GELU fused and not: losses, every gradient, the updated weights and the logits the same bits.
    (B*T = 111 rows: the fc GEMM's last row tile partly out of range.)"""
    from llmc.backend import CudaBackend
    from llmc.train import deterministic_kernels
    from tests.llmc_fixtures import train_steps
    runs = []
    for fuse in (True, False):
        be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
        m, steps, logits = train_steps(GPU_CFG, be, B, T, logits=True, fuse_gelu=fuse)
        assert m.fused_gelu == (fuse and rt.arch == "sm_90")
        runs.append([x for step in steps for x in step] + [logits])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
