"""GELU (tanh form): numpy references vs torch's gelu(approximate='tanh') and its autograd in float64,
cpu launchers (in-place backward), refusals; with -m gpu, every variant against the reference.

    python -m pytest tests/test_gelu.py -q
    python -m pytest -m gpu tests/test_gelu.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import LLMCError, VariantRefused
from llmc.ops.gelu import gelu_backward_ref, gelu_forward_ref
from llmc.testing import assert_close, module_defines, poison

FWD = ops.get("gelu_forward")
BWD = ops.get("gelu_backward")


def inputs(rng, N, dtype=np.float64):
    x = rng.standard_normal(N) * 3.0  # reaches the tails where tanh saturates
    return x.astype(dtype), rng.standard_normal(N).astype(dtype)


def test_references_match_torch_tanh_gelu(rng):
    torch = pytest.importorskip("torch")
    x, dout = inputs(rng, 1000)
    tx = torch.tensor(x, requires_grad=True)
    tout = torch.nn.functional.gelu(tx, approximate="tanh")
    tout.backward(torch.tensor(dout))
    np.testing.assert_allclose(gelu_forward_ref(x), tout.detach().numpy(), rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(gelu_backward_ref(x, dout), tx.grad.numpy(), rtol=1e-12, atol=1e-13)


def test_references_in_float32(rng):
    x, dout = inputs(rng, 1000)
    x32, d32 = x.astype(np.float32), dout.astype(np.float32)
    assert gelu_forward_ref(x32).dtype == gelu_backward_ref(x32, d32).dtype == np.float32
    assert_close(gelu_forward_ref(x32), gelu_forward_ref(x32.astype(np.float64)), 1e-6, 1e-5)
    assert_close(gelu_backward_ref(x32, d32), gelu_backward_ref(x32.astype(np.float64), d32.astype(np.float64)),
                 1e-5, 1e-5)


def test_cpu_launchers_and_in_place_backward(rng):
    N = 37
    x, dout = inputs(rng, N)
    out = np.full(N, np.nan)
    FWD.cpu(N=N)(out, x)
    np.testing.assert_array_equal(out, gelu_forward_ref(x))
    want = gelu_backward_ref(x, dout)
    d = dout.copy()
    BWD.cpu(N=N)(d, x, d)  # dinp aliases dout
    np.testing.assert_array_equal(d, want)


@pytest.mark.parametrize("spec", [FWD, BWD])
def test_float4_variant_refuses_odd_N(spec):
    reason = spec.variants[2].refuse_reason(N=66 * 3 + 1)
    assert reason and "multiple of 4" in reason
    with pytest.raises(VariantRefused, match=spec.flag):
        spec.build(None, 2, N=199)
    assert spec.variants[2].refuse_reason(N=4 * 1024 * 3072) is None
    assert spec.variants[1].refuse_reason(N=199) is None
    with pytest.raises(LLMCError, match="have 1, 2"):
        spec.variant(7)


def test_bf16_kernels_sigmoid_form_is_the_tanh_form(rng):
    """The bf16 kernels compute gelu as x * sigmoid(2u) and gelu' as s + 2 x s (1 - s) k (1 + 3c x^2)
    (cuda/gelu.cu); the same formulas in float64 equal the tanh-form references."""
    x, dout = inputs(rng, 2000)
    x = np.concatenate([x, [-30.0, -12.0, 0.0, 12.0, 30.0]])
    k, c = np.sqrt(2 / np.pi), 0.044715
    u = k * (x + c * x ** 3)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-2.0 * u))
    np.testing.assert_allclose(x * s, gelu_forward_ref(x), rtol=1e-12, atol=1e-14)
    grad = s + 2.0 * x * (s - s * s) * k * (1.0 + 3.0 * c * x * x)
    np.testing.assert_allclose(grad, gelu_backward_ref(x, np.ones_like(x)), rtol=1e-10, atol=1e-12)


def test_default_variants_have_bf16_builds():
    for spec in (FWD, BWD):
        assert "bf16" in spec.variants[spec.default].dtypes
        assert "bf16" in spec.variants[1].dtypes  # the any-N fallback


# ----------------------------------------------------------------------------------------------
# GPU

# N = B*T*4C for (B,T,C) = (1,1,80), (2,65,96), (4,64,768), (2,33,1600), plus N = 1 and an odd N
SIZES = [1 * 1 * 4 * 80, 2 * 65 * 4 * 96, 4 * 64 * 4 * 768, 2 * 33 * 4 * 1600, 1, 1003]


def _refused(spec, number, N):
    reason = spec.variants[number].refuse_reason(N=N)
    if reason:
        assert N % 4 and number == 2, reason
    return reason


@pytest.mark.gpu
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", sorted(FWD.variants))
def test_forward_gpu(rt, rng, number, N):
    if _refused(FWD, number, N):
        return
    x, _ = inputs(rng, N, np.float32)
    launch = FWD.build(rt, number, N=N)
    out = rt.empty(N)
    poison(out)
    launch(out, rt.to_device(x))
    assert_close(out.get(), gelu_forward_ref(x.astype(np.float64)), 1e-6, 1e-5, "out")  # tanhf: ~2 ulp


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", sorted(BWD.variants))
def test_backward_gpu(rt, rng, number, N, in_place):
    if _refused(BWD, number, N):
        return
    x, dout = inputs(rng, N, np.float32)
    launch = BWD.build(rt, number, N=N)
    d_dout = rt.to_device(dout)
    dinp = d_dout if in_place else rt.empty(N)
    if not in_place:
        poison(dinp)
    launch(dinp, rt.to_device(x), d_dout)
    # 1 - tanh^2 cancels in fp32 for |x| > 3: absolute error ~1e-6 at most
    assert_close(dinp.get(), gelu_backward_ref(x.astype(np.float64), dout.astype(np.float64)), 1e-5, 1e-5, "dinp")


# bf16 builds: inputs are bf16 values (rounded first, so the reference sees what the kernel sees),
# the reference is float64 on them. The kernel computes in fp32 (~1e-6 relative, the sigmoid form
# with __expf) and rounds once on the store: <= 2^-9 relative. Tolerance: rtol 2^-8 (two roundings'
# worth), and an atol of 1e-5 of the output's rms for the zero of gelu' near x = -0.75, where the fp32
# math's absolute error is all there is.
BF16_RTOL = 2.0 ** -8


def _bf16_variants(spec):
    return [n for n, v in sorted(spec.variants.items()) if "bf16" in v.dtypes]


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a))))


@pytest.mark.gpu
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", _bf16_variants(FWD))
def test_forward_gpu_bf16(rt, rng, number, N):
    if _refused(FWD, number, N):
        return
    x, _ = inputs(rng, N, np.float32)
    xb = to_bf16(x)
    launch = FWD.build(rt, number, "bf16", N=N)
    out = rt.empty(N, BF16)
    poison(out)
    launch(out, rt.to_device(xb))
    ref = gelu_forward_ref(from_bf16(xb).astype(np.float64))
    assert_close(from_bf16(out.get()), ref, 1e-5 * _rms(ref), BF16_RTOL, "out")


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("number", _bf16_variants(BWD))
def test_backward_gpu_bf16(rt, rng, number, N, in_place):
    if _refused(BWD, number, N):
        return
    x, dout = (to_bf16(a) for a in inputs(rng, N, np.float32))
    launch = BWD.build(rt, number, "bf16", N=N)
    d_dout = rt.to_device(dout)
    dinp = d_dout if in_place else rt.empty(N, BF16)
    if not in_place:
        poison(dinp)
    launch(dinp, rt.to_device(x), d_dout)
    ref = gelu_backward_ref(from_bf16(x).astype(np.float64), from_bf16(dout).astype(np.float64))
    assert_close(from_bf16(dinp.get()), ref, 1e-5 * _rms(ref), BF16_RTOL, "dinp")


@pytest.mark.gpu
def test_bf16_vector_kernel_takes_a_tail(rt, rng):
    """N % 8 != 0 (but % 4 == 0, so variant 2 takes it): the last thread's 4 elements go scalar, and
    nothing past N is written (a guard element after the tensor keeps its bits)."""
    N = 8 * 37 + 4
    x, _ = inputs(rng, N, np.float32)
    xb = to_bf16(x)
    buf = rt.empty(N + 8, BF16)
    poison(buf)
    FWD.build(rt, 2, "bf16", N=N)(buf.view(0, (N,)), rt.to_device(xb))
    got = buf.get()
    assert (got[N:] == 0xFFFF).all()
    ref = gelu_forward_ref(from_bf16(xb).astype(np.float64))
    assert_close(from_bf16(got[:N]), ref, 1e-5 * _rms(ref), BF16_RTOL, "out")


# ----------------------------------------------------------------------------------------------
# the fused form (colsum=True, with OC the row length): gelu_backward also adds the column sums of
# dinp, viewed as (N/OC, OC), into colsum (fc's bias gradient), instead of a matmul_backward_bias pass

def _colsum_variants():
    return [(n, dt) for n, v in sorted(BWD.variants.items()) if "colsum" in v.options for dt in v.dtypes]


def test_colsum_cpu_launcher_is_backward_then_bias(rng):
    """In place, as the model runs it: the plain launch, then matmul_backward_bias's cpu sum, bit for bit."""
    rows, OC = 6, 40
    x, dout = inputs(rng, rows * OC, np.float32)
    cs0 = rng.standard_normal(OC).astype(np.float32)
    d, cs = dout.copy(), cs0.copy()
    BWD.cpu(N=rows * OC, OC=OC, colsum=True)(d, cs, x, d)
    d2, cs2 = dout.copy(), cs0.copy()
    BWD.cpu(N=rows * OC)(d2, x, d2)
    ops.get("matmul_backward_bias").cpu(N=rows, OC=OC)(cs2, d2)
    np.testing.assert_array_equal(d, d2)
    np.testing.assert_array_equal(cs, cs2)
    assert not np.array_equal(cs, cs0)


