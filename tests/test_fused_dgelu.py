"""The fcproj layer's backward with GELU's fused into it (matmul_backward with dgelu=True; docs/ops.md):
where the variant chosen for mmb_fcproj has the form (5, engine 5's dgelu instances), the model's
backward launches it instead of mmb_fcproj + gelu_backward: d fch = gelu'(fch) * (dout @ fcprojw)
comes out of dinp's GEMM epilogue, and fc's bias gradient as its column sums (with the fused bias
gradients; else a matmul_backward_bias pass). On by default in fp32, off in bf16 (slower there on the
H100: docs/ops.md); LLMC_FUSED_DGELU=1/0 or fuse_dgelu=True/False either way.
The form is defined as the plain op, then gelu_backward and the column sums on d fch as stored, so
on the numpy backend (whose launcher is exactly that) the two give the same bits, and on the fake GPU
backend too (tests/fake_runtime.py). The kernels against float64 and against GEMM + gelu_backward,
bit for bit: the -m gpu tests below and in tests/test_fused_bias.py.

    python -m pytest tests/test_fused_dgelu.py -q
"""

import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.bf16 import from_bf16, to_bf16
from llmc.config import GPT2Config
from llmc.model import GPT2
from llmc.ops import gemm_wgmma as gw
from tests.fake_runtime import FakeCudaBackend, FakeRuntime

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=128, num_layers=3, num_heads=2, channels=32)


def _train(be, B=2, T=16, steps=2, **kw):
    """(model, [(loss, grads)] per step, 2 micro-steps each: the fused bias sums "+=" too)."""
    rng = np.random.default_rng(7)
    kw.setdefault("fuse_gelu_recompute", False)  # (it takes dgelu's place where both apply)
    m = GPT2(CFG, be, B, T, **kw)
    m.init_params(11)
    m.stochastic_rounding = False
    m.grad_accum_steps = 2
    out = []
    for step in range(1, steps + 1):
        m.zero_grad()
        losses = []
        for _ in range(2):
            x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
            y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
            losses.append(m.forward(x, y))
            m.backward()
        out.append((losses, np.asarray(m.get_grads(), np.float32).copy()))
        m.update(lr=1e-3, step=step)
    return m, out


def _same(a, b):
    for (la, ga), (lb, gb) in zip(a, b):
        assert la == lb
        np.testing.assert_array_equal(ga, gb)


