"""Data parallel training: one process per GPU, started by mpirun, gradients reduced per layer.

    mpirun -np 2 python train_gpt2.py -e d12 -b 16 -t 1024              # 2 GPUs, all-reduce (-z 0)
    mpirun -np 8 python train_gpt2.py -e d12 -b 16 -t 1024 -z 1         # 8 GPUs, ZeRO-1
    mpirun -np 2 python train_gpt2.py --device cpu -e L2C64H2 -b 2 -t 64 -x 10   # numpy backend + MPI
    python -m pytest -q tests/test_dist.py                              # 2 ranks vs 1 on the numpy backend

How it works, as llm.c does it (docs/multi_gpu.md has more):
- mpirun starts N copies of train_gpt2.py. mpi4py gives each its rank, the number of ranks and its
  rank on this host (the local rank), which picks its GPU. Rank 0 alone prints, logs, samples and
  writes the model file. Every rank reads its own B*T slice of each window of N*B*T tokens
  (llmc.data), so N ranks at B train on exactly what one rank at B*N would.
- Backward calls a hook as soon as a layer's gradients are launched (model.train_micro_step's
  on_layer_grads). The hook records an event on the compute stream; a second stream waits for it
  and reduces that layer's 12 gradient tensors (one NCCL group) while backward goes on with the
  layers below. The micro-step ends with the compute stream waiting for the last reduction (another
  event): no host sync anywhere. On the GPU that whole micro-step, NCCL calls and events included,
  is captured once into a CUDA graph and replayed, as the single-GPU step is.
- -z 0: the reductions are all-reduces (average) in place; every rank then runs the same clip +
  AdamW on the whole model (model.update), holding all of m and v.
- -z 1 (ZeRO-1): every gradient tensor (per layer) is cut into N equal pieces; the reductions are
  reduce-scatters, so rank r receives the average of piece r of each tensor, into a contiguous
  buffer of num_parameters/N floats. The grad norm is the sum over ranks of each rank's squared
  shard norm (an all-reduce of one float); AdamW runs on the rank's pieces only, with m and v of
  num_parameters/N floats each (N times less optimizer memory); then an all-gather of each tensor's
  updated pieces gives every rank the whole new weights.
- --precision bf16: the gradients are bf16 and are reduced as bf16 (ncclBfloat16, through nccl4py's
  low-level bindings: NcclComm._bf16), as llm.c reduces them; the all-gather moves bf16 weights.
  With -z 1 each rank also keeps its pieces of the fp32 master weights (its state file holds them,
  llm.c's layout), and AdamW writes the rank's bf16 pieces from them before the all-gather. Every
  rank draws the same stochastic-rounding seeds (-z 0: every rank rounds every weight the same way).
- On the GPU the collectives are NCCL's (nccl4py) on our own device pointers and streams; on the
  numpy backend they are MPI's (mpi4py) on the numpy buffers, the same code path otherwise: that
  is what CI runs (tests/test_dist.py).
- Failures: errors found while setting up (a bad flag, a file, no GPU for a rank, no NCCL) are
  gathered from every rank at a few agreement points; if any rank failed, rank 0 prints one line and
  every rank exits 1. The start-up (MPI_Init and the first collective) and NCCL's runs under a
  watchdog process: LLMC_DIST_TIMEOUT seconds (default 120; the agreement points get 10 times
  that), then one line and exit 1, so no rank hangs forever on a rank that never started. An
  unexpected exception on one rank aborts the whole job.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from llmc.bf16 import BF16
from llmc.config import DECAYED, param_layout, param_shapes
from llmc import ops
from llmc import switches
from llmc.errors import LLMCError

# environment variables that MPI launchers set in the processes they start: Open MPI, MPICH and
# Intel MPI (hydra), PMIx-based launchers, MVAPICH. LLMC_MPI=1 forces MPI on (an unusual launcher).
MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
DEFAULT_TIMEOUT = 120.0


def launched_by_mpi() -> bool:
    return switches.on("LLMC_MPI") or any(v in os.environ for v in MPI_ENV)


def _env_rank() -> int:
    """This process's rank from the launcher's environment (before MPI is up; 0 if unknown)."""
    for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return 0


def timeout_seconds() -> float:
    t = switches.value("LLMC_DIST_TIMEOUT")
    return DEFAULT_TIMEOUT if t is None else t


class DistError(LLMCError):
    """An error agreed on by every rank: rank 0 prints it, the others exit quietly."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet


class Watchdog:
    """A small process forked before MPI starts, which ends this one if a step it is told about
    (arm) does not finish (disarm) in time. It must be a process, not a thread: MPI_Init and NCCL's
    start-up block inside C code that holds the GIL, where no Python thread or signal handler runs.
    On a timeout it prints one line (rank 0) and kills this process; mpirun then ends the others.
    When this process exits, the pipe closes and the watchdog goes too."""

    def __init__(self, rank: int):
        r, w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the watchdog
            os.close(w)
            try:
                _watch(r, parent, rank)
            finally:
                os._exit(0)
        os.close(r)
        self._w, self.pid = w, pid

    def arm(self, seconds: float, what: str) -> None:
        os.write(self._w, f"arm {seconds} {what}\n".encode())

    def disarm(self) -> None:
        os.write(self._w, b"disarm\n")


