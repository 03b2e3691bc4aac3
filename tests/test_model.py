"""The whole model on the numpy backend against an independent PyTorch GPT-2 (float64):
logits, loss, every parameter gradient, and ten AdamW steps."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llmc.backend import CpuBackend  # noqa: E402
from llmc.config import GPT2Config, param_layout  # noqa: E402
from llmc.model import GPT2  # noqa: E402
from tests.torch_gpt2 import TorchGPT2  # noqa: E402

# a small vocab that is not a multiple of 4, padded, so padded columns are exercised
CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=2, num_heads=2, channels=32)


def make(cfg, B, T, dtype=np.float64, seed=0):
    model = GPT2(cfg, CpuBackend(dtype=dtype), B, T)
    params = model.init_params(seed).astype(np.float64)
    # make biases and layernorm params non-trivial so their gradients are tested for real
    rng = np.random.default_rng(seed + 1)
    for name, off, size in param_layout(cfg):
        if name.endswith("b") or name in ("ln1w", "ln2w", "lnfw"):
            params[off:off + size] += 0.1 * rng.standard_normal(size)
    model.load_params(params)
    ref = TorchGPT2(params, cfg.max_seq_len, cfg.vocab_size, cfg.padded_vocab_size,
                    cfg.num_layers, cfg.num_heads, cfg.channels)
    return model, ref, params


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))


@pytest.mark.parametrize("B,T", [(2, 16), (1, 1), (3, 7)])
def test_logits_loss_and_every_gradient(B, T):
    model, ref, _ = make(CFG, B, T)
    x, y = batch(CFG, B, T)
    model.forward(x)  # no targets: logits untouched
    logits = model.logits()
    ref_logits, ref_loss = ref.forward(x, y)
    np.testing.assert_allclose(logits, ref_logits.detach().numpy(), rtol=1e-9, atol=1e-10)
    model.zero_grad()
    loss = model.forward(x, y)
    assert abs(loss - ref_loss.item()) < 1e-10
    model.backward()
    ref_loss.backward()
    got, want = model.get_grads(), ref.flat_grads()
    for name, off, size in param_layout(CFG):
        g, w = got[off:off + size], want[off:off + size]
        err = np.abs(g - w).max() / max(np.abs(w).max(), 1e-12)
        assert err < 1e-8, f"gradient of {name}: max rel error {err:.2e}"


def test_padded_vocab_rows_get_no_gradient():
    model, _, _ = make(CFG, 2, 8)
    x, y = batch(CFG, 2, 8)
    model.zero_grad(); model.forward(x, y); model.backward()
    dwte = model.get_grads()[:CFG.padded_vocab_size * CFG.channels].reshape(CFG.padded_vocab_size, -1)
    assert np.all(dwte[CFG.vocab_size:] == 0)


def test_ten_adamw_steps_match_torch():
    B, T = 2, 16
    model, ref, _ = make(CFG, B, T)
    state = {}
    for step in range(1, 11):
        x, y = batch(CFG, B, T, seed=step)
        model.zero_grad()
        loss = model.forward(x, y)
        model.backward()
        # a low clip threshold so that clipping is active in some steps
        model.update(lr=1e-2, step=step, weight_decay=0.1, max_norm=1.0)
        _, ref_loss = ref.forward(x, y)
        ref_loss.backward()
        ref_norm = ref.adamw_step(lr=1e-2, step=step, wd=0.1, max_norm=1.0, state=state)
        assert abs(loss - ref_loss.item()) < 1e-9, f"step {step}: loss {loss} vs {ref_loss.item()}"
        assert abs(model.grad_norm() - ref_norm) < 1e-9 * max(1.0, ref_norm)
    want = np.concatenate([p.detach().numpy().reshape(-1) for p in ref.params.values()])
    np.testing.assert_allclose(model.get_params().astype(np.float64), want.astype(np.float32), rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_equals_big_batch():
    """Two micro-batches of B=1 accumulate to the gradient of one B=2 batch."""
    x, y = batch(CFG, 2, 8)
    big, _, _ = make(CFG, 2, 8)
    big.zero_grad(); big.forward(x, y); big.backward()
    small, _, _ = make(CFG, 1, 8)
    small.grad_accum_steps = 2
    small.zero_grad()
    for i in range(2):
        small.forward(x[i:i + 1], y[i:i + 1]); small.backward()
    np.testing.assert_allclose(small.get_grads(), big.get_grads(), rtol=1e-9, atol=1e-12)
    assert abs(small.step_loss() - big.step_loss()) < 1e-12


def test_float32_training_loss_falls():
    cfg = GPT2Config(max_seq_len=64, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=4, channels=64)
    model = GPT2(cfg, CpuBackend(np.float32), 4, 32)
    model.init_params(0)
    x, y = batch(cfg, 4, 32)
    losses = []
    for step in range(1, 31):
        model.zero_grad()
        losses.append(model.forward(x, y)); model.backward()
        model.update(lr=1e-3, step=step)
    assert losses[-1] < losses[0] - 1.0, losses
