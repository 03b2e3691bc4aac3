"""Backends: where the model's buffers live and what runs each op.

The model (llmc/model.py) and the decoder (llmc/decode.py) are written once against `Backend`, the
protocol below; CpuBackend (numpy) and CudaBackend (our kernels) implement it, and so does the CPU
tests' fake (tests/fake_runtime.py), which tests/test_backend.py checks.

CpuBackend runs each op's numpy reference (in float32 for training, float64 for tests).
CudaBackend runs the kernel variant chosen per op (`kernels={"softmax_forward": 5, ...}`); the
variant is fixed when the op is built, so nothing is looked up per launch. Which variant runs is
decided in one place, CudaBackend.choose, from rules the ops declare (llmc/ops/__init__.py).
"""
from __future__ import annotations

import contextlib
from typing import Protocol, runtime_checkable

import numpy as np

from llmc import ops
from llmc.bf16 import BF16
from llmc.errors import LLMCError


@runtime_checkable
class Backend(Protocol):
    """What the model and the decoder need from a backend."""
    name: str
    dtype: np.dtype          # the host/numpy dtype of activations and parameters (BF16 bits in bf16 mode)
    acc_dtype: np.dtype      # the dtype of what stays fp32 in bf16 mode: statistics, losses, AdamW state
    precision: str           # the element type the op builds are asked for ("fp32" or "bf16")
    kernels: dict            # {op name: variant number}, defaults overridden by the user's choices

    def empty(self, shape, dtype=None): ...
    def zeros(self, shape, dtype=None): ...
    def view(self, buf, offset, shape): ...
    def build(self, name, prefer=None, precision=None, **shape) -> ops.Built: ...  # one op at one shape
    def op(self, name, prefer=None, **shape): ...                   # build(...).launch
    def choose(self, name, prefer=None, precision=None, **shape) -> int: ...  # the variant build() would take
    def fuses(self, name, form, **shape) -> int | None: ...        # the chosen variant, if it takes the fused form
    def fold_build(self, N, V, Vp, C): ...                          # the folded classifier (cuda), or None
    def fold_bytes(self, N, V, Vp, C) -> int: ...                   # what fold_build would allocate (0: none)
    def named(self, name) -> bool: ...                              # the user chose this op's variant
    def memset0(self, buf): ...
    def upload(self, buf, host): ...
    def upload_async(self, buf, host): ...
    def pinned_free(self, host): ...                                # the GPU has read host's last upload_async
    def download(self, buf): ...
    def download_into(self, host, buf): ...
    def download_async(self, host, buf): ...                       # queue buf -> host; .wait() for it
    def graph(self, fn, pdl=False): ...                            # pdl: programmatic launches inside
    def scratch_pool(self, pool): ...                               # context: builds share scratch (see Runtime)
    def scratch_arena(self, arena): ...                             # context: builds' scratch cut from an arena (see Runtime)
    def side(self, mark=None): ...                                 # context: launches on the side stream
    def side_wait(self, mark): ...                                  # main waits for the side up to mark
    def side_join(self): ...                                        # main waits for all of the side
    def synchronize(self): ...
    def pinned(self, shape, dtype): ...
    def require_free(self, nbytes, what): ...                       # one-line error if the device can't hold it
    def describe(self) -> str: ...


class Copy:
    """A download queued on the stream (Backend.download_async): wait() returns once the host buffer
    holds it."""

    def __init__(self, event=None):
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


COPIED = Copy()  # a download that was made at once


