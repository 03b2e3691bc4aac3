"""Which kernels cuBLAS (through torch) runs for each GEMM of a GPT-2 d12 step: name, grid, block and
time, from torch.profiler's trace. The reference line of dev/bench_gemm.py is these kernels; their
names say the tile, the cluster and whether K is split, which is what our planner chooses too.

    python dev/cublas_kernels.py                   # B=4 and B=16, T=1024, BF16 and TF32
    python dev/cublas_kernels.py --B 16 --dtype bf16 --gemm dweight

Shapes as dev/bench_gemm.py: forward out(N,OC) = inp(N,C) @ W(OC,C)^T; dinp(N,C) = dout(N,OC) @ W;
dweight(OC,C) += dout^T @ inp (addmm_ into the gradient, as bench_gemm's bf16 line), N = B*T.
"""
import argparse
import json
import os
import tempfile

LAYERS = {"qkv": (768, 2304), "attproj": (768, 768), "fc": (768, 3072), "fcproj": (3072, 768), "lmhead": (768, 50304)}


def kernels_of(fn, reps=3):
    """[(name, grid, block, mean us)] of the CUDA kernels that fn() launches, from a profiled run of
    reps calls after one warm-up call."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        trace = json.load(open(path))
    finally:
        os.unlink(path)
    seen = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel":
            continue
        a = ev.get("args", {})
        key = (ev["name"], tuple(a.get("grid", ())), tuple(a.get("block", ())))
        seen.setdefault(key, []).append(float(ev.get("dur", 0.0)))
    return [(n, g, b, sum(d) / len(d)) for (n, g, b), d in seen.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, nargs="*", default=[4, 16])
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--dtype", choices=("bf16", "tf32", "both"), default="both")
    p.add_argument("--gemm", choices=("fwd", "dinp", "dweight", "all"), default="all")
    args = p.parse_args()
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("dev/cublas_kernels.py: needs a CUDA GPU (torch sees none)")
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"# cuBLAS kernels on {torch.cuda.get_device_name()} (torch {torch.__version__})")
    dtypes = ("bf16", "tf32") if args.dtype == "both" else (args.dtype,)
    gemms = ("fwd", "dinp", "dweight") if args.gemm == "all" else (args.gemm,)
    for B in args.B:
        N = B * args.T
        for layer, (C, OC) in LAYERS.items():
            for dt in dtypes:
                t = torch.bfloat16 if dt == "bf16" else torch.float32
                x = torch.randn(N, C, device="cuda", dtype=t)
                w = (torch.randn(OC, C, device="cuda") * 0.02).to(t)
                dout = torch.randn(N, OC, device="cuda", dtype=t)
                y = torch.empty(N, OC, device="cuda", dtype=t)
                dx = torch.empty(N, C, device="cuda", dtype=t)
                dw = (torch.randn(OC, C, device="cuda") * 0.01).to(t)
                fns = {"fwd": lambda: torch.matmul(x, w.t(), out=y),
                       "dinp": lambda: torch.matmul(dout, w, out=dx),
                       "dweight": lambda: dw.addmm_(dout.t(), x)}
                for g in gemms:
                    for name, grid, block, us in kernels_of(fns[g]):
                        print(f"B={B:<3d} {layer:8s} {g:8s} {dt}  {us:9.1f} us  grid={list(grid)} "
                              f"block={list(block)}  {name}", flush=True)
                del x, w, dout, y, dx, dw
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
