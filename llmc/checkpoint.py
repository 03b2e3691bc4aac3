"""Model checkpoints, llm.c debug states and our optimizer/resume state, as files.

    from llmc.checkpoint import read_model, write_model, read_debug_state, read_state, write_state
    cfg, params = read_model("gpt2_124M.bin")            # fp32 (v3) or bf16 (v5), params come back fp32
    write_model("out/model_00001000.bin", cfg, params)   # atomic: temp file + fsync + rename
    write_model("out/model_bf16.bin", cfg, params, dtype="bf16")   # round-to-nearest-even
    dbg = read_debug_state("gpt2_124M_debug_state.bin", cfg)       # x, y, logits, loss, grads
    st = read_state("out/state_00001000_00000.bin", cfg.num_parameters)  # step, m, v, loader, ...

Every file starts with a 256 x int32 little-endian header. The model and debug-state files are
llm.c's formats byte for byte (its files load here and ours load there):

  model        header[0]=20240326 magic, [1]=3 (fp32 params) or 5 (bf16 params), [2]=maxT, [3]=V,
               [4]=L, [5]=NH, [6]=C, [7]=Vp; then the 16 parameter tensors flat, in llm.c's order
               (llmc.config.param_shapes). wte is (Vp, C): rows V..Vp-1 are padding.
  debug state  header[0]=20240327 magic, [1]=2, [2]=B, [3]=T; then x (B*T int32), y (B*T int32),
               logits (B*T*V fp32), loss (1 fp32), grads (num_parameters fp32).
               The logits are UNPADDED, V per row, not Vp: llm.c's train_gpt2.py writes the
               PyTorch model's (B, T, V) logits and its test_gpt2.cu reads B*T*V floats and compares
               the first V entries of each padded row. The grads ARE padded like the params: the
               wte grad is (Vp, C) with zero rows V..Vp-1, so grads has exactly num_parameters floats.

The optimizer/resume state is llm.c's layout (its train_gpt2.cu reads ours and we read its), one
file per rank, `state_%08d_%05d.bin` (llmc/runfiles.py names the files of a run directory):

  state        header (256 x int32), llm.c's fields:
                 [0] = 20240527 magic, [1] = 1 version, [2] = number of processes, [3] = rank,
                 [4] = 1 if fp32 master weights follow (llm.c's bf16 runs), [5] = 1 if llm.c's
                 shuffling dataloader state follows (we always write 0, see below), [10] = step
                 (optimizer steps completed), [20:22] = llm.c's stochastic-rounding RNG (uint64),
                 [30:32] = current shard index (uint64), [32:34] = current sample index (uint64):
                 the batch the loader serves next, counted in windows of B*T*processes tokens;
                 everything else 0.
               then m, then v (AdamW's moments, fp32, this rank's parameters), then the fp32 master
                 weights when [4] = 1.
               then, in files we write, our trailer: int32 20241122, int32 version 2, int64 n,
                 n bytes of UTF-8 JSON {"loader": <DataLoader.state()>, "extra": <numpy RNG state,
                 outlier-detector windows, the run's hyperparameters>}. llm.c's reader stops
                 after the master weights unless [5] = 1, so it never sees the trailer.

llm.c's header does not record the parameter count: the reader takes it from the model and checks
that the file size adds up exactly. llm.c's own shuffle state ([5] = 1: a permutation of the
shards and of one shard's windows plus an mt19937 state) cannot be continued here and is refused
with one line; an unshuffled llm.c run resumes here from the same batch.

Every reader checks: the file exists, the header is there, the magic, the version, the header
fields are sane, and the file size is EXACTLY what the header implies (truncated or trailing data
both fail). Mistakes raise llmc.errors.LLMCError with one line naming the file and what was expected.

Writers are atomic: they write `.<name>.tmp.<pid>` in the same directory, flush + fsync, then
os.replace() onto the real name, so a crash mid-save leaves the previous file intact.
The generic helpers (atomic_open, read_header, check_size) are shared with llmc.data and
llmc.tokenizer.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np

from llmc.bf16 import from_bf16, to_bf16
from llmc.config import GPT2Config
from llmc.errors import LLMCError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
MODEL_VERSION_BF16 = 5
DEBUG_STATE_MAGIC = 20240327
DEBUG_STATE_VERSION = 2
STATE_MAGIC = 20240527       # llm.c's optimizer/resume state
STATE_VERSION = 1
TRAILER_MAGIC = 20241122     # our JSON trailer after llm.c's fields
TRAILER_VERSION = 2
LLMC_RNG_INIT = 13371337     # llm.c's initial stochastic-rounding RNG state (plus the rank)

# elements per chunk of bf16 conversion when writing: bounds the temporaries to ~200 MB for any model
_CHUNK = 1 << 24

# -----------------------------------------------------------------------------
# generic file helpers (also used by llmc.data and llmc.tokenizer)


@contextlib.contextmanager
def atomic_open(path):
    """Open `path` for binary writing such that it appears under its name only when complete.

    Writes a temp file in the same directory (so the rename stays on one filesystem and is atomic),
    then flush + fsync + os.replace. On any exception the temp file is removed and the old file,
    if any, is untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    # make the rename itself durable (best effort: not every filesystem allows opening a directory)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def make_header(*fields) -> np.ndarray:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:len(fields)] = fields
    return header


