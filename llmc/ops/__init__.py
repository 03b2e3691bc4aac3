"""Ops: per op family one module, holding the numpy reference and every GPU variant's launcher.

The contract every op module follows (llmc/ops/layernorm.py is the pattern):

* numpy references, pure functions named `<op>_<direction>_ref(...)`, returning their outputs
  (and whatever backward needs). They work in float32 and float64 (tests run them in float64
  against PyTorch autograd). No Python loops over tokens or channels.
* `OPS`: a list of `OpSpec`, one per op direction the model calls ("layernorm_forward",
  "layernorm_backward", ...). An OpSpec has
    - `cpu(**shape)`   -> launch(*numpy arrays): the numpy backend; writes into its output arrays
                          in place with exactly the semantics of the GPU variants (overwrite or
                          accumulate, documented per op);
    - `variants`       -> {number: Variant}; Variant.build(rt, **shape) checks the shape, fetches
                          the compiled kernels, picks grid/block, and returns
                          launch(*DevArrays, *scalars) that only launches. Nothing is looked up
                          per launch; a shape the variant can't take raises VariantRefused then;
    - `default`        -> the variant the trainer uses unless a flag says otherwise;
    - `flag`           -> the command-line flag that selects the variant (--layernorm-kernel, ...).
* Launch closures take arguments in the op's own order: outputs first, then inputs, then scalars.
  The same order for the cpu launch and every GPU variant, so the model is written once.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from llmc.errors import LLMCError, VariantRefused


@dataclass
class Variant:
    number: int
    description: str              # one line, shown by --list-kernels
    build: Callable               # build(rt, **shape) -> launch
    check: Callable | None = None  # check(**shape) -> None or a reason string (no GPU needed)
    arch: str | None = None        # the one GPU architecture it runs on ("sm_90": wgmma), or any

    def refuse_reason(self, arch: str | None = None, **shape) -> str | None:
        if self.arch and arch and arch != self.arch:
            return f"needs an {self.arch} GPU (this one is {arch})"
        return self.check(**shape) if self.check else None


@dataclass
class OpSpec:
    name: str                      # "layernorm_forward"
    cpu: Callable                  # cpu(**shape) -> launch(*np arrays)
    variants: dict[int, Variant]
    default: int
    flag: str                      # "--layernorm-kernel"
    doc: str = ""                  # argument order, shapes, overwrite/accumulate semantics

    def variant(self, number: int) -> Variant:
        v = self.variants.get(number)
        if v is None:
            have = ", ".join(str(k) for k in sorted(self.variants))
            raise LLMCError(f"{self.flag} {number}: {self.name} has no variant {number}; have {have}")
        return v

    def build(self, rt, number: int, **shape):
        v = self.variant(number)
        reason = v.refuse_reason(getattr(rt, "arch", None), **shape)
        if reason:
            raise VariantRefused(f"{self.name} variant {number} ({self.flag} {number}) refuses this shape: {reason}")
        return v.build(rt, **shape)


def check_block_size(block_size) -> str | None:
    """The common launch constraint: a block of whole warps, at most 1024 threads (None = the
    variant's own default)."""
    if block_size is not None and (block_size % 32 or not 32 <= block_size <= 1024):
        return f"block_size={block_size}: needs a multiple of 32 in [32, 1024]"
    return None


def as_view(a, shape):
    """`a` reshaped without copying: the cpu launchers write their outputs through such views, so
    a reshape that would need a copy (and silently drop the writes) raises instead."""
    import numpy as np
    return np.reshape(a, shape, copy=False)


_NOTED: set[str] = set()


def note_once(msg: str) -> None:
    """Print a fallback note the first time it occurs in this process (a model is built once per
    shape, but the trainer's sampler and the lab build many: one line each is enough)."""
    if msg not in _NOTED:
        _NOTED.add(msg)
        print(msg)


def refuse(op: str, number: int, reason: str):
    """Raise the standard refusal from inside a build function."""
    raise VariantRefused(f"{op} variant {number} refuses this shape: {reason}")


# Op family modules, in the order the model runs them. One name per op across cuda/, llmc/ops/,
# tests/ and dev/cuda/.
FAMILIES = ["encoder", "layernorm", "matmul", "attention", "gelu", "residual",
            "residual_layernorm", "classifier", "adamw", "global_norm"]

_registry: dict[str, OpSpec] | None = None


def registry() -> dict[str, OpSpec]:
    """{op name: OpSpec} over every family (imported lazily; modules not yet written are skipped
    only if they don't exist at all)."""
    global _registry
    if _registry is None:
        reg = {}
        for fam in FAMILIES:
            try:
                mod = importlib.import_module(f"llmc.ops.{fam}")
            except ModuleNotFoundError as e:
                if e.name == f"llmc.ops.{fam}":
                    continue
                raise
            for spec in getattr(mod, "OPS", []):
                reg[spec.name] = spec
        _registry = reg
    return _registry


def get(name: str) -> OpSpec:
    return registry()[name]