def kernel_choices(overrides: dict | None = None) -> dict[str, int]:
    """{op name: variant number}: each op's default, overridden by `overrides`.
    Unknown op names or variant numbers raise LLMCError naming the flag. Two rules the ops declare:
    a pair (attention forward/backward: what forward keeps must be what backward reads) takes a
    number named for one direction only in both; an op that runs only inside another op's variant
    (softmax inside the composite attention), named alone, selects that variant."""
    reg = ops.registry()
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    choice = {name: spec.default for name, spec in reg.items() if spec.variants}
    for name, num in overrides.items():
        if name not in reg:
            raise LLMCError(f"unknown op {name!r} in kernel choices; have {', '.join(sorted(reg))}")
        reg[name].variant(int(num))  # raises with the flag name if unknown
        choice[name] = int(num)
    for name, spec in reg.items():
        # the other direction follows the number named, if it has that variant (attention forward 4,
        # bf16 on wgmma, keeps what backward 3 reads: its backward stays the default)
        if spec.pair and name in overrides and spec.pair not in overrides and choice[name] in reg[spec.pair].variants:
            choice[spec.pair] = choice[name]
    for name, spec in reg.items():
        group = {name, spec.pair} - {None}
        if group & set(overrides):
            continue  # the user chose this op's variant himself
        for num, v in sorted(spec.variants.items()):
            inner = [n for n in v.selected_by if n in overrides]
            if inner and choice[name] != num:
                ops.note_once(f"note: {reg[inner[0]].flag} runs inside {name} {num}: using {spec.flag} {num} "
                              f"(variant {choice[name]} does not run it)")
                for n in group:
                    choice[n] = num
    return choice


class _Choosing:
    """The variant resolution both backends share (the numpy backend validates choices the same way,
    then runs the reference)."""

    def _setup(self, kernels, quiet):
        self.kernels = kernel_choices(kernels)
        self.chosen = frozenset(k for k, v in (kernels or {}).items() if v is not None)  # named by the user
        self.quiet = quiet
        self._noted = set()
        self._pending_uploads: dict = {}  # id(pinned host array): (array, event after its async upload)

    def named(self, name) -> bool:
        return name in self.chosen

    def kernels_for(self, precision=None) -> dict:
        """{op name: variant}: what the "kernels:" lines print. The user's choices as named, every other
        op's default for the element type (bf16 has its own defaults for some ops: layernorm, encoder
        backward, classifier), which is what choose() takes where the default fits the shape."""
        dt = precision or self.precision
        return {k: v if k in self.chosen else ops.get(k).default_for(dt) for k, v in self.kernels.items()}

    def _arch(self):
        return None

    def choose(self, name, prefer=None, precision=None, **shape) -> int:
        """The variant of op `name` at `shape`: the one named on the command line (even if it
        refuses: build says why, loudly), else `prefer` if given and it fits (a caller's better
        choice for its shapes, e.g. the decoder's GEMV), else the default, else (one note) the
        highest-numbered variant that fits; if none fits, the default (whose build then refuses).
        precision: the element type to build for, when not the backend's (the bf16 model's fp32
        loss accumulator)."""
        spec = ops.get(name)
        num = self.kernels[name]
        if name in self.chosen:
            return num
        dt = precision or self.precision
        if num == spec.default:
            num = spec.default_for(dt)  # an op whose default differs in this element type
        fits = lambda n: spec.refuse_reason(n, dt, self._arch(), **shape) is None  # noqa: E731
        if prefer is not None and fits(prefer):
            return prefer
        if fits(num):
            return num
        for alt in sorted(spec.variants, reverse=True):
            if fits(alt):
                if (name, num, alt) not in self._noted and not self.quiet:
                    reason = spec.refuse_reason(num, dt, self._arch(), **shape)
                    print(f"note: {name} variant {num} (default) refuses {shape}: {reason}; using variant {alt}")
                self._noted.add((name, num, alt))
                return alt
        return num

    def fuses(self, name, form: dict, precision=None, **shape) -> int | None:
        """The variant choose() picks for op `name` at `shape` if it also takes the op's fused form
        `form` at that shape (an option and the shape keys that come with it: {"colsum": True, "OC":
        3072}), else None. The caller then builds the fused form with prefer= that number (the
        same variant, not a fallback that happens to have the option) or launches the parts."""
        dt = precision or self.precision
        num = self.choose(name, None, dt, **shape)
        return num if ops.get(name).refuse_reason(num, dt, self._arch(), **shape, **form) is None else None

    def _uses(self, name, number) -> dict:
        """Build kwargs naming the variants chosen for the ops variant `number` is built from."""
        return {kw: self.kernels[op] for kw, op in ops.get(name).variant(number).uses.items()}

    def op(self, name, prefer=None, precision=None, **shape):
        """The launch closure of op `name` at `shape` (see build)."""
        return self.build(name, prefer, precision, **shape).launch

    def _no_kernels(self, name, precision) -> None:
        """One line when no variant of op `name` has kernels for `precision` (a bf16 run with an op
        that has only fp32 kernels), instead of the default variant's refusal."""
        spec = ops.get(name)
        if spec.variants and not any(precision in v.builds for v in spec.variants.values()):
            raise LLMCError(f"--precision {precision}: {name} has no {precision} kernels yet (its variants "
                            f"{', '.join(str(k) for k in sorted(spec.variants))} are "
                            f"{'/'.join(sorted({d for v in spec.variants.values() for d in v.dtypes}))} only); "
                            f"use --precision fp32")


