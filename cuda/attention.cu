// Attention: the permutes that move q, k, v between the model's (B, T, 3, NH, hs) layout and
// per-head (3, B, NH, T, hs), the fused ("flash") causal attention, and the decode kernels (one new
// query per sequence over a KV cache) for sampling.
// The composite attention (variant 1) runs q k^T and att v in the GEMM engines (cuda/gemm.cu through
// llmc.ops.gemm.gemm_build) around the causal softmax of cuda/softmax.cu; llmc/ops/attention.py
// composes them.
//
// permutes (helpers of the composite, no variant flag):
//   permute_kernel1/2    dst(S,B,NH,T,hs) <- src(B,T,S,NH,hs); 1 scalar, 2 float4 (hs % 4 == 0)
//   unpermute_kernel1/2  dst(B,T,S,NH,hs) <- src(S,B,NH,T,hs); the inverse
// decode:
//   attention_decode_kernel1  one block per (b, h): scores in shared memory, block softmax, att @ v
//   attention_decode_kernel2  split over chunks of 64 keys (B*NH x maxT/64 blocks, a thread per key),
//                             + attention_decode_combine_kernel2 merging the chunks' softmax states
//   (both take the new token's q, k, v straight from the qkv matmul's (B,3C) output: its k, v are
//    used for position pos and written into the caches there, so no separate append launch)
//   attention_kv_fill_kernel1    after the prompt's forward pass: k, v of positions 0..T-1 from the
//                                forward's qkvr (q|k|v, each (B,NH,T,hs)) into the caches
// bf16 (--precision bf16): <name>_bf16 entry points of the fused variants 2, 3 (section at the end;
// bf16 mma.sync m16n8k16, lse fp32), of the decode kernels and the kv fill (templated on the element
// type, fp32 math), and permute_kernel2_bf16 (16-byte moves) for the fused forward's qkvr.
#include "common.cuh"
#include "elem.cuh"  // bf16; to_f32 (loads widen exactly), from_f32<E> (stores round to nearest even)
// 4 consecutive elements (16 bytes of fp32, 8 of bf16; p aligned to that) as a float4
__device__ __forceinline__ float4 load4f(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4f(const bf16* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// ----------------------------------------------------------------------------------------------
// permutes between (B, T, S, NH, hs) and (S, B, NH, T, hs); S = 3 for q|k|v, 1 for y.
// One thread per element (or float4) of the destination, so writes are coalesced; reads are
// coalesced within runs of hs contiguous floats. Pure data movement: 2 * bytes of the tensor.

template <typename V>
__device__ __forceinline__ void permute_impl(V* dst, const V* src, int B, int T, int S, int NH, int hsv) {
    // dst (S, B, NH, T, hsv) <- src (B, T, S, NH, hsv); hsv = hs in units of V
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= S * B * NH * T * hsv) return;
    int d = idx % hsv, r = idx / hsv;
    int t = r % T; r /= T;
    int h = r % NH; r /= NH;
    int b = r % B; int s = r / B;
    dst[idx] = src[(((size_t)(b * T + t) * S + s) * NH + h) * hsv + d];
}
template <typename V>
__device__ __forceinline__ void unpermute_impl(V* dst, const V* src, int B, int T, int S, int NH, int hsv) {
    // dst (B, T, S, NH, hsv) <- src (S, B, NH, T, hsv)
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= S * B * NH * T * hsv) return;
    int d = idx % hsv, r = idx / hsv;
    int h = r % NH; r /= NH;
    int s = r % S; r /= S;
    int t = r % T; int b = r / T;
    dst[idx] = src[(((size_t)(s * B + b) * NH + h) * T + t) * hsv + d];
}

extern "C" __global__ void permute_kernel1(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    LLMC_PDL_WAIT();
    permute_impl<float>(dst, src, B, T, S, NH, hs);
}
extern "C" __global__ void permute_kernel2(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    LLMC_PDL_WAIT();
    permute_impl<float4>(reinterpret_cast<float4*>(dst), reinterpret_cast<const float4*>(src), B, T, S, NH, hs / 4);
}
extern "C" __global__ void unpermute_kernel1(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    LLMC_PDL_WAIT();
    unpermute_impl<float>(dst, src, B, T, S, NH, hs);
}
extern "C" __global__ void unpermute_kernel2(float* dst, const float* src, int B, int T, int S, int NH, int hs) {
    LLMC_PDL_WAIT();
    unpermute_impl<float4>(reinterpret_cast<float4*>(dst), reinterpret_cast<const float4*>(src), B, T, S, NH, hs / 4);
}

// ----------------------------------------------------------------------------------------------
// decode: one new query per sequence at position pos over cached keys/values 0..pos. The decode
// kernels read pos from device memory (posp), so that a CUDA graph captured once replays every step.
// out (B, C); qkv (B, 3C): q | k | v of the new token, heads side by side (the qkv matmul's output);
// kcache/vcache (B, NH, maxT, hs) hold positions 0..pos-1. The new k, v are read from qkv for
// position pos and written into the caches at pos by the one block (or chunk) that covers pos;
// nothing else reads the caches at pos during the launch.
// Every decode kernel is templated on the element type E of out, qkv and the caches (float, or bf16
// for the _bf16 entry points); scores, softmax and sums are fp32 either way.
// Version 1: one block per (b, h). Dynamic smem: hs (q) + maxT (scores) + blockDim.x floats.
template <typename E>
__device__ __forceinline__ void attention_decode1(E* out, const E* qkv, E* kcache, E* vcache, const int* posp,
                                                  int B, int NH, int hs, int maxT, float scale) {
    extern __shared__ float sm[];
    int pos = *posp;
    float* sq = sm;             // (hs)
    float* sp = sm + hs;        // (maxT) scores, then probabilities
    float* part = sp + maxT;    // (blockDim.x) partial sums of att @ v
    __shared__ float red[WARP_SIZE];
    int bh = blockIdx.x, b = bh / NH, h = bh % NH, C = NH * hs;
    int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, nwarps = blockDim.x / WARP_SIZE;
    const E* k = kcache + (size_t)bh * maxT * hs;
    const E* v = vcache + (size_t)bh * maxT * hs;
    const E* row = qkv + (size_t)b * 3 * C + h * hs;  // q; + C: the new k; + 2C: the new v
    for (int d = tid; d < hs; d += blockDim.x) {
        sq[d] = to_f32(row[d]) * scale;
        kcache[((size_t)bh * maxT + pos) * hs + d] = row[C + d];      // append (read from qkv below)
        vcache[((size_t)bh * maxT + pos) * hs + d] = row[2 * C + d];
    }
    __syncthreads();
    // scores: one warp per cached key, lanes across hs
    for (int s = warp; s <= pos; s += nwarps) {
        const E* kr = s == pos ? row + C : k + (size_t)s * hs;
        float dot = 0.0f;
        for (int d = lane; d < hs; d += WARP_SIZE) dot += sq[d] * to_f32(kr[d]);
        dot = warp_reduce_sum(dot);
        if (lane == 0) sp[s] = dot;
    }
    __syncthreads();
    float maxv = -FLT_MAX;
    for (int s = tid; s <= pos; s += blockDim.x) maxv = fmaxf(maxv, sp[s]);
    maxv = block_reduce_max(maxv, red);
    float sum = 0.0f;
    for (int s = tid; s <= pos; s += blockDim.x) { float e = expf(sp[s] - maxv); sp[s] = e; sum += e; }
    sum = block_reduce_sum(sum, red);  // its barriers also publish sp
    float inv = 1.0f / sum;
    // att @ v: G = blockDim.x / hs groups of threads (at least 1) split the keys; thread (g, d)
    // sums keys g, g+G, ...; then the G partials of each d are added.
    int G = max(1, (int)blockDim.x / hs);
    for (int i = tid; i < G * hs; i += blockDim.x) {
        int g = i / hs, d = i % hs;
        float acc = 0.0f;
        for (int s = g; s <= pos; s += G) acc += sp[s] * to_f32(s == pos ? row[2 * C + d] : v[(size_t)s * hs + d]);
        part[i] = acc;
    }
    __syncthreads();
    for (int d = tid; d < hs; d += blockDim.x) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) acc += part[g * hs + d];
        out[(size_t)b * C + h * hs + d] = from_f32<E>(acc * inv);
    }
}
extern "C" __global__ void attention_decode_kernel1(float* out, const float* qkv, float* kcache, float* vcache,
                                                    const int* posp, int B, int NH, int hs, int maxT, float scale) {
    LLMC_PDL_WAIT();
    attention_decode1<float>(out, qkv, kcache, vcache, posp, B, NH, hs, maxT, scale);
}
extern "C" __global__ void attention_decode_kernel1_bf16(bf16* out, const bf16* qkv, bf16* kcache, bf16* vcache,
                                                         const int* posp, int B, int NH, int hs, int maxT, float scale) {
    LLMC_PDL_WAIT();
    attention_decode1<bf16>(out, qkv, kcache, vcache, posp, B, NH, hs, maxT, scale);
}

