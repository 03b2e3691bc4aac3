// AdamW with global-norm gradient clipping, applied in place to one contiguous range of the flat
// parameter buffer (the model calls it once per run of tensors sharing a weight-decay flag).
//
// version 1: one thread per element, scalar loads
// version 2: float4 grid-stride loop with streaming loads/stores; any alignment (scalar head/tail, scalar fallback)
// version 3: one launch over a list of ranges (ZeRO-1's shard pieces), a tile of 4096 values per block
//
// bf16 builds (issue 13) of versions 1 and 2 (entry points <name>_bf16), llm.c's mixed precision:
//   params(n) bf16 out, grads(n) bf16, m(n), v(n) fp32 in/out, norm2(1), hp(8) fp32, master(n) fp32
//   in/out, seed(1) uint32 on the device (so a captured update replays with each step's seed).
// The update above runs on the fp32 master (the same arithmetic as the fp32 kernels, weight decay on
// the old master); then params = bf16(master): stochastic rounding when seed != 0, round to nearest
// even when seed == 0. params is only written, never read.
// Stochastic rounding: a 32-bit hash r of (seed, offset + i), the element's index in the whole
// parameter buffer (offset: a build argument, the range's start), so the bits depend neither on
// the launch configuration nor on how the buffer is cut into ranges (or ZeRO shards). The result is
// the fp32 bits plus the low 16 bits of r, cut to the upper 16: it rounds away from zero with
// probability (dropped bits) / 2^16, exactly the fractional position: unbiased.
//
//   params(n), grads(n), m(n), v(n) in/out (grads read only), norm2(1) read only, hp(8) read only:
//   the hyperparameters lr, b1, b2, bc1, bc2, eps, wd, max_norm, read from the device so that a
//   captured CUDA graph of the update replays with the current step's values (the model uploads
//   them before each update)
//   s = max_norm / sqrt(norm2) if max_norm > 0 and sqrt(norm2) > max_norm else 1   (on the device:
//       the host never reads norm2 inside a step)
//   g = s * grads; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2
//   params -= lr * (mhat / (sqrt(vhat) + eps) + wd * params),  mhat = m / bc1, vhat = v / bc2
//   bc1 = 1 - b1^t, bc2 = 1 - b2^t are computed on the host in double from t (1-based).
//
// Memory traffic: read p, g, m, v; write p, m, v: 28 bytes per parameter. At 124,475,904 params that
// is 3.49 GB -> 1.17 ms at 2.98 TB/s.
// Measured on the H100 (dev/cuda/adamw.py, L2 flushed, 2026-11-22) at n = 124,475,904:
//   version 1: 1.264 ms (2.76 TB/s) at 256 threads   version 2: 1.243 ms (2.80 TB/s) at 1024 threads
//   torch.optim.AdamW(fused=True).step(): 1.480 ms (no clipping in it)
// Both are at the DRAM floor; the float4 version wins by little because a thread per element already
// has four independent loads in flight.
// bf16: read grads (2), m, v, master (12); write params (2), m, v, master (12): 28 bytes per
// parameter, as in fp32 -> 1.17 ms at 124M params. Not yet measured.
#include "elem.cuh"

// the clip scale, computed by every thread from the one norm2 float (a broadcast load)
__device__ __forceinline__ float clip_scale(const float* norm2, float max_norm) {
    if (max_norm > 0.0f) {
        const float norm = sqrtf(__ldg(norm2));
        if (norm > max_norm) return max_norm / norm;
    }
    return 1.0f;
}

struct AdamWArgs {
    float lr, beta1, beta2, bc1, bc2, eps, wd, scale;
};

// hp: lr, beta1, beta2, bc1, bc2, eps, wd, max_norm (broadcast loads, the same 32 bytes for all)
__device__ __forceinline__ AdamWArgs adamw_args(const float* hp, const float* norm2) {
    return AdamWArgs{__ldg(hp), __ldg(hp + 1), __ldg(hp + 2), __ldg(hp + 3), __ldg(hp + 4), __ldg(hp + 5),
                     __ldg(hp + 6), clip_scale(norm2, __ldg(hp + 7))};
}

// one parameter's update; p, m, v in/out
__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v, const AdamWArgs& a) {
    g *= a.scale;
    m = a.beta1 * m + (1.0f - a.beta1) * g;
    v = a.beta2 * v + (1.0f - a.beta2) * g * g;
    const float mhat = m / a.bc1;
    const float vhat = v / a.bc2;
    p -= a.lr * (mhat / (sqrtf(vhat) + a.eps) + a.wd * p);  // decoupled weight decay uses the old p
}

