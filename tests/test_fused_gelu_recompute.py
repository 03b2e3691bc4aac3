"""Backward's GELU recompute in one pass with GELU's backward (gelu_backward with colsum and
recompute=True; matmul_backward's dinp_only / dweight_only forms): with -r >= 1 and the fused bias
gradients, where the variants have the forms, the model's backward launches mmb_fcproj's dinp GEMM,
then gelu_backward's recompute form (d fch in place, fcb += its column sums, and fch_gelu = gelu(fch),
reading fch once), then the dweight GEMM on fch_gelu, instead of gelu_forward, mmb_fcproj and
gelu_backward. The same operations on the same values: the same bits on the numpy backend, the fake
GPU backend (fp32 and bf16) and, -m gpu, the GPU. LLMC_FUSED_GELU_RECOMPUTE=0 or
fuse_gelu_recompute=False: the three launches.

    python -m pytest tests/test_fused_gelu_recompute.py -q
"""
import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from tests.fake_runtime import FakeCudaBackend, FakeRuntime
from tests.llmc_fixtures import train_steps

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=128, num_layers=3, num_heads=2, channels=32)


def _same(a, b):
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_by_default_with_the_same_bits(monkeypatch, precision):
    """The default (-r 1, fused bias gradients): the recompute form, built from the chosen variants
    (prefer=), no gelu_forward in the backward (only the forward's L per micro-step), no plain or
    colsum gelu_backward, no dgelu GEMM; fuse_gelu_recompute=False and LLMC_FUSED_GELU_RECOMPUTE=0: the
    pair. Losses, gradients, updated weights and logits the same bits (and the numpy backend's in fp32)."""
    L = CFG.num_layers
    monkeypatch.delenv("LLMC_FUSED_GELU_RECOMPUTE", raising=False)
    be = FakeCudaBackend(quiet=True, precision=precision)
    m, fused, lf = train_steps(CFG, be, 2, 16, logits=True)
    assert m.fused_gelu_recompute and not m.fused_dgelu
    assert m.built["gelu_backward_colsum_rc"].shape == dict(N=32 * 128, OC=128, colsum=True, recompute=True)
    assert m.built["mmb_fcproj_dinp"].number == m.built["mmb_fcproj_dweight"].number == 5
    assert "mmb_fcproj" not in m.built and "mmb_fcproj_dgelu" not in m.built  # (never launched: not built)
    micro = 2 * 2  # train_steps: 2 steps of 2 micro-steps, each a forward and a backward
    assert be.launches.count("gelu_forward") == L * micro + L  # the forwards' (+ the logits forward)
    assert be.launches.count("gelu_backward") == L * micro       # the recompute form only
    be2 = FakeCudaBackend(quiet=True, precision=precision)
    m2, pair, lp = train_steps(CFG, be2, 2, 16, logits=True, fuse_gelu_recompute=False, fuse_dgelu=False)
    assert not m2.fused_gelu_recompute and "gelu_backward_colsum_rc" not in m2.built
    assert be2.launches.count("gelu_forward") == 2 * L * micro + L
    _same(fused, pair)
    np.testing.assert_array_equal(lf, lp)
    monkeypatch.setenv("LLMC_FUSED_GELU_RECOMPUTE", "0")
    m3, _, _ = train_steps(CFG, FakeCudaBackend(quiet=True, precision=precision), 2, 16, steps=1)
    assert not m3.fused_gelu_recompute
    if precision == "fp32":
        monkeypatch.delenv("LLMC_FUSED_GELU_RECOMPUTE")
        m4, cpu, lc = train_steps(CFG, CpuBackend(np.float32), 2, 16, logits=True)
        assert m4.fused_gelu_recompute  # the numpy launchers implement every form of their op
        _same(fused, cpu)
        np.testing.assert_array_equal(lf, lc)


@pytest.mark.parametrize("kw,kernels", [(dict(recompute=0), None), (dict(fuse_bias=False), None),
                                        ({}, {"matmul_backward": 3}), ({}, {"gelu_backward": 1})])
def test_where_it_does_not_apply(kw, kernels):
    """-r 0 (fch_gelu is kept: nothing to recompute), unfused bias gradients (the form is the colsum
    kernel's), --matmul-backward-kernel 3 (no one-GEMM forms) or --gelu-backward-kernel 1 (no colsum
    form): the plain launches, the same results as without the fusion."""
    m, out, _ = train_steps(CFG, FakeCudaBackend(kernels, quiet=True), 2, 16, **kw)
    assert not m.fused_gelu_recompute and "gelu_backward_colsum_rc" not in m.built
    _, ref, _ = train_steps(CFG, FakeCudaBackend(kernels, quiet=True), 2, 16, fuse_gelu_recompute=False, **kw)
    _same(out, ref)


