"""Files written by someone else in llm.c's formats (tests/llmc_fixtures.py writes them with
struct/numpy, not our writers) load here and give the loss an independent implementation gives;
and our debug-state check works the way llm.c's test_gpt2 uses it: logits, loss and gradients
stored by the reference are reproduced by our model."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from llmc.backend import CpuBackend  # noqa: E402
from llmc.checkpoint import read_debug_state, read_model  # noqa: E402
from llmc.config import GPT2Config  # noqa: E402
from llmc.data import DataLoader  # noqa: E402
from llmc.model import GPT2  # noqa: E402
from tests.llmc_fixtures import write_llmc_debug_state, write_llmc_model, write_llmc_shard  # noqa: E402
from tests.torch_gpt2 import TorchGPT2  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
maxT, V, Vp, L, NH, C = 64, 50257, 50304, 2, 2, 32


def random_params(seed=0):
    cfg = GPT2Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp, num_layers=L, num_heads=NH, channels=C)
    rng = np.random.default_rng(seed)
    p = (rng.standard_normal(cfg.num_parameters) * 0.05).astype(np.float32)
    p[C * V:C * Vp] = 0.0  # llm.c keeps the padded rows of wte at zero
    return cfg, p


@pytest.mark.parametrize("version", [3, 5])
def test_foreign_checkpoint_and_shard_give_the_reference_loss(tmp_path, version):
    cfg, params = random_params()
    write_llmc_model(tmp_path / "m.bin", maxT, V, L, NH, C, Vp, params, version=version)
    rng = np.random.default_rng(1)
    write_llmc_shard(tmp_path / "shard_000.bin", rng.integers(0, V, 4000).astype(np.uint16))

    cfg2, loaded = read_model(str(tmp_path / "m.bin"))
    assert cfg2 == cfg
    B, T = 2, 32
    x, y = DataLoader(str(tmp_path / "shard_*.bin"), B, T).next_batch()
    model = GPT2(cfg2, CpuBackend(np.float64), B, T)
    model.load_params(loaded)
    ours = model.forward(x, y)
    # the independent reference gets the weights as llm.c would see them (bf16 rounding for v5)
    ref = TorchGPT2(loaded.astype(np.float64), maxT, V, Vp, L, NH, C)
    _, ref_loss = ref.forward(x, y)
    assert abs(ours - ref_loss.item()) < 1e-9
    # and the tokens really came from the shard: window 0 is tokens 0..B*T
    raw = np.fromfile(tmp_path / "shard_000.bin", dtype=np.uint16, offset=1024)
    assert np.array_equal(x.reshape(-1), raw[:B * T]) and np.array_equal(y.reshape(-1), raw[1:B * T + 1])


def test_debug_state_from_reference_is_reproduced(tmp_path):
    """llm.c's test_gpt2 flow: a reference writes (x, y, logits, loss, grads); we load the model and
    the state and must reproduce them."""
    cfg, params = random_params(2)
    write_llmc_model(tmp_path / "m.bin", maxT, V, L, NH, C, Vp, params)
    B, T = 2, 16
    rng = np.random.default_rng(3)
    x = rng.integers(0, V, (B, T)).astype(np.int32)
    y = rng.integers(0, V, (B, T)).astype(np.int32)
    ref = TorchGPT2(params.astype(np.float64), maxT, V, Vp, L, NH, C)
    logits, loss = ref.forward(x, y)
    loss.backward()
    grads = ref.flat_grads().astype(np.float32)
    write_llmc_debug_state(tmp_path / "d.bin", B, T, x, y, logits.detach().numpy().astype(np.float32),
                           np.float32(loss.item()), grads)

    cfg2, loaded = read_model(str(tmp_path / "m.bin"))
    st = read_debug_state(str(tmp_path / "d.bin"), cfg2)
    model = GPT2(cfg2, CpuBackend(np.float32), st["B"], st["T"])
    model.load_params(loaded)
    model.forward(st["x"])
    np.testing.assert_allclose(model.logits(), st["logits"].reshape(B, T, -1)[..., :V], atol=2e-5, rtol=1e-4)
    model.zero_grad()
    ours = model.forward(st["x"], st["y"])
    assert abs(ours - float(st["loss"])) < 1e-4
    model.backward()
    g = model.get_grads()
    assert np.abs(g - st["grads"]).max() < 1e-4 * max(1.0, np.abs(st["grads"]).max())


def test_cli_trains_from_a_foreign_checkpoint(tmp_path):
    cfg, params = random_params(4)
    write_llmc_model(tmp_path / "m.bin", maxT, V, L, NH, C, Vp, params)
    rng = np.random.default_rng(5)
    write_llmc_shard(tmp_path / "train_000.bin", np.tile(rng.integers(0, 300, 33), 30).astype(np.uint16))
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), "--device", "cpu", "-e", str(tmp_path / "m.bin"),
                        "-i", str(tmp_path / "train_*.bin"), "-j", "", "-b", "2", "-t", "32", "-x", "30",
                        "-l", "1e-2", "-a", "1", "-s", "0", "-o", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert f"checkpoint {tmp_path / 'm.bin'}" in p.stdout
    losses = [float(l.split("loss ")[1].split(" ")[0]) for l in p.stdout.splitlines() if l.startswith("step")]
    assert losses[-1] < losses[0] - 0.5
    # our checkpoint reads back as an llm.c v3 file
    h = np.fromfile(tmp_path / "out" / "model_00000030.bin", dtype=np.int32, count=8)
    assert list(h) == [20240326, 3, maxT, V, L, NH, C, Vp]
