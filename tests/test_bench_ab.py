"""dev/bench_ab.py (the interleaved A/B of whole steps) with a stand-in for dev/bench_step.py that
prints a step time from its environment: the order of the runs, the parsing, the medians and the
one-line errors. No GPU."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT

FAKE = '''
import os, sys
log = os.environ["AB_LOG"]
with open(log, "a") as f:
    f.write(os.environ.get("X", "-") + " " + " ".join(sys.argv[1:]) + "\\n")
if os.environ.get("X") == "fail":
    print("Traceback: boom", file=sys.stderr)
    sys.exit(3)
n = sum(1 for _ in open(log))
print(f"step: median {10.0 + float(os.environ.get('X', '0')) + 0.01 * n:.2f} ms (GPU events)")
'''


def _run(tmp_path, *args):
    fake = tmp_path / "fake_step.py"
    fake.write_text(FAKE)
    log = tmp_path / "log.txt"
    r = subprocess.run([sys.executable, str(ROOT / "dev" / "bench_ab.py"), "--cmd", str(fake), *args],
                       capture_output=True, text=True, env={"AB_LOG": str(log), "PATH": "/usr/bin:/bin"}, timeout=120)
    return r, log.read_text().splitlines() if log.exists() else []


def test_interleaved_rounds_and_medians(tmp_path):
    r, log = _run(tmp_path, "-b", "16", "--precision", "bf16", "--rounds", "3", "--env", "X=0", "--env", "X=2",
                  "--", "--attention-kernel", "3")
    assert r.returncode == 0, r.stderr
    # A B A B A B, each with bench_step's flags and the ones after --
    assert [line.split()[0] for line in log] == ["0", "2"] * 3
    assert all(line.split()[1:] == ["-b", "16", "--precision", "bf16", "--attention-kernel", "3"] for line in log)
    out = r.stdout
    assert "round 3: 10.05  12.06" in out
    assert "X=0" in out and "median    10.03 ms  (+0.00 ms" in out
    assert "X=2" in out and "median    12.04 ms  (+2.01 ms, +20.0%)" in out


def test_flags_of_one_configuration(tmp_path):
    """Flags after " -- " inside an --env go to that configuration's runs only, after the common ones."""
    r, log = _run(tmp_path, "--rounds", "2", "--env", "X=0", "--env", "X=1 -- --encoder-backward-kernel 7",
                  "--env", "-- --foo 'a b'", "--", "--bar")
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in log] == ["0", "1", "-"] * 2
    common = ["-b", "4", "--precision", "fp32", "--bar"]
    for i, line in enumerate(log):
        want = common + [[], ["--encoder-backward-kernel", "7"], ["--foo", "a", "b"]][i % 3]
        assert line.split()[1:] == want


def test_a_failing_configuration_drops_out_and_the_others_finish(tmp_path):
    """A configuration whose run fails says why in one line and runs no more; the others finish every
    round and get their table rows; the exit status is 1."""
    r, log = _run(tmp_path, "--rounds", "3", "--env", "X=0", "--env", "X=fail", "--env", "X=2")
    assert r.returncode == 1 and r.stderr.count("failed (exit 3)") == 1, r.stderr
    assert "Traceback (most recent call last)" not in r.stderr
    assert [line.split()[0] for line in log] == ["0", "fail", "2", "0", "2", "0", "2"]
    assert "round 3:" in r.stdout and "X=fail" in r.stdout and "failed (its line on stderr)" in r.stdout
    assert "X=2" in r.stdout and "(+2.0" in r.stdout


@pytest.mark.parametrize("args,why", [(["--env", "X=0"], "two or more"), (["--env", "X", "--env", "X=1"], "NAME=VALUE"),
                                      (["--env", "X=0", "--env", "X=fail"], "failed (exit 3)"),
                                      (["--env", "X=fail", "--env", "X=0"], "the first configuration"),
                                      (["--env", "X=0", "--env", "X=1,LLMC_GRAPHS=yes"],
                                       "--env 'X=1,LLMC_GRAPHS=yes': LLMC_GRAPHS='yes': expected 0 or 1")])
def test_bad_input_is_one_line(tmp_path, args, why):
    r, log = _run(tmp_path, *args)
    assert r.returncode != 0 and why in r.stderr and "Traceback (most recent call last)" not in r.stderr, r.stderr
    if "LLMC_" in why:
        assert log == [], "a switch's bad value must stop bench_ab before its first round"


TREE_STEP = '''
import os, sys
with open(os.environ["AB_LOG"], "a") as f:
    f.write("tree " + os.environ["PYTHONPATH"].split(os.pathsep)[0] + " " + " ".join(sys.argv[1:]) + "\\n")
print("step: median 9.00 ms (GPU events)")
'''


def test_a_configuration_from_another_tree(tmp_path):
    """tree=DIR runs that directory's dev/bench_step.py with DIR first on PYTHONPATH (its llmc and cuda/),
    in turn with the others, and labels its row with the configuration as given."""
    tree = tmp_path / "old"
    (tree / "dev").mkdir(parents=True)
    (tree / "dev" / "bench_step.py").write_text(TREE_STEP)
    r, log = _run(tmp_path, "--rounds", "2", "--env", f"tree={tree}", "--env", "X=1", "--", "--tokens", "t.bin")
    assert r.returncode == 0, r.stderr
    assert [line.split()[0] for line in log] == ["tree", "1"] * 2
    assert all(line.split()[1:] == [str(tree), "-b", "4", "--precision", "fp32", "--tokens", "t.bin"]
               for line in log[::2])
    assert f"tree={tree}" in r.stdout and "median     9.00 ms  (+0.00 ms" in r.stdout


def test_a_tree_from_a_git_revision(tmp_path):
    """tree=REV extracts that commit of this repository once (git archive) and runs its bench_step."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_ab", ROOT / "dev" / "bench_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    d = ab.resolve_tree("HEAD", "tree=HEAD", tmp_path)
    assert (d / "dev" / "bench_step.py").is_file() and (d / "llmc" / "model.py").is_file()
    stamp = (d / "llmc" / "model.py").stat().st_mtime_ns
    assert ab.resolve_tree("HEAD", "tree=HEAD", tmp_path) == d  # (extracted once)
    assert (d / "llmc" / "model.py").stat().st_mtime_ns == stamp
    assert ab.resolve_tree(str(d), "tree=...", tmp_path) == d.resolve()


@pytest.mark.parametrize("tree,why", [("no-such-rev", "neither a directory nor a git revision"),
                                      (".", "no dev/bench_step.py")])
def test_a_bad_tree_is_one_line(tmp_path, tree, why):
    r, log = _run(tmp_path, "--env", f"tree={tmp_path if tree == '.' else tree}", "--env", "X=0")
    assert r.returncode != 0 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert log == []


def test_a_tree_imports_its_own_llmc(tmp_path):
    """An extracted revision's bench_step imports that tree's llmc (PYTHONPATH first), and a tree whose llmc
    would come from elsewhere stops with one line."""
    import importlib.util
    import os
    spec = importlib.util.spec_from_file_location("bench_ab", ROOT / "dev" / "bench_ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    d = ab.resolve_tree("HEAD", "tree=HEAD", tmp_path)
    ab.check_tree_import(d, {"PYTHONPATH": str(d)}, "tree=HEAD")
    other = tmp_path / "empty"
    other.mkdir()
    with pytest.raises(SystemExit, match="would import llmc from"):
        ab.check_tree_import(other, {"PYTHONPATH": os.pathsep.join([str(other), str(ROOT)])}, "tree=x")
