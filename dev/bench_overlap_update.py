"""Experiment: how much of AdamW can hide under the next step's forward (side stream)?

    python dev/bench_overlap_update.py --precision bf16 -b 4

Graphs timed (median of --reps replays, CUDA events):
  fwd            the forward alone (with targets, dlogits written)
  adam           the 10 AdamW ranges alone (no global norm)
  fwd+adam       AdamW forked onto the side stream at the start, the forward on the main one, joined
  fwd+adam/sK    the same with AdamW's grid cut to K SMs' worth of blocks
  ordered/sK     AdamW per layer in the forward's order on the side stream (1-D tensors and wpe, wte,
                 then each layer's four GEMM weights), the forward waiting for each layer's
("/s0": the full grid.) Measured on an H200 (session 32, docs/results/session32_h200_2026-11-29.txt), bf16
B=4: the two in turn 3.46 ms, fwd+adam 3.43, fwd+adam/s66 3.28, ordered 3.48-3.49: at most 0.2 ms of
AdamW's 0.92 hides beside the forward, none in the order the forward reads the weights. So the trainer
does not defer its update (docs/history.md, session 32).
"""
import argparse
import statistics

from llmc import ops
from llmc.backend import CudaBackend
from llmc.config import DECAYED, config_from_name, param_layout

from bench_step import training_step  # (run as a script: dev/ is importable)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    be = CudaBackend(precision=args.precision, quiet=True)
    rt = be.rt
    cfg = config_from_name("d12")
    B, T = args.batch_size, 1024
    model, step = training_step(be, cfg, B, T)
    for i in range(3):
        step(i).loss()
    L = cfg.num_layers
    bf16 = model.bf16
    spec = ops.get("adamw")

    def build(n, off, sms):
        saved = rt.sm_count
        if sms:
            rt.sm_count = sms
        try:
            return spec.build(rt, 2, args.precision, n=n, offset=off).launch
        finally:
            rt.sm_count = saved

    # the ranges' parent (for hp and seed) by offset
    ranges = model.update_ranges

    def parent(off):
        for i, (o, n, _) in enumerate(ranges):
            if o <= off < o + n:
                return i
        raise ValueError(off)

    def launcher(off, n, sms):
        f = build(n, off, sms)
        i = parent(off)
        views = [be.view(buf, off, (n,)) for buf in (model.params, model.grads, model.m, model.v)]
        if bf16:
            mv = be.view(model.master, off, (n,))
            return lambda: f(*views, model.norm2, model.hps[i], mv, model.seed_views[i])
        return lambda: f(*views, model.norm2, model.hps[i])

    def plain(sms):
        return [launcher(o, n, sms) for o, n, _ in ranges]

    def ordered(sms):
        """[(mark, [launchers])]: 'emb' (1-D tensors, wpe, wte), then 'l0' .. 'l{L-1}' (4 GEMM weights)"""
        lay = {name: (off, size) for name, off, size in param_layout(cfg)}
        first = [launcher(off, size, sms) for name, off, size in param_layout(cfg) if name not in DECAYED or name == "wpe"]
        first.append(launcher(*lay["wte"], sms))
        out = [("emb", first)]
        for l in range(L):
            ls = []
            for name in ("qkvw", "attprojw", "fcw", "fcprojw"):
                off, size = lay[name]
                per = size // L
                ls.append(launcher(off + l * per, per, sms))
            out.append((f"l{l}", ls))
        return out

    fwd = lambda: model._launch_forward(True, True)  # noqa: E731

    def adam_plain(ls):
        def f():
            for x in ls:
                x()
        return f

    def both(ls):
        def f():
            with be.side():
                for x in ls:
                    x()
            fwd()
            be.side_join()
        return f

    def ordered_both(plan):
        def f():
            for mark, ls in plan:
                with be.side(mark):
                    for x in ls:
                        x()
            be.side_wait("emb")
            model._launch_forward(True, True, lambda l: be.side_wait(f"l{l}") if l is not None else None)
            be.side_join()
        return f

    def ordered_serial(plan):
        def f():
            for _, ls in plan:
                for x in ls:
                    x()
            fwd()
        return f

    pdl = B * T <= 4096
    cases = [("fwd", fwd), ("adam", adam_plain(plain(0))), ("fwd;adam serial", lambda: (adam_plain(plain(0))(), fwd())),
             ("fwd+adam", both(plain(0)))]
    for sms in (16, 32, 66):
        cases.append((f"fwd+adam/s{sms}", both(plain(sms))))
    cases.append(("ordered serial", ordered_serial(ordered(0))))
    for sms in (0, 16, 32, 66):
        cases.append((f"ordered/s{sms}", ordered_both(ordered(sms))))
    graphs = []
    for name, f in cases:
        f()
        rt.synchronize()
        graphs.append((name, be.graph(f, pdl=pdl)))
    res = {name: [] for name, _ in graphs}
    for r in range(args.reps):
        for name, g in graphs:
            s, e = rt.event(), rt.event()
            s.record(rt.stream)
            g()
            e.record(rt.stream)
            e.synchronize()
            res[name].append(e.time_since(s))
    print(f"{args.precision} B={B} (pdl {pdl}), median of {args.reps}, ms")
    for name, ts in res.items():
        print(f"  {name:20s} {statistics.median(ts):8.3f}   (min {min(ts):.3f})")


if __name__ == "__main__":
    main()
