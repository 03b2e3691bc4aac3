"""Encoder: GPT-2's token + position embeddings, forward and backward.

    python dev/cuda/encoder_forward.py          # validate + time every variant at B=4, T=1024, C=768
    python dev/cuda/encoder_backward.py 2 3     # just the deterministic backward variants
    python -m pytest tests/test_encoder.py -q   # references vs torch autograd (add -m gpu on a GPU)

Semantics (docs/ops.md):
    encoder_forward:  out(B,T,C)=, inp(B,T) int32, wte(Vp,C), wpe(maxT,C)
                      out[b,t] = wte[inp[b,t]] + wpe[t]
    encoder_backward: dwte(Vp,C)+=, dwpe(maxT,C)+=, dout(B,T,C), inp(B,T) int32
                      dwte[inp[b,t]] += dout[b,t]; dwpe[t] += sum_b dout[b,t]; only the rows of
                      dwte whose tokens occur (and the first T rows of dwpe) are touched

Variants 2, 3, 6, 7, 8, 9 and 10 of encoder_backward are deterministic without atomics (same inputs, same
bits on every run; 2, 3 and 6 in np.add.at's order, 7, 8, 9 and 10 too for tokens of at most 32 rows); 1,
4 and 5 use atomics and are not. 8 is 7 with the token-major order computed on the host from the
batch's ids (Built.host_inputs: the model uploads it with each batch) and one launch instead of three. 9
is 8 (its records, pieces and bits) with the tokens of more than 8 rows summed by a warp per (piece,
slice of 32 16-byte columns), so that a frequent token's chain of loads is short (bf16: the rows staged
in shared memory by cp.async). 10 is 9's pieces and bits from a work list the host writes with the
records, on a persistent grid, the dwpe sums and the tokens seen once from one read of dout: the fastest
at B=16 (lab), slower than 9 at B=4. The fp32
default is the fastest (5, 21.6 us on the H100 at the trainer's shape); --encoder-backward-kernel 3
(36 us, 58 us on Zipf-distributed ids), 6, 7, 8 or 9 makes runs bit-reproducible. 6 replaces 2/3's id scans
(N^2 id reads in all) by a per-chunk sort and a link pass.

bf16 builds (entry points <kernel>_bf16): wte, wpe, out, dout, dwte, dwpe bf16; the ids int32. Sums
in fp32, each output element rounded once. encoder_forward 1 and 3, encoder_decode 1, and the
deterministic encoder_backward variants 2, 3, 6, 7, 8 and 9 (no bf16 atomics: their order would change the
rounding from run to run); a bf16 model's encoder_backward defaults to 9 (OpSpec.defaults: the fastest
deterministic one at B=4 and B=16 on uniform, Zipf-distributed and text ids).
The owner block keeps its dwte row in fp32 in shared memory (C floats, no scratch in device memory).
"""
from __future__ import annotations

import functools

import numpy as np

from llmc.ops import Built, OpSpec, Variant, refuse, check_block_size, as_view, esize
from llmc.runtime import ceil_div

MODULE = "encoder"  # cuda/encoder.cu


# ----------------------------------------------------------------------------------------------
# numpy references (float32 or float64)

def encoder_forward_ref(inp, wte, wpe):
    """inp (B, T) int -> out (B, T, C) = wte[inp] + wpe[:T]."""
    return wte[inp] + wpe[:inp.shape[-1]]


def encoder_backward_ref(dwte, dwpe, dout, inp):
    """Accumulates (+=) into dwte (Vp, C) and dwpe (maxT, C) in place and returns them.

    Unlike the other references this one works in place: dwte is the whole (Vp, C) table, and a
    fresh zero table per call would cost more than the op. np.add.at adds repeated tokens one after
    another in position order (a plain fancy-index += would keep only the last one)."""
    C = dout.shape[-1]
    T = inp.shape[-1]
    np.add.at(dwte, inp.reshape(-1), dout.reshape(-1, C))
    dwpe[:T] += dout.reshape(-1, T, C).sum(axis=0)
    return dwte, dwpe


_shaped = as_view  # a view of `a` with `shape`; raises instead of silently copying


# ----------------------------------------------------------------------------------------------
# cpu launchers

def encoder_forward_cpu(B, T, C, block_size=None):
    def launch(out, inp, wte, wpe):
        _shaped(out, (B, T, C))[...] = encoder_forward_ref(_shaped(inp, (B, T)), _shaped(wte, (-1, C)),
                                                           _shaped(wpe, (-1, C)))
    return launch


def encoder_backward_cpu(B, T, C, block_size=None):
    def launch(dwte, dwpe, dout, inp):
        encoder_backward_ref(_shaped(dwte, (-1, C)), _shaped(dwpe, (-1, C)), _shaped(dout, (B, T, C)),
                             _shaped(inp, (B, T)))
    return launch


# ----------------------------------------------------------------------------------------------
# shape checks and GPU variants

ARGS = "PPPPiii"  # 4 pointers (outputs first), B, T, C


_check_block = check_block_size  # whole warps, <= 1024 threads


def check_any(B, T, C, block_size=None):
    return _check_block(block_size)


