// Classifier: fused softmax + cross-entropy loss + the loss gradient w.r.t. the logits.
// One row of logits per token; the gradient overwrites the logits in place (llm.c's trick: the
// logits are never needed again after the loss, and (N, Vp) floats is the largest activation).
//
// version 1: one block per row, three passes over the row in global memory (max, sum of exp, write); scalar loads
// version 2: one block per row, online softmax (max and sum in ONE read pass), then the write pass; float4, streaming hints
// version 3: one block per row, the row copied once into shared memory with cp.async; both passes read shared memory
// version 4: version 3 made persistent: a block walks rows and prefetches its next row into shared memory during the write pass
// version 5: version 3 with the exponentials as __expf (FMUL + MUFU.EX2) instead of expf (fp32 and bf16)
// version 6: version 4 with version 5's __expf (fp32 and bf16)
// version 7: version 5 with each exponential one FFMA + MUFU.EX2, 1/s and dloss folded into its offset
// version 8: version 7; its loss-only form (evaluation) streamed through registers, 256-thread blocks, no shared memory
//
// bf16 builds (issue 13) of versions 1, 2 and 3: the same bodies instantiated for bf16 logits
// (entry points <name>_bf16). The row is read as bf16 and widened exactly; max, sum of exp, the
// loss and each gradient value are fp32 arithmetic; the gradient is rounded to bf16 once, on its
// store. losses stay fp32. Chunks are 16 bytes (8 bf16) when Vp % 8 == 0, else 8 bytes (4 bf16:
// the _vec4 instantiations), so a bf16 build takes every shape the fp32 one takes.
//
//   losses(N) =, logits(N, Vp) in/out, targets(N) int32, dloss, write_dlogits
//   losses[i] = -log softmax(logits[i, :V])[targets[i]]
//   if write_dlogits: logits[i, :V] = (softmax - onehot(targets[i])) * dloss, logits[i, V:Vp] = 0
// Padded columns V..Vp-1 are never read for the loss (they may hold anything, NaN included).
// targets must lie in [0, V): the data loader guarantees it, the kernels do not check.
//
// Memory traffic (N=4096, Vp=50304 at GPT-2 124M B=4 T=1024: 824 MB of logits):
//   floor: read N*Vp*4 once + write N*Vp*4 once = 1.65 GB -> 0.55 ms at 2.98 TB/s
//   version 1 reads the row three times (2 re-reads mostly from DRAM: a 201 KB row x 2 blocks/SM
//   x 132 SMs is 53 MB, more than the 50 MB L2), version 2 twice, versions 3/4 once.
//
// Measured on the H100 (dev/cuda/classifier.py, L2 flushed, 2026-11-22), N=4096 Vp=50304, with the
// gradient (GB/s counts the floor's 1.65 GB):
//   version 1: 1.45 ms (1.13 TB/s)     version 2: 0.575 ms (2.87 TB/s) at 1024 threads
//   version 3: 0.565 ms (2.92 TB/s)    version 4: 0.593 ms (2.78 TB/s)
//   torch F.cross_entropy forward+backward on (N, V): 2.53 ms
// Version 2 is nearly at the floor only at 1024 threads: it needs 45 registers, so one block per SM,
// 132 rows (26.5 MB) in flight, and pass 2 finds its row still in L2. At 512 threads (more rows in
// flight) it drops to 2.36 TB/s, at 256 to 2.03. Version 4's prefetch did not pay: the block
// switch between rows was not costing anything measurable, and the persistent loop is 5% slower.
//
// bf16 (not yet measured): the floor halves, read N*Vp*2 + write N*Vp*2 = 0.82 GB -> 0.277 ms. A row
// is 100.5 KB of shared memory in version 3, so two blocks fit on an SM (1024 threads each when the
// kernel stays within 32 registers: __launch_bounds__(1024, 2)): one block's loads overlap the
// other's reductions and stores, which matters more than in fp32 since each row's fixed cost
// (two block reductions, the launch of a block) is spread over half the bytes.
#include "elem.cuh"
#include "fold.cuh"  // fold_exp: the fold kernels at the end

// 16-byte loads each thread issues before using the first (version 2)
#define UNROLL 4

// ----------------------------------------------------------------------------------------------
// online softmax pieces: a running (max m, sum s) with s = sum exp(x - m)

// merge (m2, s2) into (m, s). m starts at -FLT_MAX (not -inf) so that merging two empty states
// gives exp(0) * 0 = 0 instead of exp(-inf - -inf) = NaN.
__device__ __forceinline__ void ms_merge(float& m, float& s, float m2, float s2) {
    const float mn = fmaxf(m, m2);
    s = s * expf(m - mn) + s2 * expf(m2 - mn);
    m = mn;
}

// fold one chunk of VEC values into (m, s); lanes masked out are -INFINITY and add expf(-inf) = 0
// exactly. At least one lane is real whenever this is called, so m never stays at -FLT_MAX after it.
// (VEC = 4: the max is fmaxf(fmaxf(a0, a1), fmaxf(a2, a3)), the sum ((e0 + e1) + e2) + e3.)
// e^x: expf (a range reduction and a polynomial, ~10 instructions) or, FAST (version 5), __expf (one
// FMUL and MUFU.EX2: max error 2 + 1.16|x| ulp, i.e. under 1e-5 relative for x > -70; what it adds
// is negligible against the sums and bf16 roundings it feeds)
template <bool FAST>
__device__ __forceinline__ float cls_exp(float x) { return FAST ? __expf(x) : expf(x); }

template <int VEC, bool FAST = false>
__device__ __forceinline__ void ms_update(float& m, float& s, const float (&a)[VEC]) {
    float t[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) t[k] = a[k];
#pragma unroll
    for (int w = 1; w < VEC; w *= 2)  // pairwise max tree
#pragma unroll
        for (int k = 0; k < VEC; k += 2 * w) t[k] = fmaxf(t[k], t[k + w]);
    const float cm = t[0];
    if (cm > m) {  // rescale only when the max moves: rare after the first few chunks
        s *= expf(m - cm);
        m = cm;
    }
    float e = cls_exp<FAST>(a[0] - m);
#pragma unroll
    for (int k = 1; k < VEC; k++) e += cls_exp<FAST>(a[k] - m);
    s += e;
}