def test_fused_by_default_and_the_same_bits_as_the_pair(monkeypatch):
    """fp32 on the fake GPU backend: the default variant (5) takes the form, mmb_fcproj_dgelu is built
    from it (prefer=) with dgelu, and no gelu_backward runs; fc's bias gradient comes from its column
    sums (the only bias passes: qkv's L per micro-step). fuse_dgelu=False, LLMC_FUSED_DGELU=0 and
    fuse_bias=False: the pair / a bias pass. Losses and gradients: the same bits every way, and the
    numpy backend's."""
    L = CFG.num_layers
    monkeypatch.delenv("LLMC_FUSED_DGELU", raising=False)
    be = FakeCudaBackend(quiet=True)
    m, fused = _train(be)
    assert m.fused_dgelu and m.fused_bias == {"layernorm_backward": True, "gelu_backward": True,
                                                 "attention_backward": False}
    b = m.built["mmb_fcproj_dgelu"]
    assert b.number == 5 and b.shape == dict(N=32, C=128, OC=32, dgelu=True)
    assert "mmb_fcproj" not in m.built  # (the plain form, which the backward no longer launches, is not built)
    assert "gelu_backward_colsum" not in m.built and "bias_4C" not in m.built
    assert be.launches.count("gelu_backward") == 0
    assert be.launches.count("matmul_backward_bias") == L * 2 * 2   # qkv's only, 2 steps x 2 micro-steps
    be2 = FakeCudaBackend(quiet=True)
    m2, pair = _train(be2, fuse_dgelu=False)
    assert not m2.fused_dgelu and "mmb_fcproj_dgelu" not in m2.built
    assert be2.launches.count("gelu_backward") == L * 2 * 2
    _same(fused, pair)
    monkeypatch.setenv("LLMC_FUSED_DGELU", "0")
    m3, env = _train(FakeCudaBackend(quiet=True))
    assert not m3.fused_dgelu
    _same(fused, env)
    monkeypatch.delenv("LLMC_FUSED_DGELU")
    be4 = FakeCudaBackend(quiet=True)
    m4, nobias = _train(be4, fuse_bias=False)
    assert m4.fused_dgelu and m4.fused_bias == {"layernorm_backward": False, "gelu_backward": False,
                                                   "attention_backward": False}
    assert "bias_4C" in m4.built and be4.launches.count("matmul_backward_bias") == 4 * L * 2 * 2
    _same(fused, nobias)
    m5, cpu = _train(CpuBackend(np.float32))
    assert m5.fused_dgelu  # the numpy launchers implement every form of their op
    _same(fused, cpu)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_asking_for_dgelu_where_the_recompute_form_runs_says_so(monkeypatch, capsys, precision):
    """LLMC_FUSED_DGELU=1 (or fuse_dgelu=True) with -r 1 and gelu_backward's recompute form: the dgelu form is
    not taken, and one note says so (once a process); with -r 0 it is taken, silently; unset, no note."""
    from llmc import model as M
    monkeypatch.setattr(M, "_noted", set())
    be = FakeCudaBackend(precision=precision)
    monkeypatch.setenv("LLMC_FUSED_DGELU", "1")
    m = GPT2(CFG, be, 2, 16, recompute=1)
    assert m.fused_gelu_recompute and not m.fused_dgelu
    GPT2(CFG, be, 2, 16, recompute=2)
    out = capsys.readouterr().out
    assert out.count("LLMC_FUSED_DGELU=1 changes nothing with -r 1 or 2") == 1
    M._noted.clear()
    m = GPT2(CFG, be, 2, 16, recompute=0)
    assert m.fused_dgelu and "LLMC_FUSED_DGELU" not in capsys.readouterr().out
    monkeypatch.delenv("LLMC_FUSED_DGELU")
    GPT2(CFG, be, 2, 16, recompute=1)
    GPT2(CFG, be, 2, 16, recompute=1, fuse_dgelu=False)
    assert "LLMC_FUSED_DGELU" not in capsys.readouterr().out
    GPT2(CFG, be, 2, 16, recompute=1, fuse_dgelu=True)
    assert "changes nothing with -r 1 or 2" in capsys.readouterr().out


def test_bf16_fake_backend_fuses_and_stays_close():
    """bf16 on the fake GPU backend: off by default, fused when asked. Its stand-in runs the fp32 reference and rounds
    what it wrote once at the end, so the fused form's d fch is gelu' times the unrounded product where
    the pair's gelu_backward reads the rounded one (the real kernel rounds in between: bit-identical
    on the GPU, below). So here: the first step's losses equal, and each of its gradient tensors
    within a few bf16 roundings of the pair's (relative to the tensor's rms)."""
    from llmc.config import param_layout
    m, fused = _train(FakeCudaBackend(quiet=True, precision="bf16"), steps=1, fuse_dgelu=True)
    assert m.fused_dgelu
    m2, pair = _train(FakeCudaBackend(quiet=True, precision="bf16"), steps=1)
    assert not m2.fused_dgelu  # off by default in bf16
    (la, ga), (lb, gb) = fused[0], pair[0]
    assert la == lb
    assert not np.array_equal(ga, gb)  # (the stand-in's difference is real: this test would see a wrong form)
    for name, off, size in param_layout(CFG):
        a, b = ga[off:off + size].astype(np.float64), gb[off:off + size].astype(np.float64)
        rms = float(np.sqrt(np.mean(b ** 2))) + 1e-30
        assert np.all(np.abs(a - b) <= 0.05 * rms + 2.0 ** -6 * np.abs(b)), (name, float(np.max(np.abs(a - b))), rms)


