// GEMM engine 5: Hopper tensor cores through wgmma, tiles brought in by the TMA (sm_90a only).
//
//   C(M,N) = alpha * A(M,K) @ B(N,K)^T  (+ bias(N)) (+ beta * C)        both operands K-major
//
// Instances: tf32 or bf16 inputs, fp32 accumulation; fp32 output, or (bf16 inputs) bf16 output rounded
// once in the epilogue (bias and beta * C added in fp32 first). bf16 operands may also be M-/N-major
// in global memory (A^T or B^T stored, as the backward pass has them): the TMA brings them in as
// 64-wide MN boxes and the wgmma reads them transposed (see "MN-major tiles" below). TF32 has no
// transpose bit; its M-major A goes through registers (the _am instances).
//
// Build: nvcc -gencode=arch=compute_90a,code=sm_90a (llmc/runtime.py does this for this file).
// Lab:   python dev/cuda/matmul_forward.py 9      tests: pytest -m gpu tests/test_gemm_wgmma.py
//
// Why a new engine: engines 2-4 issue mma.sync (m16n8k8), which on Hopper tops out near 60% of the
// tensor cores' rate; wgmma issues a 64xN product per warpgroup (4 warps) straight from shared
// memory, asynchronously, so one thread can keep the tensor cores fed while the others wait.
//
// The structure (one CTA per SM, persistent):
//   warpgroup 0      the producer. One thread walks the same tile sequence as the consumers and,
//                    for each k-block, waits until the stage is free (`empty` mbarrier), then asks
//                    the TMA for the A tile (128 x BK) and the B tile (BN x BK), both landing in
//                    128-byte-swizzled shared memory and completing on the stage's `full` mbarrier.
//                    It gives most of its registers away (setmaxnreg.dec).
//   warpgroups 1, 2  the consumers, rows 0-63 and 64-127 of the 128 x BN tile. Per k-block: wait on
//                    `full`, issue BK*size/32 wgmmas (k=8 for tf32, k=16 for bf16: 32 bytes of K
//                    each), commit; wait for the previous k-block's group and free its stage. Then
//                    the epilogue from registers: alpha, bias, beta*C, or raw partials for split-K.
//   STAGES deep ring of stages: the TMA runs up to STAGES k-blocks ahead, across tile boundaries,
//   so the next tile's loads overlap this tile's epilogue.
//
// Each shared-memory row of a tile is exactly 128 bytes of K (32 fp32 / 64 bf16): the TMA's
// 128-byte swizzle XORs the 16-byte chunk index with (row % 8), and the wgmma descriptors say the
// same (layout type 1, 8-row groups 1024 bytes apart), so the tensor cores read conflict-free.
// Advancing K by one wgmma step inside the swizzled row is +32 bytes on the descriptor's start
// address (stages are 1024-byte aligned, so the swizzle phase is unchanged).
//
// TF32 note: the tensor cores read the top 19 bits of each fp32 operand (truncation), where engines
// 2-4 round with cvt.rna first. The TMA copies bits, so this engine truncates, like cuBLAS's TF32.
// Out-of-range rows/columns of a tile (M, N, K not multiples of the tile) are zero-filled by the TMA.
//
// MN-major tiles (bf16 only: the _bt / _at_bt instances). An operand stored K rows of MN elements
// (dout for dweight = dout^T @ inp, weight for dinp = dout @ weight) is loaded as boxes of 64 MN
// elements (128 bytes) x BK = 64 k rows, 8 KB each, 128-byte swizzled by k row: box b holds MN
// 64b..64b+63, its k row r at byte 128 r. That is the wgmma's canonical MN-major SW128 layout (PTX
// ISA "shared memory matrix layout"; imm-trans = 1): 8 k rows of 128 bytes form one 1024-byte
// swizzle atom, the stride byte offset (SBO) is the step between atoms along K (1024 bytes), the
// leading byte offset (LBO) the step between 64-wide MN blocks (one box: 8192 bytes). One k16 step is
// two atoms: +2048 bytes on the start address (atom-aligned, so the swizzle phase is unchanged).
// A consumer warpgroup's 64 rows of A are exactly one box.
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "elem.cuh"    // gelu_fwd_as: the GELU of the fused fc epilogue (the _gelu instances)
#include "fold.cuh"    // fold_exp: the _fold instances (the classifier folded into the lm head)
#include "hopper.cuh"
#include "wgmma.cuh"

typedef long long ll;

constexpr int BM = 128;            // rows of C per tile: two consumer warpgroups x 64
constexpr int ROW_BYTES = 128;     // bytes of K per shared-memory row (one swizzle span)
constexpr int THREADS = 384;       // producer warpgroup + 2 consumer warpgroups
constexpr int CONSUMER_WARPS = 8;
constexpr int GROUP_M = 8;         // tile rows walked together, for L2 reuse of B tiles

// ------------------------------------------------------------------------------------------------
// PTX helpers: shared-memory addresses, mbarriers, TMA, wgmma bookkeeping


// 2D tile load: box at coordinates (c0 = K offset, c1 = row offset), completing on `bar`
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                 ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
                 : "memory");
}

// 2D tile store from shared memory (the TMA clips what falls outside the tensor), in a bulk group
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// the stores of earlier groups have finished READING shared memory (the buffer may be rewritten)
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// ordinary shared-memory stores made visible to the TMA (the async proxy)
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// barrier over one warpgroup's 128 threads (ids 1, 2; 0 is __syncthreads)
__device__ __forceinline__ void wg_barrier(int id) { asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory"); }

// Thread-block clusters (the _mc instances: two CTAs share each B tile through TMA multicast)
__device__ __forceinline__ int cta_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
}
// every thread of every CTA of the cluster (the mbarriers initialised, before a peer signals them)
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// one arrival on the mbarrier at `bar`'s offset in the shared memory of the cluster's CTA `rank`. (The
// default .release.cta: what the arrival orders is the wgmma's reads of the stage, which have retired;
// with .release.cluster every arrival waited for a cluster-scope fence and the GEMMs ran 2.4x slower.)
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, int rank) {
    uint32_t ra;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(smem_u32(bar)), "r"(rank));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(ra) : "memory");
}
// tma_load_2d into every CTA of the cluster in `mask`: the box lands at dst's offset in each one's shared
// memory and completes its bytes on the mbarrier at bar's offset there
__device__ __forceinline__ void tma_load_2d_mc(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                               uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%3, %4}], [%2], %5;"
                 ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1),
                 "h"(mask) : "memory");
}


// Shared-memory matrix descriptor of a K-major tile with the 128-byte swizzle (hopper.cuh's
// wgmma_desc_sw128): leading byte offset unused by swizzled K-major layouts (16), stride byte offset
// 1024 (the next group of 8 rows).
__device__ __forceinline__ uint64_t smem_desc(const void* p) { return wgmma_desc_sw128(p, 16); }

// The same for an MN-major tile (bf16, 64-wide MN boxes of BK_T k rows, 128-byte swizzled): LBO =
// the next 64 MN elements (the next box, 64 k rows x 128 bytes), SBO = the next 8 k rows (1024).
constexpr int BK_T = 64;  // k rows per MN-major box (= bf16's BK)
__device__ __forceinline__ uint64_t smem_desc_mn(const void* p) { return wgmma_desc_sw128(p, BK_T * ROW_BYTES); }

// The mainloops' descriptors in two words (hopper.cuh's halves). The high one (SBO = 1024 in bits 32-45, SW128
// in 62-63: wgmma_desc_hi()) is the same for every operand here; the low one (start address >> 4, LBO >> 4 in
// bits 16-29) is made once per kernel for stage 0 (wgmma_desc_lo) and stepped by adding (stage * STAGE_BYTES
// + the k-step's offset) >> 4, one 32-bit add an operand a wgmma, where rebuilding the descriptor from the
// address takes ~5 integer instructions (the address field stays below 2^14: shared memory ends at 228 KB).
// GEMM_DESC_STEP (a -D define; 1, the default): 0 gives the rebuilt form (the same descriptors). Session 44,
// H200: 23-28% fewer warp instructions in the d12 forwards and dinps, the same time (docs/matmul_notes.md).
#ifndef GEMM_DESC_STEP
#define GEMM_DESC_STEP 1
#endif
__device__ __forceinline__ uint64_t desc_of(uint32_t lo) { return (uint64_t(wgmma_desc_hi()) << 32) | lo; }
// the k-step's offset >> 4: K-major +32 bytes (16 bf16 / 8 tf32 of k), MN-major +16 k rows (2048 bytes)
template <bool MN> __host__ __device__ constexpr uint32_t desc_kstep(int ks) { return MN ? ks * (16 * ROW_BYTES >> 4) : ks * 2; }

// bf16's 160-wide tile of the dweight layout (5 tiles across GPT-2's 768 columns). Its B^T comes in as
// three 64-wide boxes (192 columns: the last 32 are the next tile's, or zeros past N) in the same SW128
// layout as every MN-major operand, and the n160 wgmma reads the first 160 of them: 2.5 swizzle atoms
// along N, which the hardware takes (the GPU tests check it against float64). B_ROWS: a B^T tile's
// columns in shared memory, whole 64-wide boxes. (Until session 29 the tile came in as five 32-wide
// boxes with the 64-byte swizzle, the wgmma's MN-major SW64 layout: no wasted columns, but the tensor
// cores read it slower: fc's dweight at B=4 0.0402 ms against 0.0341 now, H200.)
// C's staging buffer and map keep 64-byte rows for it (box_bytes: 160 bf16 outputs are 2.5 rows of 128
// bytes): five 32-column boxes, 16-byte chunk c of row r at c ^ ((r / 2) % 4), the TMA's 64-byte swizzle.
template <int WIDTH_BYTES> __host__ __device__ constexpr int box_bytes() { return WIDTH_BYTES % 128 == 0 ? 128 : 64; }
template <int BN, bool B_T> __host__ __device__ constexpr int b_rows() { return B_T ? (BN + 63) / 64 * 64 : BN; }

// the k-th tile of the persistent sequence: tile rows go in groups of GROUP_M, column-major inside a
// group, so the CTAs running at one time share a few B tiles and GROUP_M A tiles in L2
__device__ __forceinline__ void tile_coords(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
    const int per_group = GROUP_M * tiles_n;
    const int g = t / per_group, first = g * GROUP_M;
    const int rows = min(tiles_m - first, GROUP_M);
    const int r = t - g * per_group;
    tm = first + r % rows;
    tn = r / rows;
}


// TA / TB: A M-major / B N-major in shared memory (the transpose immediates; bf16 only)
template <typename T, int BN, int TA = 0, int TB = 0> struct Wgmma;
template <> struct Wgmma<float, 64> { static __device__ __forceinline__ void run(float (&d)[32], uint64_t a, uint64_t b, int s) { wgmma_tf32_n64(d, a, b, s); } };
template <> struct Wgmma<float, 128> { static __device__ __forceinline__ void run(float (&d)[64], uint64_t a, uint64_t b, int s) { wgmma_tf32_n128(d, a, b, s); } };
template <> struct Wgmma<float, 192> { static __device__ __forceinline__ void run(float (&d)[96], uint64_t a, uint64_t b, int s) { wgmma_tf32_n192(d, a, b, s); } };
template <> struct Wgmma<float, 256> { static __device__ __forceinline__ void run(float (&d)[128], uint64_t a, uint64_t b, int s) { wgmma_tf32_n256(d, a, b, s); } };
template <int TA, int TB> struct Wgmma<__nv_bfloat16, 64, TA, TB> { static __device__ __forceinline__ void run(float (&d)[32], uint64_t a, uint64_t b, int s) { wgmma_bf16_n64<TA, TB>(d, a, b, s); } };
template <int TA, int TB> struct Wgmma<__nv_bfloat16, 128, TA, TB> { static __device__ __forceinline__ void run(float (&d)[64], uint64_t a, uint64_t b, int s) { wgmma_bf16_n128<TA, TB>(d, a, b, s); } };
template <int TA, int TB> struct Wgmma<__nv_bfloat16, 160, TA, TB> { static __device__ __forceinline__ void run(float (&d)[80], uint64_t a, uint64_t b, int s) { wgmma_bf16_n160<TA, TB>(d, a, b, s); } };
template <int TA, int TB> struct Wgmma<__nv_bfloat16, 192, TA, TB> { static __device__ __forceinline__ void run(float (&d)[96], uint64_t a, uint64_t b, int s) { wgmma_bf16_n192<TA, TB>(d, a, b, s); } };
template <int TA, int TB> struct Wgmma<__nv_bfloat16, 256, TA, TB> { static __device__ __forceinline__ void run(float (&d)[128], uint64_t a, uint64_t b, int s) { wgmma_bf16_n256<TA, TB>(d, a, b, s); } };

