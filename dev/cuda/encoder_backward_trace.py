"""Where one launch of encoder_backward 10 spends its time, unit by unit (a measurement build: ENC10_TRACE=1).

    python dev/cuda/encoder_backward_trace.py --batch 16
    python dev/cuda/encoder_backward_trace.py --batch 16 --sets z,t --define encoder:ENC_TREE_G=4 \\
        --define encoder:ENC10_WHOLE_MAX=4 --npz trace.npz

Variant 10 (bf16) walks a work list on a persistent grid: the pieces of the tokens of more than 32 rows
("multi", on warps of their own), the slices of the other pieces ("piece"), the position units ("dwpe"; they
also add the rows of the tokens seen once) and the one-piece tokens a whole row a warp ("whole"; after the
position units since session 53, ENC10_DWPE_MID). Built with ENC10_TRACE=1, each unit's warp writes the
unit's start and end (%globaltimer and clock64), its SM and warp to a device array, and each warp its own
start, read back after one launch on a flushed L2. The tables: when the warps started and how long they took
to reach their first unit; per kind of unit, how many, how long (clock64 cycles at the SM's clock, as us),
when they start and end after the first unit's start; how many were in flight in each tenth of the launch;
how busy the warps were; the units that ended last. Beside them the traced build's own time (CUDA events,
median of --repeat launches; its trace stores make it a little slower than the op).

Id sets as in dev/cuda/encoder_backward.py: u (uniform), z (Zipf), t (tiny shakespeare's val split, when
prepro_tinyshakespeare.py has written it), h (uniform with one token at 8% of the places).
"""

import argparse
from pathlib import Path

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, to_bf16
from llmc.data import read_shard, shard_num_tokens
from llmc.ops.encoder import ENC10_DWPE_MID, encoder_backward10_unit_kinds

pre = argparse.ArgumentParser(add_help=False)
pre.add_argument("--npz", help="write the raw traces (kind, start ns, end ns, cycles, SM, warp a unit) here")
own, rest = pre.parse_known_args()
L = lab.Lab("encoder_backward_trace", rest)
rt = L.rt
rt.extra_defines.setdefault("encoder", {})["ENC10_TRACE"] = "1"  # (a string, as --define gives)
B, T, C, V, Vp = L.args.batch or 16, 1024, 768, 50257, 50304
N = B * T
rng = np.random.default_rng(0)
TEXT = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare" / "tiny_shakespeare_val.bin"
have_text = TEXT.exists() and shard_num_tokens(TEXT) >= N
SETS = L.chosen_sets(("u", "z", "t", "h"), ("u", "z", "t") if have_text else ("u", "z"))
if "t" in SETS and not have_text:
    L.parser.error(f"--sets t: need {TEXT.name} with at least {N} tokens (run prepro_tinyshakespeare.py)")
