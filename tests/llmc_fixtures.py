"""Test fixtures written independently of llmc: llm.c-format files and a local HTTP server.

The writers here use only struct and numpy (and torch for bf16 rounding), straight from the format
descriptions (llm.c's train_gpt2.py writes the same bytes), never llmc's own writers, so a round trip
through them checks llmc against the format rather than against itself.

    from llmc_fixtures import write_llmc_model, write_llmc_shard, serve_files
    write_llmc_model(path, header_fields, params, version=3)
    with serve_files({"a.bin": b"..."}) as (base_url, log): ...
"""
from __future__ import annotations

import contextlib
import re
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np


def header_bytes(*fields: int) -> bytes:
    """256 little-endian int32, the given fields first, zeros after."""
    return struct.pack("<256i", *fields, *([0] * (256 - len(fields))))


def bf16_bytes_torch(x: np.ndarray) -> bytes:
    """fp32 -> bf16 (round to nearest even) by PyTorch, as little-endian uint16 bytes."""
    import torch
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().astype("<i2").tobytes()


def write_llmc_model(path, maxT, V, L, NH, C, Vp, params, version=3) -> None:
    """llm.c model checkpoint: magic 20240326, version 3 (fp32) or 5 (bf16), maxT V L NH C Vp."""
    params = np.asarray(params, dtype=np.float32).reshape(-1)
    body = params.astype("<f4").tobytes() if version == 3 else bf16_bytes_torch(params)
    with open(path, "wb") as f:
        f.write(header_bytes(20240326, version, maxT, V, L, NH, C, Vp))
        f.write(body)


def write_llmc_debug_state(path, B, T, x, y, logits, loss, grads) -> None:
    """llm.c debug state: magic 20240327, version 2, B, T; x, y int32; logits (B,T,V), loss, grads fp32."""
    with open(path, "wb") as f:
        f.write(header_bytes(20240327, 2, B, T))
        f.write(np.asarray(x, dtype="<i4").tobytes())
        f.write(np.asarray(y, dtype="<i4").tobytes())
        f.write(np.asarray(logits, dtype="<f4").tobytes())
        f.write(struct.pack("<f", loss))
        f.write(np.asarray(grads, dtype="<f4").tobytes())


def write_llmc_shard(path, tokens) -> None:
    """llm.c data shard: magic 20240520, version 1, count; uint16 tokens."""
    tokens = list(tokens)
    with open(path, "wb") as f:
        f.write(header_bytes(20240520, 1, len(tokens)))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


def write_llmc_tokenizer(path, token_bytes, eot=50256, version=2) -> None:
    """llm.c tokenizer: magic 20240328, version 2, vocab size, eot; per token a length byte + bytes.
    Version 1 has no eot field."""
    fields = (20240328, version, len(token_bytes)) + ((eot,) if version == 2 else ())
    with open(path, "wb") as f:
        f.write(header_bytes(*fields))
        for b in token_bytes:
            f.write(struct.pack("<B", len(b)) + b)


def write_llmc_evalfile(path, examples, magic=20240522, version=1) -> None:
    """llm.c eval file (HellaSwag): header magic 20240522, version 1, example count, longest example
    in bytes; then per example the uint16 stream 65535, its byte length, its index, label, 4, the
    context as (n, tokens), each ending as (n, tokens). examples: [(label, ctx_tokens, [4 endings])]."""
    stream, longest = [], 0
    for i, (label, ctx, endings) in enumerate(examples):
        ex = [65535, 0, i, label, len(endings), len(ctx), *ctx]
        for end in endings:
            ex += [len(end), *end]
        ex[1] = 2 * len(ex)
        longest = max(longest, ex[1])
        stream += ex
    with open(path, "wb") as f:
        f.write(header_bytes(magic, version, len(examples), longest))
        f.write(struct.pack(f"<{len(stream)}H", *stream))


# -----------------------------------------------------------------------------
# a local HTTP server with HEAD and byte ranges (what curl -C - and our downloads need)


