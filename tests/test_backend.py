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
    be.build = lambda name, prefer=None, precision=None, **shape: (seen.append((name, shape)),
                                                                   real(name, prefer, precision, **shape))[1]
    GPT2(cfg, be, B, T)
    dec = Decoder(cfg, be, B, params_buf=be.empty((cfg.num_parameters,)))
    if T <= cfg.max_seq_len:
        be.op("attention_kv_fill", B=B, C=cfg.channels, NH=cfg.num_heads, maxT=cfg.max_seq_len, T=T)
    assert dec.k
    # the softmax ops run inside the composite attention, which builds them through the registry
    hs = cfg.channels // cfg.num_heads
    seen += [(n, dict(BNH=B * cfg.num_heads, T=T, scale=hs ** -0.5)) for n in ("softmax_forward", "softmax_backward")]
    # the default variants sum every bias gradient in their fused forms; matmul_backward_bias runs where
    # they don't (fuse_bias=False, older variants): qkv's shape, the widest
    seen.append(("matmul_backward_bias", dict(N=B * T, OC=3 * cfg.channels)))
    return seen


@pytest.mark.parametrize("cfg_name,B,T", [("d12", 4, 1024), ("L2C64H2", 3, 65), ("L1C80H5", 1, 1)])
def test_every_variant_builds_or_refuses_cleanly(cfg_name, B, T):
    """Every build function runs (grid, block, shared memory, scratch) for every variant and every
    element type it lists at the model's shapes, without a GPU: it builds when check() passes and raises VariantRefused when not."""
    shapes = model_op_shapes(config_from_name(cfg_name), B, T)
    assert {n for n, _ in shapes} == set(ops.registry())
    for name, shape in shapes:
        spec = ops.get(name)
        for num, v in spec.variants.items():
            for dtype in v.dtypes:  # a bf16 build is covered the moment the variant lists it
                rt = FakeRuntime()
                if spec.refuse_reason(num, dtype, **shape):
                    with pytest.raises(VariantRefused):
                        spec.build(rt, num, dtype, **shape)
                else:
                    launch = spec.build(rt, num, dtype, **shape)
                    assert callable(launch) and rt.built, (name, num, dtype, shape)


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


def test_every_built_op_has_a_cost_model():
    """The profile's FLOPs and bytes come from each op's declared cost model at the shape the model
    built it for (Built.op, Built.shape): every op the model and the decoder build has one."""
    cfg = config_from_name("d12")
    be = cuda_backend()
    model = GPT2(cfg, be, 4, 1024)
    assert set(model.k) == set(model.built)
    for key, built in model.built.items():
        flops, nbytes = ops.get(built.op).cost(**built.shape)
        assert nbytes > 0 and flops >= 0, key
        assert (flops > 0) == built.op.startswith(("matmul_forward", "matmul_backward", "attention")) or \
            built.op == "matmul_backward_bias", key
    assert model.built["attention_forward"].number == 4 and model.built["attention_forward"].saved_shape == (4, 12, 1024)
    # the first micro-step's dweight GEMMs (first_write): one twin per dweight launch, costed without the read
    assert model.first_write and set(model.k_first) == set(model.built_first) == {
        "mmb_lmhead", "mmb_fcproj_dweight", "mmb_fc_dweight", "mmb_attproj_dweight", "mmb_qkv_dweight"}
    for key, built in model.built_first.items():
        assert built.shape == {**model.built[key].shape, "overwrite": True}, key
        w = ops.get(built.op).cost(**built.shape)[1]
        assert w == ops.get(built.op).cost(**model.built[key].shape)[1] - 4 * built.shape["C"] * built.shape["OC"], key
    for name, spec in ops.registry().items():
        assert spec.cost is not None, name


def test_memory_estimate_follows_the_chosen_attention():
    """What attention keeps per layer and its scratch come from the variants that will run: the
    composite needs (B,NH,T,T) per layer and T x T scratch, the fused variant a (B,NH,T) lse (and its
    backward, in its colsum form, the partials of qkv's bias gradient)."""
    cfg = config_from_name("d12")
    need = {}
    for kernels in (None, {"attention_forward": 1}):
        be = cuda_backend(kernels, free=0)
        with pytest.raises(LLMCError, match=r"need ([\d,]+) bytes") as e:
            GPT2(cfg, be, 4, 1024)
        need[1 if kernels else 2] = int(str(e.value).split("need ")[1].split(" bytes")[0].replace(",", ""))
    B, T, NH, L = 4, 1024, 12, 12
    extra = 4 * (L * B * NH * T * (T - 1)) + ops.get("attention_forward").variant(1).scratch_bytes(B=B, T=T, C=768, NH=NH) \
        + ops.get("attention_backward").variant(1).scratch_bytes(B=B, T=T, C=768, NH=NH) \
        - ops.get("attention_forward").variant(4).scratch_bytes(B=B, T=T, C=768, NH=NH, dtype="fp32") \
        - ops.get("attention_backward").variant(4).scratch_bytes(B=B, T=T, C=768, NH=NH, dtype="fp32", colsum=True)
    # (the composite's one-layer qkv buffer, where 4/4 read each layer's qkv in place, lies in the logits' buffer:
    # share_scratch)
    assert need[1] - need[2] == extra


