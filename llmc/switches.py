"""The LLMC_* environment switches: one table of them, and the only place that reads them.

Each switch is an A/B for a measurement (a fusion, a schedule, a tile) or a setting of the machine
(the kernel cache, the multi-GPU watchdog). The code asks for one by name (`on`, `flag`, `value`,
`number`); the value is checked here, so a mistyped value is one line naming the variable and what
it takes, never silently the default. An empty value is the same as unset. The trainer and the
sampler check the whole environment at start (`check_environment`): every LLMC_* value that is set,
whether or not this run reads it, and a note for a name that is not a switch (LLMC_GRAPH: did you
mean LLMC_GRAPHS?). README's "Switches" table is this table (`python -m llmc.switches` prints it;
tests/test_switches.py keeps the two equal).
"""
from __future__ import annotations

import difflib
import os
import re
import sys
from dataclasses import dataclass

from llmc.errors import LLMCError


@dataclass(frozen=True)
class Switch:
    name: str
    kind: str            # "flag" (0 / 1), "choice", "int", "float", "widths", "defines", "path"
    unset: str           # what leaving it unset does (README's table)
    what: str            # what setting it does, one line
    default: object = None  # the value when unset (None: the run decides, or nothing)
    choices: tuple = ()  # kind "choice"
    minimum: float | None = None  # kinds "int" / "float": the smallest value taken
    above: bool = False  # ... and whether it must be strictly above it
    expect: str = ""     # what the error line says is expected (numbers)
    group: str = "run"   # README's grouping: run, model, attention, gemm, multi-GPU

    def expected(self) -> str:
        if self.kind == "flag":
            return "0 or 1"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        return self.expect

    def parse(self, raw: str):
        """The checked value of a non-empty string, or LLMCError naming the variable."""
        if self.kind == "flag":
            if raw in ("0", "1"):
                return raw == "1"
        elif self.kind == "choice":
            if raw in self.choices:
                return raw
        elif self.kind in ("int", "float"):
            try:
                v = int(raw) if self.kind == "int" else float(raw)
            except ValueError:
                v = None
            if v is not None and v == v and (self.minimum is None or v > self.minimum
                                             or (v == self.minimum and not self.above)):
                return v
        elif self.kind == "widths":  # any separator but a comma works too ("128:192" in bench_ab's --env)
            try:
                return tuple(int(w) for w in re.split(r"[,:/ ]+", raw.strip()))
            except ValueError:
                pass
        elif self.kind == "defines":  # (llmc.runtime.parse_defines checks that each module exists)
            define_items(raw.split(), self.name)
            return raw
        else:  # "path"
            return raw
        raise LLMCError(f"{self.name}={raw!r}: expected {self.expected()}")


def define_items(items, source: str) -> dict:
    """`MODULE:NAME=VALUE` strings (the lab's --define, or LLMC_DEFINES split at spaces) -> {module: {NAME:
    VALUE}}; a malformed item: LLMCError naming `source`."""
    out: dict = {}
    for item in items or ():
        mod, _, rest = item.partition(":")
        name, eq, val = rest.partition("=")
        if not (mod and name and eq and val) or not name.replace("_", "").isalnum():
            raise LLMCError(f"{source} {item!r}: expected MODULE:NAME=VALUE, e.g. encoder:ENC7_COMB_BATCH=8")
        out.setdefault(mod, {})[name] = val
    return out


def _flag(name, default, unset, what, group):
    return Switch(name, "flag", unset, what, default=default, group=group)


