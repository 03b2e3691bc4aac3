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

ROOT = Path(__file__).resolve().parent.parent


_ENTRY = {}


def entry_points(module):
    """The kernel names in cuda/<module>.cu's cubin (from ptxas's report; needs nvcc, no GPU)."""
    if module not in _ENTRY:
        from llmc.runtime import ARCH_SPECIFIC, compile_cubin, nvcc_path, resource_report
        if nvcc_path() is None:
            pytest.skip("nvcc not installed")
        _ENTRY[module] = set(resource_report(compile_cubin(module, ARCH_SPECIFIC.get(module, "sm_90"))[1]))
    return _ENTRY[module]


class _AnyAttr:
    def __getattr__(self, name):
        return name


class _Device:
    """H100-like device attributes, by name."""
    VALUES = {"MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
              "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 228 * 1024, "MULTIPROCESSOR_COUNT": 132}

    def get_attribute(self, name):
        return self.VALUES[name]


class NoGpuRuntime:
    """Enough of Runtime for build functions to run: kernels are dummies, memory is pretend
    (DevArrays with made-up pointers), device attributes are an H100's. Launching is an error."""

    def __init__(self, free=80 << 30):
        self.free, self.built = free, []
        self.max_smem_optin, self.sm_count, self.l2_bytes, self.arch = 227 * 1024, 132, 50 << 20, "sm_90"
        self.device, self.drv = _Device(), type("drv", (), {"device_attribute": _AnyAttr()})()
        self.top = 1 << 40
        self.allocated_bytes = 0

    def kernel(self, module, func, argtypes, label=None, defines=None):
        assert func in entry_points(module), f"cuda/{module}.cu has no entry point {func}"
        self.built.append(func)

        class K:
            max_dynamic_smem = 48 * 1024
            rt = self

            def set_max_dynamic_smem(self, n):
                assert n <= 227 * 1024, n
                self.max_dynamic_smem = n

            def attributes(self):
                return {"regs": 64, "local_bytes": 0, "static_smem": 0, "max_threads": 1024}

            def resident_blocks(self, block_size):  # the real formula, over the fake device
                from llmc.runtime import Kernel
                return Kernel.resident_blocks(self, block_size)

            def __call__(self, *a, **k):
                raise AssertionError("no launches without a GPU")
        return K()

    def empty(self, shape, dtype=np.float32):
        from llmc.runtime import DevArray
        a = DevArray(self, self.top, shape, dtype, None)
        self.top += -(-a.nbytes // 256) * 256
        self.allocated_bytes += a.nbytes
        return a

    zeros = empty

    def pinned(self, shape, dtype):
        return np.empty(shape, dtype)

    def mem_info(self):
        return self.free, 80 << 30

    def require_free(self, nbytes, what="model"):
        from llmc.runtime import Runtime
        Runtime.require_free(self, nbytes, what)


def cuda_backend(kernels=None, free=80 << 30):
    be = CudaBackend.__new__(CudaBackend)
    be.rt, be.dtype = NoGpuRuntime(free), np.dtype(np.float32)
    be.kernels = kernel_choices(kernels)
    be.chosen = set((kernels or {}).keys())
    be.quiet, be._noted = False, set()
    return be


def test_named_variant_refuses_at_build():
    be = cuda_backend({"softmax_forward": 5})
    with pytest.raises(VariantRefused, match="softmax_forward variant 5"):
        be.op("softmax_forward", BNH=4, T=65, scale=0.125)


def test_default_falls_back_with_one_note(capsys):
    be = cuda_backend()
    spec = ops.get("softmax_forward")
    assert spec.variant(spec.default).refuse_reason(BNH=4, T=65, scale=0.125)  # the default can't take T=65
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
    """(op name, shape) for every op the model builds at (cfg, B, T)."""
    be = cuda_backend()
    seen = []
    real = be.op
    be.op = lambda name, **shape: (seen.append((name, shape)), real(name, **shape))[1]
    GPT2(cfg, be, B, T)
    return seen


@pytest.mark.parametrize("cfg_name,B,T", [("d12", 4, 1024), ("L2C64H2", 3, 65), ("L1C80H5", 1, 1)])
def test_every_variant_builds_or_refuses_cleanly(cfg_name, B, T):
    """Every build function runs (grid, block, shared memory, scratch) for every variant at the
    model's shapes, without a GPU: it builds when check() passes and raises VariantRefused when not."""
    shapes = model_op_shapes(config_from_name(cfg_name), B, T)
    assert {n for n, _ in shapes} >= {"matmul_forward", "attention_forward", "classifier", "adamw"}
    for name, shape in shapes:
        spec = ops.get(name)
        for num, v in spec.variants.items():
            rt = NoGpuRuntime()
            if v.refuse_reason(**shape):
                with pytest.raises(VariantRefused):
                    spec.build(rt, num, **shape)
            else:
                launch = spec.build(rt, num, **shape)
                assert callable(launch) and rt.built, (name, num, shape)


def test_decoder_kernels_build_without_gpu():
    from llmc.decode import Decoder
    from llmc.ops.attention import build_kv_fill
    cfg = config_from_name("d12")
    be = cuda_backend()
    dec = Decoder(cfg, be, 4, params_buf=be.empty((cfg.num_parameters,)))
    assert callable(dec.k["attention"]) and "kv_append" not in dec.k
    assert callable(build_kv_fill(be.rt, B=8, C=768, NH=12, maxT=1024, T=64))
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
