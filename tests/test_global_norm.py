"""Global norm (sum of squares of the gradients): reference vs PyTorch, the cpu launcher, variant
checks, and (with -m gpu) every variant on the GPU, including determinism and odd alignments.

    python -m pytest tests/test_global_norm.py -q          # CPU part (CI)
    python -m pytest -m gpu tests/test_global_norm.py -q   # GPU variants (needs PyCUDA + a GPU)
"""
import numpy as np
import pytest

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
@pytest.mark.parametrize("number", sorted(gn.VARIANTS))
def test_gpu_variant(rt, number, n):
    from llmc.testing import poison
    rng = np.random.default_rng(n)
    # a few elements more than n, so a view at offset 1..3 exercises a misaligned head and tail
    g = rng.standard_normal(n + 3, dtype=np.float32)
    d_g = rt.to_device(g)
    d_norm2 = rt.empty((1,))
    spec = gn.OPS[0]
    for bs in (None, 128):
        launch = spec.build(rt, number, n=n, block_size=bs)
        for off in (0, 1, 3):
            want = gn.global_norm_ref(g[off:off + n])
            view = d_g.view(off, (n,))
            bits = set()
            for _ in range(3 if number in DETERMINISTIC else 1):
                poison(d_norm2)  # NaN: version 1 must zero it itself
                launch(d_norm2, view)
                got = d_norm2.get()
                bits.add(got.tobytes())
                rel = abs(float(got[0]) - want) / want
                assert rel < 1e-5, f"v{number} n={n} off={off} bs={bs}: rel err {rel:.2e}"
            if number in DETERMINISTIC:
                assert len(bits) == 1, f"v{number} not bit-identical across runs"
