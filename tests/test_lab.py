"""dev/cuda/lab.py's bookkeeping on the CPU (a stand-in runtime whose timings are fixed lists): the
copy of the same bytes that every memory-bound row is measured against, once per size, and the
table's columns."""
import importlib.util
import types

import numpy as np

from tests.conftest import ROOT


def _load_lab():
    spec = importlib.util.spec_from_file_location("lab_under_test", ROOT / "dev" / "cuda" / "lab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Arr:
    def __init__(self, n):
        self.ptr, self.n = id(self), n

    def fill_bytes(self, b):
        pass


class _FakeRT:
    """time_ms returns the next list in `times`; memcpy calls are recorded."""
    name, l2_bytes = "fake", 1 << 20

    def __init__(self, times):
        self.times, self.copies = list(times), []
        self.stream = object()
        self.drv = types.SimpleNamespace(memcpy_dtod_async=lambda dst, src, n, stream: self.copies.append(n))

    def empty(self, shape, dtype=np.float32):
        return _Arr(int(np.prod(shape)))

    def time_ms(self, fn, warmup=3, repeat=20, flush_l2=False):
        fn()
        return self.times.pop(0)


def _lab(times):
    lab = _load_lab()
    L = object.__new__(lab.Lab)
    L.args = types.SimpleNamespace(repeat=5, no_l2_flush=False, md=None, png=None)
    L.op, L.rt, L.rows, L.failed, L.validated, L.group = "op", _FakeRT(times), [], [], {"1", "2"}, None
    L.copy_ms = {}
    return L


def test_memory_bound_rows_get_the_copy_of_their_own_bytes_once_per_size():
    # copy of 1e6 bytes: 0.5 ms; variant 1: 1.0 ms (50% of the copy); variant 2 same bytes: 0.625 ms
    # (80%); variant 2 at 2e6 bytes: a second copy (1.0 ms) then 1.25 ms (80%)
    L = _lab([[0.5] * 3, [1.0] * 3, [0.625] * 3, [1.0] * 3, [1.25] * 3])
    L.time("1", lambda: None, bytes=1_000_000)
    L.time("2", lambda: None, bytes=1_000_000)
    L.time("2", lambda: None, block_size=64, bytes=2_000_000)
    assert L.rt.copies == [500_000, 1_000_000]  # half read + half written, one copy per size
    kinds = [(r["variant"], r["kind"]) for r in L.rows]
    assert [k for _, k in kinds] == ["copy", "ours", "ours", "copy", "ours"]
    ours = [r for r in L.rows if r["kind"] == "ours"]
    assert [round(r["copy_frac"], 6) for r in ours] == [0.5, 0.8, 0.8]
    assert abs(L.rows[0]["rate"] - 1_000_000 / 0.5e-3 / 1e9) < 1e-9  # the copy row's own GB/s
    table = L.table().splitlines()
    assert "% of a copy of the same bytes" in table[2]
    row1 = next(line for line in table if line.startswith("| 1 |"))
    assert row1.split("|")[6].strip() == "50%"
    copy_row = next(line for line in table if line.startswith("| copy, same bytes (1.0 MB)"))
    assert copy_row.split("|")[6].strip() == ""  # the copy is not measured against itself


def test_a_sequence_of_launches_gets_as_many_copies_on_buffers_of_their_own():
    # 24 launches moving 2.4e6 bytes in all: 24 copies of 1e5 bytes (5e4 read, 5e4 written) each, from 24
    # sources to 24 destinations, 0.6 ms in all; the rows 0.75 ms (80%); the same bytes as one launch: one copy
    L = _lab([[0.6] * 3, [0.75] * 3, [0.3] * 3, [0.6] * 3])
    srcs = []
    L.rt.drv.memcpy_dtod_async = lambda dst, src, n, stream: (L.rt.copies.append(n), srcs.append((src, dst)))
    L.time("24 calls", lambda: None, bytes=2_400_000, copies=24)
    assert L.rt.copies == [50_000] * 24 and len(set(srcs)) == 24 and len({p for sd in srcs for p in sd}) == 48
    L.time("one call", lambda: None, bytes=2_400_000)
    assert L.rt.copies[24:] == [1_200_000]
    copy24, ours24, copy1, ours1 = L.rows
    assert copy24["variant"] == "copy, same bytes (24 x 0.1 MB)" and copy24["kind"] == "copy"
    assert abs(copy24["rate"] - 2_400_000 / 0.6e-3 / 1e9) < 1e-9
    assert round(ours24["copy_frac"], 6) == 0.8 and round(ours1["copy_frac"], 6) == 0.5


def test_flop_rows_and_other_ceilings_get_no_copy():
    L = _lab([[2.0] * 3, [3.0] * 3])
    L.time("1", lambda: None, flops=1e12, ceiling="tf32")
    L.time("2", lambda: None, bytes=1000, ceiling=None)
    assert L.rt.copies == [] and all("copy_frac" not in r for r in L.rows)


def test_per_variant_block_size_tables_cover_every_variant():
    """A lab script that keys its block sizes by variant (BLOCK_SIZES = {1: (...), ...}) must name
    every variant the op has (of its dtype: BLOCK_SIZES_BF16 those with a bf16 build), or running it
    stops with a KeyError when it reaches the new one (adamw's did at variant 3)."""
    import ast

    from llmc import ops
    checked = 0
    for path in sorted((ROOT / "dev" / "cuda").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Dict)
                    and node.targets[0].id in ("BLOCK_SIZES", "BLOCK_SIZES_BF16")):
                continue
            keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            if not keys or not all(isinstance(k, int) for k in keys):
                continue
            variants = ops.get(path.stem).variants
            want = {n for n, v in variants.items()
                    if node.targets[0].id == "BLOCK_SIZES" or "bf16" in v.dtypes}
            if node.targets[0].id == "BLOCK_SIZES" and "BLOCK_SIZES_BF16" in path.read_text():
                want = {n for n, v in variants.items() if "fp32" in v.dtypes}
            assert want <= keys, f"{path.name}: {node.targets[0].id} lacks variants {sorted(want - keys)}"
            checked += 1
    assert checked >= 3  # adamw, classifier (two), global_norm