# ----------------------------------------------------------------------------------------------
# contracts: the Backend protocol, typed build results, argument types against the PTX


def test_both_backends_and_the_fake_implement_the_protocol():
    from llmc.backend import Backend
    from tests.fake_runtime import FakeCudaBackend
    for be in (CpuBackend(), cuda_backend(), FakeCudaBackend()):
        assert isinstance(be, Backend), type(be).__name__
        assert be.precision == "fp32" and be.kernels == kernel_choices(None)
        built = be.build("layernorm_forward", N=4, C=64)
        assert isinstance(built, ops.Built) and callable(built.launch) and built.op == "layernorm_forward"
    assert CpuBackend().build("attention_forward", B=1, T=8, C=64, NH=1).saved_shape == (1, 1, 8, 8)
    assert cuda_backend().build("attention_forward", B=1, T=8, C=64, NH=1).saved_shape == (1, 1, 8)


def test_argtypes_are_checked_against_the_ptx():
    """A launcher whose argtypes string disagrees with the kernel's parameters (count, or an int where
    the kernel takes a float, or a 4-byte int for a pointer) fails on the CPU, not on a GPU."""
    from llmc.runtime import argtypes_mismatch, nvcc_path
    from tests.fake_runtime import FakeRuntime, signatures
    if nvcc_path() is None:
        pytest.skip("nvcc not installed")
    sig = signatures("softmax")["softmax_forward_kernel1"]
    assert sig == ["u64", "u64", "u32", "u32", "f32"]
    assert argtypes_mismatch("PPiif", sig) is None
    assert "argtypes" in argtypes_mismatch("PPiii", sig)   # float passed as int
    assert "argtypes" in argtypes_mismatch("PPPPPiiiii"[:5].replace("P", "i", 1), sig)
    assert "4 argtypes" in argtypes_mismatch("PPii", sig)
    rt = FakeRuntime()
    with pytest.raises(AssertionError, match="do not match"):
        rt.kernel("softmax", "softmax_forward_kernel1", "PPiii")
    with pytest.raises(AssertionError, match="no entry point"):
        rt.kernel("softmax", "softmax_forward_kernel9", "PPiif")
    k = rt.kernel("softmax", "softmax_forward_kernel1", "PPiif")
    with pytest.raises(AssertionError, match="launch arguments"):
        k((1, 1, 1), (32, 1, 1), 0, 0, 1, 1)


# ----------------------------------------------------------------------------------------------
# dtype: a build parameter of every op


def test_every_variant_declares_its_dtypes_and_refuses_others():
    for name, spec in ops.registry().items():
        for num, v in spec.variants.items():
            # fp32 first; a variant written for bf16 alone (attention_forward 4, wgmma) lists only that
            assert v.dtypes[0] == "fp32" or v.dtypes == ("bf16",), (name, num, v.dtypes)
            assert set(v.dtypes) <= set(ops.DTYPES), (name, num, v.dtypes)
            for dt in set(ops.DTYPES) - set(v.dtypes):  # a dtype it lacks refuses, naming why
                assert f"no {dt} kernels" in spec.refuse_reason(num, dtype=dt, N=4, C=64, OC=64, B=1, T=4, NH=1,
                                                                 BNH=1, scale=1.0, n=64, V=64, Vp=64, maxT=8)
    # the softmax ops run only inside the composite attention, which stays fp32
    with pytest.raises(VariantRefused, match=r"softmax_forward variant 6 .*no bf16 kernels \(has fp32\)"):
        ops.get("softmax_forward").build(FakeRuntime(), 6, dtype="bf16", BNH=1, T=4, scale=1.0)


def test_a_bf16_build_sits_beside_the_fp32_one():
    """A variant with kernels for two dtypes: the same number builds either, the backend asks for its
    precision, and a dtype the variant lacks refuses (so a default falls back)."""
    built = []
    v = ops.Variant(1, "two dtypes", {"fp32": lambda rt, n: built.append(("fp32", n)) or (lambda: None),
                                      "bf16": lambda rt, n: built.append(("bf16", n)) or (lambda: None)})
    w = ops.Variant(2, "fp32 only", lambda rt, n: (lambda: None))
    spec = ops.OpSpec("toy", cpu=lambda n: None, variants={1: v, 2: w}, default=2, flag="--toy-kernel")
    assert v.dtypes == ("fp32", "bf16")
    spec.build(None, 1, dtype="bf16", n=8)
    spec.build(None, 1, n=8)
    assert built == [("bf16", 8), ("fp32", 8)]
    assert spec.build(None, 1, dtype="bf16", n=8).dtype == "bf16"
    with pytest.raises(VariantRefused, match="no bf16 kernels"):
        spec.build(None, 2, dtype="bf16", n=8)
    with pytest.raises(ValueError, match="unknown dtype"):
        ops.Variant(3, "bad", {"fp16": lambda rt: None})


