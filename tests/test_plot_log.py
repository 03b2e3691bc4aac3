"""dev/plot_log.py: parses llm.c's main.log lines (a resumed step keeps its last value) and writes a
PNG with a loss panel, plus a HellaSwag panel when eval lines are there.

    python -m pytest tests/test_plot_log.py -q      # needs matplotlib (requirements-test.txt)
"""
import importlib.util
import struct
import subprocess
import sys

import pytest

from conftest import ROOT

# dev/plot_log.py is a script, not a package module: load it from its file
_spec = importlib.util.spec_from_file_location("plot_log", ROOT / "dev" / "plot_log.py")
plot_log = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_log)

LOG = """s:0 tel:10.8357
s:1 trl:10.8411 lr:0.000300 norm:3.21
s:2 trl:10.7179 lr:0.000300 norm:2.90
garbage line
s:2 tel:10.5000
s:2 eval:0.2600
s:3 trl:10.6000
s:2 trl:10.7000 lr:0.000300 norm:2.90
s:x trl:1
s:4 trl:oops
"""


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])   # IHDR: width, height


def test_parse(tmp_path):
    (tmp_path / "main.log").write_text(LOG)
    d = plot_log.parse_log(tmp_path / "main.log")
    assert d["trl"] == {1: 10.8411, 2: 10.7, 3: 10.6}     # step 2 logged again (a resume): the last wins
    assert d["tel"] == {0: 10.8357, 2: 10.5} and d["eval"] == {2: 0.26}


def test_png_panels(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    (tmp_path / "a" / "main.log").write_text(LOG)
    (tmp_path / "b" / "main.log").write_text("\n".join(l for l in LOG.splitlines() if "eval" not in l))
    run = lambda *a: subprocess.run([sys.executable, str(ROOT / "dev" / "plot_log.py"), *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True)
    p = run(tmp_path / "a" / "main.log")
    assert p.returncode == 0, p.stderr
    assert "HellaSwag 1 points" in p.stdout
    with_eval = png_size(tmp_path / "a" / "main.png")
    p = run(tmp_path / "b" / "main.log", "-o", tmp_path / "b.png")
    assert p.returncode == 0, p.stderr
    without = png_size(tmp_path / "b.png")
    assert with_eval[0] > 1.5 * without[0] and with_eval[1] == without[1]   # two panels vs one
    p = run(tmp_path / "a" / "main.log", tmp_path / "b" / "main.log", "-o", tmp_path / "both.png")
    assert p.returncode == 0 and "2 logs" in p.stdout


def test_bad_logs_are_one_line(tmp_path):
    (tmp_path / "x.log").write_text("hello\nworld\n")
    for path, needle in ((tmp_path / "nope.log", "not found"), (tmp_path / "x.log", "no `s:<step>")):
        p = subprocess.run([sys.executable, str(ROOT / "dev" / "plot_log.py"), str(path)], capture_output=True, text=True)
        assert p.returncode == 1 and needle in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr
