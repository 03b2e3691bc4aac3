// GEMM engines: the strided-batched GEMM library that every matmul-shaped product runs on
// (matmul_forward 6 and 7, matmul_backward, the composite attention's batched products). Not an op
// of its own: the ops that use it declare which engine (Variant.engine). Everything is fp32 in
// memory, row-major. Python side: llmc/ops/gemm.py (gemm_build, ENGINES, the TF32 planner).
//
// The engines (llmc/ops/gemm.py: ENGINES):
//   engine 1: SIMT fp32, 64x64x16 tiles, 4x4 outputs per thread, scalar predicated loads: any shape, any alignment
//   engine 2: TF32 mma.sync, 16-byte cp.async (leading dims, batch strides % 4 == 0, 16-byte aligned pointers)
//   engine 3: engine 2 with 4-byte cp.async: any shape and alignment (the TF32 fallback)
//   engine 4: engine 2 with K-major fragments through ldmatrix.x4 and a leaner cp.async loader: ~2.9
//             instead of 3.8-4.7 SASS instructions per HMMA in the main loop; same needs as engine 2
//
// Layout names: the first letter says how A is stored, the second B. n = as used ("not transposed"),
// t = stored transposed. C[b](M,N) = alpha * op(A[b]) @ op(B[b]) + beta * C[b] (+ bias[n]):
//   A: n -> (M,K) row-major, leading dim lda >= K;  t -> stored (K,M), lda >= M
//   B: n -> (K,N) row-major, leading dim ldb >= N;  t -> stored (N,K), ldb >= K
// beta == 0 never reads C (C may hold garbage/NaN); bias may be NULL.
//
// TF32 numerics: inputs are rounded to tf32 (10-bit mantissa) round-to-nearest, ties away from zero,
// by adding 0x1000 to the bit pattern (the tensor core ignores the low 13 bits). That is what
// cvt.rna.tf32.f32 computes for finite inputs, in one integer add instead of cvt's three
// instructions (cvt also guards inf/NaN; here an inf input becomes a NaN, which is just as loud).
// Accumulation is fp32. Everything compiles for sm_80 and sm_90 (mma.sync, cp.async); no wgmma.

#include "common.cuh"
#include "mma.cuh"

typedef long long ll;

// ----------------------------------------------------------------------------------------------
// gemm engine 1: SIMT, any shape, any alignment (also matmul_backward version 1)

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
        int ldb, int ldc, long long sA, long long sB, long long sC, float alpha, float beta) { LLMC_PDL_WAIT();      \
        gemm_simt_body<TA, TB>(C, A, B, bias, M, N, K, lda, ldb, ldc, sA, sB, sC, alpha, beta);     \
    }
GEMM_SIMT_ENTRY(gemm_simt_nn, false, false)
GEMM_SIMT_ENTRY(gemm_simt_nt, false, true)
GEMM_SIMT_ENTRY(gemm_simt_tn, true, false)
GEMM_SIMT_ENTRY(gemm_simt_tt, true, true)

// ----------------------------------------------------------------------------------------------
// gemm engines 2 and 3: TF32 tensor cores, cp.async multi-stage pipeline

// How the mma fragments map onto the tile (the trick that makes the shared-memory reads wide).
// An mma only needs A and B to agree on which k each fragment register holds, and the epilogue to
// agree with A/B on which row/column each accumulator is. So we choose the mapping for the loads:
//  - k: in k-step j (0..3) of a 32-wide k-tile, mma k-index t (t = lane%4) is tile k
//    pi = 4j + 16(t>>1) + 2(t&1), and k-index t+4 is pi+1: each lane's two k are adjacent.
//  - rows: mma row g (+8h) of m-tile mi is tile row wm + g*RPG_A + 2mi + h (RPG_A = 2*MI): each
//    lane owns RPG_A consecutive rows; columns: mma col g of n-tile ni is wn + g*NI + ni.
// Then a K-major fragment pair (a0,a2), (a1,a3), (b0,b1) is one 8-byte load (LDS.64), and an MN-major
// fragment set is RPG/4 16-byte loads per k (LDS.128). Each lane's accumulators cover RPG_A
// consecutive rows x 2*NI consecutive columns: the epilogue stores float4s with no shuffles.
//
// Shared-memory tiles hold a BK=32 slice of K, in whichever layout matches global memory so that
// cp.async copies 16-byte chunks straight through, swizzled so that every read and write is
// bank-conflict-free (checked exhaustively by a Python model of these formulas, docs/matmul_notes.md):
//  K-major  (A stored (M,K), B stored (N,K)): R rows of 32 floats; chunk c (4 floats) of row r lives
//           at chunk position c ^ ((r / RPG) & 7).
//  MN-major (A stored (K,M), B stored (K,N)): 32 k-rows of R floats; chunk c of k-row k lives at
//           c ^ f(u(k)), u(k) = ((k>>1)&1) | ((k>>3)&2) (= the t of the lanes reading row k),
//           f(u) = 2u if RPG == 4, else (u&1) | ((u&2)<<1).

__device__ __forceinline__ int kstep_k(int j, int t) { return 4 * j + 16 * (t >> 1) + 2 * (t & 1); }
template <int RPG>
__device__ __forceinline__ int kmajor_off(int r, int k) {
    return r * 32 + ((((k >> 2) ^ ((r / RPG) & 7))) << 2) + (k & 3);
}
template <int R, int RPG>
__device__ __forceinline__ int mnmajor_off(int k, int col) {
    const int u = ((k >> 1) & 1) | ((k >> 3) & 2);
    const int f = RPG == 4 ? 2 * u : (u & 1) | ((u & 2) << 1);
    return k * R + ((((col >> 2) ^ f)) << 2) + (col & 3);
}

