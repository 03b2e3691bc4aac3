"""HellaSwag on the GPU (training kernels) against the numpy backend (pytest -m gpu).

    python -m pytest -m gpu tests/test_hellaswag_gpu.py -q
"""
import numpy as np
import pytest

from llmc.backend import CpuBackend, CudaBackend
from llmc.config import GPT2Config
from llmc.hellaswag import HellaSwag, pack_batch, token_losses
from llmc.model import GPT2
from llmc_fixtures import write_llmc_evalfile

pytestmark = pytest.mark.gpu

# head size 64: the default fused attention runs
CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.parametrize("B,T", [(4, 64), (8, 128), (12, 40)])
def test_gpu_scores_as_cpu(rt, tmp_path, B, T):   # rt: skips without a GPU
    rng = np.random.default_rng(B)
    examples = []
    for _ in range(11):
        ctx = rng.integers(0, 97, rng.integers(1, 20)).tolist()
        ends = [rng.integers(0, 97, rng.integers(1, 15)).tolist() for _ in range(4)]
        examples.append((int(rng.integers(0, 4)), ctx, ends))
    write_llmc_evalfile(tmp_path / "h.bin", examples)
    hs = HellaSwag(tmp_path / "h.bin", B=B, T=T, vocab_size=CFG.vocab_size)
    cpu_model = GPT2(CFG, CpuBackend(np.float64), B, T)
    gpu_model = GPT2(CFG, CudaBackend(), B, T)
    x, y, mask, _ = pack_batch(hs.examples[:B // 4], B, T)
    # per-token losses at the init's scale: TF32 matmuls against float64
    params = cpu_model.init_params(1)
    cpu_model.load_params(params)
    gpu_model.load_params(params)
    lc, lg = token_losses(cpu_model, x, y), token_losses(gpu_model, x, y)
    np.testing.assert_allclose(lg[mask], lc[mask], rtol=2e-3, atol=2e-3)
    # the decisions, with weights x8 so the endings' mean losses are far apart; TF32's error grows
    # with the logits (up to ~1 on losses of ~50 here), so every example whose float64 margin is over
    # twice the largest GPU-CPU difference of an ending's mean loss must be decided the same way
    cpu_model.load_params(params * np.float32(8))
    gpu_model.load_params(params * np.float32(8))
    lc, lg = token_losses(cpu_model, x, y), token_losses(gpu_model, x, y)
    mean = lambda l: np.array([l[r][mask[r]].mean() for r in range(4 * (B // 4))]).reshape(-1, 4)  # noqa: E731
    mc, mg = mean(lc), mean(lg)
    err = np.abs(mc - mg).max()
    srt = np.sort(mc, axis=1)
    clear = (srt[:, 1] - srt[:, 0]) > 2 * err
    assert clear.sum() >= max(1, len(clear) // 2), (clear, err)  # the check is not vacuous
    assert (mc.argmin(1) == mg.argmin(1))[clear].all()
    assert hs.evaluate(gpu_model, progress=False)[1] == hs.num_examples
    # a training step after the evaluation still works (the eval forward shares the training buffers)
    gpu_model.zero_grad()
    gpu_model.train_micro_step(x, y)
    gpu_model.update(1e-4, 1)
    assert np.isfinite(gpu_model.step_loss())
