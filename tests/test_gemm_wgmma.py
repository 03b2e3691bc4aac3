"""GEMM engine 5 (wgmma + TMA, sm_90a): against a float64 reference on odd shapes, with poisoned
outputs, every tile width, split-K, bias, beta and the transposed store; plus the transpose and bf16
helpers. GPU tests need a Hopper GPU (they skip elsewhere); the planner's checks run on the CPU."""
import collections

import numpy as np
import pytest

from llmc.bf16 import from_bf16, to_bf16
from llmc import switches
from llmc.errors import LLMCError
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
    """(bf16 bits, their values as float32) of x rounded to nearest even (llmc/bf16.py)."""
    b = to_bf16(x)
    return b, from_bf16(b)


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
@pytest.mark.parametrize("splits,store", [(1, "direct"), (1, "tma"), (4, "auto")])
def test_wgmma_accumulates_with_beta(hopper, rng, splits, store):
    """C += A @ B^T: the old C read by the direct epilogue, or loaded by the TMA into the staging buffer
    (store="tma"), or added by the split-K reduce."""
    out, ref, g = _run(hopper, "tf32", 200, 136, 1024, rng, beta=1.0, splits=splits, store=store)
    assert ("+ts" in g.plan[1]) == (store == "tma")
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


# ----------------------------------------------------------------------------------------------
# bf16 in, bf16 out (the bf16 trainer's matmuls): layouts kk (forward), kn (dinp: B^T stored),
# mn (dweight: A^T and B^T stored), read through the wgmma's transpose bits


def test_instance_table_matches_the_kernels():
    """INSTANCES (the launcher's stages, hence its shared memory) against the .cu's entry points:
    same names, input/output types, stages, TMA store and layout flags; every one fits in 227 KB."""
    import re
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "gemm_wgmma.cu").read_text()
    entries = {}
    for m in re.finditer(r"^GEMM_WGMMA_ENTRY\((\w+), ([\w:]+), ([\w:]+), (\d+), (\d+), (true|false)(.*)\)$", src, re.M):
        name, t, o, bn, stages, ts, rest = m.groups()
        flags = tuple(f.strip() == "true" for f in rest.split(",")[1:])  # A_MN, A_T, B_T
        flags = flags + (False,) * (3 - len(flags))
        entries[name] = (t, o, int(bn), int(stages), ts == "true", flags)
    want = {}
    ctype = {"tf32": "float", "bf16": "__nv_bfloat16", "fp32": "float"}
    lay_flags = {"kk": (False, False, False), "mk": (True, False, False), "kn": (False, False, True),
                 "mn": (False, True, True)}
    for (ty, out, layout, ts), widths in gw.INSTANCES.items():
        for bn, stages in widths.items():
            want[gw.instance_name(ty, out, layout, ts, bn)] = (ctype[ty], ctype[out], bn, stages, ts, lay_flags[layout])
            assert gw.smem_bytes(bn, stages, ts, out) <= 227 * 1024, (ty, out, layout, ts, bn)
    assert entries == want


def test_multicast_table_matches_the_kernels():
    """MC_INSTANCES against the .cu's GEMM_WGMMA_MC_ENTRY lines (names, stages, A^T / B^T flags of the
    layout), and every one a cluster-of-2 kernel of the TMA-store body."""
    import re
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "gemm_wgmma.cu").read_text()
    entries = {m.group(1): (int(m.group(2)), int(m.group(3)), m.group(4), m.group(5))
               for m in re.finditer(r"^GEMM_WGMMA_MC_ENTRY\((\w+), (\d+), (\d+), (true|false), (true|false)\)$",
                                    src, re.M)}
    flag = lambda b: "true" if b else "false"  # noqa: E731
    want = {gw.instance_name(ty, out, lay, True, bn, mc=True): (bn, stages, flag(lay[0] == "m"), flag(lay[1] == "n"))
            for (ty, out, lay), widths in gw.MC_INSTANCES.items() for bn, stages in widths.items()}
    assert entries == want and entries
    assert {lay for _, _, lay in gw.MC_INSTANCES} == {"mn", "kk", "kn"}
    macro = src[src.index("#define GEMM_WGMMA_MC_ENTRY"):]
    macro = macro[:macro.index("GEMM_WGMMA_MC_ENTRY(gemm")]
    assert "__cluster_dims__(2, 1, 1)" in macro and "true, false, A_T, B_T, false, false, 2>" in macro
    # the same stages as the plain TMA-store instances of the layout (the same shared memory)
    for (ty, out, lay), widths in gw.MC_INSTANCES.items():
        for bn, stages in widths.items():
            assert gw.INSTANCES[(ty, out, lay, True)][bn] == stages


def test_s4_table_matches_the_kernels():
    """S4_INSTANCES against the .cu's GEMM_WGMMA_S4_ENTRY lines (names, B^T flag), the macro's 256 wide, 4
    stages, 2 slices; every one fits in shared memory with its half-size staging, and would not with whole
    staging."""
    import re
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "gemm_wgmma.cu").read_text()
    entries = {m.group(1): m.group(2) for m in re.finditer(r"^GEMM_WGMMA_S4_ENTRY\((\w+), (true|false)\)$", src, re.M)}
    want = {gw.instance_name(ty, out, lay, True, bn, s4=True): "true" if lay[1] == "n" else "false"
            for (ty, out, lay), widths in gw.S4_INSTANCES.items() for bn in widths}
    assert entries == want and entries
    macro = src[src.index("#define GEMM_WGMMA_S4_ENTRY"):]
    macro = macro[:macro.index("GEMM_WGMMA_S4_ENTRY(gemm")]
    assert f"256, 4, true, false, false, B_T, false, false, 1, {gw.S4_PARTS}>" in macro
    for (ty, out, lay), widths in gw.S4_INSTANCES.items():
        for bn, stages in widths.items():
            assert gw.smem_bytes(bn, stages, True, out, parts=gw.S4_PARTS) <= 227 * 1024
            assert gw.smem_bytes(bn, stages, True, out) > 227 * 1024
            assert stages == gw.INSTANCES[(ty, out, lay, True)][bn] + 1


def test_s4_plans(monkeypatch):
    """LLMC_WGMMA_TS256_S4=1: the bf16 forward's and dinp's plain 256-wide TMA-store plans take the 4-stage
    instance; not with the switch off, not the fused GELU, clusters, beta, split-K or another width."""
    from tests.fake_runtime import FakeRuntime
    for var in (gw.PP128_ENV, gw.SCHEDULE_ENV, gw.BT256_ENV, gw.MC_ENV, "LLMC_WGMMA_TS_WIDTHS", "LLMC_WGMMA_TS256_MAX_K"):
        monkeypatch.delenv(var, raising=False)
    qkv = dict(M=16384, N=2304, K=768, has_bias=True, out="bf16")
    fcproj_dinp = dict(M=16384, N=3072, K=768, ldb=3072, b_major="n", out="bf16")
    monkeypatch.setenv(gw.S4_ENV, "0")
    assert gw.wgmma_build(FakeRuntime(), "bf16", **qkv).plan == (5, "128x256+ts", 1)
    monkeypatch.setenv(gw.S4_ENV, "1")
    rt = FakeRuntime()
    assert gw.wgmma_build(rt, "bf16", **qkv).plan == (5, "128x256+ts+s4", 1)
    assert rt.built[-1] == "gemm_wgmma_bf16_n256_ts_s4_bf16"
    assert gw.wgmma_build(rt, "bf16", **fcproj_dinp).plan == (5, "128x256+ts+bt+s4", 1)
    assert rt.built[-1] == "gemm_wgmma_bf16_n256_bt_ts_s4_bf16"
    assert gw.wgmma_build(rt, "bf16", **qkv, gelu=True).plan == (5, "128x256+ts+gelu", 1)
    assert gw.wgmma_build(rt, "bf16", **qkv, multicast=True).plan == (5, "128x256+ts+mc", 1)
    assert gw.wgmma_build(rt, "bf16", **qkv, bn=192).plan == (5, "128x192+ts", 1)
    assert "+s4" not in gw.wgmma_build(rt, "bf16", **qkv, beta=1.0).plan[1]
    assert "+s4" not in gw.wgmma_build(rt, "bf16", **qkv, splits=2).plan[1]


@pytest.mark.parametrize("M,bn,want_grid", [(3072, 160, 120), (768, 160, 120), (3072, 192, 96), (136, 128, 12),
                                              (16384, 192, 132)])
def test_multicast_builds_pick_the_cluster_instance(monkeypatch, M, bn, want_grid):
    """multicast=True (or LLMC_WGMMA_MC=1) takes the _mc instance and launches whole clusters: pairs of
    tiles stacked along M, at most sm_count / 2 of them."""
    from tests.fake_runtime import FakeRuntime
    N = 3072 if M == 768 else 768
    monkeypatch.setattr(gw, "tensor_map", lambda *a, **k: bytes(128))
    for how in ("arg", "env"):
        rt = FakeRuntime()
        monkeypatch.setenv(gw.MC_ENV, "1" if how == "env" else "0")
        g = gw.wgmma_build(rt, "bf16", M, N, 4096, a_major="m", b_major="n", out="bf16", beta=1.0, bn=bn,
                           store="tma", multicast=True if how == "arg" else None)
        assert g.plan == (5, f"128x{bn}+ts+at+bt+mc", 1)
        g(rt.empty((M, N), np.uint16), rt.empty((4096, M), np.uint16), rt.empty((4096, N), np.uint16))
        name, grid = rt.launches[-1].func, rt.launches[-1].grid
        assert name == f"gemm_wgmma_bf16_n{bn}_at_bt_ts_mc_bf16"
        assert grid[0] == want_grid and grid[0] % 2 == 0
    monkeypatch.setenv(gw.MC_ENV, "0")
    g = gw.wgmma_build(FakeRuntime(), "bf16", M, N, 4096, a_major="m", b_major="n", out="bf16", beta=1.0, bn=bn,
                       store="tma")
    assert "+mc" not in g.plan[1]


@pytest.mark.parametrize("kw", [dict(store="direct"), dict(splits=2, store="direct"),
                                dict(a_major="k", b_major="n", bn=192), dict(a_major="k", b_major="k", bn=128),
                                dict(a_major="k", b_major="k", bn=256, gelu=True, beta=0.0)])
def test_multicast_refuses_what_is_not_built(kw):
    from tests.fake_runtime import FakeRuntime
    args = dict(a_major="m", b_major="n", out="bf16", beta=1.0)
    args.update(kw)
    with pytest.raises(LLMCError, match="multicast=True"):
        gw.wgmma_build(FakeRuntime(), "bf16", 3072, 768, 4096, multicast=True, **args)
    args["multicast"] = None  # the environment's default leaves such plans as they are
    gw.wgmma_build(FakeRuntime(), "bf16", 3072, 768, 4096, **args)


@pytest.mark.parametrize("layout,M,N,K,want_grid", [("kk", 16384, 768, 3072, 132), ("kn", 16384, 768, 3072, 132),
                                                     ("kk", 300, 2304, 768, 36), ("kn", 136, 520, 3072, 6)])
def test_multicast_256_forward_and_dinp(monkeypatch, layout, M, N, K, want_grid):
    """The forward's (K-major) and dinp's (B N-major) 256-wide tile in clusters: multicast=True or
    LLMC_WGMMA_MC=1 takes the _mc instance, whole pairs of tiles stacked along M (an odd number of tile
    rows rounds up to pairs); a K-major B's map has boxes of 128 rows (each CTA loads half of B's 256),
    B N-major keeps its 64-wide boxes; without multicast the box is the whole 256."""
    from tests.fake_runtime import FakeRuntime
    boxes = []
    monkeypatch.setattr(gw, "tensor_map", lambda *a, **k: (boxes.append(a), bytes(128))[1])
    kw = dict(b_major=layout[1], out="bf16", bn=256, store="tma", has_bias=layout == "kk")
    if layout == "kn":
        kw["ldb"] = N
    for mc in (True, False):
        for how in ("arg", "env"):
            rt = FakeRuntime()
            monkeypatch.setenv(gw.MC_ENV, "1" if how == "env" and mc else "0")
            g = gw.wgmma_build(rt, "bf16", M, N, K, multicast=mc if how == "arg" else None, **kw)
            assert g.plan == (5, f"128x256+ts{'+bt' if layout == 'kn' else ''}{'+mc' if mc else ''}", 1)
            boxes.clear()
            B = rt.empty((K, N) if layout == "kn" else (N, K), np.uint16)
            bias = rt.empty((N,), np.uint16) if layout == "kk" else None
            g(rt.empty((M, N), np.uint16), rt.empty((M, K), np.uint16), B, bias)
            name, grid = rt.launches[-1].func, rt.launches[-1].grid
            assert name == f"gemm_wgmma_bf16_n256{'_bt' if layout == 'kn' else ''}_ts{'_mc' if mc else ''}_bf16"
            b_box = boxes[1][-1]
            assert b_box == (64 if layout == "kn" else 128 if mc else 256)
            if mc:
                assert grid[0] == want_grid and grid[0] % 2 == 0


