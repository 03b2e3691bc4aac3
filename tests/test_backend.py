"""Backend behaviour that needs no GPU: a variant the user named refuses a shape loudly at build,
a default that can't take a shape falls back with one line, too little GPU memory is one line,
unknown variants are errors on both backends, --device cuda without PyCUDA is one line."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmc import ops
from llmc.backend import CpuBackend, CudaBackend, kernel_choices
from llmc.config import config_from_name
from llmc.errors import LLMCError, VariantRefused
from llmc.model import GPT2
from tests.fake_runtime import FakeRuntime

ROOT = Path(__file__).resolve().parent.parent


def cuda_backend(kernels=None, free=80 << 30):
    """The real CudaBackend over the tests' fake runtime (no heap: builds run, nothing launches)."""
    return CudaBackend(kernels, rt=FakeRuntime(free=free))


def test_named_variant_refuses_at_build():
    be = cuda_backend({"softmax_forward": 5})
    with pytest.raises(VariantRefused, match="softmax_forward variant 5"):
        be.op("softmax_forward", BNH=4, T=65, scale=0.125)


def test_default_falls_back_with_one_note(capsys):
    be = cuda_backend()
    spec = ops.get("softmax_forward")
    assert spec.refuse_reason(spec.default, BNH=4, T=65, scale=0.125)  # the default can't take T=65
    be.op("softmax_forward", BNH=4, T=65, scale=0.125)
    be.op("softmax_forward", BNH=4, T=65, scale=0.125)
    out = capsys.readouterr().out
    assert out.count("note: softmax_forward") == 1


def test_too_little_gpu_memory_is_one_line():
    be = cuda_backend(free=1 << 30)
    with pytest.raises(LLMCError, match=r"need [\d,]+ bytes, [\d,]+ free"):
        GPT2(config_from_name("d12"), be, 4, 1024)


def test_unknown_variant_is_an_error_on_both_backends():
    with pytest.raises(LLMCError, match="--matmul-kernel 42"):
        CpuBackend(kernels={"matmul_forward": 42})
    with pytest.raises(LLMCError, match="--matmul-kernel 42"):
        kernel_choices({"matmul_forward": 42})


def test_every_op_has_a_flag_and_a_default():
    flags = set()
    for name, spec in ops.registry().items():
        if spec.variants:
            assert spec.default in spec.variants, name
            assert spec.flag.startswith("--") and spec.flag.endswith("-kernel"), name
            assert spec.flag not in flags, spec.flag
            flags.add(spec.flag)
            for num, v in spec.variants.items():
                assert v.description and "\n" not in v.description, (name, num)
    assert {"--softmax-kernel", "--matmul-kernel", "--softmax-backward-kernel", "--matmul-backward-kernel"} <= flags


@pytest.mark.skipif(__import__("importlib").util.find_spec("pycuda") is not None, reason="PyCUDA is installed here")
def test_device_cuda_without_pycuda_is_one_line():
    p = subprocess.run([sys.executable, str(ROOT / "train_gpt2.py"), "--device", "cuda"], cwd=ROOT,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 1
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "--device cpu" in lines[0] and "Traceback" not in p.stderr


def model_op_shapes(cfg, B, T):
    """(op name, shape) for every op the model builds at (cfg, B, T), and the decoder at batch B
    (the prompt's kv fill at T)."""
    from llmc.decode import Decoder
    be = cuda_backend()
    seen = []
    real = be.build
    be.build = lambda name, prefer=None, **shape: (seen.append((name, shape)), real(name, prefer, **shape))[1]
    GPT2(cfg, be, B, T)
    dec = Decoder(cfg, be, B, params_buf=be.empty((cfg.num_parameters,)))
    if T <= cfg.max_seq_len:
        be.op("attention_kv_fill", B=B, C=cfg.channels, NH=cfg.num_heads, maxT=cfg.max_seq_len, T=T)
    assert dec.k
    # the softmax ops run inside the composite attention, which builds them through the registry
    hs = cfg.channels // cfg.num_heads
    seen += [(n, dict(BNH=B * cfg.num_heads, T=T, scale=hs ** -0.5)) for n in ("softmax_forward", "softmax_backward")]
    return seen


@pytest.mark.parametrize("cfg_name,B,T", [("d12", 4, 1024), ("L2C64H2", 3, 65), ("L1C80H5", 1, 1)])
def test_every_variant_builds_or_refuses_cleanly(cfg_name, B, T):
    """Every build function runs (grid, block, shared memory, scratch) for every variant at the
    model's shapes, without a GPU: it builds when check() passes and raises VariantRefused when not."""
    shapes = model_op_shapes(config_from_name(cfg_name), B, T)
    assert {n for n, _ in shapes} == set(ops.registry())
    for name, shape in shapes:
        spec = ops.get(name)
        for num, v in spec.variants.items():
            rt = FakeRuntime()
            if spec.refuse_reason(num, **shape):
                with pytest.raises(VariantRefused):
                    spec.build(rt, num, **shape)
            else:
                launch = spec.build(rt, num, **shape)
                assert callable(launch) and rt.built, (name, num, shape)


def test_decoder_kernels_build_without_gpu():
    from llmc.decode import Decoder
    cfg = config_from_name("d12")
    be = cuda_backend()
    dec = Decoder(cfg, be, 4, params_buf=be.empty((cfg.num_parameters,)))
    assert callable(dec.k["attention"]) and "kv_append" not in dec.k
    assert callable(be.op("attention_kv_fill", B=8, C=768, NH=12, maxT=1024, T=64))
    assert {"attention_decode_kernel2", "attention_decode_combine_kernel2",
            "attention_kv_fill_kernel1", "encoder_decode_kernel1", "matmul_forward_kernel8_rows4", "matmul_forward_kernel8_gelu_rows4",
            "sample_kernel1"} <= set(be.rt.built)
    assert dec.fc_gelu
    assert not any(k.startswith("gemm") for k in be.rt.built)  # every decode matmul is the GEMV


def test_decoder_matmul_follows_a_named_variant():
    """--matmul-kernel 7 named on the command line beats the decoder's GEMV preference; from batch 5
    the decoder leaves the matmuls to the default (the TF32 engine is faster there), without a note."""
    from llmc.decode import Decoder
    cfg = config_from_name("L2C64H2")
    for kernels, B in (({"matmul_forward": 7}, 2), (None, 5), (None, 16)):
        be = cuda_backend(kernels)
        dec = Decoder(cfg, be, B, params_buf=be.empty((cfg.num_parameters,)))
        assert not any(k.startswith("matmul_forward_kernel8") for k in be.rt.built) and not be._noted
        assert not dec.fc_gelu
        assert any(k.startswith("gemm") for k in be.rt.built)