__device__ __forceinline__ void adamw_scalar(float* params, const float* grads, float* m, float* v,
                                             size_t i, const AdamWArgs& a) {
    float p = params[i], mi = m[i], vi = v[i];
    adamw_update(p, grads[i], mi, vi, a);
    params[i] = p; m[i] = mi; v[i] = vi;
}

// ----------------------------------------------------------------------------------------------
// version 1

extern "C" __global__ void adamw_kernel1(float* params, const float* grads, float* m, float* v,
                                         const float* norm2, const float* hp, int n) {
    LLMC_PDL_WAIT();
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)n) return;
    const AdamWArgs a = adamw_args(hp, norm2);
    adamw_scalar(params, grads, m, v, i, a);
}

// ----------------------------------------------------------------------------------------------
// version 2: float4 body when the four pointers are equally misaligned (always so in the model:
// four cudaMalloc'd buffers viewed at the same offset); a scalar head up to the 16-byte boundary
// and a scalar tail. If the misalignments differ, the whole range takes the scalar grid-stride path
// (a uniform branch: never a wrong result, just slower).

extern "C" __global__ void adamw_kernel2(float* params, const float* grads, float* m, float* v,
                                         const float* norm2, const float* hp, int n) {
    LLMC_PDL_WAIT();
    const AdamWArgs a = adamw_args(hp, norm2);
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const uintptr_t mis = (uintptr_t)params & 15u;
    if ((((uintptr_t)grads & 15u) != mis) || (((uintptr_t)m & 15u) != mis) || (((uintptr_t)v & 15u) != mis)) {
        for (size_t i = tid; i < (size_t)n; i += stride) adamw_scalar(params, grads, m, v, i, a);
        return;
    }
    const int head = min(n, (int)(((16u - mis) & 15u) >> 2));  // floats up to the 16-byte boundary
    const int n4 = (n - head) >> 2;
    const int tail = head + 4 * n4;
    if (tid < (size_t)head) adamw_scalar(params, grads, m, v, tid, a);
    if (tid < (size_t)(n - tail)) adamw_scalar(params, grads, m, v, tail + tid, a);

    float4* p4 = reinterpret_cast<float4*>(params + head);
    const float4* g4 = reinterpret_cast<const float4*>(grads + head);
    float4* m4 = reinterpret_cast<float4*>(m + head);
    float4* v4 = reinterpret_cast<float4*>(v + head);
    for (size_t i = tid; i < (size_t)n4; i += stride) {
        // read once, written once: streaming hints keep 3.5 GB of traffic from churning L2
        float4 p = __ldcs(p4 + i), mm = __ldcs(m4 + i), vv = __ldcs(v4 + i);
        const float4 g = __ldcs(g4 + i);
        adamw_update(p.x, g.x, mm.x, vv.x, a);
        adamw_update(p.y, g.y, mm.y, vv.y, a);
        adamw_update(p.z, g.z, mm.z, vv.z, a);
        adamw_update(p.w, g.w, mm.w, vv.w, a);
        __stcs(p4 + i, p); __stcs(m4 + i, mm); __stcs(v4 + i, vv);
    }
}

// ----------------------------------------------------------------------------------------------
// bf16 builds: the update on the fp32 master, params = bf16(master)

// a 32-bit integer hash with full avalanche (xor-shift-multiply; a bijection of uint32). The hash
// functions are __host__ too: tests/test_adamw.py compiles them into a host program and checks the
// numpy copy (llmc/ops/adamw.py: sr_bits) against them bit for bit, without a GPU.
__host__ __device__ __forceinline__ unsigned int mix32(unsigned int x) {
    x ^= x >> 16; x *= 0x7FEB352Du;
    x ^= x >> 15; x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

// the random bits of element idx under seed (llmc/ops/adamw.py: sr_bits is the same function in numpy)
struct SRKey {
    unsigned int k0, k1;
};
__host__ __device__ __forceinline__ SRKey sr_key(unsigned int seed) {
    return SRKey{mix32(seed), mix32(seed + 0x9E3779B9u)};
}
__host__ __device__ __forceinline__ unsigned int sr_bits(const SRKey& key, unsigned long long idx) {
    return mix32(mix32((unsigned int)idx ^ key.k0) + ((unsigned int)(idx >> 32) ^ key.k1));
}

// fp32 -> bf16 bits: stochastic rounding with random bits r, or round to nearest even if !stochastic.
// inf and NaN go through the plain conversion (adding to a NaN's bits could carry into the sign).
__device__ __forceinline__ unsigned short round_param(float x, bool stochastic, unsigned int r) {
    const unsigned int u = __float_as_uint(x);
    if (!stochastic || (u & 0x7F800000u) == 0x7F800000u) return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    return (unsigned short)((u + (r & 0xFFFFu)) >> 16);  // a carry out of the low half rounds up
}

__device__ __forceinline__ void adamw_scalar_bf16(bf16* params, const bf16* grads, float* m, float* v, float* master,
                                                  size_t i, const AdamWArgs& a, bool stochastic, const SRKey& key,
                                                  unsigned long long offset) {
    float p = master[i], mi = m[i], vi = v[i];
    adamw_update(p, to_f32(grads[i]), mi, vi, a);
    master[i] = p; m[i] = mi; v[i] = vi;
    params[i] = __ushort_as_bfloat16(round_param(p, stochastic, stochastic ? sr_bits(key, offset + i) : 0u));
}

// version 1, bf16: one thread per element
extern "C" __global__ void adamw_kernel1_bf16(bf16* params, const bf16* grads, float* m, float* v,
                                              const float* norm2, const float* hp, float* master,
                                              const unsigned int* seed, int n, long long offset) {
    LLMC_PDL_WAIT();
    const size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= (size_t)n) return;
    const AdamWArgs a = adamw_args(hp, norm2);
    const unsigned int s = __ldg(seed);
    adamw_scalar_bf16(params, grads, m, v, master, i, a, s != 0u, sr_key(s), (unsigned long long)offset);
}