@pytest.mark.parametrize("kernels,arch", [({"matmul_backward": 3}, "sm_90"), (None, "sm_80")])
def test_a_variant_without_the_form_falls_back_to_the_pair(kernels, arch):
    """--matmul-backward-kernel 3 (engine 4), or an A100 (5 refuses: no wgmma): mmb_fcproj +
    gelu_backward, the same results."""
    be = FakeCudaBackend(kernels, quiet=True)
    be.rt.arch = arch
    m, out = _train(be)
    assert not m.fused_dgelu and "mmb_fcproj_dgelu" not in m.built and m.built["mmb_fcproj"].number != 5
    assert be.launches.count("gelu_backward") > 0
    _, ref = _train(FakeCudaBackend(kernels, quiet=True), fuse_dgelu=False)
    _same(out, ref)


def test_the_gpu_tests_run_on_the_fake_backend():
    """The GPU step test's run (tests/llmc_fixtures.py: train_steps, graph replays after the first
    micro-step), here on the fake GPU backend in fp32: fused and not, with and without the fused bias
    gradients, the same bits at every step (the numpy launchers sum exactly what the pair sums)."""
    from tests.llmc_fixtures import train_steps
    for fuse_bias in (True, False):
        runs = []
        for dg in (True, False):
            be = FakeCudaBackend(quiet=True)
            m, steps, logits = train_steps(CFG, be, 2, 16, logits=True, fuse_dgelu=dg, fuse_bias=fuse_bias,
                                           fuse_gelu_recompute=False)
            # graphs: the first micro-step after zero_grad (first_write), the later ones, the update
            assert m.fused_dgelu == dg and be.graphs == 3 and len(steps) == 2 and logits.shape[:2] == (2, 16)
            runs.append([x for step in steps for x in step] + [logits])
        for a, b in zip(*runs):
            np.testing.assert_array_equal(a, b)


def test_inference_models_build_no_backward_form():
    m = GPT2(CFG, CpuBackend(np.float32), 2, 16, training=False)
    assert not m.fused_dgelu and "mmb_fcproj_dgelu" not in m.built


# ----------------------------------------------------------------------------------------------
# the engine's instances and launcher (CPU: the fake runtime checks entry points and argtypes against
# the PTX)


def test_dgelu_instance_table_matches_the_kernels():
    """DGELU_INSTANCES against the .cu's GEMM_WGMMA_DGELU_ENTRY lines: names, types, stages (the plain
    TMA-store instances' own), layouts; every one fits in 227 KB with its two extra mbarriers."""
    from tests.llmc_fixtures import wgmma_entries
    entries = wgmma_entries("GEMM_WGMMA_DGELU_ENTRY")
    ctype = {"tf32": "float", "bf16": "__nv_bfloat16", "fp32": "float"}
    want = {}
    for (ty, out, layout), widths in gw.DGELU_INSTANCES.items():
        # (the plain TMA-store instances' stages; dinp's 256-wide tile has no dgelu twin)
        assert widths == {bn: st for bn, st in gw.INSTANCES[(ty, out, layout, True)].items() if bn != 256}
        for bn, stages in widths.items():
            want[gw.instance_name(ty, out, layout, True, bn, dgelu=True)] = (ctype[ty], ctype[out], bn, stages,
                                                                            layout == "kn")
            assert gw.smem_bytes(bn, stages, True, out) <= 227 * 1024
    assert entries == want and len(want) == 4


