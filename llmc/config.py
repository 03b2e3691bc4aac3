"""GPT-2 model configuration and llm.c's parameter layout.

    from llmc.config import GPT2Config, config_from_name, param_shapes
    cfg = config_from_name("d12")        # GPT-2 124M shape: L=12, C=768, NH=12
    cfg = config_from_name("L2C64H2")    # a small explicit one: 2 layers, 64 channels, 2 heads
    [(name, shape), ...] = param_shapes(cfg)   # llm.c's 16 tensors, in file order
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from llmc.errors import LLMCError

GPT2_VOCAB = 50257
GPT2_VOCAB_PADDED = 50304  # padded to a multiple of 128 for nicer kernels; rows V..Vp-1 are never used
GPT2_MAX_T = 1024


@dataclass(frozen=True)
class GPT2Config:
    max_seq_len: int = GPT2_MAX_T        # maxT
    vocab_size: int = GPT2_VOCAB         # V
    padded_vocab_size: int = GPT2_VOCAB_PADDED  # Vp
    num_layers: int = 12                 # L
    num_heads: int = 12                  # NH
    channels: int = 768                  # C

    def __post_init__(self):
        if self.channels % self.num_heads != 0:
            raise LLMCError(f"model config: channels {self.channels} not divisible by heads {self.num_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise LLMCError(f"model config: padded vocab {self.padded_vocab_size} < vocab {self.vocab_size}")

    @property
    def head_size(self) -> int:
        return self.channels // self.num_heads

    @property
    def num_parameters(self) -> int:
        return sum(size for _, _, size in param_layout(self))

    def describe(self) -> str:
        return (f"L={self.num_layers} C={self.channels} NH={self.num_heads} maxT={self.max_seq_len} "
                f"V={self.vocab_size} Vp={self.padded_vocab_size} params={self.num_parameters:,}")


# llm.c's descriptors: dN is N layers with GPT-2's width for that depth
DESCRIPTORS = {
    "d6": (6, 384, 6),
    "d12": (12, 768, 12),
    "d24": (24, 1024, 16),
    "d36": (36, 1280, 20),
    "d48": (48, 1600, 25),
}


def config_from_name(name: str) -> GPT2Config:
    """A config from an llm.c descriptor (d6..d48) or an explicit L<layers>C<channels>H<heads>."""
    if name in DESCRIPTORS:
        L, C, NH = DESCRIPTORS[name]
        return GPT2Config(num_layers=L, channels=C, num_heads=NH)
    m = re.fullmatch(r"L(\d+)C(\d+)H(\d+)", name)
    if m:
        L, C, NH = (int(g) for g in m.groups())
        if L < 1 or C < 1 or NH < 1:
            raise LLMCError(f"model descriptor {name}: layers, channels and heads must be positive")
        return GPT2Config(num_layers=L, channels=C, num_heads=NH)
    raise LLMCError(f"model descriptor {name!r}: expected a checkpoint file, one of "
                    f"{', '.join(DESCRIPTORS)}, or L<layers>C<channels>H<heads> such as L2C64H2")


PARAM_NAMES = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"]
# the 2-D weight matrices: AdamW's weight decay applies to these only
DECAYED = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}


def param_shapes(cfg: GPT2Config) -> list[tuple[str, tuple]]:
    """llm.c's 16 parameter tensors in file order; per-layer tensors are stacked over L."""
    Vp, C, L, maxT = cfg.padded_vocab_size, cfg.channels, cfg.num_layers, cfg.max_seq_len
    return [
        ("wte", (Vp, C)), ("wpe", (maxT, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)),
        ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)),
        ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)),
        ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
        ("lnfw", (C,)), ("lnfb", (C,)),
    ]


def param_layout(cfg: GPT2Config) -> list[tuple[str, int, int]]:
    """[(name, offset, size)] in elements into the flat parameter buffer."""
    out, off = [], 0
    for name, shape in param_shapes(cfg):
        size = 1
        for s in shape:
            size *= s
        out.append((name, off, size))
        off += size
    return out


def llmc_train_bytes(cfg: GPT2Config, B: int, T: int, recompute: int = 1, cudnn: bool = True) -> dict[str, int]:
    """The bytes llm.c's bf16 trainer (train_gpt2.cu, master weights on, single GPU) allocates on the
    device for this model and batch, by part, from the sizes of its tensors; for comparing memory at the
    same settings (issue 13), since llm.c itself is not run here. Parameters and their gradients in
    bf16; AdamW's m and v and the master weights in fp32; its 21 activation tensors (bf16 but the
    layernorm statistics, the losses and cuDNN's per-row softmax statistics, fp32) with its recompute
    rule: -r 1 keeps one layer's GELU output, -r 2 keeps no layernorm output (it recomputes into
    another buffer); its (B, T, max(3C, NH*T, Vp)) output buffer; without cuDNN the (L, B, NH, T, T)
    attention matrix instead of the statistics. Plus cuBLASLt's 32 MiB workspace and the (B, T) inputs
    and targets. Not counted: cuDNN's own workspace (sized by cuDNN at run time) and the CUDA context
    with the cuBLAS and cuDNN libraries, which the device's memory-in-use figure includes."""
    L, C, NH, Vp = cfg.num_layers, cfg.channels, cfg.num_heads, cfg.padded_vocab_size
    N, P = B * T, cfg.num_parameters
    ln = L * N * C if recompute < 2 else 0
    bf16 = {"encoded": N * C, "ln1": ln, "atty": L * N * C, "residual2": L * N * C, "ln2": ln,
            "fch": L * N * 4 * C, "fch_gelu": (L if recompute < 1 else 1) * N * 4 * C, "residual3": L * N * C,
            "lnf": N * C, "qkvr": L * N * 3 * C, "output": N * max(3 * C, NH * T, Vp),
            "scratch_bt4c": N * 4 * C, "scratch_btc": N * C}
    fp32 = {"ln1, ln2 mean and rstd": 4 * L * N, "lnf mean and rstd, losses": 3 * N}
    if cudnn:
        fp32["att (softmax statistics)"] = L * B * NH * T
    else:
        bf16["att"] = L * B * NH * T * T
    return {"params": 2 * P, "grads": 2 * P, "adamw": 8 * P, "master": 4 * P,
            "activations": 2 * sum(bf16.values()) + 4 * sum(fp32.values()), "workspace": 32 << 20,
            "batch": 2 * 4 * N}
