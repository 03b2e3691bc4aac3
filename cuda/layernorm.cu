// Layernorm over the last dimension of (N, C) rows, GPT-2's form:
//   mean = sum(x)/C, var = sum((x-mean)^2)/C (biased), rstd = 1/sqrt(var + 1e-5)
//   out = (x - mean) * rstd * weight + bias
// Backward, with norm = (x - mean) * rstd and dnorm = dout * weight:
//   dbias += dout, dweight += norm * dout (both summed over rows)
//   dinp  += rstd * (dnorm - mean_c(dnorm) - norm * mean_c(dnorm * norm))
//
// layernorm_forward (--layernorm-kernel N):
//   1  one thread per row, three serial passes over its row (neighbouring threads read rows C apart:
//      uncoalesced, the plainest)
//   2  one block per row, shared-memory block reductions for the mean and the variance
//   3  one warp per row, shuffle reductions, lanes stride the row (coalesced), three passes via L1
//   4  one warp per row, float4 loads, the row held in registers: x read from DRAM once and the
//      variance taken as E[(x-mean)^2] in registers (C % 4 == 0, C <= 2048)
//   5  4 with streaming cache hints: x loaded with ld.global.cs and out stored with st.global.cs
//      (each is touched once; keep L2 for weight/bias and whoever reads out next)
//   6  persistent warps over R consecutive rows each, the next row loaded while this one is
//      computed; 16-byte vectors only (C % V == 0); see "Variant 6" at the end of the file
// layernorm_backward (--layernorm-backward-kernel N):
//   1  one thread per row, a global atomicAdd for every dweight/dbias element (N-way contended)
//   2  one warp per row, dweight/dbias summed per block in shared memory (shared atomics), then one
//      global atomicAdd per channel per block (not deterministic: the atomics' order varies)
//   3  deterministic: one warp per row over a fixed contiguous chunk of rows per block, per-warp
//      shared-memory accumulators (each lane owns its channels: no atomics), per-block partial sums
//      to a scratch buffer, then layernorm_backward_reduce_kernel adds them up in a fixed order
//   4  3 with float4 loads and the rows of dout and inp held in registers (C % 4 == 0, C <= 2048)
//   5  4 with the row of dinp loaded together with dout and inp (one memory round trip per row
//      instead of two; for C <= 1024, where the three rows fit in registers; above that it is 4)
//   6  deterministic, persistent warps, next row prefetched, dweight/dbias in registers per lane,
//      one shared-memory pass per block, then the reduce kernel (see "Variant 6" at the end)
//   5 colsum: 5's fused form, also colsum (C) += column sums of the dinp it writes (the next linear
//      layer's bias gradient, instead of a matmul_backward_bias pass; see "colsum" below)
//   7  deterministic, one launch: persistent warps, rows strided over the grid, each warp's next rows
//      in a shared-memory ring filled by cp.async, dweight/dbias in registers, the blocks' partials
//      summed in a fixed order by the last blocks to finish (integer tickets); colsum form too; the
//      bf16 default (see "Backward variant 7" at the end)
//
// Memory traffic at the trainer's shape (N = 4096, C = 768, fp32; one row = 3 KB):
//   forward  reads x (12.6 MB) and writes out (12.6 MB): 25.2 MB, 8.5 us at 2.98 TB/s
//   backward reads dout, inp and dinp (+=), writes dinp: 50.3 MB, 16.9 us; the scratch of the
//            deterministic variants adds 2 * G * C floats written and read (G blocks, ~1-3 MB)
// Measured on the lent H100 (dev/cuda lab: median of 30, L2 flushed before each, best block size):
//   forward   1: 166 us (bs 32)   2: 18.5 us   3: 18.5 us   4: 12.9 us (1.95 TB/s)   5: 12.5 us (2.01 TB/s)
//   backward  1: 1510 us   2: 41.5 us   3: 43.3 us   4: 32.9 us (1.53 TB/s)   5: 31.4 us (1.61 TB/s)
//   Backward is ~10 us off the bytes: two rows per warp one after the other, the block's partial
//   sums and the second (reduce) launch. Next to try: overlap the next row's loads with this row's
//   stores, and fold the reduce into the last blocks.
//
// bf16 builds (entry points <name>_bf16[_nvN]): inp, out, weight, bias, dout, dinp, dweight, dbias
// bf16; mean and rstd stay fp32 (they are statistics, and backward wants them exact). All math in
// fp32, each output element rounded once; dinp/dweight/dbias "+=" read bf16, add in fp32, round once.
//   forward 3 (scalar, any C), 4 and 5: one warp per row held in registers as fp32, lane l holding
//     the 8 bf16 of 16-byte vector l + 32*i (NV = ceil(C/256) <= 8 vectors per lane). When C % 8 != 0
//     the rows are not 16-byte aligned: the same layout with guarded scalar loads and stores.
//   backward 3 (scalar, any C) and 5: per-warp fp32 accumulators in shared memory, per-block fp32
//     partial sums of dweight/dbias in scratch, the fixed-order reduce rounding each element once;
//     5 keeps its rows of dout, inp and dinp packed (4 registers per 8 values) and unpacks on use.
//   At N = 4096, C = 768 the bytes halve: forward 12.6 MB (4.2 us), backward 25.2 MB (8.4 us); the
//   backward's fp32 scratch (~3 MB written, then read, mostly in L2) does not shrink.
#include "layernorm.cuh"  // LN_EPS, hsum4, ln_row_stats, the templated row helpers (common.cuh, elem.cuh)

// the register-resident variants hold NV float4 per lane: NV * 128 channels, NV <= LN_MAX_NV
#define LN_MAX_NV 16


// ----------------------------------------------------------------------------------------------
// layernorm_forward

// out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C)
extern "C" __global__ void layernorm_forward_kernel1(float* out, float* mean, float* rstd,
        const float* inp, const float* weight, const float* bias, int N, int C) {
    LLMC_PDL_WAIT();
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const float* x = inp + (size_t)row * C;
    float m = 0.0f;
    for (int c = 0; c < C; c++) m += x[c];
    m /= C;
    float v = 0.0f;
    for (int c = 0; c < C; c++) { float d = x[c] - m; v += d * d; }
    v /= C;
    float s = rsqrtf(v + LN_EPS);
    float* o = out + (size_t)row * C;
    for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[row] = m;
    rstd[row] = s;
}

// one block per row; blockDim.x a multiple of 32
extern "C" __global__ void layernorm_forward_kernel2(float* out, float* mean, float* rstd,
        const float* inp, const float* weight, const float* bias, int N, int C) {
    LLMC_PDL_WAIT();
    __shared__ float shared[32];
    int row = blockIdx.x;
    const float* x = inp + (size_t)row * C;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) sum += x[c];
    float m = block_reduce_sum(sum, shared) / C;
    float v = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) { float d = x[c] - m; v += d * d; }
    float s = rsqrtf(block_reduce_sum(v, shared) / C + LN_EPS);
    float* o = out + (size_t)row * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = (x[c] - m) * s * weight[c] + bias[c];
    if (threadIdx.x == 0) { mean[row] = m; rstd[row] = s; }
}

// One warp per row, the row in registers: lane l holds float4 number l + 32*i for i < NV, so each
// of the NV loads is one coalesced 512-byte transaction per warp and all NV are in flight before
// the first add. Slots past C/4 are guarded (their index test is uniform per slot and lane).
template <int NV, bool STREAM>
__device__ __forceinline__ void layernorm_forward4(float* out, float* mean, float* rstd,
        const float* inp, const float* weight, const float* bias, int N, int C) {
    int lane = threadIdx.x % WARP_SIZE;
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) return;
    const int C4 = C / 4;
    const float* x = inp + (size_t)row * C;
    float4 v[NV];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int c4 = lane + i * WARP_SIZE;
        if (c4 < C4) {
            v[i] = STREAM ? load4_cs(x + 4 * c4) : load4(x + 4 * c4);
            sum += hsum4(v[i]);
        }
    }
    float m, s;
    ln_row_stats<NV>(v, sum, lane, C4, C, m, s);
    float* o = out + (size_t)row * C;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int c4 = lane + i * WARP_SIZE;
        if (c4 < C4) {
            float4 w = load4(weight + 4 * c4), b = load4(bias + 4 * c4), r;
            r.x = (v[i].x - m) * s * w.x + b.x;
            r.y = (v[i].y - m) * s * w.y + b.y;
            r.z = (v[i].z - m) * s * w.z + b.z;
            r.w = (v[i].w - m) * s * w.w + b.w;
            if (STREAM) store4_cs(o + 4 * c4, r); else store4(o + 4 * c4, r);
        }
    }
    if (lane == 0) { mean[row] = m; rstd[row] = s; }
}

// Entry points per NV (the launcher picks NV = ceil(C / 128)): layernorm_forward_kernel4_nv6 is
// variant 4 for 640 < C <= 768. Registers are sized per NV, so small C keeps high occupancy.
#define LN_FWD_ENTRY(NV)                                                                             \
    extern "C" __global__ void layernorm_forward_kernel4_nv##NV(float* out, float* mean, float* rstd, \
            const float* inp, const float* weight, const float* bias, int N, int C) { LLMC_PDL_WAIT();                 \
        layernorm_forward4<NV, false>(out, mean, rstd, inp, weight, bias, N, C);                      \
    }                                                                                                 \
    extern "C" __global__ void layernorm_forward_kernel5_nv##NV(float* out, float* mean, float* rstd, \
            const float* inp, const float* weight, const float* bias, int N, int C) { LLMC_PDL_WAIT();                 \
        layernorm_forward4<NV, true>(out, mean, rstd, inp, weight, bias, N, C);                       \
    }