def test_define_option_parses_to_per_module_defines_and_refuses_bad_ones():
    """--define MODULE:NAME=VALUE (repeatable) -> {module: {NAME: VALUE}}; a malformed item or an unknown
    module is one LLMCError line naming the flag (the lab turns it into argparse's exit 2)."""
    import pytest
    from llmc.errors import LLMCError
    from llmc.runtime import parse_defines
    assert parse_defines([]) == {}
    assert parse_defines(["encoder:ENC7_COMB_BATCH=8", "encoder:ENC7_ROWS_UNROLL=4", "matmul:X=1"]) == {
        "encoder": {"ENC7_COMB_BATCH": "8", "ENC7_ROWS_UNROLL": "4"}, "matmul": {"X": "1"}}
    for bad in ("ENC7_COMB_BATCH=8", "encoder:ENC7_COMB_BATCH", "encoder:=8", "encoder:A B=1", "nosuch:A=1"):
        with pytest.raises(LLMCError, match="--define"):
            parse_defines([bad])


def test_runtime_adds_a_modules_extra_defines_to_its_builds(monkeypatch):
    """Runtime.extra_defines reach compile_cubin for that module only, merged with a build's own
    defines, and are part of the module cache's key (a second module load with other defines)."""
    import llmc.runtime as R
    built = []
    monkeypatch.setattr(R, "compile_cubin", lambda name, arch, defines: (built.append((name, dict(defines))), ("x", ""))[1])
    rt = object.__new__(R.Runtime)
    rt.arch, rt._modules, rt._cubins = "sm_90", {}, {}
    rt.drv = types.SimpleNamespace(module_from_file=lambda path: object())
    rt.extra_defines = {"encoder": {"ENC7_COMB_BATCH": "8"}}
    rt.module("encoder", {"OTHER": 1})
    rt.module("matmul")
    rt.module("encoder", {"OTHER": 1})  # cached
    assert built == [("encoder", {"OTHER": 1, "ENC7_COMB_BATCH": "8"}), ("matmul", {})]
    rt.extra_defines = {}
    rt.module("encoder", {"OTHER": 1})  # other defines: another build
    assert built[-1] == ("encoder", {"OTHER": 1})


