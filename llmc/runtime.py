"""The CUDA runtime layer: PyCUDA on the primary context, our own nvcc build cache, checked launches.

    from llmc.runtime import Runtime
    rt = Runtime()                                   # primary context of device 0, its stream
    k = rt.kernel("layernorm", "layernorm_forward_kernel1", "PPPPPPii", label="layernorm_forward 1")
    x = rt.to_device(np.random.randn(8, 768).astype(np.float32))
    k((grid, 1, 1), (256, 1, 1), out.ptr, ..., np.int32(N), np.int32(C))
    rt.synchronize(); out.get()

Design notes
- Kernels live in cuda/<module>.cu. We compile them ourselves with nvcc to a cubin (not through
  SourceModule) so that the cache key covers the .cu, the cuda/*.cuh headers it includes (followed
  through their own includes: editing a header rebuilds only the modules that use it), the options,
  the arch and the nvcc version, and so that CI can run the very same command without a GPU
  (`compile_cubin` needs no device; see tests/test_cuda_compile.py).
- A module whose kernels need an architecture-specific target (wgmma: sm_90a) is named in
  ARCH_SPECIFIC: it is compiled for that target on a GPU of that generation and refused (CudaError)
  elsewhere; the variants that use it declare the same (Variant.arch) and so refuse, and fall back.
- Every .cu declares its entry points `extern "C" __global__`, so names are unmangled even when
  the file uses templates.
- Every launch goes through Kernel.__call__: a prepared async launch on the runtime's stream
  (rt.stream: the main stream, or between fork() and unfork() a side stream, which the backward's
  weight-gradient GEMMs use; wait_mark() and join() bring its work back into the main stream's order).
  A launch error raises CudaError naming the op and variant. With LLMC_SYNC=1 we synchronise after
  every launch so that an asynchronous fault is also pinned on the launch that caused it.
- Memory: DevArray is a typed view of device memory (ptr, shape, dtype). Everything the model needs
  is allocated once at build; views into a flat buffer share its allocation.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from llmc import switches
from llmc.errors import LLMCError

ROOT = Path(__file__).resolve().parent.parent


def _cuda_dir() -> Path:
    """The kernel sources: llmc/cuda/ in an installed package, cuda/ beside llmc/ in a checkout."""
    here = Path(__file__).resolve().parent
    for d in (here / "cuda", ROOT / "cuda"):
        if (d / "common.cuh").is_file():
            return d
    return ROOT / "cuda"


CUDA_DIR = _cuda_dir()
_said_compiling = False
CACHE_DIR = Path(switches.value("LLMC_CACHE") or Path.home() / ".cache" / "llmc")

# -O3 and C++17 everywhere; no --use_fast_math: kernels that want intrinsics (__expf) say so, and the
# numpy oracle stays meaningful. -lineinfo keeps source lines for ncu/compute-sanitizer.
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xptxas=-v"]

# Modules built for an architecture-specific target instead of the device's plain one: wgmma and
# setmaxnreg exist only on sm_90a (Hopper), so cuda/gemm_wgmma.cu and cuda/attention_wgmma.cu are built
# for it and refused elsewhere.
ARCH_SPECIFIC = {"gemm_wgmma": "sm_90a", "attention_wgmma": "sm_90a"}


def arch_flags(arch: str) -> list[str]:
    """nvcc target flags: `-arch=sm_XY`, or for an 'a' target the -gencode form (the -arch=sm_90a
    shorthand may also run a plain sm_90 pass that rejects wgmma)."""
    if arch.endswith("a"):
        num = arch[3:]
        return [f"-gencode=arch=compute_{num},code=sm_{num}"]
    return [f"-arch={arch}"]


class CudaError(LLMCError):
    """A CUDA failure, with the op/variant that caused it when known."""


# ----------------------------------------------------------------------------------------------
# building (no GPU needed)

def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def cuobjdump_env() -> tuple[str, dict] | None:
    """(cuobjdump, its environment) for reading a cubin's SASS, or None: from PATH, the CUDA install
    beside nvcc, or the pip wheels nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (requirements-test.txt:
    CI has no CUDA toolkit but nvcc, and cuobjdump needs nvdisasm, found through NVDISASM_PATH)."""
    import glob
    dirs = [str(Path(p).parent) for p in (shutil.which("cuobjdump"), nvcc_path()) if p]
    try:
        import nvidia  # the namespace package of NVIDIA's pip wheels
        dirs += sorted(d for base in nvidia.__path__ for d in glob.glob(f"{base}/cu*/bin"))
    except ImportError:
        pass
    tool = next((f"{d}/cuobjdump" for d in dirs if os.access(f"{d}/cuobjdump", os.X_OK)), None)
    disasm = next((f"{d}/nvdisasm" for d in dirs if os.access(f"{d}/nvdisasm", os.X_OK)), None)
    if tool is None or disasm is None:
        return None
    return tool, {**os.environ, "NVDISASM_PATH": str(Path(disasm).parent),
                  "PATH": f"{Path(disasm).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def sass(cubin) -> str | None:
    """cuobjdump -sass of a cubin (every function), or None where no cuobjdump is found."""
    found = cuobjdump_env()
    if found is None:
        return None
    tool, env = found
    return subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True, env=env).stdout


def cuda_sources() -> list[str]:
    """Module names, one per cuda/<name>.cu."""
    return sorted(p.stem for p in CUDA_DIR.glob("*.cu"))


_NVCC_VERSIONS: dict = {}


def _nvcc_version(nvcc: str) -> str:
    if nvcc not in _NVCC_VERSIONS:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        _NVCC_VERSIONS[nvcc] = out.strip().splitlines()[-1] if out else "unknown"
    return _NVCC_VERSIONS[nvcc]


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def module_headers(module: str, cuda_dir: Path | None = None) -> list[str]:
    """The headers of cuda/ that cuda/<module>.cu includes, directly or through other headers
    (quoted includes only; system headers are nvcc's and covered by its version)."""
    cuda_dir = cuda_dir or CUDA_DIR
    seen, todo = [], [f"{module}.cu"]
    while todo:
        text = (cuda_dir / todo.pop()).read_text()
        for name in _INCLUDE.findall(text):
            if name not in seen and (cuda_dir / name).exists():
                seen.append(name)
                todo.append(name)
    return sorted(seen)


def module_target(module: str, arch: str) -> str | None:
    """The target cuda/<module>.cu is built for on a GPU of `arch`: arch itself, or the module's
    ARCH_SPECIFIC target when arch is that generation; None when the module can't run there."""
    target = ARCH_SPECIFIC.get(module)
    if target is None:
        return arch
    return target if target.rstrip("a") == arch.rstrip("a") else None


def _cache_key(module: str, arch: str, defines: dict, nvcc: str, cuda_dir: Path | None = None) -> str:
    cuda_dir = cuda_dir or CUDA_DIR
    h = hashlib.sha256()
    h.update((cuda_dir / f"{module}.cu").read_bytes())
    for hdr in module_headers(module, cuda_dir):  # only what this module includes
        h.update(hdr.encode()); h.update((cuda_dir / hdr).read_bytes())
    h.update(repr((arch, sorted(defines.items()), NVCC_FLAGS, _nvcc_version(nvcc))).encode())
    return h.hexdigest()[:24]


def compile_cubin(module: str, arch: str = "sm_90", defines: dict | None = None,
                  extra_flags: list[str] | None = None, use_cache: bool = True) -> tuple[Path, str]:
    """Compile cuda/<module>.cu to a cubin for `arch`. Returns (cubin path, ptxas report)."""
    defines = dict(defines or {})
    src = CUDA_DIR / f"{module}.cu"
    if not src.exists():
        raise CudaError(f"no kernel source {src}")
    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaError("nvcc not found on PATH (needed to build the CUDA kernels)")
    key = _cache_key(module, arch, defines, nvcc) + ("-" + hashlib.sha256(
        repr(extra_flags).encode()).hexdigest()[:8] if extra_flags else "")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    cubin = CACHE_DIR / f"{module}-{arch}-{key}.cubin"
    logf = cubin.with_suffix(".log")
    if use_cache and cubin.exists() and logf.exists():
        return cubin, logf.read_text()
    global _said_compiling
    if not _said_compiling:  # the first d12 build takes ~30 s: say why nothing happens
        import sys
        print(f"compiling CUDA kernels with nvcc for {arch} (the first run takes ~30 s; cached in "
              f"{CACHE_DIR})", file=sys.stderr, flush=True)
        _said_compiling = True
    cmd = [nvcc, "-cubin", *arch_flags(arch), *NVCC_FLAGS, *(extra_flags or []), f"-I{CUDA_DIR}",
           *[f"-D{k}={v}" for k, v in defines.items()]]
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        tmp_out = Path(tmp) / "out.cubin"
        res = subprocess.run(cmd + ["-o", str(tmp_out), str(src)], capture_output=True, text=True)
        if res.returncode != 0:
            raise CudaError(f"nvcc failed on cuda/{module}.cu for {arch}:\n{res.stderr.strip()}")
        logf.write_text(res.stderr)
        os.replace(tmp_out, cubin)  # atomic: a concurrent build never sees half a file
    return cubin, res.stderr


def compile_ptx(module: str, arch: str = "sm_90", defines: dict | None = None) -> str:
    """The PTX of cuda/<module>.cu (cached like the cubins): what the CPU tests read the kernels'
    parameter lists from."""
    defines = dict(defines or {})
    nvcc = nvcc_path()
    if nvcc is None:
        raise CudaError("nvcc not found on PATH (needed to build the CUDA kernels)")
    arch = module_target(module, arch) or arch
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    out = CACHE_DIR / f"{module}-{arch}-{_cache_key(module, arch, defines, nvcc)}.ptx"
    if out.exists():
        return out.read_text()
    flags = [f for f in NVCC_FLAGS if not f.startswith("-Xptxas")]
    cmd = [nvcc, "-ptx", f"-arch={arch}", *flags, f"-I{CUDA_DIR}", *[f"-D{k}={v}" for k, v in defines.items()]]
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        tmp_out = Path(tmp) / "out.ptx"
        res = subprocess.run(cmd + ["-o", str(tmp_out), str(CUDA_DIR / f"{module}.cu")], capture_output=True, text=True)
        if res.returncode != 0:
            raise CudaError(f"nvcc -ptx failed on cuda/{module}.cu for {arch}:\n{res.stderr.strip()}")
        os.replace(tmp_out, out)
    return out.read_text()


# PTX parameter types -> the PyCUDA struct letters a launch may pass for them (8-byte integers are
# pointers (P) or int64 (q/Q): PTX does not tell them apart)
_PTX_LETTERS = {"u64": "PqQ", "s64": "PqQ", "b64": "PqQ", "u32": "iI", "s32": "iI", "b32": "iI",
                "f32": "f", "f64": "d", "u16": "hH", "s16": "hH", "u8": "bB", "s8": "bB"}


def ptx_signatures(ptx: str) -> dict[str, list[str]]:
    """{entry point: [PTX parameter type, ...]} from `.entry name(.param .u64 ..., ...)`."""
    sigs = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx):
        sigs[m.group(1)] = re.findall(r"\.param\s+\.(\w+)", m.group(2))
    return sigs


