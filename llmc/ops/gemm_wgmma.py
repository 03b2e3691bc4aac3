"""GEMM engine 5: wgmma + TMA on Hopper (cuda/gemm_wgmma.cu), TF32 and BF16 inputs, fp32 or bf16 out.

    from llmc.ops.gemm_wgmma import wgmma_build
    g = wgmma_build(rt, "tf32", M=4096, N=2304, K=768, has_bias=True)   # A (M,K), B (N,K): K-major
    g(C, A, B, bias)                          # C(M,N) = A @ B^T + bias
    g = wgmma_build(rt, "bf16", M, N, K, out="bf16", a_major="m", b_major="n", beta=1.0)
    g(C, At, Bt)                              # C(M,N) += At(K,M)^T @ Bt(K,N), bf16 in and out (dweight)
    python dev/cuda/matmul_forward.py 9       # lab: against cuBLAS TF32/BF16 through torch
    python -m pytest -m gpu tests/test_gemm_wgmma.py

By default both operands are K-major (each row holds K contiguous elements): the only layout wgmma
takes for tf32 from shared memory. bf16 operands may also be given transposed (a_major="m": A^T stored
(K, lda); b_major="n": B^T stored (K, ldb)), read by the wgmma through its transpose bits; tf32's
M-major A goes through registers instead (a_major="m", the _am instances). The launcher describes each operand to the TMA with a tensor map (the
driver's cuTensorMapEncodeTiled, called through ctypes: PyCUDA does not wrap it), built once per
operand pointer pair and copied to device memory; the kernel gets pointers to the maps. (The usual
way, a 64-byte-aligned __grid_constant__ kernel parameter, arrived misplaced through PyCUDA's packed
argument buffer on the H100.) The maps hold the operand pointers, so the launch closure keeps one
pair per (A, B) pointer pair; the model's buffers never move, so a captured CUDA graph stays valid.

The planner picks the tile width BN (128, 192 or 256, and 160 for bf16 dweights: N160_ENV; the tile is
128 x BN) and a K split by a wave-quantised cost model: GPT-2's N = 768 is exactly 4 tiles of 192,
which fills 128 of the H100's 132 SMs at M = 4096. Split-K partial sums go to a workspace and a second
pass adds them in order (deterministic).
"""
from __future__ import annotations

import ctypes

import numpy as np

from llmc import switches
from llmc.errors import LLMCError

MODULE = "gemm_wgmma"
BM = 128
BN_CHOICES = (128, 192, 256)     # every layout's widths; the dweight layout ("mn") also 160 (N160_ENV)
# relative steady-state rate of each tile width, measured on the H100 with long K (2026-11-23, TF32,
# direct stores: 50304 x 768 x 4096 ran at 318 / 373 / 313 TFLOP/s, 3072 x 768 x 4096 at 178 / 236 /
# 171): 192 wide with 5 stages beats 256 with 4
# (160, bf16 dweights only: fc's at B=16 on the H200 ran 5.4 TFLOP/s an SM against 192's 5.8, session 27)
# (64, the bf16 dweight layout's TMA-store instance only: attproj's dweight at B=4 on the H200, 72 CTAs,
# ran 3.7 TFLOP/s an SM against 128's 5.5 (session 29): two m64n64k16 wgmmas read as many shared-memory
# bytes a clock as the SM delivers)
BN_EFF = {128: 0.85, 192: 1.0, 256: 0.84, 160: 0.95, 64: 0.6}
# the same for the TMA-store instances, per output type. bf16 out (6 / 4 stages) as above. fp32 out:
# the staging buffers leave 192 wide 3 stages against 128's 5, and 128 wins where the waves allow
# (H100, session 13, interleaved medians, TF32 K = 768: lm head forward B=4 1.053 ms at 128 against
# 1.198 at 192, B=16 4.417 against 4.683; fc forward B=16 0.275 against 0.284), while 192 keeps the
# shapes whose 128-wide tiles would take an extra wave (attproj forward B=4: 0.0315 against 0.0346)
# bf16 256 wide (3 stages, built for the forward layout only): interleaved against 192 at K = 768, lm head
# B=16 2.170 against 2.262 ms, B=4 0.544 against 0.561; qkv B=16 0.1021 against 0.1039; but 0.1296
# against 0.1199 at fcproj's K = 3072, where 3 stages are too few (timed alone, at full clock). Under a
# sustained load, the board at its power cap (session 41, H200, dev/bench_energy.py: ~1 s of calls each,
# in turn with cuBLAS), 256 is the fastest bf16 forward at every d12 shape, fcproj's K = 3072 included
# (B=16, over cuBLAS: 1.017x against 192's 1.045x), and whole bf16 steps at B=16 agree (below, PP128_ENV),
# so the limit is gone: TS256_MAX_K None (LLMC_WGMMA_TS256_MAX_K puts one back, the A/B)
TS_BN_EFF = {"fp32": {128: 1.0, 192: 0.88}, "bf16": {**BN_EFF, 256: 1.04}}
TS256_MAX_K = None
TILE_OVERHEAD_KB = 2            # epilogue + pipeline fill of a work unit, in k-blocks
SM_TF32_FLOPS = 3.0e12          # per-SM rate assumed by the planner (~80% of 494 TFLOP/s / 132); bf16 twice
DRAM_BPS = 2.5e12

DTYPES = {  # name -> (numpy dtype of the operands, element bytes, CUtensorMapDataType)
    # CU_TENSOR_MAP_DATA_TYPE_TFLOAT32: the TMA rounds fp32 to tf32 as it copies (measured on the H100:
    # 2.9e-4 relative error at the d12 shapes, the same as engines 2-4's cvt.rna)
    "tf32": (np.float32, 4, 11),
    # CU_TENSOR_MAP_DATA_TYPE_FLOAT32: bits copied, the tensor cores truncate (7.7e-4): a lab experiment
    "tf32t": (np.float32, 4, 7),
    "bf16": (np.uint16, 2, 9),      # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 (bf16 bits held as uint16 on the host)
}
# Past TS_MAX_K[out] the planner ("auto") stores from registers instead of through the TMA store: the
# TMA-store instances have fewer stages (their staging buffer takes shared memory). fp32 out (3-5
# stages): H100, lm head dinp, K = 50304, 0.98 ms direct vs 1.32 with the TMA store; 1024 until session
# 37, when 4096 measured faster in the H200's fp32 step at B=4 (16.12 against 16.27 ms, 3 rounds in turn:
# B=4's qkv and fc dinps and fcproj forward, K = 2304 / 3072, move to the 192-wide TMA-store tile; the B=16
# plans are the same either way: ping-pong with the TMA store already) and level at B=16. bf16 out (the
# staging buffer is half, 4-6 stages): the TMA store won or tied at every d12 K (768-50304) in
# session 13 (docs/matmul_notes.md, "The TMA store at long K"), so there is no limit.
# LLMC_WGMMA_TS_MAX_K overrides both (the A/B of that measurement).
TS_MAX_K = {"fp32": 4096, "bf16": 1 << 30}


def ts256_max_k() -> int | None:
    """The largest K whose plans may take the 256-wide TMA-store tile (LLMC_WGMMA_TS256_MAX_K, else
    TS256_MAX_K; None: any K)."""
    k = switches.value("LLMC_WGMMA_TS256_MAX_K")
    return TS256_MAX_K if k is None else k


def _k256_ok(K: int) -> bool:
    m = ts256_max_k()
    return m is None or K <= m


def ts_max_k(out: str) -> int:
    k = switches.value("LLMC_WGMMA_TS_MAX_K")
    return TS_MAX_K[out] if k is None else k


SWIZZLE_128B = 3
SWIZZLE_64B = 2
L2_PROMOTION_256B = 3


# ----------------------------------------------------------------------------------------------
# tensor maps (the TMA's description of a 2D operand)

_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        try:
            _libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise LLMCError(f"gemm engine 5: cannot load the CUDA driver library for cuTensorMapEncodeTiled ({e})") from None
        f = _libcuda.cuTensorMapEncodeTiled
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                      ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                      ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return _libcuda


