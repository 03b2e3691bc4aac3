"""Layernorm: numpy references vs torch autograd (float64), cpu launcher semantics, shape refusals;
with -m gpu, every variant of layernorm_forward and layernorm_backward against the reference.

    python -m pytest tests/test_layernorm.py -q
    python -m pytest -m gpu tests/test_layernorm.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
from llmc.errors import LLMCError, VariantRefused
from llmc.ops.layernorm import layernorm_backward_ref, layernorm_forward_ref
from llmc.runtime import ceil_div
from llmc.testing import assert_close, poison

FWD = ops.get("layernorm_forward")
BWD = ops.get("layernorm_backward")


def inputs(rng, N, C, dtype=np.float64):
    # rows with their own offset and scale, so mean and rstd matter; weight/bias away from 1/0
    x = rng.standard_normal((N, C)) * rng.uniform(0.5, 2.0, (N, 1)) + rng.standard_normal((N, 1))
    w = 1.0 + 0.2 * rng.standard_normal(C)
    b = 0.2 * rng.standard_normal(C)
    dout = rng.standard_normal((N, C))
    return [a.astype(dtype) for a in (x, w, b, dout)]


# ----------------------------------------------------------------------------------------------
# references (no GPU)

@pytest.mark.parametrize("N,C", [(7, 33), (1, 768), (16, 80)])
def test_references_match_torch_autograd(rng, N, C):
    torch = pytest.importorskip("torch")
    x, w, b, dout = inputs(rng, N, C)
    out, mean, rstd = layernorm_forward_ref(x, w, b)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    tout = torch.nn.functional.layer_norm(tx, (C,), tw, tb, eps=1e-5)
    tout.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(mean, x.mean(-1), rtol=1e-12, atol=1e-12)
    trstd = 1.0 / torch.sqrt(tx.detach().var(-1, unbiased=False) + 1e-5)
    np.testing.assert_allclose(rstd, trstd.numpy(), rtol=1e-12, atol=1e-12)
    dinp, dweight, dbias = layernorm_backward_ref(dout, x, w, mean, rstd)
    np.testing.assert_allclose(dinp, tx.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dweight, tw.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(dbias, tb.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_references_in_float32(rng):
    x, w, b, dout = inputs(rng, 12, 96)
    o64, m64, s64 = layernorm_forward_ref(x, w, b)
    o32, m32, s32 = layernorm_forward_ref(*(a.astype(np.float32) for a in (x, w, b)))
    assert o32.dtype == m32.dtype == s32.dtype == np.float32
    assert_close(o32, o64, 1e-5, 1e-5)
    g64 = layernorm_backward_ref(dout, x, w, m64, s64)
    g32 = layernorm_backward_ref(*(a.astype(np.float32) for a in (dout, x, w, m64, s64)))
    for a, r in zip(g32, g64):
        assert a.dtype == np.float32
        assert_close(a, r, 1e-4, 1e-5)


def test_cpu_launchers_overwrite_and_accumulate(rng):
    N, C = 10, 24
    x, w, b, dout = inputs(rng, N, C)
    flat = rng.standard_normal(N * C + 2 * N)  # outputs as views into one flat buffer, like the model
    out, mean, rstd = flat[:N * C].reshape(N, C), flat[N * C:N * C + N], flat[N * C + N:]
    FWD.cpu(N=N, C=C)(out, mean, rstd, x, w, b)
    ro, rm, rs = layernorm_forward_ref(x, w, b)
    np.testing.assert_array_equal(flat, np.concatenate([ro.ravel(), rm, rs]))
    dinp0, dw0, db0 = rng.standard_normal((N, C)), rng.standard_normal(C), rng.standard_normal(C)
    dinp, dw, db = dinp0.copy(), dw0.copy(), db0.copy()
    BWD.cpu(N=N, C=C)(dinp, dw, db, dout, x, w, rm, rs)
    gi, gw, gb = layernorm_backward_ref(dout, x, w, rm, rs)
    np.testing.assert_allclose(dinp, dinp0 + gi, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(dw, dw0 + gw, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(db, db0 + gb, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("spec,number", [(FWD, 4), (FWD, 5), (BWD, 4), (BWD, 5)])
def test_float4_variants_refuse_odd_C(spec, number):
    for C, why in [(66, "multiple of 4"), (4096, "registers")]:
        reason = spec.variants[number].refuse_reason(N=8, C=C)
        assert reason and why in reason
        with pytest.raises(VariantRefused, match=spec.flag):
            spec.build(None, number, N=8, C=C)  # refused before it touches the (absent) GPU
    assert spec.variants[number].refuse_reason(N=8, C=768) is None


def test_variant6_refuses_in_one_line():
    """Variant 6 moves 16-byte vectors only and holds rows in registers: it names the constraint."""
    assert "multiple of 8" in FWD.refuse_reason(6, "bf16", N=8, C=100)
    assert FWD.refuse_reason(6, "fp32", N=8, C=100) is None  # fp32: 4 a vector
    assert "C=2056 > 2048" in FWD.refuse_reason(6, "bf16", N=8, C=2056)
    assert "C=1032 > 1024" in BWD.refuse_reason(6, "bf16", N=8, C=1032)
    assert "C=768 > 512" in BWD.refuse_reason(6, "fp32", N=8, C=768)
    for spec in (FWD, BWD):
        assert spec.refuse_reason(6, "bf16", N=16384, C=768) is None
        assert spec.default == 5  # the fp32 defaults (timed on the GPU; 6 and 7 do not take C=768 in fp32)


def test_variant7_refuses_in_one_line_and_declares_its_scratch():
    """Backward 7: 16-byte vectors only, rows in registers (bf16 C <= 1024, fp32 C <= 384);
    it takes colsum; a build allocates exactly what it declares (the partials and two ticket words)
    and launches one kernel, no reduce."""
    from tests.fake_runtime import FakeRuntime
    assert "multiple of 8" in BWD.refuse_reason(7, "bf16", N=8, C=100, colsum=True)
    assert "C=1032 > 1024" in BWD.refuse_reason(7, "bf16", N=8, C=1032)
    assert "C=768 > 384" in BWD.refuse_reason(7, "fp32", N=8, C=768)
    for reason in (BWD.refuse_reason(7, "bf16", N=8, C=100), BWD.refuse_reason(7, "fp32", N=8, C=66)):
        assert "\n" not in reason and "variant 7" in reason
    with pytest.raises(VariantRefused, match="--layernorm-backward-kernel 7"):
        BWD.build(None, 7, "bf16", N=8, C=100)
    # the bf16 defaults (timed on the H100 at B=16): backward 7, forward 4; fp32 keeps 5 in both
    assert BWD.default_for("bf16") == 7 and FWD.default_for("bf16") == 4
    assert BWD.default_for("fp32") == FWD.default_for("fp32") == 5
    assert BWD.refuse_reason(7, "bf16", N=16384, C=768, colsum=True) is None
    assert (7, "bf16") in _colsum_variants() and (7, "fp32") in _colsum_variants()
    for N, C in [(1, 768), (16384, 768), (65, 80), (9, 1024), (4099, 384)]:
        for colsum in (False, True):
            for d in ("fp32", "bf16"):
                if BWD.refuse_reason(7, d, N=N, C=C, colsum=colsum):
                    continue
                rt = FakeRuntime()
                built = BWD.build(rt, 7, d, N=N, C=C, colsum=colsum)
                assert rt.allocated_bytes == BWD.variants[7].scratch_bytes(N=N, C=C, colsum=colsum)
                built(*[rt.empty(8) for _ in range(9 if colsum else 8)])
                assert len(rt.launches) == 1 and "kernel7" in rt.launches[0].func
                grid = rt.launches[0].grid[0]
                assert grid * (3 if colsum else 2) * C * 4 <= built.scratch["partials"].nbytes and grid <= N


@pytest.mark.parametrize("number,dtype", [(7, "bf16"), (5, "fp32"), (5, "bf16")])
def test_deferred_form_builds_and_refuses(number, dtype):
    """deferred=S (variants 5 and 7): S slots of partials (declared), launch(slot, ...) runs the main
    kernel alone (7: no tickets taken, LN7_SPLIT; 5: no reduce launch) into its slot's partials; a slot
    taken twice before a flush, or outside [0, S), is an error; only 5 and 7 take the option."""
    from tests.fake_runtime import FakeRuntime
    from llmc.ops import layernorm as ln
    assert "no deferred option" in BWD.refuse_reason(4, "fp32", N=8, C=768, deferred=4)
    assert "slots >= 1" in BWD.refuse_reason(number, dtype, N=8, C=384, colsum=True, deferred=-1)
    N, C = 4096, 384 if dtype == "fp32" else 768
    assert BWD.refuse_reason(number, dtype, N=N, C=C, colsum=True, deferred=24) is None
    for colsum in (False, True):
        rt = FakeRuntime()
        built = BWD.build(rt, number, dtype, N=N, C=C, colsum=colsum, deferred=3)
        assert rt.allocated_bytes <= BWD.variants[number].scratch_bytes(N=N, C=C, colsum=colsum, deferred=3)
        assert built.flush is not None
        args = [rt.empty(8) for _ in range(9 if colsum else 8)]
        built(2, *args)
        built(0, *args)
        with pytest.raises(RuntimeError, match="slot 2 taken twice"):
            built(2, *args)
        with pytest.raises(IndexError, match="slot 3 outside"):
            built(3, *args)
        assert [x.func.startswith(f"layernorm_backward_kernel{number}") for x in rt.launches] == [True, True]
        part = built.scratch["partials"]
        slot_bytes = part.nbytes // 3
        p_index = (4 if colsum else 3) if number == 7 else 1  # the partials' argument
        assert [x.args[p_index] for x in rt.launches] == [part.ptr + 2 * slot_bytes, part.ptr]
        assert rt.launches[0].grid[0] * 3 * C * 4 == slot_bytes
        if number == 7:
            assert int(rt.launches[0].args[-1]) & ln.LN7_SPLIT


def test_variants_table():
    for spec in (FWD, BWD):
        assert spec.default in spec.variants and len(spec.variants) >= (5 if spec is FWD else 4)
        for n, v in spec.variants.items():
            assert v.number == n and v.description
            assert v.refuse_reason(N=5, C=80) is None
            assert "block_size" in (v.refuse_reason(N=5, C=80, block_size=48) or "")
        with pytest.raises(LLMCError, match="have 1, 2"):
            spec.variant(99)


def test_bf16_builds_and_declared_scratch():
    """The defaults and the any-C fallback (3) have bf16 builds; the deterministic backward variants
    allocate exactly the fp32 scratch they declare (Variant.scratch_bytes: the model's memory
    estimate), in both dtypes, and use no more blocks than it holds."""
    from tests.fake_runtime import FakeRuntime
    for spec in (FWD, BWD):
        assert {"fp32", "bf16"} <= set(spec.variants[spec.default].dtypes)
        assert "bf16" in spec.variants[3].dtypes
    for N, C in [(1, 768), (65, 80), (4096, 768), (16384, 768), (64, 1600), (9, 100)]:
        for num, v in BWD.variants.items():
            if v.scratch_bytes is None:
                continue
            for dtype in v.dtypes:
                if BWD.refuse_reason(num, dtype, N=N, C=C):
                    continue
                rt = FakeRuntime()
                built = BWD.build(rt, num, dtype, N=N, C=C)
                assert rt.allocated_bytes == v.scratch_bytes(N=N, C=C), (num, dtype, N, C)
                built(*[rt.empty(8) for _ in range(8)])  # (fake launches: recorded, not run)
                grid = rt.launches[0].grid[0]  # blocks, each writing one (2, C) row of partials
                assert grid * 2 * C * 4 <= rt.allocated_bytes and grid <= N, (num, dtype, N, C, grid)


# ----------------------------------------------------------------------------------------------
# GPU: every variant against the float64 reference

# N not a multiple of any block's rows (257, 65), N=1, C not a power of two (80, 96, 1600), C=66
# (the float4 variants must refuse it; the others run)
SHAPES = [(1, 768), (65, 80), (130, 96), (257, 768), (64, 1600), (33, 66)]


def _expect_refusal(spec, number, N, C, dtype="fp32"):
    reason = spec.refuse_reason(number, dtype, N=N, C=C)
    if reason:  # only the float4 variants may refuse these shapes, and only for C % 4 != 0; variant 6
        # (16-byte vectors only, rows in registers) also for C % 8 != 0 in bf16 and a C past its budget
        v = 8 if dtype == "bf16" else 4
        assert (C % 4 and number in (4, 5)) or (number in (6, 7) and (C % v or f"C={C} >" in reason)), reason
        with pytest.raises(VariantRefused, match=spec.flag):
            spec.build(None, number, dtype, N=N, C=C)
    return reason


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES)
@pytest.mark.parametrize("number", sorted(FWD.variants))
def test_forward_gpu(rt, rng, number, N, C):
    if _expect_refusal(FWD, number, N, C):
        return
    x, w, b, _ = inputs(rng, N, C)
    launch = FWD.build(rt, number, N=N, C=C)
    d_x, d_w, d_b = (rt.to_device(a.astype(np.float32)) for a in (x, w, b))
    out, mean, rstd = rt.empty((N, C)), rt.empty(N), rt.empty(N)
    poison(out, mean, rstd)
    launch(out, mean, rstd, d_x, d_w, d_b)
    # float32 inputs, float64 reference on those same values
    ro, rm, rs = layernorm_forward_ref(*(a.astype(np.float32).astype(np.float64) for a in (x, w, b)))
    # fp32: |out| <~ 10 after a C-term mean/variance; 1e-5 abs + 1e-5 rel is ~100x the rounding
    assert_close(out.get(), ro, 1e-5, 1e-5, "out")
    assert_close(mean.get(), rm, 1e-5, 1e-5, "mean")
    assert_close(rstd.get(), rs, 1e-5, 1e-5, "rstd")


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES)
@pytest.mark.parametrize("number", sorted(BWD.variants))
def test_backward_gpu_accumulates(rt, rng, number, N, C):
    if _expect_refusal(BWD, number, N, C):
        return
    x, w, b, dout = (a.astype(np.float32) for a in inputs(rng, N, C))
    _, mean, rstd = layernorm_forward_ref(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    init = [rng.standard_normal(s).astype(np.float32) for s in ((N, C), C, C)]  # "+=" outputs pre-filled
    launch = BWD.build(rt, number, N=N, C=C)
    dinp, dweight, dbias = (rt.to_device(a) for a in init)
    launch(dinp, dweight, dbias, *(rt.to_device(a) for a in (dout, x, w, mean, rstd)))
    gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
    assert_close(dinp.get(), init[0] + gi, 1e-5, 1e-5, "dinp")
    # dweight/dbias sum N rows of O(1) terms in fp32 in whatever order the variant uses
    assert_close(dweight.get(), init[1] + gw, 1e-4, 1e-4, "dweight")
    assert_close(dbias.get(), init[2] + gb, 1e-4, 1e-4, "dbias")


@pytest.mark.gpu
@pytest.mark.parametrize("number", [3, 4, 5])
def test_backward_deterministic_variants_are_bitwise_repeatable(rt, rng, number):
    N, C = 1031, 768
    x, w, b, dout = (a.astype(np.float32) for a in inputs(rng, N, C))
    _, mean, rstd = (a.astype(np.float32) for a in layernorm_forward_ref(x, w, b))
    ins = [rt.to_device(a) for a in (dout, x, w, mean, rstd)]
    launch = BWD.build(rt, number, N=N, C=C)
    results = []
    for _ in range(2):
        outs = [rt.zeros(s) for s in ((N, C), C, C)]
        launch(*outs, *ins)
        results.append([o.get().view(np.uint32) for o in outs])
    for a, b_ in zip(*results):
        np.testing.assert_array_equal(a, b_)


# ----------------------------------------------------------------------------------------------
# GPU, bf16 builds: inputs are bf16 values (the reference sees what the kernel sees), mean and rstd
# fp32. The kernels compute in fp32 and round each output element once (<= 2^-9 relative), so:
#   bf16 outputs: rtol 2^-8 (twice the one rounding), plus the fp32 test's absolute budget for the
#     fp32 math before the rounding (1e-5 for out and dinp; 1e-4 for dweight/dbias, N-row sums);
#   mean, rstd (fp32, from the same bf16 values): the fp32 test's 1e-5 abs + 1e-5 rel.

BF16_RTOL = 2.0 ** -8
SHAPES_BF16 = SHAPES + [(9, 100), (33, 36)]  # C % 8 == 4: the vector kernels' scalar path


def _bf16_variants(spec):
    return [n for n, v in sorted(spec.variants.items()) if "bf16" in v.dtypes]


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES_BF16)
@pytest.mark.parametrize("number", _bf16_variants(FWD))
def test_forward_gpu_bf16(rt, rng, number, N, C):
    if _expect_refusal(FWD, number, N, C, "bf16"):
        return
    x, w, b = (to_bf16(a) for a in inputs(rng, N, C)[:3])
    launch = FWD.build(rt, number, "bf16", N=N, C=C)
    out, mean, rstd = rt.empty((N, C), BF16), rt.empty(N), rt.empty(N)
    poison(out, mean, rstd)
    launch(out, mean, rstd, *(rt.to_device(a) for a in (x, w, b)))
    ro, rm, rs = layernorm_forward_ref(*(from_bf16(a).astype(np.float64) for a in (x, w, b)))
    assert_close(from_bf16(out.get()), ro, 1e-5, BF16_RTOL, "out")
    assert_close(mean.get(), rm, 1e-5, 1e-5, "mean")
    assert_close(rstd.get(), rs, 1e-5, 1e-5, "rstd")


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES_BF16)
@pytest.mark.parametrize("number", _bf16_variants(BWD))
def test_backward_gpu_bf16_accumulates(rt, rng, number, N, C):
    if _expect_refusal(BWD, number, N, C, "bf16"):
        return
    x, w, b, dout = (round_bf16(a) for a in inputs(rng, N, C))
    _, mean, rstd = layernorm_forward_ref(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    init = [round_bf16(rng.standard_normal(s)) for s in ((N, C), C, C)]  # "+=" outputs pre-filled
    launch = BWD.build(rt, number, "bf16", N=N, C=C)
    dinp, dweight, dbias = (rt.to_device(to_bf16(a)) for a in init)
    launch(dinp, dweight, dbias, *(rt.to_device(to_bf16(a)) for a in (dout, x, w)), rt.to_device(mean), rt.to_device(rstd))
    gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
    assert_close(from_bf16(dinp.get()), init[0] + gi, 1e-5, BF16_RTOL, "dinp")
    assert_close(from_bf16(dweight.get()), init[1] + gw, 1e-4, BF16_RTOL, "dweight")
    assert_close(from_bf16(dbias.get()), init[2] + gb, 1e-4, BF16_RTOL, "dbias")


@pytest.mark.gpu
@pytest.mark.parametrize("number", [6, 7])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("N,C", [(16391, 768), (50001, 200), (20000, 1024), (4099, 96)])
def test_variant6_many_rows_per_warp(rt, rng, number, dtype, N, C):
    """Variants 6 and 7 (backward) give each resident warp R = ceil(N / warps) rows (6 consecutive, 7
    strided over the grid) and load the next ones ahead: the small SHAPES above have R = 1 on an H100, these have R >= 2
    (and N not a multiple of the warps, C = 200: a partial last vector column per lane, C = 96 in fp32
    where V = 4). Forward outputs poisoned; backward "+=" onto random values; float64 references on
    the same inputs."""
    bf = dtype == "bf16"
    conv, back = (to_bf16, from_bf16) if bf else ((lambda a: a.astype(np.float32)), (lambda a: a))
    dty = BF16 if bf else np.float32
    x, w, b, dout = (back(conv(a)).astype(np.float32) for a in inputs(rng, N, C))
    if number in FWD.variants and not FWD.refuse_reason(number, dtype, N=N, C=C):  # (no forward 7)
        out, mean, rstd = rt.empty((N, C), dty), rt.empty(N), rt.empty(N)
        poison(out, mean, rstd)
        FWD.build(rt, number, dtype, N=N, C=C)(out, mean, rstd, *(rt.to_device(conv(a)) for a in (x, w, b)))
        ro, rm, rs = layernorm_forward_ref(*(a.astype(np.float64) for a in (x, w, b)))
        assert_close(back(out.get()).astype(np.float64), ro, 1e-5, BF16_RTOL if bf else 1e-5, "out")
        assert_close(mean.get(), rm, 1e-5, 1e-5, "mean")
        assert_close(rstd.get(), rs, 1e-5, 1e-5, "rstd")
    if not BWD.refuse_reason(number, dtype, N=N, C=C):
        _, mean, rstd = (a.astype(np.float32) for a in layernorm_forward_ref(*(a.astype(np.float64) for a in (x, w, b))))
        init = [back(conv(rng.standard_normal(s))).astype(np.float32) for s in ((N, C), C, C)]
        dinp, dweight, dbias = (rt.to_device(conv(a)) for a in init)
        BWD.build(rt, number, dtype, N=N, C=C)(dinp, dweight, dbias, *(rt.to_device(conv(a)) for a in (dout, x, w)),
                                          rt.to_device(mean), rt.to_device(rstd))
        gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
        rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
        assert_close(back(dinp.get()).astype(np.float64), init[0] + gi, 1e-5, BF16_RTOL if bf else 1e-5, "dinp")
        # dweight/dbias: N (up to 50001) rows summed in fp32 per lane, per block and over blocks: the
        # fp32 sum's error grows ~sqrt(N) * 2^-24 * |sum|, so 1e-5 of the sums' rms (plus one bf16 rounding)
        for name, got, want in (("dweight", dweight, init[1] + gw), ("dbias", dbias, init[2] + gb)):
            assert_close(back(got.get()).astype(np.float64), want, 1e-5 * rms(want), BF16_RTOL if bf else 1e-5, name)


@pytest.mark.gpu
@pytest.mark.parametrize("colsum", [False, True])
@pytest.mark.parametrize("dtype,N,C", [("bf16", 16391, 768), ("bf16", 4099, 1024), ("bf16", 1, 768),
                                       ("bf16", 3, 64), ("fp32", 5001, 384)])
def test_backward7_one_launch_repeats_and_replays(rt, rng, dtype, N, C, colsum):
    """Variant 7 sums the blocks' partials in its own launch: the last blocks to take a ticket wait for
    the rest (the count of arrivals grows by G a launch, the launch's base the count rounded down to G,
    wrapping to 0 at G * floor((2^32 - 1) / G)), then sum 32-column slices in block order, the outputs'
    old values staged in shared memory where they are 16-byte aligned. So: against the float64 reference
    with the partials poisoned first; five launches of one build from the same starting values give the
    same bits every time (a wrong base would skip the final sums or let them read unwritten partials),
    and leave the count at 5 G; a launch from the count's last base (it wraps to 0) and from an odd
    multiple of G the same bits; dweight, dbias (, colsum) an element off 16-byte alignment (read from global
    memory) the same bits; a CUDA graph replay the same bits again; session 34's tail (LN7_RESET: the counters reset by the
    last summer) every bit the same; and the lab's two alternatives (6's consecutive rows per warp; the
    separate reduce kernel) the same dinp bit for bit (a row's dinp does not depend on which warp takes
    it) and the sums within their rounding."""
    bf = dtype == "bf16"
    val = round_bf16 if bf else (lambda a: a.astype(np.float32))
    x, w, b, dout = (val(a) for a in inputs(rng, N, C))
    _, mean, rstd = layernorm_forward_ref(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    init = [val(rng.standard_normal(s)) for s in ((N, C), C, C, C)][:4 if colsum else 3]
    ins = [_upload(rt, dtype, a) for a in (dout, x, w)] + [rt.to_device(mean), rt.to_device(rstd)]
    built = BWD.build(rt, 7, dtype, N=N, C=C, colsum=colsum)
    poison(built.scratch["partials"])
    outs = [_upload(rt, dtype, a) for a in init]

    def run(launch):
        for o, a in zip(outs, init):
            o.set(to_bf16(a) if bf else a)
        launch(*outs, *ins)
        rt.synchronize()
        return [o.get().copy() for o in outs]

    first = run(built)
    gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
    rtol = BF16_RTOL if bf else 1e-5
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
    dinp = _download(dtype, outs[0])
    assert_close(dinp, init[0] + gi, 1e-5, rtol, "dinp")
    wants = [init[1] + gw, init[2] + gb] + ([init[3] + dinp.sum(axis=0)] if colsum else [])
    for name, got, want in zip(("dweight", "dbias", "colsum"), outs[1:], wants):
        # N rows summed in fp32 per lane, per block and over the blocks: ~sqrt(N) 2^-24 of the sum
        assert_close(_download(dtype, got), want, 1e-4 + 1e-5 * rms(want), max(rtol, 1e-4), name)
    for _ in range(4):
        for a, b_ in zip(first, run(built)):
            np.testing.assert_array_equal(a, b_)
    G, tickets = built.info["grid"], built.scratch["tickets"]
    assert tickets.get().tolist() == [5 * G, 0], "the count: G a launch"
    wrap = G * (0xFFFFFFFF // G)
    for start, after in ((wrap - G, 0), (7 * G, 8 * G)):
        tickets.set(np.array([start, 0], np.uint32))
        for a, b_ in zip(first, run(built)):
            np.testing.assert_array_equal(a, b_, err_msg=f"count from {start}")
        assert tickets.get().tolist() == [after, 0]
    if built.info["outs_smem"]:  # (the sums' old values from global memory: views an element in)
        plain = outs
        outs = plain[:1] + [rt.zeros(o.size + 1, o.dtype).view(1, o.shape) for o in plain[1:]]
        for name, a, b_ in zip(("dinp", "dweight", "dbias", "colsum"), first, run(built)):
            np.testing.assert_array_equal(a, b_, err_msg=f"{name}, unaligned outputs")
        outs = plain
    if rt.graphs_available() is None:
        graph = rt.capture(lambda: built(*outs, *ins))
        for _ in range(2):
            for o, a in zip(outs, init):
                o.set(to_bf16(a) if bf else a)
            graph()
            rt.synchronize()
            for a, o in zip(first, outs):
                np.testing.assert_array_equal(a, o.get(), err_msg="graph replay")
    from llmc.ops import layernorm as ln
    reset = ln._backward7(dtype)(rt, N, C, colsum=colsum, flags=ln.LN7_RESET)
    for _ in range(2):  # (twice: its counters back to 0)
        for name, a, b_ in zip(("dinp", "dweight", "dbias", "colsum"), first, run(reset)):
            np.testing.assert_array_equal(a, b_, err_msg=f"{name}, session 34's tail")
    assert reset.scratch["tickets"].get().tolist() == [0, 0]
    # (and other ring depths: 2 stages, one row in flight; 6 in blocks of 4 warps; and more blocks than
    # are resident, 2 or 4 consecutive rows a warp)
    for flags, stages, bs, rpw in ((ln.LN7_CHUNKED, None, None, None), (ln.LN7_SPLIT, 2, None, None),
                                   (ln.LN7_CHUNKED | ln.LN7_SPLIT, 6, 128, None), (0, 3, 256, 2), (0, 2, 256, 4)):
        if rpw and ceil_div(N, rpw * 8) > 1024:
            continue  # (at most MAX_BLOCKS blocks)
        other = run(ln._backward7(dtype)(rt, N, C, block_size=bs, colsum=colsum, flags=flags, stages=stages,
                                         rows_per_warp=rpw))
        np.testing.assert_array_equal(other[0], first[0], err_msg=f"dinp, flags {flags}")
        for name, a, b_ in zip(("dweight", "dbias", "colsum"), first[1:], other[1:]):
            # another order of the fp32 sums: bf16 may round the two totals to neighbours (2^-7 apart)
            conv = from_bf16 if bf else (lambda v: v)
            assert_close(conv(b_), conv(a).astype(np.float64), 1e-4 + 1e-5 * rms(conv(a)), 2.0 ** -7 if bf else 1e-4,
                         f"{name}, flags {flags}")


@pytest.mark.gpu
@pytest.mark.parametrize("colsum", [False, True])
@pytest.mark.parametrize("number,dtype,N,C", [(7, "bf16", 4099, 768), (7, "bf16", 1, 768), (7, "bf16", 65, 64),
                                              (7, "fp32", 1031, 384), (5, "fp32", 4099, 768), (5, "fp32", 1, 384),
                                              (5, "bf16", 1031, 768)])
def test_backward_deferred_sums_at_the_flush(rt, rng, number, dtype, N, C, colsum):
    """The deferred form (variants 7 and 5): three calls (their own inputs and outputs) into slots 2, 0 and 3 of 4 (slot
    1 unused) with the partials poisoned first. Each call's dinp is written at once and its sums are
    untouched until the flush; after it every output matches the float64 reference. A second round
    gives the same bits, and so does a CUDA graph replay of launches + flush; a changed output under
    capture is refused. The sums: within rounding of the plain form's (another order)."""
    bf = dtype == "bf16"
    val = round_bf16 if bf else (lambda a: a.astype(np.float32))
    # the ticketed build first: 7's deferred form asks for less shared memory (no staging of the outputs'
    # old values) of the same entry point, and must not take back the ticketed launches' opt-in (Kernel.set_max_dynamic_smem)
    ticketed = BWD.build(rt, number, dtype, N=N, C=C, colsum=colsum)  # (5: with its reduce launch)
    built = BWD.build(rt, number, dtype, N=N, C=C, colsum=colsum, deferred=4)
    poison(built.scratch["partials"])
    calls = []
    for slot in (2, 0, 3):
        x, w, b, dout = (val(a) for a in inputs(rng, N, C))
        _, mean, rstd = layernorm_forward_ref(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
        mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
        init = [val(rng.standard_normal(sh)) for sh in ((N, C), C, C, C)][:4 if colsum else 3]
        ins = [_upload(rt, dtype, a) for a in (dout, x, w)] + [rt.to_device(mean), rt.to_device(rstd)]
        outs = [_upload(rt, dtype, a) for a in init]
        calls.append((slot, init, ins, outs, (dout, x, w, mean, rstd)))

    def reset():
        for _, init, _, outs, _ in calls:
            for o, a in zip(outs, init):
                o.set(to_bf16(a) if bf else a)

    def launches():
        for slot, _, ins, outs, _ in calls:
            built(slot, *outs, *ins)

    reset()
    launches()
    rt.synchronize()
    rtol = BF16_RTOL if bf else 1e-5
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
    for slot, init, _, outs, host in calls:  # dinp now, the sums not yet
        gi, _, _ = layernorm_backward_ref(*(a.astype(np.float64) for a in host))
        assert_close(_download(dtype, outs[0]), init[0] + gi, 1e-5, rtol, f"dinp, slot {slot}")
        for o, a in zip(outs[1:], init[1:]):
            np.testing.assert_array_equal(_download(dtype, o), a.astype(np.float64), err_msg=f"before the flush, slot {slot}")
    built.flush()
    rt.synchronize()
    first = []
    for slot, init, ins, outs, host in calls:
        gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in host))
        dinp = _download(dtype, outs[0])
        wants = [init[1] + gw, init[2] + gb] + ([init[3] + dinp.sum(axis=0)] if colsum else [])
        for name, got, want in zip(("dweight", "dbias", "colsum"), outs[1:], wants):
            assert_close(_download(dtype, got), want, 1e-4 + 1e-5 * rms(want), max(rtol, 1e-4), f"{name}, slot {slot}")
        first.append([o.get().copy() for o in outs])
        # the plain form (7: ticketed; 5: its reduce launch) on the same inputs: the same dinp bits, the sums within rounding
        tick = [_upload(rt, dtype, a) for a in init]
        ticketed(*tick, *ins)
        rt.synchronize()
        np.testing.assert_array_equal(tick[0].get(), outs[0].get(), err_msg=f"dinp against the plain form, slot {slot}")
        conv = from_bf16 if bf else (lambda v: v)
        for name, a, b_ in zip(("dweight", "dbias", "colsum"), outs[1:], tick[1:]):
            ref = conv(b_.get()).astype(np.float64)
            assert_close(conv(a.get()), ref, 1e-4 + 1e-5 * rms(ref), 2.0 ** -7 if bf else 1e-4, f"{name} against the plain form")

    def check_same(what):
        for (slot, _, _, outs, _), want in zip(calls, first):
            for o, a in zip(outs, want):
                np.testing.assert_array_equal(o.get(), a, err_msg=f"{what}, slot {slot}")

    reset()
    launches()
    built.flush()
    rt.synchronize()
    check_same("second round")
    if rt.graphs_available() is None:
        graph = rt.capture(lambda: (launches(), built.flush()))
        for _ in range(2):
            reset()
            graph()
            rt.synchronize()
            check_same("graph replay")
        other = [_upload(rt, dtype, a) for a in calls[0][1]]
        with pytest.raises(RuntimeError, match="changed under graph capture"):
            rt.capture(lambda: (built(0, *other, *calls[0][2]), built.flush()))
        built.flush()  # nothing pending after the refused capture (its slot dropped): no launch
        check_same("after the refused capture")