LN_FWD_ENTRY(1) LN_FWD_ENTRY(2) LN_FWD_ENTRY(3) LN_FWD_ENTRY(4) LN_FWD_ENTRY(5) LN_FWD_ENTRY(6)
LN_FWD_ENTRY(7) LN_FWD_ENTRY(8) LN_FWD_ENTRY(9) LN_FWD_ENTRY(10) LN_FWD_ENTRY(11) LN_FWD_ENTRY(12)
LN_FWD_ENTRY(13) LN_FWD_ENTRY(14) LN_FWD_ENTRY(15) LN_FWD_ENTRY(16)

// ----------------------------------------------------------------------------------------------
// layernorm_backward

// dinp (N,C) +=, dweight (C) +=, dbias (C) +=, dout (N,C), inp (N,C), weight (C), mean (N), rstd (N)
// One thread per row. Every thread adds into the same 2C addresses: the atomics serialise at L2,
// which is what this baseline is here to show.
extern "C" __global__ void layernorm_backward_kernel1(float* dinp, float* dweight, float* dbias,
        const float* dout, const float* inp, const float* weight, const float* mean, const float* rstd,
        int N, int C) {
    LLMC_PDL_WAIT();
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const float* d = dout + (size_t)row * C;
    const float* x = inp + (size_t)row * C;
    float* g = dinp + (size_t)row * C;
    const float m = mean[row], s = rstd[row];
    float a = 0.0f, b = 0.0f;  // sum(dnorm), sum(dnorm * norm)
    for (int c = 0; c < C; c++) {
        float n = (x[c] - m) * s, dn = d[c] * weight[c];
        a += dn;
        b += dn * n;
    }
    a /= C;
    b /= C;
    for (int c = 0; c < C; c++) {
        float n = (x[c] - m) * s, dn = d[c] * weight[c];
        atomicAdd(&dbias[c], d[c]);
        atomicAdd(&dweight[c], n * d[c]);
        g[c] += s * (dn - a - n * b);
    }
}

// a = mean_c(dnorm) and b = mean_c(dnorm * norm) of one row, the two row terms of
// dinp += s * (dnorm - a - norm * b): one warp per row, lane l summing channels l, l + 32, ..., then the
// warp's sums (backward 2 and 3; in fp32 whatever T is)
template <typename T>
__device__ __forceinline__ void ln_bwd_ab(const T* d, const T* x, const T* weight, float m, float s, int lane,
        int C, float& a, float& b) {
    a = 0.0f;
    b = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        float n = (to_f32(x[c]) - m) * s, dn = to_f32(d[c]) * to_f32(weight[c]);
        a += dn;
        b += dn * n;
    }
    a = warp_reduce_sum(a) / C;
    b = warp_reduce_sum(b) / C;
}

// One warp per row, rows strided over the whole grid. Dynamic smem: 2*C floats (dweight | dbias).
extern "C" __global__ void layernorm_backward_kernel2(float* dinp, float* dweight, float* dbias,
        const float* dout, const float* inp, const float* weight, const float* mean, const float* rstd,
        int N, int C) {
    LLMC_PDL_WAIT();
    extern __shared__ float acc[];  // (2, C): dweight | dbias partial sums of this block
    float* acc_w = acc;
    float* acc_b = acc + C;
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) acc[c] = 0.0f;
    __syncthreads();
    const int lane = threadIdx.x % WARP_SIZE, nwarps = blockDim.x / WARP_SIZE;
    for (int row = blockIdx.x * nwarps + threadIdx.x / WARP_SIZE; row < N; row += gridDim.x * nwarps) {
        const float* d = dout + (size_t)row * C;
        const float* x = inp + (size_t)row * C;
        float* g = dinp + (size_t)row * C;
        const float m = mean[row], s = rstd[row];
        float a, b;
        ln_bwd_ab<float>(d, x, weight, m, s, lane, C, a, b);
        for (int c = lane; c < C; c += WARP_SIZE) {
            float dc = d[c], n = (x[c] - m) * s, dn = dc * weight[c];
            atomicAdd(&acc_b[c], dc);
            atomicAdd(&acc_w[c], n * dc);
            g[c] += s * (dn - a - n * b);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        atomicAdd(&dweight[c], acc_w[c]);
        atomicAdd(&dbias[c], acc_b[c]);
    }
}

// The deterministic variants. Block `blockIdx.x` owns rows [blockIdx.x*R, min(N, (blockIdx.x+1)*R));
// warp w takes rows w, w + nwarps, ... of that chunk, so which warp adds which row is fixed. Each
// warp keeps its own dweight|dbias accumulators in shared memory (dynamic smem: nwarps * 2C floats)
// and lane l only ever touches its own channels, so no two threads write one address. At the end the
// block sums its warps in order into scratch (G, 2, C); the reduce kernel then sums the G blocks.

// sum the per-warp accumulators (nwarps, K, C) in warp order into scratch row blockIdx.x (K = 2:
// dweight | dbias; K = 3 with the colsum of the fused form, see "colsum" below)
__device__ __forceinline__ void ln_block_partials_to_scratch(float* scratch, const float* acc, int C, int K = 2) {
    const int nwarps = blockDim.x / WARP_SIZE;
    float* out = scratch + (size_t)blockIdx.x * K * C;
    for (int c = threadIdx.x; c < K * C; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < nwarps; w++) sum += acc[w * K * C + c];
        out[c] = sum;
    }
}

// COLSUM (the fused form, "colsum" below): a third per-warp accumulator row, the column sums of
// the dinp rows this warp stores (after the +=), so scratch is (G, 3, C)
template <int NV, bool PREFETCH, bool COLSUM = false>
__device__ __forceinline__ void layernorm_backward4(float* dinp, float* scratch,
        const float* dout, const float* inp, const float* weight, const float* mean, const float* rstd,
        int N, int C, int R) {
    constexpr int K = COLSUM ? 3 : 2;
    extern __shared__ float acc[];  // (nwarps, K, C)
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    const int C4 = C / 4;
    float4* acc_w = reinterpret_cast<float4*>(acc + warp * K * C);  // C % 4 == 0: 16-byte aligned
    float4* acc_b = acc_w + C4;
    float4* acc_s = acc_b + C4;  // (COLSUM only)
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int c4 = lane + i * WARP_SIZE;
        if (c4 < C4) {
            acc_w[c4] = zero;
            acc_b[c4] = zero;
            if (COLSUM) acc_s[c4] = zero;
        }
    }
    const int row_end = min(N, (blockIdx.x + 1) * R);
    for (int row = blockIdx.x * R + warp; row < row_end; row += nwarps) {
        const float* dr = dout + (size_t)row * C;
        const float* xr = inp + (size_t)row * C;
        float* gr = dinp + (size_t)row * C;
        float4 d[NV], x[NV], gp[PREFETCH ? NV : 1];
#pragma unroll
        for (int i = 0; i < NV; i++) {  // 2*NV (3*NV) independent 16-byte loads in flight per lane
            int c4 = lane + i * WARP_SIZE;
            if (c4 < C4) {
                d[i] = load4(dr + 4 * c4);
                x[i] = load4(xr + 4 * c4);
                if (PREFETCH) gp[PREFETCH ? i : 0] = load4(gr + 4 * c4);
            }
        }
        const float m = mean[row], s = rstd[row];
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + i * WARP_SIZE;
            if (c4 < C4) {
                float4 w = load4(weight + 4 * c4);
                float nx = (x[i].x - m) * s, ny = (x[i].y - m) * s, nz = (x[i].z - m) * s, nw = (x[i].w - m) * s;
                float dx = d[i].x * w.x, dy = d[i].y * w.y, dz = d[i].z * w.z, dw = d[i].w * w.w;
                a += (dx + dy) + (dz + dw);
                b += (dx * nx + dy * ny) + (dz * nz + dw * nw);
            }
        }
        a = warp_reduce_sum(a) / C;
        b = warp_reduce_sum(b) / C;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c4 = lane + i * WARP_SIZE;
            if (c4 < C4) {
                float4 w = load4(weight + 4 * c4);
                float4 g = PREFETCH ? gp[PREFETCH ? i : 0] : load4(gr + 4 * c4);
                float4 n;
                n.x = (x[i].x - m) * s; n.y = (x[i].y - m) * s; n.z = (x[i].z - m) * s; n.w = (x[i].w - m) * s;
                g.x += s * (d[i].x * w.x - a - n.x * b);
                g.y += s * (d[i].y * w.y - a - n.y * b);
                g.z += s * (d[i].z * w.z - a - n.z * b);
                g.w += s * (d[i].w * w.w - a - n.w * b);
                store4(gr + 4 * c4, g);
                float4 aw = acc_w[c4], ab = acc_b[c4];
                aw.x += n.x * d[i].x; aw.y += n.y * d[i].y; aw.z += n.z * d[i].z; aw.w += n.w * d[i].w;
                ab.x += d[i].x; ab.y += d[i].y; ab.z += d[i].z; ab.w += d[i].w;
                acc_w[c4] = aw;
                acc_b[c4] = ab;
                if (COLSUM) {
                    float4 as = acc_s[c4];
                    as.x += g.x; as.y += g.y; as.z += g.z; as.w += g.w;
                    acc_s[c4] = as;
                }
            }
        }
    }
    __syncthreads();
    ln_block_partials_to_scratch(scratch, acc, C, K);
}

