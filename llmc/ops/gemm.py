"""GEMM engines: the strided-batched GEMM library every matmul-shaped product runs on.

Not an op: the ops built from GEMMs declare the engine each variant runs on (Variant.engine:
matmul_forward 6 -> engine 2, 7 -> 4; matmul_backward n -> the engine of the same name; the
composite attention uses the engine of the chosen matmul variant). Kernels: cuda/gemm.cu.

    from llmc.ops.gemm import gemm_build
    gemm = gemm_build(rt, 2, transA=False, transB=True, M=1024, N=1024, K=64, batch=48,
                      strideA=1024*64, strideB=1024*64, strideC=1024*1024, alpha=0.125)
    gemm(C, A, B)                              # C[b] = 0.125 * A[b] @ B[b]^T for b < 48
    python dev/cuda/matmul_forward.py          # the engines at the trainer's shapes (tiles, split-K, probes)
    python -m pytest tests/test_gemm.py -q     # planner, fallbacks, the CPU model of engine 4's layouts

The engine is row-major: C[b](M,N) = alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias[n]),
op(X) = X or X^T as stored. beta == 0 never reads C.

Adding an engine (docs/architecture.md): its kernels in their own cuda/<file>.cu (an arch-specific
target such as sm_90a goes in llmc.runtime.ARCH_SPECIFIC), its build in its own llmc/ops/<file>.py.
An engine that does this strided-batched contract registers `ENGINES[n] = Engine(n, ..., build, check,
fallback=..., arch="sm_90")` (its module named in ENGINE_MODULES below) and gemm_build serves it; one
with its own contract (a wgmma engine taking K-major operands only) keeps its own builder, called by
the matmul variants that use it. Either way the variants declare `arch` and `engine` (llmc/ops/matmul.py).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import numpy as np

from llmc.errors import LLMCError
from llmc.ops import Built, note_once, ptr as _ptr

MODULE = "gemm"  # cuda/gemm.cu

# ----------------------------------------------------------------------------------------------
# numpy reference


def gemm_ref(A, B, C=None, transA=False, transB=False, alpha=1.0, beta=0.0, bias=None):
    """Batched reference of the GEMM engine on (batch, rows, cols) arrays (packed)."""
    a = np.swapaxes(A, -1, -2) if transA else A
    b = np.swapaxes(B, -1, -2) if transB else B
    out = alpha * (a @ b)
    if beta != 0.0:
        out = out + beta * C
    if bias is not None:
        out = out + bias
    return out


# ----------------------------------------------------------------------------------------------
# the engines: strided-batched, any M, N, K, layouts nn / nt / tn / tt

# TF32 tile configurations: name -> (BM, BN, threads, pipeline stages, CTAs per SM, efficiency).
# The efficiency (steady-state rate relative to "mid") feeds the planner's cost model; measured on
# the H100 (docs/matmul_notes.md). mid8 is not built for the tn layout (it spilled).
TF32_CONFIGS = {
    "big": (128, 256, 256, 3, 1, 0.92),
    "big4": (128, 256, 256, 4, 1, 0.92),
    "mid": (128, 128, 128, 3, 2, 1.0),
    "mid8": (128, 128, 256, 3, 2, 0.95),
    "small": (64, 64, 128, 3, 4, 0.82),
}
# warp tile (WM, WN) of each config (cuda/gemm.cu); engine 4 builds all but mid8 (it spilled at 128
# registers). tests/test_gemm_layout.py checks engine 4's index formulas for every one of these.
TF32_WARP_TILES = {"big": (64, 64), "big4": (64, 64), "mid": (64, 64), "mid8": (64, 32), "small": (32, 32)}
E4_CONFIGS = ("big", "big4", "mid", "small")
SM_FLOPS = 1.3e12    # per-SM rate of "mid" with two CTAs resident (170 TFLOP/s over 132 SMs)
LONE_CTA = 0.65      # a 4-warp CTA alone on an SM gets this fraction of it (8-warp CTAs: all)
TILE_OVERHEAD = 3    # pipeline fill + epilogue, in k-tiles
DRAM_BPS = 2.5e12    # bytes/s for the split-K second pass


def _layout(transA: bool, transB: bool) -> str:
    return ("t" if transA else "n") + ("t" if transB else "n")


def _check_16B(transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC):
    """Engines 2 and 4 copy 16-byte chunks (pointer alignment is checked at launch)."""
    odd = [f"{n}={v}" for n, v in (("lda", lda), ("ldb", ldb), ("ldc", ldc), ("strideA", strideA),
                                   ("strideB", strideB), ("strideC", strideC)) if v % 4]
    if odd:
        return "16-byte copies need leading dims and batch strides % 4 == 0, have " + ", ".join(odd)
    return None


def _check_e4(transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC):
    bad = _check_16B(transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC)
    if bad:
        return bad
    if max(lda, ldb) >= 1 << 24:  # its loader keeps row steps in 32-bit byte counts
        return f"leading dims must be < 2^24 (lda={lda}, ldb={ldb})"
    return None


def gemm_check(engine, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC, arch=None):
    """Reason string when `engine` cannot take this GEMM (before any fallback), else None: what the
    matmul variants' shape checks ask."""
    return ENGINES[engine].refuse_reason(arch, transA=transA, transB=transB, M=M, N=N, K=K, batch=batch,
                                         lda=lda, ldb=ldb, ldc=ldc, strideA=strideA, strideB=strideB,
                                         strideC=strideC)


