"""GEMM engine 5 (wgmma + TMA, sm_90a): against a float64 reference on odd shapes, with poisoned
outputs, every tile width, split-K, bias, beta and the transposed store; plus the transpose and bf16
helpers. GPU tests need a Hopper GPU (they skip elsewhere); the planner's checks run on the CPU."""
import numpy as np
import pytest

from llmc.ops import gemm_wgmma as gw

# ----------------------------------------------------------------------------------------------
# CPU: the planner and the refusals


def test_plan_fills_the_h100_at_gpt2_widths():
    # N = 768 at M = 4096: 4 tiles of 192 across x 32 down = 128 work units for 132 SMs
    assert gw.plan(132, 4096, 768, 768)[0] == 192
    for M, N, K in [(4096, 2304, 768), (4096, 50304, 768), (768, 768, 4096), (16384, 3072, 768)]:
        bn, s = gw.plan(132, M, N, K)
        assert bn in gw.BN_CHOICES and s >= 1


def test_plan_splits_short_grids():
    # dweight of attproj: 768 x 768 over K = 4096 is 24 tiles: split K to fill the SMs
    assert gw.plan(132, 768, 768, 4096)[1] > 1
    assert gw.plan(132, 768, 768, 4096, allow_split=False)[1] == 1


@pytest.mark.parametrize("dtype,lda,why", [("tf32", 766, "16 bytes"), ("bf16", 12, "16 bytes"), ("fp8", 64, "no dtype")])
def test_check_refuses(dtype, lda, why):
    assert why in gw.check(dtype, 64, 64, 64, lda, 64 if dtype != "tf32" else 768)


# ----------------------------------------------------------------------------------------------
# GPU


@pytest.fixture(scope="module")
def hopper(rt):
    if rt.arch != "sm_90":
        pytest.skip(f"engine 5 needs sm_90a (this GPU is {rt.arch})")
    return rt


def _bf16_round(x):
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return b, (b.astype(np.uint32) << 16).view(np.float32)


def _run(rt, dtype, M, N, K, rng, has_bias=False, beta=0.0, trans_c=False, bn=None, splits=None, alpha=1.0,
         store="auto", c_offset=0):
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = rng.standard_normal((N, K)).astype(np.float32)
    bias = rng.standard_normal(N).astype(np.float32) if has_bias else None
    C0 = rng.standard_normal((N, M) if trans_c else (M, N)).astype(np.float32)
    if dtype == "bf16":
        Ab, A = _bf16_round(A)
        Bb, B = _bf16_round(B)
        dA, dB = rt.to_device(Ab), rt.to_device(Bb)
    else:
        dA, dB = rt.to_device(A), rt.to_device(B)
    if c_offset:  # C starting off a 16-byte boundary: the TMA store can't take it, the direct path must
        base = rt.empty((C0.size + c_offset,), np.float32)
        dC = base.view(c_offset, C0.shape)
    else:
        dC = rt.empty(C0.shape, np.float32)
    if beta:
        dC.set(C0)
    else:
        dC.fill_bytes(0xFF)  # NaN: every element must be written
    dbias = rt.to_device(bias) if has_bias else None
    g = gw.wgmma_build(rt, dtype, M, N, K, alpha=alpha, beta=beta, has_bias=has_bias, trans_c=trans_c,
                       bn=bn, splits=splits, store=store)
    g(dC, dA, dB, dbias)
    out = dC.get()
    ref = alpha * (A.astype(np.float64) @ B.astype(np.float64).T)
    if has_bias:
        ref = ref + bias
    if trans_c:
        ref = ref.T
    if beta:
        ref = ref + beta * C0
    return out, ref, g


def _rel(out, ref):
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


# tf32: the TMA rounds each input to 10 mantissa bits (2.9e-4 at the d12 shapes); tf32t truncates
# (7.7e-4); bf16 inputs are rounded on the host, so only the fp32 accumulation differs from float64
TOL = {"tf32": 1e-3, "tf32t": 2e-3, "bf16": 1e-5}
SHAPES = [(1, 1, 8), (7, 5, 8), (65, 1, 16), (128, 192, 32), (129, 193, 36), (300, 770, 68),
          (256, 256, 1000), (1024, 768, 768)]


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["tma", "direct"])
@pytest.mark.parametrize("dtype", ["tf32", "tf32t", "bf16"])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_wgmma_matches_float64(hopper, rng, dtype, M, N, K, store):
    if dtype == "bf16" and K % 8:
        pytest.skip("bf16 rows need K % 8 == 0 (16-byte TMA strides)")
    if store == "tma" and N % 4:
        pytest.skip("the TMA store needs ldc % 4 == 0")
    out, ref, g = _run(hopper, dtype, M, N, K, rng, has_bias=True, store=store)
    assert ("+ts" in g.plan[1]) == (store == "tma")
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("bn", gw.TS_WIDTHS)
def test_wgmma_tma_store_misaligned_c_falls_back(hopper, rng, bn):
    out, ref, _ = _run(hopper, "tf32", 200, 196, 64, rng, has_bias=True, bn=bn, store="tma", c_offset=1)
    assert _rel(out, ref) < TOL["tf32"]