// Global -> shared copies of one operand's k-tiles. Everything that depends only on the thread (its
// chunks' rows/columns, predicates, base pointer) is computed once; per k-tile only k moves.
//  K-major (16-byte):  chunk e = tid + i*NT covers stored row e/8, k-chunk e%8 (= tid%8 for all i).
//  MN-major (16-byte): chunk e covers k-row e/CPR, column chunk e%CPR (= tid%CPR for all i).
// A chunk past the matrix edge copies fewer bytes (zero-filling the rest of the 16); with 0 bytes
// cp.async reads nothing, so its (out-of-range) source address is never dereferenced.
// VEC == 1 (engine 3) copies single floats with 4-byte cp.async instead: any alignment.
template <bool KMAJOR, int R, int NT, int RPG, int VEC>
struct TileLoader {
    static constexpr int CPR = KMAJOR ? 8 : R / 4;     // 16-byte chunks per stored row
    static constexpr int PER = R * 8 / NT;              // chunks per thread per k-tile
    static constexpr int RSTEP = NT / CPR;              // stored rows between a thread's chunks
    static_assert(VEC == 1 || ((R * 8) % NT == 0 && NT % CPR == 0), "tile chunks must divide over the threads");
    const float* gp;   // this thread's first chunk at k = 0 (VEC == 4) / the matrix (VEC == 1)
    ll ld;
    int r0, c, edge;   // first stored row, chunk column; K-major: valid-row mask; MN-major: column bytes
    int rc0, rcs;      // VEC == 1: tile origin and extent in the M (or N) direction

    __device__ __forceinline__ TileLoader(const float* g, int ld_, int rc0_, int rcs_, int tid)
        : ld(ld_), rc0(rc0_), rcs(rcs_) {
        if (VEC == 4) {
            r0 = tid / CPR;
            c = tid % CPR;
            if (KMAJOR) {
                gp = g + (ll)(rc0 + r0) * ld + 4 * c;
                edge = 0;
#pragma unroll
                for (int i = 0; i < PER; i++) edge |= (rc0 + r0 + i * RSTEP < rcs) << i;
            } else {
                gp = g + (ll)r0 * ld + rc0 + 4 * c;
                edge = 4 * max(0, min(4, rcs - (rc0 + 4 * c)));
            }
        } else {
            gp = g;
        }
    }

    __device__ __forceinline__ void load(float* s, int k0, int K, int tid) const {
        if (VEC == 4) {
            if (KMAJOR) {
                const int kbytes = 4 * max(0, min(4, K - (k0 + 4 * c)));
                const float* p = gp + k0;
#pragma unroll
                for (int i = 0; i < PER; i++) {
                    const int r = r0 + i * RSTEP;
                    cp_async16(smem_u32(s + kmajor_off<RPG>(r, 4 * c)), p + i * RSTEP * ld,
                               (edge >> i) & 1 ? kbytes : 0);
                }
            } else {
                const float* p = gp + k0 * ld;
#pragma unroll
                for (int i = 0; i < PER; i++) {
                    const int k = r0 + i * RSTEP;
                    cp_async16(smem_u32(s + mnmajor_off<R, RPG>(k, 4 * c)), p + i * RSTEP * ld,
                               k0 + k < K ? edge : 0);
                }
            }
        } else {
#pragma unroll 4
            for (int i = 0; i < R * 32 / NT; i++) {
                const int e = tid + i * NT;
                // consecutive threads take consecutive addresses of the stored matrix
                const int r = KMAJOR ? e >> 5 : e % R, k = KMAJOR ? e & 31 : e / R;
                const int gr = rc0 + r, gk = k0 + k;
                const bool in = gr < rcs && gk < K;
                const float* src = gp + (KMAJOR ? (ll)gr * ld + gk : (ll)gk * ld + gr);
                cp_async4(smem_u32(s + (KMAJOR ? kmajor_off<RPG>(r, k) : mnmajor_off<R, RPG>(k, r))), src, in ? 4 : 0);
            }
        }
    }
};

// One CTA computes a BM x BN tile of C; warps tile it in WM x WN pieces (MI x NI mma tiles each).
// Pipeline: STAGES-1 k-tiles in flight while the tensor cores work on the oldest; one barrier per
// k-tile. blockIdx.x walks M (fastest), so consecutive CTAs share a B tile (the weights, usually the
// larger operand) and the A panel stays hot in L2. blockIdx.z = batch * splits + split: with
// split-K (splits > 1) each CTA reduces its share of the k-tiles and writes raw partial sums to the
// workspace W[z](M, ldw); gemm_splitk_reduce then adds them in a fixed order (deterministic).
// The TF32 engines' epilogue (engines 2 and 4, float4 path). A lane's accumulators are RPGA rows x
// 2*NI columns spread 4 lanes apart, which as direct float4 stores leaves every 32-byte sector
// half-written per instruction. So each warp parks its WM x WN tile in (now idle) shared memory
// `stg`, then writes it back row by row: 32 lanes = whole 128-256 byte row segments per store.
// acc[mi][ni][2h + c] is C at warp-tile row g*RPGA + 2mi + h, column (2t + c)*NI + ni; chunk ch
// (4 floats) of staged row `row` sits at (ch & ~7) | ((ch & 7) ^ hh), hh = ((row / RPGA) & 1) |
// (((ch >> 3) & 1) << 1), which makes both the fragment-order writes and the row-order reads
// conflict-free (checked by tests/test_matmul_layout.py). row0, col0: the warp tile's origin in C.
// With splits > 1 the raw partial sums go to the split-K workspace W instead.
template <int WM, int WN>
__device__ __forceinline__ void gemm_store_staged(float (&acc)[WM / 16][WN / 8][4], float* stg, float* C,
                                              const float* bias, float* W, int M, int N, int ldc, float alpha,
                                              float beta, int splits, int ldw, int z, int row0, int col0, int lane) {
    constexpr int MI = WM / 16, NI = WN / 8, RPGA = 2 * MI;
    const int g = lane >> 2, t = lane & 3;
    auto stage_off = [](int row, int col) {
        const int ch = col >> 2;
        const int hh = ((row / RPGA) & 1) | (((ch >> 3) & 1) << 1);
        return row * WN + (((ch & ~7) | ((ch & 7) ^ hh)) << 2) + (col & 3);
    };
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int c = 0; c < 2; c++)
#pragma unroll
                for (int q = 0; q < NI / 4; q++) {
                    const int row = g * RPGA + 2 * mi + h, col = (2 * t + c) * NI + 4 * q;
                    *reinterpret_cast<float4*>(stg + stage_off(row, col)) =
                        make_float4(acc[mi][4 * q][2 * h + c], acc[mi][4 * q + 1][2 * h + c],
                                    acc[mi][4 * q + 2][2 * h + c], acc[mi][4 * q + 3][2 * h + c]);
                }
    __syncwarp();
    constexpr int CPR = WN / 4, RPI = 32 / CPR;  // 4-float chunks per row, rows per instruction
    const int ch = lane % CPR, r0 = lane / CPR;
    const int col = col0 + 4 * ch;
    float bv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (bias && splits == 1) {
#pragma unroll
        for (int e = 0; e < 4; e++) bv[e] = col + e < N ? bias[col + e] : 0.0f;
    }
