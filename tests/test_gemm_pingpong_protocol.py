"""The ping-pong GEMM's synchronisation protocol (cuda/gemm_wgmma.cu, gemm_wgmma_pp_body), run on the
CPU: the producer thread and the two consumer warpgroups as coroutines under a random scheduler, with
mbarriers that behave like the hardware's (a parity wait only compares the parity of the current
phase, so it cannot tell lap L from lap L - 2), named barriers that count arrivals, TMA loads that land
at a random later time, and wgmmas that read their stage until they retire.

Each stage carries a tag (unit, k-block) when its load lands; a consumer checks the tag when its full
wait passes and again when the wgmma reading it retires, so a stale read, an early overwrite, a
deadlock or a half-arrived named barrier at the end all fail. The same simulation without the
mainloop turn must fail: that is the test that the turn is needed (and that this one can fail).
No GPU needed."""
import random

import pytest

from llmc.ops import gemm_wgmma as gw


class MBar:
    def __init__(self, count):
        self.count, self.pending, self.completed = count, count, 0  # completed phases
        self.tx = 0

    def arrive(self):
        self.pending -= 1
        self._maybe_complete()

    def expect_tx(self, nbytes):  # arrive.expect_tx: one arrival plus bytes to wait for
        self.tx += nbytes
        self.arrive()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._maybe_complete()

    def _maybe_complete(self):
        assert self.pending >= 0, "more arrivals than the barrier's count in one phase"
        if self.pending == 0 and self.tx == 0:
            self.completed += 1
            self.pending = self.count

    def try_wait_parity(self, parity):
        # true once the phase with this parity has completed: the hardware compares the current
        # (incomplete) phase's parity with the one asked for
        return (self.completed & 1) != parity


class NamedBar:
    """bar.sync / bar.arrive with a thread count of 256: 128 syncing + 128 arriving threads."""
    def __init__(self):
        self.arrived = 0
        self.generation = 0
        self.syncers = 0

    def arrive(self):
        self.arrived += 128
        self._check()

    def sync(self):
        self.arrived += 128
        self.syncers += 1
        gen = self.generation
        self._check()
        while self.generation == gen:
            yield

    def _check(self):
        if self.arrived == 256:
            assert self.syncers == 1, "named barrier completed by arrivals alone (two arrives, no sync)"
            self.arrived, self.syncers = 0, 0
            self.generation += 1


