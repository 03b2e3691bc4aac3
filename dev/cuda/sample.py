"""Kernel lab: sample, the next token from each row of logits on the GPU (the sampler's last kernel).

    python dev/cuda/sample.py            # greedy, top-k 40 and the full distribution, batch 1 and 8
    python dev/cuda/sample.py --quick
    python dev/cuda/sample.py --dtype bf16

GPT-2's vocabulary (V=50257, Vp=50304). The kernel applies llmc.sample.sample_with_uniform's rule to
each row with the row's uniform draw: validated token for token against it (greedy exactly; the
draws here land nowhere near a boundary between two tokens). Bytes counted: the logits read once
(the radix select for top-k reads its row 4 more times, from L2). Reference line: what PyTorch code
does on the GPU, torch.topk + softmax + torch.multinomial (not the same draws).

bf16 (rows "1 bf16 ...", for a bf16 model): bf16 logits, widened into shared memory; validated token
for token against the host sampler on the same bf16 values; bytes 2*B*V. Both dtypes by default;
--dtype fp32 or --dtype bf16 runs one.
"""


import numpy as np

import lab
import llmc.ops
from llmc.bf16 import from_bf16, to_bf16
from llmc.ops.sample import sample_ref

V, Vp = 50257, 50304


L = lab.Lab("sample")
DTYPES = ("fp32", "bf16") if L.args.dtype == "both" else (L.args.dtype,)  # lab.py's --dtype
rt, rng = L.rt, np.random.default_rng(0)
for dtype, B in ((dt, b) for dt in DTYPES for b in (1, 8)):
    logits = (rng.standard_normal((B, Vp)) * 3).astype(np.float32)
    host = logits
    if dtype == "bf16":  # the host sampler sees the bf16 values the kernel reads
        host = to_bf16(logits)
        logits = from_bf16(host)
    esize = 4 if dtype == "fp32" else 2
    u = rng.random(B)
    d_logits, d_u, d_tok = rt.to_device(host), rt.to_device(u), rt.empty((B,), np.int32)
    built = llmc.ops.get("sample").build(rt, 1, dtype, B=B, V=V, Vp=Vp)
    launch = built.launch  # the bare closure: no Python call in between
    print(f"{dtype} batch {B}: the row {'is' if built.info['staged'] else 'is not'} staged in shared memory")
    sfx = "" if dtype == "fp32" else " bf16"
    for name, temperature, top_k in (("greedy", 0.0, None), ("top-k 40", 1.0, 40), ("full", 1.0, None)):
        L.section(f"B={B} {name}{sfx}")
        print(f"\n## {dtype} batch {B}, {name}")
        ref = sample_ref(logits, u, V, temperature, top_k)
        fn = (lambda t=temperature, k=top_k: launch(d_tok, d_logits, d_u, t, k))
        label = f"1{sfx} B={B} {name}"
        L.validate(label, fn, outputs={"tokens": d_tok}, refs={"tokens": ref}, atol=0, rtol=0)
        L.time(label, fn, bytes=esize * B * V, ceiling="dram")
        try:
            import torch
            tl = torch.from_numpy(logits[:, :V]).cuda().to(torch.float32 if dtype == "fp32" else torch.bfloat16)

            def torch_sample(t=temperature, k=top_k):
                if t <= 0:
                    return tl.argmax(-1)
                z = tl / t
                if k:
                    vals, idx = torch.topk(z, k, dim=-1)
                    return idx.gather(-1, torch.multinomial(torch.softmax(vals, -1), 1))
                return torch.multinomial(torch.softmax(z, -1), 1)
            L.reference(f"torch{sfx} B={B} {name}", torch_sample, bytes=esize * B * V)
        except (ImportError, RuntimeError) as e:
            print(f"  no torch reference ({e})")
L.finish()