def test_colsum_only_where_declared(rng):
    """Variant 2 (the default) has the fused form in both dtypes and takes any OC (rows that are
    not 16-byte aligned go scalar); variant 1 refuses it; N must be whole rows; the build's grid
    covers the columns in blocks of 32 vectors and fills one wave, its launch has the kernel's
    argument count (the fake runtime checks it against the PTX)."""
    from tests.fake_runtime import FakeRuntime
    assert (2, "fp32") in _colsum_variants() and (2, "bf16") in _colsum_variants()
    assert "has no colsum option" in BWD.refuse_reason(1, "fp32", N=4 * 3072, OC=3072, colsum=True)
    assert "whole rows" in BWD.refuse_reason(2, "bf16", N=4 * 3072 + 1, OC=3072, colsum=True)
    assert BWD.refuse_reason(2, "fp32", N=65 * 66, OC=66, colsum=True) is None
    assert "fixed" in BWD.refuse_reason(2, "fp32", N=65 * 66, OC=66, colsum=True, block_size=128)
    for rows, OC in [(1, 3072), (65, 80), (16384, 3072), (9, 100)]:
        for dtype, V in (("fp32", 4), ("bf16", 8)):
            rt = FakeRuntime()
            built = BWD.build(rt, 2, dtype, N=rows * OC, OC=OC, colsum=True)
            built(*[rt.empty(8) for _ in range(4)])
            (launch,) = rt.launches
            assert launch.grid[0] * 32 * V >= OC > (launch.grid[0] - 1) * 32 * V and launch.block == (32, 8, 1)
            nchunks, rows_per_chunk = launch.grid[1], int(launch.args[-1])
            assert rows_per_chunk % 8 == 0 and (nchunks - 1) * rows_per_chunk < rows <= nchunks * rows_per_chunk
            assert built.scratch["partials"].shape == (nchunks, OC)


