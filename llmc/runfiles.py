"""A run directory (-o) laid out as llm.c lays it out, so runs move between the two projects.

    from llmc import runfiles
    runfiles.save_checkpoint("out", 500, cfg, params, m, v, loader.state(), extra)   # rank 0 of 1
    step = runfiles.latest_done("out")             # the newest complete checkpoint, or None
    ck = runfiles.load_checkpoint("out", step)     # cfg, params, m, v, loader position, ...
    runfiles.prune_checkpoints("out", 500, keep=3, major=1000)       # -nk 3 -nm 1000
    log = runfiles.RunLog("out", append=True); log.train(0, 10.9, 3e-4, 1.2); log.val(0, 10.8)

    out/model_00000500.bin          the weights, llm.c's model file (rank 0 writes it)
    out/state_00000500_00000.bin    one per rank: m, v, loader position, ... (llmc.checkpoint)
    out/DONE_00000500               empty, written last: the checkpoint at step 500 is complete
    out/main.log                    s:<step> trl:<loss> lr:<lr> norm:<norm> | s:<step> tel:<val loss>
                                    | s:<step> eval:<acc>, llm.c's format (its notebook reads ours)

A checkpoint counts only once its DONE marker exists: a crash while writing the model or a state
file leaves the previous checkpoints (and their markers) as they were, and `-y 1` resumes from the
newest step that has a marker. Each file itself is written to a hidden temp name and renamed
(llmc.checkpoint.atomic_open); temp files of a killed process are removed by the next run.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
from pathlib import Path

import numpy as np

from llmc.errors import LLMCError


def model_path(out_dir, step: int) -> str:
    return os.path.join(out_dir, f"model_{step:08d}.bin")


def state_path(out_dir, step: int, rank: int = 0) -> str:
    return os.path.join(out_dir, f"state_{step:08d}_{rank:05d}.bin")


def done_path(out_dir, step: int) -> str:
    return os.path.join(out_dir, f"DONE_{step:08d}")


# -----------------------------------------------------------------------------
# finding checkpoints


def done_steps(out_dir) -> list[int]:
    """Steps that have a DONE marker, ascending (llm.c's find_max_step looks at the same files)."""
    steps = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(out_dir):
            m = re.fullmatch(r"DONE_(\d+)", name)
            if m:
                steps.append(int(m.group(1)))
    return sorted(steps)


def latest_done(out_dir) -> int | None:
    steps = done_steps(out_dir)
    return steps[-1] if steps else None


def clean_temp_files(out_dir) -> list[str]:
    """Remove the temp files (`.<name>.tmp.<pid>`) that a killed process left in out_dir. Files of
    a process that is still running are left alone. Returns the names removed."""
    removed = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for name in os.listdir(out_dir):
            m = re.fullmatch(r"\..+\.tmp\.(\d+)", name)
            if not m or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, name))
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (someone else's), or we cannot tell: keep its files
    return True


# -----------------------------------------------------------------------------
# writing and reading one checkpoint


def save_checkpoint(out_dir, step: int, cfg, params, m, v, loader_state: dict, extra: dict | None = None,
                    *, rank: int = 0, world: int = 1, barrier=None, master=None, sr_rng=None,
                    model_dtype: str = "fp32") -> str:
    """Write the checkpoint of `step`: the model (rank 0), this rank's state file, then (after
    `barrier(error)`, when several processes write) the DONE marker (rank 0). params are the full
    model's weights as floats (rank 0; None elsewhere), written as llm.c's version 3 (model_dtype
    "fp32") or 5 ("bf16": a bf16 run's weights, which round to themselves); m, v (and the fp32
    master weights of a bf16 run) this rank's optimizer state.

    barrier(error) is called on every rank with None or this rank's error message, whether or not
    its own writes worked, so that no rank waits for one that failed; it must raise on every rank
    if any rank failed (llmc.dist.Group.agree does). DONE is written only when all succeeded.

    Refuses (LLMCError) to write values that are not finite. A failed write (disk full, directory
    gone or read-only) raises LLMCError saying the previous checkpoint is intact. Returns the
    model file's path."""
    from llmc.checkpoint import write_model, write_state
    mpath = model_path(out_dir, step)
    err = None
    try:
        for name, a in (("weights", params), ("AdamW m", m), ("AdamW v", v), ("master weights", master)):
            if a is not None and not np.isfinite(a).all():
                raise LLMCError(f"step {step}: the {name} hold NaN/inf; not writing a checkpoint "
                                f"({_intact(out_dir)})")
        try:
            if rank == 0:
                # a marker from an older run at this step must not vouch for the files we now replace
                with contextlib.suppress(FileNotFoundError):
                    os.remove(done_path(out_dir, step))
                write_model(mpath, cfg, params, dtype=model_dtype)
            write_state(state_path(out_dir, step, rank), step, m, v, loader_state, extra,
                        master=master, rank=rank, world=world, sr_rng=sr_rng)
        except OSError as e:
            raise LLMCError(f"writing the checkpoint of step {step} in {out_dir} failed: "
                            f"{e.strerror or e} ({e.filename or out_dir}); {_intact(out_dir)}") from None
    except LLMCError as e:
        err = e
    if barrier is not None:
        barrier(None if err is None else str(err))  # every rank has written, or all raise here
    if err is not None:
        raise err
    if rank == 0:
        try:
            with open(done_path(out_dir, step), "wb") as f:
                os.fsync(f.fileno())
        except OSError as e:
            raise LLMCError(f"writing the checkpoint of step {step} in {out_dir} failed: "
                            f"{e.strerror or e} ({e.filename or out_dir}); {_intact(out_dir)}") from None
    return mpath


def _intact(out_dir) -> str:
    last = latest_done(out_dir)
    if last is None:
        return "no earlier checkpoint in this directory"
    return f"the previous checkpoint, step {last} ({model_path(out_dir, last)}), is intact"


def load_checkpoint(out_dir, step: int, rank: int = 0, world: int = 1, num_parameters: int | None = None,
                    shards: int = 1) -> dict:
    """Read the model and this rank's state of checkpoint `step` (ours or llm.c's). num_parameters:
    the size of this rank's optimizer state (default: the whole model's / shards, i.e. a ZeRO-1
    shard when shards = the number of ranks). Returns read_state's dict plus cfg, params (fp32: the
    master weights when the state holds all of them, which is what llm.c's bf16 runs train),
    file_params (the model file's weights as floats: a bf16 run resumes its bf16 weights from them),
    model_version (3 or 5) and model_path, state_path."""
    from llmc.checkpoint import read_model, read_state
    mpath, spath = model_path(out_dir, step), state_path(out_dir, step, rank)
    cfg, params = read_model(mpath)
    file_params = params
    st = read_state(spath, num_parameters or cfg.num_parameters // shards, rank=rank, world=world)
    if st["step"] != step:
        raise LLMCError(f"state file {spath}: says step {st['step']}, its name says {step}")
    if st["master"] is not None and st["master"].size == params.size:
        params = st["master"]
    from llmc.checkpoint import MODEL_MAGIC, MODEL_VERSION_FP32, MODEL_VERSION_BF16, read_header
    version = int(read_header(mpath, "model file", MODEL_MAGIC, (MODEL_VERSION_FP32, MODEL_VERSION_BF16),
                              "an llm.c model checkpoint")[1])
    st.update(cfg=cfg, params=params, file_params=file_params, model_version=version,
              model_path=mpath, state_path=spath)
    return st


def checkpoint_processes(out_dir, step: int) -> int:
    """How many processes wrote the checkpoint of `step`: llm.c's header field [2] of rank 0's
    state file (every rank's file says the same)."""
    from llmc.checkpoint import STATE_MAGIC, STATE_VERSION, read_header
    h = read_header(state_path(out_dir, step, 0), "state file", STATE_MAGIC, (STATE_VERSION,),
                    "an llm.c/llmc-py optimizer state (state_%08d_%05d.bin)")
    return int(h[2])


def check_processes(out_dir, step: int, world: int) -> None:
    """-y 1 under another number of processes than the run that wrote the checkpoint: one line
    (each rank's state holds that rank's data slice and, with ZeRO-1, its shard of m and v)."""
    n = checkpoint_processes(out_dir, step)
    if n != world:
        files = f"state_{step:08d}_00000..{n - 1:05d}.bin" if n > 1 else f"state_{step:08d}_00000.bin"
        how = f"mpirun -np {n}" if n > 1 else "one process (no mpirun)"
        raise LLMCError(f"-y 1: the checkpoint of step {step} in {out_dir} was written by {n} "
                        f"rank{'s' if n != 1 else ''} ({files}), this run has {world}: resume with {how}")


# -----------------------------------------------------------------------------
# retention (-nk, -nm)


def prune_checkpoints(out_dir, step: int, keep: int, major: int = 0) -> list[int]:
    """After writing the checkpoint of `step`: of the complete checkpoints at or before `step`,
    keep the newest `keep` (0 = keep all) and every one whose step is a multiple of `major`;
    delete the others (DONE marker first, so a crash mid-delete never leaves a marker pointing at
    missing files). Checkpoints after `step` (an older, longer run in the same directory) are not
    touched. Returns the steps deleted."""
    if keep <= 0:
        return []
    older = [s for s in done_steps(out_dir) if s <= step]
    gone = []
    for s in older[:-keep]:
        if major > 0 and s % major == 0:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(done_path(out_dir, s))
        with contextlib.suppress(FileNotFoundError):
            os.remove(model_path(out_dir, s))
        for f in Path(out_dir).glob(f"state_{s:08d}_*.bin"):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        gone.append(s)
    return gone


# -----------------------------------------------------------------------------
# main.log


class RunLog:
    """main.log in llm.c's format. append=False starts it empty (a fresh run), True appends (a
    resumed one). Every line is flushed; a failing write is one LLMCError."""

    def __init__(self, out_dir, append: bool):
        self.path = os.path.join(out_dir, "main.log")
        try:
            self.f = open(self.path, "a" if append else "w", encoding="utf-8")
        except OSError as e:
            raise LLMCError(f"-o/--output-dir {out_dir}: cannot write {self.path} ({e.strerror})") from None

    def _write(self, line: str) -> None:
        try:
            self.f.write(line + "\n")
            self.f.flush()
        except OSError as e:
            raise LLMCError(f"writing {self.path} failed ({e.strerror})") from None

    def train(self, step: int, loss: float, lr: float, norm: float) -> None:
        """step is llm.c's: 0 for the first optimizer step (the console's "step 1/N")."""
        self._write(f"s:{step} trl:{loss:.4f} lr:{lr:.6f} norm:{norm:.2f}")

    def val(self, step: int, loss: float) -> None:
        self._write(f"s:{step} tel:{loss:.4f}")

    def eval(self, step: int, acc: float) -> None:
        self._write(f"s:{step} eval:{acc:.4f}")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.f.close()


# -----------------------------------------------------------------------------
# llm.c's outlier detector (-sl, -sg)


class OutlierDetector:
    """z-score of each new value against a window of the last 64 (including itself), as llm.c's
    outlier_detector.h computes it: NaN until the window is full, 0 when the window is constant."""

    WINDOW = 64

    def __init__(self, state: dict | None = None):
        self.buf = [0.0] * self.WINDOW
        self.count = self.index = 0
        self.sum = self.sum_sq = 0.0
        if state:
            self.buf, self.count, self.index = list(state["buf"]), int(state["count"]), int(state["index"])
            self.sum, self.sum_sq = float(state["sum"]), float(state["sum_sq"])

    def update(self, x: float) -> float:
        W = self.WINDOW
        if self.count < W:
            self.buf[self.count] = x
            self.sum += x
            self.sum_sq += x * x
            self.count += 1
            return math.nan
        old = self.buf[self.index]
        self.sum += x - old
        self.sum_sq += x * x - old * old
        self.buf[self.index] = x
        self.index = (self.index + 1) % W
        mean = self.sum / W
        var = self.sum_sq / W - mean * mean
        std = math.sqrt(var) if var > 0 else 0.0
        return 0.0 if std == 0.0 else (x - mean) / std

    def state(self) -> dict:
        return {"buf": list(self.buf), "count": self.count, "index": self.index,
                "sum": self.sum, "sum_sq": self.sum_sq}