@pytest.mark.parametrize("dtype,out,kw,want", [
    ("tf32", "fp32", dict(), "gemm_wgmma_tf32_n128_ts_dgelu"),   # (fp32 out: TS_BN_EFF prefers 128 here)
    ("tf32", "fp32", dict(bn=192), "gemm_wgmma_tf32_n192_ts_dgelu"),
    ("bf16", "bf16", dict(b_major="n"), "gemm_wgmma_bf16_n192_bt_ts_dgelu_bf16"),
])
def test_dgelu_builds_pick_their_instance(monkeypatch, dtype, out, kw, want):
    """fcproj's dinp at B=16 (M=16384, N=3072, K=768): the dgelu instance, and with a colsum the
    finishing kernel after it; P's map is the fourth."""
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, dtype, 16384, 3072, 768, out=out, dgelu=True, colsum=True, **kw)
    assert rt.built[0] == want and g.plan[1].endswith("+dgelu") and g.plan[2] == 1
    monkeypatch.setattr(gw, "tensor_map", lambda *a: bytes(128))
    C, P, dbias = rt.empty((16384, 3072)), rt.empty((16384, 3072)), rt.empty((3072,))
    A, B = rt.empty((16384, 768)), rt.empty((768, 3072) if kw.get("b_major") == "n" else (3072, 768))
    g(C, A, B, P, dbias)
    assert [L.func for L in rt.launches[-2:]] == [want, "gemm_wgmma_colsum_finish" + ("_bf16" if out == "bf16" else "")]
    assert C.ptr in rt.launches[-2].args and dbias.ptr in rt.launches[-1].args
    g(C, A, B, P)   # no column sums: the GEMM alone
    assert rt.launches[-1].func == want and rt.launches[-1].args[5] == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_op_launches_dinp_with_the_epilogue_then_dweight(monkeypatch, dtype):
    """matmul_backward 5 with dgelu on the fake runtime, d12's fcproj at B=4: fp32 transposes the
    weight, runs the dgelu GEMM on it and the column sums' finish, then dweight as the plain form
    (transpose, the M-major GEMM); bf16 the dgelu GEMM on the weight as it lies, the finish, dweight.
    Without dbias no finish runs."""
    from llmc import ops
    monkeypatch.setattr(gw, "tensor_map", lambda *a: bytes(128))
    rt = FakeRuntime()
    N, C, OC = 4096, 3072, 768
    launch = ops.get("matmul_backward").build(rt, 5, dtype, N=N, C=C, OC=OC, dgelu=True)
    arrays = [rt.empty(s) for s in ((N, C), (OC, C), (N, OC), (N, C), (OC, C), (N, C), (C,))]
    launch(*arrays)
    names = [L.func for L in rt.launches]
    sfx = "_bf16" if dtype == "bf16" else ""
    want = (["transpose_kernel", "gemm_wgmma_tf32_n128_ts_dgelu", "gemm_wgmma_colsum_finish", "transpose_kernel"]
            if dtype == "fp32" else ["gemm_wgmma_bf16_n192_bt_ts_dgelu_bf16", "gemm_wgmma_colsum_finish_bf16"])
    assert names[:len(want)] == want and len(names) == len(want) + 1, names
    assert arrays[-1].ptr in rt.launches[len(want) - (2 if dtype == "fp32" else 1)].args  # dbias to the finish
    n0 = len(rt.launches)
    launch(*arrays[:-1])
    assert not any("colsum" in L.func for L in rt.launches[n0:]) and rt.launches[n0 + (1 if sfx == "" else 0)].args[5] == 0


@pytest.mark.parametrize("kw,why", [(dict(beta=1.0), "beta = 0"), (dict(trans_c=True), "not transposed"),
                                    (dict(has_bias=True), "no bias"),
                                    (dict(dtype="bf16", out="bf16"), "dinp's layouts"),
                                    (dict(splits=2), "one K split"), (dict(store="direct"), "one K split"),
                                    (dict(ldc=258), "16-byte rows"), (dict(colsum=True, dgelu=False), "comes with")])
