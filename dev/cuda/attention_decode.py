"""Kernel lab: attention_decode, one query per sequence over the KV cache (the sampler's attention).

    python dev/cuda/attention_decode.py            # versions 1 and 2 (fp32 and bf16) at batch 1 and 8, three positions
    python dev/cuda/attention_decode.py 2 --quick

GPT-2 124M: C=768, NH=12 (hs=64), maxT=1024. Version 1: one block per (b, h), walking keys 0..pos;
version 2: the keys in chunks of 64 over B*NH*16 blocks, then a combine kernel. Bytes counted: the
cached keys and values 0..pos read once, the new q, k, v read, k, v appended and out written.
"""

import numpy as np

import lab
import llmc.ops
from llmc.bf16 import BF16, from_bf16, round_bf16, to_bf16
from llmc.ops.attention import attention_decode_ref
from llmc.testing import compare

C, NH, maxT = 768, 12, 1024
hs = C // NH

L = lab.Lab("attention_decode")
rt, rng = L.rt, np.random.default_rng(0)
for B in (1, 8):
    kc = lab.rand(rng, (B, NH, maxT, hs))
    vc = lab.rand(rng, (B, NH, maxT, hs))
    q = lab.rand(rng, (B, C), scale=2.0)
    d_kc, d_vc, d_out = rt.to_device(kc), rt.to_device(vc), rt.empty((B, C))
    for pos in (63, 319, 1023):
        L.section(f"B={B} pos={pos}")
        print(f"\n## batch {B}, position {pos}")
        ref = attention_decode_ref(q.astype(np.float64), kc.astype(np.float64), vc.astype(np.float64), pos)
        # the new token's qkv row: q, and the k, v the caches already hold at pos (the kernel writes
        # them there again, so every repeat sees the same caches)
        qkv = np.concatenate([q, kc[:, :, pos].reshape(B, C), vc[:, :, pos].reshape(B, C)], axis=1)
        d_qkv, d_pos = rt.to_device(qkv), rt.to_device(np.array([pos], np.int32))
        spec = llmc.ops.get("attention_decode")
        _, nbytes = spec.cost(B=B, C=C, NH=NH, maxT=maxT, pos=pos)  # cost model: llmc/ops/attention.py
        for v in L.selected(spec):
            launch = spec.build(rt, v, B=B, C=C, NH=NH, maxT=maxT).launch  # the bare closure: no Python call in between
            fn = (lambda launch=launch: launch(d_out, d_qkv, d_kc, d_vc, d_pos))
            label = f"{v} B={B} pos={pos}"
            L.validate(label, fn, outputs={"out": d_out}, refs={"out": ref}, atol=1e-5, rtol=1e-4)
            L.time(label, fn, bytes=nbytes, ceiling="dram")
        # the bf16 builds: caches, qkv, out bf16 (half the bytes), fp32 math; inputs made bf16 values
        # first, so the reference sees them; out is rounded once (2^-8 relative, 2^-7 allowed)
        kcb, vcb, qb = round_bf16(kc), round_bf16(vc), round_bf16(q)
        refb = attention_decode_ref(qb.astype(np.float64), kcb.astype(np.float64), vcb.astype(np.float64), pos)
        qkvb = np.concatenate([qb, kcb[:, :, pos].reshape(B, C), vcb[:, :, pos].reshape(B, C)], axis=1)
        d_kcb, d_vcb, d_qkvb = rt.to_device(to_bf16(kcb)), rt.to_device(to_bf16(vcb)), rt.to_device(to_bf16(qkvb))
        d_outb = rt.empty((B, C), BF16)
        for v in L.selected(spec):
            launch = spec.build(rt, v, "bf16", B=B, C=C, NH=NH, maxT=maxT).launch
            fn = (lambda launch=launch: launch(d_outb, d_qkvb, d_kcb, d_vcb, d_pos))
            label = f"{v} bf16 B={B} pos={pos}"
            d_outb.fill_bytes(0xFF)
            fn()
            rt.synchronize()
            msg = compare(from_bf16(d_outb.get()), refb, 2.0 ** -12 * float(np.abs(vcb).max()), 2.0 ** -7, "out")
            print(f"  variant {label}: " + (f"MISMATCH\n{msg}" if msg else "matches the reference (out)"))
            if msg:
                L.failed.append(label)
            L.time(label, fn, bytes=nbytes // 2, ceiling="dram")  # every tensor it moves is bf16
L.finish()
