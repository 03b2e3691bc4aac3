"""Hugging Face GPT-2 directories (config.json + model.safetensors) <-> llm.c's flat parameters.

    python dev/eval/export_hf.py -i out/model_00005000.bin -o out/hf       # then, anywhere:
    #   transformers.GPT2LMHeadModel.from_pretrained("out/hf")
    python train_gpt2.py -e path/to/gpt2-medium                            # fine-tune an HF checkpoint
    python sample_gpt2.py -e path/to/gpt2-medium --prompt "Hello"

    from llmc.hf import export_hf, read_hf, read_any_model
    export_hf("gpt2_124M.bin", "hf_dir", dtype="float32")
    cfg, params = read_hf("hf_dir")              # GPT2Config + flat fp32 params in llm.c's layout
    cfg, params = read_any_model(path)           # an llm.c .bin or an HF directory

No torch and no transformers here: safetensors is a simple format and we read and write it with
numpy. A file is: 8 bytes, the little-endian uint64 length N of a JSON header; the header (UTF-8,
padded with spaces so the data starts 8-byte aligned): {"<name>": {"dtype": "F32" | "BF16" | "F16",
"shape": [...], "data_offsets": [begin, end]}, ..., "__metadata__": {"format": "pt"}}; then the
data, each tensor row-major little-endian at [begin, end) counted from the end of the header, the
tensors back to back. transformers wants the "format": "pt" metadata.

The mapping (transformers' GPT2LMHeadModel state dict <- llm.c tensor, l = layer):
    transformer.wte.weight (V, C)           <- wte[:V]      (llm.c pads the rows to Vp; HF does not)
    transformer.wpe.weight (maxT, C)        <- wpe
    transformer.h.l.ln_1.{weight,bias}      <- ln1w[l], ln1b[l]
    transformer.h.l.attn.c_attn.weight      <- qkvw[l].T    (HF's Conv1D keeps (in, out); llm.c (out, in))
    transformer.h.l.attn.c_attn.bias        <- qkvb[l]
    transformer.h.l.attn.c_proj.{w,b}       <- attprojw[l].T, attprojb[l]
    transformer.h.l.ln_2.{weight,bias}      <- ln2w[l], ln2b[l]
    transformer.h.l.mlp.c_fc.{w,b}          <- fcw[l].T, fcb[l]
    transformer.h.l.mlp.c_proj.{w,b}        <- fcprojw[l].T, fcprojb[l]
    transformer.ln_f.{weight,bias}          <- lnfw, lnfb
lm_head.weight is wte (tied embeddings): not stored; transformers ties it on load. Reading accepts
the names with or without "transformer." (the original gpt2 checkpoints have none), skips the
attention-mask buffers (h.l.attn.bias / masked_bias) and a tied lm_head.weight, and reads sharded
checkpoints (model.safetensors.index.json) too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from llmc.bf16 import from_bf16, to_bf16
from llmc.checkpoint import atomic_open, read_model
from llmc.config import GPT2Config, param_layout, param_shapes
from llmc.errors import LLMCError

SAFETENSORS_DTYPES = {"F32": 4, "BF16": 2, "F16": 2}
DTYPE_NAMES = {"float32": "F32", "fp32": "F32", "bfloat16": "BF16", "bf16": "BF16"}
VOCAB_PAD = 128   # llm.c pads the vocab to a multiple of 128 (50257 -> 50304)

# ----------------------------------------------------------------------------------------------
# safetensors, by hand


def write_safetensors(path, tensors, metadata: dict | None = None) -> None:
    """tensors: [(name, fp32 array, "F32" | "BF16")], written in that order, one at a time (only
    one tensor's converted copy exists at once, so an XL model needs no second full-size buffer)."""
    header, off = {}, 0
    for name, arr, dt in tensors:
        nbytes = arr.size * SAFETENSORS_DTYPES[dt]
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-(8 + len(blob)) % 8)
    with atomic_open(path) as f:
        f.write(np.array([len(blob)], "<u8").tobytes())
        f.write(blob)
        for _, arr, dt in tensors:
            a = np.ascontiguousarray(arr, dtype=np.float32)
            f.write(to_bf16(a).astype("<u2").tobytes() if dt == "BF16" else a.astype("<f4").tobytes())


