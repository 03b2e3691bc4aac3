"""Encoder: numpy references vs torch autograd (float64) with repeated tokens, cpu launcher semantics,
shape refusals; with -m gpu, every variant against the reference and the deterministic backward
variants bit-identical across runs.

    python -m pytest tests/test_encoder.py -q
    python -m pytest -m gpu tests/test_encoder.py -q
"""
import numpy as np
import pytest

from llmc import ops
from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.errors import LLMCError, VariantRefused
from llmc.ops.encoder import (ENC10_DWPE_MID, ENC10_WHOLE_MAX, encoder_backward8_records, encoder_backward10_records,
                               encoder_backward10_unit_kinds, encoder_backward_ref,
                               encoder_decode_ref, encoder_forward_ref, heads_per_window9)
from llmc.testing import assert_close, module_defines, poison

FWD = ops.get("encoder_forward")
BWD = ops.get("encoder_backward")
DEC = ops.get("encoder_decode")
DETERMINISTIC = (2, 3, 6, 7, 8, 9, 10)


def inputs(rng, B, T, C, Vp, maxT, vocab=None, dtype=np.float64):
    """Tokens from a small vocabulary (so they repeat, within and across rows) plus the last id."""
    vocab = vocab or max(2, min(Vp, B * T // 3))
    inp = rng.integers(0, vocab, (B, T)).astype(np.int32)
    inp[-1, -1] = Vp - 1
    wte = rng.standard_normal((Vp, C)).astype(dtype)
    wpe = rng.standard_normal((maxT, C)).astype(dtype)
    dout = rng.standard_normal((B, T, C)).astype(dtype)
    return inp, wte, wpe, dout


# ----------------------------------------------------------------------------------------------
# references (no GPU)

@pytest.mark.parametrize("B,T,C", [(2, 5, 8), (3, 17, 24), (1, 1, 4)])
def test_references_match_torch_autograd(rng, B, T, C):
    torch = pytest.importorskip("torch")
    Vp, maxT = 11, T + 3
    inp, wte, wpe, dout = inputs(rng, B, T, C, Vp, maxT, vocab=4)
    out = encoder_forward_ref(inp, wte, wpe)
    twte, twpe = torch.tensor(wte, requires_grad=True), torch.tensor(wpe, requires_grad=True)
    tout = twte[torch.tensor(inp, dtype=torch.long)] + twpe[:T]
    tout.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-15, atol=0)
    dwte, dwpe = encoder_backward_ref(np.zeros_like(wte), np.zeros_like(wpe), dout, inp)
    np.testing.assert_allclose(dwte, twte.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dwpe, twpe.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert B * T == 1 or (np.bincount(inp.ravel()) > 1).any()  # the test really has repeated tokens


def test_backward_ref_accumulates_and_touches_only_used_rows(rng):
    B, T, C, Vp, maxT = 2, 6, 8, 20, 9
    inp, _, _, dout = inputs(rng, B, T, C, Vp, maxT, vocab=5)
    dwte0, dwpe0 = rng.standard_normal((Vp, C)), rng.standard_normal((maxT, C))
    dwte, dwpe = encoder_backward_ref(dwte0.copy(), dwpe0.copy(), dout, inp)
    unused = np.setdiff1d(np.arange(Vp), inp)
    np.testing.assert_array_equal(dwte[unused], dwte0[unused])
    np.testing.assert_array_equal(dwpe[T:], dwpe0[T:])
    want = dwte0.copy()
    for (b, t), tok in np.ndenumerate(inp):  # the obvious loop, as a cross-check only
        want[tok] += dout[b, t]
    np.testing.assert_allclose(dwte, want, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(dwpe[:T], dwpe0[:T] + dout.sum(0), rtol=1e-14, atol=1e-14)


def test_cpu_launchers(rng):
    B, T, C, Vp, maxT = 2, 7, 12, 10, 8
    inp, wte, wpe, dout = inputs(rng, B, T, C, Vp, maxT, dtype=np.float32)
    out = np.full((B, T, C), np.nan, np.float32)
    FWD.cpu(B=B, T=T, C=C)(out, inp, wte, wpe)
    np.testing.assert_array_equal(out, encoder_forward_ref(inp, wte, wpe))
    flat = rng.standard_normal(Vp * C + maxT * C).astype(np.float32)  # grads as views of one buffer
    want = encoder_backward_ref(flat[:Vp * C].reshape(Vp, C).copy(), flat[Vp * C:].reshape(maxT, C).copy(),
                                dout, inp)
    BWD.cpu(B=B, T=T, C=C)(flat[:Vp * C].reshape(Vp, C), flat[Vp * C:].reshape(maxT, C), dout, inp)
    np.testing.assert_array_equal(flat, np.concatenate([w.ravel() for w in want]))


@pytest.mark.parametrize("spec,number", [(FWD, 2), (FWD, 3), (BWD, 3), (BWD, 4), (BWD, 5)])
def test_float4_variants_refuse_odd_C(spec, number):
    reason = spec.variants[number].refuse_reason(B=2, T=3, C=66)
    assert reason and "multiple of 4" in reason
    with pytest.raises(VariantRefused, match=spec.flag):
        spec.build(None, number, B=2, T=3, C=66)
    assert spec.variants[number].refuse_reason(B=2, T=3, C=768) is None


def test_variants_table():
    assert len(FWD.variants) >= 2 and len(BWD.variants) >= 2
    for spec in (FWD, BWD):
        assert spec.default in spec.variants
        for n, v in spec.variants.items():
            assert v.number == n and v.description
        with pytest.raises(LLMCError, match="have 1, 2"):
            spec.variant(99)
    for n in DETERMINISTIC:
        assert "deterministic" in BWD.variants[n].description
        assert "non-deterministic" not in BWD.variants[n].description


def test_bf16_builds():
    """bf16: the forward default, the decoder's kernel and the deterministic backward variants have
    builds; the atomic backward variants don't (bf16 atomics would round in a varying order), so a
    bf16 build has its own default, the deterministic 9 (OpSpec.defaults), chosen without a note."""
    assert "bf16" in FWD.variants[FWD.default].dtypes and "bf16" in DEC.variants[DEC.default].dtypes
    assert "bf16" in FWD.variants[1].dtypes  # any C
    have = {n for n, v in BWD.variants.items() if "bf16" in v.dtypes}
    assert have == set(DETERMINISTIC)
    assert "no bf16 kernels" in BWD.refuse_reason(BWD.default, "bf16", B=4, T=64, C=768)
    assert BWD.default_for("fp32") == BWD.default == 5 and BWD.default_for("bf16") == 9


def test_bf16_model_takes_the_bf16_default_without_a_note(capsys):
    """The real CudaBackend over the fake runtime: a bf16 build of encoder_backward selects 9 and
    prints nothing (before, it fell back from the atomic 5 to 3 with a note on every bf16 run); fp32
    keeps 5; a variant the user names is still taken as named."""
    from llmc.backend import CudaBackend
    from tests.fake_runtime import FakeRuntime
    shape = dict(B=4, T=1024, C=768)
    b16 = CudaBackend(precision="bf16", rt=FakeRuntime(free=80 << 30))
    assert b16.build("encoder_backward", **shape).number == 9
    assert b16.build("encoder_backward", **shape).dtype == "bf16"
    assert CudaBackend(rt=FakeRuntime(free=80 << 30)).build("encoder_backward", **shape).number == 5
    named = CudaBackend({"encoder_backward": 6}, precision="bf16", rt=FakeRuntime(free=80 << 30))
    assert named.build("encoder_backward", **shape).number == 6
    assert "note" not in capsys.readouterr().out


def test_variant6_scratch_is_declared():
    """Variant 6's build allocates what scratch_bytes says (keys, runlen, owner, next per sorted slot)."""
    from tests.fake_runtime import FakeRuntime
    for B, T in ((4, 1024), (5, 1024), (1, 1)):
        built = BWD.build(FakeRuntime(free=80 << 30), 6, "bf16", B=B, T=T, C=768)
        got = sum(a.nbytes for a in built.scratch.values())
        assert got == BWD.variants[6].scratch_bytes(B=B, T=T, C=768) == 20 * 2048 * -(-B * T // 2048)


def test_variant7_scratch_is_declared():
    """Variant 7's build allocates what scratch_bytes says; the tickets start at zero."""
    from tests.fake_runtime import FakeRuntime
    for B, T, C in ((4, 1024, 768), (5, 1024, 768), (1, 1, 80), (16, 1024, 768)):
        built = BWD.build(FakeRuntime(free=80 << 30), 7, "bf16", B=B, T=T, C=C)
        got = sum(a.nbytes for a in built.scratch.values())
        assert got == BWD.variants[7].scratch_bytes(B=B, T=T, C=C)


@pytest.mark.parametrize("number", [8, 9])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_variant8_scratch_is_declared(number, dtype):
    """Variants 8's and 9's builds allocate what scratch_bytes says (9: a ticket per place and slice of
    32 lanes of 16 bytes, of 1 column at a C that is not a multiple of those); their records come from
    the host (host_inputs)."""
    from tests.fake_runtime import FakeRuntime
    for B, T, C in ((4, 1024, 768), (1, 1, 80), (16, 1024, 768), (2, 5, 66)):
        built = BWD.build(FakeRuntime(free=80 << 30), number, dtype, B=B, T=T, C=C)
        got = sum(a.nbytes for a in built.scratch.values())
        assert got == BWD.variants[number].scratch_bytes(B=B, T=T, C=C, dtype=dtype)
        prep, buf = built.host_inputs
        assert buf is built.scratch["place_rec"] and buf.shape == (B * T, 4) and prep is encoder_backward8_records
        if number == 9:  # 768 columns: 192 float4 or 96 vectors of 8 bf16; 80: 20 or 10; 66: 66 scalars
            slices = {768: 6 if dtype == "fp32" else 3, 80: 1, 66: 3}[C]
            assert built.scratch["tickets"].shape == (B * T * slices,)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_variant10_scratch_is_declared(dtype):
    """Variant 10's build allocates what scratch_bytes10 says: 9's, with its records (the host's, host_inputs)
    followed by a single token per position; it refuses a C its 16-byte loads can't take."""
    from tests.fake_runtime import FakeRuntime
    for B, T, C in ((4, 1024, 768), (1, 1, 80), (16, 1024, 768), (3, 5, 1600)):
        built = BWD.build(FakeRuntime(free=80 << 30), 10, dtype, B=B, T=T, C=C)
        got = sum(a.nbytes for a in built.scratch.values())
        assert got == BWD.variants[10].scratch_bytes(B=B, T=T, C=C, dtype=dtype)
        prep, buf = built.host_inputs
        assert buf is built.scratch["records"] and buf.shape == (6 * B * T + 4,) and prep is encoder_backward10_records
    reason = BWD.refuse_reason(10, dtype, None, B=2, T=5, C=66 if dtype == "fp32" else 100)
    assert reason and "16-byte" in reason


@pytest.mark.parametrize("block_size,defines", [(None, {}), (256, {}), (128, {"ENC9_STAGE": 24}), (None, {"ENC10_ROWS": 4})])
def test_variant10_launch_is_persistent_with_its_stages(block_size, defines):
    """Variant 10's launch: as many blocks as fit on the GPU at once (by registers, threads and its stages'
    shared memory), never more than its units could use, and each warp's max(ENC9_STAGE (bf16), 2
    ENC10_ROWS) 16-byte slots a lane of dynamic shared memory, in both dtypes."""
    from tests.fake_runtime import FakeRuntime
    for dtype in ("fp32", "bf16"):
        for B, T in ((16, 1024), (1, 3)):
            rt = FakeRuntime(free=80 << 30)
            rt.extra_defines = {"encoder": {k: str(v) for k, v in defines.items()}} if defines else {}
            built = BWD.build(rt, 10, dtype, B=B, T=T, C=768, block_size=block_size)
            dt = BF16 if dtype == "bf16" else np.float32
            built(rt.empty((50304, 768), dt), rt.empty((T, 768), dt), rt.empty((B, T, 768), dt), rt.empty((B, T), np.int32))
            launch = rt.launches[-1]
            wpb = (block_size or 64) // 32
            slots = max(defines.get("ENC9_STAGE", 16) if dtype == "bf16" else 0, 2 * defines.get("ENC10_ROWS", 8))
            assert launch.smem == wpb * slots * 512
            S = 6 if dtype == "fp32" else 3
            kern = rt.kernel("encoder", "encoder_backward_kernel10" + ("_bf16" if dtype == "bf16" else ""), "PPPPPPPiii")
            per_sm = min(kern.resident_blocks(32 * wpb), (228 * 1024) // (launch.smem + 1024))
            assert launch.grid[0] == min(rt.sm_count * per_sm, -(-(B * T * S + T * S) // wpb)), (dtype, B, T, launch.grid)


@pytest.mark.parametrize("B,T,vocab,zipf", [(4, 1024, 50257, False), (16, 1024, 50257, True), (2, 65, 7, False),
                                            (1, 1, 5, False), (3, 700, 300, True)])
def test_variant10_records(rng, B, T, vocab, zipf):
    """Variant 10's work list: 8's records, then every piece head of every token of at least 2 rows exactly
    once (places start + 32 q), the multi-piece tokens' first (their count in the header), the tokens of
    the most rows first, and the tokens seen once at their positions (-1 elsewhere): every position is
    in a listed piece or a single, never both."""
    if zipf:
        p = 1.0 / np.arange(1, vocab + 1)
        inp = rng.choice(vocab, (B, T), p=p / p.sum()).astype(np.int32)
    else:
        inp = rng.integers(0, vocab, (B, T)).astype(np.int32)
    N = B * T
    out = encoder_backward10_records(inp)
    assert out.dtype == np.int32 and out.shape == (6 * N + 4,)
    rec = encoder_backward8_records(inp)
    np.testing.assert_array_equal(out[:4 * N].reshape(N, 4), rec)
    n, nmulti = out[4 * N], out[4 * N + 1]
    heads = out[4 * N + 4:4 * N + 4 + n]
    np.testing.assert_array_equal(out[4 * N + 4 + n:5 * N + 4], 0)
    ids = inp.ravel()
    counts = np.bincount(ids)
    want = sorted((t, q) for t in np.flatnonzero(counts >= 2) for q in range(-(-counts[t] // 32)))
    got = sorted((rec[h, 3], (h - rec[h, 1]) // 32) for h in heads)
    assert got == want and all((h - rec[h, 1]) % 32 == 0 for h in heads)
    assert list(rec[heads, 2]) == sorted(rec[heads, 2], reverse=True)  # the most rows first
    assert nmulti == (rec[heads, 2] > 32).sum()
    # of the one-piece tokens' heads, the first hdr[2] have more than ENC10_WHOLE_MAX rows; the others
    # (summed a whole row a warp) at most that many; none of them in a batch with a multi-piece token;
    # hdr[3] is 0
    nsl = out[4 * N + 2]
    assert out[4 * N + 3] == 0 and 0 <= nsl <= n - nmulti
    if nmulti:
        assert nsl == n - nmulti
    else:
        assert (rec[heads[nmulti:nmulti + nsl], 2] > ENC10_WHOLE_MAX).all()
        assert (rec[heads[nmulti + nsl:], 2] <= ENC10_WHOLE_MAX).all()
    for whole_max in (1, 3, 32):  # the host's choice alone: the same heads, another boundary
        other = encoder_backward10_records(inp, whole_max=whole_max)
        np.testing.assert_array_equal(np.delete(other, 4 * N + 2), np.delete(out, 4 * N + 2))
        assert other[4 * N + 2] == (rec[heads[nmulti:], 2] > whole_max).sum()
    single = out[5 * N + 4:]
    np.testing.assert_array_equal(single, np.where(counts[ids] == 1, ids, -1))
    covered = np.zeros(N, int)
    for h in heads:
        covered[rec[h:h + min(32, rec[h, 2] - (h - rec[h, 1])), 0]] += 1
    covered[single >= 0] += 1
    np.testing.assert_array_equal(covered, 1)


@pytest.mark.parametrize("defines,block_size,want", [
    ({}, None, {"fp32": 0, "bf16": 2 * 16 * 512}),                      # bf16 stages 16 slots a lane
    ({}, 256, {"fp32": 0, "bf16": 8 * 16 * 512}),                       # (64 KB: past 48 KB, opted in)
    ({"ENC9_STAGE": 0}, None, {"fp32": 0, "bf16": 0}),                  # register loads
    ({"ENC9_STAGE": 3}, 128, {"fp32": 0, "bf16": 4 * 3 * 512}),
    ({"ENC9_LANE": 4}, None, {"fp32": 0, "bf16": 0}),                   # 8-byte bf16 lanes: registers
])
def test_variant9_launch_gives_the_staged_warps_their_shared_memory(defines, block_size, want):
    """cuda/encoder.cu stages the sliced warps' loads (ENC9_STAGE 16-byte slots a lane) in bf16 builds with
    16-byte lanes only, in the block's dynamic shared memory: the launch must ask for exactly a warp's
    ENC9_STAGE * 512 bytes per warp there (less would let the warps write past the block's memory), and
    for none in the fp32 build and the register forms."""
    from tests.fake_runtime import FakeRuntime
    for dtype in ("fp32", "bf16"):
        rt = FakeRuntime(free=80 << 30)
        rt.extra_defines = {"encoder": {k: str(v) for k, v in defines.items()}} if defines else {}
        built = BWD.build(rt, 9, dtype, B=2, T=64, C=768, block_size=block_size)
        dt = BF16 if dtype == "bf16" else np.float32  # (made-up addresses: the launch is recorded, not run)
        built(rt.empty((50304, 768), dt), rt.empty((64, 768), dt), rt.empty((2, 64, 768), dt), rt.empty((2, 64), np.int32))
        assert rt.launches[-1].smem == want[dtype], (dtype, rt.launches[-1].smem)


class _Defines:
    def __init__(self, **d):
        self.extra_defines = {"encoder": {k: str(v) for k, v in d.items()}} if d else {}


def test_host_constants_are_the_kernels():
    """The launchers' copies of cuda/encoder.cu's constants (the sort chunk, the piece size, variant 9's
    default ENC9_MIN, which sets the grid's heads a window) are the kernel's #define values."""
    import re
    from conftest import ROOT
    from llmc.ops import encoder
    src = (ROOT / "cuda" / "encoder.cu").read_text()
    for name, value in (("ENC_S", encoder.SORT_CHUNK), ("ENC7_K", encoder.ENC7_PIECE), ("ENC9_MIN", encoder.ENC9_MIN),
                        ("ENC9_LANE", encoder.ENC9_LANE), ("ENC9_STAGE", encoder.ENC9_STAGE),
                        ("ENC10_ROWS", encoder.ENC10_ROWS), ("ENC10_DWPE_MID", encoder.ENC10_DWPE_MID)):
        found = re.findall(rf"^#define {name} (\d+)$", src, re.M)
        assert found == [str(value)], (name, found)


def test_variant10_unit_kinds_follow_the_kernels_order(rng):
    """encoder_backward10_unit_kinds (the trace script's and the trace test's map of 10's work list): the
    multi-piece tokens' slices first, then the other pieces' slices, then the position units and the whole rows
    (ENC10_DWPE_MID, the kernel's default) or the whole rows first; no whole rows in fp32 or past C = 768."""
    B, T, C = 4, 256, 768
    inp = rng.integers(0, 300, (B, T)).astype(np.int32)
    inp[0, :100] = 7  # a token of more than 32 rows
    recs = encoder_backward10_records(inp, whole_max=4)
    N, S = B * T, 3
    nh, nmulti, nsl = (int(x) for x in recs[4 * N:4 * N + 3])
    assert nmulti > 0 and nh - nmulti - nsl > 0
    for mid in (1, 0):
        k = encoder_backward10_unit_kinds(recs, B, T, C, dwpe_mid=mid)
        want = [0] * (nmulti * S) + [1] * (nsl * S)
        rest = [3] * (T * S) + [2] * (nh - nmulti - nsl)
        want += rest if mid else rest[T * S:] + rest[:T * S]
        np.testing.assert_array_equal(k, want)
    np.testing.assert_array_equal(encoder_backward10_unit_kinds(recs, B, T, C), encoder_backward10_unit_kinds(
        recs, B, T, C, dwpe_mid=ENC10_DWPE_MID))
    for dtype, c in (("fp32", 768), ("bf16", 1024)):
        k = encoder_backward10_unit_kinds(recs, B, T, c, dtype)
        assert 2 not in k and (k == 1).sum() == (nh - nmulti) * ((c // (4 if dtype == "fp32" else 8) + 31) // 32)


@pytest.mark.parametrize("m", [0, 1, 5, 8, 16, 31, 32])
def test_variant9_heads_a_window_bound(rng, m):
    """Variant 9's sliced warps look for at most H = heads_per_window9 pieces of tokens of more than
    ENC9_MIN rows among each 32 places of the token-major order (the kernel traps on more). H from
    the records of adversarial and random batches: short last pieces, tokens of exactly m + 1 rows
    packed back to back, Zipf ids; H must cover the worst window seen and be tight for the packed case."""
    H = heads_per_window9(_Defines(ENC9_MIN=m))
    if m == 8:
        assert heads_per_window9(_Defines()) == H == 5  # (8: the kernel's default)
    cases = []
    k = min(m + 1, 32)  # the fewest rows a sliced token has (a piece of it at most 32)
    packed = np.concatenate([[0] * 33] + [[t] * k for t in range(1, 70)])  # a 1-row last piece, then k-row tokens
    cases.append(packed)
    for vocab in (40, 300, 50257):
        zipf = 1.0 / np.arange(1, vocab + 1)
        cases.append(rng.choice(vocab, 8192, p=zipf / zipf.sum()))
    worst = 0
    for ids in cases:
        rec = encoder_backward8_records(np.asarray(ids, np.int32).reshape(1, -1))
        place = np.arange(len(rec))
        head = (rec[:, 2] > m) & ((place - rec[:, 1]) % 32 == 0)
        per_window = np.bincount(place[head] // 32, minlength=1)
        worst = max(worst, int(per_window.max()))
    assert worst <= H
    if m < 32:  # the packed batch reaches the bound: H is not larger than it must be
        rec = encoder_backward8_records(packed.astype(np.int32).reshape(1, -1))
        place = np.arange(len(rec))
        head = (rec[:, 2] > m) & ((place - rec[:, 1]) % 32 == 0)
        assert np.bincount(place[head] // 32).max() == H


def _build_bwd(rt, number, dtype="fp32", inp=None, **shape):
    """BWD.build with what the build computes on the host from the ids (variant 8's records of inp) uploaded."""
    built = BWD.build(rt, number, dtype, **shape)
    if built.host_inputs is not None:
        built.put_host_inputs(inp)
    return built


def _variant7_plan(inp, K=32, S=2048):
    """Variant 7's index arithmetic in numpy, as cuda/encoder.cu does it: the chunk sort (a), each
    slot's place from per-chunk counts (b), the pieces and their partial-row slots (c)."""
    ids = inp.ravel()
    N = len(ids)
    G = -(-N // S)
    chunks = [np.array(sorted((int(ids[p]), p) for p in range(g * S, min(N, (g + 1) * S)))) for g in range(G)]
    toks = [c[:, 0] for c in chunks]
    order, start, count = np.full(N, -1), np.full(N, -1), np.full(N, -1)
    for g, c in enumerate(chunks):
        for i, (tok, pos) in enumerate(c):
            lo = [int(np.searchsorted(tj, tok, "left")) for tj in toks]
            cnt = [int(np.searchsorted(tj, tok, "right")) - lo[j] for j, tj in enumerate(toks)]
            run = i - lo[g]
            place = sum(lo) + sum(cnt[:g]) + run
            assert order[place] == -1
            order[place], start[place], count[place] = pos, sum(lo), sum(cnt)
    pieces = []  # (place, rows, partial slot or None)
    for t in range(N):
        d = t - start[t]
        if d % K:
            continue
        np_ = -(-count[t] // K)
        q = d // K
        pieces.append((t, min(K, count[t] - d), None if np_ == 1 else 2 * (t // K) + (q == np_ - 1)))
    return order, start, count, pieces


@pytest.mark.parametrize("N,vocab,zipf", [(4096, 8, False), (5000, 50257, False), (4500, 300, True),
                                          (33, 2, False), (2049, 3, True)])
def test_variant7_places_and_pieces(rng, N, vocab, zipf):
    """The order variant 7 builds is every position once, tokens ascending, each token's positions
    ascending; every token's rows are covered by its pieces exactly once; the partial-row slots of
    the multi-piece tokens never collide and fit the scratch (2 * ceil(N / 32) rows)."""
    p = 1.0 / np.arange(1, vocab + 1) if zipf else np.ones(vocab)
    inp = rng.choice(vocab, N, p=p / p.sum()).astype(np.int32)
    order, start, count, pieces = _variant7_plan(inp)
    np.testing.assert_array_equal(order, np.lexsort((np.arange(N), inp)))  # token-major, position-minor
    np.testing.assert_array_equal(count, np.bincount(inp)[inp[order]])
    covered = np.zeros(N, int)
    for t, n, _ in pieces:
        covered[t:t + n] += 1
        assert (inp[order[t:t + n]] == inp[order[t]]).all()
    np.testing.assert_array_equal(covered, 1)
    slots = [sl for _, _, sl in pieces if sl is not None]
    assert len(slots) == len(set(slots)) and all(0 <= sl < 2 * -(-N // 32) for sl in slots)
    assert any(sl is not None for _, _, sl in pieces) == bool((np.bincount(inp) > 32).any())
    # variant 8's records, computed on the host, are the places variant 7 computes on the GPU
    rec = encoder_backward8_records(inp.reshape(1, -1))
    assert rec.dtype == np.int32 and rec.shape == (N, 4)
    np.testing.assert_array_equal(rec[:, 0], order)
    np.testing.assert_array_equal(rec[:, 1], start)
    np.testing.assert_array_equal(rec[:, 2], count)
    np.testing.assert_array_equal(rec[:, 3], inp[order])


@pytest.mark.parametrize("hi", [50257, 65536, 70000])
def test_variant8_records_for_ids_of_any_width(rng, hi):
    """The host records sort 16-bit ids with numpy's radix sort and wider ones (a vocabulary above
    65536) with its int32 sort: both must give the token-major, position-minor order and the counts."""
    inp = rng.integers(0, hi, (3, 700)).astype(np.int32)
    inp[0, :5] = hi - 1                       # the widest id, repeated, and ...
    inp[2, -3:] = inp[0, 7]                   # ... a token repeated across rows
    ids = inp.ravel()
    rec = encoder_backward8_records(inp)
    order = np.lexsort((np.arange(ids.size), ids))
    np.testing.assert_array_equal(rec[:, 0], order)
    np.testing.assert_array_equal(rec[:, 3], ids[order])
    np.testing.assert_array_equal(rec[:, 2], np.bincount(ids)[ids[order]])
    np.testing.assert_array_equal(rec[:, 1], np.searchsorted(ids[order], ids[order], "left"))


# ----------------------------------------------------------------------------------------------
# GPU

# (B, T, C): T=65 and T=1, C not a power of two (80, 96, 1600), C=768, and C=66 (float4 refuses)
SHAPES = [(2, 65, 96), (1, 1, 80), (3, 64, 768), (4, 33, 1600), (2, 5, 66), (8, 129, 80)]
VP = 97


def _refused(spec, number, B, T, C, dtype="fp32"):
    """A variant refuses only rows its 16-byte loads can't take (C % 4 in fp32, C % 8 for the bf16
    builds that have no scalar path), and then by raising VariantRefused."""
    reason = spec.refuse_reason(number, dtype, None, B=B, T=T, C=C)
    if reason:
        assert C % 4 or (dtype == "bf16" and C % 8), reason
        assert "float4" in reason or "16-byte" in reason, reason
        with pytest.raises(VariantRefused):
            spec.build(None, number, dtype, B=B, T=T, C=C)
    return reason


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C", SHAPES)
@pytest.mark.parametrize("number", sorted(FWD.variants))
def test_forward_gpu(rt, rng, number, B, T, C):
    if _refused(FWD, number, B, T, C):
        return
    inp, wte, wpe, _ = inputs(rng, B, T, C, VP, T + 3, dtype=np.float32)
    launch = FWD.build(rt, number, B=B, T=T, C=C)
    out = rt.empty((B, T, C))
    poison(out)
    launch(out, rt.to_device(inp), rt.to_device(wte), rt.to_device(wpe))
    ref = encoder_forward_ref(inp, wte.astype(np.float64), wpe.astype(np.float64))
    assert_close(out.get(), ref, 1e-6, 1e-6, "out")  # one fp32 add: within half an ulp


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C", SHAPES)
@pytest.mark.parametrize("number", sorted(BWD.variants))
def test_backward_gpu_accumulates(rt, rng, number, B, T, C):
    if _refused(BWD, number, B, T, C):
        return
    maxT = T + 3
    inp, _, _, dout = inputs(rng, B, T, C, VP, maxT, dtype=np.float32)
    dwte0 = rng.standard_normal((VP, C)).astype(np.float32)   # "+=" outputs pre-filled
    dwpe0 = rng.standard_normal((maxT, C)).astype(np.float32)
    launch = _build_bwd(rt, number, inp=inp, B=B, T=T, C=C)
    dwte, dwpe = rt.to_device(dwte0), rt.to_device(dwpe0)
    launch(dwte, dwpe, rt.to_device(dout), rt.to_device(inp))
    want_wte, want_wpe = encoder_backward_ref(dwte0.astype(np.float64), dwpe0.astype(np.float64),
                                              dout.astype(np.float64), inp)
    got_wte, got_wpe = dwte.get(), dwpe.get()
    # up to ~B*T/3 repeats of a token summed in fp32: 1e-5 abs + 1e-5 rel is well above the rounding
    assert_close(got_wte, want_wte, 1e-5, 1e-5, "dwte")
    assert_close(got_wpe, want_wpe, 1e-5, 1e-5, "dwpe")
    unused = np.setdiff1d(np.arange(VP), inp)
    np.testing.assert_array_equal(got_wte[unused], dwte0[unused])  # rows not used: untouched
    np.testing.assert_array_equal(got_wpe[T:], dwpe0[T:])


def _zipf_case(rng, B, T, C, vocab, dtype):
    """Zipf-distributed ids (frequent tokens in every sort chunk), random dout and "+=" outputs (maxT =
    T), and the dtype's conversions: (inp, dout, dwte0, dwpe0, to the dtype, back to float32)."""
    zipf = 1.0 / np.arange(1, vocab + 1)
    return _case_of(rng, rng.choice(vocab, (B, T), p=zipf / zipf.sum()).astype(np.int32), C, vocab, dtype)


def _uniform_case(rng, B, T, C, vocab, dtype):
    """_zipf_case's tuple with uniform ids."""
    return _case_of(rng, rng.integers(0, vocab, (B, T)).astype(np.int32), C, vocab, dtype)


def _case_of(rng, inp, C, vocab, dtype):
    """The cases' tuple for ids inp (B, T): random dout and "+=" outputs drawn after them."""
    B, T = inp.shape
    dout = rng.standard_normal((B, T, C)).astype(np.float32)
    dwte0 = rng.standard_normal((vocab, C)).astype(np.float32)
    dwpe0 = rng.standard_normal((T, C)).astype(np.float32)
    if dtype == "fp32":
        return inp, dout, dwte0, dwpe0, (lambda a: a), (lambda a: a)
    return inp, dout, dwte0, dwpe0, to_bf16, from_bf16


def _bwd_runs(rt, case, dtype, defines_of, numbers, runs, B, T, C):
    """{(number, run): (dwte, dwpe)}: each variant built with defines_of(number) (lab knobs of cuda/encoder.cu)
    and run `runs` times on fresh copies of the case's outputs; its tickets back to 0 after them."""
    inp, dout, dwte0, dwpe0, conv, _ = case
    d_dout, d_inp = rt.to_device(conv(dout)), rt.to_device(inp)
    res = {}
    for number in numbers:
        with module_defines(rt, "encoder", defines_of(number)):
            built = _build_bwd(rt, number, dtype, inp=inp, B=B, T=T, C=C)
        for run in range(runs):
            dwte, dwpe = rt.to_device(conv(dwte0)), rt.to_device(conv(dwpe0))
            built(dwte, dwpe, d_dout, d_inp)
            res[number, run] = dwte.get(), dwpe.get()
        np.testing.assert_array_equal(built.scratch["tickets"].get(), 0)
    return res


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("B,T,C,vocab", [(5, 1024, 768, 40), (3, 1000, 100, 5000), (16, 1024, 768, 50257),
                                         (1, 2049, 96, 3)])
def test_backward6_equals_3_across_sort_chunks(rt, rng, dtype, B, T, C, vocab):
    """Variant 6 sorts the ids in chunks of 2048 positions and links each token's runs across chunks:
    at N = B*T > 2048 (3, 2, 8 and 2 chunks, partial last chunks; Zipf-like ids, so frequent tokens
    have runs in every chunk, and a C with the scalar path) it must add exactly the rows variant 3
    adds, in the same order: the same bits, and within the fp32/bf16 tolerance of the float64 sums."""
    inp, dout, dwte0, dwpe0, conv, back = _zipf_case(rng, B, T, C, vocab, dtype)
    res = {}
    for number in (3, 6):
        if BWD.refuse_reason(number, dtype, B=B, T=T, C=C):
            continue  # (3 in fp32 needs C % 4 == 0)
        dwte, dwpe = rt.to_device(conv(dwte0)), rt.to_device(conv(dwpe0))
        _build_bwd(rt, number, dtype, inp=inp, B=B, T=T, C=C)(dwte, dwpe, rt.to_device(conv(dout)), rt.to_device(inp))
        res[number] = dwte.get(), dwpe.get()
    want_wte, want_wpe = encoder_backward_ref(back(conv(dwte0)).astype(np.float64), back(conv(dwpe0)).astype(np.float64),
                                              back(conv(dout)).astype(np.float64), inp)
    for name, got, want in (("dwte", res[6][0], want_wte), ("dwpe", res[6][1], want_wpe)):
        rms = float(np.sqrt(np.mean(np.square(want))))
        # fp32: up to ~B*T/2 terms summed in fp32 (~1e-6 relative); bf16: one rounding (2^-8)
        assert_close(back(got).astype(np.float64), want, 1e-5 * rms if dtype == "bf16" else 1e-4,
                     BF16_RTOL if dtype == "bf16" else 1e-5, name)
    if 3 in res:
        np.testing.assert_array_equal(res[6][0], res[3][0])
        np.testing.assert_array_equal(res[6][1], res[3][1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("B,T,C,vocab", [(16, 1024, 768, 50257), (5, 1024, 768, 40), (3, 1000, 100, 5000),
                                         (1, 2049, 96, 3), (2, 5, 66, 97)])
def test_backward7_against_6(rt, rng, dtype, B, T, C, vocab):
    """Variant 7 at N > 2048 (8, 3, 2 and 2 chunks, partial last chunks) on Zipf-like ids: within the
    fp32/bf16 tolerance of the float64 sums; bit-identical to 6 (np.add.at's order) on every row of a
    token with at most 32 rows and on dwpe; the tickets are back to 0 after the call; a second call
    on the same inputs gives the same bits. Variant 8 (7's records from the host): 7's bits, its
    records the ones 7's rank kernel wrote, its tickets back to 0 too. Variant 9 (8's records, a warp
    per place and slice of the row) and 10 (9 with the single tokens' rows in the dwpe warps, where C
    allows it): 7's bits, on two calls, and their tickets back to 0."""
    inp, dout, dwte0, dwpe0, conv, back = _zipf_case(rng, B, T, C, vocab, dtype)
    d_dout, d_inp = rt.to_device(conv(dout)), rt.to_device(inp)
    res, built = {}, {}
    for number, runs in ((6, 1), (7, 2), (8, 2), (9, 2), (10, 2)):
        if number == 10 and BWD.refuse_reason(10, dtype, B=B, T=T, C=C):
            continue  # (C % 16 bytes)
        built[number] = _build_bwd(rt, number, dtype, inp=inp, B=B, T=T, C=C)
        for r in range(runs):
            dwte, dwpe = rt.to_device(conv(dwte0)), rt.to_device(conv(dwpe0))
            built[number](dwte, dwpe, d_dout, d_inp)
            res[number, r] = dwte.get(), dwpe.get()
    np.testing.assert_array_equal(built[7].scratch["tickets"].get(), 0)
    np.testing.assert_array_equal(built[8].scratch["tickets"].get(), 0)
    np.testing.assert_array_equal(built[9].scratch["tickets"].get(), 0)
    np.testing.assert_array_equal(built[8].scratch["place_rec"].get(), built[7].scratch["place_rec"].get())
    for k in (0, 1):
        np.testing.assert_array_equal(res[7, 0][k], res[7, 1][k])
        np.testing.assert_array_equal(res[8, 0][k], res[7, 0][k])
        np.testing.assert_array_equal(res[8, 1][k], res[7, 0][k])
        np.testing.assert_array_equal(res[9, 0][k], res[7, 0][k])
        np.testing.assert_array_equal(res[9, 1][k], res[7, 0][k])
        if 10 in built:
            np.testing.assert_array_equal(res[10, 0][k], res[7, 0][k])
            np.testing.assert_array_equal(res[10, 1][k], res[7, 0][k])
    if 10 in built:
        np.testing.assert_array_equal(built[10].scratch["tickets"].get(), 0)
    want_wte, want_wpe = encoder_backward_ref(back(conv(dwte0)).astype(np.float64), back(conv(dwpe0)).astype(np.float64),
                                              back(conv(dout)).astype(np.float64), inp)
    for name, got, want in (("dwte", res[7, 0][0], want_wte), ("dwpe", res[7, 0][1], want_wpe)):
        rms = float(np.sqrt(np.mean(np.square(want))))
        assert_close(back(got).astype(np.float64), want, 1e-5 * rms if dtype == "bf16" else 1e-4,
                     BF16_RTOL if dtype == "bf16" else 1e-5, name)
    counts = np.bincount(inp.ravel(), minlength=vocab)
    few = counts <= 32
    np.testing.assert_array_equal(res[7, 0][0][few], res[6, 0][0][few])
    np.testing.assert_array_equal(res[7, 0][1], res[6, 0][1])
    if B * T > 2048 and vocab <= 5000:
        assert (counts > 32).any()  # the multi-piece path ran


@pytest.mark.gpu
@pytest.mark.parametrize("defines", [{"ENC9_MIN": 0}, {"ENC9_MIN": 16}, {"ENC9_LANE": 4, "ENC9_PARTS": 3},
                                     {"ENC9_MIN": 32, "ENC9_ROWS": 3, "ENC9_STAGE": 0}, {"ENC9_STAGE": 3},
                                     {"ENC9_MIN": 4, "ENC9_STAGE": 2}, {"ENC9_ACQREL": 0},
                                     {"ENC9_ACQREL": 0, "ENC9_STAGE": 0}])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("B,T,C,vocab", [(16, 1024, 768, 50257), (3, 1000, 100, 300), (2, 40, 66, 3)])
def test_backward9_slices_any_token_size_with_8s_bits(rt, rng, dtype, B, T, C, vocab, defines):
    """Variant 9 built with the lab's knobs (--define encoder:ENC9_MIN=m: the tokens of more than m rows,
    single pieces too, summed by its sliced warps, the others by 8's; ENC9_LANE 4: 8-byte bf16 loads in
    twice as many slices, through registers; ENC9_STAGE 0: the register loads for 16-byte lanes too;
    odd batches of rows and partials, staged or not; ENC9_ACQREL=0, the tickets fenced on every lane, the
    form before session 54, where one acq_rel atomic a warp takes them): the same bits as 8 (np.add.at's order for the
    single pieces, the same pieces and combine for the rest), the tickets back to 0. Variant 10 with the
    same knobs (9's warps, the tokens of one row summed by its dwpe warps): 8's bits too."""
    m = defines.get("ENC9_MIN", 8)
    inp, dout, dwte0, dwpe0, conv, back = _zipf_case(rng, B, T, C, vocab, dtype)
    d_dout, d_inp = rt.to_device(conv(dout)), rt.to_device(inp)
    res = {}
    for number in (8, 9, 10):
        if number == 10 and BWD.refuse_reason(10, dtype, B=B, T=T, C=C):
            continue  # (C % 16 bytes)
        with module_defines(rt, "encoder", defines if number >= 9 else {}):
            built = _build_bwd(rt, number, dtype, inp=inp, B=B, T=T, C=C)
        dwte, dwpe = rt.to_device(conv(dwte0)), rt.to_device(conv(dwpe0))
        built(dwte, dwpe, d_dout, d_inp)
        res[number] = dwte.get(), dwpe.get()
        np.testing.assert_array_equal(built.scratch["tickets"].get(), 0)
    counts = np.bincount(inp.ravel())
    assert (counts > m).any() and ((counts > 0) & (counts <= 32)).any()  # both kinds of warps had tokens
    for k in (0, 1):
        np.testing.assert_array_equal(res[9][k], res[8][k])
        if 10 in res:
            np.testing.assert_array_equal(res[10][k], res[8][k])


@pytest.mark.gpu
@pytest.mark.parametrize("defines", [{}, {"ENC10_WHOLE_MAX": 1}, {"ENC10_WHOLE_MAX": 8}, {"ENC10_WHOLE_MAX": 32},
                                     {"ENC10_WHOLE": 0}, {"ENC10_WHOLE_CW": 1}])
@pytest.mark.parametrize("B,T,C,vocab,zipf", [(16, 1024, 768, 50257, False), (16, 1024, 768, 50257, True),
                                              (4, 256, 520, 2000, False), (2, 64, 264, 50, False),
                                              (1, 1, 768, 10, False), (3, 700, 768, 300, True)])
def test_variant10_whole_rows_keep_8s_bits(rt, rng, B, T, C, vocab, zipf, defines):
    """Variant 10 in bf16 with its one-piece tokens of at most ENC10_WHOLE_MAX rows summed a whole row a
    warp (ENC10_WHOLE, session 51; by default in batches without a token of more than 32 rows, with the
    lab's knob in any): 8's bits on dwte and dwpe whatever the host's boundary (none of them
    whole; up to 8 and every one whole, so more rows than one round of the warp's slots holds: the
    column-at-a-time path), with it off, and where the row is too wide for it (ENC10_WHOLE_CW 1); odd
    widths (C = 520: 65 16-byte columns, a partial third column a lane; 264: 33), T = 1, uniform and Zipf
    ids; the tickets back to 0, dwte's untouched rows untouched."""
    case = (_zipf_case if zipf else _uniform_case)(rng, B, T, C, vocab, "bf16")
    inp, dwte0, conv = case[0], case[2], case[4]
    res = _bwd_runs(rt, case, "bf16", lambda n: defines if n == 10 else {}, (8, 10), 2, B, T, C)
    counts = np.bincount(inp.ravel(), minlength=vocab)
    if B * T >= 1000:
        assert ((counts >= 2) & (counts <= ENC10_WHOLE_MAX)).any()  # the whole-row path had tokens
        # (Zipf ids: tokens of more than 32 rows, so only an explicit ENC10_WHOLE_MAX sums some whole)
    for k in (0, 1):
        np.testing.assert_array_equal(res[10, 0][k], res[8, 0][k])
        np.testing.assert_array_equal(res[10, 1][k], res[8, 0][k])
    np.testing.assert_array_equal(res[10, 0][0][counts == 0], conv(dwte0)[counts == 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("defines", [{}, {"ENC10_WHOLE_MAX": 4}])
@pytest.mark.parametrize("B,T,C,vocab,zipf", [(16, 1024, 768, 50257, False), (16, 1024, 768, 50257, True),
                                              (3, 700, 264, 300, True)])
def test_variant10_no_dwpe_measurement_build(rt, rng, B, T, C, vocab, zipf, defines, dtype):
    """Variant 10 built with ENC10_NO_DWPE=1 (the lab's measurement of 10 without its dwpe sums, session 52):
    dwte with 8's bits (its dwpe units still add the rows of the tokens seen once), dwpe untouched; with
    the whole-row path forced on too; uniform and Zipf ids."""
    case = (_zipf_case if zipf else _uniform_case)(rng, B, T, C, vocab, dtype)
    inp, dwpe0, conv = case[0], case[3], case[4]
    res = _bwd_runs(rt, case, dtype, lambda n: {"ENC10_NO_DWPE": 1, **defines} if n == 10 else {}, (8, 10), 1,
                    B, T, C)
    assert (np.bincount(inp.ravel(), minlength=vocab) == 1).any()  # rows the dwpe units add onto dwte
    np.testing.assert_array_equal(res[10, 0][0], res[8, 0][0])
    np.testing.assert_array_equal(res[10, 0][1], conv(dwpe0))


@pytest.mark.gpu
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("B,T,C,vocab", [(16, 1024, 768, 50257), (4, 1024, 768, 50), (3, 700, 264, 300)])
def test_tree_combine_is_deterministic_and_close(rt, rng, B, T, C, vocab, G):
    """9 and 10 built with ENC_TREE_G=G (bf16): a token of more than G pieces (Zipf ids: the top one has
    hundreds of rows) adds its partials in groups of G, then the groups' sums: within bf16's rounding of the
    float64 sums, the same bits on two calls and from 9 and 10 (the same pieces and order), 8's bits on
    every other token's row and on dwpe, the tickets back to 0."""
    case = _zipf_case(rng, B, T, C, vocab, "bf16")
    inp, dout, dwte0, dwpe0, conv, back = case
    res = _bwd_runs(rt, case, "bf16", lambda n: {"ENC_TREE_G": G} if n >= 9 else {}, (8, 9, 10), 2, B, T, C)
    counts = np.bincount(inp.ravel(), minlength=vocab)
    tree = counts > 32 * G
    assert tree.any()
    for k in (0, 1):
        np.testing.assert_array_equal(res[9, 1][k], res[9, 0][k])
        np.testing.assert_array_equal(res[10, 0][k], res[9, 0][k])
        np.testing.assert_array_equal(res[10, 1][k], res[9, 0][k])
    np.testing.assert_array_equal(res[9, 0][0][~tree], res[8, 0][0][~tree])
    np.testing.assert_array_equal(res[9, 0][1], res[8, 0][1])
    want_wte, _ = encoder_backward_ref(back(conv(dwte0)).astype(np.float64), back(conv(dwpe0)).astype(np.float64),
                                       back(conv(dout)).astype(np.float64), inp)
    rms = float(np.sqrt(np.mean(np.square(want_wte))))
    assert_close(back(res[9, 0][0]).astype(np.float64), want_wte, 1e-5 * rms, BF16_RTOL, "dwte")
    # the order, bit for bit: pieces of 32 rows in place order summed from 0 in fp32, each group's partials
    # from 0, then dwte's row + the groups' sums in group order, rounded once
    rows32, old32 = back(conv(dout)).reshape(-1, C).astype(np.float32), back(conv(dwte0)).astype(np.float32)
    ids = inp.ravel()
    for tok in np.flatnonzero(tree):
        places = np.flatnonzero(ids == tok)  # (positions ascending: the token-major order's)
        parts = []
        for q0 in range(0, len(places), 32):
            a = np.zeros(C, np.float32)
            for p in places[q0:q0 + 32]:
                a = a + rows32[p]
            parts.append(a)
        acc = old32[tok].copy()
        for k0 in range(0, len(parts), G):
            g = np.zeros(C, np.float32)
            for a in parts[k0:k0 + G]:
                g = g + a
            acc = acc + g
        np.testing.assert_array_equal(res[9, 0][0][tok], conv(acc[None])[0])


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C,vocab", [(16, 1024, 768, 50257), (4, 1024, 768, 50), (3, 700, 264, 300)])
def test_tree_combine_with_acqrel_tickets_keeps_its_bits(rt, rng, B, T, C, vocab):
    """9 and 10 with the two-level combine (ENC_TREE_G=4) and their tickets taken by one acq_rel atomic a warp
    (ENC9_ACQREL, session 53; the default since session 54): the same bits as with the fences (ENC9_ACQREL=0),
    on two calls, the tickets back to 0."""
    case = _zipf_case(rng, B, T, C, vocab, "bf16")
    fenced = _bwd_runs(rt, case, "bf16", lambda n: {"ENC_TREE_G": 4, "ENC9_ACQREL": 0}, (9,), 1, B, T, C)
    res = _bwd_runs(rt, case, "bf16", lambda n: {"ENC_TREE_G": 4}, (9, 10), 2, B, T, C)
    assert (np.bincount(case[0].ravel()) > 32 * 4).any()
    for key in ((9, 0), (9, 1), (10, 0), (10, 1)):
        for k in (0, 1):
            np.testing.assert_array_equal(res[key][k], fenced[9, 0][k])


@pytest.mark.gpu
@pytest.mark.parametrize("defines", [{"ENC10_DWPE_MID": 0}, {"ENC10_DWPE_MID": 0, "ENC10_WHOLE_MAX": 4},
                                     {"ENC10_DWPE_MID": 0, "ENC_TREE_G": 4, "ENC10_WHOLE_MAX": 4}])
@pytest.mark.parametrize("B,T,C,vocab,zipf", [(16, 1024, 768, 50257, False), (16, 1024, 768, 50257, True),
                                              (4, 256, 520, 2000, False), (2, 64, 264, 50, False),
                                              (1, 1, 768, 10, False), (32, 1024, 768, 50, True)])
def test_variant10_dwpe_mid_keeps_8s_bits(rt, rng, B, T, C, vocab, zipf, defines):
    """Variant 10 (bf16) with the whole rows before the position units in its work list (ENC10_DWPE_MID=0,
    the order before session 53), alone, with every one-piece token of up to 4 rows whole, and with the
    two-level combine: 8's bits on dwte and dwpe over two calls (the tree's tokens: equal to the default
    order's), the
    tickets back to 0; batches with fewer units than warps (T = 1, B T = 128), and one whose multi-piece
    units are more than half the warps (B = 32 over 50 tokens: every warp strides over every unit)."""
    case = (_zipf_case if zipf else _uniform_case)(rng, B, T, C, vocab, "bf16")
    base = {k: v for k, v in defines.items() if k != "ENC10_DWPE_MID"}
    res = _bwd_runs(rt, case, "bf16", lambda n: defines if n == 10 else base, (8, 10), 2, B, T, C)
    ref = _bwd_runs(rt, case, "bf16", lambda n: base, (10,), 1, B, T, C) if "ENC_TREE_G" in base else res
    for k in (0, 1):
        np.testing.assert_array_equal(res[10, 0][k], ref[10, 0][k] if "ENC_TREE_G" in base else res[8, 0][k])
        np.testing.assert_array_equal(res[10, 1][k], res[10, 0][k])


@pytest.mark.gpu
@pytest.mark.parametrize("defines", [{}, {"ENC10_DWPE_MID": 0}])
def test_variant10_trace_build_writes_every_unit(rt, rng, defines):
    """Variant 10 built with ENC10_TRACE=1 (dev/cuda/encoder_backward_trace.py's measurement build): 8's bits,
    and a trace row for every unit of the launch, none past them: an end at or after its start, a warp of
    the grid, an SM of the GPU."""
    B, T, C, vocab = 4, 1024, 768, 50257
    case = _zipf_case(rng, B, T, C, vocab, "bf16")
    inp = case[0]
    with module_defines(rt, "encoder", {"ENC10_TRACE": 1, **defines}):
        mod = rt.module("encoder")
        ptr, size = mod.get_global("enc10_trace")
        rt.drv.memset_d8(ptr, 0, size)
        res = _bwd_runs(rt, case, "bf16", lambda n: {"ENC10_TRACE": 1, **defines} if n == 10 else {}, (8, 10), 1,
                        B, T, C)
    for k in (0, 1):
        np.testing.assert_array_equal(res[10, 0][k], res[8, 0][k])
    tr = np.empty(size // 8, np.uint64)
    rt.drv.memcpy_dtoh(tr, ptr)
    tr = tr.reshape(-1, 6)
    total = len(encoder_backward10_unit_kinds(encoder_backward10_records(inp), B, T, C))
    done = tr[:, 1] > 0
    assert done[:total].all() and not done[total:].any()
    t = tr[:total].astype(np.int64)
    assert (t[:, 1] >= t[:, 0]).all() and (t[:, 3] >= t[:, 2]).all()
    assert (t[:, 4] < rt.sm_count).all() and len(np.unique(t[:, 5])) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("number", DETERMINISTIC)
def test_backward_deterministic_bit_identical(rt, rng, number):
    # many repeats (8 tokens over 4096 positions): atomics would add them in a varying order
    B, T, C = 4, 1024, 768
    inp, _, _, dout = inputs(rng, B, T, C, VP, T, vocab=8, dtype=np.float32)
    dwte0 = rng.standard_normal((VP, C)).astype(np.float32)
    dwpe0 = rng.standard_normal((T, C)).astype(np.float32)
    d_dout, d_inp = rt.to_device(dout), rt.to_device(inp)
    launch = _build_bwd(rt, number, inp=inp, B=B, T=T, C=C)
    runs = []
    for _ in range(2):
        dwte, dwpe = rt.to_device(dwte0), rt.to_device(dwpe0)
        launch(dwte, dwpe, d_dout, d_inp)
        runs.append((dwte.get().view(np.uint32), dwpe.get().view(np.uint32)))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


# ----------------------------------------------------------------------------------------------
# GPU, bf16 builds. Inputs are bf16 values; the references are float64 on them.
# forward/decode: one fp32 add of two bf16 values, rounded once to nearest even; numpy does the same
# operations (a float32 add, to_bf16), so the bits must match. backward: every dwte/dwpe element is
# (initial + the fp32 sum of its dout terms), rounded once: within half a bf16 ulp of the float64
# sum, plus the fp32 sum's own error (k terms of size ~1 at 2^-24 each: far under 1e-5 of the rms).
# So rtol 2^-8 (twice the one rounding) and atol 1e-5 * rms.

BF16_RTOL = 2.0 ** -8
SHAPES_BF16 = SHAPES + [(2, 9, 100)]  # C % 8 == 4: variant 3's bf16 kernel takes its scalar path


def _bf16_variants(spec):
    return [n for n, v in sorted(spec.variants.items()) if "bf16" in v.dtypes]


def _bf16_inputs(rng, B, T, C, Vp, maxT, vocab=None):
    inp, wte, wpe, dout = inputs(rng, B, T, C, Vp, maxT, vocab=vocab, dtype=np.float32)
    return inp, to_bf16(wte), to_bf16(wpe), to_bf16(dout)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C", SHAPES_BF16)
@pytest.mark.parametrize("number", _bf16_variants(FWD))
def test_forward_gpu_bf16_bit_exact(rt, rng, number, B, T, C):
    if _refused(FWD, number, B, T, C, "bf16"):
        return
    inp, wte, wpe, _ = _bf16_inputs(rng, B, T, C, VP, T + 3)
    launch = FWD.build(rt, number, "bf16", B=B, T=T, C=C)
    out = rt.empty((B, T, C), BF16)
    poison(out)
    launch(out, rt.to_device(inp), rt.to_device(wte), rt.to_device(wpe))
    want = to_bf16(encoder_forward_ref(inp, from_bf16(wte), from_bf16(wpe)))  # float32 add, RNE
    np.testing.assert_array_equal(out.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("B,C", [(1, 80), (3, 100), (5, 768)])
def test_decode_gpu(rt, rng, dtype, B, C):
    """B tokens at the position stored after them; both read from the device."""
    maxT = 37
    tokens = np.append(rng.integers(0, VP, B), 29).astype(np.int32)  # the position last
    wte, wpe = rng.standard_normal((VP, C)).astype(np.float32), rng.standard_normal((maxT, C)).astype(np.float32)
    if dtype == "bf16":
        wte, wpe = to_bf16(wte), to_bf16(wpe)
    launch = DEC.build(rt, DEC.default, dtype, B=B, C=C)
    out = rt.empty((B, C), BF16 if dtype == "bf16" else np.float32)
    poison(out)
    launch(out, rt.to_device(tokens), rt.to_device(wte), rt.to_device(wpe))
    if dtype == "bf16":
        want = to_bf16(encoder_decode_ref(tokens, from_bf16(wte), from_bf16(wpe)))
    else:
        want = encoder_decode_ref(tokens, wte, wpe)
    np.testing.assert_array_equal(out.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,C", SHAPES_BF16)
@pytest.mark.parametrize("number", _bf16_variants(BWD))
def test_backward_gpu_bf16_accumulates(rt, rng, number, B, T, C):
    if _refused(BWD, number, B, T, C, "bf16"):
        return
    maxT = T + 3
    inp, _, _, dout = _bf16_inputs(rng, B, T, C, VP, maxT)
    dwte0 = to_bf16(rng.standard_normal((VP, C)))  # "+=" outputs pre-filled
    dwpe0 = to_bf16(rng.standard_normal((maxT, C)))
    launch = _build_bwd(rt, number, "bf16", inp=inp, B=B, T=T, C=C)
    dwte, dwpe = rt.to_device(dwte0), rt.to_device(dwpe0)
    launch(dwte, dwpe, rt.to_device(dout), rt.to_device(inp))
    want_wte, want_wpe = encoder_backward_ref(from_bf16(dwte0).astype(np.float64), from_bf16(dwpe0).astype(np.float64),
                                              from_bf16(dout).astype(np.float64), inp)
    got_wte, got_wpe = dwte.get(), dwpe.get()
    for name, got, want in (("dwte", got_wte, want_wte), ("dwpe", got_wpe, want_wpe)):
        rms = float(np.sqrt(np.mean(np.square(want))))
        assert_close(from_bf16(got), want, 1e-5 * rms, BF16_RTOL, name)
    unused = np.setdiff1d(np.arange(VP), inp)
    np.testing.assert_array_equal(got_wte[unused], dwte0[unused])  # rows not used: untouched bits
    np.testing.assert_array_equal(got_wpe[T:], dwpe0[T:])


@pytest.mark.gpu
@pytest.mark.parametrize("number", [3, 7, 8, 9, 10])
def test_backward_bf16_rounds_each_row_once(rt, number):
    """One token at every position, dout = 2^-9 everywhere: adding it to dwte = 1.0 with a rounding
    after each add would leave 1.0 every time (a quarter of bf16's ulp at 1.0 rounds away); the fp32
    accumulator adds all B*T of them first and rounds once: 1 + B*T * 2^-9 = 1.25 (7: in four pieces
    of 32 rows, each partial exact in fp32)."""
    B, T, C = 2, 64, 768
    inp = np.full((B, T), 3, np.int32)
    dout = to_bf16(np.full((B, T, C), 2.0 ** -9, np.float32))
    dwte0 = to_bf16(np.ones((VP, C), np.float32))
    dwte, dwpe = rt.to_device(dwte0), rt.zeros((T, C), BF16)
    _build_bwd(rt, number, "bf16", inp=inp, B=B, T=T, C=C)(dwte, dwpe, rt.to_device(dout), rt.to_device(inp))
    np.testing.assert_array_equal(from_bf16(dwte.get()[3]), np.full(C, 1.0 + B * T * 2.0 ** -9, np.float32))
    np.testing.assert_array_equal(from_bf16(dwpe.get()), np.full((T, C), B * 2.0 ** -9, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("number", _bf16_variants(BWD))
def test_backward_bf16_deterministic_bit_identical(rt, rng, number):
    B, T, C = 4, 1024, 768
    inp, _, _, dout = _bf16_inputs(rng, B, T, C, VP, T, vocab=8)
    dwte0, dwpe0 = to_bf16(rng.standard_normal((VP, C))), to_bf16(rng.standard_normal((T, C)))
    d_dout, d_inp = rt.to_device(dout), rt.to_device(inp)
    launch = _build_bwd(rt, number, "bf16", inp=inp, B=B, T=T, C=C)
    runs = []
    for _ in range(2):
        dwte, dwpe = rt.to_device(dwte0), rt.to_device(dwpe0)
        launch(dwte, dwpe, d_dout, d_inp)
        runs.append((dwte.get(), dwpe.get()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])


_TRAP_SCRIPT = """
import sys
import numpy as np
from llmc import ops
from llmc.bf16 import BF16
from llmc.ops import encoder
from llmc.runtime import Runtime
dtype, number, case = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rt = Runtime()
C, V = 768, 50304
if case.startswith("heads"):  # token 5's 40 rows (pieces at places 0 and 32), token 7's 20 (at 40): two heads in window 1
    ids = np.array([5] * 40 + [7] * 20 + [9] * 4, np.int32).reshape(1, 64)
    if case == "heads-short":  # a launch that looks for fewer heads a window than ENC9_MIN allows
        encoder.heads_per_window9 = lambda rt: 1
else:
    ids = np.random.default_rng(0).integers(0, 50257, (2, 64)).astype(np.int32)
B, T = ids.shape
built = ops.get("encoder_backward").build(rt, number, dtype, B=B, T=T, C=C)
built.put_host_inputs((ids + 1) % 50257 if case == "other" else ids)   # the records of this batch or another
dt = BF16 if dtype == "bf16" else np.float32
dwte, dwpe, dout = rt.zeros((V, C), dt), rt.zeros((T, C), dt), rt.zeros((B, T, C), dt)
built(dwte, dwpe, dout, rt.to_device(ids))
rt.synchronize()
print("launch finished")
"""


def _finishes_and_traps(dtype, number, control, trapped):
    """_TRAP_SCRIPT's `control` case finishes its launch and its `trapped` case stops with an error. In
    subprocesses: a trap leaves the CUDA context unusable."""
    import subprocess
    import sys
    from conftest import ROOT
    runs = {case: subprocess.run([sys.executable, "-c", _TRAP_SCRIPT, dtype, str(number), case], cwd=ROOT,
                                 capture_output=True, text=True, timeout=300) for case in (control, trapped)}
    assert runs[control].returncode == 0 and "launch finished" in runs[control].stdout, runs[control].stderr[-2000:]
    assert runs[trapped].returncode != 0 and "launch finished" not in runs[trapped].stdout, runs[trapped].stdout


@pytest.mark.gpu
@pytest.mark.parametrize("number", [8, 9, 10])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_variant8_traps_on_records_of_another_batch(rt, dtype, number):
    """Variants 8 and 9 check each row's id against its record's token before the warp's first store (the id's
    load issued with the record's, so the check adds no round trip): records uploaded for another batch
    must stop the launch with an error, not sum the wrong rows. The same script with the batch's own
    records finishes (the control)."""
    _finishes_and_traps(dtype, number, "same", "other")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_variant9_traps_on_a_window_with_more_heads_than_its_launch(rt, dtype):
    """Variant 9's sliced warps look for H pieces of frequent tokens among each 32 places; a window with
    more (a launch built with too small an H for its ENC9_MIN) must stop with an error, never skip a
    piece's rows. Token 5's 40 rows (pieces at places 0 and 32) then token 7's 20 (at 40): two heads in
    the second window, against H = 1. The same batch with the build's own H finishes (the control)."""
    _finishes_and_traps(dtype, 9, "heads-own", "heads-short")