@pytest.mark.parametrize("env", ["2", "yes", "on"])
def test_multicast_env_must_be_0_or_1(monkeypatch, env):
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setenv(gw.MC_ENV, env)
    with pytest.raises(LLMCError, match="LLMC_WGMMA_MC"):
        gw.wgmma_build(FakeRuntime(), "bf16", 3072, 768, 4096, a_major="m", b_major="n", out="bf16", beta=1.0)


@pytest.mark.parametrize("kw,why", [(dict(dtype="tf32", out="bf16"), "no tf32 kernels with bf16 output"),
                                    (dict(dtype="tf32", b_major="n"), "no tf32 kernels"),
                                    (dict(dtype="bf16", a_major="m", out="bf16"), "no bf16 kernels"),
                                    (dict(dtype="bf16", b_major="n"), "no bf16 kernels with fp32 output")])
def test_unbuilt_layouts_refuse(kw, why):
    from llmc.errors import LLMCError
    from tests.fake_runtime import FakeRuntime
    dtype = kw.pop("dtype")
    with pytest.raises(LLMCError, match=why):
        gw.wgmma_build(FakeRuntime(), dtype, 256, 256, 256, **kw)


@pytest.mark.parametrize("a_major,b_major,beta,want", [("k", "k", 0.0, "_ts_bf16"), ("k", "n", 0.0, "_bt_ts_bf16"),
                                                        ("m", "n", 1.0, "_at_bt_ts_bf16"), ("k", "n", 1.0, "_bt_ts_bf16")])
def test_bf16_builds_pick_their_instance(a_major, b_major, beta, want):
    """The launcher fetches the instance of the layout asked for (its argtypes checked against the PTX);
    bf16 out takes the TMA store at any K, beta = 1 included (C's old tile loaded by the TMA)."""
    from tests.fake_runtime import FakeRuntime
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, "bf16", 4096, 768, 768, beta=beta, a_major=a_major, b_major=b_major, out="bf16")
    assert rt.built[0].endswith(want) and rt.built[0].startswith("gemm_wgmma_bf16_n"), rt.built
    assert ("+ts" in g.plan[1]) == ("_ts" in want)


@pytest.mark.parametrize("M,N,K,env,want_ts,want_splits", [
    (50304, 768, 16384, None, True, 1),      # the lm head's dweight at B=16: long K, TMA store
    (3072, 768, 4096, None, True, 1),        # fc's dweight at B=4
    (768, 768, 16384, None, False, None),    # attproj's dweight: the planner splits K, so direct stores
    (3072, 768, 4096, "0", False, 1),        # LLMC_WGMMA_TS_BETA=0: accumulating GEMMs stay direct
])
def test_bf16_dweight_plan_takes_the_tma_store(monkeypatch, M, N, K, env, want_ts, want_splits):
    from tests.fake_runtime import FakeRuntime
    if env is None:
        monkeypatch.delenv("LLMC_WGMMA_TS_BETA", raising=False)
    else:
        monkeypatch.setenv("LLMC_WGMMA_TS_BETA", env)
    monkeypatch.delenv("LLMC_WGMMA_TS_MAX_K", raising=False)
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, "bf16", M, N, K, lda=M, ldb=N, ldc=N, beta=1.0, a_major="m", b_major="n", out="bf16")
    assert ("+ts" in g.plan[1]) == want_ts, g.plan
    assert rt.built[0].endswith("_at_bt_ts_bf16" if want_ts else "_at_bt_bf16"), rt.built
    if want_splits is None:
        assert g.plan[2] > 1, g.plan
    else:
        assert g.plan[2] == want_splits, g.plan


@pytest.mark.parametrize("B,env,n160,want", [
    (2, None, None, "128x64+ts+at+bt/1"),    # attproj's dweight at B=2 and 4: one split with the TMA store,
    (4, None, None, "128x64+ts+at+bt/1"),    # 64 wide (K <= N64_MAX_K: 72 tiles, not 36 of 128 x 128)
    (8, None, None, "128x128+at+bt/3"),      # from B=8 split over K (estimate under half of one split's)
    (16, None, None, "128x128+at+bt/3"),     # (108 units: 3 splits of 36 tiles; session 27's split cost)
    (16, None, "1", "128x128+at+bt/3"),      # (split plans never take the 160-wide tile)
    (4, "0", None, "128x128+at+bt/3"),       # LLMC_WGMMA_SPLIT_OVER_TS=0: split wherever the planner splits
    (16, "100", None, "128x128+ts+at+bt/1"),  # a bar no split clears
])
def test_accumulating_dweight_splits_where_the_split_is_under_half(monkeypatch, B, env, n160, want):
    """attproj's bf16 dweight (768 x 768, K = B * 1024), accumulating (beta 1), and the overwrite form
    matmul_backward builds on its plan (the first micro-step's) take the same plan."""
    from tests.fake_runtime import FakeRuntime
    from llmc.ops.matmul import _dweight_gemm
    for var in ("LLMC_WGMMA_TS_MAX_K", "LLMC_WGMMA_TS_WIDTHS", "LLMC_WGMMA_TS_BETA", gw.SCHEDULE_ENV):
        monkeypatch.delenv(var, raising=False)
    for var, val in ((gw.SPLIT_OVER_TS_ENV, env), (gw.N160_ENV, n160)):
        if val is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, val)
    rt = FakeRuntime()
    kw = dict(lda=768, ldb=768, ldc=768, a_major="m", b_major="n", out="bf16", plan_only=True)
    for overwrite in (False, True):
        g = _dweight_gemm(gw.wgmma_build, overwrite, rt, "bf16", 768, 768, B * 1024, **kw)
        assert f"{g.plan[1]}/{g.plan[2]}" == want, (overwrite, g.plan)


def test_dweight_256_wide_tile_plans(monkeypatch):
    """The dweights' 256-wide TMA-store tile (session 42): planned by default and taken where it makes
    enough tiles (the lm head's dweight, at B=4 and 16; 192 with LLMC_WGMMA_MN256=0); qkv's, fc's and
    fcproj's keep their widths either way; bn=256 asks for it with the switch off too."""
    from tests.fake_runtime import FakeRuntime
    for var in ("LLMC_WGMMA_TS_MAX_K", "LLMC_WGMMA_TS_WIDTHS", "LLMC_WGMMA_TS_BETA", gw.SCHEDULE_ENV,
                gw.SPLIT_OVER_TS_ENV, gw.N160_ENV, gw.MN256_ENV, gw.MC_ENV):
        monkeypatch.delenv(var, raising=False)
    layers = {"qkv": (768, 2304, 128), "fc": (768, 3072, 160), "fcproj": (3072, 768, 160), "lmhead": (768, 50304, 256)}

    def plan(C, OC, B, **kw):
        rt = FakeRuntime()
        g = gw.wgmma_build(rt, "bf16", OC, C, B * 1024, lda=OC, ldb=C, ldc=C, beta=1.0, a_major="m", b_major="n",
                           out="bf16", plan_only=True, **kw)
        return g.plan
    for B in (4, 16):
        for layer, (C, OC, want) in layers.items():
            assert plan(C, OC, B) == (5, f"128x{want}+ts+at+bt", 1), (layer, B)
    monkeypatch.setenv(gw.MN256_ENV, "0")
    for B in (4, 16):
        for layer, (C, OC, want) in layers.items():
            assert plan(C, OC, B) == (5, f"128x{192 if want == 256 else want}+ts+at+bt", 1), (layer, B)
    assert plan(768, 50304, 16, bn=256) == (5, "128x256+ts+at+bt", 1)
    assert gw.instance_name("bf16", "bf16", "mn", True, 256) == "gemm_wgmma_bf16_n256_at_bt_ts_bf16"


@pytest.mark.parametrize("layer,B,env,beside,want", [
    ("fc", 16, None, False, 160),       # K >= N160_MIN_K, alone: 5 tiles of 160 across 768 (120 CTAs)
    ("fcproj", 16, None, False, 160),   # (768 x 3072: 6 x 20 tiles)
    ("fc", 8, None, False, 160),
    ("fc", 4, None, False, 160),        # K = 4096 = N160_MIN_K
    ("fcproj", 4, None, False, 160),
    ("fc", 2, None, False, 192),        # K = 2048: below N160_MIN_K
    ("fc", 16, None, True, 192),        # beside other work (the side stream): 96 tiles of 192
    ("fc", 16, "0", False, 192),        # LLMC_WGMMA_N160=0: never
    ("fc", 4, "1", False, 160),         # LLMC_WGMMA_N160=1: any K, beside too
    ("fc", 4, "1", True, 160),
    ("qkv", 16, None, False, 128),      # (qkv's 2304 x 768: 108 tiles of 128 x 128 fill the GPU already)
    ("lmhead", 16, None, False, 256),   # (the dweights' 256, session 42: 393 x 3 tiles; 192 without it)
])
def test_dweight_160_wide_tile_plans(monkeypatch, layer, B, env, beside, want):
    """Where the planner takes the dweight layout's 160-wide tile (bf16, one K split, the TMA store): a
    GEMM alone with K >= N160_MIN_K, never beside other work; and matmul_backward 5's dweight_only form
    (the trainer's side stream) builds beside=True while its two-GEMM form does not."""
    from tests.fake_runtime import FakeRuntime
    for var in ("LLMC_WGMMA_TS_MAX_K", "LLMC_WGMMA_TS_WIDTHS", "LLMC_WGMMA_TS_BETA", gw.SCHEDULE_ENV, gw.SPLIT_OVER_TS_ENV,
                gw.MN256_ENV):
        monkeypatch.delenv(var, raising=False)
    if env is None:
        monkeypatch.delenv(gw.N160_ENV, raising=False)
    else:
        monkeypatch.setenv(gw.N160_ENV, env)
    C, OC = {"fc": (768, 3072), "fcproj": (3072, 768), "qkv": (768, 2304), "lmhead": (768, 50304)}[layer]
    g = gw.wgmma_build(FakeRuntime(), "bf16", OC, C, B * 1024, lda=OC, ldb=C, ldc=C, beta=1.0, a_major="m",
                       b_major="n", out="bf16", plan_only=True, beside=beside)
    assert g.plan[1] == f"128x{want}+ts+at+bt" and g.plan[2] == 1, g.plan
    if layer == "fc" and env is None:
        from llmc import ops
        monkeypatch.setattr(gw, "tensor_map", lambda *a, **k: bytes(128))
        for form in ("dweight_only", None):
            built = ops.get("matmul_backward").build(FakeRuntime(), 5, "bf16", N=B * 1024, C=C, OC=OC,
                                                     **({form: True} if form else {}))
            dw_plan = built.plan if form else built.plan[1]
            alone = 160 if B >= 4 else 192
            assert dw_plan[1] == f"128x{192 if form else alone}+ts+at+bt", (form, dw_plan)


@pytest.mark.parametrize("env", ["2", "yes"])
def test_n160_env_must_be_0_or_1(monkeypatch, env):
    from llmc.errors import LLMCError
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setenv(gw.N160_ENV, env)
    with pytest.raises(LLMCError, match="LLMC_WGMMA_N160"):
        gw.wgmma_build(FakeRuntime(), "bf16", 3072, 768, 16384, lda=3072, ldb=768, ldc=768, beta=1.0, a_major="m",
                       b_major="n", out="bf16")