// block-wide merge of every thread's (m, s); every thread gets the result. Ends with a barrier,
// so the shared scratch can be reused at once (version 4 calls it once per row).
__device__ __forceinline__ void block_reduce_ms(float& m, float& s, float* sh_m, float* sh_s) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ms_merge(m, s, m2, s2);
    }
    if (lane == 0) { sh_m[warp] = m; sh_s[warp] = s; }
    __syncthreads();
    m = (lane < nwarps) ? sh_m[lane] : -FLT_MAX;
    s = (lane < nwarps) ? sh_s[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, o);
        ms_merge(m, s, m2, s2);
    }
    __syncthreads();
}

// the gradient of one logit: (p - onehot) * dloss on real columns, exactly 0 on padded ones
// (a select, not arithmetic, so NaN in the padding cannot leak through)
template <bool FAST = false>
__device__ __forceinline__ float dlogit(float x, int col, int V, int target, float m, float inv_s, float dloss) {
    const float p = cls_exp<FAST>(x - m) * inv_s;
    return (col < V) ? (p - (col == target ? 1.0f : 0.0f)) * dloss : 0.0f;
}

// the gradient of the chunk at columns col..col+VEC-1, in place
template <int VEC, bool FAST = false>
__device__ __forceinline__ void dlogit_vec(float (&x)[VEC], int col, int V, int target, float m, float inv_s, float dloss) {
#pragma unroll
    for (int k = 0; k < VEC; k++) x[k] = dlogit<FAST>(x[k], col + k, V, target, m, inv_s, dloss);
}

// the chunk at columns col..col+VEC-1 with columns >= V masked to -inf (the first is always real)
template <int VEC>
__device__ __forceinline__ void mask_vec(float (&a)[VEC], int col, int V) {
    if (col + VEC - 1 >= V) {  // only the chunk that straddles V takes this branch
#pragma unroll
        for (int k = 1; k < VEC; k++)
            if (col + k >= V) a[k] = -INFINITY;
    }
}

// ----------------------------------------------------------------------------------------------
// version 1: three plain passes, one block per row, any V and Vp.
// traffic per row: read V elements three times (max, sum, write), write Vp elements.

template <typename T>
__device__ __forceinline__ void classifier1_row(float* losses, T* logits, const int* targets,
                                                float dloss, int write_dlogits, int N, int V, int Vp) {
    __shared__ float shared[32];
    __shared__ float sh_xt;  // logits[row, target], read before anything overwrites it
    const int row = blockIdx.x;
    T* x = logits + (size_t)row * Vp;  // (Vp,)
    const int target = targets[row];
    if (threadIdx.x == 0) sh_xt = to_f32(x[target]);

    float m = -FLT_MAX;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, to_f32(x[j]));
    m = block_reduce_max(m, shared);  // its barriers also publish sh_xt
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_f32(x[j]) - m);
    s = block_reduce_sum(s, shared);

    if (threadIdx.x == 0) losses[row] = logf(s) + m - sh_xt;  // -(x_t - m - log s)
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    for (int j = threadIdx.x; j < Vp; j += blockDim.x)
        x[j] = from_f32<T>(dlogit(to_f32(x[j]), j, V, target, m, inv_s, dloss));
}

extern "C" __global__ void classifier_kernel1(float* losses, float* logits, const int* targets,
                                              float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier1_row<float>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);
}
extern "C" __global__ void classifier_kernel1_bf16(float* losses, bf16* logits, const int* targets,
                                                   float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier1_row<bf16>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);
}

// ----------------------------------------------------------------------------------------------
// version 2: online softmax. Pass 1 reads the row once for both max and sum (plain loads, so the
// row may still be in L2 for pass 2); pass 2 re-reads it with a last-use hint and writes the
// gradient with a streaming store. Needs Vp % VEC == 0 and logits aligned to a chunk (VEC elements).
// traffic per row: read ceil(V/VEC)*VEC elements twice, write Vp elements.

template <typename T, int VEC>
__device__ __forceinline__ void classifier2_row(float* losses, T* logits, const int* targets,
                                                float dloss, int write_dlogits, int N, int V, int Vp) {
    __shared__ float sh_m[32], sh_s[32];
    __shared__ float sh_xt;
    const int row = blockIdx.x;
    T* x = logits + (size_t)row * Vp;  // (Vp,)
    const int target = targets[row];
    if (threadIdx.x == 0) sh_xt = to_f32(x[target]);

    const int nv = ceil_div(V, VEC);  // chunks holding at least one real column
    const int bs = blockDim.x;
    float m = -FLT_MAX, s = 0.0f;
    // UNROLL loads issued before the first is used: the online update branches, so the compiler
    // would otherwise leave one 16-byte load in flight per thread
    int i = threadIdx.x;
    for (; i + (UNROLL - 1) * bs < nv; i += UNROLL * bs) {
        float v[UNROLL][VEC];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) load_vec<T, VEC>(x + VEC * (i + k * bs), v[k]);
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            mask_vec<VEC>(v[k], VEC * (i + k * bs), V);
            ms_update<VEC>(m, s, v[k]);
        }
    }
    for (; i < nv; i += bs) {
        float v[VEC];
        load_vec<T, VEC>(x + VEC * i, v);
        mask_vec<VEC>(v, VEC * i, V);
        ms_update<VEC>(m, s, v);
    }
    block_reduce_ms(m, s, sh_m, sh_s);  // its barriers also publish sh_xt

    if (threadIdx.x == 0) losses[row] = logf(s) + m - sh_xt;
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    i = threadIdx.x;
    for (; i + (UNROLL - 1) * bs < nv; i += UNROLL * bs) {
        float v[UNROLL][VEC];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) load_vec<T, VEC, LD_CS>(x + VEC * (i + k * bs), v[k]);
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            const int col = VEC * (i + k * bs);
            dlogit_vec<VEC>(v[k], col, V, target, m, inv_s, dloss);
            store_vec<T, VEC, ST_CS>(x + col, v[k]);
        }
    }
    for (; i < nv; i += bs) {
        float v[VEC];
        load_vec<T, VEC, LD_CS>(x + VEC * i, v);
        dlogit_vec<VEC>(v, VEC * i, V, target, m, inv_s, dloss);
        store_vec<T, VEC, ST_CS>(x + VEC * i, v);
    }
    const float zero[VEC] = {};
    for (i = nv + threadIdx.x; i < Vp / VEC; i += bs)  // padded chunks: zeros, never read
        store_vec<T, VEC, ST_CS>(x + VEC * i, zero);
}

