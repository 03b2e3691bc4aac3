"""Kernel lab: encoder_backward at the trainer's shape (B=4, T=1024, C=768, Vp=50304), fp32 and bf16.

    python dev/cuda/encoder_backward.py           # every variant and dtype, block-size sweep, table
    python dev/cuda/encoder_backward.py 2 3 6     # the deterministic ones
    python dev/cuda/encoder_backward.py 3 6 --dtype bf16 --batch 16 --quick
    python dev/cuda/encoder_backward.py 9 10 --dtype bf16 --batch 16 --sets u,h,t,t32   # the id sets by name

Id distributions: uniform over the vocab (almost every token distinct), Zipf over the vocab (p(k) ~ 1/k:
the most frequent token at ~9% of positions), which is where the owner variants (2, 3) pay for summing
one token's rows in one block (rows labelled "z"), and text (rows "t"): the first B*T tokens of tiny
shakespeare's val split when prepro_tinyshakespeare.py has written it (its most frequent token at 8% of
the first 4096 and 16384 positions, 69 tokens of more than 32 rows holding 54% of the 16384). Two more
sets, run when --sets names them (the default is u,z,t): "h", uniform ids with one token at 8% of the
positions (a frequent token's chain alone: rows "h"), and "t32", the text with the tokens of more than 32
rows replaced by uniform ids (text without a multi-piece token: rows "t32"), and "d", every id distinct
(no token twice: the dwpe sums and one row a token alone; B*T <= V). Only the deterministic owner variants have
bf16 builds (rows "3 bf16", "9 bf16 z", ...; 9 is the bf16 default): inputs are bf16 copies, the reference float64 on them, and
each output element is rounded once (rtol 2^-8, atol 1e-5 of the output's rms for the fp32 sums).
Bytes counted: dout and the ids read once; each used dwte row and the T dwpe rows read and written
once ("+="), 4 bytes an element in fp32, 2 in bf16 (variant 6's 20 bytes of scratch a position, in
L2, not counted). Timed repeats keep accumulating into dwte/dwpe
(the values don't matter to the time). Variants 8 and 9 read records computed on the host from the ids
(uploaded before its rows are timed): the GPU time is the launch alone, and the host's time for the
records is printed after the table.

    python dev/cuda/encoder_backward.py 10 --dtype bf16 --batch 16 --define encoder:ENC10_NO_DWPE=1

measures what 10 would cost if dwpe were summed elsewhere (a measurement build, never the op): its dwpe units
read only the rows of the tokens seen once and leave dwpe alone, so dout is read once; its rows are labelled
"(dwte only)", count no dwpe bytes, and check dwpe untouched (session 52).
"""

import time
from pathlib import Path

import numpy as np

import lab
from llmc import ops
from llmc.bf16 import BF16, round_bf16, to_bf16
from llmc.data import read_shard, shard_num_tokens
from llmc.errors import VariantRefused
from llmc.ops.encoder import encoder_backward8_records, encoder_backward_ref

L = lab.Lab("encoder_backward")
B, T, C, V, Vp, maxT = L.args.batch or 4, 1024, 768, 50257, 50304, 1024
N = B * T
BLOCK_SIZES = [None, 64, 128, 256, 512, 1024]

rt, rng = L.rt, np.random.default_rng(0)
zipf = 1.0 / np.arange(1, V + 1)
TEXT = Path(__file__).resolve().parents[1] / "data" / "tinyshakespeare" / "tiny_shakespeare_val.bin"
have_text = TEXT.exists() and shard_num_tokens(TEXT) >= N  # (prepro_tinyshakespeare.py writes it)
SETS = L.chosen_sets(("u", "z", "t", "h", "t32", "d"), ("u", "z", "t") if have_text else ("u", "z"))
if {"t", "t32"} & set(SETS) and not have_text:
    L.parser.error(f"--sets t, t32: need {TEXT.name} with at least {N} tokens (run prepro_tinyshakespeare.py)")
if "d" in SETS and N > V:
    L.parser.error(f"--sets d: every id distinct needs B*T <= {V} (B={B}, T={T})")