// version 2, split over the keys ("flash decoding"): kernel 1 runs one block per (b, h), a dozen
// blocks at batch 1, each walking up to 1024 keys with one warp reduction per key: latency-bound.
// Here grid (B*NH, ceil(maxT/64)): block c takes keys 64c..64c+63 (those <= pos; blocks past pos
// return at once) with one thread per key (hs/4 independent float4 loads each, the dot product in
// registers), and writes its chunk's softmax state to part (B*NH, chunks, hs+2): the unnormalised
// sum over its keys of exp(score - m) * v (hs floats), then m (its max score) and l (the sum of
// exp(score - m)). attention_decode_combine_kernel2 rescales the chunks to the global max and
// normalises. Block: 128 threads (2 groups of hs for p @ v when hs = 64). hs % 4 == 0.
#define DECODE_CHUNK 64
// part is fp32 in both builds.
template <typename E>
__device__ __forceinline__ void attention_decode2(float* part, const E* qkv, E* kcache, E* vcache, const int* posp,
                                                  int B, int NH, int hs, int maxT, float scale) {
    extern __shared__ float4 sm4[];
    float* sq = reinterpret_cast<float*>(sm4);  // (hs) the scaled query
    float* sp = sq + hs;                        // (DECODE_CHUNK) scores, then exp(score - m)
    float* acc = sp + DECODE_CHUNK;             // (G * hs) partial sums of p @ v
    const int bh = blockIdx.x, chunk = blockIdx.y, pos = *posp, s0 = chunk * DECODE_CHUNK;
    if (s0 > pos) return;                       // the combine reads chunks 0..pos/64 only
    float* dst = part + ((size_t)bh * gridDim.y + chunk) * (hs + 2);
    const int n = min(pos + 1 - s0, DECODE_CHUNK);
    const int b = bh / NH, h = bh % NH, C = NH * hs, tid = threadIdx.x, hs4 = hs / 4;
    const E* k = kcache + ((size_t)bh * maxT + s0) * hs;
    const E* v = vcache + ((size_t)bh * maxT + s0) * hs;
    const E* row = qkv + (size_t)b * 3 * C + h * hs;  // q; + C: the new k; + 2C: the new v
    const int last = pos - s0;                        // the new token's index here, if < n
    for (int d = tid; d < hs; d += blockDim.x) {
        sq[d] = to_f32(row[d]) * scale;
        if (last < n) {                                   // this chunk covers pos: append
            kcache[((size_t)bh * maxT + pos) * hs + d] = row[C + d];
            vcache[((size_t)bh * maxT + pos) * hs + d] = row[2 * C + d];
        }
    }
    __syncthreads();
    const float4* sq4 = reinterpret_cast<const float4*>(sq);
    for (int s = tid; s < n; s += blockDim.x) {
        const E* kr = s == last ? row + C : k + (size_t)s * hs;
        float dot = 0.0f;
#pragma unroll 8
        for (int i = 0; i < hs4; i++) {
            const float4 kv = load4f(kr + 4 * i), qv = sq4[i];
            dot = fmaf(qv.x, kv.x, fmaf(qv.y, kv.y, fmaf(qv.z, kv.z, fmaf(qv.w, kv.w, dot))));
        }
        sp[s] = dot;
    }
    __syncthreads();
    if (tid < WARP_SIZE) {                      // max and sum over <= 64 scores: one warp
        float m = -FLT_MAX;
        for (int s = tid; s < n; s += WARP_SIZE) m = fmaxf(m, sp[s]);
        m = warp_reduce_max(m);
        float l = 0.0f;
        for (int s = tid; s < n; s += WARP_SIZE) { const float e = expf(sp[s] - m); sp[s] = e; l += e; }
        l = warp_reduce_sum(l);
        if (tid == 0) { dst[hs] = m; dst[hs + 1] = l; }
    }
    __syncthreads();
    const int G = max(1, (int)blockDim.x / hs);  // groups of hs threads split the chunk's keys
    for (int i = tid; i < G * hs; i += blockDim.x) {
        const int g = i / hs, d = i % hs;
        float a = 0.0f;
        for (int s = g; s < n; s += G) a = fmaf(sp[s], to_f32(s == last ? row[2 * C + d] : v[(size_t)s * hs + d]), a);
        acc[i] = a;
    }
    __syncthreads();
    for (int d = tid; d < hs; d += blockDim.x) {
        float a = 0.0f;
        for (int g = 0; g < G; g++) a += acc[g * hs + d];
        dst[d] = a;
    }
}
extern "C" __global__ void __launch_bounds__(128) attention_decode_kernel2(float* part, const float* qkv,
        float* kcache, float* vcache, const int* posp, int B, int NH, int hs, int maxT, float scale) {
    LLMC_PDL_WAIT();
    attention_decode2<float>(part, qkv, kcache, vcache, posp, B, NH, hs, maxT, scale);
}
extern "C" __global__ void __launch_bounds__(128) attention_decode_kernel2_bf16(float* part, const bf16* qkv,
        bf16* kcache, bf16* vcache, const int* posp, int B, int NH, int hs, int maxT, float scale) {
    LLMC_PDL_WAIT();
    attention_decode2<bf16>(part, qkv, kcache, vcache, posp, B, NH, hs, maxT, scale);
}

// Merge the chunks 0..pos/64 of each (b, h): out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c,
// M the largest m_c. One block per (b, h), a thread per channel of the head.
template <typename E>
__device__ __forceinline__ void attention_decode_combine2(E* out, const float* part, const int* posp, int NH, int hs,
                                                          int chunks) {
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH, used = *posp / DECODE_CHUNK + 1;
    const float* p = part + (size_t)bh * chunks * (hs + 2);
    float M = -FLT_MAX;
    for (int c = 0; c < used; c++) M = fmaxf(M, p[(size_t)c * (hs + 2) + hs]);
    for (int d = threadIdx.x; d < hs; d += blockDim.x) {
        float L = 0.0f, a = 0.0f;
        for (int c = 0; c < used; c++) {
            const float* pc = p + (size_t)c * (hs + 2);
            const float w = expf(pc[hs] - M);
            L = fmaf(w, pc[hs + 1], L);
            a = fmaf(w, pc[d], a);
        }
        out[(size_t)b * NH * hs + h * hs + d] = from_f32<E>(a / L);
    }
}
extern "C" __global__ void attention_decode_combine_kernel2(float* out, const float* part, const int* posp,
                                                            int NH, int hs, int chunks) {
    LLMC_PDL_WAIT();
    attention_decode_combine2<float>(out, part, posp, NH, hs, chunks);
}
extern "C" __global__ void attention_decode_combine_kernel2_bf16(bf16* out, const float* part, const int* posp,
                                                                 int NH, int hs, int chunks) {
    LLMC_PDL_WAIT();
    attention_decode_combine2<bf16>(out, part, posp, NH, hs, chunks);
}

// qkvr holds q | k | v, each (B, NH, T, hs) (what attention_forward saves); copy k and v into
// positions 0..T-1 of the caches (B, NH, maxT, hs). One thread per element of k.
template <typename E>
__device__ __forceinline__ void attention_kv_fill1(E* kcache, E* vcache, const E* qkvr, int B, int NH, int T, int hs,
                                                   int maxT) {
    size_t n = (size_t)B * NH * T * hs;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    size_t d = i % hs, t = (i / hs) % T, bh = i / ((size_t)hs * T);
    size_t dst = (bh * maxT + t) * hs + d;
    kcache[dst] = qkvr[n + i];
    vcache[dst] = qkvr[2 * n + i];
}
extern "C" __global__ void attention_kv_fill_kernel1(float* kcache, float* vcache, const float* qkvr,
                                                     int B, int NH, int T, int hs, int maxT) {
    LLMC_PDL_WAIT();
    attention_kv_fill1<float>(kcache, vcache, qkvr, B, NH, T, hs, maxT);
}
extern "C" __global__ void attention_kv_fill_kernel1_bf16(bf16* kcache, bf16* vcache, const bf16* qkvr,
                                                          int B, int NH, int T, int hs, int maxT) {
    LLMC_PDL_WAIT();
    attention_kv_fill1<bf16>(kcache, vcache, qkvr, B, NH, T, hs, maxT);
}

