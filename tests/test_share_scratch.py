"""The logits' buffer shared with the step's scratch (GPT2(share_scratch=...), LLMC_SHARE_SCRATCH).

The (B, T, Vp) logits live only from the lm head's forward to its backward. Outside that window their
memory (the "arena") holds the forward's one-layer scratch (attproj and fcproj outputs), -r's
recomputed GELU and layernorm outputs, the backward's d residual, d qkv and d fch, and the scratch of
the backward's builds (attention's dq accumulator, the layernorm backwards' partials, GEMM partials).
The fake backend (tests/fake_runtime.py) runs the side stream's launches as late as the model lets it,
so a view placed where something still live lies would change the numbers: these tests compare the
numbers with sharing on and off, show that a wrong placement is caught, check the placement itself,
and check the memory against llm.c's at the same settings. The GPU tests (-m gpu) compare the bits of
whole steps, graphs and the side stream included."""
import numpy as np
import pytest

from llmc.backend import CpuBackend, CudaBackend
from llmc.config import GPT2Config, config_from_name, llmc_train_bytes
from llmc.model import GPT2
from tests.fake_runtime import FakeCudaBackend, FakeRuntime
from tests.llmc_fixtures import train_steps

CFG = GPT2Config(max_seq_len=32, vocab_size=250, padded_vocab_size=256, num_layers=3, num_heads=2, channels=32)
B, T = 2, 16


def _train(be, share, recompute=1, fold=False, steps=2):
    """train_steps (steps of 2 micro-steps through train_micro_step: the graph path): every loss, gradient
    and updated weight, then the logits of a forward without targets."""
    be.emulate_fold = fold
    m, out, logits = train_steps(CFG, be, B, T, steps=steps, logits=True, recompute=recompute, share_scratch=share,
                                 fold=fold)
    return m, [x for step in out for x in step] + [logits]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [0, 1, 2])
@pytest.mark.parametrize("fold", [False, True])
def test_shared_scratch_gives_the_same_bits(precision, recompute, fold):
    m_on, on = _train(FakeCudaBackend(precision=precision), True, recompute, fold)
    m_off, off = _train(FakeCudaBackend(precision=precision), False, recompute, fold)
    assert m_on.share_scratch and "arena" in m_on.acts_bufs and not m_off.share_scratch
    assert m_on.side and (m_on.fold is not None) == fold
    assert m_on.activation_bytes() < m_off.activation_bytes()
    for i, (a, b) in enumerate(zip(on, off)):
        np.testing.assert_array_equal(a, b, err_msg=str(i))


def test_shared_scratch_on_the_numpy_backend():
    on = _train(CpuBackend(np.float32), True, steps=1)[1]
    off = _train(CpuBackend(np.float32), False, steps=1)[1]
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)


def test_a_view_placed_where_something_lives_is_caught(monkeypatch):
    """The comparison above can fail. -r 1's GELU output made a "fwd" view lies over d residual in the
    backward, which gelu_backward's recompute form then overwrites while d residual is live; d residual
    made a "fwd" view lies over d qkv, which attention's backward writes while d residual is live."""
    off = _train(FakeCudaBackend(precision="bf16"), False, steps=1)[1]
    phase = GPT2._scratch_phase
    for name in ("fch_gelu", "dresidual"):
        monkeypatch.setattr(GPT2, "_scratch_phase", lambda self, n, name=name: "fwd" if n == name else phase(self, n))
        on = _train(FakeCudaBackend(precision="bf16"), True, steps=1)[1]
        assert any(not np.array_equal(a, b) for a, b in zip(on, off)), name
    monkeypatch.setattr(GPT2, "_scratch_phase", phase)


def _span(a):
    return a.ptr, a.ptr + a.nbytes


