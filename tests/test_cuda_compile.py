"""Every cuda/*.cu compiles with nvcc for sm_90 (H100) and sm_80 (A100), with no register spills
and no local-memory stack frame in any kernel (ptxas -v report parsed), and no wgmma pipeline that
ptxas serialized (its C7515 note). The SASS of some kernels (cuobjdump, where found) shows the
instructions they were written for: HGMMA and TMA in engine 5 and attention 4, 16-byte plain loads in
matmul_backward_bias 4. No GPU needed."""
import pytest

from llmc.runtime import ARCH_SPECIFIC, CUDA_DIR, compile_cubin, compile_ptx, cuda_sources, nvcc_path, resource_report

pytestmark = pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")
ARCHS = ("sm_90", "sm_80")


def _targets():
    """(module, target) of every build test_compiles_without_spills makes, the largest sources first."""
    jobs = [(m, ARCH_SPECIFIC.get(m, a)) for m in cuda_sources() for a in ARCHS
            if m not in ARCH_SPECIFIC or a == ARCH_SPECIFIC[m].rstrip("a")]
    return sorted(jobs, key=lambda j: -(CUDA_DIR / f"{j[0]}.cu").stat().st_size)


@pytest.fixture(scope="module")
def built_in_parallel():
    """Every build of the spill tests at once, one nvcc per CPU (CI's fresh machine has an empty cache: one
    after the other they took ~8 minutes on 2 CPUs); each test then reads its cubin and ptxas report from
    the cache. A build that fails here is left for its own test to make again and report."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    def build(job):
        try:
            compile_cubin(*job)
        except Exception:  # noqa: BLE001  (reported by the test of that module)
            pass
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        list(ex.map(build, _targets()))


def test_there_are_kernels():
    assert len(cuda_sources()) >= 8, cuda_sources()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", cuda_sources())
def test_compiles_without_spills(module, arch, built_in_parallel):
    if module in ARCH_SPECIFIC:  # built only for its own target (sm_90a for wgmma)
        if arch != ARCH_SPECIFIC[module].rstrip("a"):
            pytest.skip(f"cuda/{module}.cu is built for {ARCH_SPECIFIC[module]} only")
        arch = ARCH_SPECIFIC[module]
    _, log = compile_cubin(module, arch)
    report = resource_report(log)
    assert report, f"cuda/{module}.cu: no kernels in the ptxas report"
    bad = {k: r for k, r in report.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert not bad, f"cuda/{module}.cu for {arch}: spills or local memory in {bad}"
    # ptxas waits for every wgmma in turn when other instructions write its accumulators mid-pipeline
    # (2026-11-27: accumulators started from the bias, 1.6x slower); it says so as a C7515 "info", and as
    # C7520 when a warpgroup arrive it had to insert sits in a divergent path (session 46: a consumer's
    # spin loop under `if (tid == 0)` in attention_backward 5's main kernel)
    serial = [line.strip() for line in log.splitlines() if "C7515" in line or "C7520" in line]
    assert not serial, f"cuda/{module}.cu for {arch}: serialized wgmmas: {serial[:3]}"


def test_encoder_floor_bench_builds_without_spills():
    """dev/cuda/encoder_backward_floor.py's bare kernels (cuda/encoder.cu under -DENC_FLOOR_BENCH=1, absent
    from the default build) compile, the 12 the script launches, with no spills."""
    _, log = compile_cubin("encoder", "sm_90", {"ENC_FLOOR_BENCH": "1"})
    report = resource_report(log)
    floor = {k: r for k, r in report.items() if k.startswith("encoder_floor_")}
    want = {f"encoder_floor_m{m}_r{r}" for m in range(5) for r in (1, 4)} | {"encoder_floor_pos_slices",
                                                                              "encoder_floor_pos_whole"}
    assert set(floor) == want
    bad = {k: r for k, r in floor.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert not bad, bad
    _, plain = compile_cubin("encoder", "sm_90")
    assert not any(k.startswith("encoder_floor_") for k in resource_report(plain))


def test_encoder10_no_dwpe_measurement_build_compiles_without_spills():
    """cuda/encoder.cu under -DENC10_NO_DWPE=1 (dev/cuda/encoder_backward.py's "(dwte only)" rows: variant 10
    without its dwpe sums) compiles without spills, and variant 10's kernels differ from the default build's
    (the flag reaches them)."""
    _, log = compile_cubin("encoder", "sm_90", {"ENC10_NO_DWPE": "1"})
    report = resource_report(log)
    ten = {k: r for k, r in report.items() if k.startswith("encoder_backward_kernel10")}
    assert set(ten) == {"encoder_backward_kernel10", "encoder_backward_kernel10_bf16"}
    bad = {k: r for k, r in ten.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert not bad, bad
    _, plain = compile_cubin("encoder", "sm_90")
    assert any(ten[k]["regs"] != r["regs"] for k, r in resource_report(plain).items() if k in ten)


def test_encoder10_trace_measurement_build_compiles_without_spills():
    """cuda/encoder.cu under -DENC10_TRACE=1 (dev/cuda/encoder_backward_trace.py's build: each unit of variant
    10 timed into the device array enc10_trace) compiles without spills in variant 10's kernels, and only
    that build declares the array (the flag reaches the source; the op's build has no trace)."""
    _, log = compile_cubin("encoder", "sm_90", {"ENC10_TRACE": "1"})
    ten = {k: r for k, r in resource_report(log).items() if k.startswith("encoder_backward_kernel10")}
    assert set(ten) == {"encoder_backward_kernel10", "encoder_backward_kernel10_bf16"}
    assert not {k: r for k, r in ten.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert "enc10_trace" in compile_ptx("encoder", "sm_90", {"ENC10_TRACE": "1"})
    assert "enc10_trace" not in compile_ptx("encoder", "sm_90")


@pytest.mark.parametrize("defines", [{}, {"ENC_TREE_G": "4"}, {"ENC9_ACQREL": "0"}])
def test_encoder9_acqrel_tickets_compile_without_spills(defines):
    """cuda/encoder.cu with 9's and 10's tickets taken by one acq_rel atomic a warp (ENC9_ACQREL, the default
    since session 54), alone and with the two-level combine, and with the fenced tickets (ENC9_ACQREL=0): 9's
    and 10's kernels compile without spills, and the atomic (its PTX: atom.acq_rel.gpu) is there in the
    default builds and not in the fenced one."""
    _, log = compile_cubin("encoder", "sm_90", defines)
    ks = {k: r for k, r in resource_report(log).items() if k.startswith(("encoder_backward_kernel9", "encoder_backward_kernel10"))}
    assert len(ks) == 4 and not {k: r for k, r in ks.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    fenced = defines.get("ENC9_ACQREL") == "0"
    assert ("atom.acq_rel.gpu" in compile_ptx("encoder", "sm_90", defines)) != fenced


def test_cache_key_covers_only_the_headers_a_module_includes(tmp_path):
    """Editing a header rebuilds the modules that include it (directly or through another header)
    and no other: a GEMV edit (cuda/matmul.cu) or a layernorm header edit leaves the GEMM engines'
    cubin (cuda/gemm.cu) where it is."""
    import shutil
    from llmc.runtime import CUDA_DIR, _cache_key, module_headers
    assert module_headers("gemm") == ["common.cuh", "elem.cuh", "mma.cuh"]  # elem.cuh through mma.cuh
    assert module_headers("layernorm") == ["common.cuh", "elem.cuh", "layernorm.cuh"]  # through layernorm.cuh
    assert "mma.cuh" not in module_headers("softmax")
    d = tmp_path / "cuda"
    shutil.copytree(CUDA_DIR, d)
    key = lambda m: _cache_key(m, "sm_90", {}, nvcc_path(), d)  # noqa: E731
    before = {m: key(m) for m in ("gemm", "matmul", "layernorm", "residual_layernorm", "softmax")}
    (d / "matmul.cu").write_text((d / "matmul.cu").read_text() + "\n// edited\n")
    (d / "layernorm.cuh").write_text((d / "layernorm.cuh").read_text() + "\n// edited\n")
    after = {m: key(m) for m in before}
    assert after["gemm"] == before["gemm"] and after["softmax"] == before["softmax"]
    assert all(after[m] != before[m] for m in ("matmul", "layernorm", "residual_layernorm"))
    (d / "common.cuh").write_text((d / "common.cuh").read_text() + "\n// edited\n")
    assert all(key(m) != after[m] for m in after)  # everyone includes common.cuh


def test_arch_specific_targets(monkeypatch):
    """A module in ARCH_SPECIFIC (wgmma: sm_90a) is built for that target on its generation and for
    nothing else; every other module for the GPU's own arch. The -gencode form for 'a' targets."""
    import llmc.runtime as R
    monkeypatch.setitem(R.ARCH_SPECIFIC, "x", "sm_90a")
    assert R.module_target("x", "sm_90") == "sm_90a" and R.module_target("x", "sm_80") is None
    assert R.module_target("gemm", "sm_80") == "sm_80"
    assert R.arch_flags("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert R.arch_flags("sm_80") == ["-arch=sm_80"]


def _sass_functions(module: str) -> dict:
    """{entry point: its SASS} of cuda/<module>.cu built for its Hopper target (sm_90a for the wgmma
    modules, else sm_90), by cuobjdump (llmc.runtime.sass: PATH, the CUDA install, or the pip wheels
    requirements-test.txt installs); skips where none is found."""
    from llmc.runtime import sass
    cubin, _ = compile_cubin(module, ARCH_SPECIFIC.get(module, "sm_90"))
    text = sass(cubin)
    if text is None:
        pytest.skip("cuobjdump (or nvdisasm) not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    funcs = {}
    for block in text.split("Function : ")[1:]:
        name, body = block.split("\n", 1)
        funcs[name.strip()] = body
    return funcs


def test_cuobjdump_is_found_where_its_wheels_are_installed():
    """Where requirements-test.txt's wheels are installed (CI), llmc.runtime finds cuobjdump and nvdisasm
    there, so the SASS tests below run instead of skipping."""
    import os
    from importlib import metadata
    from llmc.runtime import cuobjdump_env
    try:
        metadata.version("nvidia-cuda-cuobjdump"), metadata.version("nvidia-cuda-nvdisasm")
    except metadata.PackageNotFoundError:
        pytest.skip("the nvidia-cuda-cuobjdump / nvidia-cuda-nvdisasm wheels are not installed")
    found = cuobjdump_env()
    assert found is not None
    tool, env = found
    assert os.access(os.path.join(env["NVDISASM_PATH"], "nvdisasm"), os.X_OK), env["NVDISASM_PATH"]


def _assert_wgmma_tma(funcs: dict, names: list) -> None:
    """Each named kernel issues HGMMA (of the element type its name says) and TMA loads (UTMALDG), and
    none touches local memory (LDL/STL)."""
    for f in names:
        body = funcs[f]
        assert "HGMMA" in body and "UTMALDG" in body, f
        assert " LDL" not in body and " STL" not in body, f"{f} uses local memory"
        assert (".TF32" in body) == ("tf32" in f) and (".BF16" in body) == ("bf16" in f), f


def test_engine5_sass_has_hgmma_and_tma():
    """Engine 5's kernels really run on Hopper's wgmma (HGMMA in the SASS, not HMMA/FFMA) with TMA
    loads (UTMALDG), and none touches local memory (LDL/STL)."""
    funcs = _sass_functions("gemm_wgmma")
    # (the split-K reduces and the dgelu column sums' finish are plain loops beside the engine)
    engines = [f for f in funcs if f.startswith("gemm_wgmma_") and ("tf32" in f or "bf16" in f)
               and "splitk" not in f and "colsum" not in f]
    assert len(engines) >= 9, sorted(funcs)
    _assert_wgmma_tma(funcs, engines)


def test_attention4_sass_has_hgmma_and_tma():
    """attention 4's kernels, bf16 and TF32 (forward, dq, dk/dv; every schedule, layout and transpose
    form), run on wgmma with TMA loads and no local memory (attention_vt_kernel, the transposes in
    global memory, is a plain copy beside them)."""
    funcs = _sass_functions("attention_wgmma")
    kernels = [f for f in funcs if f.startswith("flash_attention_") and "kernel4" in f]
    assert sum("tf32" in f for f in kernels) >= 12 and sum("bf16" in f for f in kernels) >= 12, sorted(funcs)
    _assert_wgmma_tma(funcs, kernels)


@pytest.mark.parametrize("module", ["gemm_wgmma", "attention_wgmma"])
def test_wgmma_kernels_keep_their_pipelines(module):
    """No kernel waits for each wgmma on its own: in the SASS, at most one WARPGROUP.DEPBAR (a wait for the
    warpgroup's products) for every two HGMMA. A serialized pipeline has one after every HGMMA (session 58:
    attention 4 / 5 with a branch between an m64n64 and an m64n128 product, every HGMMA of the kernels
    serialized, 16-42% slower in the lab). ptxas's notes said so there (C7515 / C7520, the test above);
    this reads the machine code itself. Today's highest share is 1 in 2 (the TF32 engine's k-blocks of 4
    products, a wait a block); the attention kernels' is 1 in 7 or lower."""
    import re
    funcs = _sass_functions(module)
    counts = {f: (len(re.findall(r"\bHGMMA", b)), len(re.findall(r"WARPGROUP\.DEPBAR", b))) for f, b in funcs.items()}
    wgmma = {f: c for f, c in counts.items() if c[0]}
    assert len(wgmma) >= (60 if module == "gemm_wgmma" else 30), sorted(funcs)
    serial = {f: c for f, c in wgmma.items() if 2 * c[1] > c[0]}
    assert not serial, f"cuda/{module}.cu: kernels waiting on (nearly) every wgmma (HGMMA, DEPBAR): {serial}"


def test_matmul_backward_bias4_sass_loads_16_bytes_plain():
    """matmul_backward_bias 4 reads dout and the partials 16 bytes a load and with plain loads: every
    global load in its SASS is LDG.E.128 (in bf16 a conversion helper that took the row's 16-byte word
    by reference once made it four 4-byte LDG.E, and ld.global.cg partials were LDG.E.128.STRONG.GPU,
    fewer in flight: session 31)."""
    import re
    funcs = _sass_functions("matmul")
    for f in ("matmul_backward_bias_kernel4", "matmul_backward_bias_kernel4_bf16"):
        loads = re.findall(r"\bLDG\S*", funcs[f])
        assert loads and set(loads) == {"LDG.E.128"}, f"{f}: {sorted(set(loads))}"


def test_every_entry_point_waits_for_its_predecessor_first():
    """A graph captured with programmatic dependent launches (llmc/runtime.py, PDL_ENV) may start any
    kernel while the one before it is ending, which is safe only if each waits for it before touching
    memory: every extern "C" __global__ body of cuda/ starts with LLMC_PDL_WAIT()."""
    import re
    from llmc.runtime import CUDA_DIR
    n = 0
    for f in sorted(CUDA_DIR.glob("*.cu")):
        src = f.read_text()
        for m in re.finditer(r'extern "C" __global__', src):
            i, depth, seen = m.end(), 0, False
            while not (src[i] == "{" and depth == 0 and seen):
                depth += {"(": 1, ")": -1}.get(src[i], 0)
                seen = seen or src[i] == "("
                i += 1
            body = src[i + 1:i + 200].lstrip(" \\\n")
            assert body.startswith("LLMC_PDL_WAIT();"), f"{f.name}: {src[m.start():i + 40]!r}"
            n += 1
    assert n >= 150  # (entry points made by a macro count once: the PTX test below counts them all)


def test_every_entry_point_waits_for_its_predecessor_in_its_ptx():
    """The same rule on what nvcc makes of it, macro-made entry points included: in the sm_90 PTX of every
    module each .entry runs griddepcontrol.wait before its first global-memory instruction (a load, store,
    atomic, reduction or bulk copy)."""
    import re
    from llmc.runtime import compile_ptx
    mem = re.compile(r"^\s*(@%p\d+\s+)?(ld|st|atom|red|cp|multimem|prefetch)\.[\w:.]*global", re.M)
    n = 0
    for module in cuda_sources():
        ptx = compile_ptx(module, "sm_90")
        starts = [m.start() for m in re.finditer(r"^\.(visible\s+)?\.entry\s", ptx, re.M)] + [len(ptx)]
        for a, b in zip(starts, starts[1:]):
            body = ptx[a:b]
            name = re.search(r"\.entry\s+(\w+)", body).group(1)
            wait, first = body.find("griddepcontrol.wait"), mem.search(body)
            assert wait >= 0, f"cuda/{module}.cu: {name} never waits (griddepcontrol.wait)"
            assert first is None or wait < first.start(), \
                f"cuda/{module}.cu: {name} touches global memory before it waits: {first.group(0).strip()!r}"
            n += 1
    assert n >= 190, n
