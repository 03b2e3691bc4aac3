"""dev/prebuild.py: the modules it compiles ahead of time are those a training step builds."""
import importlib.util
from pathlib import Path

import pytest

from llmc.runtime import nvcc_path

ROOT = Path(__file__).resolve().parent.parent


def _prebuild():
    spec = importlib.util.spec_from_file_location("prebuild", ROOT / "dev" / "prebuild.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(nvcc_path() is None, reason="the fake runtime checks entry points against nvcc's PTX")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_prebuild_sees_every_module_of_a_step(precision):
    wanted = _prebuild().wanted_modules("d12", precision, 4, 64, {})
    modules = {m for m, _ in wanted}
    # the forward, backward and update of a d12 step: every op's module, the engines on sm_90a
    assert modules >= {"encoder", "layernorm", "residual_layernorm", "gemm_wgmma", "attention_wgmma", "gelu", "classifier",
                       "global_norm", "adamw"}, sorted(modules)
    # a variant named on the command line changes what is built: --softmax-kernel 5 selects the
    # composite attention (fp32), built from the softmax kernels
    if precision == "fp32":
        composite = {m for m, _ in _prebuild().wanted_modules("d12", precision, 4, 64, {"softmax_forward": 5})}
        assert "softmax" in composite and "softmax" not in modules, sorted(composite)


@pytest.mark.skipif(nvcc_path() is None, reason="the fake runtime checks entry points against nvcc's PTX")
def test_prebuild_adds_llmc_defines(monkeypatch):
    """LLMC_DEFINES (what a Runtime adds to every build of a module) reaches the builds prebuild asks for:
    the cubins a `dev/bench_ab.py --env LLMC_DEFINES=...` run will look up, and no other module's."""
    monkeypatch.setenv("LLMC_DEFINES", "gemm_wgmma:LLMC_TEST_DEFINE=3")
    wanted = _prebuild().wanted_modules("d12", "bf16", 4, 64, {})
    gemm = [dict(d) for m, d in wanted if m == "gemm_wgmma"]
    assert gemm and all(d.get("LLMC_TEST_DEFINE") == "3" for d in gemm), gemm
    assert not any("LLMC_TEST_DEFINE" in dict(d) for m, d in wanted if m != "gemm_wgmma")