// ----------------------------------------------------------------------------------------------
// Fused causal attention ("flash": Dao et al. 2022/2023), head size 64, TF32 tensor cores
// (mma.sync m16n8k8), fp32 accumulation and fp32 softmax. Nothing of size T x T goes to memory:
// the forward keeps per row the log-sum-exp of the scaled scores, and the backward recomputes the
// probabilities from it, tile by tile.
//   flash_attention_forward_kernel<N>      out (B,T,C) = softmax(scale q k^T, causal) v;
//                                          lse (B,NH,T) = log sum_{s<=t} exp(scale q_t.k_s)
//   flash_attention_backward_dq_kernel<N>  D (B,NH,T) = rowsum(dout * out); dq -> dinp[..., 0:C]
//   flash_attention_backward_dkdv_kernel<N>  dk, dv -> dinp[..., C:2C], dinp[..., 2C:3C] (reads D)
// N = 2 (attention variant 2): each tile is loaded, rounded to tf32 and stored to shared memory by
//   the threads, between two barriers: the block waits for every load.
// N = 3 (variant 3): tiles are double-buffered and copied with cp.async, the next tile in flight
//   while the tensor cores work on this one; values are rounded to tf32 as fragments are read.
// q, k, v come from qkvr (3, B, NH, T, 64) as permute_kernel writes it; out, dout are (B,T,C) and
// dinp (B,T,3C): the kernels read and write the model's layouts directly (no unpermute). dq is
// summed over key tiles inside one block and dk, dv over query tiles inside another: no atomics,
// the results are deterministic.
// One block = 4 warps = 64 rows (queries in the forward and dq kernels, keys in dkdv); a warp owns
// 16 rows and sweeps the other side in tiles of 64 positions staged in shared memory; the causal
// mask skips every tile above the diagonal. Blocks with the most tiles are scheduled first.
//
// Fragments (g = lane/4, t = lane%4; layouts at mma_tf32 in mma.cuh). A product that contracts
// over the head dimension uses the plain mapping (k-index t -> dim 8kk+t, t+4 -> 8kk+t+4). A
// product that contracts over the 64 positions of a tile takes its A operand straight from the
// accumulators of the product before it: accumulator columns 2t, 2t+1 of n-tile j serve as
// k-indices t, t+4 of k-step j, i.e. k-index t means position 8j+2t and t+4 means 8j+2t+1; the B
// operand reads the same two rows. No shuffles, no trip through shared memory.
// Shared tiles are 64 rows of FA_LD = 68 floats: both read patterns, (row g, col t) and
// (row 2t, col g), hit 32 distinct banks; rows start 16-byte aligned for float4 / cp.async.
#include "mma.cuh"

#define FA_D 64        // head size
#define FA_TILE 64     // rows per block and positions per tile
#define FA_LD 68       // shared-memory row stride in floats
#define FA_THREADS 128
#define FA_TILE_FLOATS (FA_TILE * FA_LD)
// the bf16 kernels' tiles (section at the end): rows of FB_LD = 72 bf16 (144 bytes; see there why)
#define FB_LD 72                             // shared row stride in bf16
#define FB_TILE_ELEMS (FA_TILE * FB_LD)      // bf16 per staged 64 x 64 tile
#define FB_TILE_BYTES (FB_TILE_ELEMS * 2)    // 9216
// elements of one staged tile of element type E (the shared helpers below take either)
template <typename E> constexpr int FA_TILE_ELEMS = sizeof(E) == 4 ? FA_TILE_FLOATS : FB_TILE_ELEMS;
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f
// FA_KK_OUTER (default 1; build with -DFA_KK_OUTER=0 to compare): the q k^T-type products loop
// over head-dim k-steps outside and tiles inside, 8 independent accumulator chains in flight,
// instead of one accumulator's 8 k-steps back to back. Measured on the H100 (B=4 T=1024 C=768
// NH=12, permute included): forward 2 0.151 -> 0.128 ms, forward 3 0.136 either way, backward
// unchanged. (Rounding variant 3's landed tiles in shared memory once, instead of at each fragment
// read, was also tried: 0.136 -> 0.145 ms forward, 0.311 -> 0.321 backward; not kept.)
#ifndef FA_KK_OUTER
#define FA_KK_OUTER 1
#endif

__device__ __forceinline__ float fa_exp2(float x) {  // 2^x, ~2 ulp; exp2(-inf) = 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float fa_tf32(float x) { return __uint_as_float(tf32_round(x)); }
// a tile value as an mma operand: staged values are already rounded (R = false), raw ones not
template <bool R>
__device__ __forceinline__ uint32_t fa_op(float x) { return R ? tf32_round(x) : __float_as_uint(x); }

// rows r0..r0+63 (row stride ld floats) of g into the shared tile s, rounded to tf32; rows >= T are 0
__device__ __forceinline__ void fa_stage(float* s, const float* g, int r0, int T, int ld) {
#pragma unroll
    for (int i = 0; i < FA_TILE * FA_D / 4 / FA_THREADS; i++) {
        int idx = threadIdx.x + i * FA_THREADS;
        int r = idx >> 4, c = (idx & 15) * 4;
        float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r0 + r < T) v = load4(g + (size_t)(r0 + r) * ld + c);
        v.x = fa_tf32(v.x); v.y = fa_tf32(v.y); v.z = fa_tf32(v.z); v.w = fa_tf32(v.w);
        store4(s + r * FA_LD + c, v);
    }
}
// the same rows copied raw with cp.async (not waited for); rows >= T are zero-filled
__device__ __forceinline__ void fa_stage_async(float* s, const float* g, int r0, int T, int ld) {
#pragma unroll
    for (int i = 0; i < FA_TILE * FA_D / 4 / FA_THREADS; i++) {
        int idx = threadIdx.x + i * FA_THREADS;
        int r = idx >> 4, c = (idx & 15) * 4;
        bool ok = r0 + r < T;
        const float* src = g + (size_t)(ok ? r0 + r : 0) * ld + c;
        cp_async16(smem_u32(s + r * FA_LD + c), src, ok ? 16 : 0);
    }
}
// bf16 tiles: the same rows into rows of FB_LD, as they are (bf16 is what the bf16 mma reads);
// by the threads, rows >= T are 0
__device__ __forceinline__ void fa_stage(bf16* s, const bf16* g, int r0, int T, int ld) {
#pragma unroll
    for (int i = 0; i < FA_TILE * FA_D / 8 / FA_THREADS; i++) {
        int idx = threadIdx.x + i * FA_THREADS;
        int r = idx >> 3, c = (idx & 7) * 8;  // 8 chunks of 16 bytes per row
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r0 + r < T) v = *reinterpret_cast<const uint4*>(g + (size_t)(r0 + r) * ld + c);
        *reinterpret_cast<uint4*>(s + r * FB_LD + c) = v;
    }
}
// and with cp.async (not waited for); rows >= T are zero-filled
__device__ __forceinline__ void fa_stage_async(bf16* s, const bf16* g, int r0, int T, int ld) {
#pragma unroll
    for (int i = 0; i < FA_TILE * FA_D / 8 / FA_THREADS; i++) {
        int idx = threadIdx.x + i * FA_THREADS;
        int r = idx >> 3, c = (idx & 7) * 8;
        bool ok = r0 + r < T;
        const bf16* src = g + (size_t)(ok ? r0 + r : 0) * ld + c;
        cp_async16(smem_u32(s + r * FB_LD + c), src, ok ? 16 : 0);
    }
}
// 64 per-row values (lse or D) from v[r0..] into s with cp.async, one per thread of `first`..+63; 0 past T
__device__ __forceinline__ void fa_rows_async(float* s, const float* v, int r0, int T, int first) {
    int i = threadIdx.x - first;
    if (i >= 0 && i < FA_TILE) {
        bool ok = r0 + i < T;
        cp_async4(smem_u32(s + i), v + (ok ? r0 + i : 0), ok ? 4 : 0);
    }
}

