"""KV-cache decoding on the GPU (pytest -m gpu): greedy with the cache gives the same tokens as
greedy by full recomputation, the decoder's logits match the full forward's, batch 8 included."""
import numpy as np
import pytest

from llmc import ops
from llmc.backend import CpuBackend, CudaBackend
from llmc.config import GPT2Config, config_from_name
from llmc.decode import Decoder, generate
from llmc.model import GPT2
from llmc.sample import generate_full, sample_token

pytestmark = pytest.mark.gpu

SMALL = GPT2Config(max_seq_len=128, vocab_size=97, padded_vocab_size=128, num_layers=2, num_heads=4, channels=64)


def params_for(cfg, seed=0, scale=5.0):
    m = GPT2(cfg, CpuBackend(np.float32), 1, 1, training=False)
    return m.init_params(seed) * np.float32(scale)  # larger weights: greedy output is not one token


@pytest.mark.parametrize("cfg_name", ["small", "d12"])
def test_greedy_cache_equals_full_recompute_gpu(cfg_name):
    cfg = SMALL if cfg_name == "small" else config_from_name("d12")
    params = params_for(cfg, scale=5.0 if cfg_name == "small" else 1.0)
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    n = 24
    full = GPT2(cfg, CudaBackend(), 1, len(prompt) + n, training=False)
    full.load_params(params)
    want = generate_full(full, prompt, n, temperature=0)[len(prompt):]
    dec = Decoder(cfg, CudaBackend(), 1, params=params)
    got = generate(dec, prompt, n, temperature=0)[0]
    assert got == want


def test_decoder_logits_match_forward_batch8_gpu():
    cfg = SMALL
    params = params_for(cfg)
    B, T = 8, 40
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    full = GPT2(cfg, CudaBackend(), B, T, training=False)
    full.load_params(params)
    full.forward(x)
    dec = Decoder(cfg, CudaBackend(), B, params=params)
    for t in range(T):
        logits = dec.step(x[:, t], t)
        for b in (0, B - 1):
            ref = full.logits_row(b, t)
            err = np.abs(logits[b] - ref).max() / np.abs(ref).max()
            assert err < 1e-2, (t, b, err)


def test_decoder_matches_cpu_decoder_gpu():
    params = params_for(SMALL)
    outs = []
    for be in (CudaBackend(), CpuBackend(np.float32)):
        dec = Decoder(SMALL, be, 2, params=params)
        outs.append(generate(dec, [1, 2, 3], 16, temperature=0))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("pdl", [None, "0"])
def test_graph_replay_equals_eager_gpu(monkeypatch, pdl):
    """The decode step captured into a CUDA graph gives bit-identical logits to launching kernel by
    kernel (LLMC_GRAPHS=0), step after step: position and tokens are read from the device. The graph
    holds programmatic launches by default on Hopper (runtime.PDL_ENV), plain ones with LLMC_PDL=0."""
    from llmc.runtime import Graph
    if pdl is None:
        monkeypatch.delenv("LLMC_PDL", raising=False)
    else:
        monkeypatch.setenv("LLMC_PDL", pdl)
    params = params_for(SMALL)
    rng = np.random.default_rng(5)
    toks = rng.integers(0, SMALL.vocab_size, (3, 20)).astype(np.int32)
    runs = []
    for graphs in ("1", "0"):
        monkeypatch.setenv("LLMC_GRAPHS", graphs)
        dec = Decoder(SMALL, CudaBackend(), 3, params=params)
        runs.append([dec.step(toks[:, t], t).copy() for t in range(toks.shape[1])])
        assert isinstance(dec._run, Graph) == (graphs == "1")
    for t, (a, b) in enumerate(zip(*runs)):
        assert np.array_equal(a, b), f"step {t}: graph replay differs from eager launches"


def test_device_sampling_in_the_decoder_gpu():
    """step_sample (sampling on the GPU) picks what host sampling of step()'s logits picks, from the
    same draws; seeded generation on the GPU repeats itself."""
    params = params_for(SMALL)
    B = 4
    rng = np.random.default_rng(11)
    toks = rng.integers(0, SMALL.vocab_size, (B, 12)).astype(np.int32)
    dec_a = Decoder(SMALL, CudaBackend(), B, params=params)
    dec_b = Decoder(SMALL, CudaBackend(), B, params=params)
    ra, rb = np.random.default_rng(3), np.random.default_rng(3)
    for t in range(toks.shape[1]):
        got = dec_a.step_sample(toks[:, t], t, 0.9, 20, ra)
        logits = dec_b.step(toks[:, t], t)
        want = [sample_token(logits[b], 0.9, 20, rb) for b in range(B)]
        assert got == want, (t, got, want)
    runs = [generate(Decoder(SMALL, CudaBackend(), 3, params=params), [5, 6, 7], 30, 1.0, 10,
                     np.random.default_rng(9)) for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("op,num", [(name, num) for name in ("encoder_decode", "attention_decode", "attention_kv_fill", "sample")
                                    for num in sorted(ops.get(name).variants)])
def test_every_decode_variant_matches_the_cpu_decoder_gpu(op, num):
    """The decoder's own ops (registered like every op): each variant named on the command line
    gives the numpy decoder's greedy tokens (a 5-token prompt goes through the kv fill)."""
    params = params_for(SMALL)
    outs = []
    for be in (CudaBackend(kernels={op: num}), CpuBackend(np.float32)):
        dec = Decoder(SMALL, be, 2, params=params)
        outs.append(generate(dec, [1, 2, 3, 4, 5], 16, temperature=0))
    assert outs[0] == outs[1], (op, num)
