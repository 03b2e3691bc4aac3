"""The 2-CTA cluster GEMM's synchronisation protocol (cuda/gemm_wgmma.cu: producer<> and gemm_wgmma_body
with CL = 2, the _mc instances), run on the CPU: two CTAs, each a producer thread and two consumer
warpgroups, as coroutines under a random scheduler, with mbarriers that behave like the hardware's (see
test_gemm_pingpong_protocol.MBar: a parity wait cannot tell lap L from lap L - 2).

Each CTA's producer loads its own A tile (into its own stage) and one half of the shared B tile,
multicast into the same stage of both CTAs; every part lands at its own random later time and completes
its bytes on the `full` barrier of the CTA it lands in. Consumers check each part's tag when their
`full` wait passes and again when the wgmma reading the stage retires. A stage is freed by every
consumer warp of both CTAs (the `empty` barriers count both), and the producer waits, after its last
load, until every stage is free again (the tail), so that nothing lands in or arrives at a CTA that has
ended. Without the peer's arrivals a multicast overwrites a stage the peer is still reading; without the
tail a peer's arrival comes after a CTA has ended: the two tests at the end show both failing.
No GPU needed."""
import random

import pytest

from tests.test_gemm_pingpong_protocol import MBar

WARPS = 4  # consumer warps per warpgroup; two warpgroups a CTA (the kernel's CONSUMER_WARPS = 8)


def simulate(seed, units, kblocks, stages, peer_release=True, tail=True):
    """Two CTAs of a cluster walking the same `units` work units of kblocks(u) k-blocks each; raises
    AssertionError on any protocol violation (stale or overwritten data, a signal to an ended CTA,
    a deadlock)."""
    rnd = random.Random(seed)
    n_cta = 2
    full = [[MBar(1) for _ in range(stages)] for _ in range(n_cta)]
    empty = [[MBar(2 * WARPS * (n_cta if peer_release else 1)) for _ in range(stages)] for _ in range(n_cta)]
    # what each stage's shared memory holds: parts "A" (the CTA's own) and "B0", "B1" (the halves of B)
    tag = [[{} for _ in range(stages)] for _ in range(n_cta)]
    alive = [True] * n_cta
    in_flight = []  # (destination CTA, stage, part, tag)

    def producer(r):
        stage, phase = 0, 0
        for u in range(units):
            for kb in range(kblocks(u)):
                while not empty[r][stage].try_wait_parity(phase ^ 1):
                    yield
                full[r][stage].expect_tx(3)  # A + both halves of B
                in_flight.append((r, stage, "A", (u, kb, r)))
                for d in range(n_cta):  # this CTA's half of B, multicast
                    in_flight.append((d, stage, f"B{r}", (u, kb)))
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
                yield
        if tail:
            for _ in range(stages):
                while not empty[r][stage].try_wait_parity(phase ^ 1):
                    yield
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1

    def consumer(r, c):
        stage, phase = 0, 0

        def want(u, kb):
            return {"A": (u, kb, r), "B0": (u, kb), "B1": (u, kb)}

        def release(s):
            for d in (range(n_cta) if peer_release else (r,)):
                assert alive[d], f"CTA {r} consumer {c} arrived at ended CTA {d}'s barrier"
                for _ in range(WARPS):
                    empty[d][s].arrive()

        for u in range(units):
            groups = []  # committed wgmma groups not yet retired: (stage, what they read)
            prev = -1
            for kb in range(kblocks(u)):
                while not full[r][stage].try_wait_parity(phase):
                    yield
                assert tag[r][stage] == want(u, kb), \
                    f"CTA {r} consumer {c} read stage {stage}: {tag[r][stage]}, wanted {want(u, kb)}"
                groups.append((stage, want(u, kb)))
                yield
                while len(groups) > 1:  # wgmma_wait<1>
                    s_, t_ = groups.pop(0)
                    assert tag[r][s_] == t_, f"CTA {r} stage {s_} overwritten under a running wgmma"
                if prev >= 0:
                    release(prev)
                prev = stage
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
            yield
            while groups:  # wgmma_wait<0>
                s_, t_ = groups.pop(0)
                assert tag[r][s_] == t_, f"CTA {r} stage {s_} overwritten under a running wgmma"
            if prev >= 0:
                release(prev)
            yield  # the epilogue

    def tma():  # each part lands some random time after it was issued, in any order
        while True:
            if in_flight and rnd.random() < 0.4:
                d, s, part, t = in_flight.pop(rnd.randrange(len(in_flight)))
                assert alive[d], f"a load landed in ended CTA {d}"
                tag[d][s][part] = t
                full[d][s].complete_tx(1)
            yield

    procs = {}
    for r in range(n_cta):
        procs[(r, "p")] = producer(r)
        procs[(r, 0)] = consumer(r, 0)
        procs[(r, 1)] = consumer(r, 1)
    tma_proc = tma()
    steps = 0
    while procs:
        steps += 1
        assert steps < 400000, f"deadlock: {sorted(procs, key=str)} still running"
        keys = sorted(procs, key=str)
        pick = rnd.randrange(len(keys) + 3)
        if pick >= len(keys):
            next(tma_proc)
            continue
        try:
            next(procs[keys[pick]])
        except StopIteration:
            del procs[keys[pick]]
            r = keys[pick][0]
            if not any(k[0] == r for k in procs):
                alive[r] = False  # every thread of CTA r has ended
    while in_flight:  # (nothing may be left to land: it would land in an ended CTA)
        next(tma_proc)