def simulate(seed, units, kblocks, stages, turns=True, epi_turns=True):
    """One CTA: `units` work units of kblocks(u) k-blocks each, a ring of `stages`. Returns the
    epilogue order (unit numbers); raises AssertionError on any protocol violation."""
    rnd = random.Random(seed)
    full = [MBar(1) for _ in range(stages)]
    empty = [MBar(4) for _ in range(stages)]
    main_bar = [NamedBar(), NamedBar()]
    epi_bar = [NamedBar(), NamedBar()]
    tag = [None] * stages           # what the stage's shared memory holds (unit, k-block)
    in_flight = []                  # TMA loads: (stage, tag)
    done_epi = []

    def producer():
        stage, phase = 0, 0
        for u in range(units):
            for kb in range(kblocks(u)):
                while not empty[stage].try_wait_parity(phase ^ 1):
                    yield
                full[stage].expect_tx(1)
                in_flight.append((stage, (u, kb)))
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
                yield

    def consumer(c):
        stage, phase = 0, 0
        for j, u in enumerate(range(units)):   # (one CTA: unit j is u)
            nk = kblocks(u)
            if j % 2 != c:   # ring_advance
                s = stage + nk
                phase ^= (s // stages) & 1
                stage = s % stages
                continue
            more = j + 1 < units
            if j > 0 and turns:
                yield from main_bar[c].sync()
            groups = []   # committed wgmma groups not yet retired: (stage, tag)
            prev = -1
            for kb in range(nk):
                while not full[stage].try_wait_parity(phase):
                    yield
                assert tag[stage] == (u, kb), f"consumer {c} read stage {stage}: {tag[stage]}, wanted {(u, kb)}"
                groups.append((stage, (u, kb)))
                yield
                # wgmma_wait<1>: everything but the newest group retires (reading its stage till then)
                while len(groups) > 1:
                    s_, t_ = groups.pop(0)
                    assert tag[s_] == t_, f"stage {s_} overwritten under a running wgmma"
                if prev >= 0:
                    for _ in range(4):
                        empty[prev].arrive()
                prev = stage
                stage += 1
                if stage == stages:
                    stage, phase = 0, phase ^ 1
            if more and turns:
                main_bar[c ^ 1].arrive()
            yield
            while groups:   # wgmma_wait<0>
                s_, t_ = groups.pop(0)
                assert tag[s_] == t_, f"stage {s_} overwritten under a running wgmma"
            if prev >= 0:
                for _ in range(4):
                    empty[prev].arrive()
            if j > 0 and epi_turns:
                yield from epi_bar[c].sync()
            done_epi.append(u)
            yield
            if more and epi_turns:
                epi_bar[c ^ 1].arrive()

    def tma():   # loads land in order of issue, each some random time later
        while True:
            if in_flight and rnd.random() < 0.3:
                s, t = in_flight.pop(0)
                tag[s] = t
                full[s].complete_tx(1)
            yield

    procs = {"producer": producer(), "c0": consumer(0), "c1": consumer(1)}
    tma_proc = tma()
    steps = 0
    while procs:
        steps += 1
        assert steps < 200000, f"deadlock: {sorted(procs)} still running"
        name = rnd.choice(sorted(procs) + ["tma"] * 2)
        if name == "tma":
            next(tma_proc)
            continue
        try:
            next(procs[name])
        except StopIteration:
            del procs[name]
    assert not in_flight
    for b in main_bar + epi_bar:
        assert b.arrived == 0, "a named barrier left half-arrived at the end"
    return done_epi


@pytest.mark.parametrize("units", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("stages", [5, 7])
@pytest.mark.parametrize("kb", [1, 3, 12, "mixed"])
def test_pingpong_protocol_holds(units, stages, kb):
    """Random schedules: every read sees its own k-block, nothing is overwritten under a wgmma, no
    deadlock, every named barrier balanced; epilogues in unit order. Units with fewer k-blocks than
    stages (K = 8: one k-block), more (K = 768 bf16: 12), and mixed lengths (split-K's short last
    split, 0 for an empty split)."""
    kblocks = (lambda u: [12, 0, 1, 9, 3, 13, 2][u % 7]) if kb == "mixed" else (lambda u: kb)
    for seed in range(40):
        order = simulate(seed, units, kblocks, stages)
        assert order == list(range(units))


def test_pingpong_protocol_needs_the_mainloop_turn():
    """Without the mainloop turn a consumer whose tile is done runs ahead into positions whose
    previous lap has not completed, and a parity wait passes on lap L - 2: stale data (or a hang)."""
    failures = 0
    for seed in range(60):
        try:
            simulate(seed, 6, lambda u: 12, 7, turns=False, epi_turns=False)
        except AssertionError:
            failures += 1
    assert failures > 0


def test_the_kernel_and_the_model_agree_on_the_counts():
    """The simulation's numbers are the kernel's: empty barriers count 4 arrivals (one consumer's
    warps), the turns use named barriers 3/4 and 5/6 of 256 threads, clear of wg_barrier's 1 and 2."""
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "gemm_wgmma.cu").read_text()
    body = src[src.index("gemm_wgmma_pp_body("):src.index("#define GEMM_WGMMA_PP_ENTRY")]
    assert "mbar_init(&empty[s], 4);" in body and "mbar_init(&full[s], 1);" in body
    assert "constexpr int MAIN_BAR = 3, EPI_BAR = 5;" in src
    assert 'bar.sync %0, 256;' in src and 'bar.arrive %0, 256;' in src
    assert gw.PP_INSTANCES  # the instances the protocol serves


@pytest.mark.skipif(__import__("llmc.runtime", fromlist=["nvcc_path"]).nvcc_path() is None, reason="nvcc not installed")
def test_pp_ptx_issues_the_tile_it_claims():
    """In the PTX of every ping-pong instance: one stage's wgmmas (4 k-steps of 32 bytes, times 2 for
    a 128-row tile) of shape m64 n<BN>, the input type, B's transpose bit set exactly for _bt; the two
    turns' bar.arrive and bar.sync (plus __syncthreads' barrier 0); the setmaxnreg pair."""
    import re
    from llmc.runtime import compile_ptx
    ptx = compile_ptx("gemm_wgmma", "sm_90")
    chunks = re.split(r"(?=^\.visible \.entry )", ptx, flags=re.M)[1:]
    bodies = {re.match(r"\.visible \.entry (\w+)", c).group(1): c for c in chunks}
    for (ty, out, layout), shapes in gw.PP_INSTANCES.items():
        for rm, bn in shapes:
            name = gw.pp_instance_name(ty, out, layout, rm, bn)
            body = bodies[name]
            k = 8 if ty == "tf32" else 16
            w = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.\w+ [^;]*?, p, 1, 1(?:, (\d), (\d))?;", body)
            assert len(w) == 4 * rm // 64, (name, len(w))
            assert set(w) == {(f"m64n{bn}k{k}", ty, *(("0", "1" if layout == "kn" else "0") if ty == "bf16" else ("", "")))}, (name, set(w))
            assert body.count("bar.arrive") == 2 and len(re.findall(r"\bbar\.sync\b", body)) == 3, name
            assert body.count("setmaxnreg.inc") == 1 and body.count("setmaxnreg.dec") == 1, name
