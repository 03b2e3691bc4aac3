"""AdamW with on-device global-norm clipping: the reference vs torch.optim.AdamW (10 steps, float64,
clipping on and off), the cpu launcher, variant checks, and (with -m gpu) every variant on the GPU
at odd sizes and misaligned offsets.

    python -m pytest tests/test_adamw.py -q          # CPU part (CI)
    python -m pytest -m gpu tests/test_adamw.py -q   # GPU variants (needs PyCUDA + a GPU)
"""
import numpy as np
import pytest

from llmc.bf16 import BF16, bf16_neighbours, from_bf16, to_bf16
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


# ----------------------------------------------------------------------------------------------
# bf16 builds: the update on the fp32 master, params = bf16(master), stochastic rounding

def _with_fraction(rng, n, frac):
    """n float32 values whose bits lie `frac` of a bf16 ulp past a bf16 value, away from zero (both
    signs): a stochastic rounding must round them away from zero with probability frac."""
    b = to_bf16(rng.standard_normal(n) * 3)
    u = (b.astype(np.uint32) << 16) + np.uint32(round(frac * 65536))
    return u.view(np.float32)


def _rounded_away(params_bits, master):
    """True where the bf16 params are the neighbour of master away from zero."""
    return (params_bits.astype(np.uint32) << 16) != (master.view(np.uint32) & np.uint32(0xFFFF0000))


def test_round_params_seed0_is_round_to_nearest_even(rng):
    x = rng.standard_normal(10000).astype(np.float32)
    x[:4] = [np.inf, -np.inf, np.nan, 0.0]
    assert np.array_equal(aw.round_params(x, 0), to_bf16(x))


@pytest.mark.parametrize("frac", [1 / 16, 0.25, 0.5, 0.875])
def test_round_params_is_unbiased(rng, frac):
    """Over 2^18 values at a known fractional position the fraction rounded away from zero is frac
    within 5 sigma (sigma = sqrt(frac (1 - frac) / n)), and each result is one of the two neighbours."""
    n = 1 << 18
    x = _with_fraction(rng, n, frac)
    out = aw.round_params(x, 12345, offset=77)
    lo, hi = bf16_neighbours(x)
    got = from_bf16(out)
    assert np.all((got == lo) | (got == hi))
    p = _rounded_away(out, x).mean()
    assert abs(p - frac) < 5 * np.sqrt(frac * (1 - frac) / n), (p, frac)


def test_round_params_seeds_and_offsets(rng):
    """The same seed gives the same bits, different seeds differ (about 2 f (1-f) of the elements at
    fraction f); the bits of element i depend on offset + i only (a range at offset a rounds like
    the same elements of the whole buffer); inf, NaN and bf16 values pass unchanged."""
    x = _with_fraction(rng, 1 << 16, 0.5)
    a = aw.round_params(x, 1)
    assert np.array_equal(a, aw.round_params(x, 1))
    assert 0.4 < (a != aw.round_params(x, 2)).mean() < 0.6
    assert np.array_equal(aw.round_params(x[1000:], 1, offset=1000), a[1000:])
    assert not np.array_equal(aw.round_params(x[1000:], 1), a[1000:])
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1.0, -3.5], np.float32)
    assert np.array_equal(aw.round_params(special, 9), to_bf16(special))
    assert np.array_equal(aw.sr_bits(5, [2 ** 32 + 3]), aw.sr_bits(5, np.array([2 ** 32 + 3], np.uint64)))
    assert aw.sr_bits(5, [3])[0] != aw.sr_bits(5, [2 ** 32 + 3])[0]  # the index's high word counts