@pytest.mark.parametrize("env", ["-1", "fast", "nan"])
def test_split_over_ts_env_must_be_a_ratio(monkeypatch, env):
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setenv(gw.SPLIT_OVER_TS_ENV, env)
    with pytest.raises(LLMCError, match="LLMC_WGMMA_SPLIT_OVER_TS"):
        gw.wgmma_build(FakeRuntime(), "bf16", 768, 768, 4096, lda=768, ldb=768, ldc=768, beta=1.0, a_major="m",
                       b_major="n", out="bf16")


@pytest.mark.parametrize("out,K,env,want_ts", [("fp32", 4096, None, True), ("fp32", 4100, None, False),
                                               ("bf16", 50304, None, True), ("bf16", 1032, "1024", False),
                                               ("fp32", 8192, "100000", True), ("fp32", 2048, "1024", False)])
def test_tma_store_k_limit_per_output_type(monkeypatch, out, K, env, want_ts):
    """fp32 out: direct stores past K = 4096 (the TMA-store instances' fewer stages lose there); bf16
    out: no limit; LLMC_WGMMA_TS_MAX_K overrides both."""
    from tests.fake_runtime import FakeRuntime
    if env is None:
        monkeypatch.delenv("LLMC_WGMMA_TS_MAX_K", raising=False)
    else:
        monkeypatch.setenv("LLMC_WGMMA_TS_MAX_K", env)
    dtype = "bf16" if out == "bf16" else "tf32"
    g = gw.wgmma_build(FakeRuntime(), dtype, 4096, 768, K, out=out)
    assert ("+ts" in g.plan[1]) == want_ts, g.plan


def test_tma_store_k_limit_refuses_a_bad_env(monkeypatch):
    from llmc.errors import LLMCError
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setenv("LLMC_WGMMA_TS_MAX_K", "lots")
    with pytest.raises(LLMCError, match="LLMC_WGMMA_TS_MAX_K"):
        gw.wgmma_build(FakeRuntime(), "bf16", 4096, 768, 768, out="bf16")


def _bf16(x):
    from llmc.bf16 import round_bf16, to_bf16
    return to_bf16(x), round_bf16(x).astype(np.float64)


def _stored(x, transposed, rng):
    """x (rows, K) as the kernel reads it: x itself or x^T, rows padded to a multiple of 8 elements
    (16-byte TMA strides) with large garbage that must not leak into the product."""
    s = x.T if transposed else x
    ld = -(-s.shape[1] // 8) * 8
    out = np.full((s.shape[0], ld), 1000.0, np.float32)
    out[:, :s.shape[1]] = s
    return out, ld


def _run_bf16(rt, rng, M, N, K, a_major="k", b_major="k", has_bias=False, beta=0.0, store="auto", splits=None,
              bn=None, multicast=None):
    from llmc.bf16 import BF16, from_bf16, to_bf16
    from llmc.testing import poison
    A = to_bf16(rng.standard_normal((M, K)))
    B = to_bf16(rng.standard_normal((N, K)))
    A64, B64 = from_bf16(A).astype(np.float64), from_bf16(B).astype(np.float64)
    As, lda = _stored(from_bf16(A), a_major == "m", rng)
    Bs, ldb = _stored(from_bf16(B), b_major == "n", rng)
    bias = to_bf16(rng.standard_normal(N)) if has_bias else None
    C0 = to_bf16(rng.standard_normal((M, N)))
    dC = rt.empty((M, N), BF16)
    if beta:
        dC.set(C0)
    else:
        poison(dC)  # 0xFFFF is a bf16 NaN: every element must be written
    g = gw.wgmma_build(rt, "bf16", M, N, K, lda=lda, ldb=ldb, beta=beta, has_bias=has_bias, store=store,
                       splits=splits, bn=bn, a_major=a_major, b_major=b_major, out="bf16", multicast=multicast)
    g(dC, rt.to_device(to_bf16(As)), rt.to_device(to_bf16(Bs)), rt.to_device(bias) if has_bias else None)
    ref = A64 @ B64.T
    if has_bias:
        ref = ref + from_bf16(bias)
    if beta:
        ref = ref + beta * from_bf16(C0)
    return from_bf16(dC.get()), ref, g


BF16_SHAPES = [(1, 1, 16), (7, 5, 8), (65, 1, 16), (128, 192, 64), (129, 193, 72), (300, 770, 65),
               (256, 256, 1000), (1024, 768, 768), (200, 136, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["auto", "direct", "tma"])
@pytest.mark.parametrize("layout", ["kk", "kn"])
@pytest.mark.parametrize("M,N,K", BF16_SHAPES)
def test_bf16_out_forward_and_dinp_layouts(hopper, rng, M, N, K, layout, store):
    """bf16 C = A @ B^T + bias, B K-major (the forward) or N-major (dinp), against float64 on
    bf16-valued inputs; tolerance: llmc.testing.bf16_close (one rounding + fp32 accumulation)."""
    from llmc.testing import bf16_close
    if store == "tma" and N % 8:
        pytest.skip("the TMA store needs 16-byte rows of C (N % 8 == 0 in bf16)")
    out, ref, g = _run_bf16(hopper, rng, M, N, K, "k", layout[1], has_bias=True, store=store)
    if store != "auto":
        assert ("+ts" in g.plan[1]) == (store == "tma")
    bf16_close(out, ref, f"bf16 {layout} {store} {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,splits", [(768, 768, 8192, None), (300, 136, 1000, 3), (129, 193, 520, 2)])
def test_bf16_out_dweight_layout_writes_split_over_k(hopper, rng, M, N, K, splits):
    """dweight's layout with beta = 0 and direct stores, as matmul_backward's overwrite form (the first
    micro-step writes the gradient) builds it on the accumulating plan's K splits: attproj's shape at
    B=8 as the planner splits it, and asked splits; every element of the poisoned C written from the
    reduced partials."""
    from llmc.testing import bf16_close
    out, ref, g = _run_bf16(hopper, rng, M, N, K, "m", "n", beta=0.0, store="direct", splits=splits)
    assert "+at+bt" in g.plan[1] and "+ts" not in g.plan[1] and g.plan[2] > 1, g.plan
    assert np.isfinite(out).all()
    bf16_close(out, ref, f"bf16 mn beta 0 splits={g.plan[2]} {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("M,N,K", BF16_SHAPES)
def test_bf16_out_dweight_layout_accumulates(hopper, rng, M, N, K, splits):
    """dweight's layout (A^T and B^T stored, both read transposed by the wgmma) with C += (beta 1):
    the old bf16 C is read, added in fp32 and rounded once; split-K partials reduced in order."""
    from llmc.testing import bf16_close
    out, ref, g = _run_bf16(hopper, rng, M, N, K, "m", "n", beta=1.0, splits=splits)
    assert "+at+bt" in g.plan[1]
    bf16_close(out, ref, f"bf16 mn splits={splits} {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kk", "kn", "mn"])
@pytest.mark.parametrize("M,N,K", [(1, 8, 16), (65, 8, 16), (128, 192, 64), (136, 200, 72), (304, 776, 65),
                                   (256, 256, 1000), (200, 136, 4096)])
def test_bf16_beta_through_the_tma_store(hopper, rng, M, N, K, layout):
    """C += A @ B^T (+ bias) with the TMA store: C's old tile comes in by the TMA (into the staging
    buffer, in the mainloop), is added in fp32 and rounded once, and goes out by the TMA store; the
    same bits as the direct stores (alpha = beta = 1: product + old, then bias, in both)."""
    from llmc.testing import bf16_close
    has_bias = layout != "mn"
    seed = int(rng.integers(1 << 30))
    # the planner's width, or 128 where that width has no direct-store twin (the dweight layout's 64)
    pad8 = lambda n: -(-n // 8) * 8  # noqa: E731 (the test's operands: rows padded for 16-byte strides)
    planned = gw.wgmma_build(hopper, "bf16", M, N, K, lda=pad8(M if layout[0] == "m" else K), ldb=pad8(N if layout[1] == "n" else K),
                             beta=1.0, has_bias=has_bias, store="tma", splits=1, a_major=layout[0], b_major=layout[1],
                             out="bf16", plan_only=True).plan
    bn = int(planned[1].split("x")[1].split("+")[0])
    bn = bn if bn in gw.INSTANCES[("bf16", "bf16", layout, False)] else 128
    out, ref, g = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, layout[0], layout[1], has_bias=has_bias,
                            beta=1.0, store="tma", splits=1, bn=bn)
    assert "+ts" in g.plan[1], g.plan
    bf16_close(out, ref, f"bf16 {layout} beta tma {M}x{N}x{K}")
    direct, _, gd = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, layout[0], layout[1], has_bias=has_bias,
                              beta=1.0, store="direct", splits=1, bn=bn)
    assert "+ts" not in gd.plan[1]
    assert np.array_equal(out, direct)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,bn", [(lay, bn) for lay in ("kk", "kn", "mn")
                                       for bn in sorted(gw.INSTANCES[("bf16", "bf16", lay, False)])])
def test_bf16_out_every_tile_width(hopper, rng, bn, layout):
    from llmc.testing import bf16_close
    out, ref, g = _run_bf16(hopper, rng, 300, 517, 520, layout[0], layout[1], has_bias=layout != "mn",
                            beta=1.0 if layout == "mn" else 0.0, bn=bn, store="direct")
    assert g.plan[1].startswith(f"128x{bn}")
    bf16_close(out, ref, f"bf16 {layout} bn={bn}")


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("M,N,K", [(1, 8, 16), (65, 168, 64), (129, 200, 72), (300, 520, 520), (256, 768, 1000),
                                   (136, 320, 4096)])
def test_bf16_dweight_160_wide_tile(hopper, rng, M, N, K, beta):
    """The dweight layout's 160-wide tile: B^T comes in as 32-column boxes with the 64-byte swizzle (read
    by the wgmma as its MN-major SW64 layout) and the TMA store stages C the same way. Against float64
    (beta 0: a poisoned C, every element written), with the TMA store, with direct stores (the same
    bits), and split over K with direct stores (attproj's plan)."""
    from llmc.testing import bf16_close
    seed = int(rng.integers(1 << 30))
    out, ref, g = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "m", "n", beta=beta, store="tma",
                            splits=1, bn=160)
    assert g.plan[1].startswith("128x160+ts+at+bt"), g.plan
    assert np.isfinite(out).all()
    bf16_close(out, ref, f"bf16 mn 160 tma beta={beta} {M}x{N}x{K}")
    direct, _, gd = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "m", "n", beta=beta, store="direct",
                              splits=1, bn=160)
    assert gd.plan[1] == "128x160+at+bt", gd.plan
    assert np.array_equal(out, direct)
    split, ref3, g3 = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "m", "n", beta=beta, store="direct",
                                splits=3, bn=160)
    assert g3.plan[1] == "128x160+at+bt" and g3.plan[2] == min(3, -(-K // 64)), g3.plan
    assert np.isfinite(split).all()
    bf16_close(split, ref3, f"bf16 mn 160 split beta={beta} {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("bn", sorted(gw.INSTANCES[("bf16", "bf16", "mn", True)]))
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("M,N,K", [(1, 8, 16), (65, 72, 64), (200, 136, 72), (304, 520, 520), (768, 768, 4096)])
def test_bf16_dweight_tma_store_every_width(hopper, rng, M, N, K, beta, bn):
    """Every TMA-store instance of the dweight layout (64 wide included, which has no direct-store twin)
    against float64: beta 0 on a poisoned C (every element written), beta 1 through C's old tile loaded by
    the TMA; ragged M, N and K."""
    from llmc.testing import bf16_close
    out, ref, g = _run_bf16(hopper, rng, M, N, K, "m", "n", beta=beta, store="tma", splits=1, bn=bn)
    assert g.plan[1] == f"128x{bn}+ts+at+bt", g.plan
    assert np.isfinite(out).all()
    bf16_close(out, ref, f"bf16 mn tma {bn} beta={beta} {M}x{N}x{K}")


@pytest.mark.gpu
@pytest.mark.parametrize("bn", sorted(gw.MC_INSTANCES[("bf16", "bf16", "mn")]))
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("M,N,K", [(1, 8, 16), (65, 168, 64), (200, 136, 72), (300, 520, 520), (384, 768, 1000),
                                   (520, 320, 4096)])
def test_bf16_dweight_multicast_pairs(hopper, rng, M, N, K, beta, bn):
    """The dweight layout in 2-CTA clusters (TMA multicast of the shared B tile): against float64 (beta 0:
    a poisoned C, every element written), on shapes with an odd number of tile rows (1, 3, 5: the last
    pair's second CTA computes a tile past M and must store nothing) and ragged N and K; and bit-equal to
    the same width without clusters (the same products in the same order)."""
    from llmc.testing import bf16_close
    seed = int(rng.integers(1 << 30))
    out, ref, g = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "m", "n", beta=beta, store="tma",
                            splits=1, bn=bn, multicast=True)
    assert g.plan[1] == f"128x{bn}+ts+at+bt+mc", g.plan
    assert np.isfinite(out).all()
    bf16_close(out, ref, f"bf16 mn multicast {bn} beta={beta} {M}x{N}x{K}")
    plain, _, gp = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "m", "n", beta=beta, store="tma",
                             splits=1, bn=bn, multicast=False)
    assert gp.plan[1] == f"128x{bn}+ts+at+bt", gp.plan
    assert np.array_equal(out, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(lay for _, _, lay in gw.S4_INSTANCES))
@pytest.mark.parametrize("M,N,K", [(1, 8, 16), (65, 264, 64), (300, 520, 520), (257, 1000, 1040), (640, 768, 3072)])
def test_bf16_s4_tile_stored_in_slices(hopper, rng, monkeypatch, layout, M, N, K):
    """The 4-stage 256-wide instances (the tile stored in two column slices through a half-size buffer):
    the forward's (K-major, with bias) and dinp's (B N-major) against float64 on a poisoned C (every
    element written; N = 8 and 264: the second slice wholly or partly past N), bit-equal to the 3-stage
    instance (the same products and epilogue)."""
    from llmc.testing import bf16_close
    seed = int(rng.integers(1 << 30))
    monkeypatch.setenv(gw.S4_ENV, "1")
    out, ref, g = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "k", layout[1], has_bias=layout == "kk",
                            store="tma", splits=1, bn=256)
    assert g.plan[1] == f"128x256+ts{'+bt' if layout == 'kn' else ''}+s4", g.plan
    assert np.isfinite(out).all()
    bf16_close(out, ref, f"bf16 {layout} s4 {M}x{N}x{K}")
    monkeypatch.setenv(gw.S4_ENV, "0")
    plain, _, gp = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "k", layout[1], has_bias=layout == "kk",
                             store="tma", splits=1, bn=256)
    assert "+s4" not in gp.plan[1]
    assert np.array_equal(out, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,bn", [(lay, bn) for (_, _, lay), widths in sorted(gw.MC_INSTANCES.items())
                                       if lay in ("kk", "kn") for bn in sorted(widths)])