extern "C" __global__ void classifier_kernel2(float* losses, float* logits, const int* targets,
                                              float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier2_row<float, 4>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);
}
extern "C" __global__ void classifier_kernel2_bf16(float* losses, bf16* logits, const int* targets,
                                                   float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier2_row<bf16, 8>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);  // Vp % 8 == 0
}
extern "C" __global__ void classifier_kernel2_bf16_vec4(float* losses, bf16* logits, const int* targets,
                                                        float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier2_row<bf16, 4>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);  // Vp % 4 == 0
}

// ----------------------------------------------------------------------------------------------
// versions 3 and 4: the row goes through shared memory, so DRAM sees each logit read once and
// written once (the floor). A 50257-column fp32 row is 201 KB: one block per SM on an H100 (227 KB
// opt-in), not possible on an A100 (163 KB): the launcher refuses there. A bf16 row is 100.5 KB.
//
// Each thread copies chunks i = tid, tid + blockDim, ... and later reads exactly those chunks back,
// so a thread only needs its OWN cp.async to have landed (cp.async.wait_all), never a barrier.

extern __shared__ __align__(16) unsigned char cls_smem[];  // versions 3 (both types) and 4: the row

// cp.async of one chunk: 16 bytes bypass L1 (.cg), 8 bytes must go through it (.ca: .cg is 16 only)
template <int BYTES>
__device__ __forceinline__ void cp_async(void* smem, const void* gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" :: "r"(s), "l"(gmem), "n"(BYTES) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// a row kernel's first step: this thread's chunks of the row's real columns into shared memory (each
// thread later reads back only its own chunks, so waiting for its own copies is enough)
template <typename T, int VEC>
__device__ __forceinline__ void smem_row_copy(T* srow, const T* x, int nv) {
    for (int i = threadIdx.x; i < nv; i += blockDim.x) cp_async<VEC * sizeof(T)>(srow + VEC * i, x + VEC * i);
    cp_async_commit();
    cp_async_wait_all();
}

// the padded chunks (columns past the real ones, up to Vp) of the gradient row: zeros
template <typename T, int VEC>
__device__ __forceinline__ void zero_padding(T* x, int nv, int Vp) {
    const float zero[VEC] = {};
    for (int i = nv + threadIdx.x; i < Vp / VEC; i += blockDim.x) store_vec<T, VEC, ST_CS>(x + VEC * i, zero);
}

// the target's logit into xt when chunk i (columns VEC i ..) holds it: selects, not v[k] (a run-time
// index would put v in local memory)
template <int VEC>
__device__ __forceinline__ void pick_target(const float (&v)[VEC], int i, int target, float& xt) {
    if (target / VEC == i) {
        const int k = target % VEC;
#pragma unroll
        for (int j = 0; j < VEC; j++)
            if (k == j) xt = v[j];
    }
}

// pass 1 over a row held in shared memory: this thread's chunks, online (m, s); the thread that
// owns the target's chunk also picks up the target logit.
template <typename T, int VEC, bool FAST = false>
__device__ __forceinline__ void smem_row_stats(const T* srow, int nv, int V, int target,
                                               float& m, float& s, float& xt) {
    m = -FLT_MAX; s = 0.0f;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_vec<T, VEC>(srow + VEC * i, v);
        pick_target<VEC>(v, i, target, xt);
        mask_vec<VEC>(v, VEC * i, V);
        ms_update<VEC, FAST>(m, s, v);
    }
}

// version 3: one block per row. Traffic per row: read ceil(V/VEC)*VEC elements once, write Vp.
template <typename T, int VEC, bool FAST = false>
__device__ __forceinline__ void classifier3_row(float* losses, T* logits, const int* targets,
                                                float dloss, int write_dlogits, int N, int V, int Vp) {
    T* srow = reinterpret_cast<T*>(cls_smem);  // (ceil(V/VEC)*VEC,) this row's real columns
    __shared__ float sh_m[32], sh_s[32];
    const int row = blockIdx.x;
    T* x = logits + (size_t)row * Vp;  // (Vp,)
    const int target = targets[row];
    const int nv = ceil_div(V, VEC);

    smem_row_copy<T, VEC>(srow, x, nv);  // the whole row at once: ~6-13 chunks per thread in flight at 1024 threads

    float m, s, xt = 0.0f;
    smem_row_stats<T, VEC, FAST>(srow, nv, V, target, m, s, xt);
    block_reduce_ms(m, s, sh_m, sh_s);
    if ((target / VEC) % blockDim.x == threadIdx.x) losses[row] = logf(s) + m - xt;  // the target's owner
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    for (int i = threadIdx.x; i < nv; i += blockDim.x) {
        float v[VEC];
        load_vec<T, VEC>(srow + VEC * i, v);
        dlogit_vec<VEC, FAST>(v, VEC * i, V, target, m, inv_s, dloss);
        store_vec<T, VEC, ST_CS>(x + VEC * i, v);
    }
    zero_padding<T, VEC>(x, nv, Vp);
}

