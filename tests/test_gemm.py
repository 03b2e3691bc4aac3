"""The GEMM engines (llmc/ops/gemm.py, cuda/gemm.cu): the reference vs torch, the TF32 planner and
the fallbacks on the tests' fake runtime (CPU), and every engine, layout and tile config against the
float64 reference on odd shapes, random and small-integer inputs (-m gpu).

    python -m pytest tests/test_gemm.py -q            # CPU part (CI)
    python -m pytest tests/test_gemm.py -q -m gpu     # GPU part
"""
import numpy as np
import pytest

from llmc.errors import LLMCError
from llmc.ops import gemm as mm


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def ints(rng, *shape, lim=8, scale=None):
    return rng.integers(-lim, lim + 1, shape).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# CPU


@pytest.mark.parametrize("transA,transB", [(False, False), (False, True), (True, False), (True, True)])
def test_gemm_ref_matches_torch(rng, transA, transB):
    torch = pytest.importorskip("torch")
    b, M, N, K = 3, 5, 7, 4
    A = rng.standard_normal((b, K, M) if transA else (b, M, K))
    B = rng.standard_normal((b, N, K) if transB else (b, K, N))
    C, bias = rng.standard_normal((b, M, N)), rng.standard_normal(N)
    ta, tb = torch.tensor(A), torch.tensor(B)
    want = 0.5 * ((ta.transpose(1, 2) if transA else ta) @ (tb.transpose(1, 2) if transB else tb)) \
        - 2.0 * torch.tensor(C) + torch.tensor(bias)
    got = mm.gemm_ref(A, B, C, transA, transB, alpha=0.5, beta=-2.0, bias=bias)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


TRAINER_GEMMS = [(4096, 2304, 768, 1), (4096, 768, 768, 1), (4096, 3072, 768, 1), (4096, 768, 3072, 1),
                 (4096, 50304, 768, 1), (768, 768, 4096, 1), (50304, 768, 4096, 1), (1024, 1024, 64, 48),
                 (1024, 64, 1024, 48), (65, 1, 80, 1), (1, 1, 1, 1), (3, 5, 100000, 1)]