@pytest.mark.skipif(__import__("llmc.runtime", fromlist=["nvcc_path"]).nvcc_path() is None, reason="nvcc not installed")
def test_sr_bits_match_the_kernel_source(tmp_path):
    """cuda/adamw.cu's hash (mix32, sr_key, sr_bits are __host__ __device__) compiled into a host
    program: the numpy copy gives the same bits (no GPU needed)."""
    import subprocess
    from llmc.runtime import CUDA_DIR, nvcc_path
    seeds = [1, 2, 12345, 0x9E3779B9, 0xFFFFFFFF]
    idx = [0, 1, 7, 124_475_903, 2 ** 32 - 1, 2 ** 32, 12_345_678_901]
    src = tmp_path / "sr.cu"
    src.write_text('#include "adamw.cu"\n#include <cstdio>\nint main() {\n' + "".join(
        f'    printf("%u\\n", sr_bits(sr_key({s}u), {i}ull));\n' for s in seeds for i in idx) + "}\n")
    exe = tmp_path / "sr"
    subprocess.run([nvcc_path(), "-std=c++17", "-arch=sm_80", f"-I{CUDA_DIR}", str(src), "-o", str(exe)],
                   check=True, capture_output=True)
    got = [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]
    want = [int(aw.sr_bits(s, [i])[0]) for s in seeds for i in idx]
    assert got == want


@pytest.mark.parametrize("seed", [0, 99])
def test_cpu_launcher_bf16(rng, seed):
    """The bf16 build's eight arguments on numpy arrays: master, m, v as adamw_ref on the widened
    grads (float32 tolerance), params exactly round_params(master)."""
    n, off = (1 << 20) + 7, 1000
    master, m, v = _state(rng, n, np.float32)
    g = to_bf16(rng.standard_normal(n) * 0.01)
    norm2 = np.array([aw_norm2(from_bf16(g))], np.float32)
    hp = aw.hyperparams(HP["lr"], HP["b1"], HP["b2"], HP["eps"], 0.1, 7, 1.0)
    want_p, *want = aw.adamw_ref_bf16(master, g, m, v, norm2, HP["lr"], HP["b1"], HP["b2"], HP["eps"], 0.1, 7, 1.0,
                                      seed=seed, offset=off)
    params = np.full(n, 0xFFFF, BF16)
    aw.OPS[0].cpu(n=n, offset=off)(params, g, m, v, norm2, hp, master, np.array([seed], np.uint32))
    for got, ref, name in zip((master, m, v), want, ("master", "m", "v")):
        np.testing.assert_allclose(got, ref, atol=1e-6, rtol=1e-5, err_msg=name)
    assert np.array_equal(params, aw.round_params(master, seed, off))
    # against the float64 master's own rounding: equal but where float32 and float64 masters sit on
    # two sides of a bf16 rounding boundary (seed 0), or where the random bits land between them
    assert (params != want_p).mean() < 1e-3


def test_bf16_builds():
    """Variants 1 and 2 (the default) have bf16 builds; they pass offset to the kernel (int64)."""
    from fake_runtime import FakeRuntime
    spec = aw.OPS[0]
    assert all(v.dtypes == ("fp32", "bf16") for v in spec.variants.values())
    rt = FakeRuntime(check_ptx=False)
    bufs = [rt.empty((100,), dt) for dt in (BF16, BF16, np.float32, np.float32, np.float32, np.float32,
                                             np.float32, np.uint32)]
    spec.build(rt, 2, "bf16", n=100, offset=3 * 2 ** 31)(*bufs)
    assert rt.launches[-1].func == "adamw_kernel2_bf16" and rt.launches[-1].args[-1] == 3 * 2 ** 31
    spec.build(rt, 2, "fp32", n=100, offset=5)(*bufs[2:6], bufs[4], bufs[5])  # fp32: offset taken, unused
    assert "offset" in spec.variants[2].refuse_reason(n=10, offset=-1)


# GPU: (n, offsets of params, grads, m, v, master in elements). Equal offsets exercise variant 2's
# scalar head and tail; unequal ones (any one array) its scalar fallback
GPU_CASES_BF16 = [(1, (0, 0, 0, 0, 0)), (3, (1, 1, 1, 1, 1)), (1023, (0, 0, 0, 0, 0)), (1023, (2, 2, 2, 2, 2)),
                  (100003, (3, 3, 3, 3, 3)), (100003, (0, 1, 2, 3, 0)), (100003, (1, 1, 1, 1, 2)),
                  (100003, (2, 1, 1, 1, 1)), (1 << 20, (0, 0, 0, 0, 0))]


def _bf16_bufs(rt, n, offs):
    bufs = [rt.empty((n + 4,), dt) for dt in (BF16, BF16, np.float32, np.float32, np.float32)]
    return [b.view(o, (n,)) for b, o in zip(bufs, offs)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES_BF16, ids=lambda c: "n%d-off%s" % (c[0], "".join(map(str, c[1]))))