// q (which 0), k (1) or v (2) of this block's (batch, head) = blockIdx.y in qkvr (3, B, NH, T, 64)
template <typename E>
__device__ __forceinline__ const E* fa_head(const E* qkvr, int which, int B, int NH, int T) {
    return qkvr + ((size_t)which * B * NH + blockIdx.y) * T * FA_D;
}
// the k and v tiles of positions r0.. into s and s + one tile: staged (PIPE false) or in flight (true)
template <bool PIPE, typename E>
__device__ __forceinline__ void fa_load_kv(E* s, const E* k, const E* v, int r0, int T) {
    if (PIPE) {
        fa_stage_async(s, k, r0, T, FA_D);
        fa_stage_async(s + FA_TILE_ELEMS<E>, v, r0, T, FA_D);
    } else {
        fa_stage(s, k, r0, T, FA_D);
        fa_stage(s + FA_TILE_ELEMS<E>, v, r0, T, FA_D);
    }
}
// A fragment of rows row0..row0+15, head-dim k-step kk (from a staged, rounded tile)
__device__ __forceinline__ void fa_frag_a(uint32_t (&a)[4], const float* s, int row0, int kk, int g, int t) {
    const float* p = s + (row0 + g) * FA_LD + 8 * kk + t;
    a[0] = __float_as_uint(p[0]);
    a[1] = __float_as_uint(p[8 * FA_LD]);
    a[2] = __float_as_uint(p[4]);
    a[3] = __float_as_uint(p[8 * FA_LD + 4]);
}
// B fragment contracting over the head dim: B[k = dim 8kk+t (+4)][n = tile row n0+g]
template <bool R>
__device__ __forceinline__ void fa_frag_b_dim(uint32_t (&b)[2], const float* s, int n0, int kk, int g, int t) {
    const float* p = s + (n0 + g) * FA_LD + 8 * kk + t;
    b[0] = fa_op<R>(p[0]);
    b[1] = fa_op<R>(p[4]);
}
// B fragment contracting over tile positions (k-step j): B[k = row 8j+2t (+1)][n = dim n0+g]
template <bool R>
__device__ __forceinline__ void fa_frag_b_pos(uint32_t (&b)[2], const float* s, int j, int n0, int g, int t) {
    const float* p = s + (8 * j + 2 * t) * FA_LD + n0 + g;
    b[0] = fa_op<R>(p[0]);
    b[1] = fa_op<R>(p[FA_LD]);
}
// accumulators of n-tile j as the A fragment of k-step j (see the mapping above), rounded to tf32
__device__ __forceinline__ void fa_acc_as_a(uint32_t (&a)[4], const float (&c)[4]) {
    a[0] = tf32_round(c[0]);
    a[1] = tf32_round(c[2]);
    a[2] = tf32_round(c[1]);
    a[3] = tf32_round(c[3]);
}
// acc[n] (16 x 64) += S (16 x 64 in accumulator layout, over tile positions) @ tile (64 x 64)
template <bool R>
__device__ __forceinline__ void fa_mma_pos(float (&acc)[8][4], const float (&S)[8][4], const float* tile, int g, int t) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        uint32_t a[4];
        fa_acc_as_a(a, S[j]);
#pragma unroll
        for (int n = 0; n < 8; n++) {
            uint32_t b[2];
            fa_frag_b_pos<R>(b, tile, j, 8 * n, g, t);
            mma_tf32(acc[n], a, b);
        }
    }
}
// S (16 x 64) = A-rows (16 x 64, as fragments qa) @ tile^T (tile rows are the 64 columns of S)
template <bool R>
__device__ __forceinline__ void fa_mma_dim(float (&S)[8][4], const uint32_t (&qa)[8][4], const float* tile, int g, int t) {
#pragma unroll
    for (int j = 0; j < 8; j++) S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.f;
#if FA_KK_OUTER
#pragma unroll
    for (int kk = 0; kk < 8; kk++)
#pragma unroll
        for (int j = 0; j < 8; j++) {
#else
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
#endif
            uint32_t b[2];
            fa_frag_b_dim<R>(b, tile, 8 * j, kk, g, t);
            mma_tf32(S[j], qa[kk], b);
        }
}

// The tile loop shared by the three kernels: for it = 0..n-1, make tile `it` of the sweep visible
// in buffer it & 1 (PIPE) or 0, then call body(buffer). load(it, buffer) issues the tile's copies:
// fa_stage (synchronous) without PIPE, fa_stage_async with it. With PIPE tile 0 must already be in
// flight into buffer 0 (committed) when the loop starts.
template <bool PIPE, typename Load, typename Body>
__device__ __forceinline__ void fa_sweep(int n, Load load, Body body) {
    for (int it = 0; it < n; it++) {
        __syncthreads();  // every warp is done with the buffer about to be refilled
        if (PIPE) {
            if (it + 1 < n) {
                load(it + 1, (it + 1) & 1);
                cp_async_commit();
                cp_async_wait<1>();  // tile `it` has landed (this thread's copies)
            } else {
                cp_async_wait<0>();
            }
        } else {
            load(it, 0);
        }
        __syncthreads();  // ... and everyone's
        body(PIPE ? (it & 1) : 0);
    }
}

// ----------------------------------------------------------------------------------------------
// The math between the products, shared by the TF32 and the bf16 kernels. Both keep their scores
// and sums in mma accumulators of the same layout (m16n8k8 and m16n8k16 alike: n-tile j, element e
// of lane (g, t) is row g + 8 (e >> 1), column 8j + 2t + (e & 1)), in fp32, so everything that is
// not a product (masking, the online softmax, lse and D, the stores) is written once, here; only
// the fragments and the products differ (fa_mma_* for TF32, fb_mma_* for bf16).

// a row's two adjacent fp32 values as one store: float2, or bf16x2 rounded once (4 bytes)
__device__ __forceinline__ void fa_store2(float* dst, float x, float y) {
    *reinterpret_cast<float2*>(dst) = make_float2(x, y);
}
__device__ __forceinline__ void fa_store2(bf16* dst, float x, float y) {
    *reinterpret_cast<uint32_t*>(dst) = pack_bf16x2(x, y);
}
// two adjacent elements as fp32 (bf16 widens exactly)
__device__ __forceinline__ float2 fa_load2(const float* p) { return *reinterpret_cast<const float2*>(p); }
__device__ __forceinline__ float2 fa_load2(const bf16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// The forward's online softmax over one key tile, for one m-tile of 16 query rows (this lane's rows
// row0 and row0 + 8): s holds the tile's scores q k^T; they are scaled to log2 units (c2), masked
// past the diagonal (diag: the tile holds keys > some row of the block; kt: the tile's number), the
// running max m and sum l of each row move to the tile (the 4 lanes of a row hold its 64 columns),
// o is rescaled to the new max, and s becomes p = 2^(s - m). KEEP1: the rescale is exactly 1 when
// the max did not move (the bf16 forward: a fully masked tile of a 128-row block is then an exact
// no-op); without it 2^(m - m) is computed as it is (the TF32 forward).
template <bool KEEP1>
__device__ __forceinline__ void fa_softmax_tile(float (&s)[8][4], float (&m)[2], float (&l)[2], float (&o)[8][4],
                                                float c2, bool diag, int kt, int row0, int row1, int t) {
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float x = s[j][e] * c2;
            if (diag && kt * FA_TILE + 8 * j + 2 * t + (e & 1) > ((e >> 1) ? row1 : row0)) x = -INFINITY;
            s[j][e] = x;
            mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
    float corr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {  // the 4 lanes of a row hold its 64 columns
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        // 0 on the first tile (m = -inf; key 0 is never masked)
        corr[r] = KEEP1 && mx[r] == m[r] ? 1.f : fa_exp2(m[r] - mx[r]);
        m[r] = mx[r];
        l[r] *= corr[r];
    }
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float p = fa_exp2(s[j][e] - m[e >> 1]);
            s[j][e] = p;
            l[e >> 1] += p;  // the fp32 p (bf16: lse stays fp32-accurate, p v uses p rounded to bf16)
        }
#pragma unroll
    for (int n = 0; n < 8; n++) {
        o[n][0] *= corr[0]; o[n][1] *= corr[0];
        o[n][2] *= corr[1]; o[n][3] *= corr[1];
    }
}

// The forward's end for one m-tile: each row's sum l over its 4 lanes, out = o / l (rounded once
// to E) into the row's 64 columns of head h, and lse = ln(sum exp(scores)) in fp32
template <typename E>
__device__ __forceinline__ void fa_forward_store(E* out, float* lse, const float (&o)[8][4], const float (&m)[2],
                                                 const float (&l)[2], int row0, int b, int h, int bh, int T, int C,
                                                 int t) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + 8 * r;
        float lr = l[r];
        lr += __shfl_xor_sync(0xffffffffu, lr, 1);
        lr += __shfl_xor_sync(0xffffffffu, lr, 2);
        if (row >= T) continue;
        const float inv = 1.0f / lr;
        E* dst = out + ((size_t)b * T + row) * C + h * FA_D + 2 * t;
#pragma unroll
        for (int n = 0; n < 8; n++) fa_store2(dst + 8 * n, o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        if (t == 0) lse[(size_t)bh * T + row] = (m[r] + __log2f(lr)) * FA_LN2;
    }
}

