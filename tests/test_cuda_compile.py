"""Every cuda/*.cu compiles with nvcc for sm_90 (H100) and sm_80 (A100), with no register spills
and no local-memory stack frame in any kernel (ptxas -v report parsed). No GPU needed."""
import pytest

from llmc.runtime import ARCH_SPECIFIC, compile_cubin, cuda_sources, nvcc_path, resource_report

pytestmark = pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")


def test_there_are_kernels():
    assert len(cuda_sources()) >= 8, cuda_sources()


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("module", cuda_sources())
def test_compiles_without_spills(module, arch):
    if module in ARCH_SPECIFIC:  # built only for its own target (sm_90a for wgmma)
        if arch != ARCH_SPECIFIC[module].rstrip("a"):
            pytest.skip(f"cuda/{module}.cu is built for {ARCH_SPECIFIC[module]} only")
        arch = ARCH_SPECIFIC[module]
    _, log = compile_cubin(module, arch)
    report = resource_report(log)
    assert report, f"cuda/{module}.cu: no kernels in the ptxas report"
    bad = {k: r for k, r in report.items() if r["spill_stores"] or r["spill_loads"] or r["stack"]}
    assert not bad, f"cuda/{module}.cu for {arch}: spills or local memory in {bad}"
