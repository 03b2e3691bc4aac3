"""Generation with a KV cache: after the prompt, each new token costs one position's worth of work.

    from llmc.decode import Decoder, generate
    dec = Decoder(cfg, backend, B=1, params=host_params)     # or params_buf= a model's flat buffer
    toks = generate(dec, prompt_ids, max_new=200, temperature=0.8, top_k=40, rng=rng)

The decoder keeps, per layer, the keys and values of every position so far: kcache and vcache
(L, B, NH, maxT, hs). One step takes B new tokens at position `pos` through the network at M = B
rows: the encoder at that position, layernorm, the qkv matmul, the attention of one query over
positions 0..pos (our decode kernel on the GPU, which also appends the new k and v to the cache),
and the rest of the block; then the lm head gives the next logits. The prompt goes through one ordinary
forward pass (the training model's code at T = prompt length, sharing the decoder's weights), and
the keys and values it computed are copied into the cache.

The step's kernels read the token ids and the position from the device (one small upload per
step), so the first step runs kernel by kernel and is then captured into a CUDA graph (on the cuda
backend with cuda-python): each later step is one upload, one graph launch and one download of the
logits, instead of ~125 launches from Python.

When the context reaches maxT the window slides: the cache is rebuilt from the last maxT/2 tokens
(recomputed), and we say so once.

In bf16 (a backend with precision "bf16"), the weights, activations, KV cache and logits are bf16
and every op is its bf16 build; layernorm's mean and rstd stay fp32 (the bf16 conventions). An op
with no bf16 kernels refuses the build in one line (llmc.backend).
"""
from __future__ import annotations

import sys

import numpy as np

from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.config import GPT2Config, param_layout, param_shapes
from llmc.errors import LLMCError
from llmc.sample import EOT, sample_token


# The decode step's matmuls have M = batch rows. matmul_forward 8 (a GEMV) streams the weights at
# ~85% of the H100's bandwidth at 1 row; measured per decode layer + lm head (dev/bench_sample.py
# --matmuls, CUDA graphs): 71.5 / 82.2 / 88.1 / 99.2 us at 1 / 2 / 4 / 8 rows against the TF32
# engine's (variant 7) 93.6 / 94.0 / 94.2 / 94.7. So the decoder prefers it up to 4 rows.
GEMV, GEMV_MAX_BATCH = 8, 4