// dq's D = rowsum(dout * out) for the warp's 16 rows w0.. of the block's q0..: a lane per pair of
// columns, fp32 products, warp sum; into dsm (the block's 64 rows) and Dbuf (B,NH,T) for dkdv
template <typename E>
__device__ __forceinline__ void fa_rows_D(float* dsm, float* Dbuf, const E* dout, const E* out, size_t rowbase,
                                          int q0, int w0, int T, int C, int bh, int lane) {
    for (int i = 0; i < 16; i++) {
        int r = q0 + w0 + i;
        float d = 0.f;
        if (r < T) {
            float2 x = fa_load2(dout + rowbase + (size_t)r * C + 2 * lane);
            float2 y = fa_load2(out + rowbase + (size_t)r * C + 2 * lane);
            d = x.x * y.x + x.y * y.y;
        }
        d = warp_reduce_sum(d);
        if (lane == 0) {
            dsm[w0 + i] = d;
            if (r < T) Dbuf[(size_t)bh * T + r] = d;
        }
    }
}

// dq's per-row constants of this lane's rows row[0], row[1]: lse in log2 units, D (from dsm)
__device__ __forceinline__ void fa_rows_lse_D(float (&lr)[2], float (&Dr)[2], const float* lse, const float* dsm,
                                              const int (&row)[2], int w0, int g, int bh, int T) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lr[r] = row[r] < T ? lse[(size_t)bh * T + row[r]] * FA_LOG2E : 0.f;
        Dr[r] = dsm[w0 + g + 8 * r];
    }
}

// dq, one key tile: s (q k^T) becomes d preatt = scale * p * (dp - D), p = exp(scale s - lse),
// masked past the diagonal (diag: the tile kt is the block's diagonal one); dp = dout v^T
__device__ __forceinline__ void fa_dq_ds(float (&s)[8][4], const float (&dp)[8][4], const float (&lr)[2],
                                         const float (&Dr)[2], const int (&row)[2], float c2, float scale, bool diag,
                                         int kt, int t) {
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = e >> 1;
            float p = fa_exp2(s[j][e] * c2 - lr[r]);
            if (diag && kt * FA_TILE + 8 * j + 2 * t + (e & 1) > row[r]) p = 0.f;
            s[j][e] = scale * p * (dp[j][e] - Dr[r]);  // d preatt
        }
}

// dkdv, one query tile (keys as rows, queries q0.. as columns): s (k q^T) becomes p^T = exp(scale s
// - lse), dp (v dout^T) becomes d preatt^T = scale * p^T * (dp - D); queries before the lane's keys
// key[] or past T are masked. lsm, dsm: the tile's 64 lse and D.
__device__ __forceinline__ void fa_dkdv_p_ds(float (&s)[8][4], float (&dp)[8][4], const float* lsm, const float* dsm,
                                             const int (&key)[2], int q0, int T, float c2, float scale, int t) {
#pragma unroll
    for (int j = 0; j < 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int c = 8 * j + 2 * t + (e & 1), qpos = q0 + c;
            float p = fa_exp2(s[j][e] * c2 - lsm[c] * FA_LOG2E);
            if (qpos < key[e >> 1] || qpos >= T) p = 0.f;
            s[j][e] = p;                                 // p^T
            dp[j][e] = scale * p * (dp[j][e] - dsm[c]);  // d preatt^T
        }
}

// dkdv's sweep load: the q and dout tiles of query positions q0.. into s and s + one tile, and their
// 64 lse and D into r and r + 64 (0 past T); staged (PIPE false) or in flight (true)
template <bool PIPE, typename E>
__device__ __forceinline__ void fa_load_q_dout(E* s, float* r, const E* q, const E* dO, const float* lseh,
                                               const float* Dh, int q0, int T, int C) {
    if (PIPE) {
        fa_stage_async(s, q, q0, T, FA_D);
        fa_stage_async(s + FA_TILE_ELEMS<E>, dO, q0, T, C);
        fa_rows_async(r, lseh, q0, T, 0);
        fa_rows_async(r + FA_TILE, Dh, q0, T, FA_TILE);
    } else {
        fa_stage(s, q, q0, T, FA_D);
        fa_stage(s + FA_TILE_ELEMS<E>, dO, q0, T, C);
        if (threadIdx.x < FA_TILE) {
            int i = threadIdx.x;
            r[i] = q0 + i < T ? lseh[q0 + i] : 0.f;
            r[FA_TILE + i] = q0 + i < T ? Dh[q0 + i] : 0.f;
        }
    }
}

// Dynamic shared memory (sized by llmc/ops/attention.py, _flash_smem): forward and dq hold (k, v)
// tiles x stages (+ 64 floats of D for dq); dkdv holds its own k, v and (q, dout) tiles x stages
// plus 64 lse and 64 D per stage. Stages: 1 without PIPE, 2 with it.
// The TF32 kernels address it as floats (fa_smem), the bf16 kernels as bytes cast to their tiles
// (fb_smem; the TF32 dkdv kernel 3 compiles to other machine code on a byte array); fa_tiles<E> is
// either one as E.
extern __shared__ __align__(16) float fa_smem[];
extern __shared__ __align__(16) unsigned char fb_smem[];
template <typename E> __device__ __forceinline__ E* fa_tiles();
template <> __device__ __forceinline__ float* fa_tiles<float>() { return fa_smem; }
template <> __device__ __forceinline__ bf16* fa_tiles<bf16>() { return reinterpret_cast<bf16*>(fb_smem); }

template <bool PIPE>
__device__ __forceinline__ void flash_forward(float* out, float* lse, const float* qkvr, int B, int NH, int T, float scale) {
    float* kv = fa_smem;  // stage i: k at kv + 2i*TILE, v at kv + (2i+1)*TILE
    const int qt = gridDim.x - 1 - blockIdx.x;  // the query tiles with the most key tiles first
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, C = NH * FA_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const float *q = fa_head(qkvr, 0, B, NH, T), *k = fa_head(qkvr, 1, B, NH, T), *v = fa_head(qkvr, 2, B, NH, T);
    const int q0 = qt * FA_TILE, w0 = warp * 16;
    const int row0 = q0 + w0 + g;       // this lane's two query positions: row0, row0 + 8
    const float c2 = scale * FA_LOG2E;  // scores -> log2 units
    auto load = [&](int kt, int buf) { fa_load_kv<PIPE>(kv + 2 * buf * FA_TILE_FLOATS, k, v, kt * FA_TILE, T); };
    if (PIPE) { load(0, 0); cp_async_commit(); }
    // q goes into registers once, through the last tile buffer (not buffer 0 of a PIPE sweep)
    float* qs = kv + (PIPE ? 3 : 0) * FA_TILE_FLOATS;
    fa_stage(qs, q, q0, T, FA_D);
    __syncthreads();
    uint32_t qa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; kk++) fa_frag_a(qa[kk], qs, w0, kk, g, t);

    float o[8][4], s[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // running max (log2 units), partial sum
    int kt = 0;
    fa_sweep<PIPE>(qt + 1, load, [&](int buf) {
        const float* ks = kv + 2 * buf * FA_TILE_FLOATS;
        fa_mma_dim<PIPE>(s, qa, ks, g, t);  // s = q k^T (16 x 64 per warp)
        fa_softmax_tile<false>(s, m, l, o, c2, kt == qt, kt, row0, row0 + 8, t);  // s = p
        fa_mma_pos<PIPE>(o, s, ks + FA_TILE_FLOATS, g, t);  // o += p v
        kt++;
    });
    fa_forward_store(out, lse, o, m, l, row0, b, h, bh, T, C, t);
}


