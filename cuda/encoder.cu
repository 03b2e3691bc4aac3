// Encoder: token + position embeddings. out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
// Backward scatters dout back: dwte[inp[b,t],:] += dout[b,t,:], dwpe[t,:] += sum_b dout[b,t,:].
// Only the rows of dwte whose tokens occur in inp are touched.
//
// encoder_forward (--encoder-kernel N):
//   1  one thread per output element (any C)
//   2  one thread per 4 channels, float4 loads/stores (C % 4 == 0)
//   3  one warp per (b,t) row, float4: the id read once per row, no division per element, and 8
//      16-byte loads in flight per lane before the first store (C % 4 == 0)
// encoder_backward (--encoder-backward-kernel N):
//   1  one thread per element, atomicAdd into dwte and dwpe (not deterministic: repeated tokens and
//      the B rows of each position race, and float addition does not commute bit-wise)
//   2  deterministic, no atomics: one block per position p. The block first checks whether p is the
//      first occurrence of its token among the B*T positions; only that "owner" block then walks the
//      later positions in order and adds each occurrence's dout row into the dwte row, so every dwte
//      row is written by exactly one block, in the same order as np.add.at. Blocks p < T also own
//      dwpe row t = p and sum its B rows in order (any C)
//   3  2 with float4 loads/stores over the channels (C % 4 == 0)
//   4  1 with float4: one 16-byte vector atomicAdd per 4 channels on sm_90, four scalar ones on
//      older GPUs (C % 4 == 0; not deterministic)
//   5  one thread per (t, 4 channels): dwpe summed over b in registers and written once (no atomics,
//      no B-way conflicts), dwte by float4 vector atomics as in 4 (C % 4 == 0; dwte not deterministic)
//   6  deterministic, no atomics, no id scans: the ids sorted per 2048-position chunk, each token's
//      runs linked across chunks, the chain's head block sums them as 3 does (any C; fp32 and bf16).
//      See "encoder_backward 6" below.
//   7  deterministic, no atomics on data: 6's chunk sort beside the dwpe sums, every position ranked
//      in one token-major order by binary searches of the chunks, a warp per piece of <= 32 rows of a
//      token; a frequent token's pieces summed into fp32 partials and combined in a fixed order by
//      the last to finish (any C; fp32 and bf16). See "encoder_backward 7" below.
//   8  7's records computed on the host with the batch, then one launch: the dwpe sums and 7's pieces
//      (7's bits). See "encoder_backward 8" below.
//   9  8's records, pieces and bits; the pieces of tokens of more than 8 rows by a warp per (piece,
//      slice of 32 16-byte columns), the rest by 8's warps. See "encoder_backward 9".
//  10  9's pieces and bits from a work list the host writes with the records, on a persistent grid; the
//      dwpe sums and the rows of the tokens seen once from one read of dout (C % 16 bytes == 0; the
//      fastest at B=16, 9 at B=4). See "encoder_backward 10".
// encoder_decode (sampling with a KV cache, not a training variant):
//   1  out[b,:] = wte[inp[b],:] + wpe[inp[B],:]: B new tokens at the position stored after them in
//      inp (B+1 ints), so that a captured CUDA graph reads the position from the device each step
//
// Memory traffic at B=4, T=1024, C=768 (N = 4096 positions, U distinct tokens, ~N for random ids):
//   forward  reads U wte rows + T wpe rows (+ N ids), writes N rows: ~28 MB, 9.5 us at 2.98 TB/s
//   backward reads dout (12.6 MB), reads and writes U dwte rows and T dwpe rows: ~37.7 MB, 12.7 us.
//            Variants 2 and 3 also read the 16 KB of ids up to N/2 times on average (L1/L2 hits).
// Measured on the lent H100 (dev/cuda lab: median of 30, L2 flushed before each, best block size):
//   forward   1: 21.5 us (1.29 TB/s)   2: 15.0 us (1.85 TB/s)   3: 15.0 us (1.85 TB/s)
//   backward  uniform ids / Zipf ids (dev/cuda/encoder_backward.py):
//             1: 24.4 / 22.8 us   2: 31.7 / 70.1 us   3: 26.8 (bs 64) / 50.0 (bs 512) us, at the
//             default bs 256 36.2 / 58.0 us   4: 24.0 / 22.8 us   5: 21.6 / 19.8 us (1.99 TB/s)
//   The owner variants pay for the id scans and, on text-like ids, for one block summing all rows
//   of a frequent token; they are here for bit-reproducible runs (--encoder-backward-kernel 3).
//
// bf16 builds (<name>_bf16; wte, wpe, out, dwte, dwpe, dout bf16; ids int32; sums in fp32, each
// output element rounded once):
//   encoder_forward 1 (scalar, any C) and 3 (warp per row, 16-byte loads of 8 bf16 when C % 8 == 0,
//   else scalar loads in the same layout); encoder_decode 1.
//   encoder_backward 2 and 3, the deterministic owner variants: bf16 has no atomics here (a bf16
//   atomic add rounds every addition, in an order that changes from run to run). The owner keeps
//   its dwte row in fp32 in shared memory (C floats) while it adds the rows of its token, and
//   rounds it once at the end; dwpe rows are summed over b in fp32 and rounded once. Variant 3's
//   bf16 kernel moves 16 bytes per access when C % 8 == 0, else scalar. The atomic variants (1, 4,
//   5, the fp32 default) have no bf16 build, so a bf16 model falls back to 3.
//   At B=4, T=1024, C=768 the bytes halve: forward ~14 MB (4.7 us), backward ~19 MB (6.3 us).
#include "common.cuh"
#include "elem.cuh"
#ifndef ENC_FLOOR_BENCH
#define ENC_FLOOR_BENCH 0
#endif
#include "mma.cuh"  // cp_async16_full, cp_async_commit/wait, lds128, smem_u32 (variant 9's staged loads)

// ----------------------------------------------------------------------------------------------
// encoder_forward: out (B,T,C) =, inp (B,T) int32, wte (Vp,C), wpe (maxT,C)

extern "C" __global__ void encoder_forward_kernel1(float* out, const int* inp, const float* wte,
        const float* wpe, int B, int T, int C) {
    LLMC_PDL_WAIT();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * T * C) return;
    int bt = idx / C, c = idx % C, t = bt % T;
    out[idx] = wte[(size_t)inp[bt] * C + c] + wpe[(size_t)t * C + c];
}

extern "C" __global__ void encoder_forward_kernel2(float* out, const int* inp, const float* wte,
        const float* wpe, int B, int T, int C) {
    LLMC_PDL_WAIT();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;  // one float4 of the output
    int C4 = C / 4;
    if (idx >= B * T * C4) return;
    int bt = idx / C4, c = (idx % C4) * 4, t = bt % T;
    float4 a = load4(wte + (size_t)inp[bt] * C + c), b = load4(wpe + (size_t)t * C + c);
    store4(out + (size_t)bt * C + c, make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w));
}

// out, wte, wpe never overlap (an activation and two parameter tensors): __restrict__ lets the
// compiler issue the loads of a chunk before the stores of the previous one
extern "C" __global__ void encoder_forward_kernel3(float* __restrict__ out, const int* __restrict__ inp,
        const float* __restrict__ wte, const float* __restrict__ wpe, int B, int T, int C) {
    LLMC_PDL_WAIT();
    const int lane = threadIdx.x % WARP_SIZE;
    const int bt = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (bt >= B * T) return;
    const float* w = wte + (size_t)inp[bt] * C;
    const float* p = wpe + (size_t)(bt % T) * C;
    float* o = out + (size_t)bt * C;
    const int C4 = C / 4;
    for (int base = 0; base < C4; base += 4 * WARP_SIZE) {
        float4 a[4], b[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int c4 = base + j * WARP_SIZE + lane;
            if (c4 < C4) { a[j] = load4(w + 4 * c4); b[j] = load4(p + 4 * c4); }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int c4 = base + j * WARP_SIZE + lane;
            if (c4 < C4) store4(o + 4 * c4, make_float4(a[j].x + b[j].x, a[j].y + b[j].y, a[j].z + b[j].z, a[j].w + b[j].w));
        }
    }
}

// ----------------------------------------------------------------------------------------------
// encoder_backward: dwte (Vp,C) +=, dwpe (maxT,C) +=, dout (B,T,C), inp (B,T) int32

extern "C" __global__ void encoder_backward_kernel1(float* dwte, float* dwpe, const float* dout,
        const int* inp, int B, int T, int C) {
    LLMC_PDL_WAIT();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * T * C) return;
    int bt = idx / C, c = idx % C, t = bt % T;
    float d = dout[idx];
    atomicAdd(&dwte[(size_t)inp[bt] * C + c], d);
    atomicAdd(&dwpe[(size_t)t * C + c], d);
}

extern "C" __global__ void encoder_backward_kernel4(float* dwte, float* dwpe, const float* dout,
        const int* inp, int B, int T, int C) {
    LLMC_PDL_WAIT();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    int C4 = C / 4;
    if (idx >= B * T * C4) return;
    int bt = idx / C4, c = (idx % C4) * 4, t = bt % T;
    float4 d = load4(dout + (size_t)bt * C + c);
    float* w = dwte + (size_t)inp[bt] * C + c;
    float* p = dwpe + (size_t)t * C + c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd(reinterpret_cast<float4*>(w), d);
    atomicAdd(reinterpret_cast<float4*>(p), d);
#else
    atomicAdd(w, d.x); atomicAdd(w + 1, d.y); atomicAdd(w + 2, d.z); atomicAdd(w + 3, d.w);
    atomicAdd(p, d.x); atomicAdd(p + 1, d.y); atomicAdd(p + 2, d.z); atomicAdd(p + 3, d.w);
#endif
}

// dst[c] += src_k[c] for k = 0..n-1 in that order, src_k = dout row list[k]; each thread owns
// channels tid, tid+bs, ... and keeps its running sum in a register, so the n row loads are
// independent of each other (unrolled: several in flight) and only the adds are chained. The
// order of the adds is np.add.at's: ((dst + d_0) + d_1) + ...
// For a frequent token this loop is the kernel's critical path (n row loads by one block). I tried
// writing 8 loads out ahead of their adds (8 rows surely in flight): 72 registers instead of 40,
// fewer resident blocks, and slower on both id sets (uniform 30 vs 27 us at bs=64, 49 vs 36 us at
// bs=256; Zipf no better), so the compiler's schedule stays.
template <bool VEC>
__device__ __forceinline__ void rows_add(float* dst, const float* dout, const int* list, int n, int C) {
    if (VEC) {
        for (int c = 4 * threadIdx.x; c < C; c += 4 * blockDim.x) {
            float4 acc = load4(dst + c);
#pragma unroll 8
            for (int k = 0; k < n; k++) {
                float4 d = load4(dout + (size_t)list[k] * C + c);
                acc.x += d.x; acc.y += d.y; acc.z += d.z; acc.w += d.w;
            }
            store4(dst + c, acc);
        }
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float acc = dst[c];
#pragma unroll 8
            for (int k = 0; k < n; k++) acc += dout[(size_t)list[k] * C + c];
            dst[c] = acc;
        }
    }
}

// Variants 2 and 3. One block per position p (grid = B*T), blockDim.x a multiple of 32.
// Cost beyond the bytes: every block scans the ids before it (~N/2 ids on average, 4 loads in
// flight per thread), owners also scan the ids after them; at N = 4096 that is ~16 KB per block
// from L1/L2, small next to the 3 KB dout row it moves but not free. On text, the most frequent
// token owns a few percent of all positions, and its one block adds them all: that block's
// serial chain of row loads is the tail of the kernel (the lab times Zipf-distributed ids too).

// The owner test and walk, shared by the fp32 and bf16 owner kernels. Returns false (in every
// thread) when a position before p holds tok: that position's block owns the row. Otherwise calls
// add(list, n) in every thread for each sub-chunk of positions q >= p holding tok, in ascending
// order (list: n positions in shared memory), and returns true. p itself is the first match, so
// an owner calls add at least once.
template <class Add>
__device__ __forceinline__ bool encoder_owner_walk(const int* inp, int N, int p, int tok, Add add) {
    __shared__ int s_count[32];    // matches per warp in the current sub-chunk
    __shared__ int s_list[1024];   // the sub-chunk's matching positions, ascending
    const int tid = threadIdx.x, bs = blockDim.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, nwarps = bs / WARP_SIZE;

    // Is there an earlier occurrence of tok? Then that position's block owns the row: leave.
    int found = 0;
    for (int q0 = 0; q0 < p; q0 += 4 * bs) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int q = q0 + j * bs + tid;
            if (q < p && inp[q] == tok) found = 1;
        }
    }
    if (__syncthreads_or(found)) return false;

    // The owner: positions q >= p in ascending order, 4*bs at a time; the (rare) sub-chunks with a
    // match are compacted in order with warp ballots and a prefix over the warps' counts.
    for (int q0 = p; q0 < N; q0 += 4 * bs) {
        int m[4], any = 0;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int q = q0 + j * bs + tid;
            m[j] = q < N && inp[q] == tok;
            any |= m[j];
        }
        if (!__syncthreads_or(any)) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            unsigned ballot = __ballot_sync(0xffffffffu, m[j]);
            if (lane == 0) s_count[warp] = __popc(ballot);
            __syncthreads();
            int offset = 0, total = 0;
            for (int w = 0; w < nwarps; w++) {
                int cnt = s_count[w];
                offset += (w < warp) ? cnt : 0;
                total += cnt;
            }
            if (m[j]) s_list[offset + __popc(ballot & ((1u << lane) - 1u))] = q0 + j * bs + tid;
            __syncthreads();
            if (total > 0) add(s_list, total);
            __syncthreads();  // s_count and s_list are reused
        }
    }
    return true;
}

