// Classifier: fused softmax + cross-entropy loss + the loss gradient w.r.t. the logits.
// One row of logits per token; the gradient overwrites the logits in place (llm.c's trick: the
// logits are never needed again after the loss, and (N, Vp) floats is the largest activation).
//
// version 1: one block per row, three passes over the row in global memory (max, sum of exp, write); scalar loads
// version 2: one block per row, online softmax (max and sum in ONE read pass), then the write pass; float4, streaming hints
// version 3: one block per row, the row copied once into shared memory with cp.async; both passes read shared memory
// version 4: version 3 made persistent: a block walks rows and prefetches its next row into shared memory during the write pass
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
#include "common.cuh"

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

// fold four values into (m, s); lanes masked out are -INFINITY and add expf(-inf) = 0 exactly.
// At least one lane is real whenever this is called, so m never stays at -FLT_MAX after it.
__device__ __forceinline__ void ms_update4(float& m, float& s, float a0, float a1, float a2, float a3) {
    const float cm = fmaxf(fmaxf(a0, a1), fmaxf(a2, a3));
    if (cm > m) {  // rescale only when the max moves: rare after the first few chunks
        s *= expf(m - cm);
        m = cm;
    }
    s += expf(a0 - m) + expf(a1 - m) + expf(a2 - m) + expf(a3 - m);
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
__device__ __forceinline__ float dlogit(float x, int col, int V, int target, float m, float inv_s, float dloss) {
    const float p = expf(x - m) * inv_s;
    return (col < V) ? (p - (col == target ? 1.0f : 0.0f)) * dloss : 0.0f;
}

__device__ __forceinline__ float4 dlogit4(float4 x, int col, int V, int target, float m, float inv_s, float dloss) {
    return make_float4(dlogit(x.x, col, V, target, m, inv_s, dloss),
                       dlogit(x.y, col + 1, V, target, m, inv_s, dloss),
                       dlogit(x.z, col + 2, V, target, m, inv_s, dloss),
                       dlogit(x.w, col + 3, V, target, m, inv_s, dloss));
}

// the four values of chunk `col..col+3` with columns >= V masked to -inf
__device__ __forceinline__ void mask4(float4 x, int col, int V, float& a0, float& a1, float& a2, float& a3) {
    a0 = x.x; a1 = x.y; a2 = x.z; a3 = x.w;
    if (col + 3 >= V) {  // only the chunk that straddles V takes this branch
        if (col + 1 >= V) a1 = -INFINITY;
        if (col + 2 >= V) a2 = -INFINITY;
        a3 = -INFINITY;
    }
}

// ----------------------------------------------------------------------------------------------
// version 1: three plain passes, one block per row, any V and Vp.
// traffic per row: read V floats three times (max, sum, write), write Vp floats.

extern "C" __global__ void classifier_kernel1(float* losses, float* logits, const int* targets,
                                              float dloss, int write_dlogits, int N, int V, int Vp) {
    __shared__ float shared[32];
    __shared__ float sh_xt;  // logits[row, target], read before anything overwrites it
    const int row = blockIdx.x;
    float* x = logits + (size_t)row * Vp;  // (Vp,)
    const int target = targets[row];
    if (threadIdx.x == 0) sh_xt = x[target];

    float m = -FLT_MAX;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, x[j]);
    m = block_reduce_max(m, shared);  // its barriers also publish sh_xt
    float s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(x[j] - m);
    s = block_reduce_sum(s, shared);

    if (threadIdx.x == 0) losses[row] = logf(s) + m - sh_xt;  // -(x_t - m - log s)
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    for (int j = threadIdx.x; j < Vp; j += blockDim.x)
        x[j] = dlogit(x[j], j, V, target, m, inv_s, dloss);
}

