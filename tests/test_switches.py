"""The LLMC_* switches (llmc/switches.py): one table, the only reader, each value checked."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmc import switches
from llmc.errors import LLMCError

ROOT = Path(__file__).resolve().parent.parent
CODE = sorted(p for d in ("llmc", "dev") for p in (ROOT / d).rglob("*.py")) + [ROOT / "train_gpt2.py",
                                                                               ROOT / "sample_gpt2.py"]


def test_only_the_switch_table_reads_the_environment_for_llmc_names():
    """A read of os.environ with an LLMC_ name anywhere else would skip the value's check and the table."""
    for p in CODE:
        if p.name == "switches.py":
            continue
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if "LLMC_" in line and re.search(r"environ\.get\(|environ\[[^]]*\](?!\s*=)|getenv\(", line):
                assert False, f"{p.relative_to(ROOT)}:{i} reads an LLMC_ variable itself: {line.strip()}"


def test_every_switch_the_code_names_is_in_the_table_and_every_entry_is_used():
    named = set()
    for p in CODE:
        if p.name == "switches.py":
            continue
        text = p.read_text()
        named |= set(re.findall(r'switches\.(?:on|flag|value)\("(LLMC_[A-Z0-9_]+)"\)', text))
        named |= set(re.findall(r'^[A-Z0-9_]+_ENV = "(LLMC_[A-Z0-9_]+)"', text, flags=re.M))
    named.add("LLMC_CACHE")  # (CACHE_DIR, read at import)
    assert named - set(switches.SWITCHES) == set()
    assert set(switches.SWITCHES) - named == set(), "entries of the table that no code reads"


def test_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- switches:[^\n]*-->\n(.*?)\n<!-- /switches -->", readme, flags=re.S)
    assert m, "README.md lost its <!-- switches --> block"
    assert m.group(1) == switches.markdown(), "README's switch table is stale: paste `python -m llmc.switches`"
    doc = (ROOT / "docs" / "switches.md").read_text()
    assert [n for n in switches.SWITCHES if n != "LLMC_CACHE" and f"`{n}" not in doc] == []


@pytest.mark.parametrize("raw,want", [("0", False), ("1", True), ("", None)])
def test_a_flag_takes_0_or_1_and_empty_is_unset(monkeypatch, raw, want):
    monkeypatch.setenv("LLMC_FUSED_GELU", raw)  # (before the table, an empty value turned this one on)
    assert switches.flag("LLMC_FUSED_GELU") is want
    assert switches.on("LLMC_FUSED_GELU") is (False if want is None else want)
    monkeypatch.delenv("LLMC_FUSED_GELU")
    assert switches.flag("LLMC_FUSED_GELU") is None and switches.on("LLMC_FUSED_GELU") is False
    assert switches.on("LLMC_GRAPHS") is True


@pytest.mark.parametrize("name,raw", [("LLMC_GRAPHS", "yes"), ("LLMC_GRAPHS", "off"), ("LLMC_SYNC", "true"),
                                      ("LLMC_PDL", "2"), ("LLMC_ATT_BWD_STAGES", "5"), ("LLMC_WGMMA_SCHEDULE", "fast"),
                                      ("LLMC_ATT5_HEAD_GROUP", "0"), ("LLMC_ATT5_HEAD_GROUP", "x"),
                                      ("LLMC_DIST_TIMEOUT", "0"), ("LLMC_DIST_TIMEOUT", "nan"),
                                      ("LLMC_WGMMA_SPLIT_OVER_TS", "-1"), ("LLMC_WGMMA_TS_MAX_K", "1.5"),
                                      ("LLMC_WGMMA_TS_WIDTHS", "wide"), ("LLMC_DP_GATHER", "later")])
def test_a_value_a_switch_does_not_take_is_one_line_naming_it(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(LLMCError) as e:
        switches.value(name)
    msg = str(e.value)
    assert msg.startswith(f"{name}={raw!r}: expected ") and "\n" not in msg
    with pytest.raises(LLMCError, match=name):
        switches.check_environment()


@pytest.mark.parametrize("name,raw,want", [("LLMC_ATT5_HEAD_GROUP", "12", 12), ("LLMC_DIST_TIMEOUT", "2.5", 2.5),
                                           ("LLMC_WGMMA_SPLIT_OVER_TS", "0", 0.0), ("LLMC_WGMMA_TS_MAX_K", "-1", -1),
                                           ("LLMC_WGMMA_TS_WIDTHS", "128:192", (128, 192)),
                                           ("LLMC_DP_LAUNCH", "layer", "layer"), ("LLMC_ATT_BWD_STAGES", "3", "3")])
def test_values_a_switch_takes(monkeypatch, name, raw, want):
    monkeypatch.setenv(name, raw)
    assert switches.value(name) == want
    switches.check_environment()


def test_defines_are_checked_at_start(monkeypatch):
    monkeypatch.setenv("LLMC_DEFINES", "encoder:ENC7_COMB_BATCH=2 encoder:ENC7_COMB_BATCH")
    with pytest.raises(LLMCError, match="LLMC_DEFINES 'encoder:ENC7_COMB_BATCH': expected MODULE:NAME=VALUE"):
        switches.check_environment()
    monkeypatch.setenv("LLMC_DEFINES", " encoder:ENC7_COMB_BATCH=2  classifier:X=1 ")
    assert switches.value("LLMC_DEFINES") == " encoder:ENC7_COMB_BATCH=2  classifier:X=1 "
    switches.check_environment()  # (that each module exists is the Runtime's check: llmc.runtime.parse_defines)


def test_a_name_that_is_no_switch_gets_a_note_with_the_nearest(capsys):
    switches.check_environment({"LLMC_GRAPH": "0", "LLMC_SOMETHING_ELSE": "1", "PATH": "/bin"})
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].startswith("note: LLMC_GRAPH is not one of llmc's switches (did you mean LLMC_GRAPHS?)")
    assert err[1].startswith("note: LLMC_SOMETHING_ELSE is not one of llmc's switches;")
    switches.check_environment({"LLMC_GRAPH": "0"}, notes=False)  # (the other ranks of a job say nothing)
    assert capsys.readouterr().err == ""


def test_an_unknown_name_in_the_code_is_a_programming_error():
    with pytest.raises(KeyError, match="LLMC_NOPE"):
        switches.value("LLMC_NOPE")


def test_the_trainer_and_the_sampler_stop_in_one_line_on_a_bad_value(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LLMC_GRAPHS": "yes", "LLMC_OFFLINE": "1"}
    for script in ("train_gpt2.py", "sample_gpt2.py"):
        r = subprocess.run([sys.executable, str(ROOT / script), "--device", "cpu"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, (script, r.stdout, r.stderr)
        assert r.stderr.strip() == "error: LLMC_GRAPHS='yes': expected 0 or 1", (script, r.stderr)


@pytest.mark.parametrize("script", ["dev/bench_step.py", "dev/cuda/encoder_forward.py"])
def test_the_step_bench_and_the_lab_stop_in_one_line_on_a_bad_value(tmp_path, script):
    """Before any GPU work (so also here, without one): the usage line and one error line, exit 2."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LLMC_SYNC": "true"}
    r = subprocess.run([sys.executable, str(ROOT / script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1].endswith("error: LLMC_SYNC='true': expected 0 or 1"), r.stderr
    assert "Traceback" not in r.stderr
