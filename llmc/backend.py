"""Backends: where the model's buffers live and what runs each op.

The model (llmc/model.py) is written once against this small interface:

    be.empty(shape) / be.zeros(shape)      a buffer (numpy array, or a DevArray on the GPU)
    be.view(buf, offset, shape)            a view into a flat buffer, sharing memory
    be.op(name, **shape)                   the launch closure for one op at one shape (docs/ops.md)
    be.memset0(buf), be.upload(buf, host), be.download(buf), be.synchronize()

CpuBackend runs each op's numpy reference (in float32 for training, float64 for tests).
CudaBackend runs the kernel variant chosen per op (`kernels={"softmax_forward": 5, ...}`); the
variant is fixed when the op is built, so nothing is looked up per launch.
"""
from __future__ import annotations

import numpy as np

from llmc import ops
from llmc.errors import LLMCError

# attention variant 1 (the composite) is built from the variants chosen for these ops
COMPOSITES = {
    "attention_forward": ("softmax_forward", "matmul_forward"),
    "attention_backward": ("softmax_backward", "matmul_backward"),
}


def kernel_choices(overrides: dict | None = None) -> dict[str, int]:
    """{op name: variant number}: each op's default, overridden by `overrides`.
    Unknown op names or variant numbers raise LLMCError naming the flag."""
    reg = ops.registry()
    choice = {name: spec.default for name, spec in reg.items() if spec.variants}
    for name, num in (overrides or {}).items():
        if num is None:
            continue
        if name not in reg:
            raise LLMCError(f"unknown op {name!r} in kernel choices; have {', '.join(sorted(reg))}")
        reg[name].variant(int(num))  # raises with the flag name if unknown
        choice[name] = int(num)
    # forward and backward attention must agree on what forward keeps (att for 1, lse for 2): a
    # number named for one direction only is used for both
    named = [n for n in PAIRED if (overrides or {}).get(n) is not None]
    if len(named) == 1:
        for n in PAIRED:
            choice[n] = choice[named[0]]
    # a softmax variant runs only inside the composite attention: naming one (and no attention
    # variant) selects the composite, so that the softmax asked for is the one that runs
    softmax = [n for n in ("softmax_forward", "softmax_backward") if (overrides or {}).get(n) is not None]
    if softmax and not named and choice["attention_forward"] != 1:
        ops.note_once(f"note: {reg[softmax[0]].flag} runs inside the composite attention: using "
                      f"--attention-kernel 1 (the fused default computes its softmax itself)")
        for n in PAIRED:
            choice[n] = 1
    return choice


PAIRED = ("attention_forward", "attention_backward")


