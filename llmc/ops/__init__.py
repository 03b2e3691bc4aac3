"""Ops: per op family one module, holding the numpy reference and every GPU variant's launcher.

docs/architecture.md walks through adding a variant. The contract every op module follows
(llmc/ops/layernorm.py is the pattern):

* numpy references, pure functions named `<op>_ref(...)`, returning their outputs (and whatever
  backward needs). They work in float32 and float64 (tests run them in float64 against PyTorch
  autograd). No Python loops over tokens or channels.
* `OPS`: a list of `OpSpec`, one per op the model (or the decoder) calls ("layernorm_forward",
  "layernorm_backward", "attention_decode", ...). An OpSpec has
    - `cpu(**shape)`   -> launch(*numpy arrays): the numpy backend; writes into its output arrays
                          in place with exactly the semantics of the GPU variants (overwrite or
                          accumulate, documented per op);
    - `variants`       -> {number: Variant}; a Variant's build(rt, **shape) checks the shape, fetches
                          the compiled kernels, picks grid/block, allocates its scratch and returns
                          launch(*DevArrays, *scalars) that only launches (or a `Built` when it has
                          more to say). Nothing is looked up per launch;
    - `default`, `flag` -> the variant used unless `flag` (--layernorm-kernel, ...) names another;
    - the op's rules, declared here and resolved generically by the backends, the model, the lab
      and the profiler: `pair` (forward/backward ops whose numbers go together), `saves` (what a
      forward keeps for its backward), `options` (boolean shape keys only some variants take, like
      matmul_forward's gelu epilogue), `cost` (FLOPs and bytes of one call in a build's element type, for the lab and the profile).
* A Variant declares its own: the shape check (`check`, no GPU needed), the element types it has
  kernels for (`dtypes`; a build for another dtype refuses), the ops it is built from (`uses`: the
  composite attention takes the softmax and matmul variants chosen for those ops), the ops whose
  flag selects it (`selected_by`), the GEMM engine it runs on (`engine`), what it saves for
  backward if it differs from the op's (`saves`), the scratch bytes its build allocates
  (`scratch_bytes`) and the one GPU architecture it runs on, if it is tied to one (`arch`: wgmma is sm_90).
* Launch closures take arguments in the op's own order: outputs first, then inputs, then scalars.
  The same order for the cpu launch and every GPU variant, so the model is written once.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

from llmc.errors import LLMCError, VariantRefused

# Element types a build can be asked for. Every variant has fp32 kernels today; a bf16 kernel of
# variant n is declared beside the fp32 one (Variant(n, ..., build={"fp32": f, "bf16": g})), same
# number, same flag, so the lab and the tests pick it up without a parallel table.
DTYPES = ("fp32", "bf16")


@dataclass
class Built:
    """What building one op at one shape gives: the launch closure and what the rest of the program
    needs to know about it (typed fields, not attributes hung on the closure)."""
    launch: Callable                         # launch(*outputs, *inputs, *scalars): only launches
    op: str = ""                             # "attention_forward"
    number: int = 0                          # the variant that was built (0: the numpy reference)
    dtype: str = "fp32"
    shape: dict = field(default_factory=dict)  # the shape it was built for (the profile's cost model)
    saved_shape: tuple | None = None         # what a forward keeps for its backward (and a backward needs)
    scratch: dict = field(default_factory=dict)  # {name: DevArray} allocated by the build
    keep: frozenset = frozenset()            # scratch names whose contents persist between launches
    plan: tuple | None = None                # GEMM plans, (engine, config, splits) each: for the lab
    info: dict = field(default_factory=dict)  # anything else a lab script prints (e.g. sample's staging)
    flush: Callable | None = None            # a deferred form's completion (layernorm_backward 5's and 7's deferred=S)
    pool: dict | None = None                 # its Runtime.scratch buffers (the cuda backend's builds): a build
                                             # that never runs at the same time may share them (scratch_pool)
    host_inputs: tuple | None = None         # (prep, buf): what the launch reads from buf is prep(the batch's
                                             # ids (B, T)), computed on the host and uploaded with each batch
                                             # (the model's set_batch; put_host_inputs for tests and the lab)

    def __call__(self, *args):
        return self.launch(*args)

    def put_host_inputs(self, *host_args) -> None:
        """Upload host_inputs' array for these host arguments (the batch's ids), synchronously: the
        tests' and the lab's way; the model uploads it asynchronously beside the batch."""
        if self.host_inputs is not None:
            prep, buf = self.host_inputs
            buf.set(prep(*host_args))


def _as_built(x, op: str, number: int, dtype: str, shape: dict, saved_shape) -> Built:
    """A build function's result as a Built: a bare launch closure, or the Built it returned with
    the registry's facts filled in."""
    b = x if isinstance(x, Built) else Built(x)
    b.op, b.number, b.dtype, b.shape = op, number, dtype, shape
    if b.saved_shape is None:
        b.saved_shape = saved_shape
    return b