@pytest.mark.parametrize("M,N,K", [(1, 8, 16), (65, 264, 64), (300, 520, 520), (384, 776, 1000), (640, 768, 3072)])
def test_bf16_multicast_pairs_forward_and_dinp(hopper, rng, layout, bn, M, N, K):
    """The forward's (K-major, with bias) and dinp's (B N-major) TMA-store tiles in 2-CTA clusters sharing
    B by multicast: against float64 on a poisoned C (every element written), with an odd number of tile
    rows (1, 3, 5: the last pair's second CTA computes past M and stores nothing), ragged N (a K-major
    B's second half box partly or wholly past N) and ragged K; bit-equal to the same width without clusters."""
    from llmc.testing import bf16_close
    seed = int(rng.integers(1 << 30))
    out, ref, g = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "k", layout[1], has_bias=layout == "kk",
                            store="tma", splits=1, bn=bn, multicast=True)
    assert g.plan[1] == f"128x{bn}+ts{'+bt' if layout == 'kn' else ''}+mc", g.plan
    assert np.isfinite(out).all()
    bf16_close(out, ref, f"bf16 {layout} multicast {bn} {M}x{N}x{K}")
    plain, _, gp = _run_bf16(hopper, np.random.default_rng(seed), M, N, K, "k", layout[1], has_bias=layout == "kk",
                             store="tma", splits=1, bn=bn, multicast=False)
    assert "+mc" not in gp.plan[1]
    assert np.array_equal(out, plain)


@pytest.mark.gpu
@pytest.mark.parametrize("layout,bn", [(lay, bn) for lay in ("kk", "kn")
                                       for bn in sorted(gw.INSTANCES[("bf16", "bf16", lay, True)])])
@pytest.mark.parametrize("M,N,K", [(300, 520, 520), (65, 8, 16), (1, 776, 72), (257, 1000, 1040)])
def test_bf16_out_tma_store_every_width(hopper, rng, layout, bn, M, N, K):
    """Every TMA-store instance of the bf16 forward layout and of dinp's (B N-major): 128, 192 and the
    3-stage 256 (dinp's since session 41), with bias, against float64 on shapes of ragged tiles, a poisoned C
    (every element written). (Not bit-equal to the direct-store instances with a bias: the two epilogues
    add it in different orders; session 41 checked.)"""
    from llmc.testing import bf16_close
    out, ref, g = _run_bf16(hopper, rng, M, N, K, "k", layout[1], has_bias=True, bn=bn, store="tma")
    assert g.plan[1].startswith(f"128x{bn}+ts"), g.plan
    assert np.isfinite(out).all()
    bf16_close(out, ref, f"bf16 {layout} tma bn={bn} {M}x{N}x{K}")


@pytest.mark.gpu
def test_bf16_out_tma_store_misaligned_c_falls_back(hopper, rng):
    """C 2 bytes off a 16-byte boundary: the TMA store can't take it, the direct bf16 stores must
    (and they are single stores there: the bf16 pairs need 4-byte alignment)."""
    from llmc.bf16 import BF16, from_bf16, to_bf16
    from llmc.testing import bf16_close
    M, N, K = 200, 200, 64
    A, B = to_bf16(rng.standard_normal((M, K))), to_bf16(rng.standard_normal((N, K)))
    base = hopper.empty((M * N + 1,), BF16)
    dC = base.view(1, (M, N))
    dC.fill_bytes(0xFF)
    g = gw.wgmma_build(hopper, "bf16", M, N, K, store="tma", out="bf16")
    g(dC, hopper.to_device(A), hopper.to_device(B))
    ref = from_bf16(A).astype(np.float64) @ from_bf16(B).astype(np.float64).T
    bf16_close(from_bf16(dC.get()), ref, "bf16 misaligned C")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kk", "kn", "mn"])
