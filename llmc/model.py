"""GPT-2 over flat buffers in llm.c's layout, written once for both backends.

    from llmc.backend import make_backend
    from llmc.model import GPT2
    model = GPT2(cfg, make_backend("cuda"), B=4, T=1024)   # every buffer allocated here, once
    model.load_params(params)                                # host fp32, llm.c order (or init_params)
    loss = model.forward(x, y)                               # mean loss (host float)
    model.zero_grad(); model.backward(); model.update(lr=3e-4, step=1)
    print(model.grad_norm())

Each op call is one line below, with the shapes in comments; what each op computes and whether it
overwrites (=) or accumulates (+=) its outputs is in docs/ops.md.

Memory notes (GPT-2 124M, B=4, T=1024): per layer we keep what backward needs (ln1, qkvr, att or lse,
atty, residual2, ln2, fch, residual3 and the layernorm statistics). The GELU output and the qkv /
attproj / fcproj matmul outputs are not kept: one scratch buffer each, and GELU is recomputed in
backward (one extra cheap pass per layer saves 600 MB). With the composite attention
(--attention-kernel 1), att (B,NH,T,T) per layer is half of the activation memory; the fused
attention (2 and 3; the default) keeps only a (B,NH,T) log-sum-exp per layer instead.
`recompute` (the trainer's -r, as llm.c's): 0 keeps each layer's GELU output instead of recomputing
it; 1 (the default) recomputes GELU in backward; 2 also recomputes the two layernorm outputs (ln1,
ln2: one scratch buffer each) in backward from the saved residuals and statistics.
The (B,T,Vp) logits live only from the lm head's forward to its backward; outside that window their
memory holds the one-layer scratch buffers, the backward's gradient scratch and the scratch of the
backward's builds (share_scratch, LLMC_SHARE_SCRATCH; _scratch_phase, _layout): bf16 d12 at B=16, -r 1
allocates 6.90 GiB, where llm.c's trainer allocates 7.07 by its tensor sizes (llmc_train_bytes).

Precision (be.precision): fp32, or bf16 as llm.c's main trainer does it: parameters, gradients and
activations are bf16 (uint16 bits on the host: llmc/bf16.py); what the bf16 conventions keep in
fp32 stays fp32 (be.acc_dtype): the layernorm means and rstds, attention's saved log-sum-exp, the
per-token losses and their running sum, the squared grad norm, AdamW's m, v and hyperparameters,
and the fp32 master copy of the weights, which AdamW updates; each update then writes the bf16
weights from the master with stochastic rounding (a uint32 seed per AdamW launch, on the device,
drawn each step from the run's rounding RNG `sr_state`: llm.c's xorshift, whose state the
checkpoint's state file holds, so a resumed run draws the same seeds). stochastic_rounding = False
writes seed 0: round to nearest even (the tests).

Bias gradients: fcproj's, attproj's and fc's are column sums of dres and dfch, which a layernorm
backward and GELU backward write just before; where the chosen variants have the fused form
(colsum=True: layernorm_backward 5, gelu_backward 2) those kernels add the sums as they write, and
no matmul_backward_bias runs for them (fuse_bias=False or LLMC_FUSED_BIAS=0: the separate passes).
qkv's is the column sums of dqkv, which attention_backward writes: its Hopper builds (variant 5, the
bf16 default, and 4, bf16 and fp32) have the fused form too (colsum=True); elsewhere matmul_backward_bias
sums dqkv.
The fc layer's GELU can be fused likewise (fuse_gelu=True or LLMC_FUSED_GELU=1; off by default, not
faster in the step): where the chosen matmul_forward variant has the fused form (gelu_pre=True: engine
5 writes fch and gelu(fch) from one epilogue) no gelu_forward runs in the forward.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from llmc.bf16 import BF16, from_bf16, to_bf16
from llmc.checkpoint import LLMC_RNG_INIT as SR_RNG_INIT  # llm.c's initial stochastic-rounding RNG state
from llmc.config import DECAYED, GPT2Config, param_layout, param_shapes
from llmc import ops, switches
from llmc.errors import LLMCError
from llmc.ops.adamw import hyperparams


# Programmatic dependent launch (llmc/runtime.py, PDL_ENV) in the training step's graphs when a micro-step
# has at most this many tokens (B * T). Measured on the H200 (d12, T=1024 unless said, LLMC_PDL=1 against
# plain launches, interleaved rounds; docs/ops.md "PDL"): faster the smaller the step, bf16 B=1 T=64 -4.8%,
# B=1 -1.3%, B=2 -1.3%, B=4 -0.1 to -0.6% (three calls); fp32 B=1 -2.3%, B=2 -1.3%, B=4 -0.3 to -0.5%;
# but bf16 B=8 +0.5%, B=16 +0.5 to +1.0%, fp32 B=8 +0.1%. LLMC_PDL=1 / 0 overrides it either way.
PDL_TRAIN_TOKENS = 4096

# the weight whose gradient each dweight GEMM of the backward writes (first_write), by call site
GEMM_WEIGHTS = {"lmhead": "wte", "fcproj": "fcprojw", "fc": "fcw", "attproj": "attprojw", "qkv": "qkvw"}


def _size(shape) -> int:
    return int(np.prod(shape))


def _align(n: int) -> int:
    """Elements rounded up to 64: every activation view starts on a 256-byte boundary in fp32 (128
    in bf16), so the vectorised kernels can take any of them."""
    return -(-n // 64) * 64


def next_seed(state: int) -> tuple[int, int]:
    """One step of llm.c's stochastic-rounding RNG (xorshift64*): (new state, uint32 seed). A seed
    of 0 means "round to nearest" to the AdamW kernel, so 0 is drawn again."""
    while True:
        state ^= state >> 12
        state ^= (state << 25) & 0xFFFFFFFFFFFFFFFF
        state ^= state >> 27
        seed = ((state * 0x2545F4914F6CDD1D) & 0xFFFFFFFFFFFFFFFF) >> 32
        if seed:
            return state, seed


class StepRead:
    """A step's mean loss and gradient norm, on their way to the host (GPT2.read_step): the copies
    were queued on the stream behind the step's launches, so the host can launch the next step
    before it waits for them. loss() and norm() wait for those copies only."""

    def __init__(self, copies, loss_host, n_tokens: int, micro_steps: int, norm_host=None):
        self._copies, self._loss_host, self._norm_host = copies, loss_host, norm_host
        self._n, self._micro = n_tokens, max(micro_steps, 1)
        self._values = None

    def wait(self) -> None:
        """Wait for the copies and read them out of the pinned buffers (which may then be reused)."""
        if self._values is None:
            for c in self._copies:
                c.wait()
            loss = float(self._loss_host[:self._n].astype(np.float64).mean() / self._micro)
            norm = None if self._norm_host is None else \
                float(math.sqrt(max(float(self._norm_host.reshape(-1)[0]), 0.0)))
            self._values = (loss, norm)

    def loss(self) -> float:
        """The mean loss over the micro-steps since zero_grad() (step_loss's value)."""
        self.wait()
        return self._values[0]

    def norm(self) -> float:
        """The global gradient norm of the step's update (grad_norm's value)."""
        self.wait()
        if self._values[1] is None:
            raise RuntimeError("StepRead.norm(): read_step() was asked for no norm")
        return self._values[1]


_noted: set = set()


def _note_once(msg: str) -> None:
    """A note on stdout, once a process (models are built many times: graphs, tests, the eval model)."""
    if msg not in _noted:
        _noted.add(msg)
        print(msg)


class GPT2:
    def __init__(self, cfg: GPT2Config, backend, B: int, T: int, training: bool = True, params_buf=None,
                 optimizer: bool = True, recompute: int = 1, fuse_bias: bool | None = None,
                 fuse_gelu: bool | None = None, fuse_dgelu: bool | None = None,
                 fuse_gelu_recompute: bool | None = None, side_stream: bool | None = None,
                 fold: bool | None = None, share_scratch: bool | None = None):
        if T > cfg.max_seq_len:
            raise LLMCError(f"-t/--seq-len {T}: longer than the model's max sequence length {cfg.max_seq_len}")
        if B < 1 or T < 1:
            raise LLMCError(f"batch {B} x seq len {T}: both must be positive")
        self.cfg, self.be, self.B, self.T, self.training = cfg, backend, B, T, training
        if recompute not in (0, 1, 2):
            raise LLMCError(f"-r/--recompute {recompute}: expected 0 (none), 1 (GELU) or 2 (GELU and layernorm)")
        self.recompute = recompute
        L, C, NH, Vp, V = cfg.num_layers, cfg.channels, cfg.num_heads, cfg.padded_vocab_size, cfg.vocab_size
        N = B * T
        Np = -(-N // 4) * 4
        be = backend
        # bf16: params, grads, activations in be.dtype (BF16); the fp32 tensors in f32 (be.acc_dtype)
        self.bf16 = getattr(be, "precision", "fp32") == "bf16"
        f32 = self.f32 = np.dtype(getattr(be, "acc_dtype", be.dtype))
        # optimizer=False: no AdamW state here; whoever updates the weights owns it (ZeRO-1 in
        # llmc/dist.py keeps only this rank's shard of m and v, and in bf16 of the master weights)
        self.has_optimizer = training and optimizer
        self.stochastic_rounding = True  # bf16 update: stochastic rounding of the new weights
        self.sr_state = SR_RNG_INIT      # the rounding RNG (llm.c's; in the state file's header)
        # q, k, v in place: when both attention directions take it (4 and 4, bf16 on Hopper; the numpy
        # backend too), the qkv matmul writes each layer's (B,T,3C) output straight into qkvr[l] and
        # attention reads it there, forward and backward: no permuted copy. Training only (the
        # decoder's prefill fills its caches from a permuted qkvr). LLMC_QKV_IN_PLACE=0: the copy (A/B).
        # Decided before the memory check: in place, the one-layer qkv scratch is not allocated
        att_shape = dict(B=B, T=T, C=C, NH=NH)
        in_place = {}
        if training and switches.on("LLMC_QKV_IN_PLACE"):
            in_place = {d: be.fuses(d, dict(qkv_in_place=True), **att_shape) for d in ("attention_forward",
                                                                                      "attention_backward")}
        self.qkv_in_place = bool(in_place) and None not in in_place.values()
        att_kw = dict(qkv_in_place=True) if self.qkv_in_place else {}
        if fuse_bias is None:
            fuse_bias = switches.on("LLMC_FUSED_BIAS")
        # qkv's bias gradient, the column sums of dqkv, summed by attention_backward as it writes dqkv
        # where the chosen variant has that form (4's and 5's colsum=True); else matmul_backward_bias re-reads
        # dqkv (fuse_bias=False, LLMC_FUSED_BIAS=0: that pass, the A/B). Decided before the memory check:
        # the form's partials are scratch
        att_cs = (be.fuses("attention_backward", dict(colsum=True, **att_kw), **att_shape)
                  if training and fuse_bias else None)
        # the folded classifier (below, with the backward's builds): decided here, its buffers counted in the check
        if fold is None:  # (a classifier variant named on the command line runs in training: no fold)
            fold = switches.on("LLMC_CLASSIFIER_FOLD") and not be.named("classifier")
        fold = bool(training and fold)
        # The one-layer scratch views (the attproj and fcproj outputs, -r's recomputed GELU and layernorm
        # outputs, the backward's d residual, d qkv and d fch) and the backward builds' scratch live inside
        # the logits' (B, T, Vp) buffer, which holds logits only from the lm head's forward to its backward
        # (share_scratch=None: LLMC_SHARE_SCRATCH, default 1; _scratch_phase, _layout). Decided before the
        # memory check (which counts attention's scratch apart: with sharing, an overcount)
        if share_scratch is None:
            share_scratch = switches.on("LLMC_SHARE_SCRATCH")
        self.share_scratch = bool(share_scratch)
        self._check_memory(att_colsum=att_cs is not None, fold_bytes=be.fold_bytes(N, V, Vp, C) if fold else 0)

        # -- parameters (and their gradients, AdamW state): one flat buffer each, views per tensor
        self.num_params = cfg.num_parameters
        if params_buf is not None and training:
            raise ValueError("params_buf (shared weights) is for inference models only")
        # an inference model may read another's weights (the decoder's prefill does)
        self.params = params_buf if params_buf is not None else be.zeros((self.num_params,))
        self.p = self._views(self.params)
        if training:
            self.grads = be.zeros((self.num_params,))              # bf16 in bf16 mode, as llm.c
            self.g = self._views(self.grads)
            self.norm2 = be.zeros((1,), f32)
        self.master = None  # the fp32 master weights (bf16 with an optimizer): what AdamW updates
        if self.has_optimizer:
            self.m = be.zeros((self.num_params,), f32)
            self.v = be.zeros((self.num_params,), f32)
            if self.bf16:
                self.master = be.zeros((self.num_params,), f32)

        # -- the launch plan: every op built once for its shape (variants fixed here), before the
        # activations: what attention forward keeps for backward depends on its variant
        op = be.build
        self.built = {
            "encoder_forward": op("encoder_forward", B=B, T=T, C=C),
            "layernorm_forward": op("layernorm_forward", N=N, C=C),
            "mm_qkv": op("matmul_forward", N=N, C=C, OC=3 * C, has_bias=True),
            "attention_forward": op("attention_forward", prefer=in_place.get("attention_forward"), **att_shape,
                                    **att_kw),
            "mm_attproj": op("matmul_forward", N=N, C=C, OC=C, has_bias=True),
            "residual_layernorm": op("residual_layernorm_forward", N=N, C=C),
            "mm_fc": op("matmul_forward", N=N, C=C, OC=4 * C, has_bias=True),
            "gelu_forward": op("gelu_forward", N=N * 4 * C),
            "mm_fcproj": op("matmul_forward", N=N, C=4 * C, OC=C, has_bias=True),
            "mm_lmhead": op("matmul_forward", N=N, C=C, OC=Vp, has_bias=False),
            "classifier": op("classifier", N=N, V=V, Vp=Vp),
            # the running loss sum stays fp32 in bf16 mode: the fp32 build of the residual add
            "loss_acc": op("residual_forward", N=Np, precision="fp32"),
        }
        # The fc layer's GELU: where the variant chosen for mm_fc has the fused form (matmul_forward with
        # gelu_pre=True: fch and gelu(fch) from one GEMM epilogue, the bits of mm_fc then gelu_forward),
        # the forward can launch it instead of the pair, and gelu_forward no longer re-reads fch (backward
        # still recomputes the GELU from fch with -r >= 1). Off unless fuse_gelu=True or LLMC_FUSED_GELU=1:
        # on the H100 the fused GEMM is 16-33 us faster than the pair at B=16, but the d12 step is not
        # (bf16 B=16 37.01 vs 37.02 ms, fp32 74.55 vs 74.33: docs/ops.md), so the default stays the pair
        if fuse_gelu is None:
            fuse_gelu = switches.on("LLMC_FUSED_GELU")
        fc = dict(N=N, C=C, OC=4 * C, has_bias=True)
        fc_fused = be.fuses("matmul_forward", dict(gelu_pre=True), **fc) if fuse_gelu else None
        self.fused_gelu = fc_fused is not None
        if self.fused_gelu:
            self.built["mm_fc_gelu"] = op("matmul_forward", prefer=fc_fused, **fc, gelu_pre=True)
        # The fcproj layer's backward with GELU's: where the variant chosen for mmb_fcproj has the fused
        # form (matmul_backward with dgelu=True: d fch = gelu'(fch) * (dout @ fcprojw) from dinp's GEMM
        # epilogue, and fc's bias gradient as its column sums), the backward launches it instead of
        # mmb_fcproj + gelu_backward, and d fch is written once instead of written, read and rewritten.
        # Default (fuse_dgelu=None, LLMC_FUSED_DGELU unset): on in fp32, off in bf16, as measured on the
        # H100 (d12, B=16: fp32 74.23 vs 74.52 ms a step; bf16 36.63 vs 36.17: there the epilogue's
        # GELU math and column sums, which the tensor cores wait for, cost more than the separate pass:
        # docs/ops.md). LLMC_FUSED_DGELU=1 / 0 or fuse_dgelu=True / False: either way (the A/B)
        fcp = dict(N=N, C=4 * C, OC=C)
        # Backward's GELU recompute in one pass with GELU's backward (-r >= 1, with the fused bias
        # gradients): mmb_fcproj's dinp GEMM first, then gelu_backward's recompute form, which reads fch
        # and d fch once and writes d fch (fcb += its column sums) and fch_gelu, then the dweight GEMM
        # on fch_gelu: one read of fch (B,T,4C) a layer fewer than gelu_forward + gelu_backward, the
        # same bits. Where the variants have the forms; fuse_gelu_recompute=False or
        # LLMC_FUSED_GELU_RECOMPUTE=0: not. It takes the place of the dgelu form (fuse_dgelu below).
        if fuse_gelu_recompute is None:
            fuse_gelu_recompute = switches.on("LLMC_FUSED_GELU_RECOMPUTE")
        rc = {}
        if training and recompute >= 1 and fuse_bias and fuse_gelu_recompute:
            rc = {"gelu": be.fuses("gelu_backward", dict(colsum=True, recompute=True, OC=4 * C), N=N * 4 * C),
                  "dinp": be.fuses("matmul_backward", dict(dinp_only=True), **fcp),
                  "dweight": be.fuses("matmul_backward", dict(dweight_only=True), **fcp)}
        self.fused_gelu_recompute = bool(rc) and None not in rc.values()
        asked_dgelu = fuse_dgelu if fuse_dgelu is not None else switches.flag("LLMC_FUSED_DGELU")
        fuse_dgelu = not self.bf16 if asked_dgelu is None else asked_dgelu
        dg = (be.fuses("matmul_backward", dict(dgelu=True), **fcp)
              if training and fuse_dgelu and not self.fused_gelu_recompute else None)
        self.fused_dgelu = dg is not None
        if asked_dgelu and training and self.fused_gelu_recompute:
            # (an A/B of LLMC_FUSED_DGELU=1 at -r 1 compares one step with itself: sessions 44-45 did)
            _note_once("note: LLMC_FUSED_DGELU=1 changes nothing with -r 1 or 2: gelu_backward's recompute form "
                       "takes the dgelu form's place (-r 0 or LLMC_FUSED_GELU_RECOMPUTE=0 for the dgelu form)")
        # -- activations: one flat buffer per dtype (bf16 mode: the bf16 one and the fp32 one; fp32
        # mode: one) and, with share_scratch, the logits' place ("arena"), views into them (shape comments
        # are per view, in _activation_spec). Before the backward's builds, whose scratch may lie in the arena
        spec = self._activation_spec(self.built["attention_forward"].saved_shape)
        sizes, where = self._layout(spec)
        self.acts_bufs = {buf: be.empty((n,), be.dtype if buf == "arena" else buf) for buf, n in sizes.items()}
        self.a = {name: be.view(self.acts_bufs[where[name][0]], where[name][1], shape) for name, shape, _ in spec}

        self.side = False  # (training: below)
        self.ln_deferred = False  # (training: below)
        self.first_write = False  # (training: below)
        self.att_side_zero = False  # (training: below)
        if training:
            # The weight gradients on a second stream (side_stream=None: LLMC_SIDE_STREAM, default 1).
            # dweight += dout^T @ inp of fcproj (with the GELU recompute form), fc, attproj and qkv are
            # needed by nothing else in the backward, and each is one wave of long tiles (72-96 tiles of
            # 128 x 192 for an H100's 132 SMs at d12, whatever B is). On the side stream they run beside
            # the main stream's next launches (dinp GEMMs, layernorm and GELU backward, attention),
            # which take the SMs they leave idle. _launch_backward's waits keep the side stream's reads
            # of dres, d fch, dqkv and the -r scratch ahead of the main stream's rewrites. Same bits as
            # one stream (the same kernels; each gradient written by one launch). Measured on the H100
            # against LLMC_SIDE_STREAM=0 in the same call (docs/matmul_notes.md, "The weight gradients
            # on a second stream"): bf16 32.50 against 33.09 ms at B=16, 9.79 against 10.35 at B=4;
            # fp32 67.36 against 68.96 and 19.30 against 19.76. Where a variant has no dinp_only /
            # dweight_only form: one stream.
            # The backward's builds but the lm head's cut their scratch (GEMM partials, attention's dq
            # accumulator, the layernorm backwards' partials, ...: what each launch writes before it reads)
            # from the arena past the backward's views while it has room: the logits live there only from
            # the lm head's forward to its backward, which reads them (so its own build stays out), and the
            # next forward writes the arena only after the backward's side stream is joined. Each build
            # enters the arena on its own (nothing stays set on the runtime if one refuses)
            self.built["mmb_lmhead"] = op("matmul_backward", N=N, C=C, OC=Vp)
            arena = ({"base": self.acts_bufs["arena"], "used": self._arena_views_end * np.dtype(be.dtype).itemsize}
                     if "arena" in self.acts_bufs else None)

            def op(name, **kw):
                with be.scratch_arena(arena) if arena else contextlib.nullcontext():
                    return be.build(name, **kw)
            if side_stream is None:
                side_stream = switches.on("LLMC_SIDE_STREAM")
            split = {"fc": dict(N=N, C=C, OC=4 * C), "attproj": dict(N=N, C=C, OC=C), "qkv": dict(N=N, C=C, OC=3 * C)}
            forms = {(key, f): be.fuses("matmul_backward", {f: True}, **shp)
                     for key, shp in split.items() for f in ("dinp_only", "dweight_only")} if side_stream else {}
            self.side = bool(forms) and None not in forms.values()
            # (att_cs: qkv's bias gradient in attention_backward's colsum form, decided above)
            self.built.update({
                "layernorm_backward": op("layernorm_backward", N=N, C=C),
                "gelu_backward": op("gelu_backward", N=N * 4 * C),
                "attention_backward": (op("attention_backward", prefer=att_cs, **att_shape, **att_kw, colsum=True)
                                       if att_cs is not None else
                                       op("attention_backward", prefer=in_place.get("attention_backward"),
                                          **att_shape, **att_kw)),
                "encoder_backward": op("encoder_backward", B=B, T=T, C=C),
                "global_norm": op("global_norm", n=self.num_params),
            })
            # The classifier folded into the lm head's GEMMs (docs/matmul_notes.md, "The classifier folded into
            # the lm head"): a training forward's lm head GEMM (engine 5, matmul_forward 9) writes p' = exp(logit
            # - k ln 2) and its row sums per tile in place of the logits; a combine kernel makes the losses, each
            # row's scale c and X = c * lnf, and folds the one-hot into the target's element; the backward's GEMMs
            # run on p' (dinp, then its rows scaled by c) and X (dwte). No classifier pass over the (B,T,Vp)
            # logits. Evaluation and sampling keep the logits. On where the lm head runs on engine 5 and no
            # classifier variant was named (fold=False or LLMC_CLASSIFIER_FOLD=0: the pass, the A/B). H200, same
            # call: fp32 15.78 against 16.14 ms at B=4, 58.14 against 59.63 at B=16; bf16 8.15 against 8.37 and
            # 28.50 against 29.10 (docs/results/session39_h200_2026-11-29.txt).
            self.fold = be.fold_build(N, V, Vp, C) if fold else None
            # Each layer GEMM's two-GEMM form only where the backward launches it (its transposes' scratch and
            # split-K partials are allocated with the build: fp32 B=16 0.24 GiB for the four unused ones):
            # fcproj's where neither the GELU recompute form nor the dgelu form takes its place, the other
            # three's without the side stream's one-GEMM forms
            if not (self.fused_gelu_recompute or self.fused_dgelu):
                self.built["mmb_fcproj"] = op("matmul_backward", **fcp)
            if not self.side:
                for key, shp in split.items():
                    self.built[f"mmb_{key}"] = op("matmul_backward", **shp)
            # The bias gradients of fcproj, attproj (C) and fc (4C) are column sums of tensors that the
            # kernel just before them writes: dres (a layernorm backward's dinp) and dfch (GELU
            # backward's dinp). Where the chosen variant has the op's fused form (colsum=True), it sums
            # them as it writes them; otherwise matmul_backward_bias re-reads them (docs/ops.md).
            # fuse_bias=False (or LLMC_FUSED_BIAS=0) launches the bias passes with the same variants:
            # the A/B of the fusion alone (dev/bench_step.py)
            ln_fused = be.fuses("layernorm_backward", dict(colsum=True), N=N, C=C) if fuse_bias else None
            gelu_fused = (be.fuses("gelu_backward", dict(colsum=True, OC=4 * C), N=N * 4 * C)
                          if fuse_bias and not self.fused_dgelu and not self.fused_gelu_recompute else None)
            # "gelu_backward": fc's bias gradient is summed as d fch is written (by gelu_backward's fused
            # form, or by the dgelu GEMM's epilogue when fused_dgelu)
            self.fused_bias = {"layernorm_backward": ln_fused is not None,
                               "gelu_backward": (gelu_fused is not None or (self.fused_dgelu and fuse_bias)
                                                 or self.fused_gelu_recompute),
                               "attention_backward": att_cs is not None}
            if att_cs is None:
                self.built["bias_3C"] = op("matmul_backward_bias", N=N, OC=3 * C)
            if self.fused_gelu_recompute:
                self.built["mmb_fcproj_dinp"] = op("matmul_backward", prefer=rc["dinp"], **fcp, dinp_only=True)
                self.built["mmb_fcproj_dweight"] = op("matmul_backward", prefer=rc["dweight"], **fcp, dweight_only=True)
                self.built["gelu_backward_colsum_rc"] = op("gelu_backward", prefer=rc["gelu"], N=N * 4 * C, OC=4 * C,
                                                           colsum=True, recompute=True)
            if self.fused_dgelu:
                self.built["mmb_fcproj_dgelu"] = op("matmul_backward", prefer=dg, **fcp, dgelu=True)
            if self.side:
                for key, shp in split.items():
                    for f, part in (("dinp_only", "dinp"), ("dweight_only", "dweight")):
                        self.built[f"mmb_{key}_{part}"] = op("matmul_backward", prefer=forms[(key, f)], **shp, **{f: True})
            # attention_backward 5's dq accumulator zeroed on the side stream (its caller_zeroes form): its
            # prep pass then only reads dout and out (half its bytes) on the critical path, and the zeroing
            # of the accumulator for the next layer runs beside other work. Off unless LLMC_ATT5_SIDE_ZERO=1:
            # not faster on the H100 (bf16, zeroed after qkv's dweight: B=4 9.01 against 8.97 ms, B=16
            # 30.54 against 30.57; zeroed before it: B=4 9.06 against 9.15, B=16 31.11 against 30.47;
            # docs/ops.md, "attention_backward 5"; H200, session 32: B=4 8.40 against 8.38, B=16 29.34 against 29.12)
            self.att_side_zero = False
            if self.side and switches.on("LLMC_ATT5_SIDE_ZERO"):
                att = self.built["attention_backward"]
                num = be.fuses("attention_backward", dict(caller_zeroes=True), **att.shape)
                if num is not None:
                    del self.built["attention_backward"]  # (its scratch goes before the new one's comes)
                    self.built["attention_backward"] = op("attention_backward", prefer=num, **att.shape,
                                                          caller_zeroes=True)
                    # (the numpy launcher takes the option and has no accumulator: nothing to zero)
                    self.att_side_zero = "rezero" in self.built["attention_backward"].info
            if ln_fused is not None:
                self.built["layernorm_backward_colsum"] = op("layernorm_backward", prefer=ln_fused, N=N, C=C, colsum=True)
            else:
                self.built["bias_C"] = op("matmul_backward_bias", N=N, OC=C)
            # The fused layernorm backwards' column sums deferred to one launch after the last of them
            # (layernorm_backward 5's and 7's deferred form): the 2L calls each write dres at once and leave their
            # dweight, dbias and colsum sums as partials in a slot of their own, which the flush adds up
            # at the end of the backward (on the side stream, beside encoder_backward). Nothing before
            # the update reads those gradients, and each call no longer ends in a grid-wide wait
            # (H100: bf16 9.42 against 9.51 ms at B=4, fp32 18.60 against 18.63; docs/ops.md, "deferred"). Where the variant has
            # the form (0, the numpy backend's, adds at once: nothing to defer); not with per-layer hooks
            # (data parallel reads each layer's gradients as soon as its backward is launched), nor with
            # LLMC_LN_DEFERRED=0.
            if training and ln_fused is not None and switches.on("LLMC_LN_DEFERRED"):
                slots = 2 * cfg.num_layers  # lnf, then each layer's ln2 and (but layer 0's) ln1
                dfr = be.fuses("layernorm_backward", dict(colsum=True, deferred=slots), N=N, C=C)
                if dfr:
                    self.built["layernorm_backward_colsum_deferred"] = op(
                        "layernorm_backward", prefer=dfr, N=N, C=C, colsum=True, deferred=slots)
                    self.ln_deferred = True
            if gelu_fused is not None:
                self.built["gelu_backward_colsum"] = op("gelu_backward", prefer=gelu_fused, N=N * 4 * C, OC=4 * C,
                                                        colsum=True)
            elif not self.fused_bias["gelu_backward"]:
                self.built["bias_4C"] = op("matmul_backward_bias", N=N, OC=4 * C)
            # The first micro-step after zero_grad() writes the weights' gradients instead of adding to
            # them: each dweight GEMM the backward launches gets a twin built with overwrite=True (beta =
            # 0: the old gradient is neither read nor needed), launched by that micro-step, and
            # zero_grad() then zeroes only the other gradients (wpe, the biases and layernorm weights:
            # ~1% of them), inside the first micro-step's launches. So a step no longer begins with a
            # memset of every gradient (250 MB in bf16 at d12) and the dweight GEMMs of its first
            # micro-step no longer read theirs back. Where a GEMM's variant has no such form, its
            # gradient is zeroed with the rest; LLMC_FIRST_WRITE=0: the memset and += throughout (the A/B).
            op = be.build  # (the first micro-step's twins below share their builds' scratch, nothing more)
            self.built_first = {}
            if switches.on("LLMC_FIRST_WRITE"):
                fcproj = ("mmb_fcproj_dweight" if self.fused_gelu_recompute else
                          "mmb_fcproj_dgelu" if self.fused_dgelu else "mmb_fcproj")
                keys = ["mmb_lmhead", fcproj] + [f"mmb_{n}_dweight" if self.side else f"mmb_{n}"
                                                  for n in ("fc", "attproj", "qkv")]
                for key in keys:
                    num = be.fuses("matmul_backward", dict(overwrite=True), **self.built[key].shape)
                    if num is not None:  # (a twin and its call site's build never run in one micro-step:
                        # the twin takes the build's scratch, fp32's transposes and split-K partials)
                        with be.scratch_pool(self.built[key].pool) if self.built[key].pool is not None \
                                else contextlib.nullcontext():
                            self.built_first[key] = op("matmul_backward", prefer=num, **self.built[key].shape,
                                                       overwrite=True)
                self.first_write = bool(self.built_first)
        if self.has_optimizer:
            # AdamW runs over contiguous ranges of the flat buffer with one weight-decay flag each
            self.update_ranges = self._decay_ranges()
            # per range: launcher, decay, params, grads, m, v views, and (bf16) the master's view
            bufs = (self.params, self.grads, self.m, self.v) + ((self.master,) if self.bf16 else ())
            self.adamw_plan = [(be.op("adamw", n=n), decay, *(be.view(buf, off, (n,)) for buf in bufs))
                               for off, n, decay in self.update_ranges]
            # AdamW's hyperparameters (lr, bias corrections, ...) per range, on the device: uploaded
            # before each update, so that a captured update replays with the step's values; in bf16
            # also a stochastic-rounding seed per range (uint32), uploaded the same way
            R = len(self.adamw_plan)
            self.hp = be.zeros((R, 8), f32)
            self._pinned_hp = be.pinned((R, 8), f32)
            self.hps = [be.view(self.hp, 8 * i, (8,)) for i in range(R)]
            if self.bf16:
                self.seeds = be.zeros((R,), np.uint32)
                self._pinned_seeds = be.pinned((R,), np.uint32)
                self.seed_views = [be.view(self.seeds, i, (1,)) for i in range(R)]
        # the launch closures themselves (the Built records stay for the profile: op, variant, shape)
        self.k = {key: b.launch for key, b in self.built.items()}
        self.k_first = {key: b.launch for key, b in getattr(self, "built_first", {}).items()}
        # what a build computes on the host from each batch's ids (encoder_backward 8's records): (prep,
        # its device buffer, a pinned buffer), uploaded by set_batch beside the batch
        self._host_inputs = [(b.host_inputs[0], b.host_inputs[1], be.pinned(b.host_inputs[1].shape, b.host_inputs[1].dtype))
                             for b in self.built.values() if b.host_inputs is not None]
        # (first_write) the gradients no overwrite twin writes, as few contiguous views: what
        # zero_grad() leaves for the first micro-step to zero; and whether that is still to happen
        self._rest_grads = []
        if self.first_write:
            written = {GEMM_WEIGHTS[key.split("_")[1]] for key in self.k_first}  # mmb_<site>[_form]
            for name, off, size in param_layout(cfg):
                if name in written:
                    continue
                if self._rest_grads and self._rest_grads[-1][0] + self._rest_grads[-1][1] == off:
                    self._rest_grads[-1][1] += size
                else:
                    self._rest_grads.append([off, size])
            self._rest_grads = [be.view(self.grads, off, (n,)) for off, n in self._rest_grads]
        self._grads_stale = False
        self._ln_slot = None  # the next deferred layernorm backward's slot (None: not deferring)
        self._ln_flush = self.built["layernorm_backward_colsum_deferred"].flush if self.ln_deferred else None
        att_saved = self.built["attention_forward"].saved_shape
        if training:
            need = self.built["attention_backward"].saved_shape
            if need != att_saved:
                raise LLMCError(f"attention: forward keeps {att_saved} for backward but backward needs {need}: "
                                "give --attention-kernel and --attention-backward-kernel the same number")

        # per-layer activations that -r may turn into one-layer scratch: lay[name][l] is layer l's
        # view either way (the same scratch view for every l when recomputed)
        self.lay = {name: [self.a[name][l] if len(self.a[name].shape) == 4 else self.a[name] for l in range(L)]
                    for name in ("ln1", "ln2", "fch_gelu")}
        self.a["losses_N"] = be.view(self.a["losses"], 0, (N,))  # what the classifier writes
        if Np > N:
            self.a["losses_tail"] = be.view(self.a["losses"], N, (Np - N,))
        # the batch: inputs and targets side by side, so that one async copy brings both in
        self._batch = be.zeros((2, B, T), np.int32)
        self.inputs, self.targets = be.view(self._batch, 0, (B, T)), be.view(self._batch, B * T, (B, T))
        self._pinned_xy = be.pinned((2, B, T), np.int32)
        self._pinned_xy[...] = 0
        # read_step's (and step_loss's) pinned buffers, two sets in turn (one step's read still unread while the next
        # step's is queued), and the StepRead holding each
        self._read_bufs = [(be.pinned(self.a["loss_acc"].shape, f32), be.pinned((1,), f32)) for _ in range(2)]
        self._reads, self._read_turn = [None, None], 0

        self.micro_steps = 0
        self.has_loss = False
        # CUDA graphs of the training step (cuda backend, cuda-python; LLMC_GRAPHS=0 turns them off):
        # the first micro-step and update run kernel by kernel, then each is captured and replayed
        self.use_graphs = training
        self._graph_micro = self._graph_update = self._graph_custom = None
        self._graph_micro_first = None  # the first micro-step after zero_grad (first_write)
        self._graph_accum = None  # grad_accum_steps when _graph_micro was captured

    # ------------------------------------------------------------------------------------------
    # buffers

    def _views(self, flat) -> dict:
        return {name: self.be.view(flat, off, shape)
                for (name, shape), (_, off, _) in zip(param_shapes(self.cfg), param_layout(self.cfg))}

    def _decay_ranges(self) -> list[tuple[int, int, bool]]:
        """Merge llm.c's 16 tensors into contiguous runs with the same weight-decay flag."""
        runs = []
        for name, off, size in param_layout(self.cfg):
            decay = name in DECAYED
            if runs and runs[-1][2] == decay:
                o, n, d = runs[-1]
                runs[-1] = (o, n + size, d)
            else:
                runs.append((off, size, decay))
        return runs

    def _activation_spec(self, att_saved) -> list[tuple[str, tuple, np.dtype]]:
        """[(name, shape, dtype)] of every activation view, in order. dtype is be.dtype (bf16 in bf16
        mode) except what the bf16 conventions keep in fp32 (self.f32): layernorm statistics,
        attention's saved log-sum-exp (the composite attention's probabilities are fp32-only anyway),
        the losses and their running sum."""
        cfg, B, T, training = self.cfg, self.B, self.T, self.training
        L, C, Vp = cfg.num_layers, cfg.channels, cfg.padded_vocab_size
        Np = -(-(B * T) // 4) * 4
        r = self.recompute if training else 1
        per_layer_ln = (L,) if r < 2 else ()     # -r 2: ln1, ln2 recomputed in backward
        per_layer_gelu = (L,) if r == 0 else ()  # -r 0: GELU output kept per layer
        spec = [
            ("encoded", (B, T, C)),
            ("ln1", (*per_layer_ln, B, T, C)), ("ln1_mean", (L, B, T), "f32"), ("ln1_rstd", (L, B, T), "f32"),
            ("qkvr", (L, B, T, 3 * C)),      # permuted q | k | v, each (B, NH, T, hs); or, q, k, v in
                                             # place (self.qkv_in_place), the qkv matmul's output
            ("att", (L, *att_saved), "f32"),  # what attention backward needs: the softmax probabilities
                                             # (B,NH,T,T) (variant 1) or their log-sum-exp (B,NH,T) (2)
            ("atty", (L, B, T, C)),          # attention output, pre-projection
            ("residual2", (L, B, T, C)),
            ("ln2", (*per_layer_ln, B, T, C)), ("ln2_mean", (L, B, T), "f32"), ("ln2_rstd", (L, B, T), "f32"),
            ("fch", (L, B, T, 4 * C)),       # fc output, pre-GELU
            ("residual3", (L, B, T, C)),
            ("lnf", (B, T, C)), ("lnf_mean", (B, T), "f32"), ("lnf_rstd", (B, T), "f32"),
            ("losses", (Np,), "f32"), ("loss_acc", (Np,), "f32"),  # N rounded up to 4; the tail stays unused
            ("logits", (B, T, Vp)),          # overwritten by dlogits when training
            # one-layer scratch (not needed by backward, or recomputed there)
            # (the qkv matmul's output, before the permute; none in place: it writes qkvr[l] itself)
            *([] if self.qkv_in_place else [("qkv", (B, T, 3 * C))]),
            ("attproj", (B, T, C)), ("fch_gelu", (*per_layer_gelu, B, T, 4 * C)), ("fcproj", (B, T, C)),
        ]
        if training:  # gradient scratch, reused by every layer
            spec += [("dresidual", (B, T, C)), ("dbtc", (B, T, C)), ("dqkv", (B, T, 3 * C)),
                     ("dfch", (B, T, 4 * C))]
        if training and r == 2:  # the recomputed layernorm's statistics (backward keeps the saved ones)
            spec += [("rc_mean", (B, T), "f32"), ("rc_rstd", (B, T), "f32")]
        return [(e[0], e[1], self.f32 if len(e) > 2 else np.dtype(self.be.dtype)) for e in spec]

    def _scratch_phase(self, name: str) -> str | None:
        """Where a one-layer scratch view lives with share_scratch: inside the logits' buffer, which holds
        the logits only from the lm head's forward (the forward's last launches) to its backward (the
        backward's first). "fwd": written and read by the forward's layers only (the attproj and fcproj
        outputs; the qkv output when not in place); "bwd": by the backward's layers only, after the lm
        head's backward has read the logits (d residual, d qkv, d fch; d btc is written by the lm head's
        backward itself, so it keeps its own memory); "both": scratch that the forward and the backward
        each write before they read it (-r 1 and 2: the GELU output; -r 2: ln1 and ln2). None: its own
        memory. The backward ends with the side stream joined, so the next forward's writes come after
        the side stream's last reads (the dweight GEMMs read d qkv, d fch, d residual and the GELU output)."""
        r = self.recompute if self.training else 1
        if name in ("attproj", "fcproj", "qkv"):
            return "fwd"
        if self.training and name in ("dresidual", "dqkv", "dfch"):
            return "bwd"
        if (name == "fch_gelu" and r >= 1) or (name in ("ln1", "ln2") and r == 2):
            return "both"
        return None

    def _layout(self, spec) -> tuple[dict, dict]:
        """({buffer: elements}, {name: (buffer, offset)}) of the activation views. A buffer is a dtype
        (its views one after another, each 64-aligned) or, with share_scratch, "arena": the logits'
        place, which also holds the scratch views (_scratch_phase) at the times the logits do not live:
        the "both" views first, then the "fwd" views, and the "bwd" views again from the end of the
        "both" ones (the two never live at the same time); as large as the largest of the three. The
        backward's builds may cut their scratch from the arena past the views (GPT2.__init__)."""
        shared = {name for name, _, _ in spec if self.share_scratch and self._scratch_phase(name)}
        sizes, where = {}, {}
        for name, shape, dt in spec:
            if name in shared:
                continue
            if name == "logits" and shared:
                end = {"both": 0}
                for phase in ("both", "fwd", "bwd"):
                    pos = end["both"] if phase != "both" else 0
                    for sname, sshape, sdt in spec:
                        if sname in shared and self._scratch_phase(sname) == phase:
                            assert sdt == dt, (sname, sdt, dt)
                            where[sname] = ("arena", pos)
                            pos += _align(_size(sshape))
                    end[phase] = pos
                where[name] = ("arena", 0)
                sizes["arena"] = max(_align(_size(shape)), end["fwd"], end["bwd"])
                self._arena_views_end = end["bwd"]  # (elements: where the backward builds' scratch may start)
                continue
            where[name] = (dt, sizes.get(dt, 0))
            sizes[dt] = sizes.get(dt, 0) + _align(_size(shape))
        return sizes, where

    def activation_bytes(self) -> int:
        return sum(buf.size * buf.dtype.itemsize for buf in self.acts_bufs.values())

    def _check_memory(self, att_colsum: bool = False, fold_bytes: int = 0):
        """Fail early, in one line, when the GPU can't hold the model (before allocating anything).
        Bytes are counted per dtype (bf16 mode: 2 per parameter, gradient and most activations; 4
        per AdamW moment, master weight and fp32 activation). What attention keeps per layer and the
        scratch its builds allocate are declared by the variants that will run (Variant.saves,
        Variant.scratch_bytes); fold_bytes: the folded classifier's buffers (backend.fold_bytes). Not
        counted: the other builds' scratch (the GEMMs' split-K partials and tf32 transposes, the
        layernorm and encoder backwards' partials); an allocation that fails still ends in one line."""
        cfg, B, T = self.cfg, self.B, self.T
        L, C, NH = cfg.num_layers, cfg.channels, cfg.num_heads
        P, el, f4 = cfg.num_parameters, np.dtype(self.be.dtype).itemsize, self.f32.itemsize
        nbytes = P * el * (2 if self.training else 1)  # params, grads (overcounts a shared params_buf)
        if self.has_optimizer:
            nbytes += P * f4 * (3 if self.bf16 else 2)  # m, v (and the master weights)
        shape = dict(B=B, T=T, C=C, NH=NH)
        fwd = self.be.choose("attention_forward", **shape)
        att_saved = ops.get("attention_forward").saved_shape(fwd or None, **shape)
        nbytes += sum(n * np.dtype(self.be.dtype if d == "arena" else d).itemsize
                      for d, n in self._layout(self._activation_spec(att_saved))[0].items())
        scratch = 0
        for name in ("attention_forward", "attention_backward") if self.training else ("attention_forward",):
            num = self.be.choose(name, **shape)
            v = ops.get(name).variants.get(num)
            # (att_colsum: the backward's colsum form, whose partials its build allocates too)
            extra = dict(colsum=True) if att_colsum and name == "attention_backward" else {}
            scratch += (v.scratch_bytes(**shape, **extra, dtype=getattr(self.be, 'precision', 'fp32'),
                                        rt=getattr(self.be, "rt", None))
                        if v is not None and v.scratch_bytes else 0)
        self.be.require_free(nbytes + scratch + fold_bytes, what=f"model ({cfg.describe()}, B={B}, T={T}, "
                                                    f"{getattr(self.be, 'precision', 'fp32')})")

    def init_params(self, seed: int = 1337) -> np.ndarray:
        """GPT-2 initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L),
        zero biases, unit layernorm weights; the padded vocab rows of wte stay zero."""
        cfg = self.cfg
        rng = np.random.default_rng(seed)
        host = np.zeros(self.num_params, np.float32)
        scaled = {"attprojw", "fcprojw"}
        for (name, shape), (_, off, size) in zip(param_shapes(cfg), param_layout(cfg)):
            if name in ("ln1w", "ln2w", "lnfw"):
                host[off:off + size] = 1.0
            elif name.endswith("w") or name in ("wte", "wpe"):
                std = 0.02 / math.sqrt(2 * cfg.num_layers) if name in scaled else 0.02
                vals = rng.standard_normal(size, dtype=np.float32) * np.float32(std)
                if name == "wte":  # rows V..Vp-1 are padding: never used, kept zero
                    vals.reshape(shape)[cfg.vocab_size:] = 0.0
                host[off:off + size] = vals
        self.load_params(host)
        return host

    def load_params(self, host: np.ndarray, bf16_weights: np.ndarray | None = None) -> None:
        """host: the weights as floats (fp32), llm.c's layout. In bf16 mode they become the fp32
        master weights (exactly) and the bf16 weights: rounded to nearest even, or bf16_weights
        (floats that are bf16 values: a v5 model file's) when given, which is how a resumed run
        gets back the stochastically rounded weights it had beside the same masters."""
        host = np.asarray(host, dtype=np.float32 if self.bf16 else self.be.dtype).reshape(-1)
        if host.size != self.num_params:
            raise LLMCError(f"parameters: got {host.size:,} values, model needs {self.num_params:,}")
        if self.bf16:
            if self.master is not None:
                self.be.upload(self.master, host)
            host = to_bf16(host if bf16_weights is None else np.asarray(bf16_weights, np.float32).reshape(-1))
        self.be.upload(self.params, host)

    def to_host(self, buf) -> np.ndarray:
        """A device buffer's contents on the host as floats: bf16 tensors come back as fp32 (exactly)."""
        h = self.be.download(buf)
        return from_bf16(h) if h.dtype == BF16 else h

    def get_params(self) -> np.ndarray:
        """The weights as fp32, llm.c's layout: the master weights when there are (bf16 training),
        else the weights themselves (bf16 ones upcast exactly)."""
        src = self.master if self.master is not None else self.params
        return self.to_host(src).reshape(-1).astype(np.float32)

    def get_grads(self) -> np.ndarray:
        self._zero_stale_grads()
        return self.to_host(self.grads).reshape(-1)

    def set_batch(self, x: np.ndarray, y: np.ndarray | None = None) -> None:
        """Copy a batch in: through pinned memory with an async copy on the GPU."""
        B, T = self.B, self.T
        if x.shape != (B, T):
            raise LLMCError(f"batch shape {x.shape}: model was built for (B={B}, T={T})")
        if int(x.max(initial=0)) >= self.cfg.vocab_size or int(x.min(initial=0)) < 0:
            raise LLMCError(f"token id out of range [0, {self.cfg.vocab_size}) in the input batch")
        # the previous micro-step's copy may still be queued behind its predecessor's graph: it must
        # read its batch before this one overwrites it. One copy of both halves (without y the
        # targets' half holds the last targets uploaded: the same values again)
        self.be.pinned_free(self._pinned_xy)
        self._pinned_xy[0] = x
        if y is not None:
            self._pinned_xy[1] = y
        self.be.upload_async(self._batch, self._pinned_xy)
        for prep, buf, pinned in self._host_inputs:  # (the same discipline as the batch's pinned buffer)
            self.be.pinned_free(pinned)
            pinned[...] = prep(x)
            self.be.upload_async(buf, pinned)

    # ------------------------------------------------------------------------------------------
    # forward

    def forward(self, x: np.ndarray | None, y: np.ndarray | None = None, grad: bool | None = None,
                read_loss: bool = True):
        """Forward over a (B, T) batch (x=None: the batch already uploaded). With targets, computes
        the per-token losses and (when training and grad is not False) writes dlogits into the
        logits buffer for backward. Returns the mean loss as a float (read_loss) or None."""
        if x is not None:
            self.set_batch(x, y)
        with_targets = y is not None or (x is None and self.has_targets_loaded)
        self.has_targets_loaded = with_targets
        write_dlogits = with_targets and self.training and grad is not False
        self._launch_forward(with_targets, write_dlogits)
        self.has_loss = with_targets
        self.dlogits_ready = write_dlogits
        if with_targets and read_loss:
            return float(self.be.download(self.a["losses"])[:self.B * self.T].astype(np.float64).mean())
        return None

    def _launch_forward(self, with_targets: bool, write_dlogits: bool, before_layer=None) -> None:
        """The forward's launches (no host work: capturable). before_layer(l), if given, is called
        just before the first launch that reads layer l's weights, and before_layer(None) before
        the encoder (wte, wpe; lnfw, lnfb go with them): ZeRO-1 waits there for that layer's
        all-gather, which runs beside the layers before it."""
        cfg, a, p, k = self.cfg, self.a, self.p, self.k
        ln1, ln2, fch_gelu = self.lay["ln1"], self.lay["ln2"], self.lay["fch_gelu"]
        L = cfg.num_layers
        wait = before_layer or (lambda _l: None)

        wait(None)
        k["encoder_forward"](a["encoded"], self.inputs, p["wte"], p["wpe"])                  # (B,T,C)
        wait(0)
        k["layernorm_forward"](ln1[0], a["ln1_mean"][0], a["ln1_rstd"][0],
                               a["encoded"], p["ln1w"][0], p["ln1b"][0])
        for l in range(L):
            residual = a["encoded"] if l == 0 else a["residual3"][l - 1]                       # (B,T,C)
            qkv = a["qkvr"][l] if self.qkv_in_place else a["qkv"]  # in place: the layer's saved qkv itself
            k["mm_qkv"](qkv, ln1[l], p["qkvw"][l], p["qkvb"][l])                             # (B,T,3C)
            k["attention_forward"](a["atty"][l], a["qkvr"][l], a["att"][l], qkv)             # (B,T,C)
            k["mm_attproj"](a["attproj"], a["atty"][l], p["attprojw"][l], p["attprojb"][l])  # (B,T,C)
            k["residual_layernorm"](a["residual2"][l], ln2[l], a["ln2_mean"][l], a["ln2_rstd"][l],
                                    residual, a["attproj"], p["ln2w"][l], p["ln2b"][l])
            if self.fused_gelu:                                                                 # fch and
                k["mm_fc_gelu"](fch_gelu[l], a["fch"][l], ln2[l], p["fcw"][l], p["fcb"][l])  # its GELU (B,T,4C)
            else:
                k["mm_fc"](a["fch"][l], ln2[l], p["fcw"][l], p["fcb"][l])                    # (B,T,4C)
                k["gelu_forward"](fch_gelu[l], a["fch"][l])                                   # (B,T,4C)
            k["mm_fcproj"](a["fcproj"], fch_gelu[l], p["fcprojw"][l], p["fcprojb"][l])       # (B,T,C)
            # residual3 = residual2 + fcproj, normalised for the next layer (or the final layernorm)
            if l + 1 < L:
                wait(l + 1)  # (layer l+1's ln1 weights)
                ln, mean, rstd, w, b = (ln1[l + 1], a["ln1_mean"][l + 1], a["ln1_rstd"][l + 1],
                                        p["ln1w"][l + 1], p["ln1b"][l + 1])
            else:
                ln, mean, rstd, w, b = a["lnf"], a["lnf_mean"], a["lnf_rstd"], p["lnfw"], p["lnfb"]
            k["residual_layernorm"](a["residual3"][l], ln, mean, rstd, a["residual2"][l], a["fcproj"], w, b)
        dloss = 1.0 / (self.B * self.T * self.grad_accum_steps)
        self.folded = bool(self.fold and write_dlogits)
        if self.folded:  # p' and tile sums; losses, scales, X; the rows out of range recomputed
            f = self.fold
            if not f.primed:  # (a run's first folded step without k from a state file: once, never captured)
                f.prime(a["losses_N"], a["logits"], self.targets, a["lnf"], p["wte"])
            f.forward(a["logits"], a["lnf"], p["wte"])                                          # (B,T,Vp)
            f.combine(a["losses_N"], a["logits"], self.targets, a["lnf"], dloss)               # (N,)
            f.fix(a["losses_N"], a["logits"], self.targets, a["lnf"], p["wte"], dloss)
            return
        k["mm_lmhead"](a["logits"], a["lnf"], p["wte"], None)                                 # (B,T,Vp)
        if with_targets:
            k["classifier"](a["losses_N"], a["logits"], self.targets, dloss, int(write_dlogits))  # (N,)

    has_targets_loaded = False
    fold = None      # the folded classifier (training with LLMC_CLASSIFIER_FOLD=1), or None
    folded = False   # the last forward ran it: the backward reads p' and fold.X
    grad_accum_steps = 1
    dlogits_ready = False

    def logits(self) -> np.ndarray:
        """Host copy of the logits (B, T, V) of the last forward without targets."""
        return self.to_host(self.a["logits"])[..., :self.cfg.vocab_size]

    def logits_row(self, b: int, t: int) -> np.ndarray:
        """Host copy of one row of logits (V,): copies V floats, not the whole (B, T, Vp) buffer."""
        Vp = self.cfg.padded_vocab_size
        row = self.be.view(self.a["logits"], (b * self.T + t) * Vp, (Vp,))
        return self.to_host(row)[:self.cfg.vocab_size]

    # ------------------------------------------------------------------------------------------
    # backward and update

    def zero_grad(self) -> None:
        """Start a step: the gradients and the loss sum to zero. With first_write nothing is launched
        here: the next backward writes the weights' gradients and zeroes the rest and the loss sum
        first (reading them before that, get_grads(), step_loss() or update(), zeroes them then)."""
        if self.first_write:
            self._grads_stale = True
        else:
            self.be.memset0(self.grads)
            self.be.memset0(self.a["loss_acc"])
            self.be.memset0(self.a["losses"])  # the padded tail must not be garbage (it is summed, then dropped)
        self.micro_steps = 0

    def _zero_stale_grads(self) -> None:
        """What zero_grad() left undone, done now (a reader of the gradients before any backward, or a
        backward that can't write them: data parallel's per-layer hooks)."""
        if self._grads_stale:
            self.be.memset0(self.grads)
            self.be.memset0(self.a["loss_acc"])
            self._grads_stale = False

    def backward(self) -> None:
        """Gradients of the mean loss of the last forward, ACCUMULATED into self.grads (the first
        backward after zero_grad() writes them: first_write)."""
        if not (self.training and self.dlogits_ready):
            raise RuntimeError("backward() needs a training forward with targets first")
        self._launch_backward(first=self._grads_stale)
        self._grads_stale = False
        self.micro_steps += 1
        self.dlogits_ready = False

    def _launch_backward(self, on_layer_grads=None, before_attention=None, first: bool = False) -> None:
        """The backward's launches (no host work: capturable). on_layer_grads(l), if given, is
        called as soon as layer l's gradients are launched (l = L-1 .. 0), then once with None when
        the rest (wte, wpe, lnfw, lnfb) are: data parallel starts reducing them there.
        before_attention(l), if given, is called just before layer l's attention backward is
        launched: data parallel may start the previous layer's reduction there instead, beside the
        longest kernel of the layer rather than beside the persistent GEMM that opens it.
        first=True (first_write, the first micro-step after zero_grad): the dweight GEMMs write the
        weights' gradients, and the rest of the gradients are zeroed first."""
        cfg, a, p, g, k = self.cfg, self.a, self.p, self.g, self.k
        if first:
            assert self.first_write and on_layer_grads is None and before_attention is None
            k = {**k, **self.k_first}  # the dweight GEMMs' overwrite twins
            # (and the loss sum; the losses' padded tail, summed with them, then dropped, is never written)
            for view in self._rest_grads + [a["loss_acc"]] + ([a["losses_tail"]] if "losses_tail" in a else []):
                self.be.memset0(view)
        ln1, ln2, fch_gelu = self.lay["ln1"], self.lay["ln2"], self.lay["fch_gelu"]
        L = cfg.num_layers
        dres, dbtc, dqkv, dfch = a["dresidual"], a["dbtc"], a["dqkv"], a["dfch"]
        # running loss sum for logging: loss_acc += losses (the residual op, elementwise)
        k["loss_acc"](a["loss_acc"], a["loss_acc"], a["losses"])

        if self.folded:  # dwte += p'^T @ X (X = c * lnf), dlnf = c * (p' @ wte)
            k["mmb_lmhead"](dbtc, g["wte"], a["logits"], self.fold.X, p["wte"])
            self.fold.scale(dbtc)
        else:
            k["mmb_lmhead"](dbtc, g["wte"], a["logits"], a["lnf"], p["wte"])   # dlnf (B,T,C); dwte +=
        self.be.memset0(dres)
        defer = self.ln_deferred and on_layer_grads is None and before_attention is None
        self._ln_slot = 0 if defer else None
        # dres = d residual3[L-1]; its column sums are fcprojb's gradient of the last layer
        self._ln_backward(g["fcprojb"][L - 1], dres, g["lnfw"], g["lnfb"], dbtc, a["residual3"][L - 1],
                          p["lnfw"], a["lnf_mean"], a["lnf_rstd"])
        be = self.be
        side = ("fcproj", "fc", "attproj", "qkv") if self.side else ()  # whose dweight goes to the side stream
        for l in reversed(range(L)):
            residual = a["encoded"] if l == 0 else a["residual3"][l - 1]
            # (The side stream runs in order, so the two waits before the layernorm backwards, which
            # rewrite dres, also cover these two, fc_dw and qkv_dw: they stay for the reads they name.)
            if side:  # layer l + 1's fc dweight (and fcproj's before it) read d fch, fch_gelu and ln2,
                be.side_wait("fc_dw")  # which this layer rewrites (-r: fch_gelu and ln2 are one scratch)
            # MLP: residual3 = residual2 + fcproj(gelu(fc(ln2)))
            if self.fused_gelu_recompute:  # dinp, then fch_gelu and d fch from one pass over fch, then dweight
                k["mmb_fcproj_dinp"](dfch, dres, p["fcprojw"][l])                  # d fch_gelu
                k["gelu_backward_colsum_rc"](dfch, g["fcb"][l], fch_gelu[l], a["fch"][l], dfch)  # fcb +=
                with be.side("fcproj_dw") if "fcproj" in side else contextlib.nullcontext():
                    k["mmb_fcproj_dweight"](g["fcprojw"][l], dres, fch_gelu[l])
            else:
                if self.recompute >= 1:
                    k["gelu_forward"](fch_gelu[l], a["fch"][l])                    # recompute (B,T,4C)
                if self.fused_dgelu:  # d fch straight from the GEMM (fcb += its column sums with fused bias)
                    k["mmb_fcproj_dgelu"](dfch, g["fcprojw"][l], dres, fch_gelu[l], p["fcprojw"][l], a["fch"][l],
                                          g["fcb"][l] if self.fused_bias["gelu_backward"] else None)
                else:
                    k["mmb_fcproj"](dfch, g["fcprojw"][l], dres, fch_gelu[l], p["fcprojw"][l])  # d fch_gelu
            if not self.fused_bias["layernorm_backward"]:
                k["bias_C"](g["fcprojb"][l], dres)
            if self.fused_gelu_recompute or self.fused_dgelu:
                pass                                                                # d fch is written
            elif self.fused_bias["gelu_backward"]:                                  # in place: d fch;
                k["gelu_backward_colsum"](dfch, g["fcb"][l], a["fch"][l], dfch)    # fcb += its column sums
            else:
                k["gelu_backward"](dfch, a["fch"][l], dfch)                         # in place: d fch
            if self.recompute == 2:                                                 # recompute ln2 (B,T,C)
                k["layernorm_forward"](ln2[l], a["rc_mean"], a["rc_rstd"], a["residual2"][l],
                                       p["ln2w"][l], p["ln2b"][l])
            if "fc" in side:  # the dweight first, so that its CTAs hold their SMs and dinp's take the rest
                with be.side("fc_dw"):
                    k["mmb_fc_dweight"](g["fcw"][l], dfch, ln2[l])
                k["mmb_fc_dinp"](dbtc, dfch, p["fcw"][l])                            # d ln2 (B,T,C)
            else:
                k["mmb_fc"](dbtc, g["fcw"][l], dfch, ln2[l], p["fcw"][l])           # d ln2 (B,T,C)
            if not self.fused_bias["gelu_backward"]:
                k["bias_4C"](g["fcb"][l], dfch)
            if side:  # fcproj's dweight reads dres (d residual3), which the layernorm backward rewrites
                be.side_wait("fcproj_dw")
            self._ln_backward(g["attprojb"][l], dres, g["ln2w"][l], g["ln2b"][l], dbtc, a["residual2"][l],
                              p["ln2w"][l], a["ln2_mean"][l], a["ln2_rstd"][l])    # dres = d residual2
            # attention: residual2 = residual + attproj(attention(qkv(ln1)))
            if "attproj" in side:
                with be.side("attproj_dw"):
                    k["mmb_attproj_dweight"](g["attprojw"][l], dres, a["atty"][l])
                k["mmb_attproj_dinp"](dbtc, dres, p["attprojw"][l])                 # d atty
            else:
                k["mmb_attproj"](dbtc, g["attprojw"][l], dres, a["atty"][l], p["attprojw"][l])  # d atty
            if not self.fused_bias["layernorm_backward"]:
                k["bias_C"](g["attprojb"][l], dres)
            if side:  # layer l + 1's qkv dweight and bias read dqkv (and -r 2's ln1 scratch)
                be.side_wait("qkv_dw")
            if before_attention is not None:
                be.side_join()
                before_attention(l)
            if self.att_side_zero:  # the accumulator zeroed after the previous layer's attention backward
                be.side_wait("att_zero")
            if self.fused_bias["attention_backward"]:  # d qkv (B,T,3C); qkvb += its column sums
                k["attention_backward"](dqkv, g["qkvb"][l], dbtc, a["qkvr"][l], a["att"][l], a["atty"][l])
            else:
                k["attention_backward"](dqkv, dbtc, a["qkvr"][l], a["att"][l], a["atty"][l])  # d qkv (B,T,3C)
            if self.recompute == 2:                                                 # recompute ln1 (B,T,C)
                k["layernorm_forward"](ln1[l], a["rc_mean"], a["rc_rstd"], residual, p["ln1w"][l], p["ln1b"][l])
            if "qkv" in side:
                with be.side("qkv_dw"):
                    k["mmb_qkv_dweight"](g["qkvw"][l], dqkv, ln1[l])
                if not self.fused_bias["attention_backward"]:
                    k["bias_3C"](g["qkvb"][l], dqkv)  # (on the main stream: measured a little faster there)
                k["mmb_qkv_dinp"](dbtc, dqkv, p["qkvw"][l])                         # d ln1 (B,T,C)
            else:
                k["mmb_qkv"](dbtc, g["qkvw"][l], dqkv, ln1[l], p["qkvw"][l])       # d ln1 (B,T,C)
                if not self.fused_bias["attention_backward"]:
                    k["bias_3C"](g["qkvb"][l], dqkv)
            if self.att_side_zero:  # after qkv's dweight on the side stream, not before it: ahead of it the
                with be.side("att_zero"):  # zeroing held the side stream's GEMMs up (bf16 B=16 +0.64 ms)
                    self.built["attention_backward"].info["rezero"]()
            if side:
                be.side_wait("attproj_dw")  # attproj's dweight reads dres (d residual2): rewritten next
            # dres = d residual; its column sums are fcprojb's gradient of the layer below (none at l = 0)
            self._ln_backward(g["fcprojb"][l - 1] if l > 0 else None, dres, g["ln1w"][l], g["ln1b"][l], dbtc,
                              residual, p["ln1w"][l], a["ln1_mean"][l], a["ln1_rstd"][l])
            if on_layer_grads is not None:
                be.side_join()  # (layer l's weight gradients are complete)
                on_layer_grads(l)
        if defer:  # the deferred column sums of every layernorm backward: ln*w, ln*b, fcprojb, attprojb
            with be.side("ln_flush") if self.side else contextlib.nullcontext():
                self._ln_flush()
            self._ln_slot = None
        k["encoder_backward"](g["wte"], g["wpe"], dres, self.inputs)
        be.side_join()  # every gradient is written when the backward's launches are
        if on_layer_grads is not None:
            on_layer_grads(None)

    def _ln_backward(self, next_dbias, dinp, dweight, dbias, dout, inp, weight, mean, rstd) -> None:
        """layernorm_backward (dinp, dweight, dbias +=); with the fused form also next_dbias += the
        column sums of dinp after it (the bias gradient of the linear layer whose output dinp is the
        gradient of), else that is left to the caller's matmul_backward_bias."""
        if next_dbias is not None and self.fused_bias["layernorm_backward"] and self._ln_slot is not None:
            self.k["layernorm_backward_colsum_deferred"](self._ln_slot, dinp, dweight, dbias, next_dbias, dout, inp,
                                                         weight, mean, rstd)  # the sums: at the flush
            self._ln_slot += 1
        elif next_dbias is not None and self.fused_bias["layernorm_backward"]:
            self.k["layernorm_backward_colsum"](dinp, dweight, dbias, next_dbias, dout, inp, weight, mean, rstd)
        else:
            self.k["layernorm_backward"](dinp, dweight, dbias, dout, inp, weight, mean, rstd)

    def train_micro_step(self, x: np.ndarray, y: np.ndarray, on_layer_grads=None, before_attention=None,
                         before_layer=None, custom=None) -> None:
        """forward(x, y) without reading the loss, then backward(): one micro-step of training.
        On the cuda backend the first call launches kernel by kernel and captures the launches into
        a CUDA graph; later calls upload the batch and replay it (one launch instead of ~400).
        With on_layer_grads or before_layer (see _launch_backward, _launch_forward) it launches
        kernel by kernel, never captured. custom: a launch function of the caller's own (data
        parallel's forward + backward with its reductions), run, captured and replayed in the same
        way, as a graph of its own."""
        if not self.training:
            raise RuntimeError("train_micro_step() needs a model built with training=True")
        self.set_batch(x, y)
        if self._graph_accum != self.grad_accum_steps:
            # the loss scale 1/(B*T*accum) is a launch argument of the captured classifier: recapture
            self._graph_micro = self._graph_micro_first = self._graph_custom = None
            self._graph_accum = self.grad_accum_steps
        if custom is not None:
            self._zero_stale_grads()
            self._run_captured("_graph_custom", custom)
        elif on_layer_grads is not None or before_layer is not None:
            self._zero_stale_grads()
            self._launch_forward(True, True, before_layer)
            self._launch_backward(on_layer_grads, before_attention)
        elif self._grads_stale:
            self._run_captured("_graph_micro_first", self._launch_micro_first)
            self._grads_stale = False
        else:
            self._run_captured("_graph_micro", self._launch_micro)
        self.has_targets_loaded = self.has_loss = True
        self.dlogits_ready = False
        self.micro_steps += 1

    def _launch_micro(self) -> None:
        self._launch_forward(True, True)
        self._launch_backward()

    def _launch_micro_first(self) -> None:
        self._launch_forward(True, True)
        self._launch_backward(first=True)

    def _run_captured(self, attr: str, launch) -> None:
        """Run launch(): kernel by kernel the first time (or always, without graphs), then capture it
        into getattr(self, attr) (be.graph) and replay that from then on."""
        graph = getattr(self, attr)
        if graph is not None and self.use_graphs:
            graph()
            return
        launch()
        if self.use_graphs:  # (data parallel's custom graph, with NCCL's launches in it: never programmatic)
            setattr(self, attr, self.be.graph(launch, pdl=self.B * self.T <= PDL_TRAIN_TOKENS
                                              and attr != "_graph_custom"))

    def update(self, lr: float, step: int, weight_decay: float = 0.0, beta1: float = 0.9,
               beta2: float = 0.95, eps: float = 1e-8, max_norm: float = 1.0) -> None:
        """Global-norm clipping (computed and applied on the device) and AdamW. `step` is 1-based.
        The hyperparameters go up in one small async copy; the launches are captured into a CUDA
        graph after the first update (cuda backend)."""
        if not self.has_optimizer:
            raise RuntimeError("update(): this model was built with optimizer=False")
        self._zero_stale_grads()  # (zero_grad() and no backward since: the gradients are zeros)
        self.be.pinned_free(self._pinned_hp)
        for i, (_, decay, *_) in enumerate(self.adamw_plan):
            self._pinned_hp[i] = hyperparams(lr, beta1, beta2, eps, weight_decay if decay else 0.0, step,
                                             max_norm, self.f32)
        self.be.upload_async(self.hp, self._pinned_hp)
        if self.bf16:
            self.be.pinned_free(self._pinned_seeds)
            self._pinned_seeds[:] = self.draw_seeds(len(self.adamw_plan))
            self.be.upload_async(self.seeds, self._pinned_seeds)
        self._run_captured("_graph_update", self._launch_update)

    def draw_seeds(self, n: int) -> list[int]:
        """n stochastic-rounding seeds for this step's bf16 AdamW launches, from the run's rounding
        RNG (0s, i.e. round to nearest even, with stochastic_rounding off: the RNG does not move)."""
        if not self.stochastic_rounding:
            return [0] * n
        seeds = []
        for _ in range(n):
            self.sr_state, seed = next_seed(self.sr_state)
            seeds.append(seed)
        return seeds

    def _launch_update(self) -> None:
        self.k["global_norm"](self.norm2, self.grads)
        for i, ((adamw, _, params, grads, m, v, *master), hp) in enumerate(zip(self.adamw_plan, self.hps)):
            if master:  # bf16: the update runs on the fp32 master, then writes the bf16 weights
                adamw(params, grads, m, v, self.norm2, hp, master[0], self.seed_views[i])
            else:
                adamw(params, grads, m, v, self.norm2, hp)

    def grad_norm(self) -> float:
        """The global gradient norm computed by the last update() (a host read: a sync)."""
        return float(math.sqrt(max(float(self.be.download(self.norm2).reshape(-1)[0]), 0.0)))

    def read_step(self, norm: bool = True, norm_buf=None) -> StepRead:
        """Queue the copies of the step's loss sums (and, with norm, of the squared gradient norm that
        update() computed: norm2, or norm_buf) to the host behind everything launched so far, and
        return their StepRead. Unlike step_loss() and grad_norm(), this does not wait: the trainer
        launches the next step first, then reads this one's loss while the GPU runs on (no idle GPU
        between steps). Two reads may be pending at once; a third waits for the oldest."""
        self._zero_stale_grads()
        i = self._read_turn
        self._read_turn ^= 1
        if self._reads[i] is not None:
            self._reads[i].wait()  # its values out of the pinned buffers before they are reused
        loss_host, norm_host = self._read_bufs[i]
        copies = [self.be.download_async(loss_host, self.a["loss_acc"])]
        if norm:
            copies.append(self.be.download_async(norm_host, self.norm2 if norm_buf is None else norm_buf))
        self._reads[i] = StepRead(copies, loss_host, self.B * self.T, self.micro_steps,
                                  norm_host if norm else None)
        return self._reads[i]

    def step_loss(self) -> float:
        """Mean loss over the micro-steps since zero_grad() (a host read: a sync, through pinned memory
        by a copy queued on the stream behind the step)."""
        return self.read_step(norm=False).loss()