#define LN_BWD_ENTRY(NV)                                                                             \
    extern "C" __global__ void layernorm_backward_kernel4_nv##NV(float* dinp, float* scratch,        \
            const float* dout, const float* inp, const float* weight, const float* mean,              \
            const float* rstd, int N, int C, int R) { LLMC_PDL_WAIT();                                \
        layernorm_backward4<NV, false>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R);        \
    }                                                                                                 \
    extern "C" __global__ void layernorm_backward_kernel5_nv##NV(float* dinp, float* scratch,        \
            const float* dout, const float* inp, const float* weight, const float* mean,              \
            const float* rstd, int N, int C, int R) { LLMC_PDL_WAIT();                                \
        layernorm_backward4<NV, (NV <= 8)>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R);   \
    }
LN_BWD_ENTRY(1) LN_BWD_ENTRY(2) LN_BWD_ENTRY(3) LN_BWD_ENTRY(4) LN_BWD_ENTRY(5) LN_BWD_ENTRY(6)
LN_BWD_ENTRY(7) LN_BWD_ENTRY(8) LN_BWD_ENTRY(9) LN_BWD_ENTRY(10) LN_BWD_ENTRY(11) LN_BWD_ENTRY(12)
LN_BWD_ENTRY(13) LN_BWD_ENTRY(14) LN_BWD_ENTRY(15) LN_BWD_ENTRY(16)

// variant 5's fused form (colsum): scratch (G, 3, C), finished by layernorm_backward_reduce_colsum_kernel
#define LN_BWD_COLSUM_ENTRY(NV)                                                                      \
    extern "C" __global__ void layernorm_backward_kernel5_colsum_nv##NV(float* dinp, float* scratch, \
            const float* dout, const float* inp, const float* weight, const float* mean,              \
            const float* rstd, int N, int C, int R) { LLMC_PDL_WAIT();                                \
        layernorm_backward4<NV, (NV <= 8), true>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R); \
    }
LN_BWD_COLSUM_ENTRY(1) LN_BWD_COLSUM_ENTRY(2) LN_BWD_COLSUM_ENTRY(3) LN_BWD_COLSUM_ENTRY(4)
LN_BWD_COLSUM_ENTRY(5) LN_BWD_COLSUM_ENTRY(6) LN_BWD_COLSUM_ENTRY(7) LN_BWD_COLSUM_ENTRY(8)
LN_BWD_COLSUM_ENTRY(9) LN_BWD_COLSUM_ENTRY(10) LN_BWD_COLSUM_ENTRY(11) LN_BWD_COLSUM_ENTRY(12)
LN_BWD_COLSUM_ENTRY(13) LN_BWD_COLSUM_ENTRY(14) LN_BWD_COLSUM_ENTRY(15) LN_BWD_COLSUM_ENTRY(16)

// ----------------------------------------------------------------------------------------------
// Kernels templated on the element type T: the bf16 builds, and the fp32 entry points of forward 3,
// backward 3 and the reduce (the same code; to_f32 / from_f32<float> are the identity). V = 16 /
// sizeof(T) elements per vector. (fp32 forward 4/5 and backward 4/5 above keep their own float4
// bodies: they sum a float4's lanes pairwise, hsum4, where the templates add element by element,
// so the fp32 instantiations of the templates would not give the same bits.)

// forward 3: one warp per row, scalar loads, three passes (the second and third hit L1)
template <typename T>
__device__ __forceinline__ void layernorm_forward3_t(T* out, float* mean, float* rstd,
        const T* inp, const T* weight, const T* bias, int N, int C) {
    int lane = threadIdx.x % WARP_SIZE;
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) return;
    const T* x = inp + (size_t)row * C;
    float sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) sum += to_f32(x[c]);
    float m = warp_reduce_sum(sum) / C;
    float v = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) { float d = to_f32(x[c]) - m; v += d * d; }
    float s = rsqrtf(warp_reduce_sum(v) / C + LN_EPS);
    T* o = out + (size_t)row * C;
    for (int c = lane; c < C; c += WARP_SIZE)
        o[c] = from_f32<T>((to_f32(x[c]) - m) * s * to_f32(weight[c]) + to_f32(bias[c]));
    if (lane == 0) { mean[row] = m; rstd[row] = s; }
}

// forward 4/5: the row in registers, NV vectors of V elements per lane (see the top of the file);
// vec == false (C % V != 0): guarded scalar accesses in the same layout
template <typename T, int NV, bool STREAM>
__device__ __forceinline__ void layernorm_forward4_t(T* out, float* mean, float* rstd,
        const T* inp, const T* weight, const T* bias, int N, int C) {
    constexpr int V = Vec16<T>::N;
    int lane = threadIdx.x % WARP_SIZE;
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (row >= N) return;
    const bool vec = C % V == 0;
    const T* x = inp + (size_t)row * C;
    float v[NV][V];
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; i++) {  // NV independent 16-byte loads in flight per lane
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) {
            if (vec) Vec16<T>::unpack(v[i], STREAM ? Vec16<T>::ld_cs(x + c0) : Vec16<T>::ld(x + c0));
            else load_vec<T>(v[i], x + c0, false, C - c0);  // zeros past C: they add nothing
#pragma unroll
            for (int k = 0; k < V; k++) sum += v[i][k];
        }
    }
    float m, s;
    ln_row_stats_v<NV, V>(v, sum, lane, C, m, s);
    ln_row_normalize_store<T, NV, STREAM>(out + (size_t)row * C, v, m, s, weight, bias, lane, C, vec);
    if (lane == 0) { mean[row] = m; rstd[row] = s; }
}

// out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C)
extern "C" __global__ void layernorm_forward_kernel3(float* out, float* mean, float* rstd,
        const float* inp, const float* weight, const float* bias, int N, int C) {
    LLMC_PDL_WAIT();
    layernorm_forward3_t<float>(out, mean, rstd, inp, weight, bias, N, C);
}
extern "C" __global__ void layernorm_forward_kernel3_bf16(bf16* out, float* mean, float* rstd,
        const bf16* inp, const bf16* weight, const bf16* bias, int N, int C) {
    LLMC_PDL_WAIT();
    layernorm_forward3_t<bf16>(out, mean, rstd, inp, weight, bias, N, C);
}

// entry points per NV = ceil(C / 256) (8 bf16 per vector, 32 lanes), NV <= 8 (C <= 2048)
#define LN_FWD_ENTRY_BF16(NV)                                                                         \
    extern "C" __global__ void layernorm_forward_kernel4_bf16_nv##NV(bf16* out, float* mean,          \
            float* rstd, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C) { LLMC_PDL_WAIT();        \
        layernorm_forward4_t<bf16, NV, false>(out, mean, rstd, inp, weight, bias, N, C);              \
    }                                                                                                 \
    extern "C" __global__ void layernorm_forward_kernel5_bf16_nv##NV(bf16* out, float* mean,          \
            float* rstd, const bf16* inp, const bf16* weight, const bf16* bias, int N, int C) { LLMC_PDL_WAIT();        \
        layernorm_forward4_t<bf16, NV, true>(out, mean, rstd, inp, weight, bias, N, C);               \
    }
LN_FWD_ENTRY_BF16(1) LN_FWD_ENTRY_BF16(2) LN_FWD_ENTRY_BF16(3) LN_FWD_ENTRY_BF16(4)
LN_FWD_ENTRY_BF16(5) LN_FWD_ENTRY_BF16(6) LN_FWD_ENTRY_BF16(7) LN_FWD_ENTRY_BF16(8)

// backward 3, deterministic: one warp per row over a fixed chunk of R rows per block, per-warp fp32
// accumulators in dynamic shared memory, (nwarps, 2, C); per-block partials to scratch (G, 2, C);
// dinp's "+=" read, added in fp32 and rounded once to T
template <typename T>
__device__ __forceinline__ void layernorm_backward3_t(T* dinp, float* scratch,
        const T* dout, const T* inp, const T* weight, const float* mean, const float* rstd,
        int N, int C, int R) {
    extern __shared__ float acc_t[];  // (nwarps, 2, C)
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    float* acc_w = acc_t + warp * 2 * C;
    float* acc_b = acc_w + C;
    for (int c = lane; c < C; c += WARP_SIZE) { acc_w[c] = 0.0f; acc_b[c] = 0.0f; }
    const int row_end = min(N, (blockIdx.x + 1) * R);
    for (int row = blockIdx.x * R + warp; row < row_end; row += nwarps) {
        const T* d = dout + (size_t)row * C;
        const T* x = inp + (size_t)row * C;
        T* g = dinp + (size_t)row * C;
        const float m = mean[row], s = rstd[row];
        float a, b;
        ln_bwd_ab<T>(d, x, weight, m, s, lane, C, a, b);
        for (int c = lane; c < C; c += WARP_SIZE) {
            float dc = to_f32(d[c]), n = (to_f32(x[c]) - m) * s, dn = dc * to_f32(weight[c]);
            acc_b[c] += dc;
            acc_w[c] += n * dc;
            g[c] = from_f32<T>(to_f32(g[c]) + s * (dn - a - n * b));
        }
    }
    __syncthreads();
    ln_block_partials_to_scratch(scratch, acc_t, C);
}

