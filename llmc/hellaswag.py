"""HellaSwag from llm.c's eval file: read it, pack 4 endings per example into the batch, score.

    python train_gpt2.py -e gpt2_124M.bin -h 1 -x 0          # evaluate only: val loss + HellaSwag
    python train_gpt2.py -h 1 -b 8 -v 250                    # ... and every 250 steps while training

    from llmc.hellaswag import HellaSwag
    hs = HellaSwag("dev/data/hellaswag/hellaswag_val.bin", B=4, T=1024, vocab_size=50257)
    correct, total = hs.evaluate(model)       # model: llmc.model.GPT2 built for (B, T)

The file (llm.c's dev/data/data_common.py writes it; download_starter_pack.sh fetches the 10,042
validation examples): a 256 x int32 little-endian header, [0] = 20240522 magic, [1] = 1 version,
[2] = number of examples, [3] = the longest example in bytes. Then the examples, back to back, each a
stream of uint16:
    65535                        start-of-example delimiter
    nbytes                       this example's length in bytes, the 5 fields above included
    index                        0, 1, 2, ... in file order
    label                        which ending is right (0..3)
    4                            the number of endings (llm.c only ever writes 4)
    n, n context tokens          the context, shared by the endings
    n, n ending tokens           4 times

The rule (llm.c's evalloader_stat_losses, "acc_norm" in its hellaswag.py): each ending is appended to
the context, one row of the batch per ending; the forward pass gives the loss of every position;
an ending's score is the mean loss of its own tokens (the positions from the last context token
on, each predicting the next token); the lowest score wins, the first one on a tie; an example is
right when the winner is its label. 4 rows per example, B/4 examples per forward pass, so B must be a
multiple of 4. The last batch may be partly empty; empty rows are all zeros and are not scored.
Inputs and targets past an ending are zeros: attention is causal, so they cannot change the scored
positions (llm.c leaves stale tokens there, with the same effect).
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.checkpoint import HEADER_BYTES, read_header
from llmc.errors import LLMCError

EVAL_MAGIC = 20240522
EVAL_VERSION = 1
NUM_ENDINGS = 4          # llm.c's ASSUMED_NUM_COMPLETIONS
START_EXAMPLE = 65535    # the delimiter that opens every example
DEFAULT_PATH = "dev/data/hellaswag/hellaswag_val.bin"


@dataclass
class Example:
    index: int
    label: int
    context: np.ndarray          # (n_ctx,) int32
    endings: list                # NUM_ENDINGS x (n_end,) int32


# ----------------------------------------------------------------------------------------------
# the file

def read_eval_file(path) -> list[Example]:
    """Every example of an llm.c eval file, checked field by field (one clear line on a bad file)."""
    kind = "HellaSwag eval file"
    h = read_header(path, kind, EVAL_MAGIC, (EVAL_VERSION,),
                    "llm.c's hellaswag_val.bin (./download_starter_pack.sh fetches it)")
    n_examples, longest = int(h[2]), int(h[3])
    if n_examples <= 0 or longest <= 0:
        raise LLMCError(f"{kind} {path}: header says {n_examples} examples, longest {longest} bytes "
                        f"(expected both positive: corrupt header?)")
    size = Path(path).stat().st_size - HEADER_BYTES
    if size % 2:
        raise LLMCError(f"{kind} {path}: {size:,} bytes after the header, not a whole number of uint16")
    s = np.fromfile(path, dtype="<u2", offset=HEADER_BYTES).astype(np.int64)
    out, pos = [], 0
    for i in range(n_examples):
        where = f"{kind} {path}: example {i}"
        if pos + 5 > s.size:
            raise LLMCError(f"{where}: file ends early (header says {n_examples} examples)")
        delim, nbytes, index, label, n_end = (int(v) for v in s[pos:pos + 5])
        if delim != START_EXAMPLE:
            raise LLMCError(f"{where}: starts with {delim}, expected the delimiter {START_EXAMPLE}")
        if index != i:
            raise LLMCError(f"{where}: carries index {index}, expected {i} (examples in order)")
        if nbytes % 2 or nbytes < 10 or nbytes > longest:
            raise LLMCError(f"{where}: length {nbytes} bytes (expected even, >= 10 and <= the "
                            f"header's longest example, {longest})")
        end = pos + nbytes // 2
        if end > s.size:
            raise LLMCError(f"{where}: {nbytes} bytes long, past the end of the file (truncated?)")
        if not 0 <= label < NUM_ENDINGS:
            raise LLMCError(f"{where}: label {label}, expected 0..{NUM_ENDINGS - 1}")
        if n_end != NUM_ENDINGS:
            raise LLMCError(f"{where}: {n_end} endings, expected {NUM_ENDINGS}")
        p = pos + 5
        parts = []
        for what in ["context"] + [f"ending {c}" for c in range(NUM_ENDINGS)]:
            n = int(s[p]) if p < end else 0
            if n <= 0 or p + 1 + n > end:
                raise LLMCError(f"{where}: {what} has {n} tokens, which is empty or runs past the "
                                f"example's {nbytes} bytes")
            parts.append(s[p + 1:p + 1 + n].astype(np.int32))
            p += 1 + n
        if p != end:
            raise LLMCError(f"{where}: {2 * (end - p)} bytes left over after the 4th ending")
        out.append(Example(i, label, parts[0], parts[1:]))
        pos = end
    if pos != s.size:
        raise LLMCError(f"{kind} {path}: {2 * (s.size - pos):,} bytes after the last of {n_examples} "
                        f"examples (trailing data, or a wrong count in the header)")
    return out


# ----------------------------------------------------------------------------------------------
# batches and the rule

def pack_batch(examples: list[Example], B: int, T: int):
    """Examples (at most B/4) -> inputs (B,T) int32, targets (B,T) int32, mask (B,T) bool, labels.

    Row 4e+c holds example e's context followed by its ending c. The ending's tokens are predicted
    at positions len(context)-1 ... len(context)+len(ending)-2, where mask is True."""
    x = np.zeros((B, T), np.int32)
    y = np.zeros((B, T), np.int32)
    mask = np.zeros((B, T), bool)
    for e, ex in enumerate(examples):
        nc = ex.context.size
        for c, ending in enumerate(ex.endings):
            row = NUM_ENDINGS * e + c
            ne = ending.size
            x[row, :nc] = ex.context
            x[row, nc:nc + ne] = ending
            y[row, nc - 1:nc - 1 + ne] = ending
            mask[row, nc - 1:nc - 1 + ne] = True
    return x, y, mask, [ex.label for ex in examples]


def score_batch(losses: np.ndarray, mask: np.ndarray, labels: list[int]) -> int:
    """How many examples the per-position losses (B,T) get right, by llm.c's rule."""
    correct = 0
    for e, label in enumerate(labels):
        best, best_loss = -1, 0.0
        for c in range(NUM_ENDINGS):
            row = NUM_ENDINGS * e + c
            sel = losses[row][mask[row]].astype(np.float32)
            # llm.c adds the losses one by one in fp32 and divides by the count; cumsum adds in that
            # order (np.sum would add pairwise), so near-ties break exactly as they do in llm.c
            mean = np.cumsum(sel, dtype=np.float32)[-1] / np.float32(sel.size)
            if c == 0 or mean < best_loss:   # strictly lower: the first of equal scores wins
                best, best_loss = c, mean
        correct += int(best == label)
    return correct


