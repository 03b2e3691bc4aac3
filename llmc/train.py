"""The training driver behind train_gpt2.py: flags, the loop, validation, samples, checkpoints.

    python train_gpt2.py                                  # GPT-2 124M on tiny shakespeare (GPU), or a
                                                          # small model on the numpy backend without one
    python train_gpt2.py -e d12 -b 4 -t 1024 -x 100       # from scratch
    python train_gpt2.py --softmax-kernel 5 --matmul-kernel 5
    python train_gpt2.py --device cpu -e L2C64H2 -b 4 -t 64 -x 50
    python train_gpt2.py -o out -n 100 ; python train_gpt2.py -o out -y 1   # checkpoints, resume
    python train_gpt2.py --list-kernels
    mpirun -np 2 python train_gpt2.py -e d12 -b 16 -z 1            # data parallel (docs/multi_gpu.md)

Long flags are readable; llm.c's one-letter flags are aliases (-i -j -e -o -n -y -b -t -d -x -l -u
-k -q -c -v -m -s -g -a -z).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from llmc.errors import LLMCError

DEFAULT_TRAIN = "dev/data/tinyshakespeare/tiny_shakespeare_train.bin"
DEFAULT_VAL = "dev/data/tinyshakespeare/tiny_shakespeare_val.bin"
SMALL_CPU_MODEL = ("L2C64H2", 4, 64)  # what `python train_gpt2.py` trains when there is no GPU


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


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="train_gpt2.py", description="Train GPT-2 on our own CUDA kernels "
                                "(or the numpy backend).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("-i", "--train-data", default=DEFAULT_TRAIN, help="train shards (glob pattern)")
    a("-j", "--val-data", default=DEFAULT_VAL, help="val shards (glob pattern); '' = none")
    a("-e", "--model", default=None, help="checkpoint file, llm.c descriptor (d6, d12, d24, d36, d48) "
      "or L<layers>C<channels>H<heads>; default gpt2_124M.bin if present, else d12")
    a("-o", "--output-dir", default=None, help="where main.log, checkpoints and state go")
    a("-n", "--checkpoint-every", type=int, default=0, help="write a checkpoint every N steps (0 = only at the end, with -o)")
    a("-y", "--resume", type=int, default=0, help="1 = resume from the latest checkpoint in -o")
    a("-b", "--batch-size", type=int, default=None, help="micro batch size B (default 4)")
    a("-t", "--seq-len", type=int, default=None, help="sequence length T (default 1024)")
    a("-d", "--total-batch-size", type=int, default=-1, help="tokens per optimizer step (-1 = B*T); gives gradient accumulation")
    a("-x", "--max-steps", type=int, default=-1, help="optimizer steps (-1 = one epoch of the train data)")
    a("-l", "--learning-rate", type=float, default=3e-4)
    a("-u", "--warmup-steps", type=int, default=0)
    a("-k", "--lr-schedule", default="cosine", help="cosine | linear | constant | wsd")
    a("-q", "--final-lr-frac", type=float, default=1.0, help="final lr as a fraction of -l")
    a("-c", "--weight-decay", type=float, default=0.0)
    a("-v", "--val-every", type=int, default=20, help="validate every N steps (0 = never)")
    a("-m", "--val-batches", type=int, default=20, help="batches per validation")
    a("-s", "--sample-every", type=int, default=20, help="print a text sample every N steps (0 = never)")
    a("-g", "--gen-tokens", type=int, default=64, help="tokens per sample")
    a("-a", "--overfit-single-batch", type=int, default=0, help="1 = train on the first batch only")
    a("-z", "--zero-stage", type=int, default=0, help="under mpirun: 0 = all-reduce the gradients, "
      "1 = ZeRO-1 (each rank keeps 1/N of the optimizer state)")
    a("--grad-clip", type=float, default=1.0, help="global gradient-norm clip (0 = off)")
    a("--seed", type=int, default=1337)
    a("--shuffle", type=int, default=0, help="1 = seeded shuffle of shards and windows each epoch")
    a("--device", default="auto", help="cpu | cuda | auto")
    a("--precision", default="fp32", help="fp32 (the only one so far)")
    a("--list-kernels", action="store_true", help="print every op's kernel variants and exit")
    try:
        flags = kernel_flags()
    except Exception:  # an op module that fails to import must not hide --help
        flags = []
    g = p.add_argument_group("kernel variants (GPU; the numpy backend accepts and ignores them)")
    for flag, name, helptext in flags:
        g.add_argument(flag, type=int, default=None, dest=f"kernel_{name}", help=helptext)
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


# ----------------------------------------------------------------------------------------------
# checkpoints

def checkpoint_paths(out_dir: str, step: int, rank: int = 0) -> tuple[str, str]:
    """The model file (rank 0 writes it) and rank `rank`'s optimizer state (llm.c's names)."""
    from llmc.dist import state_path
    return os.path.join(out_dir, f"model_{step:08d}.bin"), state_path(out_dir, step, rank)


def latest_checkpoint(out_dir: str, world: int = 1) -> int | None:
    """The latest step with the model and every rank's state (a different rank count: one line)."""
    from llmc.dist import find_resume_step
    return find_resume_step(out_dir, world)