def test_llmc_defines_env_gives_every_runtime_its_extra_defines(monkeypatch):
    """LLMC_DEFINES="MODULE:NAME=VALUE ..." (split at spaces) is what a Runtime starts with, so that
    bench_ab can time whole steps with a macro changed; a bad item names LLMC_DEFINES in one line."""
    import pytest
    from llmc.errors import LLMCError
    from llmc.runtime import env_defines
    monkeypatch.delenv("LLMC_DEFINES", raising=False)
    assert env_defines() == {}
    monkeypatch.setenv("LLMC_DEFINES", " encoder:ENC7_COMB_BATCH=2  classifier:X=1 ")
    assert env_defines() == {"encoder": {"ENC7_COMB_BATCH": "2"}, "classifier": {"X": "1"}}
    monkeypatch.setenv("LLMC_DEFINES", "encoder:ENC7_COMB_BATCH")
    with pytest.raises(LLMCError, match="^LLMC_DEFINES 'encoder:ENC7_COMB_BATCH': expected MODULE:NAME=VALUE"):
        env_defines()


def test_module_defines_sets_a_modules_knobs_for_a_block_and_puts_them_back():
    """llmc.testing.module_defines (the GPU tests' builds with a lab knob): inside the block the
    module's defines are the ones already there with the new ones over them (as strings); after it,
    as before, also when the block raises; a module that had none has no entry again."""
    import pytest
    from llmc.testing import module_defines
    rt = types.SimpleNamespace(extra_defines={"encoder": {"ENC9_MIN": "8", "ENC9_LANE": "4"}})
    with module_defines(rt, "encoder", {"ENC9_MIN": 0}):
        assert rt.extra_defines["encoder"] == {"ENC9_MIN": "0", "ENC9_LANE": "4"}
    assert rt.extra_defines == {"encoder": {"ENC9_MIN": "8", "ENC9_LANE": "4"}}
    with pytest.raises(RuntimeError):
        with module_defines(rt, "gelu", {"GELU_CS_UNROLL": 4}):
            assert rt.extra_defines["gelu"] == {"GELU_CS_UNROLL": "4"}
            raise RuntimeError("a failed build")
    assert rt.extra_defines == {"encoder": {"ENC9_MIN": "8", "ENC9_LANE": "4"}}
    with module_defines(rt, "gelu", {}):
        assert rt.extra_defines["gelu"] == {}
    assert "gelu" not in rt.extra_defines


def test_sets_option_names_a_labs_input_sets():
    """--sets NAME[,NAME...]: the input sets a lab script runs (encoder_backward's id distributions), checked
    against the script's own names (an unknown one is argparse's one-line error, exit 2); without it, the
    script's default."""
    import pytest
    lab = _load_lab()
    assert lab.parser("op").parse_args(["9", "--sets", "u,h,,t32"]).sets == ["u", "h", "t32"]
    L = object.__new__(lab.Lab)
    L.parser = lab.parser("op")
    L.args = L.parser.parse_args([])
    assert L.chosen_sets(("u", "z", "t", "h"), ("u", "z")) == ["u", "z"]
    L.args = L.parser.parse_args(["--sets", "h,u"])
    assert L.chosen_sets(("u", "z", "t", "h"), ("u", "z")) == ["h", "u"]
    L.args = L.parser.parse_args(["--sets", "u,x"])
    with pytest.raises(SystemExit) as e:
        L.chosen_sets(("u", "z"), ("u",))
    assert e.value.code == 2


def test_sdpa_reference_lines_are_named_after_the_backend_that_ran():
    """The attention labs' torch lines say which SDPA kernel they time: torch's own choice is named from
    the kernels it launched (session 56: the line called "flash" was cuDNN's kernel), and a forced
    backend that cannot run is left out, not timed as something else."""
    lab = _load_lab()
    name = lab.sdpa_backend_name
    assert name(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64"]) == "cuDNN"
    assert name(["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>"]) == "FlashAttention-2"
    assert name(["flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "flash_bwd_convert_dq_kernel"]) == "FlashAttention-2"
    assert name(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "memory-efficient"
    assert name(["ampere_bf16_s16816gemm", "softmax_warp_forward"]) == "math"

    import pytest
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q = torch.randn(1, 2, 8, 16)
    lines = lab.sdpa_backends(torch, lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    labels = [label for label, _ in lines]
    assert labels[0].startswith("default backend") and "cuDNN forced" not in labels  # (no cuDNN on a CPU)
    for _, fn in lines:
        assert torch.allclose(fn(), lines[0][1](), atol=1e-5)