#pragma unroll 4
    for (int i = 0; i < WM / RPI; i++) {
        const int rl = r0 + i * RPI, row = row0 + rl;
        if (row >= M || col >= N) continue;
        const float4 v = *reinterpret_cast<const float4*>(stg + stage_off(rl, 4 * ch));
        if (splits > 1) {  // raw partial sums; ldw % 4 == 0 so the float4 stays in the row
            *reinterpret_cast<float4*>(W + ((ll)z * M + row) * ldw + col) = v;
            continue;
        }
        float o[4] = {alpha * v.x, alpha * v.y, alpha * v.z, alpha * v.w};
        float* cp = C + (ll)row * ldc + col;
        if (col + 4 <= N) {
            if (beta != 0.0f) {
                const float4 c4 = *reinterpret_cast<const float4*>(cp);
                o[0] += beta * c4.x; o[1] += beta * c4.y; o[2] += beta * c4.z; o[3] += beta * c4.w;
            }
            *reinterpret_cast<float4*>(cp) = make_float4(o[0] + bv[0], o[1] + bv[1], o[2] + bv[2], o[3] + bv[3]);
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (col + e >= N) break;
                float x = o[e] + bv[e];
                if (beta != 0.0f) x += beta * cp[e];
                cp[e] = x;
            }
        }
    }
}

// The mma accumulators, zeroed element by element (`= {}` instead changes the SASS of some tn kernels).
template <int MI, int NI>
__device__ __forceinline__ void zero_acc(float (&acc)[MI][NI][4]) {
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int r = 0; r < 4; r++) acc[i][j][r] = 0.0f;
}

template <bool TA, bool TB, int BM, int BN, int WM, int WN, int STAGES, int VEC>
__device__ __forceinline__ void gemm_tf32_body(float* C, const float* A, const float* B, const float* bias,
                                               float* W, int M, int N, int K, int lda, int ldb, int ldc,
                                               ll sA, ll sB, ll sC, float alpha, float beta, int splits,
                                               int kt_per_split, int ldw) {
    constexpr int BK = 32, WARPS_M = BM / WM, WARPS_N = BN / WN, NT = WARPS_M * WARPS_N * 32;
    constexpr int MI = WM / 16, NI = WN / 8, RPGA = 2 * MI, RPGB = NI;
    static_assert(NI % 4 == 0 && RPGA % 4 == 0, "warp tile too small for the float4 mapping");
    constexpr int A_TILE = BM * BK, B_TILE = BN * BK;
    extern __shared__ __align__(16) float smem[];
    float* As = smem;                     // (STAGES, A_TILE)
    float* Bs = smem + STAGES * A_TILE;   // (STAGES, B_TILE)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = (warp % WARPS_M) * WM, wn = (warp / WARPS_M) * WN;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int z = blockIdx.z, b = z / splits, split = z % splits;
    A += b * sA;
    B += b * sB;
    C += b * sC;
    const int KT = (K + BK - 1) / BK;
    const int kt0 = split * kt_per_split;
    const int nkt = max(0, min(KT, kt0 + kt_per_split) - kt0);

    const TileLoader<!TA, BM, NT, RPGA, VEC> loadA(A, lda, m0, M, tid);
    const TileLoader<TB, BN, NT, RPGB, VEC> loadB(B, ldb, n0, N, tid);
    auto load_stage = [&](int stage, int kt) {
        loadA.load(As + stage * A_TILE, kt * BK, K, tid);
        loadB.load(Bs + stage * B_TILE, kt * BK, K, tid);
    };

    float acc[MI][NI][4];
    zero_acc(acc);

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nkt) load_stage(s, kt0 + s);
        cp_async_commit();
    }

    // Per-lane fragment offsets inside a stage. With the mapping above, the swizzles collapse to a
    // few per-lane constants plus compile-time immediates (the compiler does not see this itself):
    //  K-major row r = w + g*RPG + i, k = 4j + 16(t>>1) + 2(t&1):
    //     off = (w + g*RPG)*32 + 2(t&1) + (((j ^ g ^ 4(t>>1)) & 7) << 2) + 32i   (w/RPG % 8 == 0)
    //  MN-major k-row k + r, col w + g*RPG + 4q:
    //     off = (16(t>>1) + 2(t&1))*R + (4j + r)*R + ((cb ^ f(t) ^ q) << 2),  cb = (w + g*RPG)/4
    int offA[4], offB[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int gx = g ^ (4 * (t >> 1));
        offA[j] = TA ? (16 * (t >> 1) + 2 * (t & 1)) * BM +
                           (((((wm + g * RPGA) >> 2) ^ (RPGA == 4 ? 2 * t : (t & 1) | ((t & 2) << 1))) ^ j) << 2)
                     : (wm + g * RPGA) * 32 + 2 * (t & 1) + (((j ^ gx) & 7) << 2);
        offB[j] = !TB ? (16 * (t >> 1) + 2 * (t & 1)) * BN +
                            (((((wn + g * RPGB) >> 2) ^ (RPGB == 4 ? 2 * t : (t & 1) | ((t & 2) << 1))) ^ j) << 2)
                      : (wn + g * RPGB) * 32 + 2 * (t & 1) + (((j ^ gx) & 7) << 2);
    }
    // (for MN-major, offX[q] is the q-th 16-byte column chunk, q < RPG/4 <= 2; entries 2, 3 unused)

    int stage = 0;
    for (int i = 0; i < nkt; i++) {
        cp_async_wait<STAGES - 2>();   // k-tile i has landed (this thread's copies) ...
        __syncthreads();               // ... and everyone's; everyone is also done with tile i-1
        {
            const int nx = i + STAGES - 1;  // refill the stage that tile i-1 used
            if (nx < nkt) load_stage(stage == 0 ? STAGES - 1 : stage - 1, kt0 + nx);
            cp_async_commit();
        }
        const float* as = As + stage * A_TILE;
        const float* bs = Bs + stage * B_TILE;
        stage = stage == STAGES - 1 ? 0 : stage + 1;
#pragma unroll
        for (int j = 0; j < BK / 8; j++) {
            uint32_t af[MI][4], bf[NI][2];
            if (!TA) {  // K-major: (a0, a2) and (a1, a3) are adjacent k of one row
#pragma unroll
                for (int mi = 0; mi < MI; mi++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const float2 v = *reinterpret_cast<const float2*>(as + offA[j] + (2 * mi + h) * 32);
                        af[mi][h] = tf32_round(v.x);
                        af[mi][h + 2] = tf32_round(v.y);
                    }
            } else {    // MN-major: k-row k holds the lane's RPGA rows contiguously (a0/a1), k+1 (a2/a3)
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int q = 0; q < RPGA / 4; q++) {
                        const float4 v = *reinterpret_cast<const float4*>(as + offA[q] + (4 * j + r) * BM);
                        af[2 * q][2 * r] = tf32_round(v.x);
                        af[2 * q][2 * r + 1] = tf32_round(v.y);
                        af[2 * q + 1][2 * r] = tf32_round(v.z);
                        af[2 * q + 1][2 * r + 1] = tf32_round(v.w);
                    }
            }
            if (TB) {   // K-major: (b0, b1) adjacent
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    const float2 v = *reinterpret_cast<const float2*>(bs + offB[j] + ni * 32);
                    bf[ni][0] = tf32_round(v.x);
                    bf[ni][1] = tf32_round(v.y);
                }
            } else {    // MN-major: k-row k holds b0 of NI consecutive n-tiles, k+1 their b1
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int q = 0; q < NI / 4; q++) {
                        const float4 v = *reinterpret_cast<const float4*>(bs + offB[q] + (4 * j + r) * BN);
                        bf[4 * q][r] = tf32_round(v.x);
                        bf[4 * q + 1][r] = tf32_round(v.y);
                        bf[4 * q + 2][r] = tf32_round(v.z);
                        bf[4 * q + 3][r] = tf32_round(v.w);
                    }
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) mma_tf32(acc[mi][ni], af[mi], bf[ni]);
        }
    }
    cp_async_wait<0>();  // only empty groups can be left; keep the exit clean anyway

    if constexpr (VEC == 4) {
        static_assert(BM * BN <= STAGES * (A_TILE + B_TILE), "staging tile must fit in the pipeline smem");
        __syncthreads();  // everyone is done reading the last k-tile: its smem becomes the staging area
        gemm_store_staged<WM, WN>(acc, smem + warp * (WM * WN), C, bias, W, M, N, ldc, alpha, beta, splits, ldw, z,
                                  m0 + wm, n0 + wn, lane);
        return;
    }

    // Epilogue: acc[mi][ni][2h + c] is C at row wm + g*RPGA + 2mi + h, column wn + (2t + c)*NI + ni.
    // So for each of the lane's rows, columns wn + (2t + c)*NI + 4q .. +3 are acc[mi][4q..4q+3][2h+c]:
    // one float4 each.
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = m0 + wm + g * RPGA + 2 * mi + h;
            if (row >= M) continue;