// backward 5 for any element type: one warp per row, the rows of dout, inp and dinp loaded together
// (3*NV independent 16-byte loads per lane) and held packed, unpacked where used. The per-warp
// accumulators are in channel order with a row stride Cp = C rounded up to V (the last vector of a
// row may reach past C when C % V != 0; those lanes add zeros there), so a lane's V accumulators are
// two (bf16) 16-byte shared accesses. vec == false: guarded scalar loads and stores, same layout.
// COLSUM (the fused form, "colsum" below): a third accumulator row per warp, the column sums of the
// dinp values it stores (as stored: rounded to T first), so scratch is (G, 3, C).
template <typename T, int NV, bool COLSUM = false>
__device__ __forceinline__ void layernorm_backward5_t(T* dinp, float* scratch,
        const T* dout, const T* inp, const T* weight, const float* mean, const float* rstd,
        int N, int C, int R) {
    constexpr int V = Vec16<T>::N;
    constexpr int K = COLSUM ? 3 : 2;
    typedef typename Vec16<T>::raw raw;
    extern __shared__ float acc_t[];  // (nwarps, K, Cp)
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    const int Cp = ceil_div(C, V) * V;
    const bool vec = C % V == 0;
    float* acc_w = acc_t + warp * K * Cp;
    float* acc_b = acc_w + Cp;
    float* acc_s = acc_b + Cp;  // (COLSUM only)
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) {
#pragma unroll
            for (int k = 0; k < V; k += 4) {
                store4(acc_w + c0 + k, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
                store4(acc_b + c0 + k, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
                if (COLSUM) store4(acc_s + c0 + k, make_float4(0.0f, 0.0f, 0.0f, 0.0f));
            }
        }
    }
    const int row_end = min(N, (blockIdx.x + 1) * R);
    for (int row = blockIdx.x * R + warp; row < row_end; row += nwarps) {
        const T* dr = dout + (size_t)row * C;
        const T* xr = inp + (size_t)row * C;
        T* gr = dinp + (size_t)row * C;
        raw d[NV], x[NV], g[NV];
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {  // (!vec: guarded scalar loads packed into the same bits, zeros past C)
                d[i] = load_raw<T>(dr + c0, vec, C - c0);
                x[i] = load_raw<T>(xr + c0, vec, C - c0);
                g[i] = load_raw<T>(gr + c0, vec, C - c0);
            }
        }
        const float m = mean[row], s = rstd[row];
        float a = 0.0f, b = 0.0f;  // sum(dnorm), sum(dnorm * norm) over the row
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                float dv[V], xv[V], w[V];
                Vec16<T>::unpack(dv, d[i]);
                Vec16<T>::unpack(xv, x[i]);
                load_vec<T>(w, weight + c0, vec, C - c0);
#pragma unroll
                for (int k = 0; k < V; k++) {  // past C: d = 0, so dn = 0 adds nothing
                    float n = (xv[k] - m) * s, dn = dv[k] * w[k];
                    a += dn;
                    b += dn * n;
                }
            }
        }
        a = warp_reduce_sum(a) / C;
        b = warp_reduce_sum(b) / C;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                float dv[V], xv[V], gv[V], w[V];
                Vec16<T>::unpack(dv, d[i]);
                Vec16<T>::unpack(xv, x[i]);
                Vec16<T>::unpack(gv, g[i]);
                load_vec<T>(w, weight + c0, vec, C - c0);
#pragma unroll
                for (int k = 0; k < V; k += 4) {
                    float4 aw = load4(acc_w + c0 + k), ab = load4(acc_b + c0 + k);
                    float n0 = (xv[k] - m) * s, n1 = (xv[k + 1] - m) * s;
                    float n2 = (xv[k + 2] - m) * s, n3 = (xv[k + 3] - m) * s;
                    gv[k] += s * (dv[k] * w[k] - a - n0 * b);
                    gv[k + 1] += s * (dv[k + 1] * w[k + 1] - a - n1 * b);
                    gv[k + 2] += s * (dv[k + 2] * w[k + 2] - a - n2 * b);
                    gv[k + 3] += s * (dv[k + 3] * w[k + 3] - a - n3 * b);
                    aw.x += n0 * dv[k]; aw.y += n1 * dv[k + 1]; aw.z += n2 * dv[k + 2]; aw.w += n3 * dv[k + 3];
                    ab.x += dv[k]; ab.y += dv[k + 1]; ab.z += dv[k + 2]; ab.w += dv[k + 3];
                    store4(acc_w + c0 + k, aw);
                    store4(acc_b + c0 + k, ab);
                }
                if (COLSUM) {  // the column sums of dinp as stored (what a bias kernel would read back)
                    round_to<T, V>(gv);
#pragma unroll
                    for (int k = 0; k < V; k += 4) {  // (past C, when !vec: padding columns, never read)
                        float4 as = load4(acc_s + c0 + k);
                        as.x += gv[k]; as.y += gv[k + 1]; as.z += gv[k + 2]; as.w += gv[k + 3];
                        store4(acc_s + c0 + k, as);
                    }
                }
                store_vec<T>(gr + c0, gv, vec, C - c0);
            }
        }
    }
    __syncthreads();
    // the block's warps summed in order into scratch row blockIdx.x (K rows of C), in channel order
    const float* accs = acc_t;
    float* out = scratch + (size_t)blockIdx.x * K * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
#pragma unroll
        for (int r = 0; r < K; r++) {
            float sum = 0.0f;
            for (int w = 0; w < nwarps; w++) sum += accs[(w * K + r) * Cp + c];
            out[r * C + c] = sum;
        }
    }
}

// ----------------------------------------------------------------------------------------------
// colsum: variant 5's fused form (layernorm_backward with colsum=True; llmc/ops/layernorm.py). The
// model's linear layers feed the residual stream, so the bias gradient of the linear layer whose
// output a layernorm's input is (fcproj after lnf and after the next layer's ln1, attproj after ln2)
// is the column sum of exactly the dinp this kernel writes. Instead of a matmul_backward_bias pass
// re-reading that (N, C) tensor, each warp adds the dinp values it stores into a third per-warp
// accumulator row in shared memory (lane l owns its channels: no atomics), the block sums its warps
// in order into scratch (G, 3, C), and the reduce below finishes all three in one fixed order:
//   colsum (C) += sum over rows of dinp (the whole dinp after the +=; bf16: the stored bf16 values)
// Extra cost over variant 5: the shared-memory row (K = 3: a third more per-warp smem, which at
// C = 768 still leaves the kernels register-bound: 3 blocks of 256 per SM in bf16, 2 in fp32),
// G * C more floats of scratch, and one more output in the reduce: no extra pass over (N, C).

// the fixed-order reduce of the (G, 3, C) partials: dweight, dbias, colsum "+=" (read, add the fp32
// total, round once to T); the same order as layernorm_backward_reduce_kernel
template <typename T>
__device__ __forceinline__ void layernorm_backward_reduce_colsum_t(T* dweight, T* dbias, T* colsum,
        const float* scratch, int G, int C) {
    __shared__ float sh[3][32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float acc[3] = {0.0f, 0.0f, 0.0f};
    if (c < C) {
        for (int g = threadIdx.y; g < G; g += 32) {
#pragma unroll
            for (int r = 0; r < 3; r++) acc[r] += scratch[((size_t)g * 3 + r) * C + c];
        }
    }
#pragma unroll
    for (int r = 0; r < 3; r++) sh[r][threadIdx.y][threadIdx.x] = acc[r];
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float t[3] = {0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int y = 0; y < 32; y++) {
#pragma unroll
            for (int r = 0; r < 3; r++) t[r] += sh[r][y][threadIdx.x];
        }
        dweight[c] = from_f32<T>(to_f32(dweight[c]) + t[0]);
        dbias[c] = from_f32<T>(to_f32(dbias[c]) + t[1]);
        colsum[c] = from_f32<T>(to_f32(colsum[c]) + t[2]);
    }
}

extern "C" __global__ void layernorm_backward_reduce_colsum_kernel(float* dweight, float* dbias, float* colsum,
        const float* scratch, int G, int C) {
    LLMC_PDL_WAIT();
    layernorm_backward_reduce_colsum_t<float>(dweight, dbias, colsum, scratch, G, C);
}
extern "C" __global__ void layernorm_backward_reduce_colsum_kernel_bf16(bf16* dweight, bf16* dbias, bf16* colsum,
        const float* scratch, int G, int C) {
    LLMC_PDL_WAIT();
    layernorm_backward_reduce_colsum_t<bf16>(dweight, dbias, colsum, scratch, G, C);
}

// dweight (C) +=, dbias (C) +=, scratch (G, 2, C). Block (32, 32): threadIdx.x picks the channel,
// the 32 rows of threads sum blocks g = y, y+32, ... then thread row 0 adds the 32 sums in order.
// Every sum has a fixed order, so the result is the same bits on every run. (The first version had
// 8 rows of threads: each thread then chained G/8 ~ 32 dependent L2 loads, a few us at this size.)
// dweight/dbias "+=": read, added in fp32, rounded once to T
template <typename T>
__device__ __forceinline__ void layernorm_backward_reduce_t(T* dweight, T* dbias, const float* scratch,
        int G, int C) {
    __shared__ float sw[32][33], sb[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float aw = 0.0f, ab = 0.0f;
    if (c < C) {
        for (int g = threadIdx.y; g < G; g += 32) {
            aw += scratch[(size_t)g * 2 * C + c];
            ab += scratch[(size_t)g * 2 * C + C + c];
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float w = 0.0f, b = 0.0f;
#pragma unroll
        for (int y = 0; y < 32; y++) { w += sw[y][threadIdx.x]; b += sb[y][threadIdx.x]; }
        dweight[c] = from_f32<T>(to_f32(dweight[c]) + w);
        dbias[c] = from_f32<T>(to_f32(dbias[c]) + b);
    }
}

extern "C" __global__ void layernorm_backward_reduce_kernel(float* dweight, float* dbias,
        const float* scratch, int G, int C) {
    LLMC_PDL_WAIT();
    layernorm_backward_reduce_t<float>(dweight, dbias, scratch, G, C);
}

// scratch (G, 2, C): written whole by backward 3 or 4
extern "C" __global__ void layernorm_backward_kernel3(float* dinp, float* scratch,
        const float* dout, const float* inp, const float* weight, const float* mean, const float* rstd,
        int N, int C, int R) {
    LLMC_PDL_WAIT();
    layernorm_backward3_t<float>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R);
}
extern "C" __global__ void layernorm_backward_kernel3_bf16(bf16* dinp, float* scratch,
        const bf16* dout, const bf16* inp, const bf16* weight, const float* mean, const float* rstd,
        int N, int C, int R) {
    LLMC_PDL_WAIT();
    layernorm_backward3_t<bf16>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R);
}