def test_dgelu_refusals(kw, why):
    from llmc.errors import LLMCError
    dtype = kw.pop("dtype", "tf32")
    kw.setdefault("dgelu", True)
    with pytest.raises(LLMCError, match=why):
        gw.wgmma_build(FakeRuntime(), dtype, 256, 256, 256, **kw)


# ----------------------------------------------------------------------------------------------
# GPU: the kernels


@pytest.fixture(scope="module")
def hopper(rt):
    if rt.arch != "sm_90":
        pytest.skip(f"engine 5 needs sm_90a (this GPU is {rt.arch})")
    return rt


def _case(rt, rng, dtype, M, N, K, bn=None):
    """dinp's GEMM in the model's layout (tf32: B = weight^T, K-major; bf16: B = weight, N-major) with
    the dgelu epilogue and column sums, and the plain GEMM on the same operands; outputs poisoned.
    Returns (fused C, plain C, colsum as DevArrays, the colsum's start value, P's values, the plan)."""
    from llmc.bf16 import BF16
    from llmc.testing import poison
    bf = dtype == "bf16"
    A = rng.standard_normal((M, K)).astype(np.float32)
    W = (rng.standard_normal((K, N)) * K ** -0.5).astype(np.float32)   # weight (OC=K, C=N): C ~ N(0, 1)
    P = (rng.standard_normal((M, N)) * 1.5).astype(np.float32)          # the pre-activation, GELU's curved part
    cs0 = rng.standard_normal(N).astype(np.float32)
    if bf:
        A, W, P, cs0 = (from_bf16(to_bf16(x)) for x in (A, W, P, cs0))
        dev = lambda x: rt.to_device(to_bf16(x))  # noqa: E731
    else:
        dev = rt.to_device
    dA, dP, dcs = dev(A), dev(P), dev(cs0)
    dB = dev(W) if bf else dev(np.ascontiguousarray(W.T))
    kw = dict(b_major="n", out="bf16", ldb=N) if bf else {}
    C, C2 = (rt.empty((M, N), BF16 if bf else np.float32) for _ in range(2))
    poison(C, C2)
    fused = gw.wgmma_build(rt, dtype, M, N, K, dgelu=True, colsum=True, bn=bn, **kw)
    fused(C, dA, dB, dP, dcs)
    plain = gw.wgmma_build(rt, dtype, M, N, K, store="tma", bn=bn, **kw)
    plain(C2, dA, dB)
    return C, C2, dcs, cs0, P, A.astype(np.float64) @ W.astype(np.float64), fused.plan


def _values(x):
    h = x.get()
    return (from_bf16(h) if h.dtype == np.uint16 else h).astype(np.float64)


# odd M and N (the last tiles partly out of range; N % 8 == 0 for 16-byte rows of bf16 C), K = 16 (one
# k-block, partly zero-filled), more tiles than SMs (the staging buffer reused across a CTA's tiles)
DGELU_SHAPES = [(1, 8, 16), (200, 136, 16), (129, 200, 72), (65, 392, 768), (2048, 3072, 64), (1100, 3000, 136)]