@pytest.mark.gpu
@pytest.mark.parametrize("number", _bf16_variants(BWD))
def test_backward_bf16_deterministic_and_rounds_once(rt, rng, number):
    """Bit-identical across runs; and dbias is rounded once: N rows of dout = 2^-9 added to
    dbias = 1.0 one bf16 rounding at a time would stay 1.0; summed in fp32 first, 1 + N * 2^-9."""
    N, C = 1031, 768
    x, w, b, dout = (round_bf16(a) for a in inputs(rng, N, C))
    _, mean, rstd = (a.astype(np.float32) for a in layernorm_forward_ref(x, w, b))
    ins = [rt.to_device(to_bf16(a)) for a in (dout, x, w)] + [rt.to_device(mean), rt.to_device(rstd)]
    launch = BWD.build(rt, number, "bf16", N=N, C=C)
    results = []
    for _ in range(2):
        outs = [rt.zeros(s, BF16) for s in ((N, C), C, C)]
        launch(*outs, *ins)
        results.append([o.get() for o in outs])
    for a, b_ in zip(*results):
        np.testing.assert_array_equal(a, b_)
    N = 512
    ins = [rt.to_device(to_bf16(np.full((N, C), v, np.float32))) for v in (2.0 ** -9, 1.0)]  # dout, inp
    ins += [rt.to_device(to_bf16(np.ones(C, np.float32))), rt.zeros(N), rt.to_device(np.ones(N, np.float32))]
    dbias = rt.to_device(to_bf16(np.ones(C, np.float32)))
    BWD.build(rt, number, "bf16", N=N, C=C)(rt.zeros((N, C), BF16), rt.zeros(C, BF16), dbias, *ins)
    np.testing.assert_array_equal(from_bf16(dbias.get()), np.full(C, 1.0 + N * 2.0 ** -9, np.float32))


