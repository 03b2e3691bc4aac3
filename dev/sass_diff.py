"""Did a change to cuda/ change the machine code? Each module is built from this tree and from another
revision, and the two cubins' SASS (cuobjdump -sass, encodings included) is compared function by
function. No GPU: nvcc and cuobjdump (llmc.runtime.sass: PATH, the CUDA install, or the pip wheels of
requirements-test.txt). A refactor whose every function comes out identical runs the same instructions
as before, so it needs no GPU re-test; any other change does.

    python dev/sass_diff.py                                   # against HEAD: the modules whose sources differ
    python dev/sass_diff.py --base 46d6b5d gemm_wgmma attention_wgmma
    python dev/sass_diff.py --base HEAD~1 gemm_wgmma --define gemm_wgmma:GEMM_DESC_STEP=0

Prints, per module: how many functions are identical, each function whose SASS differs (with the number
of instruction lines that differ) and those only one side has. Exit status 0 when every function of every
module compared is identical, 1 when any differs, 2 when a build fails or a tool is missing. The cubins go
to the kernel cache (LLMC_CACHE), keyed by the sources, so both sides' builds are reused by the next run and
by the trainer. Session 45 checked its clean-up of cuda/gemm_wgmma.cu and cuda/hopper.cuh this way (three
builds of gemm_wgmma and attention_wgmma identical to the previous commit's).

ptxas is not always deterministic: on a loaded machine the same source can come out in more than one form
(session 46: layernorm_backward_kernel5_colsum_bf16_nv5 in two forms over four builds at once on 2 CPUs; one
after the other, four builds gave one). So a module with functions that differ is built again, --rebuilds
times a side (default 2), one build at a time, each into an empty cache; a function whose forms on the two
sides overlap is reported as "varies" (the same code the base can produce), not as a difference.
"""
import argparse
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FUNC = re.compile(r"^\s*Function : (\S+)\s*$", re.M)


def functions(sass_text: str) -> dict:
    """{function name: its SASS text (instruction lines, blank lines dropped)} of a cuobjdump -sass listing."""
    parts = FUNC.split(sass_text)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        lines = [ln.rstrip() for ln in body.splitlines() if ln.strip()]
        out[name] = "\n".join(ln for ln in lines if not ln.lstrip().startswith(".headerflags"))
    return out


def compare(new: dict, old: dict) -> dict:
    """Function maps of two builds -> {"same": [names], "differ": {name: instruction lines that differ},
    "added": [names only in new], "removed": [names only in old]}."""
    same, differ = [], {}
    for name in sorted(set(new) & set(old)):
        if new[name] == old[name]:
            same.append(name)
        else:
            a, b = new[name].splitlines(), old[name].splitlines()
            differ[name] = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
    return {"same": same, "differ": differ, "added": sorted(set(new) - set(old)),
            "removed": sorted(set(old) - set(new))}


def settle(differ: dict, new_builds: list, old_builds: list) -> tuple:
    """After rebuilds: differ ({name: lines}) split into (still differing, varying), where a name varies when
    some build of the tree and some build of the base gave it the same SASS (function maps, one a build)."""
    still, varies = {}, []
    for name, n in differ.items():
        forms_new = {b.get(name) for b in new_builds}
        forms_old = {b.get(name) for b in old_builds}
        if (forms_new & forms_old) - {None}:
            varies.append(name)
        else:
            still[name] = n
    return still, varies


def includes(text: str) -> set:
    return set(re.findall(r'^\s*#include\s+"([^"]+)"', text, re.M))


def changed_modules(base: str, cuda_dir: Path) -> list:
    """The modules of cuda/ whose sources differ between base and the working tree (modules_touching)."""
    r = subprocess.run(["git", "diff", "--name-only", base, "--", "cuda/"], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"sass_diff: git diff {base}: {r.stderr.strip()}")
    return modules_touching({Path(p).name for p in r.stdout.split()}, cuda_dir)


def modules_touching(changed: set, cuda_dir: Path) -> list:
    """The modules of cuda_dir whose .cu, or a header it includes (directly or through another header), is
    one of the changed file names."""
    headers = {p.name: includes(p.read_text()) for p in cuda_dir.glob("*.cuh")}
    mods = []
    for cu in sorted(cuda_dir.glob("*.cu")):
        seen, todo = set(), list(includes(cu.read_text()))
        while todo:  # the headers it reaches
            h = todo.pop()
            if h not in seen:
                seen.add(h)
                todo += headers.get(h, ())
        if cu.name in changed or seen & changed:
            mods.append(cu.stem)
    return mods