def _watch(fd: int, parent: int, rank: int) -> None:
    import select
    import signal
    import time
    deadline, seconds, what, buf = None, 0.0, "", b""
    while True:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([fd], [], [], wait)
        if not ready:  # the deadline passed
            if rank == 0:
                os.write(2, (f"error: data parallel: {what} did not finish within {seconds:g} s (did a "
                             f"rank fail to start? see its output; LLMC_DIST_TIMEOUT sets the limit)\n").encode())
            os.kill(parent, signal.SIGKILL)
            return
        data = os.read(fd, 4096)
        if not data:  # the trainer has exited
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd, _, rest = line.decode().partition(" ")
            if cmd == "arm":
                sec, _, what = rest.partition(" ")
                seconds = float(sec)
                deadline = time.monotonic() + seconds
            else:
                deadline = None


# ----------------------------------------------------------------------------------------------
# the process group: ranks, host-side collectives (MPI), agreement on errors


class Group:
    """rank / world / local rank of this process, and the few host-side collectives the trainer
    needs (MPI through mpi4py). Group() is the single process: every collective is the identity."""

    def __init__(self, comm=None, local_rank: int = 0, local_world: int = 1):
        self.comm = comm
        self.rank = comm.Get_rank() if comm is not None else 0
        self.world = comm.Get_size() if comm is not None else 1
        self.local_rank, self.local_world = local_rank, local_world

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls) -> "Group":
        """The group of processes mpirun started (or the single process, if none did): MPI_Init
        and a first all-gather, under the watchdog."""
        if not launched_by_mpi():
            return cls()
        timeout = timeout_seconds()
        dog = Watchdog(_env_rank())
        dog.arm(timeout, "the MPI start-up (MPI_Init and a first all-gather across ranks)")
        try:
            from mpi4py import MPI
        except ImportError:
            raise LLMCError("started by mpirun but mpi4py is not installed: pip install mpi4py "
                            "(and an MPI, e.g. pip install mpich; see README)") from None
        comm = MPI.COMM_WORLD
        # the ranks on this host, in rank order: local rank = which GPU to use
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        g = cls(comm, local.Get_rank(), local.Get_size())
        hosts = comm.allgather(MPI.Get_processor_name())  # the first collective
        dog.disarm()
        g.watchdog, g.timeout, g.num_hosts = dog, timeout, len(set(hosts))
        return g

    def guarded(self, what: str, scale: float = 1.0):
        """A context in which `what` must finish within scale x LLMC_DIST_TIMEOUT seconds."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            if self.watchdog is None:
                yield
                return
            self.watchdog.arm(scale * self.timeout, what)
            try:
                yield
            finally:
                self.watchdog.disarm()
        return ctx()

    num_hosts = 1
    watchdog, timeout = None, DEFAULT_TIMEOUT
    phase = "setup"  # "train" once the loop starts: then an error on one rank aborts the job

    def allgather(self, obj) -> list:
        return [obj] if self.comm is None else self.comm.allgather(obj)

    def agree(self, error: str | None, what: str = "set-up") -> None:
        """A point every rank reaches, with its error (None = fine). If any rank failed, every
        rank raises DistError with the first failing rank's message (printed by rank 0 only)."""
        if self.comm is None:
            if error is not None:
                raise LLMCError(error)
            return
        # (generous: the ranks may take a while to set up, e.g. building the kernels)
        with self.guarded(f"agreeing on the {what} across ranks", scale=10):
            errors = self.comm.allgather(error)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not bad:
            return
        r, e = bad[0]
        same = all(x == e for _, x in bad) and len(bad) == self.world
        msg = e if same else f"rank {r}: {e}" + (f" (and {len(bad) - 1} more ranks failed)" if len(bad) > 1 else "")
        raise DistError(msg, quiet=not self.is_main)

    def mean(self, x: float) -> float:
        """The average of a host float over the ranks (losses for printing)."""
        if self.comm is None:
            return float(x)
        from mpi4py import MPI
        return float(self.comm.allreduce(float(x), op=MPI.SUM)) / self.world

    def abort(self, code: int = 1) -> None:
        """Take the whole job down (an unexpected error on one rank; the others would hang)."""
        if self.comm is not None:
            self.comm.Abort(code)


# ----------------------------------------------------------------------------------------------
# collectives on the model's buffers: MPI on numpy arrays, NCCL on device pointers


