// Matmul family: GPT-2's linear layers. Everything is fp32 in memory, row-major. Python side:
// llmc/ops/matmul.py. Versions 6 and 7 of matmul_forward and every matmul_backward version run on
// the GEMM engines (cuda/gemm.cu, llmc/ops/gemm.py); this file holds the op's own kernels.
//
// matmul_forward: out(N,OC) = inp(N,C) @ weight(OC,C)^T + bias(OC)       (--matmul-kernel)
//   version 1: naive, one thread per output, threads along OC (weight rows read C apart: uncoalesced)
//   version 2: coalesced: a warp per (8 rows, 1 column), lanes stride along C, warp-shuffle reduction
//   version 3: 32x32 shared-memory tiles, one output per thread
//   version 4: 128x128 register-blocked tiles, 8x8 outputs per thread, float4 loads and stores
//   version 5: TF32 tensor cores, mma.sync m16n8k8, 64x64 tiles, plain loads through shared memory
//   version 6: the TF32 GEMM engine (gemm engine 2): cp.async 3-stage pipeline, 128x256 / 128x128 /
//              64x64 block tiles picked per shape, 64x64 warp tiles, swizzled smem, fused bias, float4
//              stores staged through shared memory
//   version 7: gemm engine 4: version 6 with ldmatrix fragments and a leaner loader (the default)
//   version 8: GEMV for decoding (N <= 8 rows): a warp per output column streams its weight row once
//              with float4 loads, the N row sums in registers (what the KV-cache decoder uses)
// matmul_backward: dinp = dout @ weight (=), dweight += dout^T @ inp     (--matmul-backward-kernel)
//   version 1: two GEMMs on gemm engine 1 (SIMT)
//   version 2: two GEMMs on gemm engine 2 (TF32), split-K for the K=N*T reduction of dweight
//   version 3: version 2 on gemm engine 4 (the default)
// matmul_backward_bias: dbias(OC) += column sums of dout(N,OC)           (--matmul-backward-bias-kernel)
//   version 1: one thread per column, walks all N rows (coalesced across the warp, few threads)
//   version 2: 2-D blocks (32 columns x 8 row-lanes) over row chunks -> partials; a fixed-order
//              second pass adds them to dbias (deterministic, no atomics)
//   version 3: version 2 with float4 columns (128 per block) and 4 rows in flight per thread
//   version 4: version 3 in one launch: the last block of each column block to finish (a ticket on
//              a per-column-block counter) adds the partials up in chunk order (deterministic; the
//              default: 13.0 / 23.8 / 29.4 us at OC = 768 / 2304 / 3072, N = 4096, against version 3's
//              14.9 / 26.3 / 31.4, docs/lab/matmul_backward.md). Since session 31: chunks of >= 128 rows
//              (were >= 32), the finishing block's partials by plain loads, bf16 rows four at a time
//              (H200 bf16, N = 4096: 11.0 / 13.7 / 15.8 us, were 11.5 / 14.0 / 15.9)
//   version 5: sm_90: clusters of 8 blocks over the rows of a column slice, their sums added in rank
//              order through distributed shared memory (no partials, no counters; fp32 and bf16).
//              Faster alone in bf16, slower in the step beside the side stream's GEMMs (docs/matmul_notes.md)
//
// bf16 builds (--precision bf16; entry points end in _bf16): matmul_forward 8 (the GEMV, 8 bf16 per
// 16-byte load) and matmul_backward_bias 4 and 5 (8 columns per lane), bf16 in and out, fp32 sums, one
// rounding on the store. matmul_forward 9 / matmul_backward 5 in bf16 are engine 5 (cuda/gemm_wgmma.cu).
//
// Measured on the H100 (docs/matmul_notes.md; TFLOP/s at N=4096 for qkv / attproj / fc / fcproj / lm head):
//   forward 1: 0.5, 2: 3.6, 3: 7.3, 4: 34 / 29 / 40 / 29 / 40, 5: 79 / 54 / 84 / 63 / 67,
//   6: 139 / 109 / 158 / 128 / 173 (cuBLAS TF32: 309 / 176 / 229 / 252 / 361; mma.sync probe ceiling 320)
//   backward 1: 17 / 14 / 20 / 19 / 22, 2: 129 / 105 / 128 / 140 / 149 (cuBLAS: 180 / 125 / 194 / 216 / 292)
//   backward bias at OC=768 / 3072: 1: 147 / 161 us, 2: 15.2 / 34.0 us, 3: 15.1 / 30.9 us

#include <cuda_bf16.h>
#include "common.cuh"
#include "mma.cuh"