@pytest.mark.gpu
@pytest.mark.parametrize("bn", gw.BN_CHOICES)
@pytest.mark.parametrize("splits", [1, 3])
def test_wgmma_tile_widths_and_splits(hopper, rng, bn, splits):
    out, ref, g = _run(hopper, "tf32", 300, 517, 516, rng, has_bias=True, bn=bn, splits=splits, alpha=0.5)
    assert g.plan[2] == splits
    assert _rel(out, ref) < TOL["tf32"]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_wgmma_accumulates_with_beta(hopper, rng, splits):
    out, ref, _ = _run(hopper, "tf32", 200, 130, 1024, rng, beta=1.0, splits=splits)
    assert _rel(out, ref) < TOL["tf32"]


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_wgmma_transposed_store(hopper, rng, beta):
    out, ref, _ = _run(hopper, "tf32", 131, 67, 96, rng, beta=beta, trans_c=True)
    assert _rel(out, ref) < TOL["tf32"]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,splits,trans_c", [(2304, 768, 1024, 1, False), (131, 67, 65 * 4, 1, False),
                                                  (300, 196, 1000, 3, False), (3072, 768, 512, 1, True),
                                                  (200, 130, 520, 2, True), (1, 1, 4, 1, False)])
def test_wgmma_a_m_major(hopper, rng, M, N, K, splits, trans_c):
    """A given as A^T (K rows of M, the layout dout has for dweight = dout^T @ inp): through registers."""
    lda = -(-M // 4) * 4  # 16-byte rows for the TMA; the padding columns hold garbage that must not leak in
    At = rng.standard_normal((K, lda)).astype(np.float32)
    B = rng.standard_normal((N, K)).astype(np.float32)
    C0 = rng.standard_normal((N, M) if trans_c else (M, N)).astype(np.float32)
    dC = hopper.to_device(C0)
    g = gw.wgmma_build(hopper, "tf32", M, N, K, lda=lda, beta=1.0, a_major="m", trans_c=trans_c, splits=splits)
    assert "+am" in g.plan[1] and g.plan[2] == splits
    g(dC, hopper.to_device(At), hopper.to_device(B))
    ref = At[:, :M].T.astype(np.float64) @ B.astype(np.float64).T
    ref = (ref.T if trans_c else ref) + C0
    assert _rel(dC.get(), ref) < TOL["tf32"]


@pytest.mark.gpu
def test_wgmma_is_deterministic(hopper, rng):
    A = hopper.to_device(rng.standard_normal((500, 1024)).astype(np.float32))
    B = hopper.to_device(rng.standard_normal((300, 1024)).astype(np.float32))
    C = hopper.empty((500, 300), np.float32)
    outs = []
    for _ in range(2):
        g = gw.wgmma_build(hopper, "tf32", 500, 300, 1024, splits=4)
        C.fill_bytes(0xFF)
        g(C, A, B)
        outs.append(C.get())
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols", [(1, 1), (33, 65), (4096, 768), (7, 1000)])
def test_transpose(hopper, rng, rows, cols):
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    ld_out = -(-rows // 4) * 4
    out = hopper.empty((cols, ld_out), np.float32)
    out.fill_bytes(0xFF)
    gw.transpose_build(hopper, rows, cols, ld_out=ld_out)(out, hopper.to_device(x))
    assert np.array_equal(out.get()[:, :rows], x.T)


@pytest.mark.gpu
def test_to_bf16_rounds_to_nearest_even(hopper, rng):
    x = rng.standard_normal(1001).astype(np.float32) * 100
    bits, _ = _bf16_round(x)
    assert np.array_equal(gw.to_bf16(hopper, hopper.to_device(x)).get(), bits)


def test_tf32_rounds_in_the_copy():
    # the trainer's TF32 is the TMA's TFLOAT32 type (rounds, like engines 2-4); truncation is the lab's
    assert gw.DTYPES["tf32"][2] == 11 and gw.DTYPES["tf32t"][2] == 7
