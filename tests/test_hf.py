"""Hugging Face interop: dev/eval/export_hf.py writes what transformers loads with the same logits
(fp32 and bf16, exported without torch), and -e DIR reads a transformers-made GPT-2 into the
trainer and the sampler.

    python -m pytest tests/test_hf.py -q        # needs transformers + safetensors (requirements-test.txt)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc.errors import LLMCError
from llmc_fixtures import bf16_bytes_torch, write_llmc_model, write_llmc_shard
from torch_gpt2 import TorchGPT2

transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
L, NH, C, V, VP, MAXT = 2, 2, 64, 50257, 50304, 64


def shapes():
    return [(VP, C), (MAXT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C),
            (L, C), (L, C), (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]


def random_params(seed):
    rng = np.random.default_rng(seed)
    parts = [rng.normal(0, 0.3, s).astype(np.float32) for s in shapes()]
    parts[0][V:] = 0.0   # the padding rows
    return np.concatenate([p.reshape(-1) for p in parts])


def export(src, out, *extra):
    """Run the export script with torch and transformers made unimportable: it must not need them."""
    code = ("import sys, runpy; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            f"sys.argv = ['export_hf.py', '-i', {str(src)!r}, '-o', {str(out)!r}, *{list(extra)!r}]; "
            "runpy.run_path('dev/eval/export_hf.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p


def hf_logits(d, x, **kw):
    model = transformers.GPT2LMHeadModel.from_pretrained(str(d), **kw).eval()
    with torch.no_grad():
        return model(torch.tensor(x)).logits.float().numpy()


def ref_logits(params, x):
    ref = TorchGPT2(params.astype(np.float64), MAXT, V, VP, L, NH, C)
    with torch.no_grad():
        return ref.forward(x)[0].numpy()


X = np.random.default_rng(1).integers(0, V, (2, 24))


def test_export_fp32_same_logits(tmp_path):
    params = random_params(0)
    write_llmc_model(tmp_path / "m.bin", MAXT, V, L, NH, C, VP, params, version=3)
    out = tmp_path / "hf"
    assert "(float32)" in export(tmp_path / "m.bin", out).stdout
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]) == (L, NH, C, V, MAXT)
    # the safetensors library reads our file: unpadded vocab, Conv1D layout, no lm_head (tied)
    t = safetensors_numpy.load_file(str(out / "model.safetensors"))
    assert t["transformer.wte.weight"].shape == (V, C) and "lm_head.weight" not in t
    assert np.array_equal(t["transformer.h.1.attn.c_attn.weight"],
                          params[sum(int(np.prod(s)) for s in shapes()[:4]):][:L * 3 * C * C].reshape(L, 3 * C, C)[1].T)
    got = hf_logits(out, X)
    np.testing.assert_allclose(got, ref_logits(params, X), atol=2e-4, rtol=1e-4)
    model = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()   # tied
    if (out / "vocab.json").exists():   # the tokenizer files, when a local copy was there
        tok = transformers.GPT2Tokenizer.from_pretrained(str(out))
        assert tok.encode("Hello world") == [15496, 995]


def test_export_bf16_same_logits(tmp_path):
    params = random_params(1)
    write_llmc_model(tmp_path / "m.bin", MAXT, V, L, NH, C, VP, params, version=3)
    export(tmp_path / "m.bin", tmp_path / "hf", "--dtype", "bfloat16")
    header_len = int(np.fromfile(tmp_path / "hf" / "model.safetensors", "<u8", count=1)[0])
    with open(tmp_path / "hf" / "model.safetensors", "rb") as f:
        f.seek(8)
        header = json.loads(f.read(header_len))
    assert {e["dtype"] for k, e in header.items() if k != "__metadata__"} == {"BF16"}
    rounded = np.frombuffer(bf16_bytes_torch(params), "<u2").astype(np.uint32) << 16   # torch's rounding
    rounded = rounded.view(np.float32)
    got = hf_logits(tmp_path / "hf", X, dtype=torch.float32)   # upcast on load: compare in fp32
    np.testing.assert_allclose(got, ref_logits(rounded, X), atol=2e-4, rtol=1e-4)
    # a bf16 llm.c checkpoint (v5) exports as bf16 by default, and reads back bit-exactly
    write_llmc_model(tmp_path / "m5.bin", MAXT, V, L, NH, C, VP, params, version=5)
    assert "(bfloat16)" in export(tmp_path / "m5.bin", tmp_path / "hf5").stdout
    from llmc.hf import read_hf
    _, back = read_hf(tmp_path / "hf5")
    assert np.array_equal(back, rounded)


@pytest.fixture(scope="module")
def hf_made(tmp_path_factory):
    """A random GPT-2 made and saved by transformers itself."""
    d = tmp_path_factory.mktemp("hfmade")
    torch.manual_seed(0)
    conf = transformers.GPT2Config(n_layer=L, n_head=NH, n_embd=C, vocab_size=V, n_positions=MAXT,
                                   initializer_range=0.2)
    model = transformers.GPT2LMHeadModel(conf).eval()
    model.save_pretrained(str(d / "hf"), safe_serialization=True)
    return d, model


def test_import_same_logits(hf_made):
    from llmc.backend import make_backend
    from llmc.hf import read_any_model
    from llmc.model import GPT2
    d, model = hf_made
    cfg, params = read_any_model(d / "hf")
    assert (cfg.num_layers, cfg.num_heads, cfg.channels, cfg.vocab_size, cfg.padded_vocab_size,
            cfg.max_seq_len) == (L, NH, C, V, VP, MAXT)
    ours = GPT2(cfg, make_backend("cpu"), 2, 24, training=False)
    ours.load_params(params)
    ours.forward(X.astype(np.int32))
    with torch.no_grad():
        want = model(torch.tensor(X)).logits.numpy()
    np.testing.assert_allclose(ours.logits(), want, atol=2e-4, rtol=1e-4)
    assert not params.reshape(-1)[:VP * C].reshape(VP, C)[V:].any()   # padding rows are zero


def test_import_original_names_and_buffers(hf_made, tmp_path):
    """The original gpt2 checkpoints: names without "transformer.", the mask buffers, a tied lm_head."""
    from llmc.hf import read_hf
    d, model = hf_made
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    legacy = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in sd.items()}
    for l in range(L):
        legacy[f"h.{l}.attn.bias"] = np.tril(np.ones((1, 1, MAXT, MAXT), np.float32))
    legacy["lm_head.weight"] = sd["transformer.wte.weight"]
    (tmp_path / "old").mkdir()
    safetensors_numpy.save_file(legacy, str(tmp_path / "old" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "old" / "config.json").write_text((d / "hf" / "config.json").read_text())
    _, a = read_hf(d / "hf")
    _, b = read_hf(tmp_path / "old")
    assert np.array_equal(a, b)
    legacy["lm_head.weight"] = legacy["lm_head.weight"] + 1
    safetensors_numpy.save_file(legacy, str(tmp_path / "old" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(LLMCError, match="untied"):
        read_hf(tmp_path / "old")


def test_trainer_and_sampler_take_a_directory(hf_made, tmp_path):
    d, model = hf_made
    rng = np.random.default_rng(2)
    write_llmc_shard(tmp_path / "train.bin", rng.integers(0, 1000, 300).tolist())
    write_llmc_shard(tmp_path / "val.bin", rng.integers(0, 1000, 100).tolist())
    p = subprocess.run([sys.executable, "train_gpt2.py", "--device", "cpu", "-e", str(d / "hf"), "-b", "2",
                        "-t", "16", "-x", "2", "-s", "0", "-v", "2", "-i", str(tmp_path / "train.bin"),
                        "-j", str(tmp_path / "val.bin"), "-o", str(tmp_path / "out")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert f"checkpoint {d / 'hf'}" in p.stdout and (tmp_path / "out" / "model_00000002.bin").exists()
    # greedy sampling from the directory gives transformers' greedy tokens
    prompt = [464, 2068, 7586]
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                              pad_token_id=50256)[0, 3:].tolist()
    from llmc.tokenizer import get_encoding
    enc = get_encoding()
    p = subprocess.run([sys.executable, "sample_gpt2.py", "-e", str(d / "hf"), "--device", "cpu",
                        "--prompt", enc.decode(prompt), "--max-new-tokens", "8", "--temperature", "0", "--quiet"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == enc.decode(prompt + want)


@pytest.mark.parametrize("case", ["no config", "pytorch only", "relu", "truncated", "missing tensor"])
def test_bad_directories_are_one_line(hf_made, tmp_path, case):
    from llmc.hf import read_any_model
    d, _ = hf_made
    bad = tmp_path / "bad"
    bad.mkdir()
    conf = json.loads((d / "hf" / "config.json").read_text())
    blob = (d / "hf" / "model.safetensors").read_bytes()
    if case != "no config":
        if case == "relu":
            conf["activation_function"] = "relu"
        (bad / "config.json").write_text(json.dumps(conf))
    if case == "pytorch only":
        (bad / "pytorch_model.bin").write_bytes(b"x")
    elif case == "truncated":
        (bad / "model.safetensors").write_bytes(blob[:-100])
    elif case == "missing tensor":
        t = safetensors_numpy.load_file(str(d / "hf" / "model.safetensors"))
        del t["transformer.h.1.mlp.c_fc.bias"]
        safetensors_numpy.save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    else:
        (bad / "model.safetensors").write_bytes(blob)
    needle = {"no config": "without config.json", "pytorch only": "safe_serialization=True",
              "relu": "activation_function 'relu'", "truncated": "truncated", "missing tensor": "h.1.mlp.c_fc.bias"}[case]
    with pytest.raises(LLMCError) as e:
        read_any_model(bad)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
