"""The model driven through DevArrays (tests/fake_gpu.py) must give bit-identical results to the
numpy backend: this runs the cuda backend's buffer plumbing (views, per-layer indexing, offsets,
argument order) in CI, where there is no GPU."""
import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.model import GPT2
from llmc.runtime import DevArray
from tests.fake_gpu import BASE, FakeCudaBackend

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=2, num_heads=2, channels=32)


def test_devarray_views_and_indexing():
    a = DevArray(None, BASE, (3, 4, 5), np.float32, None)
    assert a[1].ptr == BASE + 20 * 4 and a[1].shape == (4, 5)
    assert a[-1].ptr == BASE + 40 * 4
    assert a[2][3].ptr == BASE + (40 + 15) * 4 and a[2][3].shape == (5,)
    assert a.view(7, (2, 3)).ptr == BASE + 28 and len(a) == 3
    with pytest.raises(IndexError):
        a[3]
    with pytest.raises(AssertionError):
        a.view(50, (20,))


@pytest.mark.parametrize("B,T", [(2, 16), (1, 1), (3, 7)])
def test_model_through_devarrays_is_bit_identical(B, T):
    rng = np.random.default_rng(0)
    x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    results = []
    for be in (CpuBackend(np.float32), FakeCudaBackend()):
        m = GPT2(CFG, be, B, T)
        m.init_params(3)
        out = {}
        m.forward(x)
        out["logits"] = m.logits()
        for step in range(1, 3):
            m.zero_grad()
            out[f"loss{step}"] = m.forward(x, y)
            m.backward()
            out[f"grads{step}"] = m.get_grads()
            m.update(lr=1e-3, step=step, weight_decay=0.1)
            out[f"norm{step}"] = m.grad_norm()
        out["params"] = m.get_params()
        out["row"] = m.logits_row(B - 1, T - 1)
        results.append(out)
    for key in results[0]:
        np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
