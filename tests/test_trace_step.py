"""dev/trace_step.py's timeline arithmetic (the GPU part needs torch with CUDA): union of intervals,
idle gaps, two-stream overlap, per-kernel totals, the cut into steps and the chrome-trace parsing,
on hand-made timelines whose answers are known. No GPU."""
import importlib.util

import pytest

from tests.conftest import ROOT


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "dev" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ts():
    return _load("trace_step")


def test_union_length(ts):
    assert ts.union_length([]) == 0
    assert ts.union_length([(0, 10)]) == 10
    assert ts.union_length([(0, 10), (5, 15)]) == 15            # overlapping
    assert ts.union_length([(0, 10), (2, 3)]) == 10             # nested
    assert ts.union_length([(20, 30), (0, 10)]) == 20           # disjoint, unsorted
    assert ts.union_length([(0, 10), (10, 12)]) == 12           # touching


def test_summarize_two_streams(ts):
    # main stream: A 0-10, B 12-20, C 25-30; side: D 14-27 (overlaps B and C and fills the gap 20-25)
    ks = [(0, 10, 1, "A(int)"), (12, 20, 1, "B"), (14, 27, 2, "D"), (25, 30, 1, "C")]
    sm = ts.summarize(ks)
    assert sm["span"] == 30
    assert sm["busy"] == 28                      # idle only 10-12
    assert sm["gaps"] == [2]
    assert sm["overlap"] == (10 + 8 + 5) + 13 - 28  # per-stream unions minus the overall union = 8
    assert sm["streams"] == {1: 3, 2: 1}
    assert sm["by_name"] == {"A": 10, "B": 8, "C": 5, "D": 13}  # argument lists dropped from names
    assert sm["calls"]["A"] == 1


def test_summarize_counts_repeats_and_gaps(ts):
    ks = [(i * 10.0, i * 10.0 + 9.5, 7, "k") for i in range(5)]  # 5 launches, 0.5 us apart
    sm = ts.summarize(ks)
    assert sm["calls"]["k"] == 5 and sm["by_name"]["k"] == pytest.approx(47.5)
    assert sm["gaps"] == pytest.approx([0.5] * 4)
    assert sm["overlap"] == 0


def test_split_steps_at_the_longest_idle(ts):
    step = [(0, 5, 1, "a"), (5.5, 9, 1, "b"), (6, 20, 2, "side")]  # the side kernel ends last
    ks = []
    for j, start in enumerate((0, 1000, 2500)):
        ks += [(s + start, e + start, st, n) for s, e, st, n in step]
    parts = ts.split_steps(sorted(ks), 3)
    assert [len(p) for p in parts] == [3, 3, 3]
    assert [p[0][0] for p in parts] == [0, 1000, 2500]
    # a gap inside a step shorter than the gaps between steps never cuts it
    assert ts.split_steps(sorted(ks), 1) == [sorted(ks)]


def test_kernels_of_chrome_trace(ts):
    events = [{"cat": "kernel", "name": "gemm", "ts": 10, "dur": 5, "args": {"stream": 13}},
              {"cat": "gpu_memset", "name": "Memset", "ts": 0, "dur": 3},
              {"cat": "kernel", "name": "ln", "ts": 2, "dur": 1, "args": {"stream": 16}},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "dur": 1}]
    assert ts.kernels_of(events) == [(2.0, 3.0, 16, "ln"), (10.0, 15.0, 13, "gemm")]


def test_report_prints(ts, capsys):
    ts.report(ts.summarize([(0, 10, 1, "A"), (12, 20, 1, "B")]), "step 1")
    out = capsys.readouterr().out
    assert "span 0.020 ms" in out and "idle 0.002 ms in 1 gaps" in out and "0.010     1  A" in out


# dev/power.py: bench_step --power's nvidia-smi samples

@pytest.fixture(scope="module")
def power():
    return _load("power")


def test_power_parse_and_describe(power):
    text = ("120.5, 1980, 0x0000000000000000\n"
            "697.8, 1755, 0x0000000000000004\n"
            "[N/A], 1980, 0x0\n"                     # unreadable: skipped
            "701.7, 1440, 0x0000000000000024\n"      # power cap and SW thermal
            "garbage line\n")
    rows = power.parse(text)
    assert rows == [(120.5, 1980.0, 0), (697.8, 1755.0, 4), (701.7, 1440.0, 0x24)]
    line = power.describe(rows)
    assert line.startswith("power: median 698 W, max 702 W | SM clock 1440-1980 MHz")
    assert "SW power cap in 2/3" in line and "SW thermal in 1/3" in line and "HW" not in line
    assert power.describe(power.parse("350.0, 1980, 0x1\n")).endswith("clock limited by: none (1 samples)")
    assert power.describe([]) == "power: no samples"