template <bool VEC>
__device__ __forceinline__ void encoder_backward_owner(float* dwte, float* dwpe, const float* dout,
        const int* inp, int B, int T, int C) {
    const int p = blockIdx.x, tid = threadIdx.x, bs = blockDim.x;
    const int tok = inp[p];

    // dwpe row t = p: sum the B rows in order b = 0..B-1 (no other block touches this row)
    if (p < T) {
        if (VEC) {
            for (int c = 4 * tid; c < C; c += 4 * bs) {
                float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                for (int b = 0; b < B; b++) {
                    float4 d = load4(dout + ((size_t)b * T + p) * C + c);
                    s.x += d.x; s.y += d.y; s.z += d.z; s.w += d.w;
                }
                float4 w = load4(dwpe + (size_t)p * C + c);
                store4(dwpe + (size_t)p * C + c, make_float4(w.x + s.x, w.y + s.y, w.z + s.z, w.w + s.w));
            }
        } else {
            for (int c = tid; c < C; c += bs) {
                float s = 0.0f;
                for (int b = 0; b < B; b++) s += dout[((size_t)b * T + p) * C + c];
                dwpe[(size_t)p * C + c] += s;
            }
        }
    }

    // the dwte row of tok, if this block owns it: each sub-chunk's rows added straight into it
    float* wrow = dwte + (size_t)tok * C;
    encoder_owner_walk(inp, B * T, p, tok, [&](const int* list, int n) { rows_add<VEC>(wrow, dout, list, n, C); });
}

extern "C" __global__ void encoder_backward_kernel2(float* dwte, float* dwpe, const float* dout,
        const int* inp, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward_owner<false>(dwte, dwpe, dout, inp, B, T, C);
}

extern "C" __global__ void encoder_backward_kernel3(float* dwte, float* dwpe, const float* dout,
        const int* inp, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward_owner<true>(dwte, dwpe, dout, inp, B, T, C);
}

// One thread per (t, 4 channels); grid covers T * C/4 threads.
extern "C" __global__ void encoder_backward_kernel5(float* dwte, float* dwpe, const float* dout,
        const int* inp, int B, int T, int C) {
    LLMC_PDL_WAIT();
    const int C4 = C / 4;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T * C4) return;
    const int t = idx / C4, c = (idx % C4) * 4;
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int b = 0; b < B; b++) {
        const size_t bt = (size_t)b * T + t;
        float4 d = load4(dout + bt * C + c);
        s.x += d.x; s.y += d.y; s.z += d.z; s.w += d.w;
        float* w = dwte + (size_t)inp[bt] * C + c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        atomicAdd(reinterpret_cast<float4*>(w), d);
#else
        atomicAdd(w, d.x); atomicAdd(w + 1, d.y); atomicAdd(w + 2, d.z); atomicAdd(w + 3, d.w);
#endif
    }
    float* p = dwpe + (size_t)t * C + c;
    float4 o = load4(p);
    store4(p, make_float4(o.x + s.x, o.y + s.y, o.z + s.z, o.w + s.w));
}

// ----------------------------------------------------------------------------------------------
// decode: B new tokens at one position; inp holds the B tokens and then the position (B+1 ints).
// One thread per output element: B*C floats, launch-bound.
extern "C" __global__ void encoder_decode_kernel1(float* out, const int* inp, const float* wte,
        const float* wpe, int B, int C) {
    LLMC_PDL_WAIT();
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * C) return;
    int b = idx / C, c = idx % C, pos = inp[B];
    out[idx] = wte[(size_t)inp[b] * C + c] + wpe[(size_t)pos * C + c];
}

// ----------------------------------------------------------------------------------------------
// bf16 builds, templated on the element type T (only the bf16 instantiations have entry points).
// TT is the sequence length (T names the element type here).

template <typename T>
__device__ __forceinline__ void encoder_forward1(T* out, const int* inp, const T* wte, const T* wpe,
        int B, int TT, int C) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * TT * C) return;
    int bt = idx / C, c = idx % C, t = bt % TT;
    out[idx] = from_f32<T>(to_f32(wte[(size_t)inp[bt] * C + c]) + to_f32(wpe[(size_t)t * C + c]));
}

// Variant 3: one warp per (b,t) row, lanes over the row's 16-byte vectors (V elements), 4 vectors
// of each of wte and wpe in flight per lane before the first store, held packed (4 registers per
// vector: 32, where the unpacked floats would take 64 and halve the resident warps). When C % V != 0
// the rows are not 16-byte aligned: one lane per element instead, scalar (the fallback).
template <typename T>
__device__ __forceinline__ void encoder_forward3(T* __restrict__ out, const int* __restrict__ inp,
        const T* __restrict__ wte, const T* __restrict__ wpe, int B, int TT, int C) {
    constexpr int V = Vec16<T>::N;
    typedef typename Vec16<T>::raw raw;
    const int lane = threadIdx.x % WARP_SIZE;
    const int bt = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (bt >= B * TT) return;
    const T* w = wte + (size_t)inp[bt] * C;
    const T* p = wpe + (size_t)(bt % TT) * C;
    T* o = out + (size_t)bt * C;
    if (C % V) {
        for (int c = lane; c < C; c += WARP_SIZE) o[c] = from_f32<T>(to_f32(w[c]) + to_f32(p[c]));
        return;
    }
    const int CV = C / V;  // 16-byte vectors per row
    for (int base = 0; base < CV; base += 4 * WARP_SIZE) {
        raw a[4], b[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int cv = base + j * WARP_SIZE + lane;
            if (cv < CV) { a[j] = Vec16<T>::ld(w + cv * V); b[j] = Vec16<T>::ld(p + cv * V); }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int cv = base + j * WARP_SIZE + lane;
            if (cv < CV) {
                float x[V], y[V];
                Vec16<T>::unpack(x, a[j]);
                Vec16<T>::unpack(y, b[j]);
#pragma unroll
                for (int k = 0; k < V; k++) x[k] += y[k];
                Vec16<T>::st(o + cv * V, Vec16<T>::pack(x));
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void encoder_decode1(T* out, const int* inp, const T* wte, const T* wpe, int B, int C) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * C) return;
    int b = idx / C, c = idx % C, pos = inp[B];
    out[idx] = from_f32<T>(to_f32(wte[(size_t)inp[b] * C + c]) + to_f32(wpe[(size_t)pos * C + c]));
}

// The owner variants for any element type, with an fp32 accumulator for the owned dwte row in
// dynamic shared memory (C floats), so each dwte element is rounded once however many rows of its
// token there are. Channel groups: W = V channels (vec: 16-byte accesses, needs C % V == 0) or 1;
// thread tid owns groups tid, tid + bs, ... in every phase (dwpe, the adds, the final store), so
// no thread reads another's accumulator and no barrier is needed around them. A group's V
// accumulators are read and written as float4s (a thread's 32 bytes: 2-way bank conflicts, where
// V scalar accesses at a 32-byte stride would be 8-way).

// dwpe row t = p: the B rows summed in order b = 0..B-1 in fp32, added to the row, rounded once
template <typename T>
__device__ __forceinline__ void encoder_dwpe_col_t(T* dwpe, const T* dout, int B, int TT, int C, int p, int g,
                                                   bool vec) {
    // dwpe[p] columns g W .. g W + W - 1 (W = V, or 1 without 16-byte vectors) += the sum over b of
    // dout[b, p] there, the B rows added in order from 0, then onto dwpe's value (np.add.at's order)
    constexpr int V = Vec16<T>::N;
    const int W = vec ? V : 1;
    float s[V], d[V];
#pragma unroll
    for (int k = 0; k < V; k++) s[k] = 0.0f;
    const T* col = dout + (size_t)p * C + g * W;
#pragma unroll 8
    for (int b = 0; b < B; b++) {
        load_vec<T>(d, col + (size_t)b * TT * C, vec, W);
#pragma unroll
        for (int k = 0; k < V; k++) s[k] += d[k];
    }
    T* prow = dwpe + (size_t)p * C + g * W;
    load_vec<T>(d, prow, vec, W);
#pragma unroll
    for (int k = 0; k < V; k++) d[k] += s[k];
    store_vec<T>(prow, d, vec, W);
}

template <typename T>
__device__ __forceinline__ void encoder_dwpe_row_t(T* dwpe, const T* dout, int B, int TT, int C, int p, bool vec) {
    const int G = C / (vec ? Vec16<T>::N : 1);
    for (int g = threadIdx.x; g < G; g += blockDim.x) encoder_dwpe_col_t<T>(dwpe, dout, B, TT, C, p, g, vec);
}

// dwte row of tok: ((row + d_0) + d_1) + ... in fp32, the order np.add.at adds them in. walk(add)
// is the ownership test and walk (encoder_owner_walk or encoder_sorted_walk): false (in every
// thread) when this block does not own tok's row, else add(list, n) for each sub-list of the
// positions holding tok, ascending, and true.
template <typename T, class Walk>
__device__ __forceinline__ void encoder_dwte_owner_t(T* dwte, const T* dout, int C, int tok, bool vec, Walk walk) {
    extern __shared__ float4 s_acc4[];  // (C/4 float4 = C floats): the owned dwte row in fp32
    float* s_acc = reinterpret_cast<float*>(s_acc4);
    constexpr int V = Vec16<T>::N;
    static_assert(V % 4 == 0, "groups of whole float4s");
    const int tid = threadIdx.x, bs = blockDim.x;
    const int W = vec ? V : 1, G = C / W;
    auto acc_load = [&](float (&a)[V], int g) {
        if (vec) {
#pragma unroll
            for (int k = 0; k < V; k += 4) {
                float4 t = load4(s_acc + g * V + k);
                a[k] = t.x; a[k + 1] = t.y; a[k + 2] = t.z; a[k + 3] = t.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < V; k++) a[k] = k == 0 ? s_acc[g] : 0.0f;
        }
    };
    auto acc_store = [&](const float (&a)[V], int g) {
        if (vec) {
#pragma unroll
            for (int k = 0; k < V; k += 4) store4(s_acc + g * V + k, make_float4(a[k], a[k + 1], a[k + 2], a[k + 3]));
        } else {
            s_acc[g] = a[0];
        }
    };
    T* wrow = dwte + (size_t)tok * C;
    bool started = false;  // the same in every thread: add runs in all of them
    bool owner = walk([&](const int* list, int n) {
        for (int g = tid; g < G; g += bs) {
            float a[V], d[V];
            if (started) acc_load(a, g);
            else load_vec<T>(a, wrow + g * W, vec, W);  // the first sub-list starts from dwte's row
#pragma unroll 4
            for (int j = 0; j < n; j++) {
                load_vec<T>(d, dout + (size_t)list[j] * C + g * W, vec, W);
#pragma unroll
                for (int k = 0; k < V; k++) a[k] += d[k];
            }
            acc_store(a, g);
        }
        started = true;
    });
    if (owner) {
        for (int g = tid; g < G; g += bs) {
            float a[V];
            acc_load(a, g);
            store_vec<T>(wrow + g * W, a, vec, W);
        }
    }
}

template <typename T>
__device__ __forceinline__ void encoder_backward_owner_t(T* dwte, T* dwpe, const T* dout,
        const int* inp, int B, int TT, int C, bool vec) {
    const int p = blockIdx.x, tok = inp[p];
    if (p < TT) encoder_dwpe_row_t<T>(dwpe, dout, B, TT, C, p, vec);
    encoder_dwte_owner_t<T>(dwte, dout, C, tok, vec, [&](auto add) { return encoder_owner_walk(inp, B * TT, p, tok, add); });
}

// ----------------------------------------------------------------------------------------------
// encoder_backward 6: the owner scheme without the id scans. Variants 2 and 3 find out whether a
// position owns its token, and which later positions hold it, by scanning the ids: ~N ids per block,
// N^2 in all (at B=16, T=1024: 16384 blocks x ~8K ids). Here three launches replace the scans:
//   a. sort:  the ids in chunks of ENC_S = 2048 positions, one block (1024 threads) per chunk, keys
//             (token << 32 | position in chunk) bitonic-sorted in shared memory (16 KB): within a
//             chunk the positions of a token form a run, in ascending order. Each run's first slot
//             gets its length (runlen) and owner = 1; keys (G, ENC_S) to scratch (G = ceil(N/ENC_S)).
//   b. link:  one thread per run head: a binary search of each later chunk (11 steps, keys in L1/L2)
//             finds the token's next run; next[head] = its slot (or -1), and that run's owner = 0.
//             So each token's runs form a chain from its first chunk, and only the chain's head owns.
//   c. sum:   one block per slot (and per position t < T for dwpe): an owning slot walks its chain,
//             chunk by chunk, each run's positions ascending: every occurrence of the token in
//             position order, np.add.at's order, as in 2 and 3 (same fp32 sums, same bits).
// Every step has a fixed result whatever order the GPU runs blocks in (the sort is a sort; each
// owner/next entry is written by one thread): deterministic, and no atomics at all.
// Bytes: dout read once (U owners' rows plus the dwpe pass, which re-reads it through L2: 2 x N rows
// at most), U dwte rows read and written, T dwpe rows read and written; the scratch is 20 bytes a
// position (keys 8, runlen, owner, next 4 each).
#define ENC_S 2048

// Bitonic sort of the ENC_S keys in shared memory, ascending (the whole block; ends synchronized).
__device__ __forceinline__ void encoder_sort_chunk(unsigned long long* s) {
    for (int k = 2; k <= ENC_S; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < ENC_S; i += blockDim.x) {
                const int l = i ^ j;
                if (l > i) {
                    const unsigned long long a = s[i], b = s[l];
                    if ((a > b) == ((i & k) == 0)) { s[i] = b; s[l] = a; }
                }
            }
            __syncthreads();
        }
    }
}