template <int BN> struct WgmmaRS;
template <> struct WgmmaRS<128> { static __device__ __forceinline__ void run(float (&d)[64], const uint32_t (&a)[4], uint64_t b, int s) { wgmma_tf32_rs_n128(d, a, b, s); } };
template <> struct WgmmaRS<192> { static __device__ __forceinline__ void run(float (&d)[96], const uint32_t (&a)[4], uint64_t b, int s) { wgmma_tf32_rs_n192(d, a, b, s); } };
template <> struct WgmmaRS<256> { static __device__ __forceinline__ void run(float (&d)[128], const uint32_t (&a)[4], uint64_t b, int s) { wgmma_tf32_rs_n256(d, a, b, s); } };

// An M-major A tile (the dweight GEMM's A is dout^T: its K runs along dout's rows) comes in as 4
// TMA boxes of 32 m (128 bytes) x 32 k, each 4 KB, 128-byte swizzled by k row. TF32 wgmma takes
// only K-major tiles from shared memory, so A goes through registers instead: one k-step's fragment
// is a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4) of the warp's 16 rows (g = lane/4, t = lane%4),
// read with 4 scalar loads (2-way bank conflicts at worst: the swizzle spreads the 4 k rows).
__device__ __forceinline__ void load_a_mn(uint32_t (&a)[4], const unsigned char* stage_a, int wg_row0, int ks) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int m = wg_row0 + warp * 16 + g + 8 * (i & 1), k = ks * 8 + t + 4 * (i >> 1);
        const int mm = m & 31;
        a[i] = *reinterpret_cast<const uint32_t*>(stage_a + (m >> 5) * 4096 + k * ROW_BYTES +
                                                   (((mm >> 2) ^ (k & 7)) << 4) + (mm & 3) * 4);
    }
}

// ------------------------------------------------------------------------------------------------
// the kernel body

// Loads and stores of the output type, in fp32 registers: bf16 is read exactly and rounded once on
// the store (to nearest even); a pair is two adjacent columns (float2 / __nv_bfloat162)
template <typename OUT> struct Out;
template <> struct Out<float> {
    static __device__ __forceinline__ float stored(float v) { return v; }  // v as put() stores it
    static __device__ __forceinline__ float get(const float* p) { return *p; }
    static __device__ __forceinline__ float2 get2(const float* p) { return *reinterpret_cast<const float2*>(p); }
    static __device__ __forceinline__ void put(float* p, float v) { *p = v; }
    static __device__ __forceinline__ void put2(float* p, float v0, float v1) { *reinterpret_cast<float2*>(p) = make_float2(v0, v1); }
};
template <> struct Out<__nv_bfloat16> {
    static __device__ __forceinline__ float stored(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
    static __device__ __forceinline__ float get(const __nv_bfloat16* p) { return __bfloat162float(*p); }
    static __device__ __forceinline__ float2 get2(const __nv_bfloat16* p) {
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
    }
    static __device__ __forceinline__ void put(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
    static __device__ __forceinline__ void put2(__nv_bfloat16* p, float v0, float v1) {
        *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v0, v1);  // .x (v0) at the lower address
    }
};

template <typename OUT>
struct GemmArgs {
    OUT* C;              // (M, ldc) row-major, or (N, ldc) when trans_c (C^T is stored)
    const OUT* bias;     // (N) or nullptr
    float* W;            // split-K workspace (splits, M, ldw), used when splits > 1
    int M, N, K, ldc, ldw, splits, kb_per_split;
    float alpha, beta;
    int trans_c;
    OUT* G = nullptr;    // the _gelu instances: G = gelu(C) as C is stored, (M, ldc) like C
    float* S = nullptr;  // the _dgelu instances, or nullptr: column sums of C as stored, one row per
                         // 16 rows of C (a warp's: (M rounded up to 128) / 16, N), for gemm_wgmma_colsum_finish
    // the _fold instances (the lm head's forward in the folded classifier; see fold_tile):
    float* FS = nullptr;           // (M, tiles_n): per row and BN-wide tile, the sum of p'
    const int* fold_k = nullptr;   // the device scalar k: p' = 2^(logit log2(e) - k)
    int V = 0;                     // columns >= V (llm.c's vocabulary padding) give p' = 0
};

// The bias. Read in the epilogue, it cost 7-22% of a d12 forward GEMM's time (H100, 2026-11-26): the
// epilogue is on the critical path (cooperative: both consumers run it with the tensor cores idle;
// ping-pong: a consumer's next mainloop waits for its epilogue), and it waited there for the loads'
// latency, twice per tile for the 128-row ping-pong tile. So BiasFrag holds it in registers before
// the epilogue, and the epilogue adds it as it added its own loads: the same values in the same order,
// so the results keep their bits. A thread's columns are n0 + 8j + 2(lane % 4) + {0, 1} (j < BN / 8;
// 0 past N), bf16 a pair per register:
//   BIAS_REGS   all BN / 8 pairs in the thread's registers, loaded at the tile's start (cooperative;
//               the ping-pong bf16 64 x 192 tile while it waits for its turn), or for tf32's 64 x 192
//               ping-pong tile once the products are done;
//   BIAS_LANES  the tiles of 128 accumulators (cooperative 256 wide, ping-pong 128 x 128 and 64 x 256)
//               and tf32's fused GELU: the 8 lanes with the same columns hold BN / 64 pairs each, and
//               the epilogue shuffles each pair from its holder (bias cost of bf16 qkv B=16, 128 x 128
//               ping-pong: +10.2% -> -0.2%; cooperative 256: +16.1% -> +2.3%, 2026-11-27).
// Why not always BIAS_REGS: ptxas allocates for __launch_bounds__(384, 1), 168 registers a thread,
// whatever setmaxnreg gives later. Next to 128 accumulators even 16 more spilled (through the mainloop,
// or only in the epilogue); so did tf32's fused GELU at 96 + 48. So bias_in_regs (accumulators + bias
// registers) allows 144 for the plain cooperative tiles, 120 for the fused GELU and through a ping-pong
// mainloop, 144 after one of 96 accumulators.
// Tried, 2026-11-27: a copy of the tile's bias in shared memory (cp.async at the tile's start): the
// epilogue's extra instructions cost as much as the loads had; and the accumulators started from the
// bias (the first wgmma's scale-d 1): the non-wgmma writes of the accumulators made ptxas serialize the
// wgmmas (C7515), 0.173 against 0.110 ms on bf16 qkv B=16 without a bias.
template <typename OUT, int BN, int ACC, int LIMIT>
__host__ __device__ constexpr bool bias_in_regs() { return ACC + BN / 8 * (int)(sizeof(OUT) / 2) <= LIMIT; }

template <typename OUT> struct PairOf { using type = float2; };
template <> struct PairOf<__nv_bfloat16> { using type = __nv_bfloat162; };

// Where BiasFrag keeps the bias: BIAS_REGS, a thread's BN / 4 columns in registers; BIAS_LANES, spread
// over the 8 lanes that share those columns (lane l holds column groups j = l / 4 + 8k, k < BN / 64)
// and shuffled out to the others in the epilogue: BN / 64 registers.
enum { BIAS_REGS = 1, BIAS_LANES = 2 };

// at() is called by all 32 lanes of the warp together (BIAS_LANES shuffles)
template <typename OUT, int BN, int MODE>
struct BiasFrag {
    using Pair = typename PairOf<OUT>::type;
    static_assert(MODE == BIAS_REGS || MODE == BIAS_LANES, "BIAS_REGS or BIAS_LANES");
    static constexpr int NV = MODE == BIAS_REGS ? BN / 8 : (BN / 8 + 7) / 8;
    Pair v[NV];
    // before the epilogue (one K split only: split-K's reduce adds the bias)
    __device__ __forceinline__ void fetch(const GemmArgs<OUT>& a, int n0) {
        if (!a.bias || a.splits != 1) return;
        const int lane = threadIdx.x & 31, c0 = n0 + 2 * (lane & 3);
#pragma unroll
        for (int k = 0; k < NV; k++) {
            const int c = c0 + 8 * (MODE == BIAS_REGS ? k : (lane >> 2) + 8 * k);
            const OUT zero = OUT(0.0f);
            const OUT x = c < a.N ? a.bias[c] : zero, y = c + 1 < a.N ? a.bias[c + 1] : zero;
            if constexpr (sizeof(OUT) == 2) v[k] = __halves2bfloat162(x, y);
            else v[k] = make_float2(x, y);
        }
    }
    // bias(c), bias(c + 1) as fp32 for column group j (c = n0 + 8j + 2(lane % 4)); 0 past N
    __device__ __forceinline__ float2 at(int j) const {
        if constexpr (MODE == BIAS_REGS) {
            if constexpr (sizeof(OUT) == 2) return __bfloat1622float2(v[j]);
            else return v[j];
        } else {
            const int src = ((j & 7) << 2) | (threadIdx.x & 3);
            if constexpr (sizeof(OUT) == 2) {
                const uint32_t w = __shfl_sync(0xffffffffu, *reinterpret_cast<const uint32_t*>(&v[j >> 3]), src);
                return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
            } else {
                return make_float2(__shfl_sync(0xffffffffu, v[j >> 3].x, src), __shfl_sync(0xffffffffu, v[j >> 3].y, src));
            }
        }
    }
};

// One or two adjacent columns (c, c + 1) of row r into X (C or G): a pair store where `pair` says X's
// rows allow it, else single stores; with trans_c X^T is stored
template <typename OUT>
__device__ __forceinline__ void put_cols(OUT* X, const GemmArgs<OUT>& a, bool pair, int r, int c, float v0, float v1) {
    using O = Out<OUT>;
    const bool two = c + 1 < a.N;
    if (a.trans_c) {
        O::put(X + (ll)c * a.ldc + r, v0);
        if (two) O::put(X + (ll)(c + 1) * a.ldc + r, v1);
    } else if (pair && two) {
        O::put2(X + (ll)r * a.ldc + c, v0, v1);
    } else {
        O::put(X + (ll)r * a.ldc + c, v0);
        if (two) O::put(X + (ll)r * a.ldc + c + 1, v1);
    }
}

// Pair stores need untransposed rows of even length and a pair-aligned start
template <typename OUT>
__device__ __forceinline__ bool pairs_ok(const OUT* X, const GemmArgs<OUT>& a) {
    return !a.trans_c && (a.ldc % 2 == 0) && ((reinterpret_cast<uintptr_t>(X) & (2 * sizeof(OUT) - 1)) == 0);
}

// One consumer thread's share of the epilogue. Accumulator d[4j + 2h + c] of warp w, lane l holds
// C at row 16w + l/4 + 8h (of the warpgroup's 64), column 8j + 2(l%4) + c.
// GELU (the fc layer's fused form): also G = gelu(C), computed from each C value as stored (bf16: the
// rounded value) by gelu_forward's own function for OUT, so G has gemm + gelu_forward's bits.
template <typename OUT, int BN, bool GELU = false, typename BF>
__device__ __forceinline__ void epilogue(float (&d)[BN / 2], const GemmArgs<OUT>& a, const BF& bf,
                                         int m0, int n0, int split) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3;
    const int r0 = m0 + warp * 16 + (lane >> 2), c0 = n0 + 2 * (lane & 3);
    if (a.splits > 1) {  // raw partial sums; gemm_wgmma_splitk_reduce applies alpha, beta, bias
        float* W = a.W + (ll)split * a.M * a.ldw;
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = r0 + 8 * h, c = c0 + 8 * j;
                if (r < a.M && c < a.N) {  // ldw is even and >= N rounded up to 4: both columns fit
                    *reinterpret_cast<float2*>(W + (ll)r * a.ldw + c) = make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
                }
            }
        return;
    }
    using O = Out<OUT>;
    const bool pair = pairs_ok(a.C, a), pair_g = GELU && pairs_ok(a.G, a);
    // In chunks of JC column groups: with beta != 0 all of a chunk's old C values are loaded before
    // any of its stores (a load after a store to C may alias it, so the compiler would otherwise wait
    // out each load's latency in turn: 64-128 round trips per thread, measured 2x on a K=4096 GEMM).
    constexpr int JC = 8;