# ----------------------------------------------------------------------------------------------
# evaluation with a model

class HellaSwag:
    def __init__(self, path, B: int, T: int, vocab_size: int):
        if B % NUM_ENDINGS:
            raise LLMCError(f"-h/--hellaswag 1: batch size B={B} is not a multiple of {NUM_ENDINGS} "
                            f"(each example's {NUM_ENDINGS} endings go in {NUM_ENDINGS} rows of a batch)")
        self.path, self.B, self.T = str(path), B, T
        self.examples = read_eval_file(path)
        longest = max(ex.context.size + max(e.size for e in ex.endings) for ex in self.examples)
        if longest > T:
            raise LLMCError(f"{path}: the longest example has {longest} tokens (context + ending), more "
                            f"than T={T}: run with -t {longest} or more")
        top = max(max(int(ex.context.max()), *(int(e.max()) for e in ex.endings)) for ex in self.examples)
        if top >= vocab_size:
            raise LLMCError(f"{path}: token id {top} is outside the model's vocabulary of {vocab_size}")
        self.per_batch = B // NUM_ENDINGS

    @property
    def num_examples(self) -> int:
        return len(self.examples)

    @property
    def num_batches(self) -> int:
        return -(-self.num_examples // self.per_batch)

    def evaluate(self, model, progress: bool = True, rank: int = 0, world: int = 1) -> tuple[int, int]:
        """(correct, total) over every example, through model.forward (the training kernels).
        progress: a `evaluating HellaSwag: i/N` line rewritten in place, as llm.c prints it.
        Data parallel (as llm.c splits it): rank r of `world` scores batches r, r+world, ...; the
        count it returns is its own (the caller sums over ranks), the total is every example."""
        correct = 0
        n = self.per_batch
        for i in range(rank, self.num_batches, world):
            if progress and i % 10 == 0:
                print(f"evaluating HellaSwag: {i}/{self.num_batches}", end="\r", flush=True)
            x, y, mask, labels = pack_batch(self.examples[i * n:(i + 1) * n], self.B, self.T)
            correct += score_batch(token_losses(model, x, y), mask, labels)
        if progress:
            print(" " * 40, end="\r")
        return correct, self.num_examples

    def run(self, model, group=None) -> float:
        """evaluate() and print llm.c's line; returns the accuracy. group (llmc.dist.Group): under
        mpirun each rank scores its share of the batches and the counts are summed."""
        t0 = time.perf_counter()
        rank, world = (group.rank, group.world) if group is not None else (0, 1)
        correct, total = self.evaluate(model, progress=sys.stdout.isatty(), rank=rank, world=world)
        if world > 1:
            correct = sum(group.allgather(correct))
        acc = correct / total
        print(f"HellaSwag: {correct}/{total} = {acc:f}")   # llm.c's line, to the character
        print(f"(HellaSwag: {total:,} examples in {self.num_batches:,} forward passes of B={self.B} "
              f"T={self.T}, {time.perf_counter() - t0:.1f} s)")
        return acc


def token_losses(model, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The model's per-position cross-entropy losses (B,T) for inputs x and targets y: one forward
    pass without gradients (the dlogits are not written), and one download of B*T floats."""
    model.forward(x, y, grad=False, read_loss=False)
    B, T = x.shape
    return model.be.download(model.a["losses"]).reshape(-1)[:B * T].reshape(B, T)


def open_hellaswag(flag: int, path, B: int, T: int, vocab_size: int) -> HellaSwag | None:
    """The trainer's -h/--hellaswag: None for 0, the loaded eval set for 1."""
    if flag not in (0, 1):
        raise LLMCError(f"-h/--hellaswag {flag}: expected 0 (off) or 1 (evaluate HellaSwag)")
    return HellaSwag(path, B, T, vocab_size) if flag else None
