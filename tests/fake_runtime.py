"""The CPU tests' one stand-in for the CUDA runtime (llmc/runtime.py: Runtime) and the cuda backend.

FakeRuntime has an H100's attributes (132 SMs, 227 KB of shared memory per block, sm_90) and
hands out DevArrays: with heap_bytes, views into a numpy "device heap" (poisoned with 0xFF, so a
read of unwritten memory shows as NaN); without, made-up addresses (enough to run every build at
GPT-2 sizes). rt.kernel() checks that the entry point exists in cuda/<module>.cu and that the
argtypes string matches its PTX parameter list (nvcc, no GPU); a launch checks the argument count
and shared memory, is recorded in rt.launches and, when the test registered an emulator for the
kernel (rt.emulate[prefix] = fn(rt, *args)), runs it on the heap.

FakeCudaBackend is the real CudaBackend over a FakeRuntime, with each op run by its numpy
reference on the heap memory the DevArrays name: the model's GPU-side plumbing (views, per-layer
indexing, offsets, argument order, graphs) runs in CI exactly as on the GPU.

With precision="bf16" it is the bf16 model's stand-in: each op, built for bf16, runs the fp32
reference on fp32 copies (from_bf16) of its bf16 arguments and writes back, rounded to nearest even
(to_bf16), the bf16 arguments the reference changed; fp32 and int arguments (layernorm statistics,
losses, AdamW's m and v, ...) are the heap memory itself. What it emulates is the bf16 conventions
(load bf16, compute in fp32, round once on the store), not any kernel: it does not need the bf16
builds to exist, and when they do, their launch signatures are the fp32 ones, so the same wrapper
runs them. AdamW's bf16 launch (params, grads, m, v, norm2, hp, master, seed) runs the reference on
the fp32 master, then writes params from it: to nearest even when seed == 0, else stochastically
(one of the two bf16 neighbours, drawn by a generator seeded with `seed`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy
import numpy as np

from llmc import ops
from llmc.backend import CudaBackend
from llmc.bf16 import BF16, bf16_neighbours, from_bf16, to_bf16
from llmc.runtime import DevArray, argtypes_mismatch, compile_ptx, nvcc_path, ptx_signatures

BASE = 0x7F0000000000  # fake device addresses start here

_SIGS: dict = {}


def signatures(module: str) -> dict[str, list[str]]:
    """{entry point: PTX parameter types} of cuda/<module>.cu (compiled once per process, cached on disk)."""
    if module not in _SIGS:
        _SIGS[module] = ptx_signatures(compile_ptx(module, "sm_90"))
    return _SIGS[module]


class _AnyAttr:
    def __getattr__(self, name):
        return name


class _Device:
    """H100-like device attributes, by name."""
    VALUES = {"MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
              "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 228 * 1024, "MULTIPROCESSOR_COUNT": 132}

    def get_attribute(self, name):
        return self.VALUES[name]


@dataclass
class Launch:
    func: str
    grid: tuple
    block: tuple
    args: tuple
    smem: int


class FakeKernel:
    def __init__(self, rt, module, func, argtypes, label):
        self.rt, self.module, self.func, self.argtypes, self.label = rt, module, func, argtypes, label
        self.max_dynamic_smem = 48 * 1024

    def set_max_dynamic_smem(self, n):
        assert n <= self.rt.max_smem_optin, f"{self.label}: {n} bytes of shared memory"
        self.max_dynamic_smem = max(self.max_dynamic_smem, n)

    def attributes(self):
        return {"regs": 64, "local_bytes": 0, "static_smem": 0, "max_threads": 1024}

    def resident_blocks(self, block_size):  # the real formula, over the fake device
        from llmc.runtime import Kernel
        return Kernel.resident_blocks(self, block_size)

    def __call__(self, grid, block, *args, smem=0):
        assert len(args) == len(self.argtypes), \
            f"{self.label}: {len(args)} launch arguments for argtypes {self.argtypes!r}"
        assert smem <= self.max_dynamic_smem, f"{self.label}: smem {smem} > {self.max_dynamic_smem} opted in"
        assert block[0] * block[1] * block[2] <= 1024, f"{self.label}: block {block}"
        self.rt.launches.append(Launch(self.func, tuple(grid), tuple(block), args, smem))
        for prefix, fn in self.rt.emulate.items():
            if self.func.startswith(prefix):
                fn(self.rt, *args)
                return


class _FakeEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class FakeRuntime:
    def __init__(self, heap_bytes: int | None = None, free: int = 80 << 30, check_ptx: bool | None = None):
        self.heap = np.zeros(heap_bytes, np.uint8) if heap_bytes else None
        self.stream = None  # (events are recorded "on" it: see event())
        self.top, self.free, self.allocated_bytes = 0, free, 0
        self.max_smem_optin, self.sm_count, self.l2_bytes, self.arch = 227 * 1024, 132, 50 << 20, "sm_90"
        self.name, self.sync, self.dram_peak = "fake H100", False, 3_352_320_000_000
        self.device, self.drv = _Device(), type("drv", (), {"device_attribute": _AnyAttr()})()
        self.check_ptx = nvcc_path() is not None if check_ptx is None else check_ptx
        self.built: list[str] = []         # entry points fetched, in order
        self.launches: list[Launch] = []   # every launch, in order
        self.emulate: dict = {}            # kernel name prefix -> fn(rt, *launch args)

    # -- kernels
    def kernel(self, module, func, argtypes, label=None, defines=None):
        if self.check_ptx:
            sigs = signatures(module)
            assert func in sigs, f"cuda/{module}.cu has no entry point {func}"
            bad = argtypes_mismatch(argtypes, sigs[func])
            assert bad is None, f"{func}: {bad}"
        self.built.append(func)
        return FakeKernel(self, module, func, argtypes, label or f"{module}.{func}")

    # -- memory
    def empty(self, shape, dtype=np.float32) -> DevArray:
        a = DevArray(self, BASE + self.top, shape, dtype, owner=None)
        if self.heap is not None:
            assert self.top + a.nbytes <= self.heap.size, "fake device heap exhausted"
            self.heap[self.top:self.top + a.nbytes] = 0xFF  # poisoned: unwritten floats read as NaN
        self.top += -(-max(a.nbytes, 1) // 256) * 256
        self.allocated_bytes += a.nbytes
        return a

    def zeros(self, shape, dtype=np.float32) -> DevArray:
        a = self.empty(shape, dtype)
        if self.heap is not None:
            self.np(a)[...] = 0
        return a

    def scratch(self, shape, dtype=np.float32) -> DevArray:
        from llmc.runtime import take_scratch
        return take_scratch(self, shape, dtype)

    def scratch_pool(self, pool):
        from llmc.runtime import scratch_pool
        return scratch_pool(self, pool)

    def scratch_arena(self, arena):
        from llmc.runtime import scratch_arena
        return scratch_arena(self, arena)

    def to_device(self, host) -> DevArray:
        host = np.ascontiguousarray(host)
        a = self.empty(host.shape, host.dtype)
        if self.heap is not None:  # (no heap: the allocation alone, for builds that only build)
            self.np(a)[...] = host
        return a

    def np(self, a: DevArray) -> "numpy.ndarray":
        """The heap memory a DevArray names, as a numpy array of its dtype and shape (a view)."""
        assert self.heap is not None, "this FakeRuntime has no heap"
        off = a.ptr - BASE
        assert 0 <= off and off + a.nbytes <= self.top, f"pointer outside the fake heap: {a}"
        return self.heap[off:off + a.nbytes].view(a.dtype).reshape(a.shape)

    def floats(self, ptr: int, n: int) -> np.ndarray:
        """n float32s at device address ptr (a view)."""
        off = int(ptr) - BASE
        assert self.heap is not None and off % 4 == 0 and 0 <= off and off + 4 * n <= self.top, hex(int(ptr))
        return self.heap[off:off + 4 * n].view(np.float32)

    def strided(self, ptr: int, shape, strides) -> np.ndarray:
        """A float32 view at device address ptr with strides in elements (the GEMM engine's operands)."""
        off = int(ptr) - BASE
        base = self.heap[off:].view(np.float32) if (self.heap.size - off) % 4 == 0 else \
            self.heap[off:off + (self.heap.size - off) // 4 * 4].view(np.float32)
        return np.lib.stride_tricks.as_strided(base, shape, [4 * s for s in strides])

    def pinned(self, shape, dtype=numpy.float32):
        return np.empty(shape, dtype)

    def mem_info(self):
        return self.free, 80 << 30

    def require_free(self, nbytes, what="model"):
        from llmc.runtime import Runtime
        Runtime.require_free(self, nbytes, what)

    def synchronize(self):
        pass

    def event(self):
        """A stand-in CUDA event (the backend records one after each async upload): nothing runs,
        so recording and waiting do nothing."""
        return _FakeEvent()

    def graphs_available(self):
        return "a fake runtime"

    # the side stream (Runtime.fork ...): one stream here, nothing runs
    def fork(self):
        pass

    def unfork(self, mark=None):
        pass

    def wait_mark(self, mark):
        pass

    def join(self):
        pass


class FakeCudaBackend(CudaBackend):
    """The cuda backend over a FakeRuntime with a heap, running each op's numpy reference on the
    heap memory its DevArray arguments name. Variant choice, fallbacks and notes are CudaBackend's."""
    name = "fake-cuda"

    def __init__(self, kernels=None, nbytes=1 << 26, quiet=False, precision="fp32"):
        super().__init__(kernels, quiet, rt=FakeRuntime(nbytes), precision=precision)
        self.launches = []  # op names, in launch order
        self.graphs = 0
        self.graph_pdl = []  # each graph's pdl argument, in order
        # The side stream (CudaBackend.side): its launches wait in a queue until the main stream has to
        # wait for them (side_wait up to the mark, side_join all), the latest they may run on a GPU. So a
        # missing wait shows: the main stream overwrites what a side launch reads, or reads what it
        # writes, before the queued launch runs, and the results differ from the numpy backend's.
        self._on_side = None
        self._side_queue = []  # (op name, run, args)
        self._side_marks = {}  # mark -> how many queued launches it covers (counted from the start)
        self._side_done = 0    # launches of the queue run so far
        self.side_launches = []  # the op names launched on the side stream, in order

    emulate_fold = False  # True: fold_build returns FakeFold (the folded classifier in numpy), else None

    def fold_build(self, N, V, Vp, C):
        if not self.emulate_fold or self.choose("matmul_forward", None, self.precision, N=N, C=C, OC=Vp,
                                                has_bias=False) != 9:
            return None
        return FakeFold(self, N, V, Vp, C)

    def fold_bytes(self, N, V, Vp, C) -> int:  # (where fold_build above builds its FakeFold: what a Fold would allocate)
        from llmc.ops.classifier import fold_bytes
        if not self.emulate_fold or self.choose("matmul_forward", None, self.precision, N=N, C=C, OC=Vp,
                                                has_bias=False) != 9:
            return 0
        return fold_bytes(N, V, Vp, C, self.precision)

    def side(self, mark=None):
        import contextlib

        @contextlib.contextmanager
        def block():
            assert self._on_side is None, "side() inside side()"
            self._on_side = mark
            try:
                yield
            finally:
                self._on_side = None
                if mark is not None:
                    self._side_marks[mark] = self._side_done + len(self._side_queue)
        return block()

    def _run_side(self, upto):
        while self._side_done < upto and self._side_queue:
            name, run, args = self._side_queue.pop(0)
            self._side_done += 1
            self.launches.append(name)
            self.side_launches.append(name)
            run(*args)

    def side_wait(self, mark):
        if mark in self._side_marks:
            self._run_side(self._side_marks[mark])

    def side_join(self):
        self._run_side(self._side_done + len(self._side_queue))
        self._side_marks = {}

    def build(self, name, prefer=None, precision=None, **shape):
        dt = precision or self.precision
        num = self.choose(name, prefer, dt, **shape)  # resolved as on the GPU (notes included)
        spec = ops.get(name)
        reason = spec.refuse_reason(num, dt, self.rt.arch, **shape)
        if reason and self.named(name):
            spec.build(self.rt, num, dt, **shape)  # raises the same refusal as the GPU
        deferred = shape.get("deferred") if name == "layernorm_backward" else None
        cpu = spec.build_cpu(**shape)
        if deferred:  # the reference of the plain form, run below on per-slot fp32 sums (_deferred_ln)
            cpu.launch = spec.build_cpu(**{k: v for k, v in shape.items() if k != "deferred"}).launch
        conv, run = self.rt.np, cpu.launch
        if dt == "bf16" and name == "adamw" and shape.get("chunks"):
            run = self._bf16_adamw_chunks(shape["chunks"])
        elif dt == "bf16" and name == "matmul_forward" and shape.get("gelu_pre"):
            run = self._bf16_gelu_pre(shape)
        elif dt == "bf16" and name == "attention_backward" and shape.get("colsum"):
            run = self._bf16_attention_colsum(shape)
        elif dt == "bf16" and name in ("layernorm_backward", "gelu_backward") and shape.get("colsum"):
            run = self._bf16_colsum_as_stored(name, shape)
        elif dt == "bf16":
            run = self._bf16_adamw(run) if name == "adamw" else self._bf16(run)
        else:
            ref = run
            run = lambda *args: ref(*[conv(x) if isinstance(x, DevArray) else x for x in args])  # noqa: E731

        host_inputs = None
        if name == "encoder_backward":  # (its GPU build says whether it reads what the host computes from the ids)
            host_inputs = spec.build(self.rt, num, dt, **shape).host_inputs
        if host_inputs is not None:  # what the GPU would read there must be the current batch's
            run = self._host_inputs_checked(name, run, *host_inputs)

        flush = None
        if deferred:
            run, flush = self._deferred_ln(shape, run)
        rezero = None
        if name == "attention_backward" and shape.get("caller_zeroes"):
            run, rezero = self._caller_zeroes(run)

        def enqueue(label, fn, args):
            if self._on_side is not None:  # the side stream: deferred as long as the model allows
                self._side_queue.append((label, fn, args))
                return
            self.launches.append(label)
            fn(*args)

        def launch(*args):
            for x in args:  # a DevArray argument must be a DevArray, never a numpy array
                assert not isinstance(x, np.ndarray), f"{name}: got a host array"
            enqueue(name, run, args)
        cpu.launch, cpu.number, cpu.dtype = launch, num, dt  # (saved_shape stays the reference's)
        cpu.host_inputs = host_inputs
        if flush is not None:
            cpu.flush = lambda: enqueue(name + " (flush)", flush, ())  # noqa: E731
        if rezero is not None:
            cpu.info = {**cpu.info, "rezero": lambda: enqueue(name + " (rezero)", rezero, ())}  # noqa: E731
        return cpu

    def _host_inputs_checked(self, name, run, prep, buf):
        """A build that reads what the host computed from the batch's ids (encoder_backward 8's records,
        uploaded by the model's set_batch): the reference runs, after checking that the buffer holds
        prep(the ids this launch is given), so a missing or stale upload fails."""
        def launch(*args):
            ids = self.rt.np(args[3])  # (dwte, dwpe, dout, inp)
            assert np.array_equal(self.rt.np(buf), prep(ids)), f"{name}: the host's records are not this batch's"
            run(*args)
        return launch

    @staticmethod
    def _caller_zeroes(run):
        """attention_backward 5's caller_zeroes form: the GPU's dq accumulator must be zeroed (rezero)
        after each launch and before the next. Emulated as a flag: a launch onto an accumulator not
        zeroed since the last one fails (a missing rezero, or a rezero still queued on the side stream
        for want of a wait)."""
        state = {"dirty": False}

        def launch(*args):
            assert not state["dirty"], "attention_backward: the dq accumulator was not zeroed since the last launch"
            state["dirty"] = True
            run(*args)

        def rezero():
            state["dirty"] = False
        return launch, rezero

    def _deferred_ln(self, shape, run):
        """layernorm_backward's deferred form (deferred=S) over `run`, the plain form's reference (dtype
        wrapped): launch(slot, dinp, dweight, dbias, [colsum], *inputs) writes dinp at once and keeps the
        sums in the slot's own fp32 arrays; flush() adds every pending slot's sums to its outputs (bf16:
        read, add in fp32, round once, as the GPU's reduce) and empties the slots. So a model that reads
        those gradients before the flush, or never flushes, gets other results than the numpy backend."""
        np_ = self.rt.np
        K = 3 if shape.get("colsum") else 2
        sums = [[self.rt.zeros((shape["C"],), np.float32) for _ in range(K)] for _ in range(shape["deferred"])]
        pending = {}

        def launch_slot(slot, dinp, *rest):
            assert 0 <= slot < len(sums) and slot not in pending, f"deferred slot {slot} taken twice or outside"
            for a in sums[slot]:
                np_(a)[...] = 0.0
            run(dinp, *sums[slot], *rest[K:])
            pending[slot] = rest[:K]

        def flush():
            for slot, outs in sorted(pending.items()):
                for o, a in zip(outs, sums[slot]):
                    if o.dtype == BF16:
                        np_(o)[...] = to_bf16(from_bf16(np_(o)) + np_(a))
                    else:
                        np_(o)[...] += np_(a)
            pending.clear()
        return launch_slot, flush

    def _bf16(self, ref):
        """The fp32 reference `ref` as a bf16 build: bf16 DevArrays in as fp32 copies, the ones it
        changed back as bf16 (one rounding on the store). The same DevArray passed twice (an
        in-place op: gelu_backward(dfch, fch, dfch)) is one copy."""
        np_ = self.rt.np

        def run(*args):
            copies, call = {}, []
            for x in args:
                if isinstance(x, DevArray) and x.dtype == BF16:
                    key = (x.ptr, x.shape)
                    if key not in copies:
                        f = from_bf16(np_(x)).reshape(x.shape)
                        copies[key] = (x, f, f.copy())
                    call.append(copies[key][1])
                else:
                    call.append(np_(x) if isinstance(x, DevArray) else x)
            ref(*call)
            for x, f, before in copies.values():
                if not np.array_equal(f, before, equal_nan=True):
                    np_(x)[...] = to_bf16(f)
        return run

    def _bf16_gelu_pre(self, shape):
        """matmul_forward's fused fc form (gelu_pre=True) in bf16: the plain GEMM into pre, rounded on
        the store, then the GELU of pre as stored, rounded again: what the fused epilogue computes, so
        the same bits as the plain build followed by gelu_forward's."""
        plain = self._bf16(ops.get("matmul_forward").build_cpu(**{k: v for k, v in shape.items() if k != "gelu_pre"}).launch)
        gelu = self._bf16(ops.get("gelu_forward").build_cpu(N=shape["N"] * shape["OC"]).launch)

        def run(out, pre, inp, weight, bias=None):
            plain(pre, inp, weight, bias)
            gelu(out, pre)
        return run

    def _bf16_attention_colsum(self, shape):
        """attention_backward's colsum form in bf16: the plain form (dinp rounded on the store), then
        dbias += the column sums of dinp as stored, as matmul_backward_bias's bf16 build adds them (read,
        add in fp32, round once): the GPU's sums run in another order (within fp32 rounding of these),
        here the bits of the two launches it replaces."""
        plain = self._bf16(ops.get("attention_backward").build_cpu(**{k: v for k, v in shape.items() if k != "colsum"}).launch)
        B, T, C = shape["B"], shape["T"], shape["C"]
        bias = self._bf16(ops.get("matmul_backward_bias").build_cpu(N=B * T, OC=3 * C).launch)

        def run(dinp, dbias, *rest):
            plain(dinp, *rest)
            bias(dbias, dinp)
        return run

    def _bf16_colsum_as_stored(self, name, shape):
        """layernorm_backward's and gelu_backward's colsum forms in bf16: the plain form (dinp rounded on
        the store; gelu's recompute form: gelu_forward's too), then colsum += the column sums of dinp as
        stored (docs/ops.md: what the GPU sums), as matmul_backward_bias's bf16 build adds them (read, add
        in fp32, round once; the deferred form's fp32 slot sums: added). The GPU's sums run in another
        order (within fp32 rounding of these); here the bits of the plain launch and the bias pass."""
        plain_shape = {k: v for k, v in shape.items() if k not in ("colsum", "recompute", "OC", "deferred")}
        plain = self._bf16(ops.get(name).build_cpu(**plain_shape).launch)
        if name == "layernorm_backward":
            rows, cols = shape["N"], shape["C"]
        else:
            rows, cols = shape["N"] // shape["OC"], shape["OC"]
        bias = self._bf16(ops.get("matmul_backward_bias").build_cpu(N=rows, OC=cols).launch)
        if name == "layernorm_backward":
            def run(dinp, dweight, dbias, colsum, *rest):
                plain(dinp, dweight, dbias, *rest)
                bias(colsum, dinp)
            return run
        gelu = self._bf16(ops.get("gelu_forward").build_cpu(N=shape["N"]).launch) if shape.get("recompute") else None

        def run_gelu(dinp, colsum, *rest):
            if gelu is not None:  # (dinp, colsum, gout, inp, dout)
                gout, inp, dout = rest
                gelu(gout, inp)
            else:
                inp, dout = rest
            plain(dinp, inp, dout)
            bias(colsum, dinp)
        return run_gelu

    def _bf16_adamw(self, ref):
        """AdamW's bf16 build: the fp32 reference on the master weights, then the bf16 weights from
        them (round to nearest even for seed 0, else stochastic rounding)."""
        np_ = self.rt.np

        def run(params, grads, m, v, norm2, hp, master, seed):
            assert params.dtype == BF16 and grads.dtype == BF16 and master.dtype == np.float32
            assert seed.dtype == np.uint32 and seed.size == 1
            w = np_(master)
            ref(w, from_bf16(np_(grads)), np_(m), np_(v), np_(norm2), np_(hp))
            s = int(np_(seed)[0])
            if s == 0:
                np_(params)[...] = to_bf16(w)
                return
            lo, hi = bf16_neighbours(w)
            gap = (hi - lo).astype(np.float64)
            frac = np.divide(w - lo, gap, out=np.zeros_like(gap), where=gap > 0)
            u = np.random.default_rng(s).random(w.shape)
            np_(params)[...] = to_bf16(np.where(u < frac, hi, lo))
        return run

    def _bf16_adamw_chunks(self, chunks):
        """AdamW variant 3's bf16 build over a list of ranges: each range as the one-range build,
        on views (params at poff, the shard buffers at soff, hp row `row`, seed c)."""
        from llmc.ops.adamw import adamw_cpu
        parts = [(self._bf16_adamw(adamw_cpu(nc)), poff, soff, nc, row) for poff, soff, nc, row in chunks]

        def run(params, grads, m, v, norm2, hp, master, seeds):
            assert seeds.dtype == np.uint32 and seeds.size == len(parts)
            for c, (one, poff, soff, nc, row) in enumerate(parts):
                one(params.view(poff, (nc,)), grads.view(soff, (nc,)), m.view(soff, (nc,)), v.view(soff, (nc,)),
                    norm2, hp.view(8 * row, (8,)), master.view(soff, (nc,)), seeds.view(c, (1,)))
        return run

    def memset0(self, buf):
        self.rt.np(buf)[...] = 0

    def upload(self, buf, host):
        self.rt.np(buf)[...] = np.asarray(host, dtype=buf.dtype).reshape(buf.shape)

    upload_async = upload

    def download(self, buf):
        return self.rt.np(buf).copy()

    def download_into(self, host, buf):
        host[...] = self.rt.np(buf)
        return host

    def download_async(self, host, buf):
        from llmc.backend import COPIED
        host[...] = self.rt.np(buf)  # (nothing runs later here: the copy is made now, in stream order)
        return COPIED

    def graph(self, fn, pdl=False):
        self.graphs += 1
        self.graph_pdl.append(pdl)
        return fn

    def describe(self):
        return "fake cuda (numpy ops over DevArrays)"


class FakeFold:
    """llmc.ops.classifier.Fold's launches in numpy on the fake heap (FakeCudaBackend.emulate_fold): the
    lm head's _fold GEMM (p' = 2^(logit log2 e - k) stored in P's dtype, 0 on the padding, the 128-wide
    tiles' fp32 sums), the combine (losses, c, the one-hot folded into P, X = c * lnf), the fix (rows out
    of range recomputed with their own k; the next k) and the row scale: the model's plumbing of the fold
    (which buffers, in which order, X for dwte, the scale after dinp) against the numpy backend."""

    def __init__(self, be, N, V, Vp, C):
        from llmc.ops.classifier import FOLD_INIT
        self.be, self.rt, self.N, self.V, self.Vp, self.C = be, be.rt, N, V, Vp, C
        self.bf16 = be.precision == "bf16"
        tdt = BF16 if self.bf16 else np.float32
        self.tiles = -(-Vp // 128)
        self.X = self.rt.empty((N, C), tdt)
        self.cs = self.rt.empty((N,), np.float32)
        self.FS = self.rt.empty((N, self.tiles), np.float32)
        self.ctl = self.rt.to_device(np.array(FOLD_INIT, np.int32))
        self.flagged = []
        self.primed = False

    def _get(self, a):
        x = self.rt.np(a)
        return from_bf16(x).reshape(x.shape).astype(np.float32) if self.bf16 else x.astype(np.float32)

    def _put(self, a, v):
        self.rt.np(a)[...] = to_bf16(v).reshape(a.shape) if self.bf16 else v

    def _launch(self, label, fn, *args):
        self.be.launches.append(label)
        fn(*args)

    def forward(self, P, lnf, wte):
        def run():
            k = float(self.rt.np(self.ctl)[0])
            logits = self._get(lnf).reshape(self.N, self.C) @ self._get(wte).reshape(self.Vp, self.C).T
            p = np.exp2(logits * np.float32(1.4426950408889634) - np.float32(k)).astype(np.float32)
            p[:, self.V:] = 0.0
            self._put(P, p.reshape(P.shape))
            pad = np.zeros((self.N, self.tiles * 128), np.float32)
            pad[:, :self.Vp] = p
            self.rt.np(self.FS)[...] = pad.reshape(self.N, self.tiles, 128).sum(axis=2, dtype=np.float32)
        self._launch("classifier fold gemm", run)

    def _finish(self, r, S, loss, losses, P, t, lnf, dloss):
        Pr = self._get(P).reshape(self.N, self.Vp)
        c = np.float32(dloss / np.float64(S))
        self.rt.np(losses).reshape(-1)[r] = loss
        self.rt.np(self.cs)[r] = c
        row = Pr[r].copy()
        row[t] = row[t] - np.float32(S)
        full = Pr.copy()
        full[r] = row
        self._put(P, full.reshape(P.shape))
        x = self._get(self.X).reshape(self.N, self.C)
        x[r] = c * self._get(lnf).reshape(self.N, self.C)[r]
        self._put(self.X, x.reshape(self.X.shape))

    def combine(self, losses, P, targets, lnf, dloss):
        def run():
            ctl = self.rt.np(self.ctl)
            k = int(ctl[0])
            S = self.rt.np(self.FS).sum(axis=1, dtype=np.float64)
            Pr = self._get(P).reshape(self.N, self.Vp)
            tg = self.rt.np(targets).reshape(-1)
            for r in range(self.N):
                pt = float(Pr[r, tg[r]])
                if not (2.0 ** -84 <= S[r] <= 2.0 ** 64 and 2.0 ** -120 <= pt <= 2.0 ** 80):
                    self.flagged.append(r)
                else:
                    self._finish(r, S[r], np.log(S[r] / pt), losses, P, tg[r], lnf, dloss)
                if 0 < S[r] < 3e38:
                    top = int(np.floor(np.log2(S[r]))) + k
                    ctl[2], ctl[3] = max(ctl[2], top), min(ctl[3], top)
        self._launch("classifier fold combine", run)

    def fix(self, losses, P, targets, lnf, wte, dloss):
        def run():
            ctl = self.rt.np(self.ctl)
            tg = self.rt.np(targets).reshape(-1)
            for r in self.flagged:
                logit = (self._get(wte).reshape(self.Vp, self.C)[:self.V] @ self._get(lnf).reshape(self.N, self.C)[r])
                mx = float(logit.max())
                p = np.exp(logit.astype(np.float64) - mx)
                S = p.sum()
                Pr = self._get(P).reshape(self.N, self.Vp)
                Pr[r] = 0.0
                Pr[r, :self.V] = p
                self._put(P, Pr.reshape(P.shape))
                self._finish(r, S, np.log(S) + mx - float(logit[tg[r]]), losses, P, tg[r], lnf, dloss)
                top = int(np.floor((np.log(S) + mx) / np.log(2.0)))  # (the row's lse in log2 units, rounded down)
                ctl[2], ctl[3] = max(ctl[2], top), min(ctl[3], top)
            self.flagged = []
            if ctl[3] <= ctl[2]:
                ctl[0] = max(-2048, min(2048, ((int(ctl[2]) + int(ctl[3])) >> 1) + 10))
            ctl[1:] = (0, -(1 << 30), 1 << 30, 0)
        self._launch("classifier fold fix", run)

    def prime(self, losses, P, targets, lnf, wte):
        n = min(self.N, self.rt.sm_count)
        def run():
            self.flagged = [int(i * self.N // n) for i in range(n)]
            self.rt.np(self.ctl)[1:] = (n, -(1 << 30), 1 << 30, 0)
        self._launch("classifier fold prime", run)
        self.fix(losses, P, targets, lnf, wte, 1.0)
        self.primed = True

    def scale(self, dinp):
        def run():
            x = self._get(dinp).reshape(self.N, self.C) * self.rt.np(self.cs)[:, None]
            self._put(dinp, x.reshape(dinp.shape))
        self._launch("classifier fold scale", run)

    def state(self):
        return {"k": int(self.rt.np(self.ctl)[0])}

    def load_state(self, st):
        from llmc.ops.classifier import FOLD_INIT
        init = np.array(FOLD_INIT, np.int32)
        init[0] = int(st.get("k", 0))
        self.rt.np(self.ctl)[...] = init
        self.primed = True