def tensor_map(ptr: int, dtype: str, rows: int, cols: int, ld: int, box_rows: int, box_bytes: int = 128) -> bytes:
    """The 128-byte CUtensorMap of a row-major (rows, cols) matrix with leading dimension `ld`
    (elements), read in boxes of (box_rows, box_bytes of cols) swizzled by box_bytes (128, or 64: the
    staged C of the 160-wide bf16 tile), zero-filled out of range."""
    _, esize, code = DTYPES[dtype]
    if box_bytes not in (64, 128):
        raise LLMCError(f"gemm engine 5: box rows of {box_bytes} bytes; expected 64 or 128")
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63          # CUtensorMap is 64-byte aligned
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(ld * esize)
    box = (ctypes.c_uint32 * 2)(box_bytes // esize, box_rows)
    estr = (ctypes.c_uint32 * 2)(1, 1)
    err = _driver().cuTensorMapEncodeTiled(addr, code, 2, ctypes.c_void_p(ptr), dims, strides, box, estr,
                                           0, SWIZZLE_128B if box_bytes == 128 else SWIZZLE_64B, L2_PROMOTION_256B, 0)
    if err != 0:
        raise LLMCError(f"gemm engine 5: cuTensorMapEncodeTiled failed (CUresult {err}) for a {rows}x{cols} "
                        f"{dtype} matrix, ld={ld}, at 0x{ptr:x}")
    return ctypes.string_at(addr, 128)


def box_bytes(width_bytes: int) -> int:
    """Bytes of a box row for a tile `width_bytes` wide (cuda/gemm_wgmma.cu's box_bytes): 128 where the
    width is a multiple of 128 bytes, else 64 (the staged C of bf16's 160-wide tile: 5 boxes of 32 columns;
    its B^T comes in as three 128-byte boxes of 64 columns, the wgmma reading the first 160)."""
    return 128 if width_bytes % 128 == 0 else 64


# ----------------------------------------------------------------------------------------------
# planning and checks

def check(dtype: str, M: int, N: int, K: int, lda: int, ldb: int) -> str | None:
    """Why engine 5 cannot take this GEMM (before pointers are known), or None."""
    if dtype not in DTYPES:
        return f"no dtype {dtype!r}; have {', '.join(DTYPES)}"
    esize = DTYPES[dtype][1]
    if (lda * esize) % 16 or (ldb * esize) % 16:
        return f"the TMA needs row strides that are multiples of 16 bytes (lda={lda}, ldb={ldb}, {esize}-byte elements)"
    if min(M, N, K) < 1:
        return f"empty problem M={M} N={N} K={K}"
    return None


def _estimate(sm_count: int, M: int, N: int, K: int, dtype: str, allow_split: bool, shapes, pingpong: bool,
              eff=None):
    """(seconds, rows, BN, splits) of the best tile shape (rows, BN) in `shapes` and K split, by a
    wave-quantised estimate. Cooperative: both consumer warpgroups on one 128-row tile, so every tile
    pays the pipeline fill and the epilogue (TILE_OVERHEAD_KB) and the tiles go in waves of sm_count.
    Ping-pong: each SM runs its tiles back to back on the tensor cores (one consumer's epilogue hides
    behind the other's mainloop), so the fill and the last epilogue are paid once per SM and each tile
    only a switch of consumers (PP_SWITCH_KB). eff: the cooperative tile widths' rates (BN_EFF by default)."""
    bk = 128 // DTYPES[dtype][1]
    kblocks = -(-K // bk)
    rate = SM_TF32_FLOPS * (4 / DTYPES[dtype][1])
    best = None
    for rm, bn in shapes:
        tiles = -(-M // rm) * -(-N // bn)
        for s in (1, 2, 3, 4, 6, 8) if allow_split else (1,):
            if s > 1 and (kblocks // s < 4 or tiles * s > (4 if pingpong else 2) * sm_count):
                continue
            per = -(-kblocks // s)
            s = -(-kblocks // per)          # no empty splits
            # seconds: (k-blocks an SM runs) x (flops of a k-block) / (the SM's rate)
            if pingpong:
                per_sm = -(-(tiles * s) // sm_count)
                t = (per_sm * (per + PP_SWITCH_KB) + TILE_OVERHEAD_KB) * 2 * rm * bn * bk / (rate * PP_EFF[(rm, bn)])
            else:
                waves = -(-(tiles * s) // sm_count)
                t = waves * (per + TILE_OVERHEAD_KB) * 2 * rm * bn * bk / (rate * (eff or BN_EFF)[bn])
            if s > 1:  # the fp32 partials written and read back, C read and written by the reduce (in fp32
                # terms; until session 27 (s + 2) x, which put attproj's bf16 dweight at B=16 on 4 splits of
                # 128 x 192: 0.0435 ms against 0.041 for 3 of 128 x 128, H200, both sessions 26 and 27)
                t += (2 * s + 1) * M * N * 4 / DRAM_BPS
            if best is None or t < best[0]:
                best = (t, rm, bn, s)
    return best


def plan(sm_count: int, M: int, N: int, K: int, dtype: str = "tf32", allow_split: bool = True,
         widths=BN_CHOICES, eff=None):
    """(BN, splits) of the cooperative instances (128 x BN tiles) minimising a wave-quantised time estimate
    (eff: the tile widths' relative rates, BN_EFF unless given: TS_BN_EFF for the TMA-store instances)."""
    _, _, bn, s = _estimate(sm_count, M, N, K, dtype, allow_split, [(BM, bn) for bn in widths], False, eff)
    return bn, s


def plan_pingpong(sm_count: int, M: int, N: int, K: int, dtype: str = "tf32", allow_split: bool = True,
                  shapes=None):
    """(rows, BN, splits) of the ping-pong instances (a consumer's tile: rows x BN)."""
    _, rm, bn, s = _estimate(sm_count, M, N, K, dtype, allow_split, shapes or PP_SHAPES, True)
    return rm, bn, s


TS_WIDTHS = (128, 192)          # tile widths built with the TMA-store epilogue (_ts) in every layout; bf16 -> bf16
                                # forward (kk) also 256 wide, with 3 stages (INSTANCES)

# The kernel instances of cuda/gemm_wgmma.cu: (input type, output type, layout, TMA store) -> {tile
# width: stages}. Layout: "kk" both K-major, "mk" A M-major through registers (tf32), "kn" B N-major
# (bf16, dinp), "mn" A M-major and B N-major (bf16, dweight). The stages fix the shared memory a
# launch asks for; tests/test_gemm_wgmma.py checks this table against the .cu's entry points.
_DIRECT = {128: 6, 192: 5, 256: 4}
# (the dweight layout's 160-wide tile: 5 stages direct, 4 with the TMA store: its B^T comes in as three
# 64-column boxes, 192 columns of shared memory a stage as the 192-wide tile's; its staged C in 32-column
# boxes with the 64-byte swizzle)
INSTANCES = {
    ("tf32", "fp32", "kk", False): _DIRECT, ("tf32", "fp32", "kk", True): {128: 5, 192: 3},
    ("tf32", "fp32", "mk", False): _DIRECT,
    ("bf16", "fp32", "kk", False): _DIRECT, ("bf16", "fp32", "kk", True): {128: 5, 192: 3},
    ("bf16", "bf16", "kk", False): _DIRECT, ("bf16", "bf16", "kk", True): {128: 6, 192: 4, 256: 3},
    ("bf16", "bf16", "kn", False): _DIRECT, ("bf16", "bf16", "kn", True): {128: 6, 192: 4, 256: 3},
    ("bf16", "bf16", "mn", False): {**_DIRECT, 160: 5}, ("bf16", "bf16", "mn", True): {64: 8, 128: 6, 160: 4, 192: 4, 256: 3},
}
# The 160-wide tile of the bf16 dweight layout: GPT-2's 768 columns are 5 tiles of 160, so fc's and
# fcproj's dweights are 120 tiles, filling 120 of an H100's 132 SMs where 4 tiles of 192 fill 96 (H200,
# session 27, 20 back to back, ms, cuBLAS BF16 / 128 x 160 / 128 x 192, TMA store, beta 1: fc B=16
# 0.1195 / 0.1192 / 0.1401, fcproj B=16 0.1254 / 0.1161 / 0.1367; at K = 4096 mixed: fcproj B=4 0.0299 /
# 0.0320 / 0.0362, fc B=4 0.0292 / 0.0391 / 0.0353). Session 29 moved its B^T from five 32-column SW64
# boxes to three 64-column SW128 ones (the wgmma reads SW64 slower): fc B=4 0.0341 against 0.0402 ms
# (192: 0.0362, cuBLAS 0.0308), fcproj B=4 0.0327 (192: 0.0371, cuBLAS 0.0313), fc B=16 0.1199 against
# 0.1343, qkv B=16 0.1069 against 0.1301 (H200, in turn, 20 back to back); hence N160_MIN_K 4096 (was
# 8192, where fc at K = 4096 lost to 192). The planner takes it for a GEMM alone with one K
# split, the TMA store and K >= N160_MIN_K; never split over K (attproj B=16: 0.054-0.061 ms in 2-4
# splits against 0.041-0.044 on 128 or 192); and never beside other work (wgmma_build's beside=True, the
# trainer's weight gradients on the side stream): 120 CTAs leave the main stream 12 SMs where 96 left
# it 36, and a 160 tile does less per SM-second (whole bf16 steps with it: B=16 29.38 against 29.01 ms,
# B=4 8.58 against 8.46). LLMC_WGMMA_N160=0 leaves it out everywhere; =1 lets the planner take it in any
# one-split TMA-store plan (any K, beside other work too: the A/B of both rules).
N160_ENV = "LLMC_WGMMA_N160"
# dinp's 256-wide TMA-store tile (B N-major, 3 stages: the forward layout's 256 twin, session 41). Under a
# sustained load (H200, B=16, over cuBLAS, time / energy): fcproj's dinp 1.055x / 1.094x against 192's
# 1.115x / 1.130x, attproj's 1.073x / 1.012x against 1.094x / 1.033x; in whole steps see PP128_ENV.
# Planned by default; LLMC_WGMMA_BT256=0 leaves it out of dinp's plans (the A/B)
BT256_ENV = "LLMC_WGMMA_BT256"
# The dweights' 256-wide TMA-store tile (A and B transposed, 3 stages, session 42). The planner takes it for
# the lm head's dweight (393 x 3 tiles; qkv's, fc's and fcproj's have too few tiles of 256 and keep 128 /
# 160). Under a sustained load (H200, B=16, over cuBLAS, time / energy): the lm head's 1.014x / 1.064x
# against 192's 1.028x / 1.082x; whole bf16 steps at B=16, 3 calls of interleaved rounds: -0.7%, -0.9%,
# -0.4%; B=4 level. Planned by default; LLMC_WGMMA_MN256=0 leaves it out of the dweights' plans (the A/B)
MN256_ENV = "LLMC_WGMMA_MN256"
N160_MIN_K = 4096
# The 64-wide TMA-store tile of the bf16 dweight layout: for a dweight of few tiles (attproj's 768 x 768:
# 36 tiles of 128 x 128) twice the CTAs. H200, session 29, bf16, beta 1, in turn, 20 back to back:
# attproj B=4 0.0181-0.0203 ms against 0.0245 at 128 wide and 0.0237 in 3 K splits (cuBLAS 0.0150); at
# B=16 0.0576 against the 3 splits' 0.0409, so only up to N64_MAX_K (the split plans stay beyond it).
# In whole bf16 steps at B=4 (on the side stream) no difference: 8.43 against 8.42 ms without it.
N64_MAX_K = 4096

# TMA-store instances in clusters of two CTAs (GEMM_WGMMA_MC_ENTRY, "_mc"): the two tiles of a pair,
# stacked along M, share their B tile, each CTA loading half of it by TMA multicast into both, so each
# asks the L2 for 128 + BN / 2 rows of operands a k-block instead of 128 + BN. The grid is a whole number
# of pairs. The dweight layout's widths (session 29), and the forward's and dinp's 256-wide tile (session
# 42, as cuBLAS's bf16 kernels at d12's shapes run 2-CTA clusters: under the power cap no less energy a
# GEMM, whole B=16 steps 0.8% slower; docs/matmul_notes.md). Opt-in (MC_ENV). (input, output, layout) ->
# {tile width: stages}, the plain _ts instances'.
MC_INSTANCES = {("bf16", "bf16", "mn"): {128: 6, 160: 4, 192: 4}, ("bf16", "bf16", "kk"): {256: 3},
                ("bf16", "bf16", "kn"): {256: 3}}
MC_ENV = "LLMC_WGMMA_MC"        # the default of wgmma_build's multicast: 0 off, 1 on where built

# The 256-wide TMA-store tile with 4 stages (GEMM_WGMMA_S4_ENTRY, "_s4"): the tile goes out in two column
# slices of 128 through a staging buffer of half the size, which frees a fourth stage (the plain 256
# instances have 3). bf16 forward (kk) and dinp (kn), plain outputs: one K split, beta = 0 (with beta the
# kernel falls back to direct stores), C not transposed, no GELU / dgelu / clusters. Taken in place of the
# plain 256 instance with LLMC_WGMMA_TS256_S4=1 (session 43: bf16 B=16 steps +0.5%, B=4 level; opt-in).
# (input, output, layout) -> {tile width: stages}
S4_INSTANCES = {("bf16", "bf16", "kk"): {256: 4}, ("bf16", "bf16", "kn"): {256: 4}}
S4_PARTS = 2
S4_ENV = "LLMC_WGMMA_TS256_S4"


def multicast_default() -> bool:
    return switches.on(MC_ENV)


def layout_widths(ty: str, out: str, layout: str, ts: bool, K: int = 0, beside: bool = False) -> tuple:
    """The tile widths the planner may take for a layout (INSTANCES): the built ones, 160 only as
    above (N160_ENV, N160_MIN_K), 64 only up to N64_MAX_K, dinp's 256-wide TMA-store tile only with
    BT256_ENV and the dweights' only with MN256_ENV (both on by default)."""
    asked = switches.flag(N160_ENV)
    n160 = ts and (asked or (asked is None and not beside and K >= N160_MIN_K))
    bt256 = ((not (ts and layout == "kn") or switches.on(BT256_ENV))
             and (not (ts and layout == "mn") or switches.on(MN256_ENV)))
    return tuple(w for w in sorted(INSTANCES.get((ty, out, layout, ts), {}))
                 if (w != 160 or n160) and (w != 64 or K <= N64_MAX_K) and (w != 256 or bt256))


LAYOUT_SUFFIX = {"kk": "", "mk": "_am", "kn": "_bt", "mn": "_at_bt"}

# The fused GELU instances (GEMM_WGMMA_GELU_ENTRY; the fc layer's matmul_forward with gelu_pre=True):
# both K-major, (input, output, TMA store) -> {tile width: stages}, the plain instances' stages (G is
# staged in C's buffer after C). C = the pre-activation, G = gelu(C as stored). Split-K runs the plain
# instance, then gemm_wgmma_splitk_reduce_gelu[_bf16].
GELU_INSTANCES = {
    ("tf32", "fp32", False): _DIRECT, ("tf32", "fp32", True): {128: 5, 192: 3},
    ("bf16", "bf16", False): _DIRECT, ("bf16", "bf16", True): {128: 6, 192: 4, 256: 3},
}

# The fused dgelu instances (GEMM_WGMMA_DGELU_ENTRY; the fcproj layer's matmul_backward with dgelu=True):
# dinp's GEMM with gelu_backward in the epilogue, C = gelu'(P) * (A @ B^T as stored), and optionally the
# column sums of C. TMA store only (P's tile is loaded into the staging buffer), one K split; dinp's
# layouts: tf32 K-major (after weight^T), bf16 B N-major. (input, output, layout) -> {tile width: stages},
# the plain TMA-store instances' stages (and their shared memory: smem_bytes with ts).
DGELU_INSTANCES = {("tf32", "fp32", "kk"): {128: 5, 192: 3}, ("bf16", "bf16", "kn"): {128: 6, 192: 4}}

# The ping-pong instances (cuda/gemm_wgmma.cu, GEMM_WGMMA_PP_ENTRY): each consumer warpgroup owns a
# whole (rows x BN) tile and the two take turns on the tensor cores, one's epilogue running during the
# other's mainloop. (input, output, layout) -> {(rows, BN): stages}: direct stores (PP_INSTANCES), and
# bf16 -> bf16 with the TMA store (PP_TS_INSTANCES: each consumer stages 64 rows at a time in a buffer
# of its own, so fewer stages fit; plain outputs: one K split, beta = 0, C not transposed).
# Not the default: schedule="pingpong" / "auto" or LLMC_WGMMA_SCHEDULE picks them (see wgmma_build).
PP_SHAPES = ((64, 192), (64, 256), (128, 128))
_PP = {(64, 192): 7, (64, 256): 5, (128, 128): 7}
PP_INSTANCES = {("tf32", "fp32", "kk"): _PP, ("bf16", "fp32", "kk"): _PP, ("bf16", "bf16", "kk"): _PP,
                ("bf16", "bf16", "kn"): _PP}
_PP_TS = {(64, 192): 5, (64, 256): 4, (128, 128): 6}
# tf32 -> fp32: 128 x 128 only, 5 stages (fp32 staging buffers of 32 KB each: the cooperative 128-wide
# TMA-store instance's stages and staging, on the ping-pong schedule; see TF32_PP128_ENV)
PP_TS_INSTANCES = {("bf16", "bf16", "kk"): _PP_TS, ("bf16", "bf16", "kn"): _PP_TS,
                   ("tf32", "fp32", "kk"): {(128, 128): 5}}
# relative rate of each ping-pong tile shape: NOT measured yet (assumed: one m64nBN wgmma per k-step
# reads the same shared memory per flop as the cooperative tiles of that width; 128 x 128 as width 128)
PP_EFF = {(64, 192): 1.0, (64, 256): 0.95, (128, 128): 0.85}
PP_SWITCH_KB = 0.5              # handing the tensor cores to the other consumer, in k-blocks (assumed)
SCHEDULES = ("coop", "pingpong", "auto")
SCHEDULE_ENV = "LLMC_WGMMA_SCHEDULE"   # the default of wgmma_build's schedule (unset: coop)
_noted: set = set()
OUT_BYTES = {"fp32": 4, "bf16": 2}


def instance_name(ty: str, out: str, layout: str, ts: bool, bn: int, gelu: bool = False, dgelu: bool = False,
                  mc: bool = False, s4: bool = False) -> str:
    """The entry point of one instance: gemm_wgmma_<in>_n<BN><layout>[_ts][_mc|_s4][_gelu|_dgelu][_bf16 for
    bf16 output]."""
    return (f"gemm_wgmma_{ty}_n{bn}{LAYOUT_SUFFIX[layout]}{'_ts' if ts else ''}{'_mc' if mc else ''}"
            f"{'_s4' if s4 else ''}"
            f"{'_gelu' if gelu else ''}{'_dgelu' if dgelu else ''}{'_bf16' if out == 'bf16' else ''}")


def pp_instance_name(ty: str, out: str, layout: str, rm: int, bn: int, ts: bool = False) -> str:
    """A ping-pong entry point: gemm_wgmma_<in>_n<BN><layout>[_ts]_pp<rows>[_bf16 for bf16 output]."""
    return f"gemm_wgmma_{ty}_n{bn}{LAYOUT_SUFFIX[layout]}{'_ts' if ts else ''}_pp{rm}{'_bf16' if out == 'bf16' else ''}"


def pp_smem_bytes(rm: int, bn: int, stages: int, ts: bool = False, out: str = "fp32") -> int:
    """Dynamic shared memory of a ping-pong instance: the stages, the two consumers' staging buffers
    (64 x BN outputs each) with the TMA store, the stages' mbarriers, 1 KB for alignment."""
    return stages * (rm + bn) * 128 + (2 * 64 * bn * OUT_BYTES[out] if ts else 0) + 2 * 8 * stages + 1024


def smem_bytes(bn: int, stages: int, ts: bool, out: str = "fp32", parts: int = 1) -> int:
    """Dynamic shared memory of an instance: the stages, the two TMA-store staging buffers (of 64 x bn /
    parts outputs: the _s4 instances store in slices) and the two mbarriers of the tiles loaded into them
    (P for dgelu, C's old tile for beta), the stages' mbarriers, 1 KB for the 1024-byte alignment. (A stage
    holds B in whole 64-wide boxes: 192 columns for 160.)"""
    return (stages * (BM + -(-bn // 64) * 64) * 128 + (2 * 64 * bn * OUT_BYTES[out] // parts + 16 if ts else 0)
            + 2 * 8 * stages + 1024)


def wgmma_build(rt, dtype: str, M: int, N: int, K: int, lda: int | None = None, ldb: int | None = None,
                ldc: int | None = None, alpha: float = 1.0, beta: float = 0.0, has_bias: bool = False,
                trans_c: bool = False, bn: int | None = None, splits: int | None = None, store: str = "auto",
                a_major: str = "k", b_major: str = "k", out: str = "fp32", schedule: str | None = None,
                rm: int | None = None, gelu: bool = False, dgelu: bool = False, colsum: bool = False,
                plan_only: bool = False, beside: bool = False, multicast: bool | None = None):
    """C = alpha * A(M,K) @ B(N,K)^T (+ bias(N)) (+ beta*C); with trans_c, C^T is what is stored
    (C is (N, ldc)). Returns launch(C, A, B, bias=None) taking DevArrays or raw pointers.
    a_major="m": the A argument holds A^T, i.e. (K, lda >= M) row-major, as dout holds dout^T for the
    dweight GEMM: tf32 through registers (TF32 wgmma reads only K-major shared memory), bf16 through
    the wgmma's transpose bit (with b_major="n" only: the dweight layout).
    b_major="n" (bf16): the B argument holds B^T, (K, ldb >= N) row-major, as weight (OC,C) is for dinp.
    out="bf16" (bf16 inputs): C and bias are bf16; the epilogue adds bias and beta*C in fp32 and
    rounds once (split-K partials stay fp32 until the reduce).
    store: "tma" stages each tile in shared memory and writes it with the TMA, overlapping the next
    tile's products (plain outputs only: no beta, no split-K, not transposed); "direct" stores from
    registers; "auto" takes "tma" where it can and K <= ts_max_k(out) (short K: the epilogue is a large part
    of a tile's time; long K wants the deeper pipeline of the direct-store instances).
    schedule: "coop" (both consumer warpgroups on one 128 x BN tile: the instances above), "pingpong"
    (each consumer its own rm x BN tile, taking turns on the tensor cores: the _pp instances, built for
    the kk and kn layouts; direct stores), or "auto" (whichever the planner's estimate prefers). None
    reads LLMC_WGMMA_SCHEDULE, unset meaning "coop"; there a layout without ping-pong instances says so
    once and stays cooperative. Unset, two plans still run as 128 x 128 ping-pong with the TMA store:
    bf16 -> bf16 plans of the 256-wide TMA-store tile (PP128_ENV) and tf32 -> fp32 plans of the 128-wide
    one or with at least TF32_PP128_WAVES waves of tiles (TF32_PP128_ENV). rm: the ping-pong tile's rows
    (64 or 128), else planned.
    gelu=True (the fc layer's fused form; both K-major, tf32 -> fp32 or bf16 -> bf16, beta = 0, not
    transposed; cooperative only): launch(C, A, B, bias, G) also writes G (M, ldc) = gelu(C), computed
    from C as stored by the function gelu_forward uses for that element type (cuda/elem.cuh:
    gelu_fwd_as), so C and G are the bits of this GEMM then gelu_forward.
    dgelu=True (the fcproj layer's fused backward: dinp's layouts, tf32 K-major or bf16 with b_major="n",
    the TMA store, one K split, beta = 0, no bias): launch(C, A, B, P, colsum=None) writes
    C = gelu'(P) * (A @ B^T as stored), P (M, ldc) the pre-activation, by gelu_backward's function for
    the element type (gelu_bwd_as): the bits of this GEMM then gelu_backward. colsum=True (build) lets
    the launch also add C's column sums (as stored) into colsum (N) when it is given: 16-row partials
    from the epilogue, then gemm_wgmma_colsum_finish adds them in a fixed order.
    beside=True: the GEMM runs beside other work (the trainer's weight gradients on the side stream), so
    the planner leaves out tiles that buy its own time with SM time (the 160-wide tile: N160_ENV).
    multicast: run a cooperative TMA-store plan on the instances in clusters of two CTAs that share B tiles
    (MC_INSTANCES: the bf16 dweight layout's widths, the forward's and dinp's 256); None reads LLMC_WGMMA_MC
    (unset: off). True where they are not built, or with split-K or direct stores asked for, is refused; a
    plan the planner makes without the TMA store stays as it is."""
    if a_major not in ("k", "m") or b_major not in ("k", "n") or out not in OUT_BYTES:
        raise LLMCError(f"gemm engine 5: a_major={a_major!r} b_major={b_major!r} out={out!r}; expected k/m, k/n, fp32/bf16")
    ty = "bf16" if dtype == "bf16" else "tf32"
    layout = a_major + b_major  # "kk", "mk", "kn" or "mn": built for the combinations in INSTANCES
    if (ty, out, layout, False) not in INSTANCES:
        built = ", ".join(f"{t} in / {o} out / {lay}" for t, o, lay, ts in INSTANCES if not ts)
        raise LLMCError(f"gemm engine 5: no {ty} kernels with {out} output and layout a_major={a_major!r} "
                        f"b_major={b_major!r} (built: {built})")
    if gelu:
        if (ty, out, False) not in GELU_INSTANCES or layout != "kk" or beta != 0.0 or trans_c:
            raise LLMCError(f"gemm engine 5: the fused GELU is built for K-major A and B, tf32 -> fp32 or bf16 -> "
                            f"bf16, beta = 0, C not transposed (asked: {ty} -> {out}, a_major={a_major!r}, "
                            f"b_major={b_major!r}, beta={beta}, trans_c={trans_c})")
        if schedule == "pingpong" or rm is not None:
            raise LLMCError("gemm engine 5: schedule='pingpong' refused: the fused GELU has cooperative instances only")
    if colsum and not dgelu:
        raise LLMCError("gemm engine 5: colsum=True comes with dgelu=True (the column sums of the dgelu epilogue)")
    if dgelu:
        if (ty, out, layout) not in DGELU_INSTANCES or gelu or beta != 0.0 or trans_c or has_bias:
            raise LLMCError(f"gemm engine 5: the fused dgelu is built for dinp's layouts (tf32 -> fp32 K-major, bf16 -> "
                            f"bf16 with b_major='n'), beta = 0, no bias, C not transposed (asked: {ty} -> {out}, "
                            f"a_major={a_major!r}, b_major={b_major!r}, beta={beta}, bias={has_bias}, "
                            f"trans_c={trans_c})")
        if schedule == "pingpong" or rm is not None or store == "direct" or (splits or 1) > 1:
            raise LLMCError("gemm engine 5: the fused dgelu runs on the cooperative TMA-store instances with one K split")
    lda = (M if a_major == "m" else K) if lda is None else lda
    ldb = (N if b_major == "n" else K) if ldb is None else ldb
    ldc = (M if trans_c else N) if ldc is None else ldc
    why = check(dtype, M, N, K, lda, ldb)
    if why:
        raise LLMCError(f"gemm engine 5 refuses M={M} N={N} K={K}: {why}")
    obytes = OUT_BYTES[out]
    splits_asked = splits
    has_ts = (ty, out, layout, True) in INSTANCES
    # built (what bn= may ask for) and planned (what the planner may take: layout_widths) tile widths
    ts_built = tuple(GELU_INSTANCES[(ty, out, True)] if gelu else INSTANCES[(ty, out, layout, True)]) if has_ts else ()
    direct_built = tuple(GELU_INSTANCES[(ty, out, False)] if gelu else INSTANCES[(ty, out, layout, False)])
    ts_widths = (tuple(GELU_INSTANCES[(ty, out, True)]) if gelu else layout_widths(ty, out, layout, True, K, beside)) if has_ts else ()
    if dgelu:  # (the dgelu epilogue is built for fewer widths than its layout's plain instances)
        ts_widths = tuple(w for w in ts_widths if w in DGELU_INSTANCES.get((ty, out, layout), {}))
    direct_widths = tuple(GELU_INSTANCES[(ty, out, False)]) if gelu else layout_widths(ty, out, layout, False, K, beside)
    # (beta != 0: C's old tile comes in through the TMA as well; LLMC_WGMMA_TS_BETA=0 keeps such GEMMs on
    # direct stores, the A/B of that choice)
    ts_ok = ((beta == 0.0 or switches.on("LLMC_WGMMA_TS_BETA")) and not trans_c
             and (ldc * obytes) % 16 == 0 and has_ts)
    if store not in ("auto", "tma", "direct"):
        raise LLMCError(f"gemm engine 5: store={store!r}; expected auto, tma or direct")
    if dgelu and not ts_ok:
        raise LLMCError(f"gemm engine 5: the fused dgelu needs the TMA store: 16-byte rows of C (ldc={ldc})")
    if store == "tma" and not ts_ok:
        raise LLMCError("gemm engine 5: the TMA store takes outputs not transposed, with 16-byte rows of C, in a layout "
                        "built with it (not tf32's M-major A)")
    use_pp, tile_rows = (False, BM) if gelu or dgelu else _pick_schedule(rt, dtype, ty, out, layout, M, N, K, schedule, store,
                                                               bn, rm, splits)
    if rm is not None and not use_pp:
        raise LLMCError(f"gemm engine 5: rm={rm} (a ping-pong tile's rows) but the cooperative schedule was chosen")
    if use_pp:  # ping-pong: the consumer's tile (rows x BN) from its own plan; the TMA store where it is
        # built and the output is plain (one K split, beta = 0, not transposed), unless store="direct"
        use_ts = (store != "direct" and ts_ok and beta == 0.0 and (splits or 1) == 1
                  and (ty, out, layout) in PP_TS_INSTANCES)
        if use_ts and store == "auto" and not any((bn is None or w == bn) and (rm is None or r == rm)
                                                  for r, w in PP_TS_INSTANCES[(ty, out, layout)]):
            use_ts = False  # (tf32: a tile shape built without the TMA store stores from registers)
        table = PP_TS_INSTANCES if use_ts else PP_INSTANCES
        shapes = [sh for sh in table[(ty, out, layout)] if (bn is None or sh[1] == bn) and
                  (rm is None or sh[0] == rm)]
        if not shapes:
            have = ", ".join(f"{r}x{w}" for r, w in table[(ty, out, layout)])
            raise LLMCError(f"gemm engine 5: no ping-pong tile rm={rm} bn={bn}; have {have}")
        tile_rows, pbn, psplits = plan_pingpong(rt.sm_count, M, N, K, dtype, allow_split=splits is None and not use_ts,
                                                shapes=shapes)
    else:
        use_ts = dgelu or store == "tma" or (store == "auto" and ts_ok and K <= ts_max_k(out) and (bn is None or bn in ts_built))
        # an accumulating GEMM that the planner splits over K (attproj's dweight: 24-36 tiles) stays direct
        # where the split's estimate is under half the one-split TMA-store plan's (SPLIT_OVER_TS)
        if (use_ts and store == "auto" and beta != 0.0 and splits is None
                and plan(rt.sm_count, M, N, K, dtype, widths=direct_widths)[1] > 1
                and _split_beats_ts(rt.sm_count, M, N, K, dtype, out, ts_widths, direct_widths)):
            use_ts = False
        if use_ts:  # the TMA store needs the whole tile at once: no split-K
            # the planner's widths: LLMC_WGMMA_TS_WIDTHS (e.g. "128,192", the A/B of the 256-wide instance)
            # narrows them; 256 only up to ts256_max_k()
            allowed = switches.value("LLMC_WGMMA_TS_WIDTHS") or ts_widths
            widths = tuple(w for w in ts_widths if w in allowed and (w != 256 or _k256_ok(K))) or TS_WIDTHS
            pbn, psplits = plan(rt.sm_count, M, N, K, dtype, allow_split=False, widths=widths, eff=TS_BN_EFF[out])
            splits = 1 if splits is None else splits
            if splits > 1 and store == "auto":
                use_ts = False
        if not use_ts:
            pbn, psplits = plan(rt.sm_count, M, N, K, dtype, widths=direct_widths)
    bn_asked = bn
    bn, splits = bn or pbn, splits or psplits
    # Where the planner picks the 256-wide TMA-store tile (bf16 -> bf16 forwards, K <= 1024), 128 x 128
    # ping-pong tiles with the TMA store run instead (_pp128_for_256, PP128_ENV; the fused GELU form keeps its plain
    # GEMM's bits with the cooperative 128-wide instance: the same m64n128 products in the same order)
    if (use_ts and not use_pp and bn == 256 and bn_asked is None and splits == 1 and rm is None
            and _pp128_for_256(ty, out, layout, schedule)):
        if gelu:
            bn = 128
        else:
            use_pp, tile_rows, bn = True, 128, 128
    # tf32 -> fp32 (TF32_PP128_ENV): the 128-wide cooperative TMA-store plan, and any plain plan with at
    # least 4 waves of 128 x 128 tiles, run as 128 x 128 ping-pong with the TMA store
    if (not use_pp and not gelu and not dgelu and bn_asked is None and splits_asked is None and splits == 1
            and rm is None and store == "auto" and ts_ok and beta == 0.0 and _tf32_pp128(ty, out, layout, schedule)
            and ((use_ts and bn == 128) or -(-M // 128) * -(-N // 128) >= TF32_PP128_WAVES * rt.sm_count)):
        use_pp, use_ts, tile_rows, bn = True, True, 128, 128
    if use_ts and not use_pp and (bn not in ts_built or splits > 1):
        raise LLMCError(f"gemm engine 5: the TMA store is built for tile widths {ts_built} without split-K here")
    if not use_pp and bn not in (ts_built if use_ts else direct_built):
        have = ts_built if use_ts else direct_built
        raise LLMCError(f"gemm engine 5: no tile width {bn} here; have {', '.join(map(str, have))}")
    bk = 128 // DTYPES[dtype][1]
    kblocks = -(-K // bk)
    splits = max(1, min(splits, kblocks))
    per = -(-kblocks // splits)
    splits = -(-kblocks // per)
    # the multicast instances (MC_INSTANCES): cooperative TMA-store plans with one K split
    mc = multicast_default() if multicast is None else bool(multicast)
    if mc and not (use_ts and not use_pp and not gelu and not dgelu and splits == 1
                   and bn in MC_INSTANCES.get((ty, out, layout), {})):
        if multicast:
            built = ", ".join(f"{t} -> {o} {lay} {sorted(w)}" for (t, o, lay), w in MC_INSTANCES.items())
            raise LLMCError(f"gemm engine 5: multicast=True is built for cooperative TMA-store plans with one K split "
                            f"({built}); this plan: {ty} -> {out} {layout}, 128x{bn}, "
                            f"{'TMA store' if use_ts else 'direct stores'}, {splits} split(s)"
                            f"{', ping-pong' if use_pp else ''}")
        mc = False
    # the 4-stage 256 instances (S4_INSTANCES): plain cooperative TMA-store plans, in place of the 3-stage ones
    s4 = (switches.on(S4_ENV) and use_ts and not use_pp and not mc and not gelu and not dgelu and splits == 1
          and beta == 0.0 and not trans_c and bn in S4_INSTANCES.get((ty, out, layout), {}))
    what = {"kk": "", "mk": ", A M-major", "kn": ", B N-major", "mn": ", A M-major, B N-major"}[layout]
    fused = gelu and splits == 1  # (split-K: the plain instance writes the partials; the reduce applies the GELU)
    if dgelu:
        stages = DGELU_INSTANCES[(ty, out, layout)][bn]
        smem = smem_bytes(bn, stages, True, out)
        name = instance_name(ty, out, layout, True, bn, dgelu=True)
        label = f"gemm 5 ({ty}{' -> bf16' if out == 'bf16' else ''}, 128x{bn}, TMA store{what} + dgelu)"
        return _dgelu_launch(rt, name, label, smem, dtype, out, M, N, K, lda, ldb, ldc, alpha, bn, b_major, colsum,
                             (5, f"{BM}x{bn}+ts{LAYOUT_SUFFIX[layout].replace('_', '+')}+dgelu", 1))
    if use_pp:
        stages = (PP_TS_INSTANCES if use_ts else PP_INSTANCES)[(ty, out, layout)][(tile_rows, bn)]
        smem = pp_smem_bytes(tile_rows, bn, stages, use_ts, out)
        name = pp_instance_name(ty, out, layout, tile_rows, bn, use_ts)
        label = (f"gemm 5 ({ty}{' -> bf16' if out == 'bf16' else ''}, {tile_rows}x{bn} ping-pong"
                 f"{', TMA store' if use_ts else ''}{what})")
    else:
        stages = (MC_INSTANCES[(ty, out, layout)] if mc else S4_INSTANCES[(ty, out, layout)] if s4
                  else GELU_INSTANCES[(ty, out, use_ts)] if fused else INSTANCES[(ty, out, layout, use_ts)])[bn]
        smem = smem_bytes(bn, stages, use_ts, out, parts=S4_PARTS if s4 else 1)
        name = instance_name(ty, out, layout, use_ts, bn, fused, mc=mc, s4=s4)
        label = (f"gemm 5 ({ty}{' -> bf16' if out == 'bf16' else ''}, 128x{bn}{', TMA store' if use_ts else ''}{what}"
                 f"{', 2-CTA clusters' if mc else ''}{', 4 stages, stored in 2 slices' if s4 else ''}"
                 f"{' + gelu' if gelu else ''})")
    plan_ = (5, f"{tile_rows}x{bn}{'+ts' if use_ts else ''}{'+pp' if use_pp else ''}"
                f"{LAYOUT_SUFFIX[layout].replace('_', '+')}{'+mc' if mc else ''}{'+s4' if s4 else ''}{'+gelu' if gelu else ''}", splits)
    if plan_only:  # the plan alone (what the planner picks here): no kernel, no workspace

        def no_launch(*_a, **_k):
            raise LLMCError("gemm engine 5: a plan_only build does not launch")
        no_launch.plan = plan_
        return no_launch
    k = rt.kernel(MODULE, name, "PPPPPPPPiiiiiiiffi" if fused else "PPPPPPiiiiiiiffi", label=label)
    k.set_max_dynamic_smem(smem)
    units = -(-M // tile_rows) * -(-N // bn) * splits
    grid, block = (min(units, rt.sm_count), 1, 1), (384, 1, 1)
    if mc:  # a whole number of clusters, each a pair of tiles stacked along M
        pairs = -(-(-(-M // tile_rows)) // 2) * -(-N // bn) * splits
        grid = (2 * min(pairs, rt.sm_count // 2), 1, 1)
    ldw = -(-N // 4) * 4
    W = rt.scratch((splits * M * ldw,), np.float32) if splits > 1 else None  # (partials: written, then reduced)
    red = rt.kernel(MODULE, "gemm_wgmma_splitk_reduce" + ("_gelu" if gelu else "") + ("_bf16" if out == "bf16" else ""),
                    "PPPPiiiiiffi" if gelu else "PPPiiiiiffi",
                    label=f"gemm 5 split-K reduce{' + gelu' if gelu else ''}") if splits > 1 else None
    rgrid = (max(1, min(-(-(M * N) // 256), rt.sm_count * 8)), 1, 1)
    maps: dict = {}

    def _p(x):
        return 0 if x is None else int(x if isinstance(x, (int, np.integer)) else x.ptr)

    def launch(C, A, B, bias=None, G=None):
        a, b, c, bi, gg = _p(A), _p(B), _p(C), _p(bias), _p(G)
        if (a | b) & 15:
            raise LLMCError(f"gemm engine 5: operands must be 16-byte aligned (A=0x{a:x}, B=0x{b:x})")
        if bool(gg) != gelu:
            raise LLMCError(f"gemm engine 5: built with gelu={gelu}: launch(C, A, B, bias{', G' if gelu else ''})")
        ts = use_ts and not (c | gg) & 15  # (G's own map: both 16-byte aligned, else both direct)
        key = (a, b, c if ts else 0, gg if ts else 0)
        dm = maps.get(key)
        if dm is None:  # first launch with these operands: encode the maps, copy them to the device
            # an M-/N-major operand comes in boxes of 128 bytes of MN x BK k rows (tf32 32 x 32, bf16 64 x 64)
            ta = tensor_map(a, dtype, K, M, lda, bk) if a_major == "m" else tensor_map(a, dtype, M, K, lda, tile_rows)
            tb = (tensor_map(b, dtype, K, N, ldb, bk) if b_major == "n"  # (K-major B multicast: BN / 2 rows a CTA)
                  else tensor_map(b, dtype, N, K, ldb, bn // 2 if mc else bn))
            blob = ta + tb
            if ts:  # C (and G) in boxes of 64 rows x 128 bytes (64: the 160-wide bf16 tile; fp32 copied as is)
                blob += tensor_map(c, "bf16" if out == "bf16" else "tf32t", M, N, ldc, 64, box_bytes(bn * obytes))
                if gelu:
                    blob += tensor_map(gg, "bf16" if out == "bf16" else "tf32t", M, N, ldc, 64)
            dm = maps[key] = rt.to_device(np.frombuffer(blob, np.uint8))
        tm = (dm.ptr, dm.ptr + 128, dm.ptr + 256 if ts else 0)
        tmg = (dm.ptr + 384 if ts else 0,) if fused else ()
        gp = (gg,) if fused else ()
        if splits > 1:
            k(grid, block, tm[0], tm[1], 0, c, 0, W.ptr, np.int32(M), np.int32(N), np.int32(K), np.int32(ldc),
              np.int32(ldw), np.int32(splits), np.int32(per), np.float32(1.0), np.float32(0.0), np.int32(0),
              smem=smem)
            red(rgrid, (256, 1, 1), c, *((gg,) if gelu else ()), W.ptr, bi if has_bias else 0, np.int32(M),
                np.int32(N), np.int32(ldc), np.int32(ldw), np.int32(splits), np.float32(alpha), np.float32(beta),
                np.int32(1 if trans_c else 0))
        else:
            k(grid, block, tm[0], tm[1], tm[2], *tmg, c, *gp, bi if has_bias else 0, 0, np.int32(M), np.int32(N),
              np.int32(K), np.int32(ldc), np.int32(ldw), np.int32(1), np.int32(per), np.float32(alpha),
              np.float32(beta), np.int32(1 if trans_c else 0), smem=smem)
    launch.plan = plan_
    return launch


# The lm head's forward when the classifier is folded into the lm head's GEMMs (cuda/gemm_wgmma.cu,
# GEMM_WGMMA_FOLD_ENTRY): the 128 x 128 ping-pong TMA-store tile, which the planner picked for the lm head's
# forward in both precisions when the fold was built (session 38). (input, output) -> stages.
FOLD_INSTANCES = {("tf32", "fp32"): 5, ("bf16", "bf16"): 6}
FOLD_BN = 128
# ... and bf16's on the cooperative 128 x 256 TMA-store tile (GEMM_WGMMA_COOP_FOLD_ENTRY, session 43), the
# forwards' best tile under the power cap (session 41); FS then has a sum per 256-wide tile.
FOLD256_INSTANCES = {("bf16", "bf16"): 3}
FOLD256_ENV = "LLMC_WGMMA_FOLD256"


def fold_bn(dtype: str) -> int:
    """The width of the fold's tiles (FS's sums are per tile): 256 for bf16 with LLMC_WGMMA_FOLD256=1, else 128."""
    ty = "bf16" if dtype == "bf16" else "tf32"
    return 256 if (ty, "bf16" if ty == "bf16" else "fp32") in FOLD256_INSTANCES and switches.on(FOLD256_ENV) else FOLD_BN


def fold_instance_name(ty: str, out: str, bn: int = FOLD_BN) -> str:
    if bn == 256:
        return f"gemm_wgmma_{ty}_n256_ts_fold{'_bf16' if out == 'bf16' else ''}"
    return f"gemm_wgmma_{ty}_n{FOLD_BN}_ts_pp128_fold{'_bf16' if out == 'bf16' else ''}"


def wgmma_fold_build(rt, dtype: str, M: int, N: int, K: int, V: int, out: str = "fp32"):
    """The lm head's forward for the folded classifier (llmc/ops/classifier.py: fold_build): instead of
    the logits A(M,K) @ B(N,K)^T, C gets p' = 2^(logit log2(e) - k) (k: the int32 device scalar at
    fold_k; columns >= V: 0), and FS (M, ceil(N / bn)) fp32 the sum of p' per row and bn-wide tile (bn:
    fold_bn, 128 for the ping-pong 128 x 128 tile, 256 for bf16's cooperative 128 x 256 one).
    Both operands K-major (lnf and wte as they lie), tf32 -> fp32 or bf16 -> bf16, C (M, N) contiguous.
    Returns launch(C, A, B, FS, fold_k); launch.tiles is FS's row length."""
    ty = "bf16" if dtype == "bf16" else "tf32"
    if (ty, out) not in FOLD_INSTANCES:
        raise LLMCError(f"gemm engine 5: the fold instances are tf32 -> fp32 and bf16 -> bf16 (asked {ty} -> {out})")
    if not 0 < V <= N:
        raise LLMCError(f"gemm engine 5: fold with V={V} outside (0, N={N}]")
    why = check(dtype, M, N, K, K, K)
    if why:
        raise LLMCError(f"gemm engine 5 refuses M={M} N={N} K={K}: {why}")
    obytes = OUT_BYTES[out]
    if (N * obytes) % 16:
        raise LLMCError(f"gemm engine 5: the fold's TMA store needs 16-byte rows of C (N={N})")
    bn = fold_bn(dtype)
    if bn == 256:
        smem = smem_bytes(256, FOLD256_INSTANCES[(ty, out)], True, out)
        how = "128x256, TMA store + fold"
    else:
        smem = pp_smem_bytes(128, FOLD_BN, FOLD_INSTANCES[(ty, out)], True, out)
        how = f"128x{FOLD_BN} ping-pong, TMA store + fold"
    name = fold_instance_name(ty, out, bn)
    k = rt.kernel(MODULE, name, "PPPPPPiiiii", label=f"gemm 5 ({ty}{' -> bf16' if out == 'bf16' else ''}, {how})")
    k.set_max_dynamic_smem(smem)
    tiles_n = -(-N // bn)
    units = -(-M // 128) * tiles_n
    grid, block = (min(units, rt.sm_count), 1, 1), (384, 1, 1)
    maps: dict = {}

    def _p(x):
        return int(x if isinstance(x, (int, np.integer)) else x.ptr)

    def launch(C, A, B, FS, fold_k):
        a, b, c = _p(A), _p(B), _p(C)
        if (a | b | c) & 15:
            raise LLMCError(f"gemm engine 5: fold operands must be 16-byte aligned (A=0x{a:x}, B=0x{b:x}, C=0x{c:x})")
        dm = maps.get((a, b, c))
        if dm is None:
            blob = (tensor_map(a, dtype, M, K, K, 128) + tensor_map(b, dtype, N, K, K, bn)
                    + tensor_map(c, "bf16" if out == "bf16" else "tf32t", M, N, N, 64, box_bytes(bn * obytes)))
            dm = maps[(a, b, c)] = rt.to_device(np.frombuffer(blob, np.uint8))
        k(grid, block, dm.ptr, dm.ptr + 128, dm.ptr + 256, c, _p(FS), _p(fold_k), np.int32(M), np.int32(N),
          np.int32(K), np.int32(N), np.int32(V), smem=smem)
    launch.plan = (5, f"128x{bn}+ts+fold" if bn == 256 else f"128x{FOLD_BN}+ts+pp+fold", 1)
    launch.tiles = tiles_n
    return launch


def _dgelu_launch(rt, name, label, smem, dtype, out, M, N, K, lda, ldb, ldc, alpha, bn, b_major, colsum, plan_):
    """wgmma_build's launch for the dgelu instances: launch(C, A, B, P, colsum=None)."""
    k = rt.kernel(MODULE, name, "PPPPPPiiiif", label=label)
    k.set_max_dynamic_smem(smem)
    tiles_m = -(-M // BM)
    grid, block = (min(tiles_m * -(-N // bn), rt.sm_count), 1, 1), (384, 1, 1)
    srows = 8 * tiles_m  # one partial row per 16 rows (a consumer warp's)
    S = rt.scratch((srows * N,), np.float32) if colsum else None  # (every launch writes its partials first)
    fin = rt.kernel(MODULE, "gemm_wgmma_colsum_finish" + ("_bf16" if out == "bf16" else ""), "PPii",
                    label="gemm 5 dgelu column sums") if colsum else None
    bk = 128 // DTYPES[dtype][1]
    cdt = "bf16" if out == "bf16" else "tf32t"
    maps: dict = {}

    def _p(x):
        return int(x if isinstance(x, (int, np.integer)) else x.ptr)

    def launch(C, A, B, P, colsum_out=None):
        a, b, c, pp = _p(A), _p(B), _p(C), _p(P)
        if (a | b | c | pp) & 15:
            raise LLMCError(f"gemm engine 5 (dgelu): A, B, C and P must be 16-byte aligned "
                            f"(A=0x{a:x}, B=0x{b:x}, C=0x{c:x}, P=0x{pp:x})")
        if colsum_out is not None and not colsum:
            raise LLMCError("gemm engine 5: built with colsum=False: launch(C, A, B, P) (no column sums)")
        key = (a, b, c, pp)
        dm = maps.get(key)
        if dm is None:
            ta = tensor_map(a, dtype, M, K, lda, BM)
            tb = tensor_map(b, dtype, K, N, ldb, bk) if b_major == "n" else tensor_map(b, dtype, N, K, ldb, bn)
            blob = ta + tb + tensor_map(c, cdt, M, N, ldc, 64) + tensor_map(pp, cdt, M, N, ldc, 64)
            dm = maps[key] = rt.to_device(np.frombuffer(blob, np.uint8))
        sums = colsum_out is not None
        k(grid, block, dm.ptr, dm.ptr + 128, dm.ptr + 256, dm.ptr + 384, c, S.ptr if sums else 0, np.int32(M),
          np.int32(N), np.int32(K), np.int32(ldc), np.float32(alpha), smem=smem)
        if sums:
            fin((-(-N // 32), 1, 1), (32, 32, 1), _p(colsum_out), S.ptr, np.int32(srows), np.int32(N))
    launch.plan = plan_
    return launch


# The 256-wide bf16 TMA-store instance holds 3 stages (its staging buffers take the rest of shared
# memory) and runs its epilogue with both consumers at once. On the shapes where the planner picks it,
# ping-pong 128 x 128 tiles with the TMA store (6 stages; each consumer's epilogue under the other's
# mainloop) measured faster (H100, session 18, interleaved medians, with bias): qkv forward B=16 0.1248
# against 0.1378 ms, attproj B=16 0.0536 against 0.0564, fc B=16 0.1548 against 0.1597, fc B=4 0.0516
# against 0.0547; where it picks 128 or 192 wide, the cooperative tiles stayed ahead (qkv B=4 0.0465
# against 0.0483, fcproj B=4 0.0457 against 0.0514). Those were timed alone, at full clock. Under a
# sustained load, the board at its 700 W cap as in the trainer's steps (session 41, H200,
# dev/bench_energy.py, B=16, over cuBLAS, time / energy), 256 wins back every forward: qkv 1.040x /
# 1.040x against ping-pong's 1.080x / 1.011x, attproj 1.049x / 0.955x against 1.102x / 1.061x, fc 1.042x
# / 1.115x against 1.091x / 1.231x, the lm head 1.058x / 1.054x against 1.068x / 1.059x; and whole bf16
# steps (bench_ab, 3 rounds, 40 steps): B=16 29.09 against 29.43 ms with the swap off alone, 28.62 with
# dinp's 256 tile (BT256_ENV) and 256 up to K = 4096 too, 28.16-28.23 against 28.62 in the next call;
# B=4 8.31 against 8.28 (the rounds touch). So the swap is off by default since session 41;
# LLMC_WGMMA_PP128=1 turns it back on (the A/B).
PP128_ENV = "LLMC_WGMMA_PP128"


# An accumulating GEMM that the planner splits over K runs split (direct stores, then the reduce) only
# where the planner's estimate of the split is under 1 / SPLIT_OVER_TS of the one-split TMA-store plan's;
# elsewhere on one split with the TMA store (C's old tile loaded by the TMA). The bf16 attproj dweight
# (768 x 768: 36 tiles) at B=2 and 4 (estimate ratios 1.4 and 1.9) was split in 3 until session 26; timed
# in turn, 20 back to back (H200): B=4 0.0244 ms on one split against 0.0320 in 3 (cuBLAS 0.0215), B=2
# 0.0170 against 0.0311 (cuBLAS 0.0197); whole bf16 steps B=2 5.43 against 5.50 ms, B=4 8.51 against 8.54.
# From B=8 (ratio 2.3) it stays split. LLMC_WGMMA_SPLIT_OVER_TS overrides the ratio; 0 splits wherever the
# planner does (the plans before session 26).
SPLIT_OVER_TS = 2.0
SPLIT_OVER_TS_ENV = "LLMC_WGMMA_SPLIT_OVER_TS"


def split_over_ts() -> float:
    r = switches.value(SPLIT_OVER_TS_ENV)
    return SPLIT_OVER_TS if r is None else r


def _split_beats_ts(sm_count: int, M: int, N: int, K: int, dtype: str, out: str, ts_widths,
                    direct_widths=BN_CHOICES) -> bool:
    """Whether an accumulating GEMM the planner splits over K takes the split (direct stores) rather than
    one split with the TMA store: where the split's estimate is under 1 / split_over_ts() of the other's."""
    r = split_over_ts()
    widths = [w for w in ts_widths if w != 256 or _k256_ok(K)]
    if r == 0 or not widths:
        return True
    t_ts = _estimate(sm_count, M, N, K, dtype, False, [(BM, w) for w in widths], False, TS_BN_EFF[out])[0]
    t_split = _estimate(sm_count, M, N, K, dtype, True, [(BM, w) for w in direct_widths], False)[0]
    return t_ts >= r * t_split


def _pp128_for_256(ty: str, out: str, layout: str, schedule) -> bool:
    """Whether a cooperative 256-wide TMA-store plan becomes 128 x 128 ping-pong (see PP128_ENV): only
    when no schedule is asked for (argument or LLMC_WGMMA_SCHEDULE) and the instance is built."""
    asked = schedule if schedule is not None else switches.value(SCHEDULE_ENV)
    return (asked is None and (ty, out, layout) in PP_TS_INSTANCES and (128, 128) in PP_TS_INSTANCES[(ty, out, layout)]
            and switches.on(PP128_ENV))


# tf32 -> fp32 with the TMA store: the cooperative 128 x 128 tile runs its epilogue with both consumers
# while the tensor cores wait; the 128 x 128 ping-pong instance has the same stages and staging and
# hides one consumer's epilogue under the other's mainloop (the same m64n128 products in the same
# order: the same bits). It runs where the planner picks that cooperative tile, and where a plain
# output has at least TF32_PP128_WAVES waves of 128 x 128 tiles (the planner's 192-wide direct-store
# plans of long K at B=16). H200, session 25, tf32 GEMMs of d12 timed in turn, ms, cooperative plan
# against 128 x 128 ping-pong: lm head forward B=16 4.536 -> 4.027 (cuBLAS 4.309), B=4 1.128 -> 1.010;
# qkv forward B=16 0.2116 -> 0.1983, dinp B=16 (192 wide, direct) 0.2179 -> 0.1993; with fewer tiles the
# 192-wide plan stays ahead (B=4 qkv dinp 0.0550 against 0.0637, 192 tiles). LLMC_WGMMA_TF32_PP128=0
# keeps the cooperative plans (the A/B).
TF32_PP128_ENV = "LLMC_WGMMA_TF32_PP128"
TF32_PP128_WAVES = 4


def _tf32_pp128(ty: str, out: str, layout: str, schedule) -> bool:
    """Whether tf32 -> fp32 plans may become 128 x 128 ping-pong with the TMA store (TF32_PP128_ENV): no
    schedule asked (argument or LLMC_WGMMA_SCHEDULE), the instance built, the switch not 0. wgmma_build
    decides which plans (the 128-wide TMA-store ones, and those with TF32_PP128_WAVES waves of tiles)."""
    asked = schedule if schedule is not None else switches.value(SCHEDULE_ENV)
    return (ty == "tf32" and asked is None and (ty, out, layout) in PP_TS_INSTANCES
            and switches.on(TF32_PP128_ENV))


def _pick_schedule(rt, dtype, ty, out, layout, M, N, K, schedule, store, bn, rm, splits):
    """(ping-pong?, tile rows) for wgmma_build: the schedule asked for (argument, else the environment),
    checked against the instances that exist; "auto" compares the planner's two estimates."""
    asked = schedule if schedule is not None else (switches.value(SCHEDULE_ENV) or "coop")
    if asked not in SCHEDULES:
        where = "schedule" if schedule is not None else SCHEDULE_ENV
        raise LLMCError(f"gemm engine 5: {where}={asked!r}; expected one of {', '.join(SCHEDULES)}")
    have = (ty, out, layout) in PP_INSTANCES
    ts_refused = store == "tma" and (ty, out, layout) not in PP_TS_INSTANCES
    if asked == "coop" or (asked == "auto" and (not have or ts_refused)):
        return False, BM
    if not have or ts_refused:
        why = ("the ping-pong TMA store is built for bf16 -> bf16 and tf32 -> fp32 with K-major A" if have else
               f"no ping-pong instances for {ty} in / {out} out / layout {layout}")
        if schedule is not None:
            raise LLMCError(f"gemm engine 5: schedule='pingpong' refused: {why}")
        if (ty, out, layout, store) not in _noted:  # forced for a whole run: say it once per kind of GEMM
            _noted.add((ty, out, layout, store))
            print(f"note: {SCHEDULE_ENV}=pingpong: {why}; using the cooperative instances there")
        return False, BM
    if asked == "pingpong" or rm is not None:
        return True, None
    pp = [sh for sh in PP_INSTANCES[(ty, out, layout)] if bn is None or sh[1] == bn]
    co = [(BM, w) for w in BN_CHOICES if bn is None or w == bn]
    if not pp or not co:
        return bool(pp), None if pp else BM
    t_pp = _estimate(rt.sm_count, M, N, K, dtype, splits is None, pp, True)[0]
    t_co = _estimate(rt.sm_count, M, N, K, dtype, splits is None, co, False)[0]
    return t_pp < t_co, None if t_pp < t_co else BM


def transpose_build(rt, rows: int, cols: int, ld_in: int | None = None, ld_out: int | None = None):
    """out(cols, ld_out) = in(rows, ld_in)^T (fp32). Returns launch(out, inp)."""
    ld_in = cols if ld_in is None else ld_in
    ld_out = rows if ld_out is None else ld_out
    k = rt.kernel(MODULE, "transpose_kernel", "PPiiii", label="transpose")
    grid = (-(-cols // 32), -(-rows // 32), 1)
    args = (np.int32(rows), np.int32(cols), np.int32(ld_in), np.int32(ld_out))

    def launch(out, inp):
        k(grid, (32, 8, 1), int(getattr(out, "ptr", out)), int(getattr(inp, "ptr", inp)), *args)
    return launch


def to_bf16(rt, x):
    """A bf16 copy (uint16 bits) of the fp32 DevArray x, rounded to nearest even on the GPU."""
    out = rt.empty(x.shape, np.uint16)
    k = rt.kernel(MODULE, "to_bf16_kernel", "PPq", label="to_bf16")
    k((min(-(-x.size // 256), rt.sm_count * 8), 1, 1), (256, 1, 1), out.ptr, x.ptr, np.int64(x.size))
    return out