def save_checkpoint(out_dir, step, model, loader, rng, dp):
    """Rank 0 writes the model, every rank its own optimizer state (its shard with -z 1), its
    dataloader position and its rng."""
    from llmc.checkpoint import write_model, write_state
    mpath, spath = checkpoint_paths(out_dir, step, dp.rank)
    if dp.rank == 0:
        write_model(mpath, model.cfg, model.get_params(), dtype="fp32")
    extra = {"rng": rng.bit_generator.state, **dp.state_extra()}
    m, v = dp.optimizer_state()
    write_state(spath, step, m, v, loader.state(), extra)
    return mpath


# ----------------------------------------------------------------------------------------------
# main

def resolve_model_arg(arg):
    if arg is not None:
        return arg
    return "gpt2_124M.bin" if os.path.exists("gpt2_124M.bin") else "d12"


def main(argv=None, group=None) -> int:
    args = build_parser().parse_args(argv)
    if args.list_kernels:
        print(list_kernels())
        return 0
    from llmc.dist import DataParallel, Group, MpiComm, NcclComm, check_gpus
    group = group or Group.start()
    world = group.world
    if not group.is_main:  # rank 0 alone prints (errors are agreed on and printed by rank 0)
        sys.stdout = open(os.devnull, "w")
    if args.precision != "fp32":
        raise LLMCError(f"--precision {args.precision}: only fp32 is implemented")
    if args.zero_stage not in (0, 1):
        raise LLMCError(f"-z/--zero-stage {args.zero_stage}: expected 0 (all-reduce) or 1 (ZeRO-1)")
    kernels = {k[len("kernel_"):]: v for k, v in vars(args).items() if k.startswith("kernel_") and v is not None}

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
    be = make_backend(args.device, kernels, gpu=group.local_rank)

    # the defaults that depend on the device: a real run on a GPU, a small one on the numpy backend
    small = be.name == "cpu" and args.model is None and args.batch_size is None and args.seq_len is None
    if small:
        args.model, args.batch_size, args.seq_len = SMALL_CPU_MODEL
        if args.max_steps < 0:
            args.max_steps = 50
        print(f"no GPU in use: training a small model ({args.model}, B={args.batch_size}, T={args.seq_len}) "
              f"on the numpy backend; on a GPU machine this command trains GPT-2 124M with our CUDA kernels")
    B = args.batch_size or 4
    T = args.seq_len or 1024
    model_arg = resolve_model_arg(args.model)

    # model config and weights
    from llmc.config import config_from_name
    params = None
    if os.path.exists(model_arg) or model_arg.endswith(".bin"):
        from llmc.checkpoint import read_model
        cfg, params = read_model(model_arg)
        origin = f"checkpoint {model_arg}"
    else:
        cfg = config_from_name(model_arg)
        origin = f"random init ({model_arg}, seed {args.seed})"

    # data
    from llmc.data import DataLoader
    ranks = dict(rank=group.rank, world=world)  # each rank reads its own B*T slice of every window
    train_loader = DataLoader(args.train_data, B, T, shuffle=bool(args.shuffle), seed=args.seed, **ranks)
    val_loader = DataLoader(args.val_data, B, T, **ranks) if args.val_data and args.val_every > 0 else None
    tokens_per_micro = B * T * world  # -d counts every rank's tokens
    total = args.total_batch_size if args.total_batch_size > 0 else tokens_per_micro
    if total % tokens_per_micro != 0:
        bt = f"B*T*ranks = {B}*{T}*{world}" if world > 1 else "B*T"
        raise LLMCError(f"-d/--total-batch-size {total}: must be a multiple of {bt} = {tokens_per_micro}")
    accum = total // tokens_per_micro
    max_steps = args.max_steps if args.max_steps > 0 else max(train_loader.num_tokens // total, 1)

    from llmc.model import GPT2
    zero = args.zero_stage if world > 1 else 0
    model = GPT2(cfg, be, B, T, optimizer=zero == 0)  # ZeRO-1: the rank's shard of m, v lives in dp
    model.grad_accum_steps = accum
    if params is not None:
        model.load_params(params)
    else:
        model.init_params(args.seed)  # the same seed on every rank: the same weights
    rng = np.random.default_rng(args.seed)

    # every rank has set up (or says why not); then the communicator between them
    group.agree(None, "set-up")
    comm = None
    if world > 1:
        if len(set(group.allgather(be.name))) > 1:
            raise LLMCError("the ranks chose different backends: name one with --device")
        if be.name == "cpu":
            comm = MpiComm(group)
        else:
            with group.guarded("NCCL's start-up (ncclCommInitRank)"):
                comm = NcclComm(group, be.rt)
    dp = DataParallel(group, model, zero, comm)

    start_step = 0
    if args.resume:
        if not args.output_dir:
            raise LLMCError("-y/--resume 1 needs -o/--output-dir (where the checkpoints are)")
        last = latest_checkpoint(args.output_dir, world)
        if last is None:
            raise LLMCError(f"-y/--resume 1: no checkpoint (model_*.bin + state_*.bin) in {args.output_dir}")
        from llmc.checkpoint import read_model, read_state
        mpath, spath = checkpoint_paths(args.output_dir, last, group.rank)
        cfg2, params = read_model(mpath)
        if cfg2 != cfg:
            raise LLMCError(f"{mpath}: its config ({cfg2.describe()}) differs from -e ({cfg.describe()})")
        model.load_params(params)
        st = read_state(spath, None)
        dp.check_state_extra(st.get("extra", {}), spath)
        if st["num_parameters"] != dp.optimizer_numel():
            raise LLMCError(f"{spath}: holds optimizer state for {st['num_parameters']:,} values, this "
                            f"rank needs {dp.optimizer_numel():,} (a different model?)")
        dp.load_optimizer_state(st["m"], st["v"])
        train_loader.load_state(st["loader"])
        if "rng" in st.get("extra", {}):
            rng.bit_generator.state = st["extra"]["rng"]
        start_step = st["step"]
        origin = f"resumed from {mpath} (step {start_step})"
    group.agree(None, "resume")
    group.phase = "train"  # from here on an error on one rank alone aborts the job

    print(f"model: {cfg.describe()} | {origin}")
    print(f"backend: {be.describe()} | B={B} T={T} grad accum {accum} | {max_steps} steps | "
          f"train {train_loader.num_tokens:,} tokens")
    if be.name == "cuda":
        print("kernels: " + ", ".join(f"{k}={v}" for k, v in sorted(be.kernels.items())))
    if world > 1:
        print(f"data parallel: {dp.describe()}")

    logf = None
    if args.output_dir and group.is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        logf = open(os.path.join(args.output_dir, "main.log"), "a" if args.resume else "w")

    from llmc.schedule import get_lr
    get_lr(args.lr_schedule, 0, args.learning_rate, args.warmup_steps, max_steps, args.final_lr_frac)

    tokenizer = None
    if args.sample_every > 0:
        try:
            from llmc.tokenizer import get_encoding
            tokenizer = get_encoding()
        except LLMCError as e:
            print(f"WARNING: no tokenizer ({e}); samples are printed as token ids")

    decoder = None  # built at the first sample; reads the model's live weights
    overfit_batch = train_loader.next_batch() if args.overfit_single_batch else None
    for step in range(start_step, max_steps + 1):
        last_step = step == max_steps
        # a resumed run already validated, sampled and saved at start_step before it stopped:
        # doing it again would draw from the sampling rng and break bit-exact continuation
        again = bool(args.resume) and step == start_step
        # validation
        if val_loader is not None and not again and (step % args.val_every == 0 or last_step):
            val_loader.reset()
            vl = 0.0
            nb = min(args.val_batches, max(val_loader.num_tokens // (B * T * world + 1), 1))
            for _ in range(nb):
                x, y = val_loader.next_batch()
                vl += model.forward(x, y, grad=False)
            vl = dp.mean(vl / nb)  # every rank's slice of the val batches
            print(f"val loss {vl:.6f}")
            if logf:
                logf.write(f"s:{step} tel:{vl:.6f}\n"); logf.flush()
        # samples
        if (args.sample_every > 0 and not again and (step % args.sample_every == 0 or last_step) and step > 0
                and group.is_main):
            from llmc.decode import Decoder
            from llmc.sample import sample_during_training
            if decoder is None:
                decoder = Decoder(cfg, be, 1, params_buf=model.params)
            text = sample_during_training(decoder, min(args.gen_tokens, cfg.max_seq_len - 1), rng, tokenizer)
            print(f"generating:\n---\n{text}\n---")
        # checkpoint
        if args.output_dir and step > start_step and (last_step or (args.checkpoint_every > 0 and step % args.checkpoint_every == 0)):
            err = None
            try:
                path = save_checkpoint(args.output_dir, step, model, train_loader, rng, dp)
            except (LLMCError, OSError) as e:
                err = f"checkpoint at step {step}: {e}"
            group.agree(err, "checkpoint")  # every rank's files are written before anyone goes on
            print(f"wrote {path}")
        if last_step:
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
        dp.update(lr, step + 1, weight_decay=args.weight_decay, max_norm=args.grad_clip)
        loss = dp.step_loss()   # host read: the one sync of the step (and the mean over ranks)
        norm = dp.grad_norm()
        ms = (time.perf_counter() - t0) * 1000
        print(f"step {step + 1:4d}/{max_steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.2e} | "
              f"{ms:.2f} ms | {total / (ms / 1000):.0f} tok/s")
        if logf:
            logf.write(f"s:{step + 1} trl:{loss:.6f}\n"); logf.flush()
    if logf:
        logf.close()
    return 0


def cli(argv=None) -> int:
    """Entry point: user mistakes become one line on stderr and exit code 1. Under mpirun, an error
    while setting up is agreed on by every rank and printed once, by rank 0; an error on one rank
    during training takes the whole job down (the others would wait for it forever)."""
    from llmc.dist import DistError, Group
    group = None
    try:
        group = Group.start()
        return main(argv, group)
    except DistError as e:
        if not e.quiet:
            print(f"error: {e}", file=sys.stderr)
        return 1
    except LLMCError as e:
        if group is None or group.world == 1:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if group.phase == "setup":  # the others are at (or on their way to) the next agreement
            try:
                group.agree(str(e), "set-up")
            except DistError as agreed:
                if not agreed.quiet:
                    print(f"error: {agreed}", file=sys.stderr)
            return 1
        print(f"error: rank {group.rank}: {e}", file=sys.stderr, flush=True)
        group.abort(1)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BaseException:
        if group is not None and group.world > 1:  # a bug on one rank: don't leave the others hanging
            import traceback
            traceback.print_exc()
            sys.stderr.flush()
            group.abort(1)
        raise
