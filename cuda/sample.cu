// Sampling the next token on the GPU, one block per row of logits: what the KV-cache decoder runs
// after each step instead of downloading B x 50304 logits and sampling on the host.
//
// Same rule as the host's sample_token (llmc/sample.py), given one uniform draw u per row:
//   greedy (inv_temp == 0): the first index of the largest logit;
//   else keep the logits >= the k-th largest (k = top_k, ties at the k-th value kept; all if
//   top_k is 0 or >= V), weights w_i = exp((z_i - max z) * inv_temp), and take the first index j
//   whose running sum of w in index order exceeds u * sum(w).
// The k-th largest value comes from a radix select over the order-preserving uint32 image of the
// floats: four passes of 8 bits, each a 256-bin histogram (warp-aggregated shared atomics) of the
// logits that match the digits chosen so far. The running sum is a block scan over contiguous
// per-thread chunks, in double (the host adds in float64 as well): the two can disagree only when
// u * sum(w) lies within rounding of a boundary between two tokens.
//
// The row is first copied into shared memory (201 KB at GPT-2's vocabulary: one coalesced pass over
// global memory, all later passes from shared memory) when it fits (`staged`); else every pass reads
// global memory (L2). Launch: grid (B), block SAMPLE_THREADS, dynamic smem 4*V bytes if staged.
//
// bf16 build (issue 13, sample_kernel1_bf16): bf16 logits, everything else unchanged. A staged row
// is widened to fp32 on its way into shared memory (8-byte loads of 4 bf16; the same 4*V bytes, so
// the same staging rule); an unstaged row is read as bf16 by every pass. bf16 -> fp32 is exact, so
// the kernel samples from exactly the values the host sampler sees in from_bf16(logits).
#include "elem.cuh"

#define SAMPLE_THREADS 1024

__device__ __forceinline__ unsigned int float_key(float f) {  // order-preserving: a < b <=> key(a) < key(b)
    unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_float(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// the k-th largest of row[0..V) (k >= 1, counting repeated values), by radix select
template <typename R>
__device__ float kth_largest(const R* row, int V, int k, unsigned int* hist, int* bcast) {
    unsigned int prefix = 0, mask = 0;
    const int lane = threadIdx.x % WARP_SIZE;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        // every lane of the warp walks the loop the same number of times (for __match_any_sync)
        for (int base = threadIdx.x - lane; base < V; base += blockDim.x) {
            const int i = base + lane;
            const unsigned int key = i < V ? float_key(to_f32(row[i])) : 0u;
            const bool in = i < V && (key & mask) == prefix;
            const unsigned int digit = in ? (key >> shift) & 255u : 256u;  // 256: not counted
            const unsigned int peers = __match_any_sync(0xFFFFFFFFu, digit);
            if (in && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < WARP_SIZE) {  // the bin holding the k-th largest, counting from the top:
            // lane l holds bins 255-8l .. 248-8l; a prefix sum over the lanes finds the lane, which
            // then walks its 8 bins
            int cnt[8], tot = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) { cnt[j] = (int)hist[255 - 8 * lane - j]; tot += cnt[j]; }
            int incl = tot;
#pragma unroll
            for (int off = 1; off < WARP_SIZE; off <<= 1) {
                const int v = __shfl_up_sync(0xFFFFFFFFu, incl, off);
                if (lane >= off) incl += v;
            }
            const int excl = incl - tot;  // counts in the bins above this lane's
            if (excl < k && k <= incl) {  // exactly one lane: the matching counts total >= k
                int acc = excl, d = 248 - 8 * lane;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if (acc + cnt[j] >= k) { d = 255 - 8 * lane - j; break; }
                    acc += cnt[j];
                }
                bcast[0] = d;
                bcast[1] = k - acc;  // its rank within the bin
            }
        }
        __syncthreads();
        const unsigned int d = (unsigned int)bcast[0];
        k = bcast[1];
        prefix |= d << shift;
        mask |= 255u << shift;
        __syncthreads();  // bcast and hist are reused by the next pass
    }
    return key_float(prefix);
}