#pragma unroll
            for (int c = 0; c < 2; c++)
#pragma unroll
                for (int q = 0; q < NI / 4; q++) {
                    const int col = n0 + wn + (2 * t + c) * NI + 4 * q;  // multiple of 4
                    if (col >= N) continue;
                    float o[4];
#pragma unroll
                    for (int e = 0; e < 4; e++) o[e] = acc[mi][4 * q + e][2 * h + c];
                    if (splits > 1) {  // raw partial sums; ldw % 4 == 0 so the float4 stays in the row
                        float* w = W + ((ll)z * M + row) * ldw + col;
                        if (VEC == 4) {
                            *reinterpret_cast<float4*>(w) = make_float4(o[0], o[1], o[2], o[3]);
                        } else {
#pragma unroll
                            for (int e = 0; e < 4; e++) w[e] = o[e];
                        }
                        continue;
                    }
                    float* cp = C + (ll)row * ldc + col;
                    if (VEC == 4 && col + 4 <= N) {
                        if (beta != 0.0f) {
                            const float4 c4 = *reinterpret_cast<const float4*>(cp);
                            o[0] = alpha * o[0] + beta * c4.x; o[1] = alpha * o[1] + beta * c4.y;
                            o[2] = alpha * o[2] + beta * c4.z; o[3] = alpha * o[3] + beta * c4.w;
                        } else {
#pragma unroll
                            for (int e = 0; e < 4; e++) o[e] *= alpha;
                        }
                        if (bias) {
#pragma unroll
                            for (int e = 0; e < 4; e++) o[e] += bias[col + e];
                        }
                        *reinterpret_cast<float4*>(cp) = make_float4(o[0], o[1], o[2], o[3]);
                    } else {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            if (col + e >= N) break;
                            float x = alpha * o[e];
                            if (beta != 0.0f) x += beta * cp[e];
                            if (bias) x += bias[col + e];
                            cp[e] = x;
                        }
                    }
                }
        }
}

