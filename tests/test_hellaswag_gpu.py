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
    params = cpu_model.init_params(1) * np.float32(8)   # endings far apart: no near-ties between fp32 and fp64
    cpu_model.load_params(params)
    gpu_model = GPT2(CFG, CudaBackend(), B, T)
    gpu_model.load_params(params)
    x, y, mask, _ = pack_batch(hs.examples[:B // 4], B, T)
    lc, lg = token_losses(cpu_model, x, y), token_losses(gpu_model, x, y)
    np.testing.assert_allclose(lg[mask], lc[mask], rtol=2e-3, atol=2e-3)
    assert hs.evaluate(gpu_model, progress=False) == hs.evaluate(cpu_model, progress=False)
    # a training step after the evaluation still works (the eval forward shares the training buffers)
    gpu_model.zero_grad()
    gpu_model.train_micro_step(x, y)
    gpu_model.update(1e-4, 1)
    assert np.isfinite(gpu_model.step_loss())
