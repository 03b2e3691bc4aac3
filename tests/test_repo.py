"""The tree's own rules (docs/architecture.md), checked on the CPU: one name per op everywhere, no
import cycle inside llmc/, no sys.path edits in dev/ or tests/, no tracked file naming a path
outside the repository.

    python -m pytest tests/test_repo.py -q
"""
import ast
import subprocess
from pathlib import Path

import pytest

from llmc import ops

ROOT = Path(__file__).resolve().parent.parent


def tracked(*patterns) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / f for f in out.stdout.split()]


@pytest.mark.parametrize("name", sorted(ops.registry()))
def test_one_name_per_op(name):
    """cuda/<family>.cu holds the op's <op>_kernel<N> entry points, llmc/ops/<family>.py its OpSpec,
    tests/test_<family>.py its tests and dev/cuda/<op>.py its lab script."""
    spec = ops.get(name)
    fam = spec.family
    for path in (f"cuda/{fam}.cu", f"llmc/ops/{fam}.py", f"tests/test_{fam}.py", f"dev/cuda/{name}.py"):
        assert (ROOT / path).exists(), f"{name}: no {path}"
    assert type(spec).__module__ == "llmc.ops" and spec in __import__(f"llmc.ops.{fam}", fromlist=["OPS"]).OPS
    if all(v.engine is not None and v.engine > 0 and not v.uses for v in spec.variants.values()) and \
            not any(f"{name}_kernel" in line for line in (ROOT / "cuda" / f"{fam}.cu").read_text().splitlines()):
        return  # every variant is GEMMs on the engines (matmul_backward): its kernels are cuda/gemm.cu's
    entries = [line for line in (ROOT / "cuda" / f"{fam}.cu").read_text().splitlines() if "__global__" in line]
    assert any(name in line for line in entries), f"cuda/{fam}.cu has no entry point named for {name}"


def _llmc_imports(path: Path, module: str) -> set[str]:
    """Every llmc module `path` imports, at the top or inside functions (a lazy import still ties
    the two modules together)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("llmc")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("llmc"):
            for a in node.names:  # `from llmc.ops import softmax` imports the submodule llmc.ops.softmax
                sub = f"{node.module}.{a.name}"
                out.add(sub if (ROOT / (sub.replace(".", "/") + ".py")).exists() else node.module)
    return out - {module}


def test_no_import_cycle_in_llmc():
    mods = {}
    for p in (ROOT / "llmc").rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        mods[name] = p
    graph = {m: {d for d in _llmc_imports(p, m) if d in mods} for m, p in mods.items()}
    # a package imports its submodules by name at run time (llmc.ops.registry): not an edge here,
    # but a submodule importing its package is, and that is fine (the package never imports it back)
    state, cycle = {}, []

    def visit(m, stack):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycle, "import cycles: " + "; ".join(" -> ".join(c) for c in cycle)
    assert "llmc.decode" not in graph["llmc.sample"] and "llmc.decode" not in graph["llmc.ops.sample"]


def test_no_sys_path_edits_in_dev_or_tests():
    """dev/ and tests/ import llmc as installed (pip install -e .) or from the repository root
    (pytest's pythonpath); none of them edits sys.path."""
    bad = [str(p.relative_to(ROOT)) for p in tracked("dev", "tests")
           if p.suffix == ".py" and "sys.path" in p.read_text() and p.name != "test_repo.py"]
    assert not bad, bad


def test_no_tracked_file_names_a_path_outside_the_repository():
    outside = ("../" + "shared", "/" + "work/", "../../" + "shared")  # spelled apart: this file must not match itself
    bad = []
    for p in tracked():
        if p.suffix in (".png", ".bin", ".gz") or not p.is_file() or p.name == "test_repo.py":
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{p.relative_to(ROOT)}: {s}" for s in outside if s in text]
    assert not bad, bad


def test_gpu_session_phases_are_the_documented_ones():
    """dev/gpu_session.sh: the script parses, and the phases its header documents are the ones its
    case statement runs (and the default PHASES names only those)."""
    import re
    path = ROOT / "dev" / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    doc = text.split("#   (the device machine's")[0]  # the phase list ends where the how-to-run lines begin
    header = set(re.findall(r"^#   ([a-z]+) ", doc, re.M))
    cases = set(re.findall(r"^([a-z]+)\)$", text, re.M))
    default = set(re.search(r'PHASES=\$\{PHASES:-([a-z ]+)\}', text).group(1).split())
    assert header == cases, (sorted(header), sorted(cases))
    assert default <= cases, sorted(default - cases)
