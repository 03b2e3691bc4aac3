"""The bf16 step's attention, ours (forward 4 and backward 5, in place, the trainer's builds) and torch SDPA's
(--sdpa: its default backend, or FlashAttention-2's or cuDNN's forced), one launch each inside a profiler range,
for Nsight Compute to say where each waits:

    ncu --profile-from-start off --target-processes all --set full --import-source yes \
        -o att python dev/ncu_attention.py --B 16
    ncu -i att.ncu-rep --page source --print-source sass --csv -k regex:forward_kernel4 > fwd_sass.csv

(the source page's per-instruction stall samples are how session 56 found the forward's wait for p v placed
before its softmax: docs/ops.md, "The forward's wait for p v").

Every launch runs a few times first (warm-up, outside the range), then in the range, in this order: our
forward, SDPA's forward, our backward's passes (prep, main, convert), SDPA's backward. Random normal
inputs (dout scaled by 0.1), the same for both sides.
"""
import argparse
import math

import numpy as np


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--only", choices=("forward", "backward"), help="one direction only")
    ap.add_argument("--sdpa", choices=("default", "flash", "cudnn"), default="default",
                    help="SDPA's backend: torch's own choice (cuDNN's kernel on Hopper with recent torch), or "
                         "FlashAttention-2's or cuDNN's forced")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as Fn
    from llmc.bf16 import BF16, to_bf16
    from llmc.ops import attention as A
    from llmc.runtime import Runtime
    rt = Runtime()
    B, T, C, NH = args.B, args.T, 768, 12
    hs = C // NH
    rng = np.random.default_rng(1337)
    inp = rng.standard_normal((B, T, 3 * C)).astype(np.float32)
    d_inp = rt.to_device(to_bf16(inp))
    d_out, d_lse = rt.empty((B, T, C), BF16), rt.empty((B, NH, T))
    dout = rng.standard_normal((B, T, C)).astype(np.float32) * 0.1
    d_dout = rt.to_device(to_bf16(dout))
    d_dinp = rt.empty((B, T, 3 * C), BF16)
    fwd = A.build_flash_attention_forward_wgmma(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    bwd = A.build_flash_attention_backward_wgmma5(rt, B=B, T=T, C=C, NH=NH, qkv_in_place=True)
    ours_f = lambda: fwd(d_out, d_inp, d_lse, d_inp)  # noqa: E731
    ours_b = lambda: bwd(d_dinp, d_dout, d_inp, d_lse, d_out)  # noqa: E731

    x = torch.from_numpy(inp).cuda().to(torch.bfloat16).view(B, T, 3, NH, hs).permute(2, 0, 3, 1, 4)
    q, k, v = (t.contiguous().requires_grad_() for t in x)
    g = torch.from_numpy(dout).cuda().to(torch.bfloat16).view(B, T, NH, hs).transpose(1, 2).contiguous()
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}.get(args.sdpa)
    with sdpa_kernel(backend) if backend is not None else nullcontext():
        y = Fn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hs))
        sdpa_f = lambda: Fn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(hs))  # noqa: E731
        sdpa_b = lambda: torch.autograd.grad(y, (q, k, v), g, retain_graph=True)  # noqa: E731

        def sync():
            rt.synchronize()
            torch.cuda.synchronize()

        todo = []
        if args.only != "backward":
            todo += [("ours forward", ours_f), ("sdpa forward", sdpa_f)]
        if args.only != "forward":
            todo += [("ours backward (prep, main, convert)", ours_b), ("sdpa backward", sdpa_b)]
        for _, f in todo:
            for _ in range(3):
                f()
        sync()
        torch.cuda.profiler.start()
        for label, f in todo:
            print(f"profiled: {label}", flush=True)
            f()
            sync()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
