"""A/B of whole training steps: dev/bench_step.py under two or more settings, interleaved.

    python dev/bench_ab.py -b 16 --precision bf16 --env LLMC_FUSED_DGELU=1 --env LLMC_FUSED_DGELU=0
    python dev/bench_ab.py -b 4 --rounds 5 --env "" --env LLMC_QKV_IN_PLACE=0,LLMC_FUSED_BIAS=0
    python dev/bench_ab.py --env "" --env "" -- --attention-kernel 3     # flags after -- go to bench_step
    python dev/bench_ab.py --precision bf16 --env "" --env "LLMC_PDL=0 -- --encoder-backward-kernel 7"
    python dev/bench_ab.py -b 16 --env "tree=c40942d" --env ""           # an older commit against this tree

Each --env is one configuration: comma-separated NAME=VALUE pairs set in bench_step's environment
("" = the defaults); bench_step flags of that configuration alone follow a " -- " inside it. The configurations run in turn, round after round (A B A B ...), each in a
fresh process, so a drift of the machine (clocks, other tenants) lands on all of them alike; the
table gives every round's median step time (CUDA events, bench_step's own) and, per configuration,
the median over rounds and its difference from the first. Differences smaller than the rounds'
spread are noise. `tree=REV` (or `tree=DIR`) in a configuration runs that configuration's bench_step
from another tree of the repository: a git revision of this one, extracted once into a temporary
directory (`git archive`), or a directory holding a checkout; its llmc and cuda/ sources come first on
PYTHONPATH (the kernel cache is keyed by the sources, so the trees share it). A configuration whose run fails (a variant refusing the shape, a crash) says why in
one line and drops out; the others finish their rounds, and the exit status is 1.
"""
import argparse
import atexit
import io
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from llmc import switches
from llmc.errors import LLMCError

STEP = re.compile(r"step: median ([0-9.]+) ms")


ROOT = Path(__file__).resolve().parents[1]


