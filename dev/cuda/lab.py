"""The kernel lab's shared harness: validate every variant, then time it, then print a table.

A lab script (dev/cuda/<op>.py) reads top to bottom the same way every time:

    import lab
    L = lab.Lab("layernorm_forward")          # argv: [variant ...] [--repeat N] [--md PATH] [--png PATH] [--quick]
    spec = llmc.ops.get("layernorm_forward")
    for n in L.selected(spec):
        launch = spec.build(L.rt, n, N=N, C=C)
        L.validate(n, lambda: launch(...), outputs={"out": d_out}, refs={"out": ref}, atol=1e-5, rtol=1e-5)
        L.time(n, lambda: launch(...), bytes=..., ceiling="dram")
    L.finish()

Validation poisons every output (0xFF bytes: fp32 NaN, bf16 NaN), runs once and compares against the
float64 reference (|got - ref| <= atol + rtol*|ref|; NaN = unwritten fails; bf16 outputs, uint16
DevArrays, are compared as the values they hold). Timing: warm-up, then CUDA
events around each repeat with the L2 cache flushed before it (a 2x-L2 memset), median reported
with GB/s or TFLOP/s and the fraction of the ceiling measured on the H100 (CEILINGS below).
Memory-bound rows (bytes=, ceiling "dram") also get the floor at their own size: a device-to-device
copy of the same bytes (half read, half written), timed the same way once per size, and the "% of
copy" column. A short kernel pays launch, ramp-up and tail that a 2x-L2 copy does not; this column
says how much of the gap to the ceiling is that, and how much is the kernel's own.
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys

import numpy as np

from llmc.bf16 import BF16, from_bf16
from llmc.testing import compare

# Ceilings measured on the lent H100 80GB HBM3 (the project's anchor runs, 2026-11-22)
CEILINGS = {
    "dram": ("GB/s", 2980.0),     # device-to-device copy, bytes read + written
    "fp32": ("TFLOP/s", 51.0),    # plain FP32 GEMM 8192^3
    "tf32": ("TFLOP/s", 377.0),   # TF32 tensor-core GEMM 8192^3
}


def parser(op: str) -> argparse.ArgumentParser:
    """The command line every lab script takes (Lab parses it)."""
    p = argparse.ArgumentParser(description=f"kernel lab: {op}")
    p.add_argument("variants", nargs="*", type=int, help="variant numbers to run (default: all)")
    p.add_argument("--repeat", type=int, default=50, help="timed repeats per configuration")
    p.add_argument("--quick", action="store_true", help="fewer repeats, default block size only")
    p.add_argument("--md", help="append the results table (markdown) to this file")
    p.add_argument("--png", help="write a bar chart of the results to this PNG")
    p.add_argument("--no-l2-flush", action="store_true", help="time with a warm L2 (llm.c's way)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both",
                   help="element type of the builds to run (scripts that have bf16 rows)")
    p.add_argument("--batch", type=int, help="batch size B (scripts that take it; default theirs)")
    p.add_argument("--sets", type=lambda v: [x for x in v.split(",") if x], metavar="NAME[,NAME...]",
                   help="the input sets to run, by name (scripts that have several, e.g. encoder_backward's id "
                        "distributions; default theirs)")
    p.add_argument("--define", action="append", default=[], metavar="MODULE:NAME=VALUE",
                   help="an extra -D define for every build of cuda/MODULE.cu (a kernel's tunable macro, "
                        "e.g. encoder:ENC7_COMB_BATCH=8); repeatable")
    return p


class Lab:
    def __init__(self, op: str, argv=None):
        p = self.parser = parser(op)
        self.args = p.parse_args(argv)
        if self.args.quick:
            self.args.repeat = min(self.args.repeat, 10)
        self.op = op
        from llmc import switches
        from llmc.errors import LLMCError
        from llmc.runtime import Runtime, parse_defines
        try:
            switches.check_environment()  # (an LLMC_* switch's bad value: one line, before any build)
            defines = parse_defines(self.args.define)
            self.rt = Runtime()  # (LLMC_DEFINES: parsed as it starts)
        except LLMCError as e:  # a bad define or switch: one line and exit 2
            p.error(str(e))
        for m, d in defines.items():  # on top of LLMC_DEFINES's
            self.rt.extra_defines.setdefault(m, {}).update(d)
        defines = self.rt.extra_defines
        self.rows: list[dict] = []
        self.failed: list[str] = []
        self.validated: set = set()
        self.group = None  # rows are compared with the reference lines of their own group
        self.copy_ms: dict[int, float] = {}  # bytes: median ms of a device-to-device copy of that many
        print(f"# {op} on {self.rt.name} ({self.rt.arch}, {self.rt.sm_count} SMs)"
              + "".join(f"\n# built with -D{n}={v} in cuda/{m}.cu" for m, d in defines.items() for n, v in d.items()))

    def section(self, name: str) -> None:
        """Start a group of rows (one shape, say): "vs ref" compares within the group."""
        self.group = name

    # -- selection
    def selected(self, spec_or_numbers) -> list[int]:
        have = sorted(spec_or_numbers.variants) if hasattr(spec_or_numbers, "variants") else sorted(spec_or_numbers)
        if not self.args.variants:
            return have
        missing = [v for v in self.args.variants if v not in have]
        if missing:
            print(f"{self.op}: no variant {missing}; have {have}")
            sys.exit(2)
        return [v for v in have if v in self.args.variants]

    def chosen_sets(self, have, default):
        """The input sets to run, by name: --sets's (each one of `have`), else `default`. An unknown name
        is argparse's one-line error (exit 2)."""
        names = self.args.sets or list(default)
        bad = [n for n in names if n not in have]
        if bad:
            self.parser.error(f"--sets {','.join(bad)}: this lab has {', '.join(have)}")
        return names

    def dtypes(self, variant) -> list[str]:
        """The element types to run for this Variant: those it has builds for, less --dtype's filter."""
        want = ("fp32", "bf16") if self.args.dtype == "both" else (self.args.dtype,)
        return [d for d in variant.dtypes if d in want]

    def block_sizes(self, sizes):
        """The block sizes to sweep (just the first with --quick)."""
        return list(sizes)[:1] if self.args.quick else list(sizes)

    # -- validation
    def validate(self, variant, fn, outputs: dict, refs: dict, atol: float, rtol: float,
                 init: dict | None = None) -> bool:
        """Poison outputs (or set them to `init` values for accumulating outputs), run fn once,
        compare each output with its reference. Prints OK or the first mismatches."""
        init = init or {}
        for name, dev in outputs.items():
            if name in init:
                dev.set(init[name])
            else:
                dev.fill_bytes(0xFF)
        fn()
        self.rt.synchronize()
        ok = True
        for name, dev in outputs.items():
            got = dev.get()
            if got.dtype == BF16:  # bf16 outputs: compared as the values their bits hold
                got = from_bf16(got)
            msg = compare(got, refs[name], atol, rtol, name)
            if msg:
                ok = False
                print(f"  variant {variant}: MISMATCH\n{msg}")
        if ok:
            print(f"  variant {variant}: all outputs match the reference ({', '.join(outputs)})")
            self.validated.add(variant)
        else:
            self.failed.append(str(variant))
        return ok

    # -- timing
    def _record(self, label, ms_list, block_size, bytes, flops, ceiling, kind="ours", copies=1):
        med = statistics.median(ms_list)
        row = {"variant": label, "block": block_size if block_size is not None else "",
               "ms": med, "spread": (max(ms_list) - min(ms_list)) / med if med else 0.0, "kind": kind,
               "group": self.group}
        unit, peak = CEILINGS[ceiling] if ceiling else (None, None)
        if flops:
            row["rate"] = flops / (med * 1e-3) / 1e12
            row["unit"] = "TFLOP/s"
        elif bytes:
            row["rate"] = bytes / (med * 1e-3) / 1e9
            row["unit"] = "GB/s"
        if "rate" in row and peak and unit == row["unit"]:
            row["frac"] = row["rate"] / peak
        if kind != "copy" and bytes and ceiling == "dram" and not flops and (bytes, copies) in self.copy_ms:
            row["copy_frac"] = self.copy_ms[bytes, copies] / med
        self.rows.append(row)
        rate = f"{row['rate']:9.1f} {row['unit']}" if "rate" in row else ""
        frac = f" ({100 * row['frac']:.0f}% of {ceiling}" if "frac" in row else ""
        if frac:
            frac += f", {100 * row['copy_frac']:.0f}% of a copy of the same bytes)" if "copy_frac" in row else ")"
        bs = f" bs={block_size}" if block_size is not None else ""
        print(f"  {label}{bs}: {med:.4f} ms {rate}{frac}")
        return med

    def time(self, variant, fn, block_size=None, bytes=None, flops=None, ceiling="dram", copies=1):
        """Median of CUDA-event times over --repeat runs, L2 flushed before each. A memory-bound row is
        compared with a copy of its bytes: one copy, or (copies=n, for a sequence of n launches on
        buffers of their own) n copies of bytes / n each, back to back, each between buffers of its own."""
        if variant not in self.validated and str(variant) not in self.failed and not isinstance(variant, str):
            print(f"  warning: variant {variant} timed without validate()")
        if bytes and ceiling == "dram" and not flops:
            self.copy_floor(bytes, copies)
        ms = self.rt.time_ms(fn, warmup=3, repeat=self.args.repeat, flush_l2=not self.args.no_l2_flush)
        return self._record(str(variant), ms, block_size, bytes, flops, ceiling, copies=copies)

    def copy_floor(self, nbytes: int, copies: int = 1) -> float:
        """Time (once per size and count) device-to-device copies moving nbytes in all (each nbytes //
        (2 copies) read and written), L2 flushed as for the rows; adds a "copy" row. Returns its median ms."""
        if (nbytes, copies) not in self.copy_ms:
            half = max(1, nbytes // (2 * copies))
            pairs = [(self.rt.empty((half,), np.uint8), self.rt.empty((half,), np.uint8)) for _ in range(copies)]
            for src, _ in pairs:
                src.fill_bytes(0x3C)
            drv, stream = self.rt.drv, self.rt.stream

            def run():
                for src, dst in pairs:
                    drv.memcpy_dtod_async(dst.ptr, src.ptr, half, stream)
            ms = self.rt.time_ms(run, warmup=3, repeat=self.args.repeat, flush_l2=not self.args.no_l2_flush)
            what = f"{nbytes / 1e6:.1f} MB" if copies == 1 else f"{copies} x {nbytes / copies / 1e6:.1f} MB"
            self.copy_ms[nbytes, copies] = self._record(f"copy, same bytes ({what})", ms, None, 2 * half * copies,
                                                        None, "dram", kind="copy")
        return self.copy_ms[nbytes, copies]

    def reference(self, label, fn, bytes=None, flops=None, ceiling="dram"):
        """A vendor-library line (cuBLAS via torch, ...), timed with torch's CUDA events."""
        import torch
        for _ in range(3):
            fn()
        flush = torch.empty(2 * self.rt.l2_bytes, dtype=torch.uint8, device="cuda")
        times = []
        for i in range(self.args.repeat):
            flush.fill_(i & 0xFF)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); e.synchronize()
            times.append(s.elapsed_time(e))
        return self._record(label, times, None, bytes, flops, ceiling, kind="reference")

    # -- output
    def table(self) -> str:
        lines = [f"### {self.op} — {self.rt.name}, {datetime.date.today().isoformat()}", "",
                 "| variant | block | median ms | achieved | % of ceiling | % of a copy of the same bytes "
                 "| speed vs the best reference (same group) |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]
        best_ref = {}
        for r in self.rows:
            if r["kind"] == "reference":
                best_ref[r["group"]] = min(best_ref.get(r["group"], r["ms"]), r["ms"])
        for r in self.rows:
            ach = f"{r['rate']:.1f} {r['unit']}" if "rate" in r else ""
            frac = f"{100 * r['frac']:.0f}%" if "frac" in r else ""
            cfrac = f"{100 * r['copy_frac']:.0f}%" if "copy_frac" in r else ""
            ref = best_ref.get(r["group"])
            vs = f"{ref / r['ms']:.2f}x" if ref and r["kind"] != "copy" else ""
            lines.append(f"| {r['variant']} | {r['block']} | {r['ms']:.4f} | {ach} | {frac} | {cfrac} | {vs} |")
        return "\n".join(lines)

    def best_rows(self) -> list[dict]:
        """Fastest row per variant label (over block sizes)."""
        best = {}
        for r in self.rows:
            if r["variant"] not in best or r["ms"] < best[r["variant"]]["ms"]:
                best[r["variant"]] = r
        return list(best.values())

    def png(self, path: str) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = self.best_rows()
        labels = [r["variant"] for r in rows]
        vals = [r.get("rate", 0.0) for r in rows]
        unit = next((r["unit"] for r in rows if "unit" in r), "")
        fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(rows) + 2), 3.5))
        colors = ["#888888" if r["kind"] == "reference" else "#3b75af" for r in rows]
        ax.bar(labels, vals, color=colors)
        ax.set_ylabel(unit)
        ax.set_title(f"{self.op} ({self.rt.name})")
        for r in rows:
            if r.get("unit") == "GB/s":
                ax.axhline(CEILINGS["dram"][1], color="r", lw=0.8, ls="--")
                break
        plt.xticks(rotation=30, ha="right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def finish(self) -> None:
        print()
        print(self.table())
        if self.args.md:
            with open(self.args.md, "a") as f:
                f.write(self.table() + "\n\n")
        if self.args.png and self.rows:
            self.png(self.args.png)
        if self.failed:
            print(f"\nFAILED validation: variants {', '.join(self.failed)}")
            sys.exit(1)


def rand(rng, shape, dtype=np.float32, scale=1.0):
    """Random normal inputs (never zeros)."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def sdpa_backend_name(kernel_names) -> str:
    """Which SDPA backend ran, from the names of the CUDA kernels it launched."""
    text = " ".join(kernel_names).lower()
    return ("cuDNN" if "cudnn" in text else "FlashAttention-2" if "flash_fwd" in text or "flash_bwd" in text
            else "memory-efficient" if "fmha" in text or "efficient" in text else "math")


def sdpa_backends(torch, fn):
    """The torch SDPA reference lines of an attention lab: [(label, fn)] for torch's own choice of backend
    (named after the kernel it ran, found with torch's profiler: cuDNN's fused kernel on Hopper with
    recent torch, where it once was FlashAttention-2) and for the FlashAttention-2 and cuDNN backends
    forced, each left out with a note where it cannot run. fn() runs the SDPA call being timed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def kernels(f):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            f()
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type.name == "CUDA"]

    out = []
    try:
        out.append((f"default backend: {sdpa_backend_name(kernels(fn))}", fn))
    except Exception as e:  # (the profiler unavailable: the line without its backend's name)
        print(f"note: torch's profiler could not name SDPA's default kernel ({str(e).splitlines()[0][:80]})")
        out.append(("default backend", fn))
    for label, backend in (("FlashAttention-2", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def forced(backend=backend):
            with sdpa_kernel(backend):
                return fn()
        try:
            forced()
            torch.cuda.synchronize()
        except Exception as e:
            print(f"note: torch SDPA with the {label} backend forced is not available here "
                  f"({str(e).splitlines()[0][:80]})")
            continue
        out.append((f"{label} forced", forced))
    return out