@pytest.mark.parametrize("number", sorted(aw.VARIANTS))
def test_gpu_bf16(rt, number, case):
    """master, m, v as the float64 reference within the fp32 tolerance; params exactly
    round_params(the kernel's own master) (bit for bit: seed 0 round to nearest even, else the
    hash), and within one bf16 rounding of the float64 master; grads untouched."""
    from llmc.testing import poison
    n, offs = case
    rng = np.random.default_rng(n + sum(offs))
    spec = aw.OPS[0]
    views = _bf16_bufs(rt, n, offs)
    d_seed = rt.empty((1,), np.uint32)
    for bs in (None, 128):
        launch = spec.build(rt, number, "bf16", n=n, block_size=bs, offset=1000)
        for max_norm, seed in ((0.0, 0), (1.0, 0), (1.0, 4242)):
            master, m, v = (a.astype(np.float32) for a in _state(rng, n))
            for t in (1, 2, 3):
                g = to_bf16(rng.standard_normal(n) * 0.3)
                norm2 = np.array([aw_norm2(from_bf16(g)) * 4.0], np.float32)  # as if g were a quarter of the norm
                poison(views[0])
                for view, host in zip(views[1:], (g, m, v, master)):
                    view.set(host)
                d_seed.set(np.array([seed], np.uint32))
                d_hp = rt.to_device(aw.hyperparams(HP["lr"], HP["b1"], HP["b2"], HP["eps"], 0.1, t, max_norm))
                launch(views[0], views[1], views[2], views[3], rt.to_device(norm2), d_hp, views[4], d_seed)
                want_p, *want = aw.adamw_ref_bf16(master, g, m, v, norm2, HP["lr"], HP["b1"], HP["b2"], HP["eps"],
                                                  0.1, t, max_norm, seed=seed, offset=1000)
                params, m_, v_, master_ = (x.get() for x in (views[0], views[2], views[3], views[4]))
                where = f"v{number} n={n} offs={offs} bs={bs} t={t} seed={seed}"
                # fp32 element-wise update vs float64: a few ulp of |master| ~ 1 and of m, v
                for gt, ref, name in zip((master_, m_, v_), want, ("master", "m", "v")):
                    np.testing.assert_allclose(gt, ref, atol=1e-6, rtol=1e-5, err_msg=f"{where} {name}")
                assert np.array_equal(params, aw.round_params(master_, seed, 1000)), f"{where}: params bits"
                # vs the float64 master: a bf16 neighbour of a value within the master's fp32
                # tolerance of it (near zero, where the update cancels, that is more than an ulp)
                tol = 1e-6 + 1e-5 * np.abs(want[0])
                lo = bf16_neighbours((want[0] - tol).astype(np.float32))[0]
                hi = bf16_neighbours((want[0] + tol).astype(np.float32))[1]
                pf = from_bf16(params)
                assert np.all((pf >= lo) & (pf <= hi)), f"{where}: params off the float64 master's bf16 neighbours"
                if seed == 0:  # the two masters on two sides of a rounding boundary: ~1e-4 of the elements
                    assert (params != want_p).sum() <= 1 + n // 1000, f"{where}: round to nearest even"
                assert np.array_equal(views[1].get(), g), "grads must not be modified"
                master, m, v = master_, m_, v_