@pytest.mark.gpu
@pytest.mark.parametrize("bn", [128, 192])
@pytest.mark.parametrize("dtype", ["tf32", "bf16"])
@pytest.mark.parametrize("M,N,K", DGELU_SHAPES)
def test_dgelu_epilogue_matches_float64_and_gelu_backward(hopper, rng, dtype, M, N, K, bn):
    """C against float64 (gelu'(P) times the float64 product, the GEMM's own tolerance), every element
    written (poisoned first); bit for bit gelu_backward (variants 1 and 2, the same precision) run on
    the plain GEMM's output; the column sums against float64 sums of C as stored."""
    from llmc import ops
    from llmc.ops.gelu import gelu_backward_ref
    from llmc.testing import poison
    if dtype == "tf32" and N % 4 or dtype == "bf16" and N % 8:
        pytest.skip("16-byte rows of C")
    C, C2, dcs, cs0, P, prod, plan = _case(hopper, rng, dtype, M, N, K, bn)
    assert plan[1] == f"128x{bn}+ts{'+bt' if dtype == 'bf16' else ''}+dgelu"
    c = _values(C)
    assert np.isfinite(c).all(), "unwritten (NaN-poisoned) outputs"
    ref = gelu_backward_ref(P.astype(np.float64), prod)
    err = np.abs(c - ref).max() / (np.abs(ref).max() + 1e-30)
    assert err < (1.5e-2 if dtype == "bf16" else 3e-3), err
    for v in (1, 2):
        G = hopper.empty(C2.shape, C2.dtype)
        poison(G)
        dP = hopper.to_device(to_bf16(P) if dtype == "bf16" else P)
        ops.get("gelu_backward").build(hopper, v, "bf16" if dtype == "bf16" else "fp32", N=M * N)(G, dP, C2)
        assert np.array_equal(G.get(), C.get()), f"gelu_backward {v}"
    cs = _values(dcs)
    want = cs0.astype(np.float64) + c.sum(axis=0)
    tol = (2.0 ** -7 * np.abs(want) + 1e-2 * np.sqrt(M)) if dtype == "bf16" else (5e-5 * np.abs(c).sum(axis=0) + 1e-5)
    assert np.all(np.abs(cs - want) <= tol), float(np.max(np.abs(cs - want)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["tf32", "bf16"])
def test_dgelu_is_deterministic(hopper, dtype):
    """Twice from the same inputs: the same bits in C and in the column sums (fixed summation order)."""
    outs = []
    for _ in range(2):
        C, _, dcs, _, _, _, _ = _case(hopper, np.random.default_rng(3), dtype, 1100, 3000, 136)
        outs.append((C.get(), dcs.get()))
    assert np.array_equal(outs[0][0], outs[1][0]) and np.array_equal(outs[0][1], outs[1][1])


GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(4, 64), (3, 37)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_fused_dgelu_step(rt, precision, B, T):
    """Two steps of 2 micro-steps (graph replays after the first) with --deterministic's kernels, the
    dgelu fused and not, fused bias gradients both: losses equal and every gradient within the bias
    sums' order (the fused column sums add 64-row partials, gelu_backward's fused form other chunks:
    fp32 1e-5 of the rms, bf16 a rounding of a bias element; the second step after one AdamW update,
    1e-2 of the rms: see tests/test_fused_bias.py); with the bias passes (fuse_bias=False) both
    forms sum d fch with matmul_backward_bias: the same bits. (B*T = 111: the last row tile partly
    out of range.)"""
    from llmc.backend import CudaBackend
    from llmc.config import param_layout
    from llmc.train import deterministic_kernels
    from tests.llmc_fixtures import train_steps
    for fuse_bias in (True, False):
        runs = []
        for dg in (True, False):
            be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
            m, steps, _ = train_steps(GPU_CFG, be, B, T, fuse_dgelu=dg, fuse_bias=fuse_bias,
                                      fuse_gelu_recompute=False)
            assert m.fused_dgelu == (dg and rt.arch == "sm_90")
            runs.append([(loss, grads) for loss, grads, _ in steps])
        for step, ((la, ga), (lb, gb)) in enumerate(zip(*runs)):
            if not fuse_bias:
                assert la == lb
                np.testing.assert_array_equal(ga, gb)
                continue
            if step == 0:
                assert la == lb
            for name, off, size in param_layout(GPU_CFG):
                a, b = ga[off:off + size].astype(np.float64), gb[off:off + size].astype(np.float64)
                rms = float(np.sqrt(np.mean(b ** 2))) + 1e-30
                if precision == "fp32":
                    atol, rtol = (1e-5 * rms, 1e-5) if step == 0 else (1e-2 * rms, 1e-2)
                else:
                    atol, rtol = 1e-2 * rms, 2.0 ** -7
                assert np.all(np.abs(a - b) <= atol + rtol * np.abs(b)), (precision, step, name)