#define LN_BWD_ENTRY_BF16(NV)                                                                         \
    extern "C" __global__ void layernorm_backward_kernel5_bf16_nv##NV(bf16* dinp, float* scratch,    \
            const bf16* dout, const bf16* inp, const bf16* weight, const float* mean,                 \
            const float* rstd, int N, int C, int R) { LLMC_PDL_WAIT();                                \
        layernorm_backward5_t<bf16, NV>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R);       \
    }
LN_BWD_ENTRY_BF16(1) LN_BWD_ENTRY_BF16(2) LN_BWD_ENTRY_BF16(3) LN_BWD_ENTRY_BF16(4)
LN_BWD_ENTRY_BF16(5) LN_BWD_ENTRY_BF16(6) LN_BWD_ENTRY_BF16(7) LN_BWD_ENTRY_BF16(8)

// variant 5's fused form in bf16 (colsum above): scratch (G, 3, C)
#define LN_BWD_COLSUM_ENTRY_BF16(NV)                                                                  \
    extern "C" __global__ void layernorm_backward_kernel5_colsum_bf16_nv##NV(bf16* dinp,             \
            float* scratch, const bf16* dout, const bf16* inp, const bf16* weight, const float* mean, \
            const float* rstd, int N, int C, int R) { LLMC_PDL_WAIT();                                \
        layernorm_backward5_t<bf16, NV, true>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R); \
    }
LN_BWD_COLSUM_ENTRY_BF16(1) LN_BWD_COLSUM_ENTRY_BF16(2) LN_BWD_COLSUM_ENTRY_BF16(3) LN_BWD_COLSUM_ENTRY_BF16(4)
LN_BWD_COLSUM_ENTRY_BF16(5) LN_BWD_COLSUM_ENTRY_BF16(6) LN_BWD_COLSUM_ENTRY_BF16(7) LN_BWD_COLSUM_ENTRY_BF16(8)

extern "C" __global__ void layernorm_backward_reduce_kernel_bf16(bf16* dweight, bf16* dbias,
        const float* scratch, int G, int C) {
    LLMC_PDL_WAIT();
    layernorm_backward_reduce_t<bf16>(dweight, dbias, scratch, G, C);
}

// ----------------------------------------------------------------------------------------------
// Variant 6, forward and backward (fp32 and bf16 builds of one template; 16-byte vectors only:
// C % V == 0, V = 4 fp32 / 8 bf16). Written for the copy ceiling at GPT-2's shapes (N = B*T =
// 4096..16384 rows, C = 768), where 4 and 5 reach 75% (forward) and 63% (backward, bf16):
//   * persistent warps: the launcher sizes the grid to what is resident on the GPU at once (from
//     the kernel's registers) and gives each warp R consecutive rows (R = ceil(N / warps), warps =
//     ceil(N / R): every warp has R rows or, the last, fewer), so there is no second partial wave
//     (16384 rows of 8 per block were 1.9 waves of 5's blocks) and the per-warp startup is paid once;
//   * the next row's loads are issued before this row's reductions and stores (double-buffered in
//     registers, raw 16-byte words), so each warp always has a row in flight while it computes;
//   * forward: x read once with ld.global.cs, out written once with st.global.cs; the statistics
//     two-pass in registers (ln_row_stats_v), as 4 and 5;
//   * backward: lane l owns the same channels in every row, so its dweight/dbias partial sums live
//     in registers (fp32) for all R rows; at the end the block's warps add theirs in warp order in
//     shared memory (fp32, (nwarps, 2, C), once per block, not per row) and write one (2, C) row of
//     partials to scratch; the reduce kernel (shared with 3-5) sums the G <= 1024 rows in a fixed
//     order. With G ~ 2 blocks per SM that is ~2 MB of fp32 partials at C = 768, read from L2.
//     dinp (+=) is loaded at the start of its row (its latency under the reductions), not prefetched:
//     the registers go to the double buffer of dout and inp instead.
// Bytes each must move (the labs' and the cost model's counts; the lab's % is against these):
//   forward:  read x (N*C), weight, bias (C); write out (N*C) in T; write mean, rstd (N) fp32.
//             bf16, N = 16384, C = 768: 50.4 MB (15.7 us at 3.2 TB/s)
//   backward: read dout, x (N*C), dinp (N*C), weight (C), mean, rstd (N); write dinp (N*C); dweight,
//             dbias (C) read + written. bf16, N = 16384: 100.8 MB. Plus scratch 2 * G * 2C * 4 bytes
//             (~5 MB at G = 264 blocks, in L2) and the reduce launch.
// Register budget: forward NV <= 8 (bf16 C <= 2048, fp32 C <= 1024); backward NV <= 4 (bf16
// C <= 1024, fp32 C <= 512: two rows of dout and inp, dinp and 2 * NV * V accumulators per lane).

template <typename T, int NV>
__device__ __forceinline__ void ln_load_row_raw(typename Vec16<T>::raw (&r)[NV], const T* p, int lane, int C) {
    constexpr int V = Vec16<T>::N;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) r[i] = Vec16<T>::ld_cs(p + c0);
    }
}

template <typename T, int NV>
__device__ __forceinline__ void layernorm_forward6_t(T* __restrict__ out, float* __restrict__ mean,
        float* __restrict__ rstd, const T* __restrict__ inp, const T* __restrict__ weight,
        const T* __restrict__ bias, int N, int C, int R) {
    constexpr int V = Vec16<T>::N;
    typedef typename Vec16<T>::raw raw;
    const int lane = threadIdx.x % WARP_SIZE;
    const int gw = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int row0 = gw * R, row_end = min(N, row0 + R);
    if (row0 >= N) return;  // (whole warp; no block-wide barrier below)
    raw cur[NV], nxt[NV];
    ln_load_row_raw<T, NV>(cur, inp + (size_t)row0 * C, lane, C);
    for (int row = row0; row < row_end; row++) {
        if (row + 1 < row_end) ln_load_row_raw<T, NV>(nxt, inp + (size_t)(row + 1) * C, lane, C);
        float v[NV][V];
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                Vec16<T>::unpack(v[i], cur[i]);
#pragma unroll
                for (int k = 0; k < V; k++) sum += v[i][k];
            }
        }
        float m, s;
        ln_row_stats_v<NV, V>(v, sum, lane, C, m, s);
        ln_row_normalize_store<T, NV, true>(out + (size_t)row * C, v, m, s, weight, bias, lane, C, true);
        if (lane == 0) { mean[row] = m; rstd[row] = s; }
#pragma unroll
        for (int i = 0; i < NV; i++) cur[i] = nxt[i];
    }
}

// dynamic shared memory: (nwarps, 2, C) floats, the warps' dweight | dbias sums, once at the end.
// (The two passes over a row are also 5's and 7's, written out in each: moved into shared helpers they
// changed the machine code of some builds, 7's nv1 among them (dev/sass_diff.py), so they stay.)
template <typename T, int NV>
__device__ __forceinline__ void layernorm_backward6_t(T* __restrict__ dinp, float* __restrict__ scratch,
        const T* __restrict__ dout, const T* __restrict__ inp, const T* __restrict__ weight,
        const float* __restrict__ mean, const float* __restrict__ rstd, int N, int C, int R) {
    constexpr int V = Vec16<T>::N;
    typedef typename Vec16<T>::raw raw;
    extern __shared__ float4 acc6[];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    const int gw = blockIdx.x * nwarps + warp;
    const int row0 = gw * R, row_end = min(N, row0 + R);  // (row0 >= N: no rows, zeros below)
    float aw[NV][V], ab[NV][V];  // this lane's dweight, dbias partial sums over the warp's rows
#pragma unroll
    for (int i = 0; i < NV; i++) {
#pragma unroll
        for (int k = 0; k < V; k++) { aw[i][k] = 0.0f; ab[i][k] = 0.0f; }
    }
    raw dc[NV], xc[NV], dn[NV], xn[NV];
    float mc = 0.0f, sc = 0.0f, mn = 0.0f, sn = 0.0f;
    if (row0 < row_end) {
        ln_load_row_raw<T, NV>(dc, dout + (size_t)row0 * C, lane, C);
        ln_load_row_raw<T, NV>(xc, inp + (size_t)row0 * C, lane, C);
        mc = mean[row0];
        sc = rstd[row0];
    }
    for (int row = row0; row < row_end; row++) {
        T* gr = dinp + (size_t)row * C;
        raw g[NV];
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) g[i] = Vec16<T>::ld(gr + c0);
        }
        if (row + 1 < row_end) {
            ln_load_row_raw<T, NV>(dn, dout + (size_t)(row + 1) * C, lane, C);
            ln_load_row_raw<T, NV>(xn, inp + (size_t)(row + 1) * C, lane, C);
            mn = mean[row + 1];
            sn = rstd[row + 1];
        }
        float a = 0.0f, b = 0.0f;  // sum(dnorm), sum(dnorm * norm) over the row
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                float dv[V], xv[V], w[V];
                Vec16<T>::unpack(dv, dc[i]);
                Vec16<T>::unpack(xv, xc[i]);
                Vec16<T>::unpack(w, Vec16<T>::ld(weight + c0));
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const float nrm = (xv[k] - mc) * sc, dnrm = dv[k] * w[k];
                    a += dnrm;
                    b += dnrm * nrm;
                }
            }
        }
        a = warp_reduce_sum(a) / C;
        b = warp_reduce_sum(b) / C;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                float dv[V], xv[V], gv[V], w[V];
                Vec16<T>::unpack(dv, dc[i]);
                Vec16<T>::unpack(xv, xc[i]);
                Vec16<T>::unpack(gv, g[i]);
                Vec16<T>::unpack(w, Vec16<T>::ld(weight + c0));
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const float nrm = (xv[k] - mc) * sc;
                    gv[k] += sc * (dv[k] * w[k] - a - nrm * b);
                    aw[i][k] += nrm * dv[k];
                    ab[i][k] += dv[k];
                }
                Vec16<T>::st(gr + c0, Vec16<T>::pack(gv));
            }
        }
