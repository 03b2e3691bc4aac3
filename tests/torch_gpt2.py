"""An independent GPT-2 in PyTorch (CPU, float64) over llm.c's flat parameter layout: the oracle for
the whole model. Written from the GPT-2 architecture, sharing nothing with llmc/ but the layout."""
import math

import numpy as np
import torch
import torch.nn.functional as F

NAMES = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
         "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"]


def shapes(maxT, V, Vp, L, NH, C):
    return [(Vp, C), (maxT, C), (L, C), (L, C), (L, 3 * C, C), (L, 3 * C), (L, C, C), (L, C),
            (L, C), (L, C), (L, 4 * C, C), (L, 4 * C), (L, C, 4 * C), (L, C), (C,), (C,)]


class TorchGPT2:
    def __init__(self, flat: np.ndarray, maxT, V, Vp, L, NH, C):
        self.V, self.Vp, self.L, self.NH, self.C = V, Vp, L, NH, C
        self.params = {}
        off = 0
        for name, shp in zip(NAMES, shapes(maxT, V, Vp, L, NH, C)):
            n = int(np.prod(shp))
            self.params[name] = torch.tensor(flat[off:off + n].reshape(shp), dtype=torch.float64, requires_grad=True)
            off += n

    def forward(self, idx, targets=None):
        P, L, NH, C, V = self.params, self.L, self.NH, self.C, self.V
        idx = torch.as_tensor(idx, dtype=torch.long)
        B, T = idx.shape
        hs = C // NH
        x = P["wte"][idx] + P["wpe"][:T]
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        for l in range(L):
            h = F.layer_norm(x, (C,), P["ln1w"][l], P["ln1b"][l], eps=1e-5)
            qkv = h @ P["qkvw"][l].T + P["qkvb"][l]
            q, k, v = qkv.split(C, dim=-1)
            q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).reshape(B, T, C)
            x = x + y @ P["attprojw"][l].T + P["attprojb"][l]
            h = F.layer_norm(x, (C,), P["ln2w"][l], P["ln2b"][l], eps=1e-5)
            h = F.gelu(h @ P["fcw"][l].T + P["fcb"][l], approximate="tanh")
            x = x + h @ P["fcprojw"][l].T + P["fcprojb"][l]
        x = F.layer_norm(x, (C,), P["lnfw"], P["lnfb"], eps=1e-5)
        logits = x @ P["wte"][:V].T  # the padded rows never take part
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, V), torch.as_tensor(targets, dtype=torch.long).reshape(-1))
        return logits, loss

    def flat_grads(self):
        out = []
        for name in NAMES:
            g = self.params[name].grad
            out.append(np.zeros(self.params[name].shape).reshape(-1) if g is None else g.detach().numpy().reshape(-1))
        return np.concatenate(out)

    def adamw_step(self, lr, step, wd, max_norm, b1=0.9, b2=0.95, eps=1e-8, state=None):
        """Clip by global norm (scale = max_norm/norm when norm > max_norm) then AdamW, decay on 2-D
        weights only (wte, wpe, qkvw, attprojw, fcw, fcprojw)."""
        decayed = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
        with torch.no_grad():
            norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in self.params.values()))
            scale = max_norm / norm if (max_norm > 0 and norm > max_norm) else 1.0
            for name, p in self.params.items():
                g = p.grad * scale
                m, v = state.setdefault(name, (torch.zeros_like(p), torch.zeros_like(p)))
                m.mul_(b1).add_((1 - b1) * g)
                v.mul_(b2).add_((1 - b2) * g * g)
                mhat = m / (1 - b1 ** step)
                vhat = v / (1 - b2 ** step)
                p -= lr * (mhat / (vhat.sqrt() + eps) + (wd if name in decayed else 0.0) * p)
                p.grad = None
        return norm
