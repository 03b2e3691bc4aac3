"""Plot train/val loss (and HellaSwag accuracy when logged) from llm.c-format main.log files.

    python dev/plot_log.py out/main.log                          # -> out/main.png
    python dev/plot_log.py out/main.log -o loss.png --title "d12 on tiny shakespeare"
    python dev/plot_log.py run1/main.log run2/main.log -o cmp.png   # several runs, one colour each
    python dev/plot_log.py out/main.log --hellaswag-baseline 0.2945 # a reference line (llm.c's 124M figure)

Reads the lines llm.c's trainer writes (and ours): `s:<step> trl:<train loss> [lr:<lr> norm:<norm>]`,
`s:<step> tel:<val loss>`, `s:<step> eval:<HellaSwag accuracy>`. Other keys and other lines are
ignored. A step logged twice (a resumed run appends to its log) keeps its last value, as llm.c's
notebook does. Without matplotlib: pip install matplotlib (or pip install .[plot]).
"""
import argparse
import sys
from pathlib import Path

KEYS = {"trl": "train loss", "tel": "val loss", "eval": "HellaSwag"}


def parse_log(path) -> dict:
    """{key: {step: value}} for trl, tel and eval in an llm.c main.log."""
    out = {k: {} for k in KEYS}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if not fields or not fields[0].startswith("s:"):
                continue
            try:
                step = int(fields[0][2:])
            except ValueError:
                continue
            for field in fields[1:]:
                key, _, value = field.partition(":")
                if key in out:
                    try:
                        out[key][step] = float(value)
                    except ValueError:
                        pass
    return out


def plot(logs, out_path, title=None, baseline=None) -> None:
    import matplotlib
    matplotlib.use("Agg")   # files only, no display needed
    import matplotlib.pyplot as plt

    has_eval = any(d["eval"] for _, d in logs)
    fig, axes = plt.subplots(1, 2 if has_eval else 1, figsize=(14 if has_eval else 8, 5), squeeze=False)
    ax = axes[0][0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, d) in enumerate(logs):
        c = colors[i % len(colors)]
        tag = f"{name}: " if len(logs) > 1 else ""
        if d["trl"]:
            steps = sorted(d["trl"])
            ax.plot(steps, [d["trl"][s] for s in steps], color=c, alpha=0.45, lw=1, label=f"{tag}train loss")
        if d["tel"]:
            steps = sorted(d["tel"])
            ax.plot(steps, [d["tel"][s] for s in steps], color=c, lw=2, marker="o", ms=3, label=f"{tag}val loss")
            last = steps[-1]
            ax.annotate(f"{d['tel'][last]:.4f}", (last, d["tel"][last]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8, color=c)
    ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.set_title("loss"); ax.grid(alpha=0.3); ax.legend()
    if has_eval:
        ax = axes[0][1]
        for i, (name, d) in enumerate(logs):
            if d["eval"]:
                steps = sorted(d["eval"])
                ax.plot(steps, [d["eval"][s] for s in steps], color=colors[i % len(colors)], lw=2, marker="o",
                        ms=3, label=name if len(logs) > 1 else "HellaSwag")
        if baseline is not None:
            ax.axhline(baseline, color="r", ls="--", lw=1, label=f"baseline {baseline:g}")
        ax.axhline(0.25, color="gray", ls=":", lw=1, label="chance (0.25)")
        ax.set_xlabel("step"); ax.set_ylabel("accuracy"); ax.set_title("HellaSwag"); ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("logs", nargs="+", type=Path, help="main.log files (llm.c format)")
    p.add_argument("-o", "--output", type=Path, default=None, help="PNG to write (default: the first log's name with .png)")
    p.add_argument("--title", default=None)
    p.add_argument("--hellaswag-baseline", type=float, default=None, help="draw a reference accuracy")
    args = p.parse_args(argv)
    logs = []
    for path in args.logs:
        if not path.is_file():
            print(f"error: {path}: not found", file=sys.stderr)
            return 1
        d = parse_log(path)
        if not any(d.values()):
            print(f"error: {path}: no `s:<step> trl:/tel:/eval:` lines (not an llm.c main.log?)", file=sys.stderr)
            return 1
        logs.append((str(path.parent.name or path.name), d))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: dev/plot_log.py needs matplotlib: pip install matplotlib (or pip install .[plot])",
              file=sys.stderr)
        return 1
    out = args.output or args.logs[0].with_suffix(".png")
    plot(logs, out, args.title, args.hellaswag_baseline)
    summary = ", ".join(f"{KEYS[k]} {len(v)} points" for k, v in logs[0][1].items() if v)
    print(f"wrote {out} ({summary}{'; ' + str(len(logs)) + ' logs' if len(logs) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