extern "C" __global__ void encoder_backward_sort_kernel6(unsigned long long* keys, int* runlen, int* owner,
        const int* inp, int N) {
    LLMC_PDL_WAIT();
    __shared__ unsigned long long s[ENC_S];
    const int base = blockIdx.x * ENC_S;
    for (int i = threadIdx.x; i < ENC_S; i += blockDim.x) {
        const int p = base + i;  // past N: the largest key, sorted to the end, never a run
        s[i] = p < N ? ((unsigned long long)(unsigned)inp[p] << 32) | (unsigned)i : ~0ull;
    }
    __syncthreads();
    encoder_sort_chunk(s);
    for (int i = threadIdx.x; i < ENC_S; i += blockDim.x) {
        const unsigned long long key = s[i];
        const unsigned tok = (unsigned)(key >> 32);
        const bool head = key != ~0ull && (i == 0 || (unsigned)(s[i - 1] >> 32) != tok);
        int len = 0;
        if (head) {  // (a run of a frequent token is walked by one thread: a few hundred smem reads)
            int e = i + 1;
            while (e < ENC_S && (unsigned)(s[e] >> 32) == tok) e++;
            len = e - i;
        }
        keys[base + i] = key;
        runlen[base + i] = len;
        owner[base + i] = head;
    }
}

extern "C" __global__ void encoder_backward_link_kernel6(int* next, int* owner, const unsigned long long* keys,
        const int* runlen, int G) {
    LLMC_PDL_WAIT();
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= G * ENC_S) return;
    int nx = -1;
    if (runlen[s] > 0) {
        const unsigned long long lo = keys[s] & 0xFFFFFFFF00000000ull;  // the token's smallest key
        for (int j = s / ENC_S + 1; j < G && nx < 0; j++) {
            const unsigned long long* kj = keys + (size_t)j * ENC_S;
            int a = 0, b = ENC_S;  // lower bound of lo in chunk j
            while (a < b) {
                const int m = (a + b) >> 1;
                if (kj[m] < lo) a = m + 1; else b = m;
            }
            if (a < ENC_S && (kj[a] >> 32) == (lo >> 32)) {
                nx = j * ENC_S + a;
                owner[nx] = 0;  // a later run of this token: the chain's head owns it
            }
        }
    }
    next[s] = nx;
}

// The walk of variant 6 (contract as encoder_owner_walk): slot s owns its token's row if it heads
// the token's chain; the runs' positions go through shared memory, one run per add.
template <class Add>
__device__ __forceinline__ bool encoder_sorted_walk(const unsigned long long* keys, const int* runlen,
        const int* owner, const int* next, int s, Add add) {
    __shared__ int s_list[ENC_S];  // one run's positions, ascending
    if (!owner[s]) return false;   // (the same in every thread)
    for (int r = s; r >= 0; r = next[r]) {
        const int n = runlen[r], base = (r / ENC_S) * ENC_S;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s_list[i] = base + (int)(unsigned)keys[r + i];
        __syncthreads();
        add(s_list, n);
        __syncthreads();  // s_list is reused
    }
    return true;
}

template <typename T>
__device__ __forceinline__ void encoder_backward6_t(T* dwte, T* dwpe, const T* dout,
        const unsigned long long* keys, const int* runlen, const int* owner, const int* next,
        int B, int TT, int C) {
    const int s = blockIdx.x;
    const bool vec = C % Vec16<T>::N == 0;
    if (s < TT) encoder_dwpe_row_t<T>(dwpe, dout, B, TT, C, s, vec);
    if (s >= B * TT) return;  // (a padding slot of the last chunk: never an owner; whole block)
    const int tok = (int)(keys[s] >> 32);
    encoder_dwte_owner_t<T>(dwte, dout, C, tok, vec,
                            [&](auto add) { return encoder_sorted_walk(keys, runlen, owner, next, s, add); });
}

extern "C" __global__ void encoder_backward_kernel6(float* dwte, float* dwpe, const float* dout,
        const unsigned long long* keys, const int* runlen, const int* owner, const int* next, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward6_t<float>(dwte, dwpe, dout, keys, runlen, owner, next, B, T, C);
}
extern "C" __global__ void encoder_backward_kernel6_bf16(bf16* dwte, bf16* dwpe, const bf16* dout,
        const unsigned long long* keys, const int* runlen, const int* owner, const int* next, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward6_t<bf16>(dwte, dwpe, dout, keys, runlen, owner, next, B, T, C);
}

// ----------------------------------------------------------------------------------------------
// encoder_backward 7: deterministic like 6, without 6's chains. Every position's place in one
// token-major order (tokens ascending, each token's positions ascending) is computed in parallel,
// and a frequent token's rows are summed by many warps in pieces of ENC7_K rows. Three launches:
//   a. sort + dwpe: blocks < G sort their chunk of ENC_S ids as 6 does, then every slot writes its
//      token, its position, its index in its run and the run's length (two binary searches of the
//      sorted chunk in shared memory). The other blocks sum dwpe meanwhile: a warp per (position t,
//      32 16-byte columns) adds the B rows in order, then dwpe + sum (6's order and bits).
//   b. rank: GP lanes per sorted slot (GP = G rounded up to a power of two, at most 32). Lane j
//      binary-searches chunk j (j + GP, ...) for the slot's token: lo_j ids in it are smaller, cnt_j
//      equal. The token's rows start at place sum_j lo_j of the order and number sum_j cnt_j; this
//      slot's place is start + sum_{j < g} cnt_j + its index in its run. Writes order[place] =
//      position and seg[place] = (start, count).
//   c. sum: a warp per place t; the places start + q * ENC7_K begin a piece, the other warps return.
//      A token of at most ENC7_K rows is one piece: dwte's row + its rows in position order, in
//      fp32, rounded once: np.add.at's order, the bits of 2, 3 and 6. A longer one: each piece sums
//      its rows from zero into an fp32 partial row (scratch), then takes a ticket; the piece that
//      draws the last one adds dwte's row and the partials in piece order, rounds once, and puts
//      the ticket back to 0 for the next call. Which warp finishes last varies, the order it adds
//      in does not: deterministic (not np.add.at's order; within fp32 rounding of it).
// Uniform ids: every place is a piece of one row, so c is one pass over dout and the used dwte rows;
// on text the most frequent token (~3-9% of positions) is split over up to N * 9% / ENC7_K warps
// instead of one block. Scratch: 16 bytes per chunk slot (a), 16 per place (b), a ticket per place,
// and 2 * ceil(N / ENC7_K) fp32 partial rows (two pieces can start in one window of ENC7_K places
// only if one of them is a token's last piece: index 2 * (place / ENC7_K) + last is unique).
// Measured (H100, bf16, lab median, L2 flushed; uniform / Zipf ids): B=16 0.061 / 0.116 ms (6: 0.086 /
// 0.360, 3: 0.225 / 0.250); B=4 0.040 / 0.068 (3: 0.043 / 0.053). A copy of the same bytes takes
// 0.028 ms at B=16: the three launches' latency chains (a sort, 12 dependent loads of binary
// search, a record then the rows), not the bytes, set the time; fusing b into c or a one-launch
// form is what would close it.
#define ENC7_K 32

// the number of a[0..ENC_S) smaller than x (a ascending): 11 halvings, then one last compare
__device__ __forceinline__ int encoder_count_below(const int* a, int x) {
    int c = 0;
#pragma unroll
    for (int step = ENC_S / 2; step > 0; step >>= 1)
        if (a[c + step - 1] < x) c += step;
    return c + (a[c] < x ? 1 : 0);
}

// dwpe row t, columns [32 cc, 32 cc + 32) of 16-byte vectors (scalars when C % V != 0): warp w
template <typename T>
__device__ __forceinline__ void encoder_dwpe_warp_t(T* dwpe, const T* dout, int B, int TT, int C, int w) {
    constexpr int V = Vec16<T>::N;
    const bool vec = C % V == 0;
    const int W = vec ? V : 1, G = C / W, nch = ceil_div(G, WARP_SIZE);
    const int t = w / nch, g = (w % nch) * WARP_SIZE + threadIdx.x % WARP_SIZE;
    if (t < TT && g < G) encoder_dwpe_col_t<T>(dwpe, dout, B, TT, C, t, g, vec);
}

// a: blockDim 1024; G sort blocks, then the dwpe blocks (32 warps each)
template <typename T>
__device__ __forceinline__ void encoder_backward7_sort_t(int* stok, int* spos, int* srun, int* slen, T* dwpe,
        const T* dout, const int* inp, int B, int TT, int C, int G) {
    if ((int)blockIdx.x >= G) {
        encoder_dwpe_warp_t<T>(dwpe, dout, B, TT, C,
                               (blockIdx.x - G) * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE);
        return;
    }
    __shared__ unsigned long long s[ENC_S];
    __shared__ int st[ENC_S];
    const int N = B * TT, base = blockIdx.x * ENC_S;
    for (int i = threadIdx.x; i < ENC_S; i += blockDim.x) {
        const int p = base + i;  // past N: the largest key, sorted to the end
        s[i] = p < N ? ((unsigned long long)(unsigned)inp[p] << 32) | (unsigned)i : ~0ull;
    }
    __syncthreads();
    encoder_sort_chunk(s);
    for (int i = threadIdx.x; i < ENC_S; i += blockDim.x) st[i] = s[i] == ~0ull ? INT_MAX : (int)(s[i] >> 32);
    __syncthreads();
    for (int i = threadIdx.x; i < ENC_S; i += blockDim.x) {
        const int tok = st[i];
        const int lo = encoder_count_below(st, tok);
        const int hi = tok == INT_MAX ? ENC_S : encoder_count_below(st, tok + 1);
        stok[base + i] = tok;
        spos[base + i] = base + (int)(unsigned)s[i];
        srun[base + i] = i - lo;
        slen[base + i] = hi - lo;
    }
}

extern "C" __global__ void encoder_backward_sort_kernel7(int* stok, int* spos, int* srun, int* slen, float* dwpe,
        const float* dout, const int* inp, int B, int T, int C, int G) {
    LLMC_PDL_WAIT();
    encoder_backward7_sort_t<float>(stok, spos, srun, slen, dwpe, dout, inp, B, T, C, G);
}
extern "C" __global__ void encoder_backward_sort_kernel7_bf16(int* stok, int* spos, int* srun, int* slen, bf16* dwpe,
        const bf16* dout, const int* inp, int B, int T, int C, int G) {
    LLMC_PDL_WAIT();
    encoder_backward7_sort_t<bf16>(stok, spos, srun, slen, dwpe, dout, inp, B, T, C, G);
}

// b: thread gt = slot * GP + j; the grid covers G * ENC_S * GP threads in whole warps (every lane
// reaches the shuffles; slots >= N, the last chunk's padding, write nothing)
extern "C" __global__ void encoder_backward_rank_kernel7(int4* place_rec, const int* stok,
        const int* spos, const int* srun, const int* slen, int N, int G, int GP) {
    LLMC_PDL_WAIT();
    const long long gt = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int s = (int)(gt / GP), j0 = (int)(gt % GP);
    const bool live = s < N;
    int lo = 0, before = 0, tot = 0, tok = 0;
    if (live) {
        const int g = s / ENC_S;
        tok = stok[s];
        for (int j = j0; j < G; j += GP) {
            int l, c;
            if (j == g) {
                l = (s - g * ENC_S) - srun[s];
                c = slen[s];
            } else {
                const int* kj = stok + (size_t)j * ENC_S;
                l = encoder_count_below(kj, tok);
                c = encoder_count_below(kj, tok + 1) - l;
            }
            lo += l;
            tot += c;
            if (j < g) before += c;
        }
    }
    for (int o = GP / 2; o > 0; o >>= 1) {  // GP divides 32: the groups are aligned inside warps
        lo += __shfl_xor_sync(0xffffffffu, lo, o);
        tot += __shfl_xor_sync(0xffffffffu, tot, o);
        before += __shfl_xor_sync(0xffffffffu, before, o);
    }
    if (live && j0 == 0) {
        place_rec[lo + before + srun[s]] = make_int4(spos[s], lo, tot, tok);  // one 16-byte record
    }
}