class MpiComm:
    """Collectives on the numpy backend's buffers, through MPI (host memory, blocking). Streams and
    events are no-ops here: every call has finished when it returns."""

    def __init__(self, group: Group):
        from mpi4py import MPI
        self.MPI, self.comm, self.world = MPI, group.comm, group.world

    def all_reduce_avg(self, bufs, stream=None) -> None:
        for b in bufs:  # in place
            self.comm.Allreduce(self.MPI.IN_PLACE, b, op=self.MPI.SUM)
            b *= b.dtype.type(1.0 / self.world)

    def reduce_scatter_avg(self, pairs, stream=None) -> None:
        for send, recv in pairs:  # send (n,) -> recv (n/N,): the average of piece `rank`
            self.comm.Reduce_scatter_block(send, recv, op=self.MPI.SUM)
            recv *= recv.dtype.type(1.0 / self.world)

    def all_reduce_sum(self, buf, stream=None) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)

    def all_gather(self, pairs, stream=None) -> None:
        for send, recv in pairs:  # send is recv's piece `rank` (in place)
            self.comm.Allgather(self.MPI.IN_PLACE, recv)

    # streams and events: nothing to order on the host
    def new_stream(self):
        return None

    def record(self, stream):
        return None

    def wait(self, stream, event):
        pass


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):   # DLPack >= 1.0: version first, then flags
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_DL_CODES = {"i": 0, "u": 1, "f": 2}      # DLPack's kDLInt, kDLUInt, kDLFloat
_DL_NAME = b"dltensor"                    # the capsule names: unversioned, and DLPack >= 1.0's
_DL_NAME_V = b"dltensor_versioned"
_LIVE: dict = {}   # address -> the ctypes structs of a handed-out tensor, until its consumer deletes it


