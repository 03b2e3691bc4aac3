"""The GPU side of data parallel (llmc.dist.NcclComm, the CUDA-array views, the stream/event calls, the
pointer arithmetic of the ZeRO-1 pieces) run without a GPU: the model lives in tests/fake_runtime.py's
numpy "device heap", and a stand-in `nccl.core` with nccl4py's call signatures does each collective
with MPI on the heap memory the __cuda_array_interface__ pointers name. Started by tests/test_dist.py:

    PYTHONPATH=.:tests mpiexec -n 2 python tests/dist_fake_nccl.py 0      # -z 0; one line of losses on rank 0
    PYTHONPATH=.:tests mpiexec -n 2 python tests/dist_fake_nccl.py 1      # -z 1
    PYTHONPATH=.:tests mpiexec -n 2 python tests/dist_fake_nccl.py 1 bf16 # --precision bf16

Rank 0 also trains the same model on one fake GPU at twice the batch and prints both loss lists.
In bf16 the gradients are reduced as bf16 through nccl4py's low-level bindings (llmc.dist.NcclComm
._bf16), which the stand-in provides too (nccl.bindings.nccl: pointers, counts, ncclBfloat16); the
two ranks first train two steps with stochastic rounding on and must hold identical weights (-z 0:
every rank rounds with the same seeds), then the comparison with one GPU runs with it off.
"""
import sys
import types

import numpy as np
from fake_runtime import BASE, FakeCudaBackend

from llmc.backend import CpuBackend
from llmc.bf16 import BF16, from_bf16, to_bf16
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
    m.SUM, m.AVG = 0, 4  # ncclSum, ncclAvg
    m.NcclDataType = types.SimpleNamespace(BFLOAT16=9)
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
        ptr = 0x5000  # the ncclComm_t handle

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

    # nccl.bindings.nccl: the raw calls (device pointers, element counts, the NCCL data type), used
    # for bf16 buffers; bf16 is reduced here in fp32 and rounded once (NCCL rounds per addition)
    raw = types.ModuleType("nccl.bindings.nccl")

    class Comm:
        def __init__(self, handle=0):
            assert handle == Communicator.ptr
    raw.Comm = Comm

    def bf16_at(ptr, count):
        rt = HEAPS["rt"]
        off = int(ptr) - BASE
        assert 0 <= off and off + 2 * count <= rt.top, "pointer outside the fake heap"
        return rt.heap[off:off + 2 * count].view(BF16)

    def check(dt, comm, stream):
        assert dt == 9 and isinstance(comm, Comm) and isinstance(stream, int) and stream != 0

    def all_reduce(s, r, count, dt, op, comm, stream):
        check(dt, comm, stream)
        tmp = from_bf16(bf16_at(s, count)).copy()
        MPIcomm.Allreduce(MPI.IN_PLACE, tmp, op=MPI.SUM)
        bf16_at(r, count)[...] = to_bf16(tmp / N if op == m.AVG else tmp)
        m.calls.append(("allreduce", stream))

    def reduce_scatter(s, r, recvcount, dt, op, comm, stream):
        check(dt, comm, stream)
        out = np.empty(recvcount, np.float32)
        MPIcomm.Reduce_scatter_block(from_bf16(bf16_at(s, recvcount * N)).copy(), out, op=MPI.SUM)
        bf16_at(r, recvcount)[...] = to_bf16(out / N if op == m.AVG else out)
        m.calls.append(("reduce_scatter", stream))

    def all_gather(s, r, sendcount, dt, comm, stream):
        check(dt, comm, stream)
        out = np.empty(sendcount * N, BF16)
        MPIcomm.Allgather(bf16_at(s, sendcount).copy(), out)
        bf16_at(r, sendcount * N)[...] = out
        m.calls.append(("allgather", stream))
    MPIcomm = comm
    raw.all_reduce, raw.reduce_scatter, raw.all_gather = all_reduce, reduce_scatter, all_gather
    bindings = types.ModuleType("nccl.bindings")
    bindings.nccl = raw

    pkg = types.ModuleType("nccl")
    pkg.core, pkg.bindings = m, bindings
    sys.modules.update({"nccl": pkg, "nccl.core": m, "nccl.bindings": bindings, "nccl.bindings.nccl": raw})
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