def build(tree: Path | None, module: str, arch: str, defines: dict) -> Path:
    """The cubin of cuda/<module>.cu of this checkout (tree None) or of an extracted tree, built by that
    tree's own llmc.runtime (its flags, its cache key)."""
    if tree is None:
        from llmc.runtime import compile_cubin
        return compile_cubin(module, arch, defines)[0]
    code = (f"from llmc.runtime import compile_cubin\n"
            f"print(compile_cubin({module!r}, {arch!r}, {defines!r})[0])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(tree)})
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
    return Path(r.stdout.strip().splitlines()[-1])


def rebuild_sass(tree: Path, module: str, arch: str, defines: dict) -> str:
    """One more build of tree's cuda/<module>.cu into an empty cache (ptxas afresh), its SASS listing."""
    from llmc.runtime import sass
    with tempfile.TemporaryDirectory() as cache:
        code = (f"from llmc.runtime import compile_cubin\n"
                f"print(compile_cubin({module!r}, {arch!r}, {defines!r})[0])")
        r = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(tree), "LLMC_CACHE": cache})
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}")
        return sass(Path(r.stdout.strip().splitlines()[-1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", help="modules of cuda/ (default: those whose sources differ from --base)")
    ap.add_argument("--base", default="HEAD", help="the revision to compare with (default HEAD)")
    ap.add_argument("--define", action="append", default=[], metavar="MODULE:NAME=VALUE",
                    help="a -D define for that module's builds on both sides (repeatable)")
    ap.add_argument("--rebuilds", type=int, default=2,
                    help="builds of each side again where functions differ (ptxas may vary; default 2)")
    args = ap.parse_args(argv)
    from llmc.runtime import ARCH_SPECIFIC, CUDA_DIR, CudaError, nvcc_path, sass
    if nvcc_path() is None:
        print("sass_diff: nvcc not found", file=sys.stderr)
        return 2
    defines: dict = {}
    for d in args.define:
        mod, sep, rest = d.partition(":")
        name, sep2, value = rest.partition("=")
        if not (sep and sep2 and mod and name):
            raise SystemExit(f"sass_diff: --define {d!r}: expected MODULE:NAME=VALUE")
        defines.setdefault(mod, {})[name] = value
    mods = args.modules or changed_modules(args.base, CUDA_DIR)
    if not mods:
        print(f"no module of cuda/ differs from {args.base}")
        return 0
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "archive", "--format=tar", args.base, "cuda", "llmc"], cwd=ROOT, capture_output=True)
        if tar.returncode != 0:
            raise SystemExit(f"sass_diff: git archive {args.base}: {tar.stderr.decode().strip()}")
        tarfile.open(fileobj=io.BytesIO(tar.stdout)).extractall(tmp)
        for m in mods:
            arch = ARCH_SPECIFIC.get(m, "sm_90")
            d = defines.get(m, {})
            what = f"{m} ({arch}{''.join(f' -D{k}={v}' for k, v in d.items())})"
            if not (Path(tmp) / "cuda" / f"{m}.cu").exists():
                print(f"{what}: not in {args.base}")
                status = max(status, 1)
                continue
            try:
                new_cubin, old_cubin = build(None, m, arch, d), build(Path(tmp), m, arch, d)
            except (CudaError, RuntimeError) as e:
                print(f"{what}: build failed: {e}", file=sys.stderr)
                return 2
            new_sass, old_sass = sass(new_cubin), sass(old_cubin)
            if new_sass is None or old_sass is None:
                print("sass_diff: cuobjdump (and nvdisasm) not found: pip install nvidia-cuda-cuobjdump "
                      "nvidia-cuda-nvdisasm", file=sys.stderr)
                return 2
            c = compare(functions(new_sass), functions(old_sass))
            varies: list = []
            if c["differ"] and args.rebuilds > 0:  # ptxas may vary: more builds of both sides, one at a time
                try:
                    news = [functions(new_sass)] + [functions(rebuild_sass(ROOT, m, arch, d))
                                                    for _ in range(args.rebuilds)]
                    olds = [functions(old_sass)] + [functions(rebuild_sass(Path(tmp), m, arch, d))
                                                    for _ in range(args.rebuilds)]
                except RuntimeError as e:
                    print(f"{what}: rebuild failed: {e}", file=sys.stderr)
                    return 2
                c["differ"], varies = settle(c["differ"], news, olds)
                c["same"] = sorted(c["same"] + varies)
            ok = not (c["differ"] or c["added"] or c["removed"])
            print(f"{what}: {len(c['same'])} functions identical to {args.base}'s"
                  + ("" if ok else f", {len(c['differ'])} differ, {len(c['added'])} new, {len(c['removed'])} gone"))
            for name in varies:
                print(f"  varies: {name} (ptxas gave it more than one form; the tree's and the base's overlap)")
            for name, n in c["differ"].items():
                print(f"  differs: {name} ({n} instruction lines, in {1 + args.rebuilds} builds of each side)")
            for name in c["added"]:
                print(f"  new: {name}")
            for name in c["removed"]:
                print(f"  gone: {name}")
            status = max(status, 0 if ok else 1)
    return status


if __name__ == "__main__":
    sys.exit(main())