def check_float4(B, T, C, block_size=None):
    if C % 4:
        return f"C={C} is not a multiple of 4 (float4 loads of each row)"
    return _check_block(block_size)


def _fits(op, number, kernel, block_size):
    """Refuse a block size the kernel can't launch with (its registers cap threads per block)."""
    limit = kernel.attributes()["max_threads"]
    if block_size > limit:
        refuse(op, number, f"block_size={block_size} > {limit} threads (register use of {kernel.label})")


def _sfx(dtype):
    return "" if dtype == "fp32" else f"_{dtype}"  # entry point suffix: encoder_forward_kernel3_bf16


def _elementwise(op, number, per_thread, default_bs, dtype="fp32"):
    """One thread per element (per_thread=1) or per float4 (per_thread=4) of the (B,T,C) tensor."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or default_bs
        k = rt.kernel(MODULE, f"{op}_kernel{number}{_sfx(dtype)}", ARGS, label=f"{op} {number} {dtype}")
        _fits(op, number, k, bs)
        grid = (ceil_div(B * T * C // per_thread, bs), 1, 1)
        b_, t_, c_ = np.int32(B), np.int32(T), np.int32(C)

        def launch(a0, a1, a2, a3):  # forward: out, inp, wte, wpe; backward: dwte, dwpe, dout, inp
            k(grid, (bs, 1, 1), a0.ptr, a1.ptr, a2.ptr, a3.ptr, b_, t_, c_)
        return launch
    return build


def _warp_per_row(number, default_bs, dtype="fp32"):
    """Forward variant 3: one warp per (b, t) row."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or default_bs
        k = rt.kernel(MODULE, f"encoder_forward_kernel{number}{_sfx(dtype)}", ARGS,
                      label=f"encoder_forward {number} {dtype}")
        _fits("encoder_forward", number, k, bs)
        grid = (ceil_div(B * T, bs // 32), 1, 1)
        b_, t_, c_ = np.int32(B), np.int32(T), np.int32(C)

        def launch(out, inp, wte, wpe):
            k(grid, (bs, 1, 1), out.ptr, inp.ptr, wte.ptr, wpe.ptr, b_, t_, c_)
        return launch
    return build


def encoder_backward5(rt, B, T, C, block_size=None):
    """One thread per (t, 4 channels): dwpe summed in registers, dwte by vector atomics."""
    bs = block_size or 256
    k = rt.kernel(MODULE, "encoder_backward_kernel5", ARGS, label="encoder_backward 5")
    _fits("encoder_backward", 5, k, bs)
    grid = (ceil_div(T * C // 4, bs), 1, 1)
    b_, t_, c_ = np.int32(B), np.int32(T), np.int32(C)

    def launch(dwte, dwpe, dout, inp):
        k(grid, (bs, 1, 1), dwte.ptr, dwpe.ptr, dout.ptr, inp.ptr, b_, t_, c_)
    return launch


def _owner(number, default_bs, dtype="fp32"):
    """Deterministic backward: one block per position, the first occurrence of a token owns its row.
    The bf16 kernels keep the owned row in fp32 in dynamic shared memory (C floats)."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or default_bs
        k = rt.kernel(MODULE, f"encoder_backward_kernel{number}{_sfx(dtype)}", ARGS,
                      label=f"encoder_backward {number} {dtype}")
        _fits("encoder_backward", number, k, bs)
        smem = 0 if dtype == "fp32" else 4 * C
        if smem + 8192 > rt.max_smem_optin:  # beside the kernel's 4 KB of static shared memory
            refuse("encoder_backward", number, f"C={C}: the fp32 row accumulator (4*C bytes) exceeds shared memory")
        if smem > 48 * 1024:
            k.set_max_dynamic_smem(smem)
        grid = (B * T, 1, 1)
        b_, t_, c_ = np.int32(B), np.int32(T), np.int32(C)

        def launch(dwte, dwpe, dout, inp):
            k(grid, (bs, 1, 1), dwte.ptr, dwpe.ptr, dout.ptr, inp.ptr, b_, t_, c_, smem=smem)
        return launch
    return build


SORT_CHUNK = 2048  # ENC_S in cuda/encoder.cu: positions per shared-memory sort of variant 6


def scratch_bytes6(B, T, C, **_):
    """Variant 6's scratch: per slot of the sorted chunks a key (8 bytes), runlen, owner, next (4 each)."""
    return 20 * ceil_div(B * T, SORT_CHUNK) * SORT_CHUNK


def _sorted_owner(dtype):
    """Variant 6: sort the ids per chunk, link each token's runs across chunks, then one block per
    slot sums its token's rows if it heads the chain (cuda/encoder.cu). Three launches, no id scans,
    no atomics: deterministic, the same sums (and bits) as 2 and 3."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or 128
        N = B * T
        G = ceil_div(N, SORT_CHUNK)
        label = f"encoder_backward 6 {dtype}"
        ks = rt.kernel(MODULE, "encoder_backward_sort_kernel6", "PPPPi", label=label + " (sort)")
        kl = rt.kernel(MODULE, "encoder_backward_link_kernel6", "PPPPi", label=label + " (link)")
        k = rt.kernel(MODULE, f"encoder_backward_kernel6{_sfx(dtype)}", "PPPPPPPiii", label=label)
        _fits("encoder_backward", 6, k, bs)
        smem = 4 * C  # the owned dwte row in fp32 (dynamic), beside the 8 KB run list (static)
        if smem + 8192 > rt.max_smem_optin:
            refuse("encoder_backward", 6, f"C={C}: the fp32 row accumulator (4*C bytes) exceeds shared memory")
        if smem > 48 * 1024 - 8192:
            k.set_max_dynamic_smem(smem)
        S = G * SORT_CHUNK
        keys = rt.empty((S,), np.uint64)
        runlen, owner, nxt = (rt.empty((S,), np.int32) for _ in range(3))
        n_, g_, b_, t_, c_ = (np.int32(x) for x in (N, G, B, T, C))

        def launch(dwte, dwpe, dout, inp):
            ks((G, 1, 1), (1024, 1, 1), keys.ptr, runlen.ptr, owner.ptr, inp.ptr, n_)
            kl((ceil_div(S, 256), 1, 1), (256, 1, 1), nxt.ptr, owner.ptr, keys.ptr, runlen.ptr, g_)
            k((S, 1, 1), (bs, 1, 1), dwte.ptr, dwpe.ptr, dout.ptr, keys.ptr, runlen.ptr, owner.ptr, nxt.ptr,
              b_, t_, c_, smem=smem)
        return Built(launch, scratch={"keys": keys, "runlen": runlen, "owner": owner, "next": nxt})
    return build


ENC7_PIECE = 32  # ENC7_K in cuda/encoder.cu: rows per piece of a token's sum in variant 7
ENC9_MIN = 8  # ENC9_MIN in cuda/encoder.cu: variant 9 slices the tokens of more rows (the lab may --define another)


def scratch_bytes7(B, T, C, **_):
    """Variant 7's scratch: per chunk slot token, position, run index, run length (16 bytes); per
    place of the order its record (position, start, count, token) and a ticket (20 bytes);
    2 * ceil(N / 32) fp32 partial rows."""
    N = B * T
    S = ceil_div(N, SORT_CHUNK) * SORT_CHUNK
    return 16 * S + 20 * N + 4 * 2 * ceil_div(N, ENC7_PIECE) * C


def _ranked(dtype):
    """Variant 7: sort the ids per chunk (beside the dwpe sums), rank every position in one token-major
    order by binary searches of the chunks, then a warp per piece of at most 32 rows of a token; the
    pieces of a frequent token combined in a fixed order by the last to finish (cuda/encoder.cu).
    Three launches, deterministic. Tokens of at most 32 rows get np.add.at's order (2, 3, 6's bits)."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or 128
        N = B * T
        G = ceil_div(N, SORT_CHUNK)
        GP = 1 << max(0, (min(G, 32) - 1).bit_length())  # G rounded up to a power of two, at most 32
        S = G * SORT_CHUNK
        vw = 4 if dtype == "fp32" else 8  # elements per 16-byte vector
        cols = C // vw if C % vw == 0 else C
        dwpe_blocks = ceil_div(T * ceil_div(cols, 32), 32)  # 1024-thread blocks, a warp per (t, 32 columns)
        label = f"encoder_backward 7 {dtype}"
        ks = rt.kernel(MODULE, f"encoder_backward_sort_kernel7{_sfx(dtype)}", "PPPPPPPiiii", label=label + " (sort, dwpe)")
        kr = rt.kernel(MODULE, "encoder_backward_rank_kernel7", "PPPPPiii", label=label + " (rank)")
        k = rt.kernel(MODULE, f"encoder_backward_kernel7{_sfx(dtype)}", "PPPPPii", label=label)
        _fits("encoder_backward", 7, k, bs)
        stok, spos, srun, slen = (rt.empty((S,), np.int32) for _ in range(4))
        place_rec = rt.empty((N, 4), np.int32)  # per place: position, start, count, token
        tickets = rt.zeros((N,), np.int32)  # each multi-piece token's finisher puts its ticket back to 0
        partial = rt.scratch((2 * ceil_div(N, ENC7_PIECE), C))
        n_, g_, gp_, b_, t_, c_ = (np.int32(x) for x in (N, G, GP, B, T, C))
        rank_grid = (ceil_div(S * GP, 256), 1, 1)
        sum_grid = (ceil_div(N, bs // 32), 1, 1)

        def launch(dwte, dwpe, dout, inp):
            ks((G + dwpe_blocks, 1, 1), (1024, 1, 1), stok.ptr, spos.ptr, srun.ptr, slen.ptr, dwpe.ptr, dout.ptr,
               inp.ptr, b_, t_, c_, g_)
            kr(rank_grid, (256, 1, 1), place_rec.ptr, stok.ptr, spos.ptr, srun.ptr, slen.ptr, n_, g_, gp_)
            k(sum_grid, (bs, 1, 1), dwte.ptr, dout.ptr, place_rec.ptr, partial.ptr, tickets.ptr, n_, c_)
        return Built(launch, scratch={"stok": stok, "spos": spos, "srun": srun, "slen": slen, "place_rec": place_rec,
                                      "tickets": tickets, "partial": partial})
    return build


def encoder_backward8_records(inp) -> np.ndarray:
    """Variant 8's place records from the batch's ids (B, T) on the host: per place of the token-major
    order (tokens ascending, each token's positions ascending) its position, the first place of its
    token, the token's count and the token, (B*T, 4) int32: what variant 7's rank kernel writes."""
    ids = np.asarray(inp).reshape(-1)
    N = ids.size
    # positions by (token, position); GPT-2's ids fit 16 bits, where numpy's stable sort is a radix sort
    # (16384 ids: 0.06 ms against 0.76 for the int32 merge sort, on the build machine's CPU)
    key = ids.astype(np.uint16) if N and ids.min() >= 0 and ids.max() < 65536 else ids
    order = np.argsort(key, kind="stable")
    toks = ids[order]
    starts = np.flatnonzero(np.concatenate(([True], toks[1:] != toks[:-1]))) if N else np.zeros(0, np.int64)
    counts = np.diff(np.append(starts, N))
    rec = np.empty((N, 4), np.int32)
    rec[:, 0] = order
    rec[:, 1] = np.repeat(starts, counts)
    rec[:, 2] = np.repeat(counts, counts)
    rec[:, 3] = toks
    return rec


def scratch_bytes8(B, T, C, **_):
    """Variant 8's scratch: a 16-byte record and a ticket per position, 2 * ceil(N / 32) fp32 partial rows."""
    N = B * T
    return 20 * N + 4 * 2 * ceil_div(N, ENC7_PIECE) * C


def _host_ranked(dtype):
    """Variant 8: 7's records from the host (host_inputs: encoder_backward8_records of the batch's ids,
    uploaded with it), then one launch: the dwpe sums and 7's sum in one grid. The same bits as 7."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or 64  # H200 lab (B=4 and 16, fp32 and bf16): 64 and 128 within 2%, 256 8-16% slower
        N = B * T
        vw = 4 if dtype == "fp32" else 8  # elements per 16-byte vector
        cols = C // vw if C % vw == 0 else C
        wpb = bs // 32
        dwpe_blocks = ceil_div(T * ceil_div(cols, 32), wpb)  # a warp per (t, 32 columns)
        grid = (dwpe_blocks + ceil_div(N, wpb), 1, 1)          # then a warp per place
        k = rt.kernel(MODULE, f"encoder_backward_kernel8{_sfx(dtype)}", "PPPPPPPiiii", label=f"encoder_backward 8 {dtype}")
        _fits("encoder_backward", 8, k, bs)
        place_rec = rt.empty((N, 4), np.int32)  # written by the host (put_host_inputs, the model's set_batch)
        tickets = rt.zeros((N,), np.int32)      # each multi-piece token's finisher puts its ticket back to 0
        partial = rt.scratch((2 * ceil_div(N, ENC7_PIECE), C))
        b_, t_, c_, d_ = (np.int32(x) for x in (B, T, C, dwpe_blocks))

        def launch(dwte, dwpe, dout, inp):
            k(grid, (bs, 1, 1), dwte.ptr, dwpe.ptr, dout.ptr, inp.ptr, place_rec.ptr, partial.ptr, tickets.ptr,
              b_, t_, c_, d_)
        return Built(launch, scratch={"place_rec": place_rec, "tickets": tickets, "partial": partial},
                     keep=frozenset({"place_rec", "tickets"}), host_inputs=(encoder_backward8_records, place_rec))
    return build


def _knob(rt, name, default) -> int:
    """A cuda/encoder.cu macro's value for rt's builds: the lab's --define (rt.extra_defines), else the
    kernel's default that the launcher keeps a copy of."""
    return int(getattr(rt, "extra_defines", {}).get(MODULE, {}).get(name, default))


def _slices(C, per_lane):
    """A row's slices of 32 lanes, per_lane columns a lane (1 a lane where C % per_lane != 0)."""
    return ceil_div(C // per_lane if C % per_lane == 0 else C, 32)


ENC9_LANE = 8  # ENC9_LANE in cuda/encoder.cu: columns a lane in variant 9's sliced warps (at most 16 bytes)


def _lane9(rt, dtype):
    """Columns a lane of variant 9's sliced warps: ENC9_LANE (the lab may --define another), at most 16 bytes."""
    lane = _knob(rt, "ENC9_LANE", ENC9_LANE)
    return min(lane, 4 if dtype == "fp32" else 8)


def scratch_bytes9(B, T, C, dtype="fp32", **_):
    """Variant 9's scratch: 8's records and partial rows, a ticket per (place, slice of 32 lanes' columns:
    16 bytes a lane)."""
    N = B * T
    return 16 * N + 4 * N * _slices(C, min(ENC9_LANE, 4 if dtype == "fp32" else 8)) + 4 * 2 * ceil_div(N, ENC7_PIECE) * C


ENC9_STAGE = 16  # ENC9_STAGE in cuda/encoder.cu: 16-byte shared-memory slots a lane of variant 9's sliced warps


def _stage9(rt) -> int:
    """Variant 9's staged slots a lane: ENC9_STAGE (the lab may --define another; 0: register loads)."""
    return _knob(rt, "ENC9_STAGE", ENC9_STAGE)


def heads_per_window9(rt) -> int:
    """How many pieces of variant 9's sliced tokens (more than ENC9_MIN rows; 8 unless the lab's
    --define encoder:ENC9_MIN=M says otherwise) can start among 32 places: at most one token's short
    last piece, then pieces of at least min(32, M + 1) rows (the kernel traps on a window with more)."""
    m = _knob(rt, "ENC9_MIN", ENC9_MIN)
    return min(ENC7_PIECE, 1 + ceil_div(ENC7_PIECE, min(ENC7_PIECE, m + 1)))


def _host_ranked_sliced(dtype):
    """Variant 9: 8's records (host_inputs), pieces and orders (the same bits); the pieces of tokens of
    more than ENC9_MIN (8) rows taken by their own warps, one per (piece, slice of 32 16-byte columns),
    a ticket per (token, slice); the other tokens by 8's warps. One launch with the dwpe sums
    (cuda/encoder.cu, "encoder_backward 9")."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or 64
        N = B * T
        S = _slices(C, _lane9(rt, dtype))              # the sliced warps' slices of a row
        S16 = _slices(C, 4 if dtype == "fp32" else 8)  # the dwpe warps': 32 16-byte vectors
        H = heads_per_window9(rt)
        wpb = bs // 32
        piece_blocks = ceil_div(ceil_div(N, ENC7_PIECE) * H * S, wpb)  # a warp per (window of 32 places, j < H, slice)
        dwpe_blocks = ceil_div(T * S16, wpb)                           # a warp per (t, 32 16-byte columns)
        grid = (piece_blocks + dwpe_blocks + ceil_div(N, wpb), 1, 1)  # then 8's warps, one per place
        k = rt.kernel(MODULE, f"encoder_backward_kernel9{_sfx(dtype)}", "PPPPPPPiiiiii", label=f"encoder_backward 9 {dtype}")
        _fits("encoder_backward", 9, k, bs)
        # the bf16 sliced warps' stages: ENC9_STAGE 16-byte slots a lane (16-byte lanes only; fp32: registers)
        smem = wpb * _stage9(rt) * 512 if dtype == "bf16" and _lane9(rt, dtype) == 8 else 0
        if smem > 48 * 1024:
            if smem > rt.max_smem_optin:
                refuse("encoder_backward", 9, f"block_size={bs}: {wpb} warps' load stages take {smem} bytes of "
                       f"shared memory, the device allows {rt.max_smem_optin}")
            k.set_max_dynamic_smem(smem)
        place_rec = rt.empty((N, 4), np.int32)  # written by the host (put_host_inputs, the model's set_batch)
        tickets = rt.zeros((N * S,), np.int32)  # each frequent token's finisher puts its slice's ticket back to 0
        partial = rt.scratch((2 * ceil_div(N, ENC7_PIECE), C))
        b_, t_, c_, h_, p_, d_ = (np.int32(x) for x in (B, T, C, H, piece_blocks, dwpe_blocks))

        def launch(dwte, dwpe, dout, inp):
            k(grid, (bs, 1, 1), dwte.ptr, dwpe.ptr, dout.ptr, inp.ptr, place_rec.ptr, partial.ptr, tickets.ptr,
              b_, t_, c_, h_, p_, d_, smem=smem)
        return Built(launch, scratch={"place_rec": place_rec, "tickets": tickets, "partial": partial},
                     keep=frozenset({"place_rec", "tickets"}), host_inputs=(encoder_backward8_records, place_rec))
    return build


# variant 10: the one-piece tokens of at most this many rows are summed a whole row a warp (ENC10_WHOLE in
# cuda/encoder.cu), in batches without a token of more than 32 rows (session 51, H200 lab, bf16: uniform
# ids B=16 0.0271 ms against 0.0281, B=4 0.0112 against 0.0124; with them, Zipf and text ids were 5-9%
# slower at B=16, so such batches keep 9's slices; with the two-level combine, ENC_TREE_G=4, they were faster
# (session 52: Zipf / text 0.0233 / 0.0219 ms against 0.0245 / 0.0236), a pairing of two knobs left to the lab:
# --define encoder:ENC_TREE_G=4 --define encoder:ENC10_WHOLE_MAX=4)
ENC10_WHOLE_MAX = 4


def encoder_backward10_records(inp, whole_max: int | None = None) -> np.ndarray:
    """Variant 10's work list from the batch's ids (B, T) on the host, one int32 array of 6 N + 4: 8's
    place records (N x 4); the number of piece heads, of them the pieces of tokens of more than 32 rows,
    of the others those of tokens of more than `whole_max` rows (the rest, the last heads, are summed a
    whole row a warp: ENC10_WHOLE in cuda/encoder.cu; None: ENC10_WHOLE_MAX if no token has more than 32
    rows, else none), and a zero; the N places where a piece of a token of at least 2 rows begins (the
    multi-piece tokens' first, the tokens of the most rows first, places ascending within; zeros after
    the last); per position its token if the token occurs only there, else -1."""
    rec = encoder_backward8_records(inp)
    N = len(rec)
    out = np.zeros(6 * N + 4, np.int32)
    out[:4 * N] = rec.reshape(-1)
    start, count = rec[:, 1], rec[:, 2]
    heads = np.flatnonzero((count >= 2) & ((np.arange(N) - start) % ENC7_PIECE == 0))
    heads = heads[np.argsort(-count[heads], kind="stable")]
    out[4 * N] = len(heads)
    out[4 * N + 1] = nmulti = int((count[heads] > ENC7_PIECE).sum())
    if whole_max is None:
        whole_max = ENC10_WHOLE_MAX if nmulti == 0 else 1
    out[4 * N + 2] = int((count[heads] > max(1, whole_max)).sum()) - nmulti
    out[4 * N + 4:4 * N + 4 + len(heads)] = heads
    single = out[5 * N + 4:]
    single[:] = -1
    once = count == 1
    single[rec[once, 0]] = rec[once, 3]
    return out


def scratch_bytes10(B, T, C, dtype="fp32", **_):
    """Variant 10's scratch: its work list (6 N + 4 int32), 9's tickets and partial rows."""
    return scratch_bytes9(B, T, C, dtype=dtype) - 16 * B * T + 4 * (6 * B * T + 4)


def encoder_backward10_unit_kinds(recs, B, T, C, dtype="bf16", dwpe_mid=None) -> np.ndarray:
    """Variant 10's work list as the kernel walks it, from the records it reads: one int a unit, in unit
    order: 0 a slice of a piece of a token of more than 32 rows (warps of their own), 1 a slice of another
    piece, 2 a one-piece token's whole row (ENC10_WHOLE: bf16, C <= 768), 3 a position unit. dwpe_mid:
    ENC10_DWPE_MID (None: the kernel's default), the position units before the whole rows."""
    N = B * T
    nh, nmulti, nsl = (int(x) for x in recs[4 * N:4 * N + 3])
    e9, e16 = (8, 8) if dtype == "bf16" else (min(ENC9_LANE, 4), 4)
    S, S16 = _slices(C, e9), _slices(C, e16)
    if not (dtype == "bf16" and C % 8 == 0 and ceil_div(C // 8, 32) <= 3):  # (no whole rows: every piece sliced)
        nsl = nh - nmulti
    pieces = np.repeat([0, 1], [nmulti * S, nsl * S])
    whole, pos = np.full(nh - nmulti - nsl, 2), np.full(T * S16, 3)
    mid = ENC10_DWPE_MID if dwpe_mid is None else dwpe_mid
    return np.concatenate([pieces, pos, whole] if mid else [pieces, whole, pos])


ENC10_DWPE_MID = 1  # ENC10_DWPE_MID in cuda/encoder.cu: variant 10's position units before its whole rows (session 53)
ENC10_ROWS = 8  # ENC10_ROWS in cuda/encoder.cu: rows a dwpe warp of variant 10 stages at a time (with their single tokens' rows)


def check_vec16_10(B, T, C, dtype="fp32", block_size=None):
    """Variant 10's dwpe warps have only 16-byte paths: C a multiple of 4 (fp32) or 8 (bf16)."""
    e = 4 if dtype == "fp32" else 8
    if C % e:
        return f"C={C} is not a multiple of {e} (16-byte loads of each row{', float4' if e == 4 else ''})"
    return _check_block(block_size)


def _worklist(dtype):
    """Variant 10: 9's pieces and bits from a work list computed on the host with 8's records (host_inputs:
    encoder_backward10_records), a persistent grid of as many warps as fit at once; the pieces of tokens
    of more than 32 rows on warps of their own, the rest (the other pieces, then a unit per (position,
    16-byte slice) that sums dwpe and adds the rows of the tokens seen once onto dwte from the same
    loads, then the one-piece tokens summed a whole row a warp: ENC10_DWPE_MID) round the other warps
    (cuda/encoder.cu, "encoder_backward 10")."""
    def build(rt, B, T, C, block_size=None):
        bs = block_size or 64
        N = B * T
        S = _slices(C, _lane9(rt, dtype))              # the pieces' slices (9's sliced warps)
        S16 = _slices(C, 4 if dtype == "fp32" else 8)  # the dwpe units'
        wpb = bs // 32
        k = rt.kernel(MODULE, f"encoder_backward_kernel10{_sfx(dtype)}", "PPPPPPPiii", label=f"encoder_backward 10 {dtype}")
        _fits("encoder_backward", 10, k, bs)
        stage9 = _stage9(rt) if dtype == "bf16" and _lane9(rt, dtype) == 8 else 0
        smem = wpb * max(stage9, 2 * _knob(rt, "ENC10_ROWS", ENC10_ROWS)) * 512
        if smem > rt.max_smem_optin:
            refuse("encoder_backward", 10, f"block_size={bs}: {wpb} warps' load stages take {smem} bytes of "
                   f"shared memory, the device allows {rt.max_smem_optin}")
        if smem > 48 * 1024:
            k.set_max_dynamic_smem(smem)
        smem_sm = rt.device.get_attribute(rt.drv.device_attribute.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)
        per_sm = max(1, min(k.resident_blocks(bs), smem_sm // (smem + 1024)))  # (1 KB a block the driver keeps)
        grid = (max(1, min(rt.sm_count * per_sm, ceil_div(N * S + T * S16, wpb))), 1, 1)
        recs = rt.empty((6 * N + 4,), np.int32)  # written by the host (put_host_inputs, the model's set_batch)
        whole_max = _knob(rt, "ENC10_WHOLE_MAX", -1)  # (the lab's knob, for every batch; the host's choice alone)
        records = (encoder_backward10_records if whole_max < 0
                   else functools.partial(encoder_backward10_records, whole_max=whole_max))
        tickets = rt.zeros((N * S,), np.int32)   # each frequent token's finisher puts its slice's ticket back to 0
        partial = rt.scratch((2 * ceil_div(N, ENC7_PIECE), C))
        b_, t_, c_ = (np.int32(x) for x in (B, T, C))

        def launch(dwte, dwpe, dout, inp):
            k(grid, (bs, 1, 1), dwte.ptr, dwpe.ptr, dout.ptr, inp.ptr, recs.ptr, partial.ptr, tickets.ptr,
              b_, t_, c_, smem=smem)
        return Built(launch, scratch={"records": recs, "tickets": tickets, "partial": partial},
                     keep=frozenset({"records", "tickets"}), host_inputs=(records, recs))
    return build


encoder_forward1 = _elementwise("encoder_forward", 1, 1, 256)
encoder_forward2 = _elementwise("encoder_forward", 2, 4, 256)
encoder_forward3 = _warp_per_row(3, 256)
encoder_backward1 = _elementwise("encoder_backward", 1, 1, 256)
encoder_backward2 = _owner(2, 256)
encoder_backward3 = _owner(3, 256)
encoder_backward4 = _elementwise("encoder_backward", 4, 4, 256)
encoder_forward1_bf16 = _elementwise("encoder_forward", 1, 1, 256, "bf16")
encoder_forward3_bf16 = _warp_per_row(3, 256, "bf16")
encoder_backward2_bf16 = _owner(2, 256, "bf16")
encoder_backward3_bf16 = _owner(3, 256, "bf16")
encoder_backward6 = _sorted_owner("fp32")
encoder_backward6_bf16 = _sorted_owner("bf16")
encoder_backward7 = _ranked("fp32")
encoder_backward7_bf16 = _ranked("bf16")
encoder_backward8 = _host_ranked("fp32")
encoder_backward8_bf16 = _host_ranked("bf16")
encoder_backward9 = _host_ranked_sliced("fp32")
encoder_backward9_bf16 = _host_ranked_sliced("bf16")
encoder_backward10 = _worklist("fp32")
encoder_backward10_bf16 = _worklist("bf16")


# ----------------------------------------------------------------------------------------------
# decode (sampling with a KV cache): B tokens at one position, both read from the device

def encoder_decode_ref(inp, wte, wpe):
    """inp (B+1,) int: B tokens, then their position. Returns (B, C) = wte[tokens] + wpe[pos]."""
    inp = np.asarray(inp).reshape(-1)
    return wte[inp[:-1]] + wpe[int(inp[-1])]


def encoder_decode_cpu(B, C, **_):
    def launch(out, inp, wte, wpe):
        _shaped(out, (B, C))[...] = encoder_decode_ref(_shaped(inp, (B + 1,)), _shaped(wte, (-1, C)),
                                                       _shaped(wpe, (-1, C)))
    return launch


def _decode(dtype):
    def encoder_decode1(rt, B, C, block_size=None):
        """launch(out (B,C), inp (B+1,) int32 tokens then position, wte (Vp,C), wpe (maxT,C))."""
        block_size = block_size or 256
        k = rt.kernel(MODULE, f"encoder_decode_kernel1{_sfx(dtype)}", "PPPPii", label=f"encoder_decode 1 {dtype}")
        grid, block = (ceil_div(B * C, block_size), 1, 1), (block_size, 1, 1)
        b_, c_ = np.int32(B), np.int32(C)

        def launch(out, inp, wte, wpe):
            k(grid, block, out.ptr, inp.ptr, wte.ptr, wpe.ptr, b_, c_)
        return launch
    return encoder_decode1


encoder_decode1 = _decode("fp32")
encoder_decode1_bf16 = _decode("bf16")


# ----------------------------------------------------------------------------------------------
# the table

OPS = [
    OpSpec(
        name="encoder_forward", flag="--encoder-kernel", default=3,
        # wte rows, wpe rows read, out written (elements of the build's dtype); the int32 ids
        cost=lambda B, T, C, dtype="fp32", **_: (0, esize(dtype) * 3 * B * T * C + 4 * B * T),
        cpu=encoder_forward_cpu,
        doc="out(B,T,C)=, inp(B,T) int32, wte(Vp,C), wpe(maxT,C); out[b,t] = wte[inp[b,t]] + wpe[t]",
        variants={
            1: Variant(1, "one thread per output element", {"fp32": encoder_forward1, "bf16": encoder_forward1_bf16},
                       check_any),
            2: Variant(2, "one thread per 4 channels, float4 (C%4==0)", encoder_forward2, check_float4),
            3: Variant(3, "one warp per (b,t) row, 16-byte loads (float4 / 8 bf16), 8 in flight per lane (C%4==0)",
                       {"fp32": encoder_forward3, "bf16": encoder_forward3_bf16}, check_float4),
        }),
    OpSpec(
        # fp32: the atomic 5 is fastest; bf16 has no atomics (their order would change the rounding),
        # so its default is a deterministic one: 9 (session 33), 8's bits with a frequent token's pieces
        # cut into column slices (H200 lab, bf16, uniform / Zipf / text ids: B=16 0.0306 / 0.0273 / 0.0277
        # ms against 8's 0.0357 / 0.0451 / 0.0449, B=4 0.0115 / 0.0134 / 0.0135 against 0.0144 / 0.0220 /
        # 0.0220; whole bf16 steps on text level: B=16 29.10 against 29.10 ms, B=4 8.46 against 8.47).
        # 8 against 7 (session 26): B=16 0.035 / 0.086 against 0.054 / 0.110; 7 on the H100 against 3:
        # B=16 0.061 / 0.116 against 0.225 / 0.250
        name="encoder_backward", flag="--encoder-backward-kernel", default=5, defaults={"bf16": 9},
        # dout read, dwte/dwpe rows read and written (counted as one (B,T,C) pass); the int32 ids
        cost=lambda B, T, C, dtype="fp32", **_: (0, esize(dtype) * 2 * B * T * C + 4 * B * T),
        cpu=encoder_backward_cpu,
        doc="dwte(Vp,C)+=, dwpe(maxT,C)+=, dout(B,T,C), inp(B,T) int32; scatter-add",
        variants={
            1: Variant(1, "one thread per element, atomicAdd scatter (non-deterministic)", encoder_backward1, check_any),
            2: Variant(2, "deterministic, no atomics: first occurrence of each token owns its row, block per position",
                       {"fp32": encoder_backward2, "bf16": encoder_backward2_bf16}, check_any),
            3: Variant(3, "2 with 16-byte accesses over the channels (float4 / 8 bf16; C%4==0), deterministic",
                       {"fp32": encoder_backward3, "bf16": encoder_backward3_bf16}, check_float4),
            4: Variant(4, "1 with float4 vector atomics (sm_90 RED.F32x4; C%4==0), non-deterministic",
                       encoder_backward4, check_float4),
            5: Variant(5, "thread per (t, 4 channels): dwpe summed in registers, dwte by float4 atomics (C%4==0), "
                          "non-deterministic", encoder_backward5, check_float4),
            6: Variant(6, "deterministic, no atomics, no id scans: ids sorted per 2048-position chunk, each token's "
                          "runs linked across chunks, the chain's head block sums them in order (any C)",
                       {"fp32": encoder_backward6, "bf16": encoder_backward6_bf16}, check_any,
                       scratch_bytes=scratch_bytes6),
            7: Variant(7, "deterministic, no atomics on data: ids sorted per chunk beside the dwpe sums, every "
                          "position ranked in one token-major order, a warp per piece of <= 32 rows, a frequent "
                          "token's pieces combined in a fixed order by the last to finish (any C)",
                       {"fp32": encoder_backward7, "bf16": encoder_backward7_bf16}, check_any,
                       scratch_bytes=scratch_bytes7),
            8: Variant(8, "deterministic, 7's bits: 7's records (the token-major order) computed on the host from "
                          "the batch's ids and uploaded with it, then one launch: the dwpe sums and 7's pieces in "
                          "one grid (any C)", {"fp32": encoder_backward8, "bf16": encoder_backward8_bf16}, check_any,
                       scratch_bytes=scratch_bytes8),
            9: Variant(9, "deterministic, 8's records and bits: the pieces of tokens of > 8 rows by a warp per "
                          "(piece, slice of 32 16-byte columns), their partials combined per slice; the other "
                          "tokens by 8's warps (any C)", {"fp32": encoder_backward9, "bf16": encoder_backward9_bf16},
                       check_any, scratch_bytes=scratch_bytes9),
            10: Variant(10, "deterministic, 9's pieces and bits: a work list from the host with 8's records on a "
                            "persistent grid (the multi-piece tokens' pieces on warps of their own), the dwpe sums "
                            "and the rows of tokens seen once from one read of dout (C % 4, bf16 C % 8)",
                        {"fp32": encoder_backward10, "bf16": encoder_backward10_bf16},
                        {"fp32": lambda **k: check_vec16_10(dtype="fp32", **k),
                         "bf16": lambda **k: check_vec16_10(dtype="bf16", **k)}, scratch_bytes=scratch_bytes10),
        }),
    OpSpec(
        name="encoder_decode", flag="--encoder-decode-kernel", default=1,
        cpu=encoder_decode_cpu,
        doc="out(B,C)=, inp(B+1,) int32 (B tokens, then their position), wte(Vp,C), wpe(maxT,C)",
        cost=lambda B, C, dtype="fp32", **_: (0, esize(dtype) * 3 * B * C + 4 * (B + 1)),
        variants={
            1: Variant(1, "one thread per output element; tokens and position read from the device",
                       {"fp32": encoder_decode1, "bf16": encoder_decode1_bf16},
                       lambda B, C, block_size=None: _check_block(block_size)),
        }),
]
