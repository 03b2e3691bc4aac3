// Matmul family: the forward/backward matmuls of GPT-2 and a general strided-batched GEMM engine
// (used by the matmul ops here and by attention). Everything is fp32 in memory, row-major.
//
// GEMM engines (llmc/ops/matmul.py: gemm_build, GEMM_VARIANTS):
//   gemm engine 1: SIMT fp32, 64x64x16 tiles, 4x4 outputs per thread, scalar predicated loads: any shape, any alignment
//
// Layout names: the first letter says how A is stored, the second B. N = as used ("not transposed"),
// T = stored transposed. C[b](M,N) = alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias[n]):
//   A: N -> (M,K) row-major, leading dim lda >= K;  T -> stored (K,M), lda >= M
//   B: N -> (K,N) row-major, leading dim ldb >= N;  T -> stored (N,K), ldb >= K
// beta == 0 never reads C (C may hold garbage/NaN), bias may be NULL.
#include "common.cuh"

// ----------------------------------------------------------------------------------------------
// gemm engine 1: SIMT, any shape, any alignment

// Each block computes a 64x64 tile of C with 256 threads (16x16), 4x4 outputs per thread.
// A and B tiles are staged in shared memory as As[k][m], Bs[k][n], so the inner loop reads
// 4 consecutive m (or n) as one float4. Global loads are scalar and predicated, with the thread
// order chosen so that consecutive threads read consecutive addresses in either layout.
template <bool TA, bool TB>
__device__ __forceinline__ void gemm_simt_body(float* C, const float* A, const float* B,
                                               const float* bias, int M, int N, int K,
                                               int lda, int ldb, int ldc,
                                               long long sA, long long sB, long long sC,
                                               float alpha, float beta) {
    constexpr int BM = 64, BN = 64, BK = 16, NT = 256;
    __shared__ __align__(16) float As[BK][BM];
    __shared__ __align__(16) float Bs[BK][BN];
    A += blockIdx.z * sA;
    B += blockIdx.z * sB;
    C += blockIdx.z * sC;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
        for (int i = 0; i < BM * BK / NT; i++) {
            const int e = tid + i * NT;
            // consecutive threads walk the contiguous dimension of the stored matrix
            const int m = TA ? e % BM : e / BK;
            const int k = TA ? e / BM : e % BK;
            const int gm = m0 + m, gk = k0 + k;
            float v = 0.0f;
            if (gm < M && gk < K) v = TA ? A[(long long)gk * lda + gm] : A[(long long)gm * lda + gk];
            As[k][m] = v;
        }
#pragma unroll
        for (int i = 0; i < BN * BK / NT; i++) {
            const int e = tid + i * NT;
            const int n = TB ? e / BK : e % BN;
            const int k = TB ? e % BK : e / BN;
            const int gn = n0 + n, gk = k0 + k;
            float v = 0.0f;
            if (gn < N && gk < K) v = TB ? B[(long long)gn * ldb + gk] : B[(long long)gk * ldb + gn];
            Bs[k][n] = v;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; k++) {
            const float4 a = *reinterpret_cast<const float4*>(&As[k][ty * 4]);
            const float4 b = *reinterpret_cast<const float4*>(&Bs[k][tx * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int gm = m0 + ty * 4 + i;
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int gn = n0 + tx * 4 + j;
            if (gn >= N) continue;
            float v = alpha * acc[i][j];
            if (beta != 0.0f) v += beta * C[(long long)gm * ldc + gn];
            if (bias) v += bias[gn];
            C[(long long)gm * ldc + gn] = v;
        }
    }
}

#define GEMM_SIMT_ENTRY(name, TA, TB)                                                               \
    extern "C" __global__ void __launch_bounds__(256) name(                                         \
        float* C, const float* A, const float* B, const float* bias, int M, int N, int K, int lda,  \
        int ldb, int ldc, long long sA, long long sB, long long sC, float alpha, float beta) {      \
        gemm_simt_body<TA, TB>(C, A, B, bias, M, N, K, lda, ldb, ldc, sA, sB, sC, alpha, beta);     \
    }
GEMM_SIMT_ENTRY(gemm_simt_nn, false, false)
GEMM_SIMT_ENTRY(gemm_simt_nt, false, true)
GEMM_SIMT_ENTRY(gemm_simt_tn, true, false)
GEMM_SIMT_ENTRY(gemm_simt_tt, true, true)
