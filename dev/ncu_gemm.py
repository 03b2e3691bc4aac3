"""The bf16 step's GEMMs, ours (engine 5, the planner's default plan) and cuBLAS's (through torch), one launch
each inside a profiler range, for Nsight Compute to count what each moves and issues:

    ncu --profile-from-start off --target-processes all --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section InstructionStats --page raw \
        python dev/ncu_gemm.py --B 16 --only qkv lmhead

Every GEMM runs a few times first (warm-up, outside the range), then ours and cuBLAS's once each between
cudaProfilerStart and cudaProfilerStop, in that order, so the profiled kernels come in pairs: ours
(gemm_wgmma_*), then cuBLAS's (nvjet_* or another name). The same operands as dev/bench_energy.py (random,
bf16 in and out; dweight accumulates into a bf16 gradient). Prints each GEMM's plan before its pair.
"""
import argparse

from bench_energy import LAYERS, gemm_cases  # (dev/: the same layers and operands)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--only", nargs="*", choices=list(LAYERS), help="these layers only")
    ap.add_argument("--kinds", nargs="*", choices=("fwd", "dinp", "dweight"), default=["fwd", "dinp", "dweight"])
    args = ap.parse_args()

    import torch
    from llmc.ops import gemm_wgmma as gw
    from llmc.runtime import Runtime
    rt = Runtime()
    N = args.B * args.T
    P = lambda t: t.data_ptr()  # noqa: E731
    todo = []
    for name, (C, OC) in LAYERS.items():
        if args.only and name not in args.only:
            continue
        kinds = gemm_cases(torch, N, C, OC)
        for kind in args.kinds:
            shape, cublas, ops_ = kinds[kind]
            g = gw.wgmma_build(rt, "bf16", out="bf16", **shape)
            ptrs = tuple(P(t) for t in ops_)
            todo.append((f"{name} {kind}", g.plan, lambda g=g, p=ptrs: g(*p), cublas))

    def sync():
        rt.synchronize()
        torch.cuda.synchronize()

    for _, _, ours, cublas in todo:  # warm-up: builds, tensor maps, cuBLAS's heuristics
        for _ in range(3):
            ours()
            cublas()
    sync()
    torch.cuda.profiler.start()
    for label, plan, ours, cublas in todo:
        print(f"pair: {label}: ours {plan}, then cuBLAS", flush=True)
        ours()
        sync()
        cublas()
        sync()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