#pragma unroll
        for (int i = 0; i < NV; i++) { dc[i] = dn[i]; xc[i] = xn[i]; }
        mc = mn;
        sc = sn;
    }
    // the warps' sums to shared memory (warp w: acc[w][0][c] dweight, acc[w][1][c] dbias), then
    // added in warp order into this block's scratch row: the same order on every run
    float* acc = reinterpret_cast<float*>(acc6);
    float* accw = acc + (size_t)warp * 2 * C;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) {
#pragma unroll
            for (int k = 0; k < V; k += 4) {
                store4(accw + c0 + k, make_float4(aw[i][k], aw[i][k + 1], aw[i][k + 2], aw[i][k + 3]));
                store4(accw + C + c0 + k, make_float4(ab[i][k], ab[i][k + 1], ab[i][k + 2], ab[i][k + 3]));
            }
        }
    }
    __syncthreads();
    ln_block_partials_to_scratch(scratch, acc, C);
}

// entry points per NV = ceil(C / (32 V)): forward NV <= 8, backward NV <= 4
#define LN6_FWD(T, SFX, NV)                                                                           \
    extern "C" __global__ void layernorm_forward_kernel6##SFX##_nv##NV(T* out, float* mean,           \
            float* rstd, const T* inp, const T* weight, const T* bias, int N, int C, int R) { LLMC_PDL_WAIT();         \
        layernorm_forward6_t<T, NV>(out, mean, rstd, inp, weight, bias, N, C, R);                     \
    }
#define LN6_BWD(T, SFX, NV)                                                                           \
    extern "C" __global__ void layernorm_backward_kernel6##SFX##_nv##NV(T* dinp, float* scratch,     \
            const T* dout, const T* inp, const T* weight, const float* mean, const float* rstd,       \
            int N, int C, int R) { LLMC_PDL_WAIT();                                                   \
        layernorm_backward6_t<T, NV>(dinp, scratch, dout, inp, weight, mean, rstd, N, C, R);          \
    }
LN6_FWD(float, , 1) LN6_FWD(float, , 2) LN6_FWD(float, , 3) LN6_FWD(float, , 4)
LN6_FWD(float, , 5) LN6_FWD(float, , 6) LN6_FWD(float, , 7) LN6_FWD(float, , 8)
LN6_FWD(bf16, _bf16, 1) LN6_FWD(bf16, _bf16, 2) LN6_FWD(bf16, _bf16, 3) LN6_FWD(bf16, _bf16, 4)
LN6_FWD(bf16, _bf16, 5) LN6_FWD(bf16, _bf16, 6) LN6_FWD(bf16, _bf16, 7) LN6_FWD(bf16, _bf16, 8)
LN6_BWD(float, , 1) LN6_BWD(float, , 2) LN6_BWD(float, , 3) LN6_BWD(float, , 4)
LN6_BWD(bf16, _bf16, 1) LN6_BWD(bf16, _bf16, 2) LN6_BWD(bf16, _bf16, 3) LN6_BWD(bf16, _bf16, 4)

// ----------------------------------------------------------------------------------------------
// Backward variant 7 (fp32 and bf16 builds of one template; 16-byte vectors only, as 6), written for
// the copy ceiling in bf16 at B=16 (N = 16384, C = 768), where 5 reached 63% of the measured copy
// bandwidth (57% in its fused colsum form, which the model runs 24 times a step) and 6 69%:
//   * one launch: the dweight | dbias (| colsum) partials go to scratch (G, K, C) per block as before,
//     then each block takes a ticket (one integer atomicInc, acq_rel); the last S blocks to arrive
//     (S = min(G, K*C/32)) wait until all G have written theirs and each sums 32-column slices over
//     the G blocks, in block order, onto the outputs (add in fp32 to the old value, round once). The
//     order of every sum is fixed (it does not depend on which block arrives when): the same bits on
//     every run, and no float atomics (--deterministic allows it). Waiting cannot deadlock: when u
//     blocks have not arrived, at most S - u wait, so S resident blocks are all it needs (the grid is
//     sized to what is resident anyway). Nothing is reset after a launch (graph replays included):
//     the count grows by G a launch and wraps at a multiple of G, so a launch's base is the count it
//     finds rounded down to G (session 49; before, the last summer reset two counters, one more fence
//     and atomic on the launch's last path). The outputs' old values come into shared memory with
//     the first rows (cp.async), so the final "+=" does not wait on global memory. The tail after the
//     last row: 2.3-2.5 us at d12 B=4 (H200: 0.0153 ms against 0.0128 for the rows alone), 3.3 us in
//     session 34's form;
//   * the rows come through a per-warp shared-memory ring of P rows (dout | inp | dinp) that cp.async
//     fills P - 1 rows ahead, so the bytes in flight cost no registers; dweight/dbias/colsum sums in
//     registers per lane (lane l owns its channels in every row), one block-wide pass at the end;
//   * persistent warps, rows strided over the grid (row = warp, warp + W, ...): at any moment the
//     resident warps work on one window of consecutive rows; no streaming cache hints.
// Measured (H100, bf16, B=16, lab median of 30, L2 flushed; dev/cuda/layernorm_sweep7.py): 384
// threads and P = 3 (one block an SM, 12 warps, 2 rows of 4.5 KB in flight each) 0.0493 ms, 69% (5:
// 0.0537, 63%); colsum 0.0507 ms, 67% (5: 0.0594, 57%). What did not move it: P = 2..6 (65-69%),
// 128-512 threads, consecutive rows per warp instead of strided (-1%), the reduce kernel instead of
// the tickets (+-1%), and a first build that prefetched the next row into registers (162 registers,
// 12 warps an SM: 60%, 65% with the reduce kernel). A forward built the same way (6 without the .cs
// hints, rows strided) measured 56-66% against forward 4's 76%, so it was not kept. More blocks than
// are resident, R = 2..8 consecutive rows a warp (the hardware handing out the blocks), was worse:
// 45-65% (colsum 38-59%; more partials, and a ring filled and drained every R rows). Where the rest
// is, as far as these runs say: not the bytes in flight per SM (1..5 rows a warp ahead gave the
// same), not the second launch, not the row order; next to look at: the instructions per row (two
// passes of unpack, FMAs and shuffles per 8 values: by a rough count a quarter of the issue slots
// at this rate, an estimate, not a measurement) with a profiler, which these runs did not have.
// Bytes: the counts of 5/6 (the labs' and the cost model's). The scratch (G * K * C floats, G = 132
// blocks at the default) is written and read once, in L2.

#define LN7_CHUNKED 1  // flags (the lab's comparisons): rows of a warp consecutive (6's split), not strided
#define LN7_SPLIT 2    // flags: leave the partials in scratch for the reduce kernel (no tickets)
#define LN7_RESET 4    // flags (the lab's comparison): session 34's tail, both counters reset by the last summer
#define LN7_OUTS 8     // flags: dweight, dbias (, colsum) 16-byte aligned: their old values staged in shared memory
                       // (flags >> 8: P, the stages of each warp's ring)

// the rows of global warp gw of W: [row, end) by step
__device__ __forceinline__ void ln7_rows(int flags, int gw, int W, int N, int R, int& row, int& end, int& step) {
    if (flags & LN7_CHUNKED) { row = gw * R; end = min(N, row + R); step = 1; }
    else { row = gw; end = N; step = W; }
}

// cp.async (16-byte global -> shared copies, L2 only) and 128-bit shared loads, written out here
// rather than taken from mma.cuh so that a GEMM header edit does not rebuild this module. The wait
// has a "memory" clobber: the end of the row loop reuses the stages through C++ stores.
__device__ __forceinline__ uint32_t ln7_smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ln7_cp16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void ln7_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ uint4 ln7_lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}
template <int N>
__device__ __forceinline__ void ln7_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void ln7_cp_wait_stages(int P) {  // all but the newest P - 1 groups done
    switch (P) {
        case 1: ln7_cp_wait<0>(); break;
        case 2: ln7_cp_wait<1>(); break;
        case 3: ln7_cp_wait<2>(); break;
        case 4: ln7_cp_wait<3>(); break;
        case 5: ln7_cp_wait<4>(); break;
        default: ln7_cp_wait<5>(); break;
    }
}
__device__ __forceinline__ unsigned ln7_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned ln7_ld_relaxed(const unsigned* p) {
    unsigned v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ unsigned ln7_atom_inc_acq_rel(unsigned* p, unsigned limit) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.inc.u32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(limit) : "memory");
    return old;
}
template <typename T>
__device__ __forceinline__ typename Vec16<T>::raw ln7_lds(uint32_t addr) {
    uint4 v = ln7_lds128(addr);
    return *reinterpret_cast<typename Vec16<T>::raw*>(&v);
}

