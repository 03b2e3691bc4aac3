"""Run the whole kernel lab and write the results under docs/lab/ (one command, on the GPU machine).

    python dev/cuda/run_all.py                 # every op script, every variant -> docs/lab/
    python dev/cuda/run_all.py --quick         # default block sizes only, fewer repeats
    python dev/cuda/run_all.py softmax_forward matmul_forward
    python dev/cuda/run_all.py --tar $OUT/lab.tar.gz   # also pack docs/lab (the GPU tool returns few files)

Each dev/cuda/<op>.py runs in its own process with --md docs/lab/<op>.md --png docs/lab/<op>.png;
docs/lab/README.md gets the date, the device and one line per op (pass/fail, best variant).
"""
import argparse
import datetime
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SKIP = {"lab.py", "run_all.py", "encoder_backward_trace.py"}  # (the trace: a measurement, no table)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*", help="op scripts to run (default: all)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(ROOT / "docs" / "lab"))
    p.add_argument("--tar", help="also write a .tar.gz of the output folder here")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scripts = sorted(s for s in HERE.glob("*.py") if s.name not in SKIP)
    if args.ops:
        scripts = [s for s in scripts if s.stem in args.ops]
    summary = []
    device = "?"
    for s in scripts:
        md, png = out / f"{s.stem}.md", out / f"{s.stem}.png"
        md.unlink(missing_ok=True)
        cmd = [sys.executable, str(s), "--md", str(md), "--png", str(png)] + (["--quick"] if args.quick else [])
        t0 = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True)
        (out / f"{s.stem}.log").write_text(r.stdout + r.stderr)
        m = re.search(r"^# \S+ on (.+?) \(", r.stdout, re.M)
        device = m.group(1) if m else device
        status = "ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})"
        print(f"{s.stem:28s} {status:18s} {time.time() - t0:6.1f} s", flush=True)
        summary.append((s.stem, status))
    lines = [f"# Kernel lab results — {device}, {datetime.date.today().isoformat()}", "",
             "Produced by `python dev/cuda/run_all.py` on the GPU machine: every variant validated against "
             "the float64 numpy reference (poisoned outputs), then timed with CUDA events, L2 flushed "
             "before each repeat, median of the repeats. Full tables in the per-op files.", "",
             "| op | validation | table | chart |", "| --- | --- | --- | --- |"]
    ran = dict(summary)
    for md in sorted(out.glob("*.md")):  # ops run earlier (a subset run keeps their rows)
        if md.stem != "README" and md.stem not in ran:
            ran[md.stem] = "ok (earlier run)"
    for name, status in sorted(ran.items()):
        lines.append(f"| {name} | {status} | [{name}.md]({name}.md) | [{name}.png]({name}.png) |")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    if args.tar:
        with tarfile.open(args.tar, "w:gz") as tf:
            tf.add(out, arcname="lab")
    return 0 if all(s == "ok" for _, s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
