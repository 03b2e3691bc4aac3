"""The backward's weight gradients on a second stream (GPT2(side_stream=...), LLMC_SIDE_STREAM).

The fake backend (tests/fake_runtime.py) runs a side-stream launch as late as the model lets it:
only when the main stream waits for it (side_wait up to its mark, or side_join). So if the model
forgot a wait, the main stream would overwrite what a queued dweight GEMM reads (dres, d fch, dqkv,
the -r scratch) before it ran, and the gradients would differ from the one-stream model's. These
tests check that they do not, that they would (each wait left out in turn), and which launches go
to the side stream. The GPU test (-m gpu, below) checks the same bits on the H100, graphs included."""
import numpy as np
import pytest

from llmc.backend import CpuBackend
from llmc.config import GPT2Config
from llmc.errors import LLMCError
from llmc.model import GPT2
from tests.fake_runtime import FakeCudaBackend

CFG = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=100, num_layers=3, num_heads=2, channels=32)
B, T = 2, 16


def _train(be, side, recompute=1, steps=2, skip_wait=None, **kw):
    rng = np.random.default_rng(7)
    x = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    if skip_wait is not None:  # sabotage: the main stream no longer waits for this mark
        wait = be.side_wait
        be.side_wait = lambda mark: None if mark == skip_wait else wait(mark)
    m = GPT2(CFG, be, B, T, recompute=recompute, side_stream=side, **kw)
    m.init_params(11)
    out = {}
    for step in range(1, steps + 1):
        m.zero_grad()
        out[f"loss{step}"] = m.forward(x, y)
        m.backward()
        out[f"grads{step}"] = m.get_grads()
        m.update(lr=1e-3, step=step, weight_decay=0.1)
    out["params"] = m.get_params()
    return m, out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [0, 1, 2])
def test_side_stream_gives_the_one_stream_bits(precision, recompute):
    one = _train(FakeCudaBackend(precision=precision), False, recompute)[1]
    be = FakeCudaBackend(precision=precision)
    m, two = _train(be, True, recompute)
    assert m.side
    for key in one:
        np.testing.assert_array_equal(one[key], two[key], err_msg=key)
    # what went to the side stream: per layer (top down) fcproj's dweight (with the GELU recompute
    # form, -r >= 1), fc's, attproj's and qkv's; then the flush of the layernorm backwards' deferred
    # column sums (the default variants, 5 in fp32 and 7 in bf16, have the deferred form); two steps
    per_layer = (["matmul_backward"] if recompute >= 1 else []) + ["matmul_backward"] * 3
    assert m.ln_deferred
    assert be.side_launches == (per_layer * CFG.num_layers + ["layernorm_backward (flush)"]) * 2
    assert not be._side_queue  # all run by the end of each backward (side_join)


@pytest.mark.parametrize("mark", ["fcproj_dw", "attproj_dw"])
def test_each_wait_is_needed(mark):
    """Without either wait before a layernorm backward rewrites dres, the deferred side launches read
    rewritten buffers: the fake catches a missing wait. (The waits on fc_dw and qkv_dw are implied by
    these two, the side stream running in order: fc's dweight precedes attproj's, qkv's precedes the
    next layer's fcproj's. They stay, for the reads they name.)"""
    one = _train(FakeCudaBackend(), False, steps=1)[1]
    two = _train(FakeCudaBackend(), True, steps=1, skip_wait=mark)[1]
    assert not np.array_equal(one["grads1"], two["grads1"]), mark


def test_side_stream_off_and_on_the_numpy_backend():
    """side_stream=False keeps the combined matmul_backward launches; the numpy backend takes the
    split ones too (one stream: its side() runs them at once) with the same results."""
    m = GPT2(CFG, FakeCudaBackend(), B, T, side_stream=False)
    assert not m.side and "mmb_fc_dweight" not in m.built
    cpu_on = _train(CpuBackend(np.float32), True, steps=1)[1]
    cpu_off = _train(CpuBackend(np.float32), False, steps=1)[1]
    for key in cpu_on:
        np.testing.assert_array_equal(cpu_on[key], cpu_off[key], err_msg=key)


def test_side_stream_env(monkeypatch):
    monkeypatch.setenv("LLMC_SIDE_STREAM", "0")
    assert not GPT2(CFG, FakeCudaBackend(), B, T).side
    monkeypatch.setenv("LLMC_SIDE_STREAM", "1")
    assert GPT2(CFG, FakeCudaBackend(), B, T).side
    monkeypatch.setenv("LLMC_SIDE_STREAM", "yes")
    with pytest.raises(LLMCError, match="LLMC_SIDE_STREAM"):
        GPT2(CFG, FakeCudaBackend(), B, T)
    assert not GPT2(CFG, FakeCudaBackend(), B, T, training=False).side  # (inference: no backward)


# head size 64: attention 4 / 5, so bf16 takes attention_backward 5
CFG64 = GPT2Config(max_seq_len=32, vocab_size=97, padded_vocab_size=128, num_layers=3, num_heads=2, channels=128)