@pytest.mark.gpu
@pytest.mark.parametrize("number", sorted(aw.VARIANTS))
def test_gpu_bf16_stochastic_rounding(rt, number):
    """With lr = 0 the master stays put (p - 0 * update = p), so params = the stochastic rounding of
    values at a known fractional position f of a bf16 ulp: each is a neighbour, the fraction rounded
    away from zero is f within 5 sigma; the same seed gives the same bits at any block size and
    when the buffer is updated as two ranges (offset = the second range's start); seeds differ."""
    n = 1 << 20
    rng = np.random.default_rng(number)
    spec = aw.OPS[0]
    views = _bf16_bufs(rt, n, (0, 0, 0, 0, 0))
    d_seed = rt.empty((1,), np.uint32)
    d_norm2 = rt.to_device(np.array([1.0], np.float32))
    d_hp = rt.to_device(aw.hyperparams(0.0, HP["b1"], HP["b2"], HP["eps"], 0.1, 3, 0.0))
    _, m, v = (x.astype(np.float32) for x in _state(rng, n))
    g = to_bf16(rng.standard_normal(n) * 0.3)

    def run(launches, seed, master):
        from llmc.testing import poison
        poison(views[0])
        for view, host in zip(views[1:], (g, m, v, master)):
            view.set(host)
        d_seed.set(np.array([seed], np.uint32))
        for launch, lo, hi in launches:
            sl = [x.view(lo, (hi - lo,)) for x in views]
            launch(sl[0], sl[1], sl[2], sl[3], d_norm2, d_hp, sl[4], d_seed)
        assert np.array_equal(views[4].get(), master), "lr = 0 moved the master"
        return views[0].get()

    whole = [(spec.build(rt, number, "bf16", n=n), 0, n)]
    for frac in (1 / 16, 0.25, 0.5, 0.875):
        master = _with_fraction(rng, n, frac)
        out = run(whole, 7, master)
        lo, hi = bf16_neighbours(master)
        got = from_bf16(out)
        assert np.all((got == lo) | (got == hi)), f"frac {frac}: not a neighbour"
        p = _rounded_away(out, master).mean()
        assert abs(p - frac) < 5 * np.sqrt(frac * (1 - frac) / n), f"frac {frac}: rounded away {p:.4f}"
        assert np.array_equal(out, aw.round_params(master, 7)), f"frac {frac}: bits differ from round_params"
    master = _with_fraction(rng, n, 0.5)
    a = run(whole, 7, master)
    assert np.array_equal(a, run(whole, 7, master)), "same seed, different bits"
    assert np.array_equal(a, run([(spec.build(rt, number, "bf16", n=n, block_size=128), 0, n)], 7, master)), \
        "the bits depend on the block size"
    cut = 333_333
    split = [(spec.build(rt, number, "bf16", n=cut), 0, cut),
             (spec.build(rt, number, "bf16", n=n - cut, offset=cut), cut, n)]
    assert np.array_equal(a, run(split, 7, master)), "the bits depend on how the buffer is cut into ranges"
    assert 0.4 < (a != run(whole, 8, master)).mean() < 0.6, "seeds 7 and 8 give (nearly) the same bits"
    assert np.array_equal(run(whole, 0, master), to_bf16(master)), "seed 0: round to nearest even"


# ----------------------------------------------------------------------------------------------
# variant 3 over a list of ranges (ZeRO-1's shard pieces)

def _chunks(rng, P):
    """Ranges of odd sizes (1, a tile and one, ...) at scattered places of a P-value parameter
    buffer, their shard pieces back to back in a shuffled order (as llmc/dist.py lays them out), rows
    0 and 1: ((poff, soff, n, row), ...), the shard size."""
    sizes = [1, 3, 384, aw.ADAMW_TILE, aw.ADAMW_TILE + 1, 3 * aw.ADAMW_TILE - 5, 1000]
    poffs = np.cumsum([0] + [s + 7 for s in sizes])[:-1]  # gaps of 7 values that must stay untouched
    order = rng.permutation(len(sizes))
    soffs = np.zeros(len(sizes), np.int64)
    soffs[order] = np.cumsum([0] + [sizes[i] for i in order])[:-1]
    assert poffs[-1] + sizes[-1] <= P
    return tuple((int(p), int(s), n, i % 2) for i, (p, s, n) in enumerate(zip(poffs, soffs, sizes))), sum(sizes)


def _hp2(t, max_norm, dtype=np.float32):
    return np.stack([aw.hyperparams(HP["lr"], HP["b1"], HP["b2"], HP["eps"], wd, t, max_norm, dtype) for wd in (0.0, 0.1)])


