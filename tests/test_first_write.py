"""The first micro-step after zero_grad() writes the weights' gradients (GPT2.first_write,
LLMC_FIRST_WRITE): matmul_backward's overwrite form (dweight = dout^T @ inp, beta = 0, the old
gradient never read) for the dweight GEMMs, the other gradients zeroed inside that micro-step, and no
memset of every gradient at zero_grad().

The fake backend's memory is a numpy heap, so the CPU tests see what a GPU would hold: the gradients
left stale by zero_grad(), and the bits of every step against LLMC_FIRST_WRITE=0 (memset, then +=).
Two sabotages (the other gradients not zeroed; the twins accumulating) must change the gradients.
The GPU tests run the op's forms against the accumulating build and the float64 reference with the
old gradient poisoned, and whole training steps (graph replays, both precisions) against the
memset form, bit for bit."""
import numpy as np
import pytest

from llmc import ops
from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.model import GEMM_WEIGHTS, GPT2
from llmc.config import param_layout
from tests.fake_runtime import FakeCudaBackend

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=3, num_heads=2, channels=32)
B, T = 2, 16


def _train(be, steps=2, micro=2, sabotage=None, eager=False, **kw):
    """`steps` steps of `micro` micro-steps (train_micro_step, or forward + backward when eager);
    {name: value} of the losses, gradients and weights after each step."""
    rng = np.random.default_rng(7)
    m = GPT2(CFG, be, B, T, **kw)
    m.init_params(11)
    m.stochastic_rounding = False
    if sabotage == "rest not zeroed":
        m._rest_grads = []
    elif sabotage == "twins accumulate":
        m.k_first = {}
    out = {}
    for step in range(1, steps + 1):
        m.zero_grad()
        for _ in range(micro):
            x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
            y = np.roll(x, -1, axis=1)
            if eager:
                m.forward(x, y, read_loss=False)
                m.backward()
            else:
                m.train_micro_step(x, y)
        out[f"loss{step}"] = m.step_loss()
        out[f"grads{step}"] = m.get_grads()
        m.update(lr=1e-3, step=step, weight_decay=0.1)
        out[f"params{step}"] = m.get_params()
    return m, out


def _same(a, b):
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute,side", [(0, True), (1, True), (2, True), (1, False)])
@pytest.mark.parametrize("eager", [False, True], ids=["micro_step", "forward_backward"])
def test_first_write_gives_the_memset_bits(monkeypatch, precision, recompute, side, eager):
    monkeypatch.setenv("LLMC_FIRST_WRITE", "0")
    m0, ref = _train(FakeCudaBackend(precision=precision), recompute=recompute, side_stream=side, eager=eager)
    assert not m0.first_write and not m0.k_first
    monkeypatch.delenv("LLMC_FIRST_WRITE")
    m, got = _train(FakeCudaBackend(precision=precision), recompute=recompute, side_stream=side, eager=eager)
    assert m.first_write
    # one twin per dweight launch (bf16's lm head at this padded vocabulary has no bf16 form: its
    # gradient is zeroed with the rest), the same variant, built with overwrite
    assert len(m.k_first) == (4 if precision == "bf16" else 5)
    assert all(b.shape["overwrite"] for b in m.built_first.values())
    assert all(m.built_first[k].number == m.built[k].number for k in m.built_first)
    _same(ref, got)


@pytest.mark.parametrize("sabotage", ["rest not zeroed", "twins accumulate"])
def test_a_broken_first_write_is_caught(sabotage):
    """The second step's gradients differ when the first micro-step leaves the other gradients as the
    last step left them, or adds onto the weights' stale gradients (the first step's are equal: the
    buffer starts zeroed)."""
    ref = _train(FakeCudaBackend())[1]
    got = _train(FakeCudaBackend(), sabotage=sabotage)[1]
    np.testing.assert_array_equal(ref["grads1"], got["grads1"])
    assert not np.array_equal(ref["grads2"], got["grads2"])


def test_zero_grad_leaves_the_gradients_to_the_first_micro_step():
    """After a step, zero_grad() writes nothing to the gradients (the heap still holds them) and
    whoever reads them before a backward gets zeros; the captured micro-steps are two (the first
    after zero_grad, and the later ones), each replayed after its first run."""
    be = FakeCudaBackend()
    m, _ = _train(be, steps=1)
    held = be.rt.np(m.grads).copy()
    assert np.abs(held).max() > 0
    m.zero_grad()
    np.testing.assert_array_equal(be.rt.np(m.grads), held)         # stale, not zeroed
    assert m._graph_micro_first is not None and m._graph_micro is not None
    assert not m.get_grads().any()                                  # a reader zeroes them first
    assert not m._grads_stale
    m.zero_grad()
    m.update(lr=1e-3, step=2)  # no backward since zero_grad(): the update sees zero gradients
    assert not be.rt.np(m.grads).any()