def test_bf16_out_is_deterministic(hopper, rng, layout):
    from llmc.bf16 import BF16, to_bf16
    M, N, K = 504, 304, 1024  # M-major A: its rows (M long) must be 16-byte multiples for the TMA
    A = hopper.to_device(to_bf16(rng.standard_normal((K, M) if layout[0] == "m" else (M, K))))
    B = hopper.to_device(to_bf16(rng.standard_normal((K, N) if layout[1] == "n" else (N, K))))
    C0 = to_bf16(rng.standard_normal((M, N)))
    C = hopper.empty((M, N), BF16)
    outs = []
    for _ in range(2):
        g = gw.wgmma_build(hopper, "bf16", M, N, K, splits=4, beta=1.0, a_major=layout[0], b_major=layout[1],
                           out="bf16")
        C.set(C0)
        g(C, A, B)
        outs.append(C.get())
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("osize,bn", [(4, 128), (4, 192), (2, 128), (2, 192), (2, 160)])  # fp32, bf16 output
def test_tma_store_staging_layout(osize, bn):
    """The `_ts` epilogue's staging addresses (cuda/gemm_wgmma.cu, staged_at: box = c / EPB, chunk
    (c % EPB) / EPC xor (r * RB / 128) % (RB / 16), fp32 or bf16) against the TMA's own swizzle (byte
    address bits 4-6 xor bits 7-9 of the unswizzled box layout for 128-byte box rows; bits 4-5 xor 7-8
    for the 64-byte rows of bf16's 160-wide tile): every (row, column pair)
    of a warpgroup's 64 x BN tile lands where the TMA store reads it, once, and each warp store (8 rows
    x 4 lanes of a pair: 32 bf16x2 or 32 float2) takes the fewest shared-memory wavefronts (its words
    spread evenly over the 32 banks: 1 for bf16, 2 for fp32)."""
    rb = gw.box_bytes(bn * osize)      # bytes of a box row: 128, or 64 for bf16's 160-wide tile
    epb, epc = rb // osize, 16 // osize
    assert rb == (64 if (osize, bn) == (2, 160) else 128)
    seen = {}
    for warp in range(4):
        for j in range(bn // 8):
            for h in range(2):
                words = set()
                for lane in range(32):
                    r, c = warp * 16 + (lane >> 2) + 8 * h, 8 * j + 2 * (lane & 3)
                    box, ch = c // epb, (c % epb) // epc
                    swz = ((r * rb) >> 7) & (rb // 16 - 1)
                    kernel = box * 64 * rb + r * rb + ((ch ^ swz) << 4) + (c % epc) * osize
                    plain = box * 64 * rb + r * rb + (c % epb) * osize        # the box, row-major
                    # SWIZZLE_128B: bits 4-6 ^= bits 7-9; SWIZZLE_64B: bits 4-5 ^= bits 7-8
                    tma = plain ^ (((plain >> 7) & (rb // 16 - 1)) << 4)
                    assert kernel == tma, (r, c)
                    assert kernel not in seen, (r, c, seen.get(kernel))
                    seen[kernel] = (r, c)
                    words |= {kernel // 4 + i for i in range(2 * osize // 4)}
                per_bank = collections.Counter(w % 32 for w in words)
                assert max(per_bank.values()) == len(words) // 32, (warp, j, h)
    assert len(seen) == 64 * bn // 2  # every pair of the tile, once


# ----------------------------------------------------------------------------------------------
# ping-pong consumers (the _pp instances: each consumer warpgroup owns whole rows x BN tiles and the
# two take turns on the tensor cores); chosen by schedule= or LLMC_WGMMA_SCHEDULE, never by default


def test_pp_instance_table_matches_the_kernels():
    """PP_INSTANCES and PP_TS_INSTANCES (stages, hence shared memory) against the .cu's
    GEMM_WGMMA_PP_ENTRY lines: same names, types, tile rows and width, stages, B N-major and TMA-store
    flags; every one fits in 227 KB."""
    import re
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "gemm_wgmma.cu").read_text()
    entries = {m.group(1): (m.group(2), m.group(3), int(m.group(4)), int(m.group(5)), int(m.group(6)), m.group(7) == "true",
                            m.group(8) == "true")
               for m in re.finditer(r"^GEMM_WGMMA_PP_ENTRY\((\w+), ([\w:]+), ([\w:]+), (\d+), (\d+), (\d+), (true|false), "
                                    r"(true|false)\)$", src, re.M)}
    ctype = {"tf32": "float", "bf16": "__nv_bfloat16", "fp32": "float"}
    want = {}
    for ts, table in ((False, gw.PP_INSTANCES), (True, gw.PP_TS_INSTANCES)):
        for (ty, out, layout), shapes in table.items():
            assert layout in ("kk", "kn")
            for (rm, bn), stages in shapes.items():
                want[gw.pp_instance_name(ty, out, layout, rm, bn, ts)] = (ctype[ty], ctype[out], rm, bn, stages,
                                                                          layout == "kn", ts)
                assert gw.pp_smem_bytes(rm, bn, stages, ts, out) <= 227 * 1024, (ty, out, layout, rm, bn, ts)
                assert rm * bn // 128 <= 128, "accumulators of one consumer: at most 128 registers a thread"
    assert entries == want and len(want) >= 18


def test_plan_pingpong_counts_consumer_tiles():
    # d12 attproj forward (4096 x 768 x 768): 64 x 192 tiles, 256 of them, two per SM
    rm, bn, s = gw.plan_pingpong(132, 4096, 768, 768, "bf16")
    assert (rm, bn) in gw.PP_SHAPES and s == 1
    for M, N, K in [(4096, 2304, 768), (16384, 3072, 768), (768, 768, 4096), (1, 1, 8)]:
        rm, bn, s = gw.plan_pingpong(132, M, N, K)
        assert (rm, bn) in gw.PP_SHAPES and s >= 1
    # the cooperative plan is what it was (the ping-pong model is a separate branch of the estimate)
    assert gw.plan(132, 4096, 768, 768)[0] == 192


@pytest.mark.parametrize("kw,env,want", [
    (dict(), None, "_ts_bf16"),                                    # the default stays cooperative
    (dict(schedule="coop"), "pingpong", "_ts_bf16"),               # the argument beats the environment
    (dict(schedule="pingpong"), None, "_pp64_bf16"),
    (dict(), "pingpong", "_pp"),
    (dict(schedule="pingpong", bn=128), None, "_n128_ts_pp128_bf16"),
    (dict(schedule="pingpong", rm=64, bn=256), None, "_n256_ts_pp64_bf16"),
    (dict(schedule="pingpong", b_major="n"), None, "_bt_ts_pp64_bf16"),
    (dict(schedule="pingpong", beta=1.0, splits=2), None, "_pp64_bf16"),
])
def test_schedule_picks_the_pingpong_instance(monkeypatch, kw, env, want):
    from tests.fake_runtime import FakeRuntime
    if env is None:
        monkeypatch.delenv(gw.SCHEDULE_ENV, raising=False)
    else:
        monkeypatch.setenv(gw.SCHEDULE_ENV, env)
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, "bf16", 4096, 768, 768, out="bf16", **kw)
    assert want in rt.built[0], rt.built
    assert ("+pp" in g.plan[1]) == ("_pp" in want)
    if "_pp" in want:  # the launch asks for the instance's shared memory and one CTA per SM at most
        maps = []   # (no driver here: record what the tensor maps would describe)
        monkeypatch.setattr(gw, "tensor_map", lambda ptr, dtype, rows, cols, ld, box_rows, box_bytes=128:
                            maps.append((rows, cols, box_rows)) or bytes(128))
        g(rt.empty((4096, 768), np.uint16), rt.empty((4096, 768), np.uint16), rt.empty((768, 768), np.uint16))
        L = [x for x in rt.launches if x.func == rt.built[0]][-1]   # (split-K: then the reduce)
        assert L.block == (384, 1, 1) and L.grid[0] <= 132
        rows, bn = (int(x) for x in g.plan[1].split("+")[0].split("x"))
        assert maps[0] == (4096, 768, rows)   # A K-major, in boxes of the consumer tile's rows
        ts = "_ts_pp" in rt.built[0]   # bf16 -> bf16 with a plain output: the TMA store (beta or split-K: direct)
        assert ts == (not kw.get("beta") and not kw.get("splits"))
        table = gw.PP_TS_INSTANCES if ts else gw.PP_INSTANCES
        assert L.smem == gw.pp_smem_bytes(rows, bn, table[("bf16", "bf16", "kn" if "_bt" in want else "kk")][(rows, bn)],
                                          ts, "bf16")
        assert bool(L.args[2]) == ts    # C's tensor map: only for the TMA store
        if kw.get("splits"):
            assert g.plan[2] == kw["splits"]


def test_schedule_tf32_and_auto(monkeypatch):
    from tests.fake_runtime import FakeRuntime
    monkeypatch.delenv(gw.SCHEDULE_ENV, raising=False)
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, "tf32", 4096, 2304, 768, has_bias=True, schedule="pingpong")
    assert rt.built[-1].startswith("gemm_wgmma_tf32_n") and "_pp" in rt.built[-1] and "+pp" in g.plan[1]
    g = gw.wgmma_build(rt, "tf32", 4096, 2304, 768, schedule="auto")   # either; the planner's estimate decides
    assert ("+pp" in g.plan[1]) == ("_pp" in rt.built[-1])


@pytest.mark.parametrize("env", ["0", "1"])
def test_tf32_pp128_takes_the_128_wide_tma_store_plans(monkeypatch, env):
    """LLMC_WGMMA_TF32_PP128: the tf32 GEMMs the planner puts on the cooperative 128-wide TMA-store tile
    (d12's lm head forward; qkv's dinp at B=16, K = 2304, since the TMA store's K limit became 4096), and
    plain ones with at least 4 waves of 128 x 128 tiles, run on the 128 x 128 ping-pong TMA-store instance when
    it is 1 (the default), on the cooperative plans when 0; fewer tiles on a 192-wide plan, the fused
    GELU and dgelu forms, an asked width, split or schedule, beta, and bf16 stay as they were."""
    from tests.fake_runtime import FakeRuntime
    monkeypatch.delenv(gw.SCHEDULE_ENV, raising=False)
    monkeypatch.setenv(gw.TF32_PP128_ENV, env)
    rt = FakeRuntime()
    on = env == "1"
    g = gw.wgmma_build(rt, "tf32", 16384, 50304, 768)   # lm head forward, B=16
    assert rt.built[-1] == ("gemm_wgmma_tf32_n128_ts_pp128" if on else "gemm_wgmma_tf32_n128_ts"), rt.built
    assert g.plan == (5, "128x128+ts+pp" if on else "128x128+ts", 1)
    maps = []
    monkeypatch.setattr(gw, "tensor_map", lambda ptr, dtype, rows, cols, ld, box_rows, box_bytes=128:
                        maps.append((dtype, rows, cols, box_rows)) or bytes(128))
    g(rt.empty((16384, 50304), np.float32), rt.empty((16384, 768), np.float32), rt.empty((50304, 768), np.float32))
    L = rt.launches[-1]
    assert L.smem == (gw.pp_smem_bytes(128, 128, 5, True, "fp32") if on else gw.smem_bytes(128, 5, True, "fp32"))
    assert L.smem <= 227 * 1024 and L.grid[0] == 132 and bool(L.args[2])   # C's tensor map: the TMA store
    assert maps == [("tf32", 16384, 768, 128), ("tf32", 50304, 768, 128), ("tf32t", 16384, 50304, 64)]
    assert gw.wgmma_build(rt, "tf32", 16384, 768, 2304, plan_only=True).plan[1] == ("128x128+ts+pp" if on else "128x128+ts")
    monkeypatch.setenv("LLMC_WGMMA_TS_MAX_K", "1024")  # (past the TMA store's K limit: planned 192 wide, direct)
    assert gw.wgmma_build(rt, "tf32", 16384, 768, 2304, plan_only=True).plan[1] == ("128x128+ts+pp" if on else "128x192")
    monkeypatch.delenv("LLMC_WGMMA_TS_MAX_K")
    assert switches.SWITCHES[gw.TF32_PP128_ENV].default is True
    # plans that stay as they were, either way
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 4096, 768, 768, plan_only=True).plan[1]          # 192 wide
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 4096, 768, 3072, plan_only=True).plan[1]         # 192 wide
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 4096, 768, 2304, plan_only=True).plan[1]         # 192 tiles
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 16384, 768, 2304, splits=1, plan_only=True).plan[1]
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 16384, 768, 2304, beta=1.0, plan_only=True).plan[1]
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 16384, 3072, 768, gelu=True, plan_only=True).plan[1]
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 16384, 768, 3072, dgelu=True, plan_only=True).plan[1]
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 16384, 50304, 768, bn=128, plan_only=True).plan[1]
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 16384, 50304, 768, schedule="coop", plan_only=True).plan[1]
    assert "+pp" not in gw.wgmma_build(rt, "tf32", 16384, 50304, 768, store="direct", plan_only=True).plan[1]
    assert gw.wgmma_build(rt, "bf16", 4096, 2304, 768, out="bf16", plan_only=True).plan[1] == "128x192+ts"


def test_schedule_refusals_and_fallback(monkeypatch, capsys):
    from llmc.errors import LLMCError
    from tests.fake_runtime import FakeRuntime
    rt = FakeRuntime()
    with pytest.raises(LLMCError, match="schedule='fast'"):
        gw.wgmma_build(rt, "bf16", 256, 256, 256, schedule="fast")
    monkeypatch.setenv(gw.SCHEDULE_ENV, "fast")
    with pytest.raises(LLMCError, match=gw.SCHEDULE_ENV):
        gw.wgmma_build(rt, "bf16", 256, 256, 256)
    with pytest.raises(LLMCError, match="no ping-pong instances"):   # dweight's layout has none
        gw.wgmma_build(rt, "bf16", 256, 256, 256, a_major="m", b_major="n", out="bf16", beta=1.0, schedule="pingpong")
    with pytest.raises(LLMCError, match="TMA store"):
        gw.wgmma_build(rt, "bf16", 256, 256, 256, store="tma", schedule="pingpong")
    with pytest.raises(LLMCError, match="rm=64"):
        gw.wgmma_build(rt, "bf16", 256, 256, 256, rm=64, schedule="coop")
    with pytest.raises(LLMCError, match="no ping-pong tile"):
        gw.wgmma_build(rt, "bf16", 256, 256, 256, rm=128, bn=192, schedule="pingpong")
    # forced for the whole run by the environment: a layout without instances stays cooperative, with a note
    monkeypatch.setenv(gw.SCHEDULE_ENV, "pingpong")
    gw._noted.clear()
    g = gw.wgmma_build(rt, "bf16", 256, 256, 256, a_major="m", b_major="n", out="bf16", beta=1.0)
    assert "+pp" not in g.plan[1] and "+at+bt" in g.plan[1]
    assert "using the cooperative instances" in capsys.readouterr().out