#pragma unroll
    for (int j0 = 0; j0 < BN / 8; j0 += JC) {
        float old[JC][2][2];
#pragma unroll
        for (int j = 0; j < JC && j0 + j < BN / 8; j++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = r0 + 8 * h, c = c0 + 8 * (j0 + j);
                old[j][h][0] = old[j][h][1] = 0.0f;
                if (a.beta == 0.0f || r >= a.M || c >= a.N) continue;
                if (a.trans_c) {
                    old[j][h][0] = O::get(a.C + (ll)c * a.ldc + r);
                    if (c + 1 < a.N) old[j][h][1] = O::get(a.C + (ll)(c + 1) * a.ldc + r);
                } else if (pair && c + 1 < a.N) {
                    const float2 o = O::get2(a.C + (ll)r * a.ldc + c);
                    old[j][h][0] = o.x; old[j][h][1] = o.y;
                } else {
                    old[j][h][0] = O::get(a.C + (ll)r * a.ldc + c);
                    if (c + 1 < a.N) old[j][h][1] = O::get(a.C + (ll)r * a.ldc + c + 1);
                }
            }
#pragma unroll
        for (int j = 0; j < JC && j0 + j < BN / 8; j++) {
            // (every lane: at() may shuffle; past N: + 0, and the column is not stored)
            const float2 b = a.bias ? bf.at(j0 + j) : make_float2(0.0f, 0.0f);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = r0 + 8 * h, c = c0 + 8 * (j0 + j);
                if (r >= a.M || c >= a.N) continue;
                const int i = 4 * (j0 + j) + 2 * h;
                float v0 = a.alpha * d[i] + a.beta * old[j][h][0], v1 = a.alpha * d[i + 1] + a.beta * old[j][h][1];
                if (a.bias) {
                    v0 += b.x;
                    v1 += b.y;
                }
                put_cols(a.C, a, pair, r, c, v0, v1);
                if constexpr (GELU)
                    put_cols(a.G, a, pair_g, r, c, gelu_fwd_as<OUT>(O::stored(v0)), gelu_fwd_as<OUT>(O::stored(v1)));
            }
        }
    }
}

// The tile staged in shared memory as the TMA store reads it: boxes of 64 rows x RB bytes of columns,
// RB = box_bytes (128: EPB = 32 fp32 / 64 bf16 a box row, the 128-byte swizzle, 16-byte chunk ch of row
// r at ch ^ (r % 8); 64 for bf16's 160-wide tile: 32 a row, the 64-byte swizzle, ch ^ ((r / 2) % 4)).
// Both: the chunk xor (r * RB / 128) % (RB / 16), the TMA's swizzle of the row's byte address. A quad
// of lanes writes 4 adjacent pairs of one row, 8 rows per warp store: 32 distinct banks, conflict-free.
template <typename OUT, int BN>
__device__ __forceinline__ OUT* staged_at(unsigned char* stg, int r, int c) {
    constexpr int RB = box_bytes<BN * (int)sizeof(OUT)>();
    constexpr int EPB = RB / sizeof(OUT), EPC = 16 / sizeof(OUT);  // elements per box row / chunk
    const unsigned ur = r, uc = c;  // (non-negative: unsigned divisions by powers of 2 are shifts)
    const unsigned box = uc / EPB, ch = (uc % EPB) / EPC, swz = ((ur * RB) >> 7) & (RB / 16 - 1);
    return reinterpret_cast<OUT*>(stg + box * (64 * RB) + ur * RB + ((ch ^ swz) << 4)) + (uc % EPC);
}

// GEMM_STMATRIX (a -D define; 1, the default; 0 gives the plain form): bf16 tiles staged by
// stmatrix, four 8 x 8 blocks of b16 a warp instruction (16 bytes a thread), where the plain form stores
// each pair of a thread's accumulators alone (4 bytes; 64 stores a thread for a 64 x 256 tile, 16 here).
// The blocks are the accumulators' own fragments: block i of stmatrix q holds column group j = 2q + i / 2,
// row half h = i % 2 (a thread's pair: row lane / 4, columns 2 (lane % 4) + {0, 1}); lanes 8i..8i+7 give
// the addresses of block i's 8 rows, each a whole 16-byte chunk of the swizzled staging (staged_at), so
// the bits and the layout the TMA store reads are the plain form's. (Session 43's ncu: our GEMMs issue
// 1.6-2.9x cuBLAS's instructions, and the K = 768 ones idle the tensor pipe between tiles. Session 44, H200,
// with GEMM_ALPHA1_SKIP, against both 0: whole bf16 steps -1.3% at B=16, -2.0% at B=4.)
#ifndef GEMM_STMATRIX
#define GEMM_STMATRIX 1
#endif
#ifndef GEMM_ALPHA1_SKIP
#define GEMM_ALPHA1_SKIP 1
#endif
__device__ __forceinline__ void stmatrix_x4(const void* p, const uint32_t (&x)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(smem_u32(p)), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]) : "memory");
}

// The tile's values (as stored: rounded to OUT) into the staging buffer, in the swizzled layout of C's
// TMA boxes. PARTS > 1 (the _s4 instances): the tile goes out in PARTS column slices of BN / PARTS
// through a staging buffer of 64 x BN / PARTS, slice P's columns [P BN / PARTS, (P + 1) BN / PARTS)
// staged as a tile of that width (the same boxes and swizzle: a slice is whole 128-byte boxes).
// bf16 with GEMM_STMATRIX: stmatrix.x4 writes four 8 x 8 blocks of the warp's 16 rows a step (lane t gives
// the row address of block t / 8), each block a fragment of the accumulators; else a pair a store.
template <typename OUT, int BN, int PARTS, int P>
__device__ __forceinline__ void stage_part(const float (&v)[BN / 2], unsigned char* stg) {
    using O = Out<OUT>;
    constexpr int W = BN / PARTS, J0 = P * W / 8;
    static_assert(sizeof(OUT) == 4 || sizeof(OUT) == 2, "fp32 or 16-bit outputs");
    static_assert(PARTS == 1 || W % 64 == 0, "a slice is whole 64-wide column groups");
    const int lane = threadIdx.x & 31, warp = (threadIdx.x & 127) >> 5;
    if constexpr (sizeof(OUT) == 2 && GEMM_STMATRIX && W % 16 == 0) {
        const int blk = lane >> 3, r = warp * 16 + 8 * (blk & 1) + (lane & 7);  // this lane's row of block blk
#pragma unroll
        for (int q = 0; q < W / 16; q++) {
            uint32_t x[4];
#pragma unroll
            for (int i = 0; i < 4; i++) x[i] = pack_bf16x2(v[4 * J0 + 8 * q + 2 * i], v[4 * J0 + 8 * q + 2 * i + 1]);  // (elem.cuh)
            stmatrix_x4(staged_at<OUT, W>(stg, r, 8 * (2 * q + (blk >> 1))), x);
        }
        return;
    }
#pragma unroll
    for (int j = J0; j < J0 + W / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = warp * 16 + (lane >> 2) + 8 * h, c = 8 * (j - J0) + 2 * (lane & 3);
            O::put2(staged_at<OUT, W>(stg, r, c), v[4 * j + 2 * h], v[4 * j + 2 * h + 1]);
        }
}
template <typename OUT, int BN>
__device__ __forceinline__ void stage_tile(const float (&v)[BN / 2], unsigned char* stg) {
    stage_part<OUT, BN, 1, 0>(v, stg);
}

// The staged tile out through the TMA (thread 0 of the warpgroup), one bulk group
template <typename OUT, int BN>
__device__ __forceinline__ void store_tile(const CUtensorMap* tm, unsigned char* stg, int m0, int n0) {
    constexpr int RB = box_bytes<BN * (int)sizeof(OUT)>(), EPB = RB / sizeof(OUT);
#pragma unroll
    for (int b = 0; b < BN / EPB; b++) tma_store_2d(tm, stg + b * (64 * RB), n0 + EPB * b, m0);
    bulk_commit();
}

// DGELU (the fcproj layer's fused form, matmul_backward with dgelu=True): C = gelu'(P) * (the GEMM's
// value as stored), P the pre-activation (fch), what gelu_backward computes from the plain GEMM's C.
// P's tile comes in by the TMA into this warpgroup's staging buffer, in the layout stage_tile writes
// (the same box and swizzle as C's map), issued by thread 0 of the warpgroup early in the tile's
// mainloop (load_pre), so the epilogue finds it there: each thread reads P at the positions of its
// own values, and writes the results over them (each position has one owner: no barrier between).
template <typename OUT, int BN>
__device__ __forceinline__ void load_pre(const CUtensorMap* tmP, unsigned char* stg, uint64_t* bar, int m0, int n0) {
    constexpr int RB = box_bytes<BN * (int)sizeof(OUT)>(), EPB = RB / sizeof(OUT);
    bulk_wait_read();  // the previous tile's stores have read the buffer
    mbar_expect_tx(bar, 64 * BN * sizeof(OUT));
#pragma unroll
    for (int b = 0; b < BN / EPB; b++) tma_load_2d(stg + b * (64 * RB), tmP, bar, n0 + EPB * b, m0);
}

// v: the products in, the results as stored out (for the column sums). bf16 with GEMM_STMATRIX: P's
// values come in by ldmatrix (the inverse of stage_tile's stmatrix: lane t gets the pair at row t / 4,
// columns 2 (t % 4) + {0, 1} of each 8 x 8 block, the positions of its own accumulators) and the
// results go back by stmatrix at the same addresses: 2 x 16-byte shared-memory instructions a thread
// for 8 pairs, where the plain form below takes 2 loads and a store per pair.
__device__ __forceinline__ void ldmatrix_x4(const void* p, uint32_t (&x)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(smem_u32(p)) : "memory");
}
template <typename OUT, int BN>
__device__ __forceinline__ void dgelu_staged(float (&v)[BN / 2], unsigned char* stg) {
    using O = Out<OUT>;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x & 127) >> 5;
    if constexpr (sizeof(OUT) == 2 && GEMM_STMATRIX && BN % 16 == 0) {
        const int blk = lane >> 3, r = warp * 16 + 8 * (blk & 1) + (lane & 7);  // (stage_tile's addresses)
#pragma unroll
        for (int q = 0; q < BN / 16; q++) {
            OUT* p = staged_at<OUT, BN>(stg, r, 8 * (2 * q + (blk >> 1)));
            uint32_t x[4];
            ldmatrix_x4(p, x);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int k = 8 * q + 2 * i;
                const float g0 = gelu_bwd_as<OUT>(bf16_lo(x[i]), O::stored(v[k]));
                const float g1 = gelu_bwd_as<OUT>(bf16_hi(x[i]), O::stored(v[k + 1]));
                x[i] = pack_bf16x2(g0, g1);
                v[k] = O::stored(g0);
                v[k + 1] = O::stored(g1);
            }
            stmatrix_x4(p, x);
        }
        return;
    }
#pragma unroll
    for (int j = 0; j < BN / 8; j++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = warp * 16 + (lane >> 2) + 8 * h, c = 8 * j + 2 * (lane & 3), i = 4 * j + 2 * h;
            OUT* p = staged_at<OUT, BN>(stg, r, c);
            const float g0 = gelu_bwd_as<OUT>(O::get(p), O::stored(v[i]));
            const float g1 = gelu_bwd_as<OUT>(O::get(p + 1), O::stored(v[i + 1]));
            O::put2(p, g0, g1);
            v[i] = O::stored(g0);
            v[i + 1] = O::stored(g1);
        }
}

// BETA (the accumulating GEMMs with the TMA store: dweight += dout^T @ inp): C's old tile comes in by
// the TMA into the staging buffer (load_pre on C's own map, early in the tile's mainloop), and each
// thread turns its own positions into alpha * product + beta * old (+ bias), the direct epilogue's
// order, in place; then the store writes the tile back. A tile belongs to one CTA, so its load and
// store never race with another's.
template <typename OUT, int BN, typename BF>
__device__ __forceinline__ void beta_staged(const float (&d)[BN / 2], const GemmArgs<OUT>& a, const BF& bf,
                                            unsigned char* stg, int n0) {
    using O = Out<OUT>;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x & 127) >> 5;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        const float2 b = a.bias ? bf.at(j) : make_float2(0.0f, 0.0f);  // (past N: + 0, clipped by the store)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = warp * 16 + (lane >> 2) + 8 * h, c = 8 * j + 2 * (lane & 3), i = 4 * j + 2 * h;
            OUT* p = staged_at<OUT, BN>(stg, r, c);
            float v0 = a.alpha * d[i] + a.beta * O::get(p), v1 = a.alpha * d[i + 1] + a.beta * O::get(p + 1);
            if (a.bias) {
                v0 += b.x;
                v1 += b.y;
            }
            O::put2(p, v0, v1);
        }
    }
}

// The column sums of this warp's 16 rows of the results (v: as stored), in registers: a thread's
// rows r and r + 8, then the 8 lanes holding the same columns (lane % 4) by xor shuffles; lanes 0-3
// write the warp's 16-row sums to row `srow` of a.S (columns past N left alone; rows past M are 0:
// A's zero-filled rows give 0 products, gelu'(0) * 0). Every lane ends with the same bits (a + b is
// b + a), and the finish adds the rows in order: deterministic.
template <typename OUT, int BN>
__device__ __forceinline__ void colsum_warp(const float (&v)[BN / 2], const GemmArgs<OUT>& a, int srow, int n0) {
    const int lane = threadIdx.x & 31;
    float* row = a.S + (ll)srow * a.N;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        float s0 = v[4 * j] + v[4 * j + 2], s1 = v[4 * j + 1] + v[4 * j + 3];
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) {
            s0 += __shfl_xor_sync(0xffffffffu, s0, x);
            s1 += __shfl_xor_sync(0xffffffffu, s1, x);
        }
        const int c = n0 + 8 * j + 2 * lane;
        if (lane < 4 && c < a.N) {
            row[c] = s0;
            if (c + 1 < a.N) row[c + 1] = s1;
        }
    }
}