// W fp32 values of a partial row (16 bytes at a time when vec)
template <int V>
__device__ __forceinline__ void encoder_partial_store(float* p, const float (&f)[V], bool vec) {
    if (vec) {
#pragma unroll
        for (int k = 0; k < V; k += 4) store4(p + k, make_float4(f[k], f[k + 1], f[k + 2], f[k + 3]));
    } else {
        p[0] = f[0];
    }
}
// the offset of the fp32 partial row of the piece that begins at place `first` (last: a token's last
// piece): two rows a window of ENC7_K places, the second for last pieces (see above)
__device__ __forceinline__ size_t encoder_partial_row(int first, bool last, int C) {
    return (size_t)(2 * (first / ENC7_K) + (last ? 1 : 0)) * C;
}

// a[0..V) += the partial rows of a token's npieces pieces (rows start.., see encoder_partial_row) at
// column col, in piece order (so the same bits wherever it runs): P rows' 16-byte loads issued (.cg:
// from L2, where other SMs' warps wrote them), then added, P at a time. Variant 7's combine, and
// variant 9's on register loads.
template <int P, int V>
__device__ __forceinline__ void encoder_partials_add(float (&a)[V], const float* partial, int start, int npieces,
                                                     int C, int col) {
    for (int q0 = 0; q0 < npieces; q0 += P) {
        float4 buf[P][V / 4];
#pragma unroll
        for (int r = 0; r < P; r++) {
            const int qq = q0 + r;
            const float* pp = partial + encoder_partial_row(start + qq * ENC7_K, qq == npieces - 1, C) + col;
#pragma unroll
            for (int k = 0; k < V / 4; k++)
                if (qq < npieces) buf[r][k] = __ldcg(reinterpret_cast<const float4*>(pp + 4 * k));
        }
#pragma unroll
        for (int r = 0; r < P; r++) {
#pragma unroll
            for (int k = 0; k < V / 4; k++) {
                if (q0 + r < npieces) {
                    a[4 * k] += buf[r][k].x; a[4 * k + 1] += buf[r][k].y;
                    a[4 * k + 2] += buf[r][k].z; a[4 * k + 3] += buf[r][k].w;
                }
            }
        }
    }
}

template <int V>
__device__ __forceinline__ void encoder_partial_add(float (&f)[V], const float* p, bool vec) {
    if (vec) {
#pragma unroll
        for (int k = 0; k < V; k += 4) {  // (L2: written by other SMs' warps)
            const float4 x = __ldcg(reinterpret_cast<const float4*>(p + k));
            f[k] += x.x; f[k + 1] += x.y; f[k + 2] += x.z; f[k + 3] += x.w;
        }
    } else {
        f[0] += __ldcg(p);
    }
}

// c: a warp per place; ENC7_CH chunks of 32 columns (16-byte vectors or scalars) held at once. blk: this
// block's index among the sum's blocks. inp (variant 8, whose records come from the host): every row
// added is checked against the ids, so that a stale record traps rather than sums a wrong row.
#define ENC7_CH 3
// A piece's rows are read ENC7_ROWS_UNROLL at a time, all of their 16-byte loads issued before the
// first is added (the adds stay in row order: the same bits). The loop unrolled by a pragma alone
// had ptxas add each row before loading the next, so a 32-row piece of a frequent token was 32 round
// trips. H200 lab, bf16, B=16, Zipf ids: 0.064 ms against 0.086 (uniform 0.034 against 0.035); 4
// rows at once 0.063 on Zipf but 0.048 on uniform ids (132 registers: fewer warps), 8 worse in both.
#ifndef ENC7_ROWS_UNROLL
#define ENC7_ROWS_UNROLL 2
#endif
// The last piece of a frequent token adds the pieces' fp32 partial rows ENC7_COMB_BATCH at a time for
// each 32 columns, all their loads issued first (the same order: the same bits); the old loop (a
// pragma unroll of 4) loaded one partial at a time. H200 lab, bf16, Zipf ids: B=16 0.046 ms against
// 0.063, B=4 0.022 against 0.027 (8 at a time: 0.042 at B=16); the registers it takes (122 against 88)
// cost uniform ids 0.037 against 0.034 at B=16, 0.0147 against 0.0134 at B=4. Text is the Zipf case.
#ifndef ENC7_COMB_BATCH
#define ENC7_COMB_BATCH 4
#endif
// ENC7_MAXNREG (unset by default): a register cap on kernels 7 and 8 (__maxnreg__), the lab's knob for
// trading the batched loads' registers against warps per SM (--define encoder:ENC7_MAXNREG=96). With 96
// and ENC7_COMB_BATCH=2 (no spills; 122 registers without), H200 lab, bf16: uniform ids B=4 0.0135 ms
// against 0.0147, B=16 0.0358 against 0.0370; Zipf ids (text) B=4 0.0267 against 0.0223, B=16 0.0572
// against 0.0451 (session 29). Text is the Zipf case: not the default.
#ifdef ENC7_MAXNREG
#define ENC7_REGS __maxnreg__(ENC7_MAXNREG)
#else
#define ENC7_REGS
#endif
template <typename T, int ROWS = ENC7_ROWS_UNROLL>
__device__ __forceinline__ void encoder_backward7_sum_t(T* dwte, const T* dout, const int4* place_rec,
        float* partial, int* tickets, int N, int C, int blk, const int* inp = nullptr, int others_above = INT_MAX) {
    constexpr int V = Vec16<T>::N;
    const int lane = threadIdx.x % WARP_SIZE;
    const int t = blk * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (t >= N) return;
    // lane l reads place t + l's record (position, start, count, token) in the same round trip as
    // lane 0 reads this place's; only lanes < n use theirs (the rows of this piece)
    const int4 rec = place_rec[min(t + lane, N - 1)];
    const int start = __shfl_sync(0xffffffffu, rec.y, 0), count = __shfl_sync(0xffffffffu, rec.z, 0);
    const int tok = __shfl_sync(0xffffffffu, rec.w, 0), d = t - start;
    if (d % ENC7_K) return;  // (the same in the whole warp)
    if (count > others_above) return;  // (variant 9: the tokens of more rows are summed by other warps)
    const int n = min(ENC7_K, count - d), npieces = ceil_div(count, ENC7_K), q = d / ENC7_K;
    const bool single = others_above <= ENC7_K || npieces == 1;  // (9: the compiler drops the pieces' paths)
    const int mypos = rec.x;
    // variant 8: the id at each row's position, checked against the token before this warp's first store
    // (records of another batch trap). Its load is issued here and waited for there, under the rows'
    // loads: checked up front, as until session 29, it was a third round trip before them (record, id,
    // rows) for every place of a token seen once.
    const int seen = (inp != nullptr && lane < n) ? inp[mypos] : tok;
    const bool vec = C % V == 0;
    const int W = vec ? V : 1, G = C / W;
    T* wrow = dwte + (size_t)tok * C;
    float* part = partial + encoder_partial_row(t, q == npieces - 1, C);
    for (int c0 = 0; c0 < G; c0 += ENC7_CH * WARP_SIZE) {
        float a[ENC7_CH][V];
#pragma unroll
        for (int h = 0; h < ENC7_CH; h++) {
            const int g = c0 + h * WARP_SIZE + lane;
            if (single && g < G) {
                load_vec<T>(a[h], wrow + g * W, vec, W);
            } else {
#pragma unroll
                for (int k = 0; k < V; k++) a[h][k] = 0.0f;
            }
        }
        if (vec) {  // ROWS (ENC7_ROWS_UNROLL; 9: ENC9_SINGLE_ROWS) rows' 16-byte loads issued, then added in row order
            constexpr int R = ROWS;
            for (int j0 = 0; j0 < n; j0 += R) {
                typename Vec16<T>::raw buf[R][ENC7_CH];
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const T* row = dout + (size_t)__shfl_sync(0xffffffffu, mypos, min(j0 + r, WARP_SIZE - 1)) * C;
#pragma unroll
                    for (int h = 0; h < ENC7_CH; h++) {
                        const int g = c0 + h * WARP_SIZE + lane;
                        if (j0 + r < n && g < G) buf[r][h] = Vec16<T>::ld(row + g * V);
                    }
                }
#pragma unroll
                for (int r = 0; r < R; r++) {
#pragma unroll
                    for (int h = 0; h < ENC7_CH; h++) {
                        const int g = c0 + h * WARP_SIZE + lane;
                        if (j0 + r < n && g < G) {
                            float x[V];
                            Vec16<T>::unpack(x, buf[r][h]);
#pragma unroll
                            for (int k = 0; k < V; k++) a[h][k] += x[k];
                        }
                    }
                }
            }
        } else {
            for (int j = 0; j < n; j++) {
                const T* row = dout + (size_t)__shfl_sync(0xffffffffu, mypos, j) * C;
#pragma unroll
                for (int h = 0; h < ENC7_CH; h++) {
                    const int g = c0 + h * WARP_SIZE + lane;
                    if (g < G) {
                        float x[V];
                        load_vec<T>(x, row + g * W, vec, W);
#pragma unroll
                        for (int k = 0; k < V; k++) a[h][k] += x[k];
                    }
                }
            }
        }
        if (c0 == 0 && seen != tok) __trap();  // records of another batch: nothing stored
#pragma unroll
        for (int h = 0; h < ENC7_CH; h++) {
            const int g = c0 + h * WARP_SIZE + lane;
            if (g < G) {
                if (single) store_vec<T>(wrow + g * W, a[h], vec, W);
                else encoder_partial_store<V>(part + g * W, a[h], vec);
            }
        }
    }
    if (single) return;
    __threadfence();  // this piece's partial is visible before its ticket
    __syncwarp();
    int ticket = 0;
    if (lane == 0) ticket = atomicAdd(&tickets[start], 1);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != npieces - 1) return;
    __threadfence();  // (the other pieces' partials, fenced before their tickets)
    for (int c0 = 0; c0 < G; c0 += ENC7_CH * WARP_SIZE) {
        float a[ENC7_CH][V];
#pragma unroll
        for (int h = 0; h < ENC7_CH; h++) {
            const int g = c0 + h * WARP_SIZE + lane;
            if (g < G) load_vec<T>(a[h], wrow + g * W, vec, W);
        }
        if (vec) {  // per 32 columns, ENC7_COMB_BATCH partials' loads issued, then added in piece order (same bits)
            constexpr int P = ENC7_COMB_BATCH;
#pragma unroll
            for (int h = 0; h < ENC7_CH; h++) {
                const int g = c0 + h * WARP_SIZE + lane;
                if (g < G) encoder_partials_add<P>(a[h], partial, start, npieces, C, g * V);
            }
        } else {
            for (int qq = 0; qq < npieces; qq++) {
                const float* pp = partial + encoder_partial_row(start + qq * ENC7_K, qq == npieces - 1, C);
#pragma unroll
                for (int h = 0; h < ENC7_CH; h++) {
                    const int g = c0 + h * WARP_SIZE + lane;
                    if (g < G) encoder_partial_add<V>(a[h], pp + g * W, vec);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < ENC7_CH; h++) {
            const int g = c0 + h * WARP_SIZE + lane;
            if (g < G) store_vec<T>(wrow + g * W, a[h], vec, W);
        }
    }
    if (lane == 0) tickets[start] = 0;
}

extern "C" __global__ void ENC7_REGS encoder_backward_kernel7(float* dwte, const float* dout, const int4* place_rec,
        float* partial, int* tickets, int N, int C) {
    LLMC_PDL_WAIT();
    encoder_backward7_sum_t<float>(dwte, dout, place_rec, partial, tickets, N, C, blockIdx.x);
}
extern "C" __global__ void ENC7_REGS encoder_backward_kernel7_bf16(bf16* dwte, const bf16* dout, const int4* place_rec,
        float* partial, int* tickets, int N, int C) {
    LLMC_PDL_WAIT();
    encoder_backward7_sum_t<bf16>(dwte, dout, place_rec, partial, tickets, N, C, blockIdx.x);
}

// ----------------------------------------------------------------------------------------------
// encoder_backward 8: 7's records (per place of the token-major order: position, the token's first
// place, its count, the token) computed on the host from the batch's ids and uploaded with it
// (llmc/ops/encoder.py, encoder_backward8_records), so 7's sort and rank launches go. One launch:
// blocks < dwpe_blocks sum dwpe (7's warps: a warp per (position, 32 columns), the B rows in order),
// the others run 7's sum (a warp per place, pieces of ENC7_K rows, tickets). dout is read by both
// halves of the grid; at GPT-2's B=4 it is 6.3 MB (bf16), so the second read comes from L2. The
// same records, pieces and orders as 7: the same bits.
template <typename T>
__device__ __forceinline__ void encoder_backward8_t(T* dwte, T* dwpe, const T* dout, const int* inp,
        const int4* place_rec, float* partial, int* tickets, int B, int TT, int C, int dwpe_blocks) {
    if ((int)blockIdx.x < dwpe_blocks) {
        encoder_dwpe_warp_t<T>(dwpe, dout, B, TT, C, blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE);
        return;
    }
    encoder_backward7_sum_t<T>(dwte, dout, place_rec, partial, tickets, B * TT, C, blockIdx.x - dwpe_blocks, inp);
}

extern "C" __global__ void ENC7_REGS encoder_backward_kernel8(float* dwte, float* dwpe, const float* dout, const int* inp,
        const int4* place_rec, float* partial, int* tickets, int B, int T, int C, int dwpe_blocks) {
    LLMC_PDL_WAIT();
    encoder_backward8_t<float>(dwte, dwpe, dout, inp, place_rec, partial, tickets, B, T, C, dwpe_blocks);
}
extern "C" __global__ void ENC7_REGS encoder_backward_kernel8_bf16(bf16* dwte, bf16* dwpe, const bf16* dout, const int* inp,
        const int4* place_rec, float* partial, int* tickets, int B, int T, int C, int dwpe_blocks) {
    LLMC_PDL_WAIT();
    encoder_backward8_t<bf16>(dwte, dwpe, dout, inp, place_rec, partial, tickets, B, T, C, dwpe_blocks);
}

// ----------------------------------------------------------------------------------------------
// encoder_backward 9: 8's records, pieces and orders (the same bits), with the frequent tokens' work
// cut finer. On text ids 8's time is the most frequent token's latency chain: ~9% of the positions in
// the lab's Zipf ids, ~1450 rows at B=16, 45 pieces of 32 rows, each a warp adding its rows two at a time
// over all C columns (16 round trips), then one warp adding the 45 partial rows four at a time, 32
// columns after another (36 round trips). Here the pieces of tokens of more than ENC9_MIN rows are taken
// by their own warps, one per (piece, slice of 32 lanes of ENC9_LANE columns, 16 bytes: 256 bf16 or 128
// fp32 columns; C = 768 in bf16 is 3 slices): a slice's row is one 16-byte load a lane, ENC9_ROWS rows'
// loads at a time (8 round trips for 32 rows), and its combine adds ENC9_PARTS partials at a time (12
// round trips for 45 pieces), a ticket per (token, slice). Those warps find their pieces themselves:
// warp (k, j, s) reads the records of the 32 places of window k and takes the j-th place there that
// heads a piece of such a token (j < H, the launch's heads a window: 1 + ceil(32 / (ENC9_MIN + 1)), at
// most 32, at most one of them a token's short last piece), then that piece's records; a window with
// more heads traps. The other
// tokens (at most ENC9_MIN rows: one piece) stay with 8's warps (a warp per place, all C columns, 8's
// registers and bytes in flight, which a uniform batch needs). Grid: the sliced warps first (the
// longest chains), then the dwpe warps, then 8's. Slicing every token instead was measured: uniform ids
// B=16 0.039-0.064 ms against 8's 0.036 (a third of the bytes in flight a warp).
// H200 lab (session 33), bf16, ms, uniform / Zipf / text (tiny shakespeare) ids, the final build: B=16
// 0.0306 / 0.0273 / 0.0277 against 8's 0.0357 / 0.0451 / 0.0449; B=4 0.0115 / 0.0134 / 0.0135 against
// 0.0144 / 0.0220 / 0.0220. On the way (ENC9_SINGLE_ROWS 2, ENC9_PARTS 8): B=16 0.0335 / 0.0280 / 0.0293,
// B=4 0.0124 / 0.0142 / 0.0142. The knobs (--define encoder:NAME=V), B=16 Zipf / text: ENC9_MIN 8
// 0.0280 / 0.0275 (uniform 0.0351), 24 0.0309 / 0.0300, 32 0.0324 (R 8); ENC9_ROWS 2 0.0321 / 0.0346, 8
// 0.0299 (MIN 16, 100 registers against 96: uniform 0.0378); ENC9_PARTS 4 0.0278 / 0.0288 (level). Then 8's warps one row at a
// time (ENC9_SINGLE_ROWS 1, with ENC9_PARTS 4: 72 registers against 96, more warps an SM): B=16 0.0307 /
// 0.0275 / 0.0276, B=4 0.0115 / 0.0135 / 0.0140 (ENC9_PARTS 2 level). No spills.
// ENC9_MIN: 8 since session 35 (was 16), with the bf16 loads staged (ENC9_STAGE). Same-run H200 lab, bf16,
// uniform / Zipf / text ids: B=16 0.0321 / 0.0258 / 0.0245 ms against 0.0313 / 0.0272 / 0.0275; B=4 0.0117
// / 0.0130 / 0.0127 against 0.0117 / 0.0132 / 0.0136. fp32 (registers): B=16 0.0571 / 0.0439 / 0.0428
// against 0.0543 / 0.0500 / 0.0477, B=4 0.0189 / 0.0180 / 0.0167 against 0.0182 / 0.0201 / 0.0197.
// 12: bf16 B=16 0.0316 / 0.0256 / 0.0261.
#ifndef ENC9_MIN
#define ENC9_MIN 8
#endif
#ifndef ENC9_ROWS
#define ENC9_ROWS 4
#endif
#ifndef ENC9_PARTS
#define ENC9_PARTS 4
#endif
// the sliced warps' columns a lane (4 or 8; at most 16 bytes: fp32 takes 4 at 8): a slice is 32 lanes'.
// 4 (8-byte bf16 loads, one float4 a partial, ENC9_PARTS 8: 76 registers) was measured slower: B=16 0.0334
// / 0.0289 / 0.0306 ms against 0.0309 / 0.0276 / 0.0283 (session 33)
#ifndef ENC9_LANE
#define ENC9_LANE 8
#endif
// 8's warps in 9 (the tokens of at most ENC9_MIN rows) read ENC9_SINGLE_ROWS rows at a time (8: 2)
#ifndef ENC9_SINGLE_ROWS
#define ENC9_SINGLE_ROWS 1
#endif
// ENC9_STAGE (bf16 builds): the sliced warps' loads go through shared memory, ENC9_STAGE 16-byte slots a
// lane (a warp: ENC9_STAGE * 512 bytes of the block's dynamic shared memory, llmc/ops/encoder.py sizes
// it): up to ENC9_STAGE rows of a piece, or ENC9_STAGE / 2 partials of the combine, issued by cp.async at
// once and waited for once, where registers held ENC9_ROWS rows / ENC9_PARTS partials. Each lane copies
// and reads back only its own slots (no barrier). The adds keep their order: the same bits. 0: the
// register loads (ENC9_ROWS, ENC9_PARTS), as fp32 builds and 8-byte lanes (ENC9_LANE 4) always. Same-run
// H200 lab (session 35), uniform / Zipf / text ids, at ENC9_MIN 8: bf16 B=16 0.0321 / 0.0258 / 0.0245 ms
// against the registers' 0.0318 / 0.0255 / 0.0254, B=4 0.0117 / 0.0130 / 0.0127 against 0.0117 / 0.0132 /
// 0.0134; at ENC9_MIN 16 level (B=16 0.0313 / 0.0275 / 0.0274 against 0.0305 / 0.0277 / 0.0277). fp32
// staged was slower: B=16 0.0602 / 0.0458 / 0.0440 against 0.0571 / 0.0439 / 0.0428. 8 (4 KB a warp)
// level with 16; 32 (16 KB a warp, fewer blocks an SM) slower.
#ifndef ENC9_STAGE
#define ENC9_STAGE 16
#endif
#if ENC9_STAGE == 1
#error "ENC9_STAGE: 0 (registers) or at least 2 (a bf16 partial takes two 16-byte slots)"
#endif
// columns a lane of the sliced warps: one load a row of E * sizeof(T) bytes (at most 16), one float4 per
// 4 of a partial
template <typename T>
struct Enc9Lane { static constexpr int E = ENC9_LANE * (int)sizeof(T) > 16 ? 16 / (int)sizeof(T) : ENC9_LANE; };

// ENC9_ACQREL (session 53; 1, on, by default since session 54): a piece's (and a group's) ticket taken by lane 0's
// acq_rel atomic after the warp's __syncwarp, where every lane fenced (__threadfence) before it and the winner's
// lanes after it (0: that form): the release of the warp's partial and the acquire of the others' in the atomic
// (as layernorm_backward 7's tail since session 49), the winner's lanes ordered after it by __syncwarp. For 9's
// and 10's pieces; the same bits. H200 lab, bf16, B=4, Zipf / text ids, against the fenced build in the same
// call, three calls (session 53, session 54's 1 and 2): 9 0.0128 / 0.0125, 0.0127 / 0.0124 and 0.0125 / 0.0124 ms
// against 0.0129 / 0.0128, 0.0132 / 0.0128 and 0.0130 / 0.0126; B=16 level (Zipf 0.0252 against 0.0255).
#ifndef ENC9_ACQREL
#define ENC9_ACQREL 1
#endif
__device__ __forceinline__ int enc9_ticket_add(int* p) {
#if ENC9_ACQREL
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(p) : "memory");
    return old;
#else
    return atomicAdd(p, 1);
#endif
}
#if ENC9_ACQREL
#define ENC9_FENCE_BEFORE_TICKET()  // (the ticket's atomic releases the warp's stores, after its __syncwarp)
#define ENC9_FENCE_AFTER_TICKET() __syncwarp()
#else
#define ENC9_FENCE_BEFORE_TICKET() __threadfence()
#define ENC9_FENCE_AFTER_TICKET() __threadfence()
#endif