# ----------------------------------------------------------------------------------------------
# the fused form (colsum=True): layernorm_backward also adds the column sums of the dinp it writes
# into colsum (the next linear layer's bias gradient), instead of a matmul_backward_bias pass

def _colsum_variants():
    return [(n, dt) for n, v in sorted(BWD.variants.items()) if "colsum" in v.options for dt in v.dtypes]


def test_colsum_cpu_launcher_is_backward_then_bias(rng):
    """The cpu fused form = the plain launch, then matmul_backward_bias's cpu sum of the whole dinp
    (after its +=): bit for bit, so the numpy model is the same with or without the fusion."""
    N, C = 10, 24
    x, w, b, dout = inputs(rng, N, C, np.float32)
    _, mean, rstd = layernorm_forward_ref(x, w, b)
    init = [rng.standard_normal(s).astype(np.float32) for s in ((N, C), C, C, C)]
    fused = [a.copy() for a in init]
    BWD.cpu(N=N, C=C, colsum=True)(*fused, dout, x, w, mean, rstd)
    plain = [a.copy() for a in init]
    BWD.cpu(N=N, C=C)(*plain[:3], dout, x, w, mean, rstd)
    ops.get("matmul_backward_bias").cpu(N=N, OC=C)(plain[3], plain[0])
    for f, p_ in zip(fused, plain):
        np.testing.assert_array_equal(f, p_)
    assert not np.array_equal(fused[3], init[3])


