"""GEMM engine 4's index formulas (cuda/gemm.cu: E4Tile, E4Loader, gemm_e4_body, gemm_store_staged),
checked exhaustively on the CPU against a model of what the hardware does, for every tile config the
.cu builds and every layout (nn, nt, tn, tt). No GPU: this is how engine 4 was checked before it ever
ran, and it keeps the mapping from regressing silently.

    python -m pytest tests/test_gemm_layout.py -q

The hardware model (facts from the PTX ISA; lane l, g = l // 4, t = l % 4):
  mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
     A (16x8):  a0 (g, t)   a1 (g+8, t)    a2 (g, t+4)   a3 (g+8, t+4)       (row, k)
     B (8x8):   b0 (t, g)   b1 (t+4, g)                                       (k, col)
     C (16x8):  c0 (g, 2t)  c1 (g, 2t+1)   c2 (g+8, 2t)  c3 (g+8, 2t+1)      (row, col)
  ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8q..8q+7 give the addresses of rows 0..7 of matrix
     q (16 bytes each); lane l receives in register q the 32-bit word l % 4 of row l // 4 of matrix q.
     On fp32 data a "matrix" is an 8x4 block of floats.
  Shared memory: 32 banks of 4 bytes. A 16-byte-per-lane access (LDS.128, STS.128, the shared side of
     a 16-byte cp.async, one ldmatrix matrix) is served in phases of 8 lanes (lanes 8p..8p+7; one
     matrix); a phase is conflict-free when its 8 chunks fall in 8 distinct 16-byte bank groups.

Engine 4's mapping of the mma onto the CTA tile (the epilogue relies on it; it is engine 2's for rows
and columns): row r (0..15) of m-tile mi of the warp at (wm, wn) is tile row wm + (r % 8)*RPGA + 2mi +
r // 8; column c (0..7) of n-tile ni is tile column wn + c*NI + ni; k-index kk (0..7) of k-step j is
tile k 8j + kk. RPGA = 2*MI, NI = WN / 8.

Checked per config x layout: (1) the smem layout is a bijection of the tile onto the stage, 16-byte
chunks contiguous; (2) the loader copies every chunk of a k-tile exactly once, from the right global
element to its place, conflict-free per phase, whole 32-byte sectors per warp instruction, with the
row steps the kernel keeps in registers, and byte counts that copy exactly the elements inside the
matrix on edge tiles; (3) every fragment register of every lane of every warp, for every m-tile,
n-tile and k-step, holds the element the mma needs, through the real ldmatrix / LDS.128 semantics,
conflict-free; (4) the epilogue stages each accumulator at the element of C it holds, conflict-free,
inside the warp's staging area, which fits in the pipeline's smem; (5) a whole k-tile run through the
model (loader -> smem -> fragments -> mma -> epilogue) on integer data equals A @ B^T exactly; and
(6) the C++ formulas are the formulas modelled here: E4Tile is compiled on the host from
cuda/gemm.cu (nvcc, no GPU) and every value is compared (skipped without nvcc).
"""
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from llmc.ops import gemm as mm

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "cuda" / "gemm.cu"
LAYOUTS = ["nn", "nt", "tn", "tt"]

# ----------------------------------------------------------------------------------------------
# the configs: what cuda/gemm.cu instantiates must be what llmc/ops/gemm.py knows


def source_configs():
    """{name: (BM, BN, WM, WN, STAGES, MINB)} from the GEMM_E4_LAYOUTS(...) lines of cuda/gemm.cu."""
    found = re.findall(r"^GEMM_E4_LAYOUTS\((\w+), (\d+), (\d+), (\d+), (\d+), (\d+), (\d+)\)", SRC.read_text(), re.M)
    return {name: tuple(map(int, rest)) for name, *rest in found}


def config(name):
    """(BM, BN, WM, WN, threads, stages) of an engine-4 config."""
    BM, BN, threads, stages, _, _ = mm.TF32_CONFIGS[name]
    WM, WN = mm.TF32_WARP_TILES[name]
    return BM, BN, WM, WN, threads, stages