// everything after staging, over the row `row` (shared memory fp32 or global memory of either type)
template <typename R>
__device__ __forceinline__ void sample_row(int* tokens, const R* row, const double* uniforms, int V, int top_k,
                                           float inv_temp, unsigned int* hist, int* bcast, float* redf, int* redi,
                                           double* scan) {
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    // the largest logit and its first index (greedy's answer; the softmax's shift otherwise)
    float best = -FLT_MAX;
    int besti = V;
    for (int i = tid; i < V; i += blockDim.x) {
        const float z = to_f32(row[i]);
        if (z > best) { best = z; besti = i; }  // i increases: the first index of this thread's max
    }
    for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
        const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, off);
        const int oi = __shfl_xor_sync(0xFFFFFFFFu, besti, off);
        if (ob > best || (ob == best && oi < besti)) { best = ob; besti = oi; }
    }
    if (lane == 0) { redf[warp] = best; redi[warp] = besti; }
    __syncthreads();
    if (warp == 0) {
        best = lane < nwarps ? redf[lane] : -FLT_MAX;
        besti = lane < nwarps ? redi[lane] : V;
        for (int off = WARP_SIZE / 2; off > 0; off >>= 1) {
            const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, off);
            const int oi = __shfl_xor_sync(0xFFFFFFFFu, besti, off);
            if (ob > best || (ob == best && oi < besti)) { best = ob; besti = oi; }
        }
        if (lane == 0) { redf[0] = best; redi[0] = besti; }
    }
    __syncthreads();
    const float zmax = redf[0];
    if (inv_temp == 0.0f) {
        if (tid == 0) tokens[blockIdx.x] = redi[0];
        return;
    }
    const float kth = (top_k > 0 && top_k < V) ? kth_largest(row, V, top_k, hist, bcast) : -FLT_MAX;

    // weights over contiguous chunks, one per thread, summed in index order; block scan in double
    const int chunk = (V + blockDim.x - 1) / blockDim.x;
    const int i0 = min(V, tid * chunk), i1 = min(V, i0 + chunk);
    double local = 0.0;
    for (int i = i0; i < i1; i++) {
        const float z = to_f32(row[i]);
        if (z >= kth) local += (double)expf((z - zmax) * inv_temp);
    }
    scan[tid] = local;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {  // inclusive Hillis-Steele scan
        const double v = tid >= off ? scan[tid - off] : 0.0;
        __syncthreads();
        scan[tid] += v;
        __syncthreads();
    }
    const double total = scan[blockDim.x - 1];
    const double target = uniforms[blockIdx.x] * total;
    const double before = tid ? scan[tid - 1] : 0.0;  // chunks tile [0, total) without gaps
    if (tid == 0) bcast[0] = -1;
    __syncthreads();
    if (local > 0.0 && before <= target && target < scan[tid]) {  // the draw lands in this chunk
        double acc = before;
        int pick = -1, last = -1;
        for (int i = i0; i < i1; i++) {
            const float z = to_f32(row[i]);
            if (z < kth) continue;
            const double w = (double)expf((z - zmax) * inv_temp);
            if (w == 0.0) continue;
            last = i;
            acc += w;
            if (acc > target) { pick = i; break; }
        }
        bcast[0] = pick >= 0 ? pick : last;  // rounding within the chunk: its last weighted token
    }
    __syncthreads();
    if (bcast[0] < 0) {  // target >= total by rounding: the last token with a weight
        int last = -1;
        for (int i = i1 - 1; i >= i0; i--) {
            const float z = to_f32(row[i]);
            if (z >= kth && expf((z - zmax) * inv_temp) > 0.0f) { last = i; break; }
        }
        for (int off = WARP_SIZE / 2; off > 0; off >>= 1) last = max(last, __shfl_xor_sync(0xFFFFFFFFu, last, off));
        if (lane == 0) redi[warp] = last;
        __syncthreads();
        if (tid == 0) {
            int m = -1;
            for (int w = 0; w < nwarps; w++) m = max(m, redi[w]);
            bcast[0] = m;
        }
        __syncthreads();
    }
    if (tid == 0) tokens[blockIdx.x] = bcast[0];
}

// the kernel: stage the row when asked, then sample_row. T = float: one instantiation over either
// pointer (as before the bf16 build); T = bf16: shared memory fp32 or global bf16.
template <typename T>
__device__ __forceinline__ void sample1(int* tokens, const T* logits, const double* uniforms, int V, int Vp,
                                        int top_k, float inv_temp, int staged) {
    extern __shared__ float4 srow4[];  // (V) the row, when staged, as fp32
    __shared__ unsigned int hist[256];
    __shared__ int bcast[2];
    __shared__ float redf[WARP_SIZE];
    __shared__ int redi[WARP_SIZE];
    __shared__ double scan[SAMPLE_THREADS];
    const T* grow = logits + (size_t)blockIdx.x * Vp;
    const int tid = threadIdx.x;
    float* srow = reinterpret_cast<float*>(srow4);
    if (staged) {  // one coalesced pass; Vp % 4 == 0 and the rows are aligned to 4 elements
        const int V4 = V / 4;
        if constexpr (sizeof(T) == 4) {
            const float4* g4 = reinterpret_cast<const float4*>(grow);
#pragma unroll 4
            for (int i = tid; i < V4; i += blockDim.x) srow4[i] = __ldcs(g4 + i);
        } else {
#pragma unroll 4
            for (int i = tid; i < V4; i += blockDim.x) {
                float f[4];
                load_vec<T, 4, LD_CS>(grow + 4 * i, f);
                srow4[i] = make_float4(f[0], f[1], f[2], f[3]);
            }
        }
        for (int i = 4 * V4 + tid; i < V; i += blockDim.x) srow[i] = to_f32(grow[i]);
        __syncthreads();
    }
    if constexpr (sizeof(T) == 4) {
        sample_row<float>(tokens, staged ? srow : grow, uniforms, V, top_k, inv_temp, hist, bcast, redf, redi, scan);
    } else {
        if (staged) sample_row<float>(tokens, srow, uniforms, V, top_k, inv_temp, hist, bcast, redf, redi, scan);
        else sample_row<T>(tokens, grow, uniforms, V, top_k, inv_temp, hist, bcast, redf, redi, scan);
    }
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_kernel1(
        int* tokens, const float* logits, const double* uniforms, int V, int Vp, int top_k, float inv_temp,
        int staged) {
    LLMC_PDL_WAIT();
    sample1<float>(tokens, logits, uniforms, V, Vp, top_k, inv_temp, staged);
}
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_kernel1_bf16(
        int* tokens, const bf16* logits, const double* uniforms, int V, int Vp, int top_k, float inv_temp,
        int staged) {
    LLMC_PDL_WAIT();
    sample1<bf16>(tokens, logits, uniforms, V, Vp, top_k, inv_temp, staged);
}