// Backward 7. The rows come through shared memory: each warp has a ring of P stages of (3, C) T
// (dout | inp | dinp of one row) that cp.async fills P - 1 rows ahead, so P - 1 rows (3 C sizeof(T)
// bytes each, 4.5 KB in bf16 at C = 768) are in flight per warp at all times, without the registers
// that holding them took (6, and a first register-prefetch build of this variant: 162 registers, 12
// warps an SM, 70% of the copy bandwidth). Lane l copies and later reads only its own 16-byte pieces,
// so the warp needs no barrier between them. dweight | dbias (| colsum) sums in registers per lane.
// Dynamic shared memory: nwarps * P * 3 * C * sizeof(T) bytes of stages (reused at the end for the
// warps' (K, C) fp32 sums, and for the final sums' staging), then 16 bytes for the ticket.
template <typename T, int NV, bool COLSUM>
__device__ __forceinline__ void layernorm_backward7_t(T* __restrict__ dinp, T* dweight, T* dbias, T* colsum,
        float* __restrict__ scratch, unsigned* sync, const T* __restrict__ dout, const T* __restrict__ inp,
        const T* __restrict__ weight, const float* __restrict__ mean, const float* __restrict__ rstd,
        int N, int C, int R, int flags) {
    constexpr int V = Vec16<T>::N;
    constexpr int K = COLSUM ? 3 : 2;
    typedef typename Vec16<T>::raw raw;
    extern __shared__ float4 smem7[];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    const int P = flags >> 8;  // stages per warp (2..6)
    int row, end, step;
    ln7_rows(flags, blockIdx.x * nwarps + warp, gridDim.x * nwarps, N, R, row, end, step);
    const int stage_bytes = 3 * C * (int)sizeof(T);  // (C % V == 0: every piece 16-byte aligned)
    unsigned char* region = reinterpret_cast<unsigned char*>(smem7) + (size_t)warp * P * stage_bytes;
    const uint32_t s0 = ln7_smem_u32(region);
    float aw[NV][V], ab[NV][V], as[COLSUM ? NV : 1][V];  // this lane's dweight, dbias (, colsum) sums
#pragma unroll
    for (int i = 0; i < NV; i++) {
#pragma unroll
        for (int k = 0; k < V; k++) { aw[i][k] = 0.0f; ab[i][k] = 0.0f; as[COLSUM ? i : 0][k] = 0.0f; }
    }
    // row r into stage p (nothing past the warp's last row); one commit group per row either way
    auto issue = [&](int r, int p) {
        if (r < end) {
            const uint32_t s = s0 + p * stage_bytes;
            const size_t off = (size_t)r * C;
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int c0 = V * (lane + i * WARP_SIZE);
                if (c0 < C) {
                    ln7_cp16(s + c0 * sizeof(T), dout + off + c0);
                    ln7_cp16(s + (C + c0) * sizeof(T), inp + off + c0);
                    ln7_cp16(s + (2 * C + c0) * sizeof(T), dinp + off + c0);
                }
            }
        }
        ln7_cp_commit();
    };
    // this lane's pieces of weight, loaded once (every row uses them twice): bf16 C = 768 0.0468 ms
    // against 0.0495 loaded per row (H100, B=16). Not in the colsum form at NV = 4 (C > 768 bf16), whose
    // registers would then pass the 170 that 384 threads allow.
    constexpr bool HOIST_W = !(COLSUM && NV >= 4);
    raw wv[HOIST_W ? NV : 1];
#pragma unroll
    for (int i = 0; i < (HOIST_W ? NV : 0); i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) wv[HOIST_W ? i : 0] = Vec16<T>::ld(weight + c0);
    }
    // the ticketed form's tail, set up off its path. The count of arrivals only ever grows by G a launch
    // (modulo G * floor((2^32 - 1) / G), where atomicInc wraps it), and fewer than G of this launch's
    // blocks (not this one) have arrived yet: so this launch's base is the count rounded down to G.
    // With LN7_OUTS the outputs' old values come into shared memory (after the stages and the ticket)
    // in a cp.async group ahead of the rows', so the final "+=" reads them there.
    const bool tickets = !(flags & (LN7_SPLIT | LN7_RESET));
    const unsigned G = gridDim.x;
    unsigned c0 = 0;  // (relaxed, and not used before the tail: the load does not hold the warp up here)
    if (tickets && threadIdx.x == 0) c0 = ln7_ld_relaxed(&sync[0]);
    const T* outs_s = reinterpret_cast<const T*>(reinterpret_cast<unsigned char*>(smem7) + (size_t)nwarps * P * stage_bytes + 16);
    if (tickets && (flags & LN7_OUTS)) {
        const int pieces = C / V;  // 16-byte pieces an output (C % V == 0)
        for (int i = threadIdx.x; i < K * pieces; i += blockDim.x) {
            const int r = i / pieces;
            const T* o = r == 0 ? dweight : r == 1 ? dbias : colsum;
            ln7_cp16(ln7_smem_u32(outs_s + i * V), o + (i - r * pieces) * V);
        }
        ln7_cp_commit();
    }
    for (int p = 0; p < P - 1; p++) issue(row + p * step, p);
    float mc = 0.0f, sc = 0.0f;
    if (row < end) { mc = mean[row]; sc = rstd[row]; }
    int p = 0;
    for (; row < end; row += step) {
        issue(row + (P - 1) * step, p == 0 ? P - 1 : p - 1);  // the stage the previous row used
        const int next = row + step;
        float mn = 0.0f, sn = 0.0f;
        if (next < end) { mn = mean[next]; sn = rstd[next]; }
        ln7_cp_wait_stages(P);  // this row's group (issued P - 1 rows ago) has landed
        const uint32_t s = s0 + p * stage_bytes;
        raw dc[NV], xc[NV];
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                dc[i] = ln7_lds<T>(s + c0 * sizeof(T));
                xc[i] = ln7_lds<T>(s + (C + c0) * sizeof(T));
            }
        }
        float a = 0.0f, b = 0.0f;  // sum(dnorm), sum(dnorm * norm) over the row
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                float dv[V], xv[V], w[V];
                Vec16<T>::unpack(dv, dc[i]);
                Vec16<T>::unpack(xv, xc[i]);
                Vec16<T>::unpack(w, HOIST_W ? wv[HOIST_W ? i : 0] : Vec16<T>::ld(weight + c0));
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const float nrm = (xv[k] - mc) * sc, dnrm = dv[k] * w[k];
                    a += dnrm;
                    b += dnrm * nrm;
                }
            }
        }
        a = warp_reduce_sum(a) / C;
        b = warp_reduce_sum(b) / C;
        T* gr = dinp + (size_t)row * C;
#pragma unroll
        for (int i = 0; i < NV; i++) {
            const int c0 = V * (lane + i * WARP_SIZE);
            if (c0 < C) {
                float dv[V], xv[V], gv[V], w[V];
                Vec16<T>::unpack(dv, dc[i]);
                Vec16<T>::unpack(xv, xc[i]);
                Vec16<T>::unpack(gv, ln7_lds<T>(s + (2 * C + c0) * sizeof(T)));
                Vec16<T>::unpack(w, HOIST_W ? wv[HOIST_W ? i : 0] : Vec16<T>::ld(weight + c0));
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const float nrm = (xv[k] - mc) * sc;
                    gv[k] += sc * (dv[k] * w[k] - a - nrm * b);
                    aw[i][k] += nrm * dv[k];
                    ab[i][k] += dv[k];
                }
                const raw packed = Vec16<T>::pack(gv);
                Vec16<T>::st(gr + c0, packed);
                if (COLSUM) {  // the column sums of dinp as stored (T's rounding), as 5's fused form
                    Vec16<T>::unpack(gv, packed);
#pragma unroll
                    for (int k = 0; k < V; k++) as[COLSUM ? i : 0][k] += gv[k];
                }
            }
        }
        p = p + 1 == P ? 0 : p + 1;
        mc = mn;
        sc = sn;
    }
    ln7_cp_wait<0>();  // (the empty groups past the last row)
    // the warps' sums into their own stage region ((K, C) fp32 fits in P >= 2 stages of bf16, any P
    // of fp32), then added in warp order into this block's scratch row: the same order on every run
    float* accw = reinterpret_cast<float*>(region);