def test_configs_match_the_source():
    src = source_configs()
    assert set(src) == set(mm.E4_CONFIGS), (sorted(src), mm.E4_CONFIGS)
    for name, (BM, BN, WM, WN, ST, _) in src.items():
        cBM, cBN, cWM, cWN, threads, stages = config(name)
        assert (BM, BN, WM, WN, ST) == (cBM, cBN, cWM, cWN, stages), name
        assert threads == (BM // WM) * (BN // WN) * 32, name


# ----------------------------------------------------------------------------------------------
# engine 4's formulas (a transcription of E4Tile; they work on ints and on numpy int arrays)


class Tile:
    """One operand's smem tile: K-major (R rows of 32 floats) or MN-major (32 k-rows of R floats)."""

    def __init__(self, kmajor, is_a, R, RPG, NT):
        self.kmajor, self.is_a, self.R, self.RPG, self.NT = kmajor, is_a, R, RPG, NT
        self.PER = R * 8 // NT
        self.X = NT // 64
        self.CPR = R // 4
        self.KSTEP = NT // self.CPR
        assert RPG in (4, 8)
        if kmajor:
            assert NT % 64 == 0 and RPG % self.X == 0 and R % (8 * RPG) == 0
        else:
            assert NT % self.CPR == 0 and self.KSTEP % 4 == 0

    def mn_key(self, u):
        return 2 * u if self.RPG == 4 else (u & 1) | ((u & 2) << 1)

    def off(self, row, k):
        if self.kmajor:
            return row * 32 + (((k >> 2) ^ ((row // self.RPG) & 7)) << 2) + (k & 3)
        return k * self.R + (((row >> 2) ^ self.mn_key(k & 3)) << 2) + (row & 3)

    def ld_row(self, tid):
        return (tid >> 6) + self.RPG * ((tid >> 3) & 7) if self.kmajor else tid // self.CPR

    def ld_col(self, tid):
        return 4 * (tid & 7) if self.kmajor else 4 * (tid % self.CPR)

    def ld_step(self, i):
        X, RPG = self.X, self.RPG
        return (X * i) % RPG + 8 * RPG * ((X * i) // RPG) if self.kmajor else self.KSTEP * i

    def ld_smem(self, tid):
        return self.off(self.ld_row(tid), self.ld_col(tid)) if self.kmajor else self.off(self.ld_col(tid), self.ld_row(tid))

    def ld_smem_step(self, i):
        return (32 if self.kmajor else self.R) * self.ld_step(i)

    def frag_base(self, w, lane, x):
        if self.kmajor:
            dr = (lane >> 3) & 1 if self.is_a else lane >> 4
            kh = lane >> 4 if self.is_a else (lane >> 3) & 1
            return self.off(w + (lane & 7) * self.RPG + dr, 8 * x + 4 * kh)
        return self.off(w + (lane >> 2) * self.RPG + 4 * x, lane & 3)

    def frag_imm(self, a, b):
        return 32 * a if self.kmajor else (8 * a + 4 * b) * self.R

    # the byte count the loader gives chunk i of thread tid (E4Loader::load), tile origin rc0 of rcs
    # rows (K-major) / columns (MN-major), k-tile at k0 of K
    def chunk_bytes(self, tid, i, rc0, rcs, k0, K):
        row, col = self.ld_row(tid), self.ld_col(tid)
        if rc0 + self.R <= rcs and k0 + 32 <= K:
            return 16
        if self.kmajor:
            kb = 4 * max(0, min(4, K - (k0 + col)))
            return kb if rc0 + row + self.ld_step(i) < rcs else 0
        edge = 4 * max(0, min(4, rcs - (rc0 + col)))
        return edge if k0 + row + self.ld_step(i) < K else 0


def tiles(cfg):
    """[(operand, kmajor, Tile, W)] for a config: A and B, each K-major and MN-major."""
    BM, BN, WM, WN, NT, _ = config(cfg)
    out = []
    for km in (True, False):
        out.append(("A", km, Tile(km, True, BM, 2 * (WM // 16), NT), WM))
        out.append(("B", km, Tile(km, False, BN, WN // 8, NT), WN))
    return out


TILE_CASES = [(cfg, op, km) for cfg in mm.E4_CONFIGS for op in "AB" for km in (True, False)]


def _tile(cfg, op, km):
    return next(T for o, k, T, _ in tiles(cfg) if (o, k) == (op, km))


def _ids(c):
    return f"{c[0]}-{c[1]}-{'K' if c[2] else 'MN'}"


def conflict_free(addrs):
    """Floats offsets of 8 16-byte accesses (one phase): distinct bank groups, 16-byte aligned."""
    a = np.asarray(addrs)
    return len(a) == 8 and np.all(a % 4 == 0) and len(set(((a // 4) % 8).tolist())) == 8


# ----------------------------------------------------------------------------------------------
# 1. the smem layout


@pytest.mark.parametrize("case", TILE_CASES, ids=_ids)
def test_layout_is_a_bijection_with_whole_chunks(case):
    T = _tile(*case)
    rows, ks = np.meshgrid(np.arange(T.R), np.arange(32), indexing="ij")
    o = T.off(rows, ks)
    assert sorted(o.ravel().tolist()) == list(range(T.R * 32))
    # the 4 floats of a chunk (4 consecutive k for K-major, 4 consecutive rows for MN-major) are contiguous
    chunks = o.reshape(T.R, 8, 4) if T.kmajor else o.T.reshape(32, T.R // 4, 4)
    assert np.array_equal(chunks - chunks[:, :, :1], np.broadcast_to([0, 1, 2, 3], chunks.shape))
    assert np.all(chunks[:, :, 0] % 4 == 0)


# ----------------------------------------------------------------------------------------------
# 2. the loader


@pytest.mark.parametrize("case", TILE_CASES, ids=_ids)
def test_loader_copies_every_chunk_once_to_its_place(case):
    T = _tile(*case)
    tid = np.arange(T.NT)
    seen = set()
    for i in range(T.PER):
        srow = T.ld_row(tid) + T.ld_step(i)      # stored row: tile row (K-major) / k-row (MN-major)
        scol = T.ld_col(tid)                     # first of the 4 floats along the stored row
        dst = T.ld_smem(tid) + T.ld_smem_step(i)  # what the kernel writes to (register + immediate)
        row, k = (srow, scol) if T.kmajor else (scol, srow)
        assert np.array_equal(dst, T.off(row, k)), "destination is not where the layout keeps the chunk"
        assert np.all(scol % 4 == 0)
        seen.update(zip(srow.tolist(), scol.tolist()))
        for p in range(T.NT // 8):  # the shared side of one 8-thread phase
            assert conflict_free(dst[8 * p: 8 * p + 8]), f"cp.async phase {p} of chunk {i} conflicts"
        for w in range(T.NT // 32):  # global side: every 32-byte sector a warp touches, it covers whole
            sectors = {}
            for r, c in zip(srow[32 * w: 32 * w + 32].tolist(), scol[32 * w: 32 * w + 32].tolist()):
                sectors.setdefault((r, c // 8), set()).add(c % 8)
            assert all(v == {0, 4} for v in sectors.values()), f"warp {w} chunk {i}: half sectors"
    stored_rows, stored_cols = (T.R, 32) if T.kmajor else (32, T.R)
    assert seen == {(r, c) for r in range(stored_rows) for c in range(0, stored_cols, 4)}
    assert len(seen) == T.NT * T.PER


@pytest.mark.parametrize("case", TILE_CASES, ids=_ids)
def test_loader_source_chain(case):
    """The kernel walks chunk i's source from chunk i-1's by a row step held in a register: K-major
    X rows (s1) or 7*RPG + X rows (s2), MN-major KSTEP rows; steps are positive (unsigned bytes)."""
    T = _tile(*case)
    deltas = {T.ld_step(i) - T.ld_step(i - 1) for i in range(1, T.PER)}
    assert T.ld_step(0) == 0
    if T.kmajor:
        assert deltas <= {T.X, 7 * T.RPG + T.X}
    else:
        assert deltas <= {T.KSTEP}
    assert min(deltas | {1}) > 0


@pytest.mark.parametrize("case", TILE_CASES, ids=_ids)
def test_loader_byte_counts_on_edges(case):
    """Every chunk copies exactly its elements inside the matrix (the rest of its 16 bytes is
    zero-filled); interior tiles take the whole-chunk path."""
    T = _tile(*case)
    R = T.R
    rc0 = 3 * R
    for rcs in (rc0 + R, rc0 + R + 7, rc0 + 1, rc0 + R - 1, rc0 + R // 2 + 3, rc0 + 5, rc0 + 4):
        for K, k0 in ((256, 64), (97, 64), (96, 64), (65, 64), (66, 64), (70, 64), (95, 64), (1, 0), (33, 0)):
            for tid in range(T.NT):
                for i in range(T.PER):
                    srow, scol = T.ld_row(tid) + T.ld_step(i), T.ld_col(tid)
                    if T.kmajor:   # stored row = tile row, 4 k's along it
                        inside = sum(rc0 + srow < rcs and k0 + scol + e < K for e in range(4))
                    else:          # stored row = k-row, 4 tile rows (matrix columns) along it
                        inside = sum(k0 + srow < K and rc0 + scol + e < rcs for e in range(4))
                    assert T.chunk_bytes(tid, i, rc0, rcs, k0, K) == 4 * inside, (rcs, K, tid, i)


# ----------------------------------------------------------------------------------------------
# 3-5. fragments, epilogue, and a whole k-tile through the model

LANE = np.arange(32)
G, TQ = LANE >> 2, LANE & 3


def required_a(wm, RPGA, mi, j):
    """(row, k) the mma needs in a0..a3 of every lane, for m-tile mi, k-step j: shape (32, 4, 2)."""
    rows = [wm + G * RPGA + 2 * mi + (e & 1) for e in range(4)]   # mma row g + 8*(e & 1)
    ks = [8 * j + TQ + 4 * (e >> 1) for e in range(4)]            # mma k t + 4*(e >> 1)
    return np.stack([np.stack([r, k], -1) for r, k in zip(rows, ks)], 1)


def required_b(wn, NI, ni, j):
    """(col, k) the mma needs in b0, b1 of every lane, for n-tile ni, k-step j: shape (32, 2, 2)."""
    return np.stack([np.stack([wn + G * NI + ni, 8 * j + TQ + 4 * e], -1) for e in range(2)], 1)


def ldmatrix_x4(addr):
    """What each lane receives: addr (32,) row addresses (floats) -> (32, 4) float offsets."""
    return np.stack([addr[8 * q + (LANE >> 2)] + (LANE & 3) for q in range(4)], 1)


class Smem:
    """A stage's tile as float offsets: inverse layout, bounds/alignment and phase checks."""

    def __init__(self, T):
        self.T = T
        rows, ks = np.meshgrid(np.arange(T.R), np.arange(32), indexing="ij")
        self.inv = np.zeros((T.R * 32, 2), int)
        self.inv[T.off(rows, ks).ravel()] = np.stack([rows.ravel(), ks.ravel()], -1)

    def element(self, offs):
        offs = np.asarray(offs)
        assert np.all((offs >= 0) & (offs < self.T.R * 32)), "fragment read outside the stage's tile"
        return self.inv[offs]


def fragment_a(T, S, wm, MI, j):
    """af[mi][e] of every lane as (row, k), through the kernel's loads: (MI, 32, 4, 2)."""
    out = np.zeros((MI, 32, 4, 2), int)
    if T.kmajor:  # ldmatrix.x4 per m-tile
        for mi in range(MI):
            addr = T.frag_base(wm, LANE, j) + T.frag_imm(2 * mi, 0)
            for q in range(4):
                assert conflict_free(addr[8 * q: 8 * q + 8]), f"A ldmatrix m-tile {mi} k-step {j} matrix {q}"
            out[mi] = S.element(ldmatrix_x4(addr))
    else:         # LDS.128: element e of chunk q at k-row 8j+4r+t -> af[2q + e//2][2r + e%2]
        for r in range(2):
            for q in range(T.RPG // 4):
                addr = T.frag_base(wm, LANE, q) + T.frag_imm(j, r)
                for p in range(4):
                    assert conflict_free(addr[8 * p: 8 * p + 8]), f"A LDS.128 k-step {j} r {r} q {q} phase {p}"
                for e in range(4):
                    out[2 * q + e // 2, :, 2 * r + e % 2] = S.element(addr + e)
    return out


def fragment_b(T, S, wn, NI, j):
    """bf[ni][e] of every lane as (col, k): (NI, 32, 2, 2)."""
    out = np.zeros((NI, 32, 2, 2), int)
    if T.kmajor:  # ldmatrix.x4 per pair of n-tiles: d0 d1 -> b0 b1 of ni, d2 d3 -> of ni + 1
        for ni in range(0, NI, 2):
            addr = T.frag_base(wn, LANE, j) + T.frag_imm(ni, 0)
            for q in range(4):
                assert conflict_free(addr[8 * q: 8 * q + 8]), f"B ldmatrix n-tiles {ni} k-step {j} matrix {q}"
            d = S.element(ldmatrix_x4(addr))
            out[ni], out[ni + 1] = d[:, 0:2], d[:, 2:4]
    else:         # LDS.128: element e of chunk q at k-row 8j+4r+t -> bf[4q + e][r]
        for r in range(2):
            for q in range(NI // 4):
                addr = T.frag_base(wn, LANE, q) + T.frag_imm(j, r)
                for p in range(4):
                    assert conflict_free(addr[8 * p: 8 * p + 8]), f"B LDS.128 k-step {j} r {r} q {q} phase {p}"
                for e in range(4):
                    out[4 * q + e, :, r] = S.element(addr + e)
    return out


def stage_off(row, col, RPGA, WN):
    """gemm_store_staged's staging layout (engines 2 and 4)."""
    ch = col >> 2
    hh = ((row // RPGA) & 1) | (((ch >> 3) & 1) << 1)
    return row * WN + (((ch & ~7) | ((ch & 7) ^ hh)) << 2) + (col & 3)


def epilogue(acc, WM, WN, C_warp):
    """gemm_store_staged on the model: acc (MI, NI, 32, 4) -> C_warp (WM, WN), checking the staging."""
    MI, NI, RPGA = WM // 16, WN // 8, 2 * (WM // 16)
    stg = np.full(WM * WN, np.nan)
    written = np.zeros(WM * WN, int)
    for mi in range(MI):
        for h in range(2):
            for c in range(2):
                for q in range(NI // 4):
                    row, col = G * RPGA + 2 * mi + h, (2 * TQ + c) * NI + 4 * q
                    addr = stage_off(row, col, RPGA, WN)
                    assert np.all((addr >= 0) & (addr + 4 <= WM * WN))
                    for p in range(4):
                        assert conflict_free(addr[8 * p: 8 * p + 8]), f"staging write mi {mi} h {h} c {c} q {q}"
                    for e in range(4):
                        assert np.array_equal(stage_off(row, col + e, RPGA, WN), addr + e)
                        stg[addr + e] = acc[mi, 4 * q + e, :, 2 * h + c]
                        written[addr + e] += 1
    assert np.all(written == 1), "staging: every element written exactly once"
    CPR = WN // 4
    RPI = 32 // CPR
    ch, r0 = LANE % CPR, LANE // CPR
    for i in range(WM // RPI):
        rl = r0 + i * RPI
        addr = stage_off(rl, 4 * ch, RPGA, WN)
        for p in range(4):
            assert conflict_free(addr[8 * p: 8 * p + 8]), f"staging read {i} phase {p}"
        for e in range(4):
            C_warp[rl, 4 * ch + e] = stg[addr + e]


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("cfg", mm.E4_CONFIGS)
def test_fragments_and_epilogue(cfg, lay):
    """Every register of every lane of every warp holds what the mma needs (3); the accumulators
    land where the epilogue puts them (4); a whole k-tile through the model is exact (5)."""
    BM, BN, WM, WN, NT, stages = config(cfg)
    TA, TB = lay[0] == "t", lay[1] == "t"
    MI, NI, RPGA, RPGB = WM // 16, WN // 8, 2 * (WM // 16), WN // 8
    WARPS_M = BM // WM
    ta, tb = Tile(not TA, True, BM, RPGA, NT), Tile(TB, False, BN, RPGB, NT)
    sa, sb = Smem(ta), Smem(tb)
    assert BM * BN <= stages * (BM + BN) * 32, "the staging tile must fit in the pipeline smem"

    rng = np.random.default_rng(0)
    A = rng.integers(-8, 9, size=(BM, 32)).astype(np.float64)   # tile rows x k (whatever the layout)
    B = rng.integers(-8, 9, size=(BN, 32)).astype(np.float64)   # tile cols x k
    C = np.full((BM, BN), np.nan)
    rows_a, cols_b = set(), set()
    for warp in range(NT // 32):
        wm, wn = (warp % WARPS_M) * WM, (warp // WARPS_M) * WN
        acc = np.zeros((MI, NI, 32, 4))
        ks = set()
        for j in range(4):
            af, bf = fragment_a(ta, sa, wm, MI, j), fragment_b(tb, sb, wn, NI, j)
            for mi in range(MI):
                assert np.array_equal(af[mi], required_a(wm, RPGA, mi, j)), f"warp {warp} A m-tile {mi} k-step {j}"
                rows_a.update(af[mi][..., 0].ravel().tolist())
                ks.update(af[mi][..., 1].ravel().tolist())
            for ni in range(NI):
                assert np.array_equal(bf[ni], required_b(wn, NI, ni, j)), f"warp {warp} B n-tile {ni} k-step {j}"
                cols_b.update(bf[ni][..., 0].ravel().tolist())
            # the mma itself, from the registers, by the PTX fragment layouts
            for mi in range(MI):
                for ni in range(NI):
                    Am, Bm = np.full((16, 8), np.nan), np.full((8, 8), np.nan)
                    for e in range(4):
                        Am[G + 8 * (e & 1), TQ + 4 * (e >> 1)] = A[af[mi, :, e, 0], af[mi, :, e, 1]]
                    for e in range(2):
                        Bm[TQ + 4 * e, G] = B[bf[ni, :, e, 0], bf[ni, :, e, 1]]
                    Cm = Am @ Bm
                    for e in range(4):
                        acc[mi, ni, :, e] += Cm[G + 8 * (e >> 1), 2 * TQ + (e & 1)]
        assert ks == set(range(32)), "every k of the k-tile is used"
        C_warp = np.full((WM, WN), np.nan)
        epilogue(acc, WM, WN, C_warp)
        C[wm: wm + WM, wn: wn + WN] = C_warp
    assert rows_a == set(range(BM)) and cols_b == set(range(BN)), "the warps cover the CTA tile"
    assert np.array_equal(C, A @ B.T), "a k-tile through loader layout, fragments, mma and epilogue"


# ----------------------------------------------------------------------------------------------
# 6. the C++ formulas are these formulas (E4Tile compiled on the host from cuda/gemm.cu)

DUMP = r"""
#include "gemm.cu"
#include <cstdio>
template <bool KM, bool IS_A, int R, int RPG, int NT>
void dump(const char* name, int W) {
    using T = E4Tile<KM, IS_A, R, RPG, NT>;
    printf("%s consts %d %d %d %d\n", name, T::PER, T::X, T::KSTEP, T::ROWS);
    printf("%s ld_row", name); for (int i = 0; i < NT; i++) printf(" %d", T::ld_row(i)); printf("\n");
    printf("%s ld_col", name); for (int i = 0; i < NT; i++) printf(" %d", T::ld_col(i)); printf("\n");
    printf("%s ld_smem", name); for (int i = 0; i < NT; i++) printf(" %d", T::ld_smem(i)); printf("\n");
    printf("%s ld_step", name); for (int i = 0; i < T::PER; i++) printf(" %d", T::ld_step(i)); printf("\n");
    printf("%s ld_smem_step", name); for (int i = 0; i < T::PER; i++) printf(" %d", T::ld_smem_step(i)); printf("\n");
    printf("%s off", name);
    for (int r = 0; r < R; r++) for (int k = 0; k < 32; k++) printf(" %d", T::off(r, k));
    printf("\n%s frag_base", name);
    for (int w = 0; w < R; w += W) for (int l = 0; l < 32; l++) for (int x = 0; x < 4; x++) printf(" %d", T::frag_base(w, l, x));
    printf("\n%s frag_imm", name);
    for (int a = 0; a < 8; a++) for (int b = 0; b < 2; b++) printf(" %d", T::frag_imm(a, b));
    printf("\n");
}
int main() {
%s
    return 0;
}
"""


def _instances():
    """{name: (kmajor, is_a, R, RPG, NT, W)} for every E4Tile the kernels instantiate."""
    out = {}
    for cfg in mm.E4_CONFIGS:
        BM, BN, WM, WN, NT, _ = config(cfg)
        for op, km, T, W in tiles(cfg):
            out[f"{cfg}-{op}-{'K' if km else 'MN'}"] = (km, op == "A", T.R, T.RPG, NT, W)
    return out


def _python_dump(km, is_a, R, RPG, NT, W):
    T = Tile(km, is_a, R, RPG, NT)
    return {
        "consts": [T.PER, T.X, T.KSTEP, T.R],
        "ld_row": [T.ld_row(i) for i in range(NT)],
        "ld_col": [T.ld_col(i) for i in range(NT)],
        "ld_smem": [T.ld_smem(i) for i in range(NT)],
        "ld_step": [T.ld_step(i) for i in range(T.PER)],
        "ld_smem_step": [T.ld_smem_step(i) for i in range(T.PER)],
        "off": [T.off(r, k) for r in range(R) for k in range(32)],
        "frag_base": [T.frag_base(w, l, x) for w in range(0, R, W) for l in range(32) for x in range(4)],
        "frag_imm": [T.frag_imm(a, b) for a in range(8) for b in range(2)],
    }


def test_cpp_formulas_match_the_model(tmp_path):
    from llmc.runtime import nvcc_path
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not installed")
    inst = _instances()
    calls = "\n".join(f'    dump<{"true" if km else "false"}, {"true" if a else "false"}, {R}, {RPG}, {NT}>("{name}", {W});'
                      for name, (km, a, R, RPG, NT, W) in inst.items())
    prog = tmp_path / "e4_dump.cu"
    prog.write_text(DUMP.replace("%s\n    return 0;", calls + "\n    return 0;"))
    exe = tmp_path / "e4_dump"
    # PTX only and an unoptimised device pass: we only run host code (about 2 s instead of 10)
    cmd = [nvcc, "-std=c++17", f"-I{ROOT / 'cuda'}", "-gencode", "arch=compute_80,code=compute_80",
           "-Xcicc", "-O0", "-diag-suppress", "128", "-o", str(exe), str(prog)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    got = {}
    for line in out.splitlines():
        name, func, *vals = line.split()
        got[(name, func)] = list(map(int, vals))
    for name, args in inst.items():
        for func, want in _python_dump(*args).items():
            assert got.get((name, func)) == want, f"E4Tile {name} {func}: C++ and the model differ"