def read_safetensors_header(path) -> tuple[dict, int]:
    """(header without __metadata__, byte offset of the data), every entry checked."""
    p = Path(path)
    kind = "safetensors file"
    if not p.is_file():
        raise LLMCError(f"{kind} {path}: not found")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise LLMCError(f"{kind} {path}: {size} bytes, too short for the 8-byte header length")
        n = int(np.frombuffer(head, "<u8")[0])
        if n > size - 8 or n > 100_000_000:
            raise LLMCError(f"{kind} {path}: header length {n:,} does not fit the {size:,}-byte file "
                            f"(not a safetensors file?)")
        try:
            header = json.loads(f.read(n).decode())
            assert isinstance(header, dict)
        except (ValueError, AssertionError):
            raise LLMCError(f"{kind} {path}: the header is not a JSON object (not a safetensors file?)") from None
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    for name, e in header.items():
        try:
            dt, shape, (b, end) = e["dtype"], [int(s) for s in e["shape"]], e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise LLMCError(f"{kind} {path}: tensor {name}: entry without dtype/shape/data_offsets") from None
        if dt not in SAFETENSORS_DTYPES:
            raise LLMCError(f"{kind} {path}: tensor {name}: dtype {dt}, expected one of "
                            f"{', '.join(SAFETENSORS_DTYPES)}")
        want = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_DTYPES[dt]
        if not (0 <= b <= end <= data_len and end - b == want):
            raise LLMCError(f"{kind} {path}: tensor {name}: bytes [{b}, {end}) for a {dt} {shape} "
                            f"tensor ({want:,} bytes) in {data_len:,} bytes of data (truncated?)")
    return header, 8 + n