@ctypes.CFUNCTYPE(None, ctypes.c_void_p)
def _dl_deleter(addr):
    _LIVE.pop(addr, None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _CudaArray:
    """A DevArray (or view) as nccl4py takes foreign device memory: 1-D, contiguous, read-write,
    through DLPack (which names the device: kDLCUDA and this rank's GPU) and, for consumers that
    only know it, __cuda_array_interface__ (which does not: nccl4py then guesses the device, and
    guessed GPU 0 for rank 1 of 2 on the H200s). `device` is (DLPack device type, ordinal):
    (2, gpu) for CUDA memory; the tests use (1, 0), host memory, to check the layout with numpy."""

    def __init__(self, a, device=None):
        self.ptr, self.size, self.dtype = int(a.ptr), int(a.size), np.dtype(a.dtype)
        self.device = device or (2, int(getattr(getattr(a, "rt", None), "ordinal", 0)))
        self.__cuda_array_interface__ = {"shape": (self.size,), "strides": (self.dtype.itemsize,),
                                         "data": (self.ptr, False), "typestr": self.dtype.str,
                                         "stream": None, "version": 3}

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        # stream: the consumer's stream; our collectives are ordered by the caller's events, so
        # there is nothing to wait for here. The structs stay alive (in _LIVE) until the consumer
        # calls the deleter; the memory they describe is the model's and outlives them.
        if copy:
            raise BufferError("_CudaArray does not copy")
        shape, strides = (ctypes.c_int64 * 1)(self.size), (ctypes.c_int64 * 1)(1)
        t = _DLTensor(self.ptr, _DLDevice(*self.device), 1,
                      _DLDataType(_DL_CODES[self.dtype.kind], 8 * self.dtype.itemsize, 1), shape, strides, 0)
        deleter = ctypes.cast(_dl_deleter, ctypes.c_void_p)
        if max_version is not None and tuple(max_version) >= (1, 0):   # the consumer reads 1.0
            managed, name = _DLManagedTensorVersioned(1, 0, None, deleter, 0, t), _DL_NAME_V
        else:
            managed, name = _DLManagedTensor(t, None, deleter), _DL_NAME
        _LIVE[ctypes.addressof(managed)] = (managed, shape, strides)
        return _capsule_new(ctypes.addressof(managed), name, None)


def _make_current(ordinal: int) -> None:
    """Make GPU `ordinal` the current device for every library nccl4py may ask: the CUDA runtime
    (cudaSetDevice), cuda.core (which resolves our __cuda_array_interface__ views) and CuPy. PyCUDA
    already holds that device's primary context; without this, rank 1 of 2 on one host got "sendbuf
    is on device 0, but communicator is on device 1" on the H200s, though its buffers were on GPU 1."""
    try:
        from cuda.bindings import runtime as cudart
        cudart.cudaSetDevice(ordinal)
    except ImportError:
        pass
    for mod in ("cuda.core", "cuda.core.experimental"):  # Device moved out of .experimental in 0.4
        try:
            Device = __import__(mod, fromlist=["Device"]).Device
        except (ImportError, AttributeError):
            continue
        try:
            Device(ordinal).set_current()
        except Exception:
            pass
        break
    try:
        import cupy
        cupy.cuda.Device(ordinal).use()
    except Exception:
        pass


class NcclComm:
    """Collectives on the cuda backend's DevArrays through NCCL's Python bindings (nccl4py), on our
    own PyCUDA streams; nothing goes through the host. One communicator over all ranks, created
    from a unique id that rank 0 makes and MPI broadcasts."""

    def __init__(self, group: Group, rt):
        # NVLink SHARP (multicast) stays off unless asked for: the machines we measured on forbid it,
        # and at these message sizes it is not what limits us (docs/multi_gpu.md)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        try:
            import nccl.core as nccl
        except ImportError as e:
            raise LLMCError(f"multi-GPU needs NCCL's Python bindings (pip install nccl4py): {e}") from None
        self.nccl, self.rt, self.world = nccl, rt, group.world
        _make_current(getattr(rt, "ordinal", 0))
        uid = nccl.get_unique_id() if group.is_main else None
        uid = group.comm.bcast(bytes(uid) if uid is not None else None, root=0)
        self.comm = nccl.Communicator.init(group.world, group.rank, nccl.UniqueId.from_bytes(uid))
        self._check_device(rt)

    def _check_device(self, rt) -> None:
        """nccl4py works out which GPU a buffer lives on by itself; if that is not the
        communicator's GPU, every collective would fail mid-step. Ask once, at start-up, with one of
        our own allocations, and say so in one line."""
        try:
            from nccl.core.buffer import NcclBuffer
            probe = rt.empty((4,), np.float32)
            seen, mine = NcclBuffer(_CudaArray(probe)).device_id, self.comm.device.device_id
        except Exception:  # an nccl4py without these internals: the collectives will tell
            return
        if seen != mine:
            raise LLMCError(f"NCCL: nccl4py sees this rank's buffers on GPU {seen} but its communicator on "
                            f"GPU {mine} (rank {self.comm.rank}, PyCUDA device {getattr(rt, 'ordinal', '?')}); "
                            "the buffers go to nccl4py through DLPack (llmc/dist.py: _CudaArray): is nccl4py older than 0.6?")

    def describe(self) -> str:
        try:
            return f"NCCL {self.nccl.get_version()}"
        except Exception:
            return "NCCL"

    def _h(self, stream) -> int:
        return int((stream or self.rt.stream).handle)

    def _bf16(self, kind, send, recv, op, h) -> None:
        """A collective on bf16 buffers (BF16: uint16 bits on our side), as ncclBfloat16, through
        nccl4py's low-level bindings: its buffer resolution would see uint16 (which NCCL has not)
        and names bfloat16 only through the optional ml_dtypes package. NCCL reduces in bf16, as
        llm.c's bf16 gradient reductions do."""
        from nccl.bindings import nccl as raw
        comm = getattr(self.comm, "_comm", None) or raw.Comm(int(self.comm.ptr))
        dt = int(self.nccl.NcclDataType.BFLOAT16)
        if kind == "allreduce":
            raw.all_reduce(send.ptr, recv.ptr, send.size, dt, int(op), comm, h)
        elif kind == "reduce_scatter":
            raw.reduce_scatter(send.ptr, recv.ptr, recv.size, dt, int(op), comm, h)
        else:
            raw.all_gather(send.ptr, recv.ptr, send.size, dt, comm, h)

    def all_reduce_avg(self, bufs, stream=None) -> None:
        h = self._h(stream)
        with self.nccl.group():
            for b in bufs:
                if b.dtype == BF16:
                    self._bf16("allreduce", b, b, self.nccl.AVG, h)
                    continue
                a = _CudaArray(b)
                self.comm.allreduce(a, a, self.nccl.AVG, stream=h)

    def reduce_scatter_avg(self, pairs, stream=None) -> None:
        h = self._h(stream)
        with self.nccl.group():
            for send, recv in pairs:
                if send.dtype == BF16:
                    self._bf16("reduce_scatter", send, recv, self.nccl.AVG, h)
                    continue
                self.comm.reduce_scatter(_CudaArray(send), _CudaArray(recv), self.nccl.AVG, stream=h)

    def all_reduce_sum(self, buf, stream=None) -> None:
        a = _CudaArray(buf)
        self.comm.allreduce(a, a, self.nccl.SUM, stream=self._h(stream))

    def all_gather(self, pairs, stream=None) -> None:
        h = self._h(stream)
        with self.nccl.group():
            for send, recv in pairs:  # send = recv + rank * count: in place
                if send.dtype == BF16:
                    self._bf16("all_gather", send, recv, None, h)
                    continue
                self.comm.allgather(_CudaArray(send), _CudaArray(recv), stream=h)

    def new_stream(self):
        return self.rt.drv.Stream()

    def record(self, stream):
        ev = self.rt.drv.Event(self.rt.drv.event_flags.DISABLE_TIMING)
        ev.record(stream or self.rt.stream)
        return ev

    def wait(self, stream, event):
        (stream or self.rt.stream).wait_for_event(event)

    def close(self):
        try:
            self.comm.destroy()
        except Exception:
            pass


def check_gpus(group: Group) -> str | None:
    """None if this host has a GPU for each of its ranks (device = local rank), else why not."""
    try:
        import pycuda.driver as drv
        drv.init()
        n = drv.Device.count()
    except ImportError:
        return "--device cuda: PyCUDA is not installed (pip install pycuda)"
    except Exception as e:
        return f"--device cuda: no usable CUDA GPU ({e})"
    if group.local_world > n:
        return (f"{group.local_world} ranks on this host but {n} GPU{'s' if n != 1 else ''}: one "
                f"process per GPU (mpirun -np {n} or fewer per host)")
    return None


# ----------------------------------------------------------------------------------------------
# data parallel training of one model


def grad_chunks(cfg) -> tuple[dict, list]:
    """The gradient tensors as reduction units: {layer: [(offset, size, decay)]} for l = 0..L-1,
    and [(offset, size, decay)] for the tensors outside the layers (wte, wpe, lnfw, lnfb). Every
    per-layer tensor is a chunk per layer, so a layer's reduction can start as soon as backward
    has written it. Together the chunks tile the flat buffer in order."""
    L = cfg.num_layers
    per_layer, rest = {l: [] for l in range(L)}, []
    for (name, shape), (_, off, size) in zip(param_shapes(cfg), param_layout(cfg)):
        decay = name in DECAYED
        if name in ("wte", "wpe", "lnfw", "lnfb"):
            rest.append((off, size, decay))
        else:
            n = size // L
            for l in range(L):
                per_layer[l].append((off + l * n, n, decay))
    return per_layer, rest


class RankMeanRead:
    """A StepRead whose loss is the mean over the ranks (each rank reads its own, then all-reduce):
    every rank must read its steps in the same order."""

    def __init__(self, read, group: Group):
        self.read, self.group, self._loss = read, group, None

    def loss(self) -> float:
        if self._loss is None:
            self._loss = self.group.mean(self.read.loss())
        return self._loss

    def norm(self) -> float:
        return self.read.norm()


class DataParallel:
    """Training-step calls for one rank: the micro-step (with the per-layer reduction hook on the
    last one), the update (all-reduce + AdamW, or ZeRO-1), the losses averaged over ranks, and the
    optimizer state this rank checkpoints. With one rank it is the model's own calls."""

    def __init__(self, group: Group, model, zero: int, comm=None):
        if zero not in (0, 1):
            raise LLMCError(f"-z/--zero-stage {zero}: expected 0 (all-reduce) or 1 (ZeRO-1)")
        self.group, self.model, self.be = group, model, model.be
        self.world, self.rank = group.world, group.rank
        self.zero = zero if self.world > 1 else 0  # one rank: nothing to shard
        self.comm = comm
        self.trace = None  # list of (label, stream name, start event, end event) when profiling
        # where a layer's gradient reduction starts: "attention" (the next layer's attention backward)
        # or "layer" (as soon as the layer's backward is launched); LLMC_DP_LAUNCH overrides
        where = switches.value("LLMC_DP_LAUNCH")
        self.delay, self._pending = where == "attention", None
        # -z 1: where the updated weights are all-gathered: "forward" (on the second stream, layer by
        # layer, each waited for just before the next forward reads it) or "update" (at the end of
        # the update, on the compute stream); LLMC_DP_GATHER overrides
        gather = switches.value("LLMC_DP_GATHER")
        self.gather_in_forward, self._gathered = gather == "forward", {}
        # the reducing micro-step as a CUDA graph of its own (forward, backward, the NCCL calls on the
        # second stream and the events between them), like the single-GPU step; LLMC_DP_GRAPH=0
        # launches it kernel by kernel (measured on 2 H200s, bf16 d12 B=16: ~0.75 ms a step of Python
        # launches that the GPU waits for). The forward's waits for ZeRO-1's all-gathers in flight
        # (LLMC_DP_GATHER=forward) wait on events of the previous step: those steps launch directly.
        self.graph = switches.on("LLMC_DP_GRAPH") and not self.gather_in_forward
        self._reduced = None
        if self.world == 1:
            return
        if model.has_optimizer == (self.zero == 1):
            raise ValueError("DataParallel: build the model with optimizer=(zero == 0)")
        # the micro-steps without the hook may replay a graph; the reducing one launches directly
        self.per_layer, self.rest = grad_chunks(model.cfg)
        self.comm_stream = comm.new_stream()
        be, N = self.be, self.world
        if self.zero == 1:
            P = model.num_params
            bad = [(o, n) for o, n, _ in self._all_chunks() if n % N]
            if bad:
                name = _tensor_name(model.cfg, bad[0][0])
                raise LLMCError(f"-z 1: {name} has {bad[0][1]:,} values per layer, not divisible by "
                                f"{N} ranks: ZeRO-1 splits every tensor evenly (use -z 0 or a rank count "
                                f"that divides it)")
            S = P // N  # this rank's shard: piece `rank` of every chunk, in the buffer's order
            self.shard_size = S
            f32 = model.f32  # bf16: the gradients are reduce-scattered in bf16, the rest stays fp32
            self.gshard = be.zeros((S,))   # reduced gradient pieces
            self.m = be.zeros((S,), f32)
            self.v = be.zeros((S,), f32)
            self.norm2 = be.zeros((1,), f32)
            self.k_norm = be.op("global_norm", n=S)
            self.hp = be.zeros((2, 8), f32)            # row 0 no decay, row 1 decay
            self._pinned_hp = be.pinned((2, 8), f32)
            self.hps = [be.view(self.hp, 8 * i, (8,)) for i in range(2)]
            # bf16: this rank's pieces of the fp32 master weights (as llm.c's bf16 ZeRO-1 keeps them),
            # and one stochastic-rounding seed per chunk
            self.master = be.zeros((S,), f32) if model.bf16 else None
            chunks = self._all_chunks()
            if model.bf16:
                self.seeds = be.zeros((len(chunks),), np.uint32)
                self._pinned_seeds = be.pinned((len(chunks),), np.uint32)
            # one AdamW launch over every piece (adamw variant 3: ~150 pieces at d12 on 2 ranks, where a
            # launch per piece cost ~1 ms per step on an H200); another --adamw-kernel: one per piece
            pieces = tuple((off + self.rank * (n // N), off // N, n // N, int(decay)) for off, n, decay in chunks)
            num = be.choose("adamw", prefer=3, n=S, chunks=pieces)
            self.adamw_all = None
            if num == 0 or "chunks" in ops.get("adamw").variant(num).options:  # (0: the numpy backend)
                self.adamw_all = be.op("adamw", prefer=3, n=S, chunks=pieces)
            adamw = {}
            self.plan = []  # per chunk: launcher, decay, param piece, grad piece, m, v (, master, seed) pieces
            for i, (off, n, decay) in enumerate(chunks):
                s = n // N
                if s not in adamw:
                    adamw[s] = be.op("adamw", n=s)
                so = off // N  # the shard buffers hold the chunks' pieces in order
                self.plan.append((adamw[s], int(decay), be.view(model.params, off + self.rank * s, (s,)),
                                  be.view(self.gshard, so, (s,)), be.view(self.m, so, (s,)),
                                  be.view(self.v, so, (s,)))
                                 + ((be.view(self.master, so, (s,)), be.view(self.seeds, i, (1,)))
                                    if model.bf16 else ()))
            if model.bf16:  # until load_master gives the exact fp32 weights: the bf16 ones
                self.load_master(model.to_host(model.params))

    def _all_chunks(self):
        return [c for l in range(self.model.cfg.num_layers) for c in self.per_layer[l]] + self.rest

    def describe(self) -> str:
        if self.world == 1:
            return "1 rank"
        how = "ZeRO-1 (reduce-scatter, sharded AdamW, all-gather)" if self.zero else "all-reduce"
        hosts = f" on {self.group.num_hosts} hosts" if self.group.num_hosts > 1 else ""
        via = self.comm.describe() if hasattr(self.comm, "describe") else "MPI"
        return f"{self.world} ranks{hosts}, -z {self.zero}: {how} per layer, {via}"

    # -- one training step

    def train_micro_step(self, x, y, last: bool) -> None:
        """Forward + backward on this rank's batch; on the last micro-step of the optimizer step
        each layer's gradients start reducing on the second stream as soon as they exist."""
        if self.world == 1 or not last:
            self.params_ready()  # (a graph replay: it waits for the whole all-gather first)
            self.model.train_micro_step(x, y)
            return
        if self.graph:
            self.model.train_micro_step(x, y, custom=self._launch_reducing)
            return
        self._pending = None
        self.model.train_micro_step(x, y, on_layer_grads=self._layer_done,
                                    before_attention=self._launch_pending if self.delay else None,
                                    before_layer=self._wait_gathered if self._gathered else None)
        self.params_ready()  # (a no-op: the forward waited for every piece)
        self._join()

    def _launch_reducing(self) -> None:
        """The last micro-step's launches, capturable: forward, backward with each layer's reduction
        on the second stream, and the compute stream's wait for the last one (a graph must end
        with every stream it forked joined back)."""
        self._pending = None
        self.model._launch_forward(True, True)
        self.model._launch_backward(self._layer_done, self._launch_pending if self.delay else None)
        self._join()

    def _join(self) -> None:
        """The compute stream waits for the last reduction: the update and the norm read them."""
        self.comm.wait(None, self._reduced)
        self._reduced = None

    def _wait_gathered(self, layer) -> None:
        """Called by the forward just before it first reads layer `layer`'s weights (None: wte, wpe
        and the final layernorm, before the encoder): the compute stream waits for that all-gather."""
        ev = self._gathered.pop(layer, None)
        if ev is not None:
            self.comm.wait(None, ev)

    def params_ready(self) -> None:
        """The compute stream waits for every all-gather still in flight (-z 1): call it before
        anything but the training forward reads the weights (validation, sampling, a checkpoint).
        The second stream runs them in order, so waiting for the last one waits for all."""
        if self._gathered:
            self.comm.wait(None, list(self._gathered.values())[-1])
            self._gathered = {}

    def _layer_done(self, layer) -> None:
        """Layer `layer`'s gradients are launched (None: the rest, after the encoder's backward).
        With `delay` a layer's reduction waits for the next layer's attention backward (see
        _launch_pending); layer 0's and the rest go now."""
        if self.delay and layer:  # (layer 0, the last: only the encoder's backward is left, so it goes now)
            self._launch_pending(layer)  # (never pending here: the attention backward between launched it)
            self._pending = layer
            return
        self._launch_pending(layer)
        self._reduce_layer(layer)

    def _launch_pending(self, _layer) -> None:
        """Called just before a layer's attention backward: the previous layer's reduction starts
        here, beside a kernel whose thousands of blocks share the SMs with NCCL's, instead of beside
        the persistent GEMM that opens each layer's backward (one block per SM: a block that finds
        its SM taken by NCCL starts late and holds up the GEMM; measured +1.9 ms a step on 2 H200s)."""
        if self._pending is not None:
            layer, self._pending = self._pending, None
            self._reduce_layer(layer)

    def _reduce_layer(self, layer) -> None:
        chunks = self.rest if layer is None else self.per_layer[layer]
        be, comm, cs = self.be, self.comm, self.comm_stream
        # the second stream waits for backward to have written these gradients (no host sync)
        comm.wait(cs, comm.record(None))
        label = "rest" if layer is None else f"layer {layer}"
        t0 = self._mark(cs)
        if self.zero == 0:
            comm.all_reduce_avg([be.view(self.model.grads, off, (n,)) for off, n, _ in chunks], cs)
        else:
            N = self.world
            comm.reduce_scatter_avg([(be.view(self.model.grads, off, (n,)),
                                      be.view(self.gshard, off // N, (n // N,))) for off, n, _ in chunks], cs)
        self._span(("all-reduce " if self.zero == 0 else "reduce-scatter ") + label, "comm", t0, cs)
        if layer is None:  # the last reduction: the compute stream waits for this event (_join)
            self._reduced = comm.record(cs)

    def update(self, lr: float, step: int, weight_decay: float = 0.0, max_norm: float = 1.0,
               beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8) -> None:
        model = self.model
        if self.world == 1:
            model.update(lr, step, weight_decay=weight_decay, max_norm=max_norm)
            return
        # (the compute stream waited for every reduction at the end of the micro-step: _join)
        if self.zero == 0:
            t0 = self._mark(None)
            model.update(lr, step, weight_decay=weight_decay, max_norm=max_norm)
            self._span("clip + AdamW", "compute", t0, None)
            return
        from llmc.ops.adamw import hyperparams
        be, comm = self.be, self.comm
        t0 = self._mark(None)
        # the global norm: each rank's squared norm of its shard, summed over ranks
        self.k_norm(self.norm2, self.gshard)
        comm.all_reduce_sum(self.norm2)
        be.pinned_free(self._pinned_hp)
        for decay in (0, 1):
            self._pinned_hp[decay] = hyperparams(lr, beta1, beta2, eps, weight_decay if decay else 0.0,
                                                 step, max_norm, model.f32)
        be.upload_async(self.hp, self._pinned_hp)
        if self.master is not None:
            be.pinned_free(self._pinned_seeds)
            self._pinned_seeds[:] = model.draw_seeds(len(self.plan))
            be.upload_async(self.seeds, self._pinned_seeds)
        if self.adamw_all is not None:
            self.adamw_all(model.params, self.gshard, self.m, self.v, self.norm2, self.hp,
                           *(() if self.master is None else (self.master, self.seeds)))
        else:
            for adamw, decay, p, g, m, v, *master_seed in self.plan:
                adamw(p, g, m, v, self.norm2, self.hps[decay], *master_seed)
        self._span("norm + sharded AdamW", "compute", t0, None)
        # every rank gets every tensor's updated pieces
        if not self.gather_in_forward:  # on the compute stream, all at once
            t1 = self._mark(None)
            comm.all_gather(self._gather_pairs(self._all_chunks()))
            self._span("all-gather params", "compute", t1, None)
            return
        # on the second stream, in the order the next forward reads them: wte, wpe and lnf first (the
        # encoder), then layer 0, 1, ...; an event after each, which the forward waits for just before
        # that layer (_wait_gathered). Measured on 2 H200s at d12, the whole all-gather took ~1 ms
        # (fp32) at the end of the update; layer by layer it hides under the forward's GEMMs.
        cs = self.comm_stream
        comm.wait(cs, comm.record(None))  # after AdamW wrote this rank's pieces
        self._gathered = {}
        for layer in [None] + list(range(model.cfg.num_layers)):
            t1 = self._mark(cs)
            comm.all_gather(self._gather_pairs(self.rest if layer is None else self.per_layer[layer]), cs)
            self._span("all-gather " + ("rest" if layer is None else f"layer {layer}"), "comm", t1, cs)
            self._gathered[layer] = comm.record(cs)

    def _gather_pairs(self, chunks):
        """(this rank's piece, the whole tensor) of each chunk: the all-gather is in place."""
        be, N, params = self.be, self.world, self.model.params
        return [(be.view(params, off + self.rank * (n // N), (n // N,)), be.view(params, off, (n,)))
                for off, n, _ in chunks]

    def grad_norm_before_update(self) -> float:
        """The global norm of the reduced gradients before any update (llm.c's -sg guard): the
        same value on every rank. (The micro-step ended with the compute stream waiting for the
        reductions.)"""
        model = self.model
        if self.zero == 0:
            model.k["global_norm"](model.norm2, model.grads)
            return model.grad_norm()
        self.k_norm(self.norm2, self.gshard)
        self.comm.all_reduce_sum(self.norm2)
        return self.grad_norm()

    def grad_norm(self) -> float:
        if self.zero == 0:
            return self.model.grad_norm()
        return float(np.sqrt(max(float(self.be.download(self.norm2).reshape(-1)[0]), 0.0)))

    def read_step(self) -> "RankMeanRead":
        """The step's loss and gradient norm on their way to the host (GPT2.read_step, queued behind
        the step); the loss is averaged over the ranks when it is read."""
        return RankMeanRead(self.model.read_step(norm_buf=self.norm2 if self.zero == 1 else None), self.group)

    def step_loss(self) -> float:
        """The step's mean loss over every rank's tokens (a host read and a host all-reduce)."""
        return self.group.mean(self.model.step_loss())

    def mean(self, x: float) -> float:
        return self.group.mean(x)

    # -- checkpoints: what this rank writes and reads

    def optimizer_state(self) -> tuple[np.ndarray, np.ndarray]:
        """(m, v) as this rank holds them: the whole model's, or (ZeRO-1) its shard."""
        src = self if self.zero == 1 else self.model
        return (self.be.download(src.m).reshape(-1), self.be.download(src.v).reshape(-1))

    def master_state(self) -> np.ndarray | None:
        """The fp32 master weights this rank checkpoints (bf16 runs): its ZeRO-1 pieces, or the
        whole model's; None in fp32."""
        if self.zero == 1:
            return None if self.master is None else self.be.download(self.master).reshape(-1)
        return None if self.model.master is None else self.be.download(self.model.master).reshape(-1)

    def load_master(self, full: np.ndarray) -> None:
        """bf16 ZeRO-1: this rank's pieces of the whole model's fp32 weights `full` into its master
        shard (-z 0 and one rank: the model's load_params does this)."""
        if self.zero != 1 or self.master is None:
            return
        N, full = self.world, np.asarray(full, np.float32).reshape(-1)
        host = np.empty(self.shard_size, np.float32)
        for off, n, _ in self._all_chunks():
            s = n // N
            host[off // N:off // N + s] = full[off + self.rank * s:off + (self.rank + 1) * s]
        self.be.upload(self.master, host)

    def optimizer_numel(self) -> int:
        return self.shard_size if self.zero == 1 else self.model.num_params

    def load_optimizer_state(self, m, v) -> None:
        dst = self if self.zero == 1 else self.model
        self.be.upload(dst.m, m)
        self.be.upload(dst.v, v)

    def load_master_shard(self, master) -> None:
        """llm.c's bf16 runs with ZeRO-1 keep each rank's piece of the fp32 master weights in its
        state file (the model file holds bf16): put this rank's pieces into the weights, then
        all-gather, so that every rank starts from the same, exact fp32 weights."""
        if self.zero != 1 or master.size != self.shard_size:
            raise LLMCError(f"master weights of {master.size:,} values: expected this rank's ZeRO-1 "
                            f"shard of {self.optimizer_numel():,} (resume with the -z of the run that wrote them)")
        be, model, N = self.be, self.model, self.world
        if self.master is not None:
            # a bf16 run: the bf16 weights came from the model file (written from these masters by
            # the same rounding): only the master pieces are this rank's to restore
            be.upload(self.master, np.asarray(master, np.float32))
            return
        for off, n, _ in self._all_chunks():
            s = n // N
            be.upload(be.view(model.params, off + self.rank * s, (s,)), master[off // N:off // N + s])
        self.comm.all_gather([(be.view(model.params, off + self.rank * (n // N), (n // N,)),
                               be.view(model.params, off, (n,))) for off, n, _ in self._all_chunks()])
        be.synchronize()

    def state_extra(self) -> dict:
        """What this trainer adds to each rank's state trailer (llm.c's header has rank and count)."""
        return {"rank": self.rank, "world": self.world, "zero": self.zero}

    # -- profiling (dev/bench_multi_gpu.py): CUDA events around each collective and update phase

    def _mark(self, stream):
        if self.trace is None:
            return None
        ev = self.be.rt.event()
        ev.record(stream or self.be.rt.stream)
        return ev

    def _span(self, label, lane, start, stream):
        if start is not None:
            end = self._mark(stream)
            self.trace.append((label, lane, start, end))


def _tensor_name(cfg, offset: int) -> str:
    for (name, _), (_, off, size) in zip(param_shapes(cfg), param_layout(cfg)):
        if off <= offset < off + size:
            return name
    return "a tensor"


# ----------------------------------------------------------------------------------------------
# checkpoints of a data-parallel run: llm.c's run directory (llmc/runfiles.py), one state file per
# rank. Rank 0 writes the model; every rank writes state_%08d_%05d.bin with llm.c's header (the
# number of processes and the rank), its m and v (the whole model's with -z 0, its ZeRO-1 shard
# with -z 1, laid out as llm.c lays its shards out: piece `rank` of each tensor's per-layer slice, in
# the parameters' order) and our trailer (its loader position and RNG, the rank count and -z);
# rank 0 writes DONE_%08d once every rank has written (an agreement point, Group.agree).


def load_checkpoint(out_dir, step: int, rank: int, world: int, zero: int) -> dict:
    """This rank's part of the checkpoint of `step` (llmc.runfiles.load_checkpoint): the model and
    its own state file, whose m and v are the whole model's (-z 0) or this rank's ZeRO-1 shard
    (-z 1). A run of another rank count is refused first (runfiles.check_processes); a state of
    the other -z is one line saying which -z wrote it."""
    from llmc import runfiles
    runfiles.check_processes(out_dir, step, world)
    try:
        return runfiles.load_checkpoint(out_dir, step, rank=rank, world=world, shards=world if zero else 1)
    except LLMCError as first:
        if world == 1:
            raise
        try:  # does it read as the other stage's state? (the sizes differ: P vs P/N floats each)
            runfiles.load_checkpoint(out_dir, step, rank=rank, world=world, shards=1 if zero else world)
        except LLMCError:
            raise first from None
        had = "ZeRO-1 shards of m and v (-z 1)" if not zero else "the whole model's m and v (-z 0)"
        # (the same words on every rank, so rank 0 prints it once)
        raise LLMCError(f"-y 1: the checkpoint of step {step} in {out_dir} holds {had} in each rank's "
                        f"state file, this run has -z {zero}: resume with -z {1 - zero}") from None