def _run_pp(rt, rng, dtype, out, M, N, K, b_major="k", has_bias=False, beta=0.0, alpha=1.0, trans_c=False,
            rm=None, bn=None, splits=None, store="auto"):
    """C = alpha * A @ B^T (+ bias) (+ beta * C0) on a ping-pong instance, inputs exact in the input
    type (tf32: bf16-valued inputs are exact in tf32 too, so the TMA's rounding changes nothing and
    only the fp32 accumulation differs from float64). Returns (out as float64, reference, build)."""
    from llmc.bf16 import BF16
    from llmc.testing import poison
    A64 = from_bf16(to_bf16(rng.standard_normal((M, K)))).astype(np.float64)
    B64 = from_bf16(to_bf16(rng.standard_normal((N, K)))).astype(np.float64)
    bias = from_bf16(to_bf16(rng.standard_normal(N))) if has_bias else None
    cshape = (N, M) if trans_c else (M, N)
    C0 = from_bf16(to_bf16(rng.standard_normal(cshape)))
    dev = (lambda x: rt.to_device(to_bf16(x))) if dtype == "bf16" else (lambda x: rt.to_device(np.ascontiguousarray(x, np.float32)))
    odev = (lambda x: rt.to_device(to_bf16(x))) if out == "bf16" else (lambda x: rt.to_device(x.astype(np.float32)))
    if b_major == "n":  # B^T stored, rows padded to 16 bytes with garbage that must not leak in
        ldb = -(-N // 8) * 8
        Bs = np.full((K, ldb), 1000.0)
        Bs[:, :N] = B64.T
    else:
        ldb, Bs = K, B64
    if beta:
        dC = odev(C0)
    else:
        dC = rt.empty(cshape, BF16 if out == "bf16" else np.float32)
        poison(dC)  # NaN (0xFF bytes): every element must be written
    g = gw.wgmma_build(rt, dtype, M, N, K, ldb=ldb, alpha=alpha, beta=beta, has_bias=has_bias, trans_c=trans_c,
                       b_major=b_major, out=out, schedule="pingpong", rm=rm, bn=bn, splits=splits, store=store)
    assert "+pp" in g.plan[1], g.plan
    g(dC, dev(A64), dev(Bs), odev(bias) if has_bias else None)
    ref = alpha * (A64 @ B64.T)
    if has_bias:
        ref = ref + bias
    if trans_c:
        ref = ref.T
    if beta:
        ref = ref + beta * C0
    res = dC.get()
    res = from_bf16(res) if out == "bf16" else res
    return res.astype(np.float64), ref, g


def _check_pp(res, ref, out, what):
    from llmc.testing import bf16_close
    assert np.isfinite(res).all(), f"{what}: unwritten (NaN-poisoned) or non-finite outputs"
    if out == "bf16":
        bf16_close(res, ref, what)  # one rounding of the output + fp32 accumulation
    else:  # fp32 out of exact inputs: only the fp32 accumulation order differs from float64
        assert _rel(res, ref) < 1e-5, what


# (M, N, K): tiny and odd shapes, K = 8 and 16, N = 1, tile counts that don't divide by 2 (one
# consumer gets a tile more) and M large enough that each consumer runs several tiles per CTA
PP_SHAPES_TEST = [(1, 1, 8), (7, 5, 16), (65, 1, 16), (129, 193, 72), (300, 770, 68), (1000, 1000, 8),
                  (4095, 257, 200), (4160, 768, 768), (8192, 392, 136)]
PP_KINDS = [("tf32", "fp32", "k"), ("bf16", "fp32", "k"), ("bf16", "bf16", "k"), ("bf16", "bf16", "n")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,out,b_major", PP_KINDS)
@pytest.mark.parametrize("M,N,K", PP_SHAPES_TEST)
def test_pp_matches_float64(hopper, rng, dtype, out, b_major, M, N, K):
    if (dtype == "tf32" and K % 4) or (dtype == "bf16" and K % 8):
        pytest.skip("16-byte TMA rows")
    res, ref, g = _run_pp(hopper, rng, dtype, out, M, N, K, b_major=b_major, has_bias=True)
    _check_pp(res, ref, out, f"pp {dtype}->{out} b_major={b_major} {M}x{N}x{K} {g.plan}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,out,b_major", PP_KINDS)
@pytest.mark.parametrize("rm,bn", gw.PP_SHAPES)
@pytest.mark.parametrize("store", ["auto", "direct"])
def test_pp_every_tile_shape(hopper, rng, dtype, out, b_major, rm, bn, store):
    """Every tile shape on a shape with an odd number of tiles per CTA: 133 x 3 tiles (64 rows) or 67 x
    3 (128 rows) over 132 SMs, several per consumer, interleaved in the stage ring; where a TMA-store
    instance is built (bf16 -> bf16; tf32 -> fp32 128 x 128) both through it ("auto") and from
    registers ("direct")."""
    built_ts = (dtype, out, "kn" if b_major == "n" else "kk") in gw.PP_TS_INSTANCES and \
        (rm, bn) in gw.PP_TS_INSTANCES[(dtype, out, "kn" if b_major == "n" else "kk")]
    if store == "direct" and not built_ts:
        pytest.skip("no ping-pong TMA-store instance of this tile: it stores from registers either way")
    M = 133 * 64 if rm == 64 else 67 * 128
    N = 3 * bn - 3 * 8   # (bf16 -> bf16 TMA store: 16-byte rows of C)
    res, ref, g = _run_pp(hopper, rng, dtype, out, M - 3, N, 264, b_major=b_major, has_bias=True, rm=rm, bn=bn, alpha=0.5,
                          store=store)
    want_ts = built_ts and store == "auto"
    assert g.plan[1].startswith(f"{rm}x{bn}+ts+pp" if want_ts else f"{rm}x{bn}+pp"), g.plan
    _check_pp(res, ref, out, f"pp {dtype}->{out} {rm}x{bn}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,out,b_major", PP_KINDS)
@pytest.mark.parametrize("splits", [1, 3])
def test_pp_beta_and_splits(hopper, rng, dtype, out, b_major, splits):
    """C = A @ B^T + C (beta 1, the old C read back in the epilogue), with and without split-K."""
    res, ref, g = _run_pp(hopper, rng, dtype, out, 2000, 520, 1000, b_major=b_major, beta=1.0, splits=splits)
    assert g.plan[2] == splits
    _check_pp(res, ref, out, f"pp {dtype}->{out} beta splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_pp_transposed_store(hopper, rng, beta):
    res, ref, _ = _run_pp(hopper, rng, "tf32", "fp32", 1031, 67, 96, beta=beta, trans_c=True)
    _check_pp(res, ref, "fp32", f"pp tf32 trans_c beta={beta}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,out,b_major", PP_KINDS)
@pytest.mark.parametrize("store", ["direct", "tma"])
def test_pp_matches_coop_bitwise_and_is_deterministic(hopper, rng, dtype, out, b_major, store):
    """The ping-pong (64 x 192) and cooperative (128 x 192) instances issue the same m64n192 wgmmas
    over the same k-blocks in the same order, so without split-K their outputs are bit-identical
    (stored from registers, or both through the TMA store: bf16 -> bf16); and two runs of the
    ping-pong instance are too. tf32 -> fp32 through the TMA store: 128 x 128 ping-pong (two m64n128
    per k-step) against the cooperative 128 x 128 tile (one per consumer), the same products."""
    if store == "tma" and out != "bf16" and dtype != "tf32":
        pytest.skip("the ping-pong TMA store is built for bf16 -> bf16 and tf32 -> fp32")
    from llmc.bf16 import BF16
    M, N, K = 3000, 776, 768
    mk = (lambda s: to_bf16(rng.standard_normal(s))) if dtype == "bf16" else (lambda s: rng.standard_normal(s).astype(np.float32))
    A = hopper.to_device(mk((M, K)))
    B = hopper.to_device(mk((K, N) if b_major == "n" else (N, K)))
    C = hopper.empty((M, N), BF16 if out == "bf16" else np.float32)
    outs = []
    rm, bn = (128, 128) if store == "tma" and out == "fp32" else (64, 192)
    for sched in ("pingpong", "pingpong", "coop"):
        g = gw.wgmma_build(hopper, dtype, M, N, K, b_major=b_major, out=out, schedule=sched, store=store, splits=1,
                           bn=bn, rm=rm if sched == "pingpong" else None)
        ts = "+ts" if store == "tma" else ""
        assert g.plan[1].startswith(f"{rm}x{bn}{ts}+pp" if sched == "pingpong" else f"128x{bn}{ts}"), g.plan
        C.fill_bytes(0xFF)
        g(C, A, B)
        outs.append(C.get())
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(outs[0], outs[2])


# The bias (cuda/gemm_wgmma.cu, before BiasFrag): loaded into registers before the epilogue, a thread's
# own columns (cooperative tiles up to 192 wide, ping-pong 64 x 192) or spread over the 8 lanes that
# share them and shuffled out (tiles of 128 accumulators): either way the epilogue's values in its
# order, C = round(d + bias) with d the fp32 accumulator, the
# same bits as before. d comes from the same tile without a bias and with fp32 outputs (the same wgmmas
# in the same order), so the expected bits are computed on the host. Many tiles per CTA at different
# column offsets (a bias of the wrong tile would show); N past the last full tile (columns past N read
# as 0).
BIAS_PLANS = [  # (schedule, rows, width, store)
    ("coop", None, 128, "tma"), ("coop", None, 128, "direct"), ("coop", None, 192, "tma"), ("coop", None, 192, "direct"),
    ("coop", None, 256, "tma"), ("coop", None, 256, "direct"), ("pingpong", 64, 192, "auto"),
    ("pingpong", 64, 192, "direct"), ("pingpong", 64, 256, "auto"), ("pingpong", 64, 256, "direct"),
    ("pingpong", 128, 128, "auto"), ("pingpong", 128, 128, "direct")]


def _check_bias(got, want_f32, plan, out="bf16"):
    """got (bf16 bits or fp32) against d + bias (float32), bit for bit."""
    want = to_bf16(want_f32) if out == "bf16" else want_f32
    bad = got != want
    assert not bad.any(), f"{plan}: {bad.sum()} outputs differ, first at {np.argwhere(bad)[0]}"


@pytest.mark.gpu
@pytest.mark.parametrize("sched,rm,bn,store", BIAS_PLANS)
def test_bias_keeps_the_epilogues_bits(hopper, rng, sched, rm, bn, store):
    """bf16 -> bf16 with a bias against d + bias from the bf16 -> fp32 instance of the same tile
    without one; the bias one element past a 4-byte boundary (loads of single elements)."""
    from llmc.bf16 import BF16
    M, N, K, ldc = 2053, 2300, 264, 2304   # 18 column tiles of 128 (12 of 192, 9 of 256), the last partial
    A = hopper.to_device(to_bf16(rng.standard_normal((M, K))))
    B = hopper.to_device(to_bf16(rng.standard_normal((N, K))))
    bias_b = to_bf16(rng.standard_normal(N) * 4)
    dbias = hopper.to_device(np.concatenate([to_bf16(np.zeros(1)), bias_b]))
    kw = dict(schedule=sched, rm=rm, bn=bn, splits=1)
    g32 = gw.wgmma_build(hopper, "bf16", M, N, K, ldc=ldc, out="fp32", store="direct", **kw)
    D = hopper.empty((M, ldc), np.float32)
    D.fill_bytes(0xFF)
    g32(D, A, B)
    want = D.get()[:, :N] + from_bf16(bias_b)[None, :]  # fp32 + fp32 (alpha = 1)
    g = gw.wgmma_build(hopper, "bf16", M, N, K, ldc=ldc, out="bf16", has_bias=True, store=store, **kw)
    assert g.plan[1].startswith(f"{rm or 128}x{bn}" + ("+ts" if store != "direct" else "")), g.plan
    assert ("+pp" in g.plan[1]) == (sched == "pingpong") and g32.plan[1].split("+")[0] == g.plan[1].split("+")[0]
    C = hopper.empty((M, ldc), BF16)
    for bias_ptr in (hopper.to_device(bias_b).ptr, dbias.ptr + 2):
        C.fill_bytes(0xFF)
        g(C, A, B, bias_ptr)
        _check_bias(C.get()[:, :N], want, g.plan)


@pytest.mark.gpu
@pytest.mark.parametrize("sched,rm,bn,store", [p for p in BIAS_PLANS if p[3] != "direct" or p[0] == "coop"])
def test_bias_keeps_the_epilogues_bits_fp32(hopper, rng, sched, rm, bn, store):
    """tf32 -> fp32: C with a bias against C without one plus the bias in fp32."""
    M, N, K = 2053, 2300, 264
    A = hopper.to_device(rng.standard_normal((M, K)).astype(np.float32))
    B = hopper.to_device(rng.standard_normal((N, K)).astype(np.float32))
    bias = (rng.standard_normal(N) * 4).astype(np.float32)
    st = "direct" if sched == "pingpong" else store  # (the ping-pong fp32 instances store from registers)
    if st == "tma" and bn not in gw.INSTANCES[("tf32", "fp32", "kk", True)]:
        pytest.skip(f"no tf32 TMA-store instance {bn} wide")
    kw = dict(schedule=sched, rm=rm, bn=bn, splits=1, store=st)
    outs = []
    for hb in (False, True):
        g = gw.wgmma_build(hopper, "tf32", M, N, K, has_bias=hb, **kw)
        C = hopper.empty((M, N), np.float32)
        C.fill_bytes(0xFF)
        g(C, A, B, hopper.to_device(bias) if hb else None)
        outs.append(C.get())
    assert g.plan[1].startswith(f"{rm or 128}x{bn}"), g.plan
    _check_bias(outs[1], outs[0] + bias[None, :], g.plan, out="fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("rm,bn", gw.PP_SHAPES)
def test_bias_with_alpha(hopper, rng, rm, bn):
    """alpha != 1 on every ping-pong tile, bf16 -> fp32: alpha * d + bias, bit for bit (alpha 0.5: the
    product is exact, so a fused multiply-add gives the same bits)."""
    M, N, K, alpha = 1031, 1000, 136, 0.5
    A = hopper.to_device(to_bf16(rng.standard_normal((M, K))))
    B = hopper.to_device(to_bf16(rng.standard_normal((N, K))))
    bias = (rng.standard_normal(N) * 4).astype(np.float32)
    kw = dict(schedule="pingpong", rm=rm, bn=bn, splits=1, alpha=alpha)
    outs = []
    for hb in (False, True):
        g = gw.wgmma_build(hopper, "bf16", M, N, K, has_bias=hb, out="fp32", **kw)
        C = hopper.empty((M, N), np.float32)
        C.fill_bytes(0xFF)
        g(C, A, B, hopper.to_device(bias) if hb else None)
        outs.append(C.get())
    _check_bias(outs[1], outs[0] + bias[None, :], g.plan, out="fp32")


# ----------------------------------------------------------------------------------------------
# the fused GELU epilogue (the _gelu instances: the fc layer's matmul_forward with gelu_pre=True):
# C = the pre-activation, G = gelu(C as stored), by the function gelu_forward uses in that precision


def test_gelu_instance_table_matches_the_kernels():
    """GELU_INSTANCES against the .cu's GEMM_WGMMA_GELU_ENTRY lines: names, types, stages (the plain
    instances' own: G is staged in C's buffer after C), TMA store; every one fits in 227 KB."""
    from tests.llmc_fixtures import wgmma_entries
    entries = wgmma_entries("GEMM_WGMMA_GELU_ENTRY")
    ctype = {"tf32": "float", "bf16": "__nv_bfloat16", "fp32": "float"}
    want = {}
    for (ty, out, ts), widths in gw.GELU_INSTANCES.items():
        assert widths == gw.INSTANCES[(ty, out, "kk", ts)]
        for bn, stages in widths.items():
            want[gw.instance_name(ty, out, "kk", ts, bn, True)] = (ctype[ty], ctype[out], bn, stages, ts)
            assert gw.smem_bytes(bn, stages, ts, out) <= 227 * 1024
    assert entries == want and len(want) == 11


@pytest.mark.parametrize("dtype,out,kw,want", [
    ("tf32", "fp32", dict(), ["gemm_wgmma_tf32_n128_ts_gelu"]),
    ("tf32", "fp32", dict(store="direct"), ["gemm_wgmma_tf32_n192_gelu"]),
    ("bf16", "bf16", dict(), ["gemm_wgmma_bf16_n256_ts_gelu_bf16"]),   # (K = 768: the 3-stage 256-wide one)
    ("bf16", "bf16", dict(store="direct", bn=256), ["gemm_wgmma_bf16_n256_gelu_bf16"]),
    # split-K: the plain instance writes the partials, the reduce adds them and applies the GELU
    ("tf32", "fp32", dict(splits=3), ["gemm_wgmma_tf32_n192", "gemm_wgmma_splitk_reduce_gelu"]),
    ("bf16", "bf16", dict(splits=3), ["gemm_wgmma_bf16_n192_bf16", "gemm_wgmma_splitk_reduce_gelu_bf16"]),
])
def test_gelu_builds_pick_their_instance(monkeypatch, dtype, out, kw, want):
    """The fc shape (B=16): the fused instance of the plain plan (same tile width, store and split; tf32 with
    the TMA store: 128 wide, TS_BN_EFF), its
    argtypes checked against the PTX by the fake runtime; the launch passes G (and G's tensor map)."""
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setenv(gw.SCHEDULE_ENV, "pingpong")  # the fused form stays cooperative, silently
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, dtype, 16384, 3072, 768, has_bias=True, out=out, gelu=True, **kw)
    assert rt.built == want and "+gelu" in g.plan[1] and g.plan[2] == kw.get("splits", 1)
    monkeypatch.setattr(gw, "tensor_map", lambda *a: bytes(128))
    esz = 2 if out == "bf16" else 4
    C, G = rt.empty((16384 * 3072 * esz // 4,)), rt.empty((16384 * 3072 * esz // 4,))
    g(C, rt.empty((16384, 768)), rt.empty((3072, 768)), rt.empty((3072,)), G)
    L = rt.launches[-1]   # the launch that writes the outputs (split-K: the reduce)
    assert L.func == want[-1] and C.ptr in L.args and G.ptr in L.args
    with pytest.raises(Exception, match="gelu=True"):
        g(C, rt.empty((16384, 768)), rt.empty((3072, 768)), rt.empty((3072,)))


@pytest.mark.parametrize("kw,why", [(dict(beta=1.0), "beta = 0"), (dict(trans_c=True), "not transposed"),
                                    (dict(dtype="bf16", out="fp32"), "bf16 -> bf16"),
                                    (dict(dtype="bf16", out="bf16", b_major="n"), "K-major"),
                                    (dict(schedule="pingpong"), "cooperative instances only")])
def test_gelu_refusals(kw, why):
    from llmc.errors import LLMCError
    from tests.fake_runtime import FakeRuntime
    dtype = kw.pop("dtype", "tf32")
    with pytest.raises(LLMCError, match=why):
        gw.wgmma_build(FakeRuntime(), dtype, 256, 256, 256, gelu=True, **kw)


def _gelu_case(rt, rng, dtype, M, N, K, has_bias=True, store="auto", splits=None, bn=None, alpha=1.0):
    """The fused GEMM (pre, G) and the plain one (C) on the same operands, outputs poisoned first:
    (pre, G, C as DevArrays, float64 reference of pre, the fused plan, the plain plan)."""
    from llmc.bf16 import BF16
    from llmc.testing import poison
    bf = dtype == "bf16"
    A = rng.standard_normal((M, K)).astype(np.float32)
    B = (rng.standard_normal((N, K)) * K ** -0.5).astype(np.float32)  # pre ~ N(0, 1): GELU's curved part
    bias = rng.standard_normal(N).astype(np.float32)
    if bf:
        (Ab, A), (Bb, B), (bb, bias) = _bf16_round(A), _bf16_round(B), _bf16_round(bias)
    else:
        Ab, Bb, bb = A, B, bias
    dA, dB, dbias = rt.to_device(Ab), rt.to_device(Bb), rt.to_device(bb) if has_bias else None
    pre, G, C = (rt.empty((M, N), BF16 if bf else np.float32) for _ in range(3))
    poison(pre, G, C)
    kw = dict(alpha=alpha, has_bias=has_bias, bn=bn, splits=splits, store=store, out="bf16" if bf else "fp32")
    fused = gw.wgmma_build(rt, dtype, M, N, K, gelu=True, **kw)
    fused(pre, dA, dB, dbias, G)
    plain = gw.wgmma_build(rt, dtype, M, N, K, **kw)
    plain(C, dA, dB, dbias)
    ref = alpha * (A.astype(np.float64) @ B.astype(np.float64).T) + (bias if has_bias else 0.0)
    return pre, G, C, ref, fused.plan, plain.plan


def _values(x):
    h = x.get()
    return (from_bf16(h) if h.dtype == np.uint16 else h).astype(np.float64)


# (the last two have more tiles than the H100 has SMs: a CTA's tile computes the previous tile's GELU
# during its mainloop, the TMA-store path's overlap)
GELU_SHAPES = [(1, 8, 16), (200, 100, 16), (129, 193, 16), (65, 1, 16), (300, 776, 64), (257, 3072, 768),
               (2048, 3072, 64), (1100, 3000, 136)]


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["tma", "direct", "split"])
@pytest.mark.parametrize("dtype", ["tf32", "bf16"])
@pytest.mark.parametrize("M,N,K", GELU_SHAPES)
def test_gelu_epilogue_matches_float64(hopper, rng, dtype, M, N, K, store):
    """pre against float64 (the GEMM's own tolerance), G against the float64 GELU of pre as stored
    (fp32: tanhf's few ulps; bf16: one rounding of the sigmoid form), every element of both written
    (poisoned first). M, N off the tile, N % 8 != 0 where the store allows it, K = 16 (one k-block,
    part zero-filled); "split": direct stores with 3 K splits and the GELU in the split-K reduce."""
    from llmc.ops.gelu import gelu_forward_ref
    from llmc.testing import assert_close, bf16_close
    if store == "tma" and N % (8 if dtype == "bf16" else 4):
        pytest.skip("the TMA store needs 16-byte rows of C and G")
    if store == "split" and K < 3 * 128:
        pytest.skip("3 K splits need K >= 3 k-blocks of 4")
    splits = 3 if store == "split" else 1
    pre, G, _, ref, plan, _ = _gelu_case(hopper, rng, dtype, M, N, K, store="direct" if store == "split" else store,
                                         splits=splits)
    assert ("+ts" in plan[1]) == (store == "tma") and plan[2] == splits and "+gelu" in plan[1]
    p, g = _values(pre), _values(G)
    assert np.isfinite(p).all() and np.isfinite(g).all(), "unwritten (NaN-poisoned) outputs"
    gref = gelu_forward_ref(p)
    if dtype == "bf16":
        bf16_close(p, ref, f"pre {M}x{N}x{K}")
        assert_close(g, gref, atol=1e-6, rtol=2.0 ** -8, name=f"gelu {M}x{N}x{K}")
    else:
        assert _rel(p, ref) < TOL["tf32"]
        assert_close(g, gref, atol=1e-6, rtol=1e-5, name=f"gelu {M}x{N}x{K}")
    assert _rel(g, gelu_forward_ref(ref)) < (1e-2 if dtype == "bf16" else TOL["tf32"])


@pytest.mark.gpu
@pytest.mark.parametrize("store", ["tma", "direct", "split"])
@pytest.mark.parametrize("bias_alpha", [(True, 1.0), (False, 1.0), (False, 0.5)])
@pytest.mark.parametrize("dtype", ["tf32", "bf16"])
@pytest.mark.parametrize("many_tiles", [False, True])
def test_gelu_fused_equals_gemm_then_gelu_forward(hopper, rng, dtype, bias_alpha, store, many_tiles):
    """Bit for bit: the fused pre is the plain GEMM's C, and G is what gelu_forward (variants 1 and 2,
    the same precision) computes from C. Without bias the epilogue's value is a product (alpha * acc),
    the case where a contracted fma could have reached into the GELU (common.cuh)."""
    from llmc import ops
    from llmc.testing import poison
    has_bias, alpha = bias_alpha
    M, N, K = (1100 if many_tiles else 200, 3000 if many_tiles else 136, 1024 if store == "split" else 136)
    pre, G, C, _, plan, plain_plan = _gelu_case(hopper, rng, dtype, M, N, K, has_bias=has_bias, alpha=alpha,
                                                store="direct" if store == "split" else store,
                                                splits=3 if store == "split" else 1)
    # (where the plain GEMM runs 128 x 128 ping-pong tiles, the fused form runs the cooperative 128-wide
    # instance: the same m64n128 products in the same order)
    assert plan[1] == plain_plan[1].replace("+pp", "") + "+gelu" and plan[2] == plain_plan[2]
    assert np.array_equal(pre.get(), C.get())
    spec = ops.get("gelu_forward")
    for v in (1, 2):
        G2 = hopper.empty(C.shape, C.dtype)
        poison(G2)
        spec.build(hopper, v, "bf16" if dtype == "bf16" else "fp32", N=M * N)(G2, C)
        assert np.array_equal(G.get(), G2.get()), f"gelu_forward {v}"


@pytest.mark.parametrize("M,N,K,env,want", [
    (16384, 50304, 768, None, 256),       # the lm head forward at B=16: 256 wide (3 stages) at short K
    (4096, 2304, 768, None, 192),         # qkv at B=4: 256-wide tiles would take a third wave for little
    (16384, 768, 3072, None, 256),        # fcproj at K = 3072 (no K limit since session 41: TS256_MAX_K)
    (16384, 50304, 768, "128,192", 192),  # LLMC_WGMMA_TS_WIDTHS narrows the planner's widths
    (16384, 50304, 768, "128:192", 192),  # (any separator)
])
def test_bf16_forward_tma_store_widths(monkeypatch, M, N, K, env, want):
    """The cooperative planner's tile widths (with the 128 x 128 ping-pong swap off: the next test)."""
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setenv(gw.PP128_ENV, "0")
    if env is None:
        monkeypatch.delenv("LLMC_WGMMA_TS_WIDTHS", raising=False)
    else:
        monkeypatch.setenv("LLMC_WGMMA_TS_WIDTHS", env)
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, "bf16", M, N, K, out="bf16")
    assert g.plan[1] == f"128x{want}+ts" and rt.built == [f"gemm_wgmma_bf16_n{want}_ts_bf16"], (g.plan, rt.built)
    monkeypatch.setenv("LLMC_WGMMA_TS_WIDTHS", "wide")
    from llmc.errors import LLMCError
    with pytest.raises(LLMCError, match="LLMC_WGMMA_TS_WIDTHS"):
        gw.wgmma_build(FakeRuntime(), "bf16", M, N, K, out="bf16")


@pytest.mark.parametrize("M,N,K,has_bias", [(16384, 50304, 768, False), (16384, 2304, 768, True), (4096, 3072, 768, True)])
def test_bf16_256_wide_plans_run_as_pp128(monkeypatch, M, N, K, has_bias):
    """With LLMC_WGMMA_PP128=1 (the default before session 41; unset, 256 stays cooperative), where the
    cooperative planner picks the 256-wide TMA-store tile, the build runs 128 x 128 ping-pong tiles with
    the TMA store instead (PP128_ENV); the fused GELU form takes the cooperative 128-wide instance (the
    same m64n128 products); an explicit width, schedule or LLMC_WGMMA_PP128=0 keeps 256; other plans and
    other types are untouched."""
    from tests.fake_runtime import FakeRuntime
    for var in (gw.PP128_ENV, gw.SCHEDULE_ENV, "LLMC_WGMMA_TS_WIDTHS", "LLMC_WGMMA_TS256_MAX_K"):
        monkeypatch.delenv(var, raising=False)
    assert gw.wgmma_build(FakeRuntime(), "bf16", M, N, K, has_bias=has_bias, out="bf16").plan == (5, "128x256+ts", 1)
    monkeypatch.setenv(gw.PP128_ENV, "1")
    monkeypatch.setenv("LLMC_WGMMA_TS256_MAX_K", "1024")
    rt = FakeRuntime()
    g = gw.wgmma_build(rt, "bf16", M, N, K, has_bias=has_bias, out="bf16")
    assert g.plan == (5, "128x128+ts+pp", 1) and rt.built == ["gemm_wgmma_bf16_n128_ts_pp128_bf16"]
    monkeypatch.setattr(gw, "tensor_map", lambda *a: bytes(128))
    C = rt.empty((M * N // 2,))
    g(C, rt.empty((M * K // 2,)), rt.empty((N * K // 2,)), rt.empty((N // 2,)) if has_bias else None)
    L = rt.launches[-1]
    assert L.smem == gw.pp_smem_bytes(128, 128, gw.PP_TS_INSTANCES[("bf16", "bf16", "kk")][(128, 128)], True, "bf16")
    assert L.args[2] and C.ptr in L.args   # C's tensor map: the TMA store
    if N == 3072:   # the fc layer: its fused GELU form keeps the plain GEMM's products, 128 wide, cooperative
        gg = gw.wgmma_build(rt, "bf16", M, N, K, has_bias=True, out="bf16", gelu=True)
        assert gg.plan == (5, "128x128+ts+gelu", 1) and rt.built[-1] == "gemm_wgmma_bf16_n128_ts_gelu_bf16"
    for kw in (dict(bn=256), dict(schedule="coop")):
        assert gw.wgmma_build(rt, "bf16", M, N, K, has_bias=has_bias, out="bf16", **kw).plan == (5, "128x256+ts", 1)
    monkeypatch.setenv(gw.PP128_ENV, "0")
    assert gw.wgmma_build(rt, "bf16", M, N, K, has_bias=has_bias, out="bf16").plan == (5, "128x256+ts", 1)
    monkeypatch.setenv(gw.PP128_ENV, "1")
    # plans of 128 / 192 stay cooperative (qkv at B=4, fcproj at K = 3072); tf32 has its own rule
    # (TF32_PP128_ENV, test_tf32_pp128_takes_the_128_wide_tma_store_plans), which LLMC_WGMMA_PP128 leaves alone
    assert gw.wgmma_build(rt, "bf16", 4096, 2304, 768, out="bf16").plan == (5, "128x192+ts", 1)
    assert gw.wgmma_build(rt, "bf16", 16384, 768, 3072, out="bf16").plan == (5, "128x192+ts", 1)
    monkeypatch.setenv(gw.PP128_ENV, "0")
    assert "+pp" in gw.wgmma_build(rt, "tf32", M, N, K).plan[1]


def test_bf16_dinp_256_wide_tile_and_ts256_max_k(monkeypatch):
    """dinp's 256-wide TMA-store tile (B N-major, session 41) is planned by default (LLMC_WGMMA_BT256=0
    leaves it out; bn=256 still asks for it), swapped for 128 x 128 ping-pong only with LLMC_WGMMA_PP128=1;
    any K may plan 256 unless LLMC_WGMMA_TS256_MAX_K sets a limit; the fused dgelu keeps its own widths."""
    from tests.fake_runtime import FakeRuntime
    for var in (gw.PP128_ENV, gw.SCHEDULE_ENV, gw.BT256_ENV, "LLMC_WGMMA_TS_WIDTHS", "LLMC_WGMMA_TS256_MAX_K"):
        monkeypatch.delenv(var, raising=False)
    rt = FakeRuntime()
    fcproj_dinp = dict(M=16384, N=3072, K=768, ldb=3072, b_major="n", out="bf16")
    assert gw.wgmma_build(rt, "bf16", **fcproj_dinp).plan == (5, "128x256+ts+bt", 1)
    assert rt.built[-1] == "gemm_wgmma_bf16_n256_bt_ts_bf16"
    assert gw.wgmma_build(rt, "bf16", **fcproj_dinp, dgelu=True).plan == (5, "128x192+ts+bt+dgelu", 1)
    monkeypatch.setenv(gw.PP128_ENV, "1")
    assert gw.wgmma_build(rt, "bf16", **fcproj_dinp).plan == (5, "128x128+ts+pp+bt", 1)
    monkeypatch.delenv(gw.PP128_ENV)
    monkeypatch.setenv(gw.BT256_ENV, "0")
    assert gw.wgmma_build(rt, "bf16", **fcproj_dinp).plan == (5, "128x192+ts+bt", 1)
    assert gw.wgmma_build(rt, "bf16", **fcproj_dinp, bn=256).plan == (5, "128x256+ts+bt", 1)
    monkeypatch.delenv(gw.BT256_ENV)
    # fc's dinp and fcproj's forward at K = 3072: 256 unless a K limit is set
    fc_dinp = dict(M=16384, N=768, K=3072, ldb=768, b_major="n", out="bf16")
    fcproj_fwd = dict(M=16384, N=768, K=3072, out="bf16", has_bias=True)
    assert gw.ts256_max_k() is None
    assert gw.wgmma_build(rt, "bf16", **fc_dinp).plan == (5, "128x256+ts+bt", 1)
    assert gw.wgmma_build(rt, "bf16", **fcproj_fwd).plan == (5, "128x256+ts", 1)
    monkeypatch.setenv("LLMC_WGMMA_TS256_MAX_K", "1024")
    assert gw.ts256_max_k() == 1024
    assert gw.wgmma_build(rt, "bf16", **fc_dinp).plan == (5, "128x192+ts+bt", 1)
    assert gw.wgmma_build(rt, "bf16", **fcproj_fwd).plan == (5, "128x192+ts", 1)


# GEMM_STMATRIX / GEMM_ALPHA1_SKIP (cuda/gemm_wgmma.cu, both 1 by default): the bf16 TMA-store epilogue's
# staging by stmatrix, and no pass over the accumulators at alpha = 1 without a bias
_EPILOGUE_OFF = {"GEMM_STMATRIX": 0, "GEMM_ALPHA1_SKIP": 0}


@pytest.mark.gpu
@pytest.mark.parametrize("layout,bn,schedule,rm", [("kk", 128, "coop", None), ("kk", 192, "coop", None),
                                                   ("kk", 256, "coop", None), ("kn", 192, "coop", None),
                                                   ("kn", 256, "coop", None), ("mn", 128, "coop", None),
                                                   ("mn", 160, "coop", None), ("mn", 256, "coop", None),
                                                   ("kk", 128, "pingpong", 128), ("kk", 256, "pingpong", 64)])
@pytest.mark.parametrize("alpha,has_bias", [(1.0, False), (1.0, True), (0.5, False)])
def test_bf16_epilogue_stmatrix_keeps_the_bits(hopper, rng, layout, bn, schedule, rm, alpha, has_bias):
    """The bf16 TMA-store tiles (cooperative 128 / 160 / 192 / 256 wide, ping-pong 128 x 128 and 64 x 256) with
    the stmatrix staging and the alpha-1 skip (the defaults) against both off: the same bits on a poisoned C
    (every element written), and against float64; ragged M, N, K (the last tiles partly past the edges)."""
    from llmc.bf16 import BF16, from_bf16, to_bf16
    from llmc.testing import bf16_close, module_defines, poison
    if has_bias and layout == "mn":
        pytest.skip("the dweight layout takes no bias")
    M, N, K = 300, 520, 200
    A, B = to_bf16(rng.standard_normal((M, K))), to_bf16(rng.standard_normal((N, K)))
    As, lda = _stored(from_bf16(A), layout[0] == "m", rng)
    Bs, ldb = _stored(from_bf16(B), layout[1] == "n", rng)
    bias = to_bf16(rng.standard_normal(N)) if has_bias else None
    dA, dB = hopper.to_device(to_bf16(As)), hopper.to_device(to_bf16(Bs))
    dbias = hopper.to_device(bias) if has_bias else None
    outs = []
    for defines in (_EPILOGUE_OFF, {}):
        with module_defines(hopper, "gemm_wgmma", defines):
            g = gw.wgmma_build(hopper, "bf16", M, N, K, lda=lda, ldb=ldb, alpha=alpha, has_bias=has_bias,
                               store="tma", bn=bn, a_major=layout[0], b_major=layout[1], out="bf16",
                               schedule=schedule, rm=rm, multicast=False)
            assert "+ts" in g.plan[1] and (("+pp" in g.plan[1]) == (schedule == "pingpong")), g.plan
            dC = hopper.empty((M, N), BF16)
            poison(dC)
            g(dC, dA, dB, dbias)
            outs.append(from_bf16(dC.get()))
    ref = alpha * (from_bf16(A).astype(np.float64) @ from_bf16(B).astype(np.float64).T)
    if has_bias:
        ref = ref + from_bf16(bias)
    assert np.isfinite(outs[1]).all()
    bf16_close(outs[1], ref, f"bf16 {layout} {bn} {schedule} stmatrix")
    assert np.array_equal(outs[0], outs[1]), "stmatrix staging / alpha-1 skip changed the bits"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,layout,bn,schedule,rm,out", [
    ("bf16", "kk", 256, "coop", None, "bf16"), ("bf16", "kn", 192, "coop", None, "bf16"),
    ("bf16", "mn", 160, "coop", None, "bf16"), ("bf16", "kk", 128, "coop", None, "fp32"),
    ("bf16", "kk", 128, "pingpong", 128, "bf16"), ("bf16", "kn", 192, "pingpong", 64, "bf16"),
    ("tf32", "kk", 128, "coop", None, "fp32"), ("tf32", "kk", 128, "pingpong", 128, "fp32")])
def test_desc_step_keeps_the_bits(hopper, rng, dtype, layout, bn, schedule, rm, out):
    """GEMM_DESC_STEP (the mainloops' wgmma descriptors stepped by 32-bit adds, the default) against 0 (each
    rebuilt from its address): the same bits, every element written, and close to float64, for K-major and
    MN-major operands, both schedules, tf32 and bf16, K over several turns of the stage ring."""
    from llmc.bf16 import BF16, from_bf16, to_bf16
    from llmc.testing import bf16_close, module_defines, poison
    M, N, K = 260, 300, 1000
    A, B = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
    if dtype == "bf16":
        A, B = from_bf16(to_bf16(A)), from_bf16(to_bf16(B))
    As, lda = _stored(A, layout[0] == "m", rng)
    Bs, ldb = _stored(B, layout[1] == "n", rng)
    conv = to_bf16 if dtype == "bf16" else (lambda x: x)
    dA, dB = hopper.to_device(conv(As)), hopper.to_device(conv(Bs))
    outs = []
    for defines in ({"GEMM_DESC_STEP": 0}, {}):
        with module_defines(hopper, "gemm_wgmma", defines):
            g = gw.wgmma_build(hopper, dtype, M, N, K, lda=lda, ldb=ldb, bn=bn, a_major=layout[0],
                               b_major=layout[1], out=out, schedule=schedule, rm=rm, splits=1, multicast=False)
            assert ("+pp" in g.plan[1]) == (schedule == "pingpong"), g.plan
            dC = hopper.empty((M, N), BF16 if out == "bf16" else np.float32)
            poison(dC)
            g(dC, dA, dB, None)
            c = dC.get()
            outs.append(from_bf16(c) if out == "bf16" else c)
    ref = A.astype(np.float64) @ B.astype(np.float64).T
    assert np.isfinite(outs[1]).all()
    if out == "bf16":
        bf16_close(outs[1], ref, f"{dtype} {layout} {bn} {schedule}")
    else:  # (tf32: 10-bit mantissas in; bf16 -> fp32: exact products, fp32 sums)
        tol = 2e-2 if dtype == "tf32" else 1e-3
        assert np.abs(outs[1] - ref).max() <= tol * np.abs(ref).max(), (dtype, layout, np.abs(outs[1] - ref).max())
    assert np.array_equal(outs[0], outs[1]), "the stepped descriptors changed the bits"