// ----------------------------------------------------------------------------------------------
// version 2: online softmax. Pass 1 reads the row once for both max and sum (plain loads, so the
// row may still be in L2 for pass 2); pass 2 re-reads it with a last-use hint and writes the
// gradient with a streaming store. Needs Vp % 4 == 0 and a 16-byte aligned logits pointer.
// traffic per row: read ceil(V/4)*4 floats twice, write Vp floats.

extern "C" __global__ void classifier_kernel2(float* losses, float* logits, const int* targets,
                                              float dloss, int write_dlogits, int N, int V, int Vp) {
    __shared__ float sh_m[32], sh_s[32];
    __shared__ float sh_xt;
    const int row = blockIdx.x;
    float* x = logits + (size_t)row * Vp;  // (Vp,)
    const int target = targets[row];
    if (threadIdx.x == 0) sh_xt = x[target];

    const int nv4 = ceil_div(V, 4);  // chunks holding at least one real column
    const int bs = blockDim.x;
    float m = -FLT_MAX, s = 0.0f;
    // UNROLL loads issued before the first is used: the online update branches, so the compiler
    // would otherwise leave one 16-byte load in flight per thread
    int i = threadIdx.x;
    for (; i + (UNROLL - 1) * bs < nv4; i += UNROLL * bs) {
        float4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) v[k] = load4(x + 4 * (i + k * bs));
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            float a0, a1, a2, a3;
            mask4(v[k], 4 * (i + k * bs), V, a0, a1, a2, a3);
            ms_update4(m, s, a0, a1, a2, a3);
        }
    }
    for (; i < nv4; i += bs) {
        float a0, a1, a2, a3;
        mask4(load4(x + 4 * i), 4 * i, V, a0, a1, a2, a3);
        ms_update4(m, s, a0, a1, a2, a3);
    }
    block_reduce_ms(m, s, sh_m, sh_s);  // its barriers also publish sh_xt

    if (threadIdx.x == 0) losses[row] = logf(s) + m - sh_xt;
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    i = threadIdx.x;
    for (; i + (UNROLL - 1) * bs < nv4; i += UNROLL * bs) {
        float4 v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; k++) v[k] = load4_cs(x + 4 * (i + k * bs));
#pragma unroll
        for (int k = 0; k < UNROLL; k++) {
            const int col = 4 * (i + k * bs);
            store4_cs(x + col, dlogit4(v[k], col, V, target, m, inv_s, dloss));
        }
    }
    for (; i < nv4; i += bs) store4_cs(x + 4 * i, dlogit4(load4_cs(x + 4 * i), 4 * i, V, target, m, inv_s, dloss));
    for (i = nv4 + threadIdx.x; i < Vp / 4; i += bs)  // padded chunks: zeros, never read
        store4_cs(x + 4 * i, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
}

// ----------------------------------------------------------------------------------------------
// versions 3 and 4: the row goes through shared memory, so DRAM sees each logit read once and
// written once (the floor). A 50257-column row is 201 KB: one block per SM on an H100 (227 KB
// opt-in), not possible on an A100 (163 KB): the launcher refuses there.
//
// Each thread copies chunks i = tid, tid + blockDim, ... and later reads exactly those chunks back,
// so a thread only needs its OWN cp.async to have landed (cp.async.wait_all), never a barrier.

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// pass 1 over a row held in shared memory: this thread's chunks, online (m, s); the thread that
// owns the target's chunk also picks up the target logit.
__device__ __forceinline__ void smem_row_stats(const float4* srow, int nv4, int V, int target,
                                               float& m, float& s, float& xt) {
    m = -FLT_MAX; s = 0.0f;
    for (int i = threadIdx.x; i < nv4; i += blockDim.x) {
        const float4 v = srow[i];
        if ((target >> 2) == i) {  // selects, not (&v.x)[k]: a run-time index would put v in local memory
            const int k = target & 3;
            xt = (k == 0) ? v.x : (k == 1) ? v.y : (k == 2) ? v.z : v.w;
        }
        float a0, a1, a2, a3;
        mask4(v, 4 * i, V, a0, a1, a2, a3);
        ms_update4(m, s, a0, a1, a2, a3);
    }
}