def test_attention_accumulator_zeroed_on_the_side_stream(monkeypatch):
    """bf16's attention_backward 5 in its caller_zeroes form (LLMC_ATT5_SIDE_ZERO=1): after each layer's
    qkv dweight the side stream zeroes the dq accumulator, and the next layer's attention backward waits
    for that. The fake emulates the
    accumulator's state: a launch onto one not zeroed since the last fails. The same results as prep
    zeroing it (the default); a rezero that does nothing is caught."""
    def run(**kw):
        rng = np.random.default_rng(2)
        be = FakeCudaBackend(precision="bf16", quiet=True)
        m = GPT2(CFG64, be, B, T, **kw)
        m.init_params(3)
        out = []
        for step in range(2):
            m.zero_grad()
            for _ in range(2):
                x = rng.integers(0, CFG64.vocab_size, (B, T)).astype(np.int32)
                m.train_micro_step(x, np.roll(x, -1, axis=1))
            out.append(m.get_grads())
            m.update(lr=1e-3, step=step + 1)
        return m, be, out
    assert not run()[0].att_side_zero  # (off by default: measured no faster)
    monkeypatch.setenv("LLMC_ATT5_SIDE_ZERO", "1")
    m, be, on = run()
    assert m.att_side_zero and m.built["attention_backward"].number == 5
    assert m.built["attention_backward"].shape.get("colsum")  # (rebuilt keeping qkv's fused bias gradient)
    assert be.side_launches.count("attention_backward (rezero)") == 2 * 2 * CFG64.num_layers
    monkeypatch.setenv("LLMC_ATT5_SIDE_ZERO", "0")
    m0, _, off = run()
    assert not m0.att_side_zero and m0.built["attention_backward"].number == 5
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("LLMC_ATT5_SIDE_ZERO", "1")
    assert not run(side_stream=False)[0].att_side_zero  # (on one stream prep zeroes it)
    # (the wait before the next layer's attention backward is also implied by the ones on fcproj_dw and
    # attproj_dw, the side stream running in order; the rezero itself is not)
    rezero = FakeCudaBackend._caller_zeroes
    monkeypatch.setattr(FakeCudaBackend, "_caller_zeroes", staticmethod(lambda run_: (rezero(run_)[0], lambda: None)))
    with pytest.raises(AssertionError, match="dq accumulator was not zeroed"):
        run()


GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(4, 64), (3, 37)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [1, 2])
def test_gpu_side_stream_step_is_bit_identical(rt, precision, B, T, recompute):
    """Two steps of 2 micro-steps (CUDA graph replays after the first, the side stream captured with
    them) with --deterministic's kernels, side stream on and off: losses, gradients, updated weights
    and logits the same bits."""
    from llmc.backend import CudaBackend
    from llmc.train import deterministic_kernels
    from tests.llmc_fixtures import train_steps
    runs = []
    for side in (True, False):
        be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
        m, steps, logits = train_steps(GPU_CFG, be, B, T, logits=True, side_stream=side, recompute=recompute)
        assert m.side == side
        runs.append([x for step in steps for x in step] + [logits])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_runtime_fork_join_protocol():
    """Runtime.fork / unfork / wait_mark / join on a stand-in driver that logs what the streams are asked
    to do: the side stream waits for the main one at each fork; a mark is waited for only if recorded since
    the last join; join waits for the side stream once, and only if it was used; fork inside fork refuses."""
    from llmc.runtime import Runtime
    log = []

    class Event:
        def __init__(self, flags=0):
            self.name = f"ev{len([x for x in log if x[0] == 'new'])}"
            log.append(("new", self.name))

        def record(self, stream):
            log.append(("record", self.name, stream.name))

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_for_event(self, ev):
            log.append(("wait", self.name, ev.name))

    class Drv:
        event_flags = type("F", (), {"DISABLE_TIMING": 2})
    Drv.Stream, Drv.Event = Stream, Event
    rt = Runtime.__new__(Runtime)  # (no GPU: only the stream bookkeeping)
    rt.drv, rt.stream = Drv, Stream("main")
    rt.join()
    assert log == []  # never forked: nothing to wait for
    rt.fork()
    assert rt.stream.name == "side" and ("wait", "side", "ev0") in log and ("record", "ev0", "main") in log
    with pytest.raises(RuntimeError, match="fork"):
        rt.fork()
    rt.unfork("a")
    assert rt.stream.name == "main" and log[-1] == ("record", "ev2", "side")  # ev1: the join event
    del log[:]
    rt.wait_mark("b")  # never recorded
    assert log == []
    rt.wait_mark("a")
    assert log == [("wait", "main", "ev2")]
    rt.join()
    assert log[1:] == [("record", "ev1", "side"), ("wait", "main", "ev1")]
    del log[:]
    rt.wait_mark("a")  # recorded before the join: not waited for again
    rt.join()          # the side stream unused since the last join
    assert log == []


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(4, 64), (3, 37)])
def test_gpu_attention_accumulator_zeroed_on_the_side_stream(rt, monkeypatch, B, T):
    """bf16 with the default kernels (attention_backward 5, whose dq sums land in no fixed order):
    two steps of 2 micro-steps (graph replays) with the accumulator zeroed on the side stream
    (LLMC_ATT5_SIDE_ZERO=1) and by prep: the losses, gradients and weights agree within bf16 roundings
    (an accumulator left unzeroed doubles a layer's dq: far outside them)."""
    from llmc.backend import CudaBackend
    from tests.llmc_fixtures import train_steps
    runs = []
    for on in ("1", "0"):
        monkeypatch.setenv("LLMC_ATT5_SIDE_ZERO", on)
        be = CudaBackend(quiet=True, precision="bf16")
        m, steps, _ = train_steps(GPU_CFG, be, B, T)
        assert m.att_side_zero == (on == "1") and m.built["attention_backward"].number == 5
        runs.append(steps)
    for (l1, g1, p1), (l0, g0, p0) in zip(*runs):
        assert abs(l1 - l0) < 1e-3 * abs(l0)
        assert np.linalg.norm(g1 - g0) <= 1e-2 * np.linalg.norm(g0), "gradients"
        assert np.abs(p1 - p0).max() <= 2.0 ** -6 * np.abs(p0).max(), "weights"