// version 2, bf16: groups of 4 elements (16-byte loads of m, v, master; 8-byte loads and stores of
// grads, params) when the five arrays start at the same element offset modulo 4 (always so in the
// model: views at the same offset into 256-byte aligned buffers), with a scalar head up to that
// boundary and a scalar tail; otherwise the scalar grid-stride path (slower, never wrong).
extern "C" __global__ void adamw_kernel2_bf16(bf16* params, const bf16* grads, float* m, float* v,
                                              const float* norm2, const float* hp, float* master,
                                              const unsigned int* seed, int n, long long offset) {
    LLMC_PDL_WAIT();
    const AdamWArgs a = adamw_args(hp, norm2);
    const unsigned int s = __ldg(seed);
    const bool stochastic = s != 0u;
    const SRKey key = sr_key(s);
    const unsigned long long off = (unsigned long long)offset;
    const size_t tid = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const unsigned mis = ((uintptr_t)master & 15u) >> 2;  // element offset mod 4 of each array
    if ((((uintptr_t)m & 15u) >> 2) != mis || (((uintptr_t)v & 15u) >> 2) != mis ||
        (((uintptr_t)params & 7u) >> 1) != mis || (((uintptr_t)grads & 7u) >> 1) != mis) {
        for (size_t i = tid; i < (size_t)n; i += stride)
            adamw_scalar_bf16(params, grads, m, v, master, i, a, stochastic, key, off);
        return;
    }
    const int head = min(n, (int)((4u - mis) & 3u));  // elements up to the 16-byte boundary
    const int n4 = (n - head) >> 2;
    const int tail = head + 4 * n4;
    if (tid < (size_t)head) adamw_scalar_bf16(params, grads, m, v, master, tid, a, stochastic, key, off);
    if (tid < (size_t)(n - tail)) adamw_scalar_bf16(params, grads, m, v, master, tail + tid, a, stochastic, key, off);

    float4* w4 = reinterpret_cast<float4*>(master + head);
    float4* m4 = reinterpret_cast<float4*>(m + head);
    float4* v4 = reinterpret_cast<float4*>(v + head);
    const uint2* g4 = reinterpret_cast<const uint2*>(grads + head);
    uint2* p4 = reinterpret_cast<uint2*>(params + head);
    for (size_t i = tid; i < (size_t)n4; i += stride) {
        // read once, written once: streaming hints keep 3.5 GB of traffic from churning L2
        float4 p = __ldcs(w4 + i), mm = __ldcs(m4 + i), vv = __ldcs(v4 + i);
        float g[4];
        unpack_vec<bf16, 4>(__ldcs(g4 + i), g);
        adamw_update(p.x, g[0], mm.x, vv.x, a);
        adamw_update(p.y, g[1], mm.y, vv.y, a);
        adamw_update(p.z, g[2], mm.z, vv.z, a);
        adamw_update(p.w, g[3], mm.w, vv.w, a);
        __stcs(w4 + i, p); __stcs(m4 + i, mm); __stcs(v4 + i, vv);
        const unsigned long long idx = off + head + 4 * i;  // of p.x in the whole buffer
        unsigned short b0, b1, b2, b3;
        if (stochastic) {
            b0 = round_param(p.x, true, sr_bits(key, idx));
            b1 = round_param(p.y, true, sr_bits(key, idx + 1));
            b2 = round_param(p.z, true, sr_bits(key, idx + 2));
            b3 = round_param(p.w, true, sr_bits(key, idx + 3));
        } else {
            b0 = round_param(p.x, false, 0u); b1 = round_param(p.y, false, 0u);
            b2 = round_param(p.z, false, 0u); b3 = round_param(p.w, false, 0u);
        }
        __stcs(p4 + i, make_uint2((unsigned)b0 | ((unsigned)b1 << 16), (unsigned)b2 | ((unsigned)b3 << 16)));
    }
}

