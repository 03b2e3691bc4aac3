"""A stand-in for the CUDA backend that runs on the CPU: buffers are real DevArrays (pointer,
shape, dtype) into one numpy "device heap", and every op is the numpy cpu launcher applied to the
heap memory the pointers name. So the model's GPU-side plumbing (DevArray views, per-layer
indexing, offsets, alignment, argument order) runs in CI exactly as it runs on the GPU, with the
kernels replaced by their references."""
import numpy as np

from llmc import ops
from llmc.backend import kernel_choices
from llmc.runtime import DevArray

BASE = 0x7F0000000000  # fake device addresses start here


class FakeRuntime:
    def __init__(self, nbytes=1 << 26):
        self.heap = np.zeros(nbytes, np.uint8)
        self.top = 0
        self.allocated_bytes = 0

    def empty(self, shape, dtype=np.float32):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if self.top + n > self.heap.size:
            raise MemoryError("fake device heap exhausted")
        a = DevArray(self, BASE + self.top, shape, dtype, owner=None)
        self.heap[self.top:self.top + n] = 0xFF  # poisoned: reading unwritten memory shows as NaN
        self.top += -(-n // 256) * 256
        self.allocated_bytes += n
        return a

    def require_free(self, nbytes, what="model"):
        assert nbytes <= self.heap.size - self.top, f"fake heap too small for the {what}"

    def np(self, a: DevArray) -> np.ndarray:
        off = a.ptr - BASE
        assert 0 <= off and off + a.nbytes <= self.top, f"pointer outside the fake heap: {a}"
        return self.heap[off:off + a.nbytes].view(a.dtype).reshape(a.shape)


class FakeCudaBackend:
    name = "fake-cuda"

    def __init__(self, kernels=None, nbytes=1 << 26):
        self.rt = FakeRuntime(nbytes)
        self.dtype = np.dtype(np.float32)
        self.kernels = kernel_choices(kernels)
        self.launches = []

    def empty(self, shape, dtype=None):
        return self.rt.empty(shape, dtype or self.dtype)

    def zeros(self, shape, dtype=None):
        a = self.empty(shape, dtype)
        self.rt.np(a)[...] = 0
        return a

    def view(self, buf, offset, shape):
        return buf.view(offset, shape)

    def op(self, name, prefer=None, **shape):
        cpu = ops.get(name).cpu(**shape)
        conv = self.rt.np

        def launch(*args):
            for x in args:  # a DevArray argument must be a DevArray, never a numpy array
                assert not isinstance(x, np.ndarray), f"{name}: got a host array"
            self.launches.append(name)
            cpu(*[conv(x) if isinstance(x, DevArray) else x for x in args])
        return launch

    def custom(self, cpu_launch, gpu_build, **shape):
        conv = self.rt.np

        def launch(*args):
            cpu_launch(*[conv(x) if isinstance(x, DevArray) else x for x in args])
        return launch

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

    def graph(self, fn):
        self.graphs = getattr(self, "graphs", 0) + 1
        return fn

    def synchronize(self):
        pass

    def pinned(self, shape, dtype):
        return np.empty(shape, dtype)

    def describe(self):
        return "fake cuda (numpy ops over DevArrays)"
