"""The GPU side of data parallel (llmc.dist.NcclComm, the CUDA-array views, the stream/event calls, the
pointer arithmetic of the ZeRO-1 pieces) run without a GPU: the model lives in tests/fake_runtime.py's
numpy "device heap", and a stand-in `nccl.core` with nccl4py's call signatures does each collective
with MPI on the heap memory the __cuda_array_interface__ pointers name. Started by tests/test_dist.py:

    PYTHONPATH=.:tests mpiexec -n 2 python tests/dist_fake_nccl.py 0      # -z 0; one line of losses on rank 0
    PYTHONPATH=.:tests mpiexec -n 2 python tests/dist_fake_nccl.py 1      # -z 1

Rank 0 also trains the same model on one fake GPU at twice the batch and prints both loss lists.
"""
import sys
import types

import numpy as np
from fake_runtime import BASE, FakeCudaBackend

from llmc.config import config_from_name
from llmc.dist import DataParallel, Group, NcclComm
from llmc.model import GPT2

HEAPS = {}  # the fake backend whose heap the pointers point into


def heap_array(buf):
    """The numpy view of the heap memory a CUDA-array-interface object describes."""
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["strides"] in (None, (4,)) and len(cai["shape"]) == 1, cai
    ptr, readonly = cai["data"]
    assert not readonly
    rt = HEAPS["rt"]
    off, n = ptr - BASE, cai["shape"][0] * np.dtype(cai["typestr"]).itemsize
    assert 0 <= off and off + n <= rt.top, "pointer outside the fake heap"
    return rt.heap[off:off + n].view(np.dtype(cai["typestr"]))


def fake_nccl(group):
    """A stand-in for nccl.core with the calls llmc.dist makes, checked like nccl4py checks them."""
    from mpi4py import MPI
    comm, N = group.comm, group.world
    m = types.ModuleType("nccl.core")
    m.SUM, m.AVG = "sum", "avg"
    m.calls = []

    class UniqueId:
        def __init__(self, b):
            self.b = bytes(b)

        def __bytes__(self):
            return self.b

        @staticmethod
        def from_bytes(b):
            return UniqueId(b)

    class Communicator:
        @classmethod
        def init(cls, nranks, rank, uid):
            assert (nranks, rank) == (N, group.rank) and len(bytes(uid)) == 128
            return cls()

        def allreduce(self, sendbuf, recvbuf, op, *, stream=None):
            assert isinstance(stream, int) and stream != 0 and op in (m.SUM, m.AVG)
            s, r = heap_array(sendbuf), heap_array(recvbuf)
            assert r.size >= s.size
            tmp = s.copy()
            comm.Allreduce(MPI.IN_PLACE, tmp, op=MPI.SUM)
            r[:s.size] = tmp / N if op == m.AVG else tmp
            m.calls.append(("allreduce", stream))

        def reduce_scatter(self, sendbuf, recvbuf, op, *, stream=None):
            assert isinstance(stream, int) and stream != 0 and op in (m.SUM, m.AVG)
            s, r = heap_array(sendbuf), heap_array(recvbuf)
            count = s.size // N
            assert count >= 1 and r.size >= count
            comm.Reduce_scatter_block(s.copy(), r[:count], op=MPI.SUM)
            if op == m.AVG:
                r[:count] /= N
            m.calls.append(("reduce_scatter", stream))

        def allgather(self, sendbuf, recvbuf, *, stream=None):
            assert isinstance(stream, int) and stream != 0
            s, r = heap_array(sendbuf), heap_array(recvbuf)
            assert r.size >= N * s.size
            comm.Allgather(s.copy(), r[:N * s.size])
            m.calls.append(("allgather", stream))

        def destroy(self):
            pass

    m.Communicator, m.UniqueId = Communicator, UniqueId
    m.get_unique_id = lambda: UniqueId(bytes(range(128)))
    m.get_version = lambda: "fake"

    class group_ctx:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False
    m.group = group_ctx
    pkg = types.ModuleType("nccl")
    pkg.core = m
    sys.modules["nccl"], sys.modules["nccl.core"] = pkg, m
    return m


class FakeStream:
    count = 0

    def __init__(self):
        FakeStream.count += 1
        self.handle = 0x1000 + FakeStream.count  # a nonzero handle, as a real stream has
        self.waited = []

    def wait_for_event(self, ev):
        assert isinstance(ev, FakeEvent) and ev.recorded
        self.waited.append(ev)


class FakeEvent:
    def __init__(self, flags=0):
        self.recorded = None

    def record(self, stream):
        assert isinstance(stream, FakeStream)
        self.recorded = stream


def fake_gpu(B, T, cfg, zero):
    be = FakeCudaBackend(nbytes=1 << 27)
    rt = be.rt
    rt.stream = FakeStream()
    rt.drv = types.SimpleNamespace(Stream=FakeStream, Event=FakeEvent,
                                   event_flags=types.SimpleNamespace(DISABLE_TIMING=2))
    HEAPS["rt"] = rt
    model = GPT2(cfg, be, B, T, optimizer=zero == 0)
    model.init_params(7)
    return be, model


def main():
    zero = int(sys.argv[1])
    group = Group.start()
    assert group.world == 2
    nccl = fake_nccl(group)
    cfg = config_from_name("L2C32H2")
    B, T, steps = 2, 16, 4
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 500, (2 * B, T + 1)).astype(np.int32) for _ in range(steps)]

    be, model = fake_gpu(B, T, cfg, zero)
    dp = DataParallel(group, model, zero, NcclComm(group, be.rt))
    losses = []
    for i, xy in enumerate(batches):
        mine = xy[group.rank * B:(group.rank + 1) * B]
        model.zero_grad()
        dp.train_micro_step(mine[:, :-1], mine[:, 1:], last=True)
        dp.update(1e-3, i + 1, weight_decay=0.1, max_norm=0.5)
        losses.append(dp.step_loss())
    # the reductions ran on the second stream, which waited for backward's events; the update's
    # collectives on the compute stream, after it waited for the last reduction
    comm_h, compute_h = dp.comm_stream.handle, be.rt.stream.handle
    kinds = {k for k, h in nccl.calls if h == comm_h}
    assert kinds == ({"allreduce"} if zero == 0 else {"reduce_scatter"}), kinds
    assert len(dp.comm_stream.waited) == steps * (cfg.num_layers + 1)
    assert len(be.rt.stream.waited) == steps
    if zero == 1:
        assert {k for k, h in nccl.calls if h == compute_h} == {"allreduce", "allgather"}
    final = model.get_params()
    group.comm.Barrier()
    if group.rank == 0:
        be1, one = fake_gpu(2 * B, T, cfg, 0)
        ref = []
        for i, xy in enumerate(batches):
            one.zero_grad()
            one.train_micro_step(xy[:, :-1], xy[:, 1:])
            one.update(1e-3, i + 1, weight_decay=0.1, max_norm=0.5)
            ref.append(one.step_loss())
        dw = float(np.abs(one.get_params() - final).max())
        print("losses", " ".join(f"{v:.7f}" for v in losses), "| one", " ".join(f"{v:.7f}" for v in ref),
              f"| max weight diff {dw:.3e}")


if __name__ == "__main__":
    main()