class CpuBackend:
    name = "cpu"

    def __init__(self, dtype=np.float32, kernels: dict | None = None):
        self.dtype = np.dtype(dtype)
        # validated like the GPU's (an unknown variant is a user error either way), then ignored:
        # the numpy backend has one way per op
        self.kernels = kernel_choices(kernels)

    def empty(self, shape, dtype=None):
        return np.empty(shape, dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return np.zeros(shape, dtype or self.dtype)

    def view(self, buf, offset, shape):
        n = int(np.prod(shape))
        return buf.reshape(-1)[offset:offset + n].reshape(shape)

    def op(self, name, prefer=None, **shape):
        return ops.get(name).cpu(**shape)

    def custom(self, cpu_launch, gpu_build, **shape):
        """An op outside the registry (the decoder's cache kernels): the numpy closure here."""
        return cpu_launch

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

    def graph(self, fn):
        """The numpy backend has no graphs: fn itself replays the step."""
        return fn

    def synchronize(self):
        pass

    def pinned(self, shape, dtype):
        return np.empty(shape, dtype)

    def describe(self) -> str:
        return f"cpu (numpy {np.__version__}, {self.dtype})"


class CudaBackend:
    name = "cuda"

    def __init__(self, kernels: dict | None = None, quiet: bool = False, gpu: int = 0):
        from llmc.runtime import Runtime
        self.rt = Runtime(gpu)  # gpu: the device index (data parallel: the process's local rank)
        self.dtype = np.dtype(np.float32)
        self.kernels = kernel_choices(kernels)
        self.chosen = {k for k, v in (kernels or {}).items() if v is not None}  # named on the command line
        self.quiet = quiet
        self._noted = set()

    def empty(self, shape, dtype=None):
        return self.rt.empty(shape, dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        return self.rt.zeros(shape, dtype or self.dtype)

    def view(self, buf, offset, shape):
        return buf.view(offset, shape)

    def op(self, name, prefer=None, **shape):
        """The launcher of op `name` at `shape`: the variant named on the command line (which
        refuses loudly if it can't take the shape), else `prefer` if given and it fits (a caller's
        better choice for its shapes, e.g. the decoder's GEMV), else the default, else (one note)
        the highest-numbered variant that fits."""
        if name in COMPOSITES:
            softmax, matmul = (self.kernels[p] for p in COMPOSITES[name])
            shape = dict(shape, softmax=softmax, matmul=matmul)
        spec = ops.get(name)
        num = self.kernels[name]
        if name in self.chosen:
            return spec.build(self.rt, num, **shape)  # a variant the user named refuses loudly
        arch = self.rt.arch
        if prefer is not None and spec.variant(prefer).refuse_reason(arch, **shape) is None:
            return spec.build(self.rt, prefer, **shape)
        reason = spec.variant(num).refuse_reason(arch, **shape)
        if reason is None:
            return spec.build(self.rt, num, **shape)
        # the default can't take this shape: fall back to the highest-numbered variant that can
        for alt in sorted(spec.variants, reverse=True):
            if spec.variants[alt].refuse_reason(arch, **shape) is None:
                if (name, num, alt) not in self._noted and not self.quiet:
                    dims = {k: v for k, v in shape.items() if k not in ("softmax", "matmul")}
                    print(f"note: {name} variant {num} (default) refuses {dims}: {reason}; using variant {alt}")
                self._noted.add((name, num, alt))
                return spec.build(self.rt, alt, **shape)
        return spec.build(self.rt, num, **shape)  # nothing fits: raise the default's refusal

    def custom(self, cpu_launch, gpu_build, **shape):
        """An op outside the registry (the decoder's cache kernels): built for the GPU here."""
        return gpu_build(self.rt, **shape)

    def memset0(self, buf):
        buf.zero()

    def upload(self, buf, host):
        buf.set(host)

    def upload_async(self, buf, pinned_host):
        buf.set_async(pinned_host)

    def download(self, buf):
        return buf.get()

    def download_into(self, host, buf):
        """buf into page-locked `host` (from pinned()), waiting for the stream."""
        return buf.get_into(host)

    def graph(self, fn):
        """fn's launches captured into a CUDA graph (a callable replaying them), or fn itself where
        graphs are off or unavailable (said once)."""
        why = self.rt.graphs_available()
        if why is None:
            return self.rt.capture(fn)
        if "graphs" not in self._noted and not self.quiet and "LLMC_" not in why:
            print(f"note: no CUDA graphs ({why}); launching kernel by kernel")
        self._noted.add("graphs")
        return fn

    def synchronize(self):
        self.rt.synchronize()

    def pinned(self, shape, dtype):
        return self.rt.pinned(shape, dtype)

    def describe(self) -> str:
        return f"cuda ({self.rt.name}, {self.rt.arch})"


def make_backend(device: str, kernels: dict | None = None, dtype=np.float32, gpu: int = 0):
    """device: cpu | cuda | auto (cuda when usable, else cpu with a warning on stderr naming the
    reason: llmc.gpu_check); gpu: which GPU the cuda backend runs on (data parallel: the local rank)."""
    import sys
    from llmc.gpu_check import why_no_gpu
    if device == "cpu":
        return CpuBackend(dtype, kernels)
    if device in ("cuda", "auto"):
        why = why_no_gpu()
        if why is None:
            try:
                return CudaBackend(kernels, gpu=gpu)
            except LLMCError as e:
                if device == "cuda":
                    raise
                why = str(e)
        if device == "cuda":
            raise LLMCError(f"--device cuda: {why} (--device cpu runs the numpy backend)")
        print(f"WARNING: no GPU backend: {why}; using the numpy backend (--device cpu)", file=sys.stderr)
        return CpuBackend(dtype, kernels)
    raise LLMCError(f"--device {device}: expected cpu, cuda or auto")