def test_a_variant_tied_to_one_arch_refuses_elsewhere_and_the_default_falls_back(monkeypatch, capsys):
    """Variant.arch (wgmma variants: "sm_90"): built on that GPU; elsewhere it refuses with the reason,
    a default falls back with one note, a variant the user named refuses loudly."""
    hopper = ops.Variant(2, "sm_90 only", lambda rt, n: (lambda: None), arch="sm_90")
    plain = ops.Variant(1, "anywhere", lambda rt, n: (lambda: None))
    toy = ops.OpSpec("toy", cpu=lambda n: None, variants={1: plain, 2: hopper}, default=2, flag="--toy-kernel")
    monkeypatch.setattr(ops, "_registry", dict(ops.registry(), toy=toy))
    assert hopper.refuse_reason("sm_90", n=1) is None and "needs an sm_90 GPU" in hopper.refuse_reason("sm_80", n=1)
    for arch, want in (("sm_90", 2), ("sm_80", 1)):
        be = cuda_backend()
        be.rt.arch = arch
        assert be.build("toy", n=4).number == want
    assert capsys.readouterr().out.count("note: toy variant 2 (default) refuses") == 1
    be = cuda_backend({"toy": 2})
    be.rt.arch = "sm_80"
    with pytest.raises(VariantRefused, match="needs an sm_90 GPU"):
        be.build("toy", n=4)


def test_d12_off_hopper_falls_back_to_attention_3_and_3(capsys):
    """attention 4/4 (wgmma) is the default in both element types; on another GPU (sm_80) the fp32
    model runs the fused 3/3 pair instead (a consistent pair: 3 keeps the lse that 3 reads), with one
    note per op. (bf16 needs Hopper: its matmuls exist on engine 5 only, which refuses in one line.)"""
    cfg = config_from_name("d12")
    be = CudaBackend(None, rt=FakeRuntime())
    be.rt.arch = "sm_80"
    model = GPT2(cfg, be, 4, 1024)
    assert model.built["attention_forward"].number == 3 and model.built["attention_backward"].number == 3
    assert not model.qkv_in_place  # (3 has no in-place form: the permuted copy)
    out = capsys.readouterr().out
    assert out.count("note: attention_forward variant 4 (default) refuses") == 1, out
    assert out.count("note: attention_backward variant 4 (default) refuses") == 1, out
    be = CudaBackend(None, rt=FakeRuntime(), precision="bf16")
    be.rt.arch = "sm_80"
    with pytest.raises(VariantRefused, match="needs an sm_90 GPU"):
        GPT2(cfg, be, 4, 1024)


def test_pinned_free_waits_for_the_last_async_upload_only():
    """CudaBackend.upload_async records an event after the copy; pinned_free(host) waits on that
    event (the GPU has read host: it may be written again) once, and not for other buffers."""
    import types
    from llmc.backend import CudaBackend

    waits = []

    class Ev:
        def __init__(self):
            self.n = len(waits)

        def record(self, stream):
            pass

        def synchronize(self):
            waits.append(self.n)

    rt = types.SimpleNamespace(event=Ev, stream=None)
    be = object.__new__(CudaBackend)
    be._setup({}, True)
    be.rt = rt
    copies = []
    buf = types.SimpleNamespace(set_async=lambda host: copies.append(host.copy()))
    a, b = np.zeros(4, np.int32), np.ones(4, np.int32)
    be.pinned_free(a)  # nothing pending: no wait
    assert waits == []
    be.upload_async(buf, a)
    be.upload_async(buf, b)
    be.pinned_free(a)
    assert len(waits) == 1
    be.pinned_free(a)  # already waited for
    assert len(waits) == 1
    be.pinned_free(b)
    assert len(waits) == 2 and len(copies) == 2


def test_model_frees_its_pinned_buffers_before_writing_them(monkeypatch):
    """set_batch and update wait for the previous async copy out of each pinned buffer before they
    overwrite it (pinned_free first, then the write, then upload_async)."""
    from llmc.config import GPT2Config
    from llmc.model import GPT2
    cfg = GPT2Config(max_seq_len=16, vocab_size=11, padded_vocab_size=16, num_layers=1, num_heads=2, channels=8)
    be = CpuBackend()
    m = GPT2(cfg, be, 2, 8)
    m.init_params(0)
    order = []
    monkeypatch.setattr(be, "pinned_free", lambda host: order.append(("free", id(host))), raising=False)
    monkeypatch.setattr(be, "upload_async", lambda buf, host: order.append(("upload", id(host))), raising=False)
    x = np.zeros((2, 8), np.int32)
    m.set_batch(x, x)
    assert order == [("free", id(m._pinned_xy)), ("upload", id(m._pinned_xy))]  # inputs and targets: one copy


