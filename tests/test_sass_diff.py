"""dev/sass_diff.py (does a change to cuda/ change the machine code?): its function-by-function comparison
of cuobjdump listings, which modules a changed file reaches, and one real run where nvcc and cuobjdump
are found (CI: requirements-test.txt's wheels). No GPU."""
import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("sass_diff", ROOT / "dev" / "sass_diff.py")
sd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sd)

LISTING = """
\tcode for sm_90a
\t\tFunction : {a}
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 {flags}"
        /*0000*/                   LDC R1, c[0x0][0x28] ;             /* 0x00000a00ff017b82 */
                                                                      /* 0x000fe20000000800 */
        /*0010*/                   {op} R2, SR_TID.X ;                /* 0x0000000000027919 */
                                                                      /* 0x000e220000002100 */
\t\t..........

\t\tFunction : {b}
\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90"
        /*0000*/                   EXIT ;                             /* 0x000000000000794d */
                                                                      /* 0x000fea0003800000 */
"""


def test_functions_and_compare():
    old = sd.functions(LISTING.format(a="k1", b="k2", op="S2R", flags="X"))
    assert set(old) == {"k1", "k2"} and "LDC" in old["k1"] and "EXIT" in old["k2"]
    # the header flags are not code: the same instructions are identical whatever they say
    same = sd.functions(LISTING.format(a="k1", b="k2", op="S2R", flags="Y"))
    assert sd.compare(same, old) == {"same": ["k1", "k2"], "differ": {}, "added": [], "removed": []}
    # one instruction changed (its line), a function renamed: one gone, one new
    new = sd.functions(LISTING.format(a="k1", b="k3", op="S2UR", flags="X"))
    c = sd.compare(new, old)
    assert c["same"] == [] and c["differ"] == {"k1": 1} and c["added"] == ["k3"] and c["removed"] == ["k2"]


def test_a_function_ptxas_varies_is_settled_by_overlapping_forms():
    """settle(): a differing function whose forms over the rebuilds overlap on the two sides varies (not a
    difference); one whose forms never meet still differs; a function one build lacks is no form."""
    a, b, c = "LDC R1", "S2R R2", "EXIT"
    news = [{"k1": a, "k2": c}, {"k1": b, "k2": c}]
    olds = [{"k1": b, "k2": a}, {"k2": b}]
    still, varies = sd.settle({"k1": 1, "k2": 1}, news, olds)
    assert varies == ["k1"] and still == {"k2": 1}
    assert sd.settle({"k3": 2}, [{"k3": a}], [{}]) == ({"k3": 2}, [])


def test_a_header_reaches_the_modules_that_include_it():
    cuda = ROOT / "cuda"
    assert sd.modules_touching({"hopper.cuh"}, cuda) == ["attention_wgmma", "gemm_wgmma"]
    assert sd.modules_touching({"gelu.cu"}, cuda) == ["gelu"]
    # elem.cuh is reached through layernorm.cuh too (layernorm.cu, residual_layernorm.cu include only that)
    via = sd.modules_touching({"elem.cuh"}, cuda)
    assert {"gelu", "gemm_wgmma", "layernorm", "residual_layernorm"} <= set(via)
    assert sd.modules_touching({"README.md"}, cuda) == []


def test_a_real_run_against_head():
    """Where nvcc and cuobjdump are found: the working tree's residual module against HEAD's, identical
    when cuda/residual.cu is unchanged (exit 0), and a bad --define is one line."""
    from llmc.runtime import cuobjdump_env, nvcc_path
    if nvcc_path() is None or cuobjdump_env() is None:
        pytest.skip("nvcc or cuobjdump not found")
    r = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "cuda/residual.cu", "cuda/common.cuh",
                        "cuda/elem.cuh"], cwd=ROOT)
    if r.returncode != 0:
        pytest.skip("cuda/residual.cu or its headers have uncommitted changes")
    r = subprocess.run([sys.executable, str(ROOT / "dev" / "sass_diff.py"), "residual"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "functions identical to HEAD's" in r.stdout and "differ" not in r.stdout
    r = subprocess.run([sys.executable, str(ROOT / "dev" / "sass_diff.py"), "--define", "residual"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "expected MODULE:NAME=VALUE" in r.stderr