typedef long long ll;

// ----------------------------------------------------------------------------------------------
// matmul_forward versions 1-5 (version 6 is gemm engine 2 with the bias fused)

// version 1: one thread per output out[n][oc]; consecutive threads take consecutive oc, so each
// reads its own weight row: 32 rows C floats apart per warp load (uncoalesced), inp[n] broadcast.
extern "C" __global__ void matmul_forward_kernel1(float* out, const float* inp, const float* weight,
                                                  const float* bias, int N, int C, int OC) {
    LLMC_PDL_WAIT();
    const int oc = blockIdx.x * blockDim.x + threadIdx.x, n = blockIdx.y;
    if (oc >= OC) return;
    const float* x = inp + (ll)n * C;
    const float* w = weight + (ll)oc * C;
    float s = bias ? bias[oc] : 0.0f;
    for (int c = 0; c < C; c++) s = fmaf(x[c], w[c], s);
    out[(ll)n * OC + oc] = s;
}

// version 2: the reduction runs along the lanes, so every warp load is 32 consecutive floats of
// one row (128 bytes, coalesced). A warp owns one weight row oc and 8 rows of inp: each weight value
// it loads is used 8 times. Warp-shuffle reductions at the end, lane 0..7 write the 8 outputs.
extern "C" __global__ void matmul_forward_kernel2(float* out, const float* inp, const float* weight,
                                                  const float* bias, int N, int C, int OC) {
    LLMC_PDL_WAIT();
    constexpr int R = 8;
    const int lane = threadIdx.x % 32;
    const int oc = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int n0 = blockIdx.y * R;
    if (oc >= OC) return;
    const float* w = weight + (ll)oc * C;
    float s[R] = {};
    for (int c = lane; c < C; c += 32) {
        const float wv = w[c];
#pragma unroll
        for (int r = 0; r < R; r++)
            if (n0 + r < N) s[r] = fmaf(inp[(ll)(n0 + r) * C + c], wv, s[r]);
    }
    const float b = bias ? bias[oc] : 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float v = warp_reduce_sum(s[r]);
        if (lane == r && n0 + r < N) out[(ll)(n0 + r) * OC + oc] = v + b;
    }
}

// version 8: GEMV for decoding, N <= 8 rows (the batch). The weight is read exactly once, in
// float4s, streamed past the caches (__ldcs: a decode step touches each weight once); the N input
// rows (N*C*4 bytes, <= 96 KB) are re-read by every warp from L1/L2. One warp per output column,
// lanes stride along C, the N sums per lane in registers, then one butterfly reduction per row.
// One entry point per row count (matmul_forward_kernel8_rows<R>): with R known at compile time no
// load sits behind a branch, so the unrolled loop issues all its 16-byte loads before the first
// FMA waits (with a runtime row count the loads serialise: 4x slower at 8 rows). Bandwidth-bound:
// OC*C*4 bytes at ~3 TB/s, 2.4-9.4 MB per GPT-2 124M layer matmul.
template <int R, bool GELU>
__device__ __forceinline__ void gemv_rows(float* out, const float* inp, const float* weight,
                                          const float* bias, int C, int OC) {
    constexpr int U = R <= 2 ? 4 : 2;  // 16-byte weight loads in flight per lane (registers: ~R*U*4)
    const int lane = threadIdx.x % 32;
    const int oc = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (oc >= OC) return;
    const int C4 = C / 4;
    const float4* w = reinterpret_cast<const float4*>(weight + (ll)oc * C);
    const float4* x = reinterpret_cast<const float4*>(inp);
    float s[R];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = 0.0f;
#pragma unroll U
    for (int c = lane; c < C4; c += 32) {
        const float4 wv = __ldcs(w + c);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float4 xv = __ldg(x + (ll)r * C4 + c);
            s[r] = fmaf(wv.x, xv.x, fmaf(wv.y, xv.y, fmaf(wv.z, xv.z, fmaf(wv.w, xv.w, s[r]))));
        }
    }
    const float b = bias ? bias[oc] : 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float v = warp_reduce_sum(s[r]) + b;  // every lane holds the sum
        if (lane == r) out[(ll)r * OC + oc] = GELU ? gelu_fwd(v) : v;
    }
}

// matmul_forward_kernel8_gelu_rows<R>: the same with GELU applied to the result (the decoder's
// fc matmul + gelu in one launch; not a matmul_forward variant)
#define GEMV_ENTRY(R)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) matmul_forward_kernel8_rows##R(                 \
            float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC) { LLMC_PDL_WAIT(); \
        gemv_rows<R, false>(out, inp, weight, bias, C, OC);                                            \
    }                                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) matmul_forward_kernel8_gelu_rows##R(            \
            float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC) { LLMC_PDL_WAIT(); \
        gemv_rows<R, true>(out, inp, weight, bias, C, OC);                                             \
    }