// ----------------------------------------------------------------------------------------------
// Fused causal attention in bf16: the bf16 builds of attention variants 2 and 3 (entry points
// <name><N>_bf16). The same algorithm, blocks, tiles, sweeps, causal skipping and pipelining (N = 2
// staged by the threads, N = 3 cp.async double-buffered) as the TF32 kernels above; q, k, v (qkvr),
// out, dout and dinp are bf16, the log-sum-exp lse and D = rowsum(dout * out) stay fp32 (B,NH,T).
// Every product runs on mma.sync m16n8k16 bf16 with fp32 accumulators: q k^T and dout v^T (scores,
// dp), then p v, ds k, p^T dout and ds^T q with p and ds rounded to bf16 as the A operand (what
// FlashAttention does in fp16/bf16). The online softmax, lse, D and every sum stay fp32; the
// outputs are rounded once, on the store.
//
// Shared tiles are 64 rows of FB_LD = 72 bf16 (144 bytes: rows are 16-byte aligned for cp.async
// and ldmatrix, and the 8 row addresses of one 8x8 ldmatrix matrix, 36 words apart, land in 8
// distinct groups of 4 banks: conflict-free). Every operand is read from shared memory with
// ldmatrix (layouts at mma_bf16_16816 / ldsm_x4_trans in mma.cuh; g = lane/4, t = lane%4):
//  A, rows x head dims (q, dout; k, v in dkdv), k-step kk = dims 16kk..16kk+15: ldsm_x4 with lane l
//    pointing at row (l & 7) + 8 ((l >> 3) & 1), dim 16kk + 8 (l >> 4): matrices 0..3 are rows 0-7 /
//    8-15 x dims +0, then +8, so d0..d3 = a0..a3.
//  B contracting over the head dim (k in q k^T, v in dout v^T; q, dout in dkdv): tile rows are B's
//    n, dims its k. ldsm_x4 of positions 16jp..16jp+15: lane l points at position 16jp + (l & 7)
//    + 8 (l >> 4), dim 16kk + 8 ((l >> 3) & 1): d0, d1 = b0, b1 of n-tile 2jp; d2, d3 of n-tile 2jp+1.
//  B contracting over positions (v in p v, k in ds k; dout, q in dkdv): tile rows are B's k, dims
//    its n: the transposing load. ldsm_x4_trans of positions 16j..16j+15 x dims 16np..16np+15: lane
//    l points at position 16j + (l & 7) + 8 ((l >> 3) & 1), dim 16np + 8 (l >> 4) (the A pattern):
//    d0, d1 = b0, b1 of n-tile 2np; d2, d3 of n-tile 2np+1.
//  A contracting over positions (p, ds) is the previous product's accumulators, packed: see mma.cuh.
// (FB_LD, FB_TILE_ELEMS and the staging of bf16 tiles, fa_stage / fa_stage_async, are with the
// TF32 kernels' above: the kernels of both element types share them)

// this lane's ldmatrix offset (elements) in the A / transposed-B pattern and in the B pattern
__device__ __forceinline__ int fb_lane_a(int lane) { return ((lane & 7) + 8 * ((lane >> 3) & 1)) * FB_LD + 8 * (lane >> 4); }
__device__ __forceinline__ int fb_lane_b(int lane) { return ((lane & 7) + 8 * (lane >> 4)) * FB_LD + 8 * ((lane >> 3) & 1); }

// the A fragments (4 k-steps over the head dim) of rows row0..row0+15 of a staged tile
__device__ __forceinline__ void fb_frags_a(uint32_t (&a)[4][4], const bf16* s, int row0, int la) {
    const uint32_t base = smem_u32(s) + 2 * (la + row0 * FB_LD);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) ldsm_x4(a[kk], base + 2 * 16 * kk);
}
// S (16 x 64) = A-rows (16 x 64 head dims, fragments a) @ tile^T (the tile's 64 rows are S's columns)
__device__ __forceinline__ void fb_mma_dim(float (&S)[8][4], const uint32_t (&a)[4][4], const bf16* tile, int lb) {
    const uint32_t base = smem_u32(tile) + 2 * lb;
#pragma unroll
    for (int j = 0; j < 8; j++) S[j][0] = S[j][1] = S[j][2] = S[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int jp = 0; jp < 4; jp++) {  // 8 independent accumulators per k-step
            uint32_t b[4];
            ldsm_x4(b, base + 2 * (16 * jp * FB_LD + 16 * kk));
            mma_bf16_16816(S[2 * jp], a[kk], b);
            mma_bf16_16816(S[2 * jp + 1], a[kk], b + 2);
        }
}
// acc (16 x 64 head dims) += S (16 x 64 positions, accumulator layout, rounded to bf16) @ tile (64 x 64)
__device__ __forceinline__ void fb_mma_pos(float (&acc)[8][4], const float (&S)[8][4], const bf16* tile, int la) {
    const uint32_t base = smem_u32(tile) + 2 * la;
#pragma unroll
    for (int j = 0; j < 4; j++) {  // k-step j: positions 16j..16j+15 = accumulator n-tiles 2j, 2j+1
        const uint32_t a[4] = {pack_bf16x2(S[2 * j][0], S[2 * j][1]), pack_bf16x2(S[2 * j][2], S[2 * j][3]),
                               pack_bf16x2(S[2 * j + 1][0], S[2 * j + 1][1]),
                               pack_bf16x2(S[2 * j + 1][2], S[2 * j + 1][3])};
#pragma unroll
        for (int np = 0; np < 4; np++) {
            uint32_t b[4];
            ldsm_x4_trans(b, base + 2 * (16 * j * FB_LD + 16 * np));
            mma_bf16_16816(acc[2 * np], a, b);
            mma_bf16_16816(acc[2 * np + 1], a, b + 2);
        }
    }
}
// fb_mma_dim and fb_mma_pos for a warp owning MT m-tiles of 16 rows (the forward's _rows128
// instantiation has MT = 2): every B fragment read from shared memory feeds MT m-tiles, so the
// ldmatrix traffic per FLOP is 1/MT of the one-m-tile versions. Same order of operations per row.
template <int MT>
__device__ __forceinline__ void fb_mma_dim_m(float (&S)[MT][8][4], const uint32_t (&a)[MT][4][4], const bf16* tile,
                                             int lb) {
    const uint32_t base = smem_u32(tile) + 2 * lb;
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < 8; j++) S[mt][j][0] = S[mt][j][1] = S[mt][j][2] = S[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int jp = 0; jp < 4; jp++) {
            uint32_t b[4];
            ldsm_x4(b, base + 2 * (16 * jp * FB_LD + 16 * kk));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16_16816(S[mt][2 * jp], a[mt][kk], b);
                mma_bf16_16816(S[mt][2 * jp + 1], a[mt][kk], b + 2);
            }
        }
}
template <int MT>
__device__ __forceinline__ void fb_mma_pos_m(float (&acc)[MT][8][4], const float (&S)[MT][8][4], const bf16* tile,
                                             int la) {
    const uint32_t base = smem_u32(tile) + 2 * la;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            a[mt][0] = pack_bf16x2(S[mt][2 * j][0], S[mt][2 * j][1]);
            a[mt][1] = pack_bf16x2(S[mt][2 * j][2], S[mt][2 * j][3]);
            a[mt][2] = pack_bf16x2(S[mt][2 * j + 1][0], S[mt][2 * j + 1][1]);
            a[mt][3] = pack_bf16x2(S[mt][2 * j + 1][2], S[mt][2 * j + 1][3]);
        }
#pragma unroll
        for (int np = 0; np < 4; np++) {
            uint32_t b[4];
            ldsm_x4_trans(b, base + 2 * (16 * j * FB_LD + 16 * np));
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                mma_bf16_16816(acc[mt][2 * np], a[mt], b);
                mma_bf16_16816(acc[mt][2 * np + 1], a[mt], b + 2);
            }
        }
    }
}

// Dynamic shared memory (llmc/ops/attention.py, _flash_smem with bf16): as the TF32 kernels' in
// tiles of FB_TILE_BYTES: forward 2 tiles (4 with PIPE), dq 2 (4) + 64 floats of D, dkdv 4 (6)
// + 2 (4) x 64 floats of lse and D.