class CpuBackend(_Choosing):
    name = "cpu"

    def __init__(self, dtype=np.float32, kernels: dict | None = None, quiet: bool = False):
        self.dtype = self.acc_dtype = np.dtype(dtype)
        self.precision = "fp32"
        # validated like the GPU's (an unknown variant is a user error either way), then ignored:
        # the numpy backend has one way per op
        self._setup(kernels, quiet)

    def empty(self, shape, dtype=None):
        return np.empty(shape, dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype or self.dtype)

    def view(self, buf, offset, shape):
        n = int(np.prod(shape))
        return buf.reshape(-1)[offset:offset + n].reshape(shape)

    def choose(self, name, prefer=None, precision=None, **shape) -> int:
        return 0  # the numpy reference

    def fuses(self, name, form, precision=None, **shape) -> int | None:
        return 0  # the numpy launchers implement every form of their op

    def fold_build(self, N, V, Vp, C):
        return None  # (the folded classifier is GPU kernels only: numpy runs the classifier op)

    def fold_bytes(self, N, V, Vp, C) -> int:
        return 0

    def build(self, name, prefer=None, precision=None, **shape) -> ops.Built:
        return ops.get(name).build_cpu(**shape)  # (one dtype: self.dtype)

    def memset0(self, buf):
        buf[...] = 0

    def upload(self, buf, host):
        buf[...] = np.asarray(host).reshape(buf.shape)

    def upload_async(self, buf, host):
        self.upload(buf, host)

    def download(self, buf):
        return np.array(buf, copy=True)

    def download_into(self, host, buf):
        host[...] = buf
        return host

    def download_async(self, host, buf):
        host[...] = buf  # (numpy: the copy is made now)
        return COPIED

    def graph(self, fn, pdl: bool = False):
        """The numpy backend has no graphs: fn itself replays the step."""
        return fn

    def side(self, mark=None):
        """One stream: what the block launches runs at once, in order."""
        return contextlib.nullcontext()

    def scratch_pool(self, pool):
        """(numpy builds keep no scratch)"""
        return contextlib.nullcontext()

    def scratch_arena(self, arena):
        """(numpy builds keep no scratch)"""
        return contextlib.nullcontext()

    def side_wait(self, mark):
        pass

    def side_join(self):
        pass

    def synchronize(self):
        pass

    def pinned(self, shape, dtype):
        return np.empty(shape, dtype)

    def pinned_free(self, host):
        pass  # upload_async copied at once

    def require_free(self, nbytes, what="model"):
        pass  # host memory: numpy says so itself

    def describe(self) -> str:
        return f"cpu (numpy {np.__version__}, {self.dtype})"