// FOLD (the _fold instances: the lm head's forward when the classifier is folded into the lm head's
// GEMMs; docs/matmul_notes.md, "The classifier folded into the lm head"). The tile's logits become
// p' = fold_exp(logit, k) (cuda/fold.cuh: 2^(logit log2(e) - k)), k the device scalar *a.fold_k, and 0
// in the columns >= V (llm.c's vocabulary padding: only the last column tile has them, so the others
// take no select). Per row of the tile, one thread of the row's quad writes the sum of its p' to a.FS
// (M, tiles_n): all the classifier's combine needs besides the p' themselves.
template <typename OUT, int BN, bool PAD>
__device__ __forceinline__ void fold_rows(float (&d)[BN / 2], const GemmArgs<OUT>& a, int r0, int vc, float k,
                                          int tile) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int i = 4 * j + 2 * h + c;
                const float p = fold_exp(d[i], k);
                d[i] = !PAD || 8 * j + c < vc ? p : 0.0f;
                s += d[i];
            }
        s += __shfl_xor_sync(0xffffffffu, s, 1);  // the row's quad, in a fixed order
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        const int r = r0 + 8 * h;
        if ((lane & 3) == 0 && r < a.M) a.FS[(ll)r * ((a.N + BN - 1) / BN) + tile] = s;
    }
}

template <typename OUT, int BN>
__device__ __forceinline__ void fold_tile(float (&d)[BN / 2], const GemmArgs<OUT>& a, int m0, int n0) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x & 127) >> 5;
    const int r0 = m0 + warp * 16 + (lane >> 2), c0 = n0 + 2 * (lane & 3);
    const float k = (float)*a.fold_k;
    if (n0 + BN <= a.V)  // (the same for the whole warpgroup)
        fold_rows<OUT, BN, false>(d, a, r0, a.V - c0, k, n0 / BN);
    else  // column 8j + c of this thread is real where 8j + c < V - c0
        fold_rows<OUT, BN, true>(d, a, r0, a.V - c0, k, n0 / BN);
}

// The TMA-store epilogue: the tile's values (alpha, bias) staged and stored through tmC. GELU: then
// gelu(C as stored) through tmG, out of the same staging buffer: the GELU is computed in registers
// while the TMA is still reading C's tile, and the buffer is rewritten once that read is done.
// (Tried and measured slower, 2026-11-26: leaving the staged C in the buffer and turning it into
// gelu(C) in place during the next tile's mainloop, a few column groups after each k-block's wgmmas.
// On the H100 at the d12 fc shape (B=16) the bf16 GEMM went from 0.200 ms (this form) to 0.237 ms,
// slower than the GEMM + gelu_forward's 0.219: the consumers' shared-memory traffic competes with the
// wgmmas' operand reads. fp32: 0.373 here, 0.395 there.)
// DGELU: P's tile is already on its way into the buffer (load_pre, on `pre_bar` with this parity); the
// results replace it there, and with a.S the column sums go out before the store.
// BETA: C's old tile is on its way into the buffer the same way (load_pre on C's map); see beta_staged.
template <typename OUT, int BN, bool GELU = false, bool DGELU = false, bool BETA = false, bool FOLD = false,
          int PARTS = 1, typename BF>
__device__ __forceinline__ void epilogue_tma(float (&d)[BN / 2], const GemmArgs<OUT>& a, const BF& bf,
                                             const CUtensorMap* tmC, const CUtensorMap* tmG, unsigned char* stg, int m0,
                                             int n0, int wg,
                                             uint64_t* pre_bar = nullptr, int pre_parity = 0) {
    static_assert(!(BETA && (GELU || DGELU)), "beta * C with the plain TMA-store epilogue only");
    static_assert(PARTS == 1 || !(GELU || DGELU || BETA || FOLD), "column slices: the plain epilogue only");
    using O = Out<OUT>;
    const int tid = threadIdx.x & 127;
    // GEMM_ALPHA1_SKIP (a -D define; 1, the default; 0: the pass always): no pass over the
    // accumulators when alpha = 1 and there is no bias (1 * x = x: the same bits); the test is uniform
    // (not in the fused-GELU instances, opt-in LLMC_FUSED_GELU: with it, with or without stmatrix, ptxas spilled
    // 8 bytes in the 192-wide one)
    if (!GEMM_ALPHA1_SKIP || GELU || a.alpha != 1.0f || a.bias) {
#pragma unroll
        for (int j = 0; j < (BETA ? 0 : BN / 8); j++) {
            const float2 b = a.bias ? bf.at(j) : make_float2(0.0f, 0.0f);  // (past N: + 0, clipped by the store)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int i = 4 * j + 2 * h;
                float v0 = a.alpha * d[i], v1 = a.alpha * d[i + 1];
                if (a.bias) {
                    v0 += b.x;
                    v1 += b.y;
                }
                d[i] = v0;
                d[i + 1] = v1;
            }
        }
    }
    if constexpr (BETA) {
        mbar_wait(pre_bar, pre_parity);  // C's old tile has landed
        beta_staged<OUT, BN>(d, a, bf, stg, n0);
    } else if constexpr (DGELU) {
        mbar_wait(pre_bar, pre_parity);  // P's tile has landed
        dgelu_staged<OUT, BN>(d, stg);
        if (a.S) colsum_warp<OUT, BN>(d, a, m0 / 16 + ((threadIdx.x & 127) >> 5), n0);
    } else if constexpr (PARTS == 2) {
        // slice 0 staged and stored, then slice 1 once the TMA has read slice 0 out of the buffer
        if (tid == 0) bulk_wait_read();  // the previous tile's last slice has been read
        wg_barrier(wg);
        stage_part<OUT, BN, 2, 0>(d, stg);
        fence_async_smem();
        wg_barrier(wg);
        if (tid == 0) store_tile<OUT, BN / 2>(tmC, stg, m0, n0);
        if (tid == 0) bulk_wait_read();
        wg_barrier(wg);
        stage_part<OUT, BN, 2, 1>(d, stg);
        fence_async_smem();
        wg_barrier(wg);
        if (tid == 0) store_tile<OUT, BN / 2>(tmC, stg, m0, n0 + BN / 2);
        return;
    } else {
        if constexpr (FOLD) fold_tile<OUT, BN>(d, a, m0, n0);  // (before the wait: overlaps the stores' reads)
        if (tid == 0) bulk_wait_read();  // the previous tile's stores have read the staging buffer
        wg_barrier(wg);
        stage_tile<OUT, BN>(d, stg);
    }
    fence_async_smem();
    wg_barrier(wg);
    if (tid == 0) store_tile<OUT, BN>(tmC, stg, m0, n0);
    if constexpr (GELU) {
#pragma unroll
        for (int i = 0; i < BN / 2; i++) d[i] = gelu_fwd_as<OUT>(O::stored(d[i]));
        if (tid == 0) bulk_wait_read();  // C's tile has been read out of the buffer
        wg_barrier(wg);
        stage_tile<OUT, BN>(d, stg);
        fence_async_smem();
        wg_barrier(wg);
        if (tid == 0) store_tile<OUT, BN>(tmG, stg, m0, n0);
    }
}

// The producer warpgroup of both schedules (the cooperative one below and the ping-pong one further
// down): it gives its registers away, and one thread walks the CTA's (tile, K split) units in order,
// loading every k-block of each into the next stage of the ring once the stage is free. ROWS: the A
// box's rows (BM for the cooperative schedule, a consumer's RM for ping-pong). A_MN, A_T, B_T: how
// A and B lie in global memory (the instances' flags; ping-pong has only B_T).
// CL = 2 (the _mc instances, cooperative): a work unit is two tiles stacked along M, one per CTA of the
// cluster (rank r: tile row 2 tm + r; tiles_m counts the pairs), which share the B tile: each CTA's
// producer loads its own A and half of B (every other 64-wide box of B^T stored, or K-major B's rows
// r BN / 2 to (r + 1) BN / 2 through a map whose box is BN / 2 rows), multicast into both CTAs' stages,
// so each CTA asks the L2 for half of B. A stage is refilled only when the consumers of both CTAs have
// freed it (the `empty` barriers count both CTAs' consumer warps). A pair's second tile past M loads the last real tile
// row's A (its products are dropped: the consumers store nothing for it).
template <typename T, int ROWS, int BN, int STAGES, bool A_MN, bool A_T, bool B_T, int CL = 1, typename OUT>
__device__ __forceinline__ void producer(const CUtensorMap* tmA, const CUtensorMap* tmB, const GemmArgs<OUT>& a,
                                         unsigned char* smem, uint64_t* full, uint64_t* empty, int tiles_m,
                                         int tiles_n) {
    static_assert(CL == 1 || (!A_MN && (B_T || (BN / CL) % 8 == 0)),
                  "multicast: B's boxes (B^T's 64-wide ones, or K-major B's rows) split between the cluster's CTAs");
    constexpr int BK = ROW_BYTES / sizeof(T);
    constexpr int B_ROWS = b_rows<BN, B_T>();
    constexpr int A_BYTES = ROWS * ROW_BYTES, STAGE_BYTES = A_BYTES + B_ROWS * ROW_BYTES;
    constexpr int BOX_T = BK_T * ROW_BYTES;  // one MN-major box: 64 MN x BK_T k rows (8 KB)
    static_assert(!A_MN || ROWS == 4 * 32, "A M-major through registers: 4 boxes of 32 rows");
    const int units = tiles_m * tiles_n * a.splits;
    const int kblocks_total = (a.K + BK - 1) / BK;
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x != 0) return;
    tensormap_acquire(tmA);
    tensormap_acquire(tmB);
    const int rank = CL > 1 ? cta_rank() : 0, tiles_real = (a.M + ROWS - 1) / ROWS;
    int stage = 0, phase = 0;
    for (int u = blockIdx.x / CL; u < units; u += gridDim.x / CL) {
        const int split = u % a.splits, t = u / a.splits;
        int tm, tn;
        tile_coords(t, tiles_m, tiles_n, tm, tn);
        if (CL > 1) tm = min(tm * CL + rank, tiles_real - 1);
        const int kb0 = split * a.kb_per_split, kb1 = min(kblocks_total, kb0 + a.kb_per_split);
        for (int kb = kb0; kb < kb1; kb++) {
            mbar_wait(&empty[stage], phase ^ 1);
            mbar_expect_tx(&full[stage], STAGE_BYTES);
            unsigned char* sa = smem + stage * STAGE_BYTES;
            if (A_MN) {  // A^T is stored (K rows of M): 4 boxes of 32 m x BK k
#pragma unroll
                for (int b = 0; b < 4; b++) tma_load_2d(sa + b * 4096, tmA, &full[stage], tm * ROWS + 32 * b, kb * BK);
            } else if (A_T) {  // A^T stored, bf16: ROWS / 64 boxes of 64 m x BK k, one per consumer warpgroup
#pragma unroll
                for (int b = 0; b < ROWS / 64; b++) tma_load_2d(sa + b * BOX_T, tmA, &full[stage], tm * ROWS + 64 * b, kb * BK);
            } else {
                tma_load_2d(sa, tmA, &full[stage], kb * BK, tm * ROWS);  // the A map's box is ROWS rows
            }
            if (B_T) {  // B^T stored (K rows of N), bf16: boxes of 64 n x BK k (3 for the 160-wide tile)
#pragma unroll
                for (int b = 0; b < B_ROWS / 64; b++) {
                    if (CL == 1)
                        tma_load_2d(sa + A_BYTES + b * BOX_T, tmB, &full[stage], tn * BN + 64 * b, kb * BK);
                    else if (b % CL == rank)
                        tma_load_2d_mc(sa + A_BYTES + b * BOX_T, tmB, &full[stage], tn * BN + 64 * b, kb * BK,
                                       (1 << CL) - 1);
                }
            } else if (CL == 1) {
                tma_load_2d(sa + A_BYTES, tmB, &full[stage], kb * BK, tn * BN);
            } else {  // B K-major: the B map's box is BN / CL rows; this CTA's share lands in both CTAs
                tma_load_2d_mc(sa + A_BYTES + rank * (BN / CL) * ROW_BYTES, tmB, &full[stage], kb * BK,
                               tn * BN + rank * (BN / CL), (1 << CL) - 1);
            }
            if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
    }
    // CL > 1: stay until both CTAs' consumers have freed every stage, so that no arrival from the peer
    // CTA comes to this CTA's barriers after it has ended
    if (CL > 1) {
        for (int i = 0; i < STAGES; i++) {
            mbar_wait(&empty[stage], phase ^ 1);
            if (++stage == STAGES) { stage = 0; phase ^= 1; }
        }
    }
}