# (rows, OC): one row, 65 rows, C not a power of two, OC % 8 == 4 and OC % 4 == 2 (scalar paths), GPT-2's
# 4C at several row counts (many chunks a column block: the ticket and the fixed-order finish)
COLSUM_SHAPES = [(1, 3072), (65, 3072), (65, 80), (130, 384), (9, 100), (33, 66), (257, 6400), (4099, 3072)]


@pytest.mark.gpu
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("rows,OC", COLSUM_SHAPES)
@pytest.mark.parametrize("number,dtype", _colsum_variants())
def test_backward_colsum_gpu(rt, rng, number, dtype, rows, OC, in_place):
    """Against the float64 reference: dinp (poisoned first when not in place) as the plain test, and
    bit-identical to the plain build's; colsum "+=" onto random values = the sum of the dinp the
    kernel stored (bf16: its rounded values, what matmul_backward_bias would read). The partials are
    poisoned before the launch: a chunk the kernel forgets to write is NaN in the sum."""
    N = rows * OC
    bf = dtype == "bf16"
    up = (lambda a: rt.to_device(to_bf16(a))) if bf else (lambda a: rt.to_device(a.astype(np.float32)))
    down = (lambda d: from_bf16(d.get()).astype(np.float64)) if bf else (lambda d: d.get().astype(np.float64))
    x, dout = inputs(rng, N, np.float32)
    if bf:
        x, dout = from_bf16(to_bf16(x)), from_bf16(to_bf16(dout))
    cs0 = rng.standard_normal(OC).astype(np.float32)
    if bf:
        cs0 = from_bf16(to_bf16(cs0))
    fused = BWD.build(rt, number, dtype, N=N, OC=OC, colsum=True)
    poison(fused.scratch["partials"])
    d_x, d_dout, colsum = up(x), up(dout), up(cs0)
    dinp = d_dout if in_place else rt.empty(N, BF16 if bf else np.float32)
    if not in_place:
        poison(dinp)
    fused(dinp, colsum, d_x, d_dout)
    if BWD.variants[number].refuse_reason(N=N) is None:  # (the plain fp32 form asks N % 4 == 0)
        plain = rt.empty(N, BF16 if bf else np.float32)
        BWD.build(rt, number, dtype, N=N)(plain, d_x, up(dout))
        np.testing.assert_array_equal(dinp.get(), plain.get())
    ref = gelu_backward_ref(x.astype(np.float64), dout.astype(np.float64))
    got = down(dinp)
    assert_close(got, ref, 1e-5 * _rms(ref), BF16_RTOL if bf else 1e-5, "dinp")
    # colsum: `rows` values of O(1) summed in fp32 (per thread, over 8 row-lanes, over chunks) onto
    # O(1): 1e-4 abs + rel, scaled by sqrt(rows / 257) past 257 rows; bf16 adds one rounding (2^-8)
    tol = 1e-4 * max(1.0, np.sqrt(rows / 257))
    assert_close(down(colsum), cs0 + got.reshape(rows, OC).sum(axis=0), tol, BF16_RTOL if bf else 1e-4, "colsum")