@dataclass
class Variant:
    number: int
    description: str              # one line, shown by --list-kernels
    build: Callable | dict        # build(rt, **shape) -> launch or Built; or {dtype: build}
    check: Callable | dict | None = None  # check(**shape) -> None or a reason (no GPU needed); or {dtype: check}
    options: tuple = ()           # the op's boolean options this variant takes (e.g. ("gelu",))
    uses: dict = field(default_factory=dict)   # {build kwarg: op}: built from those ops' chosen variants
    selected_by: tuple = ()       # ops whose flag, named alone, selects this variant (they run inside it)
    engine: int | None = None     # the strided-batched GEMM engine (llmc/ops/gemm.py: ENGINES) that goes
                                  # with this matmul variant: the one it runs on, or, for a variant with its
                                  # own kernels or on an engine that can't batch (wgmma), the one the
                                  # composite attention's batched products use when it is chosen
    saves: Callable | None = None  # saves(**shape) -> shape kept for backward, when not the op's
    scratch_bytes: Callable | None = None  # scratch_bytes(**shape, dtype=...) -> bytes its build for dtype allocates
    arch: str | None = None       # the one GPU architecture it runs on ("sm_90": wgmma), or any

    def __post_init__(self):
        self.builds = dict(self.build) if isinstance(self.build, dict) else {"fp32": self.build}
        for dt in self.builds:
            if dt not in DTYPES:
                raise ValueError(f"variant {self.number}: unknown dtype {dt!r}; have {', '.join(DTYPES)}")

    @property
    def dtypes(self) -> tuple:
        return tuple(self.builds)

    def refuse_reason(self, arch: str | None = None, *, dtype: str = "fp32", **shape) -> str | None:
        """Why this variant can't take `shape` on a GPU of `arch` (None: unknown, not checked) in element
        type `dtype` (a dict `check` holds one check per dtype: a bf16 build may need other alignments)."""
        if self.arch and arch and arch != self.arch:
            return f"needs an {self.arch} GPU (this one is {arch})"
        check = self.check.get(dtype) if isinstance(self.check, dict) else self.check
        return check(**shape) if check else None


@dataclass
class OpSpec:
    name: str                      # "layernorm_forward"
    cpu: Callable                  # cpu(**shape) -> launch(*np arrays)
    variants: dict[int, Variant]
    default: int
    flag: str                      # "--layernorm-kernel"
    doc: str = ""                  # argument order, shapes, overwrite/accumulate semantics
    pair: str | None = None        # the other direction whose variant number must match (attention)
    saves: Callable | None = None  # saves(**shape) -> what forward keeps for backward (the cpu's; variants may differ)
    options: tuple = ()            # boolean shape keys that only some variants take (Variant.options)
    defaults: dict = field(default_factory=dict)  # {dtype: variant}: a dtype whose default differs
                                   # (encoder_backward in bf16: no atomic build, a deterministic default)
    cost: Callable | None = None   # cost(dtype="fp32", **shape) -> (flops, bytes) of one call in that
                                   # element type (esize(dtype) bytes an element; fp32-only tensors 4)

    @property
    def family(self) -> str:
        """The family name: cuda/<family>.cu, llmc/ops/<family>.py, tests/test_<family>.py."""
        for suffix in ("_backward_bias", "_forward", "_backward", "_decode", "_kv_fill"):
            if self.name.endswith(suffix):
                return self.name[:-len(suffix)]
        return self.name

    def default_for(self, dtype: str = "fp32") -> int:
        """The variant used for a build in `dtype` unless the user names one."""
        return self.defaults.get(dtype, self.default)

    def variant(self, number: int) -> Variant:
        v = self.variants.get(number)
        if v is None:
            have = ", ".join(str(k) for k in sorted(self.variants))
            raise LLMCError(f"{self.flag} {number}: {self.name} has no variant {number}; have {have}")
        return v

    def refuse_reason(self, number: int, dtype: str = "fp32", arch=None, **shape) -> str | None:
        """Why variant `number` can't take this call (None if it can): the dtype, the GPU, an option
        it lacks, then its own shape check."""
        v = self.variant(number)
        if dtype not in v.builds:
            return f"no {dtype} kernels (has {', '.join(v.dtypes)})"
        for opt in self.options:
            if shape.get(opt) and opt not in v.options:
                return f"has no {opt} option"
        return v.refuse_reason(arch, dtype=dtype, **{k: s for k, s in shape.items() if k not in self.options or s})

    def saved_shape(self, number: int | None, **shape) -> tuple | None:
        """What variant `number` (None: the numpy reference) keeps for backward, or needs from forward."""
        f = self.variants[number].saves if number is not None and self.variants[number].saves else self.saves
        return tuple(f(**shape)) if f else None

    def build(self, rt, number: int, dtype: str = "fp32", **shape) -> Built:
        """Variant `number` built at `shape` for element type `dtype`; VariantRefused (naming the op,
        the variant, the flag and the reason) when it can't take them."""
        v = self.variant(number)
        reason = self.refuse_reason(number, dtype, getattr(rt, "arch", None), **shape)
        if reason:
            raise VariantRefused(f"{self.name} variant {number} ({self.flag} {number}) refuses this shape: {reason}")
        kw = {k: s for k, s in shape.items() if k not in self.options or s}  # options a variant lacks are False
        out = v.builds[dtype](rt, **kw)
        dims = {k: s for k, s in shape.items() if k not in v.uses}
        return _as_built(out, op=self.name, number=number, dtype=dtype, shape=dims,
                         saved_shape=self.saved_shape(number, **dims))

    def build_cpu(self, **shape) -> Built:
        """The numpy backend's launcher, typed like a GPU build."""
        return Built(self.cpu(**shape), op=self.name, number=0, shape=dict(shape),
                     saved_shape=self.saved_shape(None, **shape))


