"""Why the GPU backend cannot run here, in one line with its remedy (or None when it can).

    from llmc.gpu_check import why_no_gpu
    reason = why_no_gpu()     # None, or e.g. "no NVIDIA GPU on this machine (...)"

Checked in the order a newcomer would fix them: a GPU and its driver (through libcuda directly,
so that this works before PyCUDA is installed), a GPU new enough for our kernels (sm_80: they use
cp.async, ldmatrix and TF32 mma.sync), PyCUDA, and nvcc from CUDA >= 12.0 (the kernels are
compiled at run time). `--device auto` falls back to the numpy backend with this line on stderr;
`--device cuda` stops with it.
"""
from __future__ import annotations

import ctypes
import os
import re
import subprocess

MIN_ARCH = (8, 0)     # sm_80: A100, RTX 30xx and newer
MIN_CUDA = (12, 0)    # nvcc release

CUDA_ERROR_NO_DEVICE = 100


def probe_driver() -> dict:
    """What the CUDA driver says, through libcuda.so.1 (no PyCUDA needed):
    {"state": "no_driver" | "no_gpu" | "driver_error" | "ok", plus "detail", "name", "arch"}."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        # the kernel module without the user-space library is a broken install, not a missing GPU
        state = "no_driver" if os.path.exists("/proc/driver/nvidia/version") else "no_gpu"
        return {"state": state, "detail": "libcuda.so.1 not found"}
    rc = cu.cuInit(0)
    if rc == CUDA_ERROR_NO_DEVICE:
        return {"state": "no_gpu", "detail": "the driver sees no CUDA device"}
    if rc != 0:
        return {"state": "driver_error", "detail": f"cuInit failed with CUDA error {rc}"}
    count, dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cu.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return {"state": "no_gpu", "detail": "the driver sees no CUDA device"}
    name = ctypes.create_string_buffer(256)
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    cu.cuDeviceGetName(name, 256, dev)
    cu.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cu.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # ..._MINOR
    return {"state": "ok", "name": name.value.decode(errors="replace"), "arch": (major.value, minor.value)}


def have_pycuda() -> bool:
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        return False
    return True


def nvcc_version() -> tuple[int, int] | None:
    """(major, minor) of the nvcc that runtime.py would use, or None if there is none."""
    from llmc.runtime import nvcc_path
    nvcc = nvcc_path()
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def why_no_gpu(driver=probe_driver, pycuda=have_pycuda, nvcc=nvcc_version) -> str | None:
    d = driver()
    if d["state"] == "no_gpu":
        return f"no NVIDIA GPU on this machine ({d['detail']})"
    if d["state"] == "no_driver":
        return (f"an NVIDIA kernel driver is loaded but its CUDA library is missing ({d['detail']}): "
                f"install the NVIDIA driver's user-space libraries")
    if d["state"] == "driver_error":
        return f"the NVIDIA driver failed to start ({d['detail']}): check nvidia-smi, update the driver"
    if tuple(d["arch"]) < MIN_ARCH:
        return (f"GPU {d['name']} is sm_{d['arch'][0]}{d['arch'][1]}; our kernels need sm_"
                f"{MIN_ARCH[0]}{MIN_ARCH[1]} or newer (A100, RTX 30xx, H100, ...)")
    if not pycuda():
        return "PyCUDA is not installed: pip install pycuda cuda-python (or pip install 'llmc-py[cuda]')"
    v = nvcc()
    if v is None:
        return (f"nvcc not found (the kernels are compiled at run time): install the CUDA toolkit "
                f">= {MIN_CUDA[0]}.{MIN_CUDA[1]} and put its bin/ on PATH")
    if v < MIN_CUDA:
        return (f"nvcc is CUDA {v[0]}.{v[1]}; the kernels need CUDA >= {MIN_CUDA[0]}.{MIN_CUDA[1]}: "
                f"install a newer toolkit and put its bin/ on PATH")
    return None