def read_header(path, kind: str, magic: int, versions, hint: str) -> np.ndarray:
    """Check the file exists and holds a header with the right magic and version; return it.

    kind names the file in messages ("model file"), hint says what the magic means."""
    p = Path(path)
    if not p.exists():
        raise LLMCError(f"{kind} {path}: not found")
    if not p.is_file():
        raise LLMCError(f"{kind} {path}: not a regular file")
    size = p.stat().st_size
    if size < HEADER_BYTES:
        raise LLMCError(f"{kind} {path}: truncated: {size:,} bytes, smaller than the "
                        f"{HEADER_BYTES}-byte header")
    header = np.fromfile(p, dtype="<i4", count=HEADER_INTS)
    if int(header[0]) != magic:
        raise LLMCError(f"{kind} {path}: bad magic {int(header[0])} (expected {magic}; "
                        f"is this {hint}?)")
    if int(header[1]) not in versions:
        want = " or ".join(str(v) for v in versions)
        raise LLMCError(f"{kind} {path}: unsupported version {int(header[1])} (expected {want})")
    return header


def check_size(path, kind: str, expected_payload: int, what: str) -> None:
    """The file must be exactly header + expected_payload bytes; `what` says where the number
    comes from ("header says 124,475,904 fp32 params")."""
    have = Path(path).stat().st_size - HEADER_BYTES
    if have < expected_payload:
        raise LLMCError(f"{kind} {path}: truncated: {what} = {expected_payload:,} bytes after the "
                        f"{HEADER_BYTES}-byte header, file has {have:,}")
    if have > expected_payload:
        raise LLMCError(f"{kind} {path}: too long: {what} = {expected_payload:,} bytes after the "
                        f"{HEADER_BYTES}-byte header, file has {have:,} (trailing data: wrong header "
                        f"or a different format?)")


def _check_positive(path, kind: str, **fields) -> None:
    for name, value in fields.items():
        if value <= 0:
            raise LLMCError(f"{kind} {path}: header field {name}={value} is not positive "
                            f"(corrupt header?)")


# -----------------------------------------------------------------------------
# model checkpoint