// Tile configurations (block tile, warp tile, stages, min blocks/SM); the Python builder picks one
// per shape and passes the dynamic shared memory: STAGES * (BM + BN) * 32 * 4 bytes.
//   big:   128x256, 8 warps of 64x64, 3 stages (144 KB, 1 CTA/SM): large GEMMs (fc, lm head)
//   big4:  big with 4 stages (192 KB): one more k-tile in flight
//   mid:   128x128, 4 warps of 64x64, 3 stages (96 KB, 2 CTAs/SM): fewer tiles, better wave fill
//   mid8:  128x128, 8 warps of 64x32, 3 stages (96 KB, 2 CTAs/SM): twice the warps to hide latency
//   small: 64x64, 4 warps of 32x32, 3 stages (48 KB): small problems; also the VEC=1 engine 3
#define GEMM_TF32_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, VEC, lay, TA, TB)                              \
    extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)                    \
        gemm_tf32_##cfg##_v##VEC##_##lay(float* C, const float* A, const float* B, const float* bias, \
                                         float* W, int M, int N, int K, int lda, int ldb, int ldc,   \
                                         ll sA, ll sB, ll sC, float alpha, float beta, int splits,    \
                                         int kt_per_split, int ldw) { LLMC_PDL_WAIT();                \
        gemm_tf32_body<TA, TB, BM, BN, WM, WN, ST, VEC>(C, A, B, bias, W, M, N, K, lda, ldb, ldc, sA, \
                                                        sB, sC, alpha, beta, splits, kt_per_split,   \
                                                        ldw);                                         \
    }
#define GEMM_TF32_LAYOUTS(cfg, BM, BN, WM, WN, ST, MINB, VEC)                  \
    GEMM_TF32_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, VEC, nn, false, false)      \
    GEMM_TF32_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, VEC, nt, false, true)       \
    GEMM_TF32_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, VEC, tn, true, false)       \
    GEMM_TF32_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, VEC, tt, true, true)
GEMM_TF32_LAYOUTS(big, 128, 256, 64, 64, 3, 1, 4)
GEMM_TF32_LAYOUTS(big4, 128, 256, 64, 64, 4, 1, 4)
GEMM_TF32_LAYOUTS(mid, 128, 128, 64, 64, 3, 2, 4)
// mid8 in the tn layout needs more than the 128 registers that 2 CTAs/SM allow (it spilled): not built
GEMM_TF32_ENTRY(mid8, 128, 128, 64, 32, 3, 2, 4, nn, false, false)
GEMM_TF32_ENTRY(mid8, 128, 128, 64, 32, 3, 2, 4, nt, false, true)
GEMM_TF32_ENTRY(mid8, 128, 128, 64, 32, 3, 2, 4, tt, true, true)
GEMM_TF32_LAYOUTS(small, 64, 64, 32, 32, 3, 2, 4)
GEMM_TF32_LAYOUTS(small, 64, 64, 32, 32, 3, 2, 1)

// Split-K second pass: C[b] = alpha * sum_s W[b*splits + s] + beta * C[b] (+ bias), s in order.
// Memory: reads splits*M*N partials (+ M*N of C if beta != 0), writes M*N.
extern "C" __global__ void gemm_splitk_reduce(float* C, const float* W, const float* bias, int M, int N,
                                              int ldc, ll sC, int ldw, int splits, int batch,
                                              float alpha, float beta) {
    LLMC_PDL_WAIT();
    const ll total = (ll)batch * M * N;
    for (ll idx = (ll)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (ll)gridDim.x * blockDim.x) {
        const int n = (int)(idx % N);
        const ll bm = idx / N;
        const int m = (int)(bm % M), b = (int)(bm / M);
        float s = 0.0f;
        for (int k = 0; k < splits; k++) s += W[(((ll)b * splits + k) * M + m) * ldw + n];
        float* cp = C + b * sC + (ll)m * ldc + n;
        float x = alpha * s;
        if (beta != 0.0f) x += beta * *cp;
        if (bias) x += bias[n];
        *cp = x;
    }
}


// ----------------------------------------------------------------------------------------------
// gemm engine 4: engine 2 with ldmatrix fragments and a leaner loader
//
// Engine 2's main loop issues 524-606 instructions per 128 HMMA (SASS of mid, docs/matmul_notes.md):
// 128 HMMA, 128 tf32 rounding adds, 32-64 shared loads, and ~240-290 more, mostly the cp.async
// loader's address arithmetic (a swizzled destination and a 64-bit source recomputed for every
// chunk, a select per chunk for the zero-fill). Engine 4 keeps its pipeline, its smem tiles (K-major unchanged), its
// row/column mapping and so its epilogue, its planner and split-K, and changes three things:
//
//  1. K-major operands (A stored (M,K): nn/nt; B stored (N,K): nt/tt) are read with ldmatrix.x4.
//     On 32-bit data an ldmatrix "8x8 b16 matrix" is an 8x4 block of floats: 8 rows of 16 bytes,
//     row r's address given by lane 8q + r for matrix q, and lane l receives word l%4 of row l/4,
//     which is exactly the (g, t) position of the m16n8k8 A and B fragments. So one LDSM.x4 is a
//     whole A fragment (matrices = rows +0/+8 x k +0/+4 -> a0 a1 a2 a3), or the b0 b1 of two
//     n-tiles: 16 + 16 LDSM per k-tile instead of 32 + 32 LDS.64 for a 64x64 warp tile.
//     Each lane's address can point at any row, so the rows stay engine 2's (mma row g (+8) of
//     m-tile mi = tile row wm + g*RPGA + 2mi (+1), column g of n-tile ni = wn + g*NI + ni). The k
//     order cannot stay: an ldmatrix row is 4 consecutive k, so mma k-index kk of k-step j is tile
//     k 8j + kk (engine 2 permuted k to make LDS.64 pairs).
//  2. MN-major operands keep engine 2's LDS.128 reads (already one load per 4 registers), in the
//     new k order; their swizzle is now keyed on k & 3, the t of the lanes that read k-row k.
//  3. The loader gives each thread chunks that all share one swizzle key (K-major: 8 threads per
//     row, key = row / RPG % 8 fixed per thread), so a chunk's smem address is one register plus an
//     immediate; sources are chained by row steps kept in registers (one 64-bit add per chunk); and
//     interior k-tiles copy 16 bytes with no zero-fill arithmetic (a uniform branch: only edge tiles
//     compute per-chunk byte counts).
// Result (SASS, steady-state path of the main loop): 366-382 instructions per 128 HMMA for the big
// and mid tiles in every layout, against engine 2's 523-606. The tf32 rounding adds (128) are now
// the largest item after the HMMAs themselves.
// Not yet run on a GPU (2026-11-22): tests/test_matmul_layout.py checks every index formula below
// against a Python model of the mma and ldmatrix layouts and the banks, on the CPU.

