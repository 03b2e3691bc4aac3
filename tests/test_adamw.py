"""AdamW with on-device global-norm clipping: the reference vs torch.optim.AdamW (10 steps, float64,
clipping on and off), the cpu launcher, variant checks, and (with -m gpu) every variant on the GPU
at odd sizes and misaligned offsets.

    python -m pytest tests/test_adamw.py -q          # CPU part (CI)
    python -m pytest -m gpu tests/test_adamw.py -q   # GPU variants (needs PyCUDA + a GPU)
"""
import numpy as np
import pytest

from llmc.errors import LLMCError
from llmc.ops import adamw as aw

HP = dict(lr=3e-3, b1=0.9, b2=0.95, eps=1e-8)


def _state(rng, n, dtype=np.float64):
    """Random mid-training state: params ~ N(0,1), m ~ N(0, 0.1), v > 0."""
    p = rng.standard_normal(n)
    m = rng.standard_normal(n) * 0.1
    v = rng.uniform(0.001, 0.1, n)
    return p.astype(dtype), m.astype(dtype), v.astype(dtype)


# ----------------------------------------------------------------------------------------------
# the reference vs torch.optim.AdamW


@pytest.mark.parametrize("max_norm", [0.0, 1.0, 1e6], ids=["no-clip", "clip", "clip-inactive"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_ref_vs_torch_adamw(rng, max_norm, wd):
    """10 steps from zero moments, as torch does them; each step's grads are scaled by our clip
    factor (computed from the global norm) before torch sees them."""
    torch = pytest.importorskip("torch")
    n = 1000
    p0 = rng.standard_normal(n)
    tp = torch.tensor(p0, requires_grad=True)
    opt = torch.optim.AdamW([tp], lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"], weight_decay=wd)
    p, m, v = p0.copy(), np.zeros(n), np.zeros(n)
    clipped = 0
    for t in range(1, 11):
        g = rng.standard_normal(n) * 0.5
        norm2 = np.array([g @ g])
        s = aw.clip_scale(norm2, max_norm)
        clipped += s < 1.0
        tp.grad = torch.tensor(g * s)
        opt.step()
        p, m, v = aw.adamw_ref(p, g, m, v, norm2, HP["lr"], HP["b1"], HP["b2"], HP["eps"], wd, t, max_norm)
        np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-12, atol=1e-14)
        st = opt.state[tp]
        np.testing.assert_allclose(m, st["exp_avg"].numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(v, st["exp_avg_sq"].numpy(), rtol=1e-12, atol=1e-15)
    assert clipped == (10 if max_norm == 1.0 else 0)  # the clip cases really exercise clipping


def test_clip_scale():
    assert aw.clip_scale(np.array([16.0]), 2.0) == 0.5
    assert aw.clip_scale(np.array([16.0]), 0.0) == 1.0    # max_norm <= 0: off
    assert aw.clip_scale(np.array([16.0]), 4.0) == 1.0    # norm == max_norm: not above it
    assert aw.clip_scale(np.array([0.0]), 1.0) == 1.0


def test_bad_step_is_an_error(rng):
    p, m, v = _state(rng, 4)
    with pytest.raises(LLMCError, match="1-based"):
        aw.adamw_ref(p, p, m, v, np.array([1.0]), 1e-3, 0.9, 0.95, 1e-8, 0.0, 0, 1.0)


# ----------------------------------------------------------------------------------------------
# the cpu launcher


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_cpu_launcher(rng, dtype, max_norm):
    n = (1 << 20) + 7  # crosses the launcher's 1M chunk
    p, m, v = _state(rng, n, dtype)
    g = (rng.standard_normal(n) * 0.01).astype(dtype)
    norm2 = np.array([aw_norm2(g)], dtype)
    want = aw.adamw_ref(p, g, m, v, norm2, HP["lr"], HP["b1"], HP["b2"], HP["eps"], 0.1, 7, max_norm)
    hp = aw.hyperparams(HP["lr"], HP["b1"], HP["b2"], HP["eps"], 0.1, 7, max_norm, dtype)
    aw.OPS[0].cpu(n=n)(p, g, m, v, norm2, hp)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == np.float32 else dict(atol=1e-14, rtol=1e-12)
    for got, ref, name in zip((p, m, v), want, ("params", "m", "v")):
        np.testing.assert_allclose(got, ref, err_msg=name, **tol)


def aw_norm2(g):
    g = np.asarray(g, np.float64)
    return float(g @ g)


def test_variant_checks():
    spec = aw.OPS[0]
    for v in spec.variants.values():
        for n in (1, 3, 1023, 124_475_904):
            assert v.refuse_reason(n=n) is None
        assert "n >= 1" in v.refuse_reason(n=0)


# ----------------------------------------------------------------------------------------------
# GPU: every variant vs the float64 reference

# (n, offsets of params/grads/m/v in elements): equal offsets 0..3 exercise variant 2's scalar head
# and tail; unequal ones its scalar fallback
GPU_CASES = [(1, (0, 0, 0, 0)), (3, (1, 1, 1, 1)), (1023, (0, 0, 0, 0)), (1023, (2, 2, 2, 2)),
             (100003, (3, 3, 3, 3)), (100003, (0, 1, 2, 3)), (1 << 20, (0, 0, 0, 0))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "n%d-off%s" % (c[0], "".join(map(str, c[1]))))
@pytest.mark.parametrize("number", sorted(aw.VARIANTS))
def test_gpu_variant(rt, number, case):
    n, offs = case
    rng = np.random.default_rng(n + sum(offs))
    spec = aw.OPS[0]
    for bs in (None, 128):
        launch = spec.build(rt, number, n=n, block_size=bs)
        for max_norm in (0.0, 1.0):
            p, m, v = (a.astype(np.float32) for a in _state(rng, n))
            bufs = [rt.empty((n + 4,)) for _ in range(4)]
            views = [b.view(o, (n,)) for b, o in zip(bufs, offs)]
            for t in (1, 2, 3):  # a few steps: t enters through the bias corrections
                g = (rng.standard_normal(n) * 0.3).astype(np.float32)
                norm2 = np.array([aw_norm2(g) * 4.0], np.float32)  # as if g were a quarter of the norm
                for view, host in zip(views, (p, g, m, v)):
                    view.set(host)
                d_norm2 = rt.to_device(norm2)
                d_hp = rt.to_device(aw.hyperparams(HP["lr"], HP["b1"], HP["b2"], HP["eps"], 0.1, t, max_norm))
                launch(*views, d_norm2, d_hp)
                want = aw.adamw_ref(p, g, m, v, norm2, HP["lr"], HP["b1"], HP["b2"], HP["eps"], 0.1, t, max_norm)
                got = [views[i].get() for i in (0, 2, 3)]
                # fp32 element-wise update vs float64: a few ulp of |p| ~ 1 and of m, v
                for gt, ref, name in zip(got, want, ("params", "m", "v")):
                    np.testing.assert_allclose(gt, ref, atol=1e-6, rtol=1e-5,
                                               err_msg=f"v{number} n={n} offs={offs} bs={bs} t={t} {name}")
                assert np.array_equal(views[1].get(), g), "grads must not be modified"
                p, m, v = got
