"""Compile, ahead of time and in parallel, every CUDA module a training step builds, into the cubin
cache (LLMC_CACHE, default ~/.cache/llmc), without a GPU.

    python dev/prebuild.py                              # d12, fp32 and bf16, B=4 and 16, default variants
    python dev/prebuild.py --precision bf16 -b 16 -j 16 # one configuration, 16 nvcc processes
    LLMC_CACHE=.llmc_cache python dev/prebuild.py -- --attention-kernel 4   # flags after -- pick variants
    LLMC_DEFINES="gemm_wgmma:NAME=VALUE" python dev/prebuild.py   # the modules as a run with those defines builds them

The model is built over the CPU tests' fake runtime (tests/fake_runtime.py: H100 attributes, sm_90),
which records each (module, defines) that a kernel is asked from; one step (forward, backward,
update) runs its launches as no-ops so that builds made on first use are seen too. Then nvcc runs
for each module not yet in the cache, `-j` at a time. The cache keys are the sources, the defines,
the flags and nvcc's version, so a cache built here serves a GPU machine with the same nvcc (the
device calls carry it as .llmc_cache; gemm_wgmma.cu alone takes a minute or more to compile).
"""
import argparse
import importlib.util
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from llmc.backend import CudaBackend
from llmc.config import config_from_name
from llmc.errors import LLMCError
from llmc.model import GPT2
from llmc.runtime import CACHE_DIR, DevArray, compile_cubin, env_defines, module_target, nvcc_path
from llmc.train import kernel_flags

ROOT = Path(__file__).resolve().parent.parent


def wanted_modules(model: str, precision: str, B: int, T: int, kernels: dict) -> set:
    """{(module, defines as a sorted tuple)} that building `model` and running one step asks for."""
    spec = importlib.util.spec_from_file_location("fake_runtime", ROOT / "tests" / "fake_runtime.py")
    fake = sys.modules["fake_runtime"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(fake)
    FakeRuntime = fake.FakeRuntime

    class Recorder(FakeRuntime):
        def __init__(self):
            super().__init__(check_ptx=False)
            self.wanted = set()

        def kernel(self, module, func, argtypes, label=None, defines=None):
            merged = {**(defines or {}), **self.extra_defines.get(module, {})}
            self.wanted.add((module, tuple(sorted(merged.items()))))
            return super().kernel(module, func, argtypes, label, defines)

    rt = Recorder()
    rt.extra_defines = env_defines()  # (LLMC_DEFINES: what a real Runtime adds to every build of a module)
    # no device memory behind the fake runtime's arrays: copies and memsets do nothing
    for name in ("set", "set_async", "fill_bytes", "get_into"):
        setattr(DevArray, name, lambda self, *a, **k: self)
    DevArray.get = lambda self, *a, **k: np.zeros(self.shape, self.dtype)
    import llmc.ops.gemm_wgmma as gw  # nor a driver to encode the TMA's tensor maps: they stay zeros
    gw._libcuda = type("NoDriver", (), {"cuTensorMapEncodeTiled": staticmethod(lambda *a: 0)})()
    be = CudaBackend(kernels, quiet=True, rt=rt, precision=precision)
    cfg = config_from_name(model)
    m = GPT2(cfg, be, B, T)
    m.init_params(0)
    x = np.zeros((B, T), np.int32)
    m.zero_grad()
    m.train_micro_step(x, x)
    m.update(3e-4, 1)
    return rt.wanted


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="d12")
    p.add_argument("-b", "--batch-size", type=int, action="append", help="(repeatable; default 4 and 16)")
    p.add_argument("-t", "--seq-len", type=int, default=1024)
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2, help="nvcc processes at a time")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then trainer kernel flags")
    args = p.parse_args()
    kp = argparse.ArgumentParser(prog="prebuild.py --")
    for flag, name, h in kernel_flags():
        kp.add_argument(flag, type=int, default=None, dest=name)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    kernels = {k: v for k, v in vars(kp.parse_args(rest)).items() if v is not None}
    if nvcc_path() is None:
        raise SystemExit("prebuild: nvcc not found on PATH (it compiles the kernels)")
    wanted = set()
    for precision in (("fp32", "bf16") if args.precision == "both" else (args.precision,)):
        for B in args.batch_size or (4, 16):
            try:
                wanted |= wanted_modules(args.model, precision, B, args.seq_len, kernels)
            except LLMCError as e:
                raise SystemExit(f"prebuild: {precision} B={B}: {e}")
    jobs = sorted(wanted, key=lambda w: w[0] != "gemm_wgmma")  # the longest first
    t0 = time.perf_counter()

    def build(w):
        module, defines = w
        s = time.perf_counter()
        compile_cubin(module, module_target(module, "sm_90"), dict(defines))
        return module, defines, time.perf_counter() - s

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for module, defines, s in pool.map(build, jobs):
            print(f"  {module} {dict(defines) or ''}: {s:.1f} s", flush=True)
    print(f"prebuild: {len(jobs)} module builds in {CACHE_DIR} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