def test_the_forms_refuse_and_launch_in_order(monkeypatch):
    """recompute without colsum refuses; matmul_backward 5's one-GEMM forms launch what the whole op
    launches, in two halves (fp32: the weight's transpose and dinp's GEMM, then the transpose for
    dweight and its GEMM; bf16: one GEMM each); the recompute kernel takes gout as its third pointer."""
    from llmc import ops
    from llmc.ops import gemm_wgmma as gw
    g = ops.get("gelu_backward")
    assert "colsum" in g.refuse_reason(2, "fp32", "sm_90", N=4096, recompute=True)
    assert g.refuse_reason(2, "bf16", "sm_90", N=4096, OC=128, colsum=True, recompute=True) is None
    assert "has no" in g.refuse_reason(1, "fp32", "sm_90", N=4096, OC=128, colsum=True, recompute=True)
    monkeypatch.setattr(gw, "tensor_map", lambda *a: bytes(128))
    # (N = 2048: below N160_MIN_K, where the whole op, alone on its stream, and the dweight_only form,
    # built beside=True for the side stream, take the same tile width; from K = 4096 the whole op's
    # dweight may take the 160-wide tile, which the side stream's never does)
    N, C, OC = 2048, 3072, 768
    for dtype, whole in (("fp32", ["transpose_kernel", "gemm_wgmma_tf32_n192_ts", "transpose_kernel",
                                   "gemm_wgmma_tf32_n128_am"]),
                         ("bf16", ["gemm_wgmma_bf16_n192_bt_ts_bf16", "gemm_wgmma_bf16_n128_at_bt_bf16"])):
        rt = FakeRuntime()
        mm = ops.get("matmul_backward")
        both = mm.build(rt, 5, dtype, N=N, C=C, OC=OC)
        dinp = mm.build(rt, 5, dtype, N=N, C=C, OC=OC, dinp_only=True)
        dw = mm.build(rt, 5, dtype, N=N, C=C, OC=OC, dweight_only=True)
        A = {k: rt.empty(s) for k, s in (("dinp", (N, C)), ("dw", (OC, C)), ("dout", (N, OC)), ("inp", (N, C)),
                                          ("w", (OC, C)))}
        both(A["dinp"], A["dw"], A["dout"], A["inp"], A["w"])
        n = len(rt.launches)
        dinp(A["dinp"], A["dout"], A["w"])
        dw(A["dw"], A["dout"], A["inp"])
        names = [L.func for L in rt.launches]
        assert names[n:] == names[:n], (names[:n], names[n:])
        assert [f.split("_n")[0] for f in names[:n]] == [f.split("_n")[0] for f in whole], names[:n]
        rc = g.build(rt, 2, dtype, N=N * 4, OC=128, colsum=True, recompute=True)
        gout, x = rt.empty((N * 4,)), rt.empty((N * 4,))
        rc(x, rt.empty((128,)), gout, x, x)
        assert rt.launches[-1].func == f"gelu_backward_kernel2_colsum_rc{'_bf16' if dtype == 'bf16' else ''}"
        assert rt.launches[-1].args[2] == gout.ptr


# ----------------------------------------------------------------------------------------------
# GPU

GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,OC", [(64, 512), (37, 3072), (5, 100), (1, 8)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_recompute_form_equals_gelu_forward_then_the_colsum_form(rt, dtype, rows, OC):
    """The recompute kernel against gelu_forward 2 then gelu_backward 2's colsum form on the same
    inputs, poisoned outputs: dinp, gout and colsum the same bits (OC = 100: rows not 16-byte aligned)."""
    from llmc import ops
    from llmc.bf16 import BF16, to_bf16
    from llmc.testing import poison
    rng = np.random.default_rng(rows + OC)
    N = rows * OC
    x = (rng.standard_normal(N) * 2).astype(np.float32)
    d = rng.standard_normal(N).astype(np.float32)
    c0 = rng.standard_normal(OC).astype(np.float32)
    dev = (lambda a: rt.to_device(to_bf16(a))) if dtype == "bf16" else rt.to_device  # noqa: E731
    et = BF16 if dtype == "bf16" else np.float32
    g, f = ops.get("gelu_backward"), ops.get("gelu_forward")
    rc = g.build(rt, 2, dtype, N=N, OC=OC, colsum=True, recompute=True)
    cs = g.build(rt, 2, dtype, N=N, OC=OC, colsum=True)
    fw = f.build(rt, 2, dtype, N=N) if N % 4 == 0 else f.build(rt, 1, dtype, N=N)
    dx, dd, dd2, dc, dc2 = dev(x), dev(d), dev(d), dev(c0), dev(c0)
    gout, gout2 = rt.empty((N,), et), rt.empty((N,), et)
    poison(gout, gout2)
    rc(dd, dc, gout, dx, dd)      # in place, as the model runs it
    fw(gout2, dx)
    cs(dd2, dc2, dx, dd2)
    for a, b, what in ((dd, dd2, "dinp"), (gout, gout2, "gout"), (dc, dc2, "colsum")):
        assert np.array_equal(a.get(), b.get()), what


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(4, 64), (3, 37)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_fused_recompute_step_is_bit_identical(rt, precision, B, T):
    """Two steps of 2 micro-steps (graph replays after the first) with --deterministic's kernels, the
    recompute form and the pair (dgelu off in both): losses, gradients, updated weights and logits the
    same bits."""
    from llmc.backend import CudaBackend
    from llmc.train import deterministic_kernels
    runs = []
    for rc in (True, False):
        be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
        m, steps, logits = train_steps(GPU_CFG, be, B, T, logits=True, fuse_gelu_recompute=rc, fuse_dgelu=False)
        assert m.fused_gelu_recompute == (rc and rt.arch == "sm_90")
        runs.append([x for step in steps for x in step] + [logits])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