// ENC_TREE_G (G > 0; 0, off, by default): a token of more than G pieces has its partials added in two
// levels, where the last piece to finish added all of them, npieces / ENC9_STAGE * 2 rounds of loads
// one after another (the top token of text at B=16: 41 pieces, 6 rounds). The pieces form groups of G
// consecutive ones; the last of a group to finish (a ticket per group, at its first piece's place) adds
// the group's partials in piece order, from 0, and writes the sum over the group's first partial row;
// the last group to finish (a ticket at place start + 1, never a piece's head) adds the group sums in
// group order onto dwte's row. A group's sum is one round of loads (G <= ENC9_STAGE / 2), the last level
// one round per ENC9_STAGE / 2 groups (bf16's staged path only). Other bits than 9's for those tokens (the
// same on every run); the others' are unchanged. H200 lab, bf16, B=16, ms (session 52): 10 at G = 4 Zipf /
// text / uniform + one token at 8% 0.0243 / 0.0238 / 0.0271 against 0.0261 / 0.0242 / 0.0301, uniform
// level; 9 0-3% faster; at B=4 level or slower. Off: 9, the default, barely moves (docs/ops.md).
#ifndef ENC_TREE_G
#define ENC_TREE_G 0
#endif
#if ENC_TREE_G > 0
static_assert(2 * ENC_TREE_G <= ENC9_STAGE, "ENC_TREE_G: a group's partials take 2 slots each of ENC9_STAGE");
template <typename T>
__device__ __forceinline__ void encoder_tree_combine_t(T* dwte, float* partial, int* tickets, T* wrow, int start,
        int npieces, int q, int s, int S, int C, int g, bool live, uint32_t st) {
    constexpr int E = Enc9Lane<T>::E, K4 = E / 4, P = ENC9_STAGE / K4;
    const int lane = threadIdx.x % WARP_SIZE;
    const int q0 = (q / ENC_TREE_G) * ENC_TREE_G, gk = min(ENC_TREE_G, npieces - q0);
    const int ngroups = ceil_div(npieces, ENC_TREE_G);
    int* gticket = &tickets[(size_t)(start + q0 * ENC7_K) * S + s];
    int* fticket = &tickets[(size_t)(start + 1) * S + s];
    int ticket = 0;
    if (lane == 0) ticket = enc9_ticket_add(gticket);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != gk - 1) return;
    ENC9_FENCE_AFTER_TICKET();  // (the group's partials, fenced before their tickets)
    if (live) {
#pragma unroll 1
        for (int r = 0; r < gk; r++) {
            const int qq = q0 + r;
            const float* pp = partial + encoder_partial_row(start + qq * ENC7_K, qq == npieces - 1, C) + (size_t)g * E;
#pragma unroll
            for (int k = 0; k < K4; k++) cp_async16_full(st + 512u * (r * K4 + k), pp + 4 * k);
        }
        cp_async_commit();
        cp_async_wait<0>();
        float b[E];
#pragma unroll
        for (int k = 0; k < E; k++) b[k] = 0.0f;
        for (int r = 0; r < gk; r++) {
#pragma unroll
            for (int k = 0; k < K4; k++) {
                const uint4 v = lds128(st + 512u * (r * K4 + k));
                b[4 * k] += __uint_as_float(v.x); b[4 * k + 1] += __uint_as_float(v.y);
                b[4 * k + 2] += __uint_as_float(v.z); b[4 * k + 3] += __uint_as_float(v.w);
            }
        }
        float* gp = partial + encoder_partial_row(start + q0 * ENC7_K, q0 == npieces - 1, C) + (size_t)g * E;
#pragma unroll
        for (int k = 0; k < E; k += 4) store4(gp + k, make_float4(b[k], b[k + 1], b[k + 2], b[k + 3]));
    }
    __syncwarp();
    if (lane == 0) *gticket = 0;  // (every piece of the group has taken it)
    ENC9_FENCE_BEFORE_TICKET();  // the group's sum is visible before the group's ticket
    __syncwarp();
    if (lane == 0) ticket = enc9_ticket_add(fticket);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != ngroups - 1) return;
    ENC9_FENCE_AFTER_TICKET();
    if (live) {
        float a[E];
        load_vec<T, E>(wrow, a);
        for (int k0 = 0; k0 < ngroups; k0 += P) {
#pragma unroll 1
            for (int r = 0; r < P && k0 + r < ngroups; r++) {
                const int qq = (k0 + r) * ENC_TREE_G;
                const float* pp = partial + encoder_partial_row(start + qq * ENC7_K, qq == npieces - 1, C) + (size_t)g * E;
#pragma unroll
                for (int k = 0; k < K4; k++) cp_async16_full(st + 512u * (r * K4 + k), pp + 4 * k);
            }
            cp_async_commit();
            cp_async_wait<0>();
            for (int r = 0; r < P && k0 + r < ngroups; r++) {
#pragma unroll
                for (int k = 0; k < K4; k++) {
                    const uint4 v = lds128(st + 512u * (r * K4 + k));
                    a[4 * k] += __uint_as_float(v.x); a[4 * k + 1] += __uint_as_float(v.y);
                    a[4 * k + 2] += __uint_as_float(v.z); a[4 * k + 3] += __uint_as_float(v.w);
                }
            }
        }
        store_vec<T, E>(wrow, a);
    }
    __syncwarp();
    if (lane == 0) *fticket = 0;
}
#endif