class Decoder:
    def __init__(self, cfg: GPT2Config, backend, B: int, params: np.ndarray | None = None, params_buf=None):
        self.cfg, self.be, self.B = cfg, backend, B
        L, C, NH, Vp, maxT = cfg.num_layers, cfg.channels, cfg.num_heads, cfg.padded_vocab_size, cfg.max_seq_len
        hs = C // NH
        be = backend
        f32 = np.dtype(getattr(be, "acc_dtype", be.dtype))  # what stays fp32 in bf16
        if params_buf is None:
            params_buf = be.empty((cfg.num_parameters,))
            if be.dtype == BF16:
                be.upload(params_buf, to_bf16(np.asarray(params, np.float32)))
            else:
                be.upload(params_buf, np.asarray(params, dtype=be.dtype))
        self.params = params_buf
        self.p = {name: be.view(params_buf, off, shape)
                  for (name, shape), (_, off, _) in zip(param_shapes(cfg), param_layout(cfg))}
        a = {}
        for name, shape in [("x", (B, C)), ("x2", (B, C)), ("ln", (B, C)), ("mean", (B,)), ("rstd", (B,)),
                            ("qkv", (B, 3 * C)), ("atty", (B, C)), ("proj", (B, C)),
                            ("fch", (B, 4 * C)), ("fch_gelu", (B, 4 * C)), ("logits", (B, Vp))]:
            a[name] = be.empty(shape, f32 if name in ("mean", "rstd") else None)
        self.a = a
        self.kcache = be.zeros((L, B, NH, maxT, hs))
        self.vcache = be.zeros((L, B, NH, maxT, hs))
        self.kc = [be.view(self.kcache, l * B * NH * maxT * hs, (B, NH, maxT, hs)) for l in range(L)]
        self.vc = [be.view(self.vcache, l * B * NH * maxT * hs, (B, NH, maxT, hs)) for l in range(L)]
        # the step's input on the device: B token ids, then their position (read by the kernels, so
        # that one captured CUDA graph serves every step); uploaded from pinned memory each step
        self.inp = be.zeros((B + 1,), np.int32)
        self.pos = be.view(self.inp, B, (1,))
        self._inp_host = be.pinned((B + 1,), np.int32)
        self._logits_host = be.pinned((B, Vp), be.dtype)
        # sampling on the device: one uniform draw per row in, the B chosen tokens out
        self.uniforms = be.zeros((B,), np.float64)
        self._uni_host = be.pinned((B,), np.float64)
        self.sampled = be.zeros((B,), np.int32)
        self._sampled_host = be.pinned((B,), np.int32)
        self._run = None  # the step's launches: run once eagerly, then captured (be.graph)
        op = be.op
        gemv = GEMV if B <= GEMV_MAX_BATCH else None
        self.k = {
            "encoder": op("encoder_decode", B=B, C=C),
            "layernorm": op("layernorm_forward", N=B, C=C),
            # M = B rows: the GEMV (matmul_forward 8) up to 4 rows unless --matmul-kernel names another
            "mm_qkv": op("matmul_forward", prefer=gemv, N=B, C=C, OC=3 * C, has_bias=True),
            "mm_attproj": op("matmul_forward", prefer=gemv, N=B, C=C, OC=C, has_bias=True),
            "mm_fc": op("matmul_forward", prefer=gemv, N=B, C=C, OC=4 * C, has_bias=True),
            "mm_fcproj": op("matmul_forward", prefer=gemv, N=B, C=4 * C, OC=C, has_bias=True),
            "mm_lmhead": op("matmul_forward", prefer=gemv, N=B, C=C, OC=Vp, has_bias=False),
            "residual_layernorm": op("residual_layernorm_forward", N=B, C=C),
            "gelu": op("gelu_forward", N=B * 4 * C),
        }
        # with the GEMV, the fc matmul and GELU go in one launch (matmul_forward 8's GELU epilogue),
        # unless --matmul-kernel names a variant (which has none)
        fc_gelu = dict(N=B, C=C, OC=4 * C, has_bias=True, gelu=True)
        self.fc_gelu = (gemv is not None and not be.named("matmul_forward")
                        and be.choose("matmul_forward", prefer=gemv, **fc_gelu) == gemv)
        if self.fc_gelu:
            self.k["mm_fc_gelu"] = op("matmul_forward", prefer=gemv, **fc_gelu)
        self.k["attention"] = op("attention_decode", B=B, C=C, NH=NH, maxT=maxT)
        self.k["sample"] = op("sample", B=B, V=cfg.vocab_size, Vp=Vp)
        self._prefill = {}  # T -> (inference model sharing our weights, kv fill op)

    def step(self, tokens: np.ndarray, pos: int) -> np.ndarray:
        """Feed B tokens at position pos; returns the next-token logits (B, V) on the host (a view
        of a buffer the next step overwrites)."""
        self._run_step(tokens, pos)
        logits = self.be.download_into(self._logits_host, self.a["logits"])[:, :self.cfg.vocab_size]
        return from_bf16(logits) if logits.dtype == BF16 else logits

    def step_sample(self, tokens: np.ndarray, pos: int, temperature: float, top_k: int | None,
                    rng: np.random.Generator) -> list[int]:
        """Feed B tokens at position pos and sample the next token of each row on the device
        (llmc/ops/sample.py): only B token ids come back. Draws one uniform per row from rng
        (none when greedy), as host sampling of each row in turn would."""
        if temperature > 0:
            self._uni_host[:] = [rng.random() for _ in range(self.B)]
            self.be.upload_async(self.uniforms, self._uni_host)
        self._run_step(tokens, pos)
        self.k["sample"](self.sampled, self.a["logits"], self.uniforms, temperature, top_k)
        return self.be.download_into(self._sampled_host, self.sampled).tolist()

    def _run_step(self, tokens: np.ndarray, pos: int) -> None:
        if not 0 <= pos < self.cfg.max_seq_len:
            raise LLMCError(f"decode position {pos} outside 0..{self.cfg.max_seq_len - 1}")
        self._inp_host[:self.B] = np.asarray(tokens, np.int32).reshape(self.B)
        self._inp_host[self.B] = pos
        self.be.upload_async(self.inp, self._inp_host)
        if self._run is None:
            self._launch_step()                       # first step: eager (builds, checks launches)
            self._run = self.be.graph(self._launch_step, pdl=True)  # (programmatic launches: runtime.PDL_ENV)
        else:
            self._run()

    def _launch_step(self):
        """Every launch of one decode step; token ids and position come from self.inp on the device.
        The residual stream ping-pongs between x and x2: each residual add is fused with the
        layernorm after it (residual_layernorm_forward), as in the training model."""
        cfg, a, p, k = self.cfg, self.a, self.p, self.k
        x, x2 = a["x"], a["x2"]
        k["encoder"](x, self.inp, p["wte"], p["wpe"])                                 # (B,C)
        k["layernorm"](a["ln"], a["mean"], a["rstd"], x, p["ln1w"][0], p["ln1b"][0])
        L = cfg.num_layers
        for l in range(L):
            k["mm_qkv"](a["qkv"], a["ln"], p["qkvw"][l], p["qkvb"][l])                  # (B,3C)
            k["attention"](a["atty"], a["qkv"], self.kc[l], self.vc[l], self.pos)        # k,v -> cache; (B,C)
            k["mm_attproj"](a["proj"], a["atty"], p["attprojw"][l], p["attprojb"][l])
            k["residual_layernorm"](x2, a["ln"], a["mean"], a["rstd"], x, a["proj"],      # x2 = x + attn
                                    p["ln2w"][l], p["ln2b"][l])
            if self.fc_gelu:                                                              # (B,4C)
                k["mm_fc_gelu"](a["fch_gelu"], a["ln"], p["fcw"][l], p["fcb"][l])
            else:
                k["mm_fc"](a["fch"], a["ln"], p["fcw"][l], p["fcb"][l])
                k["gelu"](a["fch_gelu"], a["fch"])
            k["mm_fcproj"](a["proj"], a["fch_gelu"], p["fcprojw"][l], p["fcprojb"][l])
            w, b = (p["ln1w"][l + 1], p["ln1b"][l + 1]) if l + 1 < L else (p["lnfw"], p["lnfb"])
            k["residual_layernorm"](x, a["ln"], a["mean"], a["rstd"], x2, a["proj"], w, b)  # x = x2 + mlp
        k["mm_lmhead"](a["logits"], a["ln"], p["wte"], None)                              # (B,Vp)

    def prefill(self, tokens: np.ndarray) -> np.ndarray:
        """The prompt's forward pass: tokens (B, T) at positions 0..T-1 through the full model
        (built once per T, sharing our weights); its keys and values fill the cache. Returns the
        logits (B, V) after the last position. Prompts shorter than 4 tokens (the trainer's samples
        start from one <|endoftext|>) go through decode steps instead: no forward model to build,
        and none of its float4 kernels refusing T=1 (they would each print a fallback note)."""
        from llmc.model import GPT2
        tokens = np.asarray(tokens, np.int32)
        B, T = tokens.shape
        cfg = self.cfg
        if T > cfg.max_seq_len:
            raise LLMCError(f"prompt of {T} tokens is longer than the model's max sequence length "
                            f"{cfg.max_seq_len}")
        if T < 4:
            for t in range(T):
                logits = self.step(tokens[:, t], t)
            return np.array(logits, copy=True)
        if T not in self._prefill:
            model = GPT2(cfg, self.be, B, T, training=False, params_buf=self.params)
            fill = self.be.op("attention_kv_fill", B=B, C=cfg.channels, NH=cfg.num_heads, maxT=cfg.max_seq_len, T=T)
            self._prefill[T] = (model, fill)
        model, fill = self._prefill[T]
        model.forward(tokens)
        for l in range(cfg.num_layers):
            fill(self.kc[l], self.vc[l], model.a["qkvr"][l])
        return np.stack([model.logits_row(b, T - 1) for b in range(B)])