def test_the_kernels_line_names_the_variants_of_the_element_type():
    """bf16 has its own defaults for some ops: the "kernels:" line of train_gpt2.py and bench_step.py
    (Backend.kernels_for) prints those, and the user's choices as named, where be.kernels keeps the
    fp32 defaults that choose() maps per element type."""
    from tests.fake_runtime import FakeRuntime
    fp32 = CudaBackend(rt=FakeRuntime(), quiet=True).kernels_for()
    bf16 = CudaBackend(rt=FakeRuntime(), quiet=True, precision="bf16")
    shown = bf16.kernels_for()
    for name in ("layernorm_backward", "layernorm_forward", "encoder_backward", "attention_backward"):
        spec = ops.get(name)
        assert fp32[name] == spec.default and shown[name] == spec.default_for("bf16") != spec.default, name
    assert shown["layernorm_backward"] == bf16.choose("layernorm_backward", N=4096, C=768)
    named = CudaBackend(rt=FakeRuntime(), quiet=True, precision="bf16", kernels={"layernorm_backward": 5})
    assert named.kernels_for()["layernorm_backward"] == 5 and named.kernels_for()["encoder_backward"] == 9


def test_scratch_pool_shares_across_blocks_not_within_one():
    """Runtime.scratch: outside a pool a plain allocation; inside scratch_pool(pool), the pool's
    buffers of the same byte size, each at most once per block, then new ones (added to the pool);
    CudaBackend.build records each build's scratch in its Built.pool."""
    from tests.fake_runtime import FakeRuntime
    rt = FakeRuntime()
    a, b = rt.scratch((4, 8)), rt.scratch((4, 8))
    assert a.ptr != b.ptr
    pool = {}
    with rt.scratch_pool(pool):
        x, y, z = rt.scratch((16,)), rt.scratch((16,)), rt.scratch((3,), np.uint32)
    n = rt.allocated_bytes
    with rt.scratch_pool(pool):
        x2, w = rt.scratch((4, 4)), rt.scratch((8,), np.int64)  # 64 bytes each: x's and y's
        z2, extra = rt.scratch((3,), np.uint32), rt.scratch((3,), np.uint32)
    assert (x2.ptr, w.ptr, z2.ptr) == (x.ptr, y.ptr, z.ptr) and x2.shape == (4, 4) and w.dtype == np.int64
    assert extra.ptr not in (x.ptr, y.ptr, z.ptr) and rt.allocated_bytes == n + 12 and len(pool["bufs"]) == 4
    assert rt.scratch((16,)).ptr not in (x.ptr, y.ptr)  # (the block is over: plain again)
    be = CudaBackend(rt=FakeRuntime(), quiet=True)
    built = be.build("matmul_backward", prefer=5, N=64, C=32, OC=96)
    assert built.pool is not None and len(built.pool["bufs"]) == 2  # weight^T and the transposed narrow operand


def test_a_kernels_shared_memory_opt_in_only_grows(monkeypatch):
    """Kernel.set_max_dynamic_smem raises the function's opt-in and never lowers it: two builds of one
    entry point (layernorm_backward 7's ticketed form, 3 stages, then its deferred form, 2) share the
    function, and the first build's launches need its larger opt-in after the second build asked for less
    (before this, the second call set the attribute down and the first form's launch failed)."""
    import types
    from llmc.runtime import Kernel

    drv = types.ModuleType("pycuda.driver")
    drv.function_attribute = types.SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dynamic_smem")
    pkg = types.ModuleType("pycuda")
    pkg.driver = drv
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    sets = []
    func = types.SimpleNamespace(prepare=lambda a: None, prepared_async_call=None,
                                 set_attribute=lambda attr, v: sets.append((attr, v)))
    k = Kernel(None, func, "PPi", "layernorm_backward 7 bf16 colsum")
    k.set_max_dynamic_smem(40 * 1024)  # under the 48 KB every kernel has: nothing to opt in to
    assert sets == [] and k.max_dynamic_smem == 48 * 1024
    k.set_max_dynamic_smem(165904)
    k.set_max_dynamic_smem(110608)
    assert sets == [("max_dynamic_smem", 165904)] and k.max_dynamic_smem == 165904
    k.set_max_dynamic_smem(200000)
    assert sets[-1] == ("max_dynamic_smem", 200000) and k.max_dynamic_smem == 200000