// The piece of a token that begins at place t, slice s of its columns (variants 9 and 10): its rows
// summed (a single-piece token: onto dwte's row, np.add.at's order) or its partial written and its
// ticket taken, the last ticket's warp adding the token's partials onto dwte's row in piece order.
// st: this lane's first staging slot in shared memory (ENC9_STAGE slots, 512 bytes apart).
template <typename T>
__device__ __forceinline__ void encoder_piece_slice_t(T* dwte, const T* dout, const int* inp, const int4* place_rec,
        float* partial, int* tickets, int N, int C, int t, int s, uint32_t st) {
    constexpr int E = Enc9Lane<T>::E;
    typedef typename RawVec<E * sizeof(T)>::type Raw;
    const bool vec = C % E == 0;
    const int W = vec ? E : 1, G = C / W, S = ceil_div(G, WARP_SIZE);
    const int lane = threadIdx.x % WARP_SIZE;
    const int4 rec = place_rec[min(t + lane, N - 1)];  // lane l: the record of the piece's row l
    const int start = __shfl_sync(0xffffffffu, rec.y, 0), count = __shfl_sync(0xffffffffu, rec.z, 0);
    const int tok = __shfl_sync(0xffffffffu, rec.w, 0), d = t - start;
    const int n = min(ENC7_K, count - d), npieces = ceil_div(count, ENC7_K), q = d / ENC7_K;
    const bool single = npieces == 1;  // (a token of ENC9_MIN < count <= 32 rows: dwte's row first, np.add.at's order)
    const int mypos = rec.x;
    const int seen = lane < n ? inp[mypos] : tok;  // checked before the first store (records of another batch trap)
    const int g = s * WARP_SIZE + lane;
    const bool live = g < G;
    T* wrow = dwte + (size_t)tok * C + (size_t)g * W;
    float a[E];
#pragma unroll
    for (int k = 0; k < E; k++) a[k] = 0.0f;
    if (single && live) {
        if (vec) load_vec<T, E>(wrow, a);
        else a[0] = to_f32(*wrow);
    }
    constexpr bool staged = ENC9_STAGE > 0 && sizeof(T) == 2 && E * sizeof(T) == 16;  // (bf16, 16-byte lanes)
    if (vec && staged) {  // ENC9_STAGE rows' cp.async copies issued, waited for once, added in row order
        constexpr int R = ENC9_STAGE > 0 ? ENC9_STAGE : 1;
        for (int j0 = 0; j0 < n; j0 += R) {
#pragma unroll 1  // (cp.async does not wait: the issue loop needs no unrolling, nor its registers)
            for (int r = 0; r < R; r++) {
                const int p = __shfl_sync(0xffffffffu, mypos, min(j0 + r, WARP_SIZE - 1));
                if (j0 + r < n && live) cp_async16_full(st + 512u * r, dout + (size_t)p * C + g * E);
            }
            cp_async_commit();
            cp_async_wait<0>();
#pragma unroll 4
            for (int r = 0; r < R; r++) {
                if (j0 + r < n && live) {
                    float x[E];
                    unpack_vec<T, E>(lds128(st + 512u * r), x);
#pragma unroll
                    for (int k = 0; k < E; k++) a[k] += x[k];
                }
            }
        }
    } else if (vec) {  // ENC9_ROWS rows' loads issued, then added in row order (8's order: the same bits)
        constexpr int R = ENC9_ROWS;
        for (int j0 = 0; j0 < n; j0 += R) {
            Raw buf[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                const int p = __shfl_sync(0xffffffffu, mypos, min(j0 + r, WARP_SIZE - 1));
                if (j0 + r < n && live) buf[r] = ld_raw<LD_PLAIN>(reinterpret_cast<const Raw*>(dout + (size_t)p * C + g * E));
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (j0 + r < n && live) {
                    float x[E];
                    unpack_vec<T, E>(buf[r], x);
#pragma unroll
                    for (int k = 0; k < E; k++) a[k] += x[k];
                }
            }
        }
    } else {
        for (int r = 0; r < n; r++) {
            const int p = __shfl_sync(0xffffffffu, mypos, r);
            if (live) a[0] += to_f32(dout[(size_t)p * C + g]);
        }
    }
    if (seen != tok) __trap();  // records of another batch: nothing stored
    float* part = partial + encoder_partial_row(t, q == npieces - 1, C) + g * W;
    if (single) {
        if (live) {
            if (vec) store_vec<T, E>(wrow, a);
            else *wrow = from_f32<T>(a[0]);
        }
        return;
    }
    if (live) {
        if (vec) {
#pragma unroll
            for (int k = 0; k < E; k += 4) store4(part + k, make_float4(a[k], a[k + 1], a[k + 2], a[k + 3]));
        } else {
            part[0] = a[0];
        }
    }
    ENC9_FENCE_BEFORE_TICKET();  // this piece's partial is visible before its ticket
    __syncwarp();
    int ticket = 0;
#if ENC_TREE_G > 0
    if (vec && staged && npieces > ENC_TREE_G) {  // two levels (below): a token of more than G pieces
        encoder_tree_combine_t<T>(dwte, partial, tickets, wrow, start, npieces, q, s, S, C, g, live, st);
        return;
    }
#endif
    if (lane == 0) ticket = enc9_ticket_add(&tickets[(size_t)start * S + s]);
    ticket = __shfl_sync(0xffffffffu, ticket, 0);
    if (ticket != npieces - 1) return;
    ENC9_FENCE_AFTER_TICKET();  // (the other pieces' partials, fenced before their tickets)
    if (live) {
        if (vec) load_vec<T, E>(wrow, a);
        else a[0] = to_f32(*wrow);
        if (vec && staged) {  // the partials (E / 4 slots each) by cp.async, a stage at a time, added in piece order
            constexpr int K4 = E / 4, P = ENC9_STAGE / K4 > 0 ? ENC9_STAGE / K4 : 1;
            for (int q0 = 0; q0 < npieces; q0 += P) {
#pragma unroll 1
                for (int r = 0; r < P; r++) {
                    const int qq = q0 + r;
                    const float* pp = partial + encoder_partial_row(start + qq * ENC7_K, qq == npieces - 1, C) + g * E;
#pragma unroll
                    for (int k = 0; k < K4; k++)  // (.cg: from L2, where other SMs' warps wrote them)
                        if (qq < npieces) cp_async16_full(st + 512u * (r * K4 + k), pp + 4 * k);
                }
                cp_async_commit();
                cp_async_wait<0>();
#pragma unroll 2
                for (int r = 0; r < P; r++) {
#pragma unroll
                    for (int k = 0; k < K4; k++) {
                        if (q0 + r < npieces) {
                            const uint4 v = lds128(st + 512u * (r * K4 + k));
                            a[4 * k] += __uint_as_float(v.x); a[4 * k + 1] += __uint_as_float(v.y);
                            a[4 * k + 2] += __uint_as_float(v.z); a[4 * k + 3] += __uint_as_float(v.w);
                        }
                    }
                }
            }
            store_vec<T, E>(wrow, a);
        } else if (vec) {  // ENC9_PARTS partials' loads issued, then added in piece order (8's order: the same bits)
            encoder_partials_add<ENC9_PARTS>(a, partial, start, npieces, C, g * E);
            store_vec<T, E>(wrow, a);
        } else {
            for (int qq = 0; qq < npieces; qq++)
                a[0] += __ldcg(partial + encoder_partial_row(start + qq * ENC7_K, qq == npieces - 1, C) + g);
            *wrow = from_f32<T>(a[0]);
        }
    }
    __syncwarp();
    if (lane == 0) tickets[(size_t)start * S + s] = 0;
}

// variant 9's sliced warp w: (window of 32 places, j < H, slice) finds the j-th piece head of a token of
// more than ENC9_MIN rows in its window, if there is one, and sums that piece's slice
template <typename T>
__device__ __forceinline__ void encoder_backward9_piece_t(T* dwte, const T* dout, const int* inp, const int4* place_rec,
        float* partial, int* tickets, int N, int C, int H, int w) {
    constexpr int E = Enc9Lane<T>::E;
    const int G = C % E == 0 ? C / E : C, S = ceil_div(G, WARP_SIZE);
    const int lane = threadIdx.x % WARP_SIZE;
    const int s = w % S, j = (w / S) % H, base = (w / (H * S)) * ENC7_K;  // slice, which head, window
    if (base >= N) return;
    bool head = false;
    if (base + lane < N) {
        const int4 r = place_rec[base + lane];  // (position, start, count, token)
        head = r.z > ENC9_MIN && (base + lane - r.y) % ENC7_K == 0;
    }
    unsigned heads = __ballot_sync(0xffffffffu, head);
    if (__popc(heads) > H) __trap();  // (the launch's H is too small for ENC9_MIN: never silently skipped)
    for (int i = 0; i < j; i++) heads &= heads - 1;  // (drop the first j)
    if (heads == 0) return;
    const int t = base + __ffs(heads) - 1;  // this warp's piece starts at place t
#if ENC9_STAGE > 0
    extern __shared__ uint4 enc9_stage[];  // [warps][ENC9_STAGE][32 lanes]: slot r of this lane at st + 512 r
    const uint32_t st = smem_u32(enc9_stage + (threadIdx.x / WARP_SIZE) * ENC9_STAGE * WARP_SIZE + lane);
#else
    const uint32_t st = 0;
#endif
    encoder_piece_slice_t<T>(dwte, dout, inp, place_rec, partial, tickets, N, C, t, s, st);
}

// grid: piece_blocks (a warp per (window of 32 places, j < H, slice)), dwpe_blocks, then 8's warps
template <typename T>
__device__ __forceinline__ void encoder_backward9_t(T* dwte, T* dwpe, const T* dout, const int* inp,
        const int4* place_rec, float* partial, int* tickets, int B, int TT, int C, int H, int piece_blocks,
        int dwpe_blocks) {
    const int wpb = blockDim.x / WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if ((int)blockIdx.x < piece_blocks) {
        encoder_backward9_piece_t<T>(dwte, dout, inp, place_rec, partial, tickets, B * TT, C, H, blockIdx.x * wpb + warp);
        return;
    }
    const int b = blockIdx.x - piece_blocks;
    if (b < dwpe_blocks) {
        encoder_dwpe_warp_t<T>(dwpe, dout, B, TT, C, b * wpb + warp);
        return;
    }
    encoder_backward7_sum_t<T, ENC9_SINGLE_ROWS>(dwte, dout, place_rec, partial, tickets, B * TT, C, b - dwpe_blocks, inp,
                                                 ENC9_MIN);
}

extern "C" __global__ void ENC7_REGS encoder_backward_kernel9(float* dwte, float* dwpe, const float* dout, const int* inp,
        const int4* place_rec, float* partial, int* tickets, int B, int T, int C, int H, int piece_blocks, int dwpe_blocks) {
    LLMC_PDL_WAIT();
    encoder_backward9_t<float>(dwte, dwpe, dout, inp, place_rec, partial, tickets, B, T, C, H, piece_blocks, dwpe_blocks);
}
extern "C" __global__ void ENC7_REGS encoder_backward_kernel9_bf16(bf16* dwte, bf16* dwpe, const bf16* dout, const int* inp,
        const int4* place_rec, float* partial, int* tickets, int B, int T, int C, int H, int piece_blocks, int dwpe_blocks) {
    LLMC_PDL_WAIT();
    encoder_backward9_t<bf16>(dwte, dwpe, dout, inp, place_rec, partial, tickets, B, T, C, H, piece_blocks, dwpe_blocks);
}

