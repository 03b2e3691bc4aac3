"""The training driver behind train_gpt2.py (and the llmc-train command): flags, the loop,
validation, samples, checkpoints, resume.

    python train_gpt2.py                                  # GPT-2 124M on tiny shakespeare (GPU), or a
                                                          # small model on the numpy backend without one
    python train_gpt2.py -e d12 -b 4 -t 1024 -x 100       # from scratch
    python train_gpt2.py --softmax-kernel 5 --matmul-kernel 5
    python train_gpt2.py --device cpu -e L2C64H2 -b 4 -t 64 -x 50
    python train_gpt2.py -o out -n 100 -nk 3 ; python train_gpt2.py -o out -y 1   # checkpoints, resume
    python train_gpt2.py --list-kernels
    mpirun -np 2 python train_gpt2.py -e d12 -b 16 -z 1            # data parallel (docs/multi_gpu.md)

Long flags are readable; llm.c's one-letter flags are aliases (-i -j -e -o -n -nk -nm -y -b -t -d
-x -l -u -k -q -c -sl -sg -v -m -s -g -h -a -z -r). As in llm.c, -h 1 turns HellaSwag on; --help is the
help. The run directory (-o) is llm.c's: model_%08d.bin, state_%08d_%05d.bin, DONE_%08d and main.log
(llmc/runfiles.py), so a run started by llm.c resumes here and the reverse. Under mpirun every
rank writes its own state file; rank 0 alone prints, writes main.log, the model and DONE.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

from llmc import switches
from llmc.errors import LLMCError

DEFAULT_TRAIN = "dev/data/tinyshakespeare/tiny_shakespeare_train.bin"
DEFAULT_VAL = "dev/data/tinyshakespeare/tiny_shakespeare_val.bin"
DEFAULT_HELLASWAG = "dev/data/hellaswag/hellaswag_val.bin"
SMALL_CPU_MODEL = ("L2C64H2", 4, 64)  # what `python train_gpt2.py` trains when there is no GPU
SMALL_CPU_STEPS = 50


_QUIET_RANK = False  # data parallel: ranks other than 0 print nothing (set in main)


def note(msg: str) -> None:
    """Diagnostics (notes, warnings) go to stderr: stdout carries the run's own output."""
    if not _QUIET_RANK:
        print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# flags


def kernel_flags():
    """[(flag, op name, help)] for every op with GPU variants, from the op registry."""
    from llmc import ops
    out = []
    for name, spec in ops.registry().items():
        if spec.variants and spec.flag:
            have = ", ".join(str(k) for k in sorted(spec.variants))
            out.append((spec.flag, name, f"{name} variant ({have}; default {spec.default})"))
    return out


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (not the whole usage block) and exit 2."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default once, at the end of its help, unless the help already names it."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        shown = not (d is None or d is False or d is argparse.SUPPRESS)  # (0 == False: compare by identity)
        if action.option_strings and shown and "default" not in h:
            h += f" (default: {str(d).replace('%', '%%')})"
        return h