// T: input type; OUT: output type (fp32, or bf16 for bf16 inputs); A_MN: tf32 A M-major through
// registers; A_T / B_T: bf16 A M-major / B N-major in shared memory (the wgmma's transpose bits);
// GELU: the epilogues also write a.G = gelu(C) (through tmG with the TMA store)
// DGELU: C = gelu'(P) * the product, P through tmG (loaded, not stored; TMA-store instances only, run
// with one K split, beta = 0, C not transposed: the launcher's conditions for the TMA store)
// CL = 2: the _mc instances (clusters of 2 CTAs sharing B tiles; see producer<>)
// FOLD: the cooperative _fold instance (the lm head's forward of the folded classifier; see fold_rows)
template <typename T, typename OUT, int BN, int STAGES, bool TMA_STORE, bool A_MN = false, bool A_T = false,
          bool B_T = false, bool GELU = false, bool DGELU = false, int CL = 1, int PARTS = 1, bool FOLD = false>
__device__ __forceinline__ void gemm_wgmma_body(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC,
                                                const CUtensorMap* tmG, const GemmArgs<OUT>& a) {
    static_assert(!DGELU || (TMA_STORE && !GELU), "the dgelu epilogue stages P where the TMA store stages C");
    constexpr int BK = ROW_BYTES / sizeof(T);       // K per stage: 32 tf32 or 64 bf16
    constexpr int KSTEPS = ROW_BYTES / 32;           // wgmmas per stage (32 bytes of K each)
    constexpr int A_BYTES = BM * ROW_BYTES, B_BYTES = b_rows<BN, B_T>() * ROW_BYTES, STAGE_BYTES = A_BYTES + B_BYTES;
    static_assert(!(A_T || B_T) || (sizeof(T) == 2 && BK == BK_T && BN % 32 == 0),
                  "MN-major tiles: 16-bit inputs, 64- (or 32-) wide boxes of BK_T k rows");
    static_assert(BN % 64 == 0 || (B_T && !GELU && !DGELU), "the 160-wide tile: the dweight layout's plain instances");
    extern __shared__ unsigned char smem_raw[];
    // stages need 1024-byte alignment for the swizzle; the launcher asks for 1 KB extra
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    // with TMA_STORE, each consumer warpgroup's staging buffer (64 x BN outputs) follows the stages
    // (PARTS > 1: a buffer of 64 x BN / PARTS, the tile stored in column slices; the plain epilogue only)
    static_assert(PARTS == 1 || (TMA_STORE && !GELU && !DGELU && CL == 1), "column slices: plain TMA-store instances");
    static_assert(!FOLD || (TMA_STORE && !GELU && !DGELU && CL == 1 && PARTS == 1), "the fold: the plain TMA-store epilogue's");
    constexpr int STG_BYTES = TMA_STORE ? 64 * BN * (int)sizeof(OUT) / PARTS : 0;
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES + 2 * STG_BYTES);
    uint64_t* empty = full + STAGES;
    uint64_t* pre_bar = empty + STAGES;  // TMA store: P's (DGELU) or C's old (beta) tile in each consumer's staging buffer

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);                  // the producer's expect_tx arrival (+ the bytes)
            mbar_init(&empty[s], CONSUMER_WARPS * CL);  // lane 0 of every consumer warp (of every CTA of the cluster)
        }
        if (TMA_STORE) { mbar_init(&pre_bar[0], 1); mbar_init(&pre_bar[1], 1); }  // thread 0 of the consumer's expect_tx
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if constexpr (CL > 1) cluster_sync_all(); else __syncthreads();

    const int tiles_m = (a.M + BM - 1) / BM, tiles_n = (a.N + BN - 1) / BN;
    const int tiles_mc = (tiles_m + CL - 1) / CL;       // CL > 1: rows of tile pairs (one tile per CTA)
    const int units = tiles_mc * tiles_n * a.splits;  // work units: (tile, K split)
    const int kblocks_total = (a.K + BK - 1) / BK;
    const int wg = threadIdx.x / 128;

    if (wg == 0) {
        producer<T, BM, BN, STAGES, A_MN, A_T, B_T, CL>(tmA, tmB, a, smem, full, empty, tiles_mc, tiles_n);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        float d[BN / 2];
        const int lane = threadIdx.x & 31;
        int stage = 0, phase = 0;
        int tiles_done = 0;  // DGELU, beta with the TMA store: the parity of pre_bar
        // beta * C through the TMA (C's old tile loaded into the staging buffer): the TMA store's conditions
        const bool beta_tma = TMA_STORE && PARTS == 1 && !GELU && !DGELU && tmC && a.splits == 1 && a.beta != 0.0f &&
                              !a.trans_c;  // (PARTS > 1: beta * C by the direct stores)
        unsigned char* stg = smem + STAGES * STAGE_BYTES + (wg - 1) * STG_BYTES;
        if (DGELU && (threadIdx.x & 127) == 0) tensormap_acquire(tmG);
        const int rank = CL > 1 ? cta_rank() : 0;
        // a stage is freed by lane 0 of each consumer warp, in every CTA that the stage's loads went to
        auto release = [&](uint64_t* bar) {
            if constexpr (CL == 1) {
                mbar_arrive(bar);
            } else {
#pragma unroll
                for (int r = 0; r < CL; r++) mbar_arrive_cluster(bar, r);
            }
        };
        // stage 0's descriptors (GEMM_DESC_STEP): this warpgroup's 64 rows of A, and B
        const uint32_t a_lo0 = wgmma_desc_lo(smem + (wg - 1) * 64 * ROW_BYTES, A_T ? BK_T * ROW_BYTES : 16);
        const uint32_t b_lo0 = wgmma_desc_lo(smem + A_BYTES, B_T ? BK_T * ROW_BYTES : 16);
        for (int u = blockIdx.x / CL; u < units; u += gridDim.x / CL) {
            const int split = u % a.splits, t = u / a.splits;
            int tm, tn;
            tile_coords(t, tiles_mc, tiles_n, tm, tn);
            if (CL > 1) tm = tm * CL + rank;
            const bool live = CL == 1 || tm < tiles_m;  // (a pair's second tile past M: computed, not stored)
            const int kb0 = split * a.kb_per_split, kb1 = min(kblocks_total, kb0 + a.kb_per_split);
            BiasFrag<OUT, BN, bias_in_regs<OUT, BN, BN / 2, GELU ? 120 : 144>() ? BIAS_REGS : BIAS_LANES> bf;
            bf.fetch(a, tn * BN);
            int prev = -1;
            for (int kb = kb0; kb < kb1; kb++) {
                mbar_wait(&full[stage], phase);
                const unsigned char* sa = smem + stage * STAGE_BYTES + (wg - 1) * 64 * ROW_BYTES;
                const unsigned char* sb = smem + stage * STAGE_BYTES + A_BYTES;
                if constexpr (A_MN) {
                    uint32_t af[KSTEPS][4];
#pragma unroll
                    for (int ks = 0; ks < KSTEPS; ks++)
                        load_a_mn(af[ks], smem + stage * STAGE_BYTES, (wg - 1) * 64, ks);
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < KSTEPS; ks++)
                        WgmmaRS<BN>::run(d, af[ks], smem_desc(sb + 32 * ks), (kb > kb0 || ks > 0) ? 1 : 0);
                } else if constexpr (GEMM_DESC_STEP) {
                    // (A_T, B_T: an MN-major operand advances 16 k rows, two 1024-byte atoms, per k-step;
                    // this warpgroup's 64 rows of an MN-major A are box wg - 1, the same 8 KB offset as K-major)
                    const uint32_t so = stage * (STAGE_BYTES >> 4);
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < KSTEPS; ks++)
                        Wgmma<T, BN, A_T, B_T>::run(d, desc_of(a_lo0 + so + desc_kstep<A_T>(ks)),
                                                    desc_of(b_lo0 + so + desc_kstep<B_T>(ks)),
                                                    (kb > kb0 || ks > 0) ? 1 : 0);
                } else if constexpr (A_T || B_T) {
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < KSTEPS; ks++)
                        Wgmma<T, BN, A_T, B_T>::run(d, A_T ? smem_desc_mn(sa + ks * 16 * ROW_BYTES) : smem_desc(sa + 32 * ks),
                                                    B_T ? smem_desc_mn(sb + ks * 16 * ROW_BYTES) : smem_desc(sb + 32 * ks),
                                                    (kb > kb0 || ks > 0) ? 1 : 0);
                } else {
                    wgmma_fence();
#pragma unroll
                    for (int ks = 0; ks < KSTEPS; ks++)
                        Wgmma<T, BN>::run(d, smem_desc(sa + 32 * ks), smem_desc(sb + 32 * ks), (kb > kb0 || ks > 0) ? 1 : 0);
                }
                wgmma_commit();
                // DGELU: P's tile asked for once the first k-block's products are issued (by then the
                // previous tile's stores have most likely read the staging buffer: load_pre waits for that)
                if ((DGELU || beta_tma) && live && kb == kb0 && (threadIdx.x & 127) == 0)
                    load_pre<OUT, BN>(DGELU ? tmG : tmC, stg, &pre_bar[wg - 1], tm * BM + (wg - 1) * 64, tn * BN);
                if constexpr (A_MN) {
                    // A's fragments are registers that the wgmma reads while it runs, and the next
                    // k-block's loads would reuse them (the compiler sees them dead after the asm):
                    // wait for this block's products before going on (measured wrong without it)
                    wgmma_wait<0>();
                    if (lane == 0) release(&empty[stage]);
                    prev = -1;
                } else {
                    wgmma_wait<1>();  // the previous k-block's products are done: its stage can be refilled
                    if (prev >= 0 && lane == 0) release(&empty[prev]);
                    prev = stage;
                }
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            wgmma_wait<0>();
            if (prev >= 0 && lane == 0) release(&empty[prev]);
            keep_in_regs(d);
            if (!live) continue;
            if (kb1 <= kb0) {  // an empty K range (only if K splits outnumber k-blocks): contributes 0
#pragma unroll
                for (int i = 0; i < BN / 2; i++) d[i] = 0.0f;
            }
            // the TMA store takes plain results (no split-K partials, no beta * C read, not transposed)
            if (DGELU)  // (the launcher gives it one split, no beta, C not transposed, both maps)
                epilogue_tma<OUT, BN, false, true>(d, a, bf, tmC, nullptr, stg, tm * BM + (wg - 1) * 64, tn * BN, wg,
                                                   &pre_bar[wg - 1], tiles_done & 1);
            else if (TMA_STORE && tmC && (!GELU || tmG) && a.splits == 1 && a.beta == 0.0f && !a.trans_c)
                epilogue_tma<OUT, BN, GELU, false, false, FOLD, PARTS>(d, a, bf, tmC, tmG, stg, tm * BM + (wg - 1) * 64,
                                                                      tn * BN, wg);
            else if (beta_tma)
                epilogue_tma<OUT, BN, false, false, !GELU && !DGELU>(d, a, bf, tmC, nullptr, stg, tm * BM + (wg - 1) * 64,
                                                                     tn * BN, wg, &pre_bar[wg - 1], tiles_done & 1);
            else
                epilogue<OUT, BN, GELU>(d, a, bf, tm * BM + (wg - 1) * 64, tn * BN, split);
            tiles_done++;
        }
        if (TMA_STORE && (threadIdx.x & 127) == 0) bulk_wait_all();  // C is written before the CTA ends
    }
}

// shared memory a (T, BN, STAGES) instance needs: the stages, 2 mbarriers each, 1 KB for alignment
// (TMA-store instances: + the two staging buffers and the two mbarriers of their staged loads)
// tmC: the TMA map of C (or nullptr: direct stores); used only by the _ts instances
// OUT: the type of C and bias (fp32; bf16 in the _bf16 instances, which take bf16 inputs)
#define GEMM_WGMMA_ENTRY(NAME, T, OUT, BN, STAGES, TMA_STORE, ...)                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                             \
    NAME(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC, OUT* C, const OUT* bias, \
         float* W, int M, int N, int K, int ldc, int ldw, int splits, int kb_per_split, float alpha,     \
         float beta, int trans_c) { LLMC_PDL_WAIT();                                                      \
        const GemmArgs<OUT> a{C, bias, W, M, N, K, ldc, ldw, splits, kb_per_split, alpha, beta, trans_c}; \
        gemm_wgmma_body<T, OUT, BN, STAGES, TMA_STORE, ##__VA_ARGS__>(tmA, tmB, tmC, nullptr, a);        \
    }