def test_colsum_only_where_declared_and_scratch(rng):
    """Variant 5 (the fp32 default) and 7 have the fused form in both dtypes; every other variant
    refuses it in one line; the fused build allocates the (G, 3, C) partials it declares, launches its kernel and
    the colsum reduce with one more pointer."""
    from tests.fake_runtime import FakeRuntime
    assert (5, "fp32") in _colsum_variants() and (5, "bf16") in _colsum_variants()
    for num in BWD.variants:
        if num not in (5, 7):
            assert "has no colsum option" in BWD.refuse_reason(num, "fp32", N=64, C=768, colsum=True)
    assert "multiple of 4" in BWD.refuse_reason(5, "fp32", N=64, C=66, colsum=True)
    for N, C in [(1, 768), (65, 80), (16384, 768), (64, 1600), (9, 100)]:
        for dtype in ("fp32", "bf16"):
            if BWD.refuse_reason(5, dtype, N=N, C=C, colsum=True):
                continue
            rt = FakeRuntime()
            built = BWD.build(rt, 5, dtype, N=N, C=C, colsum=True)
            assert rt.allocated_bytes == BWD.variants[5].scratch_bytes(N=N, C=C, colsum=True)
            assert rt.built[0].startswith("layernorm_backward_kernel5_colsum")
            assert rt.built[1] == "layernorm_backward_reduce_colsum_kernel" + ("_bf16" if dtype == "bf16" else "")
            built(*[rt.empty(8) for _ in range(9)])
            grid = rt.launches[0].grid[0]
            assert grid * 3 * C * 4 <= rt.allocated_bytes and grid <= N


