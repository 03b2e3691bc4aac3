"""Global norm (sum of squares of the gradients): reference vs PyTorch, the cpu launcher, variant
checks, and (with -m gpu) every variant on the GPU, including determinism and odd alignments.

    python -m pytest tests/test_global_norm.py -q          # CPU part (CI)
    python -m pytest -m gpu tests/test_global_norm.py -q   # GPU variants (needs PyCUDA + a GPU)
"""
import numpy as np
import pytest

from llmc.bf16 import from_bf16, to_bf16
from llmc.ops import global_norm as gn

GPT2_124M_PARAMS = 124_475_904


@pytest.mark.parametrize("n", [1, 1023, 100003])
def test_ref_vs_torch(rng, n):
    torch = pytest.importorskip("torch")
    g = rng.standard_normal(n).astype(np.float32)
    want = float((torch.tensor(g, dtype=torch.float64) ** 2).sum())
    assert abs(gn.global_norm_ref(g) - want) <= 1e-12 * want


def test_ref_chunking(rng):
    """More than one 4M chunk: the chunked sum equals the plain float64 sum."""
    g = rng.standard_normal((1 << 22) + 12345).astype(np.float32)
    g64 = g.astype(np.float64)
    assert abs(gn.global_norm_ref(g) - float(g64 @ g64)) <= 1e-12 * float(g64 @ g64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_launcher(rng, dtype):
    g = rng.standard_normal(100003).astype(dtype)
    norm2 = np.full((1,), np.nan, dtype)
    gn.OPS[0].cpu(n=g.size)(norm2, g)
    want = gn.global_norm_ref(g)
    assert abs(float(norm2[0]) - want) <= 1e-6 * want


def test_cpu_launcher_bf16(rng):
    """bf16 grads (uint16 bits): the sum of squares of the widened values, norm2 fp32."""
    g = to_bf16(rng.standard_normal(100003))
    norm2 = np.full((1,), np.nan, np.float32)
    gn.OPS[0].cpu(n=g.size)(norm2, g)
    w = from_bf16(g).astype(np.float64)
    assert abs(float(norm2[0]) - float(w @ w)) <= 1e-6 * float(w @ w)


def test_bf16_builds():
    """The deterministic variants (2, 3: the default) have bf16 builds, with a grid for 8 bf16 per
    thread-load; variant 1 (fp32 atomics) refuses bf16."""
    from fake_runtime import FakeRuntime
    spec = gn.OPS[0]
    assert {n for n, v in spec.variants.items() if "bf16" in v.dtypes} == {2, 3}
    assert "no bf16 kernels" in spec.refuse_reason(1, "bf16", n=100)
    rt = FakeRuntime(check_ptx=False)
    spec.build(rt, 3, "bf16", n=GPT2_124M_PARAMS)(rt.empty((1,)), rt.empty((GPT2_124M_PARAMS,), np.uint16))
    spec.build(rt, 3, "fp32", n=GPT2_124M_PARAMS)(rt.empty((1,)), rt.empty((GPT2_124M_PARAMS,)))
    assert [l.func for l in rt.launches] == ["global_norm_kernel3_bf16", "global_norm_kernel3"]
    assert rt.launches[0].grid == rt.launches[1].grid  # 124M elements: a full chip either way
    rt = FakeRuntime(check_ptx=False)
    spec.build(rt, 3, "bf16", n=8 * 1024 * 3)(rt.empty((1,)), rt.empty((8 * 1024 * 3,), np.uint16))
    assert rt.launches[0].grid == (3, 1, 1)  # small: one 16-byte load (8 bf16) per thread


def test_variant_checks():
    spec = gn.OPS[0]
    for num, v in spec.variants.items():
        assert v.refuse_reason(n=GPT2_124M_PARAMS) is None
        assert v.refuse_reason(n=1) is None
        assert "n >= 1" in v.refuse_reason(n=0)
        assert "block_size" in v.refuse_reason(n=10, block_size=48)


# ----------------------------------------------------------------------------------------------
# GPU

GPU_NS = [1, 3, 1023, 100003, GPT2_124M_PARAMS]
DETERMINISTIC = (2, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("n", GPU_NS)
@pytest.mark.parametrize("number,dtype", [(k, dt) for k in sorted(gn.VARIANTS) for dt in gn.VARIANTS[k].dtypes])
def test_gpu_variant(rt, number, dtype, n):
    from llmc.testing import poison
    rng = np.random.default_rng(n)
    # a few elements more than n, so a view at an offset exercises a misaligned head and tail
    # (fp32: 1, 3 floats; bf16: 1, 3, 7 elements, up to the 8 of a 16-byte load)
    g = rng.standard_normal(n + 7, dtype=np.float32)
    offsets = (0, 1, 3)
    if dtype == "bf16":
        g = to_bf16(g)  # the reference sums the squares of exactly these values
        offsets = (0, 1, 3, 7)
    d_g = rt.to_device(g)
    d_norm2 = rt.empty((1,))
    spec = gn.OPS[0]
    for bs in (None, 128):
        launch = spec.build(rt, number, dtype, n=n, block_size=bs)
        for off in offsets:
            want = gn.global_norm_ref(g[off:off + n])
            view = d_g.view(off, (n,))
            bits = set()
            for _ in range(3 if number in DETERMINISTIC else 1):
                poison(d_norm2)  # NaN: version 1 must zero it itself
                launch(d_norm2, view)
                got = d_norm2.get()
                bits.add(got.tobytes())
                # fp32 sums vs float64 (bf16 too: a bf16 value's square is exact in fp32)
                rel = abs(float(got[0]) - want) / want
                assert rel < 1e-5, f"v{number} {dtype} n={n} off={off} bs={bs}: rel err {rel:.2e}"
            if number in DETERMINISTIC:
                assert len(bits) == 1, f"v{number} {dtype} not bit-identical across runs"