// stages: as many as fit in ~200 KB (A 16 KB + B BN*128 bytes each); the _ts (TMA store) instances
// give 2 x 64 x BN x sizeof(OUT) bytes of that to the staging buffers. llmc/ops/gemm_wgmma.py keeps the
// same table (INSTANCES; tests/test_gemm_wgmma.py checks they agree).
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n128, float, float, 128, 6, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n192, float, float, 192, 5, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n256, float, float, 256, 4, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n128_ts, float, float, 128, 5, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n192_ts, float, float, 192, 3, true)
// A M-major (A^T stored, as dout is for dweight = dout^T @ inp), tf32 only, through registers
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n128_am, float, float, 128, 6, false, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n192_am, float, float, 192, 5, false, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_tf32_n256_am, float, float, 256, 4, false, true)
// bf16 inputs, fp32 output (the lab's BF16 rows)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128, __nv_bfloat16, float, 128, 6, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192, __nv_bfloat16, float, 192, 5, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n256, __nv_bfloat16, float, 256, 4, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128_ts, __nv_bfloat16, float, 128, 5, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192_ts, __nv_bfloat16, float, 192, 3, true)
// bf16 in, bf16 out (the bf16 trainer). The staging buffer of a _ts instance is half the fp32 one's,
// so one more stage fits (128: 6 x 32 KB + 32 KB; 192: 4 x 40 KB + 48 KB).
// both K-major: the forward, out (N,OC) = inp (N,C) @ weight (OC,C)^T
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192_bf16, __nv_bfloat16, __nv_bfloat16, 192, 5, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n256_bf16, __nv_bfloat16, __nv_bfloat16, 256, 4, false)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128_ts_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192_ts_bf16, __nv_bfloat16, __nv_bfloat16, 192, 4, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n256_ts_bf16, __nv_bfloat16, __nv_bfloat16, 256, 3, true)  // (3 stages + 2 x 32 KB of staging)
// B N-major (B^T stored): dinp (N,C) = dout (N,OC) @ weight (OC,C), weight read as it lies
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128_bt_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, false, false, false, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192_bt_bf16, __nv_bfloat16, __nv_bfloat16, 192, 5, false, false, false, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n256_bt_bf16, __nv_bfloat16, __nv_bfloat16, 256, 4, false, false, false, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, true, false, false, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 192, 4, true, false, false, true)
// (256 wide with the TMA store: 3 stages + 2 x 32 KB of staging, as the forward layout's; planned only with LLMC_WGMMA_BT256=1)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n256_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 256, 3, true, false, false, true)
// A M-major and B N-major (A^T and B^T stored): dweight (OC,C) += dout^T @ inp, both read as they lie
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128_at_bt_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, false, false, true, true)
// (160 wide: 5 tiles across GPT-2's 768 columns, so fc's and fcproj's dweights are 120 tiles, not 96 of 192)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n160_at_bt_bf16, __nv_bfloat16, __nv_bfloat16, 160, 5, false, false, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192_at_bt_bf16, __nv_bfloat16, __nv_bfloat16, 192, 5, false, false, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n256_at_bt_bf16, __nv_bfloat16, __nv_bfloat16, 256, 4, false, false, true, true)
// ... with the TMA store: the accumulating dweight GEMM (beta = 1) loads C's old tile by the TMA too
// (64 wide: a dweight of few tiles, attproj's 768 x 768 at B=4, on 72 CTAs instead of 36 of 128 x 128)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n64_at_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 64, 8, true, false, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n128_at_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, true, false, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n160_at_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 160, 4, true, false, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n192_at_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 192, 4, true, false, true, true)
GEMM_WGMMA_ENTRY(gemm_wgmma_bf16_n256_at_bt_ts_bf16, __nv_bfloat16, __nv_bfloat16, 256, 3, true, false, true, true)

// Clusters of two CTAs (`__cluster_dims__(2, 1, 1)`; the grid is a multiple of 2): the two tiles of a
// pair, stacked along M, share their B tile, each CTA's producer loading half of it by TMA multicast into
// both (see producer<>); with the TMA store (beta through it), as the plain _ts ones. The dweight layout
// (A_T, B_T) at its TMA-store widths; the forward's (K-major) and dinp's (B_T) 256-wide tile (session 42).
#define GEMM_WGMMA_MC_ENTRY(NAME, BN, STAGES, A_T, B_T)                                                   \
    extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS, 1)                   \
    NAME(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC, __nv_bfloat16* C,       \
         const __nv_bfloat16* bias, float* W, int M, int N, int K, int ldc, int ldw, int splits,        \
         int kb_per_split, float alpha, float beta, int trans_c) { LLMC_PDL_WAIT();                       \
        const GemmArgs<__nv_bfloat16> a{C, bias, W, M, N, K, ldc, ldw, splits, kb_per_split, alpha, beta, trans_c}; \
        gemm_wgmma_body<__nv_bfloat16, __nv_bfloat16, BN, STAGES, true, false, A_T, B_T, false, false, 2>(     \
            tmA, tmB, tmC, nullptr, a);                                                                  \
    }
GEMM_WGMMA_MC_ENTRY(gemm_wgmma_bf16_n128_at_bt_ts_mc_bf16, 128, 6, true, true)
GEMM_WGMMA_MC_ENTRY(gemm_wgmma_bf16_n160_at_bt_ts_mc_bf16, 160, 4, true, true)
GEMM_WGMMA_MC_ENTRY(gemm_wgmma_bf16_n192_at_bt_ts_mc_bf16, 192, 4, true, true)
GEMM_WGMMA_MC_ENTRY(gemm_wgmma_bf16_n256_ts_mc_bf16, 256, 3, false, false)
GEMM_WGMMA_MC_ENTRY(gemm_wgmma_bf16_n256_bt_ts_mc_bf16, 256, 3, false, true)

// The bf16 forward's (K-major) and dinp's (B_T) 256-wide TMA-store tile with 4 stages (_s4): the tile
// stored in two column slices of 128 through a staging buffer of 64 x 128 a consumer (16 KB, not 32),
// which frees the fourth stage (4 x 48 KB + 32 KB of staging). Plain outputs (beta * C by the direct
// stores); the planner takes them with LLMC_WGMMA_TS256_S4=1 (session 43, H200: whole bf16 steps +0.5% at
// B=16, level at B=4; opt-in).
#define GEMM_WGMMA_S4_ENTRY(NAME, B_T)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                             \
    NAME(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC, __nv_bfloat16* C,       \
         const __nv_bfloat16* bias, float* W, int M, int N, int K, int ldc, int ldw, int splits,        \
         int kb_per_split, float alpha, float beta, int trans_c) { LLMC_PDL_WAIT();                       \
        const GemmArgs<__nv_bfloat16> a{C, bias, W, M, N, K, ldc, ldw, splits, kb_per_split, alpha, beta, trans_c}; \
        gemm_wgmma_body<__nv_bfloat16, __nv_bfloat16, 256, 4, true, false, false, B_T, false, false, 1, 2>(   \
            tmA, tmB, tmC, nullptr, a);                                                                  \
    }
GEMM_WGMMA_S4_ENTRY(gemm_wgmma_bf16_n256_ts_s4_bf16, false)
GEMM_WGMMA_S4_ENTRY(gemm_wgmma_bf16_n256_bt_ts_s4_bf16, true)

// The fc layer's fused form (matmul_forward with gelu_pre=True): both K-major, C = the pre-activation
// (fch, which gelu_backward reads) and G = gelu(C) (fch_gelu) from one epilogue, instead of a
// gelu_forward launch re-reading C. The arguments of GEMM_WGMMA_ENTRY plus G's TMA map (tmG, used by
// the _ts instances) and G. The stages are the plain instances': the TMA-store epilogue stages G in
// C's buffer after C has left it. Split-K runs the plain instance and gemm_wgmma_splitk_reduce_gelu.
#define GEMM_WGMMA_GELU_ENTRY(NAME, T, OUT, BN, STAGES, TMA_STORE)                                       \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                             \
    NAME(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC, const CUtensorMap* tmG, \
         OUT* C, OUT* G, const OUT* bias, float* W, int M, int N, int K, int ldc, int ldw, int splits,   \
         int kb_per_split, float alpha, float beta, int trans_c) { LLMC_PDL_WAIT();                       \
        const GemmArgs<OUT> a{C, bias, W, M, N, K, ldc, ldw, splits, kb_per_split, alpha, beta, trans_c, G}; \
        gemm_wgmma_body<T, OUT, BN, STAGES, TMA_STORE, false, false, false, true>(tmA, tmB, tmC, tmG, a); \
    }

// llmc/ops/gemm_wgmma.py: GELU_INSTANCES (a CPU test checks they agree)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_tf32_n128_gelu, float, float, 128, 6, false)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_tf32_n192_gelu, float, float, 192, 5, false)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_tf32_n256_gelu, float, float, 256, 4, false)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_tf32_n128_ts_gelu, float, float, 128, 5, true)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_tf32_n192_ts_gelu, float, float, 192, 3, true)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_bf16_n128_gelu_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, false)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_bf16_n192_gelu_bf16, __nv_bfloat16, __nv_bfloat16, 192, 5, false)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_bf16_n256_gelu_bf16, __nv_bfloat16, __nv_bfloat16, 256, 4, false)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_bf16_n128_ts_gelu_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, true)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_bf16_n192_ts_gelu_bf16, __nv_bfloat16, __nv_bfloat16, 192, 4, true)
GEMM_WGMMA_GELU_ENTRY(gemm_wgmma_bf16_n256_ts_gelu_bf16, __nv_bfloat16, __nv_bfloat16, 256, 3, true)

// The fcproj layer's fused backward (matmul_backward with dgelu=True): dinp's GEMM with gelu_backward
// in its epilogue, C = gelu'(P) * (A @ B^T as stored), P = fch through tmP (loaded into the staging
// buffer; see DGELU above), and with S the column sums of C (fc's bias gradient) as 16-row partials,
// added up by gemm_wgmma_colsum_finish. TMA-store instances of dinp's layouts: tf32 K-major (dinp
// after weight^T), bf16 B N-major (_bt). Shared memory: the plain instance's plus two mbarriers.
#define GEMM_WGMMA_DGELU_ENTRY(NAME, T, OUT, BN, STAGES, B_T)                                             \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                             \
    NAME(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC, const CUtensorMap* tmP, \
         OUT* C, float* S, int M, int N, int K, int ldc, float alpha) { LLMC_PDL_WAIT();                  \
        const GemmArgs<OUT> a{C, nullptr, nullptr, M, N, K, ldc, 0, 1, (K + ROW_BYTES / (int)sizeof(T) - 1) / \
                              (ROW_BYTES / (int)sizeof(T)), alpha, 0.0f, 0, nullptr, S};                  \
        gemm_wgmma_body<T, OUT, BN, STAGES, true, false, false, B_T, false, true>(tmA, tmB, tmC, tmP, a);  \
    }

// llmc/ops/gemm_wgmma.py: DGELU_INSTANCES (a CPU test checks they agree)
GEMM_WGMMA_DGELU_ENTRY(gemm_wgmma_tf32_n128_ts_dgelu, float, float, 128, 5, false)
GEMM_WGMMA_DGELU_ENTRY(gemm_wgmma_tf32_n192_ts_dgelu, float, float, 192, 3, false)
GEMM_WGMMA_DGELU_ENTRY(gemm_wgmma_bf16_n128_bt_ts_dgelu_bf16, __nv_bfloat16, __nv_bfloat16, 128, 6, true)
GEMM_WGMMA_DGELU_ENTRY(gemm_wgmma_bf16_n192_bt_ts_dgelu_bf16, __nv_bfloat16, __nv_bfloat16, 192, 4, true)