// The forward, MT = 1: blocks of 64 query rows like the TF32 kernel; MT = 2 (entry points
// _rows128): blocks of 128 query rows, a warp owning 32 (two m-tiles), each k, v tile read from
// shared memory once for both (half the ldmatrix and global traffic per FLOP; the key tiles next to
// the diagonal do up to 64 rows of fully masked work: exact no-ops, p = 0, corr = 1).
template <bool PIPE, int MT>
__device__ __forceinline__ void flash_forward_bf16(bf16* out, float* lse, const bf16* qkvr, int B, int NH, int T,
                                                   float scale) {
    bf16* kv = reinterpret_cast<bf16*>(fb_smem);  // stage i: k at kv + 2i*TILE, v at kv + (2i+1)*TILE
    const int qt = gridDim.x - 1 - blockIdx.x;    // the query tiles with the most key tiles first
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, C = NH * FA_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int la = fb_lane_a(lane), lb = fb_lane_b(lane);
    const bf16 *q = fa_head(qkvr, 0, B, NH, T), *k = fa_head(qkvr, 1, B, NH, T), *v = fa_head(qkvr, 2, B, NH, T);
    const int q0 = qt * FA_TILE * MT, w0 = warp * 16 * MT;
    const int nkt = min(MT * (qt + 1), (T + FA_TILE - 1) / FA_TILE);  // key tiles 0..nkt-1 (causal)
    const int kdiag = MT * qt;  // key tiles from here on can hold keys > some row of the block: masked
    const float c2 = scale * FA_LOG2E;                                // scores -> log2 units
    auto load = [&](int kt, int buf) { fa_load_kv<PIPE>(kv + 2 * buf * FB_TILE_ELEMS, k, v, kt * FA_TILE, T); };
    if (PIPE) { load(0, 0); cp_async_commit(); }
    // q goes into registers once, through the last MT tile buffers (not buffer 0 of a PIPE sweep);
    // the sweep's first barrier orders these reads before any refill of them
    bf16* qs = kv + (PIPE ? 4 - MT : 0) * FB_TILE_ELEMS;
#pragma unroll
    for (int i = 0; i < MT; i++) fa_stage(qs + i * FB_TILE_ELEMS, q, q0 + i * FA_TILE, T, FA_D);
    __syncthreads();
    uint32_t qa[MT][4][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) fb_frags_a(qa[mt], qs, w0 + 16 * mt, la);

    float o[MT][8][4], s[MT][8][4];
    float m[MT][2], l[MT][2];  // running max (log2 units), partial sum
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int n = 0; n < 8; n++) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }
    int kt = 0;
    fa_sweep<PIPE>(nkt, load, [&](int buf) {
        const bf16* ks = kv + 2 * buf * FB_TILE_ELEMS;
        fb_mma_dim_m<MT>(s, qa, ks, lb);  // s = q k^T (16 MT x 64 per warp)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)  // this lane's rows of m-tile mt: q0 + w0 + 16 mt + g (+ 8)
            fa_softmax_tile<true>(s[mt], m[mt], l[mt], o[mt], c2, kt >= kdiag, kt, q0 + w0 + 16 * mt + g,
                                  q0 + w0 + 16 * mt + g + 8, t);
        fb_mma_pos_m<MT>(o, s, ks + FB_TILE_ELEMS, la);  // o += p v
        kt++;
    });
#pragma unroll
    for (int mt = 0; mt < MT; mt++) fa_forward_store(out, lse, o[mt], m[mt], l[mt], q0 + w0 + 16 * mt + g, b, h, bh, T, C, t);
}

// ----------------------------------------------------------------------------------------------
// The backward kernels of both element types are written once, templated on E. FaMma<E, PIPE>
// gives them their products: for float the TF32 helpers above (fa_*, m16n8k8, fragments read from
// the staged fp32 tiles; with PIPE the tiles are raw and rounded to tf32 as they are read), for
// bf16 the ldmatrix / m16n8k16 ones (fb_*). They take the lane's two fragment coordinates x, y,
// which a kernel computes once (FaMma::x(lane), FaMma::y(lane)). dkdv's k q^T and v dout^T, whose
// operands differ between the types (bf16 keeps the keys' fragments in registers), are written out
// per type in the kernel. Staging, sweeps, masks, lse and D and the stores are shared code.
template <typename E, bool PIPE> struct FaMma;
template <bool PIPE> struct FaMma<float, PIPE> {
    typedef uint32_t FragsA[8][4];  // 16 rows x 64 head dims as A: 8 k-steps
    // x, y = g = lane / 4, t = lane % 4 (the mapping at "Fragments" above)
    static __device__ __forceinline__ int x(int lane) { return lane >> 2; }
    static __device__ __forceinline__ int y(int lane) { return lane & 3; }
    // dq's A fragments of rows row0..row0+15 of q (the tile at s) and dout (the tile after it)
    static __device__ __forceinline__ void frags_a(FragsA& qa, FragsA& da, const float* s, int row0, int g, int t) {
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            fa_frag_a(qa[kk], s, row0, kk, g, t);
            fa_frag_a(da[kk], s + FA_TILE_FLOATS, row0, kk, g, t);
        }
    }
    static __device__ __forceinline__ void dim(float (&S)[8][4], const FragsA& a, const float* tile, int g, int t) {
        fa_mma_dim<PIPE>(S, a, tile, g, t);
    }
    static __device__ __forceinline__ void pos(float (&acc)[8][4], const float (&S)[8][4], const float* tile, int g,
                                               int t) {
        fa_mma_pos<PIPE>(acc, S, tile, g, t);
    }
};
template <bool PIPE> struct FaMma<bf16, PIPE> {
    typedef uint32_t FragsA[4][4];  // 16 rows x 64 head dims as A: 4 k-steps
    // x, y = la, lb: the lane's ldmatrix offsets in the A / transposed-B pattern and in the B pattern
    static __device__ __forceinline__ int x(int lane) { return fb_lane_a(lane); }
    static __device__ __forceinline__ int y(int lane) { return fb_lane_b(lane); }
    static __device__ __forceinline__ void frags_a(FragsA& qa, FragsA& da, const bf16* s, int row0, int la, int) {
        fb_frags_a(qa, s, row0, la);
        fb_frags_a(da, s + FB_TILE_ELEMS, row0, la);
    }
    static __device__ __forceinline__ void dim(float (&S)[8][4], const FragsA& a, const bf16* tile, int, int lb) {
        fb_mma_dim(S, a, tile, lb);
    }
    static __device__ __forceinline__ void pos(float (&acc)[8][4], const float (&S)[8][4], const bf16* tile, int la,
                                               int) {
        fb_mma_pos(acc, S, tile, la);
    }
};

// Backward, part 1: per query tile, D = rowsum(dout * out) (fp32, written for part 2) and
// dq = scale * sum over key tiles of (p * (dp - D)) k, with p = exp(scale q k^T - lse), dp = dout v^T.
template <bool PIPE, typename E>
__device__ __forceinline__ void flash_backward_dq(E* dinp, float* Dbuf, const E* dout, const E* out, const E* qkvr,
                                                  const float* lse, int B, int NH, int T, float scale) {
    using M = FaMma<E, PIPE>;
    constexpr int TE = FA_TILE_ELEMS<E>;
    E* kv = fa_tiles<E>();
    float* dsm = reinterpret_cast<float*>(kv + (PIPE ? 4 : 2) * TE);
    const int qt = gridDim.x - 1 - blockIdx.x;
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, C = NH * FA_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int x = M::x(lane), y = M::y(lane);
    const E *q = fa_head(qkvr, 0, B, NH, T), *k = fa_head(qkvr, 1, B, NH, T), *v = fa_head(qkvr, 2, B, NH, T);
    const int q0 = qt * FA_TILE, w0 = warp * 16;
    const int row[2] = {q0 + w0 + g, q0 + w0 + g + 8};
    const float c2 = scale * FA_LOG2E;
    const size_t rowbase = (size_t)b * T * C + h * FA_D;  // + t * C: row t of this head in out / dout
    auto load = [&](int kt, int buf) { fa_load_kv<PIPE>(kv + 2 * buf * TE, k, v, kt * FA_TILE, T); };
    if (PIPE) { load(0, 0); cp_async_commit(); }

    fa_rows_D(dsm, Dbuf, dout, out, rowbase, q0, w0, T, C, bh, lane);  // D for the warp's 16 rows
    // q and dout into registers once, through the buffers a PIPE sweep fills last
    E* qs = kv + (PIPE ? 2 : 0) * TE;
    fa_stage(qs, q, q0, T, FA_D);
    fa_stage(qs + TE, dout + rowbase, q0, T, C);
    __syncthreads();
    typename M::FragsA qa, da;
    M::frags_a(qa, da, qs, w0, x, y);
    float lr[2], Dr[2];
    fa_rows_lse_D(lr, Dr, lse, dsm, row, w0, g, bh, T);

    float dq[8][4], s[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
    int kt = 0;
    fa_sweep<PIPE>(qt + 1, load, [&](int buf) {
        const E* ks = kv + 2 * buf * TE;
        M::dim(s, qa, ks, x, y);        // q k^T
        M::dim(dp, da, ks + TE, x, y);  // dout v^T
        fa_dq_ds(s, dp, lr, Dr, row, c2, scale, kt == qt, kt, t);  // s = d preatt
        M::pos(dq, s, ks, x, y);  // dq += dpreatt k
        kt++;
    });
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (row[r] >= T) continue;
        E* dst = dinp + ((size_t)b * T + row[r]) * 3 * C + h * FA_D + 2 * t;
#pragma unroll
        for (int n = 0; n < 8; n++) fa_store2(dst + 8 * n, dq[n][2 * r], dq[n][2 * r + 1]);
    }
}