@pytest.mark.parametrize("units", [1, 2, 5])
@pytest.mark.parametrize("stages", [4, 6])
@pytest.mark.parametrize("kb", [1, 3, 12, "mixed"])
def test_cluster_protocol_holds(units, stages, kb):
    """Random schedules: every read sees its own k-block's A and both halves of B, nothing is overwritten
    under a wgmma, nothing lands in or arrives at an ended CTA, no deadlock. Units shorter than the ring
    (K = 16: one k-block), longer (12), and mixed (split-K's short and empty last splits)."""
    kblocks = (lambda u: [12, 0, 1, 9, 3][u % 5]) if kb == "mixed" else (lambda u: kb)
    for seed in range(25):
        simulate(seed, units, kblocks, stages)


def _failures(seeds, *args, **kw):
    """The messages of the schedules (one per seed) that break the protocol under these rules."""
    out = []
    for seed in range(seeds):
        try:
            simulate(seed, *args, **kw)
        except AssertionError as e:
            out.append(str(e))
    return out


def test_cluster_protocol_needs_the_peer_arrivals():
    """With each CTA's consumers freeing only their own stages, a producer multicasts its half of B into
    a stage the peer is still reading (or before the peer has read it)."""
    assert any("overwritten" in m or "read stage" in m for m in _failures(40, 3, lambda u: 12, 4, peer_release=False))


def test_cluster_protocol_needs_the_producer_tail():
    """Without the producer's wait for every stage at the end, a CTA can end while its peer's consumers
    still have arrivals to make at its barriers."""
    assert any("ended CTA" in m for m in _failures(60, 2, lambda u: 3, 4, tail=False))


def test_the_kernel_and_the_model_agree():
    """The simulation's rules are the kernel's: `empty` counts both CTAs' consumer warps, a consumer frees
    a stage in every CTA of the cluster, each producer multicasts every other box of B to both and
    waits for every stage after its last load; the cluster barrier (not __syncthreads) follows the
    barriers' initialisation, before any peer can signal them."""
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "gemm_wgmma.cu").read_text()
    body = src[src.index("void gemm_wgmma_body("):src.index("#define GEMM_WGMMA_ENTRY")]
    prod = src[src.index("void producer("):src.index("void gemm_wgmma_body(")]
    assert "mbar_init(&empty[s], CONSUMER_WARPS * CL);" in body and "mbar_init(&full[s], 1);" in body
    assert "if constexpr (CL > 1) cluster_sync_all(); else __syncthreads();" in body
    assert "for (int r = 0; r < CL; r++) mbar_arrive_cluster(bar, r);" in body
    assert body.count("release(&empty[") == 3 and "mbar_arrive(&empty[" not in body
    assert "else if (b % CL == rank)" in prod and "(1 << CL) - 1);" in prod
    assert "mbar_expect_tx(&full[stage], STAGE_BYTES);" in prod  # A + every box of B, in both CTAs
    tail = prod[prod.index("if (CL > 1) {"):]
    assert "for (int i = 0; i < STAGES; i++)" in tail and "mbar_wait(&empty[stage], phase ^ 1);" in tail