// The entry points of versions 3, 5, 6 and 7: classifier_kernel<ID> (fp32, VEC 4), <ID>_bf16 (VEC 8,
// Vp % 8 == 0) and <ID>_bf16_vec4 (VEC 4, Vp % 4 == 0), each running ROW<T, VEC, ...> on its arguments.
// The bf16 ones' launch bounds: two resident blocks of 1024 threads per SM need <= 32 registers per thread.
#define CLS_ROW_ENTRY_BF16(NAME, VEC, ROW, ...)                                                            \
    extern "C" __global__ void __launch_bounds__(1024, 2) NAME(float* losses, bf16* logits,                \
            const int* targets, float dloss, int write_dlogits, int N, int V, int Vp) {                    \
        LLMC_PDL_WAIT();                                                                                   \
        ROW<bf16, VEC, ##__VA_ARGS__>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);            \
    }
#define CLS_ROW_ENTRIES(ID, ROW, ...)                                                                      \
    extern "C" __global__ void classifier_kernel##ID(float* losses, float* logits, const int* targets,     \
            float dloss, int write_dlogits, int N, int V, int Vp) {                                        \
        LLMC_PDL_WAIT();                                                                                   \
        ROW<float, 4, ##__VA_ARGS__>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);             \
    }                                                                                                      \
    CLS_ROW_ENTRY_BF16(classifier_kernel##ID##_bf16, 8, ROW, ##__VA_ARGS__)                                \
    CLS_ROW_ENTRY_BF16(classifier_kernel##ID##_bf16_vec4, 4, ROW, ##__VA_ARGS__)
CLS_ROW_ENTRIES(3, classifier3_row)

// version 5: version 3 with the exponentials on the SFU (cls_exp<true>: __expf). At GPT-2's shape in
// bf16 a row is ~2 exponentials per logit; with expf that is ~35 instructions per logit in all, which
// at ~30 T lane-instructions/s on an H100 is 0.23 ms for N = 4096: most of the 0.28 ms the bytes take,
// so the kernel was issue-bound beside its memory traffic. __expf brings it to ~20.
CLS_ROW_ENTRIES(5, classifier3_row, true)

// version 7: version 5 with each exponential as one FFMA and one MUFU.EX2: e^(x - m) = 2^(x log2e -
// m log2e), with m log2e kept beside m, and in the write pass 1/s and dloss folded into the offset
// (p dloss = 2^(x log2e - (m log2e + log2 s - log2 dloss)), dloss > 0) for every chunk that is all
// real columns and does not hold the target: ~4 instructions a logit there, where 5 spends ~12 on the
// subtraction, the scaling, the padding and target selects; the target's chunk and the chunk that
// straddles V (one each a row) take 5's exact form. In bf16 the instructions, not the bytes, were
// the limit on an H200 (71-75% of a copy of the same bytes; fp32, half the logits a byte, 93%).
// Arguments of up to |64| carry an absolute rounding of ~4e-6, a relative error of ~3e-6 in p.
__device__ __forceinline__ float cls_ex2(float x) {  // 2^x; 2^-inf = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#define CLS_LOG2E 1.4426950408889634f

// chunk i (columns VEC i ..) of a row into a thread's online (m, ml = m log2e, s) in version 7's form, and
// the target's logit into xt when the chunk holds it (versions 7 and 8)
template <int VEC>
__device__ __forceinline__ void cls7_chunk_stats(float (&v)[VEC], int i, int target, int V, float& m, float& ml,
                                                 float& s, float& xt) {
    pick_target<VEC>(v, i, target, xt);
    mask_vec<VEC>(v, VEC * i, V);
    float t[VEC];
#pragma unroll
    for (int k = 0; k < VEC; k++) t[k] = v[k];
#pragma unroll
    for (int w = 1; w < VEC; w *= 2)
#pragma unroll
        for (int k = 0; k < VEC; k += 2 * w) t[k] = fmaxf(t[k], t[k + w]);
    if (t[0] > m) {
        s *= cls_ex2((m - t[0]) * CLS_LOG2E);
        m = t[0];
        ml = m * CLS_LOG2E;
    }
    float e = 0.0f;
#pragma unroll
    for (int k = 0; k < VEC; k++) e += cls_ex2(fmaf(v[k], CLS_LOG2E, -ml));
    s += e;
}

template <typename T, int VEC>
__device__ __forceinline__ void classifier7_row(float* losses, T* logits, const int* targets,
                                                float dloss, int write_dlogits, int N, int V, int Vp) {
    T* srow = reinterpret_cast<T*>(cls_smem);  // (ceil(V/VEC)*VEC,) this row's real columns
    __shared__ float sh_m[32], sh_s[32];
    const int row = blockIdx.x, tid = threadIdx.x, bd = blockDim.x;
    T* x = logits + (size_t)row * Vp;  // (Vp,)
    const int target = targets[row];
    const int nv = ceil_div(V, VEC);
    smem_row_copy<T, VEC>(srow, x, nv);

    // pass 1: online (m, s), s = sum 2^(x log2e - ml), ml = m log2e (-FLT_MAX before the first chunk:
    // a -inf logit then gives 2^-inf = 0, not the NaN of -inf + inf)
    float m = -FLT_MAX, ml = -FLT_MAX, s = 0.0f, xt = 0.0f;
    for (int i = tid; i < nv; i += bd) {
        float v[VEC];
        load_vec<T, VEC>(srow + VEC * i, v);
        cls7_chunk_stats<VEC>(v, i, target, V, m, ml, s, xt);
    }
    block_reduce_ms(m, s, sh_m, sh_s);
    if ((target / VEC) % bd == tid) losses[row] = logf(s) + m - xt;  // the target's owner
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    const bool fold = dloss > 0.0f;
    const float c = m * CLS_LOG2E + log2f(s) - (fold ? log2f(dloss) : 0.0f);
    const int tchunk = target / VEC, vfull = V / VEC;  // chunks below vfull hold real columns only
    for (int i = tid; i < nv; i += bd) {
        float v[VEC];
        load_vec<T, VEC>(srow + VEC * i, v);
        if (fold && i < vfull && i != tchunk) {
#pragma unroll
            for (int k = 0; k < VEC; k++) v[k] = cls_ex2(fmaf(v[k], CLS_LOG2E, -c));
        } else {
            dlogit_vec<VEC, true>(v, VEC * i, V, target, m, inv_s, dloss);
        }
        store_vec<T, VEC, ST_CS>(x + VEC * i, v);
    }
    zero_padding<T, VEC>(x, nv, Vp);
}

CLS_ROW_ENTRIES(7, classifier7_row)

// version 8: version 7, whose loss-only form (write_dlogits = 0: evaluation) ran at 75% of a copy of its
// bytes in bf16 (H200): it staged the whole row in shared memory (100.5 KB), so two rows an SM, each
// waiting for all its bytes before any arithmetic. Without a gradient to write nothing needs the row twice:
// this kernel streams it from global memory into registers, CLS8_U 16-byte chunks a thread in flight, with
// 7's online (m, s), in blocks of 256 (no shared memory: many rows an SM). The gradient form is 7's kernel.
// H200, N=4096, loss only: bf16 0.114 ms against 7's 0.133 (89% against 76% of a copy of the same bytes),
// fp32 0.214 against 0.229 (91% against 85%); CLS8_U 2 or 8: bf16 86%.
#ifndef CLS8_U
#define CLS8_U 4
#endif
template <typename T, int VEC>
__device__ __forceinline__ void classifier8_loss_row(float* losses, const T* logits, const int* targets, int V, int Vp) {
    typedef typename RawVec<VEC * sizeof(T)>::type R;
    __shared__ float sh_m[32], sh_s[32];
    const int row = blockIdx.x, tid = threadIdx.x, bd = blockDim.x;
    const R* x = reinterpret_cast<const R*>(logits + (size_t)row * Vp);  // (Vp / VEC,) chunks
    const int target = targets[row];
    const int nv = ceil_div(V, VEC);
    float m = -FLT_MAX, ml = -FLT_MAX, s = 0.0f, xt = 0.0f;
    for (int i0 = tid; i0 < nv; i0 += CLS8_U * bd) {
        R r[CLS8_U];
#pragma unroll
        for (int u = 0; u < CLS8_U; u++)
            if (i0 + u * bd < nv) r[u] = ld_raw<LD_CS>(x + i0 + u * bd);
#pragma unroll
        for (int u = 0; u < CLS8_U; u++) {
            const int i = i0 + u * bd;
            if (i >= nv) break;
            float v[VEC];
            unpack_vec<T, VEC>(r[u], v);
            cls7_chunk_stats<VEC>(v, i, target, V, m, ml, s, xt);
        }
    }
    block_reduce_ms(m, s, sh_m, sh_s);
    if ((target / VEC) % bd == tid) losses[row] = logf(s) + m - xt;  // the target's owner
}

extern "C" __global__ void __launch_bounds__(256) classifier_kernel8_loss(float* losses, float* logits,
        const int* targets, float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier8_loss_row<float, 4>(losses, logits, targets, V, Vp);
}
extern "C" __global__ void __launch_bounds__(256) classifier_kernel8_loss_bf16(float* losses, bf16* logits,
        const int* targets, float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier8_loss_row<bf16, 8>(losses, logits, targets, V, Vp);  // Vp % 8 == 0
}
extern "C" __global__ void __launch_bounds__(256) classifier_kernel8_loss_bf16_vec4(float* losses, bf16* logits,
        const int* targets, float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier8_loss_row<bf16, 4>(losses, logits, targets, V, Vp);  // Vp % 4 == 0
}

// version 4 (fp32): persistent. Block b handles rows b, b + gridDim, ...; right after a thread
// has written the gradient of its chunk i it issues the cp.async of chunk i of its next row into the
// same slot (the slot is its own, so no barrier), so the next row's reads overlap this row's writes
// instead of an SM going quiet between rows. The loss is written by the target's owner (no shared
// slot that the next row could overwrite early), and block_reduce_ms ends with a barrier.
// version 6 (fp32 and bf16): version 4 with version 5's __expf.
template <typename T, int VEC, bool FAST = false>
__device__ __forceinline__ void classifier4_rows(float* losses, T* logits, const int* targets,
                                                 float dloss, int write_dlogits, int N, int V, int Vp) {
    T* srow = reinterpret_cast<T*>(cls_smem);  // (ceil(V/VEC)*VEC,) the current row's real columns
    __shared__ float sh_m[32], sh_s[32];
    const int nv = ceil_div(V, VEC);
    int row = blockIdx.x;
    if (row < N) {
        const T* x = logits + (size_t)row * Vp;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) cp_async<VEC * sizeof(T)>(srow + VEC * i, x + VEC * i);
    }
    cp_async_commit();
    for (; row < N; row += gridDim.x) {
        T* x = logits + (size_t)row * Vp;  // (Vp,)
        const int next = row + gridDim.x;
        const T* xn = logits + (size_t)next * Vp;
        const int target = targets[row];
        cp_async_wait_all();

        float m, s, xt = 0.0f;
        smem_row_stats<T, VEC, FAST>(srow, nv, V, target, m, s, xt);
        block_reduce_ms(m, s, sh_m, sh_s);
        if ((target / VEC) % blockDim.x == threadIdx.x) losses[row] = logf(s) + m - xt;
        const float inv_s = 1.0f / s;
        for (int i = threadIdx.x; i < nv; i += blockDim.x) {
            if (write_dlogits) {
                float v[VEC];
                load_vec<T, VEC>(srow + VEC * i, v);
                dlogit_vec<VEC, FAST>(v, VEC * i, V, target, m, inv_s, dloss);
                store_vec<T, VEC, ST_CS>(x + VEC * i, v);
            }
            if (next < N) cp_async<VEC * sizeof(T)>(srow + VEC * i, xn + VEC * i);  // after the read of chunk i above
        }
        cp_async_commit();
        if (write_dlogits) {
            const float zero[VEC] = {};
            for (int i = nv + threadIdx.x; i < Vp / VEC; i += blockDim.x)  // padded chunks: zeros
                store_vec<T, VEC, ST_CS>(x + VEC * i, zero);
        }
    }
    cp_async_wait_all();  // never exit with copies in flight
}

extern "C" __global__ void classifier_kernel4(float* losses, float* logits, const int* targets,
                                              float dloss, int write_dlogits, int N, int V, int Vp) {
    LLMC_PDL_WAIT();
    classifier4_rows<float, 4>(losses, logits, targets, dloss, write_dlogits, N, V, Vp);
}
CLS_ROW_ENTRIES(6, classifier4_rows, true)

// ----------------------------------------------------------------------------------------------
// The classifier folded into the lm head's GEMMs (the model's `fold` form, LLMC_CLASSIFIER_FOLD;
// docs/matmul_notes.md, "The classifier folded into the lm head"). The lm head's forward (GEMM engine
// 5's _fold instances) wrote P = p' = fold_exp(logit, k) (cuda/fold.cuh: 2^(logit log2 e - k)) over
// the logits, 0 in the padded columns, and per row and tile (128 wide; 256 with LLMC_WGMMA_FOLD256) the
// sum of p' in FS. Per row:
//   S = the tile sums added in a fixed order = m 2^e (m in [0.5, 1)); p'_t (the target's) = mt 2^et:
//   loss = (log2 m - log2 mt + e - et) ln 2        (lse - the target's logit)
//   c = (dloss / m) 2^-e = dloss / S               (softmax = P / S: dlogits = (P - onehot S) c)
//   P[target] -= S     (the one-hot folded into one element of P)
//   X = c * lnf        (the lm head's dweight GEMM reads X where it read lnf: dwte += P^T @ X)
//   cs[row] = c        (dinp = c * (P @ wte): classifier_fold_scale after the dinp GEMM)
// k only keeps p' in range; the results move with it by the FFMA's rounding of logit log2 e - k (~5e-6
// relative). In range: S in [2^FOLD_LO, 2^FOLD_HI] (the largest p' is at least S / Vp, so normal; S, c
// and X far from overflow) and p'_t at least 2^-120 (its logarithm exact enough). A row out of range
// (or not finite) goes on the list `flagged`, and classifier_fold_fix recomputes it from lnf and wte
// with its own k. ctl (int32): [0] k, [1] flagged rows, [2] / [3] the largest / smallest floor(log2 S) +
// k (the rows' lse in log2 units, rounded down), [4] the fix kernel's finished blocks; its last block
// sets the next k (the middle of [3] and [2] put FOLD_MID below it, the middle of the window) and
// resets [1]-[4]. Integer atomics only, and a row's results depend on that row alone: deterministic.
// k is part of the run's state (the trainer's state file keeps it): resume continues with the same k.
#define FOLD_LO (-84)
#define FOLD_HI 80
static_assert(FOLD_LO == -84 && FOLD_HI == 80, "fold_combine's range checks spell them out");
#define FOLD_MID (-10)
#define FOLD_LN2 0.6931471805599453f

// X's row r = c * lnf's row by one warp, in 16-byte vectors (the fold needs rows of 16-byte multiples:
// Fold checks C), FOLD_U of them a lane in flight: all a chunk's loads, then its stores. `pre` holds the
// first chunk's loads when the caller issued them early (fold_combine), else nullptr.
#ifndef FOLD_U
#define FOLD_U 3  // (the lab sweeps it: --define classifier:FOLD_U=4)
#endif
#ifndef FOLD_FS
#define FOLD_FS 13  // the combine's tile sums a lane loads at once (the rest in a loop): GPT-2's 393 tiles
#endif
template <typename T, int U = FOLD_U>
__device__ __forceinline__ void fold_row_x(int r, float c, const T* lnf, T* X, int C,
                                           const typename Vec16<T>::raw* pre) {
    typedef Vec16<T> V16;
    const int lane = threadIdx.x & 31, nv = C / V16::N;
    const T* x = lnf + (size_t)r * C;
    T* xo = X + (size_t)r * C;
    for (int i0 = 0; i0 < nv; i0 += 32 * U) {
        typename V16::raw v[U];
#pragma unroll
        for (int j = 0; j < U; j++) {
            const int i = i0 + j * 32 + lane;
            if (i < nv) v[j] = (pre && i0 == 0) ? pre[j] : V16::ld(x + (size_t)i * V16::N);
        }
#pragma unroll
        for (int j = 0; j < U; j++) {
            const int i = i0 + j * 32 + lane;
            if (i < nv) {
                float f[V16::N];
                V16::unpack(f, v[j]);
#pragma unroll
                for (int q = 0; q < V16::N; q++) f[q] *= c;
                V16::st(xo + (size_t)i * V16::N, V16::pack(f));
            }
        }
    }
}

// row r's scale, folded target element and (write_x) X by one warp; loss and cs by lane 0
template <typename T>
__device__ __forceinline__ void fold_finish_row(int r, float S, float loss, float* losses, T* P, int t, float pt,
                                                const T* lnf, T* X, float* cs, float dloss, int Vp, int C,
                                                const typename Vec16<T>::raw* pre, bool write_x = true) {
    const int lane = threadIdx.x & 31;
    int e;
    const float m = frexpf(S, &e);
    const float c = ldexpf(dloss / m, -e);
    if (lane == 0) {
        losses[r] = loss;
        cs[r] = c;
        P[(size_t)r * Vp + t] = from_f32<T>(pt - S);
    }
    if (write_x) fold_row_x<T, 2>(r, c, lnf, X, C, pre);  // (the fix: 1024 threads, 64 registers)
}

// a warp per row (grid-stride); one pair of global atomics per block for ctl[2], ctl[3]. A row's loads
// are issued together (its target and p'_t, the tile sums, the first chunk of its lnf row) so that it
// waits about two memory latencies, not one per step.
template <typename T>
__device__ __forceinline__ void fold_combine(float* losses, T* P, const float* FS, const int* targets, const T* lnf,
                                             T* X, float* cs, int* ctl, int* flagged, float dloss, int N, int Vp,
                                             int C, int tiles) {
    typedef Vec16<T> V16;
    __shared__ int sh_hi, sh_lo;
    if (threadIdx.x == 0) { sh_hi = -(1 << 30); sh_lo = 1 << 30; }
    __syncthreads();
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, nv = C / V16::N;
    const int k = ctl[0], stride = gridDim.x * warps;
    int r = blockIdx.x * warps + (threadIdx.x >> 5);
    int t = r < N ? targets[r] : 0;  // (every lane: one broadcast load; the next row's, a row ahead)
    for (; r < N; r += stride) {
        typename V16::raw pre[FOLD_U];
        const T* x = lnf + (size_t)r * C;
#pragma unroll
        for (int j = 0; j < FOLD_U; j++)
            if (j * 32 + lane < nv) pre[j] = V16::ld(x + (size_t)(j * 32 + lane) * V16::N);
        const float* row = FS + (size_t)r * tiles;
        float fs[FOLD_FS];
#pragma unroll
        for (int j = 0; j < FOLD_FS; j++) fs[j] = j * 32 + lane < tiles ? __ldcs(row + j * 32 + lane) : 0.0f;
        const float pt = to_f32(P[(size_t)r * Vp + t]);
        const int tn = r + stride < N ? targets[r + stride] : 0;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < FOLD_FS; j++) s += fs[j];
        for (int i = FOLD_FS * 32 + lane; i < tiles; i += 32) s += __ldcs(row + i);
#pragma unroll
        for (int x = 16; x >= 1; x >>= 1) s += __shfl_xor_sync(0xffffffffu, s, x);  // (every lane: the same bits)
        int e, et;
        const float m = frexpf(s, &e), mt = frexpf(pt, &et);
        const bool s_ok = s >= 0x1p-84f && s <= 0x1p80f;  // [2^FOLD_LO, 2^FOLD_HI] (NaN: not ok)
        const bool ok = s_ok && pt >= 0x1p-120f && pt <= 0x1p80f;
        // X from S alone, so its stores need not wait for p'_t (a row flagged for its p'_t alone is redone
        // whole by the fix, X included)
        if (s_ok) fold_row_x<T>(r, ldexpf(dloss / m, -e), lnf, X, C, pre);
        if (ok) {
            const float loss = (log2f(m) - log2f(mt) + (float)(e - et)) * FOLD_LN2;
            fold_finish_row<T>(r, s, loss, losses, P, t, pt, lnf, X, cs, dloss, Vp, C, nullptr, false);
        } else if (lane == 0) {
            const int at = atomicAdd(&ctl[1], 1);
            if (at < N) flagged[at] = r;  // (more only if a combine ran twice without the fix between)
        }
        if (lane == 0 && s > 0.0f && s <= 3e38f) {  // (a row with p' out of range still says where its lse is)
            const int top = e - 1 + k;
            atomicMax(&sh_hi, top);
            atomicMin(&sh_lo, top);
        }
        t = tn;
    }
    __syncthreads();
    if (threadIdx.x == 0 && sh_lo <= sh_hi) {
        atomicMax(&ctl[2], sh_hi);
        atomicMin(&ctl[3], sh_lo);
    }
}

extern "C" __global__ void __launch_bounds__(256, 4) classifier_fold_combine(float* losses, float* P, const float* FS, const int* targets,
                                                   const float* lnf, float* X, float* cs, int* ctl, int* flagged,
                                                   float dloss, int N, int Vp, int C, int tiles) {
    LLMC_PDL_WAIT();
    fold_combine<float>(losses, P, FS, targets, lnf, X, cs, ctl, flagged, dloss, N, Vp, C, tiles);
}
extern "C" __global__ void __launch_bounds__(256, 4) classifier_fold_combine_bf16(float* losses, bf16* P, const float* FS, const int* targets,
                                                        const bf16* lnf, bf16* X, float* cs, int* ctl, int* flagged,
                                                        float dloss, int N, int Vp, int C, int tiles) {
    LLMC_PDL_WAIT();
    fold_combine<bf16>(losses, P, FS, targets, lnf, X, cs, ctl, flagged, dloss, N, Vp, C, tiles);
}

// block reductions over blockDim.x threads (a multiple of 32, at most 1024) in a fixed order; every
// thread gets the result
__device__ __forceinline__ float fold_block_sum(float v, float* sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int x = 16; x >= 1; x >>= 1) v += __shfl_xor_sync(0xffffffffu, v, x);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += sh[i];
    return t;
}
__device__ __forceinline__ float fold_block_max(float v, float* sh) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int x = 16; x >= 1; x >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, x));
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float t = sh[0];
    for (int i = 1; i < nw; i++) t = fmaxf(t, sh[i]);
    return t;
}