def gemm_build(rt, engine: int, transA: bool, transB: bool, M: int, N: int, K: int, batch: int = 1,
               lda=None, ldb=None, ldc=None, strideA: int = 0, strideB: int = 0, strideC: int = 0,
               alpha: float = 1.0, beta: float = 0.0, has_bias: bool = False, config: str | None = None,
               splits: int | None = None, truncate: bool = False) -> Built:
    """Build C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias[n]) for b < batch on GEMM
    engine `engine`. Returns a Built: launch(C, A, B, bias=None) taking DevArrays (or raw device
    pointers), and plan = (engine, config, splits) for the lab.
    A refused engine falls back (Engine.fallback: 2 or 4 -> 3; 3 and 1 take anything) with one printed line.
    `config` ("big"/"mid"/"small"...) and `splits` override the TF32 planner (the lab sweeps them);
    `truncate` feeds unrounded fp32 to the tensor cores (a lab experiment, not used by the trainer)."""
    if engine not in ENGINES:
        raise LLMCError(f"gemm: no engine {engine}; have {', '.join(map(str, sorted(ENGINES)))}")
    if min(M, N, K, batch) < 1:
        raise LLMCError(f"gemm: empty problem M={M} N={N} K={K} batch={batch}")
    lda = lda if lda is not None else (M if transA else K)
    ldb = ldb if ldb is not None else (K if transB else N)
    ldc = ldc if ldc is not None else N
    if lda < (M if transA else K) or ldb < (K if transB else N) or ldc < N:
        raise LLMCError(f"gemm: leading dims too small (lda={lda}, ldb={ldb}, ldc={ldc}) "
                        f"for transA={transA} transB={transB} M={M} N={N} K={K}")
    shape = dict(transA=transA, transB=transB, M=M, N=N, K=K, batch=batch, lda=lda, ldb=ldb, ldc=ldc,
                 strideA=strideA, strideB=strideB, strideC=strideC)
    e = ENGINES[engine]
    reason = e.refuse_reason(getattr(rt, "arch", None), **shape)
    while reason:
        fb = ENGINES[e.fallback]
        note_once(f"gemm engine {e.number} refuses M={M} N={N} K={K} {_layout(transA, transB)} ({reason}); "
                  f"falling back to engine {fb.number} ({fb.description.split(',')[0]})")
        e, reason = fb, fb.refuse_reason(getattr(rt, "arch", None), **shape)
    return e.build(rt, alpha=alpha, beta=beta, has_bias=has_bias, config=config, splits=splits,
                   truncate=truncate, **shape)