def read_model(path) -> tuple[GPT2Config, np.ndarray]:
    """Read an llm.c model checkpoint (version 3 fp32 or 5 bf16). Returns (config, params) where
    params is a flat float32 array of cfg.num_parameters elements in llm.c's layout."""
    kind = "model file"
    h = read_header(path, kind, MODEL_MAGIC, (MODEL_VERSION_FP32, MODEL_VERSION_BF16),
                    "an llm.c model checkpoint")
    version = int(h[1])
    maxT, V, L, NH, C, Vp = (int(v) for v in h[2:8])
    _check_positive(path, kind, maxT=maxT, V=V, L=L, NH=NH, C=C, Vp=Vp)
    if Vp < V:
        raise LLMCError(f"{kind} {path}: header says padded vocab Vp={Vp} < vocab V={V} (corrupt header?)")
    if C % NH != 0:
        raise LLMCError(f"{kind} {path}: header says channels C={C} not divisible by heads NH={NH}")
    cfg = GPT2Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp,
                     num_layers=L, num_heads=NH, channels=C)
    n = cfg.num_parameters
    shape = f"L={L} C={C} NH={NH} maxT={maxT} Vp={Vp}"
    if version == MODEL_VERSION_FP32:
        check_size(path, kind, 4 * n, f"header ({shape}) says {n:,} fp32 params")
        params = np.fromfile(path, dtype="<f4", count=n, offset=HEADER_BYTES)
    else:
        check_size(path, kind, 2 * n, f"header ({shape}) says {n:,} bf16 params")
        params = from_bf16(np.fromfile(path, dtype="<u2", count=n, offset=HEADER_BYTES))
    return cfg, params


def write_model(path, cfg: GPT2Config, params: np.ndarray, dtype: str = "fp32") -> None:
    """Write params (flat, cfg.num_parameters elements, llm.c layout) as an llm.c checkpoint.
    dtype "fp32" writes version 3, "bf16" version 5 (rounded to nearest even)."""
    if dtype not in ("fp32", "bf16"):
        raise LLMCError(f"write_model {path}: dtype {dtype!r}: expected 'fp32' or 'bf16'")
    params = np.ascontiguousarray(params, dtype=np.float32).reshape(-1)
    n = cfg.num_parameters
    if params.size != n:
        raise ValueError(f"write_model {path}: got {params.size:,} params, config {cfg.describe()} "
                         f"needs {n:,}")
    version = MODEL_VERSION_FP32 if dtype == "fp32" else MODEL_VERSION_BF16
    header = make_header(MODEL_MAGIC, version, cfg.max_seq_len, cfg.vocab_size, cfg.num_layers,
                         cfg.num_heads, cfg.channels, cfg.padded_vocab_size)
    with atomic_open(path) as f:
        f.write(header.tobytes())
        if dtype == "fp32":
            f.write(memoryview(params).cast("B"))
        else:  # convert in chunks so a big model doesn't need a second full-size temporary
            for i in range(0, n, _CHUNK):
                f.write(to_bf16(params[i:i + _CHUNK]).tobytes())


# -----------------------------------------------------------------------------
# llm.c debug state (the reference batch that test_gpt2 checks against)


def read_debug_state(path, cfg: GPT2Config) -> dict:
    """Read llm.c's debug state for a model of config cfg. Returns dict(B, T, x (B,T) int32,
    y (B,T) int32, logits (B,T,V) fp32 unpadded, loss float, grads flat fp32 num_parameters)."""
    kind = "debug state file"
    h = read_header(path, kind, DEBUG_STATE_MAGIC, (DEBUG_STATE_VERSION,),
                    "an llm.c debug state (gpt2_124M_debug_state.bin)")
    B, T = int(h[2]), int(h[3])
    _check_positive(path, kind, B=B, T=T)
    if T > cfg.max_seq_len:
        raise LLMCError(f"{kind} {path}: header says T={T} > the model's maxT={cfg.max_seq_len}")
    BT, V, n = B * T, cfg.vocab_size, cfg.num_parameters
    check_size(path, kind, 4 * (2 * BT + BT * V + 1 + n),
               f"header says B={B} T={T} and the model has V={V}, {n:,} params")
    off = HEADER_BYTES
    x = np.fromfile(path, dtype="<i4", count=BT, offset=off); off += 4 * BT
    y = np.fromfile(path, dtype="<i4", count=BT, offset=off); off += 4 * BT
    logits = np.fromfile(path, dtype="<f4", count=BT * V, offset=off); off += 4 * BT * V
    loss = np.fromfile(path, dtype="<f4", count=1, offset=off); off += 4
    grads = np.fromfile(path, dtype="<f4", count=n, offset=off)
    return dict(B=B, T=T, x=x.reshape(B, T), y=y.reshape(B, T), logits=logits.reshape(B, T, V),
                loss=float(loss[0]), grads=grads)