// logit v of the row in xrow (fp32, shared memory): a warp's dot product with wte's row v in 16-byte
// vectors (Fold checks C), summed across the warp by xor shuffles (every lane: the same bits)
template <typename T>
__device__ __forceinline__ float fold_gemv(const T* wte, int v, const float* xrow, int C) {
    typedef Vec16<T> V16;
    const int lane = threadIdx.x & 31;
    const T* wr = wte + (size_t)v * C;
    float acc = 0.0f;
    for (int i = lane; i < C / V16::N; i += 32) {
        float f[V16::N];
        V16::unpack(f, V16::ld(wr + (size_t)i * V16::N));
#pragma unroll
        for (int q = 0; q < V16::N; q++) acc += xrow[i * V16::N + q] * f[q];
    }
#pragma unroll
    for (int x = 16; x >= 1; x >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, x);
    return acc;
}

// The flagged rows, recomputed (a block each, grid-stride over the list; none on most steps): the
// row's logits as a GEMV of its lnf row against wte (a warp per vocabulary row, fp32 sums), its own k
// (the max logit's floor(. log2 e)), p' from the fp32 logits and their sum (fp32: the logits stored in
// P's row, then p' in place; bf16: the GEMV run again, as a bf16 logit would carry 2^-9 of itself), the
// loss from the sum and the target's fp32 logit, then fold_finish_row as the combine. The last block to
// finish sets the next k and resets the step's counters. Dynamic shared memory: C floats (the lnf row).
template <typename T>
__device__ __forceinline__ void fold_fix(float* losses, T* P, const int* targets, const T* lnf, const T* wte, T* X,
                                         float* cs, int* ctl, const int* flagged, float dloss, int N, int V, int Vp,
                                         int C) {
    typedef Vec16<T> V16;
    extern __shared__ float xrow[];
    __shared__ float sh[32];
    __shared__ float sh_t;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int count = min(ctl[1], N);
    for (int i = blockIdx.x; i < count; i += gridDim.x) {
        const int r = flagged[i], t = targets[r];
        T* prow = P + (size_t)r * Vp;
        __syncthreads();  // (the previous row's readers of xrow are done)
        for (int c = threadIdx.x; c < C; c += blockDim.x) xrow[c] = to_f32(lnf[(size_t)r * C + c]);
        __syncthreads();
        // pass 1: the logits' max (and the target's fp32 logit); fp32 stores the logits in P's row for the p'
        // pass, bf16 recomputes them there (a bf16 logit of ~100 would be off by up to 0.25)
        float mx = __int_as_float(0xff800000);
        for (int v = w; v < V; v += nw) {
            const float acc = fold_gemv<T>(wte, v, xrow, C);
            if (lane == 0) {
                if constexpr (sizeof(T) == 4) prow[v] = acc;
                if (v == t) sh_t = acc;
            }
            mx = fmaxf(mx, acc);
        }
        mx = fold_block_max(mx, sh);  // (its barriers also order the logits' stores before the reads below)
        const int kr = (int)fmaxf(fminf(floorf((fabsf(mx) < 1e30f ? mx : 0.0f) * 1.4426950408889634f), 4096.0f), -4096.0f);
        float s = 0.0f;
        if constexpr (sizeof(T) == 4) {
            for (int v = threadIdx.x; v < Vp; v += blockDim.x) {
                const float p = v < V ? fold_exp(to_f32(prow[v]), (float)kr) : 0.0f;
                prow[v] = from_f32<T>(p);
                s += p;
            }
        } else {
            for (int v = w; v < V; v += nw) {
                const float p = fold_exp(fold_gemv<T>(wte, v, xrow, C), (float)kr);
                if (lane == 0) {
                    prow[v] = from_f32<T>(p);
                    s += p;
                }
            }
            for (int v = V + threadIdx.x; v < Vp; v += blockDim.x) prow[v] = from_f32<T>(0.0f);
        }
        s = fold_block_sum(s, sh);  // (and orders the p' stores, and sh_t, before the reads below)
        int e;
        frexpf(s, &e);
        if (threadIdx.x == 0 && s > 0.0f && s <= 3e38f) {
            atomicMax(&ctl[2], e - 1 + kr);
            atomicMin(&ctl[3], e - 1 + kr);
        }
        const float loss = (log2f(s) + (float)kr) * FOLD_LN2 - sh_t;
        if (w == 0) fold_finish_row<T>(r, s, loss, losses, P, t, to_f32(prow[t]), lnf, X, cs, dloss, Vp, C, nullptr);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&ctl[4], 1) == gridDim.x - 1) {  // the last block: every row of the step is done
            __threadfence();
            const int hi = atomicAdd(&ctl[2], 0), lo = atomicAdd(&ctl[3], 0);
            if (lo <= hi) ctl[0] = max(-2048, min(2048, ((hi + lo) >> 1) - FOLD_MID));
            ctl[1] = 0;
            ctl[2] = -(1 << 30);
            ctl[3] = 1 << 30;
            ctl[4] = 0;
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) classifier_fold_fix(float* losses, float* P, const int* targets, const float* lnf,
                                               const float* wte, float* X, float* cs, int* ctl, const int* flagged,
                                               float dloss, int N, int V, int Vp, int C) {
    LLMC_PDL_WAIT();
    fold_fix<float>(losses, P, targets, lnf, wte, X, cs, ctl, flagged, dloss, N, V, Vp, C);
}
extern "C" __global__ void __launch_bounds__(1024) classifier_fold_fix_bf16(float* losses, bf16* P, const int* targets, const bf16* lnf,
                                                    const bf16* wte, bf16* X, float* cs, int* ctl, const int* flagged,
                                                    float dloss, int N, int V, int Vp, int C) {
    LLMC_PDL_WAIT();
    fold_fix<bf16>(losses, P, targets, lnf, wte, X, cs, ctl, flagged, dloss, N, V, Vp, C);
}