def _overlap(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _arena(m):
    a = m.acts_bufs["arena"]
    return a.ptr, a.ptr + a.nbytes


@pytest.mark.parametrize("recompute", [0, 1, 2])
def test_what_shares_the_logits_memory(recompute):
    """With sharing, the views that overlap are the logits and a scratch view, or a "fwd" and a "bwd"
    view; the "both" views overlap no other scratch view. Without it, no two views overlap."""
    for share in (True, False):
        m = GPT2(CFG, FakeCudaBackend(precision="bf16"), B, T, recompute=recompute, share_scratch=share)
        names = list(m.a)
        shared = {n for n in names if share and m._scratch_phase(n)}
        expect = {"attproj", "fcproj", "dresidual", "dqkv", "dfch"} | ({"fch_gelu"} if recompute else set()) | \
            ({"ln1", "ln2"} if recompute == 2 else set()) | ({"qkv"} if "qkv" in m.a else set())
        assert shared == (expect if share else set())
        lo, hi = _arena(m) if share else (0, 0)
        assert all(lo <= m.a[n].ptr and m.a[n].ptr + m.a[n].nbytes <= hi for n in shared | {"logits"} if share)
        for i, x in enumerate(names):
            for y in names[i + 1:]:
                if not _overlap(m.a[x], m.a[y]) or {x, y} & {"losses_N", "losses_tail"}:
                    continue  # (losses_N and losses_tail are views of losses)
                assert share, (x, y)
                px, py = m._scratch_phase(x), m._scratch_phase(y)
                ok = ("logits" in (x, y) and (px or py)) or {px, py} == {"fwd", "bwd"}
                assert ok, (x, px, y, py)


def _scratch_in(built, lo, hi):
    """(inside, outside): the build's scratch buffers (its pool's) inside [lo, hi) and outside it."""
    bufs = (built.pool or {}).get("bufs", [])
    inside = [b for b in bufs if lo <= b.ptr and b.ptr + b.nbytes <= hi]
    return inside, [b for b in bufs if b not in inside]


@pytest.mark.parametrize("B_", [4, 16])
def test_d12_memory_below_llmc_and_the_builds_in_the_arena(B_):
    """d12, T=1024, bf16 at every -r: the bytes the model allocates (the fake runtime counts them; no
    GPU) are below what llm.c's bf16 trainer allocates at the same settings by its tensor sizes
    (llmc_train_bytes; its CUDA context with cuBLAS and cuDNN, and cuDNN's workspace, not counted, nor
    ours). The backward's builds cut their scratch from the arena past the views; the lm head's backward
    (which reads the logits there), the forward's builds and the first micro-step's twins of the lm head
    keep theirs outside it."""
    cfg = config_from_name("d12")
    for r in (0, 1, 2):
        rt = FakeRuntime(None, check_ptx=False)
        m = GPT2(cfg, CudaBackend(rt=rt, precision="bf16", quiet=True), B_, 1024, recompute=r)
        ref = sum(llmc_train_bytes(cfg, B_, 1024, r).values())
        assert rt.allocated_bytes < ref, (r, rt.allocated_bytes, ref)
        lo, hi = _arena(m)
        views_end = m.acts_bufs["arena"].ptr + m._arena_views_end * 2
        for key in ("attention_backward", "layernorm_backward_colsum_deferred", "gelu_backward_colsum_rc",
                    "encoder_backward"):
            if key not in m.built:
                continue
            inside, outside = _scratch_in(m.built[key], views_end, hi)
            assert inside and not outside, key
        for key in ["mmb_lmhead", "mm_qkv", "mm_fc", "mm_fcproj", "attention_forward"]:
            assert not _scratch_in(m.built[key], lo, hi)[0], key
        assert not _scratch_in(m.built_first.get("mmb_lmhead", m.built["mmb_lmhead"]), lo, hi)[0]
        if r == 1 and B_ == 16:  # (the README's figures)
            assert round(rt.allocated_bytes / 2**30, 2) == 6.90 and round(ref / 2**30, 2) == 7.07
    if B_ == 16:  # (without sharing, above llm.c's count: 7.34 GiB)
        rt = FakeRuntime(None, check_ptx=False)
        GPT2(cfg, CudaBackend(rt=rt, precision="bf16", quiet=True), B_, 1024, share_scratch=False)
        assert rt.allocated_bytes > sum(llmc_train_bytes(cfg, B_, 1024, 1).values())


def test_a_refused_build_leaves_no_arena_on_the_runtime(monkeypatch):
    """Each backward build enters the arena on its own: one that raises leaves the runtime as it was, so
    a later model's builds do not cut their scratch from a dead model's buffer."""
    be = FakeCudaBackend(precision="bf16")
    real = be.build

    def build(name, **kw):
        if name == "encoder_backward":
            raise RuntimeError("refused")
        return real(name, **kw)
    monkeypatch.setattr(be, "build", build)
    with pytest.raises(RuntimeError, match="refused"):
        GPT2(CFG, be, B, T)
    assert getattr(be.rt, "_scratch_arena", None) is None


def test_share_scratch_env(monkeypatch):
    monkeypatch.setenv("LLMC_SHARE_SCRATCH", "0")
    assert not GPT2(CFG, FakeCudaBackend(), B, T).share_scratch
    monkeypatch.setenv("LLMC_SHARE_SCRATCH", "1")
    assert GPT2(CFG, FakeCudaBackend(), B, T).share_scratch
    assert GPT2(CFG, FakeCudaBackend(), B, T, share_scratch=False).share_scratch is False


def test_llmc_train_bytes():
    """llm.c's count at d12, B=16, T=1024: its printed "allocating ... MiB" lines' parts (parameters and
    gradients 237 MiB each, m and v 474 each, the master copy 474), and its activations by -r."""
    cfg = config_from_name("d12")
    d = llmc_train_bytes(cfg, 16, 1024)
    assert d["params"] == d["grads"] == 2 * 124475904 and d["adamw"] == 8 * 124475904 and d["master"] == 4 * 124475904
    N, C, L = 16 * 1024, 768, 12
    r1, r0, r2 = (llmc_train_bytes(cfg, 16, 1024, r)["activations"] for r in (1, 0, 2))
    assert r0 - r1 == 2 * (L - 1) * N * 4 * C and r1 - r2 == 2 * 2 * L * N * C
    assert llmc_train_bytes(cfg, 16, 1024, cudnn=False)["activations"] - r1 == 2 * L * 16 * 12 * 1024 * 1024 - 4 * L * 16 * 12 * 1024


GPU_CFG = GPT2Config(max_seq_len=128, vocab_size=8000, padded_vocab_size=8192, num_layers=2, num_heads=2, channels=128)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [0, 1, 2])
def test_gpu_shared_scratch_step_is_bit_identical(rt, precision, recompute):
    """Two steps of 2 micro-steps (CUDA graph replays after the first, the side stream captured with them)
    with --deterministic's kernels, sharing on and off: losses, gradients, updated weights and the logits
    of a last forward the same bits; with sharing the backward builds' scratch lies in the arena."""
    from llmc.train import deterministic_kernels
    runs = []
    for share in (True, False):
        be = CudaBackend(deterministic_kernels({}, precision), quiet=True, precision=precision)
        m, steps, logits = train_steps(GPU_CFG, be, 4, 64, logits=True, share_scratch=share, recompute=recompute)
        assert m.share_scratch == share
        if share:
            lo, hi = _arena(m)
            assert _scratch_in(m.built["attention_backward"], lo, hi)[0]
        runs.append([x for step in steps for x in step] + [logits])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_shared_scratch_default_kernels(rt):
    """bf16 with the default kernels (attention_backward 5, whose dq sums land in the order the blocks
    run, its accumulator in the arena): sharing on and off agree within that order's rounding."""
    runs = []
    for share in (True, False):
        m, steps, logits = train_steps(GPU_CFG, CudaBackend(quiet=True, precision="bf16"), 4, 64, logits=True,
                                       share_scratch=share)
        if share:
            assert m.built["attention_backward"].number == 5
            lo, hi = _arena(m)
            assert _scratch_in(m.built["attention_backward"], lo, hi)[0]
        runs.append([x for step in steps for x in step] + [logits])
    for a, b in zip(*runs):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(np.abs(b).max(), 1e-6)
        assert np.abs(a - b).max() <= 2e-2 * scale