// ----------------------------------------------------------------------------------------------
// encoder_backward 10: 9's pieces and bits, with no warp launched to find no work. On text ids at B=16
// most of 9's 27k warps (a warp per place for the tokens of at most ENC9_MIN rows, H a window for the
// others) read a record and leave, and its time is waves of them, not a frequent token's chain (a
// uniform batch with one token at 1300 places takes 9 as long as a uniform one); and the dwpe warps read
// dout a second time. Here the host (llmc/ops/encoder.py, encoder_backward10_records) writes, after 8's
// place records, the places where a piece begins, of every token of at least 2 rows (the pieces of
// tokens of more than 32 rows first, the tokens of the most rows first), and per position its token if
// the token occurs only there. A persistent grid (as many warps as fit at once) takes the units: each
// piece's 16-byte slices (9's sliced piece: encoder_piece_slice_t), then a unit per (position t, 32
// 16-byte columns) that sums dwpe (8's order) and adds the rows of the tokens seen once onto dwte from
// the same loads (8's sum of a one-row token). The same bits as 8 and 9; every position's id is checked
// against the records before a warp's first store (pieces: 9's check; the single rows: here).
// Measured (H200 lab, bf16, L2 flushed, ms; uniform / Zipf / text ids; session 48): B=16 0.0281 / 0.0251
// / 0.0242 against 9's 0.0324 / 0.0259 / 0.0250 (uniform: 78% of a copy of its bytes against 67%); B=4
// 0.0125 / 0.0139 / 0.0140 against 0.0120 / 0.0130 / 0.0127 (a warp's units one after another, where 9's
// warps overlap). On the way: the multi-piece units round the warps with the others (the warp that adds
// a token's partials then has more units to do): text B=16 0.0310; the next unit from an atomic counter
// instead of round the warps: slower everywhere (uniform B=16 0.0326, B=4 0.0165). And 9 itself with the
// single tokens' rows moved to its dwpe warps (no work list): B=16 0.0306 / 0.0245 / 0.0249, B=4 0.0116 /
// 0.0135 / 0.0134 (branch wip/encoder10-singles).
#ifndef ENC10_ROWS
#define ENC10_ROWS 8
#endif
#define ENC10_SLOTS (2 * ENC10_ROWS)  // 16-byte slots a lane of a dwpe warp
// ENC10_NO_DWPE (a measurement build, 0 by default; never the op): the dwpe units leave dwpe alone and read only
// the rows of the tokens seen once, so dout is read once: what 10 would cost if dwpe were summed elsewhere
#ifndef ENC10_NO_DWPE
#define ENC10_NO_DWPE 0
#endif
// ENC10_TRACE (a measurement build, 0 by default; never the op): each unit's start and end (%globaltimer, ns, and
// clock64), the SM and the warp, written by lane 0 to enc10_trace[u] (6 words a unit, the first ENC10_TRACE_MAX
// units), and each warp's own start to enc10_entry[warp], which the host reads after the launch
// (dev/cuda/encoder_backward_trace.py): where a launch's time goes, unit by unit.
#ifndef ENC10_TRACE
#define ENC10_TRACE 0
#endif
#if ENC10_TRACE
#define ENC10_TRACE_MAX 65536
__device__ unsigned long long enc10_trace[ENC10_TRACE_MAX * 6];
#define ENC10_TRACE_WARPS 8192
__device__ unsigned long long enc10_entry[ENC10_TRACE_WARPS];  // each warp's start, before it reads the work list
__device__ __forceinline__ unsigned long long enc10_globaltimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned enc10_smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}
#endif

// position t, columns [E g, E g + E) of slice s (16-byte lanes): dwpe += the B rows summed in order;
// the rows of single tokens onto their dwte rows. st: this lane's ENC10_SLOTS staging slots.
template <typename T>
__device__ __forceinline__ void encoder_dwpe_single_t(T* dwte, T* dwpe, const T* dout, const int* inp,
        const int* tok_single, int B, int TT, int C, int t, int s, uint32_t st) {
    constexpr int E = 16 / (int)sizeof(T);
    const int lane = threadIdx.x % WARP_SIZE, G = C / E, g = s * WARP_SIZE + lane;
    const bool live = g < G;
    float acc[E], d[E];
#pragma unroll
    for (int k = 0; k < E; k++) acc[k] = 0.0f;
    T* prow = dwpe + (size_t)t * C + (size_t)g * E;
    if (live && !ENC10_NO_DWPE) load_vec<T, E>(prow, d);  // (waited for at the end)
    for (int b0 = 0; b0 < B; b0 += WARP_SIZE) {
        const int nb = min(WARP_SIZE, B - b0);
        int ts = -1, id = -1;
        if (lane < nb) {
            const size_t p = (size_t)(b0 + lane) * TT + t;
            ts = tok_single[p];
            id = inp[p];
        }
        for (int r0 = 0; r0 < nb; r0 += ENC10_ROWS) {
#pragma unroll 1
            for (int r = 0; r < ENC10_ROWS; r++) {  // the rows first: they wait for nothing
                bool take = r0 + r < nb && live;
                if (ENC10_NO_DWPE)  // (every lane shuffles, then tests its own columns)
                    take = __shfl_sync(0xffffffffu, ts, min(r0 + r, WARP_SIZE - 1)) >= 0 && take;
                if (take)
                    cp_async16_full(st + 512u * r, dout + ((size_t)(b0 + r0 + r) * TT + t) * C + (size_t)g * E);
            }
            if (r0 == 0 && __any_sync(0xffffffffu, ts >= 0 && ts != id)) __trap();  // records of another batch
#pragma unroll 1
            for (int r = 0; r < ENC10_ROWS; r++) {  // then the rows of dwte the ids name
                const int tk = __shfl_sync(0xffffffffu, ts, min(r0 + r, WARP_SIZE - 1));
                if (r0 + r < nb && live && tk >= 0)
                    cp_async16_full(st + 512u * (ENC10_ROWS + r), dwte + (size_t)tk * C + (size_t)g * E);
            }
            cp_async_commit();
            cp_async_wait<0>();
#pragma unroll
            for (int r = 0; r < ENC10_ROWS; r++) {
                const int tk = __shfl_sync(0xffffffffu, ts, min(r0 + r, WARP_SIZE - 1));
                if (r0 + r < nb && live) {
                    float x[E];
                    unpack_vec<T, E>(lds128(st + 512u * r), x);
#pragma unroll
                    for (int k = 0; k < E; k++) acc[k] += x[k];
                    if (tk >= 0) {  // dwte's row + this row, rounded once: 8's sum of a one-row token
                        float w[E];
                        unpack_vec<T, E>(lds128(st + 512u * (ENC10_ROWS + r)), w);
#pragma unroll
                        for (int k = 0; k < E; k++) w[k] += x[k];
                        store_vec<T, E>(dwte + (size_t)tk * C + (size_t)g * E, w);
                    }
                }
            }
        }
    }
    if (live && !ENC10_NO_DWPE) {
#pragma unroll
        for (int k = 0; k < E; k++) d[k] += acc[k];
        store_vec<T, E>(prow, d);
    }
}

// ENC10_WHOLE (session 51): a token of 2 to 32 rows (one piece) whose head is among the last of the work
// list's (the host puts there the tokens of at most ENC10_WHOLE_MAX rows, llmc/ops/encoder.py) is summed by
// one warp over its whole row (up to ENC10_WHOLE_CW 16-byte columns a lane): dwte's row and the token's
// rows staged by cp.async in one round where they fit the warp's slots (C = 768: up to 4 rows), else a
// column at a time; where 9's sliced piece takes a warp per 512-byte slice, each reading the records and
// waiting for them before its rows. The same order per column (dwte's row, then the rows in place order:
// 8's sum of a one-piece token), the same bits. bf16 builds only.
#ifndef ENC10_WHOLE
#define ENC10_WHOLE 1
#endif
#ifndef ENC10_WHOLE_CW
#define ENC10_WHOLE_CW 3  // at most this many 16-byte columns a lane (bf16: C <= 768), else the slices
#endif
template <typename T>
__device__ __forceinline__ void encoder_single_whole_t(T* dwte, const T* dout, const int* inp, const int4* place_rec,
        int N, int C, int t, uint32_t st, int nslots) {
    constexpr int E = 16 / (int)sizeof(T);
    const int lane = threadIdx.x % WARP_SIZE, G = C / E, CW = ceil_div(G, WARP_SIZE);
    const int4 rec = place_rec[min(t + lane, N - 1)];  // lane l: the record of the token's row l
    const int n = __shfl_sync(0xffffffffu, rec.z, 0), tok = __shfl_sync(0xffffffffu, rec.w, 0);
    const int mypos = rec.x;
    const int seen = lane < n ? inp[mypos] : tok;  // checked before the first store (records of another batch trap)
    T* wrow = dwte + (size_t)tok * C;
    if ((n + 1) * CW <= nslots) {  // one round: dwte's row in slots [0, CW), row r's columns at CW (r + 1) + c
#pragma unroll 1
        for (int r = -1; r < n; r++) {
            const T* row = r < 0 ? wrow : dout + (size_t)__shfl_sync(0xffffffffu, mypos, max(r, 0)) * C;
            for (int c = 0; c < CW; c++) {
                const int g = c * WARP_SIZE + lane;
                if (g < G) cp_async16_full(st + 512u * ((r + 1) * CW + c), row + (size_t)g * E);
            }
        }
        cp_async_commit();
        cp_async_wait<0>();
        if (seen != tok) __trap();
#pragma unroll 1
        for (int c = 0; c < CW; c++) {
            const int g = c * WARP_SIZE + lane;
            if (g >= G) continue;
            float a[E], x[E];
            unpack_vec<T, E>(lds128(st + 512u * c), a);
            for (int r = 0; r < n; r++) {
                unpack_vec<T, E>(lds128(st + 512u * ((r + 1) * CW + c)), x);
#pragma unroll
                for (int k = 0; k < E; k++) a[k] += x[k];
            }
            store_vec<T, E>(wrow + (size_t)g * E, a);
        }
        return;
    }
    // (more rows than one round's slots, where the host's boundary allows it: a column at a time)
    if (seen != tok) __trap();
#pragma unroll 1
    for (int c = 0; c < CW; c++) {
        const int g = c * WARP_SIZE + lane;
        const bool live = g < G;
        float a[E];
        if (live) load_vec<T, E>(wrow + (size_t)g * E, a);
        for (int j0 = 0; j0 < n; j0 += nslots) {
#pragma unroll 1
            for (int r = 0; r < nslots && j0 + r < n; r++) {
                const int p = __shfl_sync(0xffffffffu, mypos, j0 + r);
                if (live) cp_async16_full(st + 512u * r, dout + (size_t)p * C + (size_t)g * E);
            }
            cp_async_commit();
            cp_async_wait<0>();
            for (int r = 0; r < nslots && j0 + r < n; r++) {
                if (live) {
                    float x[E];
                    unpack_vec<T, E>(lds128(st + 512u * r), x);
#pragma unroll
                    for (int k = 0; k < E; k++) a[k] += x[k];
                }
            }
        }
        if (live) store_vec<T, E>(wrow + (size_t)g * E, a);
    }
}

// ENC10_DWPE_MID (session 53; 1, on, by default): the position units before the one-piece tokens' whole rows
// (ENC10_WHOLE) in the work list, so that the short whole-row units (one round of loads) come last and fill
// the end of the launch, where the position units (two rounds) had run last (0: that order). The trace
// (ENC10_TRACE) showed 10 at B=16 moving 4-4.8 TB/s for its first 60% and then draining for 7-8 us on the
// position units that had started in the second round of the order. H200 lab, bf16, B=16, three runs in two
// calls: uniform 0.0259-0.0261 ms against 0.0268-0.0271, Zipf 0.0246-0.0248 against 0.0256-0.0262, text
// level (0.0242 against 0.0242-0.0245; one run 0.0290); with ENC_TREE_G=4 and ENC10_WHOLE_MAX=4 uniform /
// Zipf / text 0.0259-0.0265 / 0.0226-0.0228 / 0.0213-0.0215 against 0.0270-0.0271 / 0.0233 / 0.0218-0.0220;
// B=4 level. Handing out the units after each warp's first by a counter (branch wip/enc10-dyn) was slower:
// uniform B=16 0.0283 ms against 0.0270, B=4 0.0126 against 0.0111.
#ifndef ENC10_DWPE_MID
#define ENC10_DWPE_MID 1
#endif