def write_debug_state(path, cfg: GPT2Config, B: int, T: int, x, y, logits, loss, grads) -> None:
    """Write an llm.c debug state. logits must be (B, T, V) unpadded (a (B, T, Vp) array is
    accepted and cut to V); grads flat with num_parameters elements."""
    BT, V, n = B * T, cfg.vocab_size, cfg.num_parameters
    x = np.ascontiguousarray(x, dtype="<i4").reshape(-1)
    y = np.ascontiguousarray(y, dtype="<i4").reshape(-1)
    logits = np.asarray(logits, dtype="<f4")
    if logits.size == BT * cfg.padded_vocab_size and V != cfg.padded_vocab_size:
        logits = logits.reshape(BT, cfg.padded_vocab_size)[:, :V]
    logits = np.ascontiguousarray(logits).reshape(-1)
    grads = np.ascontiguousarray(grads, dtype="<f4").reshape(-1)
    for name, a, want in (("x", x, BT), ("y", y, BT), ("logits", logits, BT * V), ("grads", grads, n)):
        if a.size != want:
            raise ValueError(f"write_debug_state {path}: {name} has {a.size:,} elements, expected {want:,}")
    with atomic_open(path) as f:
        f.write(make_header(DEBUG_STATE_MAGIC, DEBUG_STATE_VERSION, B, T).tobytes())
        for a in (x, y, logits, np.array([loss], dtype="<f4"), grads):
            f.write(memoryview(a).cast("B"))


# -----------------------------------------------------------------------------
# optimizer + dataloader state (llm.c's layout plus our trailer, see the module docstring)


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"cannot store {type(o).__name__} in a state file")


def _put_u64(header: np.ndarray, at: int, value: int) -> None:
    header[at:at + 2] = np.array([value], dtype="<u8").view("<i4")


def _get_u64(header: np.ndarray, at: int) -> int:
    return int(header[at:at + 2].copy().view("<u8")[0])


def write_state(path, step: int, m: np.ndarray, v: np.ndarray, loader_state: dict,
                extra: dict | None = None, *, master: np.ndarray | None = None, rank: int = 0,
                world: int = 1, sr_rng: int | None = None) -> None:
    """Write one rank's optimizer state in llm.c's layout: AdamW's m and v (and the fp32 master
    weights when given), the step, the loader position (from loader_state's shard_index and
    window_index) and llm.c's stochastic-rounding RNG; then our trailer with the whole
    loader_state and `extra` (JSON-able: numpy RNG state etc.) for a bit-exact resume. Atomic."""
    arrays = [np.ascontiguousarray(a, dtype="<f4").reshape(-1) for a in (m, v) + ((master,) if master is not None else ())]
    n = arrays[0].size
    if any(a.size != n for a in arrays):
        raise ValueError(f"write_state {path}: m, v (and master) differ in size: {[a.size for a in arrays]}")
    if not 0 <= step < 2**31:
        raise ValueError(f"write_state {path}: step {step} out of range")
    if not 0 <= rank < world:
        raise ValueError(f"write_state {path}: rank {rank} out of range for {world} processes")
    header = make_header(STATE_MAGIC, STATE_VERSION, world, rank, int(master is not None), 0)
    header[10] = step
    _put_u64(header, 20, LLMC_RNG_INIT + rank if sr_rng is None else sr_rng)
    _put_u64(header, 30, int(loader_state["shard_index"]))
    _put_u64(header, 32, int(loader_state["window_index"]))
    blob = json.dumps({"loader": loader_state, "extra": extra or {}}, default=_json_default,
                      sort_keys=True).encode()
    trailer = np.array([TRAILER_MAGIC, TRAILER_VERSION, 0, 0], dtype="<i4")
    trailer[2:4] = np.array([len(blob)], dtype="<i8").view("<i4")
    with atomic_open(path) as f:
        f.write(header.tobytes())
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        f.write(trailer.tobytes())
        f.write(blob)