def read_tensor(path, entry: dict, data_start: int) -> np.ndarray:
    """One tensor of a safetensors file as fp32 (read from disk on demand)."""
    dt, shape, (b, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    raw = np.fromfile(path, dtype="<u2" if dt != "F32" else "<f4",
                      count=(end - b) // SAFETENSORS_DTYPES[dt], offset=data_start + b)
    if dt == "BF16":
        raw = from_bf16(raw)
    elif dt == "F16":
        raw = raw.view("<f2").astype(np.float32)
    return raw.reshape(shape).astype(np.float32, copy=False)


# ----------------------------------------------------------------------------------------------
# llm.c -> HF

def hf_config(cfg: GPT2Config, dtype: str) -> dict:
    """GPT-2's config.json for this shape (transformers' GPT2Config defaults, as llm.c's export)."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.max_seq_len, "n_ctx": cfg.max_seq_len,
        "n_embd": cfg.channels, "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": None,
        "activation_function": "gelu_new",   # the tanh approximation, which llm.c's GELU is
        "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
        "bos_token_id": 50256, "eos_token_id": 50256, "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }


def hf_tensors(cfg: GPT2Config, params: np.ndarray, dt: str):
    """[(HF name, array view, dt)] in a fixed order, from llm.c's flat params (no copies made here)."""
    t = {name: params[off:off + size].reshape(shape)
         for (name, shape), (_, off, size) in zip(param_shapes(cfg), param_layout(cfg))}
    out = [("transformer.wte.weight", t["wte"][:cfg.vocab_size]), ("transformer.wpe.weight", t["wpe"])]
    for l in range(cfg.num_layers):
        h = f"transformer.h.{l}."
        out += [(h + "ln_1.weight", t["ln1w"][l]), (h + "ln_1.bias", t["ln1b"][l]),
                (h + "attn.c_attn.weight", t["qkvw"][l].T), (h + "attn.c_attn.bias", t["qkvb"][l]),
                (h + "attn.c_proj.weight", t["attprojw"][l].T), (h + "attn.c_proj.bias", t["attprojb"][l]),
                (h + "ln_2.weight", t["ln2w"][l]), (h + "ln_2.bias", t["ln2b"][l]),
                (h + "mlp.c_fc.weight", t["fcw"][l].T), (h + "mlp.c_fc.bias", t["fcb"][l]),
                (h + "mlp.c_proj.weight", t["fcprojw"][l].T), (h + "mlp.c_proj.bias", t["fcprojb"][l])]
    out += [("transformer.ln_f.weight", t["lnfw"]), ("transformer.ln_f.bias", t["lnfb"])]
    return [(n, a, dt) for n, a in out]


def export_hf(model_path, out_dir, dtype: str | None = None, tokenizer: bool = True) -> dict:
    """llm.c checkpoint -> out_dir/{config.json, model.safetensors} (+ the GPT-2 tokenizer files
    vocab.json / merges.txt when a local copy exists). dtype: float32 | bfloat16; None keeps the
    checkpoint's own (v3 fp32 -> float32, v5 bf16 -> bfloat16), so nothing is rounded by default."""
    cfg, params = read_model(model_path)
    if dtype is None:
        version = int(np.fromfile(model_path, dtype="<i4", count=2)[1])
        dtype = "bfloat16" if version == 5 else "float32"
    if dtype not in DTYPE_NAMES:
        raise LLMCError(f"--dtype {dtype}: expected float32 or bfloat16")
    dt = DTYPE_NAMES[dtype]
    dtype = "float32" if dt == "F32" else "bfloat16"
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LLMCError(f"-o {out_dir}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", hf_tensors(cfg, params, dt))
    with atomic_open(out / "config.json") as f:
        f.write((json.dumps(hf_config(cfg, dtype), indent=2) + "\n").encode())
    wrote_tok = tokenizer and cfg.vocab_size == 50257 and _copy_gpt2_tokenizer(out)
    return {"cfg": cfg, "dtype": dtype, "tokenizer": bool(wrote_tok)}


def _copy_gpt2_tokenizer(out: Path) -> bool:
    """GPT-2's own BPE files are HF's vocab.json and merges.txt: copy them from a local source
    (the copies shipped in llmc/vocab/, or tiktoken's cache), never the network. False if none is there."""
    from llmc import tokenizer as tk
    d = tk._shipped_vocab_dir()
    if d is not None:
        src = {"vocab.bpe": d / "vocab.bpe", "encoder.json": d / "encoder.json"}
    elif tk._in_tiktoken_cache():
        src = {name: Path(tk._tiktoken_cache_path(url)) for name, (url, _) in tk.GPT2_FILES.items()}
    else:
        return False
    shutil.copyfile(src["encoder.json"], out / "vocab.json")
    shutil.copyfile(src["vocab.bpe"], out / "merges.txt")
    with atomic_open(out / "tokenizer_config.json") as f:
        f.write(json.dumps({"tokenizer_class": "GPT2Tokenizer", "model_max_length": 1024,
                            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                            "unk_token": "<|endoftext|>"}, indent=2).encode())
    return True


# ----------------------------------------------------------------------------------------------
# HF -> llm.c

def _config_from_hf(path: Path) -> GPT2Config:
    where = f"Hugging Face model {path}/config.json"
    try:
        c = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise LLMCError(f"-e {path}: a directory, but without config.json (expected a Hugging Face "
                        f"GPT-2: config.json + model.safetensors)") from None
    except ValueError as e:
        raise LLMCError(f"{where}: not JSON ({e})") from None
    if c.get("model_type", "gpt2") != "gpt2":
        raise LLMCError(f"{where}: model_type {c.get('model_type')!r}, only GPT-2 (\"gpt2\") loads here")
    try:
        L, NH, C, V, maxT = (int(c[k]) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions"))
    except (KeyError, TypeError, ValueError) as e:
        raise LLMCError(f"{where}: missing or bad field {e}") from None
    # what our kernels compute: GPT-2 exactly; refuse variants rather than compute something else
    checks = [
        (c.get("n_inner") in (None, 4 * C), f"n_inner {c.get('n_inner')} (our MLP is 4*n_embd = {4 * C})"),
        (c.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
         f"activation_function {c.get('activation_function')!r} (ours is GELU's tanh form, gelu_new)"),
        (abs(float(c.get("layer_norm_epsilon", 1e-5)) - 1e-5) < 1e-12,
         f"layer_norm_epsilon {c.get('layer_norm_epsilon')} (ours is 1e-5)"),
        (c.get("scale_attn_weights", True) and not c.get("scale_attn_by_inverse_layer_idx", False),
         "attention scaling other than 1/sqrt(head size)"),
        (c.get("tie_word_embeddings", True), "untied embeddings (GPT-2's lm head is wte)"),
    ]
    for ok, what in checks:
        if not ok:
            raise LLMCError(f"{where}: {what}: not the GPT-2 architecture this trainer runs")
    return GPT2Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=-(-V // VOCAB_PAD) * VOCAB_PAD,
                      num_layers=L, num_heads=NH, channels=C)


def _tensor_index(path: Path) -> dict:
    """name -> (file, entry, data offset) over model.safetensors or its shards."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    files = []
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise LLMCError(f"{index}: not a safetensors index (no weight_map)") from None
    else:
        hint = " (it has pytorch_model.bin: re-save it with safe_serialization=True)" \
            if (path / "pytorch_model.bin").exists() else ""
        raise LLMCError(f"-e {path}: no model.safetensors or model.safetensors.index.json{hint}")
    out = {}
    for f in files:
        header, start = read_safetensors_header(f)
        for name, e in header.items():
            key = name[len("transformer."):] if name.startswith("transformer.") else name
            out[key] = (f, e, start)
    return out


def read_hf(path) -> tuple[GPT2Config, np.ndarray]:
    """A Hugging Face GPT-2 directory -> (config, flat fp32 params in llm.c's layout, vocab padded
    to a multiple of 128 with zero rows)."""
    path = Path(path)
    cfg = _config_from_hf(path)
    index = _tensor_index(path)
    params = np.zeros(cfg.num_parameters, np.float32)
    views = {name: params[off:off + size].reshape(shape)
             for (name, shape), (_, off, size) in zip(param_shapes(cfg), param_layout(cfg))}
    # the llm.c target of every HF tensor: (view to fill, transpose?)
    targets = {"wte.weight": (views["wte"][:cfg.vocab_size], False), "wpe.weight": (views["wpe"], False),
               "ln_f.weight": (views["lnfw"], False), "ln_f.bias": (views["lnfb"], False)}
    per_layer = {"ln_1.weight": ("ln1w", False), "ln_1.bias": ("ln1b", False),
                 "attn.c_attn.weight": ("qkvw", True), "attn.c_attn.bias": ("qkvb", False),
                 "attn.c_proj.weight": ("attprojw", True), "attn.c_proj.bias": ("attprojb", False),
                 "ln_2.weight": ("ln2w", False), "ln_2.bias": ("ln2b", False),
                 "mlp.c_fc.weight": ("fcw", True), "mlp.c_fc.bias": ("fcb", False),
                 "mlp.c_proj.weight": ("fcprojw", True), "mlp.c_proj.bias": ("fcprojb", False)}
    for l in range(cfg.num_layers):
        for hf, (ours, tr) in per_layer.items():
            targets[f"h.{l}.{hf}"] = (views[ours][l], tr)
    missing = [k for k in targets if k not in index]
    if missing:
        raise LLMCError(f"Hugging Face model {path}: no tensor {missing[0]} ({len(missing)} missing; "
                        f"config says {cfg.num_layers} layers)")
    for name, (view, tr) in targets.items():
        f, entry, start = index[name]
        want = view.T.shape if tr else view.shape
        if tuple(entry["shape"]) != want:
            raise LLMCError(f"Hugging Face model {path}: tensor {name} is {tuple(entry['shape'])}, "
                            f"config.json implies {want}")
        a = read_tensor(f, entry, start)
        view[...] = a.T if tr else a
    for name, (f, entry, start) in index.items():
        if name in targets:
            continue
        if name == "lm_head.weight":
            if not np.array_equal(read_tensor(f, entry, start), views["wte"][:cfg.vocab_size]):
                raise LLMCError(f"Hugging Face model {path}: lm_head.weight differs from wte.weight "
                                f"(untied): GPT-2 ties them")
        elif not (name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")):
            raise LLMCError(f"Hugging Face model {path}: unexpected tensor {name} (not GPT-2?)")
    return cfg, params


def read_any_model(path) -> tuple[GPT2Config, np.ndarray]:
    """An llm.c checkpoint (.bin, v3/v5) or a Hugging Face GPT-2 directory."""
    return read_hf(path) if Path(path).is_dir() else read_model(path)