def generate(dec: Decoder, prompt: list[int], max_new: int, temperature: float = 1.0,
             top_k: int | None = None, rng: np.random.Generator | None = None,
             stop_at_eot: bool = False, on_tokens=None, log=None) -> list[list[int]]:
    """B samples (dec.B) continuing the same prompt. on_tokens(list of B new tokens) is called after
    each step (for streaming). Greedy when temperature <= 0. Returns the generated tokens per row."""
    if not prompt:
        raise LLMCError("the prompt is empty (use <|endoftext|> to start from nothing)")
    rng = rng or np.random.default_rng(0)
    B, maxT = dec.B, dec.cfg.max_seq_len
    ctx = [list(prompt) for _ in range(B)]
    out = [[] for _ in range(B)]
    done = [False] * B
    if max_new <= 0:
        return out
    logits = _prefill(dec, ctx, len(ctx[0]))
    new = [sample_token(logits[b], temperature, top_k, rng) for b in range(B)]
    pos = len(ctx[0])
    warned = False
    for i in range(max_new):
        for b in range(B):
            if not done[b]:
                out[b].append(new[b])
                done[b] = stop_at_eot and new[b] == EOT
            ctx[b].append(new[b])
        if on_tokens:
            on_tokens(new, done)
        if all(done) or i == max_new - 1:
            break
        if pos == maxT:  # the context is full: slide the window, recompute the cache
            keep = maxT // 2
            if not warned:
                print(f"[context reached maxT={maxT}: sliding the window, recomputing the cache over "
                      f"the last {keep} tokens]", file=log or sys.stderr)
                warned = True
            logits = _prefill(dec, [c[-keep:] for c in ctx], keep)
            new = [sample_token(logits[b], temperature, top_k, rng) for b in range(B)]
            pos = keep
        else:  # the step's logits stay on the device: sampled there, B token ids come back
            new = dec.step_sample(np.array([c[pos] for c in ctx]), pos, temperature, top_k, rng)
            pos += 1
    return out


def _prefill(dec: Decoder, ctx: list[list[int]], n: int) -> np.ndarray:
    """Positions 0..n-1 of ctx (one forward pass) into the cache; the logits after the last."""
    return dec.prefill(np.array([c[:n] for c in ctx], np.int32))


def sample_during_training(decoder, gen_tokens: int, rng: np.random.Generator, tokenizer=None) -> str:
    """What the trainer prints every -s steps: gen_tokens tokens after <|endoftext|>, temperature 1,
    through the same KV-cache decoder as sample_gpt2.py (reading the model's live weights)."""
    toks = generate(decoder, [EOT], gen_tokens, temperature=1.0, top_k=None, rng=rng)[0]
    if tokenizer is None:
        return " ".join(str(t) for t in toks)
    return tokenizer.decode([t for t in toks if t < tokenizer.n_vocab])
