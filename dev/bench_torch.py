"""The PyTorch reference line for `make bench`: GPT-2 d12 trained by torch.compile on the same GPU,
timed the same way as dev/bench_step.py: the trainer's loop, each step launched before the previous
step's loss is read (its copy to pinned host memory queued behind the step, an event after it), a
CUDA event on the stream as each step's launches begin; the median step after warm-up. --sync: each
step's loss read before the next is launched (events around the step; bench_step --sync).

    python dev/bench_torch.py                     # fp32 weights, TF32 matmuls, B=4 and B=16, T=1024
    python dev/bench_torch.py --precision bf16    # bf16 autocast (fp32 master weights)
    python dev/bench_torch.py --precision both    # the TF32 line and the bf16-autocast line, one run
    python dev/bench_torch.py --no-compile -b 4   # eager

The model is GPT-2 124M (L=12, C=768, NH=12, Vp=50304) written here from the architecture:
flash attention through scaled_dot_product_attention(is_causal=True), tied embeddings, fused AdamW
(lr 3e-4, weight decay 0.1 on matrices), global-norm clip 1.0. One step = forward + backward + clip
+ update on random tokens. The GPU time is what the events measure: the host may still be queuing
launches (at B=4 torch.compile's step is partly host-bound), which the events include only when the
GPU waits for the host.
"""
import argparse
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, NH):
        super().__init__()
        self.NH = NH
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.NH, C // self.NH).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, L=12, C=768, NH=12, Vp=50304, maxT=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(Vp, C), nn.Embedding(maxT, C)
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.lnf = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.lnf(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def bench(B, T, precision, compile_, steps, warmup, sync=False):
    torch.manual_seed(0)
    model = GPT().cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    fwd = torch.compile(model) if compile_ else model
    x = torch.randint(0, 50257, (B, T), device="cuda")
    y = torch.randint(0, 50257, (B, T), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step().item()
    torch.cuda.synchronize()
    times = []
    if sync:
        for _ in range(steps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step().item()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
    else:
        marks, prev = [], None
        host = torch.empty((), dtype=torch.float32, pin_memory=True)
        hosts = [host, torch.empty_like(host).pin_memory()]
        for i in range(steps + 1):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
            read = None
            if i < steps:
                loss = step()
                buf = hosts[i % 2]
                buf.copy_(loss.detach(), non_blocking=True)  # queued behind the step
                done = torch.cuda.Event()
                done.record()
                read = (buf, done)
            if prev is not None:
                prev[1].synchronize()
                float(prev[0])
            prev = read
        marks[-1].synchronize()
        times = [marks[i].elapsed_time(marks[i + 1]) for i in range(steps)]
    ms = statistics.median(times)
    mem = torch.cuda.max_memory_allocated() / 2 ** 30
    del model, opt, fwd
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return ms, mem


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--batch-size", type=int, nargs="*", default=[4, 16])
    ap.add_argument("-t", "--seq-len", type=int, default=1024)
    ap.add_argument("--precision", choices=["fp32", "bf16", "both"], default="fp32")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sync", action="store_true", help="read each step's loss before launching the next")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    for precision in (("fp32", "bf16") if args.precision == "both" else (args.precision,)):
        name = ("torch.compile" if not args.no_compile else "torch eager") + (
            " TF32" if precision == "fp32" else " bf16 autocast")
        for B in args.batch_size:
            ms, mem = bench(B, args.seq_len, precision, not args.no_compile, args.steps, args.warmup, args.sync)
            print(f"{name}: B={B} T={args.seq_len}: median {ms:.2f} ms/step (GPU events) | "
                  f"{B * args.seq_len / ms * 1e3:,.0f} tokens/s | peak {mem:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