// ----------------------------------------------------------------------------------------------
// version 3: one launch over a list of ranges ("chunks"). ZeRO-1 (llmc/dist.py) updates piece
// `rank` of every tensor of every layer: at d12 on 2 ranks that is 148 ranges of 384 .. 1.2M
// values, and one launch per range cost ~1.4 ms per step on an H200 where the bytes take ~0.5 ms.
// Chunk c: its values sit at params + poff (the whole parameter buffer) and at grads, m, v (and
// master) + soff (the shard buffers, contiguous); it uses hyperparameter row `row` (hp + 8 * row:
// row 0 without weight decay, row 1 with) and, in bf16, seed seeds[c] with the hash index
// hoff + j for its value j. One chunk (poff = soff = 0, row 0) is the plain op of versions 1-2.
//   ch(C, 5) int64: poff, soff, n, row, hoff     tiles(nblocks, 2) int32: chunk, first value
// Each block updates up to ADAMW_TILE values of one chunk, a thread every blockDim.x-th value
// (scalar, coalesced: version 1 shows scalar accesses already reach the DRAM floor).
#define ADAMW_TILE 4096

struct AdamWChunk {
    long long poff, soff, hoff;
    int n, row, j0;
};

__device__ __forceinline__ AdamWChunk adamw_chunk(const long long* __restrict__ ch, const int* __restrict__ tiles,
                                                  int& c) {
    c = __ldg(tiles + 2 * blockIdx.x);
    const long long* e = ch + 5 * c;
    return AdamWChunk{__ldg(e), __ldg(e + 1), __ldg(e + 4), (int)__ldg(e + 2), (int)__ldg(e + 3),
                      __ldg(tiles + 2 * blockIdx.x + 1)};
}

extern "C" __global__ void adamw_kernel3(float* __restrict__ params, const float* __restrict__ grads,
                                         float* __restrict__ m, float* __restrict__ v,
                                         const float* __restrict__ norm2, const float* __restrict__ hp,
                                         const long long* __restrict__ ch, const int* __restrict__ tiles) {
    LLMC_PDL_WAIT();
    int c;
    const AdamWChunk k = adamw_chunk(ch, tiles, c);
    const AdamWArgs a = adamw_args(hp + 8 * k.row, norm2);
    const int end = min(k.n, k.j0 + ADAMW_TILE);
    float* p = params + k.poff;
    const float* g = grads + k.soff;
    float* mm = m + k.soff;
    float* vv = v + k.soff;
    for (int j = k.j0 + threadIdx.x; j < end; j += blockDim.x) {
        float pj = p[j], mj = mm[j], vj = vv[j];
        adamw_update(pj, g[j], mj, vj, a);
        p[j] = pj; mm[j] = mj; vv[j] = vj;
    }
}

extern "C" __global__ void adamw_kernel3_bf16(bf16* __restrict__ params, const bf16* __restrict__ grads,
                                              float* __restrict__ m, float* __restrict__ v,
                                              const float* __restrict__ norm2, const float* __restrict__ hp,
                                              float* __restrict__ master, const unsigned int* __restrict__ seeds,
                                              const long long* __restrict__ ch, const int* __restrict__ tiles) {
    LLMC_PDL_WAIT();
    int c;
    const AdamWChunk k = adamw_chunk(ch, tiles, c);
    const AdamWArgs a = adamw_args(hp + 8 * k.row, norm2);
    const unsigned int s = __ldg(seeds + c);
    const bool stochastic = s != 0u;
    const SRKey key = sr_key(s);
    const int end = min(k.n, k.j0 + ADAMW_TILE);
    bf16* p = params + k.poff;
    const bf16* g = grads + k.soff;
    float* mm = m + k.soff;
    float* vv = v + k.soff;
    float* w = master + k.soff;
    for (int j = k.j0 + threadIdx.x; j < end; j += blockDim.x) {
        float wj = w[j], mj = mm[j], vj = vv[j];
        adamw_update(wj, to_f32(g[j]), mj, vj, a);
        w[j] = wj; mm[j] = mj; vv[j] = vj;
        p[j] = __ushort_as_bfloat16(round_param(wj, stochastic,
                                                stochastic ? sr_bits(key, (unsigned long long)(k.hoff + j)) : 0u));
    }
}