def _gemm_simt(rt, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC,
               alpha, beta, has_bias, **_):
    k = rt.kernel(MODULE, f"gemm_simt_{_layout(transA, transB)}", "PPPPiiiiiiqqqff", label="gemm 1")
    grid, block = (-(-N // 64), -(-M // 64), batch), (256, 1, 1)
    args = (np.int32(M), np.int32(N), np.int32(K), np.int32(lda), np.int32(ldb), np.int32(ldc),
            np.int64(strideA), np.int64(strideB), np.int64(strideC), np.float32(alpha), np.float32(beta))

    def launch(C, A, B, bias=None):
        k(grid, block, _ptr(C), _ptr(A), _ptr(B), _ptr(bias), *args)
    return Built(launch, op="gemm", number=1, plan=(1, "simt", 1))


def _tf32_plan(sm_count, M, N, K, batch, vec, layout="nn", engine=2):
    """Pick (config, splits) minimising a wave-quantised time estimate. c = CTAs resident per SM
    (<= the config's occupancy, fewer when the grid is short); the grid runs in ceil(ctas / (sm*c))
    rounds of c CTAs per SM; a 4-warp CTA alone on an SM runs at LONE_CTA of the SM's rate.
    Split-K adds a pass that reads the partials once and writes C. Engine 4 uses engine 2's
    (measured) efficiencies over the configs it builds, until it has been measured itself."""
    KT = -(-K // 32)
    best = None
    for name, (BM, BN, threads, _, occ, eff) in TF32_CONFIGS.items():
        if (vec == 1 and name != "small") or (name == "mid8" and layout == "tn") or \
                (engine == 4 and name not in E4_CONFIGS):
            continue
        tiles = -(-M // BM) * -(-N // BN) * batch
        for s in (1, 2, 3, 4, 6, 8):
            if s > 1 and (KT // s < 8 or tiles * s > 2 * sm_count * occ):
                continue  # each split keeps >= 8 k-tiles; stop splitting once the grid is full
            kts = -(-KT // s)
            s = -(-KT // kts)  # no empty splits
            ctas = tiles * s
            c = min(occ, -(-ctas // sm_count))
            rounds = -(-ctas // (sm_count * c))
            rate = SM_FLOPS * eff * (LONE_CTA if c == 1 and occ > 1 and threads < 256 else 1.0)
            t = rounds * c * BM * BN * 64 * (kts + TILE_OVERHEAD) / rate
            if s > 1:
                t += (s + 2) * M * N * batch * 4 / DRAM_BPS
            if best is None or t < best[0]:
                best = (t, name, s)
    return best[1], best[2]


def _gemm_tf32(rt, vec, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA, strideB, strideC,
               alpha, beta, has_bias, config=None, splits=None, truncate=False, engine=None):
    engine = engine or (2 if vec == 4 else 3)  # (the lab builds configs directly by vec)
    lay = _layout(transA, transB)
    plan_cfg, plan_splits = _tf32_plan(rt.sm_count, M, N, K, batch, vec, lay, engine)
    config = config or plan_cfg
    if vec == 1:
        config = "small"
    if engine == 4:
        if config not in E4_CONFIGS:
            raise LLMCError(f"gemm: engine 4 has no TF32 config {config!r}; have {', '.join(E4_CONFIGS)}")
    elif config not in TF32_CONFIGS or (config == "mid8" and lay == "tn"):
        raise LLMCError(f"gemm: no TF32 config {config!r} for layout {lay}; have {', '.join(TF32_CONFIGS)} "
                        f"(mid8: not tn)")
    BM, BN, threads, stages, _, _ = TF32_CONFIGS[config]
    KT = -(-K // 32)
    splits = max(1, min(splits or plan_splits, KT))
    kts = -(-KT // splits)
    splits = -(-KT // kts)
    argt = "PPPPPiiiiiiqqqffiii"
    name = f"gemm_tf32_e4_{config}_{lay}" if engine == 4 else f"gemm_tf32_{config}_v{vec}_{lay}"
    k = rt.kernel(MODULE, name, argt, label=f"gemm {engine} ({config})",
                  defines={"MATMUL_TF32_TRUNCATE": 1} if truncate else None)
    smem = stages * (BM + BN) * 32 * 4
    k.set_max_dynamic_smem(smem)
    grid, block = (-(-M // BM), -(-N // BN), batch * splits), (threads, 1, 1)
    ldw = -(-N // 4) * 4
    W = rt.empty((batch * splits * M * ldw,), np.float32) if splits > 1 else None
    args = (np.int32(M), np.int32(N), np.int32(K), np.int32(lda), np.int32(ldb), np.int32(ldc),
            np.int64(strideA), np.int64(strideB), np.int64(strideC), np.float32(alpha), np.float32(beta),
            np.int32(splits), np.int32(kts), np.int32(ldw))
    if splits > 1:
        red = rt.kernel(MODULE, "gemm_splitk_reduce", "PPPiiiqiiiff", label=f"gemm {engine} split-K reduce")
        total = batch * M * N
        rgrid = (max(1, min(-(-total // 256), rt.sm_count * 8)), 1, 1)
        rargs = (np.int32(M), np.int32(N), np.int32(ldc), np.int64(strideC), np.int32(ldw), np.int32(splits),
                 np.int32(batch), np.float32(alpha), np.float32(beta))
    fallback = None
    if vec == 4:  # a pointer that is not 16-byte aligned at launch goes to engine 3, said once
        fallback = [None, False]

    def launch(C, A, B, bias=None):
        c, a, b, bi = _ptr(C), _ptr(A), _ptr(B), _ptr(bias)
        if fallback is not None and (c | a | b) & 15:
            if fallback[0] is None:
                print(f"gemm engine {engine}: pointers not 16-byte aligned (C=0x{c:x} A=0x{a:x} B=0x{b:x}); "
                      f"using engine 3 for this GEMM")
                fallback[0] = _gemm_tf32(rt, 1, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA,
                                         strideB, strideC, alpha, beta, has_bias)
            return fallback[0].launch(C, A, B, bias)
        if splits > 1:
            k(grid, block, c, a, b, 0, W.ptr, *args, smem=smem)
            red(rgrid, (256, 1, 1), c, W.ptr, bi, *rargs)
        else:
            k(grid, block, c, a, b, bi, 0, *args, smem=smem)
    return Built(launch, op="gemm", number=engine, plan=(engine, config, splits))  # plan: for the lab's table




# ----------------------------------------------------------------------------------------------
# the engine table


@dataclass
class Engine:
    number: int
    description: str
    build: Callable                # build(rt, transA, transB, M, N, K, batch, lda, ldb, ldc, strideA,
                                   #       strideB, strideC, alpha, beta, has_bias, config, splits, truncate) -> Built
    check: Callable | None = None  # check(transA, transB, M, ..., strideC) -> None or a reason
    fallback: int | None = None    # the engine that takes what this one refuses (one printed note)
    arch: str | None = None        # the one GPU architecture it runs on ("sm_90": wgmma), or any

    def refuse_reason(self, arch=None, **shape) -> str | None:
        if self.arch and arch and arch != self.arch:
            return f"needs an {self.arch} GPU (this one is {arch})"
        return self.check(**shape) if self.check else None


ENGINES: dict[int, Engine] = {
    1: Engine(1, "SIMT fp32, 64x64x16 tiles, 4x4 per thread, predicated scalar loads: any shape and alignment",
              _gemm_simt),
    2: Engine(2, "TF32 mma.sync m16n8k8, 16-byte cp.async 3-stage pipeline, 128x256/128x128/64x64 tiles by shape, "
                 "split-K when the grid is short, epilogue staged through smem (needs leading dims, strides % 4 == 0, "
                 "16-byte aligned pointers)",
              lambda rt, **kw: _gemm_tf32(rt, vec=4, engine=2, **kw), _check_16B, fallback=3),
    3: Engine(3, "TF32 like 2 but 4-byte cp.async and 64x64 tiles: any shape and alignment (engine 2's fallback)",
              lambda rt, **kw: _gemm_tf32(rt, vec=1, engine=3, **kw)),
    4: Engine(4, "TF32 like 2 with K-major fragments through ldmatrix.x4 and a leaner cp.async loader: ~2.9-3.0 "
                 "instructions per mma in the main loop instead of 4.1-4.7 (same tiles, planner, split-K, epilogue; "
                 "same alignment needs, engine 3 as its fallback)",
              lambda rt, **kw: _gemm_tf32(rt, vec=4, engine=4, **kw), _check_e4, fallback=3),
}

# Engines that live in their own files (llmc/ops/<name>.py) and add themselves to ENGINES on import.
ENGINE_MODULES: list[str] = []
for _name in ENGINE_MODULES:
    importlib.import_module(f"llmc.ops.{_name}")