@pytest.mark.parametrize("M,N,K,batch", TRAINER_GEMMS)
def test_tf32_plan(M, N, K, batch):
    for vec, lay, engine in ((4, "nt", 2), (4, "tn", 2), (1, "nn", 3), (4, "nt", 4), (4, "tn", 4), (4, "nn", 4)):
        cfg, splits = mm._tf32_plan(132, M, N, K, batch, vec, lay, engine)
        assert cfg in mm.TF32_CONFIGS and (vec == 4 or cfg == "small") and (cfg, lay) != ("mid8", "tn")
        assert engine != 4 or cfg in mm.E4_CONFIGS
        KT = -(-K // 32)
        assert 1 <= splits <= KT
        kts = -(-KT // splits)
        assert (splits - 1) * kts < KT  # no empty split


def FakeRuntime():
    """Records launches (tests/fake_runtime.py): enough to test the builders' planning and fallbacks."""
    from tests.fake_runtime import FakeRuntime as Fake
    rt = Fake()
    rt.log = _LaunchLog(rt)
    return rt


class _LaunchLog:
    """rt.log[-1] == (kernel name, grid, block, args) of the latest launch."""

    def __init__(self, rt):
        self.rt = rt

    def __getitem__(self, i):
        x = self.rt.launches[i]
        return (x.func, x.grid, x.block, x.args)


def test_gemm_build_fallbacks(capsys):
    rt = FakeRuntime()
    # engine 2 with an odd leading dim -> engine 3, one line
    g = mm.gemm_build(rt, 2, False, False, M=65, N=1, K=80)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "falling back to engine 3" in out
    g(4096, 8192, 12288)
    assert rt.log[-1][0] == "gemm_tf32_small_v1_nn"
    # aligned -> engine 2; a misaligned pointer at launch -> engine 3, said once
    g = mm.gemm_build(rt, 2, True, False, M=64, N=64, K=64, batch=2, strideA=4096, strideB=4096, strideC=4096)
    g(4096, 8192, 12288)
    assert rt.log[-1][0].startswith("gemm_tf32_") and "_v4_tn" in rt.log[-1][0]
    assert rt.log[-1][1][2] == 2  # batch in grid.z
    capsys.readouterr()
    g(4096, 8196, 12288)
    g(4096, 8196, 12288)
    assert rt.log[-1][0] == "gemm_tf32_small_v1_tn"
    assert capsys.readouterr().out.count("using engine 3") == 1
    # split-K: main kernel then the reduce
    g = mm.gemm_build(rt, 2, True, False, M=768, N=768, K=4096, beta=1.0, config="mid", splits=4)
    g(4096, 8192, 12288)
    assert rt.log[-2][0] == "gemm_tf32_mid_v4_tn" and rt.log[-2][1] == (6, 6, 4)
    assert rt.log[-1][0] == "gemm_splitk_reduce"
    with pytest.raises(LLMCError, match="leading dims too small"):
        mm.gemm_build(rt, 1, False, False, M=4, N=4, K=4, lda=3)
    with pytest.raises(LLMCError, match="no engine 7"):
        mm.gemm_build(rt, 7, False, False, M=4, N=4, K=4)


def test_gemm_build_engine4(capsys):
    rt = FakeRuntime()
    # its own entry points, engine 2's planner over the configs it builds
    for lay in ("nn", "nt", "tn", "tt"):
        g = mm.gemm_build(rt, 4, lay[0] == "t", lay[1] == "t", M=4096, N=2304, K=768)
        g(4096, 8192, 12288)
        assert rt.log[-1][0] == f"gemm_tf32_e4_{g.plan[1]}_{lay}" and g.plan[0] == 4
        assert g.plan[1] == mm._tf32_plan(132, 4096, 2304, 768, 1, 4, lay, 4)[0]
    assert capsys.readouterr().out == ""
    # an odd leading dim -> engine 3, one line
    g = mm.gemm_build(rt, 4, False, False, M=65, N=1, K=80)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "gemm engine 4 refuses" in out and "falling back to engine 3" in out
    g(4096, 8192, 12288)
    assert rt.log[-1][0] == "gemm_tf32_small_v1_nn"
    # a misaligned pointer at launch -> engine 3, said once
    g = mm.gemm_build(rt, 4, False, True, M=64, N=64, K=64, batch=2, strideA=4096, strideB=4096, strideC=4096)
    g(4096, 8192, 12288)
    assert rt.log[-1][0].startswith("gemm_tf32_e4_") and rt.log[-1][1][2] == 2
    g(4096, 8196, 12288)
    g(4096, 8196, 12288)
    assert rt.log[-1][0] == "gemm_tf32_small_v1_nt"
    assert capsys.readouterr().out.count("gemm engine 4: pointers not 16-byte aligned") == 1
    # split-K: main kernel then the reduce; every config it builds can be forced
    g = mm.gemm_build(rt, 4, True, False, M=768, N=768, K=4096, beta=1.0, config="big", splits=3)
    g(4096, 8192, 12288)
    assert rt.log[-2][0] == "gemm_tf32_e4_big_tn" and rt.log[-2][1] == (6, 3, 3)
    assert rt.log[-1][0] == "gemm_splitk_reduce"
    for cfg in mm.E4_CONFIGS:
        mm.gemm_build(rt, 4, False, True, M=256, N=256, K=64, config=cfg)(4096, 8192, 12288)
        assert rt.log[-1][0] == f"gemm_tf32_e4_{cfg}_nt"
    with pytest.raises(LLMCError, match="engine 4 has no TF32 config 'mid8'"):
        mm.gemm_build(rt, 4, False, True, M=256, N=256, K=64, config="mid8")
    # row steps are 32-bit byte counts in its loader: huge leading dims go to engine 3
    assert "2^24" in mm.gemm_check(4, False, False, 4, 4, 4, 1, 1 << 24, 4, 4, 0, 0, 0)
    assert mm.gemm_check(2, False, False, 4, 4, 4, 1, 1 << 24, 4, 4, 0, 0, 0) is None


# ----------------------------------------------------------------------------------------------
# GPU


from llmc.testing import check_matmul as check, tf32_close  # noqa: E402


GEMM_CASES = [
    (65, 1, 80, 1, False, {}),
    (65, 12, 80, 3, True, {}),
    (33, 70, 129, 2, False, {}),
    (130, 96, 81, 2, True, {}),                       # K % 4 != 0 with aligned ld: partial 16-byte copies
    (1024, 64, 1024, 4, False, {}),                   # attention's att @ v shape
    (1024, 1024, 64, 2, False, {}),                   # attention's q @ k^T shape
    (768, 200, 4096, 1, False, dict(splits=4, config="mid")),  # split-K
    (300, 520, 1000, 2, True, dict(splits=3, config="big")),   # split-K, batched, edges
    (4096, 2304, 768, 1, False, {}),                  # full size
]


@pytest.mark.gpu
@pytest.mark.parametrize("engine", sorted(mm.ENGINES))  # every engine registered (llmc/ops/gemm.py)
@pytest.mark.parametrize("lay", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: "x".join(map(str, c[:4])) + ("p" if c[4] else ""))
@pytest.mark.parametrize("integers", [False, True], ids=["random", "ints"])
def test_gemm_gpu(rt, rng, engine, lay, case, integers):
    from llmc.testing import poison
    M, N, K, batch, padded, kw = case
    if M * N * K * batch > 2e8 and (engine, lay) not in ((2, "nt"), (2, "nn"), (2, "tn"), (4, "nt"), (4, "nn"),
                                                         (4, "tn"), (1, "nt")):
        pytest.skip("full size: engines 2 and 4's trainer layouts and one SIMT layout (the float64 reference is slow)")
    if engine not in (2, 4) and kw:
        kw = {}
    transA, transB = lay[0] == "t", lay[1] == "t"
    ra, ca = (K, M) if transA else (M, K)
    rb, cb = (N, K) if transB else (K, N)
    pad = 4 if padded else 0
    lda, ldb, ldc = ca + pad, cb + pad, N + pad
    sA, sB, sC = ra * lda + pad * 8, rb * ldb + pad * 8, M * ldc + pad * 8
    mk = ints if integers else rnd
    Abuf, Bbuf = mk(rng, batch * sA), mk(rng, batch * sB, scale=K ** -0.5)
    C0 = mk(rng, batch * sC)
    bias = mk(rng, N)
    A = np.stack([Abuf[b * sA: b * sA + ra * lda].reshape(ra, lda)[:, :ca] for b in range(batch)])
    B = np.stack([Bbuf[b * sB: b * sB + rb * ldb].reshape(rb, ldb)[:, :cb] for b in range(batch)])
    Cin = np.stack([C0[b * sC: b * sC + M * ldc].reshape(M, ldc)[:, :N] for b in range(batch)])
    d_A, d_B, d_C, d_bias = rt.to_device(Abuf), rt.to_device(Bbuf), rt.empty((batch * sC,)), rt.to_device(bias)
    tf32 = engine in (2, 3, 4)
    for alpha, beta, has_bias in [(1.0, 0.0, False), (0.5, -2.0, True)]:
        ref = mm.gemm_ref(A.astype(np.float64), B.astype(np.float64), Cin.astype(np.float64), transA, transB,
                          alpha, beta, bias.astype(np.float64) if has_bias else None)
        g = mm.gemm_build(rt, engine, transA, transB, M, N, K, batch=batch, lda=lda, ldb=ldb, ldc=ldc,
                          strideA=sA, strideB=sB, strideC=sC, alpha=alpha, beta=beta, has_bias=has_bias, **kw)
        if beta == 0.0:
            poison(d_C)
        else:
            d_C.set(C0)
        g(d_C, d_A, d_B, d_bias if has_bias else None)
        Cout = d_C.get()
        got = np.stack([Cout[b * sC: b * sC + M * ldc].reshape(M, ldc)[:, :N] for b in range(batch)])
        check(got, ref, tf32, f"gemm {engine} {lay} {case} alpha={alpha} beta={beta}", exact=integers)
        if beta != 0.0:  # the padding between rows/batches is never written
            mask = np.ones(batch * sC, bool)
            for b in range(batch):
                mask[b * sC: b * sC + M * ldc].reshape(M, ldc)[:, :N] = False
            assert np.array_equal(Cout[mask], C0[mask]), "gemm wrote outside C"


@pytest.mark.gpu
@pytest.mark.parametrize("engine", [2, 4])
def test_gemm_misaligned_pointer_falls_back(rt, rng, capsys, engine):
    M, N, K = 64, 32, 48
    A, B = rnd(rng, M * K + 1), rnd(rng, K * N)
    d_A, d_B, d_C = rt.to_device(A), rt.to_device(B), rt.empty((M * N,))
    g = mm.gemm_build(rt, engine, False, False, M, N, K)
    g(d_C, d_A.view(1, (M * K,)), d_B)
    assert "using engine 3" in capsys.readouterr().out
    tf32_close(d_C.get().reshape(M, N), A[1:].astype(np.float64).reshape(M, K) @ B.astype(np.float64).reshape(K, N),
               "gemm misaligned")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", mm.E4_CONFIGS)
@pytest.mark.parametrize("lay", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("integers", [False, True], ids=["random", "ints"])
def test_gemm_engine4_every_config_gpu(rt, rng, cfg, lay, integers):
    """Every tile config engine 4 builds, in every layout, forced (the planner picks only some of
    them): edges in M, N and K, batched, padded leading dims, split-K, bias; against float64, and
    equal to engine 2 on small integers (both exact)."""
    from llmc.testing import poison
    M, N, K, batch, pad = 200, 300, 170, 2, 4
    transA, transB = lay[0] == "t", lay[1] == "t"
    ra, ca = (K, M) if transA else (M, K)
    rb, cb = (N, K) if transB else (K, N)
    lda, ldb, ldc = ca + pad, cb + pad, N + pad
    sA, sB, sC = ra * lda + 32, rb * ldb + 32, M * ldc + 32
    mk = ints if integers else rnd
    Abuf, Bbuf, C0, bias = mk(rng, batch * sA), mk(rng, batch * sB, scale=K ** -0.5), mk(rng, batch * sC), mk(rng, N)
    A = np.stack([Abuf[b * sA: b * sA + ra * lda].reshape(ra, lda)[:, :ca] for b in range(batch)])
    B = np.stack([Bbuf[b * sB: b * sB + rb * ldb].reshape(rb, ldb)[:, :cb] for b in range(batch)])
    Cin = np.stack([C0[b * sC: b * sC + M * ldc].reshape(M, ldc)[:, :N] for b in range(batch)])
    d_A, d_B, d_C, d_bias = rt.to_device(Abuf), rt.to_device(Bbuf), rt.empty((batch * sC,)), rt.to_device(bias)
    for splits, alpha, beta, has_bias in [(1, 1.0, 0.0, True), (2, 0.5, -2.0, False), (1, 0.5, 1.0, True)]:
        ref = mm.gemm_ref(A.astype(np.float64), B.astype(np.float64), Cin.astype(np.float64), transA, transB,
                          alpha, beta, bias.astype(np.float64) if has_bias else None)
        outs = []
        for engine in (4, 2):
            g = mm.gemm_build(rt, engine, transA, transB, M, N, K, batch=batch, lda=lda, ldb=ldb, ldc=ldc,
                              strideA=sA, strideB=sB, strideC=sC, alpha=alpha, beta=beta, has_bias=has_bias,
                              config=cfg, splits=splits)
            if beta == 0.0:
                poison(d_C)
            else:
                d_C.set(C0)
            g(d_C, d_A, d_B, d_bias if has_bias else None)
            Cout = d_C.get()
            got = np.stack([Cout[b * sC: b * sC + M * ldc].reshape(M, ldc)[:, :N] for b in range(batch)])
            outs.append(got)
            check(got, ref, True, f"gemm {engine} {cfg} {lay} splits={splits} beta={beta}", exact=integers)
            if beta != 0.0:  # the padding between rows/batches is never written
                mask = np.ones(batch * sC, bool)
                for b in range(batch):
                    mask[b * sC: b * sC + M * ldc].reshape(M, ldc)[:, :N] = False
                assert np.array_equal(Cout[mask], C0[mask]), f"gemm {engine} {cfg} {lay} wrote outside C"
        if integers:
            assert np.array_equal(outs[0], outs[1]), "engines 4 and 2 differ on exact inputs"