def read_state(path, num_parameters: int, rank: int | None = None, world: int | None = None) -> dict:
    """Read one rank's state file, ours or llm.c's. num_parameters is how many fp32 values each of
    m, v (and master) holds for this rank (llm.c's header does not say; the file size must add up).

    Returns dict(step, m, v, master (None unless the file has master weights), num_processes,
    rank, shard_index, sample_index (llm.c's loader position), sr_rng (llm.c's RNG), loader (our
    DataLoader.state(), or None for an llm.c file), extra ({} for an llm.c file), ours (bool))."""
    kind = "state file"
    h = read_header(path, kind, STATE_MAGIC, (STATE_VERSION,), "an llm.c/llmc-py optimizer state "
                    "(state_%08d_%05d.bin)")
    nproc, frank, has_master, shuffled, step = (int(h[i]) for i in (2, 3, 4, 5, 10))
    if nproc < 1 or not 0 <= frank < nproc or has_master not in (0, 1) or shuffled not in (0, 1) or step < 0:
        raise LLMCError(f"{kind} {path}: header says processes={nproc} rank={frank} master_weights="
                        f"{has_master} shuffle={shuffled} step={step} (corrupt header?)")
    if world is not None and nproc != world:
        raise LLMCError(f"{kind} {path}: written by a run of {nproc} processes, this run has {world} "
                        f"(resume with the same number of processes)")
    if rank is not None and frank != rank:
        raise LLMCError(f"{kind} {path}: holds rank {frank}'s state, expected rank {rank}'s")
    if shuffled:
        raise LLMCError(f"{kind} {path}: written by llm.c with its shuffling dataloader (header[5]=1), "
                        f"whose permutation llmc-py cannot continue; resume that run in llm.c, or "
                        f"start from its model_*.bin with -e")
    n = int(num_parameters)
    k = 3 if has_master else 2
    floats = 4 * k * n
    size = Path(path).stat().st_size - HEADER_BYTES
    if size < floats:
        raise LLMCError(f"{kind} {path}: truncated: {k} x {n:,} fp32 (m, v{', master' if has_master else ''}) "
                        f"= {floats:,} bytes after the header, file has {size:,} (state of a different model?)")
    loader_state, extra, ours = None, {}, size > floats
    if ours:  # our trailer: magic, version, int64 length, JSON
        with open(path, "rb") as f:
            f.seek(HEADER_BYTES + floats)
            rest = f.read()
        t = np.frombuffer(rest[:16].ljust(16, b"\0"), dtype="<i4")
        nblob = int(t[2:4].copy().view("<i8")[0])
        if int(t[0]) != TRAILER_MAGIC or int(t[1]) != TRAILER_VERSION or len(rest) != 16 + nblob:
            raise LLMCError(f"{kind} {path}: {len(rest):,} bytes after m, v"
                            f"{', master' if has_master else ''} for {n:,} params are not an llmc-py "
                            f"trailer (state of a different model, or a corrupt file?)")
        try:
            meta = json.loads(rest[16:].decode())
            loader_state, extra = meta["loader"], meta["extra"]
        except (ValueError, KeyError, TypeError) as e:
            raise LLMCError(f"{kind} {path}: unreadable JSON trailer ({e})") from None
    off = HEADER_BYTES
    m = np.fromfile(path, dtype="<f4", count=n, offset=off)
    v = np.fromfile(path, dtype="<f4", count=n, offset=off + 4 * n)
    master = np.fromfile(path, dtype="<f4", count=n, offset=off + 8 * n) if has_master else None
    return dict(step=step, m=m, v=v, master=master, num_processes=nproc, rank=frank,
                shard_index=_get_u64(h, 30), sample_index=_get_u64(h, 32), sr_rng=_get_u64(h, 20),
                loader=loader_state, extra=extra, ours=ours)
