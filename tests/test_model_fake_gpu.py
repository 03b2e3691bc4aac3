"""The model driven through DevArrays (tests/fake_runtime.py) must give bit-identical results to the
numpy backend: this runs the cuda backend's buffer plumbing (views, per-layer indexing, offsets,
argument order) in CI, where there is no GPU."""
import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.model import GPT2
from llmc.runtime import DevArray
from tests.fake_runtime import BASE, FakeCudaBackend

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


def test_graph_path_of_the_training_step_is_bit_identical():
    """train_micro_step + update, whose later calls replay what the backend's graph() returned
    (here the launch functions themselves, counted), give exactly what forward/backward/update
    give: the replay path's bookkeeping (micro-step count, loss, flags) and the device-side AdamW
    hyperparameters (lr changing every step) included, with gradient accumulation."""
    B, T, accum = 2, 8, 2
    rng = np.random.default_rng(1)
    batches = [(rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32),
                rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)) for _ in range(4 * accum)]
    runs = []
    for graph_path in (False, True):
        be = FakeCudaBackend()
        m = GPT2(CFG, be, B, T)
        m.init_params(5)
        m.grad_accum_steps = accum
        m.use_graphs = graph_path  # False: every call launches kernel by kernel
        out = []
        for step in range(1, 5):
            m.zero_grad()
            for x, y in batches[(step - 1) * accum:step * accum]:
                if graph_path:
                    m.train_micro_step(x, y)
                else:
                    m.forward(x, y, read_loss=False)
                    m.backward()
            assert m.micro_steps == accum
            m.update(lr=1e-3 * step, step=step, weight_decay=0.1, max_norm=0.5)
            out.append((m.step_loss(), m.grad_norm()))
        out.append(m.get_params())
        runs.append(out)
        assert getattr(be, "graphs", 0) == (2 if graph_path else 0)  # micro-step and update captured once
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_micro_step_graph_recaptured_when_accumulation_changes():
    """The captured micro-step bakes in the loss scale 1/(B*T*accum): changing grad_accum_steps
    must capture again, not replay a stale scale."""
    be = FakeCudaBackend()
    m = GPT2(CFG, be, 1, 8)
    m.init_params(0)
    x = np.arange(8, dtype=np.int32).reshape(1, 8)
    for _ in range(2):
        m.train_micro_step(x, x)
    assert be.graphs == 1
    m.grad_accum_steps = 4
    m.train_micro_step(x, x)
    assert be.graphs == 2