def test_chunks_cpu_is_each_range_as_a_plain_call(rng):
    """The numpy launcher of the chunked op = the plain op on each range with its hp row; the values
    between ranges are untouched."""
    P = 30000
    chunks, S = _chunks(rng, P)
    params, m, v = _state(rng, P)[0], *_state(rng, S)[1:]
    g = rng.standard_normal(S) * 0.3
    norm2, hp = np.array([4.0]), _hp2(2, 1.0, np.float64)
    want_p, want_m, want_v = params.copy(), m.copy(), v.copy()
    for poff, soff, n, row in chunks:
        sl, pl = slice(soff, soff + n), slice(poff, poff + n)
        aw.adamw_cpu(n)(want_p[pl], g[sl], want_m[sl], want_v[sl], norm2, hp[row])
    aw.adamw_cpu(S, chunks=chunks)(params, g, m, v, norm2, hp)
    assert np.array_equal(params, want_p) and np.array_equal(m, want_m) and np.array_equal(v, want_v)


def test_chunks_check():
    spec = aw.OPS[0]
    assert spec.refuse_reason(3, n=10, chunks=((0, 0, 5, 0), (100, 5, 5, 1))) is None
    assert "soff" in spec.refuse_reason(3, n=10, chunks=((0, 6, 5, 0),))
    assert "row" in spec.refuse_reason(3, n=10, chunks=((0, 0, 5, 2),))
    assert "chunks" in spec.refuse_reason(2, n=10, chunks=((0, 0, 5, 0),))  # only variant 3 takes a list
    ch, tiles = aw.chunk_tables(10, chunks=((50, 0, 5, 1), (0, 5, aw.ADAMW_TILE + 1, 0)))
    assert ch.tolist() == [[50, 0, 5, 1, 0], [0, 5, aw.ADAMW_TILE + 1, 0, 0]]
    assert tiles.tolist() == [[0, 0], [1, 0], [1, aw.ADAMW_TILE]]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_chunks(rt, dtype):
    """Variant 3 over a list of ranges = the reference on each range (fp32 tolerance; bf16 params
    bit-exact from the kernel's own master with each range's seed, hash index = the value's index
    in its range); the parameter values between ranges keep their bits."""
    rng = np.random.default_rng(3)
    P = 30000
    chunks, S = _chunks(rng, P)
    launch = aw.OPS[0].build(rt, 3, dtype, n=S, chunks=chunks)
    bf = dtype == "bf16"
    params = rng.standard_normal(P).astype(np.float32)
    host_p = to_bf16(params) if bf else params
    d_p = rt.to_device(host_p)
    master, m, v = (x.astype(np.float32) for x in _state(rng, S))
    g = rng.standard_normal(S) * 0.3
    g = to_bf16(g) if bf else g.astype(np.float32)
    gf = from_bf16(g) if bf else g
    norm2 = np.array([aw_norm2(gf) * 4.0], np.float32)
    d_g, d_m, d_v, d_master = (rt.to_device(x) for x in (g, m, v, master))
    seeds = np.arange(1, len(chunks) + 1, dtype=np.uint32) * 7919
    launch(d_p, d_g, d_m, d_v, rt.to_device(norm2), rt.to_device(_hp2(2, 1.0)),
           *((d_master, rt.to_device(seeds)) if bf else ()))
    got_p, got_m, got_v, got_w = d_p.get(), d_m.get(), d_v.get(), d_master.get()
    touched = np.zeros(P, bool)
    for c, (poff, soff, n, row) in enumerate(chunks):
        sl, pl = slice(soff, soff + n), slice(poff, poff + n)
        touched[pl] = True
        wd = 0.1 if row else 0.0
        start = master[sl] if bf else params[pl]
        want = aw.adamw_ref(start, gf[sl], m[sl], v[sl], norm2, HP["lr"], HP["b1"], HP["b2"], HP["eps"], wd, 2, 1.0)
        new_p = got_w[sl] if bf else got_p[pl]
        for gt, ref, name in zip((new_p, got_m[sl], got_v[sl]), want, ("params", "m", "v")):
            np.testing.assert_allclose(gt, ref, atol=1e-6, rtol=1e-5, err_msg=f"{dtype} chunk {c} {name}")
        if bf:
            assert np.array_equal(got_p[pl], aw.round_params(got_w[sl], seeds[c], 0)), f"chunk {c}: params bits"
    assert np.array_equal(got_p[~touched], host_p[~touched]), "values between the ranges must keep their bits"
    assert np.array_equal(d_g.get(), g), "grads must not be modified"
