"""The GPU's board power, SM clock and clock-limit reasons while a benchmark runs, sampled by
nvidia-smi in the background (dev/bench_step.py --power), and the board's energy counter (NVML)
around a run (Energy: joules a step, a call).

Why: a d12 bf16 step at B=16 draws the board's 700 W cap; the driver then lowers the SM clock ("SW
power cap") and the same step takes longer. A step time means little without knowing whether the
clock was capped while it was measured, and at the cap a step's time is its energy over 700 W.

The power sampled is nvidia-smi's `power.draw.instant` where the driver has it: `power.draw` is an
average over about a second on recent drivers, which mixes the idle time before a short run into
its figure (session 40's B=16 line read "median 327 W" at the cap; the instant draw was 700-775 W).
"""
import ctypes
import shutil
import subprocess

FIELDS = "power.draw.instant,clocks.sm,clocks_throttle_reasons.active"
FIELDS_OLD = "power.draw,clocks.sm,clocks_throttle_reasons.active"  # drivers without the instant draw
# bits of clocks_throttle_reasons.active (nvidia-smi --help-query-gpu)
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "SW power cap", 0x8: "HW slowdown",
           0x20: "SW thermal", 0x40: "HW thermal", 0x80: "HW power brake"}


class PowerSampler:
    """nvidia-smi sampling one GPU every interval_ms until stop()."""

    def __init__(self, gpu: str, interval_ms: int = 100):
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        probe = subprocess.run(["nvidia-smi", "-i", gpu, f"--query-gpu={FIELDS}", "--format=csv,noheader"],
                               capture_output=True, text=True)
        fields = FIELDS if probe.returncode == 0 else FIELDS_OLD
        self.proc = subprocess.Popen(["nvidia-smi", "-i", gpu, f"--query-gpu={fields}",
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


class Energy:
    """The board's energy counter (NVML's total energy consumption, millijoules since the driver
    loaded), read through libnvidia-ml with ctypes (it comes with the driver; no package). A run's
    energy is the difference of two reads around it, each after the GPU's work is done. The counter
    advances every few tens of ms, so a run of a second or more reads within a few percent.
    `why` says why there is no counter (then read() returns None)."""

    def __init__(self, pci_bus_id: str):
        self.lib, self.handle, self.why = None, None, None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            self.why = "libnvidia-ml.so.1 not found"
            return
        handle = ctypes.c_void_p()
        if lib.nvmlInit_v2() != 0:
            self.why = "nvmlInit failed"
        elif lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id.encode(), ctypes.byref(handle)) != 0:
            self.why = f"no NVML device at PCI {pci_bus_id}"
        elif lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(ctypes.c_ulonglong())) != 0:
            self.why = "the energy counter is not supported here"
        else:
            self.lib, self.handle = lib, handle

    def read(self) -> float | None:
        """Joules since the driver loaded (None without a counter)."""
        if self.lib is None:
            return None
        mj = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(mj)) != 0:
            return None
        return mj.value / 1000.0

    def sm_clock(self) -> int | None:
        """The SM clock now, MHz (NVML_CLOCK_SM)."""
        if self.lib is None:
            return None
        mhz = ctypes.c_uint()
        return mhz.value if self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(mhz)) == 0 else None


def describe_energy(joules: float | None, seconds: float, n: int, what: str = "step", why: str | None = None) -> str:
    """One line: joules per `what` over n of them in `seconds` of wall time, and the mean board power."""
    if joules is None:
        return f"energy: no counter ({why or 'NVML unavailable'})"
    return (f"energy: {joules / n:.3f} J a {what} ({joules:.1f} J over {n} in {seconds:.2f} s: "
            f"mean {joules / seconds:.0f} W)")
