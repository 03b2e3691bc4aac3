"""The whole model on the cuda backend against the numpy backend (GPU machine: pytest -m gpu).

Reports the maximum relative error per tensor (run with -s to see the tables)."""
import numpy as np
import pytest

from llmc.backend import CpuBackend, CudaBackend, kernel_choices
from llmc.config import GPT2Config, config_from_name, param_layout
from llmc.model import GPT2
from llmc import ops

pytestmark = pytest.mark.gpu

# head size 64: the fused attention (the default) runs; SMALL_HS16 makes it fall back to the composite
SMALL = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)
SMALL_HS16 = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=4, channels=64)


def rel(a, b):
    a = np.asarray(a, np.float64); b = np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def pair(cfg, B, T, kernels=None, seed=0):
    gpu = GPT2(cfg, CudaBackend(kernels), B, T)
    cpu = GPT2(cfg, CpuBackend(np.float64), B, T)
    params = cpu.init_params(seed)
    gpu.load_params(params)
    return gpu, cpu


def batch(cfg, B, T, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32))


def compare_step(gpu, cpu, x, y, tol_grad, label=""):
    gpu.forward(x); cpu.forward(x)
    assert rel(gpu.logits(), cpu.logits()) < 1e-2, "logits"
    gpu.zero_grad(); cpu.zero_grad()
    lg = gpu.forward(x, y); lc = cpu.forward(x, y)
    gpu.backward(); cpu.backward()
    gg, gc = gpu.get_grads(), cpu.get_grads()
    print(f"\n{label} loss gpu {lg:.6f} cpu {lc:.6f}")
    worst = {}
    for name, off, size in param_layout(gpu.cfg):
        worst[name] = rel(gg[off:off + size], gc[off:off + size])
        print(f"  {name:9s} max rel err {worst[name]:.2e}")
    assert abs(lg - lc) < 1e-3 * max(1.0, abs(lc))
    for name, e in worst.items():
        assert e < tol_grad, f"{label} gradient of {name}: max rel error {e:.2e}"


@pytest.mark.parametrize("cfg", [SMALL, SMALL_HS16], ids=["hs64", "hs16"])
@pytest.mark.parametrize("B,T", [(2, 64), (1, 1), (3, 65), (2, 128)])
def test_small_model_matches_cpu(B, T, cfg):
    gpu, cpu = pair(cfg, B, T)
    x, y = batch(cfg, B, T)
    compare_step(gpu, cpu, x, y, tol_grad=3e-2, label=f"small {cfg.describe()} B={B} T={T}")


def test_attention_pair_must_agree():
    from llmc.errors import LLMCError
    with pytest.raises(LLMCError, match="same number"):
        GPT2(SMALL, CudaBackend({"attention_forward": 2, "attention_backward": 1}), 1, 8)


def test_d12_matches_cpu():
    cfg = config_from_name("d12")
    B, T = 1, 64
    gpu, cpu = pair(cfg, B, T)
    x, y = batch(cfg, B, T)
    compare_step(gpu, cpu, x, y, tol_grad=5e-2, label="d12 B=1 T=64")


def test_ten_steps_match_cpu():
    B, T = 2, 64
    gpu, cpu = pair(SMALL, B, T)
    for step in range(1, 11):
        x, y = batch(SMALL, B, T, seed=step)
        losses = []
        for m in (gpu, cpu):
            m.zero_grad(); losses.append(m.forward(x, y)); m.backward()
            m.update(lr=1e-3, step=step, weight_decay=0.1)
        print(f"step {step}: gpu {losses[0]:.6f} cpu {losses[1]:.6f}")
        assert abs(losses[0] - losses[1]) < 2e-3, (step, losses)


DECODE_ONLY = {"encoder_decode", "attention_decode", "attention_kv_fill", "sample"}


def all_variant_swaps():
    """(op, variant) for every non-default variant of every op the training model uses (the decoder's
    own ops, attention_decode and the rest, run in tests/test_attention.py and test_decode_gpu.py)."""
    out = []
    for name, spec in ops.registry().items():
        if name in DECODE_ONLY:
            continue
        for num in sorted(spec.variants):
            if num != spec.default:
                out.append((name, num))
    return out


@pytest.mark.parametrize("op,num", all_variant_swaps())
def test_every_variant_trains(op, num):
    """Swap one variant into the model; three steps must match the numpy backend."""
    B, T = 2, 64
    try:  # (a softmax variant selects the composite attention, where it runs: kernel_choices)
        gpu, cpu = pair(SMALL, B, T, kernels={op: num})
    except Exception as e:  # a variant may refuse this shape: that must be a clear VariantRefused
        from llmc.errors import VariantRefused
        assert isinstance(e, VariantRefused), e
        pytest.skip(str(e))
    for step in range(1, 4):
        x, y = batch(SMALL, B, T, seed=step)
        losses = []
        for m in (gpu, cpu):
            m.zero_grad(); losses.append(m.forward(x, y)); m.backward(); m.update(lr=1e-3, step=step)
        assert abs(losses[0] - losses[1]) < 2e-3, (op, num, step, losses)