// One operand's tile in shared memory (one stage) and every index formula engine 4 uses on it.
// KMAJOR: k contiguous in global memory, kept as R rows of 32 floats; else MN-major: 32 k-rows of
// R floats. R = BM (A) or BN (B); RPG = rows per lane group (A: 2*MI, B: NI); IS_A picks the matrix
// order of the A or B ldmatrix; NT = threads. Host + device, so that the layout test can compile
// them on the CPU and compare every value with its Python model.
template <bool KMAJOR, bool IS_A, int R, int RPG, int NT>
struct E4Tile {
    static constexpr bool KM = KMAJOR;
    static constexpr int ROWS = R, RPG_ = RPG;
    static constexpr int PER = R * 8 / NT;  // 16-byte chunks per thread per k-tile
    static constexpr int X = NT / 64;       // K-major: threads sharing a (chunk column, swizzle key)
    static constexpr int CPR = R / 4;       // MN-major: 16-byte chunks per k-row
    static constexpr int KSTEP = NT / CPR;  // MN-major: k-rows between one thread's chunks
    static_assert(RPG == 4 || RPG == 8, "lane groups of 4 or 8 rows");
    static_assert(KMAJOR ? (NT % 64 == 0 && RPG % (NT / 64) == 0 && R % (8 * RPG) == 0)
                         : (NT % (R / 4) == 0 && (NT / (R / 4)) % 4 == 0), "loader mapping");

    // MN-major swizzle key of a k-row: a function of k & 3 only
    __host__ __device__ static constexpr int mn_key(int u) { return RPG == 4 ? 2 * u : (u & 1) | ((u & 2) << 1); }
    // where tile element (row, k) lives, in floats from the stage's start (row runs along M or N).
    // K-major: chunk k/4 of row `row` at chunk position k/4 ^ (row/RPG % 8) (engine 2's layout).
    // MN-major: chunk row/4 of k-row k at chunk position row/4 ^ mn_key(k % 4).
    __host__ __device__ static constexpr int off(int row, int k) {
        return KMAJOR ? row * 32 + (((k >> 2) ^ ((row / RPG) & 7)) << 2) + (k & 3)
                      : k * R + (((row >> 2) ^ mn_key(k & 3)) << 2) + (row & 3);
    }

    // Loader: chunk i of thread tid is 4 floats along the stored row, at (stored row, column)
    // (ld_row(tid) + ld_step(i), ld_col(tid)): K-major = (tile row, k), MN-major = (k-row, tile row).
    // K-major: column c = tid % 8, swizzle key = tid / 8 % 8, x = tid / 64; chunk i is row x + X*i
    // of the key's lane groups (rows key*RPG .. +RPG-1, then the same 8*RPG rows further on). A warp
    // instruction copies 4 whole 128-byte rows; each 8-thread phase writes one row (8 banks quads).
    // MN-major (engine 2's): thread tid takes column chunk tid % CPR of k-rows tid / CPR + KSTEP*i.
    __host__ __device__ static constexpr int ld_row(int tid) { return KMAJOR ? (tid >> 6) + RPG * ((tid >> 3) & 7) : tid / CPR; }
    __host__ __device__ static constexpr int ld_col(int tid) { return KMAJOR ? 4 * (tid & 7) : 4 * (tid % CPR); }
    __host__ __device__ static constexpr int ld_step(int i) {
        return KMAJOR ? (X * i) % RPG + 8 * RPG * ((X * i) / RPG) : KSTEP * i;
    }
    __host__ __device__ static constexpr int ld_smem(int tid) {
        return KMAJOR ? off(ld_row(tid), ld_col(tid)) : off(ld_col(tid), ld_row(tid));
    }
    __host__ __device__ static constexpr int ld_smem_step(int i) { return (KMAJOR ? 32 : R) * ld_step(i); }

    // Fragments of warp tile origin w (wm or wn) for k-step j (tile k 8j .. 8j+7):
    // K-major, ldmatrix.x4: lane l gives the address of row l % 8 of matrix q = l / 8;
    //   A: matrix q = mma rows +8*(q & 1), k +4*(q >> 1): the registers a0..a3 of one m-tile;
    //   B: matrix q = n-tile +(q >> 1), k +4*(q & 1): b0 b1 of n-tile ni, then of ni + 1.
    //   address = frag_base(w, lane, j) + frag_imm(sub, 0), sub = 2*mi (A) or ni (B, even).
    // MN-major, LDS.128: lane (g, t) reads rows w + g*RPG + 4q .. +3 of k-row 8j + 4r + t
    //   (r = 0: k-index t, r = 1: t + 4): address = frag_base(w, lane, q) + frag_imm(j, r).
    __host__ __device__ static constexpr int frag_base(int w, int lane, int x) {
        return KMAJOR ? off(w + (lane & 7) * RPG + (IS_A ? (lane >> 3) & 1 : lane >> 4),
                            8 * x + 4 * (IS_A ? lane >> 4 : (lane >> 3) & 1))
                      : off(w + (lane >> 2) * RPG + 4 * x, lane & 3);
    }
    __host__ __device__ static constexpr int frag_imm(int a, int b) { return KMAJOR ? 32 * a : (8 * a + 4 * b) * R; }
};

__device__ __forceinline__ const float* add_bytes(const float* p, uint32_t bytes) {
    return reinterpret_cast<const float*>(reinterpret_cast<const char*>(p) + bytes);
}