uniform = rng.integers(0, V, (B, T)).astype(np.int32)
text = np.asarray(read_shard(TEXT)[:N], np.int32).reshape(B, T) if have_text else None
ids = {}  # the row label's tag: the set (uniform rows unlabelled)
for name in SETS:
    if name == "u":
        ids[""] = uniform
    elif name == "z":
        ids["z"] = rng.choice(V, (B, T), p=zipf / zipf.sum()).astype(np.int32)
    elif name == "t":
        ids["t"] = text
    elif name == "h":  # one token (11) at 8% of the positions of the uniform batch
        a = uniform.copy().reshape(-1)
        a[rng.choice(N, N * 8 // 100, replace=False)] = 11
        ids["h"] = a.reshape(B, T)
    elif name == "d":  # every id distinct
        ids["d"] = rng.choice(V, N, replace=False).astype(np.int32).reshape(B, T)
    else:  # "t32": the text's tokens of more than 32 rows replaced by uniform ids
        a = text.copy().reshape(-1)
        big = np.bincount(a)[a] > 32
        a[big] = rng.integers(0, V, int(big.sum()))
        ids["t32"] = a.reshape(B, T)
dout = lab.rand(rng, (B, T, C))
init32 = {"dwte": lab.rand(rng, (Vp, C)), "dwpe": lab.rand(rng, (maxT, C))}
per_dtype = {}  # dtype: (outs, init, d_dout, dout as float64, init as float64, bytes per element)
for dt, conv, size in (("fp32", lambda a: a, 4), ("bf16", to_bf16, 2)):
    val = (lambda a: a) if dt == "fp32" else round_bf16
    dty = np.float32 if dt == "fp32" else BF16
    per_dtype[dt] = ({"dwte": rt.empty((Vp, C), dty), "dwpe": rt.empty((maxT, C), dty)},
                     {k: conv(v) for k, v in init32.items()}, rt.to_device(conv(dout)),
                     val(dout).astype(np.float64), {k: val(v).astype(np.float64) for k, v in init32.items()}, size)
cases = {}
for tag, inp in ids.items():
    U, top = len(np.unique(inp)), np.bincount(inp.ravel()).max()
    print(f"  B={B}, ids{' ' + tag if tag else ''}: {U} distinct tokens among {N} positions, "
          f"the most frequent {top} times")
    for dt, (_, _, _, dout64, init64, size) in per_dtype.items():
        refs = dict(zip(("dwte", "dwpe"), encoder_backward_ref(init64["dwte"].copy(), init64["dwpe"].copy(), dout64, inp)))
        cases[tag, dt] = (rt.to_device(inp), refs, 4 * N + size * (N * C + 2 * U * C + 2 * T * C))

no_dwpe = str(L.rt.extra_defines.get("encoder", {}).get("ENC10_NO_DWPE", "0")) not in ("0", "")
dwte_only = {}  # tag, dtype: (refs with dwpe untouched, bytes without dwpe): variant 10 under ENC10_NO_DWPE
for (tag, dt), (d_inp, refs, nbytes) in cases.items():
    size = per_dtype[dt][5]
    dwte_only[tag, dt] = ({"dwte": refs["dwte"], "dwpe": per_dtype[dt][4]["dwpe"]}, nbytes - size * 2 * T * C)

spec = ops.get("encoder_backward")
for n in L.selected(spec):
    for dt in L.dtypes(spec.variants[n]):
        outs, init, d_dout = per_dtype[dt][:3]
        for tag in ids:
            d_inp, refs, nbytes = cases[tag, dt]
            label = " ".join(str(x) for x in (n, "" if dt == "fp32" else dt, tag) if x != "")
            if n == 10 and no_dwpe:
                refs, nbytes = dwte_only[tag, dt]
                label += " (dwte only)"
            if dt == "fp32":
                atol = {"dwte": 1e-4, "dwpe": 1e-4}
                rtol = 1e-5
            else:
                atol = {k: 1e-5 * float(np.sqrt(np.mean(np.square(r)))) for k, r in refs.items()}
                rtol = 2.0 ** -8
            for bs in L.block_sizes(BLOCK_SIZES):
                try:
                    built = spec.build(rt, n, dt, B=B, T=T, C=C, block_size=bs)
                except VariantRefused as e:
                    print(f"  {e}")
                    continue
                built.put_host_inputs(ids[tag])  # (8, 9: the records of these ids, computed on the host)
                launch = built.launch  # the bare closure
                fn = lambda: launch(outs["dwte"], outs["dwpe"], d_dout, d_inp)  # noqa: E731
                key = label if label != str(n) else n
                L.validate(key, fn, outputs=outs, refs=refs, atol=max(atol.values()), rtol=rtol, init=init)
                L.time(key, fn, block_size=bs or "default", bytes=nbytes, ceiling="dram")
if {8, 9} & set(L.selected(spec)):  # 8's and 9's host part, not in their GPU time: what the trainer's set_batch adds
    for tag, inp in ids.items():
        ms = []
        for _ in range(20):
            t0 = time.perf_counter()
            encoder_backward8_records(inp)
            ms.append(1e3 * (time.perf_counter() - t0))
        print(f"  variant 8's and 9's records on the host (numpy), ids{' ' + tag if tag else ''}: {np.median(ms):.3f} ms "
              f"(median of 20; beside the GPU's work in the pipelined training loop)")
L.finish()