// Backward, part 2: per key tile, over the query tiles at and below the diagonal,
// dv = sum p^T dout and dk = sum (p * (dp - D))^T q * scale, computed transposed (keys as rows):
// p^T = exp(scale k q^T - lse), dp^T = v dout^T.
template <bool PIPE, typename E>
__device__ __forceinline__ void flash_backward_dkdv(E* dinp, const E* dout, const E* qkvr, const float* lse,
                                                    const float* Dbuf, int B, int NH, int T, float scale) {
    using M = FaMma<E, PIPE>;
    constexpr int TE = FA_TILE_ELEMS<E>;
    E* ks = fa_tiles<E>();  // this block's keys (all of the loop)
    E* vs = ks + TE;        // and values
    E* qd = vs + TE;        // stage i: q tile at qd + 2i*TILE, dout rows after it
    float* rows = reinterpret_cast<float*>(qd + (PIPE ? 4 : 2) * TE);  // stage i: lse at rows + 2i*64, D after it
    const int kt = blockIdx.x, nqt = gridDim.x;  // the key tiles with the most query tiles first
    const int bh = blockIdx.y, b = bh / NH, h = bh % NH, C = NH * FA_D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int x = M::x(lane), y = M::y(lane);
    const E *q = fa_head(qkvr, 0, B, NH, T), *k = fa_head(qkvr, 1, B, NH, T), *v = fa_head(qkvr, 2, B, NH, T);
    const E* dO = dout + (size_t)b * T * C + h * FA_D;
    const float* lseh = lse + (size_t)bh * T;
    const float* Dh = Dbuf + (size_t)bh * T;
    const int k0 = kt * FA_TILE, w0 = warp * 16;
    const int key[2] = {k0 + w0 + g, k0 + w0 + g + 8};  // this lane's two key positions
    const float c2 = scale * FA_LOG2E;
    auto load = [&](int it, int buf) {
        fa_load_q_dout<PIPE>(qd + 2 * buf * TE, rows + 2 * buf * FA_TILE, q, dO, lseh, Dh, (kt + it) * FA_TILE, T, C);
    };
    if (PIPE) { load(0, 0); cp_async_commit(); }
    fa_stage(ks, k, k0, T, FA_D);
    fa_stage(vs, v, k0, T, FA_D);
    // bf16 holds this warp's 16 keys and values as A fragments for the whole sweep (loaded after a
    // barrier: the sweep's first one comes too late for them); TF32 reads them at every k-step
    uint32_t ka[4][4], va[4][4];
    if constexpr (sizeof(E) == 2) {
        __syncthreads();
        fb_frags_a(ka, ks, w0, x);
        fb_frags_a(va, vs, w0, x);
    }
    float dk[8][4], dv[8][4], s[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[n][e] = dv[n][e] = 0.f;
    int qt = kt;
    fa_sweep<PIPE>(nqt - kt, load, [&](int buf) {
        const E* qs = qd + 2 * buf * TE;
        const E* dos = qs + TE;
        const float* lsm = rows + 2 * buf * FA_TILE;
        const float* dsm = lsm + FA_TILE;
        const int q0 = qt * FA_TILE;
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = dp[j][e] = 0.f;
        // s = k q^T, dp = v dout^T (16 keys x 64 queries per warp); written out here, not as FaMma
        // helpers: so the TF32 kernel 3 compiles to the same machine code as before the fold
        if constexpr (sizeof(E) == 2) {
            const uint32_t qb = smem_u32(qs) + 2 * y, db = smem_u32(dos) + 2 * y;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
#pragma unroll
                for (int jp = 0; jp < 4; jp++) {
                    uint32_t bq[4], bd[4];
                    ldsm_x4(bq, qb + 2 * (16 * jp * FB_LD + 16 * kk));
                    ldsm_x4(bd, db + 2 * (16 * jp * FB_LD + 16 * kk));
                    mma_bf16_16816(s[2 * jp], ka[kk], bq);
                    mma_bf16_16816(s[2 * jp + 1], ka[kk], bq + 2);
                    mma_bf16_16816(dp[2 * jp], va[kk], bd);
                    mma_bf16_16816(dp[2 * jp + 1], va[kk], bd + 2);
                }
            }
        } else {
#pragma unroll
            for (int kk = 0; kk < 8; kk++) {
                uint32_t ak[4], av[4];  // k-step kk of the keys and values
                fa_frag_a(ak, ks, w0, kk, g, t);
                fa_frag_a(av, vs, w0, kk, g, t);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    uint32_t bq[2], bd[2];
                    fa_frag_b_dim<PIPE>(bq, qs, 8 * j, kk, g, t);
                    fa_frag_b_dim<PIPE>(bd, dos, 8 * j, kk, g, t);
                    mma_tf32(s[j], ak, bq);
                    mma_tf32(dp[j], av, bd);
                }
            }
        }
        fa_dkdv_p_ds(s, dp, lsm, dsm, key, q0, T, c2, scale, t);  // s = p^T, dp = d preatt^T
        M::pos(dv, s, dos, x, y);  // dv += p^T dout
        M::pos(dk, dp, qs, x, y);  // dk += dpreatt^T q
        qt++;
    });
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (key[r] >= T) continue;
        E* dst = dinp + ((size_t)b * T + key[r]) * 3 * C + h * FA_D + 2 * t;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            fa_store2(dst + C + 8 * n, dk[n][2 * r], dk[n][2 * r + 1]);
            fa_store2(dst + 2 * C + 8 * n, dv[n][2 * r], dv[n][2 * r + 1]);
        }
    }
}

#define FLASH_ENTRIES(N, PIPE)                                                                              \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_forward_kernel##N(              \
        float* out, float* lse, const float* qkvr, int B, int NH, int T, float scale) { LLMC_PDL_WAIT();    \
        flash_forward<PIPE>(out, lse, qkvr, B, NH, T, scale);                                               \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_backward_dq_kernel##N(          \
        float* dinp, float* Dbuf, const float* dout, const float* out, const float* qkvr, const float* lse, \
        int B, int NH, int T, float scale) { LLMC_PDL_WAIT();                                               \
        flash_backward_dq<PIPE>(dinp, Dbuf, dout, out, qkvr, lse, B, NH, T, scale);                         \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_backward_dkdv_kernel##N(        \
        float* dinp, const float* dout, const float* qkvr, const float* lse, const float* Dbuf, int B,      \
        int NH, int T, float scale) { LLMC_PDL_WAIT();                                                      \
        flash_backward_dkdv<PIPE>(dinp, dout, qkvr, lse, Dbuf, B, NH, T, scale);                            \
    }
FLASH_ENTRIES(2, false)
FLASH_ENTRIES(3, true)
#define FLASH_ENTRIES_BF16(N, PIPE)                                                                          \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_forward_kernel##N##_bf16(       \
        bf16* out, float* lse, const bf16* qkvr, int B, int NH, int T, float scale) { LLMC_PDL_WAIT();       \
        flash_forward_bf16<PIPE, 1>(out, lse, qkvr, B, NH, T, scale);                                        \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_backward_dq_kernel##N##_bf16(   \
        bf16* dinp, float* Dbuf, const bf16* dout, const bf16* out, const bf16* qkvr, const float* lse,      \
        int B, int NH, int T, float scale) { LLMC_PDL_WAIT();                                                \
        flash_backward_dq<PIPE>(dinp, Dbuf, dout, out, qkvr, lse, B, NH, T, scale);                     \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, 2) flash_attention_backward_dkdv_kernel##N##_bf16( \
        bf16* dinp, const bf16* dout, const bf16* qkvr, const float* lse, const float* Dbuf, int B, int NH,  \
        int T, float scale) { LLMC_PDL_WAIT();                                                               \
        flash_backward_dkdv<PIPE>(dinp, dout, qkvr, lse, Dbuf, B, NH, T, scale);                        \
    }
FLASH_ENTRIES_BF16(2, false)
FLASH_ENTRIES_BF16(3, true)
// the forward with 128-row blocks (MT = 2), for the lab to measure against the 64-row one
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_forward_kernel2_bf16_rows128(
    bf16* out, float* lse, const bf16* qkvr, int B, int NH, int T, float scale) {
    LLMC_PDL_WAIT();
    flash_forward_bf16<false, 2>(out, lse, qkvr, B, NH, T, scale);
}
extern "C" __global__ void __launch_bounds__(FA_THREADS) flash_attention_forward_kernel3_bf16_rows128(
    bf16* out, float* lse, const bf16* qkvr, int B, int NH, int T, float scale) {
    LLMC_PDL_WAIT();
    flash_forward_bf16<true, 2>(out, lse, qkvr, B, NH, T, scale);
}

// the permute into qkvr for the bf16 builds: 16-byte moves of 8 bf16 (hs % 8 == 0)
extern "C" __global__ void permute_kernel2_bf16(bf16* dst, const bf16* src, int B, int T, int S, int NH, int hs) {
    LLMC_PDL_WAIT();
    permute_impl<uint4>(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), B, T, S, NH, hs / 8);
}