@contextlib.contextmanager
def serve_files(files: dict, etags: dict | None = None, fail_first: int = 0):
    """Serve {name: bytes} at http://127.0.0.1:<port>/<name> from a thread.

    Yields (base_url, log): log gets (method, path, range header or None) per request. Missing
    names answer 404. etags adds an x-linked-etag header per name (as HuggingFace does for the
    sha256). fail_first answers the first n requests with 503."""
    etags = etags or {}
    log = []
    state = {"to_fail": fail_first}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # keep test output clean
            pass

        def _answer(self, with_body: bool):
            name = self.path.lstrip("/")
            rng = self.headers.get("Range")
            log.append((self.command, name, rng))
            if state["to_fail"] > 0:
                state["to_fail"] -= 1
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if name not in files:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = files[name]
            start = 0
            m = re.fullmatch(r"bytes=(\d+)-", rng or "")
            if m:
                start = int(m.group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if name in etags:
                self.send_header("X-Linked-Etag", f'"{etags[name]}"')
            self.end_headers()
            if with_body:
                self.wfile.write(data[start:])

        def do_HEAD(self):
            self._answer(False)

        def do_GET(self):
            self._answer(True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A local port with nothing listening on it (connection refused)."""
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# llm.c's optimizer state (train_gpt2.cu save_state/load_state), per rank: a 256 x int32 header with
# [0]=20240527 magic, [1]=1 version, [2]=num_processes, [3]=process_rank, [4]=use_master_weights,
# [5]=should_shuffle, [10]=step, int64 [20:22]=rng_state, int64 [30:32]=current_shard_idx,
# int64 [32:34]=current_sample_idx; then m, v (fp32), then master weights (fp32) when [4]=1; then,
# only when [5]=1, the shuffling loader's permutations (which llm.c's reader reads and nothing else).

def write_llmc_state(path, step, m, v, master=None, shard=0, sample=0, rng_state=13371337,
                     num_processes=1, rank=0, shuffle=0, tail=b"") -> None:
    ints = [0] * 256
    ints[0:6] = [20240527, 1, num_processes, rank, int(master is not None), shuffle]
    ints[10] = step
    head = bytearray(struct.pack("<256i", *ints))
    struct.pack_into("<Q", head, 20 * 4, rng_state)
    struct.pack_into("<Q", head, 30 * 4, shard)
    struct.pack_into("<Q", head, 32 * 4, sample)
    with open(path, "wb") as f:
        f.write(bytes(head))
        for a in (m, v) + ((master,) if master is not None else ()):
            f.write(np.asarray(a, dtype="<f4").tobytes())
        f.write(tail)


def read_llmc_state(path, num_parameters) -> dict:
    """What llm.c's load_state takes from a state file (it reads no further unless [5]=1)."""
    data = open(path, "rb").read()
    h = struct.unpack_from("<256i", data)
    assert h[0] == 20240527 and h[1] == 1, "llm.c asserts the magic and version"
    n = num_parameters
    floats = np.frombuffer(data, dtype="<f4", count=(3 if h[4] else 2) * n, offset=1024)
    return dict(num_processes=h[2], rank=h[3], master_weights=h[4], shuffle=h[5], step=h[10],
                rng_state=struct.unpack_from("<Q", data, 80)[0], shard=struct.unpack_from("<Q", data, 120)[0],
                sample=struct.unpack_from("<Q", data, 128)[0], m=floats[:n], v=floats[n:2 * n],
                master=floats[2 * n:] if h[4] else None)


def train_steps(cfg, be, B: int, T: int, steps: int = 2, micro: int = 2, logits: bool = False, **model_kw):
    """The model tests' common run: GPT2(cfg, be, B, T, **model_kw) from init_params(3), stochastic
    rounding off, `steps` optimizer steps of `micro` micro-steps each through train_micro_step (so on
    the cuda backend the later micro-steps are CUDA graph replays), next-token targets on random ids
    (generator seed 5), AdamW at lr 1e-3. Returns (model, [(loss, grads, params after the update)]
    per step, the logits of a forward of the last batch without targets when `logits`, else None);
    grads and params as fp32 copies (bf16 runs give fp32 values too)."""
    from llmc.model import GPT2
    m = GPT2(cfg, be, B, T, **model_kw)
    m.stochastic_rounding = False
    m.init_params(3)
    rng = np.random.default_rng(5)
    out = []
    for step in range(1, steps + 1):
        m.zero_grad()
        for _ in range(micro):
            x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
            m.train_micro_step(x, np.roll(x, -1, axis=1))
        loss = np.float64(m.step_loss())
        grads = np.asarray(m.get_grads(), np.float32).copy()
        m.update(lr=1e-3, step=step)
        out.append((loss, grads, np.asarray(m.get_params(), np.float32).copy()))
    last = None
    if logits:
        m.forward(x)
        last = m.logits().copy()
    return m, out, last


def wgmma_entries(macro: str) -> dict:
    """{entry point: (input type, output type, tile width, stages, flag)} of cuda/gemm_wgmma.cu's
    `macro(NAME, T, OUT, BN, STAGES, true|false)` lines (the GELU and dgelu instance tables)."""
    from llmc.runtime import CUDA_DIR
    src = (CUDA_DIR / "gemm_wgmma.cu").read_text()
    pat = rf"^{macro}\((\w+), ([\w:]+), ([\w:]+), (\d+), (\d+), (true|false)\)$"
    return {m.group(1): (m.group(2), m.group(3), int(m.group(4)), int(m.group(5)), m.group(6) == "true")
            for m in re.finditer(pat, src, re.M)}