def number(kind, lo=None, hi=None, also=(), what=None):
    """An argparse type: int or float within [lo, hi] (either may be None), or one of `also`.
    NaN and inf are refused. A bad value is one line: 'argument -b/--batch-size: expected ...'."""
    noun = "an integer" if kind is int else "a number"
    if what is None:
        if lo is not None and hi is not None:
            what = f"{noun} in [{lo}, {hi}]"
        elif lo is not None:
            what = f"{noun} >= {lo}"
        else:
            what = noun
        if also:
            what = " or ".join(str(a) for a in also) + " or " + what

    def convert(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if v in also:
            return v
        if (kind is float and not math.isfinite(v)) or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return v
    convert.__name__ = kind.__name__
    return convert


def build_parser() -> argparse.ArgumentParser:
    from llmc.schedule import SCHEDULES
    p = OneLineParser(prog="train_gpt2.py", add_help=False, formatter_class=HelpFormatter,
                      description="Train GPT-2 on our own CUDA kernels, or on the numpy backend without a GPU.",
                      epilog=f"Without a GPU (or with --device cpu) and with none of -e, -b, -t given, the "
                             f"defaults become a small model: -e {SMALL_CPU_MODEL[0]} -b {SMALL_CPU_MODEL[1]} "
                             f"-t {SMALL_CPU_MODEL[2]} -x {SMALL_CPU_STEPS}.")
    a = p.add_argument
    a("--help", action="help", help="show this message and exit")
    bit = number(int, 0, 1, what="0 or 1")
    # files
    a("-i", "--train-data", default=DEFAULT_TRAIN, help="train shards (glob pattern)")
    a("-j", "--val-data", default=DEFAULT_VAL, help="val shards (glob pattern); '' = none")
    a("-e", "--model", default=None, help="checkpoint file, llm.c descriptor (d6, d12, d24, d36, d48) "
      "or L<layers>C<channels>H<heads> (default: gpt2_124M.bin if present, else d12)")
    a("-o", "--output-dir", default=None, help="run directory: main.log, checkpoints model_/state_/DONE_ "
      "(default: none, nothing written)")
    a("-n", "--checkpoint-every", type=number(int, 0), default=0,
      help="write a checkpoint every N steps; with -o one is always written at the end (0 = only then)")
    a("-nk", "--checkpoints-keep", type=number(int, 0), default=0,
      help="keep only the newest N checkpoints in -o, deleting older ones (0 = keep all)")
    a("-nm", "--major-checkpoint-every", type=number(int, 0), default=0,
      help="with -nk: never delete checkpoints whose step is a multiple of M (0 = none)")
    a("-y", "--resume", type=bit, default=0, help="1 = resume from the newest complete checkpoint "
      "(DONE_*) in -o; starts fresh when there is none")
    # batch
    a("-b", "--batch-size", type=number(int, 1), default=None, help="micro batch size B (default: 4)")
    a("-t", "--seq-len", type=number(int, 1), default=None,
      help="sequence length T, at most the model's maxT (default: 1024)")
    a("-d", "--total-batch-size", type=number(int, 1, also=(-1,)), default=-1,
      help="tokens per optimizer step, a multiple of B*T (-1 = B*T, no gradient accumulation)")
    a("-x", "--max-steps", type=number(int, 0, also=(-1,)), default=-1,
      help="optimizer steps (-1 = one epoch of the train data; 0 = only evaluate)")
    # optimization
    a("-l", "--learning-rate", "--lr", type=number(float, 0.0), default=3e-4, help="peak learning rate")
    a("-u", "--warmup-steps", type=number(int, 0), default=0, help="linear warmup steps")
    a("-k", "--lr-schedule", default="cosine", choices=SCHEDULES, help="learning-rate schedule")
    a("-q", "--final-lr-frac", type=number(float, 0.0, 1.0), default=1.0,
      help="final lr as a fraction of -l (1.0 = no decay)")
    a("-c", "--weight-decay", type=number(float, 0.0), default=0.0, help="AdamW weight decay (2-D weights)")
    a("-sl", "--skip-loss-z", type=number(float, 0.0), default=0.0,
      help="skip the update when the loss z-score over the last 64 steps exceeds this (0 = off)")
    a("-sg", "--skip-grad-z", type=number(float, 0.0), default=0.0,
      help="skip the update when the grad-norm z-score over the last 64 steps exceeds this (0 = off)")
    a("--grad-clip", type=number(float, 0.0), default=1.0, help="global gradient-norm clip (0 = off)")
    a("--seed", type=number(int, 0), default=1337, help="weights init, sampling and shuffle seed")
    # evaluation and samples
    a("-v", "--val-every", type=number(int, 0), default=20, help="validate every N steps (0 = never)")
    a("-m", "--val-batches", type=number(int, 1, also=(-1,)), default=20,
      help="batches per validation (-1 = the whole val split)")
    a("-s", "--sample-every", type=number(int, 0), default=20, help="print a text sample every N steps (0 = never)")
    a("-g", "--gen-tokens", type=number(int, 1), default=64, help="tokens per sample")
    a("-h", "--hellaswag", type=bit, default=0,
      help="1 = evaluate HellaSwag at the val cadence (after step 0) and at the last step")
    a("--hellaswag-data", default=DEFAULT_HELLASWAG, help="llm.c's HellaSwag eval file (used with -h 1)")
    a("-a", "--overfit-single-batch", type=bit, default=0, help="1 = train on the first batch only")
    a("--shuffle", type=bit, default=0, help="1 = seeded shuffle of shards and windows each epoch")
    # many GPUs
    a("-z", "--zero-stage", type=bit, default=0, help="under mpirun: 0 = all-reduce the gradients, "
      "1 = ZeRO-1 (each rank keeps 1/N of the optimizer state)")
    # device
    a("--device", default="auto", choices=("auto", "cuda", "cpu"),
      help="auto = the GPU when usable, else the numpy backend (saying why)")
    a("--precision", default="fp32", choices=("fp32", "bf16"),
      help="fp32, or bf16 (GPU): bf16 weights, activations and gradients, fp32 master weights and AdamW state")
    a("-r", "--recompute", type=number(int, 0, 2, what="0, 1 or 2"), default=1,
      help="activation recompute in backward, as llm.c: 0 = none (keep every layer's GELU output), "
           "1 = GELU, 2 = GELU and layernorm (less memory, a little more time)")
    a("--stochastic-rounding", type=bit, default=1,
      help="with --precision bf16: 1 = round the updated bf16 weights stochastically (as llm.c), 0 = to nearest even")
    a("--deterministic", action="store_true", help="only kernel variants without float atomics: "
      "the same bits on every run, and a resumed run equals an uninterrupted one")
    a("--list-kernels", action="store_true", help="print every op's kernel variants and exit")
    try:
        flags = kernel_flags()
    except Exception:  # an op module that fails to import must not hide --help
        flags = []
    g = p.add_argument_group("kernel variants (GPU; the numpy backend accepts and ignores them)")
    for flag, name, helptext in flags:
        g.add_argument(flag, type=number(int, 1), default=None, dest=f"kernel_{name}", metavar="N", help=helptext)
    return p


def list_kernels() -> str:
    from llmc import ops
    lines = []
    for name, spec in ops.registry().items():
        if not spec.variants:
            continue
        lines.append(f"{name}  ({spec.flag}, default {spec.default})")
        for num in sorted(spec.variants):
            mark = "*" if num == spec.default else " "
            lines.append(f"  {mark}{num}: {spec.variants[num].description}")
    return "\n".join(lines)


# Variants that accumulate floats with atomics, so that their sums depend on the order the GPU
# happens to run blocks in (cuda/encoder.cu, layernorm.cu, global_norm.cu say which). Every other
# variant in the step reduces in a fixed order.
NONDETERMINISTIC = {"encoder_backward": {1, 4, 5}, "layernorm_backward": {1, 2}, "global_norm": {1},
                    "attention_backward": {5}}
# the deterministic variant to take where the highest-numbered one is not the fastest on real text.
# layernorm_backward 6 takes C <= 512 in fp32 (registers), so d12 (C=768) stays on 5. (encoder_backward
# had 3 here while 6 was its highest: 6 walks each token's rows in one block, 2.4x slower than 3 on
# Zipf ids. Its highest now, 9, is the fastest deterministic one: fp32 on tiny shakespeare's ids,
# H200, lab: B=16 0.048 ms against 3's 0.304, B=4 0.020 against 0.050; session 34.)
# encoder_backward stays on 9 (its highest is now 10, session 48: faster at B=16 in the bf16 lab, slower at
# B=4, and only C % 4 == 0 in fp32, where 9 takes any C).
DETERMINISTIC_CHOICE = {"layernorm_backward": 5, "encoder_backward": 9}


def deterministic_kernels(kernels: dict, precision: str = "fp32") -> dict:
    """--deterministic: each op in NONDETERMINISTIC runs the precision's default when that is
    deterministic, else its DETERMINISTIC_CHOICE, else its highest-numbered deterministic variant, that has kernels for `precision`, unless one was named; naming a nondeterministic one is an
    error. The chosen variants count as named, so a shape they cannot take is refused loudly instead
    of falling back to an atomic one."""
    from llmc import ops
    out = dict(kernels)
    for name, bad in NONDETERMINISTIC.items():
        spec = ops.get(name)
        if out.get(name) in bad:
            raise LLMCError(f"{spec.flag} {out[name]}: uses atomics (not deterministic); --deterministic "
                            f"allows {', '.join(str(k) for k in sorted(set(spec.variants) - bad))}")
        if out.get(name) is None:
            ok = set(spec.variants) - bad
            have = {n for n in ok if precision in spec.variants[n].dtypes}
            if not have:
                raise LLMCError(f"--deterministic --precision {precision}: {name} has no deterministic variant "
                                f"with {precision} kernels (deterministic: {', '.join(str(k) for k in sorted(ok))})")
            default = spec.default_for(precision)  # (bf16's layernorm_backward 7 is deterministic)
            out[name] = default if default in have else (
                DETERMINISTIC_CHOICE[name] if DETERMINISTIC_CHOICE.get(name) in have else max(have))
    return out


# ----------------------------------------------------------------------------------------------
# throughput: llm.c's MFU

# dense tensor-core peak TFLOP/s (fp32 inputs on TF32 / bf16) from NVIDIA's data sheets, by a
# substring of the device name; the first match wins (H100 PCIe before the SXM H100)
PEAK_TFLOPS = [
    ("H100 PCIe", {"fp32": 378.0, "bf16": 756.0}),
    ("H100", {"fp32": 494.7, "bf16": 989.4}),     # SXM5 ("H100 80GB HBM3")
    ("H200", {"fp32": 494.7, "bf16": 989.4}),
    ("H800", {"fp32": 494.7, "bf16": 989.4}),
    ("A100", {"fp32": 156.0, "bf16": 312.0}),
    ("A800", {"fp32": 156.0, "bf16": 312.0}),
    ("L40S", {"fp32": 183.0, "bf16": 362.0}),
    ("RTX 4090", {"fp32": 82.6, "bf16": 165.2}),
    ("RTX 3090", {"fp32": 35.6, "bf16": 71.0}),
]


def peak_flops(device_name: str, precision: str) -> float | None:
    for key, peaks in PEAK_TFLOPS:
        if key in device_name:
            return peaks[precision] * 1e12
    return None


def flops_per_token(cfg, T: int) -> int:
    """6N for the weight matmuls (forward + backward) + 6LCT for attention, as llm.c counts."""
    return 6 * cfg.num_parameters + 6 * cfg.num_layers * cfg.channels * T


# ----------------------------------------------------------------------------------------------
# the run directory

HPARAMS = [("-l/--learning-rate", "learning_rate"), ("-k/--lr-schedule", "lr_schedule"),
           ("-q/--final-lr-frac", "final_lr_frac"), ("-u/--warmup-steps", "warmup_steps"),
           ("-c/--weight-decay", "weight_decay"), ("-d/--total-batch-size", "total_batch_size"),
           ("-x/--max-steps", "max_steps"), ("--grad-clip", "grad_clip"), ("--seed", "seed"),
           ("--precision", "precision")]


def prepare_output_dir(out_dir: str) -> None:
    """Create -o, or fail in one line if it is a file or not writable; remove temp files that an
    interrupted save left there."""
    from llmc.runfiles import clean_temp_files
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise LLMCError(f"-o/--output-dir {out_dir}: exists and is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise LLMCError(f"-o/--output-dir {out_dir}: cannot create it ({e.strerror})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise LLMCError(f"-o/--output-dir {out_dir}: not writable (choose another directory or fix its permissions)")
    removed = clean_temp_files(out_dir)
    if removed:
        note(f"note: removed {len(removed)} temp file(s) of an interrupted save in {out_dir}")


def save_checkpoint(out_dir, step, model, loader, rng, detectors, hparams, sr_rng=None, dp=None,
                    barrier=None) -> str:
    """The model's checkpoint of `step` (llmc.runfiles.save_checkpoint with what this trainer keeps).
    dp (llmc.dist.DataParallel): this rank's optimizer state (its ZeRO-1 shard with -z 1) goes in
    its own state file, llm.c's header names the rank and the number of ranks; barrier(error) is
    where every rank has written (or failed), before rank 0 writes DONE."""
    from llmc.runfiles import save_checkpoint as save
    extra = {"rng": rng.bit_generator.state, "hparams": hparams,
             "detectors": [d.state() for d in detectors]}
    if model.fold is not None:  # the folded classifier's exponent offset k (this rank's)
        extra["fold"] = model.fold.state()
    if dp is not None:
        m, v = dp.optimizer_state()
        master = dp.master_state()
        extra.update(dp.state_extra())
        rank, world = dp.rank, dp.world
    else:
        m, v = model.be.download(model.m).reshape(-1), model.be.download(model.v).reshape(-1)
        master = None if model.master is None else model.be.download(model.master).reshape(-1)
        rank, world = 0, 1
    # bf16: the model file is llm.c's version 5 holding the bf16 weights as they are, the state
    # file the fp32 master weights (llm.c's layout has the flag and the section) and the rounding
    # RNG: together they resume exactly
    if model.bf16:
        weights, sr_rng = model.to_host(model.params).reshape(-1), model.sr_state
    else:
        weights = model.get_params()
    return save(out_dir, step, model.cfg, weights if rank == 0 else None, m, v, loader.state(),
                extra, rank=rank, world=world, barrier=barrier, sr_rng=sr_rng, master=master,
                model_dtype="bf16" if model.bf16 else "fp32")


def llmc_loader_state(loader, shard: int, sample: int) -> dict:
    """Our DataLoader.state() for llm.c's (current_shard_idx, current_sample_idx): the batch llm.c
    would serve next. llm.c counts samples in windows of processes x B x T tokens (each rank reads
    its B*T slice of a window), and so does a DataLoader built with (rank, world): the numbers carry
    over as they are, for any number of processes. llm.c may stop at sample == the shard's window
    count (it moves on at the next call); we move on now."""
    n = len(loader.files)
    if not 0 <= shard < n or not 0 <= sample <= loader.shard_windows[shard]:
        have = loader.shard_windows[shard] if 0 <= shard < n else 0
        procs = f" x {loader.world} processes" if loader.world > 1 else ""
        raise LLMCError(f"llm.c state: loader position shard {shard}, sample {sample} is outside "
                        f"-i {loader.pattern} ({n} shards; that shard has {have} batches of B*T{procs} "
                        f"at B={loader.B} T={loader.T}): resume with the same data, -b, -t and ranks")
    epoch = 0
    if sample == loader.shard_windows[shard]:
        shard, sample = shard + 1, 0
        if shard == n:
            shard, epoch = 0, 1
    return {"epoch": epoch, "shard_index": shard, "window_index": sample, "seed": loader.seed,
            "shuffle": False, "B": loader.B, "T": loader.T, "num_shards": n,
            "rank": loader.rank, "world": loader.world}


def check_finite(what: str, value: float, step: int, group=None) -> None:
    """group: the value is the same on every rank (a mean or a reduced norm), so every rank stops
    here together and rank 0 alone says why (llmc.dist.DistError)."""
    if not math.isfinite(value):
        msg = (f"step {step}: {what} is {value}: the run diverged (or started from non-finite "
               f"weights); stopping without writing a checkpoint (try a lower -l/--learning-rate)")
        if group is not None and group.world > 1:
            from llmc.dist import DistError
            raise DistError(msg, quiet=not group.is_main)
        raise LLMCError(msg)


# ----------------------------------------------------------------------------------------------
# main

def resolve_model_arg(arg):
    if arg is not None:
        return arg
    return "gpt2_124M.bin" if os.path.exists("gpt2_124M.bin") else "d12"


def main(argv=None, group=None) -> int:
    global _QUIET_RANK
    args = build_parser().parse_args(argv)
    if args.list_kernels:
        print(list_kernels())
        return 0
    # data parallel: the processes mpirun started (llmc/dist.py), or this one alone
    from llmc.dist import DataParallel, DistError, Group, MpiComm, NcclComm, check_gpus
    group = group or Group.start()
    world = group.world
    if not group.is_main:  # rank 0 alone prints (errors are agreed on and printed by rank 0)
        sys.stdout = open(os.devnull, "w")
        _QUIET_RANK = True
    switches.check_environment(notes=group.is_main)  # (a bad value: every rank stops, rank 0 says why)
    kernels = {k[len("kernel_"):]: v for k, v in vars(args).items() if k.startswith("kernel_") and v is not None}
    if args.deterministic:
        kernels = deterministic_kernels(kernels, args.precision)

    from llmc.backend import make_backend
    if world > 1 and args.device != "cpu":
        why = check_gpus(group)
        if why is not None and args.device == "cuda":
            raise LLMCError(why)
        if why is not None:  # auto: every rank must make the same choice, so none guesses alone
            raise LLMCError(f"{why}; with mpirun, name the backend: --device cpu (numpy + MPI) or cuda")
        args.device = "cuda"
        try:
            import nccl.core  # noqa: F401  (the communicator itself is made once every rank is ready)
        except ImportError as e:
            raise LLMCError(f"multi-GPU needs NCCL's Python bindings (pip install nccl4py): {e}") from None
    be = make_backend(args.device, kernels, gpu=group.local_rank, precision=args.precision)
    # a diverging run is caught by the finite checks below, in one line: no numpy overflow warnings
    np.seterr(over="ignore", invalid="ignore", divide="ignore")

    # the defaults that depend on the device: a real run on a GPU, a small one on the numpy backend
    small = be.name == "cpu" and args.model is None and args.batch_size is None and args.seq_len is None
    if small:
        args.model, args.batch_size, args.seq_len = SMALL_CPU_MODEL
        if args.max_steps < 0:
            args.max_steps = SMALL_CPU_STEPS
        note(f"no GPU in use: training a small model ({args.model}, B={args.batch_size}, T={args.seq_len}, "
             f"{args.max_steps} steps) on the numpy backend; on a GPU machine this command trains GPT-2 "
             f"124M with our CUDA kernels")
    B = args.batch_size or 4
    T = args.seq_len or 1024
    out = args.output_dir
    zero = args.zero_stage if world > 1 else 0  # one rank: nothing to shard
    if out:
        if group.is_main:  # (the others write only once every rank has set up)
            prepare_output_dir(out)
        elif not os.path.isdir(out):
            os.makedirs(out, exist_ok=True)

    # resume: the newest checkpoint with a DONE marker (ours or llm.c's); none = start fresh. Each
    # rank reads the model and its own state file (its ZeRO-1 shard of m and v with -z 1).
    from llmc import runfiles
    ck = None
    if args.resume:
        if not out:
            raise LLMCError("-y/--resume 1 needs -o/--output-dir (where the checkpoints are)")
        last = runfiles.latest_done(out)
        if last is None:
            note(f"note: -y 1: no complete checkpoint (DONE_*) in {out}; starting fresh")
        else:
            from llmc.dist import load_checkpoint   # (another number of ranks or -z: one line)
            ck = load_checkpoint(out, last, group.rank, world, zero)

    # model config and weights
    from llmc.config import config_from_name
    if ck is not None:
        cfg, params = ck["cfg"], ck["params"]
        origin = f"resumed from {ck['model_path']} (step {ck['step']})"
        if args.model is not None and not os.path.exists(args.model) and config_from_name(args.model) != cfg:
            note(f"note: -e {args.model} is not used: resuming the model in {ck['model_path']} ({cfg.describe()})")
    else:
        model_arg = resolve_model_arg(args.model)
        params = None
        if os.path.exists(model_arg) or model_arg.endswith(".bin"):
            from llmc.hf import read_any_model   # an llm.c .bin, or a Hugging Face directory
            cfg, params = read_any_model(model_arg)
            origin = f"checkpoint {model_arg}"
        else:
            cfg = config_from_name(model_arg)
            origin = f"random init ({model_arg}, seed {args.seed})"
    if params is not None and not np.isfinite(params).all():
        raise LLMCError(f"{ck['model_path'] if ck else model_arg}: the weights hold NaN/inf values "
                        f"(a checkpoint of a diverged run?)")

    # data
    from llmc.data import DataLoader
    ranks = dict(rank=group.rank, world=world)  # each rank reads its own B*T slice of every window
    train_loader = DataLoader(args.train_data, B, T, shuffle=bool(args.shuffle), seed=args.seed, **ranks)
    train_loader.vocab_size = cfg.vocab_size
    val_loader = DataLoader(args.val_data, B, T, **ranks) if args.val_data and args.val_every > 0 else None
    if val_loader is not None:
        val_loader.vocab_size = cfg.vocab_size
    tokens_per_micro = B * T * world  # -d counts every rank's tokens
    total = args.total_batch_size if args.total_batch_size > 0 else tokens_per_micro
    if total % tokens_per_micro != 0:
        bt = f"B*T*ranks = {B}*{T}*{world}" if world > 1 else "B*T"
        raise LLMCError(f"-d/--total-batch-size {total}: must be a multiple of {bt} = {tokens_per_micro}")
    accum = total // tokens_per_micro
    max_steps = args.max_steps if args.max_steps >= 0 else max(train_loader.num_tokens // total, 1)  # -x 0: only evaluate
    hparams = {"learning_rate": args.learning_rate, "lr_schedule": args.lr_schedule,
               "final_lr_frac": args.final_lr_frac, "warmup_steps": args.warmup_steps,
               "weight_decay": args.weight_decay, "total_batch_size": total, "max_steps": max_steps,
               "grad_clip": args.grad_clip, "seed": args.seed, "precision": args.precision}

    from llmc.model import GPT2
    model = GPT2(cfg, be, B, T, optimizer=zero == 0,  # ZeRO-1: the rank's shard of m, v lives in dp
                 recompute=args.recompute)
    model.grad_accum_steps = accum
    model.stochastic_rounding = bool(args.stochastic_rounding)
    if params is not None:
        # a bf16 run resuming its own checkpoint: the fp32 masters from the state, the bf16 weights
        # from the v5 model file (stochastically rounded: not what rounding the masters would give)
        resumed_bf16 = ck is not None and model.bf16 and ck["model_version"] == 5
        model.load_params(params, ck["file_params"] if resumed_bf16 else None)
    else:
        params = model.init_params(args.seed)  # the same seed on every rank: the same weights
    rng = np.random.default_rng(args.seed)
    from llmc.runfiles import OutlierDetector
    loss_z, grad_z = OutlierDetector(), OutlierDetector()
    sr_rng = None  # llm.c's stochastic-rounding RNG: carried over unchanged from an llm.c state
    from llmc.hellaswag import open_hellaswag
    hellaswag = open_hellaswag(args.hellaswag, args.hellaswag_data, B, T, cfg.vocab_size)

    # every rank has set up (or says why not); then the communicator between them
    group.agree(None, "set-up")
    comm = None
    if world > 1:
        if len(set(group.allgather(be.name))) > 1:
            raise DistError("the ranks chose different backends: name one with --device", quiet=not group.is_main)
        if be.name == "cpu":
            comm = MpiComm(group)
        else:
            with group.guarded("NCCL's start-up (ncclCommInitRank)"):
                comm = NcclComm(group, be.rt)
    dp = DataParallel(group, model, zero, comm)
    dp.load_master(params)  # bf16 ZeRO-1: this rank's pieces of the fp32 weights

    start_step = 0
    if ck is not None:
        for name, a in (("m", ck["m"]), ("v", ck["v"])):
            if not np.isfinite(a).all():
                raise LLMCError(f"{ck['state_path']}: AdamW {name} holds NaN/inf values")
        dp.load_optimizer_state(ck["m"], ck["v"])
        if ck["master"] is not None and ck["master"].size != cfg.num_parameters:
            dp.load_master_shard(ck["master"])  # llm.c's bf16 ZeRO-1 run: each rank's fp32 master piece
        if ck["ours"]:
            train_loader.load_state(ck["loader"])
            extra = ck["extra"]
            if "rng" in extra:
                rng.bit_generator.state = extra["rng"]
            if "detectors" in extra:
                loss_z, grad_z = (OutlierDetector(s) for s in extra["detectors"])
            if "fold" in extra and model.fold is not None:
                model.fold.load_state(extra["fold"])
            for flag, key in HPARAMS:
                old = extra.get("hparams", {}).get(key)
                if old is not None and old != hparams[key]:
                    note(f"note: {flag} is {hparams[key]} now, {old} in the run that wrote "
                         f"{ck['state_path']}; using {hparams[key]}")
        else:  # llm.c's state: only the loader position
            train_loader.load_state(llmc_loader_state(train_loader, ck["shard_index"], ck["sample_index"]))
            sr_rng = ck["sr_rng"]
            note(f"note: {ck['state_path']} is llm.c's: continuing at its loader position (shard "
                 f"{ck['shard_index']}, batch {ck['sample_index']}); the sampling RNG starts from --seed")
        if model.bf16:  # the stochastic-rounding RNG continues where it stopped
            model.sr_state = ck["sr_rng"]
        start_step = ck["step"]
        if start_step >= max_steps:
            note(f"note: the checkpoint is at step {start_step}, -x/--max-steps is {max_steps}: nothing to train")
    if model.bf16 and world > 1 and zero == 0:
        # -z 0: every rank updates every weight, so every rank must round with the same seeds
        model.sr_state = group.allgather(model.sr_state)[0]
    group.agree(None, "resume")
    group.phase = "train"  # from here on an error on one rank alone aborts the job

    print(f"model: {cfg.describe()} | {origin}")
    print(f"backend: {be.describe()} | B={B} T={T} grad accum {accum} | {max_steps} steps | "
          f"train {train_loader.num_tokens:,} tokens")
    peak = None
    if be.name == "cuda":
        print("kernels: " + ", ".join(f"{k}={v}" for k, v in sorted(be.kernels_for().items())))
        free, total_mem = be.rt.mem_info()
        print(f"GPU memory: {be.rt.allocated_bytes / 2**30:.2f} GiB allocated by the model "
              f"({args.precision}; activations {model.activation_bytes() / 2**30:.2f} GiB at -r {args.recompute}), "
              f"{(total_mem - free) / 2**30:.2f} of {total_mem / 2**30:.1f} GiB in use on the device")
        peak = peak_flops(be.rt.name, args.precision)
    flops_step = flops_per_token(cfg, T) * total / world  # one GPU's share (MFU is per GPU)
    if world > 1:
        print(f"data parallel: {dp.describe()}")

    log = runfiles.RunLog(out, append=ck is not None) if out and group.is_main else None

    from llmc.schedule import get_lr
    get_lr(args.lr_schedule, 0, args.learning_rate, args.warmup_steps, max_steps, args.final_lr_frac)

    tokenizer = None
    if args.sample_every > 0:
        try:
            from llmc.tokenizer import get_encoding
            tokenizer = get_encoding()
        except LLMCError as e:
            note(f"WARNING: no tokenizer ({e}); samples are printed as token ids")

    decoder = None  # built at the first sample; reads the model's live weights
    overfit_batch = train_loader.next_batch() if args.overfit_single_batch else None
    step_ms = []
    # Each step's loss and norm are read after the next step is launched (the copies are queued
    # behind the step; the GPU runs on while the host waits for them and prints), so the GPU does not
    # idle between steps for the host's read, batch upload and launches. Anything that needs the
    # step's results or the host's attention first (validation, samples, checkpoints, the end)
    # reports it first. On the numpy backend, which computes as it launches, there is nothing to
    # overlap (and a step's time would land on the one before it): each step is read at once there.
    # LLMC_PIPELINE_STEPS=1|0 forces either.
    pipeline = switches.flag("LLMC_PIPELINE_STEPS")
    pipeline = be.name == "cuda" if pipeline is None else pipeline
    pending = None     # (step, lr, t0, StepRead) of the last launched step not yet reported
    last_done = 0.0    # when the last reported step's results were in

    def report(p) -> None:
        nonlocal last_done
        pstep, plr, pt0, read = p
        loss, norm = read.loss(), read.norm()  # waits for this step's copies only
        done = time.perf_counter()
        ms = (done - max(pt0, last_done)) * 1000
        last_done = done
        check_finite("the loss", loss, pstep + 1, group)
        check_finite("the gradient norm", norm, pstep + 1, group)
        if pstep > start_step:  # the first step of a run builds graphs and warms up: not counted
            step_ms.append(ms)
        mfu = f" | {100 * flops_step / (ms / 1000) / peak:.1f}% MFU" if peak else ""
        print(f"step {pstep + 1:4d}/{max_steps} | loss {loss:.6f} | norm {norm:.4f} | lr {plr:.2e} | "
              f"{ms:.2f} ms{mfu} | {total / (ms / 1000):.0f} tok/s")
        if log:
            log.train(pstep, loss, plr, norm)

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            p, pending = pending, None
            report(p)

    for step in range(start_step, max_steps + 1):
        last_step = step == max_steps
        # a resumed run already validated, sampled and saved at start_step before it stopped:
        # doing it again would draw from the sampling rng and break bit-exact continuation
        again = ck is not None and step == start_step
        # validation
        if val_loader is not None and not again and (step % args.val_every == 0 or last_step):
            flush()
            dp.params_ready()  # (-z 1: the last update's all-gather may still be running)
            val_loader.reset()
            most = max(val_loader.batches_per_epoch, 1)
            nb = most if args.val_batches < 0 else min(args.val_batches, most)
            vl = 0.0
            for _ in range(nb):
                x, y = val_loader.next_batch()
                vl += model.forward(x, y, grad=False)
            vl = dp.mean(vl / nb)  # every rank's slice of the val batches
            check_finite("the val loss", vl, step, group)
            print(f"val loss {vl:.6f}")
            if log:
                log.val(step, vl)
        # HellaSwag, at llm.c's cadence: every val step after the first, and the last step
        if hellaswag is not None and not again and (last_step or (args.val_every > 0 and step > 0 and step % args.val_every == 0)):
            flush()
            dp.params_ready()
            acc = hellaswag.run(model, group)  # the examples split over the ranks, as llm.c does
            if log:
                log.eval(step, acc)
        # samples (rank 0's; every rank reports the pending step first: its loss is a mean over the
        # ranks, read by all of them at the same point)
        sample_now = args.sample_every > 0 and not again and (step % args.sample_every == 0 or last_step) and step > 0
        if sample_now:
            flush()
        if sample_now and group.is_main:
            from llmc.decode import Decoder
            from llmc.decode import sample_during_training
            dp.params_ready()
            if decoder is None:
                decoder = Decoder(cfg, be, 1, params_buf=model.params)
            text = sample_during_training(decoder, min(args.gen_tokens, cfg.max_seq_len - 1), rng, tokenizer)
            print(f"generating:\n---\n{text}\n---")
        # checkpoint (with -o: every -n steps and always at the end)
        if out and step > start_step and (last_step or (args.checkpoint_every > 0 and step % args.checkpoint_every == 0)):
            # every rank writes its state; rank 0 the model, and DONE once all have written
            barrier = (lambda err: group.agree(err, "checkpoint")) if world > 1 else None
            flush()
            dp.params_ready()
            path = save_checkpoint(out, step, model, train_loader, rng, (loss_z, grad_z), hparams, sr_rng,
                                   dp=dp, barrier=barrier)
            print(f"wrote {path}")
            if group.is_main:
                for gone in runfiles.prune_checkpoints(out, step, args.checkpoints_keep, args.major_checkpoint_every):
                    print(f"deleted the checkpoint of step {gone} (-nk {args.checkpoints_keep})")
        if last_step:
            flush()
            break

        # one optimizer step: accum micro-steps of forward + backward, then clip + AdamW
        t0 = time.perf_counter()
        model.zero_grad()
        for micro in range(accum):
            x, y = overfit_batch if overfit_batch is not None else train_loader.next_batch()
            # forward + backward (a CUDA graph replay on the GPU); on the last micro-step of a
            # data-parallel step each layer's gradients are reduced across ranks as backward goes
            dp.train_micro_step(x, y, last=micro == accum - 1)
        lr = get_lr(args.lr_schedule, step, args.learning_rate, args.warmup_steps, max_steps, args.final_lr_frac)
        skip = None
        if args.skip_loss_z > 0 or args.skip_grad_z > 0:
            # llm.c's outlier guards need the loss and the norm before the update: one more sync
            # per step, only when they are on (the previous step is reported first: its line
            # comes before this one's "skipping update")
            flush()
            loss = dp.step_loss()
            check_finite("the loss", loss, step + 1, group)
            norm = dp.grad_norm_before_update()
            check_finite("the gradient norm", norm, step + 1, group)
            zl, zg = loss_z.update(loss), grad_z.update(norm)
            if args.skip_loss_z > 0 and math.isfinite(zl) and zl > args.skip_loss_z:
                skip = f"skipping update due to loss z-score of {zl:f}"
            elif args.skip_grad_z > 0 and math.isfinite(zg) and zg > args.skip_grad_z:
                skip = f"skipping update due to grad z-score of {zg:f}"
        if skip is None:
            dp.update(lr, step + 1, weight_decay=args.weight_decay, max_norm=args.grad_clip)
        else:
            print(skip)
        # the step's loss and norm go to the host behind it (and their mean over ranks at the read);
        # the previous step is reported now, while this one runs
        read = dp.read_step()
        flush()
        pending = (step, lr, t0, read)
        if not pipeline:
            flush()
    flush()
    dp.params_ready()  # nothing may still be writing the weights when the run ends
    be.synchronize()
    if step_ms:
        print(f"total average iteration time: {sum(step_ms) / len(step_ms):.3f} ms "
              f"(mean of {len(step_ms)} steps, the first excluded)")
    if log:
        log.close()
    return 0


def cli(argv=None) -> int:
    """Entry point: user and machine faults become one line on stderr and a non-zero exit. Under
    mpirun, an error while setting up is agreed on by every rank and printed once, by rank 0; an
    error on one rank during training takes the whole job down (the others would wait for it
    forever)."""
    from llmc.dist import DistError, Group
    group = None
    try:
        group = Group.start()
        return main(argv, group)
    except DistError as e:  # agreed by every rank: rank 0 says it
        if not e.quiet:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (LLMCError, MemoryError, OSError) as e:
        if isinstance(e, LLMCError):
            msg = str(e)
        elif isinstance(e, MemoryError):
            msg = "out of host memory (try a smaller model, -b or -t)"
        else:  # a file we could not read or write that no check above caught
            msg = f"{e.filename}: {e.strerror or e}" if e.filename else f"{e.strerror or e}"
        if group is None or group.world == 1:
            print(f"error: {msg}", file=sys.stderr)
            return 1
        if group.phase == "setup":  # the others are at (or on their way to) the next agreement
            try:
                group.agree(msg, "set-up")
            except DistError as agreed:
                if not agreed.quiet:
                    print(f"error: {agreed}", file=sys.stderr)
            return 1
        print(f"error: rank {group.rank}: {msg}", file=sys.stderr, flush=True)
        group.abort(1)
        return 1
    except BaseException:
        if group is not None and group.world > 1:  # a bug on one rank: don't leave the others hanging
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            group.abort(1)
        raise


def cli_main() -> None:
    """The llmc-train console command."""
    sys.exit(cli())