@pytest.mark.gpu
@pytest.mark.parametrize("number,dtype", _colsum_variants())
def test_backward_colsum_deterministic_replays_and_rounds_once(rt, rng, number, dtype):
    """One build launched three times (as a graph replays it: the finishing blocks must have reset
    their tickets) gives the same bits each time; and colsum is rounded once: 512 rows of
    dinp = 1 * 2^-9 (gelu'(10) = 1 in fp32) onto colsum = 1.0 give 2.0, where adding row by row in bf16
    would stay at 1.0."""
    bf = dtype == "bf16"
    up = (lambda a: rt.to_device(to_bf16(a))) if bf else (lambda a: rt.to_device(a.astype(np.float32)))
    rows, OC = 4099, 3072
    x, dout = (up(a) for a in inputs(rng, rows * OC, np.float32))
    launch = BWD.build(rt, number, dtype, N=rows * OC, OC=OC, colsum=True)
    results = []
    for _ in range(3):
        dinp, colsum = rt.empty(rows * OC, BF16 if bf else np.float32), up(np.zeros(OC))
        launch(dinp, colsum, x, dout)
        results.append((dinp.get(), colsum.get()))
    for r in results[1:]:
        np.testing.assert_array_equal(r[0], results[0][0])
        np.testing.assert_array_equal(r[1], results[0][1])
    rows = 512
    d = up(np.full(rows * OC, 2.0 ** -9))
    colsum = up(np.ones(OC))
    BWD.build(rt, number, dtype, N=rows * OC, OC=OC, colsum=True)(d, colsum, up(np.full(rows * OC, 10.0)), d)
    got = from_bf16(colsum.get()) if bf else colsum.get()
    np.testing.assert_array_equal(got, np.full(OC, 2.0, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("unroll", [1, 3, 4])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_backward_colsum_unroll_knob_keeps_the_bits(rt, rng, dtype, recompute, unroll):
    """GELU_CS_UNROLL (cuda/gelu.cu; the lab's --define gelu:GELU_CS_UNROLL=U) only changes how many
    rows a lane loads ahead: other values give the default build's bits for dinp and gout, and for
    colsum where both builds take the same chunks of rows (the chunks follow the blocks resident an SM,
    so the registers: fp32 builds of other unrollings can take other chunks, and then colsum adds in
    another order: within fp32 rounding). On rows that do not fill the last group, an OC with the
    scalar path, and GPT-2's 4C."""
    bf = dtype == "bf16"
    up = (lambda a: rt.to_device(to_bf16(a))) if bf else (lambda a: rt.to_device(a.astype(np.float32)))
    for rows, OC in ((4099, 3072), (65, 66), (131, 80)):
        N = rows * OC
        x, dout = inputs(rng, N, np.float32)
        cs0 = rng.standard_normal(OC)
        d_x = up(x)
        res, chunks = [], []
        for d in ({}, {"GELU_CS_UNROLL": unroll}):
            with module_defines(rt, "gelu", d):
                built = BWD.build(rt, 2, dtype, N=N, OC=OC, colsum=True, recompute=recompute)
            dinp, colsum = up(dout), up(cs0)  # in place, as the model runs it
            outs = [dinp, colsum]
            if recompute:
                gout = rt.empty(N, BF16 if bf else np.float32)
                poison(gout)
                built(dinp, colsum, gout, d_x, dinp)
                outs.append(gout)
            else:
                built(dinp, colsum, d_x, dinp)
            res.append([o.get() for o in outs])
            chunks.append(built.info["rows_per_chunk"])
            np.testing.assert_array_equal(built.scratch["counters"].get(), 0)
        for name, a, b in zip(("dinp", "colsum", "gout"), *res):
            if name == "colsum" and chunks[0] != chunks[1]:  # (another order: within a rounding)
                conv = (lambda v: from_bf16(v).astype(np.float64)) if bf else (lambda v: v.astype(np.float64))
                np.testing.assert_allclose(conv(a), conv(b), rtol=2.0 ** -7 if bf else 1e-5,
                                           atol=1e-5 * np.sqrt(rows), err_msg=name)
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"{name}, {rows} x {OC}")
