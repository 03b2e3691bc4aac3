"""Kernel lab: the fused classifier (softmax + cross-entropy + logit gradient) at the trainer's shape.

    python dev/cuda/classifier.py            # validate + time every variant over block sizes
    python dev/cuda/classifier.py 2 4        # only variants 2 and 4
    python dev/cuda/classifier.py --quick    # default block size, 10 repeats

Shape: GPT-2 124M at B=4, T=1024: N=4096 rows, V=50257 real columns padded to Vp=50304.
Bytes counted (the floor): read the logits once and write the gradient once, N*Vp*4 each, plus
targets read and losses written: 1.65 GB, 0.55 ms at 2.98 TB/s. The "loss only" lines
(write_dlogits=0, the eval path) count N*Vp*4 read + N*8.
Reference line: torch's F.cross_entropy forward + backward on a (N, V) fp32 tensor (no padding).
"""

import numpy as np

import lab
from llmc.ops import classifier as op_module
from llmc.ops.classifier import classifier_backward_ref, classifier_forward_ref

N, V, Vp = 4 * 1024, 50257, 50304
DLOSS = 1.0 / N  # the trainer's mean-loss gradient scale
BLOCK_SIZES = {1: (1024, 512, 256), 2: (1024, 512, 256), 3: (1024, 512), 4: (1024, 512)}

L = lab.Lab("classifier")
rt = L.rt
spec = op_module.OPS[0]  # the module itself: a half-written sibling op can't break this lab

rng = np.random.default_rng(0)
logits = lab.rand(rng, (N, Vp), scale=2.0)
logits[:, V:] = np.nan  # padding is never read for the loss; the gradient writes zeros there
targets = rng.integers(0, V, size=N).astype(np.int32)
print("computing the float64 reference ...")
losses_ref, probs = classifier_forward_ref(logits.astype(np.float64), targets, V)
dlogits_ref = classifier_backward_ref(probs, targets, DLOSS, Vp)
del probs

d_logits, d_targets, d_losses = rt.to_device(logits), rt.to_device(targets), rt.empty((N,))
bytes_fused = 2 * N * Vp * 4 + 2 * N * 4
bytes_loss = N * Vp * 4 + 2 * N * 4

for n in L.selected(spec):
    for bs in L.block_sizes(BLOCK_SIZES[n]):
        launch = spec.build(rt, n, N=N, V=V, Vp=Vp, block_size=bs).launch  # the bare closure: no Python call in between
        fused = lambda: launch(d_losses, d_logits, d_targets, DLOSS, 1)  # noqa: E731
        # fp32 vs float64: loss to ~1e-6 absolute, gradient p*dloss (~1e-10 here) to 1e-5 relative
        if bs == BLOCK_SIZES[n][0]:
            L.validate(n, fused, outputs={"losses": d_losses, "logits": d_logits},
                       refs={"losses": losses_ref, "logits": dlogits_ref}, atol=1e-14, rtol=1e-5,
                       init={"logits": logits})
        # timed on whatever the logits hold by now (the gradient of the last run): same work
        L.time(n, fused, block_size=bs, bytes=bytes_fused)
    launch = spec.build(rt, n, N=N, V=V, Vp=Vp).launch  # the bare closure: no Python call in between
    L.time(f"{n} loss only", lambda: launch(d_losses, d_logits, d_targets, DLOSS, 0), bytes=bytes_loss)

try:
    import torch
    if not torch.cuda.is_available():
        raise ImportError("no CUDA in this torch")
    import torch.nn.functional as F
    x = torch.tensor(logits[:, :V], device="cuda", requires_grad=True)
    t = torch.tensor(targets, device="cuda", dtype=torch.long)

    def torch_fused():
        loss = F.cross_entropy(x, t)
        torch.autograd.grad(loss, x)
    L.reference("torch F.cross_entropy fwd+bwd", torch_fused, bytes=2 * N * V * 4 + 2 * N * 4)
except ImportError as e:
    print(f"WARNING: no torch reference line ({e})")

L.finish()