def test_training_step_graphs_equal_eager():
    """Five optimizer steps of two micro-steps each, with the lr changing every step: the CUDA-graph
    replays of the micro-step and the update give bit-identical losses, norms and parameters to
    launching kernel by kernel. (encoder_backward 3: the default's atomics are not bit-reproducible.)"""
    from llmc.runtime import Graph
    B, T = 2, 64
    runs = []
    for graphs in (True, False):
        gpu, _ = pair(SMALL, B, T, kernels={"encoder_backward": 3})
        runs.append(train_steps(gpu, B, T, 5, lambda step: graphs))
        assert isinstance(gpu._graph_micro, Graph) == graphs and isinstance(gpu._graph_update, Graph) == graphs
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def train_steps(gpu, B, T, steps, graphs, accum=2):
    """`steps` optimizer steps of `accum` micro-steps on SMALL's random batches, the lr changing every
    step, graphs(step) saying whether that step replays graphs: [(loss, norm) per step..., params]."""
    gpu.grad_accum_steps = accum
    out = []
    for step in range(1, steps + 1):
        gpu.use_graphs = graphs(step)
        gpu.zero_grad()
        for micro in range(accum):
            gpu.train_micro_step(*batch(SMALL, B, T, seed=10 * step + micro))
        gpu.update(lr=1e-3 * step, step=step, weight_decay=0.1)
        out.append((gpu.step_loss(), gpu.grad_norm()))
    return out + [gpu.get_params()]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pdl_launches_give_the_plain_launches_bits(monkeypatch, precision):
    """LLMC_PDL=1: the training step's graphs captured with programmatic launches (programmatic edges;
    each kernel waits for its predecessor in its first instruction). Four optimizer steps of two
    micro-steps, graphs on (the side stream too), then two kernel by kernel: the same bits as plain
    launches: losses, norms, parameters. (fp32 with encoder_backward 3: 5's atomics are not
    bit-reproducible.)"""
    B, T = 2, 64
    kernels = {"encoder_backward": 3} if precision == "fp32" else None
    params = GPT2(SMALL, CpuBackend(np.float64), B, T).init_params(0)
    runs = []
    for pdl in ("0", "1"):
        monkeypatch.setenv("LLMC_PDL", pdl)
        be = CudaBackend(kernels, precision=precision)
        assert be.rt.pdl == (pdl == "1" and be.rt.arch >= "sm_90")  # (LLMC_PDL=0: every graph plain)
        gpu = GPT2(SMALL, be, B, T)
        gpu.load_params(params)
        runs.append(train_steps(gpu, B, T, 6, lambda step: step <= 4))
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_micro_steps_read_their_own_batch_while_the_gpu_lags(rt):
    """train_micro_step copies each batch up from one pinned buffer with no host sync, so under
    gradient accumulation the host runs ahead of the GPU: a batch must not overwrite the pinned
    buffer before the previous micro-step's copy has read it (the backend's pinned_free). Three
    micro-steps (graph replays) queued behind a few ms of other kernels give the bits of three with
    a sync after each; before the fix the lagging run trained on the later batches."""
    from llmc.train import deterministic_kernels
    B, T = 4, 64
    N = 1 << 24
    gelu = ops.get("gelu_forward")
    busy = gelu.build(rt, gelu.default, N=N)
    big_in, big_out = rt.zeros((N,)), rt.empty((N,))
    rng = np.random.default_rng(1)
    xs = [rng.integers(0, SMALL.vocab_size, (B, T)).astype(np.int32) for _ in range(3)]
    res = []
    for lag in (False, True):
        m = GPT2(SMALL, CudaBackend(deterministic_kernels({}), quiet=True, rt=rt), B, T)
        m.init_params(3)
        m.grad_accum_steps = 3
        m.train_micro_step(xs[0], xs[0])  # (the graph is built here: the micro-steps below replay it)
        rt.synchronize()
        m.zero_grad()
        if lag:
            for _ in range(40):
                busy(big_out, big_in)
        for x in xs:
            m.train_micro_step(x, np.roll(x, -1, axis=1))
            if not lag:
                rt.synchronize()
        res.append((m.step_loss(), np.asarray(m.get_grads(), np.float32).copy()))
    assert res[0][0] == res[1][0]
    np.testing.assert_array_equal(res[0][1], res[1][1])