class CudaBackend(_Choosing):
    name = "cuda"

    def __init__(self, kernels: dict | None = None, quiet: bool = False, rt=None, gpu: int = 0,
                 precision: str = "fp32"):
        if precision not in ops.DTYPES:
            raise LLMCError(f"--precision {precision}: expected one of {', '.join(ops.DTYPES)}")
        if rt is None:
            from llmc.runtime import Runtime
            rt = Runtime(gpu)  # gpu: the device index (data parallel: the process's local rank)
        self.rt = rt  # a Runtime (tests pass their fake, tests/fake_runtime.py)
        # bf16: parameters, activations and gradients are bf16 (uint16 bits on the host, llmc/bf16.py);
        # what the conventions keep in fp32 (statistics, losses, AdamW state, master weights) asks
        # for acc_dtype explicitly
        self.precision = precision
        self.dtype = np.dtype(BF16) if precision == "bf16" else np.dtype(np.float32)
        self.acc_dtype = np.dtype(np.float32)
        self._setup(kernels, quiet)

    def _arch(self):
        return self.rt.arch

    def _fold_runs(self, N, V, Vp, C) -> bool:
        """Whether fold_build builds the fold here: the lm head's matmul_forward is GEMM engine 5 (variant 9)
        and rows of C and Vp values are 16-byte multiples (the fold's TMA loads and store)."""
        if self.choose("matmul_forward", None, self.precision, N=N, C=C, OC=Vp, has_bias=False) != 9:
            return False
        esize = 2 if self.precision == "bf16" else 4
        return (Vp * esize) % 16 == 0 and (C * esize) % 16 == 0

    def fold_build(self, N, V, Vp, C):
        """The classifier folded into the lm head's GEMMs (llmc/ops/classifier.py: Fold) for N rows, or
        None where it does not run here (_fold_runs)."""
        if not self._fold_runs(N, V, Vp, C):
            return None
        from llmc.ops.classifier import fold_build
        return fold_build(self.rt, N, V, Vp, C, self.precision)

    def fold_bytes(self, N, V, Vp, C) -> int:
        """The device memory fold_build would allocate (0 where it builds nothing): the model's early check."""
        from llmc.ops.classifier import fold_bytes
        return fold_bytes(N, V, Vp, C, self.precision) if self._fold_runs(N, V, Vp, C) else 0

    def empty(self, shape, dtype=None):
        return self.rt.empty(shape, dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return self.rt.zeros(shape, dtype or self.dtype)

    def view(self, buf, offset, shape):
        return buf.view(offset, shape)

    def build(self, name, prefer=None, precision=None, **shape) -> ops.Built:
        """Op `name` built at `shape` with the variant choose() picks (a variant the user named
        refuses loudly if it can't take the shape), for the backend's precision or `precision`."""
        dt = precision or self.precision
        self._no_kernels(name, dt)
        num = self.choose(name, prefer, dt, **shape)
        outer = getattr(self.rt, "_scratch_pool", None)
        if outer is not None:  # inside a caller's scratch_pool: the build takes its scratch from there
            b = ops.get(name).build(self.rt, num, dt, **shape, **self._uses(name, num))
            b.pool = outer
            return b
        pool: dict = {}  # (its scratch recorded, for a later build that may share it: scratch_pool)
        with self.rt.scratch_pool(pool):
            b = ops.get(name).build(self.rt, num, dt, **shape, **self._uses(name, num))
        b.pool = pool
        return b

    def memset0(self, buf):
        buf.zero()

    def upload(self, buf, host):
        buf.set(host)

    def upload_async(self, buf, pinned_host):
        """buf = pinned_host by an async copy on the stream. The GPU reads pinned_host when it gets to
        the copy, which may be long after this returns (behind a queued graph of the previous
        micro-step): pinned_free(pinned_host) before writing pinned_host again."""
        buf.set_async(pinned_host)
        done = self.rt.event()
        done.record(self.rt.stream)
        self._pending_uploads[id(pinned_host)] = (pinned_host, done)  # (the array kept: its id stays its own)

    def pinned_free(self, pinned_host):
        """Wait until the GPU has read pinned_host's last async upload; at once if none is pending."""
        pending = self._pending_uploads.pop(id(pinned_host), None)
        if pending is not None:
            pending[1].synchronize()

    def download(self, buf):
        return buf.get()

    def download_into(self, host, buf):
        """buf into page-locked `host` (from pinned()), waiting for the stream."""
        return buf.get_into(host)

    def download_async(self, host, buf):
        """buf into page-locked `host` by a copy queued on the stream behind what is launched so far;
        returns its Copy, whose wait() waits for that copy only (not for what is launched after it)."""
        buf.get_async(host)
        done = self.rt.event()
        done.record(self.rt.stream)
        return Copy(done)

    def graph(self, fn, pdl: bool = False):
        """fn's launches captured into a CUDA graph (a callable replaying them), or fn itself where
        graphs are off or unavailable (said once). pdl: programmatic dependent launches inside
        (Runtime.capture; the decode step and small training steps ask for them)."""
        why = self.rt.graphs_available()
        if why is None:
            return self.rt.capture(fn, pdl=pdl)
        if "graphs" not in self._noted and not self.quiet and "LLMC_" not in why:
            print(f"note: no CUDA graphs ({why}); launching kernel by kernel")
        self._noted.add("graphs")
        return fn

    def scratch_pool(self, pool):
        """Context: the op builds inside share their scratch buffers with earlier builds under the same
        pool (Runtime.scratch_pool): only for builds that never run at the same time."""
        return self.rt.scratch_pool(pool)

    def scratch_arena(self, arena):
        """Context: the op builds inside cut their new scratch buffers from arena["base"] past
        arena["used"] while they fit (Runtime.scratch_arena)."""
        return self.rt.scratch_arena(arena)

    @contextlib.contextmanager
    def side(self, mark=None):
        """The block's launches go to the runtime's side stream, after everything launched before it on
        the main one; with `mark`, side_wait(mark) later makes the main stream wait for them (and for
        the side stream's earlier launches: it runs in order)."""
        self.rt.fork()
        try:
            yield
        finally:
            self.rt.unfork(mark)

    def side_wait(self, mark):
        self.rt.wait_mark(mark)

    def side_join(self):
        self.rt.join()

    def synchronize(self):
        self.rt.synchronize()

    def pinned(self, shape, dtype):
        return self.rt.pinned(shape, dtype)

    def require_free(self, nbytes, what="model"):
        self.rt.require_free(nbytes, what)

    def describe(self) -> str:
        return f"cuda ({self.rt.name}, {self.rt.arch}, {self.precision})"


def make_backend(device: str, kernels: dict | None = None, dtype=np.float32, gpu: int = 0,
                 precision: str = "fp32"):
    """device: cpu | cuda | auto (cuda when usable, else cpu with a warning on stderr naming the
    reason: llmc.gpu_check); gpu: which GPU the cuda backend runs on (data parallel: the local rank);
    precision: fp32 | bf16 (bf16 runs only on the cuda backend: one line saying so otherwise)."""
    import sys
    from llmc.gpu_check import why_no_gpu
    if precision not in ops.DTYPES:
        raise LLMCError(f"--precision {precision}: expected one of {', '.join(ops.DTYPES)}")
    needs_gpu = f"--precision {precision} needs the CUDA backend (a GPU); the numpy backend is fp32 only"
    if device == "cpu":
        if precision != "fp32":
            raise LLMCError(f"{needs_gpu}: drop --device cpu, or use --precision fp32")
        return CpuBackend(dtype, kernels)
    if device in ("cuda", "auto"):
        why = why_no_gpu()
        if why is None:
            try:
                return CudaBackend(kernels, gpu=gpu, precision=precision)
            except LLMCError as e:
                if device == "cuda":
                    raise
                why = str(e)
        if precision != "fp32":
            raise LLMCError(f"{needs_gpu} ({why})")
        if device == "cuda":
            raise LLMCError(f"--device cuda: {why} (--device cpu runs the numpy backend)")
        print(f"WARNING: no GPU backend: {why}; using the numpy backend (--device cpu)", file=sys.stderr)
        return CpuBackend(dtype, kernels)
    raise LLMCError(f"--device {device}: expected cpu, cuda or auto")
