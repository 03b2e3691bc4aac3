"""Token shards (llm.c's format) and the dataloader that cuts them into (x, y) batches.

    from llmc.data import DataLoader, read_shard, write_shard
    write_shard("dev/data/tinyshakespeare/tiny_shakespeare_val.bin", tokens)  # atomic
    tokens = read_shard("dev/data/tinyshakespeare/tiny_shakespeare_val.bin")  # np.uint16 memmap
    loader = DataLoader("dev/data/tinyshakespeare/tiny_shakespeare_train.bin", B=4, T=64)
    x, y = loader.next_batch()          # (B, T) int32 each; y is x shifted left by one token
    saved = loader.state()              # a small JSON-able dict; loader.load_state(saved) resumes exactly

Shard format (llm.c's): a 256 x int32 little-endian header, header[0]=20240520 magic, [1]=1 version,
[2]=token count; then that many uint16 tokens.

Batching, as llm.c does it: a batch is a window of B*T+1 consecutive tokens of one shard,
x = window[:-1], y = window[1:], both reshaped to (B, T). Windows start at multiples of B*T, so a
shard of n tokens gives (n - 1) // (B*T) windows; the tail that doesn't fill a window is skipped.
After a shard's last window comes the next shard; after the last shard the epoch wraps (epoch += 1)
back to the first. With shuffle=True, each epoch visits the shards in a random order and each
shard's windows in a random order; both permutations are drawn from numpy's PCG64 seeded with
(seed, epoch) and (seed, epoch, shard), so they depend only on seed and epoch and a resumed run
draws exactly the same ones.

Data parallel (llm.c's loader): with `world` processes, a window is world*B*T+1 tokens and process
`rank` takes its B*T+1 tokens starting at rank*B*T, so the windows start at multiples of
world*B*T and N ranks at micro-batch B see exactly the tokens one rank sees at B*N (rank r gets
rows r*B .. r*B+B-1 of that rank's batch). Shuffling permutes the windows, the same for every rank.

The state is the position of the NEXT batch: (epoch, index into the epoch's shard order, index into
that shard's window order). It always points at a valid window: serving the last window of the
last shard moves it on to epoch + 1 at once.
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np

from llmc.checkpoint import HEADER_BYTES, atomic_open, check_size, make_header, read_header
from llmc.errors import LLMCError

SHARD_MAGIC = 20240520
SHARD_VERSION = 1

# -----------------------------------------------------------------------------
# shard files


def write_shard(path, tokens) -> None:
    """Write tokens (ints in [0, 65535]) as an llm.c data shard. Atomic."""
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.dtype != np.uint16:
        if tokens.size and (tokens.min() < 0 or tokens.max() > 65535):
            raise ValueError(f"write_shard {path}: tokens must fit uint16, got range "
                             f"[{tokens.min()}, {tokens.max()}]")
        tokens = tokens.astype(np.uint16)
    if tokens.size >= 2**31:
        raise ValueError(f"write_shard {path}: {tokens.size:,} tokens do not fit the int32 count field")
    tokens = np.ascontiguousarray(tokens, dtype="<u2")
    with atomic_open(path) as f:
        f.write(make_header(SHARD_MAGIC, SHARD_VERSION, tokens.size).tobytes())
        f.write(memoryview(tokens).cast("B"))


def shard_num_tokens(path) -> int:
    """Validate the shard's header and size; return its token count (reads only the header)."""
    kind = "data shard"
    h = read_header(path, kind, SHARD_MAGIC, (SHARD_VERSION,), "an llm.c token shard (.bin from prepro)")
    n = int(h[2])
    if n < 0:
        raise LLMCError(f"{kind} {path}: header says {n} tokens (corrupt header?)")
    check_size(path, kind, 2 * n, f"header says {n:,} uint16 tokens")
    return n