def test_power_sampler_without_nvidia_smi(power, monkeypatch):
    monkeypatch.setattr(power.shutil, "which", lambda _: None)
    assert power.PowerSampler("0").stop() == "power: nvidia-smi not found"


def test_power_sampler_falls_back_without_the_instant_draw(power, monkeypatch):
    """nvidia-smi without power.draw.instant (older drivers) refuses the query: the sampler then asks for
    power.draw (a one-second average) instead."""
    calls = []

    class Probe:
        def __init__(self, rc):
            self.returncode = rc

    def run(cmd, **_):
        calls.append(cmd)
        return Probe(2)  # "Field power.draw.instant is not a valid field to query"

    class Popen:
        def __init__(self, cmd, **_):
            calls.append(cmd)

    monkeypatch.setattr(power.shutil, "which", lambda _: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(power.subprocess, "run", run)
    monkeypatch.setattr(power.subprocess, "Popen", Popen)
    power.PowerSampler("0000:19:00.0")
    assert f"--query-gpu={power.FIELDS}" in calls[0] and f"--query-gpu={power.FIELDS_OLD}" in calls[1]
    assert "power.draw.instant" in power.FIELDS and "instant" not in power.FIELDS_OLD


def test_energy_counter_absent_and_described(power, monkeypatch):
    def no_lib(_):
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")
    monkeypatch.setattr(power.ctypes, "CDLL", no_lib)
    e = power.Energy("0000:19:00.0")
    assert e.read() is None and e.sm_clock() is None and "libnvidia-ml" in e.why
    assert power.describe_energy(None, 1.0, 20, why=e.why) == f"energy: no counter ({e.why})"
    line = power.describe_energy(390.0, 0.56, 20)
    assert line == "energy: 19.500 J a step (390.0 J over 20 in 0.56 s: mean 696 W)"


def test_energy_counter_through_nvml(power, monkeypatch):
    """Energy reads NVML's millijoule counter (nvmlDeviceGetTotalEnergyConsumption) as joules; a device
    NVML does not know, or a counter it does not support, leaves it without one and says why."""
    import ctypes

    class Lib:
        def __init__(self, handle_rc=0, energy_rc=0):
            self.mj, self.handle_rc, self.energy_rc = 123456, handle_rc, energy_rc

        def nvmlInit_v2(self):
            return 0

        def nvmlDeviceGetHandleByPciBusId_v2(self, bus, ref):
            assert bus == b"0000:19:00.0"
            return self.handle_rc

        def nvmlDeviceGetTotalEnergyConsumption(self, handle, ref):
            ctypes.cast(ref, ctypes.POINTER(ctypes.c_ulonglong))[0] = self.mj
            return self.energy_rc

        def nvmlDeviceGetClockInfo(self, handle, which, ref):
            assert which == 1  # NVML_CLOCK_SM
            ctypes.cast(ref, ctypes.POINTER(ctypes.c_uint))[0] = 1605
            return 0

    lib = Lib()
    monkeypatch.setattr(power.ctypes, "CDLL", lambda _: lib)
    e = power.Energy("0000:19:00.0")
    assert e.why is None and e.read() == 123.456 and e.sm_clock() == 1605
    lib.mj = 143456
    assert e.read() == 143.456
    monkeypatch.setattr(power.ctypes, "CDLL", lambda _: Lib(handle_rc=999))
    assert "no NVML device" in power.Energy("0000:19:00.0").why
    monkeypatch.setattr(power.ctypes, "CDLL", lambda _: Lib(energy_rc=3))
    e = power.Energy("0000:19:00.0")
    assert e.read() is None and "not supported" in e.why


def test_bench_energy_sustained_spell(monkeypatch):
    """dev/bench_energy.py's measurement: the calls of the measured spell between two reads of the counter
    (each after the queue drained), J and ms a call from them, the mean power, the clocks sampled."""
    monkeypatch.syspath_prepend(str(ROOT / "dev"))
    be = _load("bench_energy")
    clock = {"t": 0.0}
    monkeypatch.setattr(be.time, "perf_counter", lambda: clock["t"])

    class Meter:
        joules = 1000.0

        def read(self):
            return self.joules

        def sm_clock(self):
            return 1500

    meter = Meter()
    calls = {"n": 0, "synced": 0}

    def fn():  # each call: 0.1 ms and 0.07 J (700 W)
        calls["n"] += 1
        clock["t"] += 1e-4
        meter.joules += 0.07

    def sync():
        calls["synced"] += 1

    r = be.sustained(fn, sync, meter, seconds=0.05, ramp=0.01)
    assert calls["synced"] == 3
    assert r["n"] in (499, 500) and abs(r["ms"] - 0.1) < 1e-9 and abs(r["J"] - 0.07) < 1e-9
    assert abs(r["W"] - 700) < 1e-6 and r["MHz"] == 1500