// ------------------------------------------------------------------------------------------------
// Ping-pong consumers (the _pp instances): each consumer warpgroup owns whole tiles
//
// The instances above split one 128 x BN tile between the two consumer warpgroups, so both run the
// mainloop together and then both run the epilogue together: during the epilogue and the start of
// the next tile the tensor cores idle. At K = 768 that is what the short-K GEMMs lose (ncu: 63-68% of
// the SM's peak against 95% for the long-K lm head). Here each consumer owns its own tile of RM x BN
// (RM = 64: one m64 wgmma per k-step; RM = 128: two, sharing the B tile), the two consumers take
// alternate tiles of the CTA's persistent sequence, and they take turns on the tensor cores: while
// one runs its mainloop, the other runs its epilogue. The producer is the one above (producer<>),
// with an A box of RM rows: one thread loads the k-blocks of every tile of the sequence in order,
// whichever consumer owns the tile. The epilogue is the direct-store one above (no TMA store: the
// epilogue is hidden behind the other consumer's mainloop, which is the point).
//
// The protocol. The CTA's work units are j = 0, 1, 2, ... (u = blockIdx.x + j * gridDim.x);
// consumer c = wg - 1 owns the units with j % 2 == c.
//
//   ring position  Every k-block of every unit takes the next position p of the stage ring, in unit
//                  order: stage p % STAGES, lap p / STAGES, mbarrier parity lap & 1. The producer and
//                  both consumers walk the whole unit sequence, so each knows p for every k-block; a
//                  consumer steps over the positions of the other's units (ring_advance).
//   full[s]        count 1: the producer's arrive.expect_tx plus the TMA's bytes. The owner of
//                  position p waits on full[p % STAGES] for parity lap & 1.
//   empty[s]       count 4: lane 0 of each warp of the consumer that owns position p arrives once the
//                  wgmmas reading the stage have retired. The producer waits for parity (lap & 1) ^ 1
//                  before it loads position p (that is the release of position p - STAGES; on the
//                  first lap a fresh barrier's "phase -1" counts as complete).
//   MAIN_BAR + c   named barrier, 256 threads: bar.sync by consumer c's 128, bar.arrive by the
//                  other's 128. "Consumer c may start its mainloop." The owner of unit j > 0 syncs on
//                  it before its first full wait; the owner of unit j arrives on the other consumer's
//                  once it has issued unit j's last wgmma (before they retire), if unit j + 1 exists.
//   EPI_BAR + c    the same for the epilogue: unit j's epilogue starts after unit j - 1's is done, so
//                  the two consumers alternate mainloop / epilogue instead of drifting into step.
//
// Why the mainloop turn is needed for correctness, not only for the schedule: a parity wait cannot
// tell lap L from lap L - 2. A consumer waiting on full[s] for lap L must know that lap L - 1 of
// full[s] has completed, else the barrier still shows lap L - 2's parity and the wait passes on stale
// data (without the turn, a consumer whose previous tile is done could run ahead while the other's
// long tile still holds positions of lap L - 1). With the turn, the owner of unit j starts only after
// unit j - 1's owner has passed its full waits for every position before unit j, so every position
// before p has completed; and lap L + 1 of s can't complete before this consumer releases position p
// (the producer waits on empty). The empty barriers see one consumer per lap: all arrivals for lap L
// of s come from the owner of position p, and the next owner of s can't arrive before the producer
// refilled s, which it does only after lap L's release; so the count of 4 never mixes consumers. The
// producer's own empty waits are as in the instances above: it waited for lap L - 2's release itself.
//
// Named barriers count arrivals: an arrive with nobody waiting yet is remembered, but a second arrive
// on the same barrier before the sync would complete it wrongly. The turns rule that out: c arrives on
// the other's barrier after unit j and next after unit j + 2, and in between it syncs on its own,
// which the other arrives on only after its own sync for unit j + 1. Every arrive has exactly one
// matching sync (both are skipped at the ends of the sequence), so no barrier is left half-arrived
// when the CTA exits. Ids 1 and 2 belong to wg_barrier (the TMA-store epilogue), 0 to __syncthreads.
constexpr int MAIN_BAR = 3, EPI_BAR = 5;
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }

// n more positions of the ring: the stage and the parity of its lap
template <int STAGES>
__device__ __forceinline__ void ring_advance(int& stage, int& phase, int n) {
    const int s = stage + n;
    phase ^= (s / STAGES) & 1;
    stage = s % STAGES;
}

// T: input type; OUT: output type; RM: rows of a consumer's tile (64 or 128); B_T: bf16 B N-major.
// TMA_STORE (the _ts_pp instances): each consumer stages its tile, 64 rows at a time, in a buffer of its
// own after the stages and writes it with the TMA (epilogue_tma), during the other consumer's mainloop;
// plain outputs only (one K split, beta = 0, C not transposed: the launcher's conditions), else the
// epilogue stores from registers as in the other instances.
template <typename T, typename OUT, int RM, int BN, int STAGES, bool B_T = false, bool TMA_STORE = false,
          bool FOLD = false>
__device__ __forceinline__ void gemm_wgmma_pp_body(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC,
                                                   const GemmArgs<OUT>& a) {
    constexpr int BK = ROW_BYTES / sizeof(T);        // K per stage: 32 tf32 or 64 bf16
    constexpr int KSTEPS = ROW_BYTES / 32;            // wgmma k-steps per stage (32 bytes of K each)
    constexpr int SUB = RM / 64;                      // m64 wgmmas per k-step
    constexpr int A_BYTES = RM * ROW_BYTES, B_BYTES = BN * ROW_BYTES, STAGE_BYTES = A_BYTES + B_BYTES;
    static_assert(RM == 64 || RM == 128, "a consumer's tile is 64 or 128 rows");
    static_assert(!B_T || (sizeof(T) == 2 && BK == BK_T && BN % 64 == 0), "MN-major B: 16-bit inputs, 64-wide boxes");
    static_assert(!FOLD || TMA_STORE, "the fold epilogue is the TMA-store one's");
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    constexpr int STG_BYTES = TMA_STORE ? 64 * BN * (int)sizeof(OUT) : 0;  // a consumer's staging buffer
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * STAGE_BYTES + 2 * STG_BYTES);
    uint64_t* empty = full + STAGES;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            mbar_init(&full[s], 1);   // the producer's expect_tx arrival (+ the bytes)
            mbar_init(&empty[s], 4);  // lane 0 of each warp of the one consumer that owns the position
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    const int tiles_m = (a.M + RM - 1) / RM, tiles_n = (a.N + BN - 1) / BN;
    const int units = tiles_m * tiles_n * a.splits;
    const int kblocks_total = (a.K + BK - 1) / BK;
    const int wg = threadIdx.x / 128;

    if (wg == 0) {
        producer<T, RM, BN, STAGES, false, false, B_T>(tmA, tmB, a, smem, full, empty, tiles_m, tiles_n);
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
        float d[SUB][BN / 2];
        const int c = wg - 1, lane = threadIdx.x & 31;
        int stage = 0, phase = 0;
        const bool use_tma = TMA_STORE && tmC && a.splits == 1 && a.beta == 0.0f && !a.trans_c;
        unsigned char* stg = smem + STAGES * STAGE_BYTES + c * STG_BYTES;
        const uint32_t a_lo0 = wgmma_desc_lo(smem, 16), b_lo0 = wgmma_desc_lo(smem + A_BYTES, B_T ? BK_T * ROW_BYTES : 16);
        int j = 0;
        for (int u = blockIdx.x; u < units; u += gridDim.x, j++) {
            const int split = u % a.splits, t = u / a.splits;
            const int kb0 = split * a.kb_per_split, kb1 = min(kblocks_total, kb0 + a.kb_per_split);
            if ((j & 1) != c) {  // the other consumer's unit: step over its ring positions
                ring_advance<STAGES>(stage, phase, max(kb1 - kb0, 0));
                continue;
            }
            const bool more = u + gridDim.x < units;  // unit j + 1 exists (the other consumer's)
            int tm, tn;
            tile_coords(t, tiles_m, tiles_n, tm, tn);
            // the bias into registers: while this consumer waits for its turn (EARLY; the tiles of 128
            // accumulators spread over lanes, BIAS_LANES), or once its products are done (LATE)
            constexpr bool EARLY = bias_in_regs<OUT, BN, SUB * BN / 2, 120>();
            constexpr bool LATE = !EARLY && SUB * BN / 2 <= 96 && bias_in_regs<OUT, BN, SUB * BN / 2, 144>();
            BiasFrag<OUT, BN, EARLY || LATE ? BIAS_REGS : BIAS_LANES> bf;
            if constexpr (!LATE) bf.fetch(a, tn * BN);
            if (j > 0) named_sync(MAIN_BAR + c);  // unit j - 1 has issued all its wgmmas
            int prev = -1;
            for (int kb = kb0; kb < kb1; kb++) {
                mbar_wait(&full[stage], phase);
                const unsigned char* sa = smem + stage * STAGE_BYTES;
                const unsigned char* sb = sa + A_BYTES;
                const uint32_t so = stage * (STAGE_BYTES >> 4);
                wgmma_fence();
#pragma unroll
                for (int ks = 0; ks < KSTEPS; ks++)
#pragma unroll
                    for (int s = 0; s < SUB; s++) {
                        if constexpr (GEMM_DESC_STEP)  // (smem_desc_mn's note above; A: sub-tile s, 64 rows on)
                            Wgmma<T, BN, 0, B_T>::run(d[s], desc_of(a_lo0 + so + (s * 64 * ROW_BYTES >> 4) + desc_kstep<false>(ks)),
                                                      desc_of(b_lo0 + so + desc_kstep<B_T>(ks)), (kb > kb0 || ks > 0) ? 1 : 0);
                        else
                            Wgmma<T, BN, 0, B_T>::run(d[s], smem_desc(sa + s * 64 * ROW_BYTES + 32 * ks),
                                                      B_T ? smem_desc_mn(sb + ks * 16 * ROW_BYTES) : smem_desc(sb + 32 * ks),
                                                      (kb > kb0 || ks > 0) ? 1 : 0);
                    }
                wgmma_commit();
                wgmma_wait<1>();  // the previous k-block's products are done: its stage can be refilled
                if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
                prev = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            }
            // the tensor cores are the other consumer's now: our last products drain while it starts
            if (more) named_arrive(MAIN_BAR + (c ^ 1));
            wgmma_wait<0>();
            if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
#pragma unroll
            for (int s = 0; s < SUB; s++) keep_in_regs(d[s]);
            if (kb1 <= kb0) {  // an empty K range (only if K splits outnumber k-blocks): contributes 0
#pragma unroll
                for (int s = 0; s < SUB; s++)
#pragma unroll
                    for (int i = 0; i < BN / 2; i++) d[s][i] = 0.0f;
            }
            if constexpr (LATE) bf.fetch(a, tn * BN);
            if (j > 0) named_sync(EPI_BAR + c);  // unit j - 1's epilogue is done
#pragma unroll
            for (int s = 0; s < SUB; s++) {
                if (use_tma)  // (waits for its previous stores to have read the buffer first)
                    epilogue_tma<OUT, BN, false, false, false, FOLD>(d[s], a, bf, tmC, nullptr, stg, tm * RM + 64 * s,
                                                                     tn * BN, wg);
                else
                    epilogue<OUT, BN>(d[s], a, bf, tm * RM + 64 * s, tn * BN, split);
            }
            if (more) named_arrive(EPI_BAR + (c ^ 1));
        }
        if (use_tma && (threadIdx.x & 127) == 0) bulk_wait_all();  // C is written before the CTA ends
    }
}

// the same parameters as GEMM_WGMMA_ENTRY (tmC: the TMA-store instances' map of C, else unused), so
// the launcher and its argument types are shared
#define GEMM_WGMMA_PP_ENTRY(NAME, T, OUT, RM, BN, STAGES, B_T, TMA_STORE)                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                             \
    NAME(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC, OUT* C, const OUT* bias, \
         float* W, int M, int N, int K, int ldc, int ldw, int splits, int kb_per_split, float alpha,     \
         float beta, int trans_c) { LLMC_PDL_WAIT();                                                      \
        const GemmArgs<OUT> a{C, bias, W, M, N, K, ldc, ldw, splits, kb_per_split, alpha, beta, trans_c}; \
        gemm_wgmma_pp_body<T, OUT, RM, BN, STAGES, B_T, TMA_STORE>(tmA, tmB, tmC, a);                     \
    }

// consumer tiles 64 x 192 / 64 x 256 (one wgmma per k-step) and 128 x 128 (two); stages: as many as
// fit in 227 KB (64 x 192 and 128 x 128: 32 KB each, 7 stages; 64 x 256: 40 KB, 5). llmc/ops/gemm_wgmma.py
// keeps the same table (PP_INSTANCES; a CPU test checks they agree).
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_tf32_n192_pp64, float, float, 64, 192, 7, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_tf32_n256_pp64, float, float, 64, 256, 5, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_tf32_n128_pp128, float, float, 128, 128, 7, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n192_pp64, __nv_bfloat16, float, 64, 192, 7, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n256_pp64, __nv_bfloat16, float, 64, 256, 5, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n128_pp128, __nv_bfloat16, float, 128, 128, 7, false, false)
// bf16 in and out: the forward (both K-major) and dinp (B N-major: weight read as it lies)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n192_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 192, 7, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n256_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 256, 5, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n128_pp128_bf16, __nv_bfloat16, __nv_bfloat16, 128, 128, 7, false, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n192_bt_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 192, 7, true, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n256_bt_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 256, 5, true, false)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n128_bt_pp128_bf16, __nv_bfloat16, __nv_bfloat16, 128, 128, 7, true, false)
// ... with the TMA store (bf16 out): a staging buffer of 64 x BN per consumer takes a stage or two
// (64 x 192: 5 stages + 2 x 24 KB; 64 x 256: 4 + 2 x 32 KB; 128 x 128: 6 + 2 x 16 KB, in two halves)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n192_ts_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 192, 5, false, true)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n256_ts_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 256, 4, false, true)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n128_ts_pp128_bf16, __nv_bfloat16, __nv_bfloat16, 128, 128, 6, false, true)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n192_bt_ts_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 192, 5, true, true)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n256_bt_ts_pp64_bf16, __nv_bfloat16, __nv_bfloat16, 64, 256, 4, true, true)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_bf16_n128_bt_ts_pp128_bf16, __nv_bfloat16, __nv_bfloat16, 128, 128, 6, true, true)
// ... and tf32 -> fp32, 128 x 128 only (fp32 staging: 2 x 32 KB beside 5 stages; the cooperative 128-wide
// TMA-store instance has the same 5 stages and 64 KB of staging, so the two differ only in the schedule)
GEMM_WGMMA_PP_ENTRY(gemm_wgmma_tf32_n128_ts_pp128, float, float, 128, 128, 5, false, true)