def parse_env(spec: str) -> tuple[dict, list, str | None]:
    """'A=1,B=x' -> ({'A': '1', 'B': 'x'}, [], None); '' -> ({}, [], None); 'A=1 -- --flag 7' -> ({'A': '1'},
    ['--flag', '7'], None); 'tree=abc123,A=1' -> ({'A': '1'}, [], 'abc123')."""
    out, tree = {}, None
    pairs, sep, flags = spec.partition("--")
    flags = shlex.split(sep + flags)[1:] if sep else []
    for part in filter(None, (p.strip() for p in pairs.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise SystemExit(f"bench_ab: --env {spec!r}: expected NAME=VALUE pairs separated by commas")
        if name == "tree":
            tree = value
            continue
        out[name] = value
    try:  # each LLMC_* value checked here, before any round runs (an unknown name: a note on stderr)
        switches.check_environment(out)
    except LLMCError as e:
        raise SystemExit(f"bench_ab: --env {spec!r}: {e}") from None
    return out, flags, tree


def resolve_tree(tree: str, spec: str, tmp: Path) -> Path:
    """The directory of a configuration's tree=: an existing checkout (with dev/bench_step.py), else a git
    revision of this repository, extracted under tmp once."""
    d = Path(tree)
    if d.is_dir():
        if not (d / "dev" / "bench_step.py").is_file():
            raise SystemExit(f"bench_ab: --env {spec!r}: {tree} has no dev/bench_step.py (expected a checkout of "
                             "this repository)")
        return d.resolve()
    if shutil.which("git") is None:
        raise SystemExit(f"bench_ab: --env {spec!r}: {tree} is not a directory, and there is no git to read it as a "
                         "revision")
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", tree + "^{commit}"],
                         capture_output=True, text=True)
    if rev.returncode != 0:
        raise SystemExit(f"bench_ab: --env {spec!r}: {tree!r} is neither a directory nor a git revision of {ROOT}")
    d = tmp / rev.stdout.strip()
    if not d.is_dir():
        arc = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev.stdout.strip()], capture_output=True)
        if arc.returncode != 0:
            raise SystemExit(f"bench_ab: --env {spec!r}: git archive {tree} failed: "
                             f"{arc.stderr.decode(errors='replace').strip()}")
        d.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(arc.stdout)) as t:  # (the "data" filter where tarfile has it)
            t.extractall(d, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return d


def check_tree_import(d: Path, env: dict, spec: str) -> None:
    """The tree's llmc must be the one its bench_step imports (an installed llmc must not shadow it)."""
    r = subprocess.run([sys.executable, "-c", "import llmc; print(llmc.__file__)"], env={**os.environ, **env},
                       capture_output=True, text=True, cwd=d)
    got = r.stdout.strip()
    if r.returncode != 0 or not Path(got).resolve().is_relative_to(d.resolve()):
        raise SystemExit(f"bench_ab: --env {spec!r}: its bench_step would import llmc from {got or '(nothing)'}, "
                         f"not from {d}")


def run_once(cmd, env: dict) -> float | str:
    """bench_step's median step (ms), or the one line saying why the run failed."""
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    m = STEP.search(r.stdout)
    if r.returncode != 0 or m is None:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        return (f"bench_ab: {' '.join(cmd)} with {env or 'the defaults'} failed (exit {r.returncode}): "
                + " | ".join(tail))
    return float(m.group(1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", action="append", default=[], help="one configuration: NAME=VALUE[,NAME=VALUE]")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-b", "--batch-size", type=int, default=4)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--cmd", default=None, help=argparse.SUPPRESS)  # the tests' stand-in for bench_step
    ap.add_argument("rest", nargs="*", help="flags for bench_step (after --)")
    args = ap.parse_args(argv)
    if len(args.env) < 2:
        ap.error("give two or more --env configurations")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    envs = [parse_env(e) for e in args.env]
    tmp = Path(tempfile.mkdtemp(prefix="bench_ab_"))  # (the extracted trees; removed at exit)
    atexit.register(shutil.rmtree, tmp, True)
    common = ["-b", str(args.batch_size), "--precision", args.precision] + args.rest
    cmds = []  # per configuration: bench_step (this tree's, or the tests' stand-in) or another tree's
    for spec, (env, flags, tree) in zip(args.env, envs):
        if tree is None:
            script = args.cmd or str(Path(__file__).with_name("bench_step.py"))
        else:
            d = resolve_tree(tree, spec, tmp)
            script = str(d / "dev" / "bench_step.py")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(d), os.environ.get("PYTHONPATH")]))
            if args.cmd is None:  # (the tests' stand-in trees hold no llmc)
                check_tree_import(d, env, spec)
        cmds.append([sys.executable, script] + common + flags)
    # a configuration whose run fails (a variant that refuses the shape, a crash) says why in one line on
    # stderr and drops out; the others go on, and bench_ab exits 1 after their table
    times, failed = [[] for _ in envs], [None] * len(envs)
    for r in range(args.rounds):
        for i, (env, _flags, _tree) in enumerate(envs):
            if failed[i] is None:
                t = run_once(cmds[i], env)
                if isinstance(t, str):
                    failed[i] = t
                    print(t, file=sys.stderr, flush=True)
                else:
                    times[i].append(t)
        print(f"round {r + 1}: " + "  ".join(f"{t[-1]:.2f}" if f is None else "  -  " for t, f in zip(times, failed)),
              flush=True)
    if failed[0] is not None:
        raise SystemExit(f"bench_ab: the first configuration ({args.env[0] or 'the defaults'}), the one the others are "
                         "compared with, failed (above)")
    first = statistics.median(times[0])
    print(f"B={args.batch_size} {args.precision} {' '.join(args.rest)}".rstrip())
    for env, t, f in zip(args.env, times, failed):
        if f is not None:
            print(f"  {env or '(defaults)':50s} failed (its line on stderr)")
            continue
        med = statistics.median(t)
        print(f"  {env or '(defaults)':50s} median {med:8.2f} ms  ({med - first:+.2f} ms, {100 * (med / first - 1):+.1f}%)"
              f"  rounds {min(t):.2f}-{max(t):.2f}")
    if any(f is not None for f in failed):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