#pragma unroll
    for (int i = 0; i < NV; i++) {
        const int c0 = V * (lane + i * WARP_SIZE);
        if (c0 < C) {
#pragma unroll
            for (int k = 0; k < V; k += 4) {
                store4(accw + c0 + k, make_float4(aw[i][k], aw[i][k + 1], aw[i][k + 2], aw[i][k + 3]));
                store4(accw + C + c0 + k, make_float4(ab[i][k], ab[i][k + 1], ab[i][k + 2], ab[i][k + 3]));
                if (COLSUM) {
                    const int j = COLSUM ? i : 0;
                    store4(accw + 2 * C + c0 + k, make_float4(as[j][k], as[j][k + 1], as[j][k + 2], as[j][k + 3]));
                }
            }
        }
    }
    __syncthreads();
    {
        const float* acc = reinterpret_cast<const float*>(smem7);
        const int wstride = P * stage_bytes / 4;  // floats between two warps' regions
        float* out = scratch + (size_t)blockIdx.x * K * C;
        for (int c = threadIdx.x; c < K * C; c += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < nwarps; w++) sum += acc[w * wstride + c];
            out[c] = sum;
        }
    }
    if (flags & LN7_SPLIT) return;
    // the ticket: the block's partials stored, then thread 0's fence and one atomicInc (in this launch's
    // arrival order: rank = count - base). The last S to arrive sum the slices, once the count reaches
    // base + G; the last to arrive sees that in its own ticket. Nothing to reset: the next launch's base
    // is base + G. (LN7_RESET: session 34's tail, every thread fenced, the count waited for to reach G,
    // and the last summer resetting both counters: one more fence and atomic on the launch's last path.)
    unsigned* ticket7 = reinterpret_cast<unsigned*>(reinterpret_cast<unsigned char*>(smem7) + (size_t)nwarps * P * stage_bytes);
    const unsigned wrap = G * (0xFFFFFFFFu / G);  // the count runs 0 .. wrap - 1
    const unsigned base = c0 - c0 % G;
    if (!tickets) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        if (tickets) {  // (acq_rel: the block's partials released, through the barrier; the others' acquired)
            *ticket7 = ln7_atom_inc_acq_rel(&sync[0], wrap - 1u) - base;
        } else {
            *ticket7 = atomicAdd(&sync[0], 1u);
        }
    }
    __syncthreads();
    const int KC4 = K * C / 4;               // float4 columns of a scratch row (C % 4 == 0)
    const int Q = ceil_div(KC4, 8);          // slices of 8 float4 = 32 columns
    const unsigned S = min(G, (unsigned)Q);  // the blocks that sum the slices: the last S to arrive
    const unsigned ticket = *ticket7;
    if (ticket < G - S) return;
    const int j0 = ticket - (G - S);
    if (threadIdx.x == 0) {
        if (tickets) {
            const unsigned target = base + G == wrap ? 0u : base + G;
            if (ticket != G - 1)
                while (ln7_ld_acquire(&sync[0]) != target) __nanosleep(32);
        } else {
            while (*reinterpret_cast<volatile unsigned*>(&sync[0]) < G) __nanosleep(32);
            __threadfence();
        }
    }
    __syncthreads();
    // slice q: lane l reads float4 column 8q + (l % 8) of blocks g = l/8 + 4*warp + 4*nwarps*t, ...
    const float4* part = reinterpret_cast<const float4*>(scratch);
    float4* sh = smem7;  // (nwarps, 8) float4: the warps' sums of one slice
    for (int q = j0; q < Q; q += S) {
        const int col4 = 8 * q + lane % 8;
        float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (col4 < KC4) {
#pragma unroll 4
            for (int g = lane / 8 + 4 * warp; g < (int)G; g += 4 * nwarps) {
                const float4 v = __ldcg(part + (size_t)g * KC4 + col4);
                t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
            }
        }
#pragma unroll
        for (int off = 16; off >= 8; off /= 2) {  // the 4 lane groups, a fixed tree
            t.x += __shfl_xor_sync(0xffffffffu, t.x, off);
            t.y += __shfl_xor_sync(0xffffffffu, t.y, off);
            t.z += __shfl_xor_sync(0xffffffffu, t.z, off);
            t.w += __shfl_xor_sync(0xffffffffu, t.w, off);
        }
        __syncthreads();  // (sh may still be read for the previous slice)
        if (lane < 8) sh[warp * 8 + lane] = t;
        __syncthreads();
        if (warp == 0 && lane < 8 && col4 < KC4) {
            float4 tot = sh[lane];
            for (int w = 1; w < nwarps; w++) {
                const float4 v = sh[w * 8 + lane];
                tot.x += v.x; tot.y += v.y; tot.z += v.z; tot.w += v.w;
            }
            const int r = (4 * col4) / C, c = 4 * col4 - r * C;  // (C % 4 == 0: one output row)
            T* o = (r == 0 ? dweight : r == 1 ? dbias : colsum) + c;
            const T* old = tickets && (flags & LN7_OUTS) ? outs_s + 4 * col4 : o;
            o[0] = from_f32<T>(to_f32(old[0]) + tot.x);
            o[1] = from_f32<T>(to_f32(old[1]) + tot.y);
            o[2] = from_f32<T>(to_f32(old[2]) + tot.z);
            o[3] = from_f32<T>(to_f32(old[3]) + tot.w);
        }
    }
    // LN7_RESET: the last of the S resets both counters for the next launch
    if (!tickets && threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&sync[1], 1u) == S - 1) {
            sync[0] = 0u;
            sync[1] = 0u;
            __threadfence();
        }
    }
}

// entry points per NV = ceil(C / (32 V)): bf16 NV <= 4, fp32 NV <= 3
#define LN7_BWD(T, SFX, NV)                                                                           \
    extern "C" __global__ void layernorm_backward_kernel7##SFX##_nv##NV(T* dinp, T* dweight, T* dbias, \
            float* scratch, unsigned* sync, const T* dout, const T* inp, const T* weight,             \
            const float* mean, const float* rstd, int N, int C, int R, int flags) { LLMC_PDL_WAIT();  \
        layernorm_backward7_t<T, NV, false>(dinp, dweight, dbias, nullptr, scratch, sync, dout, inp,  \
                                            weight, mean, rstd, N, C, R, flags);                      \
    }                                                                                                 \
    extern "C" __global__ void layernorm_backward_kernel7_colsum##SFX##_nv##NV(T* dinp, T* dweight,   \
            T* dbias, T* colsum, float* scratch, unsigned* sync, const T* dout, const T* inp,         \
            const T* weight, const float* mean, const float* rstd, int N, int C, int R, int flags) { LLMC_PDL_WAIT();  \
        layernorm_backward7_t<T, NV, true>(dinp, dweight, dbias, colsum, scratch, sync, dout, inp,    \
                                           weight, mean, rstd, N, C, R, flags);                       \
    }
LN7_BWD(float, , 1) LN7_BWD(float, , 2) LN7_BWD(float, , 3)
LN7_BWD(bf16, _bf16, 1) LN7_BWD(bf16, _bf16, 2) LN7_BWD(bf16, _bf16, 3) LN7_BWD(bf16, _bf16, 4)

// The deferred form of variants 7 and 5: the column sums of many calls finished by one launch. A
// training step calls the fused backward 24 times (d12); each call's sums are needed only by the
// update, yet 7's ticketed form above ends every call with a grid-wide wait and a reduce on its
// critical path (in the d12 bf16 step at B=4 a call alone took 16.5 us with it, 12.3 deferred), and 5
// follows every call with its reduce launch. Deferred, each call runs its main kernel alone (7 with
// LN7_SPLIT) into its own slot of scratch (G partial rows of K * C floats, K = 3 with colsum, else 2;
// slots G * 3 * C floats apart) and this kernel adds every slot's sums into its outputs afterwards.
// outs: 3 pointers a slot (dweight, dbias, colsum; colsum null: K = 2; dweight null: the slot was not
// used since the last reduce, skip it). Block (x, slot), 256 threads: float4 columns 32x .. 32x + 31
// of the slot's K * C sums; warp w adds partial rows g = w, w + 8, ... in order, warp 0 adds the 8
// warps' totals in order and "+=" them (read, add in fp32, round once to T): a fixed order, the same
// bits on every run (not the ticketed form's bits: another order of the same sums).
template <typename T>
__device__ __forceinline__ void layernorm_backward_reduce_deferred_t(const float* scratch, T* const* outs, int G,
                                                                     int C) {
    const int s = blockIdx.y;
    T* const dweight = outs[3 * s];
    T* const colsum = outs[3 * s + 2];
    if (dweight == nullptr) return;
    const int K = colsum != nullptr ? 3 : 2;
    const int KC4 = K * C / 4;  // float4 columns of one partial row (C % 4 == 0)
    if (blockIdx.x * 32 >= KC4) return;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    constexpr int NW = 8;
    const int col4 = blockIdx.x * 32 + lane;
    const float4* part = reinterpret_cast<const float4*>(scratch + (size_t)s * G * 3 * C);
    float4 t = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (col4 < KC4) {
#pragma unroll 4
        for (int g = warp; g < G; g += NW) {
            const float4 v = __ldcs(part + (size_t)g * KC4 + col4);
            t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
        }
    }
    __shared__ float4 sh[NW][WARP_SIZE];
    sh[warp][lane] = t;
    __syncthreads();
    if (warp == 0 && col4 < KC4) {
        float4 tot = sh[0][lane];
#pragma unroll
        for (int w = 1; w < NW; w++) {
            const float4 v = sh[w][lane];
            tot.x += v.x; tot.y += v.y; tot.z += v.z; tot.w += v.w;
        }
        const int r = (4 * col4) / C, c = 4 * col4 - r * C;  // (C % 4 == 0: one output row)
        T* o = (r == 0 ? dweight : r == 1 ? outs[3 * s + 1] : colsum) + c;
        o[0] = from_f32<T>(to_f32(o[0]) + tot.x);
        o[1] = from_f32<T>(to_f32(o[1]) + tot.y);
        o[2] = from_f32<T>(to_f32(o[2]) + tot.z);
        o[3] = from_f32<T>(to_f32(o[3]) + tot.w);
    }
}
extern "C" __global__ void __launch_bounds__(256) layernorm_backward_reduce_deferred_kernel(const float* scratch,
        float* const* outs, int G, int C) {
    LLMC_PDL_WAIT();
    layernorm_backward_reduce_deferred_t<float>(scratch, outs, G, C);
}
extern "C" __global__ void __launch_bounds__(256) layernorm_backward_reduce_deferred_kernel_bf16(const float* scratch,
        bf16* const* outs, int G, int C) {
    LLMC_PDL_WAIT();
    layernorm_backward_reduce_deferred_t<bf16>(scratch, outs, G, C);
}