// recs: 8's place records (N int4); nheads, nmulti, of the other heads those the host leaves on slices
// (the tokens of more than its boundary's rows; an unused int); the N piece heads; the N single tokens.
// Units: u < us: the piece at heads[u / S], slice u % S; [us, up): a one-piece token's whole row
// (ENC10_WHOLE); then (t, slice) of the dwpe units. The multi-piece units (the first nmulti * S), whose last piece adds the token's partials, get
// a warp each (warp u, unit u alone) when they are fewer than half the warps; the other units go round
// the other warps in order (unit u by warp um + (u - um) % (W - um)). A warp loads its next unit's head
// under the current unit.
template <typename T>
__device__ __forceinline__ void encoder_backward10_t(T* dwte, T* dwpe, const T* dout, const int* inp, const int* recs,
        float* partial, int* tickets, int B, int TT, int C) {
    const int N = B * TT;
    const int4* place_rec = reinterpret_cast<const int4*>(recs);
    const int* hdr = recs + 4 * (size_t)N;
    const int* heads = hdr + 4;
    const int* tok_single = heads + N;
    constexpr int E9 = Enc9Lane<T>::E, E16 = 16 / (int)sizeof(T);
    const int S = ceil_div(C / E9, WARP_SIZE), S16 = ceil_div(C / E16, WARP_SIZE);
    const int wpb = blockDim.x / WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    extern __shared__ uint4 enc10_stage[];  // [warps][max(ENC9_STAGE, ENC10_SLOTS)][32 lanes]
    constexpr int slots = ENC9_STAGE > ENC10_SLOTS ? ENC9_STAGE : ENC10_SLOTS;
    const uint32_t st = smem_u32(enc10_stage + warp * slots * WARP_SIZE + threadIdx.x % WARP_SIZE);
    const int W = gridDim.x * wpb;
    const int gw = blockIdx.x * wpb + warp;
#if ENC10_TRACE
    if (threadIdx.x % WARP_SIZE == 0 && gw < ENC10_TRACE_WARPS) enc10_entry[gw] = enc10_globaltimer();
#endif
    // the first unit's head, read beside the header rather than after it: a warp's first unit is gw whatever
    // the header says, and if it is a piece's slice, its head is heads[gw / S] (session 53: a warp waited
    // 0.9-1.9 us from its start to its first unit, two reads one after the other)
    const int head0 = heads[min(gw / S, N - 1)];
    const int nh = hdr[0], nmulti = hdr[1];
    const bool whole = ENC10_WHOLE && sizeof(T) == 2 && ceil_div(C / E16, WARP_SIZE) <= ENC10_WHOLE_CW && C % E16 == 0;
    const int nsl = whole ? hdr[2] : nh - nmulti;  // the one-piece tokens on slices
    const int us = (nmulti + nsl) * S, up = us + (nh - nmulti - nsl), um = nmulti * S, total = up + TT * S16;
    const int nd = TT * S16;  // the position units
    // the units: [0, us) a piece's 16-byte slice (9's), then the position units (t, slice) [us, us + nd) and the
    // one-piece tokens' whole rows (ENC10_WHOLE, the last hdr[0] - hdr[1] - hdr[2] heads), or (ENC10_DWPE_MID=0)
    // the whole rows [us, up) and then the position units
    auto has_head = [&](int v) { return ENC10_DWPE_MID ? v < us || v >= us + nd : v < up; };
    auto head_of = [&](int v) { return heads[v < us ? v / S : nmulti + nsl + (v - (ENC10_DWPE_MID ? us + nd : us))]; };
    int u, stride, last;
    if (2 * um < W) {  // warps of their own for the multi-piece units
        if (gw < um) { u = gw; stride = W; last = gw + 1; }
        else { u = gw; stride = W - um; last = total; }  // (gw + k (W - um): every unit from um once)
    } else {
        u = gw; stride = W; last = total;
    }
    int head = has_head(u) && u < last ? (u < us ? head0 : head_of(u)) : 0;  // (u = gw here)
    for (int next; u < last; u = next) {
#if ENC10_TRACE
        const unsigned long long g0 = enc10_globaltimer(), c0 = clock64();
#endif
        const int t = head;
        next = u + stride;
        if (has_head(next) && next < last) head = head_of(next);  // the next unit's, under this one
        const int kd = ENC10_DWPE_MID ? u - us : u - up;  // (a position unit's index)
        if (u < us) encoder_piece_slice_t<T>(dwte, dout, inp, place_rec, partial, tickets, N, C, t, u % S, st);
        else if (has_head(u)) encoder_single_whole_t<T>(dwte, dout, inp, place_rec, N, C, t, st, slots);
        else encoder_dwpe_single_t<T>(dwte, dwpe, dout, inp, tok_single, B, TT, C, kd / S16, kd % S16, st);
#if ENC10_TRACE
        __syncwarp();
        if (threadIdx.x % WARP_SIZE == 0 && u < ENC10_TRACE_MAX) {
            unsigned long long* r = enc10_trace + (size_t)u * 6;
            r[0] = g0; r[1] = enc10_globaltimer(); r[2] = c0; r[3] = clock64(); r[4] = enc10_smid(); r[5] = gw;
        }
#endif
    }
}

extern "C" __global__ void encoder_backward_kernel10(float* dwte, float* dwpe, const float* dout, const int* inp,
        const int* recs, float* partial, int* tickets, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward10_t<float>(dwte, dwpe, dout, inp, recs, partial, tickets, B, T, C);
}
extern "C" __global__ void encoder_backward_kernel10_bf16(bf16* dwte, bf16* dwpe, const bf16* dout, const int* inp,
        const int* recs, float* partial, int* tickets, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward10_t<bf16>(dwte, dwpe, dout, inp, recs, partial, tickets, B, T, C);
}

// ----------------------------------------------------------------------------------------------
// encoder_backward's floor (session 51; built only with -DENC_FLOOR_BENCH=1, for
// dev/cuda/encoder_backward_floor.py): bare kernels moving whole rows of C bf16 the way encoder_backward
// must, against a copy of the same bytes. A warp per R rows (lanes over 16-byte columns, up to 3 a lane:
// C <= 768), a grid of N / R warps. MODE 0: out[i] = in[i]; 1: out[idx[i]] += in[i] (idx distinct: the
// dwte rows of tokens seen once); 2: out[i] = in[idx[i]] (encoder_forward's gather); 3: out[idx[i]] =
// in[i]; 4: out[i] += in[i]. And the position units without a work list: a warp per (t, 512-byte slice)
// (or per t, whole rows) summing the B rows of dout into dwpe[t] and adding each onto dwte[idx] (every
// id distinct).
#if ENC_FLOOR_BENCH
__device__ __forceinline__ uint4 enc_floor_add8(uint4 a, uint4 b) {
    float x[8], y[8];
    unpack_vec<bf16, 8>(a, x);
    unpack_vec<bf16, 8>(b, y);
#pragma unroll
    for (int k = 0; k < 8; k++) x[k] += y[k];
    uint4 r;
    pack_vec<bf16, 8>(x, r);
    return r;
}

template <int MODE, int R>
__device__ __forceinline__ void enc_floor_rows(const uint4* __restrict__ in, uint4* __restrict__ out,
        const int* __restrict__ idx, int N, int C16) {
    constexpr int CW = 3;
    const int lane = threadIdx.x % WARP_SIZE;
    const int i0 = ((blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE) * R;
    if (i0 >= N) return;
    constexpr bool indexed = MODE == 1 || MODE == 2 || MODE == 3, rmw = MODE == 1 || MODE == 4;
    int src[R], dst[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int i = min(i0 + r, N - 1), j = indexed ? idx[i] : i;
        src[r] = MODE == 2 ? j : i;
        dst[r] = MODE == 2 ? i : j;
    }
    uint4 a[R][CW], b[R][CW];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < CW; c++) {
            const int col = lane + WARP_SIZE * c;
            if (col < C16) {
                a[r][c] = __ldcs(in + (size_t)src[r] * C16 + col);
                if (rmw) b[r][c] = out[(size_t)dst[r] * C16 + col];
            }
        }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < CW; c++) {
            const int col = lane + WARP_SIZE * c;
            if (col < C16 && i0 + r < N) out[(size_t)dst[r] * C16 + col] = rmw ? enc_floor_add8(a[r][c], b[r][c]) : a[r][c];
        }
}

#define ENC_FLOOR_ROWS(MODE, R) \
extern "C" __global__ void encoder_floor_m##MODE##_r##R(const uint4* in, uint4* out, const int* idx, int N, int C16) { \
    LLMC_PDL_WAIT(); \
    enc_floor_rows<MODE, R>(in, out, idx, N, C16); }
ENC_FLOOR_ROWS(0, 1) ENC_FLOOR_ROWS(0, 4) ENC_FLOOR_ROWS(1, 1) ENC_FLOOR_ROWS(1, 4) ENC_FLOOR_ROWS(2, 1)
ENC_FLOOR_ROWS(2, 4) ENC_FLOOR_ROWS(3, 1) ENC_FLOOR_ROWS(3, 4) ENC_FLOOR_ROWS(4, 1) ENC_FLOOR_ROWS(4, 4)

// a warp per (t, slice s of CW 16-byte columns a lane): dwpe[t] += the B rows of dout at t (in b order),
// each row also onto dwte[idx[b, t]]; rows RB at a time, their dout and old dwte loads issued together
template <int CW, int RB>
__device__ __forceinline__ void enc_floor_pos(const uint4* __restrict__ dout, uint4* __restrict__ dwte,
        uint4* __restrict__ dwpe, const int* __restrict__ idx, int B, int T, int C16, int t, int s) {
    const int lane = threadIdx.x % WARP_SIZE, col0 = s * WARP_SIZE * CW;
    float acc[CW][8];
#pragma unroll
    for (int c = 0; c < CW; c++)
#pragma unroll
        for (int k = 0; k < 8; k++) acc[c][k] = 0.0f;
    uint4 pold[CW];
#pragma unroll
    for (int c = 0; c < CW; c++) pold[c] = dwpe[(size_t)t * C16 + col0 + lane + WARP_SIZE * c];
    const int myid = lane < B ? idx[(size_t)lane * T + t] : 0;  // (B <= 32)
    for (int b0 = 0; b0 < B; b0 += RB) {
        uint4 x[RB][CW], w[RB][CW];
        int id[RB];
#pragma unroll
        for (int r = 0; r < RB; r++) id[r] = __shfl_sync(0xffffffffu, myid, min(b0 + r, B - 1));
#pragma unroll
        for (int r = 0; r < RB; r++)
#pragma unroll
            for (int c = 0; c < CW; c++) {
                const int col = col0 + lane + WARP_SIZE * c;
                if (b0 + r < B) {
                    x[r][c] = __ldcs(dout + ((size_t)(b0 + r) * T + t) * C16 + col);
                    w[r][c] = dwte[(size_t)id[r] * C16 + col];
                }
            }
#pragma unroll
        for (int r = 0; r < RB; r++)
#pragma unroll
            for (int c = 0; c < CW; c++) {
                if (b0 + r >= B) continue;
                const int col = col0 + lane + WARP_SIZE * c;
                float fx[8], fw[8];
                unpack_vec<bf16, 8>(x[r][c], fx);
                unpack_vec<bf16, 8>(w[r][c], fw);
#pragma unroll
                for (int k = 0; k < 8; k++) {
                    acc[c][k] += fx[k];
                    fw[k] += fx[k];
                }
                uint4 o;
                pack_vec<bf16, 8>(fw, o);
                dwte[(size_t)id[r] * C16 + col] = o;
            }
    }
#pragma unroll
    for (int c = 0; c < CW; c++) {
        float fp[8];
        unpack_vec<bf16, 8>(pold[c], fp);
#pragma unroll
        for (int k = 0; k < 8; k++) fp[k] += acc[c][k];
        uint4 o;
        pack_vec<bf16, 8>(fp, o);
        dwpe[(size_t)t * C16 + col0 + lane + WARP_SIZE * c] = o;
    }
}

// C16 = 96 (C = 768): 3 slices of one column a lane, or one warp of 3 columns a lane
extern "C" __global__ void encoder_floor_pos_slices(const uint4* dout, uint4* dwte, uint4* dwpe, const int* idx,
        int B, int T, int C16) {
    LLMC_PDL_WAIT();
    const int u = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE, S = C16 / WARP_SIZE;
    if (u < T * S) enc_floor_pos<1, 8>(dout, dwte, dwpe, idx, B, T, C16, u / S, u % S);
}
extern "C" __global__ void encoder_floor_pos_whole(const uint4* dout, uint4* dwte, uint4* dwpe, const int* idx,
        int B, int T, int C16) {
    LLMC_PDL_WAIT();
    const int u = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    if (u < T) enc_floor_pos<3, 2>(dout, dwte, dwpe, idx, B, T, C16, u, 0);
}
#endif

extern "C" __global__ void encoder_forward_kernel1_bf16(bf16* out, const int* inp, const bf16* wte,
        const bf16* wpe, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_forward1<bf16>(out, inp, wte, wpe, B, T, C);
}
extern "C" __global__ void encoder_forward_kernel3_bf16(bf16* __restrict__ out, const int* __restrict__ inp,
        const bf16* __restrict__ wte, const bf16* __restrict__ wpe, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_forward3<bf16>(out, inp, wte, wpe, B, T, C);
}
extern "C" __global__ void encoder_backward_kernel2_bf16(bf16* dwte, bf16* dwpe, const bf16* dout,
        const int* inp, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward_owner_t<bf16>(dwte, dwpe, dout, inp, B, T, C, false);
}
extern "C" __global__ void encoder_backward_kernel3_bf16(bf16* dwte, bf16* dwpe, const bf16* dout,
        const int* inp, int B, int T, int C) {
    LLMC_PDL_WAIT();
    encoder_backward_owner_t<bf16>(dwte, dwpe, dout, inp, B, T, C, C % Vec16<bf16>::N == 0);
}
extern "C" __global__ void encoder_decode_kernel1_bf16(bf16* out, const int* inp, const bf16* wte,
        const bf16* wpe, int B, int C) {
    LLMC_PDL_WAIT();
    encoder_decode1<bf16>(out, inp, wte, wpe, B, C);
}
