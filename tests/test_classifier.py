"""Classifier (fused softmax + cross-entropy + logit gradient): numpy references vs PyTorch, the cpu
launcher's in-place semantics, variant shape checks, and (with -m gpu) every variant on the GPU.

    python -m pytest tests/test_classifier.py -q          # CPU part (CI)
    python -m pytest -m gpu tests/test_classifier.py -q   # GPU variants (needs PyCUDA + a GPU)
"""
import functools
import time
from pathlib import Path

import numpy as np
import pytest

from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import LLMCError, VariantRefused
from llmc.ops import classifier as cls
from llmc.testing import assert_close

GPT2 = (50257, 50304)  # V, Vp


def assert_bf16_rounded(got, ref, name, rtol=1e-5, atol=1e-10):
    """got (bf16 values, widened) is ref rounded once to bf16, after an fp32 computation good to
    rtol: |got - ref| <= half a bf16 ulp of ref (2^-8 of the power of two below |ref|, so at most
    2^-8 relative) + rtol*|ref| + atol. A value one whole ulp off fails."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    _, e = np.frexp(np.abs(ref))                   # |ref| = f * 2^e, f in [0.5, 1): the ulp is 2^(e-8)
    half_ulp = np.ldexp(1.0, e - 9)
    bad = ~np.isfinite(got) | (np.abs(got - ref) > half_ulp + rtol * np.abs(ref) + atol)
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} elements off by more than half a bf16 ulp; "
                           f"first at {np.flatnonzero(bad)[:3]}: got {got.reshape(-1)[bad.reshape(-1)][:3]} "
                           f"want {ref.reshape(-1)[bad.reshape(-1)][:3]}")


def make_inputs(rng, N, V, Vp, scale=2.0, pad=50.0):
    """Random logits (N, Vp) with a loud padding (a value that would dominate the softmax if it were
    read) and random targets in [0, V)."""
    logits = (rng.standard_normal((N, Vp)) * scale).astype(np.float32)
    logits[:, V:] = pad
    targets = rng.integers(0, V, size=N).astype(np.int32)
    return logits, targets


# ----------------------------------------------------------------------------------------------
# references vs torch (float64)


@pytest.mark.parametrize("N,V,Vp", [(7, 100, 128), (5, 97, 100), (3, 1, 4), (4, 1000, 1000)])
def test_forward_ref_vs_torch(rng, N, V, Vp):
    torch = pytest.importorskip("torch")
    logits, targets = make_inputs(rng, N, V, Vp)
    logits = logits.astype(np.float64)
    losses, probs = cls.classifier_forward_ref(logits, targets, V)
    x = torch.tensor(logits[:, :V])
    t = torch.tensor(targets, dtype=torch.long)
    want = torch.nn.functional.cross_entropy(x, t, reduction="none").numpy()
    assert_close(losses, want, 1e-12, 1e-12, "losses")
    assert_close(probs, torch.softmax(x, dim=1).numpy(), 1e-14, 1e-12, "probs")


@pytest.mark.parametrize("N,V,Vp", [(7, 100, 128), (5, 97, 100), (2, 50257, 50304)])
def test_backward_ref_vs_torch_autograd(rng, N, V, Vp):
    torch = pytest.importorskip("torch")
    logits, targets = make_inputs(rng, N, V, Vp)
    logits = logits.astype(np.float64)
    dloss = 0.37
    _, probs = cls.classifier_forward_ref(logits, targets, V)
    got = cls.classifier_backward_ref(probs, targets, dloss, Vp)
    x = torch.tensor(logits, requires_grad=True)  # (N, Vp): the padding gets exactly zero gradient
    loss = torch.nn.functional.cross_entropy(x[:, :V], torch.tensor(targets, dtype=torch.long),
                                             reduction="none")
    (loss * dloss).sum().backward()
    assert_close(got, x.grad.numpy(), 1e-15, 1e-10, "dlogits")
    assert (got[:, V:] == 0).all()


def test_forward_ref_rejects_bad_targets(rng):
    logits, targets = make_inputs(rng, 3, 10, 12)
    targets[1] = 10
    with pytest.raises(LLMCError, match="targets"):
        cls.classifier_forward_ref(logits, targets, 10)


# ----------------------------------------------------------------------------------------------
# the cpu launcher: in place, same semantics as the GPU variants


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,V,Vp", [(7, 100, 128), (5, 97, 100), (256, 50257, 50304)])
def test_cpu_launcher(rng, N, V, Vp, dtype):
    logits, targets = make_inputs(rng, N, V, Vp)
    logits = logits.astype(dtype)
    losses_ref, probs = cls.classifier_forward_ref(logits.astype(np.float64), targets, V)
    dlogits_ref = cls.classifier_backward_ref(probs, targets, 0.37, Vp)
    launch = cls.OPS[0].cpu(N=N, V=V, Vp=Vp)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    atol_d = 1e-9 if dtype == np.float32 else 1e-16

    # forward only: logits untouched (bitwise), losses overwritten
    x = logits.copy()
    losses = np.full(N, np.nan, dtype)
    launch(losses, x, targets, 0.37, 0)
    assert np.array_equal(x, logits)
    assert_close(losses, losses_ref, tol, tol, "losses")

    # with the gradient, in place; logits shaped (B, T, Vp) like the model's buffer
    x = logits.copy().reshape(1, N, Vp)
    losses = np.full((1, N), np.nan, dtype)
    t0 = time.perf_counter()
    launch(losses, x, targets.reshape(1, N), 0.37, 1)
    elapsed = time.perf_counter() - t0
    assert_close(losses, losses_ref, tol, tol, "losses")
    assert_close(x.reshape(N, Vp), dlogits_ref, atol_d, tol, "dlogits")
    assert (x[..., V:] == 0).all()
    print(f"cpu classifier N={N} Vp={Vp} {np.dtype(dtype).name}: {elapsed * 1e3:.1f} ms")


def test_cpu_padding_is_ignored(rng):
    """NaN in the padded columns changes nothing (they are never read for the loss)."""
    N, V, Vp = 6, 97, 100
    logits, targets = make_inputs(rng, N, V, Vp, pad=np.nan)
    launch = cls.OPS[0].cpu(N=N, V=V, Vp=Vp)
    losses = np.empty(N, np.float32)
    launch(losses, logits, targets, 1.0, 1)
    assert np.isfinite(losses).all() and np.isfinite(logits).all()
    assert (logits[:, V:] == 0).all()


@pytest.mark.parametrize("N,V,Vp", [(7, 100, 128), (5, 97, 100), (64, 50257, 50304)])
def test_cpu_launcher_bf16(rng, N, V, Vp):
    """bf16 logits (uint16 bits): the loss of the widened values in float32 arithmetic, the gradient
    rounded to bf16 once (within half a bf16 ulp plus float32's ~1e-6), the padding 0."""
    logits, targets = make_inputs(rng, N, V, Vp)
    bits = to_bf16(logits)
    losses_ref, probs = cls.classifier_forward_ref(from_bf16(bits).astype(np.float64), targets, V)
    dlogits_ref = cls.classifier_backward_ref(probs, targets, 0.37, Vp)
    launch = cls.OPS[0].cpu(N=N, V=V, Vp=Vp)
    x, losses = bits.copy(), np.full(N, np.nan, np.float32)
    launch(losses, x, targets, 0.37, 0)
    assert np.array_equal(x, bits)  # forward only: the logits' bits untouched
    assert_close(losses, losses_ref, 1e-5, 1e-5, "losses")
    launch(losses, x, targets, 0.37, 1)
    assert x.dtype == BF16
    assert_close(losses, losses_ref, 1e-5, 1e-5, "losses")
    assert_bf16_rounded(from_bf16(x), dlogits_ref, "dlogits")
    assert (x[:, V:] == 0).all()


# ----------------------------------------------------------------------------------------------
# variant shape checks (no GPU)


def test_variant_checks():
    spec = cls.OPS[0]
    for num in spec.variants:  # every variant takes the trainer's shape
        assert spec.variants[num].refuse_reason(N=4096, V=GPT2[0], Vp=GPT2[1]) is None, num
    for num in (2, 3, 4, 5, 6):  # float4 variants refuse Vp % 4 != 0
        assert "multiple of 4" in spec.variants[num].refuse_reason(N=5, V=97, Vp=101)
    assert spec.variants[1].refuse_reason(N=5, V=97, Vp=101) is None
    for num in (3, 4, 5, 6):  # a row too big for shared memory
        assert "shared memory" in spec.variants[num].refuse_reason(N=5, V=60000, Vp=60000)
    assert spec.variants[2].refuse_reason(N=5, V=60000, Vp=60000) is None
    assert "block_size" in spec.variants[1].refuse_reason(N=5, V=97, Vp=100, block_size=100)
    assert "V <= Vp" in spec.variants[1].refuse_reason(N=5, V=101, Vp=100)
    with pytest.raises(VariantRefused, match="classifier variant 2"):
        spec.build(None, 2, N=5, V=97, Vp=101)
    with pytest.raises(LLMCError, match="no variant 9"):
        spec.variant(9)


def test_bf16_builds():
    """Variants 1-3 and 5-8 have bf16 builds (the default among them) and take every shape their fp32 build
    takes: 16-byte chunks of 8 bf16 when Vp % 8 == 0, else the 8-byte _vec4 kernels; version 3's row
    needs half the shared memory of fp32 (GPT-2: 100,528 bytes, so two blocks per H100 SM), the
    persistent 6 runs two blocks an SM, and 8 launches 7's kernel for the gradient and its own, in
    256-thread blocks without shared memory, for the loss alone."""
    from fake_runtime import FakeRuntime
    spec = cls.OPS[0]
    assert {n for n, v in spec.variants.items() if "bf16" in v.dtypes} == {1, 2, 3, 5, 6, 7, 8}
    assert "bf16" in spec.variants[spec.default].dtypes
    for Vp, suffix in ((GPT2[1], "_bf16"), (100, "_bf16_vec4"), (1000, "_bf16")):
        rt = FakeRuntime(check_ptx=False)
        V = min(GPT2[0], Vp - 3)
        for num in (1, 2, 3, 5, 6, 7, 8):
            spec.build(rt, num, "bf16", N=4, V=V, Vp=Vp)
        assert rt.built == ["classifier_kernel1_bf16", f"classifier_kernel2{suffix}", f"classifier_kernel3{suffix}",
                            f"classifier_kernel5{suffix}", f"classifier_kernel6{suffix}", f"classifier_kernel7{suffix}",
                            f"classifier_kernel7{suffix}", f"classifier_kernel8_loss{suffix}"]
    assert cls._smem_bytes_bf16(*GPT2) == 100_528 and cls._smem_bytes(GPT2[0]) == 201_040
    rt = FakeRuntime(check_ptx=False)
    losses, targets = rt.empty((4,)), rt.empty((4,), np.int32)
    logits = rt.empty((4 * GPT2[1] + 8,), BF16)
    launch = spec.build(rt, 3, "bf16", N=4, V=GPT2[0], Vp=GPT2[1])
    launch(losses, logits, targets, 1.0, 1)
    assert rt.launches[-1].smem == 100_528 and rt.launches[-1].block == (1024, 1, 1)
    with pytest.raises(LLMCError, match="16-byte aligned"):  # a view that breaks the 16-byte loads
        launch(losses, logits.view(4, (4 * GPT2[1],)), targets, 1.0, 1)
    launch6 = spec.build(rt, 6, "bf16", N=4096, V=GPT2[0], Vp=GPT2[1])  # persistent: 2 blocks an SM
    launch6(losses, logits, targets, 1.0, 1)
    assert rt.launches[-1].grid == (2 * rt.sm_count, 1, 1) and rt.launches[-1].smem == 100_528
    with pytest.raises(LLMCError, match="16-byte aligned"):
        launch6(losses, logits.view(4, (4 * GPT2[1],)), targets, 1.0, 1)
    launch8 = spec.build(rt, 8, "bf16", N=4, V=GPT2[0], Vp=GPT2[1])
    launch8(losses, logits, targets, 1.0, 0)
    assert rt.launches[-1].func == "classifier_kernel8_loss_bf16" and rt.launches[-1].block == (256, 1, 1)
    assert rt.launches[-1].smem == 0 and rt.launches[-1].grid == (4, 1, 1)
    launch8(losses, logits, targets, 1.0, 1)
    assert rt.launches[-1].func == "classifier_kernel7_bf16" and rt.launches[-1].smem == 100_528
    with pytest.raises(LLMCError, match="16-byte aligned"):
        launch8(losses, logits.view(4, (4 * GPT2[1],)), targets, 1.0, 0)


# ----------------------------------------------------------------------------------------------
# GPU: every variant against the float64 reference

GPU_SHAPES = [(4096, *GPT2), (65, *GPT2), (1, *GPT2), (7, 100, 128), (5, 97, 100), (33, 1000, 1000)]
# (5, 97, 100): Vp % 8 != 0, the bf16 builds' 8-byte (_vec4) kernels; the others take 16-byte chunks
GPU_CASES = [(s, n, dt) for s in GPU_SHAPES for n in sorted(cls.VARIANTS) for dt in cls.VARIANTS[n].dtypes]


@functools.lru_cache(maxsize=2)
def _case(N, V, Vp, dtype):
    rng = np.random.default_rng(N * 7919 + V)
    logits, targets = make_inputs(rng, N, V, Vp)
    logits[:, V:] = np.nan  # the padding must be neither read for the loss nor left unwritten
    if dtype == "bf16":  # the reference sees what the kernel sees: the bf16 values, exactly
        logits = to_bf16(logits)
        values = from_bf16(logits)
    else:
        values = logits
    losses, probs = cls.classifier_forward_ref(values.astype(np.float64), targets, V)
    dlogits = cls.classifier_backward_ref(probs, targets, 0.37, Vp)
    return logits, targets, losses, dlogits


@pytest.mark.gpu
@pytest.mark.parametrize("shape,number,dtype", GPU_CASES,
                         ids=lambda x: "N%d-V%d-Vp%d" % x if isinstance(x, tuple) else
                         ("v%d" % x if isinstance(x, int) else x))
def test_gpu_variant(rt, shape, number, dtype):  # shape-major order: each big reference is built once
    from llmc.testing import poison
    N, V, Vp = shape
    spec = cls.OPS[0]
    reason = spec.variants[number].refuse_reason(N=N, V=V, Vp=Vp)
    if reason:
        with pytest.raises(VariantRefused):
            spec.build(rt, number, dtype, N=N, V=V, Vp=Vp)
        pytest.skip(f"refused as it should: {reason}")
    logits, targets, losses_ref, dlogits_ref = _case(N, V, Vp, dtype)
    d_logits, d_targets = rt.to_device(logits), rt.to_device(targets)
    d_losses = rt.empty((N,))
    # fp32 tolerances: the loss is log(sum) - x: ~1e-6 absolute at V=50257; dlogits are p*dloss with
    # p ~ 1e-5, so atol must sit far below that: relative 1e-5, atol 1e-10. bf16: the loss is the
    # same fp32 arithmetic on exact inputs (same tolerance); each gradient value is that fp32 value
    # rounded once to bf16: within half a bf16 ulp of the reference (at most 2^-8 relative) plus the
    # fp32 error (1e-5 relative); a value a whole ulp off fails (assert_bf16_rounded)
    # the block sizes: the default, and a small one (many chunks per thread) on the smaller shapes
    for bs in (None,) if N * Vp > 1 << 26 else (None, 128):
        launch = spec.build(rt, number, dtype, N=N, V=V, Vp=Vp, block_size=bs)
        d_logits.set(logits); poison(d_losses)
        launch(d_losses, d_logits, d_targets, 0.37, 0)  # forward only: logits untouched
        got = d_logits.get()
        assert got.dtype == logits.dtype
        assert np.array_equal(got.view(np.uint8), logits.view(np.uint8)), "write_dlogits=0 modified the logits"
        assert_close(d_losses.get(), losses_ref, 2e-5, 1e-5, f"losses v{number} {dtype} bs={bs}")

        d_logits.set(logits); poison(d_losses)
        launch(d_losses, d_logits, d_targets, 0.37, 1)
        assert_close(d_losses.get(), losses_ref, 2e-5, 1e-5, f"losses v{number} {dtype} bs={bs}")
        got = d_logits.get()
        if dtype == "fp32":
            assert_close(got, dlogits_ref, 1e-10, 1e-5, f"dlogits v{number} bs={bs}")
        else:
            assert_bf16_rounded(from_bf16(got), dlogits_ref, f"dlogits v{number} bf16 bs={bs}")
        assert not got[:, V:].any(), "padded columns not zeroed"  # the bits: +0.0 only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("dloss", [-0.37, 0.0, 2.0 ** -12])
def test_gpu_variant7_any_dloss(rt, dtype, dloss):
    """Version 7 folds 1/s and dloss into the exponent only for dloss > 0; a negative or zero dloss
    takes version 5's form on every chunk. All three against the float64 reference (65 GPT-2 rows)."""
    from llmc.testing import poison
    N, V, Vp = 65, *GPT2
    spec = cls.OPS[0]
    logits, targets, losses_ref, _ = _case(N, V, Vp, dtype)
    values = from_bf16(logits) if dtype == "bf16" else logits
    _, probs = cls.classifier_forward_ref(values.astype(np.float64), targets, V)
    dlogits_ref = cls.classifier_backward_ref(probs, targets, dloss, Vp)
    d_logits, d_targets, d_losses = rt.to_device(logits), rt.to_device(targets), rt.empty((N,))
    poison(d_losses)
    spec.build(rt, 7, dtype, N=N, V=V, Vp=Vp)(d_losses, d_logits, d_targets, dloss, 1)
    assert_close(d_losses.get(), losses_ref, 2e-5, 1e-5, f"losses v7 {dtype} dloss={dloss}")
    got = d_logits.get()
    if dtype == "fp32":
        assert_close(got, dlogits_ref, 1e-10, 1e-5, f"dlogits v7 dloss={dloss}")
    else:
        assert_bf16_rounded(from_bf16(got), dlogits_ref, f"dlogits v7 bf16 dloss={dloss}")
    assert not got[:, V:].any(), "padded columns not zeroed"


# ----------------------------------------------------------------------------------------------
# GPU: the classifier folded into the lm head's GEMMs (fold_build; the model's LLMC_CLASSIFIER_FOLD=1)

def _tf32(x):
    """x with 10 mantissa bits (round to nearest): exact through the TMA's tf32 copy and the tensor cores."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@functools.lru_cache(maxsize=4)
def _fold_case(N, V, Vp, C, dtype, spread, shift=0.0):
    """lnf, wte (device dtype, exactly representable in the GEMM's input type), their float64 values, the
    targets, and the float64 reference: losses, dlogits (softmax - onehot) * dloss (N, Vp), dinp, dwte.
    shift: every row's logits moved by about that much (a vector u added to each wte row, -u to each lnf row,
    |u|^2 = -shift), as a pretrained GPT-2's are far below 0."""
    rng = np.random.default_rng(N * 31 + V + C)
    lnf = rng.standard_normal((N, C)).astype(np.float32)
    lnf *= (1.0 + spread * rng.random((N, 1))).astype(np.float32)  # rows whose logits spread differently
    wte = (0.3 * rng.standard_normal((Vp, C))).astype(np.float32)
    if shift:
        u = rng.standard_normal(C)
        u *= np.sqrt(-shift) / np.linalg.norm(u)
        wte += u.astype(np.float32)
        lnf -= u.astype(np.float32)
    wte[V:] = 0.0  # llm.c's padding rows
    if dtype == "bf16":
        lnf, wte = to_bf16(lnf), to_bf16(wte)
        x64, w64 = from_bf16(lnf).astype(np.float64), from_bf16(wte).astype(np.float64)
    else:
        lnf, wte = _tf32(lnf), _tf32(wte)
        x64, w64 = lnf.astype(np.float64), wte.astype(np.float64)
    targets = rng.integers(0, V, N).astype(np.int32)
    logits = x64 @ w64.T
    losses, probs = cls.classifier_forward_ref(logits, targets, V)
    dl = cls.classifier_backward_ref(probs, targets, FOLD_DLOSS, Vp)
    return lnf, wte, x64, w64, targets, losses, dl, dl @ w64, dl.T @ x64


FOLD_DLOSS = 2.0 ** -9


def _run_fold(rt, N, V, Vp, C, dtype, k, spread=0.0):
    """The fold's launches at k; returns host copies (losses, P, X, cs, dinp, dwte, ctl after) and the case."""
    from llmc.testing import poison
    case = _fold_case(N, V, Vp, C, dtype, spread)
    lnf, wte, x64, w64, targets = case[:5]
    f = cls.fold_build(rt, N, V, Vp, C, dtype)
    f.load_state({"k": k})
    tdt = BF16 if dtype == "bf16" else np.float32
    d_lnf, d_wte, d_t = rt.to_device(lnf), rt.to_device(wte), rt.to_device(targets)
    P, losses = rt.empty((N, Vp), tdt), rt.empty((N,))
    poison(P, losses, f.X, f.cs, f.FS)
    f.forward(P, d_lnf, d_wte)
    f.combine(losses, P, d_t, d_lnf, FOLD_DLOSS)
    f.fix(losses, P, d_t, d_lnf, d_wte, FOLD_DLOSS)
    h = lambda a: from_bf16(a.get()).astype(np.float64) if dtype == "bf16" else a.get().astype(np.float64)
    Ph, Xh, cs = h(P), h(f.X), f.cs.get().astype(np.float64)
    # the backward's two GEMMs, in float64 on what the kernels left: dinp = c * (P @ wte), dwte = P^T @ X;
    # dinp's row scale through the fold's own kernel
    y = rng_y = np.random.default_rng(5).standard_normal((N, C)).astype(np.float32)
    d_y = rt.to_device(to_bf16(y) if dtype == "bf16" else y)
    f.scale(d_y)
    yv = from_bf16(to_bf16(y)).astype(np.float64) if dtype == "bf16" else y.astype(np.float64)
    return dict(losses=losses.get(), P=P.get(), Ph=Ph, X=f.X.get(), Xh=Xh, cs=cs, ctl=f.ctl.get(),
                dinp=cs[:, None] * (Ph @ w64), dwte=Ph.T @ Xh, scaled=h(d_y), scaled_ref=cs[:, None] * yv), case


FOLD_SHAPES = [(130, 50257, 50304, 96), (65, 1000, 1024, 72), (1, 300, 384, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-256"])
@pytest.mark.parametrize("shape", FOLD_SHAPES, ids=lambda s: "N%d-V%d-Vp%d-C%d" % s)
def test_gpu_fold(rt, shape, dtype, monkeypatch):
    """The fold's losses, its gradients as the backward's GEMMs see them (c * P, P^T @ X, the row scale)
    against float64, every output written; at another k, P and X scaled by 2^-k and 2^k; every row forced
    through the recompute path (k far off) against float64 too; the next k from the rows' sums.
    bf16-256: bf16 on the cooperative 128 x 256 tile (LLMC_WGMMA_FOLD256=1; Vp = 384 and 50304: a last tile
    partly past Vp, and padding columns inside it)."""
    from llmc.ops import gemm_wgmma as gw
    monkeypatch.setenv(gw.FOLD256_ENV, "1" if dtype == "bf16-256" else "0")
    dtype = dtype[:4]
    N, V, Vp, C = shape
    r0, case = _run_fold(rt, N, V, Vp, C, dtype, 0)
    _, _, x64, w64, targets, losses_ref, dl_ref, dinp_ref, dwte_ref = case
    bf = dtype == "bf16"
    tol = 2e-2 if bf else 2e-4  # relative to the largest reference value: bf16 p' carries 2^-9
    for r, how in ((r0, "combine"), ):
        assert np.isfinite(r["losses"]).all() and np.isfinite(r["cs"]).all()
        assert_close(r["losses"], losses_ref, 1e-2 if bf else 1e-4, 0, f"fold losses {dtype} ({how})")
        dl = r["cs"][:, None] * r["Ph"]
        assert not r["Ph"][:, V:].any(), "padded columns of P not zero"
        for name, got, ref in (("dlogits", dl, dl_ref), ("dinp", r["dinp"], dinp_ref), ("dwte", r["dwte"], dwte_ref)):
            err = np.abs(got - ref).max() / np.abs(ref).max()
            assert err < tol, f"fold {name} {dtype} ({how}): {err:.2e} of the largest value"
        assert_close(r["Xh"], r["cs"][:, None] * x64, 1e-30, 1e-2 if bf else 1e-6, f"fold X {dtype}")
        assert_close(r["scaled"], r["scaled_ref"], 1e-30, 1e-2 if bf else 1e-6, f"fold scale {dtype}")
    assert r0["ctl"][1] == 0 and r0["ctl"][4] == 0, f"counters not reset: {r0['ctl']}"
    lse2 = np.floor(np.log2(np.exp(losses_ref + (x64 @ w64.T)[np.arange(N), targets])))
    assert abs(int(r0["ctl"][0]) - (int((lse2.max() + lse2.min()) // 2) + 10)) <= 1, f"next k {r0['ctl'][0]}"
    # another k: P and X scaled by 2^-k and 2^k, the losses the same (up to the rounding of logit log2 e - k)
    k = 7
    r1, _ = _run_fold(rt, N, V, Vp, C, dtype, k)
    assert_close(r1["losses"], r0["losses"], 1e-5, 1e-5, f"fold losses at k = {k} against k = 0")
    rel = 2.0 ** -7 if bf else 1e-5  # (bf16: a value next to a rounding boundary may round the other way)
    assert_close(r1["Ph"] * 2.0 ** k, r0["Ph"], 1e-30, rel, f"fold P at k = {k}, times 2^{k}")
    assert_close(r1["Xh"], r0["Xh"] * 2.0 ** k, 1e-30, rel, f"fold X at k = {k}, times 2^-{k}")
    # k far from every row: each row recomputed by classifier_fold_fix (its own GEMV logits)
    rf, _ = _run_fold(rt, N, V, Vp, C, dtype, 400)
    ftol = 4e-2 if bf else 2e-4  # bf16: the recomputed logits are stored as bf16 before their exps
    assert_close(rf["losses"], losses_ref, 2e-2 if bf else 1e-4, 0, f"fold losses {dtype} (fix)")
    for name, got, ref in (("dlogits", rf["cs"][:, None] * rf["Ph"], dl_ref), ("dinp", rf["dinp"], dinp_ref),
                           ("dwte", rf["dwte"], dwte_ref)):
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < ftol, f"fold {name} {dtype} (fix): {err:.2e} of the largest value"
    assert rf["ctl"][1] == 0 and abs(int(rf["ctl"][0]) - int(r0["ctl"][0])) <= 1, f"fix path's next k: {rf['ctl']}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_fold_prime(rt, dtype):
    """Logits ~130 below 0 (a pretrained GPT-2's are far below 0): at k = 0 every row leaves the range and
    goes through the fix; primed first (a run without k from a state file), none does, the losses match
    float64 and k sits where the fix's would."""
    from llmc.testing import poison
    N, V, Vp, C = 300, 50257, 50304, 64
    lnf, wte, x64, w64, targets, losses_ref = _fold_case(N, V, Vp, C, dtype, 0.0, -130.0)[:6]
    lse = losses_ref + (x64 @ w64.T)[np.arange(N), targets]
    assert lse.max() < -70, f"case: lse up to {lse.max():.1f}"  # (below 2^-84 * e^0: out of range at k = 0)
    tdt = BF16 if dtype == "bf16" else np.float32
    d_lnf, d_wte, d_t = rt.to_device(lnf), rt.to_device(wte), rt.to_device(targets)
    counts, ks = [], []
    for primed in (False, True):
        f = cls.fold_build(rt, N, V, Vp, C, dtype)
        P, losses = rt.empty((N, Vp), tdt), rt.empty((N,))
        poison(P, losses, f.X, f.cs, f.FS)
        assert not f.primed
        if primed:
            f.prime(losses, P, d_t, d_lnf, d_wte)
            assert f.primed and f.ctl.get()[1] == 0
            ks.append(int(f.ctl.get()[0]))
        f.forward(P, d_lnf, d_wte)
        f.combine(losses, P, d_t, d_lnf, FOLD_DLOSS)
        counts.append(int(f.ctl.get()[1]))
        f.fix(losses, P, d_t, d_lnf, d_wte, FOLD_DLOSS)
        # (fp32: logits of ~-130 carry the GEMM's fp32 sums' rounding, ~1e-5 of them)
        assert_close(losses.get(), losses_ref, 2e-2 if dtype == "bf16" else 2e-3, 0, f"fold losses (primed {primed})")
        ks.append(int(f.ctl.get()[0]))
    assert counts == [N, 0], f"rows flagged by the combine, at k = 0 and primed: {counts}"
    lse2 = np.floor(lse / np.log(2.0))
    assert abs(ks[0] - (int((lse2.max() + lse2.min()) // 2) + 10)) <= 1, f"k after the fix: {ks}"
    assert abs(ks[1] - ks[0]) <= 24 and abs(ks[2] - ks[0]) <= 1, f"k after the fix, after prime, then the fix: {ks}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "bf16-256"])
def test_fold_build_matches_the_kernels(dtype, monkeypatch):
    """fold_build on the fake runtime (tests/fake_runtime.py): every entry point it asks for exists in
    cuda/gemm_wgmma.cu and cuda/classifier.cu with the argument types it passes (checked against their
    PTX), and the combine, fix and scale launches pass as many arguments as the kernels take. bf16-256:
    LLMC_WGMMA_FOLD256=1, the cooperative 128 x 256 instance, a tile sum per 256 columns (fp32 keeps 128)."""
    from tests.fake_runtime import FakeRuntime
    from llmc.ops import gemm_wgmma as gw
    wide = dtype == "bf16-256"
    monkeypatch.setenv(gw.FOLD256_ENV, "1" if wide else "0")
    monkeypatch.setattr(gw, "tensor_map", lambda *a, **k: bytes(128))  # (no driver to encode the maps)
    dtype = dtype[:4]
    rt = FakeRuntime(1 << 24)
    N, V, Vp, C = 65, 1000, 1024, 72
    f = cls.fold_build(rt, N, V, Vp, C, dtype)
    bn = 256 if wide else 128
    assert f.tiles == Vp // bn and f.FS.shape == (N, f.tiles) and f.X.shape == (N, C)
    assert f.gemm.plan == (5, "128x256+ts+fold" if wide else "128x128+ts+pp+fold", 1)
    f.forward(rt.empty((N, Vp), BF16 if dtype == "bf16" else np.float32), rt.empty((N, C), BF16 if dtype == "bf16"
              else np.float32), rt.empty((Vp, C), BF16 if dtype == "bf16" else np.float32))
    launch = rt.launches[-1]
    assert launch.func == (f"gemm_wgmma_bf16_n256_ts_fold_bf16" if wide else
                           f"gemm_wgmma_{'bf16' if dtype == 'bf16' else 'tf32'}_n128_ts_pp128_fold"
                           f"{'_bf16' if dtype == 'bf16' else ''}")
    assert launch.grid[0] == min(-(-N // 128) * f.tiles, rt.sm_count)
    # the cooperative instance's stages are the plain 256-wide bf16 forward's (the same shared memory)
    if wide:
        assert gw.FOLD256_INSTANCES[("bf16", "bf16")] == gw.INSTANCES[("bf16", "bf16", "kk", True)][256]
        assert "GEMM_WGMMA_COOP_FOLD_ENTRY(gemm_wgmma_bf16_n256_ts_fold_bf16, __nv_bfloat16, __nv_bfloat16, 256, 3)" \
            in (Path(__file__).resolve().parent.parent / "cuda" / "gemm_wgmma.cu").read_text()
    assert list(rt.np(f.ctl)) == list(cls.FOLD_INIT)
    tdt = BF16 if dtype == "bf16" else np.float32
    P, lnf, wte = rt.empty((N, Vp), tdt), rt.empty((N, C), tdt), rt.empty((Vp, C), tdt)
    losses, targets = rt.empty((N,)), rt.empty((N,), np.int32)
    f.combine(losses, P, targets, lnf, 0.5)
    f.fix(losses, P, targets, lnf, wte, 0.5)
    f.scale(lnf)
    assert [la.func for la in rt.launches][-3:] == [f"classifier_fold_{n}{'_bf16' if dtype == 'bf16' else ''}"
                                                        for n in ("combine", "fix", "scale")]
    f.prime(losses, P, targets, lnf, wte)
    assert f.primed and [la.func for la in rt.launches][-2:] == [
        "classifier_fold_prime", f"classifier_fold_fix{'_bf16' if dtype == 'bf16' else ''}"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fold_only_where_it_runs(precision, monkeypatch):
    """CudaBackend.fold_build (on the fake H100): the fold where the lm head runs on GEMM engine 5 (matmul_forward
    9) and its rows are 16-byte multiples; None (the model keeps the classifier pass) on a vocabulary or width
    the TMA can't take, or with another matmul_forward variant named."""
    from llmc.backend import CudaBackend
    from tests.fake_runtime import FakeRuntime
    be = CudaBackend(quiet=True, rt=FakeRuntime(1 << 24), precision=precision)
    assert isinstance(be.fold_build(64, 1000, 1024, 72), cls.Fold)
    assert be.fold_build(64, 1000, 1001, 72) is None  # Vp's rows not 16-byte multiples
    assert be.fold_build(64, 1000, 1024, 70 if precision == "bf16" else 66) is None
    named = CudaBackend({"matmul_forward": 7}, quiet=True, rt=FakeRuntime(1 << 24), precision=precision)
    assert named.fold_build(64, 1000, 1024, 72) is None
    # fold_bytes: what fold_build allocates, counted before it does (the model's memory check); 0 where it builds nothing
    from llmc.ops import gemm_wgmma as gw
    for wide in ("0", "1"):  # (LLMC_WGMMA_FOLD256: bf16's row sums per 256-wide tile, fewer of them)
        monkeypatch.setenv(gw.FOLD256_ENV, wide)
        rt = FakeRuntime(1 << 28)
        be = CudaBackend(quiet=True, rt=rt, precision=precision)
        for N, V, Vp, C in ((64, 1000, 1024, 72), (65, 1000, 1040, 80), (4096, 50257, 50304, 768)):
            before = rt.allocated_bytes
            be.fold_build(N, V, Vp, C)
            assert rt.allocated_bytes - before == be.fold_bytes(N, V, Vp, C) > 0
    assert be.fold_bytes(64, 1000, 1001, 72) == 0 and named.fold_bytes(64, 1000, 1024, 72) == 0