uniform = rng.integers(0, V, (B, T)).astype(np.int32)
zipf = 1.0 / np.arange(1, V + 1)
ids = {}
for name in SETS:
    if name == "u":
        ids[name] = uniform
    elif name == "z":
        ids[name] = rng.choice(V, (B, T), p=zipf / zipf.sum()).astype(np.int32)
    elif name == "t":
        ids[name] = np.asarray(read_shard(TEXT)[:N], np.int32).reshape(B, T)
    else:
        a = uniform.copy().reshape(-1)
        a[rng.choice(N, N * 8 // 100, replace=False)] = 11
        ids[name] = a.reshape(B, T)

spec = ops.get("encoder_backward")
d_dout = rt.to_device(to_bf16(rng.standard_normal((B, T, C)).astype(np.float32) * 0.01))
dwte, dwpe = rt.zeros((Vp, C), BF16), rt.zeros((T, C), BF16)
mod = rt.module("encoder")
tptr, tsize = mod.get_global("enc10_trace")
eptr, esize = mod.get_global("enc10_entry")
clock_khz = rt.device.get_attribute(rt.drv.device_attribute.CLOCK_RATE)
KINDS = ("multi", "piece", "whole", "dwpe")
saved = {}


def q(a, p):
    return float(np.percentile(a, p)) if len(a) else float("nan")


for name, inp in ids.items():
    built = spec.build(rt, 10, "bf16", B=B, T=T, C=C)
    built.put_host_inputs(inp)
    d_inp = rt.to_device(inp)
    fn = lambda: built.launch(dwte, dwpe, d_dout, d_inp)  # noqa: E731
    ms = float(np.median(rt.time_ms(fn, warmup=3, repeat=L.args.repeat, flush_l2=True)))
    rt.drv.memset_d8(tptr, 0, tsize)
    rt.drv.memset_d8(eptr, 0, esize)
    rt.time_ms(fn, warmup=0, repeat=1, flush_l2=True)  # the traced launch: one, on a flushed L2
    rt.synchronize()
    tr = np.empty(tsize // 8, np.uint64)
    rt.drv.memcpy_dtoh(tr, tptr)
    tr = tr.reshape(-1, 6)
    entry = np.empty(esize // 8, np.uint64)
    rt.drv.memcpy_dtoh(entry, eptr)
    recs = built.scratch["records"].get()
    nh, nmulti = (int(x) for x in recs[4 * N:4 * N + 2])
    mid = int(rt.extra_defines["encoder"].get("ENC10_DWPE_MID", ENC10_DWPE_MID))
    kind = encoder_backward10_unit_kinds(recs, B, T, C, "bf16", mid)  # (the kernel's order: KINDS)
    total = len(kind)
    tr = tr[:total]
    if (tr[:, 1] == 0).any():
        print(f"  {name}: {(tr[:, 1] == 0).sum()} of {total} units left no trace (more than the trace holds?)")
    g0, g1, c0, c1 = (tr[:, i].astype(np.int64) for i in range(4))
    sm, warp = tr[:, 4].astype(np.int64), tr[:, 5].astype(np.int64)
    base = g0.min()
    start_us, end_us = (g0 - base) / 1e3, (g1 - base) / 1e3
    dur_us = (c1 - c0) / (clock_khz / 1e3)  # (cycles at the SM's base clock rate: a unit's own time)
    span = end_us.max()
    steps = np.unique(np.diff(np.unique(g0)))
    W = int(warp.max()) + 1
    busy = np.bincount(warp, weights=(g1 - g0) / 1e3, minlength=W)
    first = np.full(W, np.inf)
    np.minimum.at(first, warp, start_us)
    lastend = np.zeros(W)
    np.maximum.at(lastend, warp, end_us)
    counts = np.bincount(inp.ravel())
    print(f"\n== ids {name}, B={B}: {len(np.unique(inp))} distinct, top token {counts.max()} rows; launch {ms:.4f} ms "
          f"(traced build, median of {L.args.repeat}); units {total} on {W} warps (heads {nh}, multi-piece "
          f"tokens' {nmulti}); globaltimer's smallest step {steps[0] if len(steps) else 0} ns")
    has = entry[:W] > 0
    e_us = (entry[:W].astype(np.int64) - base) / 1e3  # each warp's entry, from the first unit's start
    lead = first - e_us
    ok = has & np.isfinite(first)
    print(f"  warps' entry (before the work list is read): first {e_us[has].min():+.2f}, median {np.median(e_us[has]):+.2f}, "
          f"last {e_us[has].max():+.2f} us; entry to the warp's first unit: median {np.median(lead[ok]):.2f}, "
          f"max {lead[ok].max():.2f} us")
    print(f"  first unit to last end: {span:.2f} us; warps' first start: median {q(first, 50):.2f}, max "
          f"{first.max():.2f} us; warps' last end: p10 {q(lastend, 10):.2f}, median {q(lastend, 50):.2f}, p90 "
          f"{q(lastend, 90):.2f} us; warps busy {busy.sum() / (W * span):.0%} of warps x span")
    print("  kind   units  dur p50 / p90 / max us   start p50 / max us   end p50 / p99 / max us")
    for k, kn in enumerate(KINDS):
        m = kind == k
        if not m.any():
            continue
        print(f"  {kn:6s} {m.sum():5d}  {q(dur_us[m], 50):6.2f} / {q(dur_us[m], 90):6.2f} / {dur_us[m].max():6.2f}"
              f"   {q(start_us[m], 50):6.2f} / {start_us[m].max():6.2f}"
              f"   {q(end_us[m], 50):6.2f} / {q(end_us[m], 99):6.2f} / {end_us[m].max():6.2f}")
    edges = np.linspace(0, span, 11)
    running = [[int(((kind == k) & (start_us < b) & (end_us > a)).sum()) for a, b in zip(edges[:-1], edges[1:])]
               for k in range(4)]
    print("  units in flight in each tenth of the span: " + "; ".join(
        f"{kn} " + " ".join(str(x) for x in running[k]) for k, kn in enumerate(KINDS) if (kind == k).any()))
    order = np.argsort(end_us)[::-1][:8]
    print("  the last units to end: " + ", ".join(
        f"{KINDS[kind[u]]} u{u} [{start_us[u]:.1f}, {end_us[u]:.1f}] w{warp[u]}" for u in order))
    saved[name] = np.stack([kind, g0 - base, g1 - base, c1 - c0, sm, warp], 1)

if own.npz:
    np.savez(own.npz, **saved)
    print(f"\nraw traces (kind, start ns, end ns, cycles, SM, warp) a unit: {own.npz}")