GEMV_ENTRY(1) GEMV_ENTRY(2) GEMV_ENTRY(3) GEMV_ENTRY(4) GEMV_ENTRY(5) GEMV_ENTRY(6) GEMV_ENTRY(7) GEMV_ENTRY(8)

// the 8 bf16 of a 16-byte load as 4 float pairs (exact)
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float2 (&f)[4]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) f[i] = __bfloat1622float2(h[i]);
}

// version 8, bf16 build: the same GEMV with 8 bf16 per 16-byte load (C % 8 == 0): half the bytes
// per weight row, so twice the columns per byte of bandwidth. fp32 sums, bias and GELU in fp32, one
// rounding on the store.
template <int R, bool GELU>
__device__ __forceinline__ void gemv_rows_bf16(__nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight,
                                               const __nv_bfloat16* bias, int C, int OC) {
    constexpr int U = R <= 2 ? 4 : 2;
    const int lane = threadIdx.x % 32;
    const int oc = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (oc >= OC) return;
    const int C8 = C / 8;
    const uint4* w = reinterpret_cast<const uint4*>(weight + (ll)oc * C);
    const uint4* x = reinterpret_cast<const uint4*>(inp);
    float s[R];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = 0.0f;
#pragma unroll U
    for (int c = lane; c < C8; c += 32) {
        float2 wf[4];
        bf16x8_to_float(__ldcs(w + c), wf);
#pragma unroll
        for (int r = 0; r < R; r++) {
            float2 xf[4];
            bf16x8_to_float(__ldg(x + (ll)r * C8 + c), xf);
#pragma unroll
            for (int i = 0; i < 4; i++) s[r] = fmaf(wf[i].x, xf[i].x, fmaf(wf[i].y, xf[i].y, s[r]));
        }
    }
    const float b = bias ? __bfloat162float(bias[oc]) : 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float v = warp_reduce_sum(s[r]) + b;
        if (lane == r) out[(ll)r * OC + oc] = __float2bfloat16_rn(GELU ? gelu_fwd(v) : v);
    }
}
#define GEMV_ENTRY_BF16(R)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) matmul_forward_kernel8_rows##R##_bf16(           \
            __nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight,                 \
            const __nv_bfloat16* bias, int N, int C, int OC) { LLMC_PDL_WAIT();                         \
        gemv_rows_bf16<R, false>(out, inp, weight, bias, C, OC);                                        \
    }                                                                                                   \
    extern "C" __global__ void __launch_bounds__(256) matmul_forward_kernel8_gelu_rows##R##_bf16(      \
            __nv_bfloat16* out, const __nv_bfloat16* inp, const __nv_bfloat16* weight,                 \
            const __nv_bfloat16* bias, int N, int C, int OC) { LLMC_PDL_WAIT();                         \
        gemv_rows_bf16<R, true>(out, inp, weight, bias, C, OC);                                         \
    }
GEMV_ENTRY_BF16(1) GEMV_ENTRY_BF16(2) GEMV_ENTRY_BF16(3) GEMV_ENTRY_BF16(4)
GEMV_ENTRY_BF16(5) GEMV_ENTRY_BF16(6) GEMV_ENTRY_BF16(7) GEMV_ENTRY_BF16(8)

// version 3: 32x32 output tile per block (32x32 threads), K in steps of 32 through shared memory.
// Both tiles load coalesced along C; wt is padded to 33 so the column walk is conflict-free.
extern "C" __global__ void __launch_bounds__(1024) matmul_forward_kernel3(
    float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC) {
    LLMC_PDL_WAIT();
    __shared__ float xt[32][33];  // (rows n, c)
    __shared__ float wt[32][33];  // (rows oc, c)
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int n = blockIdx.y * 32 + ty, oc = blockIdx.x * 32 + tx;
    const int wrow = blockIdx.x * 32 + ty;  // the weight row this thread loads
    float s = 0.0f;
    for (int c0 = 0; c0 < C; c0 += 32) {
        xt[ty][tx] = (n < N && c0 + tx < C) ? inp[(ll)n * C + c0 + tx] : 0.0f;
        wt[ty][tx] = (wrow < OC && c0 + tx < C) ? weight[(ll)wrow * C + c0 + tx] : 0.0f;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 32; k++) s = fmaf(xt[ty][k], wt[tx][k], s);
        __syncthreads();
    }
    if (n < N && oc < OC) out[(ll)n * OC + oc] = s + (bias ? bias[oc] : 0.0f);
}