_TABLE = [
    # the run
    Switch("LLMC_CACHE", "path", "~/.cache/llmc", "the directory of the compiled kernels (cubins)"),
    _flag("LLMC_SYNC", False, "0", "synchronise after every launch, so an asynchronous fault names the op and "
          "variant that caused it (also turns the CUDA graphs off)", "run"),
    _flag("LLMC_GRAPHS", True, "1", "0: no CUDA graphs (the training step and each decode step are otherwise "
          "captured after their first run and replayed)", "run"),
    _flag("LLMC_PDL", None, "the decode step's graph, and the training graphs of micro-steps of at most 4096 "
          "tokens", "1 / 0: every graph, or none, captured with programmatic dependent launches (same bits)",
          "run"),
    _flag("LLMC_PIPELINE_STEPS", None, "1 with the cuda backend, 0 with numpy", "1: each step's loss and norm "
          "are read after the next step is launched (the same printed lines)", "run"),
    Switch("LLMC_DEFINES", "defines", "none", "builds cuda/MODULE.cu with -DNAME=VALUE (a kernel's tunable macro, "
           "e.g. `encoder:ENC7_COMB_BATCH=8`)"),
    _flag("LLMC_OFFLINE", False, "0", "1: the tokenizer never downloads its files (the package ships them)",
          "run"),
    # the model's fusions
    _flag("LLMC_QKV_IN_PLACE", True, "1", "0: attention permutes q, k, v out of the qkv GEMM's output instead "
          "of reading them in place", "model"),
    _flag("LLMC_FUSED_BIAS", True, "1", "0: the bias gradients of attproj, fcproj and fc in their own "
          "matmul_backward_bias passes, not in layernorm_backward / gelu_backward", "model"),
    _flag("LLMC_FUSED_GELU", False, "0", "1: the fc GEMM's epilogue writes the GELU (no gelu_forward launch)",
          "model"),
    _flag("LLMC_FUSED_DGELU", None, "1 in fp32, 0 in bf16", "1 / 0: gelu_backward inside fcproj's dinp GEMM "
          "(where GELU is not recomputed in gelu_backward: -r 0 or LLMC_FUSED_GELU_RECOMPUTE=0)", "model"),
    _flag("LLMC_FUSED_GELU_RECOMPUTE", True, "1", "0: with -r 1 / 2, GELU recomputed in its own pass, not in "
          "gelu_backward's", "model"),
    _flag("LLMC_CLASSIFIER_FOLD", True, "1", "0: the training step's classifier as its own pass over the logits "
          "(the lm head GEMM writes them, the classifier kernel reads them and writes dlogits), not folded into the "
          "lm head's GEMMs", "model"),
    _flag("LLMC_SIDE_STREAM", True, "1", "0: the backward's weight-gradient GEMMs on the one stream, not on a "
          "second one beside the critical path (same bits)", "model"),
    _flag("LLMC_FIRST_WRITE", True, "1", "0: zero_grad() clears every gradient and the first micro-step's "
          "dweight GEMMs add onto it, instead of writing it", "model"),
    _flag("LLMC_LN_DEFERRED", True, "1", "0: each fused layernorm backward finishes its column sums itself, "
          "not in one flush at the end of the backward", "model"),
    _flag("LLMC_SHARE_SCRATCH", True, "1", "0: the forward's and the backward's one-layer scratch buffers and "
          "the backward builds' scratch in memory of their own, not in the logits' buffer outside the lm head", "model"),
    _flag("LLMC_ATT5_SIDE_ZERO", False, "0", "1: bf16 attention_backward 5's dq accumulator zeroed on the side "
          "stream, not in its prep pass", "model"),
    # attention
    _flag("LLMC_TF32_SMEM_TRANSPOSE", None, "shared memory where the copies would not fit in the L2 and the DRAM is below 4 TB/s",
          "1 / 0: fp32 attention 4 transposes in shared memory, or in passes over global memory",
          "attention"),
    _flag("LLMC_TF32_PINGPONG", True, "1", "0: fp32 attention 4's forward without its consumers' turns",
          "attention"),
    _flag("LLMC_TF32_PERSISTENT", True, "1", "0: fp32 attention 4's forward one CTA per item, not persistent",
          "attention"),
    Switch("LLMC_ATT_BWD_STAGES", "choice", "2", "the bf16 attention backward's k/v ring depth",
           choices=("2", "3", "4"), group="attention"),
    _flag("LLMC_ATT5_MAIN_ZERO", False, "0", "1: bf16 attention_backward 5's dq accumulator zeroed by its main "
          "kernel, each head's rows just before the reductions into them, not by its prep pass", "attention"),
    Switch("LLMC_ATT5_HEAD_GROUP", "int", "heads whose dq rows take 1/16 of the L2",
           "bf16 attention_backward 5's heads per group", minimum=1, expect="a number of heads >= 1",
           group="attention"),
    # GEMM engine 5 (wgmma)
    Switch("LLMC_WGMMA_SCHEDULE", "choice", "coop (with the PP128 swaps below)", "pingpong / auto: the forward "
           "and dinp GEMMs on the ping-pong instances, or by the planner's estimates", choices=("coop", "pingpong",
           "auto"), group="gemm"),
    _flag("LLMC_WGMMA_PP128", False, "0", "1: bf16 plans of the 256-wide TMA-store tile run as 128 x 128 "
          "ping-pong, not cooperative (the default before session 41)", "gemm"),
    _flag("LLMC_WGMMA_BT256", True, "1", "0: the bf16 dinp GEMMs (B N-major) never plan the 256-wide TMA-store "
          "tile", "gemm"),
    _flag("LLMC_WGMMA_MN256", True, "1", "0: the bf16 dweight GEMMs (A and B transposed) never plan the 256-wide "
          "TMA-store tile", "gemm"),
    _flag("LLMC_WGMMA_FOLD256", False, "0", "1: the bf16 lm head's forward with the classifier folded in on the "
          "cooperative 128 x 256 TMA-store tile (else the 128 x 128 ping-pong one)", "gemm"),
    _flag("LLMC_WGMMA_TS256_S4", False, "0", "1: the bf16 forward's and dinp's 256-wide TMA-store plans on the "
          "4-stage instances that store the tile in two slices (session 44, with stmatrix: B=16 steps +0.3%)", "gemm"),
    Switch("LLMC_WGMMA_TS256_MAX_K", "int", "no limit", "the largest K whose plans may take the 256-wide "
           "TMA-store tile (3 stages; 1024 before session 41)", minimum=1, expect="an integer K >= 1", group="gemm"),
    _flag("LLMC_WGMMA_TF32_PP128", True, "1", "0: tf32 plans stay cooperative, not 128 x 128 ping-pong",
          "gemm"),
    Switch("LLMC_WGMMA_SPLIT_OVER_TS", "float", "2", "an accumulating GEMM runs split over K only where the "
           "split's estimate is under 1/this of one split's with the TMA store (0: wherever the planner splits)",
           minimum=0, expect="a ratio of estimates >= 0", group="gemm"),
    _flag("LLMC_WGMMA_N160", None, "alone, one K split and K >= 4096", "1 / 0: the bf16 dweights' 128 x 160 "
          "tile in any one-split plan, or never", "gemm"),
    _flag("LLMC_WGMMA_MC", False, "0", "1: the bf16 TMA-store plans built for it (the dweights', the 256-wide "
          "forward and dinp tiles) on clusters of two CTAs sharing B by TMA multicast", "gemm"),
    Switch("LLMC_WGMMA_TS_MAX_K", "int", "4096 for fp32 output, no limit for bf16", "the largest K that takes "
           "the TMA-store epilogue", expect="an integer K", group="gemm"),
    _flag("LLMC_WGMMA_TS_BETA", True, "1", "0: the accumulating dweight GEMMs on direct stores, not the TMA "
          "store", "gemm"),
    Switch("LLMC_WGMMA_TS_WIDTHS", "widths", "every built width", "the tile widths the planner may take for the "
           "TMA store, e.g. `128:192`", expect="tile widths such as 128,192", group="gemm"),
    # many GPUs
    _flag("LLMC_MPI", False, "MPI when a launcher's variables are set", "1: start MPI under a launcher this "
          "project does not recognise", "multi-GPU"),
    Switch("LLMC_DIST_TIMEOUT", "float", "120", "seconds a rank waits for the others before the watchdog stops "
           "the job", minimum=0, above=True, expect="a positive number of seconds",
           group="multi-GPU"),
    Switch("LLMC_DP_LAUNCH", "choice", "attention", "layer: a layer's gradient reductions start as soon as its "
           "backward is launched, not beside the next layer's attention backward", default="attention", choices=("attention", "layer"),
           group="multi-GPU"),
    Switch("LLMC_DP_GATHER", "choice", "update", "forward: -z 1's all-gather under the next forward, layer by "
           "layer (slower; no graph)", default="update", choices=("forward", "update"), group="multi-GPU"),
    _flag("LLMC_DP_GRAPH", True, "1", "0: the reducing micro-step launched kernel by kernel, not as a graph",
          "multi-GPU"),
]
SWITCHES = {s.name: s for s in _TABLE}
GROUPS = ("run", "model", "attention", "gemm")