// Global -> shared copies of one operand, k-tile after k-tile (the pipeline loads them in order).
// A chunk past the matrix (rows >= M or N: K-major; columns: MN-major) or past K copies fewer
// bytes, zero-filling the rest; with 0 bytes its source is never read. Tiles entirely inside the
// matrix (all but the last k-tile of all but the edge CTAs) take the path without byte counts.
// Source addresses are chained: chunk i = chunk i-1 + a row step held in a register, in bytes
// (K-major: X or 7*RPG + X rows, MN-major: KSTEP rows; leading dims < 2^24, checked by the builder).
template <class T>
struct E4Loader {
    const float* gp;  // this thread's chunk 0 in the next k-tile
    uint32_t sm;      // smem byte address of chunk 0 in stage 0
    uint32_t s1, s2;  // byte steps: K-major: X rows, 7*RPG + X rows; MN-major: KSTEP rows, 32 rows
    int k0, kc;       // k of the next k-tile; K-major: the chunk's k offset, MN-major: its first k-row
    int edge;         // K-major: bit i = chunk i's row is inside; MN-major: bytes of the column chunk inside
    bool all_in;      // every row (K-major) / column (MN-major) of the tile is inside the matrix

    __device__ __forceinline__ E4Loader(const float* g, int ld, int rc0, int rcs, int tid, uint32_t smem, int k0_)
        : sm(smem + 4 * T::ld_smem(tid)), k0(k0_), all_in(rc0 + T::ROWS <= rcs) {
        const int row = T::ld_row(tid), col = T::ld_col(tid);
        if (T::KM) {
            gp = g + (ll)(rc0 + row) * ld + k0_ + col;
            s1 = 4u * T::X * ld;
            s2 = 4u * (7 * T::RPG_ + T::X) * ld;
            kc = col;
            edge = 0;
#pragma unroll
            for (int i = 0; i < T::PER; i++) edge |= (rc0 + row + T::ld_step(i) < rcs) << i;
        } else {
            gp = g + (ll)(k0_ + row) * ld + rc0 + col;
            s1 = 4u * T::KSTEP * ld;
            s2 = 4u * 32 * ld;
            kc = row;
            edge = 4 * max(0, min(4, rcs - (rc0 + col)));
        }
    }
    // source of chunk i from that of chunk i - 1
    __device__ __forceinline__ const float* next(const float* p, int i) const {
        return add_bytes(p, !T::KM || T::ld_step(i) - T::ld_step(i - 1) == T::X ? s1 : s2);
    }

    // copy the next k-tile into the stage that starts `stage` bytes after stage 0
    __device__ __forceinline__ void load(uint32_t stage, int K) {
        const uint32_t dst = sm + stage;
        const float* p = gp;
        if (all_in && k0 + 32 <= K) {  // interior: whole chunks
#pragma unroll
            for (int i = 0; i < T::PER; i++) {
                if (i) p = next(p, i);
                cp_async16_full(dst + 4 * T::ld_smem_step(i), p);
            }
        } else if (T::KM) {
            const int kb = 4 * max(0, min(4, K - (k0 + kc)));
#pragma unroll
            for (int i = 0; i < T::PER; i++) {
                if (i) p = next(p, i);
                cp_async16(dst + 4 * T::ld_smem_step(i), p, (edge >> i) & 1 ? kb : 0);
            }
        } else {
#pragma unroll
            for (int i = 0; i < T::PER; i++) {
                if (i) p = next(p, i);
                cp_async16(dst + 4 * T::ld_smem_step(i), p, k0 + kc + T::ld_step(i) < K ? edge : 0);
            }
        }
        gp = T::KM ? gp + 32 : add_bytes(gp, s2);
        k0 += 32;
    }
};


// The CTA, grid, split-K and pipeline are engine 2's (gemm_tf32_body); only the loads differ.
template <bool TA, bool TB, int BM, int BN, int WM, int WN, int STAGES>
__device__ __forceinline__ void gemm_e4_body(float* C, const float* A, const float* B, const float* bias, float* W,
                                             int M, int N, int K, int lda, int ldb, int ldc, ll sA, ll sB, ll sC,
                                             float alpha, float beta, int splits, int kt_per_split, int ldw) {
    constexpr int BK = 32, WARPS_M = BM / WM, WARPS_N = BN / WN, NT = WARPS_M * WARPS_N * 32;
    constexpr int MI = WM / 16, NI = WN / 8, RPGA = 2 * MI, RPGB = NI;
    static_assert(NI % 4 == 0 && RPGA % 4 == 0, "warp tile too small for the float4 mapping");
    using TileA = E4Tile<!TA, true, BM, RPGA, NT>;
    using TileB = E4Tile<TB, false, BN, RPGB, NT>;
    constexpr int A_TILE = BM * BK, B_TILE = BN * BK;  // floats per stage
    static_assert(BM * BN <= STAGES * (A_TILE + B_TILE), "staging tile must fit in the pipeline smem");
    extern __shared__ __align__(16) float smem[];
    float* As = smem;                     // (STAGES, A_TILE)
    float* Bs = smem + STAGES * A_TILE;   // (STAGES, B_TILE)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp % WARPS_M) * WM, wn = (warp / WARPS_M) * WN;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int z = blockIdx.z, b = z / splits, split = z % splits;
    A += b * sA;
    B += b * sB;
    C += b * sC;
    const int KT = (K + BK - 1) / BK;
    const int kt0 = split * kt_per_split;
    const int nkt = max(0, min(KT, kt0 + kt_per_split) - kt0);
    const uint32_t sa0 = smem_u32(As), sb0 = smem_u32(Bs);

    E4Loader<TileA> la(A, lda, m0, M, tid, sa0, kt0 * BK);
    E4Loader<TileB> lb(B, ldb, n0, N, tid, sb0, kt0 * BK);

    float acc[MI][NI][4];
    zero_acc(acc);

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < nkt) {
            la.load(s * (A_TILE * 4), K);
            lb.load(s * (B_TILE * 4), K);
        }
        cp_async_commit();
    }

    // per-lane fragment offsets in a stage: K-major one per k-step j, MN-major one per 16-byte column chunk q
    int fa[4], fb[4];