// version 4: 128x128 tile per block of 256 threads, 8x8 outputs per thread (two 4x4 quadrants 64
// apart so the float4 smem reads of a warp spread over the banks), K in steps of 8. Global loads
// are float4 along C (needs C % 4 == 0), stored transposed as (k, m) so the inner loop reads
// 4 consecutive m as one float4; rows padded to 132 floats to split the transposing stores over
// the banks. The next k-slice is fetched into registers while the current one is consumed.
extern "C" __global__ void __launch_bounds__(256) matmul_forward_kernel4(
    float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC) {
    LLMC_PDL_WAIT();
    constexpr int BM = 128, BK = 8, LDS = BM + 4;
    __shared__ __align__(16) float xs[BK][LDS];  // (k, n)
    __shared__ __align__(16) float ws[BK][LDS];  // (k, oc)
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    const int n0 = blockIdx.y * BM, oc0 = blockIdx.x * BM;
    const int lr = tid / 2, lk = (tid % 2) * 4;  // each thread loads one float4 of each tile
    const bool xin = n0 + lr < N, win = oc0 + lr < OC;
    const float* xp = inp + (ll)(n0 + lr) * C + lk;
    const float* wp = weight + (ll)(oc0 + lr) * C + lk;
    const float4 zero4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 xv = (xin && lk < C) ? load4(xp) : zero4;
    float4 wv = (win && lk < C) ? load4(wp) : zero4;
    float acc[8][8] = {};
    for (int c0 = 0; c0 < C; c0 += BK) {
        xs[lk + 0][lr] = xv.x; xs[lk + 1][lr] = xv.y; xs[lk + 2][lr] = xv.z; xs[lk + 3][lr] = xv.w;
        ws[lk + 0][lr] = wv.x; ws[lk + 1][lr] = wv.y; ws[lk + 2][lr] = wv.z; ws[lk + 3][lr] = wv.w;
        __syncthreads();
        const int cn = c0 + BK + lk;  // prefetch the next slice while computing this one
        xv = (xin && cn < C) ? load4(xp + c0 + BK) : zero4;
        wv = (win && cn < C) ? load4(wp + c0 + BK) : zero4;
#pragma unroll
        for (int k = 0; k < BK; k++) {
            const float4 a0 = *reinterpret_cast<const float4*>(&xs[k][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&xs[k][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&ws[k][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&ws[k][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float bb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; i++)
#pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] = fmaf(a[i], bb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int n = n0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
        if (n >= N) continue;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int oc = oc0 + h * 64 + tx * 4;
            if (oc >= OC) continue;  // OC % 4 == 0: the float4 is all in or all out
            float4 o = make_float4(acc[i][h * 4], acc[i][h * 4 + 1], acc[i][h * 4 + 2], acc[i][h * 4 + 3]);
            if (bias) { o.x += bias[oc]; o.y += bias[oc + 1]; o.z += bias[oc + 2]; o.w += bias[oc + 3]; }
            store4(out + (ll)n * OC + oc, o);
        }
    }
}

// version 5: the first tensor-core version. 64x64 output tile per block of 4 warps (2x2, 32x32 each),
// K in steps of 32. Tiles go global -> registers (float4, C % 4 == 0) -> tf32-rounded -> shared, rows
// padded to 36 floats: the fragment read (row g, col t) then hits bank 4g+t, all 32 distinct.
// No pipelining: load, barrier, compute, barrier.
extern "C" __global__ void __launch_bounds__(128) matmul_forward_kernel5(
    float* out, const float* inp, const float* weight, const float* bias, int N, int C, int OC) {
    LLMC_PDL_WAIT();
    constexpr int BM = 64, BK = 32, LDS = BK + 4;
    __shared__ __align__(16) uint32_t xs[BM][LDS];  // (n, c) as tf32
    __shared__ __align__(16) uint32_t ws[BM][LDS];  // (oc, c) as tf32
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int g = lane / 4, t = lane % 4;
    const int wm = (warp % 2) * 32, wn = (warp / 2) * 32;
    const int n0 = blockIdx.y * BM, oc0 = blockIdx.x * BM;
    float acc[2][4][4] = {};
    for (int c0 = 0; c0 < C; c0 += BK) {
#pragma unroll
        for (int i = 0; i < 4; i++) {  // 64 rows x 8 float4 per tile = 512 float4 / 128 threads
            const int e = tid + i * 128, r = e / 8, c = (e % 8) * 4;
            float4 xv = make_float4(0.f, 0.f, 0.f, 0.f), wv = xv;
            if (n0 + r < N && c0 + c < C) xv = load4(inp + (ll)(n0 + r) * C + c0 + c);
            if (oc0 + r < OC && c0 + c < C) wv = load4(weight + (ll)(oc0 + r) * C + c0 + c);
            *reinterpret_cast<uint4*>(&xs[r][c]) =
                make_uint4(tf32_round(xv.x), tf32_round(xv.y), tf32_round(xv.z), tf32_round(xv.w));
            *reinterpret_cast<uint4*>(&ws[r][c]) =
                make_uint4(tf32_round(wv.x), tf32_round(wv.y), tf32_round(wv.z), tf32_round(wv.w));
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 8) {
            uint32_t af[2][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                const int r = wm + mi * 16 + g;
                af[mi][0] = xs[r][kk + t];
                af[mi][1] = xs[r + 8][kk + t];
                af[mi][2] = xs[r][kk + t + 4];
                af[mi][3] = xs[r + 8][kk + t + 4];
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                bf[ni][0] = ws[wn + ni * 8 + g][kk + t];
                bf[ni][1] = ws[wn + ni * 8 + g][kk + t + 4];
            }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_tf32(acc[mi][ni], af[mi], bf[ni]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int h = 0; h < 2; h++) {  // h = 0: row g, cols 2t, 2t+1; h = 1: row g+8
                const int n = n0 + wm + mi * 16 + g + h * 8, oc = oc0 + wn + ni * 8 + 2 * t;
                if (n >= N) continue;
#pragma unroll
                for (int j = 0; j < 2; j++)
                    if (oc + j < OC)
                        out[(ll)n * OC + oc + j] = acc[mi][ni][h * 2 + j] + (bias ? bias[oc + j] : 0.0f);
            }
}

// ----------------------------------------------------------------------------------------------
// matmul_backward_bias

// version 1: thread oc sums column oc over all N rows. A warp reads 32 consecutive floats of a row
// per step (coalesced), but there are only OC threads in flight (768: 6 blocks on a 132-SM GPU).
extern "C" __global__ void matmul_backward_bias_kernel1(float* dbias, const float* dout, int N, int OC) {
    LLMC_PDL_WAIT();
    const int oc = blockIdx.x * blockDim.x + threadIdx.x;
    if (oc >= OC) return;
    float s = 0.0f;
    for (int n = 0; n < N; n++) s += dout[(ll)n * OC + oc];
    dbias[oc] += s;
}

// version 2, pass 1: block (32, 8) owns 32 columns of one chunk of rows; the 8 row-lanes stride
// through the chunk (each warp load: 32 consecutive floats), then a shared-memory sum over the
// row-lanes in fixed order. partial(nchunks, OC) = per-chunk column sums.
// Memory: reads N*OC floats once, writes nchunks*OC.
extern "C" __global__ void matmul_backward_bias_kernel2(float* partial, const float* dout, int N, int OC,
                                                        int rows_per_chunk) {
    LLMC_PDL_WAIT();
    __shared__ float sh[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int oc = blockIdx.x * 32 + tx;
    const int r0 = blockIdx.y * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float s = 0.0f;
    if (oc < OC)
        for (int n = r0 + ty; n < r1; n += 8) s += dout[(ll)n * OC + oc];
    sh[ty][tx] = s;
    __syncthreads();
    if (ty == 0 && oc < OC) {
#pragma unroll
        for (int k = 1; k < 8; k++) s += sh[k][tx];
        partial[(ll)blockIdx.y * OC + oc] = s;
    }
}
// version 2, pass 2: dbias[oc] += sum of the nchunks partials, in chunk order (deterministic)
extern "C" __global__ void matmul_backward_bias_kernel2_finish(float* dbias, const float* partial, int nchunks,
                                                               int OC) {
    LLMC_PDL_WAIT();
    const int oc = blockIdx.x * blockDim.x + threadIdx.x;
    if (oc >= OC) return;
    float s = 0.0f;
    for (int k = 0; k < nchunks; k++) s += partial[(ll)k * OC + oc];
    dbias[oc] += s;
}

// the 8 row-lanes' float4 column sums of the block, added up in lane order into the ty == 0 threads'
// return value (the other threads return garbage); sh is the block's (8, 32) float4 scratch
__device__ __forceinline__ float4 bias_reduce_rows(float4 s, float4 (*sh)[32], int tx, int ty) {
    sh[ty][tx] = s;
    __syncthreads();
    if (ty == 0) {
#pragma unroll
        for (int k = 1; k < 8; k++) {
            const float4 v = sh[k][tx];
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
    }
    return s;
}

// version 3 and 4's first pass: thread (tx, ty) of block (bx, by) sums rows ty, ty+8, ... of chunk
// by for columns 4(32 bx + tx) .. +3, and the block's column sums go to partial row by
__device__ __forceinline__ void bias_chunk_partial(float* partial, const float* dout, int N, int OC,
                                                   int rows_per_chunk, float4 (*sh)[32]) {
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = (blockIdx.x * 32 + tx) * 4;
    const int r0 = blockIdx.y * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (col < OC) {
#pragma unroll 4
        for (int n = r0 + ty; n < r1; n += 8) {
            const float4 v = load4(dout + (ll)n * OC + col);
            s.x += v.x; s.y += v.y; s.z += v.z; s.w += v.w;
        }
    }
    s = bias_reduce_rows(s, sh, tx, ty);
    if (ty == 0 && col < OC) store4(partial + (ll)blockIdx.y * OC + col, s);
}

// version 3, pass 1: like version 2 but each lane owns 4 adjacent columns (float4 loads, OC % 4 == 0):
// a warp reads 512 contiguous bytes per row, and 4 rows per thread are in flight at once (unrolled).
// Same fixed-order partials and finishing pass (deterministic). Memory: reads N*OC floats once.
extern "C" __global__ void matmul_backward_bias_kernel3(float* partial, const float* dout, int N, int OC,
                                                        int rows_per_chunk) {
    LLMC_PDL_WAIT();
    __shared__ float4 sh[8][32];
    bias_chunk_partial(partial, dout, N, OC, rows_per_chunk, sh);
}

// version 4's bf16 rows: BIAS4_ROWS_BATCH rows at a time per thread, their loads issued before the first
// add (the adds in row order: the same bits as one row at a time). Its pragma-unrolled loop had ptxas add
// each row before loading the next, and read each row as four 4-byte loads. H200 lab (session 31), bf16,
// N = 4096, OC = 768 / 2304 / 3072: 0.0114 / 0.0142 / 0.0161 ms batched by 4 against 0.0112 / 0.0148 /
// 0.0172 one row at a time (--define matmul:BIAS4_ROWS_BATCH=1). The finishing block's partials batched
// the same way (8 chunks' loads, then their adds) were slower than one at a time (0.0114 / 0.0142 /
// 0.0161 against 0.0104 / 0.0137 / 0.0160).
//
// The finishing block reads the partials with plain loads. They were ld.global.cg (__ldcg: L2 only),
// which ptxas issues as strong loads (LDG.E.128.STRONG.GPU) and keeps fewer of in flight: 0.0111 /
// 0.0139 / 0.0159 ms against 0.0097 / 0.0130 / 0.0150 (bf16, chunks of >= 128 rows, session 31). Plain
// loads see the other blocks' partials by the memory model: each block's stores, then its fence, then its
// ticket (a release); the last block's ticket read, then its fence (an acquire), then the loads.
#ifndef BIAS4_ROWS_BATCH
#define BIAS4_ROWS_BATCH 4
#endif

// version 4: version 3's pass and its finishing pass in one launch. Every block writes its partial
// (chunk blockIdx.y, its 128 columns), fences, and takes a ticket on the counter of its column block;
// the block that takes the last ticket sums the gridDim.y partials of those columns, thread (tx, ty)
// over chunks ty, ty+8, ... and then the 8 row-lanes in order (a fixed order: deterministic), adds
// them into dbias and resets the counter (zeroed once at build, so CUDA-graph replays work). Saves
// the second launch and its serial walk over the chunks.
extern "C" __global__ void matmul_backward_bias_kernel4(float* dbias, float* partial, unsigned int* counters,
                                                        const float* dout, int N, int OC, int rows_per_chunk) {
    LLMC_PDL_WAIT();
    __shared__ float4 sh[8][32];
    __shared__ bool is_last;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = (blockIdx.x * 32 + tx) * 4;
    bias_chunk_partial(partial, dout, N, OC, rows_per_chunk, sh);
    if (!last_block_ticket(counters, is_last)) return;
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
    if (col < OC) {
        for (int k = ty; k < (int)gridDim.y; k += 8) {
            const float4 v = load4(partial + (ll)k * OC + col);
            t.x += v.x; t.y += v.y; t.z += v.z; t.w += v.w;
        }
    }
    t = bias_reduce_rows(t, sh, tx, ty);
    if (ty == 0 && col < OC) {
        float4 d = load4(dbias + col);
        d.x += t.x; d.y += t.y; d.z += t.z; d.w += t.w;
        store4(dbias + col, d);
    }
    if (tx == 0 && ty == 0) counters[blockIdx.x] = 0u;
}

// version 4, bf16 build: dbias bf16 (OC) += column sums of dout bf16 (N,OC). Each lane owns 8 adjacent
// columns (one 16-byte load per row, OC % 8 == 0), so a block covers 256 columns; sums, partials
// (nchunks, OC) and the fixed-order finish in fp32 as in the fp32 build (deterministic), then dbias is
// read, the total added in fp32, and rounded once on the store.
extern "C" __global__ void matmul_backward_bias_kernel4_bf16(__nv_bfloat16* dbias, float* partial, unsigned int* counters,
                                                             const __nv_bfloat16* dout, int N, int OC, int rows_per_chunk) {
    LLMC_PDL_WAIT();
    __shared__ float4 sh[2][8][32];
    __shared__ bool is_last;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int col = (blockIdx.x * 32 + tx) * 8;
    const int r0 = blockIdx.y * rows_per_chunk, r1 = min(N, r0 + rows_per_chunk);
    float4 s0 = make_float4(0.f, 0.f, 0.f, 0.f), s1 = s0;
    if (col < OC) {
        // BIAS4_ROWS_BATCH rows at a time (above), then the chunk's last rows one at a time. Each row is
        // loaded into a register copy: bf16x8_to_float takes a reference, and handed the global word
        // itself it read it as four 4-byte loads (LDG.E, not LDG.E.128).
        constexpr int R = BIAS4_ROWS_BATCH;
        auto add_row = [&](const uint4& raw) {
            float2 f[4];
            bf16x8_to_float(raw, f);
            s0.x += f[0].x; s0.y += f[0].y; s0.z += f[1].x; s0.w += f[1].y;
            s1.x += f[2].x; s1.y += f[2].y; s1.z += f[3].x; s1.w += f[3].y;
        };
        int n = r0 + ty;
        for (; n + 8 * (R - 1) < r1; n += 8 * R) {
            uint4 raw[R];
#pragma unroll
            for (int r = 0; r < R; r++) raw[r] = *reinterpret_cast<const uint4*>(dout + (ll)(n + 8 * r) * OC + col);
#pragma unroll
            for (int r = 0; r < R; r++) add_row(raw[r]);
        }
        for (; n < r1; n += 8) {
            const uint4 raw = *reinterpret_cast<const uint4*>(dout + (ll)n * OC + col);
            add_row(raw);
        }
    }
    s0 = bias_reduce_rows(s0, sh[0], tx, ty);
    s1 = bias_reduce_rows(s1, sh[1], tx, ty);
    if (ty == 0 && col < OC) {
        store4(partial + (ll)blockIdx.y * OC + col, s0);
        store4(partial + (ll)blockIdx.y * OC + col + 4, s1);
    }
    if (!last_block_ticket(counters, is_last)) return;
    float4 t0 = make_float4(0.f, 0.f, 0.f, 0.f), t1 = t0;
    if (col < OC) {
        for (int k = ty; k < (int)gridDim.y; k += 8) {
            const float4 v0 = load4(partial + (ll)k * OC + col);
            const float4 v1 = load4(partial + (ll)k * OC + col + 4);
            t0.x += v0.x; t0.y += v0.y; t0.z += v0.z; t0.w += v0.w;
            t1.x += v1.x; t1.y += v1.y; t1.z += v1.z; t1.w += v1.w;
        }
    }
    t0 = bias_reduce_rows(t0, sh[0], tx, ty);
    t1 = bias_reduce_rows(t1, sh[1], tx, ty);
    if (ty == 0 && col < OC) {
        uint4 raw = *reinterpret_cast<const uint4*>(dbias + col);
        float2 d[4];
        bf16x8_to_float(raw, d);
        const float add[8] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w};
        __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; i++) h[i] = __floats2bfloat162_rn(d[i].x + add[2 * i], d[i].y + add[2 * i + 1]);
        *reinterpret_cast<uint4*>(dbias + col) = raw;
    }
    if (tx == 0 && ty == 0) counters[blockIdx.x] = 0u;
}

// version 5 (sm_90: thread-block clusters): no partials in global memory, no counters, no second
// pass. A cluster of 8 blocks owns a slice of W columns; block rank r sums rows [r N/8, (r+1) N/8)
// of it. A block is 256 threads: LX column lanes (16 bytes each: W = LX * V columns) x 256/LX row
// lanes, 8 loads in flight per thread. The row lanes of a warp are added by shuffles (a fixed
// butterfly), the 8 warps in order through shared memory; then rank 0 reads the other blocks' W
// sums through distributed shared memory (mapa + ld.shared::cluster) and adds them in rank order
// (deterministic), into dbias (read at the start), rounded once. A second cluster barrier keeps every
// block's shared memory alive until rank 0 has read it. What it saves against version 4: the partials' write, the
// fence, the ticket and the finishing block's walk over ~128 chunk partials (a few microseconds of
// latency on a kernel that moves 6-25 MB). LX = 8 (W = 64 bf16 / 32 fp32 columns) by default; LX = 4
// (64-byte row segments, twice the blocks) was never faster in the lab, narrow OC included.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BIAS5_CLUSTER 8

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cluster_barrier() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// a float of block `rank`'s shared memory at the address of `p` in this block's
__device__ __forceinline__ float ld_cluster_f32(const float* p, unsigned rank) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), ra;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(ra) : "memory");
    return v;
}

template <typename T, int LX>
__device__ __forceinline__ void bias_cluster_sums(T* dbias, const T* __restrict__ dout, int N, int OC) {
    constexpr int V = Vec16<T>::N, W = LX * V, RL = 256 / LX, NWARP = 8;
    __shared__ float wsum[NWARP][W];
    __shared__ float bsum[W];
    const int tid = threadIdx.x, lx = tid % LX, ly = tid / LX, lane = tid % 32, warp = tid / 32;
    const int col = blockIdx.x * W + lx * V;
    const int rank = (int)cluster_rank();
    const int rows = (N + BIAS5_CLUSTER - 1) / BIAS5_CLUSTER;
    const int r0 = rank * rows, r1 = min(N, r0 + rows);
    // rank 0's dbias read before the rows, so its round trip is not the last thing the cluster waits for
    const int c_out = blockIdx.x * W + tid;
    const bool writer = rank == 0 && tid < W && c_out < OC;
    const float db = writer ? to_f32(dbias[c_out]) : 0.0f;
    float s[V];
#pragma unroll
    for (int k = 0; k < V; k++) s[k] = 0.0f;
    if (col < OC) {
        for (int n = r0 + ly; n < r1; n += 8 * RL) {  // 8 loads issued, then added in row order
            typename Vec16<T>::raw v[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (n + j * RL < r1) v[j] = Vec16<T>::ld(dout + (ll)(n + j * RL) * OC + col);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (n + j * RL < r1) {
                    float f[V];
                    Vec16<T>::unpack(f, v[j]);
#pragma unroll
                    for (int k = 0; k < V; k++) s[k] += f[k];
                }
            }
        }
    }
#pragma unroll
    for (int off = LX; off < 32; off *= 2) {
#pragma unroll
        for (int k = 0; k < V; k++) s[k] += __shfl_xor_sync(0xffffffffu, s[k], off);
    }
    if (lane < LX) {
#pragma unroll
        for (int k = 0; k < V; k++) wsum[warp][lx * V + k] = s[k];
    }
    __syncthreads();
    if (tid < W) {
        float t = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARP; w++) t += wsum[w][tid];
        bsum[tid] = t;
    }
    cluster_barrier();  // every block's bsum written and visible to the cluster
    if (writer) {
        float t = 0.0f;
#pragma unroll
        for (int r = 0; r < BIAS5_CLUSTER; r++) t += ld_cluster_f32(&bsum[tid], (unsigned)r);
        dbias[c_out] = from_f32<T>(db + t);
    }
    cluster_barrier();  // no block leaves (freeing its shared memory) before rank 0 has read it
}

#define BIAS5_ENTRY(NAME, T, LX)                                                                         \
    extern "C" __global__ void __cluster_dims__(1, BIAS5_CLUSTER, 1) __launch_bounds__(256)             \
    NAME(T* dbias, const T* dout, int N, int OC) {                                                      \
        LLMC_PDL_WAIT();                                                                                \
        bias_cluster_sums<T, LX>(dbias, dout, N, OC);                                                   \
    }
BIAS5_ENTRY(matmul_backward_bias_kernel5_l4, float, 4)
BIAS5_ENTRY(matmul_backward_bias_kernel5_l8, float, 8)
BIAS5_ENTRY(matmul_backward_bias_kernel5_l4_bf16, bf16, 4)
BIAS5_ENTRY(matmul_backward_bias_kernel5_l8_bf16, bf16, 8)
#endif