// A run's first folded step when k came from no state (Fold.prime): n rows spread over the batch put on
// the list, as a combine that flagged them would, so that the fix that follows recomputes them and sets
// k from their lse range before the lm head's forward runs. One block.
extern "C" __global__ void classifier_fold_prime(int* ctl, int* flagged, int N, int n) {
    LLMC_PDL_WAIT();
    for (int i = threadIdx.x; i < n; i += blockDim.x) flagged[i] = (int)(((long long)i * N) / n);
    if (threadIdx.x == 0) {
        ctl[1] = n;
        ctl[2] = -(1 << 30);
        ctl[3] = 1 << 30;
        ctl[4] = 0;
    }
}

// dinp (N, C) *= cs (N), per row: the dinp GEMM ran on P without the rows' scales. A warp per row,
// 16-byte vectors, FOLD_U a lane in flight (all a chunk's loads, then its stores: in place)
template <typename T>
__device__ __forceinline__ void fold_scale(T* x, const float* cs, int N, int C) {
    const int warps = blockDim.x >> 5;
    for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < N; r += gridDim.x * warps)
        fold_row_x<T>(r, cs[r], x, x, C, nullptr);
}
extern "C" __global__ void classifier_fold_scale(float* x, const float* cs, int N, int C) {
    LLMC_PDL_WAIT();
    fold_scale<float>(x, cs, N, C);
}
extern "C" __global__ void classifier_fold_scale_bf16(bf16* x, const float* cs, int N, int C) {
    LLMC_PDL_WAIT();
    fold_scale<bf16>(x, cs, N, C);
}