// The lm head's forward when the classifier is folded into it (FOLD above): C gets p', FS the tile
// sums; k is read from fold_k. One K split, beta = 0, no bias (llmc/ops/gemm_wgmma.py: FOLD_INSTANCES).
// (one entry macro for both schedules: BODY is the body's call, with a the GemmArgs)
#define GEMM_WGMMA_FOLD_ENTRY_(NAME, T, OUT, BODY)                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                             \
    NAME(const CUtensorMap* tmA, const CUtensorMap* tmB, const CUtensorMap* tmC, OUT* C, float* FS,     \
         const int* fold_k, int M, int N, int K, int ldc, int V) { LLMC_PDL_WAIT();                      \
        const int kb = (K + ROW_BYTES / (int)sizeof(T) - 1) / (ROW_BYTES / (int)sizeof(T));             \
        GemmArgs<OUT> a{C, nullptr, nullptr, M, N, K, ldc, 0, 1, kb, 1.0f, 0.0f, 0};                     \
        a.FS = FS; a.fold_k = fold_k; a.V = V;                                                           \
        BODY;                                                                                            \
    }
#define GEMM_WGMMA_FOLD_ENTRY(NAME, T, OUT, STAGES)                                                      \
    GEMM_WGMMA_FOLD_ENTRY_(NAME, T, OUT, (gemm_wgmma_pp_body<T, OUT, 128, 128, STAGES, false, true, true>(tmA, tmB, tmC, a)))
GEMM_WGMMA_FOLD_ENTRY(gemm_wgmma_tf32_n128_ts_pp128_fold, float, float, 5)
GEMM_WGMMA_FOLD_ENTRY(gemm_wgmma_bf16_n128_ts_pp128_fold_bf16, __nv_bfloat16, __nv_bfloat16, 6)
// ... and on the cooperative 128 x 256 TMA-store tile (the plain bf16 forward's 256-wide instance: 3 stages;
// FS then holds a sum per 256-wide tile), taken with LLMC_WGMMA_FOLD256=1
#define GEMM_WGMMA_COOP_FOLD_ENTRY(NAME, T, OUT, BN, STAGES)                                              \
    GEMM_WGMMA_FOLD_ENTRY_(NAME, T, OUT, (gemm_wgmma_body<T, OUT, BN, STAGES, true, false, false, false, false, false, \
                                                          1, 1, true>(tmA, tmB, tmC, nullptr, a)))
GEMM_WGMMA_COOP_FOLD_ENTRY(gemm_wgmma_bf16_n256_ts_fold_bf16, __nv_bfloat16, __nv_bfloat16, 256, 3)

// ------------------------------------------------------------------------------------------------
// helpers the engine's launcher uses

// C = alpha * sum_s W[s] (+ bias) (+ beta * C), the splits added in order (deterministic); with
// trans_c, C^T is what is stored. The _bf16 instance: C and bias bf16, everything added in fp32, one
// rounding on the store. GELU (the _gelu instances, the fc layer's fused form): also G = gelu(C as stored).
template <typename OUT, bool GELU = false>
__device__ __forceinline__ void splitk_reduce(OUT* C, OUT* G, const float* W, const OUT* bias, int M, int N, int ldc,
                                              int ldw, int splits, float alpha, float beta, int trans_c) {
    using O = Out<OUT>;
    const ll total = (ll)M * N;
    for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (ll)gridDim.x * blockDim.x) {
        const int m = (int)(i / N), n = (int)(i % N);
        float s = 0.0f;
        for (int k = 0; k < splits; k++) s += W[((ll)k * M + m) * ldw + n];
        float x = alpha * s;
        if (bias) x += O::get(bias + n);
        const ll off = trans_c ? (ll)n * ldc + m : (ll)m * ldc + n;
        if (beta != 0.0f) x += beta * O::get(C + off);
        O::put(C + off, x);
        if constexpr (GELU) O::put(G + off, gelu_fwd_as<OUT>(O::stored(x)));
    }
}
extern "C" __global__ void gemm_wgmma_splitk_reduce(float* C, const float* W, const float* bias, int M, int N,
                                                    int ldc, int ldw, int splits, float alpha, float beta, int trans_c) {
    LLMC_PDL_WAIT();
    splitk_reduce<float>(C, nullptr, W, bias, M, N, ldc, ldw, splits, alpha, beta, trans_c);
}
extern "C" __global__ void gemm_wgmma_splitk_reduce_bf16(__nv_bfloat16* C, const float* W, const __nv_bfloat16* bias,
                                                         int M, int N, int ldc, int ldw, int splits, float alpha,
                                                         float beta, int trans_c) {
    LLMC_PDL_WAIT();
    splitk_reduce<__nv_bfloat16>(C, nullptr, W, bias, M, N, ldc, ldw, splits, alpha, beta, trans_c);
}
extern "C" __global__ void gemm_wgmma_splitk_reduce_gelu(float* C, float* G, const float* W, const float* bias, int M,
                                                         int N, int ldc, int ldw, int splits, float alpha, float beta,
                                                         int trans_c) {
    LLMC_PDL_WAIT();
    splitk_reduce<float, true>(C, G, W, bias, M, N, ldc, ldw, splits, alpha, beta, trans_c);
}
extern "C" __global__ void gemm_wgmma_splitk_reduce_gelu_bf16(__nv_bfloat16* C, __nv_bfloat16* G, const float* W,
                                                              const __nv_bfloat16* bias, int M, int N, int ldc, int ldw,
                                                              int splits, float alpha, float beta, int trans_c) {
    LLMC_PDL_WAIT();
    splitk_reduce<__nv_bfloat16, true>(C, G, W, bias, M, N, ldc, ldw, splits, alpha, beta, trans_c);
}

// colsum (N) += the column sums of S (rows, N), the dgelu instances' 16-row partials: block (32, 32)
// takes 32 columns; row-lane y adds rows y, y + 32, ... in order (8 loads in flight), then the 32
// row-lanes are added in order (fixed order: the same bits on every run), and colsum is read, added
// in fp32, rounded once.
template <typename OUT>
__device__ __forceinline__ void colsum_finish(OUT* colsum, const float* S, int rows, int N) {
    using O = Out<OUT>;
    __shared__ float sh[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x, y = threadIdx.y;
    float s = 0.0f;
    if (c < N) {
#pragma unroll 8
        for (int r = y; r < rows; r += 32) s += __ldcg(S + (ll)r * N + c);
    }
    sh[y][threadIdx.x] = s;
    __syncthreads();
    if (y == 0 && c < N) {
        float t = sh[0][threadIdx.x];
#pragma unroll
        for (int i = 1; i < 32; i++) t += sh[i][threadIdx.x];
        O::put(colsum + c, O::get(colsum + c) + t);
    }
}
extern "C" __global__ void gemm_wgmma_colsum_finish(float* colsum, const float* S, int rows, int N) {
    LLMC_PDL_WAIT();
    colsum_finish<float>(colsum, S, rows, N);
}
extern "C" __global__ void gemm_wgmma_colsum_finish_bf16(__nv_bfloat16* colsum, const float* S, int rows, int N) {
    LLMC_PDL_WAIT();
    colsum_finish<__nv_bfloat16>(colsum, S, rows, N);
}

// out(cols, ld_out) = in(rows, cols)^T: 32x32 tiles through padded shared memory (the padding
// column keeps the transposed reads off a single bank). Both global sides coalesced.
extern "C" __global__ void transpose_kernel(float* out, const float* in, int rows, int cols, int ld_in, int ld_out) {
    LLMC_PDL_WAIT();
    __shared__ float tile[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
#pragma unroll
    for (int i = 0; i < 32; i += 8) {
        const int r = blockIdx.y * 32 + threadIdx.y + i;
        if (r < rows && c < cols) tile[threadIdx.y + i][threadIdx.x] = in[(ll)r * ld_in + c];
    }
    __syncthreads();
    const int r = blockIdx.y * 32 + threadIdx.x;
#pragma unroll
    for (int i = 0; i < 32; i += 8) {
        const int oc = blockIdx.x * 32 + threadIdx.y + i;
        if (oc < cols && r < rows) out[(ll)oc * ld_out + r] = tile[threadIdx.x][threadIdx.y + i];
    }
}

// fp32 -> bf16 (round to nearest even), for the lab's BF16 rows and the tests
extern "C" __global__ void to_bf16_kernel(__nv_bfloat16* out, const float* in, ll n) {
    LLMC_PDL_WAIT();
    for (ll i = (ll)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ll)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(in[i]);
}

#ifdef GEMM_WGMMA_DEBUG
// bring-up probe (built only with -DGEMM_WGMMA_DEBUG): one TMA box copied back out through shared memory
// `boxes` TMA boxes of `box_bytes`, the b-th at coordinates (b * c0_step, 0), into 1024-aligned shared
// memory one after another; every thread returns once they have landed
__device__ unsigned char* debug_load_boxes(const CUtensorMap* tm, int boxes, int box_bytes, int c0_step) {
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    __shared__ uint64_t bar;
    if (threadIdx.x == 0) { mbar_init(&bar, 1); asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
    __syncthreads();
    if (threadIdx.x == 0) {
        tensormap_acquire(tm);
        mbar_expect_tx(&bar, boxes * box_bytes);
        for (int b = 0; b < boxes; b++) tma_load_2d(smem + b * box_bytes, tm, &bar, b * c0_step, 0);
    }
    mbar_wait(&bar, 0);
    return smem;
}

extern "C" __global__ void wgmma_debug_tma(const CUtensorMap* tmA, float* out, int rows) {
    LLMC_PDL_WAIT();
    const unsigned char* smem = debug_load_boxes(tmA, 1, rows * ROW_BYTES, 0);
    const float* s = reinterpret_cast<const float*>(smem);
    for (int i = threadIdx.x; i < rows * 32; i += blockDim.x) out[i] = s[i];
}

// Which (row, k) of A does register i of lane l hold in wgmma's tf32 register form? A's registers hold
// the code 4 * tid + i + 1 (exact in tf32), B(n, k) = (n == k) in 128B-swizzled K-major shared memory,
// so D(m, n < 8) = the code at A(m, n); D is written out through the (verified) accumulator layout.
extern "C" __global__ void wgmma_debug_rs_layout(float* out /* (64, 8) */) {
    LLMC_PDL_WAIT();
    extern __shared__ unsigned char smem_raw[];
    unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    float* b = reinterpret_cast<float*>(smem);
    for (int i = threadIdx.x; i < 128 * 32; i += blockDim.x) {
        const int n = i / 32, k = i % 32;
        b[n * 32 + (((k >> 2) ^ (n & 7)) << 2) + (k & 3)] = (n == k && k < 8) ? 1.0f : 0.0f;
    }
    fence_async_smem();
    __syncthreads();
    uint32_t a[4];
    for (int i = 0; i < 4; i++) a[i] = __float_as_uint((float)(4 * threadIdx.x + i + 1));
    float d[64];
    wgmma_fence();
    wgmma_tf32_rs_n128(d, a, smem_desc(smem), 0);
    wgmma_commit();
    wgmma_wait<0>();
    keep_in_regs(d);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 2; c++)
            out[(warp * 16 + (lane >> 2) + 8 * h) * 8 + 2 * (lane & 3) + c] = d[2 * h + c];
}

// load_a_mn against a known A^T (value m * 1000 + k) loaded by the TMA as the kernel loads it
extern "C" __global__ void wgmma_debug_load_a_mn(const CUtensorMap* tmA, float* out /* (256 threads, 4 ks, 4) */) {
    LLMC_PDL_WAIT();
    const unsigned char* smem = debug_load_boxes(tmA, 4, 4096, 32);
    const int wg = threadIdx.x / 128;  // launched with 256 threads: warpgroups "1" and "2" of the kernel
    for (int ks = 0; ks < 4; ks++) {
        uint32_t a[4];
        load_a_mn(a, smem, wg * 64, ks);
        for (int i = 0; i < 4; i++) out[(threadIdx.x * 4 + ks) * 4 + i] = __uint_as_float(a[i]);
    }
}
#endif