def fake_gpu(B, T, cfg, zero, precision="fp32"):
    be = FakeCudaBackend(nbytes=1 << 27, precision=precision)
    rt = be.rt
    rt.stream = FakeStream()
    rt.drv = types.SimpleNamespace(Stream=FakeStream, Event=FakeEvent,
                                   event_flags=types.SimpleNamespace(DISABLE_TIMING=2))
    HEAPS["rt"] = rt
    model = GPT2(cfg, be, B, T, optimizer=zero == 0)
    model.init_params(7)
    model.stochastic_rounding = False  # (the rank-agreement check below turns it on)
    return be, model


def main():
    zero = int(sys.argv[1])
    precision = sys.argv[2] if len(sys.argv) > 2 else "fp32"
    group = Group.start()
    assert group.world == 2
    nccl = fake_nccl(group)
    cfg = config_from_name("L2C32H2")
    B, T, steps = 2, 16, 4
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, 500, (2 * B, T + 1)).astype(np.int32) for _ in range(steps)]

    if precision == "bf16":
        # stochastic rounding on: after two steps every rank holds the same bf16 weights
        be, model = fake_gpu(B, T, cfg, zero, precision)
        model.stochastic_rounding = True
        dp = DataParallel(group, model, zero, NcclComm(group, be.rt))
        dp.load_master(model.get_params() if zero == 0 else from_bf16(be.download(model.params)))
        for i, xy in enumerate(batches[:2]):
            mine = xy[group.rank * B:(group.rank + 1) * B]
            model.zero_grad()
            dp.train_micro_step(mine[:, :-1], mine[:, 1:], last=True)
            dp.update(1e-3, i + 1, weight_decay=0.1, max_norm=0.5)
        w = be.download(model.params)
        assert w.dtype == BF16 and model.sr_state != 13371337
        allw = group.comm.allgather(w)
        assert all(np.array_equal(allw[0], x) for x in allw), "the ranks' bf16 weights differ"
        if zero == 1:
            assert dp.master is not None and dp.master_state().size == model.num_params // 2
    be, model = fake_gpu(B, T, cfg, zero, precision)
    dp = DataParallel(group, model, zero, NcclComm(group, be.rt))
    host = GPT2(cfg, CpuBackend(np.float32), 1, 1, training=False).init_params(7)
    dp.load_master(host)  # (bf16 ZeRO-1: the exact fp32 weights, as the trainer does)
    losses = []
    for i, xy in enumerate(batches):
        mine = xy[group.rank * B:(group.rank + 1) * B]
        model.zero_grad()
        dp.train_micro_step(mine[:, :-1], mine[:, 1:], last=True)
        dp.update(1e-3, i + 1, weight_decay=0.1, max_norm=0.5)
        losses.append(dp.step_loss())
    dp.params_ready()  # (-z 1 with LLMC_DP_GATHER=forward: the last all-gather)
    # the reductions ran on the second stream, which waited for backward's events; the compute
    # stream waited for the last reduction at the end of each micro-step, then ran the update's
    # norm. -z 1's all-gathers: on the compute stream at the end of the update (the default), or
    # (LLMC_DP_GATHER=forward) on the second stream after it waited for AdamW, one per layer + the
    # rest, each waited for by the next forward (none before the first step; the last one by
    # params_ready). The reducing micro-step is a graph of its own unless it waits on gathers.
    comm_h, compute_h = dp.comm_stream.handle, be.rt.stream.handle
    L, fwd = cfg.num_layers, zero == 1 and dp.gather_in_forward
    kinds = {k for k, h in nccl.calls if h == comm_h}
    assert kinds == ({"allreduce"} if zero == 0 else {"reduce_scatter"} | ({"allgather"} if fwd else set())), kinds
    assert len(dp.comm_stream.waited) == steps * (L + 1) + (steps if fwd else 0)
    assert len(be.rt.stream.waited) == steps + ((steps - 1) * (L + 1) + 1 if fwd else 0)
    if zero == 1:
        assert {k for k, h in nccl.calls if h == compute_h} == ({"allreduce"} if fwd else {"allreduce", "allgather"})
    assert (model._graph_custom is not None) == (not fwd) == dp.graph
    if precision == "bf16":  # (the low-level bf16 calls check their data type themselves)
        assert model.grads.dtype == BF16 and model.params.dtype == BF16
    final = model.get_params()
    group.comm.Barrier()
    if group.rank == 0:
        be1, one = fake_gpu(2 * B, T, cfg, 0, precision)
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