// version 3: one block per row. Traffic per row: read ceil(V/4)*4 floats once, write Vp floats.
extern "C" __global__ void classifier_kernel3(float* losses, float* logits, const int* targets,
                                              float dloss, int write_dlogits, int N, int V, int Vp) {
    extern __shared__ float4 srow[];  // (ceil(V/4),) this row's real columns
    __shared__ float sh_m[32], sh_s[32];
    const int row = blockIdx.x;
    float* x = logits + (size_t)row * Vp;  // (Vp,)
    const int target = targets[row];
    const int nv4 = ceil_div(V, 4);

    // the whole row is requested at once: ~13 x 16 B per thread in flight at 1024 threads
    for (int i = threadIdx.x; i < nv4; i += blockDim.x) cp_async16(&srow[i], x + 4 * i);
    cp_async_commit();
    cp_async_wait_all();

    float m, s, xt = 0.0f;
    smem_row_stats(srow, nv4, V, target, m, s, xt);
    block_reduce_ms(m, s, sh_m, sh_s);
    if ((target >> 2) % blockDim.x == threadIdx.x) losses[row] = logf(s) + m - xt;  // the target's owner
    if (!write_dlogits) return;
    const float inv_s = 1.0f / s;
    for (int i = threadIdx.x; i < nv4; i += blockDim.x)
        store4_cs(x + 4 * i, dlogit4(srow[i], 4 * i, V, target, m, inv_s, dloss));
    for (int i = nv4 + threadIdx.x; i < Vp / 4; i += blockDim.x)  // padded chunks: zeros
        store4_cs(x + 4 * i, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
}

// version 4: persistent. Block b handles rows b, b + gridDim, ...; right after a thread has written
// the gradient of its chunk i it issues the cp.async of chunk i of its next row into the same slot
// (the slot is its own, so no barrier), so the next row's reads overlap this row's writes instead
// of an SM going quiet between rows. The loss is written by the target's owner (no shared slot
// that the next row could overwrite early), and block_reduce_ms ends with a barrier.
extern "C" __global__ void classifier_kernel4(float* losses, float* logits, const int* targets,
                                              float dloss, int write_dlogits, int N, int V, int Vp) {
    extern __shared__ float4 srow[];  // (ceil(V/4),) the current row's real columns
    __shared__ float sh_m[32], sh_s[32];
    const int nv4 = ceil_div(V, 4);
    int row = blockIdx.x;
    if (row < N) {
        const float* x = logits + (size_t)row * Vp;
        for (int i = threadIdx.x; i < nv4; i += blockDim.x) cp_async16(&srow[i], x + 4 * i);
    }
    cp_async_commit();
    for (; row < N; row += gridDim.x) {
        float* x = logits + (size_t)row * Vp;  // (Vp,)
        const int next = row + gridDim.x;
        const float* xn = logits + (size_t)next * Vp;
        const int target = targets[row];
        cp_async_wait_all();

        float m, s, xt = 0.0f;
        smem_row_stats(srow, nv4, V, target, m, s, xt);
        block_reduce_ms(m, s, sh_m, sh_s);
        if ((target >> 2) % blockDim.x == threadIdx.x) losses[row] = logf(s) + m - xt;
        const float inv_s = 1.0f / s;
        for (int i = threadIdx.x; i < nv4; i += blockDim.x) {
            if (write_dlogits) store4_cs(x + 4 * i, dlogit4(srow[i], 4 * i, V, target, m, inv_s, dloss));
            if (next < N) cp_async16(&srow[i], xn + 4 * i);  // after the read of srow[i] above
        }
        cp_async_commit();
        if (write_dlogits)
            for (int i = nv4 + threadIdx.x; i < Vp / 4; i += blockDim.x)
                store4_cs(x + 4 * i, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
    }
    cp_async_wait_all();  // never exit with copies in flight
}