def argtypes_mismatch(argtypes: str, ptx_params: list[str]) -> str | None:
    """Why a PyCUDA argtypes string can't launch a kernel with these PTX parameters (None: it can)."""
    if len(argtypes) != len(ptx_params):
        return f"{len(argtypes)} argtypes {argtypes!r} for {len(ptx_params)} parameters {ptx_params}"
    bad = [f"#{i} {a!r} vs .{t}" for i, (a, t) in enumerate(zip(argtypes, ptx_params))
           if a not in _PTX_LETTERS.get(t, "")]
    return f"argtypes {argtypes!r} do not match the PTX parameters: {', '.join(bad)}" if bad else None


def resource_report(ptxas_log: str) -> dict[str, dict]:
    """Parse `ptxas -v` output into {kernel: {regs, stack, spill_stores, spill_loads, smem}}."""
    report, cur = {}, None
    for line in ptxas_log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line) or \
            re.search(r"Function properties for (\w+)", line)
        if m:
            cur = m.group(1)
            report.setdefault(cur, {"regs": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            report[cur].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            report[cur]["regs"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            report[cur]["smem"] = int(m.group(1))
    return report


def take_scratch(rt, shape, dtype=np.float32):
    """Runtime.scratch (also the tests' fake runtime's)."""
    pool = getattr(rt, "_scratch_pool", None)
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if pool is not None:
        for i, a in enumerate(pool["bufs"]):
            if i not in pool["taken"] and a.nbytes == nbytes:
                pool["taken"].add(i)
                return DevArray(rt, a.ptr, shape, dtype, a.owner)
    arena = getattr(rt, "_scratch_arena", None)
    start = -(-arena["used"] // 256) * 256 if arena is not None else 0
    if arena is not None and start + nbytes <= arena["base"].nbytes:  # a piece of the arena, else its own
        arena["used"] = start + nbytes
        a = DevArray(rt, arena["base"].ptr + start, shape, dtype, arena["base"].owner or arena["base"])
    else:
        a = rt.empty(shape, dtype)
    if pool is not None:
        pool["taken"].add(len(pool["bufs"]))
        pool["bufs"].append(a)
    return a


@contextlib.contextmanager
def _set_for_block(rt, attr: str, value):
    """rt.attr = value inside the block, what it was after it (whatever ends the block)."""
    prev = getattr(rt, attr, None)
    setattr(rt, attr, value)
    try:
        yield value
    finally:
        setattr(rt, attr, prev)


def scratch_pool(rt, pool: dict):
    """Runtime.scratch_pool (also the fake runtime's)."""
    pool.setdefault("bufs", [])
    pool["taken"] = set()
    return _set_for_block(rt, "_scratch_pool", pool)


def scratch_arena(rt, arena: dict):
    """Runtime.scratch_arena (also the fake runtime's)."""
    return _set_for_block(rt, "_scratch_arena", arena)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# device memory

class DevArray:
    """A typed view of device memory. `owner` keeps the allocation alive for views."""

    __slots__ = ("ptr", "shape", "dtype", "size", "nbytes", "owner", "rt")

    def __init__(self, rt: "Runtime", ptr: int, shape, dtype, owner):
        self.rt, self.ptr, self.owner = rt, int(ptr), owner
        self.shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        self.dtype = np.dtype(dtype)
        self.size = int(np.prod(self.shape)) if self.shape else 1
        self.nbytes = self.size * self.dtype.itemsize

    def view(self, offset: int, shape, dtype=None) -> "DevArray":
        """A view starting `offset` elements in (of this array's dtype), with a new shape."""
        dtype = np.dtype(dtype or self.dtype)
        out = DevArray(self.rt, self.ptr + offset * self.dtype.itemsize, shape, dtype, self.owner)
        assert offset * self.dtype.itemsize + out.nbytes <= self.nbytes, "view out of bounds"
        return out

    def __getitem__(self, i) -> "DevArray":
        """Integer index along the first axis, like numpy's a[i]: a view of one sub-tensor
        (the model indexes per-layer tensors this way: p["qkvw"][l] is (3C, C))."""
        if not isinstance(i, (int, np.integer)):
            raise TypeError("DevArray supports only an integer index along the first axis")
        n = self.shape[0]
        i = int(i) + n if i < 0 else int(i)
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for the first axis of {self.shape}")
        sub = self.shape[1:]
        step = int(np.prod(sub)) if sub else 1
        return DevArray(self.rt, self.ptr + i * step * self.dtype.itemsize, sub, self.dtype, self.owner)

    def __len__(self) -> int:
        return self.shape[0]

    def reshape(self, *shape) -> "DevArray":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        out = DevArray(self.rt, self.ptr, shape, self.dtype, self.owner)
        assert out.size == self.size
        return out

    def get(self, stream_sync: bool = True) -> np.ndarray:
        import pycuda.driver as drv
        host = np.empty(self.shape, self.dtype)
        if stream_sync:
            self.rt.stream.synchronize()
        drv.memcpy_dtoh(host, self.ptr)
        return host

    def set(self, host: np.ndarray) -> "DevArray":
        import pycuda.driver as drv
        host = np.ascontiguousarray(host, dtype=self.dtype)
        assert host.size == self.size, f"set: {host.size} elements into {self.size}"
        self.rt.stream.synchronize()
        drv.memcpy_htod(self.ptr, host)
        return self

    def get_into(self, pinned_host: np.ndarray) -> np.ndarray:
        """Copy into page-locked host memory on the runtime's stream, then wait for the stream."""
        import pycuda.driver as drv
        assert pinned_host.nbytes == self.nbytes, f"get_into: {pinned_host.nbytes} bytes from {self.nbytes}"
        drv.memcpy_dtoh_async(pinned_host, self.ptr, self.rt.stream)
        self.rt.stream.synchronize()
        return pinned_host

    def get_async(self, pinned_host: np.ndarray) -> None:
        """Copy into page-locked host memory on the runtime's stream (no host wait: an event recorded
        after it says when pinned_host holds it)."""
        import pycuda.driver as drv
        assert pinned_host.nbytes == self.nbytes, f"get_async: {pinned_host.nbytes} bytes from {self.nbytes}"
        drv.memcpy_dtoh_async(pinned_host, self.ptr, self.rt.stream)

    def set_async(self, pinned_host: np.ndarray) -> None:
        """Copy from page-locked host memory on the runtime's stream (no host wait)."""
        import pycuda.driver as drv
        drv.memcpy_htod_async(self.ptr, pinned_host, self.rt.stream)

    def fill_bytes(self, byte: int) -> None:
        """memset every byte (e.g. 0xFF poisons fp32 with NaN), on the stream."""
        import pycuda.driver as drv
        drv.memset_d8_async(self.ptr, byte, self.nbytes, self.rt.stream)

    def zero(self) -> None:
        self.fill_bytes(0)

    def __repr__(self):
        return f"DevArray(shape={self.shape}, dtype={self.dtype}, ptr=0x{self.ptr:x})"


# ----------------------------------------------------------------------------------------------
# kernels

# Programmatic dependent launch (PDL, Hopper): inside a graph capture that asks for it, each kernel is
# launched with the programmatic stream-serialization attribute, so the graph holds programmatic edges:
# a kernel may be scheduled while the kernel before it on the stream is still finishing, and waits for
# it in its first instruction (LLMC_PDL_WAIT in every entry point of cuda/). PyCUDA has no launch
# attributes and no function handles, so these launches go through the driver's cuLaunchKernelEx by
# ctypes, on the runtime's own CUmodule of the same cubin. Measured on an H200 (docs/ops.md, "PDL"):
# the decode step's graph 0.416 -> 0.392 ms at batch 1, a d12 B=1 T=64 training step 3.10 -> 2.95 ms,
# B=4 -0.1 to -0.6%, but B=8 +0.5% and B=16 +0.5 to +1%; so by default the decode graph asks for it,
# and the training step's graphs of at most 4096 tokens (llmc/model.py, PDL_TRAIN_TOKENS).
# LLMC_PDL=1: every capture, LLMC_PDL=0: none.
PDL_ENV = "LLMC_PDL"
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CTYPES_OF = {"P": ctypes.c_uint64, "i": ctypes.c_int32, "I": ctypes.c_uint32, "q": ctypes.c_int64,
              "Q": ctypes.c_uint64, "f": ctypes.c_float, "d": ctypes.c_double}


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("val", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint),
                ("bx", ctypes.c_uint), ("by", ctypes.c_uint), ("bz", ctypes.c_uint),
                ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)),
                ("nattrs", ctypes.c_uint)]


class Kernel:
    """A prepared kernel: call with (grid, block, *args, smem=bytes). Launch errors name `label`.
    While the runtime captures a graph that asked for PDL (Runtime.capture), it is launched by
    cuLaunchKernelEx with the programmatic attribute, on the driver's handle of the same entry point
    (`where`: its module key and name, looked up on the first such launch)."""

    def __init__(self, rt: "Runtime", func, argtypes: str, label: str, where: tuple | None = None):
        self.rt, self.func, self.label = rt, func, label
        self.argtypes = argtypes
        func.prepare(argtypes)
        self._call = func.prepared_async_call
        self.max_dynamic_smem = 48 * 1024
        self._where = where  # (module key, entry point): the driver handle's source, looked up on first use
        self._cu = None
        self._ctypes = [_CTYPES_OF[c] for c in argtypes] if all(c in _CTYPES_OF for c in argtypes) else None

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Opt in to more than 48 KB of dynamic shared memory (Hopper allows up to 227 KB). The opt-in
        only grows: builds of one entry point share its function, so a build that asks for less
        (layernorm_backward 7's deferred form, 2 stages, after its ticketed form, 3) must not take
        back what an earlier build's launches need."""
        if int(nbytes) <= self.max_dynamic_smem:
            return
        import pycuda.driver as drv
        self.func.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))
        if self._cu:
            self._cu_smem(nbytes)
        self.max_dynamic_smem = int(nbytes)

    def _cu_smem(self, nbytes: int) -> None:
        self.rt._cu_call("cuFuncSetAttribute", ctypes.c_void_p(self._cu),
                         _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(int(nbytes)))

    def _pdl_ready(self) -> bool:
        """The driver handle for a programmatic launch, looked up the first time one is asked for."""
        if self._cu is None and self._ctypes is not None and self._where is not None:
            self._cu = self.rt._cu_function(*self._where)
            if self.max_dynamic_smem > 48 * 1024:
                self._cu_smem(self.max_dynamic_smem)
        return self._cu is not None

    def __call__(self, grid, block, *args, smem: int = 0):
        try:
            if self.rt.pdl_active and self._pdl_ready():
                self._launch_pdl(grid, block, args, smem)
            else:
                self._call(grid, block, self.rt.stream, *args, shared_size=smem)
        except Exception as e:  # pycuda raises its own LaunchError/LogicError types
            raise CudaError(f"{self.label}: launch failed (grid={grid}, block={block}, smem={smem}): {e}") from None
        if self.rt.sync:
            self.rt.check(self.label)

    def _launch_pdl(self, grid, block, args, smem):
        if len(args) != len(self._ctypes):
            raise TypeError(f"{len(args)} arguments for {len(self._ctypes)} ({self.argtypes})")
        vals = [t(float(a) if t in (ctypes.c_float, ctypes.c_double) else int(a)) for t, a in zip(self._ctypes, args)]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], int(smem), ctypes.c_void_p(self.rt.stream.handle),
                            ctypes.pointer(self.rt._pdl_attr), 1)
        self.rt._cu_call("cuLaunchKernelEx", ctypes.byref(cfg), ctypes.c_void_p(self._cu), params, None)

    def resident_blocks(self, block_size: int) -> int:
        """Blocks of `block_size` threads that fit on one SM at once, by threads and registers
        (for kernels with little shared memory). A grid-stride kernel wants sm_count times this:
        one block more than fits starts a second, mostly empty wave."""
        attr = self.rt.drv.device_attribute
        regs_sm = self.rt.device.get_attribute(attr.MAX_REGISTERS_PER_MULTIPROCESSOR)
        threads_sm = self.rt.device.get_attribute(attr.MAX_THREADS_PER_MULTIPROCESSOR)
        regs = -(-max(self.attributes()["regs"], 1) // 8) * 8  # allocated per warp, 8 per thread at a time
        return max(1, min(threads_sm // block_size, (regs_sm // (regs * 32)) // (block_size // 32), 32))

    def attributes(self) -> dict:
        import pycuda.driver as drv
        fa = drv.function_attribute
        return {"regs": self.func.get_attribute(fa.NUM_REGS),
                "local_bytes": self.func.get_attribute(fa.LOCAL_SIZE_BYTES),
                "static_smem": self.func.get_attribute(fa.SHARED_SIZE_BYTES),
                "max_threads": self.func.get_attribute(fa.MAX_THREADS_PER_BLOCK)}


def _cuda_driver():
    """cuda-python's driver bindings (cuda.bindings.driver; cuda.cuda in older releases), or None."""
    try:
        from cuda.bindings import driver
        return driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
            return driver
        except ImportError:
            return None


class Graph:
    """Launches captured once from the runtime's stream into a CUDA graph, replayed by one call.

    PyCUDA has no graphs; cuda-python's driver API captures PyCUDA's launches on PyCUDA's stream.
    Kernel arguments are frozen at capture: whatever changes between replays (a decode position,
    token ids) must be read by the kernels from device memory, written before each replay."""

    def __init__(self, rt: "Runtime", cu, graph, exe):
        self.rt, self._cu, self._graph, self._exe = rt, cu, graph, exe
        self._stream = cu.CUstream(rt.stream.handle)

    def __call__(self) -> None:  # (never under LLMC_SYNC=1: graphs are off then)
        _cu_check(self._cu, self._cu.cuGraphLaunch(self._exe, self._stream), "cuGraphLaunch")

    def __del__(self):
        try:
            self._cu.cuGraphExecDestroy(self._exe)
            self._cu.cuGraphDestroy(self._graph)
        except Exception:
            pass


def _cu_check(cu, result, what: str):
    err = result[0] if isinstance(result, tuple) else result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaError(f"{what} failed: {err}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


DEFINES_ENV = "LLMC_DEFINES"


def parse_defines(items, source: str = "--define") -> dict:
    """`MODULE:NAME=VALUE` strings (the lab's --define, or LLMC_DEFINES split at spaces) -> {module:
    {NAME: VALUE}}: extra -D defines for every build of cuda/<module>.cu (a kernel's tunable macros,
    e.g. encoder:ENC7_COMB_BATCH=8). A malformed item or an unknown module: LLMCError naming `source`."""
    out = switches.define_items(items, source)
    for mod in out:
        if not (CUDA_DIR / f"{mod}.cu").exists():
            item = next(i for i in items if i.startswith(mod + ":"))
            raise LLMCError(f"{source} {item!r}: there is no cuda/{mod}.cu")
    return out


def env_defines() -> dict:
    """LLMC_DEFINES="MODULE:NAME=VALUE ...": the extra defines every Runtime starts with (so that a whole
    training step can be timed with a kernel's macro changed: dev/bench_ab.py --env LLMC_DEFINES=...)."""
    return parse_defines((switches.value(DEFINES_ENV) or "").split(), DEFINES_ENV)


class Runtime:
    """PyCUDA on the primary context of one device, its stream (and a side stream: fork), our module cache.
    extra_defines ({module: {NAME: VALUE}}, parse_defines; LLMC_DEFINES at start): -D defines added to
    every build of a module."""

    def __init__(self, device: int = 0, sync: bool | None = None):
        try:
            import pycuda.driver as drv
        except ImportError:
            raise LLMCError("--device cuda: PyCUDA is not installed (pip install pycuda); "
                            "--device cpu runs the numpy backend") from None
        try:
            drv.init()
            if drv.Device.count() == 0:
                raise LLMCError("no CUDA device")
            self.device = drv.Device(device)
            self.ordinal = device  # the device index (data parallel: the process's local rank)
            self.context = self.device.retain_primary_context()
            self.context.push()
        except LLMCError:
            raise LLMCError("--device cuda: no CUDA GPU found; --device cpu runs the numpy backend") from None
        except Exception as e:
            raise LLMCError(f"--device cuda: no usable CUDA GPU ({e}); --device cpu runs the numpy backend") from None
        import atexit
        atexit.register(self._pop)
        self.drv = drv
        major, minor = self.device.compute_capability()
        self.arch = f"sm_{major}{minor}"
        self.name = self.device.name()
        self.sm_count = self.device.get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
        self.l2_bytes = self.device.get_attribute(drv.device_attribute.L2_CACHE_SIZE)
        self.max_smem_optin = self.device.get_attribute(
            drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        # the DRAM's peak bytes/s from its clock (kHz, double data rate) and bus width (bits): H100 SXM
        # 3.35e12, H200 4.8e12 (the attention_forward/backward 4 fp32 builds pick a form by it)
        # (None where the driver no longer reports them)
        try:
            self.dram_peak = (2 * 1000 * self.device.get_attribute(drv.device_attribute.MEMORY_CLOCK_RATE)
                              * self.device.get_attribute(drv.device_attribute.GLOBAL_MEMORY_BUS_WIDTH) // 8) or None
        except (AttributeError, drv.Error):
            self.dram_peak = None
        self.stream = drv.Stream()
        self.sync = switches.on("LLMC_SYNC") if sync is None else sync
        self.capturing = False  # inside capture()
        self._modules: dict = {}
        self._kernels: dict = {}
        self.extra_defines: dict = env_defines()
        # programmatic dependent launch (PDL_ENV; Hopper or newer, not under LLMC_SYNC=1): possible in
        # captures here (self.pdl), on in the one running now (self.pdl_active)
        self.pdl_env = switches.flag(PDL_ENV)  # (None: each capture's own choice)
        self.pdl = self.pdl_env is not False and major >= 9 and not self.sync
        self.pdl_active = False
        self._cu_modules: dict = {}
        self._cubins: dict = {}
        if self.pdl:
            self._libcuda = ctypes.CDLL("libcuda.so.1")
            version = ctypes.c_int(0)
            self._libcuda.cuDriverGetVersion(ctypes.byref(version))
            # (programmatic launches under stream capture: drivers of CUDA 12.3 and later)
            self.pdl = version.value >= 12030 and hasattr(self._libcuda, "cuLaunchKernelEx")
        if self.pdl:
            self._pdl_attr = _LaunchAttr()
            self._pdl_attr.id = _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            ctypes.c_int.from_buffer(self._pdl_attr.val).value = 1
        self._allocs: list = []
        self.allocated_bytes = 0

    def _pop(self):
        try:
            self.context.pop()
        except Exception:
            pass

    # -- modules and kernels
    def _defines(self, name: str, defines: dict | None) -> dict:
        return {**(defines or {}), **getattr(self, "extra_defines", {}).get(name, {})}

    def module(self, name: str, defines: dict | None = None):
        defines = self._defines(name, defines)
        key = (name, tuple(sorted(defines.items())))
        mod = self._modules.get(key)
        if mod is None:
            arch = self.arch
            if name in ARCH_SPECIFIC:
                arch = ARCH_SPECIFIC[name]
                if arch.rstrip("a") != self.arch:
                    raise CudaError(f"cuda/{name}.cu needs {arch} (this GPU is {self.arch})")
            cubin, _ = compile_cubin(name, arch, defines)
            mod = self.drv.module_from_file(str(cubin))
            self._modules[key] = mod
            self._cubins[key] = cubin
        return mod

    def _cu_function(self, key: tuple, func: str) -> int:
        """The driver handle of `func` in our own load of module `key`'s cubin (PDL's launches; PyCUDA
        exposes neither its module nor its function handles), the module loaded on first use."""
        h = self._cu_modules.get(key)
        if h is None:
            h = self._cu_modules[key] = ctypes.c_void_p()
            self._cu_call("cuModuleLoad", ctypes.byref(h), str(self._cubins[key]).encode())
        f = ctypes.c_void_p()
        self._cu_call("cuModuleGetFunction", ctypes.byref(f), h, func.encode())
        return f.value

    def _cu_call(self, fn: str, *args) -> None:
        """A driver API call through ctypes (PDL's launches); a failure names the call and the error."""
        err = getattr(self._libcuda, fn)(*args)
        if err != 0:
            msg = ctypes.c_char_p()
            self._libcuda.cuGetErrorString(err, ctypes.byref(msg))
            raise CudaError(f"{fn} failed: {err} {(msg.value or b'').decode()}")

    def kernel(self, module: str, func: str, argtypes: str, label: str | None = None,
               defines: dict | None = None) -> Kernel:
        """The prepared kernel `func` of cuda/<module>.cu. `argtypes` in PyCUDA's struct letters:
        P pointer, i int32, f float32, ... Cached: asking twice returns the same Kernel."""
        defines = self._defines(module, defines)
        mkey = (module, tuple(sorted(defines.items())))  # (module()'s key)
        key = (module, func, argtypes, mkey[1])
        k = self._kernels.get(key)
        if k is None:
            try:
                f = self.module(module, defines).get_function(func)
            except self.drv.LogicError as e:
                raise CudaError(f"cuda/{module}.cu has no entry point {func} ({e})") from None
            k = Kernel(self, f, argtypes, label or f"{module}.{func}", (mkey, func))
            self._kernels[key] = k
        return k

    # -- memory
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes on the device."""
        return self.drv.mem_get_info()

    def empty(self, shape, dtype=np.float32) -> DevArray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        try:
            alloc = self.drv.mem_alloc(max(n, 1))
        except self.drv.MemoryError:
            free, _ = self.mem_info()
            raise LLMCError(f"out of GPU memory: need {n:,} more bytes, {free:,} free") from None
        self._allocs.append(alloc)
        self.allocated_bytes += n
        return DevArray(self, int(alloc), shape, dtype, alloc)

    def zeros(self, shape, dtype=np.float32) -> DevArray:
        a = self.empty(shape, dtype)
        a.zero()
        return a

    def scratch(self, shape, dtype=np.float32) -> DevArray:
        """A build's working buffer that holds nothing from one launch to the next (each launch writes
        it before it reads it): empty(), except inside scratch_pool(pool), where a buffer of the pool
        of the same byte size that this block has not taken yet is handed out first."""
        return take_scratch(self, shape, dtype)

    def scratch_pool(self, pool: dict):
        """Context: the builds inside share scratch() buffers with the earlier blocks given the same
        pool (a dict the caller keeps), each buffer taken once per block. For builds that never run
        at the same time (the model's GEMM of one call site and its first micro-step's twin)."""
        return scratch_pool(self, pool)

    def scratch_arena(self, arena: dict):
        """Context: the scratch() buffers that the builds inside allocate (not those a pool hands out
        again) are cut from arena["base"]'s bytes past arena["used"], one after another (256-aligned,
        "used" moving on: the caller's dict carries it from one block to the next), while they fit; then
        empty(). For builds whose scratch lives only while memory that base holds at other times is
        free (the model's backward builds in the logits' buffer: GPT2, share_scratch)."""
        return scratch_arena(self, arena)

    def to_device(self, host: np.ndarray) -> DevArray:
        host = np.ascontiguousarray(host)
        a = self.empty(host.shape, host.dtype)
        return a.set(host)

    def pinned(self, shape, dtype=np.float32) -> np.ndarray:
        return self.drv.pagelocked_empty(shape, dtype)

    def require_free(self, nbytes: int, what: str = "model") -> None:
        free, _ = self.mem_info()
        if nbytes > free:
            raise LLMCError(f"not enough GPU memory for the {what}: need {nbytes:,} bytes, {free:,} free")

    # -- CUDA graphs
    def graphs_available(self) -> str | None:
        """None when graphs can be captured here, else why not (LLMC_GRAPHS=0 turns them off;
        LLMC_SYNC=1 too, since a synchronisation after each launch cannot be captured)."""
        if not switches.on("LLMC_GRAPHS"):
            return "LLMC_GRAPHS=0"
        if self.sync:
            return "LLMC_SYNC=1"
        if _cuda_driver() is None:
            return "cuda-python is not installed (pip install cuda-python)"
        return None

    def capture(self, fn, pdl: bool = False) -> Graph:
        """Run fn() (launches on self.stream, no host synchronisation inside) under stream capture
        and return the instantiated graph: calling it replays every launch fn made. pdl: its kernels
        launched for programmatic dependent launch (PDL_ENV above; LLMC_PDL=1 / 0 overrides)."""
        why = self.graphs_available()
        if why:
            raise LLMCError(f"CUDA graphs unavailable: {why}")
        cu = _cuda_driver()
        stream = cu.CUstream(self.stream.handle)
        mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
        _cu_check(cu, cu.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        self.capturing = True  # (a launcher that must upload first refuses under capture)
        self.pdl_active = self.pdl and (pdl if self.pdl_env is None else self.pdl_env)
        try:
            fn()
        finally:
            self.capturing = self.pdl_active = False
            graph = _cu_check(cu, cu.cuStreamEndCapture(stream), "cuStreamEndCapture (a launch in the "
                              "captured function failed or synchronised)")
        exe = _cu_check(cu, cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        return Graph(self, cu, graph, exe)

    # -- a second stream: launches off the critical path (the backward's weight-gradient GEMMs)
    def fork(self) -> None:
        """Launches from now until unfork() go to the side stream, after everything launched on the
        main stream so far (an event between them: also under graph capture, where it brings the side
        stream into the capture)."""
        if self.stream is getattr(self, "_side", None):
            raise RuntimeError("fork() inside fork(): unfork() first")
        if getattr(self, "_side", None) is None:
            flags = self.drv.event_flags.DISABLE_TIMING
            self._side, self._main = self.drv.Stream(), self.stream
            self._fork_event, self._join_event = self.drv.Event(flags), self.drv.Event(flags)
            self._marks: dict = {}
            self._live_marks: set = set()
        self._fork_event.record(self._main)
        self._side.wait_for_event(self._fork_event)
        self.stream = self._side
        self._side_used = True

    def unfork(self, mark: str | None = None) -> None:
        """Back to the main stream; with `mark`, an event after the side stream's launches so far,
        which wait_mark(mark) makes the main stream wait for."""
        self.stream = self._main
        if mark is not None:
            ev = self._marks.get(mark)
            if ev is None:
                ev = self._marks[mark] = self.drv.Event(self.drv.event_flags.DISABLE_TIMING)
            ev.record(self._side)
            self._live_marks.add(mark)

    def wait_mark(self, mark: str) -> None:
        """The main stream waits for the side stream's launches up to `mark`'s last unfork. A mark not
        recorded since the last join() is nothing to wait for (and waiting on an event recorded
        outside a graph capture is not allowed inside it)."""
        if mark in getattr(self, "_live_marks", ()):
            self.stream.wait_for_event(self._marks[mark])

    def join(self) -> None:
        """The main stream waits for everything launched on the side stream (if any was, since the last join)."""
        if getattr(self, "_side_used", False):
            self._side_used = False
            self._join_event.record(self._side)
            self.stream.wait_for_event(self._join_event)
            self._live_marks = set()

    # -- sync, errors and timing
    def synchronize(self) -> None:
        self.stream.synchronize()

    def check(self, label: str) -> None:
        try:
            self.stream.synchronize()
        except Exception as e:
            raise CudaError(f"{label}: kernel failed: {e}") from None

    def event(self):
        return self.drv.Event()

    def time_ms(self, fn, warmup: int = 3, repeat: int = 20, flush_l2: bool = False) -> list[float]:
        """Run fn() (which launches on rt.stream) and return per-repeat times in ms (CUDA events).
        With flush_l2, a buffer twice the L2 size is overwritten before each timed repeat."""
        for _ in range(warmup):
            fn()
        flush = self.empty((2 * self.l2_bytes,), np.uint8) if flush_l2 else None
        times = []
        for _ in range(repeat):
            if flush is not None:
                flush.fill_bytes(repeat & 0xFF)
            start, end = self.event(), self.event()
            start.record(self.stream)
            fn()
            end.record(self.stream)
            end.synchronize()
            times.append(end.time_since(start))
        return times