def test_the_rest_is_every_gradient_no_dweight_gemm_writes():
    m = GPT2(CFG, FakeCudaBackend(), B, T)
    covered = np.zeros(m.num_params, bool)
    for v in m._rest_grads:
        off = (v.ptr - m.grads.ptr) // m.grads.dtype.itemsize
        covered[off:off + v.size] = True
    for name, off, size in param_layout(CFG):
        assert covered[off:off + size].all() != (name in GEMM_WEIGHTS.values()), name
    assert len(m._rest_grads) == 5  # wpe..ln1b, qkvb, attprojb..ln2b, fcb, fcprojb..lnfb
    # a GEMM without the form (bf16's lm head at a padded vocabulary that is not a multiple of 8): its
    # gradient joins the rest
    m = GPT2(CFG, FakeCudaBackend(precision="bf16", quiet=True), B, T)
    assert m.first_write and "mmb_lmhead" not in m.k_first and len(m.k_first) == 4
    off = (m._rest_grads[0].ptr - m.grads.ptr) // m.grads.dtype.itemsize
    assert off == 0 and m._rest_grads[0].size == param_layout(CFG)[4][1]  # wte..ln1b


def test_data_parallel_paths_zero_first():
    """Per-layer hooks (data parallel's last micro-step) run the accumulating backward: the
    gradients are zeroed before it, and the results are the memset form's."""
    def run(be, hooks):
        rng = np.random.default_rng(3)
        m = GPT2(CFG, be, B, T)
        m.init_params(11)
        grads = []
        for step in range(2):
            m.zero_grad()
            x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
            if hooks:
                m.train_micro_step(x, x, on_layer_grads=lambda layer: None)
            else:
                m.train_micro_step(x, x)
            grads.append(m.get_grads())
            m.update(lr=1e-3, step=step + 1)
        return grads
    for a, b in zip(run(FakeCudaBackend(), True), run(FakeCudaBackend(), False)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("B", [4, 16])
def test_twins_take_no_device_memory(monkeypatch, precision, B):
    """The overwrite twins share their call site's scratch (fp32's weight^T and transposed narrow
    operand, split-K partials): the d12 model allocates the same bytes with first_write on and off
    (session 21's twins allocated their own: +0.24 / +0.46 GiB in fp32 at B=4 / 16). And the one-GEMM
    forms (dinp_only, dweight_only) allocate no scratch for the GEMM they do not run."""
    from llmc.backend import CudaBackend
    from llmc.config import config_from_name
    from llmc.ops import gemm_wgmma as gw
    from tests.fake_runtime import FakeRuntime
    monkeypatch.setattr(gw, "tensor_map", lambda *a, **k: bytes(128))
    got = {}
    for on in ("1", "0"):
        monkeypatch.setenv("LLMC_FIRST_WRITE", on)
        rt = FakeRuntime()
        m = GPT2(config_from_name("d12"), CudaBackend(rt=rt, quiet=True, precision=precision), B, 1024)
        assert m.first_write == (on == "1") and len(m.built_first) == (5 if on == "1" else 0)
        got[on] = rt.allocated_bytes
    assert got["1"] == got["0"]
    if precision == "fp32":  # weight^T only with a dinp, the narrow transpose only with a dweight
        wt, t_buf = 768 * 3072 * 4, 768 * 4096 * 4  # fc at B=4: weight^T (C, OC); inp^T (C, N)
        for form, want in (("dinp_only", wt), ("dweight_only", t_buf), (None, wt + t_buf)):
            rt = FakeRuntime()
            ops.get("matmul_backward").build(rt, 5, "fp32", N=4096, C=768, OC=3072, **({form: True} if form else {}))
            assert rt.allocated_bytes == want, (form, rt.allocated_bytes)


def test_numpy_backend_and_refusals(monkeypatch):
    # the numpy backend writes too (its launchers implement every form), with the same results
    cpu = _train(CpuBackend(np.float32))
    assert cpu[0].first_write
    monkeypatch.setenv("LLMC_FIRST_WRITE", "0")
    _same(_train(CpuBackend(np.float32))[1], cpu[1])
    monkeypatch.delenv("LLMC_FIRST_WRITE")
    # a dweight variant without the form: the memset, as before
    m = GPT2(CFG, FakeCudaBackend({"matmul_backward": 3}, quiet=True), B, T)
    assert not m.first_write and not m.k_first
    spec = ops.get("matmul_backward")
    assert spec.refuse_reason(3, N=64, C=32, OC=32, overwrite=True) == "has no overwrite option"
    assert "dinp_only" in spec.refuse_reason(5, N=64, C=32, OC=32, dinp_only=True, overwrite=True)
    assert "dinp_only" in spec.refuse_reason(5, "bf16", N=64, C=32, OC=32, dinp_only=True, overwrite=True)
    assert not GPT2(CFG, FakeCudaBackend(), B, T, training=False).first_write


def test_cpu_launcher_overwrites(rng):
    N, C, OC = 9, 12, 16
    dout, inp, weight = (rng.standard_normal(s).astype(np.float32) for s in ((N, OC), (N, C), (OC, C)))
    spec = ops.get("matmul_backward")
    for form in ({}, {"dweight_only": True}):
        dweight = np.full((OC, C), np.nan, np.float32)
        launch = spec.cpu(N=N, C=C, OC=OC, overwrite=True, **form)
        args = (dweight, dout, inp) if form else (np.empty((N, C), np.float32), dweight, dout, inp, weight)
        launch(*args)
        np.testing.assert_allclose(dweight, dout.T @ inp, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# GPU

OVERWRITE_SHAPES = [dict(N=4 * 1024, C=768, OC=768), dict(N=4 * 1024, C=3072, OC=768), dict(N=4 * 1024, C=768, OC=2304),
                    dict(N=65, C=96, OC=80), dict(N=33, C=80, OC=40), dict(N=1, C=8, OC=16)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", OVERWRITE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("form", ["both", "dweight_only", "dgelu"])
def test_matmul_backward_overwrite_gpu(rt, rng, dtype, form, shape):
    """Variant 5's overwrite build against its accumulating build run onto zeros: dinp and dweight the
    same values, with the old dweight poisoned (NaN: never read, every element written); and dweight
    against the float64 reference."""
    from llmc.bf16 import BF16, from_bf16, to_bf16
    from llmc.testing import compare, poison
    N, C, OC = shape["N"], shape["C"], shape["OC"]
    spec = ops.get("matmul_backward")
    opts = {} if form == "both" else {form: True}
    if spec.refuse_reason(5, dtype, rt.arch, **shape, **opts, overwrite=True):
        pytest.skip(spec.refuse_reason(5, dtype, rt.arch, **shape, **opts, overwrite=True))
    dt = BF16 if dtype == "bf16" else np.float32
    host = [rng.standard_normal(s).astype(np.float32) for s in ((N, OC), (N, C), (OC, C), (N, C))]
    if dtype == "bf16":
        host = [to_bf16(h) for h in host]
    dout, inp, w, pre = (rt.to_device(h) for h in host)
    f64 = [(from_bf16(h) if dtype == "bf16" else h).astype(np.float64) for h in host]
    outs = {}
    for overwrite in (False, True):
        launch = spec.build(rt, 5, dtype, **shape, **opts, overwrite=overwrite)
        dinp, dweight = rt.empty((N, C), dt), rt.empty((OC, C), dt)
        poison(dinp)
        if overwrite:
            poison(dweight)
        else:
            dweight.zero()
        if form == "dweight_only":
            launch(dweight, dout, inp)
        elif form == "dgelu":
            launch(dinp, dweight, dout, inp, w, pre, None)
        else:
            launch(dinp, dweight, dout, inp, w)
        got = [dweight.get()] + ([] if form == "dweight_only" else [dinp.get()])
        outs[overwrite] = [from_bf16(g) if dtype == "bf16" else g for g in got]
    for a, b in zip(outs[False], outs[True]):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a, b)  # (+0 and -0 compare equal: 0 + -0 is +0)
    ref = f64[0].T @ f64[1]
    scale = np.sqrt(np.mean(ref ** 2))
    tol = 2e-2 if dtype == "bf16" else 1e-2
    err = compare(outs[True][0], ref, atol=tol * scale, rtol=tol, name=f"matmul_backward 5 {dtype} overwrite dweight")
    assert err is None, err


GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(4, 64), (3, 37)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [0, 1])
def test_gpu_first_write_step_is_bit_identical(rt, monkeypatch, precision, B, T, recompute):
    """Two steps of 2 micro-steps (the first micro-step's graph and the later one's, each replayed)
    with --deterministic's kernels, first_write on and off: losses, gradients, updated weights and
    logits the same bits."""
    from llmc.backend import CudaBackend
    from llmc.train import deterministic_kernels
    from tests.llmc_fixtures import train_steps
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("LLMC_FIRST_WRITE", on)
        be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
        m, steps, logits = train_steps(GPU_CFG, be, B, T, steps=3, logits=True, recompute=recompute)
        assert m.first_write == (on == "1")
        runs.append([x for step in steps for x in step] + [logits])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
