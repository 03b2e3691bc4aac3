"""The GPU's board power, SM clock and clock-limit reasons while a benchmark runs, sampled by
nvidia-smi in the background (dev/bench_step.py --power).

Why: a d12 bf16 step at B=16 draws the H100's 700 W cap; the driver then lowers the SM clock ("SW
power cap") and the same step takes longer. A step time means little without knowing whether the
clock was capped while it was measured.
"""
import shutil
import subprocess

FIELDS = "power.draw,clocks.sm,clocks_throttle_reasons.active"
# bits of clocks_throttle_reasons.active (nvidia-smi --help-query-gpu)
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown",
           0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake"}


class PowerSampler:
    """nvidia-smi sampling one GPU every interval_ms until stop()."""

    def __init__(self, gpu: str, interval_ms: int = 100):
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        self.proc = subprocess.Popen(["nvidia-smi", "-i", gpu, f"--query-gpu={FIELDS}",
                                      "--format=csv,noheader,nounits", "-lms", str(interval_ms)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop(self) -> str:
        """The samples as one line of text (or why there are none)."""
        if self.proc is None:
            return "power: nvidia-smi not found"
        self.proc.terminate()
        try:
            out, _ = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return describe(parse(out))


def parse(text: str) -> list[tuple[float, float, int]]:
    """'312.40, 1980, 0x0000000000000004' lines -> [(watts, MHz, reasons bitmask)]; others skipped."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            rows.append((float(parts[0]), float(parts[1]), int(parts[2], 16)))
        except ValueError:
            continue
    return rows


def describe(rows) -> str:
    """One line: median and max board power, the SM clock's range, and how many samples had each
    clock-limit reason (idle and application-clock settings left out)."""
    if not rows:
        return "power: no samples"
    watts = sorted(r[0] for r in rows)
    mhz = [r[1] for r in rows]
    counts = {name: sum(1 for r in rows if r[2] & bit) for bit, name in REASONS.items() if bit > 0x2}
    limits = ", ".join(f"{name} in {n}/{len(rows)}" for name, n in counts.items() if n) or "none"
    return (f"power: median {watts[len(watts) // 2]:.0f} W, max {watts[-1]:.0f} W | SM clock "
            f"{min(mhz):.0f}-{max(mhz):.0f} MHz | clock limited by: {limits} ({len(rows)} samples)")
