"""dev/bench_gemm.py --plot: the chart of a saved run (no GPU): a TF32 panel per batch size, and a BF16 panel
beside it when the run has the bf16 rows timed in turn; the ratio over engine 5's bars.

    python -m pytest tests/test_bench_gemm.py -q      # needs matplotlib (requirements-test.txt)
"""
import importlib.util
import json
import struct
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("matplotlib")

_spec = importlib.util.spec_from_file_location("bench_gemm", ROOT / "dev" / "bench_gemm.py")
bench_gemm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_gemm)


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])   # IHDR: width, height


def _rows(bf16):
    rows = []
    for B in (4, 16):
        for layer, gemm in (("qkv", "fwd"), ("fc", "dweight")):
            r = {"B": B, "layer": layer, "gemm": gemm, "cublas_tf32": 0.05, "engine5_tf32": 0.04}
            r.update({f"tflops_{k}": v for k, v in (("cublas_tf32", 300.0), ("engine4", 150.0), ("engine5_tf32", 310.0))})
            if bf16:
                r.update(bf16_cublas=0.025, bf16_engine5=0.026, tflops_bf16_cublas=600.0, tflops_bf16_engine5=577.0)
            rows.append(r)
    return rows


@pytest.mark.parametrize("bf16", [False, True])
def test_plot_has_a_bf16_panel_when_the_run_has_bf16_rows(tmp_path, bf16):
    (tmp_path / "run.json").write_text(json.dumps(_rows(bf16)))
    bench_gemm.plot(str(tmp_path / "run.json"), str(tmp_path / "chart.png"), "test machine")
    w, h = png_size(tmp_path / "chart.png")
    assert h > 400 and (w > 2 * h if bf16 else w < 2 * h)   # two panels across, or one


def test_plot_takes_two_or_three_arguments(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps(_rows(True)))
    out = subprocess.run([sys.executable, str(ROOT / "dev" / "bench_gemm.py"), "--plot", str(tmp_path / "run.json")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--plot takes JSON PNG [LABEL]" in out.stderr
    out = subprocess.run([sys.executable, str(ROOT / "dev" / "bench_gemm.py"), "--plot", str(tmp_path / "run.json"),
                          str(tmp_path / "c.png"), "H200"], capture_output=True, text=True)
    assert out.returncode == 0 and (tmp_path / "c.png").exists(), out.stderr