def _upload(rt, dtype, a):
    return rt.to_device(to_bf16(a) if dtype == "bf16" else a.astype(np.float32))


def _download(dtype, d):
    return (from_bf16(d.get()) if dtype == "bf16" else d.get()).astype(np.float64)


@pytest.mark.gpu
@pytest.mark.parametrize("N,C", SHAPES_BF16 + [(4099, 768)])
@pytest.mark.parametrize("number,dtype", _colsum_variants())
def test_backward_colsum_gpu(rt, rng, number, dtype, N, C):
    """The fused form against the float64 reference, "+=" onto random values (colsum too), the
    partials poisoned first (a block row the kernel forgets is NaN in the sum); dinp, dweight and
    dbias are bit-identical to the plain build's (the fusion only adds a sum); colsum is the sum of
    the dinp the kernel stored (bf16: its rounded values), which is what matmul_backward_bias reads."""
    reason = BWD.refuse_reason(number, dtype, N=N, C=C, colsum=True)
    if reason:  # variant 5 (either dtype) refuses only C % 4 != 0 of these shapes; 7 (16-byte vectors
        # only, rows in registers) C % 8 != 0 in bf16 and a C past its register budget
        assert (C % 4 and "multiple of 4" in reason) or (number == 7 and ("multiple of" in reason or f"C={C} >" in reason)), reason
        return
    val = round_bf16 if dtype == "bf16" else (lambda a: a.astype(np.float32))
    x, w, b, dout = (val(a) for a in inputs(rng, N, C))
    _, mean, rstd = layernorm_forward_ref(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    mean, rstd = mean.astype(np.float32), rstd.astype(np.float32)
    init = [val(rng.standard_normal(s)) for s in ((N, C), C, C, C)]
    ins = [_upload(rt, dtype, a) for a in (dout, x, w)] + [rt.to_device(mean), rt.to_device(rstd)]
    fused = BWD.build(rt, number, dtype, N=N, C=C, colsum=True)
    poison(fused.scratch["partials"])
    outs = [_upload(rt, dtype, a) for a in init]
    fused(*outs, *ins)
    plain = [_upload(rt, dtype, a) for a in init[:3]]
    BWD.build(rt, number, dtype, N=N, C=C)(*plain, *ins)
    for name, f, p_ in zip(("dinp", "dweight", "dbias"), outs, plain):
        np.testing.assert_array_equal(f.get(), p_.get(), err_msg=name)
    gi, gw, gb = layernorm_backward_ref(*(a.astype(np.float64) for a in (dout, x, w, mean, rstd)))
    rtol = BF16_RTOL if dtype == "bf16" else 1e-5
    dinp = _download(dtype, outs[0])
    assert_close(dinp, init[0] + gi, 1e-5, rtol, "dinp")
    # colsum: N rows of O(1) values summed in fp32 (per warp, per block, over blocks) onto O(1): the
    # fp32 dbias budget of the plain test, 1e-4 abs + rel, scaled by sqrt(N / 257) past its shapes;
    # bf16 adds one rounding of the total (2^-8)
    tol = 1e-4 * max(1.0, np.sqrt(N / 257))
    assert_close(_download(dtype, outs[3]), init[3] + dinp.sum(axis=0), tol, max(rtol, 1e-4), "colsum")
    if dtype == "fp32":  # (bf16: the stored dinp's roundings add up to ~sqrt(N) 2^-9 over the rows)
        assert_close(outs[3].get(), init[3] + (init[0] + gi).sum(axis=0), tol, 1e-4, "colsum vs float64 dinp")


@pytest.mark.gpu
@pytest.mark.parametrize("number,dtype", _colsum_variants())
def test_backward_colsum_deterministic_and_rounds_once(rt, rng, number, dtype):
    """Two launches of one build (as a graph replays it) give the same bits, colsum included; and
    colsum is rounded once: N rows of dinp = 2^-9 (dout = 0 adds nothing to it) onto colsum = 1.0
    give 1 + N 2^-9 = 2.0, where adding row by row in bf16 would stay at 1.0."""
    N, C = 1031, 768 if dtype == "bf16" or number != 7 else 384  # (fp32 7: C <= 384)
    val = round_bf16 if dtype == "bf16" else (lambda a: a.astype(np.float32))
    x, w, b, dout = (val(a) for a in inputs(rng, N, C))
    _, mean, rstd = (a.astype(np.float32) for a in layernorm_forward_ref(x, w, b))
    ins = [_upload(rt, dtype, a) for a in (dout, x, w)] + [rt.to_device(mean), rt.to_device(rstd)]
    launch = BWD.build(rt, number, dtype, N=N, C=C, colsum=True)
    results = []
    for _ in range(2):
        outs = [_upload(rt, dtype, np.zeros(s)) for s in ((N, C), C, C, C)]
        launch(*outs, *ins)
        results.append([o.get() for o in outs])
    for a, b_ in zip(*results):
        np.testing.assert_array_equal(a, b_)
    N = 512
    ins = [_upload(rt, dtype, np.zeros((N, C))), _upload(rt, dtype, np.ones((N, C))), _upload(rt, dtype, np.ones(C)),
           rt.zeros(N), rt.to_device(np.ones(N, np.float32))]
    dinp, colsum = _upload(rt, dtype, np.full((N, C), 2.0 ** -9)), _upload(rt, dtype, np.ones(C))
    BWD.build(rt, number, dtype, N=N, C=C, colsum=True)(dinp, _upload(rt, dtype, np.zeros(C)),
                                                         _upload(rt, dtype, np.zeros(C)), colsum, *ins)
    np.testing.assert_array_equal(_download(dtype, colsum), np.full(C, 2.0))