#pragma unroll
    for (int x = 0; x < 4; x++) {
        fa[x] = TileA::frag_base(wm, lane, x);
        fb[x] = TileB::frag_base(wn, lane, x);
    }

    int rd = 0, wr = STAGES - 1;  // the stage read in this iteration, the stage refilled
    for (int i = 0; i < nkt; i++) {
        cp_async_wait<STAGES - 2>();  // k-tile i has landed (this thread's copies) ...
        __syncthreads();              // ... and everyone's; everyone is also done with tile i-1
        if (i + STAGES - 1 < nkt) {   // refill the stage that tile i-1 used
            la.load(wr * (A_TILE * 4), K);
            lb.load(wr * (B_TILE * 4), K);
        }
        cp_async_commit();
        wr = wr == STAGES - 1 ? 0 : wr + 1;
        const uint32_t sa = sa0 + rd * (A_TILE * 4), sb = sb0 + rd * (B_TILE * 4);
        rd = rd == STAGES - 1 ? 0 : rd + 1;
#pragma unroll
        for (int j = 0; j < BK / 8; j++) {
            uint32_t af[MI][4], bf[NI][2];
            if (!TA) {  // K-major: one ldmatrix.x4 per m-tile
#pragma unroll
                for (int mi = 0; mi < MI; mi++) ldsm_x4(af[mi], sa + 4 * (fa[j] + TileA::frag_imm(2 * mi, 0)));
            } else {    // MN-major: k-row 8j+t holds the lane's RPGA rows contiguously (a0/a1), 8j+4+t (a2/a3)
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int q = 0; q < RPGA / 4; q++) {
                        const uint4 v = lds128(sa + 4 * (fa[q] + TileA::frag_imm(j, r)));
                        af[2 * q][2 * r] = v.x;
                        af[2 * q][2 * r + 1] = v.y;
                        af[2 * q + 1][2 * r] = v.z;
                        af[2 * q + 1][2 * r + 1] = v.w;
                    }
            }
            if (TB) {   // K-major: one ldmatrix.x4 per two n-tiles
#pragma unroll
                for (int ni = 0; ni < NI; ni += 2) {
                    uint32_t d[4];
                    ldsm_x4(d, sb + 4 * (fb[j] + TileB::frag_imm(ni, 0)));
                    bf[ni][0] = d[0];
                    bf[ni][1] = d[1];
                    bf[ni + 1][0] = d[2];
                    bf[ni + 1][1] = d[3];
                }
            } else {    // MN-major: k-row 8j+t holds b0 of NI consecutive n-tiles, 8j+4+t their b1
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int q = 0; q < NI / 4; q++) {
                        const uint4 v = lds128(sb + 4 * (fb[q] + TileB::frag_imm(j, r)));
                        bf[4 * q][r] = v.x;
                        bf[4 * q + 1][r] = v.y;
                        bf[4 * q + 2][r] = v.z;
                        bf[4 * q + 3][r] = v.w;
                    }
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int e = 0; e < 4; e++) af[mi][e] = tf32_round(__uint_as_float(af[mi][e]));
#pragma unroll
            for (int ni = 0; ni < NI; ni++)
#pragma unroll
                for (int e = 0; e < 2; e++) bf[ni][e] = tf32_round(__uint_as_float(bf[ni][e]));
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < NI; ni++) mma_tf32(acc[mi][ni], af[mi], bf[ni]);
        }
    }
    cp_async_wait<0>();  // only empty groups can be left; keep the exit clean anyway
    __syncthreads();     // everyone is done reading the last k-tile: its smem becomes the staging area
    gemm_store_staged<WM, WN>(acc, smem + warp * (WM * WN), C, bias, W, M, N, ldc, alpha, beta, splits, ldw, z,
                              m0 + wm, n0 + wn, lane);
}

// Engine 4's tile configurations are engine 2's (same names, threads and smem; llmc/ops/gemm.py)
// except mid8, which needs more than the 128 registers that 2 CTAs/SM of 256 threads allow (it spilled).
#define GEMM_E4_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, lay, TA, TB)                                      \
    extern "C" __global__ void __launch_bounds__((BM / WM) * (BN / WN) * 32, MINB)                    \
        gemm_tf32_e4_##cfg##_##lay(float* C, const float* A, const float* B, const float* bias,       \
                                   float* W, int M, int N, int K, int lda, int ldb, int ldc, ll sA,  \
                                   ll sB, ll sC, float alpha, float beta, int splits,                 \
                                   int kt_per_split, int ldw) { LLMC_PDL_WAIT();                      \
        gemm_e4_body<TA, TB, BM, BN, WM, WN, ST>(C, A, B, bias, W, M, N, K, lda, ldb, ldc, sA, sB, sC, \
                                                 alpha, beta, splits, kt_per_split, ldw);             \
    }
#define GEMM_E4_LAYOUTS(cfg, BM, BN, WM, WN, ST, MINB)                  \
    GEMM_E4_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, nn, false, false)      \
    GEMM_E4_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, nt, false, true)       \
    GEMM_E4_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, tn, true, false)       \
    GEMM_E4_ENTRY(cfg, BM, BN, WM, WN, ST, MINB, tt, true, true)
GEMM_E4_LAYOUTS(big, 128, 256, 64, 64, 3, 1)
GEMM_E4_LAYOUTS(big4, 128, 256, 64, 64, 4, 1)
GEMM_E4_LAYOUTS(mid, 128, 128, 64, 64, 3, 2)
GEMM_E4_LAYOUTS(small, 64, 64, 32, 32, 3, 2)

// Lab instrument (dev/cuda/matmul_forward.py), not an op: the issue rate of mma.sync m16n8k8 TF32
// with no memory traffic at all, 8 independent accumulators per warp. Its TFLOP/s is the ceiling of
// every mma.sync kernel in this file; the gap from there to cuBLAS is what wgmma buys.
extern "C" __global__ void __launch_bounds__(256) gemm_tf32_mma_probe(float* out, int iters) {
    LLMC_PDL_WAIT();
    const uint32_t a[4] = {tf32_round(1.0f + threadIdx.x * 1e-3f), tf32_round(0.5f - threadIdx.x * 1e-3f),
                           tf32_round(0.25f + blockIdx.x * 1e-3f), tf32_round(-1.5f)};
    const uint32_t b[2] = {tf32_round(0.75f + threadIdx.x * 2e-3f), tf32_round(-0.125f)};
    float acc[8][4] = {};
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int j = 0; j < 8; j++) mma_tf32(acc[j], a, b);
    }
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