def check_block_size(block_size) -> str | None:
    """The common launch constraint: a block of whole warps, at most 1024 threads (None = the
    variant's own default)."""
    if block_size is not None and (block_size % 32 or not 32 <= block_size <= 1024):
        return f"block_size={block_size}: needs a multiple of 32 in [32, 1024]"
    return None


def check_elementwise(N, block_size=None) -> str | None:
    """An elementwise op's shape check (gelu, residual): any N elements, whole warps."""
    return check_block_size(block_size)


def check_elementwise_float4(N, block_size=None) -> str | None:
    """An elementwise op's vector variants: N a multiple of 4 (float4 loads), whole warps."""
    if N % 4:
        return f"N={N} is not a multiple of 4 (float4 loads)"
    return check_block_size(block_size)


def as_view(a, shape):
    """`a` reshaped without copying: the cpu launchers write their outputs through such views, so
    a reshape that would need a copy (and silently drop the writes) raises instead."""
    import numpy as np
    return np.reshape(a, shape, copy=False)


def ptr(x) -> int:
    """The device address of a DevArray, or x itself when it is already an address (None: 0)."""
    return 0 if x is None else int(x if isinstance(x, int) else getattr(x, "ptr", x))


def nbytes(shape, itemsize: int = 4) -> int:
    return int(math.prod(shape)) * itemsize


def esize(dtype: str = "fp32") -> int:
    """Bytes of one element of a build's element type: what a cost model counts per element of the
    tensors that follow the build's dtype (bf16: 2). The tensors that stay fp32 in a bf16 build
    (BF16_CONVENTIONS: layernorm mean/rstd, attention lse, classifier losses, global_norm norm2, AdamW
    m, v, master weights) count 4 in both."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; have {', '.join(DTYPES)}")
    return 2 if dtype == "bf16" else 4


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


# Op family modules, in the order the model runs them (the order of --list-kernels). One name per
# op across cuda/, llmc/ops/, tests/ and dev/cuda/.
FAMILIES = ["encoder", "layernorm", "matmul", "softmax", "attention", "gelu", "residual",
            "residual_layernorm", "classifier", "adamw", "global_norm", "sample"]

_registry: dict[str, OpSpec] | None = None


def registry() -> dict[str, OpSpec]:
    """{op name: OpSpec} over every family, in FAMILIES order."""
    global _registry
    if _registry is None:
        reg = {}
        for fam in FAMILIES:
            mod = importlib.import_module(f"llmc.ops.{fam}")
            for spec in mod.OPS:
                reg[spec.name] = spec
        _registry = reg
    return _registry


def get(name: str) -> OpSpec:
    return registry()[name]