def read_shard(path, mmap: bool = True) -> np.ndarray:
    """The shard's tokens as a 1-D np.uint16 array (a read-only memmap unless mmap=False)."""
    n = shard_num_tokens(path)
    if n == 0:
        return np.zeros(0, dtype=np.uint16)
    if mmap:
        return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))
    return np.fromfile(path, dtype="<u2", count=n, offset=HEADER_BYTES)


# -----------------------------------------------------------------------------
# the dataloader


class DataLoader:
    """Batches of (x, y) from every shard matching a glob pattern, sorted by name."""

    vocab_size = None  # when set (the trainer sets the model's V), next_batch checks every token id

    def __init__(self, pattern, B: int, T: int, shuffle: bool = False, seed: int = 1337,
                 rank: int = 0, world: int = 1):
        if B < 1 or T < 1:
            raise LLMCError(f"dataloader: B={B} and T={T} must be positive")
        if not 0 <= rank < world:
            raise ValueError(f"dataloader: rank {rank} outside [0, {world})")
        self.rank, self.world = int(rank), int(world)
        W = self.world * B * T  # tokens of one window: every rank's B*T, side by side
        if seed < 0:
            raise LLMCError(f"dataloader: seed {seed} must be >= 0")
        self.pattern = str(pattern)
        self.B, self.T = B, T
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.files = sorted(glob.glob(os.path.expanduser(self.pattern)))
        if not self.files:
            raise LLMCError(f"data: no files match {self.pattern!r} (make them with "
                            f"python prepro_tinyshakespeare.py or ./download_starter_pack.sh)")
        self.shard_tokens = []
        for f in self.files:
            n = shard_num_tokens(f)
            if n < W + 1:
                ranks = f" x {self.world} ranks" if self.world > 1 else ""
                raise LLMCError(f"data shard {f}: {n:,} tokens, fewer than B*T{ranks}+1 = {W + 1:,} "
                                f"needed for one batch at B={B} T={T} (use a smaller B or T)")
            self.shard_tokens.append(n)
        # windows per shard: starts at 0, W, 2W, ... with start + W + 1 <= n
        self.shard_windows = [(n - 1) // W for n in self.shard_tokens]
        self._shards = {}  # shard number -> memmap, opened on first use
        self.reset()

    # -- sizes
    @property
    def num_tokens(self) -> int:
        """Tokens in all shards together."""
        return sum(self.shard_tokens)

    @property
    def batches_per_epoch(self) -> int:
        return sum(self.shard_windows)

    # -- order of visiting (identity unless shuffling)
    def _shard_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.files))
        return np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(len(self.files))

    def _window_order(self, epoch: int, shard: int) -> np.ndarray | None:
        if not self.shuffle:
            return None  # window k is window k
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch, shard]))
        return rng.permutation(self.shard_windows[shard])

    def _enter(self, epoch: int, shard_idx: int, window_idx: int) -> None:
        if epoch != self.epoch:  # a new epoch (or a reset/load): draw its shard order
            self._order = self._shard_order(epoch)
        key = (epoch, int(self._order[shard_idx]))
        if key != self._windows_key:  # entering another shard: its window order for this epoch
            self._windows, self._windows_key = self._window_order(*key), key
        self.epoch, self.shard_idx, self.window_idx = epoch, shard_idx, window_idx

    def reset(self) -> None:
        """Back to the first batch of epoch 0."""
        self.epoch = self._windows_key = None
        self._enter(0, 0, 0)

    # -- batches
    @property
    def current_shard(self) -> int:
        """Number (index into self.files) of the shard the next batch comes from."""
        return int(self._order[self.shard_idx])

    @property
    def position(self) -> int:
        """Token offset of the next batch (this rank's part of its window) in its shard."""
        w = self.window_idx if self._windows is None else int(self._windows[self.window_idx])
        return (w * self.world + self.rank) * self.B * self.T

    def _tokens(self, shard: int) -> np.ndarray:
        if shard not in self._shards:
            self._shards[shard] = read_shard(self.files[shard])
        return self._shards[shard]

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        B, T = self.B, self.T
        start = self.position
        buf = self._tokens(self.current_shard)[start:start + B * T + 1].astype(np.int32)
        if self.vocab_size is not None and int(buf.max()) >= self.vocab_size:
            bad = int(np.argmax(buf >= self.vocab_size))
            raise LLMCError(f"data shard {self.files[self.current_shard]}: token id {int(buf[bad])} at "
                            f"token {start + bad:,} is outside the model's vocabulary (V={self.vocab_size}); "
                            f"a shard made with another tokenizer?")
        x = buf[:-1].reshape(B, T)
        y = buf[1:].reshape(B, T)
        # advance to the next window now, so state() always names the batch that comes next
        epoch, s, w = self.epoch, self.shard_idx, self.window_idx + 1
        if w == self.shard_windows[self.current_shard]:
            s, w = s + 1, 0
            if s == len(self.files):
                epoch, s = epoch + 1, 0
        self._enter(epoch, s, w)
        return x, y

    # -- resume
    def state(self) -> dict:
        """Where the next batch comes from, plus what must match for a resume to be exact."""
        return {"epoch": self.epoch, "shard_index": self.shard_idx, "window_index": self.window_idx,
                "shard": self.current_shard, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "B": self.B, "T": self.T, "num_shards": len(self.files),
                "rank": self.rank, "world": self.world}

    def load_state(self, state: dict) -> None:
        """Continue from state(): the next batch is the one the saved loader would have given."""
        try:
            B, T, nshards = int(state["B"]), int(state["T"]), int(state["num_shards"])
            epoch, s, w = int(state["epoch"]), int(state["shard_index"]), int(state["window_index"])
            shuffle, seed = bool(state["shuffle"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as e:
            raise LLMCError(f"dataloader state: missing or bad field ({e!r}); expected a dict "
                            f"from DataLoader.state()") from None
        if (B, T) != (self.B, self.T):
            raise LLMCError(f"dataloader state: saved with B={B} T={T}, this run has B={self.B} "
                            f"T={self.T}: resume with the same batch shape")
        # (states from before data parallel have no rank/world: a single process wrote them)
        rank, world = int(state.get("rank", 0)), int(state.get("world", 1))
        if (rank, world) != (self.rank, self.world):
            raise LLMCError(f"dataloader state: saved by rank {rank} of {world}, this is rank "
                            f"{self.rank} of {self.world}: resume with the same number of ranks")
        if nshards != len(self.files):
            raise LLMCError(f"dataloader state: saved with {nshards} shards, {self.pattern!r} now "
                            f"matches {len(self.files)}")
        if shuffle != self.shuffle:
            raise LLMCError(f"dataloader state: saved with shuffle={shuffle}, this run has "
                            f"shuffle={self.shuffle}")
        if not (epoch >= 0 and 0 <= s < nshards):
            raise LLMCError(f"dataloader state: epoch={epoch} shard_index={s} out of range")
        old_seed, self.seed = self.seed, seed
        shard = int(self._shard_order(epoch)[s])
        if not 0 <= w < self.shard_windows[shard]:
            self.seed = old_seed
            raise LLMCError(f"dataloader state: window_index={w} out of range for shard "
                            f"{self.files[shard]} ({self.shard_windows[shard]} windows)")
        self.epoch = self._windows_key = None  # make _enter redraw the orders for this seed
        self._enter(epoch, s, w)

    def __repr__(self) -> str:
        return (f"DataLoader({self.pattern!r}, B={self.B}, T={self.T}, shuffle={self.shuffle}, "
                f"rank={self.rank}/{self.world}, "
                f"seed={self.seed}: {len(self.files)} shards, {self.num_tokens:,} tokens, "
                f"{self.batches_per_epoch:,} batches per epoch)")