def _switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:  # a programming error: every switch the code reads is in the table
        raise KeyError(f"{name} is not in llmc/switches.py's table") from None


def value(name: str):
    """The switch's checked value (a bool for flags, an int / float / str / tuple by kind); its table
    default when unset or empty (None where the run decides)."""
    s = _switch(name)
    raw = os.environ.get(name, "")
    return s.parse(raw) if raw else s.default


def flag(name: str) -> bool | None:
    """A 0 / 1 switch: True / False when set, None when unset (the caller's default)."""
    s = _switch(name)
    assert s.kind == "flag", name
    raw = os.environ.get(name, "")
    return s.parse(raw) if raw else None


def on(name: str) -> bool:
    """A 0 / 1 switch with a fixed default (the table's)."""
    s = _switch(name)
    assert s.kind == "flag" and isinstance(s.default, bool), name
    got = flag(name)
    return s.default if got is None else got


def check_environment(environ=None, out=None, notes: bool = True) -> None:
    """At start: every LLMC_* switch that is set must hold a value it takes (LLMCError, one line); a
    name that is not a switch gets a note on `out` (stderr), with the nearest switch's name."""
    environ = os.environ if environ is None else environ
    for name in sorted(environ):
        if not name.startswith("LLMC_") or not environ[name]:
            continue
        s = SWITCHES.get(name)
        if s is not None:
            s.parse(environ[name])
            continue
        if not notes:
            continue
        near = difflib.get_close_matches(name, SWITCHES, n=1, cutoff=0.8)
        hint = f" (did you mean {near[0]}?)" if near else ""
        print(f"note: {name} is not one of llmc's switches{hint}; it changes nothing "
              f"(python -m llmc.switches lists them)", file=out or sys.stderr)


def markdown() -> str:
    """README's table of the switches."""
    rows = ["| switch | takes | unset | what setting it does |", "| --- | --- | --- | --- |"]
    for g in GROUPS:
        for s in _TABLE:
            if s.group == g:
                takes = s.expected() if s.kind in ("flag", "choice") else {
                    "path": "a directory", "defines": "`MODULE:NAME=VALUE ...`"}.get(s.kind, s.expect)
                rows.append(f"| `{s.name}` | {takes} | {s.unset} | {s.what} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
